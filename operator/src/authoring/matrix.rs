//! The cases `plugin test` renders, and the inputs of each, assembled by the same function
//! the provider uses ([`crate::render::inputs_with`]) so a case is exactly a Create's render.
//!
//! Axes: every host (of the given config, or the sample host), BIOS and UEFI machine types,
//! one and three NICs, a static address and DHCP. Only what reaches a kind's input is
//! varied: a vendor-data input carries the host and machine type but neither NICs nor
//! the address, so its cases are hosts × firmware.

use std::net::Ipv4Addr;

use crate::api::proxy::ProxySpec;
use crate::config::{Firmware, HostConfig, ValidConfig};
use crate::instance::{InstanceNet, name_based_uid};
use crate::provider::ProxyRef;
use crate::render::{Facts, Inputs};
use crate::templates::TemplateKind;

use super::AuthoringError;

/// A providers config with one host, an address pool, an image and a BIOS and a UEFI
/// machine type: what `plugin test` renders for without `--config`. Only the parts that
/// reach a plugin's input matter; nothing is dialled or loaded from it.
pub const SAMPLE_CONFIG: &str = r#"
clusterId: plugin-test
kvm2:
  ssh:
    user: egress
    privateKeyFile: /etc/egress-operator/ssh/id_ed25519
    knownHostsFile: /etc/egress-operator/ssh/known_hosts
  hosts:
    - name: sample-host
      address: kvm-a.example.internal:22
      storagePool: default
      bridge: br-egress
      addressPool:
        cidr: 10.203.0.0/24
        gateway: 10.203.0.1
        rangeStart: 10.203.0.10
        rangeEnd: 10.203.0.200
  images:
    - name: debian-12
      url: https://images.example.internal/debian-12-genericcloud-amd64.qcow2
      sha256: 7c61a4e4a4d23b7ff25d8e4a4f4a1a0c3e06a1f4ad3ec15c2b0d1fb0c9b4b7a1
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 1024, diskGiB: 10, firmware: bios}
    - {name: medium-efi, vcpus: 2, memoryMiB: 2048, diskGiB: 20, firmware: efi}
  defaults: {machineType: small, image: debian-12}
  templates:
    domain: {path: /usr/lib/egress-operator/plugins/domain-default.wasm}
    vendorData: {path: /usr/lib/egress-operator/plugins/vendor-data-default.wasm}
"#;

/// Machine type added to a config that has none of a firmware kind, so both are tested.
const ADDED_MACHINE_TYPE: &str = "plugin-test";

/// Address of the static case on a host without an address pool (TEST-NET-1, RFC 5737).
const SAMPLE_STATIC_ADDRESS: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

/// Namespace and name of the Proxy every case renders for.
const PROXY_NAMESPACE: &str = "default";
const PROXY_NAME: &str = "plugin-test";
/// Creation time in the metadata mark: fixed, so snapshots are byte-identical run to run.
const CREATED_AT: &str = "2026-01-01T00:00:00Z";

/// How the guest gets its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressing {
    /// From the host's address pool (recorded in the metadata mark).
    Static(Ipv4Addr),
    /// DHCP on the bridge.
    Dhcp,
    /// DHCP, and the input gives no MAC: the WIT promises one only "when the operator
    /// assigns one", so a plugin must render without it (libvirt then makes one).
    DhcpWithoutMac,
}

impl Addressing {
    /// Whether the guest asks DHCP for its address.
    pub fn is_dhcp(self) -> bool {
        matches!(self, Self::Dhcp | Self::DhcpWithoutMac)
    }
}

/// One render of the matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// Host name from the config.
    pub host: String,
    /// Machine type name (of `firmware`).
    pub machine_type: String,
    /// Its firmware.
    pub firmware: Firmware,
    /// NICs asked for through `extraNics`; `None` where NICs do not reach the input.
    pub nics: Option<u8>,
    /// NICs the rendered domain has, once rendered: the label shows these, since a plugin
    /// may write more (or fewer) than it was asked for.
    pub rendered_nics: Option<usize>,
    /// Addressing; `None` where the address does not reach the input.
    pub addressing: Option<Addressing>,
    /// Settings of the plugin's own this case sets over the configured ones (see
    /// [`setting_variants`]); empty for the matrix's cases.
    pub settings: Vec<(String, serde_json::Value)>,
}

