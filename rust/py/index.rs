//! `StoreIndex`: the store's index ([`crate::index`]) as a Python object.
//! One mutex guards it; it is locked with the GIL released for the work
//! that scales with the index (lookup, load, save) and never while a
//! Python object is built from inside a released section.
//!
//! `Prefixes`: a lazy lookup of that index ([`crate::index::Prefixes`]) as
//! a Python iterator over index rows, longest first (here, beside the
//! index it holds). It holds the prompt (its buffer export, not a copy) and
//! the index; the first match is found when it is made, each next one when
//! it is asked for, with the GIL released while hashing.

use super::buffer::bytes_of;
use super::errors::to_pyerr;
use crate::format;
use crate::index::{self, DirStamp, Entry, Index, Prefixes, Query, StatKey};
use crate::name::FileId;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

type PyKey = (u64, u64, i64);
/// `(name, version, tokens, text_bytes, hits, created, last_used, abi,
/// reason, ctx, (ino, size, mtime_ns), namespace)`: the fields of
/// `ds4.kvstore.Entry` (its size is the stat key's).
pub(super) type PyEntry = (
    String,
    u8,
    u32,
    u32,
    u32,
    u64,
    u64,
    String,
    &'static str,
    u32,
    PyKey,
    Option<String>,
);
type PyStamp = (u64, u64, i64, i64);

fn digest_of(name: &str) -> PyResult<FileId> {
    FileId::parse(name)
        .ok_or_else(|| PyValueError::new_err(format!("not a checkpoint name: {name:?}")))
}

fn py_key(k: StatKey) -> PyKey {
    (k.ino, k.size, k.mtime_ns)
}

pub(super) fn py_entry(e: &Entry) -> PyEntry {
    (
        e.name(),
        e.version,
        e.tokens,
        e.text_bytes,
        e.hits,
        e.created,
        e.last_used,
        e.abi.to_string(),
        format::reason_name(e.reason),
        e.ctx,
        py_key(e.key),
        e.namespace.as_deref().map(str::to_owned),
    )
}

fn stamp_of(s: PyStamp) -> DirStamp {
    DirStamp {
        dev: s.0,
        ino: s.1,
        mtime_ns: s.2,
        scanned_ns: s.3,
    }
}

/// The index of one cache directory (see `ds4.kvstore`).
#[pyclass(name = "StoreIndex", module = "ds4._core", frozen)]
pub(super) struct PyStoreIndex {
    pub(super) inner: Mutex<Index>,
}

impl PyStoreIndex {
    pub(super) fn lock(&self) -> PyResult<MutexGuard<'_, Index>> {
        self.inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("index poisoned by a panic"))
    }
}

#[pymethods]
impl PyStoreIndex {
    #[new]
    fn new() -> Self {
        PyStoreIndex {
            inner: Mutex::new(Index::new()),
        }
    }

    /// Reads an index file: `(index, (dev, ino, dir mtime ns, scan time ns))`.
    /// A damaged or foreign-format file raises `CorruptCheckpointError`
    /// (`bad_metadata`); a missing one `FileNotFoundError`.
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<(Self, PyStamp)> {
        let (idx, s) = py
            .detach(|| index::load(&path))
            .map_err(|e| to_pyerr(py, e, Some(&path)))?;
        Ok((
            PyStoreIndex {
                inner: Mutex::new(idx),
            },
            (s.dev, s.ino, s.mtime_ns, s.scanned_ns),
        ))
    }

    /// Writes the index to `path` through `tmp` (fsync, rename, fsync of the
    /// directory); returns its size. The caller holds the directory's lock.
    fn save(&self, py: Python<'_>, path: PathBuf, tmp: PathBuf, stamp: PyStamp) -> PyResult<u64> {
        let st = stamp_of(stamp);
        py.detach(|| {
            let idx = self
                .inner
                .lock()
                .map_err(|_| crate::Error::BadMetadata("index poisoned by a panic".to_owned()))?;
            index::save(&idx, &st, &path, &tmp)
        })
        .map_err(|e| to_pyerr(py, e, Some(&path)))
    }

    /// Indexes the file at `path` from its header (see `crate::index::read_entry`)
    /// and returns its entry; raises what the header stage of a load raises.
    fn index_file(&self, py: Python<'_>, path: PathBuf) -> PyResult<PyEntry> {
        let e = py
            .detach(|| index::read_entry(&path))
            .map_err(|e| to_pyerr(py, e, Some(&path)))?;
        let out = py_entry(&e);
        self.lock()?.insert(e);
        Ok(out)
    }

