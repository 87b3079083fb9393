//! KV block files (FORMAT.md §7): the 128-byte header, its checks, the
//! chained block names and the block MAC's key.
//!
//! A block holds the KV bytes of a fixed number of tokens. Its name is a
//! digest chained over every token before it (so a name says the whole
//! prefix, not only the block's own tokens), and its file `<hex>.kvb` is
//! shared by every checkpoint whose prefix has that block. A header is
//! parsed from untrusted bytes: fixed offsets only, read with the
//! non-panicking helpers of `bytes`.

use super::bytes::{byte, le_u32, le_u64};
use super::mac::MacKey;
use super::MAX_ABI;
use crate::error::{Error, Result};
use crate::hash::to_hex;
use crate::name::ModelTag;
use std::num::NonZeroU32;
use xxhash_rust::xxh3::xxh3_64;

pub const BLOCK_MAGIC: [u8; 3] = *b"KVB";
pub const BLOCK_VERSION: u8 = 1;
/// Size of the fixed header; the payload starts here.
pub const BLOCK_HEADER: usize = 128;
/// Header bytes the header checksum (and the MAC) covers.
pub const BLOCK_SUMMED: usize = 120;
/// Flags bit 0: a MAC trailer follows the payload.
pub const FLAG_MAC: u8 = 1;
/// Length of the MAC trailer.
pub const BLOCK_MAC_BYTES: usize = 32;
/// The most payload bytes one block may hold: checked before anything is
/// allocated for it.
pub const MAX_BLOCK_PAYLOAD: u64 = 1 << 30;
/// A block file is `<64 lowercase hex of its name>.kvb`.
pub const BLOCK_SUFFIX: &str = ".kvb";
/// BLAKE3 `derive_key` contexts: the chain's root, a block's name, and the
/// block MAC's key (derived from the checkpoints' MAC key).
pub const ROOT_CONTEXT: &str = "ds4 block root v1";
pub const NAME_CONTEXT: &str = "ds4 block name v1";
pub const BLOCK_KEY_CONTEXT: &str = "ds4 block authentication key v1";
/// Header ranges that must be zero (bytes 5..8, 44..48, 72..120).
const RESERVED: [(usize, usize); 3] = [(5, 8), (44, 48), (72, BLOCK_SUMMED)];

/// A block's name: 32 bytes of the chained digest.
pub type BlockName = [u8; 32];

/// What a block file's header says, once its own checks passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader {
    pub name: BlockName,
    pub n_tokens: u32,
    pub payload_len: u64,
    /// xxh3-64 of the payload, as the header records it.
    pub checksum: u64,
    /// The first 8 bytes of the SHA-1 of the payload ABI (`name::model_tag`).
    pub abi_tag: ModelTag,
    /// Flags bit 0: a MAC trailer follows the payload.
    pub authenticated: bool,
    pub header_checksum: u64,
}

impl BlockHeader {
    /// The file length this header declares.
    pub fn file_len(&self) -> u64 {
        file_len(self.payload_len, self.authenticated)
    }
}

/// Length of a block file of `payload_len` payload bytes (no overflow:
/// callers bound `payload_len` by [`MAX_BLOCK_PAYLOAD`] first).
pub fn file_len(payload_len: u64, authenticated: bool) -> u64 {
    let mac = if authenticated {
        BLOCK_MAC_BYTES as u64
    } else {
        0
    };
    (BLOCK_HEADER as u64)
        .saturating_add(payload_len)
        .saturating_add(mac)
}

/// The file name of a block: `<64 lowercase hex>.kvb`.
pub fn file_name(name: &BlockName) -> String {
    format!("{}{BLOCK_SUFFIX}", to_hex(name))
}

/// The name a block file name spells (`<64 lowercase hex>.kvb`), if any.
pub fn parse_file_name(file: &str) -> Option<BlockName> {
    let hex = file.strip_suffix(BLOCK_SUFFIX)?.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        *o = (digit(byte(pair, 0))? << 4) | digit(byte(pair, 1))?;
    }
    Some(out)
}

