#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Ctrl-C during `make demo` tears everything down (issue 18, deliverable 5).
//!
//! The demo (`egress-demo`, what `make demo` runs) is started as a process and sent
//! SIGINT while its pool's VMs boot, the moment with the most running: the node (its
//! control plane, containerd, kubelet, kube-proxy and the operator's pods), sshd, libvirtd
//! in its network namespace with QEMU, the HTTP server, the veth between the two
//! namespaces. It must exit on its own, and nothing it started may be left: no process,
//! network namespace or temporary directory named after its PID (the harness names them
//! all so), and not the node's namespace either.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use integration_tests::guest_lab::GuestLab;
use integration_tests::harness::{self, Need, node};

/// Hang guards: the demo's start (node, images, lab, the operator's Deployment) and its
/// teardown.
const START_GUARD: Duration = Duration::from_secs(600);
const STOP_GUARD: Duration = Duration::from_secs(180);

/// What the demo starts carries its PID in one of these names.
fn traces(pid: u32) -> Vec<String> {
    [
        "eotest-cp-",
        "eotest-sshd-",
        "eotest-libvirt-",
        "eotest-kube-",
        "eotest-node-",
        "egress-lab",
        "eotest-",
    ]
    .iter()
    .map(|p| format!("{p}{pid}-"))
    .collect()
}

/// Processes whose command line names one of `traces`.
fn processes_with(traces: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if traces.iter().any(|t| cmdline.contains(t.as_str())) {
            found.push(format!(
                "{}: {}",
                entry.file_name().to_string_lossy(),
                cmdline
            ));
        }
    }
    found
}

#[test]
fn ctrl_c_while_the_vm_boots_leaves_nothing() {
    if harness::skip(&[Need::Sshd, Need::Libvirtd, Need::Node]) {
        return;
    }
    let image = GuestLab::default_image();
    if !image.exists()
        && harness::cannot_run(&format!(
            "{} is missing: `make test` builds it (make guest-image)",
            image.display()
        ))
    {
        return;
    }
    let operator = PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"));
    let mut demo = Command::new(env!("CARGO_BIN_EXE_egress-demo"))
        .arg(&image)
        .arg(&operator)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = demo.id();
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = demo.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            all.push_str(&line);
            all.push('\n');
            let _ = tx.send(line);
        }
        all
    });
    let stderr = demo.stderr.take().unwrap();
    let errors = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());

    // Wait until the pool is applied and the demo waits for its proxies: the VMs are being
    // defined and booted.
    let started = Instant::now();
    loop {
        let left = START_GUARD.saturating_sub(started.elapsed());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("waiting until both proxies serve") => break,
            Ok(_) => {}
            Err(_) => {
                let _ = demo.kill();
                panic!(
                    "the demo did not reach its Ready wait within {START_GUARD:?} (hang guard):\n{}",
                    errors.join().unwrap()
                );
            }
        }
    }
    // Let the operator define and start the domains.
    std::thread::sleep(Duration::from_secs(15));
    let running = processes_with(&traces(pid));
    for daemon in ["kube-apiserver", "kubelet", "kube-proxy", "containerd"] {
        assert!(
            running.iter().any(|p| p.contains(daemon)),
            "the demo runs no {daemon} under its PID's names: {running:#?}"
        );
    }
    let status = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());

    let stopping = Instant::now();
    let exit = loop {
        if let Some(exit) = demo.try_wait().unwrap() {
            break exit;
        }
        if stopping.elapsed() > STOP_GUARD {
            let _ = demo.kill();
            panic!("the demo did not stop within {STOP_GUARD:?} of SIGINT (hang guard)");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = reader.join().unwrap();
    let err = errors.join().unwrap();
    println!(
        "the demo stopped {:.1} s after SIGINT ({exit})",
        stopping.elapsed().as_secs_f64()
    );
    assert!(
        !exit.success(),
        "an interrupted demo does not report success"
    );
    assert!(out.contains("interrupted"), "{out}\n{err}");

    // The watchdogs of the harness poll every 0.2 s: give them a moment, then look.
    std::thread::sleep(Duration::from_secs(2));
    let traces = traces(pid);
    let left = processes_with(&traces);
    assert!(left.is_empty(), "processes left: {left:#?}");
    let netns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let netns = String::from_utf8_lossy(&netns.stdout);
    assert!(
        !netns
            .lines()
            .any(|l| l.starts_with(&format!("eotest-{pid}-")) || l.starts_with(node::NETNS)),
        "network namespace left: {netns}"
    );
    let dirs: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| traces.iter().any(|t| n.starts_with(t.as_str())))
        .collect();
    assert!(dirs.is_empty(), "temporary directories left: {dirs:?}");
}
