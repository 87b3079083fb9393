//! One test per `ds4::Error` variant that bytes on disk can produce, each from
//! constructed bytes, checking `code()`, `stage()` and `class()`, in both the
//! mmap and the pread mode, one file per stage: `errors_open.rs`,
//! `errors_header.rs`, `errors_text.rs`, `errors_payload.rs`. Plus `touch`
//! (`errors_touch.rs`) and failed writes (`errors_write.rs`).
//!
//! Here: a failed `write_checkpoint` leaves no temp file.

mod common;

use common::*;
use ds4::{Class, Error, WriteOptions};

// ---- write_checkpoint: a failed write leaves no temp file ----
//
// The writer (rust/format/writer.rs) validates its input before it creates
// the temp file `.<name>.tmp.<pid>.<unique>`; after that, what can fail is
// I/O: a write (disk full, file size limit), the length check, fsync, the
// rename onto the final name and the directory fsync. The tests below reach
// two of these through the public API: a write that hits RLIMIT_FSIZE and a
// rename onto a directory.

fn write_meta() -> ds4::WriteMeta {
    ds4::WriteMeta {
        reason: 1,
        tokens: TOKENS,
        ctx: CTX,
        created: CREATED,
        abi: ABI.into(),
        ..Default::default()
    }
}

/// The names in `dir`, sorted.
fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// Asserts that `dir` holds no writer temp file (`.<name>.tmp.<pid>.<hex>`).
#[track_caller]
fn assert_no_temp_file(dir: &std::path::Path) {
    let names = listing(dir);
    let temps: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with('.') && n.contains(".kv.tmp."))
        .collect();
    assert!(temps.is_empty(), "temp files left behind: {temps:?}");
}

#[test]
fn rejected_input_creates_no_file() {
    // The declared size does not match the data: refused before any file exists.
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let t = [ds4::TensorSrc {
        name: "logits",
        dtype: ds4::Dtype::F32,
        shape: &[4],
        data: b"too short",
    }];
    let e =
        ds4::write_checkpoint(&p, &write_meta(), TEXT, &t, &WriteOptions::default()).unwrap_err();
    assert!(matches!(e, Error::TensorTable(_)), "{e:?}");
    assert_eq!(listing(d.path()), Vec::<String>::new());
}

#[test]
fn failed_rename_removes_the_temp_file() {
    // The destination is a directory: the temp file is created, written and
    // fsynced, then rename(2) fails with EISDIR. The temp file must go and
    // the directory (with its content) must stay.
    let d = dir();
    let dest = d.path().join(name_for(TEXT));
    std::fs::create_dir(&dest).unwrap();
    std::fs::write(dest.join("keep"), b"keep me").unwrap();
    let lg = logits();
    let t = [ds4::TensorSrc {
        name: "logits",
        dtype: ds4::Dtype::F32,
        shape: &[4],
        data: &lg,
    }];
    let e = ds4::write_checkpoint(&dest, &write_meta(), TEXT, &t, &WriteOptions::default())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Io(io) if io.raw_os_error() == Some(libc::EISDIR)),
        "{e:?}"
    );
    assert_eq!((e.code(), e.class()), ("io", Class::Io));
    assert_no_temp_file(d.path());
    assert_eq!(listing(d.path()), [name_for(TEXT)]);
    assert!(dest.is_dir());
    assert_eq!(std::fs::read(dest.join("keep")).unwrap(), b"keep me");
}

/// Set in the child process of `failed_write_removes_the_temp_file_and_keeps_the_old_file`.
const FSIZE_CHILD: &str = "DS4_TEST_FSIZE_CHILD_DIR";
const FSIZE_LIMIT: u64 = 4096;

#[test]
fn failed_write_removes_the_temp_file_and_keeps_the_old_file() {
    if let Some(d) = std::env::var_os(FSIZE_CHILD) {
        return fsize_child(std::path::Path::new(&d));
    }
    // A good checkpoint is already at the destination.
    let d = dir();
    let dest = d.path().join(name_for(TEXT));
    let good = default_file();
    std::fs::write(&dest, &good).unwrap();
    // RLIMIT_FSIZE is per process, so the failing write runs in a child: this
    // test binary again, running only this test.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "failed_write_removes_the_temp_file_and_keeps_the_old_file",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FSIZE_CHILD, d.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("fsize child: write failed with EFBIG"),
        "the child did not run the write: {stdout}"
    );
    // Checked again here, outside the limited process.
    assert_no_temp_file(d.path());
    assert_eq!(listing(d.path()), [name_for(TEXT)]);
    assert_eq!(std::fs::read(&dest).unwrap(), good, "the old file changed");
    open_both(&dest, &opts()).unwrap();
}

/// In the child: with a 4 KiB file size limit (and SIGXFSZ ignored, so the
/// write fails with EFBIG instead of killing the process), rewrite the
/// destination with a 64 KiB payload. The temp file exists and holds the
/// first 4 KiB when the write fails.
fn fsize_child(d: &std::path::Path) {
    let dest = d.join(name_for(TEXT));
    let good = std::fs::read(&dest).unwrap();
    assert!((good.len() as u64) < FSIZE_LIMIT);
    // SAFETY: plain libc calls with valid arguments; this process runs only
    // this test (--exact, one thread).
    unsafe {
        assert_ne!(libc::signal(libc::SIGXFSZ, libc::SIG_IGN), libc::SIG_ERR);
        let lim = libc::rlimit {
            rlim_cur: FSIZE_LIMIT,
            rlim_max: FSIZE_LIMIT,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &raw const lim), 0);
    }
    let big = vec![7u8; 64 * 1024];
    let t = [ds4::TensorSrc {
        name: "blob",
        dtype: ds4::Dtype::U8,
        shape: &[big.len() as u64],
        data: &big,
    }];
    let e = ds4::write_checkpoint(&dest, &write_meta(), TEXT, &t, &WriteOptions::default())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Io(io) if io.raw_os_error() == Some(libc::EFBIG)),
        "{e:?}"
    );
    assert_eq!((e.code(), e.class()), ("io", Class::Io));
    assert_no_temp_file(d);
    assert_eq!(std::fs::read(&dest).unwrap(), good);
    println!("fsize child: write failed with EFBIG");
}
