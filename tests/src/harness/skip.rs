//! Decides whether a test that needs real daemons can run here. On the build
//! machines (root, `make setup` done) nothing is skipped; elsewhere (a laptop
//! without root, a container without the packages) the tests say why and pass
//! instead of failing on something that is not a bug. Where the tests must run, a
//! missing daemon or tool is a broken setup, never a pass, and the test fails with the
//! reason: in CI (`CI` set, as `.ci/run` runs) and as root (root can run `make setup`, so
//! nothing is out of reach; a skip there only hides a broken machine, and libtest hides a
//! passing test's output).
//!
//! A skip that does happen writes `SKIPPED: <reason>` straight to the process's stderr,
//! past libtest's capture, so `make test`'s log holds it and the summary
//! (`scripts/test-summary.sh`) counts it and prints the reason.

use std::fs;
use std::path::{Path, PathBuf};

/// What a test needs from the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// OpenSSH's sshd plus the `ssh` and `ssh-keygen` clients.
    Sshd,
    /// libvirtd, virtlogd, virsh, QEMU and the tools that build its namespace.
    Libvirtd,
    /// promtool (Debian's `prometheus`), which checks and unit-tests the alerts.
    Promtool,
    /// The node tier (`scripts/node.sh`): root, containerd, runc, the CNI plugins, buildah.
    Node,
    /// The CNCF distribution registry (Debian's `docker-registry`) and htpasswd
    /// (apache2-utils), for OCI plugin push and pull.
    Registry,
}

/// Binaries behind each [`Need`]; all must exist.
const SSHD_BINARIES: &[&str] = &["sshd", "ssh", "ssh-keygen"];
const LIBVIRTD_BINARIES: &[&str] = &[
    "libvirtd",
    "virtlogd",
    "virsh",
    "qemu-system-x86_64",
    "ip",
    "unshare",
    "nsenter",
    "taskset",
    "timeout",
];

/// Binaries of the node tier (`scripts/node.sh`, `scripts/operator-image.sh`).
const NODE_BINARIES: &[&str] = &[
    "containerd",
    "ctr",
    "runc",
    "buildah",
    "busybox",
    "gcc",
    "nsenter",
    "ip",
    "nft",
    "openssl",
];

/// Directories searched besides `PATH`: the daemons live in sbin, which a
/// non-login root shell does not always have on its `PATH`.
const SBIN_DIRS: &[&str] = &["/usr/sbin", "/sbin"];

/// Why tests needing `needs` cannot run here, or None when they can. The reason
/// says what to do (`make setup`, run as root).
pub fn skip_reason(needs: &[Need]) -> Option<String> {
    if needs.is_empty() {
        return None;
    }
    let daemons = needs
        .iter()
        .any(|n| matches!(n, Need::Sshd | Need::Libvirtd | Need::Node));
    if daemons && !is_root() {
        return Some("needs root (network namespaces, mounts, sshd privilege separation)".into());
    }
    let mut missing: Vec<&str> = Vec::new();
    for need in needs {
        let binaries = match need {
            Need::Sshd => SSHD_BINARIES,
            Need::Libvirtd => LIBVIRTD_BINARIES,
            Need::Promtool => &["promtool"],
            Need::Node => NODE_BINARIES,
            Need::Registry => &[super::registry::REGISTRY, super::registry::HTPASSWD],
        };
        missing.extend(
            binaries
                .iter()
                .copied()
                .filter(|b| find_binary(b).is_none()),
        );
    }
    if missing.is_empty() {
        None
    } else {
        Some(format!(
            "missing binaries: {} (run `make setup` as root)",
            missing.join(", ")
        ))
    }
}

/// Prints the skip reason for `needs` and returns true when the test must stop.
/// Tests call this first: `if skip(&[Need::Sshd]) { return; }`. Where tests must
/// run (CI, root: see [`must_run`]) it panics instead, so a machine that lost a daemon
/// cannot turn tests green.
pub fn skip(needs: &[Need]) -> bool {
    match skip_reason(needs) {
        Some(reason) => cannot_run(&reason),
        None => false,
    }
}

/// Reports that a test (or a bench) cannot run here because `reason` (a missing tool,
/// say): prints `SKIPPED: <reason>` and returns true where skipping is allowed, panics
/// with it where tests must run ([`must_run`]).
// Failing the calling test is the point: a panic is how a Rust test fails.
#[allow(clippy::panic)]
pub fn cannot_run(reason: &str) -> bool {
    if in_ci() {
        panic!("CI must run this test, but it cannot run here: {reason}");
    }
    if is_root() {
        panic!(
            "as root every test must run (`make setup` installs what they need), but this one cannot: {reason}"
        );
    }
    report_skip(reason);
    true
}

/// Whether a test that cannot run must fail rather than skip: in CI, and as root.
pub fn must_run() -> bool {
    in_ci() || is_root()
}

/// Writes `SKIPPED: <reason>` as one write to the real stderr. `eprintln!` in a test goes
/// to libtest's capture, which a passing test's output never leaves; the summary of
/// `make test` counts these lines in the log.
fn report_skip(reason: &str) {
    use std::io::Write as _;
    let line = format!("SKIPPED: {reason}\n");
    // Best effort: a skip that cannot be reported still skips.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Whether this is a CI run: `CI` set to anything but empty, `0` or `false`.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"))
}

/// Effective UID 0, read from procfs (no libc call, no unsafe).
fn is_root() -> bool {
    let Ok(status) = fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        == Some("0")
}

/// The full path of `name` on `PATH` or in the sbin directories.
pub(crate) fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(SBIN_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
