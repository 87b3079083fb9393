//! The buffer protocol, both ways: reading the bytes of any Python
//! bytes-like object ([`bytes_of`]) and exporting a payload range without a
//! copy ([`PayloadView`]).

use super::errors::to_pyerr;
use crate::error::Error;
use crate::payload::{Damage, Storage};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use std::os::raw::{c_char, c_int};
use std::path::PathBuf;
use std::sync::Arc;

/// A contiguous byte view of any buffer-protocol object.
pub(super) fn bytes_of(buf: &PyBuffer<u8>) -> PyResult<&[u8]> {
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("buffer must be C-contiguous"));
    }
    // SAFETY: the PyBuffer holds the export (and so the memory) alive for
    // 'a; it is contiguous and `len_bytes` long. Concurrent mutation of a
    // mutable buffer by another thread is the caller's responsibility, as
    // with every buffer-protocol consumer.
    Ok(unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) })
}

/// The bytes of a writable, C-contiguous buffer, to fill (`ValueError` for a
/// read-only or non-contiguous one).
#[allow(clippy::mut_from_ref)] // the memory is the exporter's, not `buf`'s; PyBuffer keeps it alive
pub(super) fn bytes_of_mut(buf: &PyBuffer<u8>) -> PyResult<&mut [u8]> {
    if buf.readonly() || !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(
            "buffer must be writable and C-contiguous",
        ));
    }
    // SAFETY: as `bytes_of`; the export is writable. The caller fills it
    // once, each byte from one thread, while no Python code runs on it.
    Ok(unsafe { std::slice::from_raw_parts_mut(buf.buf_ptr().cast::<u8>(), buf.len_bytes()) })
}

/// A read-only, 1-D, byte-format buffer over part of a checkpoint's payload.
/// It owns a reference to the storage (the map), so the bytes stay valid for
/// as long as any consumer (a numpy array's base) holds the view.
#[pyclass(module = "ds4._core", frozen)]
pub(super) struct PayloadView {
    storage: Arc<Storage>,
    path: PathBuf,
    start: usize,
    len: ffi::Py_ssize_t,
}

impl PayloadView {
    /// The `len` bytes at `start` of `storage`; `ValueError` when they are
    /// not all inside it.
    pub(super) fn new(
        storage: Arc<Storage>,
        start: u64,
        len: u64,
        path: PathBuf,
    ) -> PyResult<Self> {
        let out_of_bounds = || PyValueError::new_err("tensor out of bounds");
        let end = start.checked_add(len).ok_or_else(out_of_bounds)?;
        if usize::try_from(end).map_or(true, |end| end > storage.bytes().len()) {
            return Err(out_of_bounds());
        }
        Ok(PayloadView {
            storage,
            path,
            start: usize::try_from(start).map_err(|_| out_of_bounds())?,
            len: ffi::Py_ssize_t::try_from(len).map_err(|_| out_of_bounds())?,
        })
    }
}

#[pymethods]
impl PayloadView {
    fn __len__(&self) -> usize {
        self.len.unsigned_abs()
    }

    /// Raise `TruncatedCheckpointError` if a page of the map behind this
    /// view vanished (its file was truncated), `CheckpointChangedError` if
    /// the map's lease was broken long enough for a writer to get through:
    /// a view can check itself after its bytes were read, whoever holds it.
    fn check_intact(&self, py: Python<'_>) -> PyResult<()> {
        match self.storage.intact() {
            Ok(()) => Ok(()),
            Err(Damage::Faulted) => {
                let actual = std::fs::metadata(&self.path).map_or(0, |m| m.len());
                let expected = self.storage.bytes().len() as u64;
                Err(to_pyerr(
                    py,
                    Error::Truncated { expected, actual },
                    Some(&self.path),
                ))
            }
            Err(Damage::Changed) => Err(to_pyerr(py, Error::Changed, Some(&self.path))),
        }
    }

    /// True when the bytes behind this view are a map (else a private copy).
    #[getter]
    fn mapped(&self) -> bool {
        matches!(*self.storage, Storage::Mmap { .. })
    }

    /// Address of the first byte (for engines that take a raw pointer).
    #[getter]
    fn address(&self) -> usize {
        self.storage.bytes().as_ptr() as usize + self.start
    }

    /// The buffer protocol's `bf_getbuffer`: a read-only, 1-D buffer of
    /// unsigned bytes over this view's range of the payload.
    ///
    /// # Safety
    /// Called by the interpreter with `view` null or pointing at a
    /// `Py_buffer` it owns (the contract of `bf_getbuffer`).
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
        // In bounds: PayloadView::new checked start + len against the storage.
        let buf = this.storage.bytes()[this.start..].as_ptr();
        let format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
            FORMAT_B.as_ptr().cast::<c_char>().cast_mut()
        } else {
            std::ptr::null_mut()
        };
        let shape = if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
            (&raw const this.len).cast_mut()
        } else {
            std::ptr::null_mut()
        };
        let strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
            (&raw const ITEMSIZE).cast_mut()
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: `view` is a valid, non-null Py_buffer from the interpreter
        // (see above); we fill every field. `buf` points into storage kept
        // alive by `obj` (a new reference to this view, released by Python
        // in PyBuffer_Release). `shape` points at `this.len`, which lives as
        // long as `obj`; `format` and `strides` at statics. Consumers never
        // write through them (the buffer is read-only).
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = buf.cast_mut().cast();
            (*view).len = this.len;
            (*view).readonly = 1;
            (*view).itemsize = 1;
            (*view).format = format;
            (*view).ndim = 1;
            (*view).shape = shape;
            (*view).strides = strides;
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }
}

/// The struct-module format of one unsigned byte, NUL-terminated.
static FORMAT_B: &[u8; 2] = b"B\0";
/// The stride of a 1-D byte buffer (`strides` points here).
static ITEMSIZE: ffi::Py_ssize_t = 1;
