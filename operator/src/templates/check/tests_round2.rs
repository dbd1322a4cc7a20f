//! Round two: what the allow-list *accepts* may still cost the host, boot something else,
//! touch what tenants share or pick weak models. One table per class; each case is
//! refused by its rule, naming its path, in the plugin's output and in libvirt's reading
//! (the same document: libvirt's reading is held to the same rules). Several forms each:
//! the explicit value, the implied default, a second place libvirt reads, and extreme
//! numbers.

use super::*;

const BIG: &str = "4294967295";

fn efi() -> DomainInput {
    input_with(Firmware::Efi)
}

fn kvm() -> DomainInput {
    let mut i = input();
    i.host.kvm = true;
    i
}

fn policy(mtu: Option<u32>, cpus: Option<&str>, nodes: Option<&str>) -> HostPolicy {
    HostPolicy {
        bridge_mtu: mtu,
        cpu_placement: cpus.map(|c| CpuPlacement {
            cpus: CpuSet::parse(c).unwrap(),
            nodes: nodes.map(|n| CpuSet::parse(n).unwrap()),
        }),
        nvram_templates: Vec::new(),
        host_size: None,
    }
}

fn verdict_on(
    xml: &str,
    input: &DomainInput,
    policy: &HostPolicy,
    reading: Reading,
) -> Result<(), (String, String)> {
    let r = match reading {
        Reading::Plugin => check_domain_xml_on(xml, input, policy),
        Reading::Libvirt => check_defined_domain_xml_on(xml, input, policy),
    };
    r.map_err(|e| match e {
        TemplateErrorKind::InvalidOutput { rule, detail } => (rule.to_string(), detail),
        other => panic!("unexpected error kind {other}"),
    })
}

/// Each case refused by `rule` naming `path`, in both readings, for `input` on a host
/// with `policy`.
fn refused_on(cases: &[(&str, &str, String)], input: &DomainInput, policy: &HostPolicy) {
    for (rule, path, xml) in cases {
        let xml = if input.firmware == Firmware::Efi {
            as_libvirt_reads_it(xml)
        } else {
            xml.clone()
        };
        for reading in [Reading::Plugin, Reading::Libvirt] {
            // The plugin never writes libvirt's NVRAM path; libvirt always does.
            let doc = if reading == Reading::Plugin {
                plugin_form(&xml)
            } else {
                xml.clone()
            };
            match verdict_on(&doc, input, policy, reading) {
                Ok(()) => panic!("accepted ({reading:?}), expected {rule}:\n{doc}"),
                Err((got, detail)) => {
                    assert_eq!(&got, rule, "({reading:?}) {detail}\n{doc}");
                    assert!(
                        names(&detail, path),
                        "({reading:?}) detail {detail:?} does not name {path:?}"
                    );
                }
            }
        }
    }
}

fn accepted_on(xml: &str, input: &DomainInput, policy: &HostPolicy) {
    let libvirt = as_libvirt_reads_it(xml);
    for (doc, reading) in [(xml, Reading::Plugin), (libvirt.as_str(), Reading::Libvirt)] {
        if let Err((rule, detail)) = verdict_on(doc, input, policy, reading) {
            panic!("refused ({reading:?}) by {rule}: {detail}\n{doc}");
        }
    }
}

/// `xml` without the NVRAM path libvirt fills in.
fn plugin_form(xml: &str) -> String {
    let path = format!("{NVRAM_DIR}/{NAME}_VARS.fd");
    let mut out = xml.to_string();
    while let Some(i) = out.find(&format!("\">{path}</nvram>")) {
        out.replace_range(i..i + path.len() + 10, "\"/>");
    }
    out
}

fn nic_extra(extra: &str) -> String {
    with(
        "<model type=\"virtio\"/>",
        &format!("<model type=\"virtio\"/>{extra}"),
    )
}

fn uefi(loader: &str, nvram: &str) -> String {
    with(
        "<boot dev=\"hd\"/>",
        &format!("{loader}{nvram}<boot dev=\"hd\"/>"),
    )
    .replace("<apic/>", "<apic/><smm state=\"on\"/>")
}

