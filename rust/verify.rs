//! Opening a checkpoint: the verification pipeline (docs/DESIGN.md, "Verification pipeline") and the
//! zero-copy payload it hands out.
//!
//! Stages, in order, stopping at the first failure:
//! 1. open    -- name is `<sha1>.kv` (when asked), a regular file, not a symlink
//! 2. header  -- length, magic, version, header checksum, sizes vs file length
//!    (corrupt); then ABI, quantization, context (incompatible)
//! 3. text    -- SHA-1(text) == header and file name (corrupt); text is a byte
//!    prefix of the prompt (mismatch, or corrupt on a collision)
//! 4. payload -- tensor table in bounds and exact, payload checksum (corrupt)
//!
//! Every size is checked against the real file length (from `fstat`) before
//! anything is allocated or mapped: only the fixed header is read before
//! that, and the metadata (bounded by [`MAX_META`](crate::format::MAX_META))
//! once it is known to lie inside the file. The file is opened and read
//! through [`crate::io`]; the payload's storage is [`crate::payload`]'s.

use crate::decode::{self, MacCheck, RawBound, Stored};
use crate::error::{Error, Result};
use crate::format::mac::{MacKey, MacState, MAC_BYTES};
use crate::format::{v1, v2, Header, V2_FIXED, VERSION_V1, VERSION_V2, VERSION_V3};
use crate::hash::{self, Sha1Digest};
use crate::io::{open_regular, pread_vec, Lease};
use crate::name::{check_name_model, id_from_name};
use crate::payload::{self, Damage, Storage};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What [`open`] checks beyond the file itself, and how it loads the payload.
#[derive(Debug, Clone)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent switches, one per keyword argument of ds4._core.open_checkpoint"
)]
pub struct VerifyOptions<'a> {
    /// Reject (incompatible) when the payload ABI differs.
    pub expected_abi: Option<&'a str>,
    /// Reject (incompatible) when the quantization differs.
    pub quant_bits: Option<u8>,
    /// Reject (incompatible) when the checkpoint holds more tokens than this.
    pub ctx: Option<u64>,
    /// Require the name `<sha1 of text>.kv`, or `<sha1 of text>-<tag>.kv`
    /// with the tag of the file's ABI (`crate::name`).
    pub check_name: bool,
    /// Require the stored text to be a byte prefix of this prompt.
    pub prompt: Option<&'a [u8]>,
    /// Run the payload stage (tensor table, checksum) and map the payload.
    pub load_payload: bool,
    /// Verify the payload checksum (on by default; costs one pass).
    pub verify_checksum: bool,
    /// Memory-map the payload (copy-on-write, read-only); else pread it.
    pub mmap: bool,
    /// Require a valid keyed MAC (FORMAT.md §1.9): a file without one is
    /// incompatible (`mac_missing`, header stage); a full open computes it
    /// in the checksum's pass over the payload (`mac_mismatch`, corrupt).
    pub auth_key: Option<&'a MacKey>,
    /// v3: refuse (`frame_table`) a file declaring more raw payload bytes
    /// than a state of its token count can take ([`RawBound`]), before
    /// anything is allocated. Without it only `v3::MAX_RATIO` bounds them.
    pub max_raw: Option<RawBound>,
}

impl Default for VerifyOptions<'_> {
    fn default() -> Self {
        VerifyOptions {
            expected_abi: None,
            quant_bits: None,
            ctx: None,
            check_name: true,
            prompt: None,
            load_payload: true,
            verify_checksum: true,
            mmap: true,
            auth_key: None,
            max_raw: None,
        }
    }
}

/// A verified checkpoint. The payload (when loaded) stays valid for as long
/// as any clone of `storage` lives.
#[derive(Debug)]
pub struct Checkpoint {
    pub path: PathBuf,
    pub header: Header,
    pub text: Vec<u8>,
    pub file_len: u64,
    pub storage: Option<Arc<Storage>>,
    /// Offset of the payload inside `storage`.
    pub payload_base: usize,
    /// ds4 v1 only: the 13 DSV4 payload header fields.
    pub dsv4: Option<[u32; 13]>,
}

