//! Authenticated checkpoints (FORMAT.md §1.9): a keyed BLAKE3 MAC over
//! everything a checkpoint says, in a 32-byte trailer after the payload.
//!
//! A checksum finds damage; anyone can recompute it. The MAC can only be
//! made with the key: with a key configured, a checkpoint whose MAC is
//! missing or wrong never loads, however well its checksums match.
// The MAC input's header copy is a fixed 96-byte array indexed by constant
// ranges inside it.
#![allow(clippy::indexing_slicing)]

use super::V2_FIXED;

/// Header byte 52: how the checkpoint is authenticated (0: not at all).
pub const AUTH_OFFSET: usize = 52;
/// Header byte 52 value: a BLAKE3 keyed-mode MAC trailer.
pub const AUTH_BLAKE3: u8 = 1;
/// Length of the MAC trailer.
pub const MAC_BYTES: u64 = 32;
/// BLAKE3 `derive_key` context that turns a key file's bytes into the MAC key.
pub const KEY_CONTEXT: &str = "ds4 checkpoint authentication key v1";

/// A 32-byte MAC key (see [`derive_key`]).
pub type MacKey = [u8; 32];

/// The MAC key for the secret bytes of a key file.
pub fn derive_key(secret: &[u8]) -> MacKey {
    blake3::derive_key(KEY_CONTEXT, secret)
}

/// A MAC being computed: the header part is fed at creation, then the
/// text, the padding and the payload, in file order.
pub struct MacState(blake3::Hasher);

impl MacState {
    /// Starts the MAC with the fixed header (bytes 12..16 and 32..40, the
    /// mutable `hits` and `last_used`, and 80..96, the two checksums, read
    /// as zero) and the metadata.
    pub fn new(key: &MacKey, fixed: &[u8], meta: &[u8]) -> Self {
        let mut f = [0u8; V2_FIXED];
        let n = fixed.len().min(V2_FIXED);
        f[..n].copy_from_slice(&fixed[..n]);
        for r in [12..16usize, 32..40, 80..96] {
            f[r].fill(0);
        }
        let mut h = blake3::Hasher::new_keyed(key);
        h.update(&f);
        h.update(meta);
        MacState(h)
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finalize(&self) -> [u8; 32] {
        *self.0.finalize().as_bytes()
    }

    /// Compares with a stored MAC in constant time.
    pub fn matches(&self, stored: &[u8]) -> bool {
        let Ok(stored) = <[u8; 32]>::try_from(stored) else {
            return false;
        };
        self.0.finalize() == blake3::Hash::from_bytes(stored)
    }
}
