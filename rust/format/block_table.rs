//! A manifest's block table (FORMAT.md §7.3): which block files, in order,
//! hold a checkpoint's KV bytes. The Python side stores it as the uint8
//! tensor `ds4.blocks` of a v2/v3 checkpoint, whose own checksums (and MAC)
//! cover it; a table that does not decode is `block_table` (the manifest
//! itself is damaged).

use super::block::{BlockName, MAX_BLOCK_PAYLOAD};
use super::bytes::Cursor;
use crate::error::{Error, Result};

pub const TABLE_MAGIC: [u8; 4] = *b"KVBT";
pub const TABLE_VERSION: u32 = 1;
/// Size of the table's head (magic, version, count, `block_tokens`).
pub const TABLE_HEAD: usize = 16;
/// Size of one record.
pub const TABLE_RECORD: usize = 56;
/// The most records a table may hold.
pub const MAX_TABLE_BLOCKS: usize = 1 << 20;

/// One block of a table: its name and what its file must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub name: BlockName,
    pub n_tokens: u32,
    pub payload_len: u64,
    /// xxh3-64 of the block's payload.
    pub checksum: u64,
}

/// A decoded block table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Tokens of a full block (> 0).
    pub block_tokens: u32,
    pub records: Vec<Record>,
}

fn bad(detail: String) -> Error {
    Error::BlockTable(detail)
}

/// The checks a record passes in both directions (encode and decode).
fn check_record(i: usize, r: &Record) -> Result<()> {
    if r.n_tokens == 0 {
        return Err(bad(format!("record {i} holds no tokens")));
    }
    if r.payload_len > MAX_BLOCK_PAYLOAD {
        return Err(bad(format!(
            "record {i} declares {} payload bytes, more than the {MAX_BLOCK_PAYLOAD} a block may hold",
            r.payload_len
        )));
    }
    Ok(())
}

fn check_head(block_tokens: u32, count: usize) -> Result<()> {
    if block_tokens == 0 {
        return Err(bad("block_tokens is 0".to_owned()));
    }
    if count > MAX_TABLE_BLOCKS {
        return Err(bad(format!(
            "{count} records, more than the {MAX_TABLE_BLOCKS} a table may hold"
        )));
    }
    Ok(())
}

impl Table {
    /// The table's bytes; `BlockTable` for a table [`Table::decode`] would
    /// refuse (no `block_tokens`, too many records, a record of no tokens or
    /// of too many bytes).
    pub fn encode(&self) -> Result<Vec<u8>> {
        check_head(self.block_tokens, self.records.len())?;
        let count = u32::try_from(self.records.len()).map_err(|_| Error::SizeOverflow)?;
        let mut out = Vec::with_capacity(TABLE_HEAD + TABLE_RECORD * self.records.len());
        out.extend_from_slice(&TABLE_MAGIC);
        out.extend_from_slice(&TABLE_VERSION.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&self.block_tokens.to_le_bytes());
        for (i, r) in self.records.iter().enumerate() {
            check_record(i, r)?;
            out.extend_from_slice(&r.name);
            out.extend_from_slice(&r.n_tokens.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&r.payload_len.to_le_bytes());
            out.extend_from_slice(&r.checksum.to_le_bytes());
        }
        Ok(out)
    }

    /// Decodes a table with every check: the magic, the version, the count
    /// bound, `block_tokens > 0`, the exact length `16 + 56 × count`, zero
    /// reserved fields, records of at least one token and of at most
    /// [`MAX_BLOCK_PAYLOAD`] bytes. Nothing is allocated before the length
    /// is known to match the count.
    pub fn decode(b: &[u8]) -> Result<Table> {
        let mut c = Cursor::new(b, |what: &str| {
            bad(format!("{} bytes end inside {what}", b.len()))
        });
        if c.take(4, "the magic")? != TABLE_MAGIC {
            return Err(bad("bad magic, not \"KVBT\"".to_owned()));
        }
        let version = c.u32("the version")?;
        if version != TABLE_VERSION {
            return Err(bad(format!(
                "version {version} (this build reads version 1)"
            )));
        }
        let count = usize::try_from(c.u32("the count")?).map_err(|_| Error::SizeOverflow)?;
        let block_tokens = c.u32("block_tokens")?;
        check_head(block_tokens, count)?;
        let want = TABLE_RECORD
            .checked_mul(count)
            .and_then(|n| n.checked_add(TABLE_HEAD))
            .ok_or(Error::SizeOverflow)?;
        if b.len() != want {
            return Err(bad(format!(
                "{} bytes, {want} expected for {count} records",
                b.len()
            )));
        }
        let mut records = Vec::with_capacity(count);
        for i in 0..count {
            let mut name = [0u8; 32];
            name.copy_from_slice(c.take(32, "a name")?);
            let n_tokens = c.u32("n_tokens")?;
            if c.u32("a reserved field")? != 0 {
                return Err(bad(format!("record {i}'s reserved field is not zero")));
            }
            let r = Record {
                name,
                n_tokens,
                payload_len: c.u64("payload_len")?,
                checksum: c.u64("a checksum")?,
            };
            check_record(i, &r)?;
            records.push(r);
        }
        Ok(Table {
            block_tokens,
            records,
        })
    }

    /// Payload bytes of every block together.
    pub fn payload_len(&self) -> u64 {
        self.records.iter().map(|r| r.payload_len).sum()
    }

    /// Tokens of every block together.
    pub fn tokens(&self) -> u64 {
        self.records.iter().map(|r| u64::from(r.n_tokens)).sum()
    }
}