impl Checkpoint {
    /// Fails with `Truncated` if the mapped file shrank under us (another
    /// process truncated it: see `crate::io::sigbus`), and with `Changed`
    /// if the map's lease was broken long enough ago that a writer may have
    /// got through. Consumers call this after they have read the payload,
    /// before trusting what they read.
    pub fn check_intact(&self) -> Result<()> {
        let Some(s) = &self.storage else {
            return Ok(());
        };
        match s.intact() {
            Ok(()) => Ok(()),
            Err(Damage::Faulted) => {
                let actual = std::fs::metadata(&self.path).map_or(0, |m| m.len());
                Err(Error::Truncated {
                    expected: self.file_len,
                    actual,
                })
            }
            Err(Damage::Changed) => Err(Error::Changed),
        }
    }

    /// Gives back the map's lease (see [`Storage::release`]): called once
    /// the consumer has read what it needs and checked it.
    pub fn release(&self) {
        if let Some(s) = &self.storage {
            s.release();
        }
    }

    /// The payload bytes; `None` when it was not loaded (or, which
    /// verification rules out, when the header's range is not inside it).
    pub fn payload(&self) -> Option<&[u8]> {
        let s = self.storage.as_ref()?;
        let len = usize::try_from(self.header.raw_payload_bytes).ok()?;
        let end = self.payload_base.checked_add(len)?;
        s.bytes().get(self.payload_base..end)
    }
}

/// Runs the whole verification pipeline on `path`: the stages below, in
/// this order, each stopping the open at its first failure.
pub fn open(path: &Path, o: &VerifyOptions<'_>) -> Result<Checkpoint> {
    // Stage: open.
    let name_id = if o.check_name {
        Some(id_from_name(path)?)
    } else {
        None
    };
    let name_digest = name_id.map(|id| id.digest);
    let (file, file_len) = open_regular(path, false)?;

    // Stage: header (corrupt, then incompatible).
    let header = read_header(&file, file_len)?;
    check_compatible(&header, o)?;
    if let Some(id) = name_id {
        check_name_model(&id, &header)?;
    }

    // Stage: text.
    let text = pread_vec(
        &file,
        header.text_offset,
        u64::from(header.text_bytes),
        file_len,
    )?;
    let digest = hash::sha1(&text);
    check_text_sha1(&header, digest, name_digest)?;
    if let Some(prompt) = o.prompt {
        check_prompt_prefix(&text, digest, prompt)?;
    }
    if header.version != VERSION_V1 {
        check_padding(&file, &header, file_len)?;
    }

    let mut ck = Checkpoint {
        path: path.to_path_buf(),
        header,
        text,
        file_len,
        storage: None,
        payload_base: 0,
        dsv4: None,
    };

    // Stage: payload.
    if o.load_payload {
        load_payload(&file, &mut ck, o)?;
    } else if ck.header.version == VERSION_V1 {
        // Header-only open: describe the DSV4 payload when it can be, but
        // leave its verification to a full open.
        let head = read_dsv4_head(&file, &ck.header, file_len)?;
        ck.dsv4 = v1::decode_dsv4(&head, ck.header.tokens).ok();
    }
    Ok(ck)
}

/// Header stage only (corrupt checks): reads and checks the header of an
/// open file of length `file_len`.
pub fn read_header(file: &File, file_len: u64) -> Result<Header> {
    let head = pread_vec(file, 0, file_len.min(V2_FIXED as u64), file_len)?;
    match v2::sniff(&head, file_len)? {
        VERSION_V1 => v1::parse_v1(&head, file_len),
        VERSION_V2 | VERSION_V3 => {
            let meta_len = v2::v2_meta_len(&head, file_len)?;
            let meta = pread_vec(file, V2_FIXED as u64, meta_len, file_len)?;
            v2::parse_v2(&head, &meta, file_len)
        }
        found => Err(Error::UnsupportedVersion { found }),
    }
}

/// Header stage, incompatible checks: the ABI, quantization and context the
/// caller asked for.
fn check_compatible(header: &Header, o: &VerifyOptions<'_>) -> Result<()> {
    if let Some(abi) = o.expected_abi {
        // A v1 file never matches: its DSV4 payload is described, not executed.
        if header.version == VERSION_V1 || header.abi != abi {
            let found = if header.version == VERSION_V1 {
                "ds4 v1 (DSV4 payload)".to_owned()
            } else {
                header.abi.clone()
            };
            return Err(Error::AbiMismatch {
                found,
                expected: format!("the session's {abi:?}"),
            });
        }
    }
    if let Some(q) = o.quant_bits {
        if header.quant_bits != q {
            return Err(Error::QuantMismatch {
                found: header.quant_bits,
                expected: q,
            });
        }
    }
    if let Some(ctx) = o.ctx {
        if u64::from(header.tokens) > ctx {
            return Err(Error::CtxTooSmall {
                tokens: u64::from(header.tokens),
                ctx,
            });
        }
    }
    if o.auth_key.is_some() && !header.authenticated {
        return Err(Error::MacMissing);
    }
    Ok(())
}

