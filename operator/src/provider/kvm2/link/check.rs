//! Host checks: can the operator reach a host, and does the host have what a proxy needs?
//!
//! Each check dials its own connection (never the shared one, so a check cannot disturb
//! running reconciles and always exercises a fresh handshake), bounded by a timeout, and
//! reports every fact it could read plus a reason code for the first thing that failed.
//! Used by `egress-operator check` and, later, by the provider health monitor.

use std::time::{Duration, Instant};

use serde::Serialize;
use virt::error::ErrorNumber;
use virt::interface::Interface;
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;

use super::hosts::{HostError, HostLink};
use super::libvirt::BlockingPool;
use super::ssh::SshTarget;
use crate::config::{HostConfig, ImageConfig, SshConfig};
use crate::instance;

/// Deadline of each libvirt call of a check.
const CHECK_CALL_DEADLINE: Duration = Duration::from_secs(10);

/// What one host check found.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HostReport {
    /// Host name from the config.
    pub host: String,
    /// Its SSH address.
    pub address: String,
    /// Whether every check passed.
    pub ok: bool,
    /// Reason code of the first failure (`config`, `dns`, `connect`, `timeout`, `auth`,
    /// `host-key`, `key-file`, `libvirt-socket`, `forwarding-disabled`, `disconnected`,
    /// `tunnel`, `busy`, `libvirt`, `pool-missing`, `pool-inactive`, `bridge-missing`,
    /// `cpu-placement`).
    pub reason: Option<String>,
    /// The dial stage the first failure happened at (`key-files`, `dns`, `tcp-connect`,
    /// `ssh-handshake`, `ssh-auth`, `channel`, `libvirt-open`), when it was the dial's.
    pub stage: Option<String>,
    /// Human message of the first failure.
    pub message: Option<String>,
    /// The SSH connection and handshake succeeded.
    pub reachable: bool,
    /// The host key was verified against known_hosts (false when verification is off).
    pub host_key_verified: bool,
    /// libvirt daemon version, `major.minor.micro`.
    pub libvirt_version: Option<String>,
    /// Hypervisor (QEMU) version, `major.minor.micro`.
    pub hypervisor_version: Option<String>,
    /// Whether the host offers KVM domains.
    pub kvm: Option<bool>,
    /// CPUs online (what plugins see as `host.cpus`).
    pub cpus: Option<u32>,
    /// NUMA nodes (what plugins see as `host.numa-nodes`).
    pub numa_nodes: Option<u32>,
    /// The storage pool.
    pub pool: Option<PoolReport>,
    /// Whether the bridge exists on the host.
    pub bridge_present: Option<bool>,
    /// Cached base images, per configured image.
    pub images: Vec<ImageReport>,
    /// How long the whole check took, in milliseconds.
    pub duration_ms: u64,
}

/// The storage pool of a host.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolReport {
    /// Pool name.
    pub name: String,
    /// Whether the pool is active.
    pub active: bool,
    /// Free bytes.
    pub free_bytes: u64,
}

/// Whether an image is in a host's cache.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ImageReport {
    /// Image name from the config.
    pub name: String,
    /// Volume it is cached as.
    pub volume: String,
    /// Whether it is cached and verified (its data volume and its commit marker exist).
    pub cached: bool,
    /// Whether only the data volume exists: an upload in progress, or one that died (the
    /// next Create takes it over once its heartbeat record stops changing).
    pub staging: bool,
}

fn version_string(v: u32) -> String {
    format!("{}.{}.{}", v / 1_000_000, (v / 1_000) % 1_000, v % 1_000)
}

impl HostReport {
    fn new(host: &HostConfig) -> Self {
        Self {
            host: host.name.clone(),
            address: host.address.clone(),
            ok: false,
            reason: None,
            stage: None,
            message: None,
            reachable: false,
            host_key_verified: false,
            libvirt_version: None,
            hypervisor_version: None,
            kvm: None,
            cpus: None,
            numa_nodes: None,
            pool: None,
            bridge_present: None,
            images: Vec::new(),
            duration_ms: 0,
        }
    }

    fn fail(&mut self, reason: &str, message: impl Into<String>) {
        if self.reason.is_none() {
            self.reason = Some(reason.to_string());
            self.message = Some(message.into());
        }
    }

