//! The rules page for plugin authors (`templates-sdk/src/rules.md`, `egress-operator
//! rules`): every rule a plugin's output is held to, generated from the checker's own
//! tables so it cannot go stale.
//!
//! Each refusal names its rule ([`TemplateErrorKind::InvalidOutput`]) and the page has a
//! section per rule with that name as its anchor, so a refusal leads straight to the text
//! that explains it ([`link`]). Tests keep [`RULES`] and the checker in step both ways:
//! every rule the checker can refuse with is on the page, and nothing on the page is a
//! rule the checker no longer has.
//!
//! [`TemplateErrorKind::InvalidOutput`]: crate::templates::TemplateErrorKind::InvalidOutput

use super::allow::{self, Content, Count, Value};

/// Where the rules page lives in the repository (refusals point at its sections).
pub const PAGE: &str = "templates-sdk/src/rules.md";

/// The reference to rule `rule`'s section of the rules page, for refusals.
pub fn link(rule: &str) -> String {
    format!("{PAGE}#{rule}")
}

/// Which part of the page a rule belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// How domain XML is read (the strict parser).
    Parser,
    /// The allow-list of elements, attributes and values.
    AllowList,
    /// Values tied to the render's input.
    Input,
    /// Firmware files and UEFI.
    Firmware,
    /// What a domain may cost and share on its host.
    Host,
    /// Cloud-init vendor-data.
    VendorData,
    /// A plugin's settings JSON Schema.
    SettingsSchema,
}

impl Section {
    fn title(self) -> &'static str {
        match self {
            Section::Parser => "Reading the domain XML",
            Section::AllowList => "The allow-list",
            Section::Input => "Values tied to the input",
            Section::Firmware => "Firmware",
            Section::Host => "The host",
            Section::VendorData => "Vendor-data",
            Section::SettingsSchema => "The settings schema",
        }
    }
}

/// One rule: its name (what refusals say), its part of the page, and what it asks.
#[derive(Debug, Clone, Copy)]
pub struct RuleDoc {
    /// The name a refusal carries.
    pub name: &'static str,
    /// Its part of the page.
    pub section: Section,
    /// What it asks, for plugin authors (Markdown).
    pub asks: &'static str,
}

const fn rule(name: &'static str, section: Section, asks: &'static str) -> RuleDoc {
    RuleDoc {
        name,
        section,
        asks,
    }
}

