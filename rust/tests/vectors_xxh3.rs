//! The tests' own XXH3 (`common::xxh3_64`, from `twox-hash`, independent of
//! the crate's `xxhash-rust`) agrees with the crate's checksums on inputs of
//! every length class XXH3-64 treats differently: the payload checksum, the
//! writer's streaming payload checksum and the header checksum. The vector
//! tests (`vectors.rs`) recompute FORMAT.md's documented checksums with it.

mod common;

use ds4::{Dtype, TensorSrc};

/// Inputs of every length class XXH3-64 treats differently (0, 1-3, 4-8,
/// 9-16, 17-128, 129-240, and longer: one stripe, several, several blocks).
fn xxh3_inputs() -> Vec<Vec<u8>> {
    let lens = [
        0usize, 1, 3, 4, 8, 9, 16, 17, 64, 128, 129, 200, 240, 241, 1023, 1024, 1025, 4096, 100_003,
    ];
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|i| (i.wrapping_mul(131) ^ (i >> 7)).to_le_bytes()[0])
                .collect()
        })
        .collect()
}

#[test]
fn independent_xxh3_agrees_with_the_crate() {
    // A published answer: XXH3_64bits("") with seed 0.
    assert_eq!(common::xxh3_64(b""), 0x2d06_8005_38d3_94c2);
    for data in xxh3_inputs() {
        assert_eq!(
            ds4::format::v2::payload_checksum(&data),
            common::independent_payload_checksum(&data),
            "payload checksum of {} bytes",
            data.len()
        );
    }
    // The writer's streaming payload checksum: tensors of those lengths, each
    // at the next 64-byte boundary, with the zero padding in between.
    let inputs = xxh3_inputs();
    let srcs: Vec<TensorSrc<'_>> = inputs
        .iter()
        .map(|d| TensorSrc {
            name: "t",
            dtype: Dtype::U8,
            shape: &[],
            data: d,
        })
        .collect();
    for n in 0..=srcs.len() {
        let mut payload = Vec::new();
        for t in &srcs[..n] {
            payload.resize(payload.len().div_ceil(64) * 64, 0);
            payload.extend_from_slice(t.data);
        }
        assert_eq!(
            ds4::format::writer::checksum_tensors(&srcs[..n]),
            common::independent_payload_checksum(&payload),
            "writer payload checksum of the first {n} tensors"
        );
    }
    // The header checksum, including non-zero mutable fields and a stored
    // checksum (both read as zero) and metadata of several lengths.
    let fixed: Vec<u8> = (0..96u8)
        .map(|i| i.wrapping_mul(37).wrapping_add(1))
        .collect();
    for meta in xxh3_inputs().iter().take(14) {
        assert_eq!(
            ds4::format::v2::header_checksum(&fixed, meta),
            common::independent_header_checksum(&fixed, meta),
            "header checksum with {} metadata bytes",
            meta.len()
        );
    }
    let f = common::default_file();
    let meta_len = u32::from_le_bytes(f[20..24].try_into().unwrap()) as usize;
    assert_eq!(
        ds4::format::v2::header_checksum(&f[..96], &f[96..96 + meta_len]),
        u64::from_le_bytes(f[88..96].try_into().unwrap())
    );
}
