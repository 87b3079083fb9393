//! The v3 payload codec (FORMAT.md §1.10), damaged: the exact typed error
//! for a flipped byte in each frame, in the frame table, a truncated file, a
//! frame of the wrong raw length, a wrong raw hash, an unknown codec, a
//! forged ratio, a wrong MAC key; and no single bit flip loads anything but
//! the original payload.

mod common;

use common::codec::{span, write_pair, SPAN};
use common::{expect_err, open_both, reseal, set_u32, set_u64, xxh3_64};
use ds4::format::mac::derive_key;
use ds4::{open, Class, VerifyOptions};
use std::path::Path;

#[test]
fn an_authenticated_v3_file_is_macd_over_its_stored_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let key = derive_key(b"a codec test secret, not for use");
    let (_, p3) = write_pair(dir.path(), 900, span(true, 1), Some(&key));
    let o = VerifyOptions {
        auth_key: Some(&key),
        ..VerifyOptions::default()
    };
    let ck = open_both(&p3, &o).unwrap();
    assert!(ck.header.authenticated);
    let other = derive_key(b"another secret of sixteen bytes");
    let o2 = VerifyOptions {
        auth_key: Some(&other),
        ..VerifyOptions::default()
    };
    expect_err(&p3, &o2, "mac_mismatch", "payload", Class::Corrupt);
    // a stored byte flipped and the payload checksum resealed: the MAC
    // catches it, before any frame is decompressed
    let mut f = std::fs::read(&p3).unwrap();
    let off = usize::try_from(ck.header.payload_offset).unwrap();
    let end = f.len() - 32;
    f[off + 3] ^= 1;
    let sum = xxh3_64(&f[off..end]);
    set_u64(&mut f, 80, sum);
    reseal(&mut f);
    std::fs::write(&p3, &f).unwrap();
    expect_err(&p3, &o, "mac_mismatch", "payload", Class::Corrupt);
    // without the key the checksum passes and the frame is found bad
    expect_err(
        &p3,
        &VerifyOptions::default(),
        "bad_frame",
        "payload",
        Class::Corrupt,
    );
}

/// (payload offset, frame table offset, frames as (stored start, stored len)).
fn layout(p: &Path) -> (usize, usize, Vec<(usize, usize)>) {
    let ck = open(
        p,
        &VerifyOptions {
            load_payload: false,
            ..VerifyOptions::default()
        },
    )
    .unwrap();
    let c = ck.header.codec.unwrap();
    let off = usize::try_from(ck.header.payload_offset).unwrap();
    let table = usize::try_from(ck.header.text_offset).unwrap() - 16 * c.frames.len();
    let mut at = off;
    let frames = c
        .frames
        .iter()
        .map(|f| {
            let s = at;
            at += f.stored as usize;
            (s, f.stored as usize)
        })
        .collect();
    (off, table, frames)
}

fn reseal_payload(f: &mut [u8], off: usize) {
    let sum = xxh3_64(&f[off..]);
    set_u64(f, 80, sum);
    reseal(f);
}

#[test]
fn a_flipped_byte_in_each_frame_is_a_checksum_error_then_a_bad_frame() {
    let dir = tempfile::tempdir().unwrap();
    for shuffle in [true, false] {
        let (_, p3) = write_pair(dir.path(), 4 * 256 + 5, span(shuffle, 1), None);
        let good = std::fs::read(&p3).unwrap();
        let (off, _, frames) = layout(&p3);
        assert_eq!(frames.len(), 5);
        for (i, &(start, len)) in frames.iter().enumerate() {
            for at in [start, start + len / 2, start + len - 1] {
                let mut f = good.clone();
                f[at] ^= 0x40;
                std::fs::write(&p3, &f).unwrap();
                expect_err(
                    &p3,
                    &VerifyOptions::default(),
                    "payload_checksum",
                    "payload",
                    Class::Corrupt,
                );
                let unchecked = VerifyOptions {
                    verify_checksum: false,
                    ..VerifyOptions::default()
                };
                let e = expect_err(&p3, &unchecked, "bad_frame", "payload", Class::Corrupt);
                assert!(e.to_string().contains(&format!("frame {i} ")), "{e}");
                reseal_payload(&mut f, off);
                std::fs::write(&p3, &f).unwrap();
                let e = expect_err(
                    &p3,
                    &VerifyOptions::default(),
                    "bad_frame",
                    "payload",
                    Class::Corrupt,
                );
                assert!(e.to_string().contains(&format!("frame {i} ")), "{e}");
            }
        }
        std::fs::write(&p3, &good).unwrap();
        open_both(&p3, &VerifyOptions::default()).unwrap();
    }
}

