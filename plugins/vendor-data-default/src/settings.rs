//! The plugin's settings, their JSON Schema (derived from the type) and their checks.
//!
//! [`Plan::new`] is the one place values are checked: `validate-settings` reports its
//! problems with JSON pointers, and `render` builds from the plan it returns, so a value
//! that reaches the output has always been parsed and checked.

use std::collections::BTreeSet;
use std::net::IpAddr;

use schemars::JsonSchema;
use serde::Deserialize;
use templates_sdk::SettingsProblem;

use crate::cidr::Cidr;

/// Settings of the default vendor-data plugin. `{}` gives tinyproxy on port 3128 for the
/// private address ranges, CONNECT only to port 443, and destinations that are this VM,
/// the network it sits on, link-local or a cloud metadata address refused by the kernel.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Settings {
    /// TCP port the proxy listens on (every address of the VM).
    #[schemars(range(min = 1, max = 65535))]
    pub listen_port: u16,
    /// Client networks allowed to use the proxy, in CIDR notation (IPv4 or IPv6). Every
    /// other client gets 403. At least one: an open proxy is never the default.
    #[schemars(length(min = 1, max = 256))]
    pub allowed_client_cidrs: Vec<String>,
    /// Destination ports a client may `CONNECT` to (tinyproxy's `ConnectPort`). At least
    /// one: tinyproxy allows every port when none is listed. Plain HTTP requests are not
    /// limited by port; the destination firewall applies to both.
    #[schemars(length(min = 1, max = 64))]
    pub connect_ports: Vec<u16>,
    /// Destination networks the proxy may reach even though they are refused by default:
    /// an address of the VM itself (loopback included), a network the VM sits on,
    /// link-local, or a metadata address. Checked before every refusal, so a range that
    /// covers the VM's own address opens that address too. Only TCP is filtered.
    #[schemars(length(max = 256))]
    pub allowed_destination_cidrs: Vec<String>,
    /// More destination networks the proxy must not reach, on top of the defaults.
    #[schemars(length(max = 256))]
    pub denied_destination_cidrs: Vec<String>,
    /// Whether the guest may install what it lacks (tinyproxy, nftables, iproute2,
    /// qemu-guest-agent, `extraPackages`) with apt. `false` for air-gapped guests whose
    /// image already has the software: then no package index is updated, nothing is
    /// installed, and a missing program fails the setup with its name.
    pub install_packages: bool,
    /// Most simultaneous client connections.
    #[schemars(range(min = 1, max = 100000))]
    pub max_clients: u32,
    /// NTP servers for cloud-init's `ntp` module; none keeps the image's default. Needs
    /// `installPackages` (the module installs an NTP client when the image has none).
    /// Optional: a Proxy's user-data `ntp:` key replaces it.
    #[schemars(length(max = 16))]
    pub ntp_servers: Vec<String>,
    /// Extra Debian/Ubuntu packages to install (only those missing). Needs
    /// `installPackages`.
    #[schemars(length(max = 64))]
    pub extra_packages: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            listen_port: 3128,
            allowed_client_cidrs: vec![
                "10.0.0.0/8".into(),
                "172.16.0.0/12".into(),
                "192.168.0.0/16".into(),
            ],
            connect_ports: vec![443],
            allowed_destination_cidrs: Vec::new(),
            denied_destination_cidrs: Vec::new(),
            install_packages: true,
            max_clients: 512,
            ntp_servers: Vec::new(),
            extra_packages: Vec::new(),
        }
    }
}

/// What every proxy needs; installed when missing and `installPackages` is on.
pub const REQUIRED_PACKAGES: &[&str] = &["tinyproxy", "nftables", "iproute2", "qemu-guest-agent"];

/// Destinations refused unless `allowedDestinationCidrs` covers them, each with the
/// reason written next to its rule. The VM's own addresses (whatever they are) and the
/// networks it sits on (learnt from its routes at each start) are refused besides these.
pub const DEFAULT_DENIED: &[(&str, &str)] = &[
    ("0.0.0.0/8", "this network: 0.0.0.0 reaches this VM"),
    ("127.0.0.0/8", "loopback"),
    (
        "169.254.0.0/16",
        "link-local, with the 169.254.169.254 metadata service",
    ),
    ("100.100.100.200/32", "metadata service (Alibaba Cloud)"),
    ("::/128", "unspecified: reaches this VM"),
    ("::1/128", "loopback"),
    ("fe80::/10", "link-local"),
    ("fd00:ec2::254/128", "metadata service (AWS, IPv6)"),
];

/// Checked, canonical settings: what the render writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// tinyproxy's `Port`.
    pub listen_port: u16,
    /// tinyproxy's `MaxClients`.
    pub max_clients: u32,
    /// tinyproxy's `Allow` lines, in the given order, duplicates dropped.
    pub clients: Vec<Cidr>,
    /// tinyproxy's `ConnectPort` lines.
    pub connect_ports: BTreeSet<u16>,
    /// Exemptions, each with its settings index (for the rule's comment).
    pub allowed_destinations: Vec<(usize, Cidr)>,
    /// Refusals from the settings, each with its settings index.
    pub denied_destinations: Vec<(usize, Cidr)>,
    /// Whether packages may be installed.
    pub install_packages: bool,
    /// Required and extra packages, in order, duplicates dropped.
    pub packages: Vec<String>,
    /// NTP servers.
    pub ntp_servers: Vec<String>,
}

