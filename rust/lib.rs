//! ds4 core: the checkpoint format (v2 written and read, ds4's v1 read), the
//! verification pipeline, SHA-1 and prefix helpers, zero-copy payload reads
//! and durable writes, and the content-addressed KV block files (`blocks`).
//! Pure Rust: builds, tests, benches and fuzzes without Python. The `PyO3`
//! glue lives in `py/` behind the `python` feature.

pub mod blocks;
pub mod blocks_open;
pub mod decode;
pub mod error;
pub mod format;
pub mod hash;
pub mod index;
pub mod io;
pub mod name;
pub mod payload;
pub mod touch;
pub mod verify;

#[cfg(feature = "python")]
mod py;

pub use error::{Class, Error, Result};
pub use format::writer::{write_checkpoint, TensorSrc, WriteMeta, WriteOptions, Written};
pub use format::writer_v3::Compression;
pub use format::{Dtype, Header, TensorInfo};
pub use touch::touch;
pub use verify::{open, Checkpoint, VerifyOptions};
