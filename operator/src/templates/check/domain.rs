//! Domain XML against the allow-list and against the input it was rendered from.

use super::allow::{self, Content, Count, Reading, Rule, TABLE};
use super::policy::HostPolicy;
use super::tree::{self, Node};
use super::{devices, host, refuse, show};
use crate::templates::errors::TemplateErrorKind;
use crate::templates::{DiskRole, DomainInput, Firmware};

/// A UEFI code image on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirmwareCode {
    /// Exact path (compared exactly: no prefix match, so no `..` or symlink games).
    pub path: &'static str,
    /// Which flash layout it has; its variable store must come from the same family.
    pub family: &'static str,
    /// A Secure Boot build (needs SMM and `secure="yes"`).
    pub secure_boot: bool,
}

/// A UEFI variable-store template on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirmwareVars {
    /// Exact path.
    pub path: &'static str,
    /// Flash layout; matches [`FirmwareCode::family`].
    pub family: &'static str,
    /// The OS vendors' keys (Microsoft's, which shim is signed with) are enrolled.
    pub enrolled: bool,
}

const fn code(path: &'static str, family: &'static str, secure_boot: bool) -> FirmwareCode {
    FirmwareCode {
        path,
        family,
        secure_boot,
    }
}
const fn vars(path: &'static str, family: &'static str, enrolled: bool) -> FirmwareVars {
    FirmwareVars {
        path,
        family,
        enrolled,
    }
}

/// UEFI code images on the distributions we support (Debian/Ubuntu `ovmf`, Fedora/RHEL
/// `edk2-ovmf`). Adding one is a reviewed change. Debian's `*.snakeoil.fd` builds are not
/// here: they trust a test key whose private half ships with Debian.
pub const FIRMWARE_CODE: &[FirmwareCode] = &[
    code("/usr/share/OVMF/OVMF_CODE_4M.fd", "debian-4m", false),
    code("/usr/share/OVMF/OVMF_CODE_4M.ms.fd", "debian-4m", true),
    code("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd", "debian-4m", true),
    code("/usr/share/OVMF/OVMF_CODE.fd", "debian-2m", false),
    code("/usr/share/OVMF/OVMF_CODE.ms.fd", "debian-2m", true),
    code("/usr/share/OVMF/OVMF_CODE.secboot.fd", "debian-2m", true),
    code("/usr/share/edk2/ovmf/OVMF_CODE.fd", "fedora-2m", false),
    code(
        "/usr/share/edk2/ovmf/OVMF_CODE.secboot.fd",
        "fedora-2m",
        true,
    ),
    code(
        "/usr/share/edk2/ovmf/OVMF_CODE_4M.qcow2",
        "fedora-4m",
        false,
    ),
    code(
        "/usr/share/edk2/ovmf/OVMF_CODE_4M.secboot.qcow2",
        "fedora-4m",
        true,
    ),
];
/// UEFI variable-store templates that go with [`FIRMWARE_CODE`]: empty stores and stores
/// with the OS vendors' keys. Test keys (Debian's `OVMF_VARS*.snakeoil.fd`, whose private
/// key is public) are excluded; a host may allow a site's own in `nvramTemplates`.
pub const FIRMWARE_VARS: &[FirmwareVars] = &[
    vars("/usr/share/OVMF/OVMF_VARS_4M.fd", "debian-4m", false),
    vars("/usr/share/OVMF/OVMF_VARS_4M.ms.fd", "debian-4m", true),
    vars("/usr/share/OVMF/OVMF_VARS.fd", "debian-2m", false),
    vars("/usr/share/OVMF/OVMF_VARS.ms.fd", "debian-2m", true),
    vars("/usr/share/edk2/ovmf/OVMF_VARS.fd", "fedora-2m", false),
    vars(
        "/usr/share/edk2/ovmf/OVMF_VARS.secboot.fd",
        "fedora-2m",
        true,
    ),
    vars(
        "/usr/share/edk2/ovmf/OVMF_VARS_4M.qcow2",
        "fedora-4m",
        false,
    ),
    vars(
        "/usr/share/edk2/ovmf/OVMF_VARS_4M.secboot.qcow2",
        "fedora-4m",
        true,
    ),
];