impl Plan {
    /// Checks every value and builds the plan, or returns every problem found.
    pub fn new(s: &Settings) -> Result<Self, Vec<SettingsProblem>> {
        let mut problems = Vec::new();
        if s.listen_port == 0 {
            problems.push(SettingsProblem::new("/listenPort", "must not be 0"));
        }
        if !(1..=100_000).contains(&s.max_clients) {
            problems.push(SettingsProblem::new("/maxClients", "must be in 1..=100000"));
        }
        if s.allowed_client_cidrs.is_empty() {
            problems.push(SettingsProblem::new(
                "/allowedClientCidrs",
                "at least one network is required; an open proxy is never the default",
            ));
        }
        if s.connect_ports.is_empty() {
            problems.push(SettingsProblem::new(
                "/connectPorts",
                "at least one port is required; tinyproxy allows CONNECT to every port when none is listed",
            ));
        }
        for (i, port) in s.connect_ports.iter().enumerate() {
            if *port == 0 {
                problems.push(SettingsProblem::new(
                    format!("/connectPorts/{i}"),
                    "must not be 0",
                ));
            }
        }
        let clients = cidrs(
            "/allowedClientCidrs",
            &s.allowed_client_cidrs,
            false,
            &mut problems,
        );
        let allowed = cidrs(
            "/allowedDestinationCidrs",
            &s.allowed_destination_cidrs,
            true,
            &mut problems,
        );
        let denied = cidrs(
            "/deniedDestinationCidrs",
            &s.denied_destination_cidrs,
            true,
            &mut problems,
        );
        for (i, host) in s.ntp_servers.iter().enumerate() {
            if let Err(e) = check_host(host) {
                problems.push(SettingsProblem::new(format!("/ntpServers/{i}"), e));
            }
        }
        for (i, name) in s.extra_packages.iter().enumerate() {
            if let Err(e) = check_package(name) {
                problems.push(SettingsProblem::new(format!("/extraPackages/{i}"), e));
            }
        }
        if !s.install_packages {
            if !s.extra_packages.is_empty() {
                problems.push(SettingsProblem::new(
                    "/extraPackages",
                    "installPackages is false: nothing is installed, so extra packages must be in the image",
                ));
            }
            if !s.ntp_servers.is_empty() {
                problems.push(SettingsProblem::new(
                    "/ntpServers",
                    "installPackages is false, and cloud-init's ntp module installs an NTP client \
                     when the image has none (which fails without a network); set ntp in the \
                     Proxy's user-data if the image has a client",
                ));
            }
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        let mut packages: Vec<String> = REQUIRED_PACKAGES.iter().map(|p| p.to_string()).collect();
        for p in &s.extra_packages {
            if !packages.contains(p) {
                packages.push(p.clone());
            }
        }
        let mut unique_clients = Vec::new();
        for (_, c) in clients {
            if !unique_clients.contains(&c) {
                unique_clients.push(c);
            }
        }
        Ok(Self {
            listen_port: s.listen_port,
            max_clients: s.max_clients,
            clients: unique_clients,
            connect_ports: s.connect_ports.iter().copied().collect(),
            allowed_destinations: allowed,
            denied_destinations: denied,
            install_packages: s.install_packages,
            packages,
            ntp_servers: s.ntp_servers.clone(),
        })
    }
}

/// Parses a list of networks, reporting each bad entry at its pointer. Destinations in
/// the IPv4-mapped range are refused: their packets are IPv4, so the rule would be dead.
fn cidrs(
    pointer: &str,
    items: &[String],
    destination: bool,
    problems: &mut Vec<SettingsProblem>,
) -> Vec<(usize, Cidr)> {
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match Cidr::parse(item) {
            Ok(c) if destination && c.is_ipv4_mapped() => problems.push(SettingsProblem::new(
                format!("{pointer}/{i}"),
                format!("{item:?} is IPv4-mapped; write the IPv4 network instead"),
            )),
            Ok(c) => out.push((i, c)),
            Err(e) => problems.push(SettingsProblem::new(format!("{pointer}/{i}"), e)),
        }
    }
    out
}

/// A DNS name or IP address (for NTP servers).
pub fn check_host(host: &str) -> Result<(), String> {
    if host.parse::<IpAddr>().is_ok() {
        return Ok(());
    }
    let ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!("{host:?} is not a host name or IP address"))
    }
}

/// Debian package names: lower-case letters, digits, `+ - .`, starting alphanumeric
/// (Debian policy 5.6.7). Nothing a shell or apt would read as an option or a pattern.
pub fn check_package(name: &str) -> Result<(), String> {
    let ok = name.len() >= 2
        && name.len() <= 128
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'+' | b'-' | b'.')
        });
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?} is not a valid package name"))
    }
}
