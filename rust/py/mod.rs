//! The `PyO3` glue: the only code that knows about Python. Errors become the
//! classes of `ds4.errors` (built there by `from_core`, see [`errors`]), heavy
//! work runs with the GIL released, and payload tensors are exported through
//! the buffer protocol straight from the map ([`buffer`]: numpy's
//! `frombuffer` then keeps the map alive through the array's base).
//!
//! The extension module `ds4._core` is declared here; its stub is
//! `python/ds4/_core.pyi`.

// PyO3 extracts every argument by value (`PyBuffer`, `PathBuf`, `Vec`,
// `Bound`); the signatures are the Python API, not a borrowing choice.
#![allow(clippy::needless_pass_by_value)]

mod block;
mod buffer;
mod checkpoint;
mod errors;
mod hash;
mod index;

use pyo3::prelude::*;

#[pymodule(gil_used = false)]
mod _core {
    #[pymodule_export]
    use super::block::{
        block_names, block_root, block_table, open_blocks, open_blocks_into, read_block_header,
        read_block_table, verify_block, write_block, xxh3_64,
    };
    #[pymodule_export]
    use super::buffer::PayloadView;
    #[pymodule_export]
    use super::checkpoint::{
        derive_auth_key, open_checkpoint, sync_dir, touch, write_checkpoint, PyCheckpoint,
    };
    #[pymodule_export]
    use super::hash::{
        common_prefix_len, common_token_prefix, is_byte_prefix, model_tag, namespace_of, sha1_hex,
        sha1_prefixes,
    };
    #[pymodule_export]
    use super::index::PyPrefixes;
    #[pymodule_export]
    use super::index::PyStoreIndex;
    use crate::format;
    use pyo3::prelude::*;

    /// The format version this build writes.
    #[pymodule_export]
    const FORMAT_VERSION: u8 = format::VERSION_V2;
    /// Payload and every tensor start on a multiple of this.
    #[pymodule_export]
    const ALIGN: u64 = format::ALIGN;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("REASONS", format::REASONS.to_vec())?;
        Ok(())
    }
}