#[test]
fn the_frame_table_is_covered_by_the_header_checksum_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let (_, p3) = write_pair(dir.path(), 3 * 256, span(true, 1), None);
    let good = std::fs::read(&p3).unwrap();
    let (_, table, frames) = layout(&p3);
    assert_eq!(frames.len(), 4);
    let o = VerifyOptions::default();
    for at in table - 4..table + 16 * frames.len() {
        let mut f = good.clone();
        f[at] ^= 1;
        std::fs::write(&p3, &f).unwrap();
        expect_err(&p3, &o, "header_checksum", "header", Class::Corrupt);
    }
    let sealed = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut f = good.clone();
        edit(&mut f);
        reseal(&mut f);
        std::fs::write(&p3, &f).unwrap();
    };
    // a raw length that is not the span (not the last frame)
    sealed(&|f| set_u32(f, table + 4, SPAN - 1));
    expect_err(&p3, &o, "frame_table", "header", Class::Corrupt);
    // the last frame's raw length off by one: the tensor table no longer ends there
    sealed(&|f| {
        let at = table + 16 * 3 + 4;
        let raw = u32::from_le_bytes(f[at..at + 4].try_into().unwrap());
        set_u32(f, at, raw - 1);
    });
    expect_err(&p3, &o, "tensor_table", "payload", Class::Corrupt);
    // stored lengths that do not add up to the payload section
    sealed(&|f| {
        let s = u32::from_le_bytes(f[table..table + 4].try_into().unwrap());
        set_u32(f, table, s + 1);
    });
    expect_err(&p3, &o, "frame_table", "header", Class::Corrupt);
    // stored lengths moved between two frames: the sum holds, frame 0 is bad
    sealed(&|f| {
        let s0 = u32::from_le_bytes(f[table..table + 4].try_into().unwrap());
        let s1 = u32::from_le_bytes(f[table + 16..table + 20].try_into().unwrap());
        set_u32(f, table, s0 + 1);
        set_u32(f, table + 16, s1 - 1);
    });
    let e = expect_err(&p3, &o, "bad_frame", "payload", Class::Corrupt);
    assert!(e.to_string().contains("frame 0 "), "{e}");
    // a wrong raw hash in the table (the frame itself is intact)
    sealed(&|f| f[table + 16 * 2 + 8] ^= 1);
    let e = expect_err(&p3, &o, "bad_frame", "payload", Class::Corrupt);
    assert!(
        e.to_string().contains("frame 2 ") && e.to_string().contains("hash"),
        "{e}"
    );
    // a span the format does not allow
    sealed(&|f| set_u32(f, 76, 100));
    expect_err(&p3, &o, "frame_table", "header", Class::Corrupt);
    // an unknown codec or filter: kept for a newer ds4
    sealed(&|f| f[53] = 2);
    expect_err(&p3, &o, "unsupported_codec", "header", Class::Incompatible);
    sealed(&|f| f[54] = 2);
    expect_err(&p3, &o, "unsupported_codec", "header", Class::Incompatible);
    // a frame count that does not match the table's bytes
    sealed(&|f| set_u32(f, table - 4, 3));
    expect_err(&p3, &o, "frame_table", "header", Class::Corrupt);
}

#[test]
fn a_frame_of_the_wrong_raw_length_is_a_bad_frame() {
    let dir = tempfile::tempdir().unwrap();
    let (_, p3) = write_pair(dir.path(), 2 * 256, span(false, 1), None);
    let good = std::fs::read(&p3).unwrap();
    let (off, table, frames) = layout(&p3);
    let ck = open(&p3, &VerifyOptions::default()).unwrap();
    let raw0 = ck.payload().unwrap()[..SPAN as usize].to_vec();
    for n in [SPAN as usize - 1, SPAN as usize + 1] {
        // frame 0 replaced by a valid zstd frame of n raw bytes, the table's
        // stored length, the payload length and both checksums resealed
        let mut src = raw0.clone();
        src.resize(n, 0);
        let z = zstd::bulk::compress(&src, 1).unwrap();
        let (s0, l0) = frames[0];
        let mut f = good[..s0].to_vec();
        f.extend_from_slice(&z);
        f.extend_from_slice(&good[s0 + l0..]);
        set_u32(&mut f, table, u32::try_from(z.len()).unwrap());
        let stored = u64::try_from(f.len() - off).unwrap();
        set_u64(&mut f, 40, stored);
        reseal_payload(&mut f, off);
        std::fs::write(&p3, &f).unwrap();
        let e = expect_err(
            &p3,
            &VerifyOptions::default(),
            "bad_frame",
            "payload",
            Class::Corrupt,
        );
        assert!(e.to_string().contains("frame 0 "), "{e}");
    }
}

