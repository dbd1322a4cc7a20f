//! A domain plugin that misbehaves on request, to prove the sandbox and the output checks.
//!
//! The `mode` setting picks the misbehaviour, so one component covers the whole corpus and
//! the tests load it once per case with different settings. `good` renders a valid domain,
//! used to show the host still works after every other case.
//!
//! The settings schema is exported before the host has any settings, so a hostile schema
//! is picked differently: by the bytes of [`SCHEMA_MODE`], which a test patches in a copy
//! of the component (same length, so the component stays valid).
// `deny`, not `forbid`: `raw_wasi` declares two WASI imports by hand (see there).
#![deny(unsafe_code)]
#![allow(clippy::panic)] // panicking on request is this plugin's job

use schemars::JsonSchema;
use serde::Deserialize;
use templates_sdk::domain::{DiskRole, DomainInput};
use templates_sdk::xml::Element;
use templates_sdk::{DomainPlugin, SettingsProblem};

/// Marks the schema mode in the component's data: the tests find this exact prefix and
/// overwrite the 16 bytes after it with another mode, padded with `_`.
pub const SCHEMA_MODE_PREFIX: &str = "egress-hostile-schema-mode:";
/// The schema mode, as stored in the component's data segment.
pub static SCHEMA_MODE: [u8; 43] = *b"egress-hostile-schema-mode:ordinary________";

/// What to do wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Render a valid domain.
    Good,
    /// Spin forever.
    EndlessLoop,
    /// Allocate until memory runs out.
    MemoryBomb,
    /// Recurse without end.
    DeepRecursion,
    /// Return 100 MB.
    HugeOutput,
    /// Return 1 MB of otherwise valid XML (over the output cap, under the memory cap).
    BigOutput,
    /// Return something that is not XML.
    InvalidXml,
    /// Change the domain name.
    Rename,
    /// Leave out the metadata mark.
    DropMark,
    /// Change one character of the metadata mark.
    EditMark,
    /// Add a PCI host device.
    Hostdev,
    /// Add a disk backed by a host file.
    FileDisk,
    /// Add raw QEMU arguments.
    QemuCommandline,
    /// Add a NIC on another bridge.
    SecondBridge,
    /// Add a second NIC on the host's bridge, without a MAC (allowed: libvirt makes it).
    SecondNic,
    /// Panic.
    Panic,
    /// Call exit(3) (WASI 0.2 reports any non-zero status as 1).
    Exit,
    /// Print far more than the captured log holds.
    PrintFlood,
    /// Fail `validate-settings` (the schema accepts it).
    RejectSettings,
    /// Add a serial port writing to a host file.
    FileSerial,
    /// Declare a DOCTYPE with an entity.
    Doctype,
    /// Open stdout handles without ever dropping one (WASI resource-table entries).
    ManyHandles,
    /// Subscribe to one stream without ever dropping the pollables (child entries).
    ManyPollables,
    /// Return 64 MiB (over the output cap; needs a memory cap above 64 MiB to get there).
    OversizedOutput,
    /// Refuse to render with a 1 MiB message.
    OversizedRefusal,
    /// `validate-settings` returns 100,000 issues.
    ManyIssues,
    /// `validate-settings` returns one issue with a 1 MiB message and a 64 KiB pointer.
    LongIssue,
}

/// Settings: only the mode.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The misbehaviour.
    pub mode: Mode,
}

/// The plugin.
#[derive(Debug)]
pub struct Hostile;

/// A domain the output checks accept (the default plugin's shape without its optional
/// devices), with `extra` devices appended and the given mark and name.
fn valid_domain(input: &DomainInput, extra: Vec<Element>, mark: &str, name: &str) -> Element {
    let mut devices = Element::new("devices");
    for d in &input.disks {
        let (device, bus, dev) = match d.role {
            DiskRole::Root => ("disk", "virtio", "vda"),
            DiskRole::Seed => ("cdrom", "sata", "sda"),
        };
        let mut disk = Element::new("disk")
            .attr("type", "volume")
            .attr("device", device)
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
            .child(Element::new("target").attr("dev", dev).attr("bus", bus));
        if d.role == DiskRole::Seed {
            disk = disk.child(Element::new("readonly"));
        }
        devices = devices.child(disk);
    }
    devices = devices
        .child(
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
        )
        .children(extra);
    Element::new("domain")
        .attr("type", if input.host.kvm { "kvm" } else { "qemu" })
        .child(Element::new("name").text(name))
        .child(Element::new("uuid").text(&input.uuid))
        .child(Element::new("metadata").trusted_fragment(mark))
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
        .child(
            Element::new("os")
                .child(
                    Element::new("type")
                        .attr("arch", &input.host.arch)
                        .attr("machine", "q35")
                        .text("hvm"),
                )
                .child(Element::new("boot").attr("dev", "hd")),
        )
        .child(
            Element::new("features")
                .child(Element::new("acpi"))
                .child(Element::new("apic")),
        )
        .child(Element::new("clock").attr("offset", "utc"))
        .child(Element::new("on_poweroff").text("destroy"))
        .child(Element::new("on_reboot").text("restart"))
        .child(Element::new("on_crash").text("destroy"))
        .child(devices)
}

