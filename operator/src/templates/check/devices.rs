//! Device models, written or implied, and what boots.
//!
//! Models come from the allow-list's enumerations: virtio first, and each other model on
//! [`JUSTIFIED`] with its reason (a test keeps the two in step). What a plugin leaves out
//! matters as much as what it writes: libvirt's QEMU driver fills in legacy models for a
//! NIC without `<model>` (rtl8139), a disk `sdX` without a bus (an lsilogic SCSI
//! controller), `<graphics>` or `<video>` without a video model (Cirrus) and a SCSI
//! controller without a model (lsilogic). Those are refused here in the plugin's output
//! (`model-implied`), and the same enumerations refuse them where they become visible, in
//! libvirt's reading at define time (`device-model`).
//!
//! Boot: only the prepared root disk. `<os><boot dev>` is `hd` only (allow-list), no
//! device but the root disk carries `<boot order>`, and the root disk is the first disk,
//! which is the one libvirt's QEMU driver gives the boot index for `hd`.

use super::refuse;
use super::tree::Node;
use crate::templates::errors::TemplateErrorKind;
use crate::templates::{DiskRole, DomainInput};

/// Every model on the allow-list that is not virtio, and why it is there.
pub const JUSTIFIED: &[(&str, &str, &str)] = &[
    (
        "disk/target/@bus",
        "sata",
        "the q35 chipset's built-in AHCI controller: the only bus for a cdrom seed on q35",
    ),
    (
        "disk/target/@bus",
        "scsi",
        "only with a `virtio-scsi` controller (`model-implied` refuses the lsilogic default)",
    ),
    (
        "controller/@type",
        "sata",
        "the q35 chipset's built-in AHCI controller (libvirt always adds it on q35)",
    ),
    (
        "controller/@type",
        "ide",
        "the i440fx (`pc`) chipset's built-in IDE controller (libvirt always adds it); no disk may use the IDE bus",
    ),
    (
        "controller/@type",
        "pci",
        "PCI topology (roots, root ports and bridges): no emulated function behind it",
    ),
    (
        "controller/@model",
        "piix3-uhci",
        "the i440fx (`pc`) chipset's USB controller: libvirt's default there",
    ),
    (
        "controller/@model",
        "qemu-xhci",
        "QEMU's own xHCI controller, the default on q35, for a USB tablet",
    ),
    (
        "serial/target/@type",
        "isa-serial",
        "the 16550A UART: the console every kernel and firmware knows, libvirt's default",
    ),
    ("serial/target/@type", "pci-serial", "QEMU's PCI 16550A"),
    (
        "serial/target/model/@name",
        "isa-serial",
        "how libvirt writes out the 16550A console's model",
    ),
    (
        "video/model/@type",
        "vga",
        "QEMU's standard VGA (bochs dispi), no 2D/3D engine; Cirrus is refused",
    ),
    (
        "video/model/@type",
        "bochs",
        "the same display as `vga` without the legacy VGA ports",
    ),
    (
        "input/@bus",
        "ps2",
        "the i8042 controller every x86 machine has; libvirt adds PS/2 mouse and keyboard",
    ),
    ("input/@bus", "usb", "a USB tablet on the xHCI controller"),
    (
        "watchdog/@model",
        "i6300esb",
        "the only PCI watchdog QEMU has",
    ),
    (
        "watchdog/@model",
        "itco",
        "the q35 chipset's built-in TCO watchdog",
    ),
    (
        "panic/@model",
        "pvpanic",
        "QEMU's paravirtual panic notifier on PCI: one register",
    ),
    (
        "panic/@model",
        "isa",
        "the pvpanic ISA port: a paravirtual device of a few registers",
    ),
];

/// Applies the model and boot rules.
pub fn check(devices: &Node, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    models(devices)?;
    boot(devices, input)
}

fn implied(detail: String) -> TemplateErrorKind {
    refuse("model-implied", detail)
}

/// The bus libvirt gives a disk: its `bus`, else the one its target name implies.
fn disk_bus(disk: &Node) -> Option<&str> {
    let target = disk.child("target")?;
    if let Some(bus) = target.attr("bus") {
        return Some(bus);
    }
    let dev = target.attr("dev")?;
    [
        ("vd", "virtio"),
        ("sd", "scsi"),
        ("hd", "ide"),
        ("xvd", "xen"),
        ("ubd", "uml"),
        ("fd", "fdc"),
    ]
    .iter()
    .find(|(prefix, _)| dev.starts_with(prefix))
    .map(|(_, bus)| *bus)
}

