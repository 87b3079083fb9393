//! Edges of the verification pipeline that the per-error tests
//! (`errors_*.rs`) do not pin down, written against the mutants
//! cargo-mutants found; one file per concern: `pipeline_names.rs`,
//! `pipeline_header.rs`, `pipeline_writer.rs`, `pipeline_touch.rs`,
//! `pipeline_storage.rs`, `pipeline_sigbus.rs`.
//!
//! Here: every limit of the format at exactly its value (limits are
//! inclusive), in the reader (and the writer where a file is at them); the
//! public stage functions (`sniff`, `v2_meta_len`, `parse_v2`, `parse_v1`,
//! `read_header`) when their inputs disagree or the file shrank after
//! `fstat`.

mod common;

use common::*;
use ds4::format::v1::{parse_v1, V1_FIXED};
use ds4::format::v2::{sniff, v2_meta_len};
use ds4::format::{MAX_ABI, MAX_META, MAX_NAME, MAX_NDIM, MAX_TENSORS, V2_FIXED};
use ds4::io::open_regular;
use ds4::verify::read_header;
use ds4::{open, Class, Dtype, Error, VerifyOptions, WriteOptions};
use std::fs::OpenOptions;

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
        &WriteOptions::default(),
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
