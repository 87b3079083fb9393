//! Edges of the verification pipeline that the per-error tests in errors.rs
//! do not pin down (written against the mutants cargo-mutants found):
//! - every limit of the format at exactly its value (limits are inclusive),
//!   in the reader and in the writer;
//! - the public stage functions (`sniff`, `v2_meta_len`, `parse_v2`,
//!   `parse_v1`, `read_header`, `Storage::pread`) when their inputs disagree
//!   or the file shrank after `fstat`;
//! - what the open flags buy: `O_NONBLOCK` against a lease, `O_NOFOLLOW`
//!   against a path swapped for a symlink after the `lstat`;
//! - `touch`: the 40-byte bound, `flock` released on drop and retried after
//!   a signal;
//! - storage: heap buffers freed, every map guarded, and the SIGBUS guard
//!   (in child processes): truncation after open is reported by
//!   `check_intact`, faults outside the guarded range go to the previous
//!   handler or kill as before;
//! - the writer's temp file names and directory;
//! - the tables of names (dtype strings, reasons, error classes) that the
//!   Python side relies on, and the hash helpers.

mod common;

use common::*;
use ds4::format::v1::{parse_v1, V1_FIXED};
use ds4::format::v2::{sniff, v2_meta_len};
use ds4::format::writer::temp_name;
use ds4::format::{reason_name, MAX_ABI, MAX_META, MAX_NAME, MAX_NDIM, MAX_TENSORS, V2_FIXED};
use ds4::hash::{common_prefix_len, sha1, sha1_prefixes};
use ds4::payload::{sigbus, Storage};
use ds4::verify::{open_regular, read_header, FileLock};
use ds4::{open, touch, Class, Dtype, Error, VerifyOptions};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn opts() -> VerifyOptions<'static> {
    VerifyOptions::default()
}

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Waits until `cond` holds; panics (instead of hanging) after a minute.
#[track_caller]
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "gave up waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Installs `handler` for `sig` with exactly `flags` (no `SA_RESTART` unless given).
fn install_handler(sig: libc::c_int, handler: extern "C" fn(libc::c_int), flags: libc::c_int) {
    // SAFETY: a plain sigaction call with a zeroed, then filled-in struct;
    // the handlers used here only touch atomics and call fcntl.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = flags;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(sig, &raw const sa, std::ptr::null_mut()),
            0,
            "{}",
            std::io::Error::last_os_error()
        );
    }
}

