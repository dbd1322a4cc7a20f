//! Table tests: one table per class of attack, several forms each, and a corpus of ordinary
//! documents that must stay accepted.

use super::*;
use crate::instance::{METADATA_NS, MetadataMark};
use crate::templates::{Disk, DiskBus, DiskRole, Firmware, HostFacts};

const NAME: &str = "egress-0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887";
const UUID: &str = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887";
const ROOT: &str = "egress-0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887-root";
const SEED: &str = "egress-0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887-seed";
const MAC: &str = "52:54:00:1a:2b:3c";

fn mark() -> String {
    MetadataMark {
        cluster_id: "prod-1".into(),
        cluster_uid: None,
        namespace: "default".into(),
        name: "office".into(),
        uid: UUID.into(),
        created_at: "2026-12-03T07:00:00Z".into(),
        mac: None,
        address: None,
    }
    .to_xml()
}

fn input_with(firmware: Firmware) -> DomainInput {
    DomainInput {
        name: NAME.into(),
        uuid: UUID.into(),
        vcpus: 2,
        memory_mib: 1024,
        firmware,
        disks: vec![
            Disk {
                pool: "default".into(),
                volume: ROOT.into(),
                role: DiskRole::Root,
                bus: DiskBus::Virtio,
                format: "qcow2".into(),
            },
            Disk {
                pool: "default".into(),
                volume: SEED.into(),
                role: DiskRole::Seed,
                bus: DiskBus::Sata,
                format: "raw".into(),
            },
        ],
        bridge: "br0".into(),
        mac: Some(MAC.into()),
        metadata_mark: mark(),
        host: HostFacts {
            name: "h1".into(),
            arch: "x86_64".into(),
            kvm: false,
            libvirt_version: "9.0.0".into(),
            cpus: 2,
            numa_nodes: 1,
        },
        settings: "{}".into(),
    }
}

fn input() -> DomainInput {
    input_with(Firmware::Bios)
}

/// The default plugin's output for [`input`], as `to_pretty_xml` writes it.
fn base() -> String {
    format!(
        r#"<domain type="qemu">
  <name>{NAME}</name>
  <uuid>{UUID}</uuid>
  <metadata>{mark}</metadata>
  <memory unit="MiB">1024</memory>
  <vcpu placement="static">2</vcpu>
  <os>
    <type arch="x86_64" machine="q35">hvm</type>
    <boot dev="hd"/>
  </os>
  <features>
    <acpi/>
    <apic/>
  </features>
  <clock offset="utc"/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <disk type="volume" device="disk">
      <driver name="qemu" type="qcow2" discard="unmap"/>
      <source pool="default" volume="{ROOT}"/>
      <target dev="vda" bus="virtio"/>
    </disk>
    <disk type="volume" device="cdrom">
      <driver name="qemu" type="raw"/>
      <source pool="default" volume="{SEED}"/>
      <target dev="sda" bus="sata"/>
      <readonly/>
    </disk>
    <interface type="bridge">
      <source bridge="br0"/>
      <mac address="{MAC}"/>
      <model type="virtio"/>
    </interface>
    <serial type="pty">
      <target port="0"/>
    </serial>
    <console type="pty">
      <target type="serial" port="0"/>
    </console>
    <channel type="unix">
      <target type="virtio" name="org.qemu.guest_agent.0"/>
    </channel>
    <rng model="virtio">
      <backend model="random">/dev/urandom</backend>
      <rate period="1000" bytes="1024"/>
    </rng>
    <memballoon model="virtio"/>
  </devices>
</domain>
"#,
        mark = mark()
    )
}

/// `base()` with `from` replaced by `to` (which must occur).
fn with(from: &str, to: &str) -> String {
    let b = base();
    assert!(b.contains(from), "fixture lacks {from}");
    b.replacen(from, to, 1)
}

/// `base()` with `extra` added as the last device.
fn device(extra: &str) -> String {
    with("</devices>", &format!("{extra}</devices>"))
}

/// `base()` with `extra` added after `<vcpu>`.
fn top(extra: &str) -> String {
    with(
        "<vcpu placement=\"static\">2</vcpu>",
        &format!("<vcpu placement=\"static\">2</vcpu>{extra}"),
    )
}

fn verdict(xml: &str, input: &DomainInput, reading: Reading) -> Result<(), (String, String)> {
    let r = match reading {
        Reading::Plugin => check_domain_xml(xml, input),
        Reading::Libvirt => check_defined_domain_xml(xml, input),
    };
    r.map_err(|e| match e {
        TemplateErrorKind::InvalidOutput { rule, detail } => (rule.to_string(), detail),
        TemplateErrorKind::OutputTooLarge { .. } => ("size".into(), e.to_string()),
        other => panic!("unexpected error kind {other}"),
    })
}

/// Every case must be refused by `rule` (in both readings: libvirt's inactive XML is held
/// to the same rules), with a detail that names `path`.
/// Whether `detail` names `path`; sibling indexes (`[1]`) in the detail are ignored unless
/// `path` gives one.
fn names(detail: &str, path: &str) -> bool {
    if path.contains('[') {
        return detail.contains(path);
    }
    let mut plain = String::new();
    let mut skip = false;
    for c in detail.chars() {
        match c {
            '[' => skip = true,
            ']' if skip => skip = false,
            _ if !skip => plain.push(c),
            _ => {}
        }
    }
    plain.contains(path)
}

fn refused(cases: &[(&str, &str, String)]) {
    for (rule, path, xml) in cases {
        for reading in [Reading::Plugin, Reading::Libvirt] {
            match verdict(xml, &input(), reading) {
                Ok(()) => panic!("accepted ({reading:?}), expected {rule}:\n{xml}"),
                Err((got, detail)) => {
                    assert_eq!(&got, rule, "({reading:?}) {detail}\n{xml}");
                    assert!(
                        names(&detail, path),
                        "({reading:?}) detail {detail:?} does not name {path:?}"
                    );
                }
            }
        }
    }
}

fn accepted(xml: &str, input: &DomainInput, reading: Reading) {
    if let Err((rule, detail)) = verdict(xml, input, reading) {
        panic!("refused ({reading:?}) by {rule}: {detail}\n{xml}");
    }
}

#[test]
fn the_default_output_passes() {
    accepted(&base(), &input(), Reading::Plugin);
    accepted(&base(), &input(), Reading::Libvirt);
}

