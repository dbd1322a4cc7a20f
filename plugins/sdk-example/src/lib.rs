// A complete domain plugin: BIOS or UEFI as the machine type asks, the root disk and the
// NoCloud seed the operator prepared, one NIC on the given bridge with the given MAC, and
// one setting of its own. This file is the SDK's "A complete plugin" example verbatim;
// `make plugins` builds it and a test renders it through the operator's checks.
use templates_sdk::domain::{DiskRole, DomainInput, Firmware};
use templates_sdk::xml::Element;
use templates_sdk::{DomainPlugin, SettingsProblem};

/// Settings of this plugin; `{}` is valid.
#[derive(Debug, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Settings {
    /// Serial number the guest sees on its root disk (empty: none).
    pub disk_serial: String,
}

/// The plugin.
#[derive(Debug)]
pub struct Example;

impl DomainPlugin for Example {
    type Settings = Settings;

    fn validate_settings(s: &Settings) -> Vec<SettingsProblem> {
        if s.disk_serial.len() > 20 {
            vec![SettingsProblem::new("/diskSerial", "at most 20 characters")]
        } else {
            vec![]
        }
    }

    fn render(input: &DomainInput, s: &Settings) -> Result<String, String> {
        // Every disk the operator prepared is attached, the root disk first: the root as
        // a writable virtio disk, the seed read-only (cloud-init finds it by its label).
        let mut disks: Vec<_> = input.disks.iter().collect();
        disks.sort_by_key(|d| d.role != DiskRole::Root);
        if disks.first().map(|d| d.role) != Some(DiskRole::Root) {
            return Err("no root disk in the input".into());
        }
        let disk_elements = disks.iter().zip(["vda", "vdb", "vdc"]).map(|(d, dev)| {
            let root = d.role == DiskRole::Root;
            Element::new("disk")
                .attr("type", "volume")
                .attr("device", "disk")
                .child(
                    Element::new("driver")
                        .attr("name", "qemu")
                        .attr("type", &d.format),
                )
                .child(
                    Element::new("source")
                        .attr("pool", &d.pool)
                        .attr("volume", &d.volume),
                )
                .child(
                    Element::new("target")
                        .attr("dev", dev)
                        .attr("bus", "virtio"),
                )
                .child_opt((!root).then(|| Element::new("readonly")))
                .child_opt(
                    (root && !s.disk_serial.is_empty())
                        .then(|| Element::new("serial").text(&s.disk_serial)),
                )
        });
        // UEFI without naming files: libvirt picks the firmware and makes the VM's own
        // variable store (see the Firmware section of the rules page).
        let os = Element::new("os")
            .attr_opt(
                "firmware",
                (input.firmware == Firmware::Efi).then_some("efi"),
            )
            .child(
                Element::new("type")
                    .attr("arch", &input.host.arch)
                    .text("hvm"),
            )
            .child(Element::new("boot").attr("dev", "hd"));
        let nic = Element::new("interface")
            .attr("type", "bridge")
            .child(Element::new("source").attr("bridge", &input.bridge))
            .child_opt(
                input
                    .mac
                    .as_ref()
                    .map(|m| Element::new("mac").attr("address", m)),
            )
            .child(Element::new("model").attr("type", "virtio"));
        Ok(Element::new("domain")
            .attr("type", if input.host.kvm { "kvm" } else { "qemu" })
            .child(Element::new("name").text(&input.name))
            .child(Element::new("uuid").text(&input.uuid))
            .child(Element::new("metadata").trusted_fragment(&input.metadata_mark))
            .child(
                Element::new("memory")
                    .attr("unit", "MiB")
                    .text(input.memory_mib.to_string()),
            )
            .child(Element::new("vcpu").text(input.vcpus.to_string()))
            .child(os)
            .child(Element::new("features").child(Element::new("acpi")))
            .child(
                Element::new("devices")
                    .children(disk_elements)
                    .child(nic)
                    .child(
                        Element::new("serial")
                            .attr("type", "pty")
                            .child(Element::new("target").attr("port", "0")),
                    ),
            )
            .to_xml())
    }
}

templates_sdk::export_domain_plugin!(Example);