#[test]
fn resources_are_bounded_by_the_machine_type() {
    let cases = [
        (
            "resource-bound",
            "/domain/iothreads",
            top("<iothreads>3</iothreads>"),
        ),
        (
            "resource-bound",
            "/domain/iothreads",
            top(&format!("<iothreads>{BIG}</iothreads>")),
        ),
        // Past u64: not even a number as libvirt reads it.
        (
            "value",
            "/domain/iothreads",
            top("<iothreads>18446744073709551616</iothreads>"),
        ),
        (
            "resource-bound",
            "/domain/devices/interface[1]/driver/@queues",
            nic_extra("<driver name=\"vhost\" queues=\"3\"/>"),
        ),
        (
            "resource-bound",
            "/domain/devices/interface[1]/driver/@queues",
            nic_extra(&format!("<driver name=\"vhost\" queues=\"{BIG}\"/>")),
        ),
        (
            "resource-bound",
            "/domain/devices/interface[1]/driver/@queues",
            nic_extra("<driver name=\"vhost\" queues=\"0\"/>"),
        ),
        (
            "resource-bound",
            "/domain/devices/interface[1]/driver/@rx_queue_size",
            nic_extra("<driver name=\"vhost\" rx_queue_size=\"4096\"/>"),
        ),
        (
            "resource-bound",
            "/domain/devices/interface[1]/driver/@tx_queue_size",
            nic_extra(&format!("<driver name=\"vhost\" tx_queue_size=\"{BIG}\"/>")),
        ),
        // A second NIC: the bound holds on every one.
        (
            "resource-bound",
            "/domain/devices/interface[2]/driver/@queues",
            device(
                "<interface type=\"bridge\"><source bridge=\"br0\"/><model type=\"virtio\"/><driver queues=\"64\"/></interface>",
            ),
        ),
        (
            "resource-bound",
            "/domain/devices/disk[1]/driver/@queues",
            with("discard=\"unmap\"/>", "discard=\"unmap\" queues=\"64\"/>"),
        ),
        (
            "resource-bound",
            "/domain/devices/controller[1]/@ports",
            device(&format!(
                "<controller type=\"virtio-serial\" index=\"0\" ports=\"{BIG}\"/>"
            )),
        ),
        (
            "resource-bound",
            "/domain/devices/controller[1]/@vectors",
            device("<controller type=\"virtio-serial\" index=\"0\" vectors=\"4096\"/>"),
        ),
        (
            "resource-bound",
            "/domain/devices/controller[1]/driver/@queues",
            device(
                "<controller type=\"scsi\" index=\"0\" model=\"virtio-scsi\"><driver queues=\"16\"/></controller>",
            ),
        ),
        (
            "resource-bound",
            "/domain/devices/video[1]/model/@vram",
            device(&format!(
                "<video><model type=\"vga\" vram=\"{BIG}\"/></video>"
            )),
        ),
        (
            "resource-bound",
            "/domain/devices/video[1]/model/@ram",
            device("<video><model type=\"vga\" ram=\"65536\"/></video>"),
        ),
        (
            "resource-bound",
            "/domain/devices/video[1]/model/@vgamem",
            device("<video><model type=\"virtio\" vgamem=\"1048576\"/></video>"),
        ),
        (
            "resource-bound",
            "/domain/devices/video[1]/model/@heads",
            device(&format!(
                "<video><model type=\"virtio\" heads=\"{BIG}\"/></video>"
            )),
        ),
        (
            "resource-bound",
            "/domain/devices/video[1]/model/@heads",
            device("<video><model type=\"virtio\" heads=\"2\"/></video>"),
        ),
        // Several video devices: gigabytes outside <memory> one by one.
        (
            "singleton",
            "/domain/devices/video",
            device("<video><model type=\"virtio\"/></video><video><model type=\"vga\"/></video>"),
        ),
        // The TCG translation cache is not a plugin's to size.
        (
            "allow-list",
            "/domain/features/tcg",
            with(
                "<apic/>",
                "<apic/><tcg><tb-cache unit=\"GiB\">64</tb-cache></tcg>",
            ),
        ),
    ];
    let cases: Vec<(&str, &str, String)> = cases.into_iter().collect();
    refused_on(&cases, &input(), &HostPolicy::default());
    // At the bound they pass.
    accepted_on(
        &top("<iothreads>2</iothreads>").replace(
            "<model type=\"virtio\"/>",
            "<model type=\"virtio\"/><driver name=\"vhost\" queues=\"2\" rx_queue_size=\"1024\"/>",
        ),
        &input(),
        &HostPolicy::default(),
    );
    accepted_on(
        &device("<video><model type=\"vga\" vram=\"16384\" heads=\"1\" primary=\"yes\"/></video>"),
        &input(),
        &HostPolicy::default(),
    );
}

