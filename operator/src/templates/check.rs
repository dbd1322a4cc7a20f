//! Checks on plugin output, before anything reaches libvirt or cloud-init.
//!
//! A plugin is code a site wrote; its output is treated as untrusted input. Domain XML is
//! parsed (quick-xml, namespace-aware) and must be one `<domain>` with the operator's name,
//! UUID and metadata mark, using only the volumes and the bridge the operator passed, and
//! nothing that reaches into the host: no host devices, files, raw QEMU arguments, custom
//! emulators or disabled confinement. Elements the rules do not name pass, because libvirt
//! keeps growing. Each refusal names its rule and where it fired.

use quick_xml::events::{BytesStart, Event};
use quick_xml::name::ResolveResult;
use quick_xml::reader::NsReader;

use super::DomainInput;
use super::errors::TemplateErrorKind;

/// Largest domain XML accepted; real ones are a few KB.
pub const DOMAIN_XML_MAX: usize = 256 * 1024;
/// Largest vendor-data accepted; it goes into a seed ISO next to user-data.
pub const VENDOR_DATA_MAX: usize = 512 * 1024;
/// libvirt's namespace for raw QEMU passthrough (`qemu:commandline`, `qemu:override`).
const QEMU_NS: &[u8] = b"http://libvirt.org/schemas/domain/qemu/1.0";
/// Elements that name host files, devices or binaries.
const HOST_ELEMENTS: &[&str] = &[
    "hostdev",
    "filesystem",
    "emulator",
    "kernel",
    "initrd",
    "dtb",
    "shmem",
    "backingStore",
    "commandline",
];
/// Character-device types that read or write host files, sockets or devices.
const HOST_CHARDEV_TYPES: &[&str] = &["file", "tcp", "udp", "dev", "pipe"];
/// Where firmware images live on Debian, Ubuntu, Fedora and RHEL hosts.
const FIRMWARE_PREFIX: &str = "/usr/share/";
/// The only entropy sources a virtio-rng may read.
const RNG_SOURCES: &[&str] = &["/dev/urandom", "/dev/random"];

fn refuse(rule: &'static str, detail: impl Into<String>) -> TemplateErrorKind {
    TemplateErrorKind::InvalidOutput {
        rule,
        detail: detail.into(),
    }
}

fn attr(e: &BytesStart<'_>, name: &str) -> Result<Option<String>, TemplateErrorKind> {
    for a in e.attributes() {
        let a = a.map_err(|err| refuse("well-formed", err.to_string()))?;
        if a.key.as_ref() == name.as_bytes() {
            let v = a
                .unescape_value()
                .map_err(|err| refuse("well-formed", err.to_string()))?;
            return Ok(Some(v.into_owned()));
        }
    }
    Ok(None)
}

/// State of the walk over a domain document.
struct Walk<'a> {
    input: &'a DomainInput,
    /// Local names of the open elements, outermost first.
    stack: Vec<String>,
    roots: usize,
    name: Option<String>,
    uuid: Option<String>,
    metadata_spans: Vec<(usize, usize)>,
    metadata_start: Option<usize>,
    /// `/domain/metadata` elements seen, empty ones included.
    metadata_count: usize,
    text: String,
}