    /// One listing of `dir` (no `stat`): forgets names that are gone and
    /// returns `(changed, others, gone)`: checkpoint names new or replaced
    /// (another inode), every other name, and how many names were forgotten.
    fn sync_listing(
        &self,
        py: Python<'_>,
        dir: PathBuf,
    ) -> PyResult<(Vec<String>, Vec<String>, usize)> {
        let r = py.detach(|| match self.inner.lock() {
            Ok(mut idx) => idx.sync_listing(&dir),
            Err(_) => Err(crate::Error::BadMetadata(
                "index poisoned by a panic".to_owned(),
            )),
        });
        let l = r.map_err(|e| to_pyerr(py, e, Some(&dir)))?;
        Ok((l.changed, l.others, l.gone))
    }

    /// Every record whose file in `dir` disagrees with it, with how
    /// (`changed`, `header`, `namespace`, `kept`, `unreadable`; see
    /// `crate::index::check_entry`): one open, `fstat` and one or two small
    /// `pread`s a file, on up to `threads` threads, the GIL released.
    /// Changes nothing: the caller reads those names again.
    #[pyo3(signature = (dir, *, threads=1))]
    fn check_files(
        &self,
        py: Python<'_>,
        dir: PathBuf,
        threads: usize,
    ) -> PyResult<Vec<(String, &'static str)>> {
        let r = py.detach(|| match self.inner.lock() {
            Ok(idx) => Ok(idx.check_files(&dir, threads)),
            Err(_) => Err(crate::Error::BadMetadata(
                "index poisoned by a panic".to_owned(),
            )),
        });
        let v = r.map_err(|e| to_pyerr(py, e, Some(&dir)))?;
        Ok(v.into_iter().map(|(n, d)| (n, d.as_str())).collect())
    }

    /// Remembers a file kept but not indexed (another format's), by stat key.
    fn keep(&self, name: &str, key: PyKey) -> PyResult<()> {
        let d = digest_of(name)?;
        self.lock()?.keep(
            d,
            StatKey {
                ino: key.0,
                size: key.1,
                mtime_ns: key.2,
            },
            index::case_of(name),
        );
        Ok(())
    }

    /// Forgets a name; true when it was indexed or kept.
    fn remove(&self, name: &str) -> PyResult<bool> {
        let d = digest_of(name)?;
        Ok(self.lock()?.remove(&d))
    }

    /// Every known name (indexed and kept) with its stat key and whether it
    /// is indexed: `{name: ((ino, size, mtime_ns), indexed)}`.
    fn keys(&self) -> PyResult<HashMap<String, (PyKey, bool)>> {
        let idx = self.lock()?;
        Ok(idx
            .names()
            .filter_map(|d| {
                idx.key_of(d)
                    .and_then(|(k, ok)| idx.name(d).map(|n| (n, (py_key(k), ok))))
            })
            .collect())
    }

    /// The entry of `name`, or None.
    fn get(&self, name: &str) -> PyResult<Option<PyEntry>> {
        let d = digest_of(name)?;
        Ok(self.lock()?.get(&d).map(py_entry))
    }

    /// Every entry (unordered).
    fn entries(&self) -> PyResult<Vec<PyEntry>> {
        Ok(self.lock()?.entries().map(py_entry).collect())
    }

    /// The entries whose name is the SHA-1 of a prefix of `prompt`, with at
    /// least `min_tokens` tokens, of `abi` (or v1) and fewer than `ctx`
    /// tokens, longest first; the GIL is released throughout.
    #[pyo3(signature = (prompt, *, min_tokens, abi=None, ctx=None))]
    fn lookup(
        &self,
        py: Python<'_>,
        prompt: PyBuffer<u8>,
        min_tokens: u32,
        abi: Option<String>,
        ctx: Option<u32>,
    ) -> PyResult<Vec<PyEntry>> {
        let p = bytes_of(&prompt)?;
        let q = Query {
            min_tokens,
            abi: abi.as_deref(),
            ctx,
        };
        let found = py.detach(|| {
            self.inner
                .lock()
                .map(|mut idx| idx.lookup(p, &q))
                .map_err(|_| ())
        });
        let found = found.map_err(|()| PyRuntimeError::new_err("index poisoned by a panic"))?;
        Ok(found.iter().map(py_entry).collect())
    }