/// Every rule a plugin's output or schema can be refused by.
pub const RULES: &[RuleDoc] = &[
    rule(
        "well-formed",
        Section::Parser,
        "The document is well-formed XML 1.0 in UTF-8 as libxml2 reads it: balanced tags, one root, no processing instructions, only the five predefined entities and character references, comments only between elements outside `<metadata>`, no text outside the root.",
    ),
    rule(
        "xml-declaration",
        Section::Parser,
        "An XML declaration, if any, says version `1.0`, encoding UTF-8 (or none) and nothing else: libxml2 honours the encoding it names.",
    ),
    rule(
        "no-doctype",
        Section::Parser,
        "No DOCTYPE: it could define entities or attribute defaults that libvirt would see and we would not.",
    ),
    rule(
        "no-cdata",
        Section::Parser,
        "No CDATA sections; write text with entities instead.",
    ),
    rule(
        "namespaces",
        Section::Parser,
        "No namespace declarations, prefixed elements or prefixed attributes outside `<metadata>`; inside it, every prefix is bound.",
    ),
    rule(
        "characters",
        Section::Parser,
        "No NUL, no control characters but tab and line feed, no carriage return, and no tab or line feed inside attribute values (libxml2 normalises them).",
    ),
    rule(
        "depth",
        Section::Parser,
        "Elements nest at most `MAX_DEPTH` deep.",
    ),
    rule(
        "size",
        Section::Parser,
        "At most `MAX_ELEMENTS` elements and `DOMAIN_XML_MAX` bytes (vendor-data: `VENDOR_DATA_MAX`); values at most `VALUE_MAX` bytes.",
    ),
    rule(
        "text-only",
        Section::Parser,
        "Text only in elements without child elements (libvirt reads an element's text as all the text below it).",
    ),
    rule(
        "one-domain",
        Section::Parser,
        "The root element is one `<domain>`.",
    ),
    rule(
        "allow-list",
        Section::AllowList,
        "Every element path and attribute is on [the table](#the-allow-list); anything else is refused, naming its path.",
    ),
    rule(
        "count",
        Section::AllowList,
        "An element appears at most as often as the table's \"at most\" column says.",
    ),
    rule(
        "singleton",
        Section::AllowList,
        "An element the table allows once appears once: libvirt would read only the first.",
    ),
    rule(
        "value",
        Section::AllowList,
        "Every attribute value and text has the form the table gives (an enumeration, a number, a name, a MAC, ...).",
    ),
    rule(
        "required",
        Section::AllowList,
        "The elements the checks need are present (`<os>`, `<os><type>`, `<devices>`, a disk's `<source>`, ...).",
    ),
    rule(
        "device-model",
        Section::AllowList,
        "Device models come from the safe list (values marked `model:` in the table; see [Device models](#device-models)).",
    ),
    rule(
        "model-implied",
        Section::AllowList,
        "Nothing is left out where libvirt would fill in a legacy model (see [Device models](#device-models)).",
    ),
    rule(
        "name-unchanged",
        Section::Input,
        "`/domain/name` is the input's `name`.",
    ),
    rule(
        "uuid-unchanged",
        Section::Input,
        "`/domain/uuid` is the input's `uuid`.",
    ),
    rule(
        "metadata-mark",
        Section::Input,
        "`<metadata>` carries the input's `metadata-mark` once, structurally unchanged, beside your own elements in your own namespace; no comments inside `<metadata>`.",
    ),
    rule(
        "memory-matches",
        Section::Input,
        "`<memory>` (and `<currentMemory>`) is the input's `memory-mib`, in any unit.",
    ),
    rule(
        "vcpus-match",
        Section::Input,
        "`<vcpu>` is the input's `vcpus`.",
    ),
    rule(
        "arch-matches",
        Section::Input,
        "`/domain/os/type/@arch`, when present, is the input's `host.arch`.",
    ),
    rule(
        "disk-volume-only",
        Section::Input,
        "Every disk is `type=\"volume\"`: libvirt reads a missing type as a host file.",
    ),
    rule(
        "disk-not-prepared",
        Section::Input,
        "Every disk's `<source pool volume>` is one of the input's `disks`, and every disk of the input is attached.",
    ),
    rule(
        "disk-format",
        Section::Input,
        "A disk's `<driver type>` is its volume's `format` from the input, so libvirt never probes the format.",
    ),
    rule(
        "disk-device",
        Section::Input,
        "The root volume is attached as a `disk`, not a `cdrom`.",
    ),
    rule(
        "seed-readonly",
        Section::Input,
        "The seed volume is attached with `<readonly/>`.",
    ),
    rule(
        "interface-bridge-only",
        Section::Input,
        "Every NIC is `type=\"bridge\"` on the input's `bridge`.",
    ),
    rule(
        "mac-assigned",
        Section::Input,
        "When the input has a `mac`, the first NIC carries it; other NICs carry no MAC (libvirt generates theirs).",
    ),
    rule(
        "boot-root-only",
        Section::Input,
        "Only the prepared root disk boots: `<os><boot dev=\"hd\"/>` only, `<boot order=\"1\">` on the root disk only, no boot entry on NICs or the seed, and the root disk is the first disk (in libvirt's reading too).",
    ),
    rule(
        "firmware-matches",
        Section::Firmware,
        "The firmware is the input's `firmware`. UEFI is a `<loader>` or `<os firmware=\"efi\">` (libvirt then picks a firmware itself); BIOS is neither, and no `<nvram>`.",
    ),
    rule(
        "firmware-readonly",
        Section::Firmware,
        "`<loader>` is `readonly=\"yes\" type=\"pflash\"`: the firmware code is the host's, shared by every VM.",
    ),
    rule(
        "firmware-paths",
        Section::Firmware,
        "`<loader>` is a UEFI code file and `<nvram template>` a variable-store template from [the lists](#firmware) (or one the host allows in `nvramTemplates`); `<nvram>` itself is empty, so libvirt makes the VM's own store.",
    ),
    rule(
        "firmware-kind",
        Section::Firmware,
        "Loader, `secure` and NVRAM template are of one kind: `secure=\"yes\"` exactly on Secure Boot builds, the template of the loader's family, and Secure Boot with a template that has keys enrolled.",
    ),
    rule(
        "domain-type",
        Section::Host,
        "`/domain/@type` is `kvm` where the host has KVM, `qemu` only where it has not or the host sets `disableKvm`.",
    ),
    rule(
        "resource-bound",
        Section::Host,
        "Counts and sizes stay within [the bounds tied to the machine type](#bounds-tied-to-the-machine-type).",
    ),
    rule(
        "cpu-placement",
        Section::Host,
        "`cpuset`, `vcpupin`, `emulatorpin` and `numatune` only inside the host's `cpuPlacement`, and never past the host's CPUs or NUMA nodes.",
    ),
    rule(
        "bridge-mtu",
        Section::Host,
        "A NIC `<mtu>` only equal to the host's `bridgeMtu`; none when it is not configured.",
    ),
    rule(
        "rng-rate",
        Section::Host,
        "Every rng has a `<rate>` within the bound in the table above.",
    ),
    rule(
        "nested-virt",
        Section::Host,
        "No `vmx`/`svm` CPU feature asked for: nested virtualisation is a host setting (`kvm_intel nested=0`, `kvm_amd nested=0`).",
    ),
    rule(
        "vpmu",
        Section::Host,
        "`<pmu>` only `state=\"off\"`: the vPMU is a host setting (`kvm enable_pmu=0`).",
    ),
    rule(
        "graphics-no-listener",
        Section::Host,
        "`<graphics>` contains `<listen type=\"none\"/>`: without it QEMU listens on a host socket.",
    ),
    rule(
        "vendor-data-format",
        Section::VendorData,
        "Vendor-data is either plain (first line `#cloud-config`, optionally followed by spaces or tabs; no `mime-version:` in the first 4096 bytes) or MIME `multipart/mixed`; cloud-init decides the form from the bytes, and so do we.",
    ),
    rule(
        "control-character",
        Section::VendorData,
        "No control characters but line feed and tab (and CRLF line ends in the plain form).",
    ),
    rule(
        "mime-multipart",
        Section::VendorData,
        "A MIME document has `MIME-Version: 1.0` in its first 4096 bytes, is `multipart/mixed` (any case) with 1 to `VENDOR_DATA_MAX_PARTS` parts and exact delimiter lines; a preamble and an epilogue are ignored, as cloud-init ignores them.",
    ),
    rule(
        "mime-header",
        Section::VendorData,
        "Top-level headers are from the allow-list (`MIME-Version`, `Content-Type`, ...), each once, folded only right after a `;`.",
    ),
    rule(
        "mime-boundary",
        Section::VendorData,
        "`Content-Type` has one boundary parameter, of safe characters, that occurs nowhere in the parts.",
    ),
    rule(
        "mime-part-header",
        Section::VendorData,
        "Part headers are from the allow-list (`Content-Type`, `Content-Disposition`, `Content-Transfer-Encoding` `7bit`, `8bit`, `base64` or `quoted-printable`, ...), each once, folded only right after a `;`.",
    ),
    rule(
        "mime-part-type",
        Section::VendorData,
        "Each part is `text/x-shellscript` (starting with `#!`) or `text/cloud-config`.",
    ),
    rule(
        "mime-filename",
        Section::VendorData,
        "A shell script part is named (`Content-Disposition: attachment; filename=...`) with a plain file name: cloud-init writes it under that name.",
    ),
    rule(
        "mime-part-ascii",
        Section::VendorData,
        "7bit and 8bit parts are ASCII only: Python's `email` passes other characters differently from us (base64 parts may hold UTF-8).",
    ),
    rule(
        "mime-part-encoding",
        Section::VendorData,
        "A base64 part is strict base64 (standard alphabet, padded), a quoted-printable part uses `=XX` with upper-case hex and soft line breaks only, with no trailing whitespace; either decodes to UTF-8 text.",
    ),
    rule(
        "cloud-config-yaml",
        Section::VendorData,
        "cloud-config parses as YAML to a mapping (or nothing), with no duplicate keys (PyYAML keeps the last silently) no anchors or aliases (PyYAML fails on an anchor defined twice), and no block scalar (`|`, `>`) at the very end without a line break after it (readers disagree on that line break).",
    ),
    rule(
        "cloud-config-pyyaml",
        Section::VendorData,
        "cloud-config is a document PyYAML 6 loads (cloud-init drops a part it cannot load): no tabs outside quoted and block scalars (not as indentation, not after a colon, not in an unquoted value), no `%` directives, one document and no `...` marker, no unquoted `=`, no unquoted text starting with `@`, a backtick, `?` or `:`, none with a `?` or ending in `:` inside `[...]`/`{...}`, keys on one line and at most 1024 characters.",
    ),
    rule(
        "cloud-config-value",
        Section::VendorData,
        "Every unquoted value reads the same by YAML 1.1 (cloud-init's PyYAML) and YAML 1.2: quote `yes`/`no`/`on`/`off`, `0644`, `1:30`, `1e3`, `1_000`, dates and the like, or write `true`, `420`, `1000.0`.",
    ),
    rule(
        "cloud-config-key",
        Section::VendorData,
        "Every key is a string to YAML 1.1 and 1.2 (quote `yes`, `1`, ...); top-level keys are plain identifiers `[a-z_][a-z0-9_]*`.",
    ),
    rule("cloud-config-tag", Section::VendorData, "No YAML tags."),
    rule(
        "cloud-config-merge-key",
        Section::VendorData,
        "No `<<` merge keys (PyYAML merges them and we do not), and no `merge_how`/`merge_type` (they change how cloud-init merges parts).",
    ),
    rule(
        "schema-size",
        Section::SettingsSchema,
        "The settings schema is at most 256 KiB of JSON.",
    ),
    rule(
        "schema-depth",
        Section::SettingsSchema,
        "The schema nests at most 32 arrays/objects.",
    ),
    rule(
        "schema-ref",
        Section::SettingsSchema,
        "Every `$ref` points inside the schema at something that exists; no `$dynamicRef`/`$recursiveRef`, no `$id` below the root, only a well-known `$schema`: nothing is ever fetched.",
    ),
    rule(
        "schema-refs",
        Section::SettingsSchema,
        "At most 256 references.",
    ),
    rule(
        "schema-recursive-ref",
        Section::SettingsSchema,
        "No reference cycle (settings are finite documents).",
    ),
    rule(
        "schema-expansion",
        Section::SettingsSchema,
        "At most 2000 schema nodes with every `$ref` expanded: that is what bounds each evaluation.",
    ),
    rule(
        "schema-pattern",
        Section::SettingsSchema,
        "At most 64 `pattern`/`patternProperties` regexes of at most 1 KiB each, compiling with the linear-time engine (no look-around, no back-references).",
    ),
    rule(
        "schema-time",
        Section::SettingsSchema,
        "Compiling the schema, and evaluating the configured settings against it, each fit their budget (1 s, 0.5 s).",
    ),
];

