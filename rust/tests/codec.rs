//! The v3 payload codec (FORMAT.md §1.10): round trips against v2 for
//! payloads of several sizes (empty, one byte, around the frame span,
//! several frames), each filter and level; and the exact typed error for a
//! flipped byte in each frame, in the frame table, a truncated file, a frame
//! of the wrong raw length, a wrong raw hash, an unknown codec.

mod common;

use common::{expect_err, open_both, reseal, set_u32, set_u64, xxh3_64};
use ds4::format::mac::derive_key;
use ds4::format::writer::write_checkpoint_with;
use ds4::format::writer_v3::{write_compressed, Compression};
use ds4::{open, Class, Dtype, TensorSrc, VerifyOptions, WriteMeta};
use std::path::{Path, PathBuf};

const SPAN: u32 = 256;

fn meta() -> WriteMeta {
    WriteMeta {
        quant_bits: 0,
        reason: 1,
        flags: 0,
        tokens: 3,
        ctx: 4096,
        created: 1_700_000_000,
        abi: "test/1".into(),
    }
}

/// f16-like data: a smooth ramp (compressible high bytes) with noise.
fn data(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .map(|i| {
            let i = u32::try_from(i).unwrap();
            if i % 2 == 1 {
                0x3c
            } else {
                (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13).to_le_bytes()[0]
            }
        })
        .collect()
}

fn name(text: &[u8]) -> String {
    format!("{}.kv", ds4::hash::sha1_hex(text))
}

/// Writes the same input as v2 and as v3; returns both paths.
fn write_pair(
    dir: &Path,
    blob_len: usize,
    c: Compression,
    key: Option<&[u8; 32]>,
) -> (PathBuf, PathBuf) {
    let text = format!("text {blob_len} {c:?}").into_bytes();
    let logits: Vec<u8> = [1.0f32, 2.0, 3.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let blob = data(blob_len, 7);
    let shape_l = [3u64];
    let shape_b = [blob_len as u64];
    let tensors = [
        TensorSrc {
            name: "logits",
            dtype: Dtype::F32,
            shape: &shape_l,
            data: &logits,
        },
        TensorSrc {
            name: "blob",
            dtype: Dtype::U8,
            shape: &shape_b,
            data: &blob,
        },
    ];
    let d2 = dir.join("v2");
    let d3 = dir.join("v3");
    std::fs::create_dir_all(&d2).unwrap();
    std::fs::create_dir_all(&d3).unwrap();
    let p2 = d2.join(name(&text));
    let p3 = d3.join(name(&text));
    write_checkpoint_with(&p2, &meta(), &text, &tensors, key, false).unwrap();
    write_compressed(&p3, &meta(), &text, &tensors, key, false, &c).unwrap();
    (p2, p3)
}

fn span(shuffle: bool, level: u8) -> Compression {
    Compression {
        level,
        shuffle,
        span: SPAN,
    }
}

#[test]
fn v3_round_trips_every_size_filter_and_level_as_v2_does() {
    let dir = tempfile::tempdir().unwrap();
    // the blob starts at payload offset 64: raw lengths around 0, 1, SPAN, 3 SPAN
    for blob_len in [0usize, 1, 2, 191, 192, 193, 255, 256, 700, 3 * 256 + 17] {
        for (shuffle, level) in [(true, 1), (false, 1), (true, 3), (false, 19)] {
            let (p2, p3) = write_pair(dir.path(), blob_len, span(shuffle, level), None);
            let a = open_both(&p2, &VerifyOptions::default()).unwrap();
            let b = open_both(&p3, &VerifyOptions::default()).unwrap();
            assert_eq!(a.header.version, 2);
            assert_eq!(b.header.version, 3);
            assert_eq!(a.payload().unwrap(), b.payload().unwrap(), "len {blob_len}");
            assert_eq!(a.header.tensors, b.header.tensors);
            assert_eq!(a.text, b.text);
            assert_eq!(b.header.raw_payload_bytes, a.header.payload_bytes);
            let c = b.header.codec.as_ref().unwrap();
            assert_eq!(
                (c.codec, c.filter, c.level, c.span),
                (1, u8::from(shuffle), level, SPAN)
            );
            let raw = a.header.payload_bytes;
            assert_eq!(c.frames.len() as u64, raw.div_ceil(u64::from(SPAN)));
            let stored: u64 = c.frames.iter().map(|f| u64::from(f.stored)).sum();
            assert_eq!(stored, b.header.payload_bytes);
            assert_eq!(b.file_len, b.header.payload_offset + stored);
            // the stored checksum is the xxh3 of the stored section (independent XXH3)
            let f = std::fs::read(&p3).unwrap();
            let off = usize::try_from(b.header.payload_offset).unwrap();
            assert_eq!(xxh3_64(&f[off..]), b.header.payload_checksum);
            // every tensor 64-byte aligned in memory
            for t in &b.header.tensors {
                let at =
                    b.payload().unwrap().as_ptr() as usize + usize::try_from(t.offset).unwrap();
                assert_eq!(at % 64, 0);
            }
        }
    }
}

#[test]
fn v2_stays_zero_copy_and_v3_is_decoded_into_a_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (p2, p3) = write_pair(dir.path(), 5000, span(true, 1), None);
    let a = open(&p2, &VerifyOptions::default()).unwrap();
    let b = open(&p3, &VerifyOptions::default()).unwrap();
    assert!(matches!(
        a.storage.as_deref(),
        Some(ds4::payload::Storage::Mmap { .. })
    ));
    assert!(matches!(
        b.storage.as_deref(),
        Some(ds4::payload::Storage::Heap(_))
    ));
    assert!(b.file_len < a.file_len, "{} vs {}", b.file_len, a.file_len);
    // the payload of v2 is exactly the input: logits, padding, blob
    let p = a.payload().unwrap();
    assert_eq!(&p[64..], &data(5000, 7)[..]);
}

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