fn firmware_code(path: &str) -> Option<FirmwareCode> {
    FIRMWARE_CODE.iter().copied().find(|c| c.path == path)
}
fn firmware_vars(path: &str) -> Option<FirmwareVars> {
    FIRMWARE_VARS.iter().copied().find(|v| v.path == path)
}
/// Where libvirt's QEMU driver puts a domain's NVRAM when the XML names none
/// (`nvram_dir` default); libvirt's reading must show exactly `<dir>/<name>_VARS.fd`.
pub const NVRAM_DIR: &str = "/var/lib/libvirt/qemu/nvram";

/// Checks a parsed domain against the allow-list and the input.
pub fn check(
    doc: &tree::Document,
    input: &DomainInput,
    policy: &HostPolicy,
    reading: Reading,
) -> Result<(), TemplateErrorKind> {
    let root = &doc.root;
    if root.name != "domain" || root.ns.is_some() {
        return Err(refuse(
            "one-domain",
            format!("root element is <{}>, not <domain>", root.name),
        ));
    }
    let rule = TABLE
        .get("domain")
        .copied()
        .ok_or_else(|| refuse("allow-list", "no rule for /domain"))?;
    walk(root, "domain", "/domain", &rule, reading)?;
    tie(root, input, policy, reading)?;
    host::check(root, input, policy)?;
    devices::check(required(root, "devices", "/domain")?, input)
}

/// Applies the allow-list to `node` (at table key `key`, shown as `shown`) and below.
fn walk(
    node: &Node,
    key: &str,
    shown: &str,
    rule: &Rule,
    reading: Reading,
) -> Result<(), TemplateErrorKind> {
    if rule.libvirt_only && reading == Reading::Plugin {
        return Err(refuse(
            "allow-list",
            format!("{shown} is filled in by libvirt; a plugin may not write it"),
        ));
    }
    for a in &node.attrs {
        let Some((_, form)) = rule.attrs.iter().find(|(n, _)| *n == a.name) else {
            return Err(refuse(
                "allow-list",
                format!("{shown}/@{} is not on the allow-list", a.name),
            ));
        };
        if !allow::value_ok(*form, &a.value) {
            return Err(refuse(
                if matches!(form, allow::Value::Model(_)) {
                    "device-model"
                } else {
                    "value"
                },
                format!(
                    "{shown}/@{} is {}, not an allowed value; {}",
                    a.name,
                    show(&a.value),
                    allow::expected(*form)
                ),
            ));
        }
    }
    match rule.content {
        Content::Metadata => Ok(()),
        Content::Empty | Content::Text(_) if !node.children.is_empty() => {
            let child = &node.children[0].name;
            Err(refuse(
                if matches!(rule.content, Content::Text(_)) && !tree::is_blank(&node.text) {
                    "text-only"
                } else {
                    "allow-list"
                },
                format!("{shown}/{child} is not on the allow-list ({shown} holds no elements)"),
            ))
        }
        Content::Empty => {
            if tree::is_blank(&node.text) {
                Ok(())
            } else {
                Err(refuse("value", format!("{shown} must be empty")))
            }
        }
        Content::Text(form) => {
            if allow::value_ok(form, &node.text) {
                Ok(())
            } else {
                Err(refuse(
                    "value",
                    format!(
                        "{shown} holds {}, not an allowed value; {}",
                        show(&node.text),
                        allow::expected(form)
                    ),
                ))
            }
        }
        Content::Elements => {
            if !tree::is_blank(&node.text) {
                return Err(refuse(
                    "text-only",
                    format!("{shown} may hold only elements, not text"),
                ));
            }
            let mut seen: Vec<(&str, usize)> = Vec::new();
            for child in &node.children {
                let child_key = format!("{key}/{}", child.name);
                let Some(child_rule) = TABLE.get(child_key.as_str()) else {
                    return Err(refuse(
                        "allow-list",
                        format!("{shown}/{} is not on the allow-list", child.name),
                    ));
                };
                let n = match seen.iter_mut().find(|(name, _)| *name == child.name) {
                    Some((_, n)) => {
                        *n += 1;
                        *n
                    }
                    None => {
                        seen.push((&child.name, 1));
                        1
                    }
                };
                let child_shown = match child_rule.count {
                    Count::Single if n > 1 => {
                        return Err(refuse(
                            "singleton",
                            format!(
                                "{shown}/{} appears more than once (libvirt reads only the first)",
                                child.name
                            ),
                        ));
                    }
                    Count::Single => format!("{shown}/{}", child.name),
                    Count::Many(max) if n > max => {
                        return Err(refuse(
                            "count",
                            format!("{shown}/{} appears more than {max} times", child.name),
                        ));
                    }
                    Count::Many(_) => format!("{shown}/{}[{n}]", child.name),
                };
                walk(child, &child_key, &child_shown, child_rule, reading)?;
            }
            Ok(())
        }
    }
}