#[test]
fn prefixed_attributes_are_refused_because_libvirt_matches_local_names() {
    let x = "xmlns:x=\"urn:x\"";
    refused(&[
        (
            "namespaces",
            "/domain/devices/interface",
            with(
                "<interface type=\"bridge\">",
                &format!("<interface {x} x:type=\"user\" type=\"bridge\">"),
            ),
        ),
        (
            "namespaces",
            "/domain/devices/interface/source",
            with(
                "<source bridge=\"br0\"/>",
                &format!("<source {x} x:bridge=\"virbr0\" bridge=\"br0\"/>"),
            ),
        ),
        (
            "namespaces",
            "/domain/devices/disk/source",
            with(
                &format!("<source pool=\"default\" volume=\"{ROOT}\"/>"),
                &format!("<source {x} x:pool=\"other\" pool=\"default\" volume=\"{ROOT}\"/>"),
            ),
        ),
        (
            "namespaces",
            "/domain/devices/disk/source",
            with(
                &format!("<source pool=\"default\" volume=\"{ROOT}\"/>"),
                &format!("<source {x} x:file=\"/etc/shadow\" pool=\"default\" volume=\"{ROOT}\"/>"),
            ),
        ),
        (
            "namespaces",
            "/domain/seclabel",
            top(&format!("<seclabel {x} x:type=\"none\" type=\"dynamic\"/>")),
        ),
        // The predeclared xml: prefix is a prefix too.
        (
            "namespaces",
            "/domain/devices/interface",
            with(
                "<interface type=\"bridge\">",
                "<interface xml:lang=\"en\" type=\"bridge\">",
            ),
        ),
        // A declaration alone, on the root and on a device.
        (
            "namespaces",
            "/domain",
            with(
                "<domain type=\"qemu\">",
                "<domain xmlns:qemu=\"http://libvirt.org/schemas/domain/qemu/1.0\" type=\"qemu\">",
            ),
        ),
        (
            "namespaces",
            "/domain/devices",
            with("<devices>", "<devices xmlns=\"urn:default\">"),
        ),
        // Namespaces on <metadata> itself are outside the opaque part.
        (
            "namespaces",
            "/domain/metadata",
            with("<metadata>", "<metadata xmlns:x=\"urn:x\">"),
        ),
    ]);
}

#[test]
fn repeated_singletons_are_refused_because_libvirt_reads_the_first() {
    let other = "egress-11111111-2222-4333-8444-555555555555";
    refused(&[
        (
            "singleton",
            "/domain/name",
            with(
                &format!("<name>{NAME}</name>"),
                &format!("<name>{other}</name><name>{NAME}</name>"),
            ),
        ),
        (
            "singleton",
            "/domain/name",
            with(
                &format!("<name>{NAME}</name>"),
                &format!("<name>{NAME}</name><name>{other}</name>"),
            ),
        ),
        (
            "singleton",
            "/domain/uuid",
            with(
                &format!("<uuid>{UUID}</uuid>"),
                &format!("<uuid>11111111-2222-4333-8444-555555555555</uuid><uuid>{UUID}</uuid>"),
            ),
        ),
        (
            "singleton",
            "/domain/memory",
            top("<memory unit=\"GiB\">64</memory>"),
        ),
        ("singleton", "/domain/os", top("<os><type>hvm</type></os>")),
        (
            "singleton",
            "/domain/devices",
            top("<devices><disk type=\"volume\"/></devices>"),
        ),
        (
            "singleton",
            "/domain/devices/interface/source",
            with(
                "<source bridge=\"br0\"/>",
                "<source bridge=\"virbr0\"/><source bridge=\"br0\"/>",
            ),
        ),
        (
            "singleton",
            "/domain/devices/disk/driver",
            with(
                "<driver name=\"qemu\" type=\"raw\"/>",
                "<driver name=\"qemu\" type=\"qcow2\"/><driver name=\"qemu\" type=\"raw\"/>",
            ),
        ),
        ("singleton", "/domain/metadata", top("<metadata/>")),
    ]);
}

#[test]
fn text_is_read_whole_as_libvirt_does() {
    refused(&[
        // A child element, a comment or CDATA inside a text-valued element.
        (
            "text-only",
            "/domain/name",
            with(
                &format!("<name>{NAME}</name>"),
                &format!("<name>{NAME}<x/></name>"),
            ),
        ),
        (
            "text-only",
            "/domain/name",
            with(
                &format!("<name>{NAME}</name>"),
                &format!("<name>egress-<!-- split -->{}</name>", &NAME[7..]),
            ),
        ),
        (
            "no-cdata",
            "/domain/name",
            with(
                &format!("<name>{NAME}</name>"),
                &format!("<name><![CDATA[{NAME}]]></name>"),
            ),
        ),
        (
            "text-only",
            "/domain/devices/rng/backend",
            with(
                "<backend model=\"random\">/dev/urandom</backend>",
                "<backend model=\"random\">/etc/x<y/></backend>",
            ),
        ),
        (
            "text-only",
            "/domain/devices/rng/backend",
            with(
                "<backend model=\"random\">/dev/urandom</backend>",
                "<backend model=\"random\">/dev/<!-- -->urandom</backend>",
            ),
        ),
        // Split text whose last run looks right.
        (
            "value",
            "/domain/devices/rng/backend",
            with(
                "<backend model=\"random\">/dev/urandom</backend>",
                "<backend model=\"random\">/etc/shadow&#10;/dev/urandom</backend>",
            ),
        ),
        // Mixed content in an element-only element.
        (
            "text-only",
            "/domain/devices",
            with("<devices>", "<devices>text"),
        ),
        // Surrounding white space is part of libvirt's value.
        (
            "name-unchanged",
            "/domain/name",
            with(
                &format!("<name>{NAME}</name>"),
                &format!("<name> {NAME}</name>"),
            ),
        ),
        (
            "value",
            "/domain/on_crash",
            with(
                "<on_crash>destroy</on_crash>",
                "<on_crash>coredump-destroy</on_crash>",
            ),
        ),
        (
            "value",
            "/domain/vcpu",
            with(
                "<vcpu placement=\"static\">2</vcpu>",
                "<vcpu placement=\"static\">2 </vcpu>",
            ),
        ),
        // Numbers as libvirt parses them: a leading zero in an address is octal there.
        (
            "value",
            "/domain/devices/disk/address/@slot",
            with(
                "<target dev=\"vda\" bus=\"virtio\"/>",
                "<target dev=\"vda\" bus=\"virtio\"/><address type=\"pci\" domain=\"0\" bus=\"0\" slot=\"010\" function=\"0\"/>",
            ),
        ),
    ]);
}

