//! The checkpoint file format: v2 (written and read) and ds4's v1 (read).
//!
//! The byte layout is documented in docs/FORMAT.md; the constants here are
//! the source of truth for it. Parsing never indexes with offsets read from
//! a file: every range is computed with checked arithmetic and taken with
//! `.get()`.
#![deny(clippy::indexing_slicing)]

pub mod v1;
pub mod writer;

use crate::error::{Error, Result};
use crate::hash::Sha1Digest;
use xxhash_rust::xxh3::Xxh3;

pub const MAGIC: [u8; 3] = *b"KVC";
pub const VERSION_V1: u8 = 1;
pub const VERSION_V2: u8 = 2;
/// Size of the fixed v2 header.
pub const V2_FIXED: usize = 96;
/// Payload and every tensor start on a multiple of this.
pub const ALIGN: u64 = 64;
pub const MAX_META: u64 = 1 << 20;
pub const MAX_ABI: usize = 4096;
pub const MAX_TENSORS: usize = 4096;
pub const MAX_NDIM: usize = 8;
pub const MAX_NAME: usize = 255;
/// Mutable fields, outside the header checksum: hits u32 at 12, last_used u64 at 32.
pub const HITS_OFFSET: u64 = 12;
pub const LAST_USED_OFFSET: u64 = 32;

/// Where a checkpoint came from (ds4's reasons 0-6, plus our own).
pub const REASONS: &[&str] = &[
    "unknown",
    "cold",
    "continued",
    "evict",
    "shutdown",
    "agent-system",
    "agent-session",
    "named",
];

pub fn reason_name(r: u8) -> &'static str {
    REASONS.get(r as usize).copied().unwrap_or("unknown")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Dtype {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    U64 = 6,
    I64 = 7,
    F16 = 8,
    F32 = 9,
    F64 = 10,
}

impl Dtype {
    pub fn from_code(c: u8) -> Option<Dtype> {
        use Dtype::*;
        Some(match c {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => U64,
            7 => I64,
            8 => F16,
            9 => F32,
            10 => F64,
            _ => return None,
        })
    }
    /// Bytes of a C-contiguous array of this dtype and `shape`; None on overflow.
    pub fn nbytes(self, shape: &[u64]) -> Option<u64> {
        shape
            .iter()
            .try_fold(self.itemsize(), |acc, &d| acc.checked_mul(d))
    }
    pub fn itemsize(self) -> u64 {
        use Dtype::*;
        match self {
            U8 | I8 => 1,
            U16 | I16 | F16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
        }
    }
    /// The numpy dtype string (little-endian).
    pub fn numpy(self) -> &'static str {
        use Dtype::*;
        match self {
            U8 => "|u1",
            I8 => "|i1",
            U16 => "<u2",
            I16 => "<i2",
            U32 => "<u4",
            I32 => "<i4",
            U64 => "<u8",
            I64 => "<i8",
            F16 => "<f2",
            F32 => "<f4",
            F64 => "<f8",
        }
    }
    pub fn from_numpy(s: &str) -> Option<Dtype> {
        use Dtype::*;
        Some(match s.trim_start_matches(['<', '|', '=']) {
            "u1" | "B" => U8,
            "i1" | "b" => I8,
            "u2" => U16,
            "i2" => I16,
            "u4" => U32,
            "i4" => I32,
            "u8" => U64,
            "i8" => I64,
            "f2" => F16,
            "f4" => F32,
            "f8" => F64,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Offset from the start of the payload (a multiple of [`ALIGN`]).
    pub offset: u64,
    pub nbytes: u64,
}

/// Everything the header of a checkpoint says (v1 or v2).
#[derive(Debug, Clone)]
pub struct Header {
    pub version: u8,
    pub quant_bits: u8,
    pub reason: u8,
    pub flags: u8,
    pub tokens: u32,
    pub hits: u32,
    pub ctx: u32,
    pub created: u64,
    pub last_used: u64,
    pub payload_bytes: u64,
    pub text_bytes: u32,
    /// v2: SHA-1 of the text recorded in the header. v1: none.
    pub text_sha1: Option<Sha1Digest>,
    pub payload_checksum: u64,
    pub header_checksum: u64,
    pub abi: String,
    pub tensors: Vec<TensorInfo>,
    pub text_offset: u64,
    pub payload_offset: u64,
    /// Total length the header declares (== the file length once verified).
    pub total_len: u64,
    /// v1 only: bytes after the payload (ds4's optional tool-map trailer).
    pub trailer_bytes: u64,
}

pub fn align_up(x: u64) -> Option<u64> {
    x.checked_add(ALIGN - 1).map(|v| v & !(ALIGN - 1))
}

pub(crate) fn le_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        a.copy_from_slice(s);
    }
    u16::from_le_bytes(a)
}
pub(crate) fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}
pub(crate) fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}
pub(crate) fn byte(b: &[u8], at: usize) -> u8 {
    b.get(at).copied().unwrap_or(0)
}

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
/// (hits, last_used) and the checksum itself read as zero, then the metadata.
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

