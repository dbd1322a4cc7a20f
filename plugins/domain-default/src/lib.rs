//! The default domain plugin: libvirt domain XML for an egress proxy VM.
//!
//! KVM when the host has it, else QEMU emulation; BIOS or UEFI; a virtio root disk on the
//! operator's overlay volume; the seed ISO read-only on the bus the operator suggests
//! (virtio: a read-only disk; other buses: a cdrom); one virtio NIC on the configured
//! bridge; serial console; QEMU guest agent channel; virtio-rng; the operator's metadata
//! mark. Everything a site may want to change is a setting.
#![forbid(unsafe_code)]

use schemars::JsonSchema;
use serde::Deserialize;
use templates_sdk::domain::{Disk, DiskBus, DiskRole, DomainInput, Firmware};
use templates_sdk::xml::Element;
use templates_sdk::{DomainPlugin, SettingsProblem};

/// How the guest CPU is presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum CpuMode {
    /// The host CPU model, migratable: the safe choice with KVM.
    HostModel,
    /// The host CPU exactly: fastest, not migratable.
    HostPassthrough,
    /// QEMU's default model: works everywhere, including emulation.
    Default,
}

/// UEFI firmware files on the host, used when the machine type asks for `efi`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Uefi {
    /// OVMF code image (read-only, pflash).
    #[schemars(length(min = 1, max = 4095))]
    pub loader: String,
    /// OVMF variables template copied into each VM's NVRAM.
    #[schemars(length(min = 1, max = 4095))]
    pub nvram_template: String,
    /// Use the Secure Boot variant (needs the q35 machine and SMM).
    pub secure_boot: bool,
}

impl Default for Uefi {
    fn default() -> Self {
        // Debian's and Ubuntu's ovmf package paths.
        Self {
            loader: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(),
            nvram_template: "/usr/share/OVMF/OVMF_VARS_4M.fd".into(),
            secure_boot: false,
        }
    }
}

/// Settings of the default domain plugin. `{}` gives a sensible proxy VM.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Settings {
    /// QEMU machine type: `q35` (modern, PCIe) or `pc` (i440fx).
    #[schemars(regex(pattern = r"^(q35|pc)$"))]
    pub machine: String,
    /// CPU mode; by default `host-model` with KVM and QEMU's default model without it.
    pub cpu_mode: Option<CpuMode>,
    /// UEFI firmware paths (used only for machine types with `firmware: efi`).
    pub uefi: Uefi,
    /// Add a virtio memory balloon (lets the host reclaim unused guest memory).
    pub memballoon: bool,
    /// Add a virtio RNG fed from the host's /dev/urandom (fast entropy at boot for TLS),
    /// limited to 1 KiB per second.
    pub rng: bool,
    /// Further virtio NICs on the same bridge (e.g. a separate client-facing interface);
    /// libvirt assigns their MAC addresses, the operator's MAC stays on the first.
    #[schemars(range(max = 3))]
    pub extra_nics: u8,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            machine: "q35".into(),
            cpu_mode: None,
            uefi: Uefi::default(),
            memballoon: true,
            rng: true,
            extra_nics: 0,
        }
    }
}

/// Bytes per second the virtio-rng may draw from the host (the operator allows up to 64 KiB).
const RNG_BYTES_PER_SECOND: &str = "1024";

/// Most extra NICs: the operator's output check allows four NICs per VM.
const MAX_EXTRA_NICS: u8 = 3;

/// The plugin.
#[derive(Debug)]
pub struct DefaultDomain;

