//! What a plugin may cost the host and what it may share with other tenants: counts and
//! sizes bounded by the machine type (or fixed), CPU and NUMA placement only inside the
//! CPUs the operator owns on that host, the accelerator the host has, the bridge's MTU,
//! and no nested virtualisation or vPMU asked for by the plugin.
//!
//! Each bound is a documented function of the machine type's vCPUs, or a fixed number;
//! [`BOUNDS`] lists them for the rules page.

use super::allow;
use super::policy::{CpuSet, HostPolicy};
use super::tree::Node;
use super::{refuse, show};
use crate::templates::DomainInput;
use crate::templates::errors::TemplateErrorKind;

/// Largest video memory (`ram`, `vram`, `vgamem`, in KiB) of the one video device: QEMU's
/// default for standard VGA, enough for a text console at any resolution a proxy needs.
pub const MAX_VIDEO_KIB: u64 = 16 * 1024;
/// Largest virtio ring a NIC may ask for (`rx_queue_size`, `tx_queue_size`): the virtio
/// maximum QEMU accepts for a tap backend.
pub const MAX_NIC_RING: u64 = 1024;
/// Most ports of a controller (`ports`): virtio-serial's default maximum and above the
/// 15 of an xHCI controller.
pub const MAX_CONTROLLER_PORTS: u64 = 31;
/// Most MSI-X vectors of a controller (`vectors`).
pub const MAX_CONTROLLER_VECTORS: u64 = 64;
/// Most bytes per second a virtio-rng may draw from the host's random device.
pub const MAX_RNG_BYTES_PER_SECOND: u64 = 64 * 1024;
/// Shortest rng rate period (ms): a shorter one only refills the budget more often.
pub const MIN_RNG_PERIOD_MS: u64 = 100;

/// The bounds as the rules page shows them: (where, bound).
pub const BOUNDS: &[(&str, &str)] = &[
    ("`/domain/iothreads`", "at most the machine type's vCPUs"),
    (
        "`/domain/devices/interface/driver/@queues`, `/domain/devices/disk/driver/@queues`, `/domain/devices/controller/driver/@queues`",
        "1 to the machine type's vCPUs",
    ),
    (
        "`/domain/devices/interface/driver/@rx_queue_size`, `@tx_queue_size`",
        "at most 1024",
    ),
    ("`/domain/devices/controller/@ports`", "at most 31"),
    ("`/domain/devices/controller/@vectors`", "at most 64"),
    (
        "`/domain/devices/video`",
        "at most one device; `ram`, `vram`, `vgamem` at most 16384 KiB each; `heads` 1",
    ),
    (
        "`/domain/devices/rng/rate`",
        "required on every rng; `period` at least 100 ms (1000 when absent); at most 65536 bytes per second",
    ),
    (
        "TCG translation cache (`/domain/features/tcg`)",
        "not settable: QEMU's default",
    ),
    (
        "`/domain/vcpu/@cpuset`, `/domain/cputune/vcpupin/@cpuset`, `/domain/cputune/emulatorpin/@cpuset`",
        "refused unless the host's `cpuPlacement.cpus` is set; then a subset of it",
    ),
    (
        "`/domain/numatune/memory/@nodeset`",
        "refused unless the host's `cpuPlacement.nodes` is set; then a subset of it",
    ),
];

/// Applies the host rules to the document root.
pub fn check(
    root: &Node,
    input: &DomainInput,
    policy: &HostPolicy,
) -> Result<(), TemplateErrorKind> {
    domain_type(root, input)?;
    bounds(root, input)?;
    placement(root, policy)?;
    cpu_features(root)?;
    let Some(devices) = root.child("devices") else {
        return Ok(());
    };
    for (i, nic) in devices.children_named("interface").enumerate() {
        if let Some(mtu) = nic.child("mtu") {
            let at = format!("/domain/devices/interface[{}]/mtu/@size", i + 1);
            let size = mtu.attr("size").and_then(allow::uint);
            match policy.bridge_mtu {
                Some(want) if size == Some(u64::from(want)) => {}
                Some(want) => {
                    return Err(refuse(
                        "bridge-mtu",
                        format!(
                            "{at} is {}; the bridge's MTU is {want} (a NIC may only repeat it)",
                            show(mtu.attr("size").unwrap_or_default())
                        ),
                    ));
                }
                None => {
                    return Err(refuse(
                        "bridge-mtu",
                        format!(
                            "{at} is set and the host's bridge MTU is not configured (bridgeMtu): a NIC MTU would change the shared bridge's MTU"
                        ),
                    ));
                }
            }
        }
    }
    rng_rates(devices)
}