/// The one text of a required singleton.
fn required<'a>(parent: &'a Node, name: &str, at: &str) -> Result<&'a Node, TemplateErrorKind> {
    parent
        .child(name)
        .ok_or_else(|| refuse("required", format!("{at}/{name} is missing")))
}

/// Memory in bytes from a `<memory>`-like element (unit defaults to KiB, as in libvirt).
fn memory_bytes(node: &Node, at: &str) -> Result<u64, TemplateErrorKind> {
    let unit = node.attr("unit").unwrap_or("KiB");
    let factor = allow::MEMORY_UNITS
        .iter()
        .find(|(u, _)| *u == unit)
        .map(|(_, f)| *f)
        .ok_or_else(|| refuse("value", format!("{at}/@unit {} is unknown", show(unit))))?;
    allow::uint(&node.text)
        .and_then(|n| n.checked_mul(factor))
        .ok_or_else(|| refuse("value", format!("{at} {} is not a size", show(&node.text))))
}

fn tie(
    root: &Node,
    input: &DomainInput,
    policy: &HostPolicy,
    reading: Reading,
) -> Result<(), TemplateErrorKind> {
    // Identity: libvirt keys the domain by these; a plugin must not redirect the define to
    // another Proxy's domain.
    let name = required(root, "name", "/domain")?;
    if name.text != input.name {
        return Err(refuse(
            "name-unchanged",
            format!(
                "/domain/name is {}, expected {}",
                show(&name.text),
                show(&input.name)
            ),
        ));
    }
    let uuid = required(root, "uuid", "/domain")?;
    if !is_canonical_uuid(&uuid.text) || !uuid.text.eq_ignore_ascii_case(&input.uuid) {
        return Err(refuse(
            "uuid-unchanged",
            format!(
                "/domain/uuid is {}, expected {}",
                show(&uuid.text),
                show(&input.uuid)
            ),
        ));
    }
    check_mark(required(root, "metadata", "/domain")?, &input.metadata_mark)?;

    // Sizes the machine type pays for.
    let want = input.memory_mib.saturating_mul(1 << 20);
    for el in ["memory", "currentMemory"] {
        let at = format!("/domain/{el}");
        let node = if el == "memory" {
            Some(required(root, el, "/domain")?)
        } else {
            root.child(el)
        };
        if let Some(node) = node {
            let got = memory_bytes(node, &at)?;
            if got != want {
                return Err(refuse(
                    "memory-matches",
                    format!(
                        "{at} is {got} bytes; the machine type gives {} MiB ({want} bytes)",
                        input.memory_mib
                    ),
                ));
            }
        }
    }
    let vcpu = required(root, "vcpu", "/domain")?;
    let vcpus = u64::from(input.vcpus);
    if allow::uint(&vcpu.text) != Some(vcpus) {
        return Err(refuse(
            "vcpus-match",
            format!(
                "/domain/vcpu is {}; the machine type gives {vcpus}",
                show(&vcpu.text)
            ),
        ));
    }
    if let Some(current) = vcpu.attr("current")
        && allow::uint(current) != Some(vcpus)
    {
        return Err(refuse(
            "vcpus-match",
            format!(
                "/domain/vcpu/@current is {}; expected {vcpus}",
                show(current)
            ),
        ));
    }
    if let Some(cputune) = root.child("cputune") {
        for (i, pin) in cputune.children_named("vcpupin").enumerate() {
            let n = pin.attr("vcpu").and_then(allow::uint);
            if n.is_none_or(|n| n >= vcpus) {
                return Err(refuse(
                    "vcpus-match",
                    format!(
                        "/domain/cputune/vcpupin[{}] pins vCPU {:?}, the domain has {vcpus}",
                        i + 1,
                        pin.attr("vcpu")
                    ),
                ));
            }
        }
    }
    if let Some(topology) = root.child("cpu").and_then(|c| c.child("topology")) {
        let mut product: u64 = 1;
        for a in &topology.attrs {
            product = product.saturating_mul(allow::uint(&a.value).unwrap_or(u64::MAX));
        }
        if product != vcpus {
            return Err(refuse(
                "vcpus-match",
                format!("/domain/cpu/topology gives {product} vCPUs; expected {vcpus}"),
            ));
        }
    }

    tie_os(root, input, policy, reading)?;
    let devices = required(root, "devices", "/domain")?;
    tie_disks(devices, input)?;
    tie_interfaces(devices, input, reading)?;
    if let Some(g) = devices.child("graphics")
        && g.child("listen").and_then(|l| l.attr("type")) != Some("none")
    {
        return Err(refuse(
            "graphics-no-listener",
            "/domain/devices/graphics must contain <listen type=\"none\"/>: without it QEMU listens on a host socket",
        ));
    }
    Ok(())
}

