//! A domain plugin that misbehaves on request, to prove the sandbox and the output checks.
//!
//! The `mode` setting picks the misbehaviour, so one component covers the whole corpus and
//! the tests load it once per case with different settings. `good` renders a valid domain,
//! used to show the host still works after every other case.
#![forbid(unsafe_code)]
#![allow(clippy::panic)] // panicking on request is this plugin's job

use schemars::JsonSchema;
use serde::Deserialize;
use templates_sdk::domain::DomainInput;
use templates_sdk::xml::Element;
use templates_sdk::{DomainPlugin, SettingsProblem};

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

fn valid_domain(input: &DomainInput, extra: Vec<Element>, mark: &str, name: &str) -> Element {
    let mut devices = Element::new("devices");
    for d in &input.disks {
        devices = devices.child(
            Element::new("disk")
                .attr("type", "volume")
                .attr("device", "disk")
                .child(
                    Element::new("source")
                        .attr("pool", &d.pool)
                        .attr("volume", &d.volume),
                )
                .child(
                    Element::new("target")
                        .attr("dev", "vda")
                        .attr("bus", "virtio"),
                ),
        );
    }
    devices = devices
        .child(
            Element::new("interface")
                .attr("type", "bridge")
                .child(Element::new("source").attr("bridge", &input.bridge)),
        )
        .children(extra);
    Element::new("domain")
        .attr("type", "qemu")
        .child(Element::new("name").text(name))
        .child(Element::new("uuid").text(&input.uuid))
        .child(Element::new("metadata").trusted_fragment(mark))
        .child(
            Element::new("memory")
                .attr("unit", "MiB")
                .text(input.memory_mib.to_string()),
        )
        .child(Element::new("os").child(Element::new("type").text("hvm")))
        .child(Element::new("features").child(Element::new("acpi")))
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
        if s.mode == Mode::RejectSettings {
            vec![SettingsProblem::new(
                "/mode",
                "reject-settings is refused by validate-settings",
            )]
        } else {
            vec![]
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
        })
    }
}

templates_sdk::export_domain_plugin!(Hostile);