/// `flock(LOCK_EX | LOCK_NB)` on a descriptor of the test's own: Ok when
/// taken, the errno when not.
fn try_lock(f: &File) -> Result<(), i32> {
    // SAFETY: flock on an open descriptor.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

fn unlock(f: &File) {
    // SAFETY: flock on an open descriptor.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) }, 0);
}

fn hits_and_last_used(p: &Path) -> (u32, u64) {
    let b = std::fs::read(p).unwrap();
    (
        u32::from_le_bytes(b[12..16].try_into().unwrap()),
        u64::from_le_bytes(b[32..40].try_into().unwrap()),
    )
}

// ---- names the Python side relies on ----

#[test]
fn dtype_strings_map_both_ways() {
    let table = [
        (Dtype::U8, "|u1", 1u64),
        (Dtype::I8, "|i1", 1),
        (Dtype::U16, "<u2", 2),
        (Dtype::I16, "<i2", 2),
        (Dtype::U32, "<u4", 4),
        (Dtype::I32, "<i4", 4),
        (Dtype::U64, "<u8", 8),
        (Dtype::I64, "<i8", 8),
        (Dtype::F16, "<f2", 2),
        (Dtype::F32, "<f4", 4),
        (Dtype::F64, "<f8", 8),
    ];
    for (d, s, size) in table {
        assert_eq!(d.numpy(), s, "{d:?}");
        assert_eq!(d.itemsize(), size, "{d:?}");
        assert_eq!(Dtype::from_numpy(s), Some(d), "{s}");
        // The same without a byte-order prefix, and with numpy's '=' (native).
        let bare = &s[1..];
        assert_eq!(Dtype::from_numpy(bare), Some(d), "{bare}");
        assert_eq!(Dtype::from_numpy(&format!("={bare}")), Some(d), "={bare}");
        assert_eq!(Dtype::from_code(d as u8), Some(d));
    }
    // numpy's one-character codes for bytes.
    assert_eq!(Dtype::from_numpy("B"), Some(Dtype::U8));
    assert_eq!(Dtype::from_numpy("b"), Some(Dtype::I8));
    // Big-endian, complex, bool, unknown or empty: not a ds4 dtype.
    for s in [
        ">u2", ">f4", "<c8", "|b1", "?", "f16", "u16", "<U4", "", "<", "float32",
    ] {
        assert_eq!(Dtype::from_numpy(s), None, "{s:?}");
    }
}

#[test]
fn reason_names() {
    let names = [
        "unknown",
        "cold",
        "continued",
        "evict",
        "shutdown",
        "agent-system",
        "agent-session",
        "named",
        "frontier",
    ];
    for (r, name) in names.iter().enumerate() {
        assert_eq!(reason_name(u8::try_from(r).unwrap()), *name, "reason {r}");
    }
    for r in [9u8, 10, 100, 255] {
        assert_eq!(reason_name(r), "unknown", "reason {r}");
    }
}

#[test]
fn class_names() {
    // Recovery (Python) dispatches on these strings.
    let cases = [
        (
            Error::BadMagic { found: *b"GGU" },
            Class::Corrupt,
            "corrupt",
        ),
        (
            Error::UnsupportedVersion { found: 9 },
            Class::Incompatible,
            "incompatible",
        ),
        (
            Error::NotPrefix {
                len: 2,
                prompt_len: 1,
            },
            Class::Mismatch,
            "mismatch",
        ),
        (
            Error::Io(std::io::Error::from_raw_os_error(libc::EACCES)),
            Class::Io,
            "io",
        ),
    ];
    for (e, class, name) in cases {
        assert_eq!(e.class(), class, "{e}");
        assert_eq!(e.class().as_str(), name, "{e}");
    }
}

// ---- hashing helpers ----

#[test]
fn sha1_prefixes_gives_one_answer_per_length() {
    let text: Vec<u8> = (0..300u32)
        .map(|i| u8::try_from(i * 13 % 256).unwrap())
        .collect();
    assert!(sha1_prefixes(&text, &[]).is_empty());
    // Unsorted, repeated, zero, the whole text and past the end.
    let lens = [200usize, 0, 64, 64, 300, 1, 301, 63, 1000, 65];
    let got = sha1_prefixes(&text, &lens);
    assert_eq!(got.len(), lens.len());
    for (l, g) in lens.iter().zip(&got) {
        if *l > text.len() {
            assert_eq!(*g, None, "len {l}");
        } else {
            assert_eq!(*g, Some(sha1(&text[..*l])), "len {l}");
        }
    }
    assert_eq!(sha1_prefixes(b"", &[0, 1]), vec![Some(sha1(b"")), None]);
}

#[test]
fn common_prefix_len_finds_the_first_difference_anywhere() {
    let a: Vec<u8> = (0..40u8).map(|i| b'a' + i % 26).collect();
    for i in 0..a.len() {
        let mut b = a.clone();
        b[i] ^= 0x20;
        assert_eq!(common_prefix_len(&a, &b), i, "difference at {i}");
        assert_eq!(common_prefix_len(&b, &a), i, "difference at {i}");
    }
    // A difference in the first 8-byte word, the rest equal.
    assert_eq!(
        common_prefix_len(b"abcdefgh12345678", b"abXdefgh12345678"),
        2
    );
    for n in 0..=a.len() {
        assert_eq!(common_prefix_len(&a[..n], &a), n);
        assert_eq!(common_prefix_len(&a, &a[..n]), n);
    }
}

// ---- sniff and the v2 fixed header, called directly ----

/// A header stage that needs `need` bytes: a file one byte short is
/// `TooShort { need, have: need - 1 }`, and a buffer cut to each length in
/// `cuts` inside a long file is `TooShort { need, have: 1000 }` (nothing is
/// made up from bytes past the buffer).
fn assert_needs<T: std::fmt::Debug>(
    stage: impl Fn(&[u8], u64) -> Result<T, Error>,
    full: &[u8],
    need: u64,
    cuts: &[usize],
) {
    let r = stage(full, need - 1);
    assert!(
        matches!(r, Err(Error::TooShort { need: n, have }) if n == need && have == need - 1),
        "{r:?}"
    );
    for &c in cuts {
        let r = stage(&full[..c], 1000);
        assert!(
            matches!(r, Err(Error::TooShort { need: n, have: 1000 }) if n == need),
            "{c}: {r:?}"
        );
    }
}

#[test]
fn sniff_needs_four_bytes_of_file_and_of_buffer() {
    assert_eq!(sniff(b"KVC\x02", 4).unwrap(), 2);
    assert_eq!(sniff(b"KVC\x01 and more", 1000).unwrap(), 1);
    // The file shorter than the buffer claims; the buffer shorter than the file.
    assert_needs(sniff, b"KVC\x02", 4, &[3, 2, 0]);
}

/// A 96-byte fixed header declaring `meta` metadata bytes.
fn fixed_with_meta(meta: u32) -> Vec<u8> {
    let mut f = default_file()[..V2_FIXED].to_vec();
    set_u32(&mut f, 20, meta);
    f
}

#[test]
fn v2_meta_len_boundaries() {
    let fixed = fixed_with_meta(0);
    // The fixed header alone: exactly 96 bytes is enough, 95 is not.
    assert_eq!(v2_meta_len(&fixed, 96).unwrap(), 0);
    // 95 bytes of file are not; nor is a buffer without the whole fixed
    // header, in a long file.
    assert_needs(v2_meta_len, &fixed, 96, &[0, 24, 95]);
    // The metadata must end inside the file: exactly at its end is fine.
    let fixed = fixed_with_meta(10);
    assert_eq!(v2_meta_len(&fixed, 106).unwrap(), 10);
    assert_eq!(v2_meta_len(&fixed, 107).unwrap(), 10);
    assert!(matches!(
        v2_meta_len(&fixed, 105),
        Err(Error::Truncated {
            expected: 106,
            actual: 105
        })
    ));
    // MAX_META itself is allowed, one more is not.
    let fixed = fixed_with_meta(u32::try_from(MAX_META).unwrap());
    let end = V2_FIXED as u64 + MAX_META;
    assert_eq!(v2_meta_len(&fixed, end).unwrap(), MAX_META);
    assert!(matches!(
        v2_meta_len(&fixed, end - 1),
        Err(Error::Truncated { expected, actual }) if expected == end && actual == end - 1
    ));
    let fixed = fixed_with_meta(u32::try_from(MAX_META).unwrap() + 1);
    assert!(matches!(
        v2_meta_len(&fixed, u64::MAX),
        Err(Error::HeaderTooLarge {
            what: "metadata",
            len,
            max: MAX_META
        }) if len == MAX_META + 1
    ));
}

#[test]
fn parse_v2_with_less_metadata_than_declared_is_truncated() {
    let f = default_file();
    let meta_len = text_offset(&f) - V2_FIXED;
    let meta = &f[V2_FIXED..V2_FIXED + meta_len];
    // The whole metadata parses.
    let h = ds4::format::v2::parse_v2(&f[..V2_FIXED], meta, f.len() as u64).unwrap();
    assert_eq!(h.text_offset, (V2_FIXED + meta_len) as u64);
    // One byte short: truncated at the declared end of the metadata.
    for short in [meta_len - 1, 0] {
        let r = ds4::format::v2::parse_v2(&f[..V2_FIXED], &meta[..short], f.len() as u64);
        assert!(
            matches!(r, Err(Error::Truncated { expected, actual })
                if expected == (V2_FIXED + meta_len) as u64 && actual == f.len() as u64),
            "{short}: {r:?}"
        );
    }
}

#[test]
fn parse_v1_needs_52_bytes_of_file_and_of_buffer() {
    // The smallest v1 file: the 52-byte header, no text, no payload (one
    // token: a header of none is one ds4 ignores, `v1_ignored`).
    let v0 = v1_file(b"", 0, 0, b"", b"");
    assert!(matches!(parse_v1(&v0, 52), Err(Error::V1Ignored(_))));
    let v1 = v1_file(b"", 1, 0, b"", b"");
    assert_eq!(v1.len(), V1_FIXED);
    let h = parse_v1(&v1, 52).unwrap();
    assert_eq!((h.text_offset, h.payload_offset, h.total_len), (52, 52, 52));
    assert_needs(parse_v1, &v1, 52, &[0, 4, 51]);
    // As a file: its header stage passes; its empty payload is no DSV4 state.
    let d = dir();
    let p = put(d.path(), b"", &v1);
    let ck = open_both(
        &p,
        &VerifyOptions {
            load_payload: false,
            ..opts()
        },
    )
    .unwrap();
    assert_eq!((ck.header.version, ck.text.len(), ck.dsv4), (1, 0, None));
    expect_err(&p, &opts(), "bad_v1_payload", "payload", Class::Corrupt);
}

// ---- whole files at the limits ----

#[test]
fn a_file_of_only_the_fixed_header_is_judged_on_its_sizes() {
    // 96 bytes, no metadata: long enough for the fixed header, so the
    // declared layout (payload at 128) is what is wrong with it.
    let mut f = default_file()[..V2_FIXED].to_vec();
    set_u32(&mut f, 20, 0); // metadata bytes
    set_u64(&mut f, 40, 0); // payload bytes
    set_u32(&mut f, 48, 0); // text bytes
    reseal(&mut f);
    let d = dir();
    let p = put(d.path(), TEXT, &f);
    let e = expect_err(&p, &opts(), "truncated", "header", Class::Corrupt);
    assert!(
        matches!(
            e,
            Error::Truncated {
                expected: 128,
                actual: 96
            }
        ),
        "{e}"
    );
}

#[test]
fn a_header_ending_exactly_at_the_end_of_the_file_opens() {
    // Empty text, empty payload and 32 bytes of metadata: the metadata ends
    // at 128, which is also where the (empty) payload starts and the file ends.
    let abi = "x".repeat(28);
    let meta = encode_meta(abi.as_bytes(), &[]);
    assert_eq!(V2_FIXED + meta.len(), 128);
    let f = assemble(&meta, b"", b"");
    assert_eq!(f.len(), 128);
    let d = dir();
    let p = put(d.path(), b"", &f);
    let ck = open_both(
        &p,
        &VerifyOptions {
            expected_abi: Some(&abi),
            prompt: Some(b"anything"),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!((ck.text.len(), ck.header.payload_bytes), (0, 0));
    assert_eq!(ck.header.text_offset, 128);
    assert_eq!(ck.header.payload_offset, 128);
    assert_eq!(ck.payload(), Some(&b""[..]));
}

#[test]
fn metadata_of_exactly_max_meta_is_not_too_large() {
    // Declared MAX_META bytes of metadata in a small file: within the bound,
    // so the answer is that the file is truncated.
    let d = dir();
    let mut f = default_file();
    set_u32(&mut f, 20, u32::try_from(MAX_META).unwrap());
    reseal(&mut f);
    let p = put(d.path(), TEXT, &f);
    let e = expect_err(&p, &opts(), "truncated", "header", Class::Corrupt);
    assert!(
        matches!(e, Error::Truncated { expected, .. } if expected == V2_FIXED as u64 + MAX_META),
        "{e}"
    );
}

#[test]
fn an_abi_string_of_exactly_max_abi_bytes_opens() {
    let d = dir();
    let abi = "a".repeat(MAX_ABI);
    let f = assemble(
        &encode_meta(abi.as_bytes(), &default_tensors()),
        TEXT,
        &default_payload(),
    );
    let p = put(d.path(), TEXT, &f);
    let ck = open_both(
        &p,
        &VerifyOptions {
            expected_abi: Some(&abi),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(ck.header.abi, abi);
}

#[test]
fn exactly_max_tensors_open() {
    let d = dir();
    let names: Vec<String> = (0..MAX_TENSORS).map(|i| format!("t{i:04}")).collect();
    let tensors: Vec<RawTensor<'_>> = names
        .iter()
        .enumerate()
        .map(|(i, n)| RawTensor {
            name: n.as_bytes(),
            dtype: 0,
            shape: vec![1],
            offset: 64 * i as u64,
            nbytes: 1,
        })
        .collect();
    let mut payload = vec![0u8; 64 * (MAX_TENSORS - 1) + 1];
    for i in 0..MAX_TENSORS {
        payload[64 * i] = i.to_le_bytes()[0] | 1;
    }
    let f = assemble(&encode_meta(ABI.as_bytes(), &tensors), TEXT, &payload);
    let p = put(d.path(), TEXT, &f);
    let ck = open(&p, &opts()).unwrap();
    assert_eq!(ck.header.tensors.len(), MAX_TENSORS);
    assert_eq!(ck.header.tensors[MAX_TENSORS - 1].name, "t4095");
    assert_eq!(ck.payload().unwrap(), &payload[..]);
}

#[test]
fn a_tensor_with_max_ndim_dimensions_and_a_max_name_opens() {
    let d = dir();
    let name = vec![b'n'; MAX_NAME];
    let mut shape = vec![1u64; MAX_NDIM];
    shape[MAX_NDIM - 1] = 2;
    let t = [RawTensor {
        name: &name,
        dtype: 3, // i16
        shape: shape.clone(),
        offset: 0,
        nbytes: 4,
    }];
    let f = assemble(&encode_meta(ABI.as_bytes(), &t), TEXT, b"\x01\x00\xff\xff");
    let p = put(d.path(), TEXT, &f);
    let ck = open_both(&p, &opts()).unwrap();
    let ti = &ck.header.tensors[0];
    assert_eq!(ti.name.len(), MAX_NAME);
    assert_eq!((ti.dtype, &ti.shape, ti.nbytes), (Dtype::I16, &shape, 4));
    // The writer accepts the same limits and its file opens.
    let name = "w".repeat(MAX_NAME);
    let abi = "b".repeat(MAX_ABI);
    let src = [ds4::TensorSrc {
        name: &name,
        dtype: Dtype::I16,
        shape: &shape,
        data: b"\x01\x00\xff\xff",
    }];
    let p = d.path().join(name_for(TEXT));
    ds4::write_checkpoint(
        &p,
        &ds4::WriteMeta {
            abi: abi.clone(),
            ..Default::default()
        },
        TEXT,
        &src,
    )
    .unwrap();
    let ck = open_both(
        &p,
        &VerifyOptions {
            expected_abi: Some(&abi),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(ck.header.tensors[0].name, name);
    assert_eq!(ck.header.tensors[0].shape, shape);
}

#[test]
fn the_writer_takes_metadata_of_exactly_max_meta() {
    // 3102 tensors with 255-byte names and 8 dimensions (338 metadata bytes
    // each) and a 96-byte ABI string: exactly MAX_META bytes of metadata.
    let n = 3102;
    let names: Vec<String> = (0..n).map(|i| format!("{i:0>255}")).collect();
    let shape = [1u64; MAX_NDIM];
    let srcs: Vec<ds4::TensorSrc<'_>> = names
        .iter()
        .map(|name| ds4::TensorSrc {
            name,
            dtype: Dtype::U8,
            shape: &shape,
            data: b"\x07",
        })
        .collect();
    let abi_len = usize::try_from(MAX_META).unwrap() - 4 - n * 338;
    assert_eq!(abi_len, 96);
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let meta = |abi_len: usize| ds4::WriteMeta {
        abi: "a".repeat(abi_len),
        ..Default::default()
    };
    ds4::write_checkpoint(&p, &meta(abi_len), TEXT, &srcs).unwrap();
    let ck = open(&p, &opts()).unwrap();
    assert_eq!(ck.header.text_offset, V2_FIXED as u64 + MAX_META);
    assert_eq!(ck.header.tensors.len(), n);
    // One byte more is refused before any file is made.
    let p2 = d.path().join(name_for(b"other"));
    let e = ds4::write_checkpoint(&p2, &meta(abi_len + 1), b"other", &srcs).unwrap_err();
    assert!(
        matches!(e, Error::HeaderTooLarge { what: "metadata", len, max: MAX_META } if len == MAX_META + 1),
        "{e}"
    );
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
}

#[test]
fn temp_names_are_hidden_recognisable_and_unique() {
    let prefix = format!(".{}.tmp.{}.", name_for(TEXT), std::process::id());
    let names: Vec<String> = (0..3).map(|_| temp_name(&name_for(TEXT))).collect();
    for t in &names {
        assert!(t.starts_with(&prefix) && t.len() > prefix.len(), "{t}");
    }
    assert!(names[0] != names[1] && names[1] != names[2] && names[0] != names[2]);
}

#[test]
fn the_writer_refuses_what_it_cannot_write_and_takes_the_limits() {
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let one = [1u8];
    let src = |name, shape| ds4::TensorSrc {
        name,
        dtype: Dtype::U8,
        shape,
        data: &one,
    };
    let meta = |abi_len: usize| ds4::WriteMeta {
        abi: "a".repeat(abi_len),
        ..Default::default()
    };
    let long = "n".repeat(MAX_NAME + 1);
    let nine = [1u64; MAX_NDIM + 1];
    // Names and dimensions: refused as input, before any file exists.
    for (what, t) in [
        ("empty name", src("", &[1])),
        ("256-byte name", src(&long, &[1])),
        ("9 dimensions", src("t", &nine)),
    ] {
        let e = ds4::write_checkpoint(&p, &meta(1), TEXT, &[t]).unwrap_err();
        assert!(
            matches!(&e, Error::TensorTable(m) if m.starts_with("cannot write tensor")),
            "{what}: {e}"
        );
    }
    // Sizes of the header.
    let e = ds4::write_checkpoint(&p, &meta(MAX_ABI + 1), TEXT, &[]).unwrap_err();
    assert!(
        matches!(e, Error::HeaderTooLarge { what: "ABI string", len, .. } if len == MAX_ABI as u64 + 1),
        "{e}"
    );
    let names: Vec<String> = (0..=MAX_TENSORS).map(|i| format!("t{i}")).collect();
    let srcs: Vec<ds4::TensorSrc<'_>> = names.iter().map(|n| src(n, &[1])).collect();
    let e = ds4::write_checkpoint(&p, &meta(1), TEXT, &srcs).unwrap_err();
    assert!(
        matches!(e, Error::HeaderTooLarge { what: "tensor table", len, .. } if len == MAX_TENSORS as u64 + 1),
        "{e}"
    );
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        0,
        "a file was made"
    );
    // Exactly MAX_TENSORS is fine.
    ds4::write_checkpoint(&p, &meta(1), TEXT, &srcs[..MAX_TENSORS]).unwrap();
    let ck = open(&p, &opts()).unwrap();
    assert_eq!(ck.header.tensors.len(), MAX_TENSORS);
    assert_eq!(
        ck.header.tensors[MAX_TENSORS - 1].name,
        names[MAX_TENSORS - 1]
    );
}

#[test]
fn sync_dir_reports_a_directory_it_cannot_open() {
    let d = dir();
    ds4::format::writer::sync_dir(d.path()).unwrap();
    let e = ds4::format::writer::sync_dir(&d.path().join("missing")).unwrap_err();
    assert!(
        matches!(&e, Error::Io(io) if io.kind() == std::io::ErrorKind::NotFound),
        "{e}"
    );
}

#[test]
fn the_writer_puts_its_temp_file_next_to_the_destination() {
    // In a child whose working directory is `<dir>/cwd`: a bare file name is
    // written in the working directory; an absolute path is written in its
    // own directory, even once the working directory is gone.
    const NAME: &str = "the_writer_puts_its_temp_file_next_to_the_destination";
    let Some(root) = child_dir() else {
        return assert_child_passed(NAME, "child: both written");
    };
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(cwd, root.join("cwd"));
    let lg = logits();
    let t = [ds4::TensorSrc {
        name: "logits",
        dtype: Dtype::F32,
        shape: &[4],
        data: &lg,
    }];
    let meta = ds4::WriteMeta {
        abi: ABI.into(),
        ..Default::default()
    };
    let bare = name_for(TEXT);
    ds4::write_checkpoint(Path::new(&bare), &meta, TEXT, &t).unwrap();
    open(&cwd.join(&bare), &opts()).unwrap();
    std::fs::remove_file(cwd.join(&bare)).unwrap();
    std::fs::remove_dir(&cwd).unwrap();
    let dest = root.join("dest").join(&bare);
    ds4::write_checkpoint(&dest, &meta, TEXT, &t).unwrap();
    open(&dest, &opts()).unwrap();
    println!("child: both written");
}

// ---- a file that changes under an open handle ----

#[test]
fn read_header_reports_a_file_that_shrank_after_fstat() {
    let d = dir();
    let f = default_file();
    let meta_end = text_offset(&f) as u64;
    // Cut inside the fixed header, then inside the metadata.
    for cut in [50u64, 100] {
        let p = put(d.path(), TEXT, &f);
        let (file, len) = open_regular(&p, false).unwrap();
        assert_eq!(len, f.len() as u64);
        OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let e = read_header(&file, len).unwrap_err();
        let want = if cut < V2_FIXED as u64 {
            V2_FIXED as u64
        } else {
            meta_end
        };
        assert!(
            matches!(e, Error::Truncated { expected, actual } if expected == want && actual == len),
            "cut at {cut}: {e}"
        );
        assert_eq!(e.class(), Class::Corrupt);
    }
}

// ---- touch: bounds, open flags, the lock ----

#[test]
fn touch_needs_exactly_the_mutable_fields() {
    let d = dir();
    // 40 bytes reach the end of last_used: enough to record a hit.
    let mut f = default_file()[..40].to_vec();
    f[12..16].copy_from_slice(&7u32.to_le_bytes());
    let p = put(d.path(), TEXT, &f);
    assert_eq!(touch(&p, 1_234_567).unwrap(), 8);
    assert_eq!(hits_and_last_used(&p), (8, 1_234_567));
    let g = std::fs::read(&p).unwrap();
    assert_eq!((&g[..12], &g[16..32]), (&f[..12], &f[16..32]));
    // 39 bytes do not.
    let p = put(d.path(), TEXT, &f[..39]);
    let e = touch(&p, 1).unwrap_err();
    assert!(matches!(e, Error::TooShort { need: 40, have: 39 }), "{e}");
    assert_eq!(std::fs::read(&p).unwrap(), &f[..39]);
}

static LEASE_FD: AtomicI32 = AtomicI32::new(-1);
static SIGIO_SEEN: AtomicUsize = AtomicUsize::new(0);

/// The lease holder's answer to a lease break: give the lease up.
extern "C" fn give_up_lease(_: libc::c_int) {
    SIGIO_SEEN.fetch_add(1, Ordering::SeqCst);
    let fd = LEASE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: fcntl is async-signal-safe; fd is the test's open descriptor.
        unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK) };
    }
}

#[test]
fn touch_waits_briefly_for_a_lease_then_gives_up() {
    // Another process holding a read lease (a load of ours, a file server,
    // a backup tool) makes an open for writing wait until it gives the
    // lease up. touch opens with O_NONBLOCK and retries for a bounded
    // while: a holder that gives the lease up (on the break's signal) lets
    // the hit through; one that keeps it makes touch fail, unwritten.
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    install_handler(libc::SIGIO, give_up_lease, libc::SA_RESTART);
    let holder = File::open(&p).unwrap();
    LEASE_FD.store(holder.as_raw_fd(), Ordering::SeqCst);
    let seen = SIGIO_SEEN.load(Ordering::SeqCst);
    // SAFETY: fcntl on an open descriptor.
    let r = unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    assert_eq!(r, 0, "F_SETLEASE: {}", std::io::Error::last_os_error());

    // Reading does not conflict with a read lease: verification is not held up.
    open_both(&p, &opts()).unwrap();
    assert_eq!(touch(&p, 9).unwrap(), 1, "the hit after the holder let go");
    assert!(
        SIGIO_SEEN.load(Ordering::SeqCst) > seen,
        "the break was signalled"
    );

    // A holder that keeps its lease: touch gives up, and writes nothing.
    LEASE_FD.store(-1, Ordering::SeqCst);
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    assert_eq!(r, 0, "F_SETLEASE: {}", std::io::Error::last_os_error());
    let before = std::fs::read(&p).unwrap();
    let e = touch(&p, 10).expect_err("touch wrote under a lease");
    match &e {
        Error::Io(io) => assert_eq!(io.raw_os_error(), Some(libc::EWOULDBLOCK), "{io}"),
        other => panic!("expected an I/O error, got {other}"),
    }
    assert_eq!((e.code(), e.stage(), e.class()), ("io", "open", Class::Io));
    assert_eq!(
        std::fs::read(&p).unwrap(),
        before,
        "a refused touch must not write"
    );
    drop(holder);
    assert_eq!(touch(&p, 11).unwrap(), 2);
}

#[test]
fn file_lock_is_released_on_drop() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let file = File::open(&p).unwrap();
    let other = File::open(&p).unwrap();
    let lock = FileLock::exclusive(&file).unwrap();
    assert_eq!(try_lock(&other), Err(libc::EWOULDBLOCK));
    drop(lock);
    // `file` is still open: only the drop can have released the lock.
    assert_eq!(try_lock(&other), Ok(()));
    unlock(&other);
    // And it can be taken again through the same descriptor.
    let lock = FileLock::exclusive(&file).unwrap();
    assert_eq!(try_lock(&other), Err(libc::EWOULDBLOCK));
    drop(lock);
    drop(file);
}

static SIGNALS: AtomicUsize = AtomicUsize::new(0);
extern "C" fn count_signal(_: libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// True when /proc/locks shows a process waiting for a FLOCK on inode `ino`.
fn flock_waiter_on(ino: u64) -> bool {
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    let suffix = format!(":{ino}");
    locks.lines().any(|l| {
        l.contains("->")
            && l.contains("FLOCK")
            && l.split_whitespace().any(|w| w.ends_with(&suffix))
    })
}

#[test]
fn touch_waiting_for_the_lock_survives_a_signal() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::thread::JoinHandleExt;
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let ino = std::fs::metadata(&p).unwrap().ino();
    // Another process holds the lock.
    let holder = File::open(&p).unwrap();
    try_lock(&holder).unwrap();
    // A handler without SA_RESTART: a blocked flock returns EINTR.
    install_handler(libc::SIGUSR2, count_signal, 0);

    let pp = p.clone();
    let t = std::thread::spawn(move || touch(&pp, 42));
    wait_for("touch to wait for the lock", || flock_waiter_on(ino));
    let before = SIGNALS.load(Ordering::SeqCst);
    // SAFETY: the thread is alive (it is blocked in flock until we unlock).
    assert_eq!(
        unsafe { libc::pthread_kill(t.as_pthread_t(), libc::SIGUSR2) },
        0
    );
    // The handler has run, so the flock it interrupted has returned EINTR.
    wait_for("the signal handler", || {
        SIGNALS.load(Ordering::SeqCst) > before
    });
    // touch either waits again or has given up; let it have the lock.
    wait_for("touch to wait again or return", || {
        t.is_finished() || flock_waiter_on(ino)
    });
    unlock(&holder);
    assert_eq!(t.join().unwrap().unwrap(), 1, "touch gave up on EINTR");
    assert_eq!(hits_and_last_used(&p), (1, 42));
}

#[test]
fn a_path_swapped_for_a_symlink_is_never_followed() {
    // The name check (lstat) and the open are two steps; a checkpoint path
    // replaced by a symlink in between must still not be followed (the open
    // itself refuses symlinks). Another thread keeps exchanging the path
    // with a symlink to a different, valid checkpoint; every open must give
    // either the real file or "symlink", never the file the symlink names.
    // (A race: it can only show a regression with some probability.)
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::sync::atomic::AtomicBool;
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let other_text = b"another checkpoint";
    let other = d.path().join("other.kv");
    std::fs::write(
        &other,
        assemble(
            &encode_meta(ABI.as_bytes(), &default_tensors()),
            other_text,
            &default_payload(),
        ),
    )
    .unwrap();
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&other, &link).unwrap();
    let cp = CString::new(p.as_os_str().as_bytes()).unwrap();
    let cl = CString::new(link.as_os_str().as_bytes()).unwrap();
    // Reach the file through many "./" components: the open walks them all
    // after the lstat has looked, which widens the window for the swap.
    let mut slow = d.path().as_os_str().to_owned();
    slow.push("/");
    slow.push("./".repeat(1800));
    let slow = std::path::PathBuf::from(slow).join(p.file_name().unwrap());
    let stop = AtomicBool::new(false);
    let o = VerifyOptions {
        check_name: false,
        load_payload: false,
        ..opts()
    };
    let (mut real, mut refused) = (0, 0);
    let mut wrong: Vec<String> = Vec::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: two valid NUL-terminated paths.
                let r = unsafe {
                    libc::renameat2(
                        libc::AT_FDCWD,
                        cp.as_ptr(),
                        libc::AT_FDCWD,
                        cl.as_ptr(),
                        libc::RENAME_EXCHANGE,
                    )
                };
                assert!(r == 0, "renameat2: {}", std::io::Error::last_os_error());
            }
        });
        let t0 = Instant::now();
        let mut i = 0;
        while wrong.is_empty() && i < 20_000 && (i < 2_000 || t0.elapsed() < Duration::from_secs(1))
        {
            i += 1;
            match open(&slow, &o) {
                Ok(ck) if ck.text == TEXT => real += 1,
                Ok(ck) => wrong.push(format!(
                    "followed the symlink to {:?}",
                    String::from_utf8_lossy(&ck.text)
                )),
                Err(Error::NotRegularFile { what: "symlink" }) => refused += 1,
                Err(e) => wrong.push(format!("unexpected error: {e}")),
            }
        }
        // Stop the swapper before any assertion can unwind out of the scope.
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(wrong, Vec::<String>::new());
    assert!(real + refused >= 2_000);
}

