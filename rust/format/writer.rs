//! The checkpoint writer's one entry point, [`write_checkpoint`], with its
//! [`WriteOptions`] (MAC key, page-cache hint, compression: v3 is written
//! by [`super::writer_v3`]), and the v2 writer: streams tensors to a temp
//! file in the target directory, fsyncs it, renames it into place and
//! fsyncs the directory. Nothing is concatenated in memory; the payload
//! checksum is computed in a first pass over the caller's buffers.
// The parent module denies `clippy::indexing_slicing` for code that parses
// untrusted bytes. The writer only indexes buffers it sized itself (the
// 96-byte header it allocates, `zeros[..n]` with `n < ALIGN`).
#![allow(clippy::indexing_slicing)]

use super::mac::{MacKey, MacState, AUTH_BLAKE3, AUTH_OFFSET, MAC_BYTES};
use super::v2::{check_tensor_table, header_checksum};
use super::writer_v3::{write_compressed, Compression};
use super::{
    align_up, Dtype, TensorInfo, ALIGN, MAGIC, MAX_ABI, MAX_META, MAX_NAME, MAX_NDIM, MAX_TENSORS,
    V2_FIXED, VERSION_V2,
};
use crate::error::{Error, Result};
use crate::hash::sha1;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use xxhash_rust::xxh3::Xxh3;

/// One tensor to write: raw little-endian bytes of a C-contiguous array.
pub struct TensorSrc<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
    pub data: &'a [u8],
}

#[derive(Debug, Clone, Default)]
pub struct WriteMeta {
    pub quant_bits: u8,
    pub reason: u8,
    pub flags: u8,
    pub tokens: u32,
    pub ctx: u32,
    pub created: u64,
    pub abi: String,
}

/// The file a writer produced.
#[derive(Debug, Clone)]
pub struct Written {
    pub path: PathBuf,
    pub file_len: u64,
    pub payload_checksum: u64,
    pub header_checksum: u64,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Temp files are `.<final name>.tmp.<pid>.<where>.<unique>`: hidden from
/// listings, recognisable by the store's cleanup, unique per process and
/// call. `<where>` ([`pid_space`]) names the PID namespace the pid means
/// something in: a store that sees another one (another container, another
/// host sharing the directory) cannot ask whether that writer is alive, and
/// judges the file by its age only.
pub fn temp_name(final_name: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    format!(
        ".{final_name}.tmp.{}.{}.{:x}{:x}",
        std::process::id(),
        pid_space(),
        t,
        n
    )
}

/// This process's PID namespace on this boot of this host: the first 12 hex
/// digits of the boot id, then the namespace's inode in hex (`x` when either
/// cannot be read: then no store treats the pid as one of its own).
/// `ds4.kvstore.files.pid_space` computes the same string.
pub fn pid_space() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let boot: String = boot
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(12)
        .collect();
    match std::fs::metadata("/proc/self/ns/pid") {
        Ok(md) if boot.len() == 12 => {
            use std::os::unix::fs::MetadataExt;
            format!("{boot}{:x}", md.ino())
        }
        _ => "x".to_owned(),
    }
}

