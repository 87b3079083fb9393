//! A hit recorded in a checkpoint's mutable fields (`hits`, `last_used`,
//! outside the header checksum), under an exclusive `flock`
//! ([`FileLock`]): the one write ds4 makes to a verified file.

use crate::error::{Error, Result};
use crate::format::bytes::le_u32;
use crate::format::{v2, HITS_OFFSET, LAST_USED_OFFSET, VERSION_V1, VERSION_V2, VERSION_V3};
use crate::io::{open_regular, pread_vec, FileLock};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Records a hit: `hits += 1`, `last_used = now`, under an exclusive `flock`
/// so concurrent hits from several processes are never lost. Only the
/// mutable fields are written; they are outside the header checksum.
///
/// A file another load holds a read lease on cannot be opened for writing
/// until that load gives it back (milliseconds): the open is retried for up
/// to [`TOUCH_WAIT_MS`], then the hit is given up (`Io`, `EWOULDBLOCK`).
pub fn touch(path: &Path, now: u64) -> Result<u32> {
    let (file, file_len) = open_for_touch(path)?;
    let lock = FileLock::exclusive(&file)?;
    let head = pread_vec(&file, 0, file_len.min(40), file_len)?;
    let v = v2::sniff(&head, file_len)?;
    if v != VERSION_V1 && v != VERSION_V2 && v != VERSION_V3 {
        return Err(Error::UnsupportedVersion { found: v });
    }
    if file_len < 40 {
        return Err(Error::TooShort {
            need: 40,
            have: file_len,
        });
    }
    let hits = le_u32(&head, HITS_OFFSET).saturating_add(1);
    file.write_all_at(&hits.to_le_bytes(), HITS_OFFSET as u64)?;
    file.write_all_at(&now.to_le_bytes(), LAST_USED_OFFSET as u64)?;
    drop(lock);
    Ok(hits)
}

/// How long [`touch`] waits for a lease on the file to be given back.
pub const TOUCH_WAIT_MS: u64 = 2000;

fn open_for_touch(path: &Path) -> Result<(File, u64)> {
    let mut waited = 0;
    let mut step = 1;
    loop {
        match open_regular(path, true) {
            Err(Error::Io(e))
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) && waited < TOUCH_WAIT_MS =>
            {
                std::thread::sleep(std::time::Duration::from_millis(step));
                waited += step;
                step = (step * 2).min(50);
            }
            r => return r,
        }
    }
}
