//! The v3 writer (FORMAT.md §1.10): the v2 file with its payload cut into
//! frames of `span` raw bytes, each filtered (`shuffle2`, optional) and
//! compressed with zstd on its own. Streamed: one frame of raw bytes and one
//! of compressed bytes are held at a time. The header and its frame table
//! (whose size is known from the raw length) are written last, over the
//! zeros that held their place; with a key, the MAC is computed in a second
//! pass that reads the stored payload back from the temp file.
// The writer only indexes buffers it sized itself (the header it built).
#![allow(clippy::indexing_slicing)]

use super::mac::{MacKey, MacState, AUTH_BLAKE3, AUTH_OFFSET, MAC_BYTES};
use super::v2::header_checksum;
use super::v3::{
    shuffle2, within_ratio, Frame, CODEC_OFFSET, CODEC_ZSTD, FILTER_NONE, FILTER_OFFSET,
    FILTER_SHUFFLE2, FRAME_ENTRY, LEVEL_OFFSET, MAX_SPAN, MIN_SPAN, SPAN_OFFSET,
};
use super::writer::{
    commit, encode_header, temp_for, write_v2, zeros, TensorSrc, WriteMeta, WriteOptions, Written,
};
use super::{align_up, MAX_META, V2_FIXED, VERSION_V3};
use crate::error::{Error, Result};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use xxhash_rust::xxh3::Xxh3;

/// How to compress a payload: zstd at `level`, `shuffle2` first or not,
/// `span` raw bytes per frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compression {
    pub level: u8,
    pub shuffle: bool,
    pub span: u32,
}

impl Default for Compression {
    fn default() -> Self {
        Compression {
            level: 1,
            shuffle: true,
            span: super::v3::DEFAULT_SPAN,
        }
    }
}

impl Compression {
    fn check(self) -> Result<()> {
        if !(1..=22).contains(&self.level) {
            return Err(Error::FrameTable(format!(
                "zstd level {} is not in 1..=22",
                self.level
            )));
        }
        if !(MIN_SPAN..=MAX_SPAN).contains(&self.span) || self.span % 64 != 0 {
            return Err(Error::FrameTable(format!(
                "frame span {} is not a multiple of 64 in [{MIN_SPAN}, {MAX_SPAN}]",
                self.span
            )));
        }
        Ok(())
    }
}

/// Cuts the raw payload (tensors and their zero padding, in file order)
/// into frames and writes each compressed frame to `w`.
struct Framer<'w, W: Write> {
    w: &'w mut W,
    c: Compression,
    cctx: zstd::bulk::Compressor<'static>,
    raw: Vec<u8>,
    shuffled: Vec<u8>,
    out: Vec<u8>,
    frames: Vec<Frame>,
    stored: Xxh3,
}

impl<W: Write> Framer<'_, W> {
    fn feed(&mut self, mut bytes: &[u8]) -> Result<()> {
        let span = self.c.span as usize;
        while !bytes.is_empty() {
            let k = (span - self.raw.len()).min(bytes.len());
            self.raw.extend_from_slice(&bytes[..k]);
            bytes = &bytes[k..];
            if self.raw.len() == span {
                self.emit()?;
            }
        }
        Ok(())
    }

    fn emit(&mut self) -> Result<()> {
        if self.raw.is_empty() {
            return Ok(());
        }
        let hash = xxhash_rust::xxh3::xxh3_64(&self.raw);
        let src: &[u8] = if self.c.shuffle {
            self.shuffled.resize(self.raw.len(), 0);
            shuffle2(&self.raw, &mut self.shuffled);
            &self.shuffled
        } else {
            &self.raw
        };
        self.out.clear();
        self.cctx.compress_to_buffer(src, &mut self.out)?;
        self.w.write_all(&self.out)?;
        self.stored.update(&self.out);
        let too_big = || Error::SizeOverflow;
        self.frames.push(Frame {
            stored: u32::try_from(self.out.len()).map_err(|_| too_big())?,
            raw: u32::try_from(self.raw.len()).map_err(|_| too_big())?,
            hash,
        });
        self.raw.clear();
        Ok(())
    }
}