#[test]
fn firmware_paths_are_exact_known_files() {
    let efi = input_with(Firmware::Efi);
    let os = |loader: &str, nvram: &str| {
        with(
            "<boot dev=\"hd\"/>",
            &format!("{loader}{nvram}<boot dev=\"hd\"/>"),
        )
    };
    let code = "/usr/share/OVMF/OVMF_CODE_4M.fd";
    let vars = "<nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.fd\"/>";
    let loader = |p: &str| format!("<loader readonly=\"yes\" type=\"pflash\">{p}</loader>");
    accepted(&os(&loader(code), vars), &efi, Reading::Plugin);
    let cases = [
        os(&loader("/usr/share/../../etc/shadow"), vars),
        os(&loader("/usr/share/OVMF/../../../etc/shadow"), vars),
        os(&loader("/usr/share//OVMF/OVMF_CODE_4M.fd"), vars),
        os(&loader("/usr/share/OVMF/./OVMF_CODE_4M.fd"), vars),
        os(&loader("/usr/share/OVMF/OVMF_CODE_4M.fd/"), vars),
        os(&loader(" /usr/share/OVMF/OVMF_CODE_4M.fd"), vars),
        os(&loader("/usr/share/evil/OVMF_CODE_4M.fd"), vars),
        os(
            &loader(code),
            "<nvram template=\"/usr/share/../etc/passwd\"/>",
        ),
        os(&loader(code), "<nvram template=\"/etc/passwd\"/>"),
        os(
            &loader(code),
            "<nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.fd\">/etc/passwd</nvram>",
        ),
        os(
            &loader(code),
            "<nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.fd\">/var/lib/libvirt/qemu/nvram/other_VARS.fd</nvram>",
        ),
    ];
    for xml in &cases {
        for reading in [Reading::Plugin, Reading::Libvirt] {
            let (rule, detail) = verdict(xml, &efi, reading).expect_err(xml);
            assert_eq!(rule, "firmware-paths", "{detail}");
            assert!(detail.contains("/domain/os/"), "{detail}");
        }
    }
    // Host-file forms of nvram libvirt also understands are not on the list.
    for (xml, path) in [
        (
            os(
                &loader(code),
                "<nvram type=\"file\"><source file=\"/etc/x\"/></nvram>",
            ),
            "/domain/os/nvram/@type",
        ),
        (
            os(
                &loader(code),
                "<nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.fd\"><source file=\"/etc/x\"/></nvram>",
            ),
            "/domain/os/nvram/source",
        ),
        (
            os(&loader(code), "<kernel>/boot/vmlinuz</kernel>"),
            "/domain/os/kernel",
        ),
        (
            os(
                &loader(code),
                "<acpi><table type=\"slic\">/etc/x</table></acpi>",
            ),
            "/domain/os/acpi",
        ),
    ] {
        let (rule, detail) = verdict(&xml, &efi, Reading::Plugin).expect_err(&xml);
        assert_eq!(rule, "allow-list", "{detail}");
        assert!(detail.contains(path), "{detail}");
    }
    // libvirt's reading names the VM's own store, and only that.
    let own = format!(
        "<nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.fd\">{NVRAM_DIR}/{NAME}_VARS.fd</nvram>"
    );
    accepted(&os(&loader(code), &own), &efi, Reading::Libvirt);
    assert!(verdict(&os(&loader(code), &own), &efi, Reading::Plugin).is_err());
    // Firmware follows the machine type.
    assert_eq!(
        verdict(&base(), &efi, Reading::Plugin).unwrap_err().0,
        "firmware-matches"
    );
    assert_eq!(
        verdict(&os(&loader(code), vars), &input(), Reading::Plugin)
            .unwrap_err()
            .0,
        "firmware-matches"
    );
}

#[test]
fn namespace_uris_are_compared_after_unescaping() {
    // The QEMU namespace spelled with references is still the QEMU namespace to libxml2;
    // outside <metadata> every namespace is refused, however it is spelled.
    let q = "http&#58;//libvirt.org/schemas/domain/qemu/1.0";
    refused(&[
        (
            "namespaces",
            "/domain",
            with(
                "<domain type=\"qemu\">",
                &format!("<domain xmlns:qemu=\"{q}\" type=\"qemu\">"),
            ),
        ),
        (
            "namespaces",
            "/domain/commandline",
            top(&format!(
                "<qemu:commandline xmlns:qemu=\"{q}\"><qemu:arg value=\"-x\"/></qemu:commandline>"
            )),
        ),
        (
            "namespaces",
            "/domain/commandline",
            top("<commandline xmlns=\"http://libvirt.org/schemas/domain/qemu/1.0\"/>"),
        ),
    ]);
    // In metadata, our own namespace spelled with references is ours: a second mark.
    let ns_escaped = METADATA_NS.replace(':', "&#x3a;");
    let forged = mark()
        .replace(METADATA_NS, &ns_escaped)
        .replace("prod-1", "evil");
    refused(&[(
        "metadata-mark",
        "/domain/metadata",
        with("<metadata>", &format!("<metadata>{forged}")),
    )]);
}

#[test]
fn the_mark_is_one_structurally_equal_element() {
    let m = mark();
    let forged = m.replace("office", "other");
    refused(&[
        // In a comment or CDATA it is not a mark (and both are refused in metadata).
        (
            "metadata-mark",
            "/domain/metadata",
            with(&m, &format!("<!--{m}-->")),
        ),
        (
            "no-cdata",
            "/domain/metadata",
            with(&m, &format!("<![CDATA[{m}]]>")),
        ),
        (
            "metadata-mark",
            "/domain/metadata",
            with(&m, &format!("{m}<!-- note -->")),
        ),
        // A forged first mark, or a second one after ours.
        (
            "metadata-mark",
            "/domain/metadata",
            with(&m, &format!("{forged}{m}")),
        ),
        (
            "metadata-mark",
            "/domain/metadata",
            with(&m, &format!("{m}{forged}")),
        ),
        // Changed, missing, moved elsewhere, only mentioned in text.
        ("metadata-mark", "/domain/metadata", with(&m, &forged)),
        ("metadata-mark", "/domain/metadata", with(&m, "")),
        (
            "metadata-mark",
            "/domain/metadata",
            with(&m, &m.replace("<eo:managed>true", "<eo:managed>false")),
        ),
        (
            "metadata-mark",
            "/domain/metadata",
            with(
                &m,
                &m.replace("</eo:instance>", "<eo:extra/></eo:instance>"),
            ),
        ),
        (
            "namespaces",
            "/domain/description",
            with(
                &format!("<metadata>{m}</metadata>"),
                &format!("<metadata/><description>{m}</description>"),
            ),
        ),
        (
            "metadata-mark",
            "/domain/metadata",
            with(
                &format!("<metadata>{m}</metadata>"),
                "<metadata>mark</metadata>",
            ),
        ),
        // Un-namespaced children of metadata.
        (
            "metadata-mark",
            "/domain/metadata/x",
            with(&m, &format!("{m}<x/>")),
        ),
    ]);
    // Re-prefixed, re-indented, with foreign metadata: still the mark.
    let reprefixed = m.replace("eo:", "e2:").replace("xmlns:eo", "xmlns:e2");
    let fine = with(
        &m,
        &format!(
            "<f:site xmlns:f=\"urn:site\"><f:team>net</f:team></f:site>{}",
            reprefixed
        ),
    );
    accepted(&fine, &input(), Reading::Plugin);
    accepted(&with(&m, &reprefixed), &input(), Reading::Libvirt);
}