impl Walk<'_> {
    fn path(&self) -> String {
        format!("/{}", self.stack.join("/"))
    }

    fn in_metadata(&self) -> bool {
        self.stack.len() >= 2 && self.stack[1] == "metadata"
    }

    /// Rules that look at one element when it opens.
    // One arm per rule, each with its own check, reads better than guards.
    #[allow(clippy::collapsible_match)]
    fn open(
        &mut self,
        e: &BytesStart<'_>,
        ns: &ResolveResult<'_>,
    ) -> Result<(), TemplateErrorKind> {
        let local = String::from_utf8_lossy(e.local_name().as_ref()).into_owned();
        // Text rules look at an element's own text, not the whitespace before it.
        self.text.clear();
        if self.stack.is_empty() {
            self.roots += 1;
            if self.roots > 1 {
                return Err(refuse("one-domain", "more than one root element"));
            }
            if local != "domain" || !matches!(ns, ResolveResult::Unbound) {
                return Err(refuse(
                    "one-domain",
                    format!("root element is <{local}>, not <domain>"),
                ));
            }
        }
        self.stack.push(local.clone());
        if self.stack.len() == 2 && local == "metadata" {
            self.metadata_count += 1;
        }
        if self.in_metadata() {
            // Metadata is opaque to libvirt; any namespace and element may live there.
            return Ok(());
        }
        let at = self.path();
        if let ResolveResult::Bound(n) = ns
            && n.as_ref() == QEMU_NS
        {
            return Err(refuse(
                "no-qemu-passthrough",
                format!("{at} is in libvirt's QEMU passthrough namespace"),
            ));
        }
        if HOST_ELEMENTS.contains(&local.as_str()) {
            return Err(refuse(
                "no-host-resources",
                format!("{at} gives the guest host files, devices or binaries"),
            ));
        }
        let parent = self
            .stack
            .len()
            .checked_sub(2)
            .map(|i| self.stack[i].as_str());
        match (parent, local.as_str()) {
            (Some("devices"), "disk") => {
                let kind = attr(e, "type")?.unwrap_or_default();
                if kind != "volume" {
                    return Err(refuse(
                        "disk-volume-only",
                        format!(
                            "{at} has type {kind:?}; only type=\"volume\" disks the operator prepared are allowed"
                        ),
                    ));
                }
            }
            (Some("disk"), "source") => self.disk_source(e, &at)?,
            (Some("devices"), "interface") => {
                let kind = attr(e, "type")?.unwrap_or_default();
                if kind != "bridge" {
                    return Err(refuse(
                        "interface-bridge-only",
                        format!(
                            "{at} has type {kind:?}; only type=\"bridge\" on the configured bridge is allowed"
                        ),
                    ));
                }
            }
            (Some("interface"), "source") => {
                let bridge = attr(e, "bridge")?;
                if bridge.as_deref() != Some(self.input.bridge.as_str()) {
                    return Err(refuse(
                        "interface-bridge-only",
                        format!(
                            "{at} uses bridge {bridge:?}; only {:?} is allowed",
                            self.input.bridge
                        ),
                    ));
                }
            }
            (
                Some("devices"),
                "serial" | "parallel" | "console" | "channel" | "redirdev" | "smartcard",
            ) => {
                let kind = attr(e, "type")?.unwrap_or_default();
                if HOST_CHARDEV_TYPES.contains(&kind.as_str()) {
                    return Err(refuse(
                        "no-host-chardev",
                        format!(
                            "{at} has type {kind:?}, which reaches host files, sockets or devices"
                        ),
                    ));
                }
            }
            (Some("serial" | "parallel" | "console" | "channel"), "source") => {
                if attr(e, "path")?.is_some() {
                    return Err(refuse("no-host-chardev", format!("{at} names a host path")));
                }
            }
            (Some("serial" | "parallel" | "console" | "channel"), "log") => {
                return Err(refuse(
                    "no-host-chardev",
                    format!("{at} writes a host file"),
                ));
            }
            (Some("os"), "loader") => {}
            (Some("os"), "nvram") => {
                if let Some(t) = attr(e, "template")?
                    && !t.starts_with(FIRMWARE_PREFIX)
                {
                    return Err(refuse(
                        "firmware-paths",
                        format!("{at} template {t:?} is not under {FIRMWARE_PREFIX}"),
                    ));
                }
            }
            (_, "backend") => {
                if attr(e, "type")?.as_deref() == Some("passthrough")
                    || attr(e, "model")?.as_deref() == Some("egd")
                {
                    return Err(refuse(
                        "no-host-resources",
                        format!("{at} passes a host device or socket through"),
                    ));
                }
            }
            (_, "seclabel") => {
                if attr(e, "type")?.as_deref() == Some("none") {
                    return Err(refuse(
                        "no-seclabel-none",
                        format!("{at} turns off sVirt/AppArmor confinement"),
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn disk_source(&self, e: &BytesStart<'_>, at: &str) -> Result<(), TemplateErrorKind> {
        for forbidden in ["file", "dev", "dir", "protocol", "name"] {
            if attr(e, forbidden)?.is_some() {
                return Err(refuse(
                    "disk-volume-only",
                    format!("{at} has a {forbidden:?} attribute"),
                ));
            }
        }
        let pool = attr(e, "pool")?.unwrap_or_default();
        let volume = attr(e, "volume")?.unwrap_or_default();
        let prepared = self
            .input
            .disks
            .iter()
            .any(|d| d.pool == pool && d.volume == volume);
        if prepared {
            Ok(())
        } else {
            Err(refuse(
                "disk-not-prepared",
                format!(
                    "{at} references pool {pool:?} volume {volume:?}, which the operator did not prepare"
                ),
            ))
        }
    }

    /// Rules that need an element's text, checked when it closes.
    #[allow(clippy::collapsible_match)]
    fn close(&mut self) -> Result<(), TemplateErrorKind> {
        let text = std::mem::take(&mut self.text);
        if !self.in_metadata() {
            let at = self.path();
            match self
                .stack
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .as_slice()
            {
                ["domain", "name"] => self.name = Some(text),
                ["domain", "uuid"] => self.uuid = Some(text),
                ["domain", "os", "loader"] => {
                    if !text.trim().starts_with(FIRMWARE_PREFIX) {
                        return Err(refuse(
                            "firmware-paths",
                            format!("{at} {text:?} is not under {FIRMWARE_PREFIX}"),
                        ));
                    }
                }
                ["domain", "os", "nvram"] => {
                    if !text.trim().is_empty() {
                        return Err(refuse(
                            "firmware-paths",
                            format!(
                                "{at} names a host file; leave it empty and libvirt creates the VM's NVRAM"
                            ),
                        ));
                    }
                }
                [.., "rng", "backend"] => {
                    if !text.trim().is_empty() && !RNG_SOURCES.contains(&text.trim()) {
                        return Err(refuse(
                            "no-host-resources",
                            format!("{at} reads {text:?}; only {RNG_SOURCES:?}"),
                        ));
                    }
                }
                _ => {}
            }
        }
        self.stack.pop();
        Ok(())
    }
}

/// Checks rendered domain XML against the input it was rendered from.
pub fn check_domain_xml(xml: &str, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    if xml.len() > DOMAIN_XML_MAX {
        return Err(TemplateErrorKind::OutputTooLarge {
            size: xml.len(),
            max: DOMAIN_XML_MAX,
        });
    }
    let mut reader = NsReader::from_str(xml);
    let mut w = Walk {
        input,
        stack: Vec::new(),
        roots: 0,
        name: None,
        uuid: None,
        metadata_spans: Vec::new(),
        metadata_start: None,
        metadata_count: 0,
        text: String::new(),
    };
    loop {
        let at = reader.buffer_position();
        let (ns, event) = reader
            .read_resolved_event()
            .map_err(|e| refuse("well-formed", format!("after byte {at}: {e}")))?;
        match event {
            Event::Start(e) => {
                w.open(&e, &ns)?;
                if w.stack.len() == 2 && w.stack[1] == "metadata" {
                    w.metadata_start =
                        Some(usize::try_from(reader.buffer_position()).unwrap_or(usize::MAX));
                }
            }
            Event::Empty(e) => {
                w.open(&e, &ns)?;
                w.close()?;
            }
            Event::End(_) => {
                if w.stack.len() == 2 && w.stack[1] == "metadata" {
                    let end = usize::try_from(reader.buffer_position()).unwrap_or(usize::MAX);
                    if let Some(start) = w.metadata_start.take() {
                        // The span ends before `</metadata>`; find that tag's start.
                        let close = xml
                            .get(start..end)
                            .and_then(|s| s.rfind("</"))
                            .map_or(end, |i| start + i);
                        w.metadata_spans.push((start, close));
                    }
                }
                w.close()?;
            }
            Event::Text(t) => {
                let text = t
                    .decode()
                    .map_err(|e| refuse("well-formed", e.to_string()))?;
                let text = quick_xml::escape::unescape(&text)
                    .map_err(|e| refuse("well-formed", e.to_string()))?;
                if w.stack.is_empty() && !text.trim().is_empty() {
                    return Err(refuse("one-domain", "text outside the <domain> element"));
                }
                w.text.push_str(&text);
            }
            Event::GeneralRef(r) => {
                // Only the five predefined entities and character references exist here;
                // quick-xml leaves anything else unresolved, and so do we (refuse).
                let name = r
                    .decode()
                    .map_err(|e| refuse("well-formed", e.to_string()))?;
                let resolved = match name.as_ref() {
                    "amp" => "&".to_string(),
                    "lt" => "<".to_string(),
                    "gt" => ">".to_string(),
                    "quot" => "\"".to_string(),
                    "apos" => "'".to_string(),
                    other => match r.resolve_char_ref() {
                        Ok(Some(c)) => c.to_string(),
                        _ => {
                            return Err(refuse("well-formed", format!("unknown entity &{other};")));
                        }
                    },
                };
                w.text.push_str(&resolved);
            }
            Event::CData(c) => w.text.push_str(&String::from_utf8_lossy(&c)),
            Event::DocType(_) => {
                return Err(refuse(
                    "no-doctype",
                    "a DOCTYPE could define entities; none is allowed",
                ));
            }
            Event::PI(_) => {
                return Err(refuse(
                    "well-formed",
                    "processing instructions are not allowed",
                ));
            }
            Event::Decl(_) | Event::Comment(_) => {}
            Event::Eof => break,
        }
    }
    if !w.stack.is_empty() {
        return Err(refuse(
            "well-formed",
            format!("unclosed element <{}>", w.stack.join("><")),
        ));
    }
    if w.roots == 0 {
        return Err(refuse("one-domain", "no <domain> element"));
    }
    if w.name.as_deref() != Some(input.name.as_str()) {
        return Err(refuse(
            "name-unchanged",
            format!("/domain/name is {:?}, expected {:?}", w.name, input.name),
        ));
    }
    let uuid = w.uuid.as_deref().map(|u| u.trim().to_ascii_lowercase());
    if uuid.as_deref() != Some(input.uuid.as_str()) {
        return Err(refuse(
            "uuid-unchanged",
            format!("/domain/uuid is {:?}, expected {:?}", w.uuid, input.uuid),
        ));
    }
    if w.metadata_count > 1 {
        return Err(refuse("metadata-mark", "more than one /domain/metadata"));
    }
    match w.metadata_spans.as_slice() {
        [(start, end)] => {
            let inside = xml.get(*start..*end).unwrap_or_default();
            if !inside.contains(input.metadata_mark.as_str()) {
                return Err(refuse(
                    "metadata-mark",
                    "/domain/metadata does not carry the operator's mark unchanged",
                ));
            }
        }
        _ => {
            return Err(refuse(
                "metadata-mark",
                "/domain/metadata is missing or empty; it must carry the operator's mark",
            ));
        }
    }
    Ok(())
}

/// Checks libvirt's own reading of a defined domain (its inactive XML,
/// `virDomainGetXMLDesc(VIR_DOMAIN_XML_INACTIVE)`) against the input the plugin rendered
/// from, before the domain is ever started. libvirt fills in defaults (emulator, addresses,
/// controllers, generated MACs, the NVRAM path); everything else obeys the same rules as
/// the plugin's output, so a document that libvirt reads differently from us is caught.
pub fn check_defined_domain_xml(xml: &str, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    check_domain_xml(xml, input)
}

/// Checks rendered vendor-data: `#cloud-config` YAML that parses to a mapping, or a MIME
/// multipart document with its boundary.
pub fn check_vendor_data(text: &str) -> Result<(), TemplateErrorKind> {
    if text.len() > VENDOR_DATA_MAX {
        return Err(TemplateErrorKind::OutputTooLarge {
            size: text.len(),
            max: VENDOR_DATA_MAX,
        });
    }
    let first = text.lines().next().unwrap_or_default().trim_end();
    if first == "#cloud-config" {
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(text)
            .map_err(|e| refuse("cloud-config-yaml", format!("does not parse as YAML: {e}")))?;
        return match doc {
            serde_yaml_ng::Value::Mapping(_) => Ok(()),
            serde_yaml_ng::Value::Null => Ok(()),
            _ => Err(refuse("cloud-config-yaml", "top level must be a mapping")),
        };
    }
    let lower_headers: String = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n")
        .to_ascii_lowercase();
    if lower_headers.contains("content-type: multipart/") {
        let boundary = lower_headers
            .split("boundary=")
            .nth(1)
            .map(|b| b.trim_start_matches('"'))
            .and_then(|b| b.split(['"', ';', '\n', ' ']).next())
            .filter(|b| !b.is_empty())
            .ok_or_else(|| refuse("mime-multipart", "the Content-Type header has no boundary"))?;
        if !text.to_ascii_lowercase().contains(&format!("--{boundary}")) {
            return Err(refuse(
                "mime-multipart",
                format!("boundary {boundary:?} never appears in the body"),
            ));
        }
        return Ok(());
    }
    Err(refuse(
        "vendor-data-format",
        "must start with a `#cloud-config` line or be a MIME multipart document",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::templates::{Disk, DiskBus, DiskRole, Firmware, HostFacts};

    const MARK: &str =
        "<eo:instance xmlns:eo=\"urn:eo\"><eo:managed>true</eo:managed></eo:instance>";

    fn input() -> DomainInput {
        DomainInput {
            name: "egress-1".into(),
            uuid: "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887".into(),
            vcpus: 1,
            memory_mib: 512,
            firmware: Firmware::Bios,
            disks: vec![Disk {
                pool: "default".into(),
                volume: "egress-1-root".into(),
                role: DiskRole::Root,
                bus: DiskBus::Virtio,
                format: "qcow2".into(),
            }],
            bridge: "br0".into(),
            mac: None,
            metadata_mark: MARK.into(),
            host: HostFacts {
                name: "h".into(),
                arch: "x86_64".into(),
                kvm: false,
                libvirt_version: "9.0.0".into(),
            },
            settings: "{}".into(),
        }
    }

    /// A valid document with `devices` and `extra` spliced in.
    fn doc(devices: &str, extra: &str) -> String {
        format!(
            "<?xml version=\"1.0\"?><!-- ok --><domain type=\"qemu\"><name>egress-1</name>\
             <uuid>0B7C3C1E-9A43-4F5E-A1D2-3C4B5A697887</uuid><metadata>{MARK}<other:x xmlns:other=\"urn:o\"><hostdev/></other:x></metadata>\
             <os><type>hvm</type></os>{extra}<devices>\
             <disk type=\"volume\"><source pool=\"default\" volume=\"egress-1-root\"/></disk>\
             <interface type=\"bridge\"><source bridge=\"br0\"/></interface>\
             <channel type=\"unix\"><target type=\"virtio\" name=\"org.qemu.guest_agent.0\"/></channel>\
             <rng model=\"virtio\"><backend model=\"random\">/dev/urandom</backend></rng>\
             <futureDevice type=\"new\"/>{devices}</devices></domain>"
        )
    }

    fn rule_of(xml: &str) -> Option<&'static str> {
        match check_domain_xml(xml, &input()) {
            Ok(()) => None,
            Err(TemplateErrorKind::InvalidOutput { rule, .. }) => Some(rule),
            Err(TemplateErrorKind::OutputTooLarge { .. }) => Some("size"),
            Err(other) => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn valid_documents_pass_including_unknown_elements_and_foreign_metadata() {
        assert_eq!(rule_of(&doc("", "")), None);
        let efi = "<os><loader readonly=\"yes\" type=\"pflash\">/usr/share/OVMF/OVMF_CODE_4M.fd</loader>\
                   <nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.fd\"/></os>";
        assert_eq!(rule_of(&doc("", efi)), None);
        assert_eq!(
            rule_of(&doc(
                "<serial type=\"pty\"><target port=\"0\"/></serial>",
                ""
            )),
            None
        );
    }

    #[test]
    fn every_rule_fires() {
        let cases: &[(&str, String)] = &[
            ("well-formed", "<domain><name>x".into()),
            ("well-formed", doc("", "").replace("</domain>", "")),
            ("one-domain", "<network/>".into()),
            ("one-domain", format!("{}<domain/>", doc("", ""))),
            ("one-domain", String::new()),
            (
                "no-doctype",
                format!("<!DOCTYPE d [<!ENTITY e \"x\">]>{}", doc("", "")),
            ),
            (
                "well-formed",
                doc("", "").replace("<name>egress-1</name>", "<name>&e;</name>"),
            ),
            (
                "name-unchanged",
                doc("", "").replace("<name>egress-1</name>", "<name>egress-2</name>"),
            ),
            (
                "uuid-unchanged",
                doc("", "").replace("0B7C3C1E", "1B7C3C1E"),
            ),
            (
                "metadata-mark",
                doc("", "").replace("true</eo:managed>", "false</eo:managed>"),
            ),
            ("metadata-mark", doc("", "").replace(MARK, "")),
            (
                "metadata-mark",
                doc("", &format!("<description>{MARK}</description>"))
                    .replace(&format!("<metadata>{MARK}"), "<metadata>"),
            ),
            ("metadata-mark", doc("", "<metadata/>")),
            (
                "no-host-resources",
                doc("<hostdev mode=\"subsystem\" type=\"pci\"/>", ""),
            ),
            (
                "no-host-resources",
                doc(
                    "<filesystem type=\"mount\"><source dir=\"/\"/></filesystem>",
                    "",
                ),
            ),
            (
                "no-host-resources",
                doc("", "<devices><emulator>/bin/sh</emulator></devices>"),
            ),
            (
                "no-host-resources",
                doc("", "<os><kernel>/boot/vmlinuz</kernel></os>"),
            ),
            (
                "no-host-resources",
                doc("<tpm><backend type=\"passthrough\"/></tpm>", ""),
            ),
            (
                "no-host-resources",
                doc(
                    "<rng model=\"virtio\"><backend model=\"random\">/etc/shadow</backend></rng>",
                    "",
                ),
            ),
            (
                "no-qemu-passthrough",
                doc(
                    "",
                    "<q:commandline xmlns:q=\"http://libvirt.org/schemas/domain/qemu/1.0\"/>",
                ),
            ),
            (
                "no-qemu-passthrough",
                doc(
                    "",
                    "<q:capabilities xmlns:q=\"http://libvirt.org/schemas/domain/qemu/1.0\"/>",
                ),
            ),
            (
                "disk-volume-only",
                doc(
                    "<disk type=\"file\"><source file=\"/etc/shadow\"/></disk>",
                    "",
                ),
            ),
            (
                "disk-volume-only",
                doc(
                    "<disk type=\"volume\"><source pool=\"default\" volume=\"egress-1-root\" file=\"/x\"/></disk>",
                    "",
                ),
            ),
            ("disk-volume-only", doc("<disk type=\"block\"/>", "")),
            (
                "disk-not-prepared",
                doc(
                    "<disk type=\"volume\"><source pool=\"default\" volume=\"someone-elses\"/></disk>",
                    "",
                ),
            ),
            (
                "disk-not-prepared",
                doc(
                    "<disk type=\"volume\"><source pool=\"other\" volume=\"egress-1-root\"/></disk>",
                    "",
                ),
            ),
            (
                "no-host-resources",
                doc(
                    "<disk type=\"volume\"><source pool=\"default\" volume=\"egress-1-root\"/><backingStore type=\"file\"/></disk>",
                    "",
                ),
            ),
            (
                "interface-bridge-only",
                doc(
                    "<interface type=\"network\"><source network=\"default\"/></interface>",
                    "",
                ),
            ),
            (
                "interface-bridge-only",
                doc("<interface type=\"direct\"/>", ""),
            ),
            (
                "interface-bridge-only",
                doc(
                    "<interface type=\"bridge\"><source bridge=\"br1\"/></interface>",
                    "",
                ),
            ),
            (
                "no-host-chardev",
                doc(
                    "<serial type=\"file\"><source path=\"/tmp/x\"/></serial>",
                    "",
                ),
            ),
            ("no-host-chardev", doc("<serial type=\"tcp\"/>", "")),
            ("no-host-chardev", doc("<channel type=\"udp\"/>", "")),
            (
                "no-host-chardev",
                doc(
                    "<channel type=\"unix\"><source path=\"/run/x.sock\"/></channel>",
                    "",
                ),
            ),
            (
                "no-host-chardev",
                doc(
                    "<serial type=\"pty\"><log file=\"/var/log/x\"/></serial>",
                    "",
                ),
            ),
            (
                "firmware-paths",
                doc("", "<os><loader>/etc/shadow</loader></os>"),
            ),
            (
                "firmware-paths",
                doc("", "<os><nvram template=\"/etc/passwd\"/></os>"),
            ),
            (
                "firmware-paths",
                doc("", "<os><nvram>/etc/passwd</nvram></os>"),
            ),
            ("no-seclabel-none", doc("", "<seclabel type=\"none\"/>")),
            (
                "size",
                format!("{}<!--{}-->", doc("", ""), "x".repeat(DOMAIN_XML_MAX)),
            ),
        ];
        for (want, xml) in cases {
            assert_eq!(rule_of(xml), Some(*want), "{xml}");
        }
    }

    #[test]
    fn vendor_data_formats() {
        assert!(check_vendor_data("#cloud-config\npackages: [a]\n").is_ok());
        assert!(check_vendor_data("#cloud-config\n").is_ok());
        let mime = "Content-Type: multipart/mixed; boundary=\"XYZ\"\nMIME-Version: 1.0\n\n--XYZ\nContent-Type: text/cloud-config\n\npackages: []\n--XYZ--\n";
        assert!(check_vendor_data(mime).is_ok());
        let cases = [
            (
                "cloud-config-yaml",
                "#cloud-config\npackages: [a\n".to_string(),
            ),
            ("cloud-config-yaml", "#cloud-config\n- a\n- b\n".to_string()),
            (
                "mime-multipart",
                "Content-Type: multipart/mixed\n\nbody".to_string(),
            ),
            ("mime-multipart", mime.replace("--XYZ", "--ABC")),
            ("vendor-data-format", "#!/bin/sh\nrm -rf /\n".to_string()),
            ("vendor-data-format", String::new()),
        ];
        for (want, text) in cases {
            match check_vendor_data(&text) {
                Err(TemplateErrorKind::InvalidOutput { rule, .. }) => {
                    assert_eq!(rule, want, "{text}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        let big = format!("#cloud-config\n#{}\n", "x".repeat(VENDOR_DATA_MAX));
        assert!(matches!(
            check_vendor_data(&big),
            Err(TemplateErrorKind::OutputTooLarge { .. })
        ));
    }
}