    /// What `lookup` returns, lazily (`ds4._core.Prefixes`, an iterator):
    /// the longest match is found here (one SHA-1 pass over the prompt up
    /// to the longest candidate, the GIL released), each next one only
    /// when asked for (`crate::index::Index::prefixes`).
    #[pyo3(signature = (prompt, *, min_tokens, abi=None, ctx=None))]
    fn prefixes(
        slf: Bound<'_, Self>,
        prompt: PyBuffer<u8>,
        min_tokens: u32,
        abi: Option<String>,
        ctx: Option<u32>,
    ) -> PyResult<PyPrefixes> {
        PyPrefixes::start(
            slf.py(),
            slf.unbind(),
            prompt,
            min_tokens,
            abi.as_deref(),
            ctx,
        )
    }

    /// The longest entry of `namespace` (None: the default) whose text is
    /// at most `limit` bytes, with at least `min_tokens` tokens and fewer
    /// than `ctx`, not named in `exclude` (ties: most tokens, then the
    /// smaller name); nothing hashed, no file read.
    #[pyo3(signature = (limit, namespace, *, min_tokens, ctx=None, exclude=Vec::new()))]
    fn longest(
        &self,
        limit: usize,
        namespace: Option<String>,
        min_tokens: u32,
        ctx: Option<u32>,
        exclude: Vec<String>,
    ) -> PyResult<Option<PyEntry>> {
        let q = Query {
            min_tokens,
            abi: None,
            ctx,
        };
        let exclude: HashSet<String> = exclude.into_iter().collect();
        Ok(self
            .lock()?
            .longest(limit, namespace.as_deref(), &q, &exclude)
            .as_ref()
            .map(py_entry))
    }

    /// Records a hit on an indexed entry; false when it is not indexed.
    fn set_hit(&self, name: &str, hits: u32, last_used: u64, key: PyKey) -> PyResult<bool> {
        let d = digest_of(name)?;
        let k = StatKey {
            ino: key.0,
            size: key.1,
            mtime_ns: key.2,
        };
        Ok(self.lock()?.set_hit(&d, hits, last_used, k))
    }

    /// The blocks an indexed file names, recorded for the version indexed:
    /// their 32-byte names joined (empty: a single file); None when none are
    /// recorded.
    fn blocks_of<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let d = digest_of(name)?;
        let got = self.lock()?.blocks_of(&d);
        Ok(got.map(|b| PyBytes::new(py, b.as_flattened())))
    }

    /// Records the blocks (32-byte names joined) an indexed file names, read
    /// from the version whose stat key is `key`; true when its record
    /// changed (false: not indexed, another version, or the same blocks).
    fn set_blocks(&self, name: &str, key: PyKey, blocks: &[u8]) -> PyResult<bool> {
        let d = digest_of(name)?;
        if blocks.len() % 32 != 0 {
            return Err(PyValueError::new_err("block names are 32 bytes each"));
        }
        let names: Vec<[u8; 32]> = blocks
            .chunks_exact(32)
            .map(|c| c.try_into().unwrap_or([0; 32]))
            .collect();
        let k = StatKey {
            ino: key.0,
            size: key.1,
            mtime_ns: key.2,
        };
        Ok(self.lock()?.set_blocks(&d, k, &names))
    }

    /// Sum of the indexed files' sizes.
    fn total_bytes(&self) -> PyResult<u64> {
        Ok(self.lock()?.total_bytes())
    }

    /// `(namespace, bytes, files)` per namespace of the indexed files
    /// (None: the default namespace), sorted.
    fn namespace_usage(&self) -> PyResult<Vec<(Option<String>, u64, u64)>> {
        let usage = self.lock()?.namespace_usage();
        Ok(usage
            .into_iter()
            .map(|(ns, b, n)| (ns.as_deref().map(str::to_owned), b, n))
            .collect())
    }

    /// (ABI, bytes, files, hits) of the indexed files, per payload ABI.
    fn abi_usage(&self) -> PyResult<Vec<(String, u64, u64, u64)>> {
        let usage = self.lock()?.abi_usage();
        Ok(usage
            .into_iter()
            .map(|(abi, b, n, h)| (abi.to_string(), b, n, h))
            .collect())
    }

    /// An estimate of the heap the index holds, in bytes.
    fn heap_bytes(&self) -> PyResult<usize> {
        Ok(self.lock()?.heap_bytes())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.lock()?.len())
    }
}

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