#[test]
fn host_reaching_features_are_not_on_the_list() {
    let cases: Vec<(&str, String)> = vec![
        (
            "/domain/devices/graphics/@listen",
            device("<graphics type=\"vnc\" listen=\"0.0.0.0\"/>"),
        ),
        (
            "/domain/devices/graphics/listen/@type",
            device(
                "<graphics type=\"vnc\"><listen type=\"address\" address=\"0.0.0.0\"/></graphics>",
            ),
        ),
        (
            "/domain/devices/graphics/listen/@type",
            device(
                "<graphics type=\"spice\"><listen type=\"socket\" socket=\"/tmp/s\"/></graphics>",
            ),
        ),
        (
            "/domain/devices/graphics/@type",
            device("<graphics type=\"dbus\"/>"),
        ),
        (
            "/domain/devices/graphics/@type",
            device(
                "<graphics type=\"egl-headless\"><gl rendernode=\"/dev/dri/renderD128\"/></graphics>",
            ),
        ),
        (
            "/domain/devices/graphics/gl",
            device(
                "<graphics type=\"spice\"><listen type=\"none\"/><gl enable=\"yes\" rendernode=\"/dev/dri/renderD128\"/></graphics>",
            ),
        ),
        (
            "/domain/sysinfo",
            top("<sysinfo type=\"fwcfg\"><entry name=\"opt/x\" file=\"/etc/shadow\"/></sysinfo>"),
        ),
        (
            "/domain/devices/memory",
            device(
                "<memory model=\"nvdimm\"><source><path>/etc/shadow</path></source><target><size unit=\"KiB\">512</size></target></memory>",
            ),
        ),
        (
            "/domain/devices/memory",
            device("<memory model=\"virtio-pmem\"><source><path>/tmp/x</path></source></memory>"),
        ),
        (
            "/domain/devices/interface/rom/@file",
            with(
                "<model type=\"virtio\"/>",
                "<model type=\"virtio\"/><rom file=\"/etc/shadow\"/>",
            ),
        ),
        (
            "/domain/devices/interface/backend",
            with(
                "<model type=\"virtio\"/>",
                "<model type=\"virtio\"/><backend tap=\"/dev/net/tun\" vhost=\"/dev/vhost-net\"/>",
            ),
        ),
        (
            "/domain/devices/interface/target",
            with(
                "<model type=\"virtio\"/>",
                "<model type=\"virtio\"/><target dev=\"eth0\"/>",
            ),
        ),
        (
            "/domain/devices/input/@type",
            device("<input type=\"evdev\"><source dev=\"/dev/input/event0\"/></input>"),
        ),
        (
            "/domain/devices/input/@type",
            device(
                "<input type=\"passthrough\" bus=\"virtio\"><source evdev=\"/dev/input/event1\"/></input>",
            ),
        ),
        (
            "/domain/devices/audio/@type",
            device("<audio id=\"1\" type=\"file\" path=\"/tmp/x.wav\"/>"),
        ),
        ("/domain/devices/sound", device("<sound model=\"ich9\"/>")),
        (
            "/domain/devices/smartcard",
            device("<smartcard mode=\"host\"/>"),
        ),
        (
            "/domain/devices/smartcard",
            device(
                "<smartcard mode=\"passthrough\" type=\"unix\"><source mode=\"connect\" path=\"/run/x\"/></smartcard>",
            ),
        ),
        (
            "/domain/devices/redirdev",
            device(
                "<redirdev bus=\"usb\" type=\"unix\"><source mode=\"connect\" path=\"/run/x\"/></redirdev>",
            ),
        ),
        (
            "/domain/devices/vsock",
            device("<vsock model=\"virtio\"><cid auto=\"yes\"/></vsock>"),
        ),
        (
            "/domain/seclabel/@type",
            top(
                "<seclabel type=\"static\" model=\"dac\" relabel=\"no\"><label>+0:+0</label></seclabel>",
            ),
        ),
        ("/domain/seclabel/@type", top("<seclabel type=\"none\"/>")),
        (
            "/domain/seclabel/@relabel",
            top("<seclabel type=\"dynamic\" model=\"selinux\" relabel=\"no\"/>"),
        ),
        (
            "/domain/seclabel/label",
            top(
                "<seclabel type=\"dynamic\" model=\"selinux\"><label>unconfined_t</label></seclabel>",
            ),
        ),
        (
            "/domain/on_crash",
            with(
                "<on_crash>destroy</on_crash>",
                "<on_crash>coredump-restart</on_crash>",
            ),
        ),
        (
            "/domain/devices/watchdog/@action",
            device("<watchdog model=\"i6300esb\" action=\"dump\"/>"),
        ),
        (
            "/domain/devices/hostdev",
            device("<hostdev mode=\"subsystem\" type=\"pci\"/>"),
        ),
        (
            "/domain/devices/filesystem",
            device(
                "<filesystem type=\"mount\"><source dir=\"/\"/><target dir=\"r\"/></filesystem>",
            ),
        ),
        (
            "/domain/devices/emulator",
            device("<emulator>/bin/sh</emulator>"),
        ),
        ("/domain/devices/shmem", device("<shmem name=\"x\"/>")),
        (
            "/domain/devices/tpm",
            device(
                "<tpm model=\"tpm-tis\"><backend type=\"passthrough\"><device path=\"/dev/tpm0\"/></backend></tpm>",
            ),
        ),
        (
            "/domain/devices/serial[2]/@type",
            device("<serial type=\"file\"><source path=\"/etc/x\"/></serial>"),
        ),
        (
            "/domain/devices/serial[2]/@type",
            device(
                "<serial type=\"tcp\"><source mode=\"bind\" host=\"0.0.0.0\" service=\"4444\"/></serial>",
            ),
        ),
        (
            "/domain/devices/serial/log",
            with(
                "<target port=\"0\"/>",
                "<target port=\"0\"/><log file=\"/var/log/x\"/>",
            ),
        ),
        (
            "/domain/devices/channel/source/@path",
            with(
                "<target type=\"virtio\" name=\"org.qemu.guest_agent.0\"/>",
                "<source mode=\"bind\" path=\"/run/x.sock\"/><target type=\"virtio\" name=\"org.qemu.guest_agent.0\"/>",
            ),
        ),
        (
            "/domain/devices/console/@tty",
            with(
                "<console type=\"pty\">",
                "<console type=\"pty\" tty=\"/dev/pts/1\">",
            ),
        ),
        (
            "/domain/devices/rng/backend/@model",
            with(
                "<backend model=\"random\">/dev/urandom</backend>",
                "<backend model=\"egd\" type=\"unix\"/>",
            ),
        ),
        (
            "/domain/memoryBacking",
            top("<memoryBacking><locked/></memoryBacking>"),
        ),
        (
            "/domain/memoryBacking",
            top("<memoryBacking><hugepages/></memoryBacking>"),
        ),
        (
            "/domain/cputune/vcpusched",
            top("<cputune><vcpusched vcpus=\"0\" scheduler=\"fifo\" priority=\"99\"/></cputune>"),
        ),
        (
            "/domain/cputune/shares",
            top("<cputune><shares>262144</shares></cputune>"),
        ),
        (
            "/domain/maxMemory",
            top("<maxMemory slots=\"16\" unit=\"GiB\">64</maxMemory>"),
        ),
        (
            "/domain/blkiotune",
            top("<blkiotune><weight>1000</weight></blkiotune>"),
        ),
        (
            "/domain/devices/disk/backingStore",
            with(
                "<readonly/>",
                "<readonly/><backingStore type=\"file\"><source file=\"/etc/shadow\"/></backingStore>",
            ),
        ),
        (
            "/domain/devices/disk/@type",
            device("<disk type=\"file\" device=\"disk\"><source file=\"/etc/shadow\"/></disk>"),
        ),
        (
            "/domain/devices/disk/@type",
            device("<disk type=\"block\"><source dev=\"/dev/sda\"/></disk>"),
        ),
        (
            "/domain/devices/disk/@type",
            device("<disk type=\"network\"><source protocol=\"nbd\" name=\"x\"/></disk>"),
        ),
        (
            "/domain/devices/disk/source/@file",
            with(
                &format!("<source pool=\"default\" volume=\"{ROOT}\"/>"),
                &format!("<source pool=\"default\" volume=\"{ROOT}\" file=\"/x\"/>"),
            ),
        ),
        (
            "/domain/devices/interface[2]/@type",
            device("<interface type=\"network\"><source network=\"default\"/></interface>"),
        ),
        (
            "/domain/devices/interface[2]/@type",
            device("<interface type=\"direct\"><source dev=\"eth0\" mode=\"bridge\"/></interface>"),
        ),
        (
            "/domain/devices/interface[2]/@type",
            device("<interface type=\"user\"/>"),
        ),
        (
            "/domain/devices/interface/vlan",
            with(
                "<model type=\"virtio\"/>",
                "<model type=\"virtio\"/><vlan><tag id=\"4\"/></vlan>",
            ),
        ),
        (
            "/domain/os/smbios",
            with(
                "<boot dev=\"hd\"/>",
                "<boot dev=\"hd\"/><smbios mode=\"host\"/>",
            ),
        ),
        (
            "/domain/features/kvm",
            with("<apic/>", "<apic/><kvm><hidden state=\"on\"/></kvm>"),
        ),
        (
            "/domain/features/acpi/table",
            with(
                "<acpi/>",
                "<acpi><table type=\"slic\">/etc/x</table></acpi>",
            ),
        ),
        (
            "/domain/devices/video/model/acceleration",
            device(
                "<video><model type=\"virtio\"><acceleration accel3d=\"yes\" rendernode=\"/dev/dri/renderD128\"/></model></video>",
            ),
        ),
        (
            "/domain/devices/video/driver",
            device("<video><driver name=\"vhostuser\"/><model type=\"virtio\"/></video>"),
        ),
        (
            "/domain/devices/controller/@type",
            device("<controller type=\"ccid\" index=\"0\"/>"),
        ),
        (
            "/domain/devices/panic/@model",
            device("<panic model=\"hyperv\"/>"),
        ),
        (
            "/domain/iothreadids",
            top("<iothreadids><iothread id=\"1\"/></iothreadids>"),
        ),
        ("/domain/keywrap", top("<keywrap/>")),
        (
            "/domain/launchSecurity",
            top("<launchSecurity type=\"sev\"/>"),
        ),
        (
            "/domain/perf",
            top("<perf><event name=\"cmt\" enabled=\"yes\"/></perf>"),
        ),
        ("/domain/idmap", top("<idmap/>")),
        (
            "/domain/bootloader",
            top("<bootloader>/usr/bin/pygrub</bootloader>"),
        ),
        (
            "/domain/devices/nvram",
            device("<nvram><address type=\"spapr-vio\"/></nvram>"),
        ),
        ("/domain/devices/iommu", device("<iommu model=\"intel\"/>")),
        (
            "/domain/devices/lease",
            device("<lease><lockspace>x</lockspace><key>y</key><target path=\"/etc/x\"/></lease>"),
        ),
        ("/domain/devices/hub", device("<hub type=\"usb\"/>")),
        (
            "/domain/devices/crypto",
            device("<crypto model=\"virtio\" type=\"qemu\"><backend model=\"builtin\"/></crypto>"),
        ),
    ];
    for (path, xml) in &cases {
        for reading in [Reading::Plugin, Reading::Libvirt] {
            let (rule, detail) = verdict(xml, &input(), reading).expect_err(xml);
            assert!(
                matches!(
                    rule.as_str(),
                    "allow-list" | "value" | "device-model" | "graphics-no-listener"
                ),
                "{rule}: {detail}"
            );
            assert!(names(&detail, path), "{detail} does not name {path}");
        }
    }
    // A display with no listener at all is what the list allows.
    accepted(
        &device(
            "<graphics type=\"vnc\"><listen type=\"none\"/></graphics><video><model type=\"virtio\"/></video>",
        ),
        &input(),
        Reading::Plugin,
    );
    assert_eq!(
        verdict(
            &device("<graphics type=\"vnc\"/>"),
            &input(),
            Reading::Plugin
        )
        .unwrap_err()
        .0,
        "graphics-no-listener"
    );
}