// ---- storage: heap buffers, maps and the SIGBUS guard ----

#[test]
fn storage_debug_names_the_kind_and_size_never_the_bytes() {
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    let ck = open(&p, &opts()).unwrap();
    let s = ck.storage.as_deref().unwrap();
    assert_eq!(
        format!("{s:?}"),
        format!("Storage::Mmap({} bytes)", f.len())
    );
    assert!(format!("{ck:?}").contains(&format!("Storage::Mmap({} bytes)", f.len())));
    let ck = open(
        &p,
        &VerifyOptions {
            mmap: false,
            ..opts()
        },
    )
    .unwrap();
    let s = ck.storage.as_deref().unwrap();
    assert_eq!(
        format!("{s:?}"),
        format!("Storage::Heap({} bytes)", default_payload().len())
    );
}

#[test]
fn storage_pread_reports_a_file_that_shrank_after_fstat() {
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    let (file, len) = open_regular(&p, false).unwrap();
    let po = payload_offset(&f) as u64;
    OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(po + 1)
        .unwrap();
    let e = Storage::pread(&file, po, len - po, len).unwrap_err();
    assert!(
        matches!(e, Error::Truncated { expected, actual } if expected == len && actual == len),
        "{e}"
    );
    // What is still there reads fine.
    let s = Storage::pread(&file, po, 1, len).unwrap();
    let po = usize::try_from(po).unwrap();
    assert_eq!(s.bytes(), &f[po..=po]);
}

