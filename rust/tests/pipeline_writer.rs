//! Edges of the verification pipeline that the per-error tests
//! (`errors_*.rs`) do not pin down, written against the mutants
//! cargo-mutants found; one file per concern: `pipeline_names.rs`,
//! `pipeline_header.rs`, `pipeline_writer.rs`, `pipeline_touch.rs`,
//! `pipeline_storage.rs`, `pipeline_sigbus.rs`.
//!
//! Here: the writer at and past the limits, its temp file names and the
//! directory it writes them in.

mod common;

use common::child::{assert_child_passed, child_dir};
use common::*;
use ds4::format::writer::temp_name;
use ds4::format::{MAX_ABI, MAX_META, MAX_NAME, MAX_NDIM, MAX_TENSORS, V2_FIXED};
use ds4::{open, Dtype, Error, WriteOptions};
use std::path::Path;

#[test]
fn the_writer_takes_metadata_of_exactly_max_meta() {
    // 3102 tensors with 255-byte names and 8 dimensions (338 metadata bytes
    // each) and a 96-byte ABI string: exactly MAX_META bytes of metadata.
    let n = 3102;
    let names: Vec<String> = (0..n).map(|i| format!("{i:0>255}")).collect();
    let shape = [1u64; MAX_NDIM];
    let srcs: Vec<ds4::TensorSrc<'_>> = names
        .iter()
        .map(|name| ds4::TensorSrc {
            name,
            dtype: Dtype::U8,
            shape: &shape,
            data: b"\x07",
        })
        .collect();
    let abi_len = usize::try_from(MAX_META).unwrap() - 4 - n * 338;
    assert_eq!(abi_len, 96);
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let meta = |abi_len: usize| ds4::WriteMeta {
        abi: "a".repeat(abi_len),
        ..Default::default()
    };
    ds4::write_checkpoint(&p, &meta(abi_len), TEXT, &srcs, &WriteOptions::default()).unwrap();
    let ck = open(&p, &opts()).unwrap();
    assert_eq!(ck.header.text_offset, V2_FIXED as u64 + MAX_META);
    assert_eq!(ck.header.tensors.len(), n);
    // One byte more is refused before any file is made.
    let p2 = d.path().join(name_for(b"other"));
    let e = ds4::write_checkpoint(
        &p2,
        &meta(abi_len + 1),
        b"other",
        &srcs,
        &WriteOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::HeaderTooLarge { what: "metadata", len, max: MAX_META } if len == MAX_META + 1),
        "{e}"
    );
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
}

#[test]
fn temp_names_are_hidden_recognisable_and_unique() {
    let prefix = format!(".{}.tmp.{}.", name_for(TEXT), std::process::id());
    let names: Vec<String> = (0..3).map(|_| temp_name(&name_for(TEXT))).collect();
    for t in &names {
        assert!(t.starts_with(&prefix) && t.len() > prefix.len(), "{t}");
    }
    assert!(names[0] != names[1] && names[1] != names[2] && names[0] != names[2]);
}

#[test]
fn the_writer_refuses_what_it_cannot_write_and_takes_the_limits() {
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let one = [1u8];
    let src = |name, shape| ds4::TensorSrc {
        name,
        dtype: Dtype::U8,
        shape,
        data: &one,
    };
    let meta = |abi_len: usize| ds4::WriteMeta {
        abi: "a".repeat(abi_len),
        ..Default::default()
    };
    let long = "n".repeat(MAX_NAME + 1);
    let nine = [1u64; MAX_NDIM + 1];
    // Names and dimensions: refused as input, before any file exists.
    for (what, t) in [
        ("empty name", src("", &[1])),
        ("256-byte name", src(&long, &[1])),
        ("9 dimensions", src("t", &nine)),
    ] {
        let e =
            ds4::write_checkpoint(&p, &meta(1), TEXT, &[t], &WriteOptions::default()).unwrap_err();
        assert!(
            matches!(&e, Error::TensorTable(m) if m.starts_with("cannot write tensor")),
            "{what}: {e}"
        );
    }
    // Sizes of the header.
    let e = ds4::write_checkpoint(&p, &meta(MAX_ABI + 1), TEXT, &[], &WriteOptions::default())
        .unwrap_err();
    assert!(
        matches!(e, Error::HeaderTooLarge { what: "ABI string", len, .. } if len == MAX_ABI as u64 + 1),
        "{e}"
    );
    let names: Vec<String> = (0..=MAX_TENSORS).map(|i| format!("t{i}")).collect();
    let srcs: Vec<ds4::TensorSrc<'_>> = names.iter().map(|n| src(n, &[1])).collect();
    let e = ds4::write_checkpoint(&p, &meta(1), TEXT, &srcs, &WriteOptions::default()).unwrap_err();
    assert!(
        matches!(e, Error::HeaderTooLarge { what: "tensor table", len, .. } if len == MAX_TENSORS as u64 + 1),
        "{e}"
    );
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        0,
        "a file was made"
    );
    // Exactly MAX_TENSORS is fine.
    ds4::write_checkpoint(
        &p,
        &meta(1),
        TEXT,
        &srcs[..MAX_TENSORS],
        &WriteOptions::default(),
    )
    .unwrap();
    let ck = open(&p, &opts()).unwrap();
    assert_eq!(ck.header.tensors.len(), MAX_TENSORS);
    assert_eq!(
        ck.header.tensors[MAX_TENSORS - 1].name,
        names[MAX_TENSORS - 1]
    );
}

#[test]
fn sync_dir_reports_a_directory_it_cannot_open() {
    let d = dir();
    ds4::format::writer::sync_dir(d.path()).unwrap();
    let e = ds4::format::writer::sync_dir(&d.path().join("missing")).unwrap_err();
    assert!(
        matches!(&e, Error::Io(io) if io.kind() == std::io::ErrorKind::NotFound),
        "{e}"
    );
}

#[test]
fn the_writer_puts_its_temp_file_next_to_the_destination() {
    // In a child whose working directory is `<dir>/cwd`: a bare file name is
    // written in the working directory; an absolute path is written in its
    // own directory, even once the working directory is gone.
    const NAME: &str = "the_writer_puts_its_temp_file_next_to_the_destination";
    let Some(root) = child_dir() else {
        return assert_child_passed(NAME, "child: both written");
    };
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(cwd, root.join("cwd"));
    let lg = logits();
    let t = [ds4::TensorSrc {
        name: "logits",
        dtype: Dtype::F32,
        shape: &[4],
        data: &lg,
    }];
    let meta = ds4::WriteMeta {
        abi: ABI.into(),
        ..Default::default()
    };
    let bare = name_for(TEXT);
    ds4::write_checkpoint(Path::new(&bare), &meta, TEXT, &t, &WriteOptions::default()).unwrap();
    open(&cwd.join(&bare), &opts()).unwrap();
    std::fs::remove_file(cwd.join(&bare)).unwrap();
    std::fs::remove_dir(&cwd).unwrap();
    let dest = root.join("dest").join(&bare);
    ds4::write_checkpoint(&dest, &meta, TEXT, &t, &WriteOptions::default()).unwrap();
    open(&dest, &opts()).unwrap();
    println!("child: both written");
}
