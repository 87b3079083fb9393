//! `Prefixes`: a lazy lookup of the store's index ([`crate::index::Prefixes`])
//! as a Python iterator over index rows, longest first. It holds the prompt
//! (its buffer export, not a copy) and the index; the first match is found
//! when it is made, each next one when it is asked for, with the GIL
//! released while hashing.

use super::buffer::bytes_of;
use super::index::{py_entry, PyEntry, PyStoreIndex};
use crate::index::{Entry, Prefixes, Query};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::Mutex;

struct State {
    cursor: Prefixes,
    /// The match found but not yet handed out.
    pending: Option<Entry>,
    /// How many matches were found (handed out or pending).
    found: usize,
}

/// The stored prefixes of one prompt, longest first, found one at a time
/// (`StoreIndex.prefixes`).
#[pyclass(name = "Prefixes", module = "ds4._core", frozen)]
pub(super) struct PyPrefixes {
    index: Py<PyStoreIndex>,
    prompt: PyBuffer<u8>,
    state: Mutex<State>,
}

fn poisoned() -> PyErr {
    PyRuntimeError::new_err("index poisoned by a panic")
}

impl PyPrefixes {
    pub(super) fn start(
        py: Python<'_>,
        index: Py<PyStoreIndex>,
        prompt: PyBuffer<u8>,
        min_tokens: u32,
        abi: Option<&str>,
        ctx: Option<u32>,
    ) -> PyResult<Self> {
        let q = Query {
            min_tokens,
            abi,
            ctx,
        };
        let p = bytes_of(&prompt)?;
        let idx = index.get();
        let state = py
            .detach(|| {
                let mut g = idx.inner.lock().map_err(|_| ())?;
                let mut cursor = g.prefixes(p.len(), &q);
                let pending = g.next_prefix(&mut cursor, p);
                Ok(State {
                    found: usize::from(pending.is_some()),
                    cursor,
                    pending,
                })
            })
            .map_err(|()| poisoned())?;
        Ok(PyPrefixes {
            index,
            prompt,
            state: Mutex::new(state),
        })
    }
}

#[pymethods]
impl PyPrefixes {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyEntry>> {
        let p = bytes_of(&self.prompt)?;
        let idx = self.index.get();
        let got = py
            .detach(|| {
                let mut st = self.state.lock().map_err(|_| ())?;
                if let Some(e) = st.pending.take() {
                    return Ok(Some(e));
                }
                let g = idx.inner.lock().map_err(|_| ())?;
                let e = g.next_prefix(&mut st.cursor, p);
                st.found += usize::from(e.is_some());
                Ok(e)
            })
            .map_err(|()| poisoned())?;
        Ok(got.as_ref().map(py_entry))
    }

    /// How many matches have been found so far (the first is found when
    /// the lookup is made).
    #[getter]
    fn found(&self) -> PyResult<usize> {
        Ok(self.state.lock().map_err(|_| poisoned())?.found)
    }

    /// How many bytes of the prompt have been hashed so far (in whole
    /// strides of the pass; a candidate's last partial stride is not counted).
    #[getter]
    fn hashed(&self) -> PyResult<usize> {
        Ok(self.state.lock().map_err(|_| poisoned())?.cursor.hashed())
    }
}