#[test]
fn a_read_payload_is_freed_with_its_checkpoint() {
    let d = dir();
    let big = vec![5u8; 1 << 20];
    let t = [RawTensor {
        name: b"big",
        dtype: 0,
        shape: vec![big.len() as u64],
        offset: 0,
        nbytes: big.len() as u64,
    }];
    let f = assemble(&encode_meta(ABI.as_bytes(), &t), TEXT, &big);
    let p = put(d.path(), TEXT, &f);
    let o = VerifyOptions {
        mmap: false,
        ..opts()
    };
    drop(open(&p, &o).unwrap()); // first-use allocations, if any
    let before = live_bytes();
    let ck = open(&p, &o).unwrap();
    let held = live_bytes() - before;
    assert!(held >= isize::try_from(big.len()).unwrap(), "{held}");
    assert_eq!(ck.payload().unwrap(), &big[..]);
    drop(ck);
    let left = live_bytes() - before;
    assert!(
        left < 64 * 1024,
        "{left} bytes still allocated after the drop"
    );
}

#[test]
fn every_map_is_guarded_however_many_came_before() {
    // More maps than the guard has slots, one after the other: each one
    // frees its slot when dropped, so the next is guarded too.
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    for i in 0..1100 {
        let ck = open(&p, &opts()).unwrap();
        match ck.storage.as_deref() {
            Some(s @ Storage::Mmap { .. }) => assert!(s.leased(), "map {i} has no lease"),
            other => panic!("map {i} is not a guarded map: {other:?}"),
        }
    }
}