#[test]
fn cpu_and_numa_placement_only_inside_the_hosts_cpuset() {
    let vcpu = "<vcpu placement=\"static\">2</vcpu>";
    let cpuset = |s: &str| {
        with(
            vcpu,
            &format!("<vcpu placement=\"static\" cpuset=\"{s}\">2</vcpu>"),
        )
    };
    let pins = |a: &str, b: &str| {
        top(&format!(
            "<cputune><vcpupin vcpu=\"0\" cpuset=\"{a}\"/><vcpupin vcpu=\"1\" cpuset=\"{b}\"/></cputune>"
        ))
    };
    let emu = |s: &str| top(&format!("<cputune><emulatorpin cpuset=\"{s}\"/></cputune>"));
    let numa = |s: &str| {
        top(&format!(
            "<numatune><memory mode=\"strict\" nodeset=\"{s}\"/></numatune>"
        ))
    };
    // No placement configured: none at all.
    let unset = HostPolicy::default();
    refused_on(
        &[
            ("cpu-placement", "/domain/vcpu/@cpuset", cpuset("0-1")),
            (
                "cpu-placement",
                "/domain/cputune/vcpupin[1]/@cpuset",
                pins("2", "3"),
            ),
            (
                "cpu-placement",
                "/domain/cputune/emulatorpin/@cpuset",
                emu("0"),
            ),
            (
                "cpu-placement",
                "/domain/numatune/memory/@nodeset",
                numa("0"),
            ),
            ("cpu-placement", "/domain/numatune", top("<numatune/>")),
        ],
        &input(),
        &unset,
    );
    // The host owns CPUs 4-7 and node 1.
    let owned = policy(None, Some("4-7"), Some("1"));
    refused_on(
        &[
            ("cpu-placement", "/domain/vcpu/@cpuset", cpuset("3-4")),
            (
                "cpu-placement",
                "/domain/vcpu/@cpuset",
                cpuset("0-4294967295"),
            ),
            ("cpu-placement", "/domain/vcpu/@cpuset", cpuset(BIG)),
            (
                "cpu-placement",
                "/domain/cputune/vcpupin[2]/@cpuset",
                pins("4", "0"),
            ),
            (
                "cpu-placement",
                "/domain/cputune/emulatorpin/@cpuset",
                emu("0-7"),
            ),
            (
                "cpu-placement",
                "/domain/numatune/memory/@nodeset",
                numa("0"),
            ),
            (
                "cpu-placement",
                "/domain/numatune/memory/@nodeset",
                numa("0-1"),
            ),
        ],
        &input(),
        &owned,
    );
    for ok in [cpuset("4-7,^5"), pins("4", "5"), emu("6-7"), numa("1")] {
        accepted_on(&ok, &input(), &owned);
    }
    // Without nodes, no memory binding even with CPUs.
    refused_on(
        &[(
            "cpu-placement",
            "/domain/numatune/memory/@nodeset",
            numa("1"),
        )],
        &input(),
        &policy(None, Some("4-7"), None),
    );
    // A placement written for bigger hosts, on a host with 6 CPUs and one NUMA node: a
    // CPU or node the host does not have is refused before define, not at start.
    let small = HostPolicy {
        host_size: Some(HostSize {
            cpus: 6,
            numa_nodes: 1,
        }),
        ..owned.clone()
    };
    refused_on(
        &[
            ("cpu-placement", "/domain/vcpu/@cpuset", cpuset("4-7")),
            (
                "cpu-placement",
                "/domain/cputune/vcpupin[2]/@cpuset",
                pins("4", "6"),
            ),
            (
                "cpu-placement",
                "/domain/cputune/emulatorpin/@cpuset",
                emu("7"),
            ),
            (
                "cpu-placement",
                "/domain/numatune/memory/@nodeset",
                numa("1"),
            ),
        ],
        &input(),
        &small,
    );
    for ok in [cpuset("4-5"), pins("4", "5"), emu("5")] {
        accepted_on(&ok, &input(), &small);
    }
    let detail = verdict_on(&cpuset("4-7"), &input(), &small, Reading::Plugin)
        .unwrap_err()
        .1;
    assert!(
        detail.contains("the host has 6 CPUs (numbered 0 to 5)"),
        "{detail}"
    );
}

