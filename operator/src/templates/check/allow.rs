//! The allow-list of domain XML: every element path, how often it may appear, its
//! attributes and its content. Anything not listed is refused, naming its path.
//!
//! The list is what a proxy VM needs and nothing that reaches into the host: the default
//! plugin's output, UEFI and Secure Boot with known firmware files, CPU model and topology,
//! pinning, volumes the operator prepared, NICs on the configured bridge, a serial console,
//! the guest agent channel, virtio-rng from the host's random devices, a balloon, video
//! without a host-side display, input devices, a watchdog that cannot dump, no audio
//! output. Values are checked here by form (enumerations, numbers, names); values tied to
//! the input (name, UUID, memory, vCPUs, volumes, bridge, MACs, firmware files) are
//! checked against it by `domain.rs`.
//!
//! Widening the list is a reviewed change: the table below, its rendering for plugin
//! authors (`templates-sdk/src/rules.md`, see `rules.rs`, checked by a test), and a test that the new
//! entry is accepted and its host-reaching neighbours are still refused.

use std::collections::BTreeMap;
use std::sync::LazyLock;

/// Which reading of the domain a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// What the plugin rendered, before libvirt sees it.
    Plugin,
    /// libvirt's inactive XML of the defined domain, with the defaults libvirt fills in.
    Libvirt,
}

/// How often an element may appear under its parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// At most once (libvirt reads the first; a second one would be read by nobody but us).
    Single,
    /// Up to this many.
    Many(usize),
}

/// What an element may contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// Nothing (white space only).
    Empty,
    /// Text of this form, and no child elements.
    Text(Value),
    /// Child elements (each on the list under this path), no text.
    Elements,
    /// `/domain/metadata`: opaque to libvirt, checked for the mark by `domain.rs`.
    Metadata,
}

/// The form of an attribute value or a text content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// Exactly one of these strings.
    Enum(&'static [&'static str]),
    /// A device model (or bus) from the list of safe models: exactly one of these
    /// strings; any other is refused by the `device-model` rule. Each that is not virtio
    /// is justified on the rules page (`devices::JUSTIFIED`).
    Model(&'static [&'static str]),
    /// A unit of [`MEMORY_UNITS`].
    MemoryUnit,
    /// Decimal digits, no sign or space (what `virStrToLong_ui` and friends accept).
    Uint,
    /// A PCI/drive address component: decimal without a leading zero (libvirt would read
    /// it as octal) or `0x` hexadecimal.
    HexOrUint,
    /// A name: letters, digits, `_ . + -`, up to 64.
    Ident,
    /// A host CPU or NUMA node set: digits, `,`, `-`, `^`.
    CpuSet,
    /// A unicast MAC address `xx:xx:xx:xx:xx:xx`.
    Mac,
    /// `q35`, `pc` or a versioned QEMU machine type.
    Machine,
    /// A QEMU emulator binary as libvirt fills it in from the host's capabilities.
    Emulator,
    /// Free text for people (title, description): no control characters but line feeds.
    Prose,
    /// Checked against the input by `domain.rs`; here only bounded and printable.
    Tied(Tie),
}

/// What a [`Value::Tied`] value must equal, and the rule that checks it (for the rules
/// page, which lists every tie from this table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tie {
    /// What the value is tied to, in the plugin author's terms.
    pub to: &'static str,
    /// The rule that refuses anything else.
    pub rule: &'static str,
}

const fn tied(to: &'static str, rule: &'static str) -> Value {
    Value::Tied(Tie { to, rule })
}

/// The rule of one element path.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    /// How often it may appear under its parent.
    pub count: Count,
    /// Allowed attributes and their forms.
    pub attrs: &'static [(&'static str, Value)],
    /// What it may contain.
    pub content: Content,
    /// Only in libvirt's reading (defaults libvirt fills in; a plugin may not write them).
    pub libvirt_only: bool,
}