#[test]
fn when_every_slot_is_taken_the_payload_is_copied_never_mapped_unguarded() {
    // 1,100 checkpoints alive at once: more than the guard has slots. Every
    // map holds a slot (a map is only ever made in one); the rest are
    // copies, checked as they were copied, and read the same bytes.
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    let mut live = Vec::new();
    for _ in 0..1100 {
        let ck = open(&p, &opts()).unwrap();
        ck.release(); // as a load does at its end: the map stays, the lease goes
        live.push(ck);
    }
    let (mut maps, mut copies) = (0, 0);
    for ck in &live {
        match ck.storage.as_deref() {
            Some(Storage::Mmap { .. }) => maps += 1,
            Some(Storage::Heap(_)) => copies += 1,
            None => panic!("no payload"),
        }
        assert_eq!(ck.payload().unwrap(), default_payload().as_slice());
        ck.check_intact().unwrap();
    }
    assert!(maps <= sigbus::SLOTS && maps > 0, "{maps} maps");
    assert!(copies >= 1100 - sigbus::SLOTS, "{copies} copies");
    assert!(sigbus::claimed() <= sigbus::SLOTS);
    drop(live);
    // The slots came back: the next open maps again.
    let ck = open(&p, &opts()).unwrap();
    assert!(matches!(ck.storage.as_deref(), Some(Storage::Mmap { .. })));
}