fn is_absolute_clean_path(p: &str) -> bool {
    p.starts_with('/')
        && !p.chars().any(char::is_control)
        && p[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

impl DomainPlugin for DefaultDomain {
    type Settings = Settings;

    fn validate_settings(s: &Settings) -> Vec<SettingsProblem> {
        let mut problems = Vec::new();
        if s.machine != "q35" && s.machine != "pc" {
            problems.push(SettingsProblem::new(
                "/machine",
                "must be \"q35\" or \"pc\"",
            ));
        }
        for (pointer, path) in [
            ("/uefi/loader", &s.uefi.loader),
            ("/uefi/nvramTemplate", &s.uefi.nvram_template),
        ] {
            if !is_absolute_clean_path(path) {
                problems.push(SettingsProblem::new(
                    pointer,
                    "must be an absolute path without '.', '..' or empty components",
                ));
            }
        }
        if s.extra_nics > MAX_EXTRA_NICS {
            problems.push(SettingsProblem::new(
                "/extraNics",
                "at most 3 (the operator accepts four NICs per VM)",
            ));
        }
        if s.uefi.secure_boot && s.machine != "q35" {
            problems.push(SettingsProblem::new(
                "/uefi/secureBoot",
                "Secure Boot needs machine \"q35\" (it relies on SMM)",
            ));
        }
        problems
    }

    fn render(input: &DomainInput, s: &Settings) -> Result<String, String> {
        let kvm = input.host.kvm;
        let cpu_mode = s.cpu_mode.unwrap_or(if kvm {
            CpuMode::HostModel
        } else {
            CpuMode::Default
        });
        let efi = input.firmware == Firmware::Efi;

        let mut os = Element::new("os").child(
            Element::new("type")
                .attr("arch", &input.host.arch)
                .attr("machine", &s.machine)
                .text("hvm"),
        );
        if efi {
            os = os
                .child(
                    Element::new("loader")
                        .attr("readonly", "yes")
                        .attr("secure", if s.uefi.secure_boot { "yes" } else { "no" })
                        .attr("type", "pflash")
                        .text(&s.uefi.loader),
                )
                .child(Element::new("nvram").attr("template", &s.uefi.nvram_template));
        }
        os = os.child(Element::new("boot").attr("dev", "hd"));

        let mut features = Element::new("features")
            .child(Element::new("acpi"))
            .child(Element::new("apic"));
        if efi && s.uefi.secure_boot {
            features = features.child(Element::new("smm").attr("state", "on"));
        }

        let cpu = match cpu_mode {
            CpuMode::HostModel => Some(Element::new("cpu").attr("mode", "host-model")),
            CpuMode::HostPassthrough => Some(
                Element::new("cpu")
                    .attr("mode", "host-passthrough")
                    .attr("check", "none"),
            ),
            CpuMode::Default => None,
        };

        let mut devices = Element::new("devices");
        let (mut virtio_disks, mut sata_disks) = (0u8, 0u8);
        for disk in &input.disks {
            devices = devices.child(render_disk(disk, &mut virtio_disks, &mut sata_disks)?);
        }
        devices = devices.child(
            Element::new("interface")
                .attr("type", "bridge")
                .child(Element::new("source").attr("bridge", &input.bridge))
                .child_opt(
                    input
                        .mac
                        .as_ref()
                        .map(|m| Element::new("mac").attr("address", m)),
                )
                .child(Element::new("model").attr("type", "virtio")),
        );
        for _ in 0..s.extra_nics.min(MAX_EXTRA_NICS) {
            devices = devices.child(
                Element::new("interface")
                    .attr("type", "bridge")
                    .child(Element::new("source").attr("bridge", &input.bridge))
                    .child(Element::new("model").attr("type", "virtio")),
            );
        }
        devices = devices
            .child(
                Element::new("serial")
                    .attr("type", "pty")
                    .child(Element::new("target").attr("port", "0")),
            )
            .child(
                Element::new("console").attr("type", "pty").child(
                    Element::new("target")
                        .attr("type", "serial")
                        .attr("port", "0"),
                ),
            )
            .child(
                Element::new("channel").attr("type", "unix").child(
                    Element::new("target")
                        .attr("type", "virtio")
                        .attr("name", "org.qemu.guest_agent.0"),
                ),
            );
        if s.rng {
            devices = devices.child(
                Element::new("rng")
                    .attr("model", "virtio")
                    .child(
                        Element::new("backend")
                            .attr("model", "random")
                            .text("/dev/urandom"),
                    )
                    // The operator requires a rate limit on every rng: plenty to seed
                    // the guest's pool at boot, never a drain on the host's.
                    .child(
                        Element::new("rate")
                            .attr("period", "1000")
                            .attr("bytes", RNG_BYTES_PER_SECOND),
                    ),
            );
        }
        devices = devices.child(
            Element::new("memballoon").attr("model", if s.memballoon { "virtio" } else { "none" }),
        );

        let domain = Element::new("domain")
            .attr("type", if kvm { "kvm" } else { "qemu" })
            .child(Element::new("name").text(&input.name))
            .child(Element::new("uuid").text(&input.uuid))
            .child(Element::new("metadata").trusted_fragment(&input.metadata_mark))
            .child(
                Element::new("memory")
                    .attr("unit", "MiB")
                    .text(input.memory_mib.to_string()),
            )
            .child(
                Element::new("vcpu")
                    .attr("placement", "static")
                    .text(input.vcpus.to_string()),
            )
            .child(os)
            .child(features)
            .child_opt(cpu)
            .child(Element::new("clock").attr("offset", "utc"))
            .child(Element::new("on_poweroff").text("destroy"))
            .child(Element::new("on_reboot").text("restart"))
            .child(Element::new("on_crash").text("destroy"))
            .child(devices);
        Ok(domain.to_pretty_xml())
    }
}

fn render_disk(disk: &Disk, virtio: &mut u8, sata: &mut u8) -> Result<Element, String> {
    // The seed follows the operator's bus hint. On virtio (the default hint) it is a
    // read-only disk, not a cdrom (virtio-blk has no cdrom): cloud-init's NoCloud finds it
    // by its `cidata` file-system label on any block device, and every Linux kernel has
    // virtio-blk, while cloud kernels lack the AHCI driver a SATA cdrom needs.
    let (device, readonly) = match (disk.role, disk.bus) {
        (DiskRole::Root, _) => ("disk", false),
        (DiskRole::Seed, DiskBus::Virtio) => ("disk", true),
        (DiskRole::Seed, _) => ("cdrom", true),
    };
    let bus = disk.bus;
    let (bus_name, dev) = match bus {
        DiskBus::Virtio => ("virtio", next_dev("vd", virtio)?),
        DiskBus::Sata => ("sata", next_dev("sd", sata)?),
        DiskBus::Scsi => ("scsi", next_dev("sd", sata)?),
        DiskBus::Ide => ("ide", next_dev("hd", sata)?),
    };
    let format = match disk.format.as_str() {
        "qcow2" => "qcow2",
        "raw" => "raw",
        other => {
            return Err(format!(
                "disk {:?} has unsupported format {other:?}",
                disk.volume
            ));
        }
    };
    let mut driver = Element::new("driver")
        .attr("name", "qemu")
        .attr("type", format);
    if disk.role == DiskRole::Root {
        driver = driver.attr("discard", "unmap");
    }
    let mut el = Element::new("disk")
        .attr("type", "volume")
        .attr("device", device)
        .child(driver)
        .child(
            Element::new("source")
                .attr("pool", &disk.pool)
                .attr("volume", &disk.volume),
        )
        .child(
            Element::new("target")
                .attr("dev", dev)
                .attr("bus", bus_name),
        );
    if readonly {
        el = el.child(Element::new("readonly"));
    }
    Ok(el)
}

/// `vda`, `vdb`, ...: at most 26 disks per prefix, far beyond a proxy's two.
fn next_dev(prefix: &str, counter: &mut u8) -> Result<String, String> {
    if *counter >= 26 {
        return Err("too many disks".into());
    }
    let letter = char::from(b'a' + *counter);
    *counter += 1;
    Ok(format!("{prefix}{letter}"))
}

templates_sdk::export_domain_plugin!(DefaultDomain);
