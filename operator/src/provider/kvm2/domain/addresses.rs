//! Choosing the guest addresses to publish in a Proxy's status.
//!
//! An instance with a static address (allocated from its host's pool and recorded in its
//! mark) is reported with that address and [`AddressOrigin::Static`], and no source is
//! asked. Otherwise libvirt knows a guest's addresses from three sources of differing trust
//! and availability; they are asked in [`AddressSource::ORDER`], and the first one that
//! gives a usable address wins, so the answer does not flap between sources.
//!
//! What keeps a stale address out of status (an address that belongs, or belonged, to
//! another VM, or to this one no longer):
//!
//! 1. **The guest's own view first.** The guest agent reports the addresses the guest has
//!    configured now; a lease or a neighbour entry is somebody else's memory of the past.
//!    So the agent is asked first, then the lease database, then the ARP table.
//! 2. **Only this incarnation's MAC.** Only the operator's NIC counts, matched by MAC (a
//!    guest may have other interfaces, Docker bridges or loopback via the agent, whose
//!    addresses a consumer must not be sent to). The MAC is new for every domain a Create
//!    defines ([`crate::instance::derive_mac`]), so a lease or ARP entry that an earlier VM
//!    of the same Proxy left behind carries another MAC and never matches.
//! 3. **No address by a shared MAC.** When another domain on the host carries the same MAC
//!    (a collision the Create-time check should have prevented, or a hand-made domain), no
//!    detected address is published: nobody can tell whose it is.
//! 4. **Expired leases are not reported.** libvirt's lease source skips leases whose expiry
//!    is past (its network driver filters them before they reach
//!    `virDomainInterfaceAddresses`); leases of the previous incarnation that have not
//!    expired carry its MAC (rule 2).
//! 5. **Inside the bridge's network.** When the host's bridge network is known (its
//!    `addressPool.cidr`, or in DHCP mode the network of the libvirt network whose bridge
//!    it is: [`super::bridgenet`]), an IPv4 address outside it is dropped (an entry from
//!    another segment, or a guest that configured itself wrongly).
//! 6. **Usable, and only while running.** Loopback, link-local, unspecified, multicast and
//!    broadcast addresses are dropped, and an instance that is not running has none.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use virt::sys;

use crate::provider::{AddressOrigin, InstanceState};

/// Where libvirt got an interface list from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AddressSource {
    /// The QEMU guest agent inside the VM.
    Agent,
    /// DHCP leases of a libvirt-managed network.
    Lease,
    /// The host's ARP table (bridged networks without libvirt's DHCP).
    Arp,
}

impl AddressSource {
    /// The order sources are tried in: the guest's own view (the agent), then the DHCP
    /// server's, then the host's neighbour table (see the module's rules).
    pub const ORDER: [AddressSource; 3] = [
        AddressSource::Agent,
        AddressSource::Lease,
        AddressSource::Arp,
    ];

    /// The `source` argument of `virDomainInterfaceAddresses`.
    pub fn virt_source(self) -> u32 {
        match self {
            AddressSource::Lease => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE,
            AddressSource::Agent => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT,
            AddressSource::Arp => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP,
        }
    }

    /// The provider-level name of this source, as status publishes it.
    pub fn origin(self) -> AddressOrigin {
        match self {
            AddressSource::Lease => AddressOrigin::Lease,
            AddressSource::Agent => AddressOrigin::Agent,
            AddressSource::Arp => AddressOrigin::Arp,
        }
    }

    /// Stable lower-case label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            AddressSource::Lease => "lease",
            AddressSource::Agent => "agent",
            AddressSource::Arp => "arp",
        }
    }
}

/// One interface as a source reports it, reduced to what address choice needs; a plain
/// type so the choice is testable without libvirt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicAddrs {
    /// MAC address as libvirt prints it.
    pub hwaddr: String,
    /// Addresses as libvirt prints them, without prefix length.
    pub addrs: Vec<String>,
}

impl From<&virt::domain::Interface> for NicAddrs {
    fn from(iface: &virt::domain::Interface) -> Self {
        Self {
            hwaddr: iface.hwaddr.clone(),
            addrs: iface.addrs.iter().map(|a| a.addr.clone()).collect(),
        }
    }
}