/// Fields of the fixed 96-byte v2 header, before the metadata is read.
#[derive(Debug, Clone)]
pub struct V2Fixed {
    pub meta_bytes: u64,
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
    let meta = le_u32(fixed, 20) as u64;
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

/// Parses and checks a v2 header: `fixed` is the first 96 bytes, `meta` the
/// metadata that follows, `file_len` the real length of the file. Checks, in
/// order: header checksum, reserved bytes, section sizes against the file
/// length (truncation and trailing bytes apart), then decodes the metadata.
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
    for off in [7usize, 52, 53, 54, 55, 76, 77, 78, 79] {
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
        .checked_add(text_bytes as u64)
        .and_then(align_up)
        .ok_or(Error::SizeOverflow)?;
    let total = payload_offset
        .checked_add(payload_bytes)
        .ok_or(Error::SizeOverflow)?;
    check_total(total, file_len)?;
    let mut sha = [0u8; 20];
    if let Some(s) = fixed.get(56..76) {
        sha.copy_from_slice(s);
    }
    let (abi, tensors) = decode_meta(meta)?;
    Ok(Header {
        version: VERSION_V2,
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
        trailer_bytes: 0,
    })
}

pub(crate) fn check_total(total: u64, file_len: u64) -> Result<()> {
    if total > file_len {
        return Err(Error::Truncated {
            expected: total,
            actual: file_len,
        });
    }
    if total < file_len {
        return Err(Error::TrailingBytes {
            expected: total,
            extra: file_len - total,
        });
    }
    Ok(())
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).ok_or(Error::SizeOverflow)?;
        let s = self
            .b
            .get(self.at..end)
            .ok_or_else(|| Error::BadMetadata(format!("metadata ends inside {what}")))?;
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?.first().copied().unwrap_or(0))
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(le_u16(self.take(2, what)?, 0))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(le_u64(self.take(8, what)?, 0))
    }
}

/// Metadata: `u16 abi_len, abi, u16 n_tensors`, then per tensor
/// `u8 name_len, name, u8 dtype, u8 ndim, u64 shape[ndim], u64 offset, u64 nbytes`.
pub fn decode_meta(meta: &[u8]) -> Result<(String, Vec<TensorInfo>)> {
    let mut c = Cursor { b: meta, at: 0 };
    let abi_len = c.u16("abi length")? as usize;
    if abi_len > MAX_ABI {
        return Err(Error::HeaderTooLarge {
            what: "ABI string",
            len: abi_len as u64,
            max: MAX_ABI as u64,
        });
    }
    let abi = std::str::from_utf8(c.take(abi_len, "abi")?)
        .map_err(|_| Error::BadMetadata("ABI string is not UTF-8".into()))?
        .to_owned();
    let n = c.u16("tensor count")? as usize;
    if n > MAX_TENSORS {
        return Err(Error::HeaderTooLarge {
            what: "tensor table",
            len: n as u64,
            max: MAX_TENSORS as u64,
        });
    }
    let mut tensors = Vec::with_capacity(n);
    for i in 0..n {
        let name_len = c.u8("tensor name length")? as usize;
        let name = std::str::from_utf8(c.take(name_len, "tensor name")?)
            .map_err(|_| Error::BadMetadata(format!("tensor {i} name is not UTF-8")))?
            .to_owned();
        let code = c.u8("dtype")?;
        let dtype = Dtype::from_code(code).ok_or_else(|| {
            Error::BadMetadata(format!("tensor {name:?} has unknown dtype {code}"))
        })?;
        let ndim = c.u8("ndim")? as usize;
        if ndim > MAX_NDIM {
            return Err(Error::BadMetadata(format!(
                "tensor {name:?} has {ndim} dimensions (max {MAX_NDIM})"
            )));
        }
        let mut shape = Vec::with_capacity(ndim);
        for _ in 0..ndim {
            shape.push(c.u64("shape")?);
        }
        let offset = c.u64("offset")?;
        let nbytes = c.u64("nbytes")?;
        tensors.push(TensorInfo {
            name,
            dtype,
            shape,
            offset,
            nbytes,
        });
    }
    if c.at != meta.len() {
        return Err(Error::BadMetadata(format!(
            "{} unused metadata bytes",
            meta.len() - c.at
        )));
    }
    Ok((abi, tensors))
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

/// xxh3-64 of the payload bytes.
pub fn payload_checksum(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}
