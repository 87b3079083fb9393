//! ds4's own v1 files (`ds4_kvstore.c`): a 48-byte header, `u32` text length,
//! the text, the engine payload (DSV4), and an optional trailer.
//! They are listed, verified and inspected; their payload is described, not
//! executed.
#![deny(clippy::indexing_slicing)]

use super::bytes::{byte, le_u32, le_u64, Cursor};
use super::{check_total, Header, VERSION_V1};
use crate::error::{Error, Result};

pub const V1_FIXED: usize = 52;
pub const DSV4_MAGIC: u32 = 0x3456_5344;
pub const DSV4_FIELDS: [&str; 13] = [
    "magic",
    "version",
    "ctx",
    "prefill_cap",
    "raw_cap",
    "raw_window",
    "comp_cap",
    "tokens",
    "layers",
    "head_dim",
    "indexer_dim",
    "vocab",
    "raw_live",
];
/// ext flag bit 0: the file carries a tool-map (KTM) trailer.
pub const EXT_TOOL_MAP: u8 = 1;

/// Parses a v1 header from the first 52 bytes, with the accept rules of
/// ds4's own reader (`ds4_kvstore_read_header`, `read_entry_file`): quant
/// bits 2 or 4 and at least one token, else ds4 ignores the file
/// (`V1Ignored`: incompatible, kept); the file at least as long as header,
/// text and payload, and any bytes after them are trailer room (ds4 writes
/// its tool-map trailer there when ext bit 0 is set, and allows them
/// whatever the bit): they are reported as `trailer_bytes`.
pub fn parse_v1(head: &[u8], file_len: u64) -> Result<Header> {
    if file_len < V1_FIXED as u64 || head.len() < V1_FIXED {
        return Err(Error::TooShort {
            need: V1_FIXED as u64,
            have: file_len,
        });
    }
    let flags = byte(head, 6);
    let quant_bits = byte(head, 4);
    let tokens = le_u32(head, 8);
    let text_bytes = le_u32(head, 48);
    let payload_bytes = le_u64(head, 40);
    let text_offset = V1_FIXED as u64;
    let payload_offset = text_offset
        .checked_add(u64::from(text_bytes))
        .ok_or(Error::SizeOverflow)?;
    let end = payload_offset
        .checked_add(payload_bytes)
        .ok_or(Error::SizeOverflow)?;
    if end > file_len {
        check_total(end, file_len)?;
    }
    let trailer = file_len - end;
    if quant_bits != 2 && quant_bits != 4 {
        return Err(Error::V1Ignored(format!(
            "quantization {quant_bits} bits is neither 2 nor 4"
        )));
    }
    if tokens == 0 {
        return Err(Error::V1Ignored("the header holds no tokens".to_owned()));
    }
    Ok(Header {
        version: VERSION_V1,
        quant_bits,
        reason: byte(head, 5),
        flags,
        tokens,
        hits: le_u32(head, 12),
        ctx: le_u32(head, 16),
        created: le_u64(head, 24),
        last_used: le_u64(head, 32),
        payload_bytes,
        text_bytes,
        text_sha1: None,
        payload_checksum: 0,
        header_checksum: 0,
        abi: String::new(),
        tensors: Vec::new(),
        text_offset,
        payload_offset,
        total_len: file_len,
        trailer_bytes: trailer,
        authenticated: false,
        raw_payload_bytes: payload_bytes,
        codec: None,
    })
}

/// Decodes the 13 u32 fields at the start of a DSV4 payload and checks the
/// magic, version and that the token count matches the file header.
pub fn decode_dsv4(payload_head: &[u8], header_tokens: u32) -> Result<[u32; 13]> {
    let mut c = Cursor::new(payload_head, |_: &str| {
        Error::BadV1Payload(format!(
            "payload is {} bytes, shorter than the 52-byte DSV4 header",
            payload_head.len()
        ))
    });
    let mut f = [0u32; 13];
    for (v, name) in f.iter_mut().zip(DSV4_FIELDS) {
        *v = c.u32(name)?;
    }
    if f[0] != DSV4_MAGIC {
        return Err(Error::BadV1Payload(format!(
            "magic {:#010x} is not DSV4",
            f[0]
        )));
    }
    if f[1] != 1 {
        return Err(Error::BadV1Payload(format!(
            "DSV4 version {} is not 1",
            f[1]
        )));
    }
    if f[7] != header_tokens {
        return Err(Error::BadV1Payload(format!(
            "DSV4 token count {} differs from the header's {header_tokens}",
            f[7]
        )));
    }
    Ok(f)
}