/// The addresses to publish: those of the first source (in [`AddressSource::ORDER`],
/// whatever the order of `results`) that yields at least one usable address, from the
/// interfaces whose MAC is `mac` (case-insensitive; any interface when `None`). IPv4 first,
/// then IPv6, duplicates dropped, otherwise in the order reported. Empty when no source
/// has one.
pub fn pick_addresses(
    mac: Option<&str>,
    results: &[(AddressSource, Vec<NicAddrs>)],
) -> Vec<IpAddr> {
    for source in AddressSource::ORDER {
        let found: Vec<IpAddr> = results
            .iter()
            .filter(|(s, _)| *s == source)
            .flat_map(|(_, nics)| nics)
            .filter(|nic| mac.is_none_or(|m| nic.hwaddr.trim().eq_ignore_ascii_case(m.trim())))
            .flat_map(|nic| &nic.addrs)
            .filter_map(|a| a.trim().parse::<IpAddr>().ok())
            .filter(|ip| usable(*ip))
            .collect();
        if found.is_empty() {
            continue;
        }
        let mut out: Vec<IpAddr> = Vec::with_capacity(found.len());
        for ip in found
            .iter()
            .filter(|ip| ip.is_ipv4())
            .chain(found.iter().filter(|ip| ip.is_ipv6()))
        {
            if !out.contains(ip) {
                out.push(*ip);
            }
        }
        return out;
    }
    Vec::new()
}

/// `addrs` without the IPv4 addresses outside `net` (rule 5); all of them when the
/// network is not known. IPv6 addresses are kept: the pool says nothing about them.
pub fn within(net: Option<&ipnet::Ipv4Net>, addrs: Vec<IpAddr>) -> Vec<IpAddr> {
    match net {
        None => addrs,
        Some(net) => addrs
            .into_iter()
            .filter(|ip| match ip {
                IpAddr::V4(v4) => net.contains(v4),
                IpAddr::V6(v6) => v6.to_ipv4_mapped().is_none_or(|v4| net.contains(&v4)),
            })
            .collect(),
    }
}

/// The addresses of an instance in `state`: none unless it runs. A stopped domain's lease
/// or ARP entry can outlive it, and an address that answers nothing must not be published.
pub fn running_only(state: InstanceState, addrs: Vec<IpAddr>) -> Vec<IpAddr> {
    if state == InstanceState::Running {
        addrs
    } else {
        Vec::new()
    }
}

/// Whether a consumer could reach the guest at this address from elsewhere: not loopback,
/// link-local, unspecified, multicast or broadcast. An IPv4-mapped IPv6 address is judged
/// as the IPv4 address it carries.
fn usable(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => usable_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => usable_v4(v4),
            None => usable_v6(v6),
        },
    }
}

fn usable_v4(ip: Ipv4Addr) -> bool {
    !(ip.is_loopback()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_multicast()
        || ip.is_broadcast())
}