#[test]
fn only_the_prepared_root_disk_boots() {
    let seed_disk_first = {
        let b = base();
        let seed_start = b.find("<disk type=\"volume\" device=\"cdrom\">").unwrap();
        let seed_end = seed_start + b[seed_start..].find("</disk>").unwrap() + "</disk>".len();
        let seed = b[seed_start..seed_end]
            .replace("device=\"cdrom\"", "device=\"disk\"")
            .replace(
                "<target dev=\"sda\" bus=\"sata\"/>",
                "<target dev=\"vdb\" bus=\"virtio\"/>",
            );
        let rest = format!("{}{}", &b[..seed_start], &b[seed_end..]);
        let root_start = rest.find("<disk type=\"volume\" device=\"disk\">").unwrap();
        format!("{}{seed}{}", &rest[..root_start], &rest[root_start..])
    };
    refused_on(
        &[
            (
                "value",
                "/domain/os/boot/@dev",
                with("<boot dev=\"hd\"/>", "<boot dev=\"network\"/>"),
            ),
            (
                "value",
                "/domain/os/boot/@dev",
                with("<boot dev=\"hd\"/>", "<boot dev=\"cdrom\"/>"),
            ),
            // A second boot entry: libvirt reads them all, in order.
            (
                "singleton",
                "/domain/os/boot",
                with(
                    "<boot dev=\"hd\"/>",
                    "<boot dev=\"hd\"/><boot dev=\"network\"/>",
                ),
            ),
            (
                "allow-list",
                "/domain/devices/interface/boot",
                nic_extra("<boot order=\"1\"/>"),
            ),
            (
                "value",
                "/domain/devices/interface/rom/@enabled",
                nic_extra("<rom enabled=\"yes\"/>"),
            ),
            (
                "value",
                "/domain/os/bootmenu/@enable",
                with(
                    "<boot dev=\"hd\"/>",
                    "<boot dev=\"hd\"/><bootmenu enable=\"yes\"/>",
                ),
            ),
            (
                "boot-root-only",
                "/domain/devices/disk[2]/boot",
                with("<readonly/>", "<readonly/><boot order=\"1\"/>"),
            ),
            (
                "boot-root-only",
                "/domain/devices/disk[1]/boot/@order",
                with(
                    "discard=\"unmap\"/>",
                    "discard=\"unmap\"/><boot order=\"2\"/>",
                ),
            ),
            ("boot-root-only", "/domain/devices/disk[1]", seed_disk_first),
        ],
        &input(),
        &HostPolicy::default(),
    );
}

#[test]
fn nic_mtu_only_repeats_the_bridges() {
    let mtu = |n: &str| nic_extra(&format!("<mtu size=\"{n}\"/>"));
    let at = "/domain/devices/interface[1]/mtu/@size";
    refused_on(
        &[("bridge-mtu", at, mtu("1500"))],
        &input(),
        &HostPolicy::default(),
    );
    let host = policy(Some(1500), None, None);
    refused_on(
        &[
            ("bridge-mtu", at, mtu("1400")),
            ("bridge-mtu", at, mtu("68")),
            ("bridge-mtu", at, mtu("9000")),
            ("bridge-mtu", at, mtu(BIG)),
            (
                "bridge-mtu",
                "/domain/devices/interface[2]/mtu/@size",
                device(
                    "<interface type=\"bridge\"><source bridge=\"br0\"/><model type=\"virtio\"/><mtu size=\"576\"/></interface>",
                ),
            ),
        ],
        &input(),
        &host,
    );
    accepted_on(&mtu("1500"), &input(), &host);
}