#[test]
fn slot_claims_race_free_across_threads() {
    // Threads claim slots at the same time: no slot is ever handed to two
    // of them (a claim is one compare-and-swap on the slot's own flag).
    let taken: Vec<Vec<sigbus::Slot>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..8)
            .map(|_| {
                sc.spawn(|| {
                    (0..100)
                        .filter_map(|_| sigbus::Slot::claim())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut seen = std::collections::HashSet::new();
    for s in taken.iter().flatten() {
        assert!(
            seen.insert(s.index()),
            "slot {} handed out twice",
            s.index()
        );
    }
    assert!(!seen.is_empty());
}

#[test]
fn a_lease_keeps_writers_out_until_it_is_given_back() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let ck = open(&p, &opts()).unwrap();
    assert!(ck.storage.as_deref().unwrap().leased());
    let try_write = || {
        OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&p)
    };
    let e = try_write().unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EWOULDBLOCK), "{e}");
    // The writer's attempt broke the lease; the break is recent, so no
    // writer can have got through: the bytes read are still the verified ones.
    ck.check_intact().unwrap();
    ck.release();
    assert!(!ck.storage.as_deref().unwrap().leased());
    drop(try_write().unwrap());
    // A file someone has open for writing gets no lease: its payload is copied.
    let w = OpenOptions::new().write(true).open(&p).unwrap();
    let ck = open(&p, &opts()).unwrap();
    assert!(matches!(ck.storage.as_deref(), Some(Storage::Heap(_))));
    assert_eq!(ck.payload().unwrap(), default_payload().as_slice());
    drop(w);
}