    fn fail_with(&mut self, e: &HostError) {
        if self.reason.is_none() {
            self.stage = e.stage().map(str::to_string);
        }
        self.fail(e.reason_code(), e.to_string());
    }
}

/// Checks one host within `timeout`, on a dedicated connection.
pub async fn check_host(
    ssh: &SshConfig,
    host: &HostConfig,
    images: &[ImageConfig],
    pool: &BlockingPool,
    timeout: Duration,
) -> HostReport {
    let started = Instant::now();
    let mut report = HostReport::new(host);
    match tokio::time::timeout(timeout, run(ssh, host, images, pool, &mut report)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => report.fail_with(&e),
        Err(_) => report.fail(
            "timeout",
            format!("the check did not finish within {timeout:?}"),
        ),
    }
    report.ok = report.reason.is_none();
    report.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    report
}

async fn run(
    ssh: &SshConfig,
    host: &HostConfig,
    images: &[ImageConfig],
    pool: &BlockingPool,
    report: &mut HostReport,
) -> Result<(), HostError> {
    let target = SshTarget::from_config(ssh, host)?;
    let link = match HostLink::dial(&target, host, pool, CHECK_CALL_DEADLINE).await {
        Ok(link) => link,
        Err(e) => {
            // Past the SSH handshake and login, the host is reachable even if its
            // libvirt socket is not.
            if matches!(e.stage(), Some("channel" | "tunnel" | "libvirt-open")) {
                report.reachable = true;
                report.host_key_verified = !host.insecure_ignore_host_key;
            }
            return Err(e);
        }
    };
    report.reachable = true;
    report.host_key_verified = !host.insecure_ignore_host_key;
    let result = facts(&link, host, images, report).await;
    link.close().await;
    result
}

async fn facts(
    link: &HostLink,
    host: &HostConfig,
    images: &[ImageConfig],
    report: &mut HostReport,
) -> Result<(), HostError> {
    let conn = link.conn();
    let wrap = |source| HostError::Libvirt {
        host: host.name.clone(),
        source,
    };
    let (lib, hyp, caps, node) = conn
        .call("host-facts", CHECK_CALL_DEADLINE, |c| {
            Ok((
                c.get_lib_version()?,
                c.get_hyp_version()?,
                c.get_capabilities()?,
                c.get_node_info()?,
            ))
        })
        .await
        .map_err(wrap)?;
    report.libvirt_version = Some(version_string(lib));
    report.hypervisor_version = Some(version_string(hyp));
    report.kvm = Some(caps.contains("domain type='kvm'") || caps.contains("domain type=\"kvm\""));
    let numa_nodes = crate::provider::kvm2::ops::capabilities_cells(&caps)
        .unwrap_or(node.nodes)
        .max(1);
    report.cpus = Some(node.cpus);
    report.numa_nodes = Some(numa_nodes);
    if let Some(problem) = placement_beyond(host, node.cpus, numa_nodes) {
        report.fail("cpu-placement", problem);
    }

    let pool_name = host.storage_pool.clone();
    let volumes: Vec<(String, String, String)> = images
        .iter()
        .map(|i| {
            (
                i.name.clone(),
                instance::image_volume_name(&i.sha256),
                instance::image_marker_name(&i.sha256),
            )
        })
        .collect();
    let lookups = volumes.clone();
    let pool_facts = conn
        .call("pool-facts", CHECK_CALL_DEADLINE, move |c| {
            let pool = match StoragePool::lookup_by_name(c, &pool_name) {
                Ok(p) => p,
                Err(e) if e.code() == ErrorNumber::NoStoragePool => return Ok(None),
                Err(e) => return Err(e),
            };
            let active = pool.is_active()?;
            let free = if active {
                pool.get_info()?.available
            } else {
                0
            };
            let exists = |name: &str| active && StorageVol::lookup_by_name(&pool, name).is_ok();
            let cached: Vec<(bool, bool)> = lookups
                .iter()
                .map(|(_, vol, marker)| (exists(vol), exists(marker)))
                .collect();
            Ok(Some((active, free, cached)))
        })
        .await
        .map_err(wrap)?;
    match pool_facts {
        None => report.fail(
            "pool-missing",
            format!("storage pool {:?} does not exist", host.storage_pool),
        ),
        Some((active, free_bytes, cached)) => {
            if !active {
                report.fail(
                    "pool-inactive",
                    format!("storage pool {:?} is not active", host.storage_pool),
                );
            }
            report.pool = Some(PoolReport {
                name: host.storage_pool.clone(),
                active,
                free_bytes,
            });
            report.images = volumes
                .into_iter()
                .zip(cached)
                .map(|((name, volume, _), (data, marker))| ImageReport {
                    name,
                    volume,
                    cached: data && marker,
                    staging: data && !marker,
                })
                .collect();
        }
    }

    let bridge = host.bridge.clone();
    let present = conn
        .call(
            "bridge",
            CHECK_CALL_DEADLINE,
            move |c| match Interface::lookup_by_name(c, &bridge) {
                Ok(_) => Ok(true),
                Err(e) if e.code() == ErrorNumber::NoInterface => Ok(false),
                Err(e) => Err(e),
            },
        )
        .await
        .map_err(wrap)?;
    report.bridge_present = Some(present);
    if !present {
        report.fail(
            "bridge-missing",
            format!("bridge {:?} does not exist on the host", host.bridge),
        );
    }
    Ok(())
}

