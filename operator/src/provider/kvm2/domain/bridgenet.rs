//! The IPv4 network a DHCP-mode host's bridge serves, for the subnet rule of
//! [`super::addresses`] (rule 5).
//!
//! A host with an `addressPool` names its bridge network in the config. A host without
//! one (DHCP mode) does not, so an address a guest agent reports from another segment
//! (a second NIC's, a guest that configured itself wrongly) was published as it came.
//! Where the bridge belongs to a libvirt network (the usual DHCP setup: libvirt's
//! dnsmasq serves the bridge), libvirt knows its network: the network's `<ip address
//! prefix|netmask>`. A bridge managed outside libvirt has no such record, and its
//! addresses are kept as before.
//!
//! Looked up once per host and kept for [`BRIDGE_NET_TTL`]: a bridge's network changes
//! only when an admin redefines it, and the lookup would otherwise add a libvirt call to
//! every refresh of every instance.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use quick_xml::events::Event;

/// How long a host's bridge network, once read, is used before it is read again.
pub const BRIDGE_NET_TTL: Duration = Duration::from_secs(600);

/// The IPv4 network of a libvirt network definition: its first `<ip>` element directly
/// under `<network>` whose family is IPv4 (no `family`, or `ipv4`), from `address` and
/// `prefix` (or `netmask`). `None` when there is none or it cannot be read.
pub fn network_ipv4(xml: &str) -> Option<Ipv4Net> {
    let mut reader = quick_xml::Reader::from_str(xml);
    let mut depth = 0usize;
    loop {
        let (e, empty) = match reader.read_event().ok()? {
            Event::Start(e) => (e, false),
            Event::Empty(e) => (e, true),
            Event::End(_) => {
                depth = depth.saturating_sub(1);
                continue;
            }
            Event::Eof => return None,
            _ => continue,
        };
        if depth == 1 && e.local_name().as_ref() == b"ip" {
            let attr = |name: &[u8]| -> Option<String> {
                e.attributes()
                    .flatten()
                    .find(|a| a.key.local_name().as_ref() == name)
                    .and_then(|a| a.unescape_value().ok().map(|v| v.trim().to_string()))
            };
            let family = attr(b"family");
            if family.as_deref().is_none_or(|f| f == "ipv4")
                && let Some(net) = ipv4_of(attr(b"address"), attr(b"prefix"), attr(b"netmask"))
            {
                return Some(net);
            }
        }
        if !empty {
            depth += 1;
        }
    }
}

fn ipv4_of(
    address: Option<String>,
    prefix: Option<String>,
    netmask: Option<String>,
) -> Option<Ipv4Net> {
    let address: Ipv4Addr = address?.parse().ok()?;
    let prefix = match (prefix, netmask) {
        (Some(p), _) => p.parse::<u8>().ok()?,
        (None, Some(m)) => ipnet::ipv4_mask_to_prefix(m.parse().ok()?).ok()?,
        (None, None) => return None,
    };
    // A /0 "network" would keep everything: no rule at all.
    if prefix == 0 {
        return None;
    }
    Some(Ipv4Net::new(address, prefix).ok()?.trunc())
}

/// Per host, its bridge's network as last read, and when.
#[derive(Debug, Default)]
pub struct BridgeNets {
    seen: Mutex<BTreeMap<String, (Instant, Option<Ipv4Net>)>>,
}

impl BridgeNets {
    /// The network of `host`'s bridge if read within [`BRIDGE_NET_TTL`]; `None` when it
    /// must be read (again).
    pub fn fresh(&self, host: &str) -> Option<Option<Ipv4Net>> {
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.get(host)
            .filter(|(at, _)| at.elapsed() < BRIDGE_NET_TTL)
            .map(|(_, net)| *net)
    }

    /// Records what a lookup found (a failed lookup is not recorded: it is asked again).
    pub fn note(&self, host: &str, net: Option<Ipv4Net>) {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(host.to_string(), (Instant::now(), net));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_networks_ipv4_is_read_from_prefix_or_netmask() {
        let with_prefix = "<network><name>lab</name><bridge name='br0'/>\
            <ip family='ipv6' address='fd00::1' prefix='64'/>\
            <ip address='10.203.0.1' prefix='24'><dhcp><range start='10.203.0.10' end='10.203.0.99'/></dhcp></ip>\
            </network>";
        assert_eq!(
            network_ipv4(with_prefix),
            Some("10.203.0.0/24".parse().unwrap())
        );
        let with_mask = "<network><name>default</name><bridge name='virbr0'/>\
            <ip address='192.168.122.1' netmask='255.255.255.0'/></network>";
        assert_eq!(
            network_ipv4(with_mask),
            Some("192.168.122.0/24".parse().unwrap())
        );
    }

    #[test]
    fn no_ipv4_network_means_no_rule() {
        for xml in [
            "<network><name>n</name><bridge name='br0'/></network>",
            "<network><name>n</name><ip family='ipv6' address='fd00::1' prefix='64'/></network>",
            "<network><name>n</name><ip address='10.0.0.1' prefix='0'/></network>",
            "<network><name>n</name><ip address='nonsense' prefix='24'/></network>",
            // Not directly under <network>: a route's or a port group's is not the bridge's.
            "<network><name>n</name><portgroup name='p'><ip address='10.0.0.1' prefix='24'/></portgroup></network>",
            "not xml <",
        ] {
            assert_eq!(network_ipv4(xml), None, "{xml}");
        }
    }
}