fn is_canonical_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

fn tie_os(
    root: &Node,
    input: &DomainInput,
    policy: &HostPolicy,
    reading: Reading,
) -> Result<(), TemplateErrorKind> {
    let os = required(root, "os", "/domain")?;
    let ty = required(os, "type", "/domain/os")?;
    if let Some(arch) = ty.attr("arch")
        && arch != input.host.arch
    {
        return Err(refuse(
            "arch-matches",
            format!(
                "/domain/os/type/@arch is {}; the host runs {}",
                show(arch),
                show(&input.host.arch)
            ),
        ));
    }
    let loader = os.child("loader");
    let nvram = os.child("nvram");
    let auto_efi = os.attr("firmware") == Some("efi");
    let secure = loader.and_then(|l| l.attr("secure")) == Some("yes")
        || os.child("firmware").is_some_and(|f| {
            f.children_named("feature")
                .any(|x| x.attr("name") == Some("secure-boot") && x.attr("enabled") == Some("yes"))
        });
    let code = match loader {
        Some(l) => {
            if l.attr("readonly") != Some("yes") || l.attr("type") != Some("pflash") {
                return Err(refuse(
                    "firmware-readonly",
                    "/domain/os/loader must be readonly=\"yes\" type=\"pflash\": the firmware code is the host's, shared by every VM",
                ));
            }
            let Some(code) = firmware_code(&l.text) else {
                return Err(refuse(
                    "firmware-paths",
                    format!(
                        "/domain/os/loader {} is not a known UEFI code file (the Firmware section of the rules page lists them)",
                        show(&l.text)
                    ),
                ));
            };
            if code.secure_boot != (l.attr("secure") == Some("yes")) {
                return Err(refuse(
                    "firmware-kind",
                    format!(
                        "/domain/os/loader {} is {} build; secure=\"{}\" must say so (a Secure Boot build without SMM protection lets the guest write its variables)",
                        show(&l.text),
                        if code.secure_boot {
                            "a Secure Boot"
                        } else {
                            "a plain"
                        },
                        if code.secure_boot { "yes" } else { "no" }
                    ),
                ));
            }
            Some(code)
        }
        None => None,
    };
    if let Some(n) = nvram {
        if let Some(t) = n.attr("template") {
            let site = policy.nvram_templates.iter().any(|s| s == t);
            match (firmware_vars(t), code) {
                _ if site => {}
                (None, _) => {
                    return Err(refuse(
                        "firmware-paths",
                        format!(
                            "/domain/os/nvram/@template {} is not a known variable-store template (test keys such as snakeoil are not; a host may allow its own in nvramTemplates)",
                            show(t)
                        ),
                    ));
                }
                (Some(vars), Some(code)) if vars.family != code.family => {
                    return Err(refuse(
                        "firmware-kind",
                        format!(
                            "/domain/os/nvram/@template {} does not go with the loader {}",
                            show(t),
                            show(code.path)
                        ),
                    ));
                }
                (Some(vars), _) if secure && !vars.enrolled => {
                    return Err(refuse(
                        "firmware-kind",
                        format!(
                            "/domain/os/nvram/@template {} has no keys enrolled; Secure Boot needs a template with the vendor's keys",
                            show(t)
                        ),
                    ));
                }
                _ => {}
            }
        }
        let ok = match reading {
            // libvirt creates the VM's own store; a plugin naming a host file is refused.
            Reading::Plugin => n.text.is_empty(),
            Reading::Libvirt => n.text == format!("{NVRAM_DIR}/{}_VARS.fd", input.name),
        };
        if !ok {
            return Err(refuse(
                "firmware-paths",
                format!(
                    "/domain/os/nvram names {}; {}",
                    show(&n.text),
                    match reading {
                        Reading::Plugin =>
                            "leave it empty and libvirt creates the VM's own NVRAM".to_string(),
                        Reading::Libvirt =>
                            format!("libvirt's own store is {NVRAM_DIR}/{}_VARS.fd", input.name),
                    }
                ),
            ));
        }
    }
    let efi = auto_efi || loader.is_some();
    match input.firmware {
        Firmware::Efi if !efi => Err(refuse(
            "firmware-matches",
            "the machine type asks for UEFI: /domain/os needs a <loader> or firmware=\"efi\"",
        )),
        Firmware::Bios if efi || nvram.is_some() => Err(refuse(
            "firmware-matches",
            "the machine type asks for BIOS: /domain/os may not carry a loader, NVRAM or firmware=\"efi\"",
        )),
        _ => Ok(()),
    }
}

