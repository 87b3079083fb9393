//! The one error type of the core crate.
//!
//! Every variant has a stable [`Error::code`] (the Python exception in
//! `ds4.errors` with the same `code` is raised for it; every `block_*` code
//! raises `BlockError`, which carries the code), the verification
//! [`Error::stage`] that produces it and a [`Class`] that tells recovery what
//! to do with the file.

use std::io;

/// What recovery does with a file that failed with this error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The bytes are damaged: invalidate, remove (or quarantine), go on.
    Corrupt,
    /// Intact but for another engine/model/layout/context: skip and keep.
    Incompatible,
    /// Intact but not for this prompt (or not a checkpoint name): skip and keep.
    Mismatch,
    /// An operating-system error (permissions, I/O): not the file's fault.
    Io,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Corrupt => "corrupt",
            Class::Incompatible => "incompatible",
            Class::Mismatch => "mismatch",
            Class::Io => "io",
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("not a regular file: {what}")]
    NotRegularFile { what: &'static str },
    #[error("file name {name:?} is not <40 hex digits>.kv")]
    BadName { name: String },
    #[error("file is {have} bytes, shorter than the {need}-byte fixed header")]
    TooShort { need: u64, have: u64 },
    #[error("bad magic {found:02x?}, expected \"KVC\"")]
    BadMagic { found: [u8; 3] },
    #[error("format version {found} is not supported (this build reads versions 1, 2 and 3)")]
    UnsupportedVersion { found: u8 },
    #[error("reserved header byte at offset {offset} is {value:#04x}, not zero")]
    ReservedNonZero { offset: u64, value: u8 },
    #[error("header checksum mismatch: stored {stored:016x}, computed {computed:016x}")]
    HeaderChecksum { stored: u64, computed: u64 },
    #[error("declared section sizes overflow 64-bit arithmetic")]
    SizeOverflow,
    #[error("{what} is {len} bytes, more than the {max} the format allows")]
    HeaderTooLarge {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("bad metadata: {0}")]
    BadMetadata(String),
    #[error("file is truncated: its header declares {expected} bytes, the file has {actual}")]
    Truncated { expected: u64, actual: u64 },
    #[error("file has {extra} trailing bytes after the {expected} its header declares")]
    TrailingBytes { expected: u64, extra: u64 },
    #[error("alignment padding at offset {offset} is not zero")]
    BadPadding { offset: u64 },
    #[error("payload ABI {found:?} differs from {expected}")]
    AbiMismatch { found: String, expected: String },
    #[error("quantization {found} bits differs from the session's {expected}")]
    QuantMismatch { found: u8, expected: u8 },
    #[error("checkpoint holds {tokens} tokens, more than the context of {ctx} can take")]
    CtxTooSmall { tokens: u64, ctx: u64 },
    #[error("SHA-1 of the stored text is {computed}, the header records {stored}")]
    TextHashMismatch { stored: String, computed: String },
    #[error("SHA-1 of the stored text is {computed}, the file is named {name}")]
    NameMismatch { name: String, computed: String },
    #[error("stored text ({len} bytes) is not a byte prefix of the prompt ({prompt_len} bytes)")]
    NotPrefix { len: u64, prompt_len: u64 },
    #[error("prompt prefix of {len} bytes hashes to the file name but its bytes differ at {at}")]
    PrefixCollision { len: u64, at: u64 },
    #[error("tensor table: {0}")]
    TensorTable(String),
    #[error("payload checksum mismatch: stored {stored:016x}, computed {computed:016x}")]
    PayloadChecksum { stored: u64, computed: u64 },
    #[error("the file was opened for writing by another process while its map was in use")]
    Changed,
    #[error("ds4 v1 header: {0} (ds4's own reader ignores this file)")]
    V1Ignored(String),
    #[error("ds4 v1 payload: {0}")]
    BadV1Payload(String),
    #[error("an authentication key is configured and the checkpoint carries no MAC")]
    MacMissing,
    #[error("the checkpoint's MAC does not match (forged, damaged, or written with another key)")]
    MacMismatch,
    #[error("payload codec {codec} with filter {filter} is not one this build reads (zstd = 1; filters none = 0, shuffle2 = 1)")]
    UnsupportedCodec { codec: u8, filter: u8 },
    #[error("frame table: {0}")]
    FrameTable(String),
    #[error("payload frame {index} is bad: {reason}")]
    BadFrame { index: usize, reason: String },
    #[error("block table: {0}")]
    BlockTable(String),
    #[error("block {block} is missing: {detail}")]
    BlockMissing { block: String, detail: String },
    #[error("block {block}: {detail}")]
    BlockCorrupt { block: String, detail: String },
    #[error("block {block} has the wrong length: {detail}")]
    BlockShort { block: String, detail: String },
    #[error("block {block} holds another block: {detail}")]
    BlockName { block: String, detail: String },
    #[error("block {block} was written for another payload ABI: {detail}")]
    BlockAbi { block: String, detail: String },
    #[error("block {block}: {detail}")]
    BlockChecksum { block: String, detail: String },
    #[error("an authentication key is configured and block {block} carries no MAC")]
    BlockMacMissing { block: String },
    #[error("block {block}'s MAC does not match (forged, damaged, or written with another key)")]
    BlockMac { block: String },
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl Error {
    /// The error of an `open` with `O_NOFOLLOW`: `ELOOP` means the path is
    /// a symlink (refused like any entry that is not a regular file).
    pub fn from_nofollow_open(e: io::Error) -> Error {
        if e.raw_os_error() == Some(libc::ELOOP) {
            Error::NotRegularFile { what: "symlink" }
        } else {
            Error::Io(e)
        }
    }

    /// Stable identifier; equals the `code` of the matching `ds4.errors` class.
    pub fn code(&self) -> &'static str {
        match self {
            Error::NotRegularFile { .. } => "not_regular_file",
            Error::BadName { .. } => "bad_name",
            Error::TooShort { .. } => "too_short",
            Error::BadMagic { .. } => "bad_magic",
            Error::UnsupportedVersion { .. } => "unsupported_version",
            Error::ReservedNonZero { .. } => "reserved_nonzero",
            Error::HeaderChecksum { .. } => "header_checksum",
            Error::SizeOverflow => "size_overflow",
            Error::HeaderTooLarge { .. } => "header_too_large",
            Error::BadMetadata(_) => "bad_metadata",
            Error::Truncated { .. } => "truncated",
            Error::TrailingBytes { .. } => "trailing_bytes",
            Error::BadPadding { .. } => "bad_padding",
            Error::AbiMismatch { .. } => "abi_mismatch",
            Error::QuantMismatch { .. } => "quant_mismatch",
            Error::CtxTooSmall { .. } => "ctx_too_small",
            Error::TextHashMismatch { .. } => "text_sha1_mismatch",
            Error::NameMismatch { .. } => "name_mismatch",
            Error::NotPrefix { .. } => "not_prefix",
            Error::PrefixCollision { .. } => "prefix_collision",
            Error::TensorTable(_) => "tensor_table",
            Error::PayloadChecksum { .. } => "payload_checksum",
            Error::BadV1Payload(_) => "bad_v1_payload",
            Error::Changed => "changed_while_loading",
            Error::V1Ignored(_) => "v1_ignored",
            Error::MacMissing => "mac_missing",
            Error::MacMismatch => "mac_mismatch",
            Error::UnsupportedCodec { .. } => "unsupported_codec",
            Error::FrameTable(_) => "frame_table",
            Error::BadFrame { .. } => "bad_frame",
            Error::BlockTable(_) => "block_table",
            Error::BlockMissing { .. } => "block_missing",
            Error::BlockCorrupt { .. } => "block_corrupt",
            Error::BlockShort { .. } => "block_short",
            Error::BlockName { .. } => "block_name",
            Error::BlockAbi { .. } => "block_abi",
            Error::BlockChecksum { .. } => "block_checksum",
            Error::BlockMacMissing { .. } => "block_mac_missing",
            Error::BlockMac { .. } => "block_mac",
            Error::Io(_) => "io",
        }
    }

    /// The verification stage that reports this error.
    pub fn stage(&self) -> &'static str {
        match self {
            Error::NotRegularFile { .. } | Error::BadName { .. } | Error::Io(_) => "open",
            Error::TooShort { .. }
            | Error::BadMagic { .. }
            | Error::UnsupportedVersion { .. }
            | Error::ReservedNonZero { .. }
            | Error::HeaderChecksum { .. }
            | Error::SizeOverflow
            | Error::HeaderTooLarge { .. }
            | Error::BadMetadata(_)
            | Error::Truncated { .. }
            | Error::TrailingBytes { .. }
            | Error::BadPadding { .. }
            | Error::AbiMismatch { .. }
            | Error::QuantMismatch { .. }
            | Error::CtxTooSmall { .. }
            | Error::V1Ignored(_)
            | Error::MacMissing
            | Error::UnsupportedCodec { .. }
            | Error::FrameTable(_) => "header",
            Error::TextHashMismatch { .. }
            | Error::NameMismatch { .. }
            | Error::NotPrefix { .. }
            | Error::PrefixCollision { .. } => "text",
            Error::TensorTable(_)
            | Error::PayloadChecksum { .. }
            | Error::BadV1Payload(_)
            | Error::Changed
            | Error::MacMismatch
            | Error::BadFrame { .. }
            | Error::BlockTable(_) => "payload",
            Error::BlockMissing { .. }
            | Error::BlockCorrupt { .. }
            | Error::BlockShort { .. }
            | Error::BlockName { .. }
            | Error::BlockAbi { .. }
            | Error::BlockChecksum { .. }
            | Error::BlockMacMissing { .. }
            | Error::BlockMac { .. } => "block",
        }
    }

    /// The block file a block error is about: its name in hex (empty for a
    /// block table); None for every other error.
    pub fn block(&self) -> Option<&str> {
        match self {
            Error::BlockMissing { block, .. }
            | Error::BlockCorrupt { block, .. }
            | Error::BlockShort { block, .. }
            | Error::BlockName { block, .. }
            | Error::BlockAbi { block, .. }
            | Error::BlockChecksum { block, .. }
            | Error::BlockMacMissing { block }
            | Error::BlockMac { block } => Some(block),
            Error::BlockTable(_) => Some(""),
            _ => None,
        }
    }

    pub fn class(&self) -> Class {
        match self {
            Error::UnsupportedVersion { .. }
            | Error::AbiMismatch { .. }
            | Error::QuantMismatch { .. }
            | Error::CtxTooSmall { .. }
            | Error::V1Ignored(_)
            | Error::MacMissing
            | Error::UnsupportedCodec { .. } => Class::Incompatible,
            Error::BadName { .. } | Error::NotPrefix { .. } | Error::Changed => Class::Mismatch,
            Error::Io(_) => Class::Io,
            _ => Class::Corrupt,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
