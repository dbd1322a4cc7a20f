//! The default vendor-data plugin: turns a stock Debian-family cloud image into an egress
//! proxy, safe with `{}` settings.
//!
//! - tinyproxy listens on `listenPort`, serves only `allowedClientCidrs` (everyone else
//!   gets 403), allows `CONNECT` only to `connectPorts` (443 by default), and adds no Via
//!   header (it would carry the VM's host name).
//! - An nftables table, applied before every start of tinyproxy by a systemd drop-in
//!   (`ExecStartPre`, failing closed), resets tinyproxy's new TCP connections to the VM's
//!   own addresses, the networks it sits on (read from its routes, and applied again by
//!   a watcher on every change of them, see [`netwatch`]),
//!   loopback, link-local, metadata addresses and `deniedDestinationCidrs`, unless
//!   `allowedDestinationCidrs` matches first. tinyproxy's filters match host names as
//!   strings, which `CONNECT 127.1:22` or a name resolving to 127.0.0.1 defeats; the
//!   kernel sees the address actually dialled.
//! - Missing packages are installed with apt, or nothing at all with
//!   `installPackages: false` (air-gapped guests whose image has the software).
//!
//! The output is a MIME multipart whose essential part is a shell script (see
//! [`render`]): cloud-init replaces whole top-level keys of vendor-data with user-data's,
//! and a script part is the one thing the Proxy's user-data cannot silently drop.
#![forbid(unsafe_code)]

pub mod cidr;
pub mod netwatch;
pub mod render;
pub mod settings;

use templates_sdk::vendor_data::VendorDataInput;
use templates_sdk::{SettingsProblem, VendorDataPlugin};

pub use settings::{Plan, Settings};

/// The plugin.
#[derive(Debug)]
pub struct DefaultVendorData;

impl VendorDataPlugin for DefaultVendorData {
    type Settings = Settings;

    fn validate_settings(s: &Settings) -> Vec<SettingsProblem> {
        Plan::new(s).err().unwrap_or_default()
    }

    fn render(_input: &VendorDataInput, s: &Settings) -> Result<String, String> {
        // The operator validated the settings; check again rather than trust, since the
        // output is a script run as root.
        let plan = Plan::new(s).map_err(|problems| {
            let all: Vec<String> = problems.iter().map(ToString::to_string).collect();
            format!("settings refused: {}", all.join("; "))
        })?;
        render::vendor_data(&plan)
    }
}

templates_sdk::export_vendor_data_plugin!(DefaultVendorData);

#[cfg(test)]
mod tests;
