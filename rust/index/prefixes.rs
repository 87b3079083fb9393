//! The lazy lookup's cursor ([`Prefixes`], made by
//! [`super::Index::prefixes`]): the table rows walked down from the
//! longest text no longer than the prompt, the SHA-1 of the prompt taken
//! once up to the first candidate, with a state kept every
//! [`SNAPSHOT_STRIDE`] bytes so each later candidate costs a stride at most.

use super::{tail_of, Table};
use crate::hash::Sha1Digest;
use crate::name::FileId;
use sha1::{Digest, Sha1};
use std::sync::Arc;

/// How far apart the pass keeps its SHA-1 states: a candidate below the
/// first is finalised from the state at or below its length, hashing fewer
/// than this many bytes. 4 KiB: the states of a 1 MiB prompt take 256 × the
/// size of a SHA-1 state (about 26 KiB), and a later candidate costs a few
/// microseconds, well under the load that rejected the one before it.
pub const SNAPSHOT_STRIDE: usize = 4096;

/// A lookup in progress (see [`super::Index::prefixes`]). It holds the
/// table it started from, so the index may change under it: an entry
/// added since is not offered, one removed since is skipped.
#[derive(Debug)]
pub struct Prefixes {
    pub(super) table: Arc<Table>,
    pub(super) abi: Option<u32>,
    pub(super) min_tokens: u32,
    pub(super) ctx: Option<u32>,
    /// Rows `[0, next)` are still to visit, from `next - 1` down.
    pub(super) next: usize,
    pub(super) prompt_len: usize,
    /// `snaps[k]`: the SHA-1 state after `k * SNAPSHOT_STRIDE` bytes.
    pub(super) snaps: Vec<Sha1>,
    /// The last length hashed and its digest (rows of one length share it).
    pub(super) last: Option<(usize, Sha1Digest)>,
}

impl Prefixes {
    /// The digest of the next row that passes the tail, the filters and
    /// the hash (a stored prefix of `prompt`), or None when none is left.
    /// `prompt` must be the bytes the cursor was made for.
    ///
    /// # Panics
    ///
    /// When `prompt` is not as long as the prompt the cursor was made for.
    pub fn next_digest(&mut self, prompt: &[u8]) -> Option<FileId> {
        assert_eq!(prompt.len(), self.prompt_len, "a cursor is for one prompt");
        let t = Arc::clone(&self.table);
        let q = super::Query {
            min_tokens: self.min_tokens,
            abi: None,
            ctx: self.ctx,
        };
        while self.next > 0 {
            self.next -= 1;
            let i = self.next;
            let len = t.lens[i] as usize;
            if tail_of(prompt, len) != t.tails[i] || !t.passes(i, &q, self.abi) {
                continue;
            }
            if self.digest_at(prompt, len) == t.digests[i].digest {
                return Some(t.digests[i]);
            }
        }
        None
    }

    /// How many rows are still to visit (for tests: a cursor stops early).
    pub fn remaining(&self) -> usize {
        self.next
    }

    /// How many bytes of the prompt the pass has hashed so far (its states
    /// reach that far; for tests and benches).
    pub fn hashed(&self) -> usize {
        self.snaps.len().saturating_sub(1) * SNAPSHOT_STRIDE
    }

    /// The SHA-1 of `prompt[..len]`: from the pass's state at or below
    /// `len` (the pass extended to it first when it does not reach), then
    /// fewer than [`SNAPSHOT_STRIDE`] bytes.
    fn digest_at(&mut self, prompt: &[u8], len: usize) -> Sha1Digest {
        if let Some((l, d)) = self.last {
            if l == len {
                return d;
            }
        }
        let k = len / SNAPSHOT_STRIDE;
        if self.snaps.is_empty() {
            self.snaps.reserve(k + 1);
            self.snaps.push(Sha1::new());
        }
        while self.snaps.len() <= k {
            let j = self.snaps.len();
            let mut h = self.snaps[j - 1].clone();
            h.update(&prompt[(j - 1) * SNAPSHOT_STRIDE..j * SNAPSHOT_STRIDE]);
            self.snaps.push(h);
        }
        let mut h = self.snaps[k].clone();
        h.update(&prompt[k * SNAPSHOT_STRIDE..len]);
        let d: Sha1Digest = h.finalize().into();
        self.last = Some((len, d));
        d
    }
}

#[cfg(test)]
mod tests;
