//! SHA-1, prefix and key-text helpers over Python buffers.

use super::buffer::bytes_of;
use crate::hash;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

/// Inputs above this many bytes are hashed or compared with the GIL released.
const DETACH_ABOVE: usize = 1 << 16;

/// Hex SHA-1 of a bytes-like object (GIL released above 64 KiB).
#[pyfunction]
pub(super) fn sha1_hex(py: Python<'_>, data: PyBuffer<u8>) -> PyResult<String> {
    let d = bytes_of(&data)?;
    Ok(if d.len() > DETACH_ABOVE {
        py.detach(|| hash::sha1_hex(d))
    } else {
        hash::sha1_hex(d)
    })
}

/// The 16 hex digits a payload ABI adds to a checkpoint's name
/// (`<sha1>-<tag>.kv`: docs/FORMAT.md, "File names").
#[pyfunction]
pub(super) fn model_tag(abi: &str) -> String {
    hash::to_hex(&crate::name::model_tag(abi))
}

/// Hex SHA-1 of `data[:n]` for every `n` in `lengths`, in one pass over
/// `data`; `None` where `n > len(data)`.
#[pyfunction]
pub(super) fn sha1_prefixes(
    py: Python<'_>,
    data: PyBuffer<u8>,
    lengths: Vec<usize>,
) -> PyResult<Vec<Option<String>>> {
    let d = bytes_of(&data)?;
    let r = py.detach(|| hash::sha1_prefixes(d, &lengths));
    Ok(r.into_iter().map(|o| o.map(|x| hash::to_hex(&x))).collect())
}

/// True when `prefix` is a byte prefix of `text`.
#[pyfunction]
pub(super) fn is_byte_prefix(
    py: Python<'_>,
    prefix: PyBuffer<u8>,
    text: PyBuffer<u8>,
) -> PyResult<bool> {
    let (p, t) = (bytes_of(&prefix)?, bytes_of(&text)?);
    Ok(if p.len() > DETACH_ABOVE {
        py.detach(|| hash::is_byte_prefix(p, t))
    } else {
        hash::is_byte_prefix(p, t)
    })
}

/// Length of the longest common byte prefix of `a` and `b`.
#[pyfunction]
pub(super) fn common_prefix_len(
    py: Python<'_>,
    a: PyBuffer<u8>,
    b: PyBuffer<u8>,
) -> PyResult<usize> {
    let (a, b) = (bytes_of(&a)?, bytes_of(&b)?);
    Ok(if a.len().min(b.len()) > DETACH_ABOVE {
        py.detach(|| hash::common_prefix_len(a, b))
    } else {
        hash::common_prefix_len(a, b)
    })
}

/// Length of the common prefix of two token lists.
#[pyfunction]
pub(super) fn common_token_prefix(a: Vec<u32>, b: Vec<u32>) -> usize {
    hash::common_prefix_len_u32(&a, &b)
}

/// The namespace a key text's preamble names, the index's reading
/// ([`crate::index::namespace_of`]); None for the default namespace and for
/// a start that is not a whole, well-formed preamble.
#[pyfunction]
pub(super) fn namespace_of(text: PyBuffer<u8>) -> PyResult<Option<String>> {
    Ok(crate::index::namespace_of(bytes_of(&text)?).map(str::to_owned))
}