#[test]
fn the_output_is_tied_to_the_input() {
    refused(&[
        (
            "memory-matches",
            "/domain/memory",
            with(
                "<memory unit=\"MiB\">1024</memory>",
                "<memory unit=\"MiB\">65536</memory>",
            ),
        ),
        (
            "memory-matches",
            "/domain/memory",
            with(
                "<memory unit=\"MiB\">1024</memory>",
                "<memory>1024</memory>",
            ),
        ),
        (
            "memory-matches",
            "/domain/memory",
            with(
                "<memory unit=\"MiB\">1024</memory>",
                "<memory unit=\"MB\">1024</memory>",
            ),
        ),
        (
            "memory-matches",
            "/domain/currentMemory",
            top("<currentMemory unit=\"GiB\">2</currentMemory>"),
        ),
        (
            "required",
            "/domain/memory",
            with("<memory unit=\"MiB\">1024</memory>", ""),
        ),
        (
            "vcpus-match",
            "/domain/vcpu",
            with(
                "<vcpu placement=\"static\">2</vcpu>",
                "<vcpu placement=\"static\">64</vcpu>",
            ),
        ),
        (
            "vcpus-match",
            "/domain/vcpu/@current",
            with(
                "<vcpu placement=\"static\">2</vcpu>",
                "<vcpu placement=\"static\" current=\"1\">2</vcpu>",
            ),
        ),
        (
            "vcpus-match",
            "/domain/cpu/topology",
            top("<cpu mode=\"custom\"><topology sockets=\"1\" cores=\"4\" threads=\"2\"/></cpu>"),
        ),
        (
            "vcpus-match",
            "/domain/cputune/vcpupin[1]",
            top("<cputune><vcpupin vcpu=\"7\" cpuset=\"0\"/></cputune>"),
        ),
        (
            "mac-assigned",
            "/domain/devices/interface[1]/mac",
            with(
                &format!("<mac address=\"{MAC}\"/>"),
                "<mac address=\"52:54:00:00:00:01\"/>",
            ),
        ),
        (
            "mac-assigned",
            "/domain/devices/interface[1]/mac",
            with(&format!("<mac address=\"{MAC}\"/>"), ""),
        ),
        (
            "value",
            "/domain/devices/interface/mac/@address",
            with(
                &format!("<mac address=\"{MAC}\"/>"),
                "<mac address=\"53:54:00:1a:2b:3c\"/>",
            ),
        ),
        (
            "mac-assigned",
            "/domain/devices/interface[2]/mac",
            device(&format!(
                "<interface type=\"bridge\"><source bridge=\"br0\"/><mac address=\"{MAC}\"/></interface>"
            )),
        ),
        (
            "interface-bridge-only",
            "/domain/devices/interface[2]/source",
            device("<interface type=\"bridge\"><source bridge=\"virbr0\"/></interface>"),
        ),
        (
            "required",
            "/domain/devices/interface[2]/source",
            device("<interface type=\"bridge\"/>"),
        ),
        (
            "disk-format",
            "/domain/devices/disk[1]/driver/@type",
            with(
                "<driver name=\"qemu\" type=\"qcow2\" discard=\"unmap\"/>",
                "<driver name=\"qemu\" type=\"raw\"/>",
            ),
        ),
        (
            "disk-format",
            "/domain/devices/disk[2]/driver/@type",
            with(
                "<driver name=\"qemu\" type=\"raw\"/>",
                "<driver name=\"qemu\" type=\"qcow2\"/>",
            ),
        ),
        (
            "disk-format",
            "/domain/devices/disk[1]/driver/@type",
            with(
                "<driver name=\"qemu\" type=\"qcow2\" discard=\"unmap\"/>",
                "<driver name=\"qemu\"/>",
            ),
        ),
        (
            "seed-readonly",
            "/domain/devices/disk[2]",
            with("<readonly/>", ""),
        ),
        (
            "disk-not-prepared",
            "/domain/devices/disk[3]/source",
            device(
                "<disk type=\"volume\"><driver name=\"qemu\" type=\"qcow2\"/><source pool=\"default\" volume=\"egress-other-root\"/></disk>",
            ),
        ),
        (
            "disk-not-prepared",
            "/domain/devices/disk[3]",
            device(&format!(
                "<disk type=\"volume\"><driver name=\"qemu\" type=\"qcow2\"/><source pool=\"default\" volume=\"{ROOT}\"/></disk>"
            )),
        ),
        (
            "disk-not-prepared",
            "/domain/devices/disk[1]/source",
            with(
                &format!("pool=\"default\" volume=\"{ROOT}\""),
                &format!("pool=\"other\" volume=\"{ROOT}\""),
            ),
        ),
        (
            "name-unchanged",
            "/domain/name",
            with(
                &format!("<name>{NAME}</name>"),
                "<name>egress-11111111-2222-4333-8444-555555555555</name>",
            ),
        ),
        (
            "uuid-unchanged",
            "/domain/uuid",
            with(
                &format!("<uuid>{UUID}</uuid>"),
                "<uuid>0b7c3c1e9a434f5ea1d23c4b5a697887</uuid>",
            ),
        ),
        (
            "disk-volume-only",
            "/domain/devices/disk[1]/@type",
            with(
                "<disk type=\"volume\" device=\"disk\">",
                "<disk device=\"disk\">",
            ),
        ),
        (
            "interface-bridge-only",
            "/domain/devices/interface[1]/@type",
            with("<interface type=\"bridge\">", "<interface>"),
        ),
        (
            "arch-matches",
            "/domain/os/type/@arch",
            with("arch=\"x86_64\"", "arch=\"aarch64\""),
        ),
    ]);
    // The seed disk missing altogether.
    let no_seed = {
        let b = base();
        let start = b.find("<disk type=\"volume\" device=\"cdrom\">").unwrap();
        let end = b[start..].find("</disk>").unwrap() + start + "</disk>".len();
        format!("{}{}", &b[..start], &b[end..])
    };
    assert_eq!(
        verdict(&no_seed, &input(), Reading::Plugin).unwrap_err().0,
        "disk-not-prepared"
    );
    // Other units that give the same size are fine.
    accepted(
        &with(
            "<memory unit=\"MiB\">1024</memory>",
            "<memory unit=\"KiB\">1048576</memory>",
        ),
        &input(),
        Reading::Plugin,
    );
    accepted(
        &with(
            "<memory unit=\"MiB\">1024</memory>",
            "<memory>1048576</memory>",
        ),
        &input(),
        Reading::Plugin,
    );
    // libvirt generates the MACs of further NICs.
    let second = device(
        "<interface type=\"bridge\"><source bridge=\"br0\"/><mac address=\"52:54:00:aa:bb:cc\"/><model type=\"virtio\"/></interface>",
    );
    accepted(&second, &input(), Reading::Libvirt);
    assert_eq!(
        verdict(&second, &input(), Reading::Plugin).unwrap_err().0,
        "mac-assigned"
    );
}

