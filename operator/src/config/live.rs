//! The config in force, which a reload may replace while the operator runs.
//!
//! A fleet lives for months; a changed plugin, image or machine type must reach it without
//! a restart (issue 30). What reads the config takes the current [`Snapshot`] at the start
//! of a step and keeps it for that step, so a reload never mixes two configs inside one
//! render. The config and its plugins are one snapshot: a new config takes effect only
//! with its plugins loaded and checked, and never half.
//!
//! Some fields are read once at start, where the operator's connections and loops are
//! built from them; a change there is refused by [`needs_restart`] (the whole new config
//! with it), naming the fields, so nothing half-applies:
//! - `clusterId`: the identity every mark is written under;
//! - `kvm2.ssh` and the host list's connection fields (`name`, `address`,
//!   `libvirtSocket`, `driver`, `insecureIgnoreHostKey`, `maxConcurrentCreates`): the
//!   SSH links and per-host create slots are made at start;
//! - `gc`, `healthCheck`, `serving`: their loops and the prober are made at start.

use std::sync::{Arc, RwLock};

use super::{HostConfig, ValidConfig};
use crate::templates::TemplateSet;

/// One config with its plugins, as one reload installed it.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The validated config.
    pub config: Arc<ValidConfig>,
    /// Its plugins.
    pub templates: Arc<TemplateSet>,
    /// How many reloads installed a config before this one (0: the one read at start).
    pub generation: u64,
    /// When it was installed.
    pub installed_at: std::time::Instant,
}

/// The snapshot in force, and a channel that tells each install.
#[derive(Debug)]
pub struct Live(RwLock<Arc<Snapshot>>, tokio::sync::watch::Sender<u64>);

impl Live {
    /// The config read at start, with its plugins.
    pub fn new(config: Arc<ValidConfig>, templates: Arc<TemplateSet>) -> Self {
        Self(
            RwLock::new(Arc::new(Snapshot {
                config,
                templates,
                generation: 0,
                installed_at: std::time::Instant::now(),
            })),
            tokio::sync::watch::Sender::new(0),
        )
    }

    /// Sees each install's generation (what the pool controller reconciles every pool on).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.1.subscribe()
    }

    /// The snapshot in force now; hold it for one step, not longer.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The config in force now.
    pub fn config(&self) -> Arc<ValidConfig> {
        self.snapshot().config.clone()
    }

    /// The plugins in force now.
    pub fn templates(&self) -> Arc<TemplateSet> {
        self.snapshot().templates.clone()
    }

    /// Installs a new config with its (loaded, checked) plugins; returns its generation.
    /// The caller checked [`needs_restart`] first.
    pub fn install(&self, config: Arc<ValidConfig>, templates: Arc<TemplateSet>) -> u64 {
        let mut slot = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let generation = slot.generation + 1;
        *slot = Arc::new(Snapshot {
            config,
            templates,
            generation,
            installed_at: std::time::Instant::now(),
        });
        drop(slot);
        self.1.send_replace(generation);
        generation
    }
}

/// The config in force: `live`'s, else `start` (a context built without a reload handle).
pub fn current(start: &Arc<ValidConfig>, live: Option<&Live>) -> Arc<ValidConfig> {
    live.map_or_else(|| start.clone(), Live::config)
}

/// The fields of `new` that differ from `old` but take effect only at start (see the
/// module docs); empty when `new` can be installed live.
pub fn needs_restart(old: &ValidConfig, new: &ValidConfig) -> Vec<String> {
    let mut out = Vec::new();
    if old.cluster_id != new.cluster_id {
        out.push("clusterId".to_string());
    }
    if old.kvm2.ssh != new.kvm2.ssh {
        out.push("kvm2.ssh".to_string());
    }
    let conn = |h: &HostConfig| {
        (
            h.name.clone(),
            h.address.clone(),
            h.libvirt_socket.clone(),
            h.driver,
            h.insecure_ignore_host_key,
            h.max_concurrent_creates,
        )
    };
    let old_hosts: Vec<_> = old.kvm2.hosts.iter().map(conn).collect();
    let new_hosts: Vec<_> = new.kvm2.hosts.iter().map(conn).collect();
    if old_hosts.len() != new_hosts.len() {
        out.push("kvm2.hosts (hosts added or removed)".to_string());
    } else {
        for (i, (a, b)) in old_hosts.iter().zip(&new_hosts).enumerate() {
            if a != b {
                out.push(format!(
                    "kvm2.hosts[{i}] ({}: name, address, libvirtSocket, driver, \
                     insecureIgnoreHostKey or maxConcurrentCreates)",
                    a.0
                ));
            }
        }
    }
    if old.gc != new.gc {
        out.push("gc".to_string());
    }
    if old.health_check != new.health_check {
        out.push("healthCheck".to_string());
    }
    if old.serving != new.serving {
        out.push("serving".to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const CONFIG: &str = r#"
clusterId: test
kvm2:
  ssh: {user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}
  hosts:
    - {name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "0000000000000000000000000000000000000000000000000000000000000000"
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: small, image: debian}
  templates:
    domain: {path: /p/domain.wasm}
    vendorData: {path: /p/vendor-data.wasm}
"#;

    fn parse(text: &str) -> ValidConfig {
        crate::config::parse(text, "live-test.yaml", Path::new("/")).unwrap()
    }

    #[test]
    fn render_inputs_change_live_and_connections_need_a_restart() {
        let old = parse(CONFIG);
        let live = [
            CONFIG.replace("memoryMiB: 512", "memoryMiB: 1024"),
            CONFIG.replace("/p/domain.wasm", "/p/domain-2.wasm"),
            CONFIG.replace("bridge: br0", "bridge: br1, maxDomains: 3"),
        ];
        for text in &live {
            assert!(needs_restart(&old, &parse(text)).is_empty(), "{text}");
        }
        let restart = [
            (
                CONFIG.replace("clusterId: test", "clusterId: other"),
                "clusterId",
            ),
            (CONFIG.replace("user: egress", "user: root"), "kvm2.ssh"),
            (
                CONFIG.replace("127.0.0.1:2222", "127.0.0.1:2223"),
                "kvm2.hosts[0] (h1:",
            ),
            (
                CONFIG.replace("kvm2:\n", "serving: {port: 3129}\nkvm2:\n"),
                "serving",
            ),
        ];
        for (text, field) in &restart {
            let got = needs_restart(&old, &parse(text));
            assert!(got.iter().any(|f| f.starts_with(field)), "{field}: {got:?}");
        }
    }

    #[test]
    fn install_counts_generations_and_snapshots_stay_whole() {
        let config = Arc::new(parse(CONFIG));
        let templates = Arc::new(TemplateSet::loading(&config.kvm2.templates));
        let live = Live::new(config.clone(), templates.clone());
        let before = live.snapshot();
        let newer = Arc::new(parse(&CONFIG.replace("memoryMiB: 512", "memoryMiB: 1024")));
        assert_eq!(live.install(newer.clone(), templates), 1);
        assert_eq!(before.generation, 0);
        assert_eq!(before.config.kvm2.machine_types[0].memory_mib, 512);
        assert_eq!(live.config().kvm2.machine_types[0].memory_mib, 1024);
        assert_eq!(live.snapshot().generation, 1);
    }
}
