//! The heap buffer a payload is copied or decoded into.

use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};

/// A 64-byte-aligned heap buffer of zeros: from the global allocator
/// ([`AlignedBuf::zeroed`], for a buffer about to be filled whole), or,
/// from [`MAP_ABOVE`] bytes, an anonymous private map whose pages are
/// committed only when first written ([`AlignedBuf::lazy`]: a buffer sized
/// from a header costs only what is written into it). (The global
/// allocator's zeroed allocation at an alignment above 16 allocates, then
/// writes every byte with zero, committing the whole buffer.)
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    mapped: bool,
}

/// From this many bytes an [`AlignedBuf::lazy`] is an anonymous map.
pub const MAP_ABOVE: usize = 1 << 20;

// SAFETY: AlignedBuf uniquely owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access is read-only.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> Result<AlignedBuf> {
        Self::alloc(len, false)
    }

    /// Zeros committed lazily: page by page as they are written (from
    /// [`MAP_ABOVE`] bytes).
    pub(crate) fn lazy(len: usize) -> Result<AlignedBuf> {
        Self::alloc(len, true)
    }

    fn alloc(len: usize, lazy: bool) -> Result<AlignedBuf> {
        let oom = || {
            Error::Io(std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                "cannot allocate payload buffer",
            ))
        };
        if len == 0 {
            // A dangling but 64-aligned pointer, so empty views stay aligned.
            return Ok(AlignedBuf {
                ptr: std::ptr::without_provenance_mut(64),
                len: 0,
                mapped: false,
            });
        }
        if lazy && len >= MAP_ABOVE {
            // SAFETY: a fresh private anonymous mapping of `len` bytes (no
            // file, no fixed address): zero-filled pages, ours alone.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(oom());
            }
            return Ok(AlignedBuf {
                ptr: ptr.cast::<u8>(),
                len,
                mapped: true,
            });
        }
        let layout = Layout::from_size_align(len, 64).map_err(|_| Error::SizeOverflow)?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(oom());
        }
        Ok(AlignedBuf {
            ptr,
            len,
            mapped: false,
        })
    }
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes, or dangling with len 0.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `zeroed` with exactly this address and length.
            unsafe {
                libc::munmap(self.ptr.cast::<libc::c_void>(), self.len);
            }
        } else if self.len > 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, 64)) }
        }
    }
}