#[test]
fn parser_level_tricks_are_refused() {
    let cases: Vec<(&str, String)> = vec![
        ("characters", base().replace("</domain>", "</domain>\0<x/>")),
        (
            "characters",
            with(&format!("<name>{NAME}"), &format!("<name>{NAME}\0")),
        ),
        ("characters", base().replace('\n', "\r\n")),
        ("characters", with("<domain", "\u{feff}<domain")),
        (
            "characters",
            with(&format!("<name>{NAME}"), &format!("<name>{NAME}&#1;")),
        ),
        (
            "characters",
            with(&format!("<name>{NAME}"), &format!("<name>{NAME}&#xFFFE;")),
        ),
        (
            "characters",
            with(&format!("<name>{NAME}"), &format!("<name>{NAME}\u{7}")),
        ),
        (
            "well-formed",
            with(&format!("<name>{NAME}"), &format!("<name>{NAME}&#0;")),
        ),
        (
            "well-formed",
            with(&format!("<name>{NAME}"), &format!("<name>{NAME}&e;")),
        ),
        (
            "no-doctype",
            format!("<!DOCTYPE domain [<!ENTITY e \"x\">]>{}", base()),
        ),
        (
            "no-doctype",
            format!("<!DOCTYPE domain SYSTEM \"file:///etc/passwd\">{}", base()),
        ),
        (
            "xml-declaration",
            format!("<?xml version=\"1.0\" encoding=\"ISO-8859-1\"?>{}", base()),
        ),
        (
            "xml-declaration",
            format!("<?xml version=\"1.0\" encoding=\"UTF-16\"?>{}", base()),
        ),
        (
            "xml-declaration",
            format!("<?xml version=\"1.1\"?>{}", base()),
        ),
        (
            "well-formed",
            format!("<!-- c --><?xml version=\"1.0\"?>{}", base()),
        ),
        (
            "well-formed",
            format!("<?xml-stylesheet href=\"x\"?>{}", base()),
        ),
        ("well-formed", with("<devices>", "<devices><?pi x?>")),
        ("well-formed", with("<devices>", "<devices><!-- a -- b -->")),
        (
            "characters",
            with("<source bridge=\"br0\"/>", "<source bridge=\"br0\n\"/>"),
        ),
        (
            "characters",
            with("<source bridge=\"br0\"/>", "<source bridge=\"br0\t\"/>"),
        ),
        (
            "well-formed",
            with(
                "<source bridge=\"br0\"/>",
                "<source bridge=\"br0\" bridge=\"br1\"/>",
            ),
        ),
        (
            "well-formed",
            with(
                &format!("<name>{NAME}</name>"),
                &format!("<name>{NAME}</nam>"),
            ),
        ),
        ("well-formed", base().replace("</domain>", "")),
        (
            "well-formed",
            with(&format!("<name>{NAME}"), &format!("<name>{NAME}&")),
        ),
        ("one-domain", format!("{}<domain/>", base())),
        ("one-domain", format!("{}text", base())),
        ("one-domain", "<network/>".to_string()),
        ("one-domain", String::new()),
        ("one-domain", "<!-- only a comment -->".to_string()),
        (
            "depth",
            with(
                "<metadata>",
                &format!(
                    "<metadata><f:a xmlns:f=\"urn:f\">{}{}</f:a>",
                    "<f:a>".repeat(MAX_DEPTH),
                    "</f:a>".repeat(MAX_DEPTH)
                ),
            ),
        ),
        (
            "size",
            with(
                "<metadata>",
                &format!(
                    "<metadata>{}",
                    "<f:a xmlns:f=\"urn:f\"/>".repeat(MAX_ELEMENTS)
                ),
            ),
        ),
        (
            "size",
            format!("{}<!--{}-->", base(), "x".repeat(DOMAIN_XML_MAX)),
        ),
        (
            "namespaces",
            with(
                "<metadata>",
                "<metadata><f:a xmlns:f=\"urn:f\"><g:b/></f:a>",
            ),
        ),
    ];
    for (rule, xml) in &cases {
        for reading in [Reading::Plugin, Reading::Libvirt] {
            match verdict(xml, &input(), reading) {
                Ok(()) => panic!("accepted ({reading:?}), expected {rule}: {xml:?}"),
                Err((got, detail)) => assert_eq!(&got, rule, "{detail}: {xml:?}"),
            }
        }
    }
}