fn usable_v6(ip: Ipv6Addr) -> bool {
    // fe80::/10; `Ipv6Addr::is_unicast_link_local` says the same.
    let link_local = ip.segments()[0] & 0xffc0 == 0xfe80;
    !(ip.is_loopback() || link_local || ip.is_unspecified() || ip.is_multicast())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: &str = "52:54:00:ab:cd:ef";

    fn nic(hwaddr: &str, addrs: &[&str]) -> NicAddrs {
        NicAddrs {
            hwaddr: hwaddr.into(),
            addrs: addrs.iter().map(|a| a.to_string()).collect(),
        }
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn usable_addresses() {
        let table = [
            ("192.0.2.10", true),
            ("10.0.0.1", true),
            ("2001:db8::1", true),
            ("fd00::1", true),
            ("127.0.0.1", false),
            ("127.1.2.3", false),
            ("::1", false),
            ("169.254.1.1", false),
            ("169.254.0.0", false),
            ("169.255.0.1", true),
            ("fe80::1", false),
            ("febf::1", false),
            ("fec0::1", true),
            ("0.0.0.0", false),
            ("::", false),
            ("224.0.0.1", false),
            ("239.255.255.250", false),
            ("ff02::1", false),
            ("255.255.255.255", false),
            ("::ffff:127.0.0.1", false),
            ("::ffff:192.0.2.1", true),
        ];
        for (addr, want) in table {
            let ip: IpAddr = addr.parse().unwrap();
            assert_eq!(usable(ip), want, "{addr}");
        }
    }

    #[test]
    fn picking() {
        use AddressSource::{Agent, Arp, Lease};
        struct Case {
            what: &'static str,
            mac: Option<&'static str>,
            results: Vec<(AddressSource, Vec<NicAddrs>)>,
            want: Vec<&'static str>,
        }
        let cases = vec![
            Case {
                what: "nothing",
                mac: Some(MAC),
                results: vec![],
                want: vec![],
            },
            Case {
                what: "the agent (the guest's own view) wins",
                mac: Some(MAC),
                results: vec![
                    (Lease, vec![nic(MAC, &["192.0.2.10"])]),
                    (Agent, vec![nic(MAC, &["192.0.2.20"])]),
                    (Arp, vec![nic(MAC, &["192.0.2.30"])]),
                ],
                want: vec!["192.0.2.20"],
            },
            Case {
                what: "an earlier VM's lease and ARP entry (another MAC) are not ours",
                mac: Some(MAC),
                results: vec![
                    (Lease, vec![nic("52:54:00:00:00:01", &["192.0.2.10"])]),
                    (Arp, vec![nic("52:54:00:00:00:01", &["192.0.2.11"])]),
                    (Arp, vec![nic(MAC, &["192.0.2.30"])]),
                ],
                want: vec!["192.0.2.30"],
            },
            Case {
                what: "source order, not slice order",
                mac: Some(MAC),
                results: vec![
                    (Arp, vec![nic(MAC, &["192.0.2.30"])]),
                    (Agent, vec![nic(MAC, &["192.0.2.20"])]),
                ],
                want: vec!["192.0.2.20"],
            },
            Case {
                what: "lease when the agent has only unusable addresses",
                mac: Some(MAC),
                results: vec![
                    (
                        Agent,
                        vec![
                            nic("00:00:00:00:00:00", &["127.0.0.1", "::1"]),
                            nic(MAC, &["169.254.3.4", "fe80::5054:ff:feab:cdef"]),
                        ],
                    ),
                    (Lease, vec![nic(MAC, &["192.0.2.20"])]),
                ],
                want: vec!["192.0.2.20"],
            },
            Case {
                what: "arp last",
                mac: Some(MAC),
                results: vec![
                    (Lease, vec![]),
                    (Agent, vec![nic(MAC, &[])]),
                    (Arp, vec![nic(MAC, &["192.0.2.30"])]),
                ],
                want: vec!["192.0.2.30"],
            },
            Case {
                what: "other NICs ignored",
                mac: Some(MAC),
                results: vec![(
                    Agent,
                    vec![
                        nic("02:42:ac:11:00:02", &["172.17.0.1"]),
                        nic(MAC, &["192.0.2.20"]),
                    ],
                )],
                want: vec!["192.0.2.20"],
            },
            Case {
                what: "only other NICs: next source",
                mac: Some(MAC),
                results: vec![
                    (Agent, vec![nic("02:42:ac:11:00:02", &["172.17.0.1"])]),
                    (Arp, vec![nic(MAC, &["192.0.2.30"])]),
                ],
                want: vec!["192.0.2.30"],
            },
            Case {
                what: "MAC case-insensitive",
                mac: Some("52:54:00:AB:CD:EF"),
                results: vec![(Lease, vec![nic(MAC, &["192.0.2.10"])])],
                want: vec!["192.0.2.10"],
            },
            Case {
                what: "any NIC without a MAC",
                mac: None,
                results: vec![(
                    Agent,
                    vec![nic("a", &["192.0.2.1"]), nic("b", &["192.0.2.2", "lo"])],
                )],
                want: vec!["192.0.2.1", "192.0.2.2"],
            },
            Case {
                what: "IPv4 first, stable, deduplicated",
                mac: Some(MAC),
                results: vec![(
                    Agent,
                    vec![
                        nic(
                            MAC,
                            &[
                                "2001:db8::2",
                                "192.0.2.2",
                                "2001:db8::1",
                                "192.0.2.1",
                                "192.0.2.2",
                            ],
                        ),
                        nic(MAC, &["2001:db8::2", "192.0.2.3"]),
                    ],
                )],
                want: vec![
                    "192.0.2.2",
                    "192.0.2.1",
                    "192.0.2.3",
                    "2001:db8::2",
                    "2001:db8::1",
                ],
            },
            Case {
                what: "IPv6 only",
                mac: Some(MAC),
                results: vec![(Lease, vec![nic(MAC, &["fe80::1", "2001:db8::1"])])],
                want: vec!["2001:db8::1"],
            },
            Case {
                what: "garbage skipped",
                mac: Some(MAC),
                results: vec![(
                    Lease,
                    vec![nic(
                        MAC,
                        &[
                            "",
                            "not-an-ip",
                            "192.0.2.10/24",
                            "300.1.1.1",
                            " 192.0.2.11 ",
                        ],
                    )],
                )],
                want: vec!["192.0.2.11"],
            },
            Case {
                what: "same source twice is merged",
                mac: Some(MAC),
                results: vec![
                    (Arp, vec![nic(MAC, &["192.0.2.31"])]),
                    (Arp, vec![nic(MAC, &["192.0.2.32", "192.0.2.31"])]),
                ],
                want: vec!["192.0.2.31", "192.0.2.32"],
            },
            Case {
                what: "nothing usable anywhere",
                mac: Some(MAC),
                results: vec![
                    (Lease, vec![nic(MAC, &["0.0.0.0"])]),
                    (
                        Agent,
                        vec![nic(MAC, &["127.0.0.1", "224.0.0.1", "ff02::1", "::"])],
                    ),
                    (Arp, vec![nic("other", &["192.0.2.1"])]),
                ],
                want: vec![],
            },
        ];
        for c in cases {
            assert_eq!(
                pick_addresses(c.mac, &c.results),
                ips(&c.want),
                "{}",
                c.what
            );
        }
    }

    #[test]
    fn outside_the_bridge_network_is_dropped() {
        let net: ipnet::Ipv4Net = "10.203.0.0/24".parse().unwrap();
        let found = ips(&[
            "10.203.0.17",
            "192.0.2.10",
            "2001:db8::1",
            "::ffff:192.0.2.1",
        ]);
        assert_eq!(
            within(Some(&net), found.clone()),
            ips(&["10.203.0.17", "2001:db8::1"])
        );
        assert_eq!(within(None, found.clone()), found);
    }

    #[test]
    fn only_running_instances_have_addresses() {
        let addrs = ips(&["192.0.2.10", "2001:db8::1"]);
        let table = [
            (InstanceState::Running, true),
            (InstanceState::Paused, false),
            (InstanceState::ShutOff, false),
            (InstanceState::Dying, false),
            (InstanceState::Crashed, false),
            (InstanceState::Suspended, false),
            (InstanceState::Blocked, false),
            (InstanceState::NoState, false),
        ];
        for (state, keeps) in table {
            let want = if keeps { addrs.clone() } else { vec![] };
            assert_eq!(running_only(state, addrs.clone()), want, "{state}");
        }
    }

    #[test]
    fn sources() {
        assert_eq!(
            AddressSource::ORDER.map(AddressSource::virt_source),
            [1, 0, 2]
        );
        assert_eq!(
            AddressSource::ORDER.map(AddressSource::as_str),
            ["agent", "lease", "arp"]
        );
        let mut sorted = AddressSource::ORDER;
        sorted.sort();
        assert_eq!(sorted, AddressSource::ORDER);
    }

    #[test]
    fn from_virt_interface() {
        let iface = virt::domain::Interface {
            name: "vnet0".into(),
            hwaddr: MAC.into(),
            naddrs: 2,
            addrs: vec![
                virt::domain::IPAddress {
                    typed: 0,
                    addr: "192.0.2.10".into(),
                    prefix: 24,
                },
                virt::domain::IPAddress {
                    typed: 1,
                    addr: "2001:db8::1".into(),
                    prefix: 64,
                },
            ],
        };
        assert_eq!(
            NicAddrs::from(&iface),
            nic(MAC, &["192.0.2.10", "2001:db8::1"])
        );
    }
}