#[test]
fn a_truncated_or_extended_v3_file_is_rejected_at_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let (_, p3) = write_pair(dir.path(), 1000, span(true, 1), None);
    let good = std::fs::read(&p3).unwrap();
    for cut in [1, 10, good.len() - 200] {
        std::fs::write(&p3, &good[..good.len() - cut]).unwrap();
        expect_err(
            &p3,
            &VerifyOptions::default(),
            "truncated",
            "header",
            Class::Corrupt,
        );
    }
    let mut longer = good.clone();
    longer.push(0);
    std::fs::write(&p3, &longer).unwrap();
    expect_err(
        &p3,
        &VerifyOptions::default(),
        "trailing_bytes",
        "header",
        Class::Corrupt,
    );
}

/// Two single-bit flips of every byte (bits `at % 8` and `(at + 3) % 8`)
/// of a small v3 file (three frames, both filters) outside the mutable
/// `hits`/`last_used`: each fails the open (as corrupt, but for the version
/// byte). With the payload checksum off, a flip in the frames either fails
/// (`bad_frame`) or, when zstd decodes the flipped frame to the same bytes,
/// loads exactly the original payload: a wrong byte never reaches a tensor.
#[test]
fn no_single_bit_flip_of_a_v3_file_loads_anything_but_the_original() {
    let dir = tempfile::tempdir().unwrap();
    for shuffle in [true, false] {
        let (_, p3) = write_pair(dir.path(), 2 * 256 + 40, span(shuffle, 1), None);
        let good = std::fs::read(&p3).unwrap();
        let want = open(&p3, &VerifyOptions::default())
            .unwrap()
            .payload()
            .unwrap()
            .to_vec();
        let (off, _, _) = layout(&p3);
        let unchecked = VerifyOptions {
            verify_checksum: false,
            ..VerifyOptions::default()
        };
        let mut same = 0;
        for at in 0..good.len() {
            if (12..16).contains(&at) || (32..40).contains(&at) {
                continue;
            }
            for bit in [at % 8, (at + 3) % 8] {
                let mut f = good.clone();
                f[at] ^= 1 << bit;
                std::fs::write(&p3, &f).unwrap();
                let e = open(&p3, &VerifyOptions::default()).expect_err("a flipped file opened");
                if at != 3 {
                    // the version byte may name another version: v1 (ignored), 7 (unknown)
                    assert_eq!(e.class(), Class::Corrupt, "byte {at} bit {bit}: {e}");
                }
                if at >= off {
                    assert_eq!(e.code(), "payload_checksum", "byte {at}");
                    match open(&p3, &unchecked) {
                        Ok(ck) => {
                            assert_eq!(ck.payload().unwrap(), &want[..], "byte {at} bit {bit}");
                            same += 1;
                        }
                        Err(e) => assert_eq!(e.code(), "bad_frame", "byte {at} bit {bit}: {e}"),
                    }
                }
            }
        }
        // zstd ignores few bits (frame header flags it does not need): most flips are bad frames
        assert!(
            same < 8 * (good.len() - off) / 4,
            "{same} flips decoded the same"
        );
    }
}

#[test]
fn a_table_claiming_more_than_the_ratio_is_refused_before_any_allocation() {
    // a forged table: the same few hundred stored bytes, now claiming
    // 8 MiB frames (the most a span may be), 2^25 raw bytes in all
    let dir = tempfile::tempdir().unwrap();
    let (_, p3) = write_pair(dir.path(), 3 * 256, span(true, 1), None);
    let (_, table, frames) = layout(&p3);
    let mut f = std::fs::read(&p3).unwrap();
    let big = ds4::format::v3::MAX_SPAN;
    set_u32(&mut f, 76, big);
    for i in 0..frames.len() {
        set_u32(&mut f, table + 16 * i + 4, big);
    }
    reseal(&mut f);
    std::fs::write(&p3, &f).unwrap();
    let e = expect_err(
        &p3,
        &VerifyOptions::default(),
        "frame_table",
        "header",
        Class::Corrupt,
    );
    assert!(e.to_string().contains("more than 64 times"), "{e}");
    assert!(ds4::format::v3::within_ratio(64 * 100 + 256, 100, 256));
    assert!(!ds4::format::v3::within_ratio(64 * 100 + 257, 100, 256));
}
