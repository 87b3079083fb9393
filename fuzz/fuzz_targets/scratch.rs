//! The fuzz targets' scratch directory: `$DS4_FUZZ_SCRATCH`
//! (`scripts/fuzz.sh` sets and removes it), else tmpfs when there is one,
//! else the temp dir. The targets write a file per input.

use std::path::{Path, PathBuf};

/// A fresh directory for `target` in this process, created on first use.
pub fn dir(target: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = match std::env::var_os("DS4_FUZZ_SCRATCH") {
        Some(d) => PathBuf::from(d),
        None if shm.is_dir() => shm.to_path_buf(),
        None => std::env::temp_dir(),
    };
    let d = base.join(format!("ds4-fuzz-{target}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
