//! One entry per checkpoint file, from its header alone ([`read_entry`]),
//! its name's case, its text's tail, and the namespace preamble
//! ([`namespace_of`]).

use crate::error::{Error, Result};
use crate::hash::{self, Sha1Digest};
use crate::io;
use crate::name::{FileId, ModelTag};
use crate::verify;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

/// What identifies one version of a file: inode, size, mtime (ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatKey {
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
}

impl StatKey {
    pub fn of(md: &std::fs::Metadata) -> Self {
        StatKey {
            ino: md.ino(),
            size: md.size(),
            mtime_ns: md
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(md.mtime_nsec()),
        }
    }
}

/// One indexed checkpoint: its header facts, its text's tail and the stat
/// key of the version they were read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub digest: Sha1Digest,
    /// The tag of a per-model name (`<sha1>-<tag>.kv`); None for `<sha1>.kv`.
    pub model: Option<ModelTag>,
    pub version: u8,
    pub quant_bits: u8,
    pub reason: u8,
    pub tokens: u32,
    pub hits: u32,
    pub ctx: u32,
    pub text_bytes: u32,
    pub created: u64,
    pub last_used: u64,
    pub abi: Arc<str>,
    /// The cache namespace its text's preamble names (None: the default
    /// namespace, or a text whose start is not a well-formed preamble).
    pub namespace: Option<Arc<str>>,
    /// The last (up to) 8 bytes of the text, little-endian, zero-padded.
    pub tail: u64,
    pub key: StatKey,
    /// Which of the name's 40 hex digits are upper case (bit i: digit i);
    /// 0 for the usual lower-case name. ds4 reads names in either case.
    pub case: u64,
    /// The blocks the file names, in order, when a reader recorded them for
    /// this version of the file ([`Index::set_blocks`](super::Index::set_blocks));
    /// empty for a single file. A new entry (a header read) has none.
    pub blocks: Option<BlockList>,
}

/// A block's name (docs/FORMAT.md, "Names").
pub type BlockName = [u8; 32];
/// The blocks one file names, in order.
pub type BlockList = Arc<[BlockName]>;

/// The bits of [`Entry::case`] for a file name.
pub fn case_of(name: &str) -> u64 {
    name.bytes()
        .take(40)
        .enumerate()
        .filter(|(_, c)| c.is_ascii_uppercase())
        .fold(0, |m, (i, _)| m | (1 << i))
}

/// The file name of an id whose SHA-1 digits have the case `case`.
pub fn name_of(id: &FileId, case: u64) -> String {
    id.name(case)
}

impl Entry {
    /// What its name identifies (the index's key).
    pub fn id(&self) -> FileId {
        FileId {
            digest: self.digest,
            model: self.model,
        }
    }
    /// Its file name, as on disk.
    pub fn name(&self) -> String {
        self.id().name(self.case)
    }
}

/// The last (up to) 8 bytes of `text[..len]` as a little-endian `u64`
/// (zero-padded when `len < 8`); `len <= text.len()`.
pub fn tail_of(text: &[u8], len: usize) -> u64 {
    let mut b = [0u8; 8];
    let start = len.saturating_sub(8);
    if let (Some(src), Some(dst)) = (text.get(start..len), b.get_mut(..len - start)) {
        dst.copy_from_slice(src);
    }
    u64::from_le_bytes(b)
}

/// How many bytes of a text [`read_entry`] reads for its namespace: the
/// longest preamble, `FF 00 "ns:"`, a 128-byte id and `FF 00`.
pub const NS_READ: usize = 5 + NS_ID_MAX + 2;
/// The longest namespace id (`ds4.keytext.NAMESPACE_ID_RE`).
pub const NS_ID_MAX: usize = 128;
const NS_HEAD: &[u8] = b"\xff\x00ns:";
const NS_MARK: &[u8] = b"\xff\x00";

/// Whether `id` is a namespace id: 1 to 128 printable ASCII bytes without
/// spaces (`ds4.keytext.NAMESPACE_ID_RE`).
pub fn is_namespace_id(id: &[u8]) -> bool {
    (1..=NS_ID_MAX).contains(&id.len()) && id.iter().all(|c| (b'!'..=b'~').contains(c))
}

/// The namespace a key text's preamble names (`ds4.keytext.namespace_of`):
/// `FF 00 "ns:" <id> FF 00` at its start. None for the default namespace (no
/// preamble) and for a start that is not a whole, well-formed preamble (no
/// text ds4 writes is that: it is counted as the default namespace's).
pub fn namespace_of(text: &[u8]) -> Option<&str> {
    let rest = text.strip_prefix(NS_HEAD)?;
    let end = rest.windows(2).position(|w| w == NS_MARK)?;
    let id = rest.get(..end)?;
    if is_namespace_id(id) {
        std::str::from_utf8(id).ok()
    } else {
        None
    }
}

/// Indexes one file from its header: the name must be `<sha1>.kv` or
/// `<sha1>-<tag>.kv` ([`FileId`]), the file regular, the header valid (the
/// corrupt checks of a load's header stage); a v2 header's recorded SHA-1
/// must equal the name, and a per-model name's tag the ABI's. Reads the text's first
/// [`NS_READ`] bytes (its namespace) and last 8 bytes, never the whole text. The stat key is the opened file's.
pub fn read_entry(path: &Path) -> Result<Entry> {
    let id = crate::name::id_from_name(path)?;
    let digest = id.digest;
    let case = case_of(path.file_name().and_then(|n| n.to_str()).unwrap_or(""));
    let (file, file_len) = io::open_regular(path, false)?;
    let key = StatKey::of(&file.metadata()?);
    let h = verify::read_header(&file, file_len)?;
    crate::name::check_name_model(&id, &h)?;
    if let Some(stored) = h.text_sha1 {
        if stored != digest {
            return Err(Error::NameMismatch {
                name: hash::to_hex(&digest),
                computed: hash::to_hex(&stored),
            });
        }
    }
    let text_len = u64::from(h.text_bytes);
    let head_len = text_len.min(NS_READ as u64);
    let mut head = vec![0u8; io::checked_range(h.text_offset, head_len, file_len)?];
    io::read_exact_at(&file, &mut head, h.text_offset, file_len)?;
    let tail = if text_len <= head_len {
        tail_of(&head, head.len())
    } else {
        let at = h.text_offset + text_len - 8;
        let mut last = [0u8; 8];
        io::checked_range(at, 8, file_len)?;
        io::read_exact_at(&file, &mut last, at, file_len)?;
        u64::from_le_bytes(last)
    };
    Ok(Entry {
        digest,
        model: id.model,
        version: h.version,
        quant_bits: h.quant_bits,
        reason: h.reason,
        tokens: h.tokens,
        hits: h.hits,
        ctx: h.ctx,
        text_bytes: h.text_bytes,
        created: h.created,
        last_used: h.last_used,
        abi: Arc::from(h.abi.as_str()),
        namespace: namespace_of(&head).map(Arc::from),
        tail,
        key,
        case,
        blocks: None,
    })
}