impl Case {
    /// A short label: `host firmware [N-nic] [static|dhcp|dhcp no-mac] [key=value]`, N
    /// being the NICs rendered (asked for, before the render or when it failed).
    pub fn label(&self) -> String {
        let mut parts = vec![
            self.host.clone(),
            match self.firmware {
                Firmware::Bios => "bios".to_string(),
                Firmware::Efi => "uefi".to_string(),
            },
        ];
        match (self.rendered_nics, self.nics) {
            (Some(n), _) => parts.push(format!("{n}-nic")),
            (None, Some(n)) => parts.push(format!("{n}-nic")),
            (None, None) => {}
        }
        match self.addressing {
            Some(Addressing::Static(_)) => parts.push("static".into()),
            Some(Addressing::Dhcp) => parts.push("dhcp".into()),
            Some(Addressing::DhcpWithoutMac) => parts.push("dhcp no-mac".into()),
            None => {}
        }
        for (key, value) in &self.settings {
            let shown = match value {
                serde_json::Value::String(v) => v.clone(),
                v => v.to_string(),
            };
            parts.push(format!("{key}={shown}"));
        }
        parts.join(" ")
    }

    /// The label as a file name (snapshots): anything but letters, digits, `-`, `=` and
    /// `.` becomes `_`.
    pub fn file_stem(&self) -> String {
        self.label()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '=' | '.') {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }
}

/// The machine types of a prepared config, one per firmware.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineTypes {
    /// A BIOS machine type.
    pub bios: String,
    /// A UEFI machine type.
    pub efi: String,
}

/// The config `plugin test` renders with: `config`, or the sample when `None`, with a
/// machine type added for a firmware kind it lacks (its first machine type's size with
/// that firmware). Returns it and the machine type used per firmware.
pub fn prepare(config: Option<ValidConfig>) -> Result<(ValidConfig, MachineTypes), AuthoringError> {
    let config = match config {
        Some(c) => c,
        None => crate::config::parse(SAMPLE_CONFIG, "sample config", std::path::Path::new("/"))
            .map_err(AuthoringError::Config)?,
    };
    let first = |fw: Firmware| {
        config
            .kvm2
            .machine_types
            .iter()
            .find(|m| m.firmware == fw)
            .map(|m| m.name.clone())
    };
    if let (Some(bios), Some(efi)) = (first(Firmware::Bios), first(Firmware::Efi)) {
        return Ok((config, MachineTypes { bios, efi }));
    }
    let mut providers = (*config).clone();
    let mut added = providers
        .kvm2
        .machine_types
        .first()
        .cloned()
        .ok_or_else(|| AuthoringError::Matrix {
            reason: "the providers config has no machine types".into(),
        })?;
    added.firmware = match added.firmware {
        Firmware::Bios => Firmware::Efi,
        Firmware::Efi => Firmware::Bios,
    };
    added.name = unused_name(&providers.kvm2.machine_types);
    let name = added.name.clone();
    providers.kvm2.machine_types.push(added);
    let text = serde_json::to_string(&providers).map_err(|e| AuthoringError::Matrix {
        reason: e.to_string(),
    })?;
    // JSON is YAML: the config parser checks the amended config like any other.
    let config = crate::config::parse(&text, "amended config", std::path::Path::new("/"))
        .map_err(AuthoringError::Config)?;
    let types = MachineTypes {
        bios: first(Firmware::Bios).unwrap_or_else(|| name.clone()),
        efi: first(Firmware::Efi).unwrap_or(name),
    };
    Ok((config, types))
}

