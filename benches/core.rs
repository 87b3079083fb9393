//! Benchmarks of the ds4 core (criterion). Small sample counts so the whole
//! `cargo bench` stays well under five minutes on two cores:
//!
//! - `sha1/64MiB`: SHA-1 of 64 MiB.
//! - `prefix_lookup`: 1 MiB prompt, 1,000 candidate prefix lengths:
//!   `one_pass` (`ds4::hash::sha1_prefixes`), `per_candidate` (one SHA-1 per
//!   candidate prefix, ds4's algorithm when every candidate must be checked)
//!   and `single_sha1` (one SHA-1 of the whole prompt, the lower bound).
//! - `open_256MiB`: `ds4::open` (header, text, tensor table, payload checksum,
//!   mmap) vs `std::fs::read` of the same file (page cache warm).
//! - `write_256MiB`: `ds4::write_checkpoint` (temp file, fsync, rename, dir
//!   fsync) vs `File::create` + `write_all` + `sync_all`.
//!
//! Ratios are computed from criterion's report (see the PR/report notes).

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use ds4::{Dtype, TensorSrc, VerifyOptions, WriteMeta, WriteOptions};
use std::hint::black_box;
use std::io::Write;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn data(n: usize) -> Vec<u8> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s.to_le_bytes()[0]
        })
        .collect()
}

fn sha1(c: &mut Criterion) {
    let buf = data(64 * MIB);
    let mut g = c.benchmark_group("sha1");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Bytes(buf.len() as u64));
    g.bench_function("64MiB", |b| b.iter(|| ds4::hash::sha1(black_box(&buf))));
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let prompt = data(MIB);
    // 1,000 candidate lengths spread over the prompt (as a store of many
    // checkpoints of one long conversation would have), unsorted.
    let lengths: Vec<usize> = (1..=1000usize)
        .map(|i| (i * 7919 % 1000 + 1) * (MIB / 1000))
        .collect();
    let mut g = c.benchmark_group("prefix_lookup_1MiB_1000");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .sampling_mode(SamplingMode::Flat);
    g.bench_function("one_pass", |b| {
        b.iter(|| ds4::hash::sha1_prefixes(black_box(&prompt), black_box(&lengths)));
    });
    g.bench_function("per_candidate", |b| {
        b.iter(|| {
            lengths
                .iter()
                .map(|&l| ds4::hash::sha1(black_box(&prompt[..l])))
                .collect::<Vec<_>>()
        });
    });
    g.bench_function("single_sha1", |b| {
        b.iter(|| ds4::hash::sha1(black_box(&prompt)));
    });
    g.finish();
}

struct Fixture {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    dir: std::path::PathBuf,
    text: Vec<u8>,
    payload: Vec<u8>,
}

fn fixture() -> Fixture {
    // Next to the build output (a real disk), not a tmpfs.
    let base = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    std::fs::create_dir_all(&base).unwrap();
    let dir = tempfile::tempdir_in(&base).unwrap();
    let text = b"bench prompt ".repeat(1000);
    let payload = data(256 * MIB);
    let path = dir
        .path()
        .join(format!("{}.kv", ds4::hash::sha1_hex(&text)));
    let f = Fixture {
        dir: dir.path().to_path_buf(),
        _dir: dir,
        path,
        text,
        payload,
    };
    write(&f, &f.path);
    f
}

fn write(f: &Fixture, path: &std::path::Path) -> ds4::Written {
    let meta = WriteMeta {
        tokens: 1000,
        ctx: 8192,
        created: 1,
        abi: "bench/1".into(),
        ..Default::default()
    };
    // Three tensors as an engine would save them: tokens, logits, one KV blob.
    let (toks, rest) = f.payload.split_at(4000);
    let (logits, kv) = rest.split_at(4 * 49152);
    let t = [
        TensorSrc {
            name: "tokens",
            dtype: Dtype::U32,
            shape: &[1000],
            data: toks,
        },
        TensorSrc {
            name: "logits",
            dtype: Dtype::F32,
            shape: &[49152],
            data: logits,
        },
        TensorSrc {
            name: "kv",
            dtype: Dtype::U8,
            shape: &[kv.len() as u64],
            data: kv,
        },
    ];
    ds4::write_checkpoint(path, &meta, &f.text, &t, &WriteOptions::default()).unwrap()
}

fn open_vs_read(c: &mut Criterion) {
    let f = fixture();
    let len = std::fs::metadata(&f.path).unwrap().len();
    let _ = std::fs::read(&f.path).unwrap(); // warm the page cache
    let mut g = c.benchmark_group("open_256MiB");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .throughput(Throughput::Bytes(len));
    g.bench_function("ds4_open_verify_mmap", |b| {
        b.iter(|| {
            let ck = ds4::open(&f.path, &VerifyOptions::default()).unwrap();
            black_box(ck.payload().unwrap().len())
        });
    });
    g.bench_function("ds4_open_verify_pread", |b| {
        b.iter(|| {
            let ck = ds4::open(
                &f.path,
                &VerifyOptions {
                    mmap: false,
                    ..Default::default()
                },
            )
            .unwrap();
            black_box(ck.payload().unwrap().len())
        });
    });
    g.bench_function("std_fs_read", |b| {
        b.iter(|| black_box(std::fs::read(&f.path).unwrap().len()));
    });
    g.finish();
}

fn write_vs_plain(c: &mut Criterion) {
    let f = fixture();
    let len = std::fs::metadata(&f.path).unwrap().len();
    let mut g = c.benchmark_group("write_256MiB");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(10))
        .warm_up_time(Duration::from_secs(1))
        .sampling_mode(SamplingMode::Flat)
        .throughput(Throughput::Bytes(len));
    let target = f.dir.join(format!("{}.kv", ds4::hash::sha1_hex(b"w")));
    g.bench_function(BenchmarkId::new("ds4_write_checkpoint", "durable"), |b| {
        b.iter(|| write(&f, &target));
    });
    let plain = f.dir.join("plain.bin");
    g.bench_function(BenchmarkId::new("std_write_all", "sync_all"), |b| {
        b.iter(|| {
            let mut file = std::fs::File::create(&plain).unwrap();
            file.write_all(&f.text).unwrap();
            file.write_all(&f.payload).unwrap();
            file.sync_all().unwrap();
        });
    });
    g.finish();
}

criterion_group!(benches, sha1, prefix_lookup, open_vs_read, write_vs_plain);
criterion_main!(benches);