/// Why the host's `cpuPlacement` names a CPU or NUMA node the host does not have (every
/// render that pins there would be refused by the rule `cpu-placement`), if it does.
fn placement_beyond(host: &HostConfig, cpus: u32, numa_nodes: u32) -> Option<String> {
    let p = host.cpu_placement.as_ref()?;
    let beyond = |set: &str, count: u32, what: &str, field: &str| {
        let max = crate::templates::check::CpuSet::parse(set)?.max();
        (max >= count).then(|| {
            format!(
                "cpuPlacement.{field} {set:?} names {what} {max}; the host has {count} (numbered 0 to {})",
                count.saturating_sub(1)
            )
        })
    };
    beyond(&p.cpus, cpus, "CPU", "cpus").or_else(|| {
        p.nodes
            .as_deref()
            .and_then(|n| beyond(n, numa_nodes, "NUMA node", "nodes"))
    })
}

/// Renders reports as a table for people.
pub fn table(reports: &[HostReport]) -> String {
    let mut out = String::new();
    for r in reports {
        let status = if r.ok {
            "OK".to_string()
        } else {
            format!("FAIL ({})", r.reason.as_deref().unwrap_or("unknown"))
        };
        out.push_str(&format!("{}  {}  {status}\n", r.host, r.address));
        if let Some(stage) = &r.stage {
            out.push_str(&format!("  failed at            {stage}\n"));
        }
        let yn = |b: bool| if b { "yes" } else { "no" };
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        out.push_str(&format!("  reachable            {}\n", yn(r.reachable)));
        out.push_str(&format!(
            "  host key verified    {}\n",
            yn(r.host_key_verified)
        ));
        out.push_str(&format!(
            "  libvirt version      {}\n",
            opt(&r.libvirt_version)
        ));
        out.push_str(&format!(
            "  hypervisor version   {}\n",
            opt(&r.hypervisor_version)
        ));
        out.push_str(&format!(
            "  kvm                  {}\n",
            r.kvm.map_or("-", yn)
        ));
        let count = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |n| n.to_string());
        out.push_str(&format!(
            "  cpus / numa nodes    {} / {}\n",
            count(r.cpus),
            count(r.numa_nodes)
        ));
        match &r.pool {
            Some(p) => out.push_str(&format!(
                "  pool                 {} ({}, {} bytes free)\n",
                p.name,
                if p.active { "active" } else { "inactive" },
                p.free_bytes
            )),
            None => out.push_str("  pool                 -\n"),
        }
        out.push_str(&format!(
            "  bridge present       {}\n",
            r.bridge_present.map_or("-", yn)
        ));
        for i in &r.images {
            out.push_str(&format!(
                "  image {:<14} {}\n",
                i.name,
                match (i.cached, i.staging) {
                    (true, _) => "cached (verified)",
                    (false, true) => "staging (upload in progress or abandoned)",
                    _ => "not cached",
                }
            ));
        }
        if let Some(m) = &r.message {
            out.push_str(&format!("  problem              {m}\n"));
        }
        out.push_str(&format!("  took                 {} ms\n", r.duration_ms));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_dotted() {
        assert_eq!(version_string(9_000_000), "9.0.0");
        assert_eq!(version_string(10_000_002), "10.0.2");
        assert_eq!(version_string(8_010_003), "8.10.3");
    }
}