fn unused_name(types: &[crate::config::MachineTypeConfig]) -> String {
    let mut name = ADDED_MACHINE_TYPE.to_string();
    let mut n = 1;
    while types.iter().any(|m| m.name == name) {
        n += 1;
        name = format!("{ADDED_MACHINE_TYPE}-{n}");
    }
    name
}

/// The static address of `host`'s case: the first of its pool, else a documentation
/// address.
fn static_address(host: &HostConfig) -> Ipv4Addr {
    host.address_pool
        .as_ref()
        .and_then(|p| p.parse().ok())
        .map(|p| p.first)
        .unwrap_or(SAMPLE_STATIC_ADDRESS)
}

/// Every case for a plugin of `kind`: hosts × firmware, and for a domain plugin × NICs
/// (1, and 3 when `nics_setting`, i.e. the plugin has an `extraNics` setting) × addressing
/// (static, DHCP), plus one DHCP case per host and firmware whose input has no MAC.
pub fn cases(
    kind: TemplateKind,
    config: &ValidConfig,
    types: &MachineTypes,
    nics_setting: bool,
) -> Vec<Case> {
    let mut cases = Vec::new();
    for host in &config.kvm2.hosts {
        for (firmware, machine_type) in [(Firmware::Bios, &types.bios), (Firmware::Efi, &types.efi)]
        {
            let case = |nics, addressing| Case {
                host: host.name.clone(),
                machine_type: machine_type.clone(),
                firmware,
                nics,
                rendered_nics: None,
                addressing,
                settings: Vec::new(),
            };
            match kind {
                TemplateKind::VendorData => cases.push(case(None, None)),
                TemplateKind::Domain => {
                    let nic_counts: &[u8] = if nics_setting { &[1, 3] } else { &[1] };
                    for &n in nic_counts {
                        for addressing in
                            [Addressing::Static(static_address(host)), Addressing::Dhcp]
                        {
                            cases.push(case(Some(n), Some(addressing)));
                        }
                    }
                    cases.push(case(Some(1), Some(Addressing::DhcpWithoutMac)));
                }
            }
        }
    }
    cases
}

/// Most values of one setting rendered (an enum longer than this is sampled from its
/// start).
const VARIANTS_PER_SETTING: usize = 16;

/// The values of the plugin's own top-level settings worth a case each: every value of an
/// enum (a finite list in the schema) and both booleans, except the schema's default,
/// which the matrix's cases render already. `skip` is left out (the NIC count, an axis of
/// its own). In key order.
pub fn setting_variants(schema: &str, skip: &str) -> Vec<(String, serde_json::Value)> {
    use serde_json::Value;
    let Ok(root) = serde_json::from_str::<Value>(schema) else {
        return Vec::new();
    };
    let Some(props) = root.get("properties").and_then(Value::as_object) else {
        return Vec::new();
    };
    let mut keys: Vec<&String> = props.keys().filter(|k| k.as_str() != skip).collect();
    keys.sort();
    let mut out = Vec::new();
    for key in keys {
        let prop = &props[key];
        let node = crate::templates::schema::resolve(&root, prop);
        let default = prop
            .get("default")
            .or_else(|| node.get("default"))
            .cloned()
            .unwrap_or(Value::Null);
        let boolean = |n: &Value| match n.get("type") {
            Some(Value::String(t)) => t == "boolean",
            Some(Value::Array(ts)) => ts.iter().any(|t| t == "boolean"),
            _ => false,
        };
        let values = if boolean(node) {
            vec![Value::Bool(false), Value::Bool(true)]
        } else {
            crate::templates::schema::allowed_values(&root, prop, 0).unwrap_or_default()
        };
        out.extend(
            values
                .into_iter()
                .filter(|v| !v.is_null() && *v != default)
                .take(VARIANTS_PER_SETTING)
                .map(|v| (key.clone(), v)),
        );
    }
    out
}