#[test]
fn touch_updates_a_v3_file_and_it_still_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let (_, p3) = write_pair(dir.path(), 600, span(true, 1), None);
    assert_eq!(ds4::touch(&p3, 1_800_000_000).unwrap(), 1);
    let ck = open_both(&p3, &VerifyOptions::default()).unwrap();
    assert_eq!((ck.header.hits, ck.header.last_used), (1, 1_800_000_000));
}

#[test]
fn the_writer_refuses_bad_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let t = [TensorSrc {
        name: "x",
        dtype: Dtype::U8,
        shape: &[1],
        data: &[1],
    }];
    for c in [
        Compression {
            level: 0,
            shuffle: true,
            span: SPAN,
        },
        Compression {
            level: 23,
            shuffle: true,
            span: SPAN,
        },
        Compression {
            level: 1,
            shuffle: true,
            span: 100,
        },
        Compression {
            level: 1,
            shuffle: true,
            span: 16 << 20,
        },
    ] {
        let p = dir.path().join(name(b"x"));
        assert!(
            write_compressed(&p, &meta(), b"x", &t, None, false, &c).is_err(),
            "{c:?}"
        );
        assert!(!p.exists());
    }
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

/// A 0-byte payload (no tensors, or one empty tensor): no frames, an empty
/// stored section, and the same (empty) payload as v2.
#[test]
fn an_empty_payload_has_no_frames() {
    let dir = tempfile::tempdir().unwrap();
    let empty: [u64; 1] = [0];
    let one = [TensorSrc {
        name: "e",
        dtype: Dtype::F16,
        shape: &empty,
        data: &[],
    }];
    for (i, tensors) in [&[][..], &one[..]].into_iter().enumerate() {
        let text = format!("empty {i}").into_bytes();
        let p = dir.path().join(name(&text));
        let c = span(true, 1);
        write_compressed(&p, &meta(), &text, tensors, None, false, &c).unwrap();
        let ck = open_both(&p, &VerifyOptions::default()).unwrap();
        let codec = ck.header.codec.as_ref().unwrap();
        assert!(codec.frames.is_empty());
        assert_eq!(
            (ck.header.payload_bytes, ck.header.raw_payload_bytes),
            (0, 0)
        );
        assert_eq!(ck.payload().unwrap(), b"");
        assert_eq!(ck.file_len, ck.header.payload_offset);
        assert_eq!(ck.header.tensors.len(), tensors.len());
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

#[test]
fn a_payload_that_compresses_beyond_the_ratio_is_written_as_v2() {
    // zeros: a 1 MiB frame stores a few bytes, beyond what a reader takes,
    // so the writer stores the file uncompressed (and it reads back)
    let dir = tempfile::tempdir().unwrap();
    let zeros = vec![0u8; 4 << 20];
    let shape = [zeros.len() as u64];
    let t = [TensorSrc {
        name: "z",
        dtype: Dtype::U8,
        shape: &shape,
        data: &zeros,
    }];
    let text = b"zeros".to_vec();
    let p = dir.path().join(name(&text));
    let c = Compression::default();
    write_compressed(&p, &meta(), &text, &t, None, false, &c).unwrap();
    let ck = open_both(&p, &VerifyOptions::default()).unwrap();
    assert_eq!(ck.header.version, 2);
    assert!(ck.header.codec.is_none());
    assert_eq!(ck.payload().unwrap(), &zeros[..]);
    // data that compresses as KV states do (about 0.9) stays v3
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let blob: Vec<u8> = (0..4usize << 20)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if i % 2 == 1 {
                0x3c | (x.to_le_bytes()[0] & 1)
            } else {
                x.to_le_bytes()[0]
            }
        })
        .collect();
    let t = [TensorSrc {
        name: "b",
        dtype: Dtype::U8,
        shape: &shape,
        data: &blob,
    }];
    let text = b"ramp".to_vec();
    let p = dir.path().join(name(&text));
    write_compressed(&p, &meta(), &text, &t, None, false, &c).unwrap();
    let ck = open_both(&p, &VerifyOptions::default()).unwrap();
    assert_eq!(ck.header.version, 3);
    assert_eq!(ck.payload().unwrap(), &blob[..]);
}