#[test]
fn firmware_is_read_only_of_its_kind_with_trusted_keys() {
    let plain = "/usr/share/OVMF/OVMF_CODE_4M.fd";
    let secboot = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd";
    let loader = |attrs: &str, path: &str| format!("<loader {attrs}>{path}</loader>");
    let tmpl = |t: &str| format!("<nvram template=\"{t}\"/>");
    let empty4m = tmpl("/usr/share/OVMF/OVMF_VARS_4M.fd");
    let ms4m = tmpl("/usr/share/OVMF/OVMF_VARS_4M.ms.fd");
    let ro = "readonly=\"yes\" type=\"pflash\"";
    let cases = [
        // The host's firmware opened writable: readonly missing, or said otherwise.
        (
            "firmware-readonly",
            "/domain/os/loader",
            uefi(&loader("type=\"pflash\" secure=\"no\"", plain), &empty4m),
        ),
        (
            "firmware-readonly",
            "/domain/os/loader",
            uefi(&loader("secure=\"no\"", plain), &empty4m),
        ),
        (
            "value",
            "/domain/os/loader/@readonly",
            uefi(&loader("readonly=\"no\" type=\"pflash\"", plain), &empty4m),
        ),
        (
            "value",
            "/domain/os/loader/@type",
            uefi(&loader("readonly=\"yes\" type=\"rom\"", plain), &empty4m),
        ),
        // Test keys: Debian's snakeoil code and variable stores.
        (
            "firmware-paths",
            "/domain/os/loader",
            uefi(
                &loader(
                    &format!("{ro} secure=\"yes\""),
                    "/usr/share/OVMF/OVMF_CODE_4M.snakeoil.fd",
                ),
                &ms4m,
            ),
        ),
        (
            "firmware-paths",
            "/domain/os/nvram/@template",
            uefi(
                &loader(&format!("{ro} secure=\"yes\""), secboot),
                &tmpl("/usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd"),
            ),
        ),
        // Without a loader, libvirt picks the code; the template is still checked.
        (
            "firmware-paths",
            "/domain/os/nvram/@template",
            with(
                "<boot dev=\"hd\"/>",
                &format!(
                    "{}<boot dev=\"hd\"/>",
                    tmpl("/usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd")
                ),
            )
            .replace("<os>", "<os firmware=\"efi\">"),
        ),
        // Kinds that do not go together.
        (
            "firmware-kind",
            "/domain/os/loader",
            uefi(&loader(&format!("{ro} secure=\"no\""), secboot), &ms4m),
        ),
        (
            "firmware-kind",
            "/domain/os/loader",
            uefi(&loader(ro, secboot), &ms4m),
        ),
        (
            "firmware-kind",
            "/domain/os/loader",
            uefi(&loader(&format!("{ro} secure=\"yes\""), plain), &ms4m),
        ),
        (
            "firmware-kind",
            "/domain/os/nvram/@template",
            uefi(&loader(&format!("{ro} secure=\"yes\""), secboot), &empty4m),
        ),
        (
            "firmware-kind",
            "/domain/os/nvram/@template",
            uefi(
                &loader(&format!("{ro} secure=\"no\""), plain),
                &tmpl("/usr/share/OVMF/OVMF_VARS.fd"),
            ),
        ),
    ];
    let cases: Vec<(&str, &str, String)> = cases.into_iter().collect();
    refused_on(&cases, &efi(), &HostPolicy::default());
    // A site's own template, allowed by the host.
    let own = "/etc/egress/OVMF_VARS_site.fd";
    let xml = uefi(
        &loader(&format!("{ro} secure=\"yes\""), secboot),
        &tmpl(own),
    );
    refused_on(
        &[("firmware-paths", "/domain/os/nvram/@template", xml.clone())],
        &efi(),
        &HostPolicy::default(),
    );
    let site = HostPolicy {
        nvram_templates: vec![own.into()],
        ..HostPolicy::default()
    };
    let libvirt = xml.replace(
        &tmpl(own),
        &format!("<nvram template=\"{own}\">{NVRAM_DIR}/{NAME}_VARS.fd</nvram>"),
    );
    assert!(verdict_on(&xml, &efi(), &site, Reading::Plugin).is_ok());
    assert!(verdict_on(&libvirt, &efi(), &site, Reading::Libvirt).is_ok());
    accepted_on(
        &uefi(&loader(&format!("{ro} secure=\"yes\""), secboot), &ms4m),
        &efi(),
        &HostPolicy::default(),
    );
}

#[test]
fn the_domain_type_follows_the_host() {
    refused_on(
        &[("domain-type", "/domain/@type", base())],
        &kvm(),
        &HostPolicy::default(),
    );
    refused_on(
        &[(
            "domain-type",
            "/domain/@type",
            with("<domain type=\"qemu\">", "<domain type=\"kvm\">"),
        )],
        &input(),
        &HostPolicy::default(),
    );
    accepted_on(
        &with("<domain type=\"qemu\">", "<domain type=\"kvm\">"),
        &kvm(),
        &HostPolicy::default(),
    );
}

