//! The default vendor-data plugin: cloud-config that turns a stock cloud image into an
//! egress proxy.
//!
//! It installs tinyproxy (small, one config file, in every distribution) and the QEMU guest
//! agent (so the operator can read the VM's address), configures tinyproxy to listen on a
//! port and accept only the allowed client networks, sets NTP servers, and installs extra
//! packages. User-data from the Proxy's Secret is applied by cloud-init on top of this.
#![forbid(unsafe_code)]

use std::net::IpAddr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use templates_sdk::cloud_config::CloudConfig;
use templates_sdk::vendor_data::VendorDataInput;
use templates_sdk::{SettingsProblem, VendorDataPlugin};

/// Settings of the default vendor-data plugin. `{}` gives a proxy on port 3128 for the
/// private address ranges.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Settings {
    /// TCP port the proxy listens on.
    #[schemars(range(min = 1, max = 65535))]
    pub listen_port: u16,
    /// Client networks allowed to use the proxy, in CIDR notation (IPv4 or IPv6).
    #[schemars(length(min = 1, max = 256))]
    pub allowed_client_cidrs: Vec<String>,
    /// Most simultaneous client connections.
    #[schemars(range(min = 1, max = 100000))]
    pub max_clients: u32,
    /// NTP servers; none keeps the image's default.
    #[schemars(length(max = 16))]
    pub ntp_servers: Vec<String>,
    /// Extra Debian/Ubuntu packages to install.
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
            max_clients: 512,
            ntp_servers: Vec::new(),
            extra_packages: Vec::new(),
        }
    }
}

/// Checks `addr/len` with `len` within the address family's width.
fn check_cidr(cidr: &str) -> Result<(), String> {
    let (addr, len) = cidr
        .split_once('/')
        .ok_or_else(|| format!("{cidr:?} is not in CIDR notation (address/prefix-length)"))?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("{addr:?} is not an IP address"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    match len.parse::<u8>() {
        Ok(n) if n <= max => Ok(()),
        _ => Err(format!("prefix length {len:?} is not in 0..={max}")),
    }
}

/// A DNS name or IP address (for NTP servers).
fn check_host(host: &str) -> Result<(), String> {
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

/// Debian package names: lower-case letters, digits, `+ - .`, starting alphanumeric.
fn check_package(name: &str) -> Result<(), String> {
    let ok = name.len() >= 2
        && name.len() <= 128
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'+' | b'-' | b'.')
        });
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?} is not a valid package name"))
    }
}

/// The plugin.
#[derive(Debug)]
pub struct DefaultVendorData;

impl VendorDataPlugin for DefaultVendorData {
    type Settings = Settings;

    fn validate_settings(s: &Settings) -> Vec<SettingsProblem> {
        let mut problems = Vec::new();
        if s.listen_port == 0 {
            problems.push(SettingsProblem::new("/listenPort", "must not be 0"));
        }
        if s.allowed_client_cidrs.is_empty() {
            problems.push(SettingsProblem::new(
                "/allowedClientCidrs",
                "at least one network is required; an open proxy is never the default",
            ));
        }
        type Rule = fn(&str) -> Result<(), String>;
        let lists: [(&str, &Vec<String>, Rule); 3] = [
            ("/allowedClientCidrs", &s.allowed_client_cidrs, check_cidr),
            ("/ntpServers", &s.ntp_servers, check_host),
            ("/extraPackages", &s.extra_packages, check_package),
        ];
        for (pointer, items, check) in lists {
            for (i, item) in items.iter().enumerate() {
                if let Err(e) = check(item) {
                    problems.push(SettingsProblem::new(format!("{pointer}/{i}"), e));
                }
            }
        }
        problems
    }

    fn render(input: &VendorDataInput, s: &Settings) -> Result<String, String> {
        // The proxy name goes into a config file value; the operator validated it as a
        // DNS-1123 label, and we check again rather than trust.
        if !input
            .proxy_name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(format!(
                "proxy name {:?} is not a DNS-1123 label",
                input.proxy_name
            ));
        }
        let mut conf = String::new();
        conf.push_str("# Written by egress-operator's vendor-data-default plugin.\n");
        conf.push_str("User tinyproxy\nGroup tinyproxy\n");
        conf.push_str(&format!("Port {}\n", s.listen_port));
        conf.push_str("Timeout 600\n");
        conf.push_str(&format!("MaxClients {}\n", s.max_clients));
        conf.push_str("LogLevel Info\nSyslog On\n");
        conf.push_str(&format!("ViaProxyName \"{}\"\n", input.proxy_name));
        conf.push_str("DisableViaHeader Yes\n");
        for cidr in &s.allowed_client_cidrs {
            check_cidr(cidr)?;
            conf.push_str(&format!("Allow {cidr}\n"));
        }

        let mut doc = CloudConfig::new()
            .set("package_update", true)?
            .package("tinyproxy")
            .package("qemu-guest-agent");
        for p in &s.extra_packages {
            check_package(p)?;
            doc = doc.package(p);
        }
        if !s.ntp_servers.is_empty() {
            #[derive(Serialize)]
            struct Ntp<'a> {
                enabled: bool,
                servers: &'a [String],
            }
            doc = doc.set(
                "ntp",
                Ntp {
                    enabled: true,
                    servers: &s.ntp_servers,
                },
            )?;
        }
        doc.write_file("/etc/tinyproxy/tinyproxy.conf", conf, "0644")
            .run_command(["systemctl", "enable", "--now", "qemu-guest-agent"])
            .run_command(["systemctl", "restart", "tinyproxy"])
            .render()
    }
}

templates_sdk::export_vendor_data_plugin!(DefaultVendorData);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        assert!(check_cidr("10.0.0.0/8").is_ok());
        assert!(check_cidr("fd00::/8").is_ok());
        assert!(check_cidr("10.0.0.0/33").is_err());
        assert!(check_cidr("10.0.0.0").is_err());
        assert!(check_cidr("x/8").is_err());
        assert!(check_host("ntp.example.org").is_ok());
        assert!(check_host("bad host").is_err());
        assert!(check_package("squid").is_ok());
        assert!(check_package("a;rm").is_err());
    }

    #[test]
    fn defaults_are_valid() {
        assert!(DefaultVendorData::validate_settings(&Settings::default()).is_empty());
        let open = Settings {
            allowed_client_cidrs: vec![],
            ..Settings::default()
        };
        assert_eq!(
            DefaultVendorData::validate_settings(&open)[0].pointer,
            "/allowedClientCidrs"
        );
    }
}