// The SIGBUS guard runs in child processes (this test binary again, running
// one test): a guard that fails kills the process, and some checks need a
// process-wide SIGBUS disposition of their own.

/// Set in the child to the directory its files go in (the parent's, so it
/// is removed even when the child is killed). The child runs in its `cwd`
/// subdirectory; it also has an empty `dest`.
const CHILD: &str = "DS4_TEST_PIPELINE_CHILD_DIR";

/// In the child: its directory. None in the parent.
fn child_dir() -> Option<std::path::PathBuf> {
    let d = std::env::var_os(CHILD)?;
    // SAFETY: plain libc calls. No core files from the deaths some checks
    // expect, and a child that hangs (a fault that is never resolved
    // repeats forever) is killed.
    unsafe {
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &raw const no_core);
        libc::alarm(10);
    }
    Some(d.into())
}

/// Runs test `name` in a child process; returns how it ended and its output.
fn run_child(name: &str) -> (std::process::ExitStatus, String) {
    let d = dir();
    for sub in ["cwd", "dest"] {
        std::fs::create_dir(d.path().join(sub)).unwrap();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, d.path())
        .current_dir(d.path().join("cwd"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

#[track_caller]
fn assert_child_passed(name: &str, marker: &str) {
    let (status, out) = run_child(name);
    assert!(status.success(), "child {name}: {status}\n{out}");
    assert!(out.contains(marker), "child {name} did not finish:\n{out}");
}

#[track_caller]
fn assert_child_killed_by_sigbus(name: &str, marker: &str) {
    use std::os::unix::process::ExitStatusExt;
    let (status, out) = run_child(name);
    assert!(
        out.contains(marker),
        "child {name} did not get there:\n{out}"
    );
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "child {name}: {status}\n{out}"
    );
}

/// Maps `len` bytes of `f` read-only (at `at` exactly when given).
fn map_file(f: &File, len: usize, at: Option<usize>) -> usize {
    let fixed = if at.is_some() { libc::MAP_FIXED } else { 0 };
    // SAFETY: a new private read-only mapping of the test's own file; with
    // MAP_FIXED it replaces pages of a mapping this test owns.
    let p = unsafe {
        libc::mmap(
            at.unwrap_or(0) as *mut libc::c_void,
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE | fixed,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    p as usize
}

fn read_at(addr: usize) -> u8 {
    // SAFETY: callers pass an address inside a live mapping they made.
    unsafe { std::ptr::read_volatile(addr as *const u8) }
}

fn shrink(p: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len)
        .unwrap();
}

#[test]
fn check_intact_reports_a_mapped_file_truncated_after_open() {
    const NAME: &str = "check_intact_reports_a_mapped_file_truncated_after_open";
    let Some(d) = child_dir() else {
        return assert_child_passed(NAME, "child: truncation reported");
    };
    // A payload of many pages, no zero byte in it.
    let big: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8 + 1).collect();
    let t = [RawTensor {
        name: b"big",
        dtype: 0,
        shape: vec![big.len() as u64],
        offset: 0,
        nbytes: big.len() as u64,
    }];
    let f = assemble(&encode_meta(ABI.as_bytes(), &t), TEXT, &big);
    let keep = 8192u64;

    // Mapped: the pages past the new end fault, read as zeros, and the
    // checkpoint reports itself truncated.
    let p = put(&d, TEXT, &f);
    let ck = open(&p, &opts()).unwrap();
    ck.check_intact().unwrap();
    // Under its lease nobody could cut the file (the open for writing would
    // wait); a load gives the lease back at its end, and the map stays.
    ck.release();
    shrink(&p, keep);
    let payload = ck.payload().unwrap();
    for i in (0..payload.len()).step_by(4096) {
        // SAFETY: a read of a byte inside the slice.
        unsafe { std::ptr::read_volatile(&raw const payload[i]) };
    }
    assert_eq!(
        payload[payload.len() - 1],
        0,
        "a vanished page reads as zeros"
    );
    assert_eq!(payload[0], big[0], "a page still in the file is intact");
    assert!(ck.storage.as_ref().unwrap().faulted());
    let e = ck.check_intact().unwrap_err();
    assert!(
        matches!(e, Error::Truncated { expected, actual } if expected == f.len() as u64 && actual == keep),
        "{e}"
    );
    assert_eq!((e.code(), e.class()), ("truncated", Class::Corrupt));
    drop(ck);

    // Read into memory: the copy is unaffected by the truncation.
    let p = put(&d, TEXT, &f);
    let ck = open(
        &p,
        &VerifyOptions {
            mmap: false,
            ..opts()
        },
    )
    .unwrap();
    shrink(&p, keep);
    assert_eq!(ck.payload().unwrap(), &big[..]);
    assert!(!ck.storage.as_ref().unwrap().faulted());
    ck.check_intact().unwrap();
    println!("child: truncation reported");
}

// The child's own SIGBUS handler, installed before ds4's: it records what it
// was given and resolves the fault at EXPECTED with a zero page.
static BUS_CALLS: AtomicUsize = AtomicUsize::new(0);
static BUS_ADDR: AtomicUsize = AtomicUsize::new(0);
static BUS_EXPECTED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn own_bus_handler(
    _sig: libc::c_int,
    info: *mut libc::siginfo_t,
    _ctx: *mut libc::c_void,
) {
    BUS_CALLS.fetch_add(1, Ordering::SeqCst);
    if !info.is_null() {
        // SAFETY: the kernel (or a handler chaining to this one) passes the
        // siginfo of the fault.
        BUS_ADDR.store(unsafe { (*info).si_addr() } as usize, Ordering::SeqCst);
    }
    let page = BUS_EXPECTED.load(Ordering::SeqCst) & !4095;
    // SAFETY: replaces one page of a mapping the test made with zeros.
    unsafe {
        libc::mmap(
            page as *mut libc::c_void,
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        );
    }
}

#[test]
fn a_fault_outside_the_guarded_range_goes_to_the_previous_handler() {
    const NAME: &str = "a_fault_outside_the_guarded_range_goes_to_the_previous_handler";
    let Some(d) = child_dir() else {
        return assert_child_passed(NAME, "child: faults went where they belong");
    };
    // SAFETY: installs the handler above (SA_SIGINFO) for this process.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = own_bus_handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGBUS, &raw const sa, std::ptr::null_mut()),
            0
        );
    }
    // A guarded map of 4096 + 100 bytes: its second page is only partly
    // inside the guarded range [s, s + len).
    let guarded = d.join("guarded");
    std::fs::write(&guarded, vec![1u8; 4096 + 100]).unwrap();
    let gf = File::open(&guarded).unwrap();
    let storage = Storage::map(&gf, 4096 + 100, None).unwrap().unwrap();
    let s = storage.bytes().as_ptr() as usize;
    let len = storage.bytes().len();
    assert_eq!(len, 4096 + 100);

    // A file of the test's own, mapped over that second page, then cut: a
    // read of the first byte past the guarded range faults, and that fault
    // is not the guard's.
    let mine = d.join("mine");
    std::fs::write(&mine, vec![2u8; 4096]).unwrap();
    let mf = File::open(&mine).unwrap();
    let m = map_file(&mf, 4096, Some(s + 4096));
    assert_eq!(read_at(m + 100), 2);
    shrink(&mine, 0);
    BUS_EXPECTED.store(s + len, Ordering::SeqCst);
    assert_eq!(read_at(s + len), 0);
    assert_eq!(
        BUS_CALLS.load(Ordering::SeqCst),
        1,
        "the previous handler was not called"
    );
    assert_eq!(
        BUS_ADDR.load(Ordering::SeqCst),
        s + len,
        "the previous handler did not get the fault's siginfo"
    );
    assert!(
        !storage.faulted(),
        "the guard took a fault outside its range"
    );

    // The guard is still in place for its own range.
    shrink(&guarded, 0);
    BUS_EXPECTED.store(s + 50, Ordering::SeqCst);
    // SAFETY: a read of a byte inside the slice.
    assert_eq!(
        unsafe { std::ptr::read_volatile(&raw const storage.bytes()[50]) },
        0
    );
    assert!(storage.faulted(), "the guard did not take its own fault");
    assert_eq!(
        BUS_CALLS.load(Ordering::SeqCst),
        1,
        "the guard passed on its own fault"
    );
    println!("child: faults went where they belong");
}