#[test]
fn libvirt_only_defaults_are_refused_from_a_plugin() {
    let emulator = device("<emulator>/usr/bin/qemu-system-x86_64</emulator>");
    accepted(&emulator, &input(), Reading::Libvirt);
    assert_eq!(
        verdict(&emulator, &input(), Reading::Plugin).unwrap_err().0,
        "allow-list"
    );
    for bad in [
        "/bin/sh",
        "/usr/bin/qemu-system-x86_64/../../../bin/sh",
        "/tmp/qemu-system-x86_64",
        "/usr/bin/qemu-system-",
    ] {
        let xml = device(&format!("<emulator>{bad}</emulator>"));
        assert_eq!(
            verdict(&xml, &input(), Reading::Libvirt).unwrap_err().0,
            "value",
            "{bad}"
        );
    }
    let resource = top("<resource><partition>/machine</partition></resource>");
    accepted(&resource, &input(), Reading::Libvirt);
    assert!(verdict(&resource, &input(), Reading::Plugin).is_err());
    let elsewhere = top("<resource><partition>/evil</partition></resource>");
    assert!(verdict(&elsewhere, &input(), Reading::Libvirt).is_err());
}

/// `xml` with the NVRAM path libvirt fills in for a domain with a variable-store template.
fn as_libvirt_reads_it(xml: &str) -> String {
    let mut out = xml.to_string();
    for vars in FIRMWARE_VARS.iter().map(|v| v.path) {
        out = out.replace(
            &format!("<nvram template=\"{vars}\"/>"),
            &format!("<nvram template=\"{vars}\">{NVRAM_DIR}/{NAME}_VARS.fd</nvram>"),
        );
    }
    out
}

