//! Every one-shot subcommand run as a real process with `RUST_LOG=debug`, against the
//! harness's sshd and libvirtd: each must finish (success or a clear refusal), never hang.
//!
//! Why as processes: the binary wires stdout, stderr and logging the way no in-process
//! test does. Holding stderr's lock on the main thread while the runtime's other threads
//! log (a dial's warning, a debug line) deadlocked `provision`; only a process shows that.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use integration_tests::guest_lab::run_guarded;
use integration_tests::harness::{self, Libvirtd, Need, Sshd};

/// A hang fails the test instead of blocking CI; never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(120);

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

/// Runs the binary with `args` and debug logging; returns (exit code, stdout, stderr).
/// Panics (after killing it) if it does not finish within the hang guard.
fn run(args: &[&str], what: &str) -> (i32, String, String) {
    let mut cmd = Command::new(binary());
    cmd.args(args).env("RUST_LOG", "debug");
    let f =
        run_guarded(&mut cmd, HANG_GUARD, &format!("`{what}`")).unwrap_or_else(|e| panic!("{e:#}"));
    (f.code, f.stdout, f.stderr)
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn every_one_shot_command_finishes_with_debug_logging() {
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return;
    }
    let (sshd, libvirtd) = (Sshd::start().unwrap(), Libvirtd::start().unwrap());
    libvirtd.define_dir_pool("default").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let image = integration_tests::TestImage {
        name: "debian".into(),
        url: "http://127.0.0.1:9/never-fetched.qcow2".into(),
        sha256: "b".repeat(64),
        max_size_mib: None,
    };
    let yaml = integration_tests::provider_config_yaml(
        &sshd,
        &libvirtd,
        "h1",
        std::slice::from_ref(&image),
        &[],
    )
    .unwrap();
    let healthy = write(dir.path(), "healthy.yaml", &yaml);
    let wrong_key = write(
        dir.path(),
        "wrong-key.yaml",
        &yaml.replace(
            &sshd.known_hosts().display().to_string(),
            &sshd.wrong_known_hosts().unwrap().display().to_string(),
        ),
    );
    // No host-key check (warned about on every dial, from a runtime thread) and a libvirt
    // socket that does not exist: the dial logs, then fails.
    let insecure = write(
        dir.path(),
        "insecure.yaml",
        &yaml
            .replace(
                &libvirtd.socket_path().display().to_string(),
                "/nonexistent/libvirt-sock",
            )
            .replace(
                "disableKvm: true",
                "disableKvm: true, insecureIgnoreHostKey: true",
            ),
    );
    let proxy = write(
        dir.path(),
        "proxy.yaml",
        "apiVersion: egress-operator.dev/v1alpha1\nkind: Proxy\nmetadata:\n  name: cli\n  \
         namespace: default\n  uid: 00000000-0000-4000-8000-000000000077\nspec:\n  provider: kvm2\n",
    );

    // The host's size as libvirt reports it (online CPUs), and a cpuPlacement written
    // for a bigger host, which `check` refuses naming the rule plugins would meet.
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    let cpus: u32 = online
        .trim()
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<u32>().unwrap() - a.parse::<u32>().unwrap() + 1,
            None => 1,
        })
        .sum();
    let size = format!("cpus / numa nodes    {cpus} / ");
    let too_big = write(
        dir.path(),
        "too-big.yaml",
        &yaml.replace(
            "disableKvm: true}",
            "disableKvm: true, cpuPlacement: {cpus: \"0-4095\"}}",
        ),
    );
    assert_ne!(std::fs::read_to_string(&too_big).unwrap(), yaml);

    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["config-schema"], 0, "$schema"),
        (vec!["crd"], 0, "CustomResourceDefinition"),
        (vec!["allow-list"], 0, "/domain"),
        (vec!["rules"], 0, "### `firmware-paths`"),
        (vec!["validate-config", &healthy], 0, ""),
        (vec!["check", "--config", &healthy], 0, "reachable"),
        (vec!["check", "--config", &healthy], 0, &size),
        (
            vec!["check", "--config", &too_big],
            1,
            "FAIL (cpu-placement)",
        ),
        (vec!["check", "--config", &wrong_key], 1, "host-key"),
        (vec!["check", "--config", &insecure], 1, "libvirt-socket"),
        (
            vec![
                "provision",
                "--config",
                &wrong_key,
                "--proxy",
                &proxy,
                "--no-progress",
            ],
            1,
            "",
        ),
        (
            vec![
                "provision",
                "--config",
                &insecure,
                "--proxy",
                &proxy,
                "--no-progress",
            ],
            1,
            "",
        ),
        (
            vec![
                "provision",
                "--delete",
                "--config",
                &insecure,
                "--proxy",
                &proxy,
            ],
            1,
            "",
        ),
    ];
    let mut logged = 0;
    for (args, want, needle) in cases {
        let what = args.join(" ");
        let (code, out, err) = run(&args, &what);
        // stderr is a pipe here, as under a log collector: plain text, no colour codes.
        assert!(
            !err.contains('\u{1b}'),
            "`{what}`: ANSI escape codes in piped logs:\n{}",
            tail(&err)
        );
        logged += usize::from(err.contains("DEBUG"));
        assert_eq!(
            code,
            want,
            "`{what}`\nstdout: {out}\nstderr tail: {}",
            tail(&err)
        );
        assert!(
            out.contains(needle) || err.contains(needle),
            "`{what}` should mention {needle:?}\nstdout: {out}\nstderr tail: {}",
            tail(&err)
        );
    }
    assert!(
        logged > 0,
        "no command logged at debug: the colour check saw nothing"
    );
}

fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(3000);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    &s[start..]
}
