//! The PyO3 glue: the only code that knows about Python. Errors become the
//! classes of `ds4.errors` (built there by `from_core`), heavy work runs with
//! the GIL released, and payload tensors are exported through the buffer
//! protocol straight from the map (numpy's `frombuffer` then keeps the map
//! alive through the array's base).

use crate::error::Error;
use crate::format::{self, writer, Dtype};
use crate::hash;
use crate::payload::Storage;
use crate::verify::{self, Checkpoint, VerifyOptions};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyKeyError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::ffi::CString;
use std::os::raw::c_int;
use std::path::PathBuf;
use std::sync::Arc;

/// Turns a core error into the matching `ds4.errors` exception (or OSError).
fn to_pyerr(py: Python<'_>, e: Error, path: Option<&std::path::Path>) -> PyErr {
    if let Error::Io(io) = e {
        return match path {
            Some(p) => {
                let kind = io.raw_os_error();
                let msg = format!("{io}");
                match kind {
                    Some(errno) => {
                        pyo3::exceptions::PyOSError::new_err((errno, msg, p.display().to_string()))
                    }
                    None => PyErr::from(io),
                }
            }
            None => PyErr::from(io),
        };
    }
    let code = e.code();
    let msg = e.to_string();
    let p = path.map(|p| p.display().to_string());
    match py
        .import("ds4.errors")
        .and_then(|m| m.getattr("from_core"))
        .and_then(|f| f.call1((code, msg.clone(), p)))
    {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

/// A contiguous byte view of any buffer-protocol object.
fn bytes_of(buf: &PyBuffer<u8>) -> PyResult<&[u8]> {
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("buffer must be C-contiguous"));
    }
    // SAFETY: the PyBuffer holds the export (and so the memory) alive for
    // 'a; it is contiguous and `len_bytes` long. Concurrent mutation of a
    // mutable buffer by another thread is the caller's responsibility, as
    // with every buffer-protocol consumer.
    Ok(unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) })
}

/// Hex SHA-1 of a bytes-like object (GIL released above 64 KiB).
#[pyfunction]
fn sha1_hex(py: Python<'_>, data: PyBuffer<u8>) -> PyResult<String> {
    let d = bytes_of(&data)?;
    Ok(if d.len() > 1 << 16 {
        py.detach(|| hash::sha1_hex(d))
    } else {
        hash::sha1_hex(d)
    })
}

/// Hex SHA-1 of `data[:n]` for every `n` in `lengths`, in one pass over
/// `data`; `None` where `n > len(data)`.
#[pyfunction]
fn sha1_prefixes(
    py: Python<'_>,
    data: PyBuffer<u8>,
    lengths: Vec<usize>,
) -> PyResult<Vec<Option<String>>> {
    let d = bytes_of(&data)?;
    let r = py.detach(|| hash::sha1_prefixes(d, &lengths));
    Ok(r.into_iter().map(|o| o.map(|x| hash::to_hex(&x))).collect())
}

#[pyfunction]
fn is_byte_prefix(py: Python<'_>, prefix: PyBuffer<u8>, text: PyBuffer<u8>) -> PyResult<bool> {
    let (p, t) = (bytes_of(&prefix)?, bytes_of(&text)?);
    Ok(if p.len() > 1 << 16 {
        py.detach(|| hash::is_byte_prefix(p, t))
    } else {
        hash::is_byte_prefix(p, t)
    })
}

#[pyfunction]
fn common_prefix_len(py: Python<'_>, a: PyBuffer<u8>, b: PyBuffer<u8>) -> PyResult<usize> {
    let (a, b) = (bytes_of(&a)?, bytes_of(&b)?);
    Ok(if a.len().min(b.len()) > 1 << 16 {
        py.detach(|| hash::common_prefix_len(a, b))
    } else {
        hash::common_prefix_len(a, b)
    })
}

/// Length of the common prefix of two token lists.
#[pyfunction]
fn common_token_prefix(a: Vec<u32>, b: Vec<u32>) -> usize {
    hash::common_prefix_len_u32(&a, &b)
}

/// Writes a v2 checkpoint durably. `tensors` is a list of
/// `(name, numpy dtype str, shape, buffer)`; buffers are streamed, never
/// concatenated. Returns `(file_len, payload_checksum)`.
#[pyfunction]
#[pyo3(signature = (path, text, tensors, *, abi, tokens, ctx, reason=0, quant_bits=0, flags=0, created=0))]
#[allow(clippy::too_many_arguments)]
fn write_checkpoint(
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
) -> PyResult<(u64, u64)> {
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
    let r = py.detach(|| writer::write_checkpoint(&path, &meta, text_b, &srcs));
    match r {
        Ok(w) => Ok((w.file_len, w.payload_checksum)),
        Err(e @ Error::Io(_)) => Err(to_pyerr(py, e, Some(&path))),
        // Bad arguments to the writer are the caller's error, not a corrupt file.
        Err(e) => Err(PyValueError::new_err(format!(
            "cannot write checkpoint: {e}"
        ))),
    }
}

