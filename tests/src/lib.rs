//! Shared helpers for the integration tests in `tests/tests/`.
#![forbid(unsafe_code)]

pub mod bench;
pub mod connect_responder;
pub mod fake_rig;
pub mod fleet_config;
pub mod guest_lab;
pub mod harness;
pub mod http;
pub mod https;
pub mod installed;
pub mod monitoring;
pub mod node_lab;
pub mod operator_process;
pub mod provider_rig;
pub mod scale;

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

/// An image entry of [`provider_config`].
#[derive(Debug, Clone)]
pub struct TestImage {
    /// Image name.
    pub name: String,
    /// Where the test's HTTP server serves it.
    pub url: String,
    /// Its sha256 (or a wrong one on purpose).
    pub sha256: String,
    /// Size cap in MiB.
    pub max_size_mib: Option<u64>,
}

/// A providers config for provider tests: the harness's sshd + libvirtd as host `name`
/// (the qemu driver, pool `default`, the namespace's bridge), the given images served
/// from loopback (so `allowHttp` and `allowPrivateAddresses` are set), one machine type
/// `small`, and the default plugins built by `make plugins`. Extra hosts (name, address)
/// point at addresses that refuse connections, for "host down" cases.
pub fn provider_config(
    sshd: &harness::Sshd,
    libvirtd: &harness::Libvirtd,
    name: &str,
    images: &[TestImage],
    dead_hosts: &[(&str, &str)],
) -> anyhow::Result<egress_operator::config::ValidConfig> {
    let yaml = provider_config_yaml(sshd, libvirtd, name, images, dead_hosts)?;
    Ok(egress_operator::config::parse(
        &yaml,
        "provider-test-config",
        std::path::Path::new("/"),
    )?)
}

/// The YAML text of [`provider_config`] (for tests that hand a file to the CLI).
pub fn provider_config_yaml(
    sshd: &harness::Sshd,
    libvirtd: &harness::Libvirtd,
    name: &str,
    images: &[TestImage],
    dead_hosts: &[(&str, &str)],
) -> anyhow::Result<String> {
    let host = |n: &str, address: &str| {
        format!(
            "    - {{name: {n}, address: \"{address}\", libvirtSocket: {socket}, driver: qemu, \
             storagePool: default, bridge: {bridge}, maxConcurrentCreates: 4, disableKvm: true}}\n",
            socket = libvirtd.socket_path().display(),
            bridge = libvirtd.bridge(),
        )
    };
    let mut hosts = host(name, &sshd.address());
    for (n, a) in dead_hosts {
        hosts.push_str(&host(n, a));
    }
    let mut image_yaml = String::new();
    for i in images {
        image_yaml.push_str(&format!(
            "    - {{name: {}, url: \"{}\", sha256: \"{}\", format: qcow2, allowHttp: true, \
             allowPrivateAddresses: true{}}}\n",
            i.name,
            i.url,
            i.sha256,
            i.max_size_mib
                .map(|m| format!(", maxSizeMiB: {m}"))
                .unwrap_or_default()
        ));
    }
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
    keepaliveMaxMissed: 3
  hosts:
{hosts}  images:
{image_yaml}  machineTypes:
    - {{name: small, vcpus: 1, memoryMiB: 128, diskGiB: 1}}
  defaults: {{machineType: small, image: {first}}}
  templates:
    domain: {{path: {domain}}}
    vendorData:
      path: {vendor}
      settings: {{listenPort: 3128, allowedClientCidrs: [10.0.0.0/8]}}
"#,
        user = sshd.user(),
        key = sshd.client_key().display(),
        known = sshd.known_hosts().display(),
        first = images.first().map(|i| i.name.as_str()).unwrap_or("none"),
        domain = plugin_path("domain-default")?.display(),
        vendor = plugin_path("vendor-data-default")?.display(),
    );
    Ok(yaml)
}

/// A small qcow2 file (64 MiB virtual, a few hundred KB on disk) made with qemu-img,
/// with `salt` written into it so each test's image has its own sha256.
pub fn small_qcow2(dir: &std::path::Path, salt: &str) -> anyhow::Result<(PathBuf, String)> {
    use anyhow::Context;
    let path = dir.join(format!("{salt}.qcow2"));
    let status = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&path)
        .arg("64M")
        .status()
        .context("running qemu-img")?;
    anyhow::ensure!(status.success(), "qemu-img create failed");
    let mut bytes = std::fs::read(&path)?;
    // Past the header and tables: qemu ignores it, the hash does not.
    bytes.extend_from_slice(salt.as_bytes());
    std::fs::write(&path, &bytes)?;
    Ok((path, sha256_hex(&bytes)))
}

/// Hex sha256 of bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// The template plugins `templates` names, loaded and checked healthy: what a test
/// binary's providers render with. The engine is made once per test binary and never
/// dropped, since its epoch ticker must outlive every render.
pub fn load_templates(
    templates: &egress_operator::config::TemplatesConfig,
) -> anyhow::Result<std::sync::Arc<egress_operator::templates::TemplateSet>> {
    use egress_operator::templates::{TemplateEngine, TemplateSet};
    static ENGINE: std::sync::OnceLock<TemplateEngine> = std::sync::OnceLock::new();
    let engine = match ENGINE.get() {
        Some(engine) => engine,
        None => {
            // A race makes a second engine that is dropped unused; either is fine.
            let _ = ENGINE.set(TemplateEngine::new(None)?);
            ENGINE
                .get()
                .ok_or_else(|| anyhow::anyhow!("the template engine was not kept"))?
        }
    };
    let set = TemplateSet::load(engine, templates);
    anyhow::ensure!(set.is_healthy(), "plugins not healthy: {:?}", set.health());
    Ok(std::sync::Arc::new(set))
}