#[allow(unconditional_recursion)]
fn recurse(depth: u64, sink: &mut Vec<u64>) -> u64 {
    sink.push(depth);
    recurse(depth + 1, sink) + sink[sink.len() - 1]
}

impl DomainPlugin for Hostile {
    type Settings = Settings;

    fn validate_settings(s: &Settings) -> Vec<SettingsProblem> {
        match s.mode {
            Mode::RejectSettings => vec![SettingsProblem::new(
                "/mode",
                "reject-settings is refused by validate-settings",
            )],
            Mode::ManyIssues => (0..100_000)
                .map(|i| SettingsProblem::new(format!("/mode/{i}"), format!("issue number {i}")))
                .collect(),
            Mode::LongIssue => vec![SettingsProblem::new(
                format!("/{}", "p".repeat(64 * 1024)),
                "m".repeat(1024 * 1024),
            )],
            _ => vec![],
        }
    }

    fn render(input: &DomainInput, s: &Settings) -> Result<String, String> {
        let mark = input.metadata_mark.as_str();
        let name = input.name.as_str();
        let xml = |extra: Vec<Element>| valid_domain(input, extra, mark, name).to_xml();
        Ok(match s.mode {
            Mode::Good | Mode::RejectSettings => xml(vec![]),
            Mode::EndlessLoop => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            Mode::MemoryBomb => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            Mode::DeepRecursion => {
                let mut sink = Vec::new();
                recurse(0, &mut sink).to_string()
            }
            Mode::HugeOutput => "x".repeat(100 * 1024 * 1024),
            Mode::BigOutput => {
                let pad = Element::new("description").text("x".repeat(1024 * 1024));
                valid_domain(input, vec![], mark, name).child(pad).to_xml()
            }
            Mode::InvalidXml => "<domain><name>unclosed".into(),
            Mode::Rename => valid_domain(input, vec![], mark, "someone-else").to_xml(),
            Mode::DropMark => valid_domain(input, vec![], "", name).to_xml(),
            Mode::EditMark => {
                let edited = mark.replacen("true", "false", 1);
                valid_domain(input, vec![], &edited, name).to_xml()
            }
            Mode::Hostdev => xml(vec![
                Element::new("hostdev")
                    .attr("mode", "subsystem")
                    .attr("type", "pci")
                    .child(
                        Element::new("source").child(Element::new("address").attr("bus", "0x01")),
                    ),
            ]),
            Mode::FileDisk => xml(vec![
                Element::new("disk")
                    .attr("type", "file")
                    .attr("device", "disk")
                    .child(Element::new("source").attr("file", "/etc/shadow"))
                    .child(Element::new("target").attr("dev", "vdz")),
            ]),
            Mode::QemuCommandline => {
                let doc = xml(vec![]);
                doc.replacen(
                    "<domain type=\"qemu\">",
                    "<domain type=\"qemu\" xmlns:qemu=\"http://libvirt.org/schemas/domain/qemu/1.0\">\
                     <qemu:commandline><qemu:arg value=\"-monitor\"/></qemu:commandline>",
                    1,
                )
            }
            Mode::SecondBridge => xml(vec![
                Element::new("interface")
                    .attr("type", "bridge")
                    .child(Element::new("source").attr("bridge", "br-other")),
            ]),
            Mode::SecondNic => xml(vec![
                Element::new("interface")
                    .attr("type", "bridge")
                    .child(Element::new("source").attr("bridge", &input.bridge))
                    .child(Element::new("model").attr("type", "virtio")),
            ]),
            Mode::Panic => panic!("hostile plugin panics on purpose"),
            Mode::Exit => std::process::exit(3),
            Mode::PrintFlood => {
                for i in 0..100_000 {
                    println!("flooding the log, line {i}");
                }
                xml(vec![])
            }
            Mode::FileSerial => xml(vec![
                Element::new("serial")
                    .attr("type", "file")
                    .child(Element::new("source").attr("path", "/var/log/x")),
            ]),
            Mode::Doctype => format!("<!DOCTYPE domain [<!ENTITY x \"y\">]>{}", xml(vec![])),
            Mode::ManyHandles => {
                let mut held: u64 = 0;
                loop {
                    // Each call adds an entry to the host's resource table; none is dropped.
                    held += u64::from(raw_wasi::get_stdout() != 0);
                    std::hint::black_box(held);
                }
            }
            Mode::ManyPollables => {
                let stream = raw_wasi::get_stdout();
                let mut held: u64 = 0;
                loop {
                    held += u64::from(raw_wasi::subscribe(stream) != 0);
                    std::hint::black_box(held);
                }
            }
            Mode::OversizedOutput => "x".repeat(64 * 1024 * 1024),
            Mode::OversizedRefusal => return Err("r".repeat(1024 * 1024)),
            Mode::ManyIssues | Mode::LongIssue => xml(vec![]),
        })
    }
}

