//! The `Checkpoint` class and the functions that make one (open, write) or
//! act on a checkpoint file (`touch`, `sync_dir`).

use super::buffer::{bytes_of, PayloadView};
use super::errors::{to_pyerr, write_pyerr};
use crate::decode::RawBound;
use crate::format::mac::{self, MacKey};
use crate::format::v3;
use crate::format::writer_v3::Compression;
use crate::format::{self, writer, Dtype};
use crate::hash;
use crate::payload::Storage;
use crate::verify::{self, Checkpoint, VerifyOptions};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::path::PathBuf;
use std::sync::Arc;

/// Writes a checkpoint durably: v2 with `codec="none"`, v3 (its payload in
/// zstd frames, FORMAT.md §1.10) with `codec="zstd"` at `level`, `filter`
/// `"shuffle2"` or `"none"`. `tensors` is a list of
/// `(name, numpy dtype str, shape, buffer)`; buffers are streamed, never
/// concatenated. Returns `(file_len, payload_checksum)`.
#[pyfunction]
#[pyo3(signature = (path, text, tensors, *, abi, tokens, ctx, reason=0, quant_bits=0, flags=0, created=0, auth_key=None, drop_cache=true, codec="none", level=1, filter="shuffle2", span=1_048_576))]
#[expect(
    clippy::too_many_arguments,
    reason = "the Python keyword arguments of write_checkpoint"
)]
pub(super) fn write_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    text: PyBuffer<u8>,
    tensors: Vec<(String, String, Vec<u64>, PyBuffer<u8>)>,
    abi: String,
    tokens: u32,
    ctx: u32,
    reason: u8,
    quant_bits: u8,
    flags: u8,
    created: u64,
    auth_key: Option<Vec<u8>>,
    drop_cache: bool,
    codec: &str,
    level: u8,
    filter: &str,
    span: u32,
) -> PyResult<(u64, u64)> {
    let key = auth_key.as_deref().map(mac_key).transpose()?;
    let compression = compression(codec, level, filter, span)?;
    let text_b = bytes_of(&text)?;
    let mut srcs = Vec::with_capacity(tensors.len());
    for (name, dt, shape, buf) in &tensors {
        let dtype = Dtype::from_numpy(dt).ok_or_else(|| {
            PyValueError::new_err(format!("unsupported dtype {dt:?} for tensor {name:?}"))
        })?;
        srcs.push(writer::TensorSrc {
            name,
            dtype,
            shape,
            data: bytes_of(buf)?,
        });
    }
    let meta = writer::WriteMeta {
        quant_bits,
        reason,
        flags,
        tokens,
        ctx,
        created,
        abi,
    };
    let opts = writer::WriteOptions {
        auth_key: key.as_ref(),
        drop_cache,
        compression,
    };
    py.detach(|| writer::write_checkpoint(&path, &meta, text_b, &srcs, &opts))
        .map(|w| (w.file_len, w.payload_checksum))
        .map_err(|e| write_pyerr(py, e, &path))
}

/// The writer's compression for the Python keywords (`None`: v2, uncompressed).
fn compression(codec: &str, level: u8, filter: &str, span: u32) -> PyResult<Option<Compression>> {
    let shuffle = match filter {
        "shuffle2" => true,
        "none" => false,
        f => {
            return Err(PyValueError::new_err(format!(
                "filter must be 'shuffle2' or 'none', not {f:?}"
            )))
        }
    };
    match codec {
        "none" => Ok(None),
        "zstd" => Ok(Some(Compression {
            level,
            shuffle,
            span,
        })),
        c => Err(PyValueError::new_err(format!(
            "codec must be 'none' or 'zstd', not {c:?}"
        ))),
    }
}

/// Runs the verification pipeline and returns an open checkpoint.
#[pyfunction]
#[pyo3(signature = (path, *, expected_abi=None, quant_bits=None, ctx=None, check_name=true, prompt=None, load_payload=true, verify_checksum=true, mmap=true, auth_key=None, max_raw_bytes=None, state_bytes=None))]
#[expect(
    clippy::too_many_arguments,
    clippy::fn_params_excessive_bools,
    reason = "the Python keyword arguments of open_checkpoint, one per VerifyOptions field"
)]
pub(super) fn open_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    expected_abi: Option<String>,
    quant_bits: Option<u8>,
    ctx: Option<u64>,
    check_name: bool,
    prompt: Option<PyBuffer<u8>>,
    load_payload: bool,
    verify_checksum: bool,
    mmap: bool,
    auth_key: Option<Vec<u8>>,
    max_raw_bytes: Option<u64>,
    state_bytes: Option<(u64, u64)>,
) -> PyResult<PyCheckpoint> {
    let key = auth_key.as_deref().map(mac_key).transpose()?;
    let prompt_b = prompt.as_ref().map(bytes_of).transpose()?;
    let opts = VerifyOptions {
        expected_abi: expected_abi.as_deref(),
        quant_bits,
        ctx,
        check_name,
        prompt: prompt_b,
        load_payload,
        verify_checksum,
        mmap,
        auth_key: key.as_ref(),
        max_raw: raw_bound(max_raw_bytes, state_bytes),
    };
    py.detach(|| verify::open(&path, &opts))
        .map(|ck| PyCheckpoint {
            inner: Arc::new(ck),
        })
        .map_err(|e| to_pyerr(py, e, Some(&path)))
}