/// The MAC key of block files, derived from the checkpoints' 32-byte MAC
/// key (the `auth_key` the store passes).
pub fn block_mac_key(key: &MacKey) -> MacKey {
    blake3::derive_key(BLOCK_KEY_CONTEXT, key)
}

/// A block's MAC being computed: header bytes 0..120 fed, the payload next.
pub fn mac_state(key: &MacKey, head: &[u8; BLOCK_HEADER]) -> blake3::Hasher {
    let mut h = blake3::Hasher::new_keyed(&block_mac_key(key));
    h.update(head.get(..BLOCK_SUMMED).unwrap_or_default());
    h
}

/// The xxh3-64 header checksum: of bytes 0..120.
pub fn header_checksum(head: &[u8; BLOCK_HEADER]) -> u64 {
    xxh3_64(head.get(..BLOCK_SUMMED).unwrap_or_default())
}

/// Copies `src` to `at` in a header (constant offsets inside 128 bytes).
fn put(head: &mut [u8; BLOCK_HEADER], at: usize, src: &[u8]) {
    if let Some(d) = head.get_mut(at..at + src.len()) {
        d.copy_from_slice(src);
    }
}

/// The header of a block holding `payload_len` bytes of checksum `checksum`.
pub fn encode_header(
    name: &BlockName,
    n_tokens: u32,
    abi_tag: &ModelTag,
    payload_len: u64,
    checksum: u64,
    authenticated: bool,
) -> [u8; BLOCK_HEADER] {
    let mut h = [0u8; BLOCK_HEADER];
    put(&mut h, 0, &BLOCK_MAGIC);
    put(
        &mut h,
        3,
        &[BLOCK_VERSION, if authenticated { FLAG_MAC } else { 0 }],
    );
    put(&mut h, 8, name);
    put(&mut h, 40, &n_tokens.to_le_bytes());
    put(&mut h, 48, &payload_len.to_le_bytes());
    put(&mut h, 56, &checksum.to_le_bytes());
    put(&mut h, 64, abi_tag);
    let sum = header_checksum(&h);
    put(&mut h, BLOCK_SUMMED, &sum.to_le_bytes());
    h
}

fn corrupt(block: &str, detail: String) -> Error {
    Error::BlockCorrupt {
        block: block.to_owned(),
        detail,
    }
}

/// Parses and checks the header of a block file of `file_len` bytes whose
/// first bytes are `head` (at least 128 when the file has them). `block`
/// names the block in errors. Checks: length at least the header, magic,
/// version, flags, reserved bytes, header checksum, at least one token, the
/// payload bound, and the file length the header declares.
pub fn parse_header(head: &[u8], file_len: u64, block: &str) -> Result<BlockHeader> {
    let Some(head) = head
        .get(..BLOCK_HEADER)
        .and_then(|h| <&[u8; BLOCK_HEADER]>::try_from(h).ok())
        .filter(|_| file_len >= BLOCK_HEADER as u64)
    else {
        return Err(Error::BlockShort {
            block: block.to_owned(),
            detail: format!(
                "the file is {file_len} bytes, shorter than the {BLOCK_HEADER}-byte header"
            ),
        });
    };
    if head.get(..3) != Some(&BLOCK_MAGIC[..]) {
        return Err(corrupt(block, "bad magic, not \"KVB\"".to_owned()));
    }
    let version = byte(head, 3);
    if version != BLOCK_VERSION {
        return Err(corrupt(
            block,
            format!("version {version} (this build reads version 1)"),
        ));
    }
    let flags = byte(head, 4);
    if flags & !FLAG_MAC != 0 {
        return Err(corrupt(block, format!("unknown flags {flags:#04x}")));
    }
    for (a, b) in RESERVED {
        if let Some(i) = (a..b).find(|&i| byte(head, i) != 0) {
            return Err(corrupt(block, format!("reserved byte {i} is not zero")));
        }
    }
    let stored = le_u64(head, BLOCK_SUMMED);
    let computed = header_checksum(head);
    if stored != computed {
        return Err(corrupt(
            block,
            format!("header checksum mismatch: stored {stored:016x}, computed {computed:016x}"),
        ));
    }
    let mut name = [0u8; 32];
    name.copy_from_slice(head.get(8..40).unwrap_or(&[0; 32]));
    let mut abi_tag = [0u8; 8];
    abi_tag.copy_from_slice(head.get(64..72).unwrap_or(&[0; 8]));
    let h = BlockHeader {
        name,
        n_tokens: le_u32(head, 40),
        payload_len: le_u64(head, 48),
        checksum: le_u64(head, 56),
        abi_tag,
        authenticated: flags & FLAG_MAC != 0,
        header_checksum: stored,
    };
    if h.n_tokens == 0 {
        return Err(corrupt(block, "the header holds no tokens".to_owned()));
    }
    if h.payload_len > MAX_BLOCK_PAYLOAD {
        return Err(corrupt(
            block,
            format!(
                "a payload of {} bytes, more than the {MAX_BLOCK_PAYLOAD} a block may hold",
                h.payload_len
            ),
        ));
    }
    if h.file_len() != file_len {
        return Err(Error::BlockShort {
            block: block.to_owned(),
            detail: format!(
                "the file is {file_len} bytes, its header declares {}",
                h.file_len()
            ),
        });
    }
    Ok(h)
}