/// `kvm` where the host has KVM (and does not disable it), `qemu` only where it has not:
/// TCG is no security boundary and costs many times the CPU.
fn domain_type(root: &Node, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    let want = if input.host.kvm { "kvm" } else { "qemu" };
    let got = root.attr("type").unwrap_or_default();
    if got != want {
        return Err(refuse(
            "domain-type",
            format!(
                "/domain/@type is {}; this host {} (use {want:?})",
                show(got),
                if input.host.kvm {
                    "has KVM: emulation (TCG) is refused"
                } else {
                    "has no KVM (or disables it)"
                }
            ),
        ));
    }
    Ok(())
}

/// A number attribute at most `max`, and at least `min`.
fn bounded(
    node: &Node,
    attr: &str,
    at: &str,
    min: u64,
    max: u64,
    why: &str,
) -> Result<(), TemplateErrorKind> {
    let Some(raw) = node.attr(attr) else {
        return Ok(());
    };
    match allow::uint(raw) {
        Some(n) if (min..=max).contains(&n) => Ok(()),
        _ => Err(refuse(
            "resource-bound",
            format!(
                "{at}/@{attr} is {}; allowed {min} to {max} ({why})",
                show(raw)
            ),
        )),
    }
}

fn bounds(root: &Node, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    let vcpus = u64::from(input.vcpus);
    let per_vcpu = "the machine type's vCPUs";
    if let Some(io) = root.child("iothreads") {
        match allow::uint(&io.text) {
            Some(n) if n <= vcpus => {}
            _ => {
                return Err(refuse(
                    "resource-bound",
                    format!(
                        "/domain/iothreads is {}; at most {vcpus} ({per_vcpu})",
                        show(&io.text)
                    ),
                ));
            }
        }
    }
    let Some(devices) = root.child("devices") else {
        return Ok(());
    };
    for (i, nic) in devices.children_named("interface").enumerate() {
        if let Some(d) = nic.child("driver") {
            let at = format!("/domain/devices/interface[{}]/driver", i + 1);
            bounded(d, "queues", &at, 1, vcpus, per_vcpu)?;
            bounded(d, "rx_queue_size", &at, 1, MAX_NIC_RING, "virtio's ring")?;
            bounded(d, "tx_queue_size", &at, 1, MAX_NIC_RING, "virtio's ring")?;
        }
    }
    for (i, disk) in devices.children_named("disk").enumerate() {
        if let Some(d) = disk.child("driver") {
            let at = format!("/domain/devices/disk[{}]/driver", i + 1);
            bounded(d, "queues", &at, 1, vcpus, per_vcpu)?;
        }
    }
    for (i, c) in devices.children_named("controller").enumerate() {
        let at = format!("/domain/devices/controller[{}]", i + 1);
        bounded(c, "ports", &at, 1, MAX_CONTROLLER_PORTS, "fixed")?;
        bounded(c, "vectors", &at, 0, MAX_CONTROLLER_VECTORS, "fixed")?;
        if let Some(d) = c.child("driver") {
            bounded(d, "queues", &format!("{at}/driver"), 1, vcpus, per_vcpu)?;
        }
    }
    for (i, v) in devices.children_named("video").enumerate() {
        let at = format!("/domain/devices/video[{}]", i + 1);
        if i > 0 {
            return Err(refuse(
                "resource-bound",
                format!("{at}: at most one video device"),
            ));
        }
        if let Some(m) = v.child("model") {
            let at = format!("{at}/model");
            for attr in ["ram", "vram", "vgamem"] {
                bounded(m, attr, &at, 0, MAX_VIDEO_KIB, "KiB, fixed")?;
            }
            bounded(m, "heads", &at, 1, 1, "one head")?;
        }
    }
    Ok(())
}

/// Host CPU and NUMA placement: only inside what the host's config gives the operator.
fn placement(root: &Node, policy: &HostPolicy) -> Result<(), TemplateErrorKind> {
    let cpus = policy.cpu_placement.as_ref().map(|p| &p.cpus);
    let nodes = policy.cpu_placement.as_ref().and_then(|p| p.nodes.as_ref());
    let mut sets: Vec<(String, &str)> = Vec::new();
    if let Some(s) = root.child("vcpu").and_then(|v| v.attr("cpuset")) {
        sets.push(("/domain/vcpu/@cpuset".into(), s));
    }
    if let Some(tune) = root.child("cputune") {
        for (i, pin) in tune.children_named("vcpupin").enumerate() {
            sets.push((
                format!("/domain/cputune/vcpupin[{}]/@cpuset", i + 1),
                pin.attr("cpuset").unwrap_or_default(),
            ));
        }
        if let Some(pin) = tune.child("emulatorpin") {
            sets.push((
                "/domain/cputune/emulatorpin/@cpuset".into(),
                pin.attr("cpuset").unwrap_or_default(),
            ));
        }
    }
    let size = policy.host_size;
    for (at, set) in sets {
        within(&at, set, cpus, "cpuPlacement.cpus")?;
        on_host(&at, set, size.map(|s| s.cpus), "CPUs")?;
    }
    if let Some(mem) = root.child("numatune").and_then(|n| n.child("memory")) {
        let at = "/domain/numatune/memory/@nodeset";
        let set = mem.attr("nodeset").unwrap_or_default();
        within(at, set, nodes, "cpuPlacement.nodes")?;
        on_host(at, set, size.map(|s| s.numa_nodes), "NUMA nodes")?;
    } else if root.child("numatune").is_some() && nodes.is_none() {
        return Err(refuse(
            "cpu-placement",
            "/domain/numatune is set and this host's cpuPlacement.nodes is not",
        ));
    }
    Ok(())
}