/// Builds the header and metadata bytes for `text` and `tensors`.
pub fn encode_header(
    meta: &WriteMeta,
    text: &[u8],
    tensors: &[TensorSrc<'_>],
) -> Result<(Vec<u8>, Vec<TensorInfo>, u64)> {
    if meta.abi.len() > MAX_ABI {
        return Err(Error::HeaderTooLarge {
            what: "ABI string",
            len: meta.abi.len() as u64,
            max: MAX_ABI as u64,
        });
    }
    if tensors.len() > MAX_TENSORS {
        return Err(Error::HeaderTooLarge {
            what: "tensor table",
            len: tensors.len() as u64,
            max: MAX_TENSORS as u64,
        });
    }
    let text_len: u32 = text.len().try_into().map_err(|_| Error::HeaderTooLarge {
        what: "text",
        len: text.len() as u64,
        max: u64::from(u32::MAX),
    })?;
    let mut infos = Vec::with_capacity(tensors.len());
    let mut off = 0u64;
    let mut payload_len = 0u64;
    for t in tensors {
        if t.name.is_empty() || t.name.len() > MAX_NAME || t.shape.len() > MAX_NDIM {
            return Err(bad_tensor(t.name));
        }
        let want = t.dtype.nbytes(t.shape).ok_or(Error::SizeOverflow)?;
        if want != t.data.len() as u64 {
            return Err(Error::TensorTable(format!(
                "cannot write tensor {:?}: {} data bytes for shape {:?}, expected {want}",
                t.name,
                t.data.len(),
                t.shape
            )));
        }
        infos.push(TensorInfo {
            name: t.name.to_owned(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            offset: off,
            nbytes: want,
        });
        payload_len = off + want;
        off = align_up(payload_len).ok_or(Error::SizeOverflow)?;
    }
    check_tensor_table(&infos, payload_len)?;

    let m = encode_meta(&meta.abi, &infos)?;
    let meta_len = u32::try_from(m.len())
        .ok()
        .filter(|&n| u64::from(n) <= MAX_META)
        .ok_or(Error::HeaderTooLarge {
            what: "metadata",
            len: m.len() as u64,
            max: MAX_META,
        })?;

    let mut f = vec![0u8; V2_FIXED];
    f[0..3].copy_from_slice(&MAGIC);
    f[3] = VERSION_V2;
    f[4] = meta.quant_bits;
    f[5] = meta.reason;
    f[6] = meta.flags;
    f[8..12].copy_from_slice(&meta.tokens.to_le_bytes());
    // 12..16 hits = 0
    f[16..20].copy_from_slice(&meta.ctx.to_le_bytes());
    f[20..24].copy_from_slice(&meta_len.to_le_bytes());
    f[24..32].copy_from_slice(&meta.created.to_le_bytes());
    f[32..40].copy_from_slice(&meta.created.to_le_bytes()); // last_used starts at created
    f[40..48].copy_from_slice(&payload_len.to_le_bytes());
    f[48..52].copy_from_slice(&text_len.to_le_bytes());
    // 52..56: reserved for flags of future versions, zero
    f[56..76].copy_from_slice(&sha1(text));
    // payload checksum (80..88) is filled by the caller; header checksum last.
    f.extend_from_slice(&m);
    Ok((f, infos, payload_len))
}

fn bad_tensor(name: &str) -> Error {
    Error::TensorTable(format!(
        "cannot write tensor {name:?}: bad name or too many dimensions"
    ))
}

/// The metadata: `u16 abi_len, abi, u16 n_tensors`, then per tensor
/// `u8 name_len, name, u8 dtype, u8 ndim, u64 shape[ndim], u64 offset, u64 nbytes`.
/// [`encode_header`] has checked every length against the format's limits;
/// a length that does not fit its field is still an error here, never
/// truncated.
fn encode_meta(abi: &str, infos: &[TensorInfo]) -> Result<Vec<u8>> {
    let abi_len = u16::try_from(abi.len()).map_err(|_| Error::HeaderTooLarge {
        what: "ABI string",
        len: abi.len() as u64,
        max: MAX_ABI as u64,
    })?;
    let n_tensors = u16::try_from(infos.len()).map_err(|_| Error::HeaderTooLarge {
        what: "tensor table",
        len: infos.len() as u64,
        max: MAX_TENSORS as u64,
    })?;
    let mut m = Vec::new();
    m.extend_from_slice(&abi_len.to_le_bytes());
    m.extend_from_slice(abi.as_bytes());
    m.extend_from_slice(&n_tensors.to_le_bytes());
    for t in infos {
        let name_len = u8::try_from(t.name.len()).map_err(|_| bad_tensor(&t.name))?;
        let ndim = u8::try_from(t.shape.len()).map_err(|_| bad_tensor(&t.name))?;
        m.push(name_len);
        m.extend_from_slice(t.name.as_bytes());
        m.push(t.dtype as u8);
        m.push(ndim);
        for d in &t.shape {
            m.extend_from_slice(&d.to_le_bytes());
        }
        m.extend_from_slice(&t.offset.to_le_bytes());
        m.extend_from_slice(&t.nbytes.to_le_bytes());
    }
    Ok(m)
}

/// `n` zero bytes, `n < ALIGN`: the padding up to the next aligned offset.
pub(crate) fn zeros(n: u64) -> &'static [u8] {
    const ZEROS: [u8; 64] = [0; 64];
    const _: () = assert!(ZEROS.len() as u64 == ALIGN);
    usize::try_from(n)
        .ok()
        .and_then(|n| ZEROS.get(..n))
        .expect("padding is shorter than ALIGN")
}

/// Computes the payload checksum over tensors and their zero padding.
pub fn checksum_tensors(tensors: &[TensorSrc<'_>]) -> u64 {
    checksum_and_mac(tensors, None)
}

/// The payload checksum, and the MAC's payload part in the same pass (each
/// tensor is read once while both hashes take it).
fn checksum_and_mac(tensors: &[TensorSrc<'_>], mut mac: Option<&mut MacState>) -> u64 {
    let mut h = Xxh3::new();
    let mut pos = 0u64;
    for t in tensors {
        let aligned = align_up(pos).unwrap_or(pos);
        let pad = zeros(aligned - pos);
        for piece in std::iter::once(pad).chain(t.data.chunks(1 << 20)) {
            h.update(piece);
            if let Some(m) = mac.as_deref_mut() {
                m.update(piece);
            }
        }
        pos = aligned + t.data.len() as u64;
    }
    h.digest()
}

/// The directory of `path` and the temp file a durable write of it goes
/// through (same directory, [`temp_name`]).
pub(crate) fn temp_for(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "checkpoint path has no file name",
        ))
    })?;
    let tmp = dir.join(temp_name(name));
    Ok((dir, tmp))
}

