//! The v3 reader (docs/FORMAT.md §1.10): v2 with its payload stored as
//! independent compressed frames. The header names the codec (byte 53), the
//! filter (54), the level (55, informational) and the raw span of a frame
//! (76..80); the metadata ends with the frame table, covered by the header
//! checksum. The payload checksum and the MAC run over the stored
//! (compressed) bytes; each frame's raw bytes are checked against their own
//! xxh3-64 once decompressed ([`decode_frames`]), and the first frame that
//! fails stops the load.
#![deny(clippy::indexing_slicing)]

use super::bytes::{byte, le_u32, Cursor};
use super::meta::{decode_meta_with, ends_inside};
use super::TensorInfo;
use crate::error::{Error, Result};
use crate::payload::AlignedBuf;

/// Header byte 53: the codec.
pub const CODEC_OFFSET: usize = 53;
/// Header byte 54: the filter applied to a frame's raw bytes before it is compressed.
pub const FILTER_OFFSET: usize = 54;
/// Header byte 55: the compression level the writer used (not needed to read).
pub const LEVEL_OFFSET: usize = 55;
/// Header bytes 76..80: u32, the raw bytes of every frame but the last.
pub const SPAN_OFFSET: usize = 76;
/// Codec 1: zstd (RFC 8878), one zstd frame per payload frame.
pub const CODEC_ZSTD: u8 = 1;
/// Filter 0: none.
pub const FILTER_NONE: u8 = 0;
/// Filter 1, `shuffle2`: the even bytes of the frame, then its odd bytes
/// (the low, then the high bytes of each f16).
pub const FILTER_SHUFFLE2: u8 = 1;
/// The span ds4 writes: 1 MiB of raw payload per frame.
pub const DEFAULT_SPAN: u32 = 1 << 20;
/// Spans a reader accepts: a multiple of 64 in `[MIN_SPAN, MAX_SPAN]`.
pub const MIN_SPAN: u32 = 64;
pub const MAX_SPAN: u32 = 8 << 20;
/// The most raw bytes a v3 file may claim per stored byte (beyond one
/// span): what a reader allocates is bounded by the file it reads, as for
/// v2, and a forged table of highly compressible frames is refused before
/// any allocation. KV states store 0.85-0.93 of their raw bytes
/// (BENCHMARKS.md §2.4); a payload that compresses further is written as v2
/// (by [`write_checkpoint`](super::writer::write_checkpoint)).
pub const MAX_RATIO: u64 = 64;

/// Whether `raw` bytes decoded from `stored` are within [`MAX_RATIO`].
pub fn within_ratio(raw: u64, stored: u64, span: u32) -> bool {
    raw <= stored
        .saturating_mul(MAX_RATIO)
        .saturating_add(u64::from(span))
}

/// One frame table entry: u32 stored length, u32 raw length, u64 xxh3-64.
pub const FRAME_ENTRY: usize = 16;

/// One frame of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    /// Bytes the frame takes in the file.
    pub stored: u32,
    /// Bytes it decompresses to.
    pub raw: u32,
    /// xxh3-64 of those raw bytes.
    pub hash: u64,
}

/// What a v3 header says about its payload's encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Codec {
    pub codec: u8,
    pub filter: u8,
    pub level: u8,
    pub span: u32,
    pub frames: Vec<Frame>,
}

pub fn codec_name(codec: u8) -> &'static str {
    match codec {
        CODEC_ZSTD => "zstd",
        _ => "unknown",
    }
}

pub fn filter_name(filter: u8) -> &'static str {
    match filter {
        FILTER_NONE => "none",
        FILTER_SHUFFLE2 => "shuffle2",
        _ => "unknown",
    }
}

