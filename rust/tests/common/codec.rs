//! The input of the v3 codec tests (`codec.rs`, `codec_errors.rs`): the
//! same tensors written as v2 and as v3, with frames of `SPAN` raw bytes.

use ds4::{write_checkpoint, Compression, Dtype, TensorSrc, WriteMeta, WriteOptions};
use std::path::{Path, PathBuf};

pub const SPAN: u32 = 256;

pub fn meta() -> WriteMeta {
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
pub fn data(n: usize, seed: u32) -> Vec<u8> {
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

pub fn name(text: &[u8]) -> String {
    format!("{}.kv", ds4::hash::sha1_hex(text))
}

/// Writes the same input as v2 and as v3; returns both paths.
pub fn write_pair(
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
    write_checkpoint(&p2, &meta(), &text, &tensors, &wopts(key, None)).unwrap();
    write_checkpoint(&p3, &meta(), &text, &tensors, &wopts(key, Some(c))).unwrap();
    (p2, p3)
}

/// The writer's options here: `key`, `compression`, the page cache left alone.
pub fn wopts(key: Option<&[u8; 32]>, compression: Option<Compression>) -> WriteOptions<'_> {
    WriteOptions {
        auth_key: key,
        drop_cache: false,
        compression,
    }
}

pub fn span(shuffle: bool, level: u8) -> Compression {
    Compression {
        level,
        shuffle,
        span: SPAN,
    }
}
