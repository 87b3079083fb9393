//! Helpers shared by the integration tests: an independent v2 encoder (so
//! the tests do not trust the writer they check), field patching with
//! re-sealed header checksums, and "open in both modes" assertions; tests
//! run in a child process (`child`) and the v3 codec tests' input (`codec`).
//!
//! The encoder's checksums come from `twox-hash`, an XXH3 implementation
//! independent of the one the crate uses (`xxhash-rust`), and follow
//! docs/FORMAT.md §1.3 and §1.6 rather than calling `ds4::format`. A wrong
//! checksum in the crate therefore fails the tests instead of sealing the
//! files they compare against.
#![allow(dead_code)]

use ds4::{open, Class, Error, VerifyOptions};
use std::path::{Path, PathBuf};

pub mod child;
pub mod codec;

/// The default options: every check, mmap.
pub fn opts() -> VerifyOptions<'static> {
    VerifyOptions::default()
}

/// A new temporary directory, removed on drop.
pub fn dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// XXH3-64 with seed 0 (`XXH3_64bits`), from `twox-hash`, not from the crate.
pub fn xxh3_64(data: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(data)
}

/// FORMAT.md §1.3: xxh3-64 of the 96-byte fixed header with bytes 12..16
/// (`hits`), 32..40 (`last_used`) and 88..96 (the checksum) read as zero,
/// followed by the metadata.
pub fn independent_header_checksum(fixed: &[u8], meta: &[u8]) -> u64 {
    assert_eq!(fixed.len(), 96, "the fixed v2 header is 96 bytes");
    let mut covered = fixed.to_vec();
    for r in [12..16usize, 32..40, 88..96] {
        covered[r].fill(0);
    }
    covered.extend_from_slice(meta);
    xxh3_64(&covered)
}

/// FORMAT.md §1.6: xxh3-64 of the whole payload section, padding included.
pub fn independent_payload_checksum(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

pub struct RawTensor<'a> {
    pub name: &'a [u8],
    pub dtype: u8,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub nbytes: u64,
}