fn models(devices: &Node) -> Result<(), TemplateErrorKind> {
    let mut scsi_controllers: Vec<u64> = Vec::new();
    for (i, c) in devices.children_named("controller").enumerate() {
        let at = format!("/domain/devices/controller[{}]", i + 1);
        let ty = c.attr("type").unwrap_or_default();
        let model = c.attr("model");
        let ok = match ty {
            "scsi" => match model {
                Some("virtio-scsi") => true,
                Some(_) => false,
                None => {
                    return Err(implied(format!(
                        "{at} is a SCSI controller without a model: libvirt makes it lsilogic; write model=\"virtio-scsi\""
                    )));
                }
            },
            "usb" => matches!(model, None | Some("qemu-xhci" | "piix3-uhci" | "none")),
            "pci" => matches!(
                model,
                Some(
                    "pci-root"
                        | "pcie-root"
                        | "pcie-root-port"
                        | "pci-bridge"
                        | "dmi-to-pci-bridge"
                        | "pcie-to-pci-bridge"
                )
            ),
            "virtio-serial" => matches!(model, None | Some("virtio")),
            "sata" | "ide" => model.is_none(),
            _ => false,
        };
        if !ok {
            return Err(refuse(
                "device-model",
                format!(
                    "{at} is a {ty} controller of model {}, not on the list of safe models",
                    model.unwrap_or("(none)")
                ),
            ));
        }
        if ty == "scsi" {
            scsi_controllers.push(c.attr("index").and_then(super::allow::uint).unwrap_or(0));
        }
    }
    for (i, disk) in devices.children_named("disk").enumerate() {
        let at = format!("/domain/devices/disk[{}]/target", i + 1);
        let explicit = disk.child("target").and_then(|t| t.attr("bus")).is_some();
        match disk_bus(disk) {
            Some("virtio" | "sata") => {}
            Some("scsi") if !explicit => {
                return Err(implied(format!(
                    "{at} names an sd device without a bus: libvirt puts it on SCSI with an lsilogic controller; write bus=\"virtio\" or \"sata\""
                )));
            }
            Some("scsi") => {
                let index = disk
                    .child("address")
                    .and_then(|a| a.attr("controller"))
                    .and_then(super::allow::uint)
                    .unwrap_or(0);
                if !scsi_controllers.contains(&index) {
                    return Err(implied(format!(
                        "{at} is on SCSI controller {index}, which is not written: libvirt adds an lsilogic one; add <controller type=\"scsi\" index=\"{index}\" model=\"virtio-scsi\"/>"
                    )));
                }
            }
            Some(other) => {
                return Err(refuse(
                    "device-model",
                    format!(
                        "{at} puts the disk on the {other} bus; allowed: virtio, sata, scsi (virtio-scsi)"
                    ),
                ));
            }
            None => {
                return Err(refuse(
                    "device-model",
                    format!("{at}/@dev does not name a bus libvirt knows"),
                ));
            }
        }
    }
    for (i, nic) in devices.children_named("interface").enumerate() {
        if nic.child("model").and_then(|m| m.attr("type")).is_none() {
            return Err(implied(format!(
                "/domain/devices/interface[{}]/model is missing: libvirt makes the NIC an rtl8139; write <model type=\"virtio\"/>",
                i + 1
            )));
        }
    }
    let videos: Vec<&Node> = devices.children_named("video").collect();
    for (i, v) in videos.iter().enumerate() {
        if v.child("model").and_then(|m| m.attr("type")).is_none() {
            return Err(implied(format!(
                "/domain/devices/video[{}]/model is missing: libvirt makes it Cirrus VGA; write <model type=\"virtio\"/>",
                i + 1
            )));
        }
    }
    if devices.child("graphics").is_some() && videos.is_empty() {
        return Err(implied(
            "/domain/devices/graphics without a <video>: libvirt adds Cirrus VGA; add <video><model type=\"virtio\"/></video>"
                .into(),
        ));
    }
    Ok(())
}

fn boot(devices: &Node, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    let root = input
        .disks
        .iter()
        .find(|d| d.role == DiskRole::Root)
        .map(|d| (d.pool.as_str(), d.volume.as_str()));
    let is_root = |disk: &Node| {
        let s = disk.child("source");
        root == s.map(|s| {
            (
                s.attr("pool").unwrap_or_default(),
                s.attr("volume").unwrap_or_default(),
            )
        })
    };
    let mut first_disk = true;
    for (i, disk) in devices.children_named("disk").enumerate() {
        let at = format!("/domain/devices/disk[{}]", i + 1);
        let device = disk.attr("device").unwrap_or("disk");
        if device == "disk" {
            if first_disk && !is_root(disk) {
                return Err(refuse(
                    "boot-root-only",
                    format!(
                        "{at} is the first disk and not the root disk: the first disk is the one that boots"
                    ),
                ));
            }
            first_disk = false;
        }
        if let Some(order) = disk.child("boot") {
            if !is_root(disk) {
                return Err(refuse(
                    "boot-root-only",
                    format!("{at}/boot gives a boot order to a disk that is not the root disk"),
                ));
            }
            if order.attr("order") != Some("1") {
                return Err(refuse(
                    "boot-root-only",
                    format!("{at}/boot/@order must be 1 on the root disk"),
                ));
            }
        }
    }
    Ok(())
}
