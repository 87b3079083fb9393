//! Little-endian readers for untrusted bytes, shared by the v1 and v2
//! readers: fixed-offset reads (`le_*`, [`byte`]) for the fixed headers and
//! one [`Cursor`] for sequential fields (the v2 metadata, the DSV4 payload
//! header of a v1 file, the index file). None of them can panic: a fixed-offset read past
//! the end yields zero (its callers have checked the length first), a cursor
//! read past the end fails with the error its reader chose.

use crate::error::{Error, Result};

/// The `N` bytes at `at`, or zeros when they are not all inside `b`.
fn array<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    at.checked_add(N)
        .and_then(|end| b.get(at..end))
        .and_then(|s| s.try_into().ok())
        .unwrap_or([0; N])
}

pub(crate) fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(array(b, at))
}

pub(crate) fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(array(b, at))
}

pub(crate) fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(array(b, at))
}

pub(crate) fn byte(b: &[u8], at: usize) -> u8 {
    b.get(at).copied().unwrap_or(0)
}

/// Reads fields one after the other. Every read is bounds-checked; when
/// the bytes run out, the read fails with the error the reader chose
/// (`short`, given the name of the field that did not fit).
pub(crate) struct Cursor<'a, E> {
    b: &'a [u8],
    at: usize,
    short: E,
}

impl<'a, E: Fn(&str) -> Error> Cursor<'a, E> {
    pub(crate) fn new(b: &'a [u8], short: E) -> Self {
        Cursor { b, at: 0, short }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.b.len().saturating_sub(self.at)
    }

    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).ok_or(Error::SizeOverflow)?;
        let s = self.b.get(self.at..end).ok_or_else(|| (self.short)(what))?;
        self.at = end;
        Ok(s)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(byte(self.take(1, what)?, 0))
    }

    pub(crate) fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(le_u16(self.take(2, what)?, 0))
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(le_u32(self.take(4, what)?, 0))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(le_u64(self.take(8, what)?, 0))
    }

    pub(crate) fn i64(&mut self, what: &str) -> Result<i64> {
        Ok(i64::from_le_bytes(array(self.take(8, what)?, 0)))
    }
}