/// Metadata exactly as docs/FORMAT.md §1.4 describes it.
pub fn encode_meta(abi: &[u8], tensors: &[RawTensor<'_>]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&u16::try_from(abi.len()).unwrap().to_le_bytes());
    m.extend_from_slice(abi);
    m.extend_from_slice(&u16::try_from(tensors.len()).unwrap().to_le_bytes());
    for t in tensors {
        m.push(u8::try_from(t.name.len()).unwrap());
        m.extend_from_slice(t.name);
        m.push(t.dtype);
        m.push(u8::try_from(t.shape.len()).unwrap());
        for d in &t.shape {
            m.extend_from_slice(&d.to_le_bytes());
        }
        m.extend_from_slice(&t.offset.to_le_bytes());
        m.extend_from_slice(&t.nbytes.to_le_bytes());
    }
    m
}

pub const TEXT: &[u8] = b"Hello, errors!";
pub const ABI: &str = "test/1";
pub const TOKENS: u32 = 3;
pub const CTX: u32 = 4096;
pub const CREATED: u64 = 1_700_000_000;

pub fn logits() -> Vec<u8> {
    [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// The default tensors: `logits` f32 [4] at 0 and `blob` u8 [3] at 64.
pub fn default_tensors() -> Vec<RawTensor<'static>> {
    vec![
        RawTensor {
            name: b"logits",
            dtype: 9,
            shape: vec![4],
            offset: 0,
            nbytes: 16,
        },
        RawTensor {
            name: b"blob",
            dtype: 0,
            shape: vec![3],
            offset: 64,
            nbytes: 3,
        },
    ]
}

pub fn default_payload() -> Vec<u8> {
    let mut p = logits();
    p.resize(64, 0);
    p.extend_from_slice(b"xyz");
    p
}

/// A complete v2 file from raw parts, with both checksums correct.
pub fn assemble(meta: &[u8], text: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 96];
    f[0..3].copy_from_slice(b"KVC");
    f[3] = 2;
    f[4] = 0; // quant
    f[5] = 1; // reason
    f[8..12].copy_from_slice(&TOKENS.to_le_bytes());
    f[16..20].copy_from_slice(&CTX.to_le_bytes());
    f[20..24].copy_from_slice(&u32::try_from(meta.len()).unwrap().to_le_bytes());
    f[24..32].copy_from_slice(&CREATED.to_le_bytes());
    f[32..40].copy_from_slice(&CREATED.to_le_bytes());
    f[40..48].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    f[48..52].copy_from_slice(&u32::try_from(text.len()).unwrap().to_le_bytes());
    f[56..76].copy_from_slice(&ds4::hash::sha1(text));
    f[80..88].copy_from_slice(&independent_payload_checksum(payload).to_le_bytes());
    f.extend_from_slice(meta);
    f.extend_from_slice(text);
    while f.len() % 64 != 0 {
        f.push(0);
    }
    f.extend_from_slice(payload);
    reseal(&mut f);
    f
}

pub fn default_file() -> Vec<u8> {
    assemble(
        &encode_meta(ABI.as_bytes(), &default_tensors()),
        TEXT,
        &default_payload(),
    )
}

/// Recomputes the header checksum (bytes 88..96) after a header edit.
pub fn reseal(f: &mut [u8]) {
    let meta = u32::from_le_bytes(f[20..24].try_into().unwrap()) as usize;
    let end = (96 + meta).min(f.len());
    let sum = independent_header_checksum(&f[..96], &f[96..end]);
    f[88..96].copy_from_slice(&sum.to_le_bytes());
}

pub fn set_u32(f: &mut [u8], at: usize, v: u32) {
    f[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub fn set_u64(f: &mut [u8], at: usize, v: u64) {
    f[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Offset of the text in a v2 file.
pub fn text_offset(f: &[u8]) -> usize {
    96 + u32::from_le_bytes(f[20..24].try_into().unwrap()) as usize
}
pub fn payload_offset(f: &[u8]) -> usize {
    let t = text_offset(f) + u32::from_le_bytes(f[48..52].try_into().unwrap()) as usize;
    t.div_ceil(64) * 64
}

pub fn name_for(text: &[u8]) -> String {
    format!("{}.kv", ds4::hash::sha1_hex(text))
}

/// Writes `bytes` as `<sha1(text)>.kv` in `dir`.
pub fn put(dir: &Path, text: &[u8], bytes: &[u8]) -> PathBuf {
    let p = dir.join(name_for(text));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A v1 file: 48-byte header, text, payload, trailer.
pub fn v1_file(text: &[u8], tokens: u32, flags: u8, payload: &[u8], trailer: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; 48];
    f[0..3].copy_from_slice(b"KVC");
    f[3] = 1;
    f[4] = 2;
    f[5] = 1;
    f[6] = flags;
    f[8..12].copy_from_slice(&tokens.to_le_bytes());
    f[16..20].copy_from_slice(&4096u32.to_le_bytes());
    f[24..32].copy_from_slice(&CREATED.to_le_bytes());
    f[32..40].copy_from_slice(&CREATED.to_le_bytes());
    f[40..48].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    f.extend_from_slice(&u32::try_from(text.len()).unwrap().to_le_bytes());
    f.extend_from_slice(text);
    f.extend_from_slice(payload);
    f.extend_from_slice(trailer);
    f
}

pub fn dsv4_payload(tokens: u32) -> Vec<u8> {
    let fields = [
        0x3456_5344u32,
        1,
        4096,
        2048,
        256,
        256,
        1024,
        tokens,
        43,
        512,
        128,
        129_280,
        tokens.min(256),
    ];
    let mut p: Vec<u8> = fields.iter().flat_map(|v| v.to_le_bytes()).collect();
    for t in 0..tokens {
        p.extend_from_slice(&(100 + t).to_le_bytes());
    }
    p
}

/// Opens `path` with mmap and with pread; both must give the same outcome.
pub fn open_both(path: &Path, o: &VerifyOptions<'_>) -> ds4::Result<ds4::Checkpoint> {
    let a = open(
        path,
        &VerifyOptions {
            mmap: true,
            ..o.clone()
        },
    );
    let b = open(
        path,
        &VerifyOptions {
            mmap: false,
            ..o.clone()
        },
    );
    match (&a, &b) {
        (Ok(x), Ok(y)) => {
            assert_eq!(x.text, y.text);
            assert_eq!(x.payload(), y.payload(), "mmap and pread payloads differ");
        }
        (Err(x), Err(y)) => {
            assert_eq!(x.code(), y.code(), "mmap and pread disagree");
            assert_eq!(x.to_string(), y.to_string(), "mmap and pread disagree");
        }
        _ => panic!(
            "mmap {:?} vs pread {:?}",
            a.as_ref().err(),
            b.as_ref().err()
        ),
    }
    a
}

/// Asserts that opening fails (in both modes) with this code, stage and class.
#[track_caller]
pub fn expect_err(
    path: &Path,
    o: &VerifyOptions<'_>,
    code: &str,
    stage: &str,
    class: Class,
) -> Error {
    match open_both(path, o) {
        Ok(_) => panic!("{} opened, expected {code}", path.display()),
        Err(e) => {
            assert_eq!(
                (e.code(), e.stage(), e.class()),
                (code, stage, class),
                "got {e}"
            );
            e
        }
    }
}
