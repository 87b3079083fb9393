//! The v2 reader (docs/FORMAT.md): the first check of any file ([`sniff`]),
//! the fixed header and its checksum, the metadata (ABI string and tensor
//! table) and the payload-stage checks of the tensor table and checksum.
#![deny(clippy::indexing_slicing)]

use super::bytes::{byte, le_u32, le_u64};
use super::mac::{AUTH_BLAKE3, AUTH_OFFSET, MAC_BYTES};
pub use super::meta::decode_meta;
use super::{
    align_up, check_total, Dtype, Header, TensorInfo, MAGIC, MAX_META, MAX_NAME, V2_FIXED,
    VERSION_V2, VERSION_V3,
};
use crate::error::{Error, Result};
use xxhash_rust::xxh3::Xxh3;

/// The first check of any file: length and magic; returns the version byte.
pub fn sniff(head: &[u8], file_len: u64) -> Result<u8> {
    if file_len < 4 || head.len() < 4 {
        return Err(Error::TooShort {
            need: 4,
            have: file_len,
        });
    }
    let found = [byte(head, 0), byte(head, 1), byte(head, 2)];
    if found != MAGIC {
        return Err(Error::BadMagic { found });
    }
    Ok(byte(head, 3))
}

/// Header checksum: xxh3-64 over the fixed header with the mutable fields
/// (`hits`, `last_used`) and the checksum itself read as zero, then the metadata.
pub fn header_checksum(fixed: &[u8], meta: &[u8]) -> u64 {
    let mut f = [0u8; V2_FIXED];
    let n = fixed.len().min(V2_FIXED);
    if let (Some(dst), Some(src)) = (f.get_mut(..n), fixed.get(..n)) {
        dst.copy_from_slice(src);
    }
    for r in [12..16usize, 32..40, 88..96] {
        if let Some(s) = f.get_mut(r) {
            s.fill(0);
        }
    }
    let mut h = Xxh3::new();
    h.update(&f);
    h.update(meta);
    h.digest()
}

/// Stage 1 of a v2 header: length, magic, version, the metadata size bound
/// and that the metadata lies inside the file. Returns the metadata length.
pub fn v2_meta_len(fixed: &[u8], file_len: u64) -> Result<u64> {
    if file_len < V2_FIXED as u64 || fixed.len() < V2_FIXED {
        return Err(Error::TooShort {
            need: V2_FIXED as u64,
            have: file_len,
        });
    }
    let meta = u64::from(le_u32(fixed, 20));
    if meta > MAX_META {
        return Err(Error::HeaderTooLarge {
            what: "metadata",
            len: meta,
            max: MAX_META,
        });
    }
    let need = V2_FIXED as u64 + meta;
    if need > file_len {
        return Err(Error::Truncated {
            expected: need,
            actual: file_len,
        });
    }
    Ok(meta)
}

/// Parses and checks a v2 or v3 header (the version byte says which):
/// `fixed` is the first 96 bytes, `meta` the
/// metadata that follows, `file_len` the real length of the file. Checks, in
/// order: header checksum, reserved bytes (v3: the codec bytes instead,
/// FORMAT.md §1.10), section sizes against the file
/// length (truncation and trailing bytes apart), then decodes the metadata
/// (v3: and checks the frame table).
pub fn parse_v2(fixed: &[u8], meta: &[u8], file_len: u64) -> Result<Header> {
    let meta_len = v2_meta_len(fixed, file_len)?;
    if meta.len() as u64 != meta_len {
        return Err(Error::Truncated {
            expected: V2_FIXED as u64 + meta_len,
            actual: file_len,
        });
    }
    let stored = le_u64(fixed, 88);
    let computed = header_checksum(fixed, meta);
    if stored != computed {
        return Err(Error::HeaderChecksum { stored, computed });
    }
    let auth = byte(fixed, AUTH_OFFSET);
    if auth > AUTH_BLAKE3 {
        return Err(Error::ReservedNonZero {
            offset: AUTH_OFFSET as u64,
            value: auth,
        });
    }
    let trailer = if auth == AUTH_BLAKE3 { MAC_BYTES } else { 0 };
    let v3 = byte(fixed, 3) == VERSION_V3;
    let reserved: &[usize] = if v3 {
        &[7]
    } else {
        &[7, 53, 54, 55, 76, 77, 78, 79]
    };
    for &off in reserved {
        let v = byte(fixed, off);
        if v != 0 {
            return Err(Error::ReservedNonZero {
                offset: off as u64,
                value: v,
            });
        }
    }
    let text_bytes = le_u32(fixed, 48);
    let payload_bytes = le_u64(fixed, 40);
    let text_offset = V2_FIXED as u64 + meta_len;
    let payload_offset = text_offset
        .checked_add(u64::from(text_bytes))
        .and_then(align_up)
        .ok_or(Error::SizeOverflow)?;
    let total = payload_offset
        .checked_add(payload_bytes)
        .and_then(|t| t.checked_add(trailer))
        .ok_or(Error::SizeOverflow)?;
    check_total(total, file_len)?;
    let mut sha = [0u8; 20];
    if let Some(s) = fixed.get(56..76) {
        sha.copy_from_slice(s);
    }
    let (abi, tensors, codec) = if v3 {
        let (abi, tensors, codec) = super::v3::decode_meta_v3(fixed, meta)?;
        (abi, tensors, Some(codec))
    } else {
        let (abi, tensors) = decode_meta(meta)?;
        (abi, tensors, None)
    };
    let raw_payload_bytes = match &codec {
        Some(c) => c.check_frames(payload_bytes)?,
        None => payload_bytes,
    };
    Ok(Header {
        version: if v3 { VERSION_V3 } else { VERSION_V2 },
        quant_bits: byte(fixed, 4),
        reason: byte(fixed, 5),
        flags: byte(fixed, 6),
        tokens: le_u32(fixed, 8),
        hits: le_u32(fixed, 12),
        ctx: le_u32(fixed, 16),
        created: le_u64(fixed, 24),
        last_used: le_u64(fixed, 32),
        payload_bytes,
        text_bytes,
        text_sha1: Some(sha),
        payload_checksum: le_u64(fixed, 80),
        header_checksum: stored,
        abi,
        tensors,
        text_offset,
        payload_offset,
        total_len: total,
        trailer_bytes: trailer,
        authenticated: trailer != 0,
        raw_payload_bytes,
        codec,
    })
}