/// The whole page (Markdown).
pub fn render_markdown() -> String {
    let mut out = String::from(
        "<!-- Generated from operator/src/templates/check (rules.rs and the tables it reads); `make generate` writes it and a test keeps it in step. -->\n\
         Every refusal of a plugin's output names its rule, and each rule has a section \
         below with its name as the anchor (`rules.md#firmware-paths`). Run a plugin \
         through all of them with `egress-operator plugin test`.\n",
    );
    for section in [
        Section::Parser,
        Section::AllowList,
        Section::Input,
        Section::Firmware,
        Section::Host,
        Section::VendorData,
        Section::SettingsSchema,
    ] {
        out.push_str(&format!("\n## {}\n\n", section.title()));
        match section {
            Section::Parser => out.push_str(PARSER_INTRO),
            Section::AllowList => allow_table(&mut out),
            Section::Input => tied_table(&mut out),
            Section::Firmware => firmware_tables(&mut out),
            Section::Host => host_tables(&mut out),
            Section::VendorData => out.push_str(VENDOR_INTRO),
            Section::SettingsSchema => out.push_str(SCHEMA_INTRO),
        }
        for r in RULES.iter().filter(|r| r.section == section) {
            out.push_str(&format!("\n### `{}`\n\n{}\n", r.name, r.asks));
        }
    }
    out
}

