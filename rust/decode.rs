//! Payload stage, v3 (docs/FORMAT.md §1.10): the stored frames decoded in
//! bounded memory, straight from the file into the raw payload's buffer.
//!
//! Nothing of the stored payload is copied whole: one frame's stored bytes
//! at a time are read into one reusable buffer (at most zstd's bound for a
//! span), so what a load holds beyond the raw payload is one frame. The raw
//! payload's buffer is sized from the header (whose declared size the
//! caller has checked against what a state of that many tokens occupies:
//! [`crate::verify::VerifyOptions::max_raw`]) and is committed only as
//! frames are written into it ([`AlignedBuf`]).
//!
//! Without a key, one pass: each frame read, fed to the payload checksum,
//! decompressed into its slice and checked against its xxh3-64. A frame
//! that fails stops the decoding; the checksum is then finished over the
//! rest of the stored bytes (read, not decoded), so damaged stored bytes
//! are reported as the checksum mismatch they are.
//!
//! With a key, nothing is decompressed before the MAC matches: a first pass
//! streams the stored bytes, frame by frame, through the checksum and the
//! MAC, keeping a BLAKE3 digest of each frame's stored bytes; then the
//! MAC is compared; then a second pass reads each frame again, checks it
//! against its digest from the first pass (a file changed between the two
//! passes is [`Error::Changed`]) and decodes it.
#![deny(clippy::indexing_slicing)]

use crate::error::{Error, Result};
use crate::format::mac::MacState;
use crate::format::v3::{Codec, Frame, FrameDecoder};
use crate::io::{checked_range, read_exact_at};
use crate::payload::AlignedBuf;
use std::fs::File;
use xxhash_rust::xxh3::Xxh3;

/// The most raw payload bytes a v3 file of `tokens` tokens may declare:
/// `min(most, fixed + per_token * tokens)`. The caller's engine says what
/// a state of that many tokens occupies (`fixed`, `per_token`: an upper
/// bound, its layout's), the store what it may hold at all (`most`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawBound {
    pub fixed: u64,
    pub per_token: u64,
    pub most: u64,
}

impl RawBound {
    pub fn limit(&self, tokens: u32) -> u64 {
        self.fixed
            .saturating_add(self.per_token.saturating_mul(u64::from(tokens)))
            .min(self.most)
    }

    /// Refuses (`frame_table`, corrupt: the frame table's raw lengths are a
    /// lie for this ABI, whose states are never that large) a file of
    /// `tokens` tokens declaring `raw` raw bytes over [`RawBound::limit`].
    /// Checked before anything of the payload is read or allocated.
    pub fn check(&self, raw: u64, tokens: u32) -> Result<()> {
        let limit = self.limit(tokens);
        if raw > limit {
            return Err(Error::FrameTable(format!(
                "the frames claim {raw} raw bytes; a state of {tokens} tokens takes at most \
                 {limit} here (what the engine's layout and the store allow)"
            )));
        }
        Ok(())
    }
}

/// The stored payload inside its file.
#[derive(Debug, Clone, Copy)]
pub struct Stored<'a> {
    pub file: &'a File,
    /// Where the payload starts.
    pub offset: u64,
    /// The stored (compressed) bytes the header declares.
    pub len: u64,
    /// The file's real length (`fstat`).
    pub file_len: u64,
}

/// The MAC being computed (header, metadata, text and padding already fed)
/// and the 32-byte tag the file stores after its payload.
pub struct MacCheck<'a> {
    pub state: MacState,
    pub tag: &'a [u8],
}

/// Reads the frames of `src` one at a time into one buffer.
struct Frames<'a> {
    src: Stored<'a>,
    buf: Vec<u8>,
}

impl<'a> Frames<'a> {
    fn new(src: Stored<'a>, c: &Codec) -> Result<Self> {
        checked_range(src.offset, src.len, src.file_len)?;
        let most = c.frames.iter().map(|f| f.stored).max().unwrap_or(0);
        Ok(Frames {
            src,
            buf: vec![0u8; most as usize],
        })
    }

