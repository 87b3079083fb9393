//! Core errors as Python exceptions.

use crate::error::Error;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use std::path::Path;

/// Turns a core error into the matching `ds4.errors` exception (built by
/// `ds4.errors.from_core` from the error's code, message, path and stage),
/// or into an `OSError` carrying errno and path for an operating-system
/// error.
pub(super) fn to_pyerr(py: Python<'_>, e: Error, path: Option<&Path>) -> PyErr {
    if let Error::Io(io) = e {
        return match (path, io.raw_os_error()) {
            (Some(p), Some(errno)) => {
                PyOSError::new_err((errno, io.to_string(), p.display().to_string()))
            }
            _ => PyErr::from(io),
        };
    }
    let (code, stage) = (e.code(), e.stage());
    let msg = e.to_string();
    let p = path.map(|p| p.display().to_string());
    let exc = py
        .import("ds4.errors")
        .and_then(|m| m.getattr("from_core"))
        .and_then(|f| f.call1((code, msg, p, stage)));
    // A block error names its block (`BlockError.block`: hex, "" for a table).
    let exc = match (exc, e.block()) {
        (Ok(exc), Some(b)) => exc.setattr("block", b).map(|()| exc),
        (exc, _) => exc,
    };
    match exc {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

/// A writer error: an operating-system error is an `OSError` (as above); any
/// other is a bad argument from the caller (`ValueError`), not a corrupt file.
pub(super) fn write_pyerr(py: Python<'_>, e: Error, path: &Path) -> PyErr {
    match e {
        Error::Io(_) => to_pyerr(py, e, Some(path)),
        e => PyValueError::new_err(format!("cannot write checkpoint: {e}")),
    }
}