/// Ordinary documents a site may write: each must pass.
#[test]
fn a_corpus_of_ordinary_documents_stays_accepted() {
    let efi = input_with(Firmware::Efi);
    let bios = input();
    let uefi_loader = "<loader readonly=\"yes\" secure=\"no\" type=\"pflash\">/usr/share/OVMF/OVMF_CODE_4M.fd</loader><nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.fd\"/>";
    let secure = "<loader readonly=\"yes\" secure=\"yes\" type=\"pflash\">/usr/share/OVMF/OVMF_CODE_4M.secboot.fd</loader><nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.ms.fd\"/>";
    let cases: Vec<(String, &DomainInput)> = vec![
        (base(), &bios),
        (
            with(
                "<boot dev=\"hd\"/>",
                &format!("{uefi_loader}<boot dev=\"hd\"/>"),
            ),
            &efi,
        ),
        (
            with("<boot dev=\"hd\"/>", &format!("{secure}<boot dev=\"hd\"/>"))
                .replace("<apic/>", "<apic/><smm state=\"on\"/>"),
            &efi,
        ),
        (
            with(
                "<os>",
                "<os firmware=\"efi\"><firmware><feature enabled=\"yes\" name=\"secure-boot\"/><feature enabled=\"yes\" name=\"enrolled-keys\"/></firmware>",
            ),
            &efi,
        ),
        // Two NICs on the same bridge, the second without a MAC.
        (
            device(
                "<interface type=\"bridge\"><source bridge=\"br0\"/><model type=\"virtio\"/></interface>",
            ),
            &bios,
        ),
        // The seed on virtio (a kernel without AHCI sees it too).
        (
            with(
                "<target dev=\"sda\" bus=\"sata\"/>",
                "<target dev=\"vdb\" bus=\"virtio\"/>",
            )
            .replace("device=\"cdrom\"", "device=\"disk\""),
            &bios,
        ),
        (
            top(
                "<cpu mode=\"host-passthrough\" check=\"none\" migratable=\"on\"><topology sockets=\"1\" dies=\"1\" cores=\"2\" threads=\"1\"/></cpu>",
            ),
            &bios,
        ),
        (
            top(
                "<cpu mode=\"custom\" match=\"exact\" check=\"partial\"><model fallback=\"allow\">Skylake-Client</model><feature policy=\"disable\" name=\"hle\"/></cpu>",
            ),
            &bios,
        ),
        (
            top(
                "<title>office egress</title><description>Proxy for the office.\nOwner: net team.</description><currentMemory unit=\"KiB\">1048576</currentMemory><iothreads>1</iothreads><pm><suspend-to-mem enabled=\"no\"/><suspend-to-disk enabled=\"no\"/></pm><seclabel type=\"dynamic\" model=\"apparmor\" relabel=\"yes\"/>",
            ),
            &bios,
        ),
        (
            with(
                "<clock offset=\"utc\"/>",
                "<clock offset=\"utc\"><timer name=\"rtc\" tickpolicy=\"catchup\"/><timer name=\"pit\" tickpolicy=\"delay\"/><timer name=\"hpet\" present=\"no\"/></clock>",
            ),
            &bios,
        ),
        (
            device(concat!(
                "<!-- guest-visible extras -->\n",
                "<controller type=\"usb\" index=\"0\" model=\"qemu-xhci\" ports=\"15\"><address type=\"pci\" domain=\"0x0000\" bus=\"0x02\" slot=\"0x00\" function=\"0x0\"/></controller>",
                "<controller type=\"pci\" index=\"1\" model=\"pcie-root-port\"><model name=\"pcie-root-port\"/><target chassis=\"1\" port=\"0x10\"/><address type=\"pci\" domain=\"0x0000\" bus=\"0x00\" slot=\"0x02\" function=\"0x0\" multifunction=\"on\"/></controller>",
                "<controller type=\"virtio-serial\" index=\"0\"/>",
                "<input type=\"tablet\" bus=\"usb\"><address type=\"usb\" bus=\"0\" port=\"1\"/></input>",
                "<input type=\"mouse\" bus=\"ps2\"/><input type=\"keyboard\" bus=\"ps2\"/>",
                "<video><model type=\"virtio\" heads=\"1\" primary=\"yes\"/></video>",
                "<graphics type=\"vnc\" port=\"-1\" autoport=\"yes\"><listen type=\"none\"/></graphics>",
                "<watchdog model=\"itco\" action=\"reset\"/>",
                "<audio id=\"1\" type=\"none\"/>",
                "<panic model=\"isa\"><address type=\"isa\" iobase=\"0x505\"/></panic>",
            )),
            &bios,
        ),
        (
            with(
                "<model type=\"virtio\"/>",
                "<model type=\"virtio\"/><driver name=\"vhost\" queues=\"2\"/><link state=\"up\"/><rom bar=\"off\" enabled=\"no\"/><alias name=\"ua-net0\"/>",
            ),
            &bios,
        ),
        (
            with(
                "<driver name=\"qemu\" type=\"qcow2\" discard=\"unmap\"/>",
                "<driver name=\"qemu\" type=\"qcow2\" cache=\"none\" io=\"native\" discard=\"unmap\" detect_zeroes=\"unmap\"/><serial>root</serial><boot order=\"1\"/>",
            ),
            &bios,
        ),
        (
            format!(
                "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<!-- rendered by site plugin -->\n{}",
                base()
            ),
            &bios,
        ),
        (base().replace('"', "'"), &bios),
        (
            with(
                "<memballoon model=\"virtio\"/>",
                "<memballoon model=\"virtio\" autodeflate=\"on\"><stats period=\"10\"/></memballoon>",
            ),
            &bios,
        ),
        (
            with(
                "<backend model=\"random\">/dev/urandom</backend>",
                "<backend model=\"random\">/dev/random</backend>",
            ),
            &bios,
        ),
        (with("<name>", "<!-- identity -->\n  <name>"), &bios),
    ];
    for (xml, input) in &cases {
        accepted(xml, input, Reading::Plugin);
        accepted(&as_libvirt_reads_it(xml), input, Reading::Libvirt);
    }
    // Without an assigned MAC the NICs carry none.
    let mut no_mac = input();
    no_mac.mac = None;
    accepted(
        &with(&format!("<mac address=\"{MAC}\"/>"), ""),
        &no_mac,
        Reading::Plugin,
    );
}

/// libvirt 9.0's reading of the default plugin's output, as captured from the harness's
/// libvirtd: the post-define check must accept it.
#[test]
fn libvirts_reading_of_the_default_output_is_accepted() {
    for (file, firmware) in [
        ("libvirt-inactive-default.xml", Firmware::Bios),
        ("libvirt-inactive-default-uefi.xml", Firmware::Efi),
    ] {
        libvirts_reading_is_accepted(file, firmware);
    }
}

fn libvirts_reading_is_accepted(file: &str, firmware: Firmware) {
    let path = format!(
        "{}/src/templates/testdata/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    let Ok(xml) = std::fs::read_to_string(&path) else {
        panic!("{path} is missing");
    };
    let doc = tree::parse(&xml, tree::Opaque::DomainMetadata).expect("parses");
    let name = doc
        .root
        .child("name")
        .map(|n| n.text.clone())
        .unwrap_or_default();
    let uuid = doc
        .root
        .child("uuid")
        .map(|n| n.text.clone())
        .unwrap_or_default();
    let mut input = input_with(firmware);
    let uid = name.trim_start_matches("egress-").to_string();
    input.name = name.clone();
    input.uuid = uuid;
    for d in &mut input.disks {
        d.volume = d.volume.replace(UUID, &uid);
    }
    let mark = doc
        .root
        .child("metadata")
        .and_then(|m| m.children.first())
        .expect("a mark");
    let field = |n: &str| mark.child(n).map(|c| c.text.clone()).unwrap_or_default();
    let proxy = mark.child("proxy").expect("proxy element");
    input.metadata_mark = MetadataMark {
        cluster_id: field("cluster"),
        cluster_uid: mark.child("clusterUid").map(|c| c.text.clone()),
        namespace: proxy.attr("namespace").unwrap_or_default().into(),
        name: proxy.attr("name").unwrap_or_default().into(),
        uid: proxy.attr("uid").unwrap_or_default().into(),
        created_at: field("createdAt"),
        mac: mark.child("mac").map(|c| c.text.clone()),
        address: mark.child("address").and_then(|c| c.text.parse().ok()),
    }
    .to_xml();
    let nic = doc
        .root
        .child("devices")
        .and_then(|d| d.child("interface"))
        .expect("a NIC");
    input.mac = nic
        .child("mac")
        .and_then(|m| m.attr("address"))
        .map(str::to_string);
    input.bridge = nic
        .child("source")
        .and_then(|s| s.attr("bridge"))
        .unwrap_or_default()
        .into();
    let mem = doc.root.child("memory").expect("memory");
    input.memory_mib = allow::uint(&mem.text).unwrap_or_default() / 1024;
    input.vcpus = doc
        .root
        .child("vcpu")
        .and_then(|v| allow::uint(&v.text))
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or_default();
    let pool = doc
        .root
        .child("devices")
        .and_then(|d| d.child("disk"))
        .and_then(|d| d.child("source"))
        .and_then(|s| s.attr("pool"))
        .unwrap_or_default()
        .to_string();
    for d in &mut input.disks {
        d.pool = pool.clone();
    }
    accepted(&xml, &input, Reading::Libvirt);
    // And it is libvirt's: the plugin could not have written its emulator.
    assert!(verdict(&xml, &input, Reading::Plugin).is_err());
}

#[test]
fn the_sdk_documents_the_rules() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../templates-sdk/src/rules.md");
    let page = rules_markdown();
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(path, &page).expect("write rules.md");
    }
    let doc = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        doc == page,
        "templates-sdk/src/rules.md is stale: run `make generate` \
         (or `egress-operator rules > templates-sdk/src/rules.md`)"
    );
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

#[path = "tests_round2.rs"]
mod round_two;