fn tie_disks(devices: &Node, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    let mut used = vec![false; input.disks.len()];
    for (i, disk) in devices.children_named("disk").enumerate() {
        let at = format!("/domain/devices/disk[{}]", i + 1);
        // libvirt defaults a missing type to "file" and would ignore pool and volume.
        if disk.attr("type") != Some("volume") {
            return Err(refuse(
                "disk-volume-only",
                format!(
                    "{at}/@type must be \"volume\" (libvirt reads a missing type as a host file)"
                ),
            ));
        }
        let source = required(disk, "source", &at)?;
        let (pool, volume) = (
            source.attr("pool").unwrap_or_default(),
            source.attr("volume").unwrap_or_default(),
        );
        let Some(k) = input
            .disks
            .iter()
            .position(|d| d.pool == pool && d.volume == volume)
        else {
            return Err(refuse(
                "disk-not-prepared",
                format!(
                    "{at}/source references pool {} volume {}, which the operator did not prepare",
                    show(pool),
                    show(volume)
                ),
            ));
        };
        if std::mem::replace(&mut used[k], true) {
            return Err(refuse(
                "disk-not-prepared",
                format!("{at} attaches volume {} a second time", show(volume)),
            ));
        }
        let prepared = &input.disks[k];
        let format = disk.child("driver").and_then(|d| d.attr("type"));
        if format != Some(prepared.format.as_str()) {
            return Err(refuse(
                "disk-format",
                format!(
                    "{at}/driver/@type is {}; volume {} is {} (libvirt must not probe the format)",
                    format.map_or("missing".to_string(), show),
                    show(volume),
                    show(&prepared.format)
                ),
            ));
        }
        if prepared.role == DiskRole::Seed && disk.child("readonly").is_none() {
            return Err(refuse(
                "seed-readonly",
                format!("{at} attaches the seed volume without <readonly/>"),
            ));
        }
        if prepared.role == DiskRole::Root && disk.attr("device") == Some("cdrom") {
            return Err(refuse(
                "disk-device",
                format!("{at} attaches the root volume as a cdrom"),
            ));
        }
    }
    if let Some(k) = used.iter().position(|u| !u) {
        return Err(refuse(
            "disk-not-prepared",
            format!(
                "volume {} that the operator prepared is not attached",
                show(&input.disks[k].volume)
            ),
        ));
    }
    Ok(())
}

