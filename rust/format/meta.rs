//! The metadata both v2 and v3 open with (docs/FORMAT.md §1.3): the ABI
//! string and the tensor table. v3's frame table follows it
//! ([`super::v3`]); each version's reader checks what is left after it.
#![deny(clippy::indexing_slicing)]

use super::bytes::Cursor;
use super::{Dtype, TensorInfo, MAX_ABI, MAX_NDIM, MAX_TENSORS};
use crate::error::{Error, Result};

pub(crate) fn ends_inside(what: &str) -> Error {
    Error::BadMetadata(format!("metadata ends inside {what}"))
}

/// Metadata: `u16 abi_len, abi, u16 n_tensors`, then per tensor
/// `u8 name_len, name, u8 dtype, u8 ndim, u64 shape[ndim], u64 offset, u64 nbytes`.
pub fn decode_meta(meta: &[u8]) -> Result<(String, Vec<TensorInfo>)> {
    let mut c = Cursor::new(meta, ends_inside);
    let out = decode_meta_with(&mut c)?;
    let unused = c.remaining();
    if unused != 0 {
        return Err(Error::BadMetadata(format!(
            "{unused} unused metadata bytes"
        )));
    }
    Ok(out)
}

/// The ABI string and the tensor table, read from `c` (v3's frame table
/// follows them).
pub(crate) fn decode_meta_with<E: Fn(&str) -> Error>(
    c: &mut Cursor<'_, E>,
) -> Result<(String, Vec<TensorInfo>)> {
    let abi_len = c.u16("abi length")? as usize;
    if abi_len > MAX_ABI {
        return Err(Error::HeaderTooLarge {
            what: "ABI string",
            len: abi_len as u64,
            max: MAX_ABI as u64,
        });
    }
    let abi = std::str::from_utf8(c.take(abi_len, "abi")?)
        .map_err(|_| Error::BadMetadata("ABI string is not UTF-8".into()))?
        .to_owned();
    let n = c.u16("tensor count")? as usize;
    if n > MAX_TENSORS {
        return Err(Error::HeaderTooLarge {
            what: "tensor table",
            len: n as u64,
            max: MAX_TENSORS as u64,
        });
    }
    let mut tensors = Vec::with_capacity(n);
    for i in 0..n {
        let name_len = c.u8("tensor name length")? as usize;
        let name = std::str::from_utf8(c.take(name_len, "tensor name")?)
            .map_err(|_| Error::BadMetadata(format!("tensor {i} name is not UTF-8")))?
            .to_owned();
        let code = c.u8("dtype")?;
        let dtype = Dtype::from_code(code).ok_or_else(|| {
            Error::BadMetadata(format!("tensor {name:?} has unknown dtype {code}"))
        })?;
        let ndim = c.u8("ndim")? as usize;
        if ndim > MAX_NDIM {
            return Err(Error::BadMetadata(format!(
                "tensor {name:?} has {ndim} dimensions (max {MAX_NDIM})"
            )));
        }
        let mut shape = Vec::with_capacity(ndim);
        for _ in 0..ndim {
            shape.push(c.u64("shape")?);
        }
        let offset = c.u64("offset")?;
        let nbytes = c.u64("nbytes")?;
        tensors.push(TensorInfo {
            name,
            dtype,
            shape,
            offset,
            nbytes,
        });
    }
    Ok((abi, tensors))
}
