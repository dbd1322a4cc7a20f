//! Real components for integration tests: OpenSSH's sshd on 127.0.0.1 and an
//! isolated libvirtd (with QEMU) inside a network namespace the test creates.
//!
//! Every test starts what it needs and gets a fresh instance; dropping the
//! handle (also while a test panics) stops the processes and removes namespaces
//! and temp dirs. Leftovers of a test run killed before its drops ran are
//! cleaned by the next start: every resource name carries the owning test
//! process's PID.
//!
//! Network rule: nothing here routes anywhere. sshd listens on 127.0.0.1 only;
//! VM NICs sit on a bridge inside the namespace, with no NAT and no uplink.
//!
//! ```no_run
//! use integration_tests::harness::{self, Need, Sshd};
//! # fn t() -> anyhow::Result<()> {
//! if harness::skip(&[Need::Sshd]) {
//!     return Ok(());
//! }
//! let sshd = Sshd::start()?;
//! let status = sshd.ssh_command().arg("true").status()?;
//! assert!(status.success());
//! # Ok(())
//! # }
//! ```

pub mod controlplane;
mod libvirtd;
pub mod node;
mod process;
mod registry;
mod route;
mod skip;
mod sshd;

use std::fs;

use anyhow::{Context, Result};
use tempfile::TempDir;

pub use controlplane::{ControlPlane, TestNamespace};
pub use libvirtd::Libvirtd;
pub use node::Node;
pub use registry::Registry;
pub use route::{NamespaceLink, NamespaceRoute, subnet_index};
pub use skip::{Need, cannot_run, in_ci, must_run, skip, skip_reason};
pub use sshd::Sshd;

/// A fresh temp dir named `PREFIX<pid>-<random>`, the PID being this test
/// process, so a later run can recognise it as a leftover once we are gone.
pub(crate) fn temp_dir_with_owner(prefix: &str) -> Result<TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("{prefix}{}-", std::process::id()))
        .tempdir()
        .with_context(|| format!("cannot create a temp dir {prefix}*"))
}

/// Whether `name` (`PREFIX<pid>-...`) belongs to a test process that no longer
/// exists. Names that do not parse are never ours to touch.
pub(crate) fn owner_is_gone(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|rest| rest.split('-').next())
        .and_then(|pid| pid.parse::<u32>().ok())
        .is_some_and(|pid| !process::pid_exists(pid))
}

/// Removes temp dirs `PREFIX<pid>-*` whose test process is gone.
pub(crate) fn remove_stale_temp_dirs(prefix: &str) {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_str().is_some_and(|n| owner_is_gone(n, prefix)) {
            // Best effort: a leftover we cannot remove harms nobody.
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}