/// The v3 raw-size bound of `open_checkpoint`'s `max_raw_bytes` (the
/// most, whatever the token count) and `state_bytes` (`(fixed, per_token)`:
/// a state of n tokens takes at most `fixed + per_token * n` bytes).
fn raw_bound(most: Option<u64>, state: Option<(u64, u64)>) -> Option<RawBound> {
    if most.is_none() && state.is_none() {
        return None;
    }
    let (fixed, per_token) = state.unwrap_or((u64::MAX, 0));
    Some(RawBound {
        fixed,
        per_token,
        most: most.unwrap_or(u64::MAX),
    })
}

/// A MAC key passed from Python: exactly 32 bytes (`derive_auth_key`'s output).
pub(super) fn mac_key(b: &[u8]) -> PyResult<MacKey> {
    <MacKey>::try_from(b).map_err(|_| {
        PyValueError::new_err(format!(
            "auth_key must be 32 bytes (from derive_auth_key), not {}",
            b.len()
        ))
    })
}

/// The 32-byte MAC key for the secret bytes of a key file (BLAKE3
/// `derive_key`, FORMAT.md §1.9).
#[pyfunction]
pub(super) fn derive_auth_key(py: Python<'_>, secret: PyBuffer<u8>) -> PyResult<Py<PyBytes>> {
    let s = bytes_of(&secret)?;
    Ok(PyBytes::new(py, &mac::derive_key(s)).unbind())
}

/// Records a hit (`hits += 1`, `last_used = now`) under an exclusive file lock.
#[pyfunction]
pub(super) fn touch(py: Python<'_>, path: PathBuf, now: u64) -> PyResult<u32> {
    py.detach(|| crate::touch::touch(&path, now))
        .map_err(|e| to_pyerr(py, e, Some(&path)))
}

/// fsync a directory.
#[pyfunction]
pub(super) fn sync_dir(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detach(|| writer::sync_dir(&path))
        .map_err(|e| to_pyerr(py, e, Some(&path)))
}

/// An open, verified checkpoint.
#[pyclass(name = "Checkpoint", module = "ds4._core", frozen)]
pub(super) struct PyCheckpoint {
    inner: Arc<Checkpoint>,
}