/// Text stage: the SHA-1 of the stored text against the one the header
/// records (v2), then against the file name (when the name was checked).
fn check_text_sha1(
    header: &Header,
    digest: Sha1Digest,
    name_digest: Option<Sha1Digest>,
) -> Result<()> {
    if let Some(stored) = header.text_sha1 {
        if stored != digest {
            return Err(Error::TextHashMismatch {
                stored: hash::to_hex(&stored),
                computed: hash::to_hex(&digest),
            });
        }
    }
    if let Some(nd) = name_digest {
        if nd != digest {
            return Err(Error::NameMismatch {
                name: hash::to_hex(&nd),
                computed: hash::to_hex(&digest),
            });
        }
    }
    Ok(())
}

/// Text stage: the stored text is a byte prefix of the prompt. A prompt
/// prefix that hashes the same but differs is a SHA-1 collision (corrupt),
/// anything else is another conversation (mismatch).
fn check_prompt_prefix(text: &[u8], digest: Sha1Digest, prompt: &[u8]) -> Result<()> {
    if hash::is_byte_prefix(text, prompt) {
        return Ok(());
    }
    let len = text.len() as u64;
    if text.len() <= prompt.len() && prompt.get(..text.len()).map(hash::sha1) == Some(digest) {
        let at = hash::common_prefix_len(text, prompt) as u64;
        return Err(Error::PrefixCollision { len, at });
    }
    Err(Error::NotPrefix {
        len,
        prompt_len: prompt.len() as u64,
    })
}

/// Text stage, v2: the padding between text and payload must be zero.
fn check_padding(file: &File, header: &Header, file_len: u64) -> Result<()> {
    let text_end = header.text_offset + u64::from(header.text_bytes);
    let pad = pread_vec(file, text_end, header.payload_offset - text_end, file_len)?;
    if let Some(i) = pad.iter().position(|&b| b != 0) {
        return Err(Error::BadPadding {
            offset: text_end + i as u64,
        });
    }
    Ok(())
}

/// Payload stage: the payload's own layout (v1: the DSV4 header; v2: the
/// tensor table), then the payload is mapped or copied, then its checksum
/// (v2, when asked) and that the map did not lose a page meanwhile.
///
/// A map is made only under a read [`Lease`] taken before the checksum:
/// the bytes the engine later reads through it are the bytes checked (see
/// [`Checkpoint::check_intact`]). When the kernel refuses the lease (a
/// writer has the file open, another user's file, a filesystem without
/// leases) or every SIGBUS slot is taken, the payload is copied instead,
/// and the checksum is taken of the copy.
fn load_payload(file: &File, ck: &mut Checkpoint, o: &VerifyOptions<'_>) -> Result<()> {
    if ck.header.version == VERSION_V1 {
        let head = read_dsv4_head(file, &ck.header, ck.file_len)?;
        ck.dsv4 = Some(v1::decode_dsv4(&head, ck.header.tokens)?);
    } else {
        v2::check_tensor_table(&ck.header.tensors, ck.header.raw_payload_bytes)?;
    }
    if ck.header.codec.is_some() {
        return load_compressed(file, ck, o);
    }
    let checked = o.verify_checksum && ck.header.version == VERSION_V2;
    let mapped = if o.mmap {
        match Lease::take(file) {
            Some(lease) => Storage::map(file, ck.file_len, Some(lease))?,
            None => None,
        }
    } else {
        None
    };
    let mut mac = match o.auth_key {
        Some(key) if ck.header.version != VERSION_V1 => Some(start_mac(file, ck, key)?),
        _ => None,
    };
    if let Some(storage) = mapped {
        ck.storage = Some(Arc::new(storage));
        ck.payload_base =
            usize::try_from(ck.header.payload_offset).map_err(|_| Error::SizeOverflow)?;
        if checked || mac.is_some() {
            check_payload_hashes(ck, checked, mac.as_mut())?;
        }
    } else {
        let storage = Storage::copy(
            file,
            ck.header.payload_offset,
            ck.header.payload_bytes,
            ck.file_len,
            checked.then_some(ck.header.payload_checksum),
            mac.as_mut(),
        )?;
        ck.storage = Some(Arc::new(storage));
        ck.payload_base = 0;
    }
    if let Some(m) = mac {
        let at = ck.header.payload_offset + ck.header.payload_bytes;
        let stored = pread_vec(file, at, MAC_BYTES, ck.file_len)?;
        if !m.matches(&stored) {
            ck.check_intact()?;
            return Err(Error::MacMismatch);
        }
    }
    ck.check_intact()
}