/// The v3 metadata: v2's (ABI string, tensor table), then `u32 n_frames`
/// and `n_frames` entries of [`FRAME_ENTRY`] bytes; nothing may follow.
/// The codec and filter bytes are checked first (an unknown one is
/// `unsupported_codec`: incompatible, a newer ds4 may own the file).
pub fn decode_meta_v3(fixed: &[u8], meta: &[u8]) -> Result<(String, Vec<TensorInfo>, Codec)> {
    let codec = byte(fixed, CODEC_OFFSET);
    let filter = byte(fixed, FILTER_OFFSET);
    if codec != CODEC_ZSTD || filter > FILTER_SHUFFLE2 {
        return Err(Error::UnsupportedCodec { codec, filter });
    }
    let mut c = Cursor::new(meta, ends_inside);
    let (abi, tensors) = decode_meta_with(&mut c)?;
    let n = c.u32("frame count")? as usize;
    if n.checked_mul(FRAME_ENTRY) != Some(c.remaining()) {
        return Err(Error::FrameTable(format!(
            "{n} frames need {} bytes of table, the metadata has {} left",
            n.saturating_mul(FRAME_ENTRY),
            c.remaining()
        )));
    }
    let mut frames = Vec::with_capacity(n);
    for _ in 0..n {
        frames.push(Frame {
            stored: c.u32("frame stored length")?,
            raw: c.u32("frame raw length")?,
            hash: c.u64("frame hash")?,
        });
    }
    Ok((
        abi,
        tensors,
        Codec {
            codec,
            filter,
            level: byte(fixed, LEVEL_OFFSET),
            span: le_u32(fixed, SPAN_OFFSET),
            frames,
        },
    ))
}

impl Codec {
    /// The frame table against the span and the stored payload: the span a
    /// multiple of 64 in `[MIN_SPAN, MAX_SPAN]`; every frame but the last
    /// `span` raw bytes, the last 1 to `span`; each stored length at least 1
    /// and at most zstd's bound for its raw length; the stored lengths add
    /// up to `payload_bytes`. Returns the raw payload length.
    pub fn check_frames(&self, payload_bytes: u64) -> Result<u64> {
        let span = self.span;
        if !(MIN_SPAN..=MAX_SPAN).contains(&span) || span % 64 != 0 {
            return Err(Error::FrameTable(format!(
                "frame span {span} is not a multiple of 64 in [{MIN_SPAN}, {MAX_SPAN}]"
            )));
        }
        let mut stored = 0u64;
        let mut raw = 0u64;
        let last = self.frames.len().saturating_sub(1);
        for (i, f) in self.frames.iter().enumerate() {
            let ok_raw = if i == last {
                (1..=span).contains(&f.raw)
            } else {
                f.raw == span
            };
            if !ok_raw {
                return Err(Error::FrameTable(format!(
                    "frame {i} holds {} raw bytes (span {span}, {} frames)",
                    f.raw,
                    self.frames.len()
                )));
            }
            let bound = zstd::zstd_safe::compress_bound(f.raw as usize) as u64;
            if f.stored == 0 || u64::from(f.stored) > bound {
                return Err(Error::FrameTable(format!(
                    "frame {i} stores {} bytes for {} raw bytes (at most {bound})",
                    f.stored, f.raw
                )));
            }
            stored += u64::from(f.stored);
            raw += u64::from(f.raw);
        }
        if stored != payload_bytes {
            return Err(Error::FrameTable(format!(
                "the frames store {stored} bytes, the payload section is {payload_bytes}"
            )));
        }
        if !within_ratio(raw, stored, span) {
            return Err(Error::FrameTable(format!(
                "the frames claim {raw} raw bytes from {stored} stored: more than {MAX_RATIO} times \
                 what is stored (a reader never allocates for a decompression bomb)"
            )));
        }
        Ok(raw)
    }
}

/// `shuffle2`: the even bytes of `src`, then its odd bytes, into `dst`
/// (of the same length).
pub fn shuffle2(src: &[u8], dst: &mut [u8]) {
    let half = src.len().div_ceil(2);
    let (even, odd) = dst.split_at_mut(half.min(dst.len()));
    for (d, s) in even.iter_mut().zip(src.iter().step_by(2)) {
        *d = *s;
    }
    for (d, s) in odd.iter_mut().zip(src.iter().skip(1).step_by(2)) {
        *d = *s;
    }
}