#[pymethods]
impl PyCheckpoint {
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path.clone()
    }
    #[getter]
    fn version(&self) -> u8 {
        self.inner.header.version
    }
    #[getter]
    fn quant_bits(&self) -> u8 {
        self.inner.header.quant_bits
    }
    #[getter]
    fn reason(&self) -> u8 {
        self.inner.header.reason
    }
    #[getter]
    fn reason_name(&self) -> &'static str {
        format::reason_name(self.inner.header.reason)
    }
    #[getter]
    fn flags(&self) -> u8 {
        self.inner.header.flags
    }
    #[getter]
    fn tokens(&self) -> u32 {
        self.inner.header.tokens
    }
    #[getter]
    fn hits(&self) -> u32 {
        self.inner.header.hits
    }
    #[getter]
    fn ctx(&self) -> u32 {
        self.inner.header.ctx
    }
    #[getter]
    fn created(&self) -> u64 {
        self.inner.header.created
    }
    #[getter]
    fn last_used(&self) -> u64 {
        self.inner.header.last_used
    }
    #[getter]
    fn payload_bytes(&self) -> u64 {
        self.inner.header.payload_bytes
    }
    /// Bytes the tensors take once decompressed (`payload_bytes` unless v3).
    #[getter]
    fn raw_payload_bytes(&self) -> u64 {
        self.inner.header.raw_payload_bytes
    }
    /// The payload codec: `"none"`, or `"zstd"` (v3).
    #[getter]
    fn codec(&self) -> &'static str {
        self.inner
            .header
            .codec
            .as_ref()
            .map_or("none", |c| v3::codec_name(c.codec))
    }
    /// v3: `(filter, level, span, frames)`; None for v1 and v2.
    #[getter]
    fn codec_params(&self) -> Option<(&'static str, u8, u32, usize)> {
        self.inner
            .header
            .codec
            .as_ref()
            .map(|c| (v3::filter_name(c.filter), c.level, c.span, c.frames.len()))
    }
    #[getter]
    fn payload_offset(&self) -> u64 {
        self.inner.header.payload_offset
    }
    #[getter]
    fn text_bytes(&self) -> u32 {
        self.inner.header.text_bytes
    }
    #[getter]
    fn text<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.text)
    }
    #[getter]
    fn text_sha1(&self) -> String {
        hash::sha1_hex(&self.inner.text)
    }
    #[getter]
    fn abi(&self) -> &str {
        &self.inner.header.abi
    }
    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.file_len
    }
    #[getter]
    fn header_checksum(&self) -> u64 {
        self.inner.header.header_checksum
    }
    #[getter]
    fn payload_checksum(&self) -> u64 {
        self.inner.header.payload_checksum
    }
    #[getter]
    fn trailer_bytes(&self) -> u64 {
        self.inner.header.trailer_bytes
    }
    /// True when the file carries a MAC trailer (FORMAT.md §1.9); it was
    /// checked when the open was given the key.
    #[getter]
    fn authenticated(&self) -> bool {
        self.inner.header.authenticated
    }
    #[getter]
    fn mapped(&self) -> bool {
        matches!(self.inner.storage.as_deref(), Some(Storage::Mmap { .. }))
    }
    /// Raise `TruncatedCheckpointError` if the mapped file was truncated by
    /// another process while we read it, `CheckpointChangedError` if its
    /// lease was broken long enough for a writer to get through (the bytes
    /// read are then untrusted).
    fn check_intact(&self, py: Python<'_>) -> PyResult<()> {
        self.inner
            .check_intact()
            .map_err(|e| to_pyerr(py, e, Some(&self.inner.path)))
    }
    /// Give back the map's lease (writers of the file that wait for it go
    /// on): once a load has checked what it read. A no-op for a copy.
    fn release(&self) {
        self.inner.release();
    }
    /// True while the map holds its read lease (no other process can open
    /// the file for writing).
    #[getter]
    fn leased(&self) -> bool {
        self.inner.storage.as_deref().is_some_and(Storage::leased)
    }
    #[getter]
    fn payload_loaded(&self) -> bool {
        self.inner.storage.is_some()
    }
    /// ds4 v1 only: the 13 DSV4 payload header fields by name.
    #[getter]
    fn dsv4<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.inner.dsv4 {
            None => Ok(None),
            Some(f) => {
                let d = PyDict::new(py);
                for (k, v) in format::v1::DSV4_FIELDS.iter().zip(f) {
                    d.set_item(k, v)?;
                }
                Ok(Some(d))
            }
        }
    }
    /// `[(name, numpy dtype, shape, offset, nbytes)]` in payload order.
    fn tensor_table<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let l = PyList::empty(py);
        for t in &self.inner.header.tensors {
            l.append((
                t.name.clone(),
                t.dtype.numpy(),
                t.shape.clone(),
                t.offset,
                t.nbytes,
            ))?;
        }
        Ok(l)
    }
    /// A read-only buffer over one tensor's bytes, straight from the map.
    fn tensor_buffer(&self, name: &str) -> PyResult<PayloadView> {
        let t = self
            .inner
            .header
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| PyKeyError::new_err(name.to_owned()))?;
        self.view(t.offset, t.nbytes)
    }
    /// A read-only buffer over the whole payload.
    fn payload_buffer(&self) -> PyResult<PayloadView> {
        self.view(0, self.inner.header.raw_payload_bytes)
    }
    fn __repr__(&self) -> String {
        let h = &self.inner.header;
        format!(
            "<Checkpoint v{} {} tokens={} text={}B payload={}B abi={:?}>",
            h.version,
            self.inner.path.display(),
            h.tokens,
            h.text_bytes,
            h.payload_bytes,
            h.abi
        )
    }
}

impl PyCheckpoint {
    /// A buffer over `len` bytes at `offset` in the payload.
    fn view(&self, offset: u64, len: u64) -> PyResult<PayloadView> {
        let storage =
            self.inner.storage.clone().ok_or_else(|| {
                PyValueError::new_err("checkpoint was opened without its payload")
            })?;
        let start = u64::try_from(self.inner.payload_base)
            .ok()
            .and_then(|base| base.checked_add(offset))
            .ok_or_else(|| PyValueError::new_err("tensor out of bounds"))?;
        PayloadView::new(storage, start, len, self.inner.path.clone())
    }
}

// The signature's span default is written out (PyO3's text signature shows
// a constant's name as `...`): it is the format's default span.
const _: () = assert!(v3::DEFAULT_SPAN == 1_048_576);