#[test]
fn device_models_come_from_the_safe_list_written_or_implied() {
    let model = |m: &str| {
        with(
            "<model type=\"virtio\"/>",
            &format!("<model type=\"{m}\"/>"),
        )
    };
    let seed_target = "<target dev=\"sda\" bus=\"sata\"/>";
    let cases = [
        (
            "device-model",
            "/domain/devices/interface/model/@type",
            model("rtl8139"),
        ),
        (
            "device-model",
            "/domain/devices/interface/model/@type",
            model("e1000"),
        ),
        (
            "device-model",
            "/domain/devices/interface/model/@type",
            model("e1000e"),
        ),
        // Implied: libvirt's QEMU driver makes a NIC without a model an rtl8139.
        (
            "model-implied",
            "/domain/devices/interface[1]/model",
            with("<model type=\"virtio\"/>", ""),
        ),
        (
            "model-implied",
            "/domain/devices/interface[2]/model",
            device("<interface type=\"bridge\"><source bridge=\"br0\"/></interface>"),
        ),
        // sdX without a bus: SCSI with an lsilogic controller.
        (
            "model-implied",
            "/domain/devices/disk[2]/target",
            with(seed_target, "<target dev=\"sda\"/>"),
        ),
        (
            "model-implied",
            "/domain/devices/disk[2]/target",
            with(seed_target, "<target dev=\"sda\" bus=\"scsi\"/>"),
        ),
        (
            "model-implied",
            "/domain/devices/controller[1]",
            with(seed_target, "<target dev=\"sda\" bus=\"scsi\"/>").replace(
                "</devices>",
                "<controller type=\"scsi\" index=\"0\"/></devices>",
            ),
        ),
        // As libvirt writes the default out.
        (
            "device-model",
            "/domain/devices/controller[1]/@model",
            with(seed_target, "<target dev=\"sda\" bus=\"scsi\"/>").replace(
                "</devices>",
                "<controller type=\"scsi\" index=\"0\" model=\"lsilogic\"/></devices>",
            ),
        ),
        (
            "device-model",
            "/domain/devices/controller[1]/@model",
            device("<controller type=\"scsi\" index=\"0\" model=\"am53c974\"/>"),
        ),
        (
            "device-model",
            "/domain/devices/controller",
            device("<controller type=\"usb\" index=\"0\" model=\"ich9-ehci1\"/>"),
        ),
        (
            "device-model",
            "/domain/devices/disk/target/@bus",
            with(seed_target, "<target dev=\"hda\" bus=\"ide\"/>"),
        ),
        (
            "device-model",
            "/domain/devices/disk[2]/target",
            with(seed_target, "<target dev=\"hda\"/>"),
        ),
        // Graphics without video, video without a model: Cirrus.
        (
            "model-implied",
            "/domain/devices/graphics",
            device(
                "<graphics type=\"vnc\" port=\"-1\" autoport=\"yes\"><listen type=\"none\"/></graphics>",
            ),
        ),
        (
            "model-implied",
            "/domain/devices/video[1]/model",
            device("<video/>"),
        ),
        (
            "device-model",
            "/domain/devices/video/model/@type",
            device(
                "<video><model type=\"cirrus\" vram=\"16384\" heads=\"1\" primary=\"yes\"/></video>",
            ),
        ),
        (
            "device-model",
            "/domain/devices/video/model/@type",
            device("<video><model type=\"qxl\"/></video>"),
        ),
        (
            "device-model",
            "/domain/devices/watchdog/@model",
            device("<watchdog model=\"ib700\" action=\"reset\"/>"),
        ),
    ];
    let cases: Vec<(&str, &str, String)> = cases.into_iter().collect();
    refused_on(&cases, &input(), &HostPolicy::default());
    // virtio-scsi on a written controller is fine.
    accepted_on(
        &with(seed_target, "<target dev=\"sda\" bus=\"scsi\"/>").replace(
            "</devices>",
            "<controller type=\"scsi\" index=\"0\" model=\"virtio-scsi\"/></devices>",
        ),
        &input(),
        &HostPolicy::default(),
    );
}