/// Runs the verification pipeline and returns an open checkpoint.
#[pyfunction]
#[pyo3(signature = (path, *, expected_abi=None, quant_bits=None, ctx=None, check_name=true, prompt=None, load_payload=true, verify_checksum=true, mmap=true))]
#[allow(clippy::too_many_arguments)]
fn open_checkpoint(
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
) -> PyResult<PyCheckpoint> {
    let prompt_b = match &prompt {
        Some(b) => Some(bytes_of(b)?),
        None => None,
    };
    let opts = VerifyOptions {
        expected_abi: expected_abi.as_deref(),
        quant_bits,
        ctx,
        check_name,
        prompt: prompt_b,
        load_payload,
        verify_checksum,
        mmap,
    };
    match py.detach(|| verify::open(&path, &opts)) {
        Ok(ck) => Ok(PyCheckpoint {
            inner: Arc::new(ck),
        }),
        Err(e) => Err(to_pyerr(py, e, Some(&path))),
    }
}

/// Records a hit (hits+1, last_used=now) under an exclusive file lock.
#[pyfunction]
fn touch(py: Python<'_>, path: PathBuf, now: u64) -> PyResult<u32> {
    py.detach(|| verify::touch(&path, now))
        .map_err(|e| to_pyerr(py, e, Some(&path)))
}

/// fsync a directory.
#[pyfunction]
fn sync_dir(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detach(|| writer::sync_dir(&path))
        .map_err(|e| to_pyerr(py, e, Some(&path)))
}

/// An open, verified checkpoint.
#[pyclass(name = "Checkpoint", module = "ds4._core", frozen)]
struct PyCheckpoint {
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
    #[getter]
    fn mapped(&self) -> bool {
        matches!(self.inner.storage.as_deref(), Some(Storage::Mmap { .. }))
    }
    /// Raise TruncatedCheckpointError if the mapped file was truncated by
    /// another process while we read it (the bytes read are then untrusted).
    fn check_intact(&self, py: Python<'_>) -> PyResult<()> {
        self.inner
            .check_intact()
            .map_err(|e| to_pyerr(py, e, Some(&self.inner.path)))
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
        self.view(0, self.inner.header.payload_bytes)
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
    fn view(&self, offset: u64, len: u64) -> PyResult<PayloadView> {
        let storage =
            self.inner.storage.clone().ok_or_else(|| {
                PyValueError::new_err("checkpoint was opened without its payload")
            })?;
        let start = self.inner.payload_base as u64 + offset;
        let end = start + len;
        if end as usize > storage.bytes().len() {
            return Err(PyValueError::new_err("tensor out of bounds"));
        }
        Ok(PayloadView {
            storage,
            start: start as usize,
            len: len as ffi::Py_ssize_t,
        })
    }
}

/// A read-only, 1-D, byte-format buffer over part of a checkpoint's payload.
/// It owns a reference to the storage (the map), so the bytes stay valid for
/// as long as any consumer (a numpy array's base) holds the view.
#[pyclass(module = "ds4._core", frozen)]
struct PayloadView {
    storage: Arc<Storage>,
    start: usize,
    len: ffi::Py_ssize_t,
}

#[pymethods]
impl PayloadView {
    fn __len__(&self) -> usize {
        self.len as usize
    }

    /// Address of the first byte (for engines that take a raw pointer).
    #[getter]
    fn address(&self) -> usize {
        self.storage.bytes().as_ptr() as usize + self.start
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("view is null"));
        }
        if (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("checkpoint payloads are read-only"));
        }
        let this = slf.get();
        let ptr = this.storage.bytes().as_ptr().add(this.start);
        // SAFETY: `view` is a valid Py_buffer from the interpreter; we fill
        // every field. `buf` points into storage kept alive by `obj` (a new
        // reference to this view, released by Python in PyBuffer_Release).
        // `shape` points at `self.len`, which lives as long as `obj`.
        (*view).obj = slf.clone().into_any().into_ptr();
        (*view).buf = ptr as *mut std::os::raw::c_void;
        (*view).len = this.len;
        (*view).readonly = 1;
        (*view).itemsize = 1;
        (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
            FORMAT_B.as_ptr() as *mut std::os::raw::c_char
        } else {
            std::ptr::null_mut()
        };
        (*view).ndim = 1;
        (*view).shape = if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
            &this.len as *const ffi::Py_ssize_t as *mut ffi::Py_ssize_t
        } else {
            std::ptr::null_mut()
        };
        (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
            &ITEMSIZE as *const ffi::Py_ssize_t as *mut ffi::Py_ssize_t
        } else {
            std::ptr::null_mut()
        };
        (*view).suboffsets = std::ptr::null_mut();
        (*view).internal = std::ptr::null_mut();
        Ok(())
    }
}

static FORMAT_B: &[u8; 2] = b"B\0";
static ITEMSIZE: ffi::Py_ssize_t = 1;

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", format::VERSION_V2)?;
    m.add("ALIGN", format::ALIGN)?;
    m.add("REASONS", format::REASONS.to_vec())?;
    m.add_function(wrap_pyfunction!(sha1_hex, m)?)?;
    m.add_function(wrap_pyfunction!(sha1_prefixes, m)?)?;
    m.add_function(wrap_pyfunction!(is_byte_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(common_prefix_len, m)?)?;
    m.add_function(wrap_pyfunction!(common_token_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(write_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(open_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(touch, m)?)?;
    m.add_function(wrap_pyfunction!(sync_dir, m)?)?;
    m.add_class::<PyCheckpoint>()?;
    m.add_class::<PayloadView>()?;
    let _ = CString::default();
    Ok(())
}
