//! Shared helpers for the integration tests in `tests/tests/`.
#![forbid(unsafe_code)]

pub mod harness;
pub mod https;

use std::path::PathBuf;

/// The workspace root (where `Cargo.toml`, `config/` and `operator/` live).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Cargo's target directory, as the Makefile sees it.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// A plugin component built by `make plugins` (`target/plugins/NAME.wasm`).
pub fn plugin_path(name: &str) -> anyhow::Result<PathBuf> {
    let path = target_dir().join("plugins").join(format!("{name}.wasm"));
    anyhow::ensure!(
        path.exists(),
        "{} is missing: run `make plugins` first (`make test` does)",
        path.display()
    );
    Ok(path)
}

/// A valid providers config with one host, `name`, served by the harness's sshd (dialled
/// at `address`) and libvirtd (behind `driver`). Short SSH timeouts and keepalives, so
/// fault tests see a dead link quickly. Images and templates are placeholders: only the
/// connection layer reads this config.
pub fn harness_config(
    sshd: &harness::Sshd,
    libvirtd: &harness::Libvirtd,
    driver: egress_operator::config::LibvirtDriver,
    name: &str,
    address: &str,
) -> anyhow::Result<egress_operator::config::ValidConfig> {
    use egress_operator::config::LibvirtDriver;
    let driver = match driver {
        LibvirtDriver::Qemu => "qemu",
        LibvirtDriver::Test => "test",
    };
    let yaml = format!(
        r#"
clusterId: test
kvm2:
  ssh:
    user: {user}
    privateKeyFile: {key}
    knownHostsFile: {known}
    connectTimeoutSeconds: 3
    keepaliveIntervalSeconds: 2
    keepaliveMaxMissed: 2
  hosts:
    - name: {name}
      address: "{address}"
      libvirtSocket: {socket}
      driver: {driver}
      storagePool: default
      bridge: {bridge}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "{sha}"
      format: qcow2
  machineTypes:
    - {{name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}}
  templates:
    domain: {{path: /nonexistent/d.wasm}}
    vendorData: {{path: /nonexistent/v.wasm}}
"#,
        user = sshd.user(),
        key = sshd.client_key().display(),
        known = sshd.known_hosts().display(),
        socket = libvirtd.socket_path().display(),
        bridge = libvirtd.bridge(),
        sha = "a".repeat(64),
    );
    Ok(egress_operator::config::parse(
        &yaml,
        "harness-config",
        std::path::Path::new("/"),
    )?)
}
