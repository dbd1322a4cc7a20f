//! A route from the test process's network namespace into a namespace the test made, so
//! the operator (which runs here) can reach a VM on the namespace's isolated bridge, as
//! it reaches a VM on a real bridge in production.
//!
//! Network rule: the route leads only into the namespace. A veth pair joins the two
//! namespaces on a /30 (here `.1`, namespace `.2`); forwarding is turned on inside the
//! namespace only, whose routing table knows nothing but the /30 and its own bridge. A
//! VM can so reach exactly one address outside its bridge (`.1`, this machine), and
//! nothing at all beyond it: there is no NAT and no default route in the namespace.

use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{Result, bail};

use super::process;

/// A veth pair plus a route for one subnet into a namespace; removed on drop (deleting
/// one end deletes the pair, and with it the route).
#[derive(Debug)]
pub struct NamespaceRoute {
    root_if: String,
    root_addr: Ipv4Addr,
    ns_addr: Ipv4Addr,
}

impl NamespaceRoute {
    /// Links this namespace to `netns` on `10.214.K.0/30` and routes `subnet` (a network
    /// inside `netns`, e.g. its bridge's) through it. `k` keeps concurrent tests apart;
    /// use [`super::subnet_index`].
    pub fn start(netns: &str, subnet: &str, k: u8) -> Result<Self> {
        let root_addr = Ipv4Addr::new(10, 214, k, 1);
        let ns_addr = Ipv4Addr::new(10, 214, k, 2);
        let root_if = format!("egr{}k{k}", std::process::id() % 100_000);
        let ns_if = format!("{root_if}n");
        process::run(Command::new("ip").args([
            "link", "add", &root_if, "type", "veth", "peer", "name", &ns_if,
        ]))?;
        let route = Self {
            root_if: root_if.clone(),
            root_addr,
            ns_addr,
        };
        process::run(Command::new("ip").args(["link", "set", &ns_if, "netns", netns]))?;
        let in_ns = |args: &[&str]| -> Result<()> {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", netns]).args(args);
            process::run(&mut cmd).map(drop)
        };
        in_ns(&["ip", "addr", "add", &format!("{ns_addr}/30"), "dev", &ns_if])?;
        in_ns(&["ip", "link", "set", &ns_if, "up"])?;
        // Forwarding between the bridge and the veth, inside the namespace only.
        in_ns(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        process::run(Command::new("ip").args([
            "addr",
            "add",
            &format!("{root_addr}/30"),
            "dev",
            &root_if,
        ]))?;
        process::run(Command::new("ip").args(["link", "set", &root_if, "up"]))?;
        process::run(Command::new("ip").args([
            "route",
            "replace",
            subnet,
            "via",
            &ns_addr.to_string(),
            "dev",
            &root_if,
        ]))?;
        Ok(route)
    }

    /// This side's address: the source of the operator's probes, and the one address
    /// outside the bridge that the namespace can reach.
    pub fn root_address(&self) -> Ipv4Addr {
        self.root_addr
    }

    /// The namespace side's address (the gateway of the route into it).
    pub fn namespace_address(&self) -> Ipv4Addr {
        self.ns_addr
    }
}

impl Drop for NamespaceRoute {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.root_if])
            .output();
    }
}

/// A subnet index in 1..=250 that no route of this namespace uses yet in `10.213.K.0/24`
/// or `10.214.K.0/30`: concurrent tests (and a demo beside them) get disjoint networks.
pub fn subnet_index() -> Result<u8> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let base = std::process::id();
    for _ in 0..250 {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let k = u8::try_from((base.wrapping_add(n.wrapping_mul(7))) % 250 + 1).unwrap_or(1);
        let routes = process::run(Command::new("ip").args(["-4", "route", "show"]))?;
        let taken = routes.lines().any(|l| {
            l.starts_with(&format!("10.213.{k}.")) || l.starts_with(&format!("10.214.{k}."))
        });
        if !taken {
            return Ok(k);
        }
    }
    bail!("no free 10.213.K.0/24 subnet for a test bridge")
}

/// A veth pair between two namespaces that the tests made (the node's and a libvirtd's),
/// so pods reach VMs on the libvirtd's isolated bridge and the VMs answer them, without
/// anything passing through this machine's own namespace. Removed on drop.
///
/// Network rule as for [`NamespaceRoute`]: each side routes only the other's given
/// networks into the link, on `10.215.K.0/30`; neither gains a default route or NAT.
#[derive(Debug)]
pub struct NamespaceLink {
    netns_a: String,
    if_a: String,
}

impl NamespaceLink {
    /// Links `netns_a` (`10.215.K.1`) to `netns_b` (`10.215.K.2`); `a_routes` are the
    /// networks `netns_a` sends into the link (they live in `netns_b`), and `b_routes` the
    /// reverse. Both namespaces must already forward.
    pub fn start(
        netns_a: &str,
        netns_b: &str,
        k: u8,
        a_routes: &[&str],
        b_routes: &[&str],
    ) -> Result<Self> {
        let a_addr = Ipv4Addr::new(10, 215, k, 1);
        let b_addr = Ipv4Addr::new(10, 215, k, 2);
        let if_a = format!("eolk{k}a");
        let if_b = format!("eolk{k}b");
        process::run(Command::new("ip").args([
            "-n", netns_a, "link", "add", &if_a, "type", "veth", "peer", "name", &if_b, "netns",
            netns_b,
        ]))?;
        let link = Self {
            netns_a: netns_a.to_string(),
            if_a: if_a.clone(),
        };
        for (ns, dev, addr, peer, routes) in [
            (netns_a, &if_a, a_addr, b_addr, a_routes),
            (netns_b, &if_b, b_addr, a_addr, b_routes),
        ] {
            process::run(Command::new("ip").args([
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/30"),
                "dev",
                dev,
            ]))?;
            process::run(Command::new("ip").args(["-n", ns, "link", "set", dev, "up"]))?;
            for net in routes {
                process::run(Command::new("ip").args([
                    "-n",
                    ns,
                    "route",
                    "replace",
                    net,
                    "via",
                    &peer.to_string(),
                    "dev",
                    dev,
                ]))?;
            }
        }
        Ok(link)
    }
}

impl Drop for NamespaceLink {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["-n", &self.netns_a, "link", "del", &self.if_a])
            .output();
    }
}