/// Payload stage, v3: the declared raw size against `o.max_raw`, then
/// the frames decoded one at a time from the file into one buffer of the
/// raw payload, the checksum and (first) the MAC over their stored bytes
/// ([`decode::load`]: bounded memory, nothing decompressed before the MAC
/// matches). Never mapped: the engine reads the decompressed buffer.
fn load_compressed(file: &File, ck: &mut Checkpoint, o: &VerifyOptions<'_>) -> Result<()> {
    if let Some(b) = &o.max_raw {
        b.check(ck.header.raw_payload_bytes, ck.header.tokens)?;
    }
    let codec = ck.header.codec.as_ref().ok_or(Error::SizeOverflow)?;
    let src = Stored {
        file,
        offset: ck.header.payload_offset,
        len: ck.header.payload_bytes,
        file_len: ck.file_len,
    };
    let tag;
    let mac = match o.auth_key {
        Some(key) => {
            tag = pread_vec(file, src.offset + src.len, MAC_BYTES, ck.file_len)?;
            Some(MacCheck {
                state: start_mac(file, ck, key)?,
                tag: &tag,
            })
        }
        None => None,
    };
    let checksum = o.verify_checksum.then_some(ck.header.payload_checksum);
    let raw = decode::load(src, codec, ck.header.raw_payload_bytes, checksum, mac)?;
    ck.storage = Some(Arc::new(Storage::Heap(raw)));
    ck.payload_base = 0;
    Ok(())
}

/// The MAC of `ck` up to its payload: the header and metadata (read again:
/// they are small), the verified text and its zero padding.
fn start_mac(file: &File, ck: &Checkpoint, key: &MacKey) -> Result<MacState> {
    let head = pread_vec(file, 0, ck.header.text_offset, ck.file_len)?;
    let (fixed, meta) = head.split_at(V2_FIXED.min(head.len()));
    let mut mac = MacState::new(key, fixed, meta);
    mac.update(&ck.text);
    let text_end = ck.header.text_offset + u64::from(ck.header.text_bytes);
    let pad =
        usize::try_from(ck.header.payload_offset - text_end).map_err(|_| Error::SizeOverflow)?;
    mac.update(&[0u8; 64][..pad.min(64)]); // verified zero by check_padding (fewer than 64 bytes)
    Ok(mac)
}

/// v1: the first bytes of the payload, where the 52-byte DSV4 header lives.
fn read_dsv4_head(file: &File, header: &Header, file_len: u64) -> Result<Vec<u8>> {
    let n = header.payload_bytes.min(52);
    pread_vec(file, header.payload_offset, n, file_len)
}

/// Payload stage, v2: the payload's xxh3-64 against the header's (when
/// `checksum`) and the keyed MAC fed (when `mac`), in one pass over the map,
/// one window at a time (a large payload's pages dropped behind: the check
/// takes bounded memory). A mismatch on a map that lost a page is reported
/// as the truncation it is.
fn check_payload_hashes(ck: &Checkpoint, checksum: bool, mac: Option<&mut MacState>) -> Result<()> {
    let missing = || Error::Truncated {
        expected: ck.header.total_len,
        actual: ck.file_len,
    };
    let storage = ck.storage.as_deref().ok_or_else(missing)?;
    let len = usize::try_from(ck.header.payload_bytes).map_err(|_| Error::SizeOverflow)?;
    let end = ck.payload_base.checked_add(len).ok_or_else(missing)?;
    let computed = storage
        .checksum(ck.payload_base..end, len > payload::STREAM_ABOVE, mac)
        .ok_or_else(missing)?;
    if checksum && computed != ck.header.payload_checksum {
        ck.check_intact()?;
        return Err(Error::PayloadChecksum {
            stored: ck.header.payload_checksum,
            computed,
        });
    }
    Ok(())
}