/// `u32 len(abi) ‖ abi`, the ABI's part of a root or a name.
fn abi_field(abi: &str) -> Result<[u8; 4]> {
    u32::try_from(abi.len())
        .ok()
        .filter(|&n| n as usize <= MAX_ABI)
        .map(u32::to_le_bytes)
        .ok_or(Error::HeaderTooLarge {
            what: "ABI string",
            len: abi.len() as u64,
            max: MAX_ABI as u64,
        })
}

/// The root of a chain: BLAKE3 (`derive_key` mode, [`ROOT_CONTEXT`]) of
/// `u32 len(abi) ‖ abi ‖ namespace` (the key text's namespace preamble,
/// empty for the default namespace: it keeps tenants' blocks apart).
pub fn root(abi: &str, namespace: &[u8]) -> Result<BlockName> {
    let mut h = blake3::Hasher::new_derive_key(ROOT_CONTEXT);
    h.update(&abi_field(abi)?);
    h.update(abi.as_bytes());
    h.update(namespace);
    Ok(*h.finalize().as_bytes())
}

/// A block's name: BLAKE3 (`derive_key` mode, [`NAME_CONTEXT`]) of
/// `parent ‖ u32 count ‖ tokens (u32 each) ‖ u32 len(abi) ‖ abi`.
pub fn name(parent: &BlockName, tokens: &[u32], abi: &str) -> Result<BlockName> {
    let count = u32::try_from(tokens.len()).map_err(|_| Error::SizeOverflow)?;
    let mut bytes = Vec::with_capacity(4 * tokens.len());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let mut h = blake3::Hasher::new_derive_key(NAME_CONTEXT);
    h.update(parent);
    h.update(&count.to_le_bytes());
    h.update(&bytes);
    h.update(&abi_field(abi)?);
    h.update(abi.as_bytes());
    Ok(*h.finalize().as_bytes())
}

/// The chained names of the `tokens.len() / block_tokens` full blocks of
/// `tokens`: block i's parent is block i-1's name, block 0's is `root`.
pub fn names(
    root: &BlockName,
    tokens: &[u32],
    block_tokens: NonZeroU32,
    abi: &str,
) -> Result<Vec<BlockName>> {
    let size = usize::try_from(block_tokens.get()).map_err(|_| Error::SizeOverflow)?;
    let mut out: Vec<BlockName> = Vec::with_capacity(tokens.len() / size);
    let mut parent = *root;
    for chunk in tokens.chunks_exact(size) {
        parent = name(&parent, chunk, abi)?;
        out.push(parent);
    }
    Ok(out)
}