/// Two WASI functions called directly, so the plugin can hold handles without dropping
/// them (the standard library always drops what it opens). They are imports the sandbox
/// provides anyway (Rust's standard library imports them), with the core-wasm signatures
/// of the canonical ABI: a resource handle is an `i32`.
#[allow(unsafe_code)]
mod raw_wasi {
    #[cfg(target_arch = "wasm32")]
    #[link(wasm_import_module = "wasi:cli/stdout@0.2.0")]
    unsafe extern "C" {
        /// `get-stdout: func() -> output-stream`: a new handle on every call.
        #[link_name = "get-stdout"]
        safe fn get_stdout_import() -> i32;
    }

    #[cfg(target_arch = "wasm32")]
    #[link(wasm_import_module = "wasi:io/streams@0.2.0")]
    unsafe extern "C" {
        /// `[method]output-stream.subscribe: func(self: borrow<output-stream>) -> pollable`.
        #[link_name = "[method]output-stream.subscribe"]
        safe fn subscribe_import(stream: i32) -> i32;
    }

    /// A new stdout handle, never dropped.
    pub fn get_stdout() -> i32 {
        #[cfg(target_arch = "wasm32")]
        return get_stdout_import();
        #[cfg(not(target_arch = "wasm32"))]
        panic!("only in WebAssembly")
    }

    /// A new pollable on `stream`, never dropped.
    pub fn subscribe(stream: i32) -> i32 {
        #[cfg(target_arch = "wasm32")]
        return subscribe_import(stream);
        #[cfg(not(target_arch = "wasm32"))]
        {
            let _ = stream;
            panic!("only in WebAssembly")
        }
    }
}

/// The schema mode: [`SCHEMA_MODE`] after its prefix, without the `_` padding. Read
/// through `black_box`, so the compiler keeps the bytes in the component's data.
fn schema_mode() -> String {
    let bytes: &[u8] = std::hint::black_box(&SCHEMA_MODE[..]);
    String::from_utf8_lossy(&bytes[SCHEMA_MODE_PREFIX.len()..])
        .trim_end_matches('_')
        .to_string()
}

/// The settings schema the mode asks for.
fn settings_schema() -> String {
    let ordinary = templates_sdk::settings::schema_json::<Settings>();
    match schema_mode().as_str() {
        // 40 levels of `properties`: 81 nested objects.
        "deep" => {
            let mut s = String::from("{\"type\":\"string\"}");
            for _ in 0..40 {
                s = format!("{{\"properties\":{{\"a\":{s}}}}}");
            }
            s
        }
        // 1 MiB of description.
        "huge" => format!(
            "{{\"description\":\"{}\",\"type\":\"object\"}}",
            "x".repeat(1024 * 1024)
        ),
        "remote-ref" => "{\"$ref\":\"https://schemas.example.org/settings.json\"}".into(),
        // Compiles to far more than the regex size limit.
        "bad-pattern" => {
            "{\"properties\":{\"mode\":{\"type\":\"string\",\"pattern\":\"([a-z]{1000}){1000}\"}}}"
                .into()
        }
        // 40 definitions, each `anyOf` twice the next: a few KB, 2^40 evaluations.
        "ref-bomb" => {
            let defs: Vec<String> = (0..40)
                .map(|i| {
                    format!(
                        "\"d{i}\":{{\"anyOf\":[{{\"$ref\":\"#/$defs/d{n}\"}},{{\"$ref\":\"#/$defs/d{n}\"}}]}}",
                        n = i + 1
                    )
                })
                .collect();
            format!(
                "{{\"$defs\":{{{},\"d40\":{{}}}},\"$ref\":\"#/$defs/d0\"}}",
                defs.join(",")
            )
        }
        "recursive" => "{\"anyOf\":[{\"$ref\":\"#\"}]}".into(),
        _ => ordinary,
    }
}

/// The exports, as `export_domain_plugin!` makes them but with [`settings_schema`] as the
/// schema.
#[doc(hidden)]
#[derive(Debug)]
pub struct HostileExport;

impl templates_sdk::domain::exports::egress::templates::domain_template::Guest for HostileExport {
    fn settings_schema() -> String {
        settings_schema()
    }

    fn validate_settings(
        settings: String,
    ) -> Result<(), Vec<templates_sdk::domain::SettingsError>> {
        templates_sdk::__private::validate::<Settings>(&settings, Hostile::validate_settings)
            .map_err(|problems| {
                problems
                    .into_iter()
                    .map(|p| templates_sdk::domain::SettingsError {
                        pointer: p.pointer,
                        message: p.message,
                    })
                    .collect()
            })
    }

    fn render(input: DomainInput) -> Result<String, String> {
        templates_sdk::__private::render_domain::<Hostile>(&input)
    }
}

#[cfg(target_arch = "wasm32")]
templates_sdk::domain::__export_domain_world!(HostileExport with_types_in templates_sdk::domain);
