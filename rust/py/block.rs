//! KV block files from Python (FORMAT.md §7): chained names, the durable
//! write, a manifest's block table, and the verification of a whole table
//! into one `bytes`. Every file and hash operation runs with the GIL
//! released.

use super::buffer::{bytes_of, bytes_of_mut};
use super::checkpoint::mac_key;
use super::errors::to_pyerr;
use crate::blocks;
use crate::error::Error;
use crate::format::block::{self, BlockHeader, BlockName};
use crate::format::block_table::{Record, Table};
use crate::hash::to_hex;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyMemoryView};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

/// A 32-byte block name (or root) passed from Python.
fn block_name(b: &[u8], what: &str) -> PyResult<BlockName> {
    BlockName::try_from(b)
        .map_err(|_| PyValueError::new_err(format!("{what} must be 32 bytes, not {}", b.len())))
}

/// A caller's mistake (not a damaged file): `ValueError`; an operating
/// system error stays an `OSError` with errno and path.
fn arg_err(py: Python<'_>, e: Error, what: &str, path: Option<&Path>) -> PyErr {
    match e {
        Error::Io(_) => to_pyerr(py, e, path),
        e => PyValueError::new_err(format!("{what}: {e}")),
    }
}

/// The bytes of any C-contiguous buffer (a numpy array of any dtype, too):
/// a byte buffer as it is, any other through `memoryview(obj).cast("B")`.
fn byte_buffer(obj: &Bound<'_, PyAny>) -> PyResult<PyBuffer<u8>> {
    if let Ok(b) = PyBuffer::<u8>::get(obj) {
        return Ok(b);
    }
    let view = PyMemoryView::from(obj)?.call_method1("cast", ("B",))?;
    PyBuffer::<u8>::get(&view)
}

/// The xxh3-64 of any C-contiguous buffer: a block's payload checksum
/// (GIL released).
#[pyfunction]
pub(super) fn xxh3_64(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
    let buf = byte_buffer(data)?;
    let d = bytes_of(&buf)?;
    Ok(py.detach(|| xxhash_rust::xxh3::xxh3_64(d)))
}

/// The chain's root for a payload ABI and a namespace preamble (bytes,
/// empty for the default namespace).
#[pyfunction]
pub(super) fn block_root(
    py: Python<'_>,
    abi: &str,
    namespace: PyBuffer<u8>,
) -> PyResult<Py<PyBytes>> {
    let r = block::root(abi, bytes_of(&namespace)?)
        .map_err(|e| arg_err(py, e, "cannot make a block root", None))?;
    Ok(PyBytes::new(py, &r).unbind())
}

/// The chained names of the `len(tokens) // block_tokens` full blocks of
/// `tokens` (a C-contiguous int32 buffer: a numpy int32 array).
#[pyfunction]
pub(super) fn block_names(
    py: Python<'_>,
    root: PyBuffer<u8>,
    tokens: PyBuffer<i32>,
    block_tokens: u32,
    abi: &str,
) -> PyResult<Vec<Py<PyBytes>>> {
    let root = block_name(bytes_of(&root)?, "root")?;
    let size = NonZeroU32::new(block_tokens)
        .ok_or_else(|| PyValueError::new_err("block_tokens must be > 0"))?;
    if !tokens.is_c_contiguous() {
        return Err(PyValueError::new_err("tokens must be C-contiguous"));
    }
    // SAFETY: the PyBuffer holds the export alive for this call; it is a
    // contiguous buffer of `item_count` aligned i32 (PyBuffer::<i32>::get
    // checked item size, format and alignment).
    let ids: &[i32] =
        unsafe { std::slice::from_raw_parts(tokens.buf_ptr() as *const i32, tokens.item_count()) };
    let names = py.detach(|| -> Result<Vec<BlockName>, String> {
        let ids: Vec<u32> = ids
            .iter()
            .map(|&t| u32::try_from(t).map_err(|_| format!("token id {t} is negative")))
            .collect::<Result<_, _>>()?;
        block::names(&root, &ids, size, abi).map_err(|e| e.to_string())
    });
    let names = names.map_err(|e| PyValueError::new_err(format!("cannot name blocks: {e}")))?;
    Ok(names.iter().map(|n| PyBytes::new(py, n).unbind()).collect())
}

