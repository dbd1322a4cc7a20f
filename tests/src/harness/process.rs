//! Small process helpers shared by the daemon harnesses: run a command and
//! explain its failure, signal and await processes that are not our children,
//! and poll for a condition with a deadline.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How often the polling helpers look again: short enough that tests stay fast,
/// long enough not to spin a core that QEMU or rustc may need.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Rounds of freezing and re-reading a process tree before killing it anyway:
/// one or two suffice; the bound only guards against a fork bomb.
const FREEZE_ROUNDS: usize = 20;

/// Log lines shown in errors: enough to see why a daemon died, short enough to read.
pub(crate) const LOG_TAIL_LINES: usize = 30;

/// Runs `cmd` to completion and returns its stdout; a non-zero exit becomes an
/// error that names the command and carries its stderr, so a failing harness step
/// explains itself.
pub(crate) fn run(cmd: &mut Command) -> Result<String> {
    let output = output(cmd)?;
    if !output.status.success() {
        bail!(
            "{} failed ({}): {}",
            describe(cmd),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs `cmd` to completion and returns everything, whatever the exit status.
pub(crate) fn output(cmd: &mut Command) -> Result<Output> {
    cmd.output()
        .with_context(|| format!("cannot run {}", describe(cmd)))
}

/// The command line as text, for error messages.
pub(crate) fn describe(cmd: &Command) -> String {
    let mut text = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Whether `pid` names a live process. A zombie counts as gone: our PID 1 may
/// reap late (or never), and a zombie holds no sockets, mounts or namespaces.
pub(crate) fn is_alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state letter follows the parenthesised command name, which may itself
    // contain spaces and parentheses, hence the search from the right.
    match stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3)) {
        Some("Z") | Some("X") | None => false,
        Some(_) => true,
    }
}

/// The parent PID of `pid`, if it is still there.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every live descendant of `root` (children, grandchildren, ...). sshd's
/// per-connection processes call `setsid`, so a process group kill misses them;
/// walking the parent links finds them all.
pub(crate) fn descendants(root: u32) -> Vec<u32> {
    let mut all: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            if let Some(ppid) = parent_of(pid) {
                all.push((pid, ppid));
            }
        }
    }
    let mut found = vec![root];
    let mut i = 0;
    while let Some(&parent) = found.get(i) {
        for &(pid, ppid) in &all {
            if ppid == parent && !found.contains(&pid) {
                found.push(pid);
            }
        }
        i += 1;
    }
    found.retain(|&pid| pid != root && is_alive(pid));
    found
}

/// SIGKILLs `root` and all its descendants and returns their PIDs. The tree is
/// frozen (SIGSTOP) and re-read until no new process appears, so a child forked
/// while we look (sshd starting a session's command) cannot escape to PID 1.
pub(crate) fn kill_tree(root: u32) -> Vec<u32> {
    let mut pids = vec![root];
    for _ in 0..FREEZE_ROUNDS {
        signal(&pids, "STOP");
        std::thread::sleep(POLL_INTERVAL);
        let mut now = descendants(root);
        now.push(root);
        now.sort_unstable();
        pids.sort_unstable();
        if now == pids {
            break;
        }
        pids = now;
    }
    signal(&pids, "KILL");
    pids
}

/// Sends `signal` (a name such as `KILL` or `TERM`) to each PID. Processes that
/// are already gone are not an error: cleanup races with processes exiting.
pub(crate) fn signal(pids: &[u32], signal: &str) {
    if pids.is_empty() {
        return;
    }
    let mut cmd = Command::new("kill");
    cmd.arg("-s").arg(signal).arg("--");
    cmd.args(pids.iter().map(u32::to_string));
    // Ignored on purpose: `kill` fails when any PID has already exited.
    let _ = output(&mut cmd);
}

/// Waits until none of `pids` is alive; false if some outlived `timeout`.
pub(crate) fn wait_gone(pids: &[u32], timeout: Duration) -> bool {
    wait_until(timeout, || Ok(pids.iter().all(|&pid| !is_alive(pid)))).unwrap_or(false)
}

/// Polls `ready` until it says true (Ok(true)), it fails, or `timeout` passes
/// (Ok(false)).
pub(crate) fn wait_until(
    timeout: Duration,
    mut ready: impl FnMut() -> Result<bool>,
) -> Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// The last `lines` lines of a log file, for error messages.
pub(crate) fn tail(path: &Path, lines: usize) -> String {
    match fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("({} unreadable: {e})", path.display()),
    }
}

/// Live processes (other than this one) with an argument naming a file below `path`: the
/// daemons a harness started with their files there, found even when their PID files
/// are gone.
pub(crate) fn naming(path: &Path) -> Vec<u32> {
    let inside = format!("{}/", path.to_string_lossy());
    let own = std::process::id();
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        if pid == own {
            continue;
        }
        let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let names_it = cmdline
            .split(|&b| b == 0)
            .map(String::from_utf8_lossy)
            .any(|arg| arg.contains(&inside));
        if names_it && is_alive(pid) {
            found.push(pid);
        }
    }
    found
}

/// Whether a process with this PID exists at all: used to tell whether the test
/// process that left a resource behind is still running.
pub(crate) fn pid_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}