#[test]
fn disk_cache_and_rng_sources_are_safe_and_rate_limited() {
    let rate = "<rate period=\"1000\" bytes=\"1024\"/>";
    let cases = [
        (
            "value",
            "/domain/devices/disk/driver/@cache",
            with(
                "discard=\"unmap\"/>",
                "cache=\"unsafe\" discard=\"unmap\"/>",
            ),
        ),
        ("rng-rate", "/domain/devices/rng/rate", with(rate, "")),
        (
            "rng-rate",
            "/domain/devices/rng/rate",
            with(rate, &format!("<rate period=\"1000\" bytes=\"{BIG}\"/>")),
        ),
        (
            "rng-rate",
            "/domain/devices/rng/rate",
            with(rate, "<rate period=\"1\" bytes=\"1\"/>"),
        ),
        (
            "rng-rate",
            "/domain/devices/rng/rate",
            with(rate, "<rate period=\"1000\" bytes=\"0\"/>"),
        ),
        (
            "rng-rate",
            "/domain/devices/rng/rate",
            with(rate, "<rate bytes=\"131072\"/>"),
        ),
        (
            "rng-rate",
            "/domain/devices/rng/rate",
            with(rate, "<rate period=\"1000\"/>"),
        ),
        (
            "value",
            "/domain/devices/rng/backend",
            with("/dev/urandom</backend>", "/dev/hwrng</backend>"),
        ),
        (
            "value",
            "/domain/devices/rng/backend/@model",
            with(
                "<backend model=\"random\">/dev/urandom</backend>",
                "<backend model=\"egd\" type=\"tcp\"/>",
            ),
        ),
    ];
    let cases: Vec<(&str, &str, String)> = cases.into_iter().collect();
    refused_on(&cases, &input(), &HostPolicy::default());
    for ok in [
        "<rate bytes=\"65536\"/>",
        "<rate period=\"2000\" bytes=\"131072\"/>",
    ] {
        accepted_on(&with(rate, ok), &input(), &HostPolicy::default());
    }
}

#[test]
fn nested_virtualisation_and_the_vpmu_are_not_for_plugins() {
    let cpu = |f: &str| {
        top(&format!(
            "<cpu mode=\"host-passthrough\" check=\"none\">{f}</cpu>"
        ))
    };
    refused_on(
        &[
            (
                "nested-virt",
                "/domain/cpu/feature[1]",
                cpu("<feature policy=\"require\" name=\"vmx\"/>"),
            ),
            (
                "nested-virt",
                "/domain/cpu/feature[1]",
                cpu("<feature name=\"svm\"/>"),
            ),
            (
                "nested-virt",
                "/domain/cpu/feature[2]",
                cpu(
                    "<feature policy=\"disable\" name=\"hle\"/><feature policy=\"force\" name=\"vmx\"/>",
                ),
            ),
            (
                "vpmu",
                "/domain/features/pmu",
                with("<apic/>", "<apic/><pmu state=\"on\"/>"),
            ),
        ],
        &input(),
        &HostPolicy::default(),
    );
    // Turning them off is fine.
    accepted_on(
        &cpu(
            "<feature policy=\"disable\" name=\"vmx\"/><feature policy=\"disable\" name=\"svm\"/>",
        )
        .replace("<apic/>", "<apic/><pmu state=\"off\"/>"),
        &input(),
        &HostPolicy::default(),
    );
}

/// The ordinary documents of the issue, each accepted in both readings.
#[test]
fn an_ordinary_corpus_stays_accepted_under_round_two() {
    let secure = "<loader readonly=\"yes\" secure=\"yes\" type=\"pflash\">/usr/share/OVMF/OVMF_CODE_4M.secboot.fd</loader><nvram template=\"/usr/share/OVMF/OVMF_VARS_4M.ms.fd\"/>";
    let none = HostPolicy::default();
    let cases: Vec<(String, DomainInput, HostPolicy)> = vec![
        // 2 vCPUs with topology.
        (
            top("<cpu mode=\"custom\" match=\"exact\"><model fallback=\"forbid\">qemu64</model><topology sockets=\"1\" dies=\"1\" cores=\"2\" threads=\"1\"/></cpu>"),
            input(),
            none.clone(),
        ),
        // UEFI with Secure Boot on a UEFI machine type.
        (uefi(secure, ""), efi(), none.clone()),
        // A second NIC on the bridge.
        (
            device("<interface type=\"bridge\"><source bridge=\"br0\"/><model type=\"virtio\"/></interface>"),
            input(),
            none.clone(),
        ),
        // Virtio everything.
        (
            with("<target dev=\"sda\" bus=\"sata\"/>", "<target dev=\"vdb\" bus=\"virtio\"/>")
                .replace("device=\"cdrom\"", "device=\"disk\"")
                .replace(
                    "</devices>",
                    "<controller type=\"virtio-serial\" index=\"0\"/><controller type=\"scsi\" index=\"0\" model=\"virtio-scsi\"/><input type=\"keyboard\" bus=\"virtio\"/><video><model type=\"virtio\" heads=\"1\" primary=\"yes\"/></video><graphics type=\"vnc\" port=\"-1\" autoport=\"yes\"><listen type=\"none\"/></graphics><panic model=\"pvpanic\"/></devices>",
                ),
            input(),
            none.clone(),
        ),
        // A serial console (the base has one) with a virtio console too.
        (
            device("<console type=\"pty\"><target type=\"virtio\" port=\"1\"/></console>"),
            input(),
            none.clone(),
        ),
        // A rate-limited rng from /dev/random.
        (
            with("/dev/urandom</backend>", "/dev/random</backend>"),
            input(),
            none.clone(),
        ),
        // A watchdog.
        (
            device("<watchdog model=\"i6300esb\" action=\"reset\"/>"),
            input(),
            none.clone(),
        ),
        // On KVM with pinning and an MTU the host allows.
        (
            with("<domain type=\"qemu\">", "<domain type=\"kvm\">")
                .replace(
                    "<vcpu placement=\"static\">2</vcpu>",
                    "<vcpu placement=\"static\">2</vcpu><cputune><vcpupin vcpu=\"0\" cpuset=\"4\"/><vcpupin vcpu=\"1\" cpuset=\"5\"/><emulatorpin cpuset=\"6-7\"/></cputune><numatune><memory mode=\"strict\" nodeset=\"1\"/></numatune>",
                )
                .replace("<model type=\"virtio\"/>", "<model type=\"virtio\"/><mtu size=\"9000\"/>"),
            kvm(),
            policy(Some(9000), Some("4-7"), Some("1")),
        ),
    ];
    for (xml, input, policy) in &cases {
        accepted_on(xml, input, policy);
    }
}

