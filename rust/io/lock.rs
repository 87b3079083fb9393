//! An advisory `flock` on an open file, held until dropped: what
//! serialises [`crate::touch::touch`]'s read-modify-write of a file's hit
//! count across processes.

use crate::error::{Error, Result};
use std::fs::File;

/// An advisory `flock` held until dropped.
pub struct FileLock<'a> {
    file: &'a File,
}

impl<'a> FileLock<'a> {
    pub fn exclusive(file: &'a File) -> Result<Self> {
        use std::os::unix::io::AsRawFd;
        loop {
            // SAFETY: flock on a valid, open descriptor; no memory is passed.
            let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                return Ok(FileLock { file });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::Io(e));
            }
        }
    }
}

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        use std::os::unix::io::AsRawFd;
        // SAFETY: as above.
        unsafe {
            libc::flock(self.file.as_raw_fd(), libc::LOCK_UN);
        }
    }
}
