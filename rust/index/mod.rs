//! The store's index: what the headers of a directory's checkpoints say,
//! kept in memory, looked up in one pass over a prompt, and persisted in the
//! directory (docs/FORMAT.md, "The index file").
//!
//! A file enters the index from its header alone ([`read_entry`]: the fixed
//! header and metadata, checked as a load checks them, and the last 8 bytes
//! of its text, the lookup's filter); its text is never hashed here. The
//! index only proposes candidates: every load runs the whole pipeline
//! ([`crate::verify::open`]) again, so an index that lies (stale, torn,
//! foreign, tampered) can cost a miss or a rejected candidate, never a wrong
//! load.
//!
//! Each entry also records its cache namespace ([`namespace_of`]: the key
//! text's preamble, read with the header from the text's first
//! [`NS_READ`] bytes), so the store's eviction policy can tell tenants
//! apart without reading any file again. Like every header fact it is a
//! claim of the file's: the load pipeline verifies the whole text (and the
//! name is its SHA-1), so a lying preamble cannot make a file load for
//! another namespace's prompt; it can only misattribute its own bytes.
//! An index read from its file is the index's own claim on top: an open
//! checks every record against its file ([`Index::check_files`]: the stat
//! key, the fixed header's facts, the ABI and the namespace preamble, one
//! or two small reads a file), so a forged `.ds4.index` cannot move a
//! file's bytes to another namespace past the open.
//!
//! Lookup ([`Index::lookup`]) keeps the entries' text lengths and tails in
//! two arrays sorted by length: an entry is a candidate when its tail equals
//! the prompt's bytes just before its length (one comparison per entry, no
//! hashing), and only the candidates' lengths are hashed, in one SHA-1 pass
//! ([`crate::hash::sha1_prefixes`]). The ladder's lookup is lazy
//! ([`Index::prefixes`], a [`Prefixes`] cursor): the table is walked down
//! from the longest text no longer than the prompt, the prompt is hashed
//! once up to the first candidate (a SHA-1 state kept every
//! [`SNAPSHOT_STRIDE`] bytes), and a later match is finalised only when it
//! is asked for, from the state below it: the best match costs one pass
//! whatever the number of stored prefixes.

mod blocks;
mod check;
mod entry;
mod file;
mod lookup;
mod prefixes;

pub use check::*;
pub use entry::*;
pub use file::*;
pub use lookup::*;
pub use prefixes::*;

#[cfg(test)]
mod tests;
