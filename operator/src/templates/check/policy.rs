//! What the checker knows about the host beyond the plugin's input: facts and per-host
//! settings from the providers config that decide what a plugin may ask of this host.
//!
//! The default ([`HostPolicy::default`]) is the strictest: no NIC MTU, no CPU or NUMA
//! placement, only the stock NVRAM templates.

use std::collections::BTreeSet;

use crate::config::HostConfig;

/// Highest CPU or NUMA node number a set may name. libvirt's bitmaps are larger; no host
/// we run on has more, and the bound keeps parsing a hostile `^0-4294967295` cheap.
pub const MAX_CPU_ID: u32 = 8191;

/// Host facts and settings the output check applies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPolicy {
    /// MTU of the host's bridge (`bridgeMtu`); a NIC `<mtu>` must equal it. `None`: no
    /// NIC may set an MTU (libvirt would apply it to the tap before enslaving it, which
    /// changes the bridge's MTU for every VM on it).
    pub bridge_mtu: Option<u32>,
    /// CPU and NUMA placement the host lets plugins choose (`cpuPlacement`); `None`
    /// refuses any pinning.
    pub cpu_placement: Option<CpuPlacement>,
    /// UEFI variable-store templates allowed beyond the stock list (`nvramTemplates`: a
    /// site's own keys).
    pub nvram_templates: Vec<String>,
    /// CPUs the host has online and its NUMA nodes, as libvirt reports them (see
    /// [`HostPolicy::on_host`]); `None` where unknown. A `cpuset` or `nodeset` naming one
    /// past them is refused here, before define, instead of failing at start.
    pub host_size: Option<HostSize>,
}

/// How many CPUs and NUMA nodes a host has (libvirt's node info and capabilities).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostSize {
    /// CPUs online; valid CPU numbers are `0..cpus`.
    pub cpus: u32,
    /// NUMA nodes; valid node numbers are `0..numa_nodes`.
    pub numa_nodes: u32,
}

/// The host CPUs (and NUMA nodes) the operator owns for proxy VMs: every `cpuset` and
/// `nodeset` a plugin writes must lie inside them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuPlacement {
    /// Host CPUs proxy VMs may be pinned to.
    pub cpus: CpuSet,
    /// NUMA nodes their memory may be bound to; `None` refuses `<numatune>`.
    pub nodes: Option<CpuSet>,
}

impl HostPolicy {
    /// The policy of a configured host. Its sets were checked when the config was loaded
    /// ([`CpuSet::parse`]); one that does not parse here gives no placement (strict).
    pub fn for_host(host: &HostConfig) -> Self {
        let cpu_placement = host.cpu_placement.as_ref().and_then(|p| {
            Some(CpuPlacement {
                cpus: CpuSet::parse(&p.cpus)?,
                nodes: match &p.nodes {
                    Some(n) => Some(CpuSet::parse(n)?),
                    None => None,
                },
            })
        });
        Self {
            bridge_mtu: host.bridge_mtu,
            cpu_placement,
            nvram_templates: host.nvram_templates.clone(),
            host_size: None,
        }
    }

    /// The policy of a configured host with the size its libvirt reported (what a Create
    /// renders with, and what the plugin saw in `host.cpus` and `host.numa-nodes`).
    pub fn on_host(host: &HostConfig, size: HostSize) -> Self {
        Self {
            host_size: Some(size),
            ..Self::for_host(host)
        }
    }

    /// The policy a render with `input` is checked against: its host's, with the size
    /// the input told the plugin.
    pub fn for_render(host: &HostConfig, input: &crate::templates::DomainInput) -> Self {
        Self::on_host(
            host,
            HostSize {
                cpus: input.host.cpus,
                numa_nodes: input.host.numa_nodes,
            },
        )
    }
}

/// A set of host CPUs or NUMA nodes in libvirt's syntax: `0-3,8,^2` (ranges, single
/// numbers, and exclusions applied after the inclusions, as `virBitmapParse` does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuSet(BTreeSet<u32>);

impl CpuSet {
    /// Parses libvirt's syntax; `None` for anything libvirt would not read the same way
    /// or that names a number above [`MAX_CPU_ID`] or is empty after exclusions.
    pub fn parse(s: &str) -> Option<Self> {
        if s.is_empty() || s.len() > 256 {
            return None;
        }
        let mut set = BTreeSet::new();
        let mut minus = BTreeSet::new();
        for part in s.split(',') {
            let (neg, body) = match part.strip_prefix('^') {
                Some(b) => (true, b),
                None => (false, part),
            };
            let (lo, hi) = match body.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => {
                    let n = num(body)?;
                    (n, n)
                }
            };
            if lo > hi || (neg && lo != hi) {
                return None;
            }
            let target = if neg { &mut minus } else { &mut set };
            target.extend(lo..=hi);
        }
        for n in &minus {
            set.remove(n);
        }
        (!set.is_empty()).then_some(Self(set))
    }

    /// Whether every member is also in `other`.
    pub fn is_subset(&self, other: &CpuSet) -> bool {
        self.0.is_subset(&other.0)
    }

    /// The highest member (a set is never empty).
    pub fn max(&self) -> u32 {
        self.0.last().copied().unwrap_or(0)
    }
}

/// A CPU number: digits only, at most [`MAX_CPU_ID`].
fn num(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 5 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|n| *n <= MAX_CPU_ID)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_sets_read_as_libvirt_does() {
        let set = |s| CpuSet::parse(s).map(|c| c.0.into_iter().collect::<Vec<_>>());
        assert_eq!(set("0-3,^2,8"), Some(vec![0, 1, 3, 8]));
        assert_eq!(set("5"), Some(vec![5]));
        for bad in [
            "",
            "3-1",
            "0-",
            "-1",
            "a",
            "0,,1",
            "^0",
            "0-4294967295",
            "4294967295",
            "1 ",
            "+1",
            "^1-2",
        ] {
            assert_eq!(set(bad), None, "{bad:?}");
        }
        let owned = CpuSet::parse("4-7").unwrap();
        assert!(CpuSet::parse("4,6").unwrap().is_subset(&owned));
        assert!(!CpuSet::parse("3-4").unwrap().is_subset(&owned));
    }
}