    /// Each frame with its index, entry and stored bytes, in file order,
    /// to `each`; stops at the first error `each` returns.
    fn for_each(
        &mut self,
        c: &Codec,
        mut each: impl FnMut(usize, &Frame, &[u8]) -> Result<()>,
        from: usize,
    ) -> Result<()> {
        let mut at = self.src.offset;
        for (i, f) in c.frames.iter().enumerate() {
            if i >= from {
                let bytes = self
                    .buf
                    .get_mut(..f.stored as usize)
                    .ok_or(Error::SizeOverflow)?;
                read_exact_at(self.src.file, bytes, at, self.src.file_len)?;
                each(i, f, bytes)?;
            }
            at += u64::from(f.stored);
        }
        Ok(())
    }
}

/// Decodes the v3 payload of `src` (frame table `c`, `raw_len` raw bytes)
/// into a new buffer: checks the stored bytes' xxh3-64 against `checksum`
/// (when given) and, with `mac`, the MAC before anything is decompressed
/// (module docs).
pub fn load(
    src: Stored<'_>,
    c: &Codec,
    raw_len: u64,
    checksum: Option<u64>,
    mac: Option<MacCheck<'_>>,
) -> Result<AlignedBuf> {
    let mut frames = Frames::new(src, c)?;
    let digests = match mac {
        Some(m) => Some(authenticate(&mut frames, c, checksum, m)?),
        None => None,
    };
    let mut out = AlignedBuf::lazy(usize::try_from(raw_len).map_err(|_| Error::SizeOverflow)?)?;
    let mut dec = FrameDecoder::new(c)?;
    // Keyed: the checksum was taken in the first pass.
    let mut sum = checksum
        .filter(|_| digests.is_none())
        .map(|s| (s, Xxh3::new()));
    let mut failed: Option<(usize, Error)> = None;
    let mut r = 0usize;
    let dst_all = out.as_mut_slice();
    let decoded = frames.for_each(
        c,
        |i, f, bytes| {
            if let Some(d) = &digests {
                if d.get(i) != Some(blake3::hash(bytes).as_bytes()) {
                    return Err(Error::Changed);
                }
            }
            if let Some((_, h)) = sum.as_mut() {
                h.update(bytes);
            }
            let nr = r + f.raw as usize;
            let dst = dst_all.get_mut(r..nr).ok_or(Error::SizeOverflow)?;
            if let Err(e) = dec.frame(i, f, bytes, dst) {
                failed = Some((i + 1, e));
                return Err(Error::SizeOverflow); // stops the pass; `failed` says why
            }
            r = nr;
            Ok(())
        },
        0,
    );
    if let Some((next, e)) = failed {
        // Damaged stored bytes are a checksum mismatch: finish it.
        if let Some((stored, mut h)) = sum.take() {
            frames.for_each(
                c,
                |_, _, bytes| {
                    h.update(bytes);
                    Ok(())
                },
                next,
            )?;
            let computed = h.digest();
            if computed != stored {
                return Err(Error::PayloadChecksum { stored, computed });
            }
        }
        return Err(e);
    }
    decoded?;
    if let Some((stored, h)) = sum {
        let computed = h.digest();
        if computed != stored {
            return Err(Error::PayloadChecksum { stored, computed });
        }
    }
    Ok(out)
}

/// The keyed first pass: the stored bytes through the checksum (when
/// asked) and the MAC, frame by frame; the MAC compared. Returns the
/// BLAKE3 digest of each frame's stored bytes.
fn authenticate(
    frames: &mut Frames<'_>,
    c: &Codec,
    checksum: Option<u64>,
    mut mac: MacCheck<'_>,
) -> Result<Vec<[u8; 32]>> {
    let mut h = Xxh3::new();
    let mut digests = Vec::with_capacity(c.frames.len());
    frames.for_each(
        c,
        |_, _, bytes| {
            if checksum.is_some() {
                h.update(bytes);
            }
            mac.state.update(bytes);
            digests.push(*blake3::hash(bytes).as_bytes());
            Ok(())
        },
        0,
    )?;
    if let Some(stored) = checksum {
        let computed = h.digest();
        if computed != stored {
            return Err(Error::PayloadChecksum { stored, computed });
        }
    }
    if !mac.state.matches(mac.tag) {
        return Err(Error::MacMismatch);
    }
    Ok(digests)
}
