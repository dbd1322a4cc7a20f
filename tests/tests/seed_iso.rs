#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
//! The NoCloud seed ISO read back by an independent implementation, xorriso: every file
//! byte for byte, no other file, the `cidata` volume id, through the Rock Ridge tree (what
//! Linux mounts) and through the Joliet tree alone.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use egress_operator::provider::kvm2::seed::{self, SeedFiles};

/// xorriso on `PATH`, or None (the test then says why and passes).
fn xorriso() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("xorriso"))
        .find(|candidate| candidate.is_file())
}

fn skip_without_xorriso() -> Option<PathBuf> {
    let found = xorriso();
    if found.is_none() {
        integration_tests::harness::cannot_run("xorriso is not on PATH (run `make setup` as root)");
    }
    found
}

/// Runs xorriso with `args`; panics with its output when it fails.
fn run(xorriso: &Path, args: &[&str]) -> String {
    let out = Command::new(xorriso).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "xorriso {args:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

/// Every regular file under `dir`, by path relative to it; anything else fails the test.
fn read_all(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        for entry in fs::read_dir(&current).unwrap() {
            let entry = entry.unwrap();
            let kind = entry.file_type().unwrap();
            let rel = entry
                .path()
                .strip_prefix(dir)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if kind.is_dir() {
                pending.push(entry.path());
                files.insert(format!("{rel}/"), Vec::new());
            } else {
                assert!(kind.is_file(), "{rel} is not a regular file: {kind:?}");
                files.insert(rel, fs::read(entry.path()).unwrap());
            }
        }
    }
    files
}

/// Builds `files`, writes the image, and checks it against `expected` through both trees.
fn check_seed(xorriso: &Path, files: &SeedFiles, expected: &BTreeMap<String, Vec<u8>>) {
    let image = seed::build(files).unwrap();
    assert_eq!(image.len() % 2048, 0, "an ISO is whole 2048-byte sectors");

    let dir = tempfile::tempdir().unwrap();
    let iso = dir.path().join("seed.iso");
    fs::write(&iso, &image).unwrap();
    let iso = iso.to_str().unwrap();

    // Rock Ridge (what Linux's isofs and cloud-init see), then the Joliet tree alone.
    for (tree, extra) in [
        ("rock-ridge", &[][..]),
        ("joliet", &["-rockridge", "off"][..]),
    ] {
        let out = dir.path().join(tree);
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["-osirrox", "on", "-indev", iso, "-extract", "/"]);
        args.push(out.to_str().unwrap());
        run(xorriso, &args);
        let got = read_all(&out);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>(),
            "{tree}: file names"
        );
        for (name, want) in expected {
            assert!(
                got[name] == *want,
                "{tree}: {name} differs from what was written"
            );
        }
    }

    let pvd = run(xorriso, &["-indev", iso, "-pvd_info"]);
    let volume_id = pvd
        .lines()
        .find_map(|line| line.strip_prefix("Volume Id"))
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, id)| id.trim())
        .unwrap_or_else(|| panic!("no Volume Id in -pvd_info:\n{pvd}"));
    assert_eq!(volume_id, "cidata", "{pvd}");
}

#[test]
fn seed_with_all_four_files_reads_back_byte_for_byte() {
    let Some(xorriso) = skip_without_xorriso() else {
        return;
    };
    // Binary-ish user-data: every byte value, NULs and invalid UTF-8 included, 6 KiB.
    let mut user_data = b"#cloud-config\n".to_vec();
    user_data.extend((0..=255u8).cycle().take(6 * 1024));
    // Multi-KB vendor-data spanning several sectors, not a multiple of 2048.
    let vendor_data: Vec<u8> = (0..1500)
        .flat_map(|i| format!("# line {i}: proxy vendor data\n").into_bytes())
        .collect();
    assert!(vendor_data.len() > 3 * 2048);
    // Exactly one sector.
    let mut network_config = b"version: 2\nethernets: {}\n".to_vec();
    network_config.resize(2048, b'#');

    let files = SeedFiles {
        meta_data: seed::meta_data("proxy-7f3a", "egress-proxy-1"),
        user_data: Some(user_data.clone()),
        vendor_data: vendor_data.clone(),
        network_config: Some(network_config.clone()),
    };
    let expected = BTreeMap::from([
        (
            "meta-data".to_string(),
            files.meta_data.clone().into_bytes(),
        ),
        ("user-data".to_string(), user_data),
        ("vendor-data".to_string(), vendor_data),
        ("network-config".to_string(), network_config),
    ]);
    check_seed(&xorriso, &files, &expected);
}

#[test]
fn seed_without_user_data_or_network_config() {
    let Some(xorriso) = skip_without_xorriso() else {
        return;
    };
    let files = SeedFiles {
        meta_data: seed::meta_data("i-1", "proxy-1"),
        user_data: None,
        vendor_data: Vec::new(),
        network_config: None,
    };
    let expected = BTreeMap::from([
        (
            "meta-data".to_string(),
            files.meta_data.clone().into_bytes(),
        ),
        ("user-data".to_string(), b"#cloud-config\n".to_vec()),
        ("vendor-data".to_string(), Vec::new()),
    ]);
    check_seed(&xorriso, &files, &expected);
}