/// Longest value of any form (paths are at most 4095 bytes on Linux).
pub const VALUE_MAX: usize = 4096;
/// Memory units libvirt accepts, with their factor in bytes (`virScaleInteger`).
pub const MEMORY_UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("bytes", 1),
    ("KB", 1000),
    ("k", 1024),
    ("K", 1024),
    ("KiB", 1024),
    ("MB", 1_000_000),
    ("M", 1 << 20),
    ("MiB", 1 << 20),
    ("GB", 1_000_000_000),
    ("G", 1 << 30),
    ("GiB", 1 << 30),
];
const ON_OFF: Value = Value::Enum(&["on", "off"]);
const YES_NO: Value = Value::Enum(&["yes", "no"]);
const LIFECYCLE: Value = Value::Enum(&["destroy", "restart", "preserve"]);
/// Guest address of a device (PCI slot, drive unit, virtio-serial port).
const ADDRESS: &[(&str, Value)] = &[
    (
        "type",
        Value::Enum(&["pci", "drive", "virtio-serial", "usb", "isa"]),
    ),
    ("domain", Value::HexOrUint),
    ("bus", Value::HexOrUint),
    ("slot", Value::HexOrUint),
    ("function", Value::HexOrUint),
    ("multifunction", ON_OFF),
    ("controller", Value::HexOrUint),
    ("target", Value::HexOrUint),
    ("unit", Value::HexOrUint),
    ("port", Value::HexOrUint),
    ("iobase", Value::HexOrUint),
];

const fn el(attrs: &'static [(&'static str, Value)], content: Content, count: Count) -> Rule {
    Rule {
        count,
        attrs,
        content,
        libvirt_only: false,
    }
}
const fn one(attrs: &'static [(&'static str, Value)], content: Content) -> Rule {
    el(attrs, content, Count::Single)
}
const fn many(n: usize, attrs: &'static [(&'static str, Value)], content: Content) -> Rule {
    el(attrs, content, Count::Many(n))
}
const fn libvirt(rule: Rule) -> Rule {
    Rule {
        libvirt_only: true,
        ..rule
    }
}

