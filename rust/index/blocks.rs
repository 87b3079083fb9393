//! Which blocks each indexed manifest names (docs/FORMAT.md, "The index
//! file"): recorded by the store for the version of the file it read them
//! from ([`Index::set_blocks`]: only while the entry has that stat key), kept
//! with the entry while its file is unchanged (a hit's header update keeps
//! them), dropped with it when it is read again, replaced or forgotten, and
//! persisted in the index file's block section so that an open knows every
//! manifest's blocks without reading its table.

use super::file::bad;
use super::{BlockList, BlockName, Entry, Index, StatKey};
use crate::error::{Error, Result};
use crate::format::bytes::Cursor;
use crate::name::FileId;
use std::collections::HashMap;

impl Index {
    /// The blocks `d`'s file names, when recorded for the version indexed.
    pub fn blocks_of(&self, d: &FileId) -> Option<BlockList> {
        self.entries.get(d).and_then(|e| e.blocks.clone())
    }
    /// Records the blocks `d`'s file names (empty: a single file), read from
    /// the version whose stat key is `key`: only while `d` is indexed with
    /// that key. True when the entry's record changed.
    pub fn set_blocks(&mut self, d: &FileId, key: StatKey, blocks: &[BlockName]) -> bool {
        match self.entries.get_mut(d) {
            Some(e) if e.key == key && e.blocks.as_deref() != Some(blocks) => {
                e.blocks = Some(blocks.into());
                true
            }
            _ => false,
        }
    }
    /// Heap bytes of the recorded block lists.
    pub(super) fn block_bytes(&self) -> usize {
        self.entries
            .values()
            .filter_map(|e| e.blocks.as_ref())
            .map(|b| b.len() * 32 + 16)
            .sum()
    }
}

/// The block section of the index file, after the records: `u32` count of
/// block names, the names (32 bytes each), `u32` count of lists, then per
/// list `u32` record (the entry's position among the entry records), `u32`
/// length and that many `u32` indexes into the names.
pub(super) fn encode_blocks<'a>(entries: impl Iterator<Item = &'a Entry>, v: &mut Vec<u8>) {
    let mut names: Vec<&BlockName> = Vec::new();
    let mut at: HashMap<&BlockName, u32> = HashMap::new();
    let mut lists: Vec<(u32, Vec<u32>)> = Vec::new();
    for (i, e) in entries.enumerate() {
        let Some(b) = e.blocks.as_ref() else { continue };
        let list = b
            .iter()
            .map(|n| {
                *at.entry(n).or_insert_with(|| {
                    names.push(n);
                    u32::try_from(names.len() - 1).unwrap_or(u32::MAX)
                })
            })
            .collect();
        lists.push((u32::try_from(i).unwrap_or(u32::MAX), list));
    }
    put_u32(v, names.len());
    for n in names {
        v.extend_from_slice(n);
    }
    put_u32(v, lists.len());
    for (i, list) in lists {
        v.extend_from_slice(&i.to_le_bytes());
        put_u32(v, list.len());
        for x in list {
            v.extend_from_slice(&x.to_le_bytes());
        }
    }
}

fn put_u32(v: &mut Vec<u8>, n: usize) {
    v.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

/// Reads the block section into the entries `order` lists (the entry
/// records' names, in the file's order): every count within the bytes left,
/// every record and name index in bounds, no record listed twice.
pub(super) fn decode_blocks(
    r: &mut Cursor<'_, fn(&str) -> Error>,
    order: &[FileId],
    idx: &mut Index,
) -> Result<()> {
    let n_names = r.u32("index")? as usize;
    if n_names.checked_mul(32).is_none_or(|x| x > r.remaining()) {
        return Err(bad("block count out of bounds"));
    }
    let mut names: Vec<BlockName> = Vec::with_capacity(n_names);
    for _ in 0..n_names {
        let n = r.take(32, "index")?;
        names.push(n.try_into().map_err(|_| bad("truncated"))?);
    }
    let n_lists = r.u32("index")? as usize;
    if n_lists > order.len() {
        return Err(bad("block lists out of bounds"));
    }
    for _ in 0..n_lists {
        let rec = r.u32("index")? as usize;
        let len = r.u32("index")? as usize;
        if len.checked_mul(4).is_none_or(|x| x > r.remaining()) {
            return Err(bad("block list out of bounds"));
        }
        let mut list: Vec<BlockName> = Vec::with_capacity(len);
        for _ in 0..len {
            let i = r.u32("index")? as usize;
            list.push(
                *names
                    .get(i)
                    .ok_or_else(|| bad("block reference out of bounds"))?,
            );
        }
        let e = order
            .get(rec)
            .and_then(|d| idx.entries.get_mut(d))
            .ok_or_else(|| bad("block list of no record"))?;
        if e.blocks.is_some() {
            return Err(bad("a record's blocks listed twice"));
        }
        e.blocks = Some(list.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;