fn tie_interfaces(
    devices: &Node,
    input: &DomainInput,
    reading: Reading,
) -> Result<(), TemplateErrorKind> {
    let assigned = match input.mac.as_deref() {
        Some(m) => Some(allow::mac(m).ok_or_else(|| {
            refuse(
                "mac-assigned",
                format!("the input MAC {} is invalid", show(m)),
            )
        })?),
        None => None,
    };
    let mut seen: Vec<[u8; 6]> = Vec::new();
    let mut count = 0usize;
    for (i, nic) in devices.children_named("interface").enumerate() {
        count += 1;
        let at = format!("/domain/devices/interface[{}]", i + 1);
        if nic.attr("type") != Some("bridge") {
            return Err(refuse(
                "interface-bridge-only",
                format!("{at}/@type must be \"bridge\""),
            ));
        }
        let bridge = required(nic, "source", &at)?.attr("bridge");
        if bridge != Some(input.bridge.as_str()) {
            return Err(refuse(
                "interface-bridge-only",
                format!(
                    "{at}/source uses bridge {}; only {} is allowed",
                    bridge.map_or("none".to_string(), show),
                    show(&input.bridge)
                ),
            ));
        }
        let mac = nic
            .child("mac")
            .and_then(|m| m.attr("address"))
            .map(|m| allow::mac(m).ok_or_else(|| refuse("value", format!("{at}/mac is invalid"))))
            .transpose()?;
        match (i, assigned, mac) {
            // The primary NIC carries the operator's MAC: addresses are matched by it.
            (0, Some(want), got) if got != Some(want) => {
                return Err(refuse(
                    "mac-assigned",
                    format!(
                        "{at}/mac must be the assigned {}",
                        show(input.mac.as_deref().unwrap_or_default())
                    ),
                ));
            }
            (0, Some(_), _) => {}
            // Any other MAC a plugin writes could be another VM's on the same bridge;
            // libvirt generates one when none is given.
            (0, None, Some(_)) if reading == Reading::Plugin => {
                return Err(refuse(
                    "mac-assigned",
                    format!(
                        "{at}/mac is set; only the operator assigns the first NIC's MAC \
                         address: leave <mac> out"
                    ),
                ));
            }
            (_, _, Some(_)) if reading == Reading::Plugin => {
                return Err(refuse(
                    "mac-assigned",
                    format!(
                        "{at}/mac is set; libvirt makes a unique MAC address for every NIC \
                         after the first: leave <mac> out"
                    ),
                ));
            }
            _ => {}
        }
        if let Some(m) = mac {
            if seen.contains(&m) {
                return Err(refuse(
                    "mac-assigned",
                    format!("{at}/mac repeats another NIC's address"),
                ));
            }
            seen.push(m);
        }
    }
    if assigned.is_some() && count == 0 {
        return Err(refuse(
            "mac-assigned",
            "/domain/devices has no <interface> for the assigned MAC",
        ));
    }
    Ok(())
}

