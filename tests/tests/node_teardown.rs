#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The node tier leaves nothing behind: a test process that exits, or is killed with a pod
//! running, has its node torn down by the watchdog, and `node.sh leftovers` (processes,
//! mounts, the namespace and its veth, routes, cgroups, nft tables, kubelet's sysctls,
//! listeners, paths outside the node's directory) finds nothing.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::harness::{self, Need, node};

/// Hang guard: a teardown takes seconds; this only stops a hung test.
const GUARD: Duration = Duration::from_secs(180);

/// `src/bin/node-holder.rs`: a stand-in test binary holding the shared node with a pod on it.
fn holder() -> (Child, PathBuf) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_node-holder"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("NODE "))
        .expect("the holder printed where its node is");
    let dir = PathBuf::from(line.trim_start_matches("NODE ").trim());
    assert!(dir.exists(), "{}", dir.display());
    (child, dir)
}

/// Waits until the watchdog has torn the node down and nothing is left.
fn wait_clean(dir: &Path) {
    let start = Instant::now();
    loop {
        let left = node::leftovers(dir).unwrap();
        if left.is_none() && !dir.exists() {
            return;
        }
        assert!(
            start.elapsed() < GUARD,
            "the node in {} was not torn down within {GUARD:?}: {}",
            dir.display(),
            left.unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One test, so that the two holders never want the machine's one node at once.
#[test]
fn a_node_whose_test_process_exits_or_is_killed_leaves_nothing_behind() {
    if harness::skip(&[Need::Node]) {
        return;
    }
    // Exits as a test binary does: no drop of the shared node, only the watchdog.
    let (mut child, dir) = holder();
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    wait_clean(&dir);
    println!("exit: {} torn down, nothing left", dir.display());

    // Killed with SIGKILL while its pod runs: the same.
    let (mut child, dir) = holder();
    child.kill().unwrap();
    child.wait().unwrap();
    wait_clean(&dir);
    println!("SIGKILL: {} torn down, nothing left", dir.display());
}