/// Every model on the list that is not virtio (or `none`) has its reason on the rules
/// page, and every reason names a model on the list.
#[test]
fn every_non_virtio_model_is_justified() {
    let mut listed = Vec::new();
    for (path, rule) in allow::TABLE.iter() {
        for (attr, form) in rule.attrs {
            if let allow::Value::Model(models) = form {
                for m in *models {
                    if !m.starts_with("virtio") && *m != "none" {
                        listed.push((format!("{path}/@{attr}"), *m));
                    }
                }
            }
        }
    }
    let justified = |p: &str, m: &str| {
        devices::JUSTIFIED
            .iter()
            .any(|(at, model, _)| *model == m && p.ends_with(at))
    };
    for (p, m) in &listed {
        // Controller topology and the bridges behind pci are covered by the pci type.
        let pci = m.starts_with("pci") || m.contains("bridge") || m.starts_with("dmi");
        assert!(
            justified(p, m) || pci,
            "{p} lists {m} without a reason in devices::JUSTIFIED"
        );
    }
    for (at, model, _) in devices::JUSTIFIED {
        let on_list = listed.iter().any(|(p, m)| p.ends_with(at) && m == model)
            || allow::TABLE.iter().any(|(p, r)| {
                r.attrs.iter().any(|(a, f)| {
                    format!("{p}/@{a}").ends_with(at)
                        && matches!(f, allow::Value::Enum(o) | allow::Value::Model(o) if o.contains(model))
                })
            });
        assert!(on_list, "{at} {model} is justified but not on the list");
    }
}

/// A refused value names what is allowed, and a MAC address on a NIC says who makes it
/// (issue 34: "not an allowed value" alone, and "only the operator assigns MAC addresses"
/// on a second NIC, where libvirt makes the address).
#[test]
fn refusals_name_the_fix() {
    let p = policy(None, None, None);
    let refused = |xml: String| verdict_on(&xml, &input(), &p, Reading::Plugin).unwrap_err();
    let (rule, detail) = refused(with(
        "<on_crash>destroy</on_crash>",
        "<on_crash>coredump-destroy</on_crash>",
    ));
    assert_eq!(rule, "value");
    assert!(
        detail.contains("not an allowed value; expected ") && detail.contains("\"destroy\""),
        "{detail}"
    );
    let (rule, detail) = refused(with(
        "<target dev=\"vda\" bus=\"virtio\"/>",
        "<target dev=\"vda\" bus=\"virtio\"/><address type=\"pci\" domain=\"0\" bus=\"0\" slot=\"010\" function=\"0\"/>",
    ));
    assert_eq!(rule, "value");
    assert!(
        detail.ends_with(
            "/@slot is \"010\", not an allowed value; expected decimal digits without a \
             leading zero, or 0x and at most 8 hex digits"
        ),
        "{detail}"
    );
    let (rule, detail) = refused(device(
        "<interface type=\"bridge\"><source bridge=\"br0\"/><mac address=\"52:54:00:00:00:09\"/></interface>",
    ));
    assert_eq!(rule, "mac-assigned");
    assert!(
        detail.contains("libvirt makes a unique MAC address for every NIC after the first"),
        "{detail}"
    );
}