/// A set inside the operator's placement can still name a CPU (or node) the host does
/// not have, when `cpuPlacement` was written for bigger hosts: refused here rather than
/// at start, where libvirt fails the whole Create.
fn on_host(at: &str, set: &str, count: Option<u32>, what: &str) -> Result<(), TemplateErrorKind> {
    match (CpuSet::parse(set), count) {
        (Some(s), Some(n)) if s.max() >= n => Err(refuse(
            "cpu-placement",
            format!(
                "{at} is {}, but the host has {n} {what} (numbered 0 to {})",
                show(set),
                n.saturating_sub(1)
            ),
        )),
        _ => Ok(()),
    }
}

fn within(
    at: &str,
    set: &str,
    owned: Option<&CpuSet>,
    setting: &str,
) -> Result<(), TemplateErrorKind> {
    let Some(owned) = owned else {
        return Err(refuse(
            "cpu-placement",
            format!(
                "{at} pins to host CPUs/nodes {}; this host's {setting} is not set, so plugins may not choose placement",
                show(set)
            ),
        ));
    };
    match CpuSet::parse(set) {
        Some(s) if s.is_subset(owned) => Ok(()),
        _ => Err(refuse(
            "cpu-placement",
            format!(
                "{at} is {}, not inside the host's {setting} (the CPUs the operator owns)",
                show(set)
            ),
        )),
    }
}

/// Nested virtualisation and the vPMU are host settings (see the rules page); a plugin may
/// not ask for them.
fn cpu_features(root: &Node) -> Result<(), TemplateErrorKind> {
    if let Some(cpu) = root.child("cpu") {
        for (i, f) in cpu.children_named("feature").enumerate() {
            let name = f.attr("name").unwrap_or_default();
            // libvirt's default policy is `require`.
            let policy = f.attr("policy").unwrap_or("require");
            if matches!(name, "vmx" | "svm") && !matches!(policy, "disable" | "forbid") {
                return Err(refuse(
                    "nested-virt",
                    format!(
                        "/domain/cpu/feature[{}] asks for {name} ({policy}): nested virtualisation is not for plugins",
                        i + 1
                    ),
                ));
            }
        }
    }
    if let Some(pmu) = root.child("features").and_then(|f| f.child("pmu"))
        && pmu.attr("state") != Some("off")
    {
        return Err(refuse(
            "vpmu",
            "/domain/features/pmu may only turn the vPMU off (state=\"off\")",
        ));
    }
    Ok(())
}

/// Every rng has a rate limit within [`MAX_RNG_BYTES_PER_SECOND`].
fn rng_rates(devices: &Node) -> Result<(), TemplateErrorKind> {
    for rng in devices.children_named("rng") {
        let at = "/domain/devices/rng/rate";
        let Some(rate) = rng.child("rate") else {
            return Err(refuse(
                "rng-rate",
                format!("{at} is missing: every rng needs a rate limit (bytes per period)"),
            ));
        };
        let bytes = rate.attr("bytes").and_then(allow::uint);
        // libvirt documents a missing period as 1000 ms.
        let period = match rate.attr("period") {
            Some(p) => allow::uint(p),
            None => Some(1000),
        };
        let ok = match (bytes, period) {
            (Some(b), Some(p)) if b > 0 && p >= MIN_RNG_PERIOD_MS => {
                u128::from(b) * 1000 <= u128::from(MAX_RNG_BYTES_PER_SECOND) * u128::from(p)
            }
            _ => false,
        };
        if !ok {
            return Err(refuse(
                "rng-rate",
                format!(
                    "{at} is bytes={} period={}; allowed: a period of at least {MIN_RNG_PERIOD_MS} ms and at most {MAX_RNG_BYTES_PER_SECOND} bytes per second",
                    show(rate.attr("bytes").unwrap_or("missing")),
                    show(rate.attr("period").unwrap_or("1000"))
                ),
            ));
        }
    }
    Ok(())
}
