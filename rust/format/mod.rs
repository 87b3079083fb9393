//! The checkpoint file format: v2 (written and read) and ds4's v1 (read);
//! the KV block files and a manifest's block table ([`block`],
//! [`block_table`]).
//!
//! The byte layout is documented in docs/FORMAT.md; the constants here are
//! the source of truth for it. This module holds the types and constants
//! both versions share; the readers are [`v2`] and [`v1`] (on the byte
//! helpers of `bytes`), the writer is [`writer`]. Parsing never indexes
//! with offsets read from a file: every range is computed with checked
//! arithmetic and taken with `.get()`.
#![deny(clippy::indexing_slicing)]

pub mod block;
pub mod block_table;
pub(crate) mod bytes;
pub mod mac;
pub mod meta;
pub mod v1;
pub mod v2;
pub mod v3;
pub mod writer;
pub mod writer_v3;

use crate::error::{Error, Result};
use crate::hash::Sha1Digest;

pub const MAGIC: [u8; 3] = *b"KVC";
pub const VERSION_V1: u8 = 1;
pub const VERSION_V2: u8 = 2;
/// v2 plus a compressed payload in frames (FORMAT.md §1.10).
pub const VERSION_V3: u8 = 3;
/// Size of the fixed v2 header.
pub const V2_FIXED: usize = 96;
/// Payload and every tensor start on a multiple of this.
pub const ALIGN: u64 = 64;
pub const MAX_META: u64 = 1 << 20;
pub const MAX_ABI: usize = 4096;
pub const MAX_TENSORS: usize = 4096;
pub const MAX_NDIM: usize = 8;
pub const MAX_NAME: usize = 255;
/// Mutable fields, outside the header checksum: `hits` (u32) at 12 and
/// `last_used` (u64) at 32, in both versions.
pub const HITS_OFFSET: usize = 12;
pub const LAST_USED_OFFSET: usize = 32;

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
    "frontier",
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
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::U64,
            7 => Self::I64,
            8 => Self::F16,
            9 => Self::F32,
            10 => Self::F64,
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
        match self {
            Self::U8 | Self::I8 => 1,
            Self::U16 | Self::I16 | Self::F16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 => 8,
        }
    }
    /// The numpy dtype string (little-endian).
    pub fn numpy(self) -> &'static str {
        match self {
            Self::U8 => "|u1",
            Self::I8 => "|i1",
            Self::U16 => "<u2",
            Self::I16 => "<i2",
            Self::U32 => "<u4",
            Self::I32 => "<i4",
            Self::U64 => "<u8",
            Self::I64 => "<i8",
            Self::F16 => "<f2",
            Self::F32 => "<f4",
            Self::F64 => "<f8",
        }
    }
    pub fn from_numpy(s: &str) -> Option<Self> {
        Some(match s.trim_start_matches(['<', '|', '=']) {
            "u1" | "B" => Self::U8,
            "i1" | "b" => Self::I8,
            "u2" => Self::U16,
            "i2" => Self::I16,
            "u4" => Self::U32,
            "i4" => Self::I32,
            "u8" => Self::U64,
            "i8" => Self::I64,
            "f2" => Self::F16,
            "f4" => Self::F32,
            "f8" => Self::F64,
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
    /// Bytes after the payload: v1, ds4's optional tool-map trailer; v2,
    /// the MAC of an authenticated checkpoint (§1.9).
    pub trailer_bytes: u64,
    /// v2: header byte 52 says a MAC trailer follows the payload.
    pub authenticated: bool,
    /// Bytes the tensors take once decompressed: `payload_bytes` for v1
    /// and v2; for v3 the sum of the frames' raw lengths.
    pub raw_payload_bytes: u64,
    /// v3: the codec, filter, frame span and frame table.
    pub codec: Option<v3::Codec>,
}

pub fn align_up(x: u64) -> Option<u64> {
    x.checked_add(ALIGN - 1).map(|v| v & !(ALIGN - 1))
}

/// The last size check of both readers: the sections the header declares
/// end exactly at the end of the file (truncation and trailing bytes apart).
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
