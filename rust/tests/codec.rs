//! The v3 payload codec (FORMAT.md §1.10): round trips against v2 for
//! payloads of several sizes (empty, one byte, around the frame span,
//! several frames), each filter and level; what the writer refuses and when
//! it stores v2 instead. The typed errors of damaged v3 files are in
//! `codec_errors.rs`.

mod common;

use common::codec::{data, meta, name, span, wopts, write_pair, SPAN};
use common::{open_both, xxh3_64};
use ds4::{open, write_checkpoint, Compression, Dtype, TensorSrc, VerifyOptions};

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
            write_checkpoint(&p, &meta(), b"x", &t, &wopts(None, Some(c))).is_err(),
            "{c:?}"
        );
        assert!(!p.exists());
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
        write_checkpoint(&p, &meta(), &text, tensors, &wopts(None, Some(c))).unwrap();
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
    write_checkpoint(&p, &meta(), &text, &t, &wopts(None, Some(c))).unwrap();
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
    write_checkpoint(&p, &meta(), &text, &t, &wopts(None, Some(c))).unwrap();
    let ck = open_both(&p, &VerifyOptions::default()).unwrap();
    assert_eq!(ck.header.version, 3);
    assert_eq!(ck.payload().unwrap(), &blob[..]);
}