const PARSER_INTRO: &str = "Domain XML is read the way libxml2 (and so libvirt) reads it, \
or refused where a Rust reader and libxml2 could disagree. The same checks run again on \
libvirt's own reading of the defined domain before it starts.\n";

const VENDOR_INTRO: &str = "Vendor-data is read the way the guest's cloud-init 22.4 \
(Debian 12) reads it: only a subset of plain `#cloud-config` and MIME multipart on which \
cloud-init's own reading (Python's `email`, PyYAML's YAML 1.1) and ours agree part for part, \
byte for byte and value for value, and nothing cloud-init would drop.\n";

const SCHEMA_INTRO: &str = "A plugin's settings schema is plugin output too: it is refused \
at load unless it is small, shallow, self-contained and cheap to evaluate. Settings that \
do not fit it are reported at their JSON pointer (`validate-config` shows them before a \
rollout).\n";

fn allow_table(out: &mut String) {
    out.push_str(
        "Every element path a plugin may write, how often, with which attributes and \
         content. Elements libvirt itself adds to its reading of a defined domain \
         (`<emulator>`, `<resource>`, generated MACs of further NICs, the NVRAM file) are \
         accepted there only.\n\n\
         | element | at most | attributes | content |\n|---|---|---|---|\n",
    );
    for (path, rule) in allow::RULES {
        if rule.libvirt_only {
            continue;
        }
        let count = match rule.count {
            Count::Single => "1".to_string(),
            Count::Many(n) => n.to_string(),
        };
        let attrs: Vec<String> = rule
            .attrs
            .iter()
            .map(|(n, v)| format!("`{n}` ({})", allow::describe(*v)))
            .collect();
        let content = match rule.content {
            Content::Empty => "empty".to_string(),
            Content::Text(v) => format!("text: {}", allow::describe(v)),
            Content::Elements => "elements".to_string(),
            Content::Metadata => {
                "your elements, in your namespace, and the operator's mark".to_string()
            }
        };
        out.push_str(&format!(
            "| `/{path}` | {count} | {} | {content} |\n",
            if attrs.is_empty() {
                "none".to_string()
            } else {
                attrs.join(", ")
            }
        ));
    }
    out.push_str(
        "\n### Device models\n\n\
         Values marked `model:` above are the list of safe models. virtio comes first; \
         every other model is there for this reason:\n\n\
         | where | model | why |\n|---|---|---|\n",
    );
    for (at, model, why) in super::devices::JUSTIFIED {
        out.push_str(&format!("| `{at}` | `{model}` | {why} |\n"));
    }
    out.push_str(
        "\nWhat a plugin leaves out counts too: libvirt would fill in a legacy model for a \
         NIC without `<model>` (rtl8139), a disk `sdX` without a bus or a SCSI controller \
         without a model (lsilogic), and `<graphics>` or `<video>` without a video model \
         (Cirrus).\n",
    );
}