/// The inverse of [`shuffle2`].
pub fn unshuffle2(src: &[u8], dst: &mut [u8]) {
    let half = src.len().div_ceil(2);
    let (even, odd) = src.split_at(half.min(src.len()));
    for (d, s) in dst.iter_mut().step_by(2).zip(even) {
        *d = *s;
    }
    for (d, s) in dst.iter_mut().skip(1).step_by(2).zip(odd) {
        *d = *s;
    }
}

fn bad_frame(index: usize, reason: String) -> Error {
    Error::BadFrame { index, reason }
}

/// Decompresses one frame at a time into its slice of the raw payload
/// (what [`crate::decode`] and [`decode_frames`] share). A frame that does
/// not decompress, decompresses to another length than its table entry's,
/// or whose raw bytes do not hash to the entry's xxh3-64 is
/// [`Error::BadFrame`]. Holds zstd's decompression context and, for
/// `shuffle2`, one span of scratch.
pub struct FrameDecoder {
    dctx: zstd::bulk::Decompressor<'static>,
    shuffled: bool,
    scratch: Vec<u8>,
}

impl FrameDecoder {
    pub fn new(c: &Codec) -> Result<Self> {
        let shuffled = c.filter == FILTER_SHUFFLE2;
        Ok(FrameDecoder {
            dctx: zstd::bulk::Decompressor::new()?,
            shuffled,
            scratch: vec![0u8; if shuffled { c.span as usize } else { 0 }],
        })
    }

    /// Frame `i` (`f`, its table entry), stored as `src`, into `dst`
    /// (`f.raw` bytes long).
    pub fn frame(&mut self, i: usize, f: &Frame, src: &[u8], dst: &mut [u8]) -> Result<()> {
        let zerr = |e: std::io::Error| bad_frame(i, format!("zstd cannot decompress it: {e}"));
        let n = if self.shuffled {
            let tmp = self
                .scratch
                .get_mut(..f.raw as usize)
                .ok_or(Error::SizeOverflow)?;
            let n = self.dctx.decompress_to_buffer(src, tmp).map_err(zerr)?;
            if n == f.raw as usize {
                unshuffle2(tmp, dst);
            }
            n
        } else {
            self.dctx.decompress_to_buffer(src, dst).map_err(zerr)?
        };
        if n != f.raw as usize {
            return Err(bad_frame(
                i,
                format!("it decompresses to {n} bytes, the table says {}", f.raw),
            ));
        }
        let h = xxhash_rust::xxh3::xxh3_64(dst);
        if h != f.hash {
            return Err(bad_frame(
                i,
                format!(
                    "its raw bytes hash to {h:016x}, the table says {:016x}",
                    f.hash
                ),
            ));
        }
        Ok(())
    }
}

/// Decompresses the verified stored payload `stored` (in memory) frame by
/// frame into a 64-byte-aligned buffer of the raw payload ([`FrameDecoder`]);
/// the first frame that fails stops the decoding: nothing of the buffer is
/// handed out. (A file is read by [`crate::decode::load`], which never
/// holds more than one frame of its stored bytes.)
pub fn decode_frames(stored: &[u8], c: &Codec, raw_len: u64) -> Result<AlignedBuf> {
    let mut out = AlignedBuf::lazy(usize::try_from(raw_len).map_err(|_| Error::SizeOverflow)?)?;
    let mut dec = FrameDecoder::new(c)?;
    let (mut s, mut r) = (0usize, 0usize);
    let dst_all = out.as_mut_slice();
    for (i, f) in c.frames.iter().enumerate() {
        let (ns, nr) = (s + f.stored as usize, r + f.raw as usize);
        let src = stored.get(s..ns).ok_or(Error::SizeOverflow)?;
        let dst = dst_all.get_mut(r..nr).ok_or(Error::SizeOverflow)?;
        dec.frame(i, f, src, dst)?;
        (s, r) = (ns, nr);
    }
    Ok(out)
}