/// The mark: exactly one child of `/domain/metadata` in the mark's namespace, equal to the
/// input's mark as a tree (namespace URIs and local names, attributes, leaf text; prefixes
/// and white space between elements may differ, as libvirt reserialises it).
fn check_mark(metadata: &Node, mark: &str) -> Result<(), TemplateErrorKind> {
    let want = tree::parse(mark, tree::Opaque::Fragment)
        .map_err(|e| {
            refuse(
                "metadata-mark",
                format!("the input mark does not parse: {e}"),
            )
        })?
        .root;
    let Some(ns) = want.ns.as_deref() else {
        return Err(refuse("metadata-mark", "the input mark has no namespace"));
    };
    let mut ours = Vec::new();
    for (i, child) in metadata.children.iter().enumerate() {
        match child.ns.as_deref() {
            None => {
                return Err(refuse(
                    "metadata-mark",
                    format!(
                        "/domain/metadata/{}[{}] has no namespace; metadata elements need one",
                        child.name,
                        i + 1
                    ),
                ));
            }
            Some(n) if n == ns => ours.push(child),
            Some(_) => {}
        }
    }
    match ours.as_slice() {
        [only] if same_tree(only, &want) => Ok(()),
        [_] => Err(refuse(
            "metadata-mark",
            "/domain/metadata carries a changed copy of the operator's mark",
        )),
        [] => Err(refuse(
            "metadata-mark",
            "/domain/metadata does not carry the operator's mark",
        )),
        _ => Err(refuse(
            "metadata-mark",
            "/domain/metadata has more than one element in the operator's namespace (libvirt would read the first)",
        )),
    }
}

fn same_tree(a: &Node, b: &Node) -> bool {
    let attrs_equal = a.attrs.len() == b.attrs.len() && a.attrs.iter().all(|x| b.attrs.contains(x));
    a.name == b.name
        && a.ns == b.ns
        && attrs_equal
        && a.children.len() == b.children.len()
        && a.children
            .iter()
            .zip(&b.children)
            .all(|(x, y)| same_tree(x, y))
        && (!a.children.is_empty() || a.text == b.text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::templates::check::allow::Value;

    #[test]
    fn every_path_has_its_parent_on_the_list() {
        for path in TABLE.keys() {
            if let Some((parent, _)) = path.rsplit_once('/') {
                let rule = TABLE
                    .get(parent)
                    .unwrap_or_else(|| panic!("{path} has no parent rule"));
                assert_eq!(
                    rule.content,
                    Content::Elements,
                    "{path}'s parent holds no elements"
                );
            }
        }
    }

    #[test]
    fn tied_values_are_all_checked() {
        // Every Tied value in the table is one of these, each with a tie above.
        let tied: Vec<String> = TABLE
            .iter()
            .flat_map(|(p, r)| {
                let mut v: Vec<String> = r
                    .attrs
                    .iter()
                    .filter(|(_, f)| matches!(f, Value::Tied(_)))
                    .map(|(n, _)| format!("{p}/@{n}"))
                    .collect();
                if matches!(r.content, Content::Text(Value::Tied(_))) {
                    v.push((*p).to_string());
                }
                v
            })
            .collect();
        let mut expected = vec![
            "domain/name",
            "domain/uuid",
            "domain/os/type/@arch",
            "domain/os/loader",
            "domain/os/nvram",
            "domain/os/nvram/@template",
            "domain/devices/disk/driver/@type",
            "domain/devices/disk/source/@pool",
            "domain/devices/disk/source/@volume",
            "domain/devices/interface/source/@bridge",
        ];
        expected.sort_unstable();
        let mut tied: Vec<&str> = tied.iter().map(String::as_str).collect();
        tied.sort_unstable();
        assert_eq!(tied, expected);
    }
}