/// Every value of the allow-list tied to the input, from the table itself.
fn tied_table(out: &mut String) {
    out.push_str(
        "Values that must equal what the render's input (`domain-input` in \
         `templates.wit`) or the host says, each with the rule that checks it. Memory and \
         vCPUs are checked as numbers, see their rules below.\n\n\
         | where | must be | rule |\n|---|---|---|\n",
    );
    for (path, at, tie) in ties() {
        out.push_str(&format!(
            "| `/{path}{at}` | {} | [`{}`](#{}) |\n",
            tie.to, tie.rule, tie.rule
        ));
    }
}

/// `(element path, "" or "/@attribute", tie)` of every tied value in the allow-list.
fn ties() -> Vec<(&'static str, String, allow::Tie)> {
    let mut all = Vec::new();
    for (path, rule) in allow::RULES {
        if let Content::Text(Value::Tied(t)) = rule.content {
            all.push((*path, String::new(), t));
        }
        for (name, v) in rule.attrs {
            if let Value::Tied(t) = v {
                all.push((*path, format!("/@{name}"), *t));
            }
        }
    }
    all
}

fn firmware_tables(out: &mut String) {
    out.push_str(
        "UEFI is either a `<loader>` from the first list (with `<nvram template>` from the \
         second, or none) or `<os firmware=\"efi\">` with no loader, when libvirt picks \
         the firmware from the host's descriptors. `<nvram>` is always empty: libvirt \
         makes the VM's own variable store. A BIOS machine type has neither.\n\n\
         UEFI code (only `readonly=\"yes\" type=\"pflash\"`; `secure=\"yes\"` exactly for \
         Secure Boot builds):\n\n| file | family | Secure Boot build |\n|---|---|---|\n",
    );
    for c in super::domain::FIRMWARE_CODE {
        out.push_str(&format!(
            "| `{}` | {} | {} |\n",
            c.path,
            c.family,
            if c.secure_boot { "yes" } else { "no" }
        ));
    }
    out.push_str(
        "\nVariable-store templates (`<nvram template>`, same family as the code; Secure \
         Boot needs enrolled keys; test keys such as Debian's snakeoil are not on the \
         list, and a host may allow its own in `nvramTemplates`):\n\n\
         | file | family | keys enrolled |\n|---|---|---|\n",
    );
    for v in super::domain::FIRMWARE_VARS {
        out.push_str(&format!(
            "| `{}` | {} | {} |\n",
            v.path,
            v.family,
            if v.enrolled { "yes" } else { "no" }
        ));
    }
}