/// The end of a durable write: the temp file must hold `total` bytes; it
/// is fsynced (its pages dropped from the cache with `drop_cache`),
/// renamed to `path`, and the directory fsynced.
pub(crate) fn commit(
    file: File,
    total: u64,
    drop_cache: bool,
    tmp: &Path,
    path: &Path,
    dir: &Path,
) -> Result<()> {
    let written = file.metadata()?.len();
    if written != total {
        return Err(Error::Io(std::io::Error::other(format!(
            "wrote {written} bytes, expected {total}"
        ))));
    }
    file.sync_all()?;
    if drop_cache {
        drop_cached(&file, total);
    }
    drop(file);
    fs::rename(tmp, path)?;
    sync_dir(dir)
}

/// How [`write_checkpoint`] writes: the defaults write an unauthenticated
/// v2 file and drop its pages from the page cache once it is durable.
#[derive(Debug, Clone, Copy)]
pub struct WriteOptions<'a> {
    /// Authenticate the file: header byte 52 says so and the file ends with
    /// the keyed MAC (FORMAT.md §1.9), computed in the same pass over the
    /// tensors as the payload checksum (v3: over the stored frames, read
    /// back from the temp file).
    pub auth_key: Option<&'a MacKey>,
    /// Once the file is fsynced, drop its pages from the page cache
    /// (`posix_fadvise(DONTNEED)` on the written range: a checkpoint is read
    /// again only by a later load, and hundreds of saves would otherwise push
    /// out the pages other processes use). The hint is best-effort: its
    /// errors are ignored.
    pub drop_cache: bool,
    /// Write v3 (FORMAT.md §1.10), the payload compressed as this says; a
    /// payload that compresses beyond what a reader accepts is written as
    /// v2. `None`: v2, uncompressed.
    pub compression: Option<Compression>,
}

impl Default for WriteOptions<'_> {
    fn default() -> Self {
        WriteOptions {
            auth_key: None,
            drop_cache: true,
            compression: None,
        }
    }
}

/// Writes a checkpoint durably to `path`: a 0600 temp file in the same
/// directory, fsync, rename, fsync of the directory. On any error the temp
/// file is removed and `path` is untouched. `o` says whether it is
/// authenticated, compressed (v3) and kept in the page cache.
pub fn write_checkpoint(
    path: &Path,
    meta: &WriteMeta,
    text: &[u8],
    tensors: &[TensorSrc<'_>],
    o: &WriteOptions<'_>,
) -> Result<Written> {
    match o.compression {
        None => write_v2(path, meta, text, tensors, o),
        Some(c) => write_compressed(path, meta, text, tensors, o, c),
    }
}

/// [`write_checkpoint`] of a v2 file (`o.compression` aside).
pub(super) fn write_v2(
    path: &Path,
    meta: &WriteMeta,
    text: &[u8],
    tensors: &[TensorSrc<'_>],
    o: &WriteOptions<'_>,
) -> Result<Written> {
    let (mut head, _infos, payload_len) = encode_header(meta, text, tensors)?;
    let text_end = head.len() as u64 + text.len() as u64;
    let payload_off = align_up(text_end).ok_or(Error::SizeOverflow)?;
    let mut mac = o.auth_key.map(|k| {
        head[AUTH_OFFSET] = AUTH_BLAKE3;
        let mut m = MacState::new(k, &head[..V2_FIXED], &head[V2_FIXED..]);
        m.update(text);
        m.update(zeros(payload_off - text_end));
        m
    });
    let sum = checksum_and_mac(tensors, mac.as_mut());
    let tag = mac.map(|m| m.finalize());
    head[80..88].copy_from_slice(&sum.to_le_bytes());
    let hsum = header_checksum(&head[..V2_FIXED], &head[V2_FIXED..]);
    head[88..96].copy_from_slice(&hsum.to_le_bytes());

    let total = payload_off + payload_len + if tag.is_some() { MAC_BYTES } else { 0 };

    let (dir, tmp) = temp_for(path)?;
    let res = (|| -> Result<()> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        w.write_all(&head)?;
        w.write_all(text)?;
        w.write_all(zeros(payload_off - text_end))?;
        let mut pos = 0u64;
        for t in tensors {
            let aligned = align_up(pos).ok_or(Error::SizeOverflow)?;
            w.write_all(zeros(aligned - pos))?;
            w.write_all(t.data)?;
            pos = aligned + t.data.len() as u64;
        }
        if let Some(tag) = &tag {
            w.write_all(tag)?;
        }
        let file = w.into_inner().map_err(|e| Error::Io(e.into_error()))?;
        commit(file, total, o.drop_cache, &tmp, path, &dir)?;
        Ok(())
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(Written {
        path: path.to_path_buf(),
        file_len: total,
        payload_checksum: sum,
        header_checksum: hsum,
    })
}

/// Asks the kernel to drop `len` bytes of `file` from the page cache (they
/// are clean: the file was fsynced). Best-effort: a filesystem that keeps
/// its pages (tmpfs) or refuses the hint changes nothing, and an error is
/// ignored, never a failed save.
pub fn drop_cached(file: &File, len: u64) {
    let len = libc::off_t::try_from(len).unwrap_or(0); // 0: to the end of the file
                                                       // SAFETY: posix_fadvise only reads its arguments; the fd is open for the call.
    let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, len, libc::POSIX_FADV_DONTNEED) };
}

/// fsync a directory so a rename or unlink in it survives a crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}
