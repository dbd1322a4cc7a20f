//! The real binary: exit codes and streams as scripts see them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::path::PathBuf;
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_egress-operator"))
}

fn samples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/samples")
}

#[test]
fn validate_config_exits_zero_on_the_sample() {
    let out = bin()
        .arg("validate-config")
        .arg(samples().join("providers-config.yaml"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().count(),
        1,
        "one-line summary expected: {stdout}"
    );
}

#[test]
fn validate_config_exits_non_zero_with_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.yaml");
    let text = std::fs::read_to_string(samples().join("providers-config.yaml"))
        .unwrap()
        .replace("clusterId: prod-eu-1", "clusterId: Prod_EU")
        .replace("vcpus: 1", "vcpus: 0");
    std::fs::write(&file, text).unwrap();
    let out = bin().arg("validate-config").arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("clusterId: \"Prod_EU\" is not a valid DNS-1123 label"),
        "{stderr}"
    );
    assert!(
        stderr.contains("kvm2.machineTypes[0].vcpus: 0 vCPUs is out of range"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn unreadable_file_is_reported_not_panicked() {
    let out = bin()
        .args(["validate-config", "/nonexistent.yaml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot read config file /nonexistent.yaml")
    );
}