fn host_tables(out: &mut String) {
    out.push_str(
        "### Bounds tied to the machine type\n\n\
         What a plugin may cost the host. A value outside its bound is refused by the rule \
         `resource-bound` (`cpu-placement` for placement, `rng-rate` for the rng).\n\n\
         | where | bound |\n|---|---|\n",
    );
    for (at, bound) in super::host::BOUNDS {
        out.push_str(&format!("| {at} | {bound} |\n"));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The checker's sources: every rule name it refuses with is a string literal right
    /// after `refuse(` (or a `rule:` field).
    const SOURCES: &[&str] = &[
        include_str!("tree.rs"),
        include_str!("allow.rs"),
        include_str!("domain.rs"),
        include_str!("host.rs"),
        include_str!("devices.rs"),
        include_str!("vendor/mod.rs"),
        include_str!("vendor/mime.rs"),
        include_str!("vendor/yaml.rs"),
        include_str!("vendor/yaml11.rs"),
        include_str!("mod.rs"),
        include_str!("../schema.rs"),
    ];

    fn used_rules() -> BTreeSet<String> {
        let mut used = BTreeSet::new();
        for src in SOURCES {
            // Test modules refuse nothing; their names are expectations.
            let src = src.split("#[cfg(test)]").next().unwrap_or(src);
            for piece in src.split("refuse(").skip(1) {
                let piece = piece.trim_start();
                if let Some(rest) = piece.strip_prefix('"')
                    && let Some((name, _)) = rest.split_once('"')
                {
                    used.insert(name.to_string());
                }
            }
            // Rules picked at run time are listed as `"name" =>` or `=> "name"` arms.
            for line in src.lines() {
                let line = line.trim();
                if let Some(rest) = line.strip_prefix("Scope::")
                    && let Some((_, name)) = rest.split_once("=> \"")
                    && let Some((name, _)) = name.split_once('"')
                    && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
                {
                    used.insert(name.to_string());
                }
            }
        }
        used
    }

    #[test]
    fn every_rule_the_checker_uses_is_on_the_page_and_no_other() {
        let documented: BTreeSet<String> = RULES.iter().map(|r| r.name.to_string()).collect();
        assert_eq!(documented.len(), RULES.len(), "a rule is documented twice");
        let used = used_rules();
        let missing: Vec<&String> = used.difference(&documented).collect();
        assert!(
            missing.is_empty(),
            "rules used but not on the page: {missing:?}"
        );
        // A rule passed through a variable (`device-model` vs `value`, `mime-header`)
        // is still a literal somewhere in the sources.
        let stale: Vec<&String> = documented
            .iter()
            .filter(|r| !SOURCES.iter().any(|s| s.contains(&format!("\"{r}\""))))
            .collect();
        assert!(
            stale.is_empty(),
            "rules on the page the checker never uses: {stale:?}"
        );
        // And every rule a tie names is a rule of the page.
        for (path, at, tie) in ties() {
            assert!(documented.contains(tie.rule), "/{path}{at}: {}", tie.rule);
        }
    }

    #[test]
    fn every_rule_has_its_own_anchor() {
        let page = render_markdown();
        for r in RULES {
            assert!(
                page.contains(&format!("\n### `{}`\n", r.name)),
                "no section for {}",
                r.name
            );
        }
        assert_eq!(
            link("firmware-paths"),
            "templates-sdk/src/rules.md#firmware-paths"
        );
    }

    #[test]
    fn the_input_ties_name_their_fields() {
        let page = render_markdown();
        assert!(
            page.contains("| `/domain/os/loader` | a UEFI code file of the [Firmware](#firmware) list | [`firmware-paths`](#firmware-paths) |"),
            "{page}"
        );
        assert!(
            page.contains("| `/domain/devices/interface/source/@bridge` | the input's `bridge` |")
        );
    }
}