/// Writes the block `name` durably as `dir/<hex>.kvb` (temp file, fsync,
/// rename; the directory is not fsynced: `sync_dir` once per save).
/// Returns `(file_len, payload_checksum)`.
#[pyfunction]
#[pyo3(signature = (dir, name, n_tokens, abi, payload, auth_key=None))]
pub(super) fn write_block(
    py: Python<'_>,
    dir: PathBuf,
    name: PyBuffer<u8>,
    n_tokens: u32,
    abi: &str,
    payload: &Bound<'_, PyAny>,
    auth_key: Option<Vec<u8>>,
) -> PyResult<(u64, u64)> {
    let key = auth_key.as_deref().map(mac_key).transpose()?;
    let name = block_name(bytes_of(&name)?, "name")?;
    let payload = byte_buffer(payload)?;
    let data = bytes_of(&payload)?;
    py.detach(|| blocks::write_block(&dir, &name, n_tokens, abi, data, key.as_ref()))
        .map(|w| (w.file_len, w.checksum))
        .map_err(|e| {
            let path = dir.join(block::file_name(&name));
            arg_err(py, e, "cannot write block", Some(&path))
        })
}

/// Encodes a block table: `records` are `(name, n_tokens, payload_len,
/// checksum)`.
#[pyfunction]
pub(super) fn block_table(
    py: Python<'_>,
    block_tokens: u32,
    records: Vec<(Vec<u8>, u32, u64, u64)>,
) -> PyResult<Py<PyBytes>> {
    let records = records
        .into_iter()
        .map(|(name, n_tokens, payload_len, checksum)| {
            Ok(Record {
                name: block_name(&name, "a record's name")?,
                n_tokens,
                payload_len,
                checksum,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let t = Table {
        block_tokens,
        records,
    };
    let b = t
        .encode()
        .map_err(|e| arg_err(py, e, "cannot encode a block table", None))?;
    Ok(PyBytes::new(py, &b).unbind())
}

/// Decodes a table with every check (`BlockError`, code `block_table`).
fn decode(py: Python<'_>, table: &PyBuffer<u8>) -> PyResult<Table> {
    Table::decode(bytes_of(table)?).map_err(|e| to_pyerr(py, e, None))
}

/// A table record as Python sees it: `(name, n_tokens, payload_len, checksum)`.
type PyRecord = (Py<PyBytes>, u32, u64, u64);

/// Decodes a block table: `(block_tokens, [(name, n_tokens, payload_len,
/// checksum)])`.
#[pyfunction]
pub(super) fn read_block_table(
    py: Python<'_>,
    table: PyBuffer<u8>,
) -> PyResult<(u32, Vec<PyRecord>)> {
    let t = decode(py, &table)?;
    let records = t
        .records
        .iter()
        .map(|r| {
            (
                PyBytes::new(py, &r.name).unbind(),
                r.n_tokens,
                r.payload_len,
                r.checksum,
            )
        })
        .collect();
    Ok((t.block_tokens, records))
}

/// Verifies every block of `table` in `dir` (on up to `threads` threads)
/// and returns their payloads concatenated in table order. The first
/// failing block in table order raises `BlockError` (its `path` the
/// block file's).
#[pyfunction]
#[pyo3(signature = (dir, table, abi, auth_key=None, threads=2))]
pub(super) fn open_blocks(
    py: Python<'_>,
    dir: PathBuf,
    table: PyBuffer<u8>,
    abi: &str,
    auth_key: Option<Vec<u8>>,
    threads: usize,
) -> PyResult<Py<PyBytes>> {
    let key = auth_key.as_deref().map(mac_key).transpose()?;
    let t = decode(py, &table)?;
    match py.detach(|| blocks::open_blocks(&dir, &t, abi, key.as_ref(), threads)) {
        Ok(out) => Ok(PyBytes::new(py, &out).unbind()),
        Err(f) => Err(to_pyerr(py, f.error, f.path.as_deref())),
    }
}

/// One array being joined: a writable buffer and its runs `(start, rows, unit)`.
type PyTarget = (PyBuffer<u8>, Vec<(u64, u64, u64)>);

/// Verifies every block of `table` in `dir` as `open_blocks` does and
/// places each block's bytes straight into `targets` (the state's arrays
/// of `n_tokens` tokens, each `(writable buffer, [(start, rows, unit)])`
/// in the layout's order: block `b`'s payload is, for every target, run
/// and row in order, the rows of its tokens). A table that does not fit
/// the targets is `BlockError` code `block_table`; a failing block as in
/// `open_blocks`. Bytes outside the blocks' rows are not touched.
#[pyfunction]
#[pyo3(signature = (dir, table, abi, targets, n_tokens, auth_key=None, threads=2))]
#[allow(clippy::too_many_arguments)]
pub(super) fn open_blocks_into(
    py: Python<'_>,
    dir: PathBuf,
    table: PyBuffer<u8>,
    abi: &str,
    targets: Vec<PyTarget>,
    n_tokens: u64,
    auth_key: Option<Vec<u8>>,
    threads: usize,
) -> PyResult<()> {
    let key = auth_key.as_deref().map(mac_key).transpose()?;
    let t = decode(py, &table)?;
    let mut outs = Vec::with_capacity(targets.len());
    for (buf, runs) in &targets {
        let runs = runs
            .iter()
            .map(|&(start, rows, unit)| blocks::Run { start, rows, unit })
            .collect();
        outs.push(blocks::Target {
            out: bytes_of_mut(buf)?,
            runs,
        });
    }
    py.detach(|| {
        blocks::open_blocks_into(&dir, &t, abi, key.as_ref(), threads, &mut outs, n_tokens)
    })
    .map_err(|f| to_pyerr(py, f.error, f.path.as_deref()))
}

/// A block header as the dict `read_block_header` and `verify_block` return.
fn header_dict<'py>(py: Python<'py>, h: &BlockHeader) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", to_hex(&h.name))?;
    d.set_item("n_tokens", h.n_tokens)?;
    d.set_item("payload_len", h.payload_len)?;
    d.set_item("checksum", h.checksum)?;
    d.set_item("authenticated", h.authenticated)?;
    d.set_item("abi_tag", to_hex(&h.abi_tag))?;
    d.set_item("file_len", h.file_len())?;
    Ok(d)
}

/// A block file's header, with the header's own checks only (for
/// `ds4 kv ls`): `{name, n_tokens, payload_len, checksum, authenticated,
/// abi_tag, file_len}`.
#[pyfunction]
pub(super) fn read_block_header(py: Python<'_>, path: PathBuf) -> PyResult<Bound<'_, PyDict>> {
    let h = py
        .detach(|| blocks::read_block_header(&path))
        .map_err(|e| to_pyerr(py, e, Some(&path)))?;
    header_dict(py, &h)
}

/// Every check of one block file on its own (the header's, the name
/// against the file name, the payload checksum; the ABI tag when `abi` is
/// given, the MAC when `auth_key` is): the same dict as `read_block_header`.
#[pyfunction]
#[pyo3(signature = (path, abi=None, auth_key=None))]
pub(super) fn verify_block<'py>(
    py: Python<'py>,
    path: PathBuf,
    abi: Option<&str>,
    auth_key: Option<Vec<u8>>,
) -> PyResult<Bound<'py, PyDict>> {
    let key = auth_key.as_deref().map(mac_key).transpose()?;
    let h = py
        .detach(|| blocks::verify_block(&path, abi, key.as_ref()))
        .map_err(|e| to_pyerr(py, e, Some(&path)))?;
    header_dict(py, &h)
}
