#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Skips are never silent (issue 33, item 15): as root (and in CI) a test that cannot run
//! fails; elsewhere it says `SKIPPED: <reason>` where `make test`'s log sees it (past
//! libtest's capture of a passing test's output), and the summary counts and lists it.

use std::path::Path;
use std::process::Command;

use integration_tests::harness::{self, Need, Sshd};

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// As root a skip is a failure, CI or not (before, only `CI` made it one).
#[test]
fn a_test_that_cannot_run_fails_as_root() {
    let outcome = std::panic::catch_unwind(|| harness::cannot_run("a tool this test lacks"));
    if running_as_root() || harness::in_ci() {
        let err = outcome.expect_err("cannot_run returned instead of failing the test");
        let message = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(message.contains("a tool this test lacks"), "{message}");
        assert!(harness::must_run());
    } else {
        assert!(outcome.unwrap(), "cannot_run must tell the test to stop");
        assert!(!harness::must_run());
    }
}

/// A real test of the sshd harness, and the child of the next test, which runs it as an
/// unprivileged user so that it skips.
#[test]
fn ssh_runs_a_command_or_the_test_says_why_not() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let status = sshd.ssh_command().arg("true").status().unwrap();
    assert!(status.success());
}

/// The previous test run as `nobody` (with `CI` unset, as on a laptop) skips and passes;
/// its `SKIPPED:` line must reach the log although libtest captures a passing test's
/// output, and `scripts/test-summary.sh` must count and list it. Before, the line went to
/// the capture and the summary counted only `#[ignore]`: "0 skipped".
#[test]
fn a_skip_outside_ci_reaches_the_log_and_the_summary() {
    let exe = std::env::current_exe().unwrap();
    let mut child = if running_as_root() {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--reset-env",
        ])
        .arg(&exe);
        cmd
    } else {
        Command::new(&exe)
    };
    let out = child
        .args([
            "--exact",
            "ssh_runs_a_command_or_the_test_says_why_not",
            "--test-threads=1",
        ])
        .env_remove("CI")
        .current_dir("/")
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the child failed:\n{log}");
    assert!(
        log.contains("SKIPPED: needs root"),
        "no SKIPPED line in the child's output:\n{log}"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("test.log");
    std::fs::write(&path, &log).unwrap();
    let summary = summarize(&path);
    assert!(
        summary
            .starts_with("tests: 1 passed, 0 failed, 1 skipped (0 ignored, 1 skipped at run time)"),
        "{summary}"
    );
    assert!(summary.contains("SKIPPED: needs root"), "{summary}");
}

fn summarize(log: &Path) -> String {
    let script = integration_tests::workspace_root().join("scripts/test-summary.sh");
    let out = Command::new("bash").arg(script).arg(log).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
