//! Tests that run in a child process: the test binary again, running one
//! test (`--exact`), in a temporary directory of the parent's. A test calls
//! `child_dir()`: None in the parent, which then runs the child with
//! `assert_child_passed` or `assert_child_killed_by_sigbus`; the child's
//! directory in the child.

use super::dir;

/// Set in the child to the directory its files go in (the parent's, so it
/// is removed even when the child is killed). The child runs in its `cwd`
/// subdirectory; it also has an empty `dest`.
const CHILD: &str = "DS4_TEST_PIPELINE_CHILD_DIR";

/// In the child: its directory. None in the parent.
pub fn child_dir() -> Option<std::path::PathBuf> {
    let d = std::env::var_os(CHILD)?;
    // SAFETY: plain libc calls. No core files from the deaths some checks
    // expect, and a child that hangs (a fault that is never resolved
    // repeats forever) is killed.
    unsafe {
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &raw const no_core);
        libc::alarm(10);
    }
    Some(d.into())
}

/// Runs test `name` in a child process; returns how it ended and its output.
fn run_child(name: &str) -> (std::process::ExitStatus, String) {
    let d = dir();
    for sub in ["cwd", "dest"] {
        std::fs::create_dir(d.path().join(sub)).unwrap();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, d.path())
        .current_dir(d.path().join("cwd"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

#[track_caller]
pub fn assert_child_passed(name: &str, marker: &str) {
    let (status, out) = run_child(name);
    assert!(status.success(), "child {name}: {status}\n{out}");
    assert!(out.contains(marker), "child {name} did not finish:\n{out}");
}

#[track_caller]
pub fn assert_child_killed_by_sigbus(name: &str, marker: &str) {
    use std::os::unix::process::ExitStatusExt;
    let (status, out) = run_child(name);
    assert!(
        out.contains(marker),
        "child {name} did not get there:\n{out}"
    );
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "child {name}: {status}\n{out}"
    );
}