/// The inputs of `case`, as the provider assembles them for a Create on that host.
pub fn inputs(config: &ValidConfig, case: &Case, facts: &Facts) -> Result<Inputs, AuthoringError> {
    let fail = |reason: String| AuthoringError::Inputs {
        case: case.label(),
        reason,
    };
    let image = config
        .kvm2
        .defaults
        .as_ref()
        .and_then(|d| d.image.clone())
        .or_else(|| config.kvm2.images.first().map(|i| i.name.clone()))
        .ok_or_else(|| fail("the providers config has no images".into()))?;
    let owner = ProxyRef {
        namespace: PROXY_NAMESPACE.into(),
        name: PROXY_NAME.into(),
        uid: name_based_uid(PROXY_NAMESPACE, PROXY_NAME),
    };
    let spec = ProxySpec {
        provider: "kvm2".into(),
        machine_type: Some(case.machine_type.clone()),
        image: Some(image),
        host: Some(case.host.clone()),
        user_data: None,
        template_settings: None,
        update_policy: None,
    };
    let mut net = InstanceNet::preview(&owner.uid);
    net.address = match case.addressing {
        Some(Addressing::Static(a)) => Some(a),
        _ => None,
    };
    let mut facts = facts.clone();
    if let Some(host) = config.host(&case.host) {
        // As the provider does: a host with `disableKvm` renders for emulation.
        facts.kvm &= !host.disable_kvm;
    }
    let mut inputs =
        crate::render::inputs_with(config, &owner, &spec, None, &facts, CREATED_AT, &net)
            .map_err(fail)?;
    if case.addressing == Some(Addressing::DhcpWithoutMac) {
        inputs.domain.mac = None;
        inputs.mark.mac = None;
        inputs.domain.metadata_mark = inputs.mark.to_xml();
    }
    Ok(inputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every enum value and both booleans, except the default and null, in key order; the
    /// NIC setting and settings without a finite list are left out; labels and snapshot
    /// names carry the setting.
    #[test]
    fn setting_variants_cover_each_value_but_the_default() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "rng": {"type": "boolean", "default": true},
                "cpuMode": {"anyOf": [{"$ref": "#/$defs/CpuMode"}, {"type": "null"}], "default": null},
                "cache": {"enum": ["none", "writeback"], "default": "none"},
                "extraNics": {"type": "integer"},
                "name": {"type": "string"}
            },
            "$defs": {"CpuMode": {"oneOf": [{"const": "host-model"}, {"const": "host-passthrough"}]}}
        })
        .to_string();
        let v = setting_variants(&schema, "extraNics");
        let shown: Vec<String> = v.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(
            shown,
            [
                "cache=\"writeback\"",
                "cpuMode=\"host-model\"",
                "cpuMode=\"host-passthrough\"",
                "rng=false"
            ]
        );
        let (config, types) = sample();
        let mut case = cases(TemplateKind::Domain, &config, &types, false)[0].clone();
        case.settings = vec![v[1].clone()];
        assert_eq!(
            case.label(),
            "sample-host bios 1-nic static cpuMode=host-model"
        );
        assert_eq!(
            case.file_stem(),
            "sample-host_bios_1-nic_static_cpuMode=host-model"
        );
        assert!(setting_variants("not json", "x").is_empty());
    }

    fn sample() -> (ValidConfig, MachineTypes) {
        prepare(None).unwrap()
    }

    #[test]
    fn a_domain_plugin_gets_every_axis() {
        let (config, types) = sample();
        let cases = cases(TemplateKind::Domain, &config, &types, true);
        let labels: Vec<String> = cases.iter().map(Case::label).collect();
        assert_eq!(
            labels,
            [
                "sample-host bios 1-nic static",
                "sample-host bios 1-nic dhcp",
                "sample-host bios 3-nic static",
                "sample-host bios 3-nic dhcp",
                "sample-host bios 1-nic dhcp no-mac",
                "sample-host uefi 1-nic static",
                "sample-host uefi 1-nic dhcp",
                "sample-host uefi 3-nic static",
                "sample-host uefi 3-nic dhcp",
                "sample-host uefi 1-nic dhcp no-mac",
            ]
        );
        // The static address is the first of the host's pool.
        assert_eq!(
            cases[0].addressing,
            Some(Addressing::Static(Ipv4Addr::new(10, 203, 0, 10)))
        );
        assert_eq!(cases[0].file_stem(), "sample-host_bios_1-nic_static");
        // Without an `extraNics` setting there is no way to ask for three NICs.
        assert_eq!(cases_len(TemplateKind::Domain, false), 6);
        // Once rendered, a case is labelled with the NICs the plugin wrote.
        let mut two = cases[0].clone();
        two.rendered_nics = Some(2);
        assert_eq!(two.label(), "sample-host bios 2-nic static");
    }

    fn cases_len(kind: TemplateKind, nics: bool) -> usize {
        let (config, types) = sample();
        cases(kind, &config, &types, nics).len()
    }

    #[test]
    fn a_vendor_data_plugin_varies_only_what_reaches_its_input() {
        let (config, types) = sample();
        let labels: Vec<String> = cases(TemplateKind::VendorData, &config, &types, true)
            .iter()
            .map(Case::label)
            .collect();
        assert_eq!(labels, ["sample-host bios", "sample-host uefi"]);
    }

    #[test]
    fn inputs_follow_the_case() {
        let (config, types) = sample();
        let all = cases(TemplateKind::Domain, &config, &types, true);
        let efi_static = all
            .iter()
            .find(|c| {
                c.firmware == Firmware::Efi && matches!(c.addressing, Some(Addressing::Static(_)))
            })
            .unwrap();
        let inputs = inputs(&config, efi_static, &Facts::default()).unwrap();
        assert_eq!(inputs.domain.firmware, crate::templates::Firmware::Efi);
        assert_eq!(inputs.domain.vcpus, 2);
        assert_eq!(inputs.domain.bridge, "br-egress");
        assert!(
            inputs.domain.metadata_mark.contains("10.203.0.10"),
            "{}",
            inputs.domain.metadata_mark
        );
        let dhcp = all
            .iter()
            .find(|c| c.addressing == Some(Addressing::Dhcp))
            .unwrap();
        let plain = super::inputs(&config, dhcp, &Facts::default()).unwrap();
        assert!(!plain.domain.metadata_mark.contains("10.203.0.10"));
        assert_eq!(plain.domain.firmware, crate::templates::Firmware::Bios);
        // The input without a MAC says so in the domain input and in its mark alike.
        let no_mac = all
            .iter()
            .find(|c| c.addressing == Some(Addressing::DhcpWithoutMac))
            .unwrap();
        let bare = super::inputs(&config, no_mac, &Facts::default()).unwrap();
        assert_eq!(bare.domain.mac, None);
        assert!(plain.domain.mac.is_some());
        let mac = plain.domain.mac.clone().unwrap();
        assert!(plain.domain.metadata_mark.contains(&mac));
        assert!(
            !bare.domain.metadata_mark.contains(&mac),
            "{}",
            bare.domain.metadata_mark
        );
        // Deterministic: the same case gives the same input.
        assert_eq!(
            super::inputs(&config, dhcp, &Facts::default())
                .unwrap()
                .domain
                .metadata_mark,
            plain.domain.metadata_mark
        );
    }

    #[test]
    fn a_config_without_uefi_machine_types_gets_one_added() {
        let text = SAMPLE_CONFIG.replace(
            "    - {name: medium-efi, vcpus: 2, memoryMiB: 2048, diskGiB: 20, firmware: efi}\n",
            "",
        );
        let config = crate::config::parse(&text, "t", std::path::Path::new("/")).unwrap();
        let (config, types) = prepare(Some(config)).unwrap();
        assert_eq!(types.bios, "small");
        assert_eq!(types.efi, "plugin-test");
        let added = config.machine_type("plugin-test").unwrap();
        assert_eq!(added.firmware, Firmware::Efi);
        assert_eq!(added.vcpus, 1);
    }
}
