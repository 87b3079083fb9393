//! The checks of the `roundtrip` fuzz target. Text and tensors derived from
//! the input are written with the v2 writer
//! and opened again (mmap and pread): everything must come back identical,
//! every tensor 64-byte aligned. Any mismatch panics.
#![allow(
    clippy::cast_possible_truncation,
    reason = "fuzz inputs are small: lengths fit usize"
)]

use arbitrary::{Result, Unstructured};
use ds4::{open, Dtype, TensorSrc, VerifyOptions, WriteMeta, WriteOptions};
use std::path::PathBuf;
use std::sync::OnceLock;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| crate::scratch::dir("roundtrip"))
}

struct T {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn derive(u: &mut Unstructured<'_>) -> Result<(WriteMeta, Vec<u8>, Vec<T>)> {
    let meta = WriteMeta {
        quant_bits: u.arbitrary()?,
        reason: u.arbitrary()?,
        flags: u.arbitrary()?,
        tokens: u.arbitrary()?,
        ctx: u.arbitrary()?,
        created: u.arbitrary()?,
        abi: {
            let s: String = u.arbitrary()?;
            s.chars().take(64).collect()
        },
    };
    let text_len = u.int_in_range(0..=2048usize)?;
    let text = u.bytes(text_len.min(u.len()))?.to_vec();
    let n = u.int_in_range(0..=8usize)?;
    let mut tensors = Vec::new();
    for i in 0..n {
        let dtype = Dtype::from_code(u.int_in_range(0..=10u8)?).unwrap();
        let ndim = u.int_in_range(0..=3usize)?;
        let mut shape = Vec::new();
        for _ in 0..ndim {
            shape.push(u.int_in_range(0..=16u64)?);
        }
        let suffix: String = u.arbitrary()?;
        let mut name = format!("{i}{suffix}");
        while name.len() > 255 {
            name.pop();
        }
        let nbytes = (shape.iter().product::<u64>() * dtype.itemsize()) as usize;
        // Data from the input, cycled when the input runs out.
        let avail = u.bytes(nbytes.min(u.len()))?.to_vec();
        let data: Vec<u8> = (0..nbytes)
            .map(|j| {
                if avail.is_empty() {
                    j as u8
                } else {
                    avail[j % avail.len()]
                }
            })
            .collect();
        tensors.push(T {
            name,
            dtype,
            shape,
            data,
        });
    }
    Ok((meta, text, tensors))
}

/// One input through the target's round trip: what the fuzzer runs, and
/// what `cargo test` replays for every seed and crash input
/// (`rust/tests/fuzz_corpus.rs`).
pub fn check(input: &[u8]) {
    let mut u = Unstructured::new(input);
    let Ok((meta, text, tensors)) = derive(&mut u) else {
        return;
    };
    let srcs: Vec<TensorSrc<'_>> = tensors
        .iter()
        .map(|t| TensorSrc {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            data: &t.data,
        })
        .collect();
    let path = scratch().join(format!("{}.kv", ds4::hash::sha1_hex(&text)));
    let w = ds4::write_checkpoint(&path, &meta, &text, &srcs, &WriteOptions::default())
        .expect("writer refused valid input");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), w.file_len);
    for mmap in [true, false] {
        let ck = open(
            &path,
            &VerifyOptions {
                mmap,
                expected_abi: Some(&meta.abi),
                prompt: Some(&text),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("written file does not open (mmap={mmap}): {e}"));
        let h = &ck.header;
        assert_eq!(
            (
                h.version,
                h.quant_bits,
                h.reason,
                h.flags,
                h.tokens,
                h.ctx,
                h.created,
                h.last_used,
                h.hits
            ),
            (
                2,
                meta.quant_bits,
                meta.reason,
                meta.flags,
                meta.tokens,
                meta.ctx,
                meta.created,
                meta.created,
                0
            )
        );
        assert_eq!(h.abi, meta.abi);
        assert_eq!(ck.text, text);
        assert_eq!(h.payload_checksum, w.payload_checksum);
        assert_eq!(h.header_checksum, w.header_checksum);
        assert_eq!(h.tensors.len(), tensors.len());
        let payload = ck.payload().unwrap();
        assert!(payload.is_empty() || (payload.as_ptr() as usize) % 64 == 0);
        for (info, t) in h.tensors.iter().zip(&tensors) {
            assert_eq!(
                (&info.name, info.dtype, &info.shape),
                (&t.name, t.dtype, &t.shape)
            );
            assert_eq!(info.offset % 64, 0);
            assert_eq!(
                &payload[info.offset as usize..][..t.data.len()],
                &t.data[..]
            );
        }
    }
    std::fs::remove_file(&path).unwrap();
}
