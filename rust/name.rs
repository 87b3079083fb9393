//! A checkpoint's file name (docs/FORMAT.md, "File names"): what a
//! directory entry says about the file before it is opened.
//!
//! Two forms are read: `<sha1>.kv`, the SHA-1 of the key text alone (what
//! every release before the per-model names wrote: one file per text, the
//! first model to save a text owned its name), and `<sha1>-<model>.kv`,
//! where `<model>` is [`model_tag`] of the payload ABI the file records (16
//! lowercase hex digits), so models whose key texts are the same bytes keep
//! one file each. New files are written in the second form. The 40 digits
//! of the SHA-1 are read in either case; the tag only in lower case.

use crate::error::{Error, Result};
use crate::format::Header;
use crate::hash::{self, Sha1Digest};
use std::path::Path;

/// The first 8 bytes of the SHA-1 of a payload ABI string.
pub type ModelTag = [u8; 8];

/// Characters of a tag in a name.
pub const TAG_HEX: usize = 16;

/// The tag a payload ABI gives a file's name: the first 8 bytes of the
/// SHA-1 of its UTF-8 bytes.
pub fn model_tag(abi: &str) -> ModelTag {
    let d = hash::sha1(abi.as_bytes());
    let mut t = [0u8; 8];
    t.copy_from_slice(&d[..8]);
    t
}

/// What a checkpoint's name identifies: the SHA-1 of its key text and, for
/// a per-model name, the tag of its ABI. The index's key: two files of one
/// text are two entries when their tags differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub digest: Sha1Digest,
    pub model: Option<ModelTag>,
}

impl FileId {
    /// The per-model id of a text's digest and an ABI: the name new files get.
    pub fn for_abi(digest: Sha1Digest, abi: &str) -> Self {
        FileId {
            digest,
            model: Some(model_tag(abi)),
        }
    }

    /// Parses `<40 hex>.kv` or `<40 hex>-<16 lowercase hex>.kv`.
    pub fn parse(name: &str) -> Option<Self> {
        let stem = name.strip_suffix(".kv")?;
        let (sha, model) = match stem.split_once('-') {
            None => (stem, None),
            Some((sha, tag)) => (sha, Some(parse_tag(tag)?)),
        };
        Some(FileId {
            digest: hash::parse_hex_digest(sha)?,
            model,
        })
    }

    /// The file name, the SHA-1's digits in the case `case` (bit i: digit
    /// i upper case).
    pub fn name(&self, case: u64) -> String {
        let mut hex = hash::to_hex(&self.digest).into_bytes();
        for (i, c) in hex.iter_mut().enumerate() {
            if case & (1 << i) != 0 {
                c.make_ascii_uppercase();
            }
        }
        if let Some(t) = &self.model {
            hex.push(b'-');
            hex.extend_from_slice(hash::to_hex(t).as_bytes());
        }
        hex.extend_from_slice(b".kv");
        String::from_utf8(hex).unwrap_or_default()
    }
}

/// `<40 hex>.kv` or `<40 hex>-<16 hex>.kv` -> what the name says
/// ([`FileId`]).
pub fn id_from_name(path: &Path) -> Result<FileId> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    FileId::parse(name).ok_or_else(|| Error::BadName {
        name: name.to_owned(),
    })
}

/// A per-model name's tag is the tag of the ABI the header records. A file
/// under another model's name is `abi_mismatch` (incompatible: kept, never
/// loaded), not corrupt: a release that tags names otherwise must not have
/// its files deleted here.
pub fn check_name_model(id: &FileId, header: &Header) -> Result<()> {
    match id.model {
        Some(t) if t != model_tag(&header.abi) => Err(Error::AbiMismatch {
            found: header.abi.clone(),
            expected: format!("the one its name's model tag {} names", hash::to_hex(&t)),
        }),
        _ => Ok(()),
    }
}

fn parse_tag(s: &str) -> Option<ModelTag> {
    let b = s.as_bytes();
    if b.len() != TAG_HEX || !b.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut t = [0u8; 8];
    for (i, o) in t.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_in_both_forms() {
        let d = hash::sha1(b"abc");
        let old = FileId::parse("a9993e364706816aba3e25717850c26c9cd0d89d.kv").unwrap();
        assert_eq!(
            old,
            FileId {
                digest: d,
                model: None
            }
        );
        assert_eq!(old.name(0), "a9993e364706816aba3e25717850c26c9cd0d89d.kv");
        let id = FileId::for_abi(d, "llamacpp x");
        let name = id.name(0);
        assert_eq!(name.len(), 40 + 1 + 16 + 3);
        assert_eq!(FileId::parse(&name), Some(id));
        // the SHA-1 in either case, the tag in lower case only
        let upper = id.name(1);
        assert!(upper.starts_with('A'));
        assert_eq!(FileId::parse(&upper), Some(id));
        for bad in [
            "a9993e364706816aba3e25717850c26c9cd0d89d-.kv",
            "a9993e364706816aba3e25717850c26c9cd0d89d-0123456789ABCDEF.kv",
            "a9993e364706816aba3e25717850c26c9cd0d89d-0123456789abcde.kv",
            "a9993e364706816aba3e25717850c26c9cd0d89d-0123456789abcdef0.kv",
            "a9993e364706816aba3e25717850c26c9cd0d89d-0123456789abcdef-0123456789abcdef.kv",
            "a9993e364706816aba3e25717850c26c9cd0d89d-+123456789abcdef.kv",
            "a9993e364706816aba3e25717850c26c9cd0d89d",
        ] {
            assert_eq!(FileId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_tag_is_the_abis_sha1_head() {
        // docs/FORMAT.md's test vector
        assert_eq!(hash::to_hex(&model_tag("abc")), "a9993e364706816a");
        assert_ne!(model_tag("llamacpp a"), model_tag("llamacpp b"));
    }
}