/// Paths (without the leading `/`) and their rules.
pub(super) const RULES: &[(&str, Rule)] = &[
    (
        "domain",
        one(
            &[("type", Value::Enum(&["kvm", "qemu"]))],
            Content::Elements,
        ),
    ),
    (
        "domain/name",
        one(
            &[],
            Content::Text(tied("the input's `name`, unchanged", "name-unchanged")),
        ),
    ),
    (
        "domain/uuid",
        one(
            &[],
            Content::Text(tied("the input's `uuid`, unchanged", "uuid-unchanged")),
        ),
    ),
    ("domain/title", one(&[], Content::Text(Value::Prose))),
    ("domain/description", one(&[], Content::Text(Value::Prose))),
    ("domain/metadata", one(&[], Content::Metadata)),
    (
        "domain/memory",
        one(&[("unit", Value::MemoryUnit)], Content::Text(Value::Uint)),
    ),
    (
        "domain/currentMemory",
        one(&[("unit", Value::MemoryUnit)], Content::Text(Value::Uint)),
    ),
    (
        "domain/vcpu",
        one(
            &[
                ("placement", Value::Enum(&["static"])),
                ("current", Value::Uint),
                ("cpuset", Value::CpuSet),
            ],
            Content::Text(Value::Uint),
        ),
    ),
    // Bounded by the machine type's vCPUs (`host.rs`).
    ("domain/iothreads", one(&[], Content::Text(Value::Uint))),
    ("domain/cputune", one(&[], Content::Elements)),
    (
        "domain/cputune/vcpupin",
        many(
            256,
            &[("vcpu", Value::Uint), ("cpuset", Value::CpuSet)],
            Content::Empty,
        ),
    ),
    (
        "domain/cputune/emulatorpin",
        one(&[("cpuset", Value::CpuSet)], Content::Empty),
    ),
    ("domain/numatune", one(&[], Content::Elements)),
    (
        "domain/numatune/memory",
        one(
            &[
                (
                    "mode",
                    Value::Enum(&["strict", "interleave", "preferred", "restrictive"]),
                ),
                ("nodeset", Value::CpuSet),
            ],
            Content::Empty,
        ),
    ),
    ("domain/resource", libvirt(one(&[], Content::Elements))),
    (
        "domain/resource/partition",
        libvirt(one(&[], Content::Text(Value::Enum(&["/machine"])))),
    ),
    (
        "domain/os",
        one(
            &[("firmware", Value::Enum(&["efi", "bios"]))],
            Content::Elements,
        ),
    ),
    (
        "domain/os/type",
        one(
            &[
                ("arch", tied("the input's `host.arch`", "arch-matches")),
                ("machine", Value::Machine),
            ],
            Content::Text(Value::Enum(&["hvm"])),
        ),
    ),
    ("domain/os/firmware", one(&[], Content::Elements)),
    (
        "domain/os/firmware/feature",
        many(
            2,
            &[
                ("enabled", YES_NO),
                ("name", Value::Enum(&["enrolled-keys", "secure-boot"])),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/os/loader",
        one(
            &[
                ("readonly", Value::Enum(&["yes"])),
                ("secure", YES_NO),
                ("type", Value::Enum(&["pflash"])),
            ],
            Content::Text(tied(
                "a UEFI code file of the [Firmware](#firmware) list",
                "firmware-paths",
            )),
        ),
    ),
    (
        "domain/os/nvram",
        one(
            &[(
                "template",
                tied(
                    "a variable-store template of the [Firmware](#firmware) list, of the loader's family",
                    "firmware-kind",
                ),
            )],
            Content::Text(tied(
                "nothing: leave it empty and libvirt makes the VM's own store",
                "firmware-paths",
            )),
        ),
    ),
    (
        "domain/os/boot",
        one(&[("dev", Value::Enum(&["hd"]))], Content::Empty),
    ),
    (
        "domain/os/bootmenu",
        one(
            &[("enable", Value::Enum(&["no"])), ("timeout", Value::Uint)],
            Content::Empty,
        ),
    ),
    (
        "domain/os/bios",
        one(&[("useserial", YES_NO)], Content::Empty),
    ),
    ("domain/features", one(&[], Content::Elements)),
    ("domain/features/acpi", one(&[], Content::Empty)),
    (
        "domain/features/apic",
        one(&[("eoi", ON_OFF)], Content::Empty),
    ),
    ("domain/features/pae", one(&[], Content::Empty)),
    (
        "domain/features/smm",
        one(&[("state", ON_OFF)], Content::Empty),
    ),
    (
        "domain/features/vmport",
        one(&[("state", ON_OFF)], Content::Empty),
    ),
    (
        "domain/features/pmu",
        one(&[("state", ON_OFF)], Content::Empty),
    ),
    (
        "domain/features/ioapic",
        one(&[("driver", Value::Enum(&["kvm", "qemu"]))], Content::Empty),
    ),
    (
        "domain/cpu",
        one(
            &[
                (
                    "mode",
                    Value::Enum(&["host-model", "host-passthrough", "custom", "maximum"]),
                ),
                ("match", Value::Enum(&["exact", "minimum", "strict"])),
                ("check", Value::Enum(&["none", "partial", "full"])),
                ("migratable", ON_OFF),
            ],
            Content::Elements,
        ),
    ),
    (
        "domain/cpu/model",
        one(
            &[("fallback", Value::Enum(&["allow", "forbid"]))],
            Content::Text(Value::Ident),
        ),
    ),
    ("domain/cpu/vendor", one(&[], Content::Text(Value::Ident))),
    (
        "domain/cpu/topology",
        one(
            &[
                ("sockets", Value::Uint),
                ("dies", Value::Uint),
                ("clusters", Value::Uint),
                ("cores", Value::Uint),
                ("threads", Value::Uint),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/cpu/feature",
        many(
            128,
            &[
                (
                    "policy",
                    Value::Enum(&["force", "require", "optional", "disable", "forbid"]),
                ),
                ("name", Value::Ident),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/cpu/cache",
        one(
            &[
                ("mode", Value::Enum(&["emulate", "passthrough", "disable"])),
                ("level", Value::Uint),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/clock",
        one(
            &[("offset", Value::Enum(&["utc", "localtime"]))],
            Content::Elements,
        ),
    ),
    (
        "domain/clock/timer",
        many(
            8,
            &[
                (
                    "name",
                    Value::Enum(&["rtc", "pit", "hpet", "kvmclock", "hypervclock", "tsc"]),
                ),
                ("present", YES_NO),
                (
                    "tickpolicy",
                    Value::Enum(&["delay", "catchup", "merge", "discard"]),
                ),
            ],
            Content::Empty,
        ),
    ),
    ("domain/on_poweroff", one(&[], Content::Text(LIFECYCLE))),
    ("domain/on_reboot", one(&[], Content::Text(LIFECYCLE))),
    ("domain/on_crash", one(&[], Content::Text(LIFECYCLE))),
    ("domain/pm", one(&[], Content::Elements)),
    (
        "domain/pm/suspend-to-mem",
        one(&[("enabled", YES_NO)], Content::Empty),
    ),
    (
        "domain/pm/suspend-to-disk",
        one(&[("enabled", YES_NO)], Content::Empty),
    ),
    (
        "domain/seclabel",
        many(
            3,
            &[
                ("type", Value::Enum(&["dynamic"])),
                ("model", Value::Enum(&["selinux", "apparmor", "dac"])),
                ("relabel", Value::Enum(&["yes"])),
            ],
            Content::Empty,
        ),
    ),
    ("domain/devices", one(&[], Content::Elements)),
    (
        "domain/devices/emulator",
        libvirt(one(&[], Content::Text(Value::Emulator))),
    ),
    // Disks: only volumes the operator prepared (tied to the input by domain.rs).
    (
        "domain/devices/disk",
        many(
            8,
            &[
                ("type", Value::Enum(&["volume"])),
                ("device", Value::Enum(&["disk", "cdrom"])),
            ],
            Content::Elements,
        ),
    ),
    (
        "domain/devices/disk/driver",
        one(
            &[
                ("name", Value::Enum(&["qemu"])),
                (
                    "type",
                    tied("the `format` of the disk it attaches", "disk-format"),
                ),
                (
                    "cache",
                    Value::Enum(&["none", "writeback", "writethrough", "directsync"]),
                ),
                ("io", Value::Enum(&["native", "threads", "io_uring"])),
                ("discard", Value::Enum(&["unmap", "ignore"])),
                ("detect_zeroes", Value::Enum(&["off", "on", "unmap"])),
                ("queues", Value::Uint),
                ("ioeventfd", ON_OFF),
                ("event_idx", ON_OFF),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/disk/source",
        one(
            &[
                (
                    "pool",
                    tied("a `pool` of the input's `disks`", "disk-not-prepared"),
                ),
                (
                    "volume",
                    tied("the `volume` of that disk", "disk-not-prepared"),
                ),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/disk/target",
        one(
            &[
                ("dev", Value::Ident),
                ("bus", Value::Model(&["virtio", "sata", "scsi"])),
            ],
            Content::Empty,
        ),
    ),
    ("domain/devices/disk/readonly", one(&[], Content::Empty)),
    (
        "domain/devices/disk/serial",
        one(&[], Content::Text(Value::Ident)),
    ),
    (
        "domain/devices/disk/boot",
        one(&[("order", Value::Uint)], Content::Empty),
    ),
    ("domain/devices/disk/address", one(ADDRESS, Content::Empty)),
    (
        "domain/devices/disk/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    // NICs: bridge type on the configured bridge only.
    (
        "domain/devices/interface",
        many(4, &[("type", Value::Enum(&["bridge"]))], Content::Elements),
    ),
    (
        "domain/devices/interface/source",
        one(
            &[(
                "bridge",
                tied("the input's `bridge`", "interface-bridge-only"),
            )],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/interface/mac",
        one(&[("address", Value::Mac)], Content::Empty),
    ),
    (
        "domain/devices/interface/model",
        one(&[("type", Value::Model(&["virtio"]))], Content::Empty),
    ),
    (
        "domain/devices/interface/driver",
        one(
            &[
                ("name", Value::Enum(&["vhost", "qemu"])),
                ("queues", Value::Uint),
                ("rx_queue_size", Value::Uint),
                ("tx_queue_size", Value::Uint),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/interface/link",
        one(&[("state", Value::Enum(&["up", "down"]))], Content::Empty),
    ),
    (
        "domain/devices/interface/mtu",
        one(&[("size", Value::Uint)], Content::Empty),
    ),
    (
        "domain/devices/interface/rom",
        one(
            &[("bar", ON_OFF), ("enabled", Value::Enum(&["no"]))],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/interface/address",
        one(ADDRESS, Content::Empty),
    ),
    (
        "domain/devices/interface/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    (
        "domain/devices/controller",
        many(
            64,
            &[
                (
                    "type",
                    Value::Enum(&["pci", "usb", "sata", "scsi", "virtio-serial", "ide"]),
                ),
                ("index", Value::Uint),
                (
                    "model",
                    Value::Model(&[
                        "virtio-scsi",
                        "virtio",
                        "qemu-xhci",
                        "piix3-uhci",
                        "none",
                        "pci-root",
                        "pcie-root",
                        "pcie-root-port",
                        "pci-bridge",
                        "dmi-to-pci-bridge",
                        "pcie-to-pci-bridge",
                    ]),
                ),
                ("ports", Value::Uint),
                ("vectors", Value::Uint),
            ],
            Content::Elements,
        ),
    ),
    (
        "domain/devices/controller/model",
        one(
            &[(
                "name",
                Value::Model(&[
                    "pcie-root-port",
                    "pci-bridge",
                    "i82801b11-bridge",
                    "pcie-pci-bridge",
                ]),
            )],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/controller/target",
        one(
            &[
                ("chassisNr", Value::HexOrUint),
                ("chassis", Value::HexOrUint),
                ("port", Value::HexOrUint),
                ("busNr", Value::HexOrUint),
                ("index", Value::HexOrUint),
                ("hotplug", ON_OFF),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/controller/driver",
        one(&[("queues", Value::Uint)], Content::Empty),
    ),
    (
        "domain/devices/controller/address",
        one(ADDRESS, Content::Empty),
    ),
    (
        "domain/devices/controller/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    // Character devices: a pseudo-terminal (the console) and the guest agent's socket,
    // whose path libvirt chooses. No host files, sockets, devices or logs.
    (
        "domain/devices/serial",
        many(4, &[("type", Value::Enum(&["pty"]))], Content::Elements),
    ),
    (
        "domain/devices/serial/target",
        one(
            &[
                ("type", Value::Model(&["isa-serial", "pci-serial"])),
                ("port", Value::Uint),
            ],
            Content::Elements,
        ),
    ),
    (
        "domain/devices/serial/target/model",
        one(
            &[("name", Value::Model(&["isa-serial", "pci-serial"]))],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/serial/address",
        one(ADDRESS, Content::Empty),
    ),
    (
        "domain/devices/serial/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    (
        "domain/devices/console",
        many(4, &[("type", Value::Enum(&["pty"]))], Content::Elements),
    ),
    (
        "domain/devices/console/target",
        one(
            &[
                ("type", Value::Enum(&["serial", "virtio"])),
                ("port", Value::Uint),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/console/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    (
        "domain/devices/channel",
        many(2, &[("type", Value::Enum(&["unix"]))], Content::Elements),
    ),
    (
        "domain/devices/channel/source",
        one(&[("mode", Value::Enum(&["bind"]))], Content::Empty),
    ),
    (
        "domain/devices/channel/target",
        one(
            &[
                ("type", Value::Enum(&["virtio"])),
                ("name", Value::Enum(&["org.qemu.guest_agent.0"])),
            ],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/channel/address",
        one(ADDRESS, Content::Empty),
    ),
    (
        "domain/devices/channel/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    (
        "domain/devices/rng",
        one(&[("model", Value::Model(&["virtio"]))], Content::Elements),
    ),
    (
        "domain/devices/rng/backend",
        one(
            &[("model", Value::Enum(&["random"]))],
            Content::Text(Value::Enum(&["/dev/urandom", "/dev/random"])),
        ),
    ),
    (
        "domain/devices/rng/rate",
        one(
            &[("period", Value::Uint), ("bytes", Value::Uint)],
            Content::Empty,
        ),
    ),
    ("domain/devices/rng/address", one(ADDRESS, Content::Empty)),
    (
        "domain/devices/rng/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    (
        "domain/devices/memballoon",
        one(
            &[
                ("model", Value::Model(&["virtio", "none"])),
                ("autodeflate", ON_OFF),
                ("freePageReporting", ON_OFF),
            ],
            Content::Elements,
        ),
    ),
    (
        "domain/devices/memballoon/stats",
        one(&[("period", Value::Uint)], Content::Empty),
    ),
    (
        "domain/devices/memballoon/address",
        one(ADDRESS, Content::Empty),
    ),
    (
        "domain/devices/memballoon/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    // Video for the guest's own console; no 3D acceleration (host render nodes). One
    // device, its memory bounded (`host.rs`).
    ("domain/devices/video", one(&[], Content::Elements)),
    (
        "domain/devices/video/model",
        one(
            &[
                ("type", Value::Model(&["virtio", "vga", "bochs", "none"])),
                ("vram", Value::Uint),
                ("ram", Value::Uint),
                ("vgamem", Value::Uint),
                ("heads", Value::Uint),
                ("primary", Value::Enum(&["yes"])),
            ],
            Content::Empty,
        ),
    ),
    ("domain/devices/video/address", one(ADDRESS, Content::Empty)),
    (
        "domain/devices/video/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    // A display only without any listener (domain.rs requires `<listen type="none"/>`):
    // reachable through libvirt's API, never through a host socket.
    (
        "domain/devices/graphics",
        one(
            &[
                ("type", Value::Enum(&["vnc", "spice"])),
                ("autoport", Value::Enum(&["yes"])),
                ("port", Value::Enum(&["-1"])),
            ],
            Content::Elements,
        ),
    ),
    (
        "domain/devices/graphics/listen",
        one(&[("type", Value::Enum(&["none"]))], Content::Empty),
    ),
    (
        "domain/devices/input",
        many(
            8,
            &[
                ("type", Value::Enum(&["mouse", "keyboard", "tablet"])),
                ("bus", Value::Model(&["ps2", "usb", "virtio"])),
            ],
            Content::Elements,
        ),
    ),
    ("domain/devices/input/address", one(ADDRESS, Content::Empty)),
    (
        "domain/devices/input/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    (
        "domain/devices/watchdog",
        many(
            1,
            &[
                ("model", Value::Model(&["i6300esb", "itco"])),
                (
                    "action",
                    Value::Enum(&[
                        "reset",
                        "shutdown",
                        "poweroff",
                        "pause",
                        "none",
                        "inject-nmi",
                    ]),
                ),
            ],
            Content::Elements,
        ),
    ),
    (
        "domain/devices/watchdog/address",
        one(ADDRESS, Content::Empty),
    ),
    (
        "domain/devices/watchdog/alias",
        one(&[("name", Value::Ident)], Content::Empty),
    ),
    (
        "domain/devices/audio",
        one(
            &[("id", Value::Uint), ("type", Value::Enum(&["none"]))],
            Content::Empty,
        ),
    ),
    (
        "domain/devices/panic",
        one(
            &[("model", Value::Model(&["isa", "pvpanic"]))],
            Content::Elements,
        ),
    ),
    ("domain/devices/panic/address", one(ADDRESS, Content::Empty)),
];

/// The rules by path, built once.
pub static TABLE: LazyLock<BTreeMap<&'static str, Rule>> =
    LazyLock::new(|| RULES.iter().copied().collect());

/// Whether `value` has the form `v` asks for.
pub fn value_ok(v: Value, value: &str) -> bool {
    if value.len() > VALUE_MAX {
        return false;
    }
    let ident = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'+' | b'-'))
    };
    match v {
        Value::Enum(options) | Value::Model(options) => options.contains(&value),
        Value::MemoryUnit => MEMORY_UNITS.iter().any(|(u, _)| *u == value),
        Value::Uint => uint(value).is_some(),
        Value::HexOrUint => match value.strip_prefix("0x") {
            Some(hex) => {
                !hex.is_empty() && hex.len() <= 8 && hex.bytes().all(|b| b.is_ascii_hexdigit())
            }
            // libvirt parses addresses with base 0, where a leading zero means octal.
            None => uint(value).is_some() && (value == "0" || !value.starts_with('0')),
        },
        Value::Ident => ident(value, 64),
        Value::CpuSet => {
            !value.is_empty()
                && value.len() <= 256
                && value
                    .bytes()
                    .all(|b| b.is_ascii_digit() || matches!(b, b',' | b'-' | b'^'))
        }
        Value::Mac => mac(value).is_some(),
        Value::Machine => {
            ident(value, 64)
                && (value == "q35"
                    || value == "pc"
                    || value.starts_with("pc-q35-")
                    || value.starts_with("pc-i440fx-"))
        }
        Value::Emulator => is_emulator(value),
        Value::Prose => {
            value.len() <= VALUE_MAX && !value.chars().any(|c| c.is_control() && c != '\n')
        }
        Value::Tied(_) => !value.chars().any(char::is_control),
    }
}

/// A decimal number as libvirt's strict parsers read it: digits only.
pub fn uint(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The six bytes of a unicast MAC address written `xx:xx:xx:xx:xx:xx`.
pub fn mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for byte in &mut out {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(p, 16).ok()?;
    }
    if parts.next().is_some() || out[0] & 1 == 1 {
        return None;
    }
    Some(out)
}

/// The emulators libvirt fills in from the host's capabilities on the distributions we
/// support. A plugin never writes one (the rule is libvirt-only).
fn is_emulator(s: &str) -> bool {
    let Some(bin) = s
        .strip_prefix("/usr/bin/")
        .or_else(|| s.strip_prefix("/usr/libexec/"))
    else {
        return false;
    };
    bin == "qemu-kvm"
        || bin == "kvm"
        || bin.strip_prefix("qemu-system-").is_some_and(|arch| {
            !arch.is_empty() && arch.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
}

/// What `v` allows, for a refusal: the fix in the plugin author's terms (the rules page
/// says the same in Markdown, [`describe`]).
pub(super) fn expected(v: Value) -> String {
    let quoted = |o: &[&str]| {
        o.iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match v {
        Value::Enum([one]) | Value::Model([one]) => format!("expected \"{one}\""),
        Value::Enum(o) | Value::Model(o) => format!("expected one of {}", quoted(o)),
        Value::MemoryUnit => {
            let units: Vec<&str> = MEMORY_UNITS.iter().map(|(u, _)| *u).collect();
            format!("expected one of {}", quoted(&units))
        }
        Value::Uint => "expected decimal digits only".into(),
        Value::HexOrUint => {
            "expected decimal digits without a leading zero, or 0x and at most 8 hex digits".into()
        }
        Value::Ident => "expected at most 64 letters, digits, `_`, `.`, `+` or `-`".into(),
        Value::CpuSet => "expected digits, `,`, `-` and `^` only (a CPU or node set)".into(),
        Value::Mac => "expected a unicast MAC address written xx:xx:xx:xx:xx:xx".into(),
        Value::Machine => "expected \"q35\", \"pc\", or pc-q35-* or pc-i440fx-*".into(),
        Value::Emulator => {
            "expected /usr/bin/ or /usr/libexec/ qemu-kvm, kvm or qemu-system-<arch>".into()
        }
        Value::Prose => {
            format!(
                "expected text of at most {VALUE_MAX} bytes without control characters but line feeds"
            )
        }
        Value::Tied(t) => format!("expected {} (rule {})", t.to, t.rule),
    }
}

pub(super) fn describe(v: Value) -> String {
    match v {
        Value::Enum(o) => o
            .iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(" \\| "),
        Value::Model(o) => format!(
            "model: {}",
            o.iter()
                .map(|s| format!("`{s}`"))
                .collect::<Vec<_>>()
                .join(" \\| ")
        ),
        Value::MemoryUnit => MEMORY_UNITS
            .iter()
            .map(|(u, _)| format!("`{u}`"))
            .collect::<Vec<_>>()
            .join(" \\| "),
        Value::Uint => "number".into(),
        Value::HexOrUint => "number or 0x-hex".into(),
        Value::Ident => "name".into(),
        Value::CpuSet => "cpu/node set".into(),
        Value::Mac => "MAC".into(),
        Value::Machine => "`q35`, `pc` or a versioned one".into(),
        Value::Emulator => "QEMU binary".into(),
        Value::Prose => "free text".into(),
        Value::Tied(t) => format!("{} (rule [`{}`](#{}))", t.to, t.rule, t.rule),
    }
}