/// Payload-stage check of the tensor table: names non-empty and unique,
/// sizes exact (`nbytes == prod(shape) * itemsize`, checked), each tensor at
/// the next 64-byte boundary after the previous one, the last ending exactly
/// at `payload_bytes`.
pub fn check_tensor_table(tensors: &[TensorInfo], payload_bytes: u64) -> Result<()> {
    let mut expect_off = 0u64;
    let mut end = 0u64;
    let mut names = std::collections::HashSet::with_capacity(tensors.len());
    for t in tensors {
        if t.name.is_empty() || t.name.len() > MAX_NAME {
            return Err(Error::TensorTable(format!(
                "tensor name {:?} is empty or too long",
                t.name
            )));
        }
        if !names.insert(t.name.as_str()) {
            return Err(Error::TensorTable(format!(
                "duplicate tensor name {:?}",
                t.name
            )));
        }
        let want = t.dtype.nbytes(&t.shape).ok_or_else(|| {
            Error::TensorTable(format!("tensor {:?}: shape size overflows", t.name))
        })?;
        if !numpy_can_hold(t.dtype, &t.shape) {
            return Err(Error::TensorTable(format!(
                "tensor {:?}: shape {:?} of {:?} is beyond what an array can describe \
                 (the bytes of its non-zero dimensions exceed 2^63 - 1)",
                t.name, t.shape, t.dtype
            )));
        }
        if want != t.nbytes {
            return Err(Error::TensorTable(format!(
                "tensor {:?}: {} bytes for shape {:?} of {:?}, expected {want}",
                t.name, t.nbytes, t.shape, t.dtype
            )));
        }
        if t.offset != expect_off {
            return Err(Error::TensorTable(format!(
                "tensor {:?} at offset {}, expected {expect_off} (64-byte aligned, in order, no gaps)",
                t.name, t.offset
            )));
        }
        end = t.offset.checked_add(t.nbytes).ok_or_else(|| {
            Error::TensorTable(format!("tensor {:?}: offset + size overflows", t.name))
        })?;
        if end > payload_bytes {
            return Err(Error::TensorTable(format!(
                "tensor {:?} ends at {end}, past the {payload_bytes}-byte payload",
                t.name
            )));
        }
        expect_off = align_up(end).ok_or(Error::SizeOverflow)?;
    }
    if end != payload_bytes {
        return Err(Error::TensorTable(format!(
            "tensors end at {end} but the payload is {payload_bytes} bytes"
        )));
    }
    Ok(())
}

/// True when numpy (and any C array of `isize` extents) can describe an
/// array of `dtype` and `shape`: numpy skips zero dimensions and refuses
/// when the product of the others, times the item size, exceeds
/// `isize::MAX`. A zero-byte tensor can otherwise claim any shape (such as
/// `[0, 2^63]`), pass every byte-count check, and fail only when a view is
/// made, after verification said yes.
pub fn numpy_can_hold(dtype: Dtype, shape: &[u64]) -> bool {
    const MAX: u64 = u64::MAX >> 1; // isize::MAX on a 64-bit target
    shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(dtype.itemsize(), |acc, &d| {
            acc.checked_mul(d).filter(|&v| v <= MAX)
        })
        .is_some()
}

/// xxh3-64 of the payload bytes.
pub fn payload_checksum(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}
