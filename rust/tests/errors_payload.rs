//! One test per `ds4::Error` variant that bytes on disk can produce, each from
//! constructed bytes, checking `code()`, `stage()` and `class()`, in both the
//! mmap and the pread mode, one file per stage: `errors_open.rs`,
//! `errors_header.rs`, `errors_text.rs`, `errors_payload.rs`. Plus `touch`
//! (`errors_touch.rs`) and failed writes (`errors_write.rs`).
//!
//! Here: the payload stage (the tensor table, the payload checksum, the v1
//! DSV4 state).

mod common;

use common::*;
use ds4::{Class, Error, VerifyOptions};

// ---- stage payload ----

fn table_case(tensors: &[RawTensor<'_>], payload: &[u8]) -> Vec<u8> {
    assemble(&encode_meta(ABI.as_bytes(), tensors), TEXT, payload)
}

/// The default file with a zero-byte tensor of `dtype` and `shape` first.
fn zero_byte_tensor_case(dtype: u8, shape: Vec<u64>) -> Vec<u8> {
    let mut t = default_tensors();
    t.insert(
        0,
        RawTensor {
            name: b"empty",
            dtype,
            shape,
            offset: 0,
            nbytes: 0,
        },
    );
    table_case(&t, &default_payload())
}

#[test]
fn zero_byte_tensors_open_exactly_when_an_array_can_describe_them() {
    let d = dir();
    // u8 [0, 2^63 - 1] and [0, 2^62]: numpy makes these views.
    for shape in [vec![0, u64::MAX >> 1], vec![0, 1 << 62], vec![0]] {
        let p = put(d.path(), TEXT, &zero_byte_tensor_case(0, shape.clone()));
        open_both(&p, &opts()).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    }
    // One more byte, or a wider item, and numpy refuses: so does the table.
    for (dtype, shape) in [
        (0, vec![0, 1 << 63]),
        (9, vec![0, 1 << 61]),
        (0, vec![3, 0, 1 << 62]),
    ] {
        let p = put(d.path(), TEXT, &zero_byte_tensor_case(dtype, shape.clone()));
        let e = expect_err(&p, &opts(), "tensor_table", "payload", Class::Corrupt);
        assert!(
            matches!(&e, Error::TensorTable(m) if m.contains("beyond what an array can describe")),
            "{shape:?}: {e}"
        );
    }
}

#[test]
fn tensor_table() {
    let d = dir();
    let payload = default_payload();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();

    let mut t = default_tensors();
    t[1].offset = 32;
    cases.push(("misaligned offset", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[1].offset = 0;
    cases.push(("overlapping", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[1].offset = 128;
    let mut p2 = payload[..64].to_vec();
    p2.resize(128, 0);
    p2.extend_from_slice(b"xyz");
    cases.push(("gap", table_case(&t, &p2)));
    let mut t = default_tensors();
    t[0].nbytes = 15;
    cases.push(("size mismatch", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[0].shape = vec![1 << 62, 8];
    cases.push(("shape overflow", table_case(&t, &payload)));
    // Zero bytes, so every byte count agrees; numpy still cannot make a view.
    cases.push((
        "zero-byte shape [0, 2^63]",
        zero_byte_tensor_case(0, vec![0, 1 << 63]),
    ));
    cases.push((
        "zero-byte shape [2^62, 2, 0]",
        zero_byte_tensor_case(0, vec![1 << 62, 2, 0]),
    ));
    cases.push((
        "zero-byte f32 shape [0, 2^62]",
        zero_byte_tensor_case(9, vec![0, 1 << 62]),
    ));
    let mut t = default_tensors();
    t[1].name = b"logits";
    cases.push(("duplicate names", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[1].name = b"";
    cases.push(("empty name", table_case(&t, &payload)));
    let mut p3 = payload.clone();
    p3.extend_from_slice(&[0; 5]);
    cases.push((
        "ends before payload end",
        table_case(&default_tensors(), &p3),
    ));
    cases.push(("no tensors, non-empty payload", table_case(&[], &payload)));
    cases.push((
        "ends past payload end",
        table_case(&default_tensors(), &payload[..66]),
    ));
    let mut t = default_tensors();
    t[1].shape = vec![u64::MAX - 10];
    t[1].nbytes = u64::MAX - 10;
    cases.push(("offset + nbytes overflows", table_case(&t, &payload)));

    for (what, f) in cases {
        let p = put(d.path(), TEXT, &f);
        // The header stage accepts these: the table is a payload-stage check.
        open_both(
            &p,
            &VerifyOptions {
                load_payload: false,
                ..opts()
            },
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let e = expect_err(&p, &opts(), "tensor_table", "payload", Class::Corrupt);
        assert!(matches!(e, Error::TensorTable(_)), "{what}: {e}");
    }
}

#[test]
fn payload_checksum() {
    let d = dir();
    let f = default_file();
    let po = payload_offset(&f);
    // A tensor byte, inter-tensor padding, the last byte.
    for at in [po, po + 15, po + 16, po + 63, f.len() - 1] {
        let mut g = f.clone();
        g[at] ^= 0x80;
        let p = put(d.path(), TEXT, &g);
        let e = expect_err(&p, &opts(), "payload_checksum", "payload", Class::Corrupt);
        assert!(matches!(e, Error::PayloadChecksum { .. }), "{at}");
        // Opt-out of the checksum: the header-stage checks still pass.
        open_both(
            &p,
            &VerifyOptions {
                verify_checksum: false,
                ..opts()
            },
        )
        .unwrap();
    }
}

#[test]
fn bad_v1_payload() {
    let d = dir();
    let good = dsv4_payload(2);
    let mut cases: Vec<(&str, Vec<u8>, u32)> = vec![
        ("short payload", good[..51].to_vec(), 2),
        ("empty payload", Vec::new(), 2),
    ];
    let mut p = good.clone();
    p[0] = b'X';
    cases.push(("bad magic", p, 2));
    let mut p = good.clone();
    set_u32(&mut p, 4, 2);
    cases.push(("version 2", p, 2));
    cases.push(("token count differs", good.clone(), 3));
    for (what, payload, tokens) in cases {
        let f = v1_file(TEXT, tokens, 0, &payload, b"");
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "bad_v1_payload", "payload", Class::Corrupt);
        assert!(matches!(e, Error::BadV1Payload(_)), "{what}: {e}");
        // Header-only open succeeds (DSV4 decoded best effort).
        let ck = open_both(
            &p,
            &VerifyOptions {
                load_payload: false,
                ..opts()
            },
        )
        .unwrap();
        assert!(ck.dsv4.is_none(), "{what}");
    }
    let f = v1_file(TEXT, 2, 0, &good, b"");
    let p = put(d.path(), TEXT, &f);
    let ck = open_both(&p, &opts()).unwrap();
    assert_eq!(ck.dsv4.unwrap()[7], 2);
    assert_eq!(ck.payload().unwrap(), &good[..]);
}