/// In a child whose SIGBUS disposition is `disp` (`SIG_DFL` or `SIG_IGN`) before
/// ds4 guards a map: a fault outside the guarded maps kills it with SIGBUS,
/// as it would without ds4.
fn foreign_fault_with_disposition(d: &Path, disp: libc::sighandler_t) {
    // SAFETY: sets the disposition of SIGBUS for this (child) process.
    unsafe {
        assert_ne!(libc::signal(libc::SIGBUS, disp), libc::SIG_ERR);
    }
    let p = put(d, TEXT, &default_file());
    let ck = open(&p, &opts()).unwrap(); // installs the guard
    let mine = d.join("mine");
    std::fs::write(&mine, vec![2u8; 4096]).unwrap();
    let mf = File::open(&mine).unwrap();
    let m = map_file(&mf, 4096, None);
    shrink(&mine, 0);
    println!("child: about to fault");
    read_at(m + 10);
    println!("child: survived a fault outside ds4's maps");
    drop(ck);
}

#[test]
fn a_foreign_fault_still_kills_when_sigbus_was_default() {
    const NAME: &str = "a_foreign_fault_still_kills_when_sigbus_was_default";
    let Some(d) = child_dir() else {
        return assert_child_killed_by_sigbus(NAME, "child: about to fault");
    };
    foreign_fault_with_disposition(&d, libc::SIG_DFL);
}

#[test]
fn a_foreign_fault_still_kills_when_sigbus_was_ignored() {
    const NAME: &str = "a_foreign_fault_still_kills_when_sigbus_was_ignored";
    let Some(d) = child_dir() else {
        return assert_child_killed_by_sigbus(NAME, "child: about to fault");
    };
    foreign_fault_with_disposition(&d, libc::SIG_IGN);
}

// ---- a global allocator that counts the live bytes of each thread ----

struct Counting;
thread_local! {
    static LIVE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}
fn add_live(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_add_unsigned(n)));
}
fn sub_live(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub_unsigned(n)));
}
fn live_bytes() -> isize {
    LIVE.with(std::cell::Cell::get)
}
// SAFETY: forwards every call to `System` unchanged; only counts sizes.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        add_live(l.size());
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        add_live(l.size());
        unsafe { std::alloc::System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        add_live(new);
        sub_live(l.size());
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        sub_live(l.size());
        unsafe { std::alloc::System.dealloc(p, l) }
    }
}
#[global_allocator]
static ALLOC: Counting = Counting;