/// [`write_checkpoint`](super::writer::write_checkpoint) of a v3 file: its
/// payload compressed as `c` says (the temp file, fsync, rename and fsync
/// of the directory of a v2 write); authenticated when `o.auth_key` is
/// given.
pub(super) fn write_compressed(
    path: &Path,
    meta: &WriteMeta,
    text: &[u8],
    tensors: &[TensorSrc<'_>],
    o: &WriteOptions<'_>,
    c: Compression,
) -> Result<Written> {
    c.check()?;
    match write_v3(path, meta, text, tensors, o.auth_key, o.drop_cache, c) {
        // a payload that compresses beyond what a reader accepts (zeros,
        // mostly: `v3::MAX_RATIO`) is stored uncompressed, as v2: nothing
        // is lost but bytes
        Err(Error::FrameTable(_)) => write_v2(path, meta, text, tensors, o),
        other => other,
    }
}

/// The v3 header and metadata of a write, the frame table zeroed (filled
/// in once the frames are written): the bytes, where the table starts, and
/// the raw payload length.
fn v3_head(
    meta: &WriteMeta,
    text: &[u8],
    tensors: &[TensorSrc<'_>],
    keyed: bool,
    c: Compression,
) -> Result<(Vec<u8>, usize, u64)> {
    let (mut head, _infos, raw_len) = encode_header(meta, text, tensors)?;
    let n_frames = raw_len.div_ceil(u64::from(c.span));
    let meta_len = (head.len() - V2_FIXED) as u64 + 4 + n_frames * FRAME_ENTRY as u64;
    if meta_len > MAX_META {
        return Err(Error::HeaderTooLarge {
            what: "metadata",
            len: meta_len,
            max: MAX_META,
        });
    }
    let n_frames_u32 = u32::try_from(n_frames).map_err(|_| Error::SizeOverflow)?;
    head[3] = VERSION_V3;
    head[20..24].copy_from_slice(&u32::try_from(meta_len).unwrap_or(0).to_le_bytes());
    head[CODEC_OFFSET] = CODEC_ZSTD;
    head[FILTER_OFFSET] = if c.shuffle {
        FILTER_SHUFFLE2
    } else {
        FILTER_NONE
    };
    head[LEVEL_OFFSET] = c.level;
    head[SPAN_OFFSET..SPAN_OFFSET + 4].copy_from_slice(&c.span.to_le_bytes());
    if keyed {
        head[AUTH_OFFSET] = AUTH_BLAKE3;
    }
    let table_at = head.len();
    head.extend_from_slice(&n_frames_u32.to_le_bytes());
    head.resize(table_at + 4 + FRAME_ENTRY * n_frames_u32 as usize, 0);
    Ok((head, table_at, raw_len))
}

/// [`write_compressed`] without the v2 fallback, its parameters checked:
/// `FrameTable` only when the payload compresses beyond [`within_ratio`]
/// (the temp file removed).
fn write_v3(
    path: &Path,
    meta: &WriteMeta,
    text: &[u8],
    tensors: &[TensorSrc<'_>],
    key: Option<&MacKey>,
    drop_cache: bool,
    c: Compression,
) -> Result<Written> {
    let (mut head, table_at, raw_len) = v3_head(meta, text, tensors, key.is_some(), c)?;
    let text_end = head.len() as u64 + text.len() as u64;
    let payload_off = align_up(text_end).ok_or(Error::SizeOverflow)?;

    let (dir, tmp) = temp_for(path)?;
    let res = (|| -> Result<Written> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        w.write_all(&head)?; // zeros where the header's checksums and table go
        w.write_all(text)?;
        w.write_all(zeros(payload_off - text_end))?;
        let (frames, sum) = write_frames(&mut w, tensors, c)?;
        let file = w.into_inner().map_err(|e| Error::Io(e.into_error()))?;
        let stored_len: u64 = frames.iter().map(|f| u64::from(f.stored)).sum();
        if !within_ratio(raw_len, stored_len, c.span) {
            return Err(Error::FrameTable(String::from("beyond the reader's ratio")));
        }
        for (i, f) in frames.iter().enumerate() {
            let at = table_at + 4 + i * FRAME_ENTRY;
            head[at..at + 4].copy_from_slice(&f.stored.to_le_bytes());
            head[at + 4..at + 8].copy_from_slice(&f.raw.to_le_bytes());
            head[at + 8..at + 16].copy_from_slice(&f.hash.to_le_bytes());
        }
        head[40..48].copy_from_slice(&stored_len.to_le_bytes());
        head[80..88].copy_from_slice(&sum.to_le_bytes());
        let hsum = header_checksum(&head[..V2_FIXED], &head[V2_FIXED..]);
        head[88..96].copy_from_slice(&hsum.to_le_bytes());
        file.write_all_at(&head, 0)?;
        let mut total = payload_off + stored_len;
        if let Some(k) = key {
            let tag = mac_of(&file, k, &head, text, payload_off, stored_len)?;
            file.write_all_at(&tag, total)?;
            total += MAC_BYTES;
        }
        commit(file, total, drop_cache, &tmp, path, &dir)?;
        Ok(Written {
            path: path.to_path_buf(),
            file_len: total,
            payload_checksum: sum,
            header_checksum: hsum,
        })
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

/// Streams the raw payload of `tensors` (zero padding between them) through
/// the framer; returns the frame table and the xxh3-64 of the stored bytes.
fn write_frames<W: Write>(
    w: &mut W,
    tensors: &[TensorSrc<'_>],
    c: Compression,
) -> Result<(Vec<Frame>, u64)> {
    let span = c.span as usize;
    let mut f = Framer {
        w,
        c,
        cctx: zstd::bulk::Compressor::new(i32::from(c.level))?,
        raw: Vec::with_capacity(span),
        shuffled: Vec::with_capacity(if c.shuffle { span } else { 0 }),
        out: Vec::with_capacity(zstd::zstd_safe::compress_bound(span)),
        frames: Vec::new(),
        stored: Xxh3::new(),
    };
    let mut pos = 0u64;
    for t in tensors {
        let aligned = align_up(pos).ok_or(Error::SizeOverflow)?;
        f.feed(zeros(aligned - pos))?;
        f.feed(t.data)?;
        pos = aligned + t.data.len() as u64;
    }
    f.emit()?;
    Ok((f.frames, f.stored.digest()))
}

/// The MAC of the file as written (FORMAT.md §1.9, over the stored bytes):
/// the header and metadata, the text, its padding, then the stored payload
/// read back from `file` one window at a time.
fn mac_of(
    file: &File,
    key: &MacKey,
    head: &[u8],
    text: &[u8],
    payload_off: u64,
    stored_len: u64,
) -> Result<[u8; 32]> {
    let mut m = MacState::new(key, &head[..V2_FIXED], &head[V2_FIXED..]);
    m.update(text);
    let text_end = head.len() as u64 + text.len() as u64;
    m.update(zeros(payload_off - text_end));
    let mut buf = vec![0u8; usize::try_from(stored_len.min(1 << 20)).unwrap_or(1 << 20)];
    let mut at = 0u64;
    while at < stored_len {
        let k = usize::try_from((stored_len - at).min(buf.len() as u64)).unwrap_or(0);
        file.read_exact_at(&mut buf[..k], payload_off + at)?;
        m.update(&buf[..k]);
        at += k as u64;
    }
    Ok(m.finalize())
}
