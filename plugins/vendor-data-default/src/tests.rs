//! Tests of the rendered vendor-data, the settings checks, and (where the machine allows)
//! the rendered scripts under shellcheck and the firewall in a network namespace.

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{Value, json};
use templates_sdk::vendor_data::{Firmware, HostFacts, MachineType, VendorDataInput};

use super::*;
use crate::render::{BOUNDARY, DROP_IN, FIREWALL_SCRIPT, TINYPROXY_CONF};

fn input(settings: &Value) -> VendorDataInput {
    VendorDataInput {
        proxy_name: "office-egress".into(),
        proxy_namespace: "default".into(),
        host: HostFacts {
            name: "h1".into(),
            arch: "x86_64".into(),
            kvm: false,
            libvirt_version: "9.0.0".into(),
            cpus: 2,
            numa_nodes: 1,
        },
        machine_type: MachineType {
            name: "small".into(),
            vcpus: 1,
            memory_mib: 512,
            disk_gib: 4,
            firmware: Firmware::Bios,
        },
        settings: settings.to_string(),
    }
}

/// Renders through the same path the component export uses (settings parsed from JSON).
fn render_json(settings: Value) -> Result<String, String> {
    templates_sdk::__private::render_vendor_data::<DefaultVendorData>(&input(&settings))
}

/// Settings problems of a JSON document, as `(pointer, message)` pairs.
fn problems(settings: Value) -> Vec<(String, String)> {
    match templates_sdk::__private::validate::<Settings>(
        &settings.to_string(),
        DefaultVendorData::validate_settings,
    ) {
        Ok(()) => Vec::new(),
        Err(p) => p.into_iter().map(|p| (p.pointer, p.message)).collect(),
    }
}

fn plan(settings: Value) -> Plan {
    let s: Settings = serde_json::from_value(settings).unwrap();
    Plan::new(&s).unwrap()
}

/// One MIME part: its headers (lower-cased) and body.
#[derive(Debug)]
struct Part {
    headers: String,
    body: String,
}

/// Splits the document the way a MIME reader does, checking the outer header and the
/// closing delimiter.
fn parts(doc: &str) -> Vec<Part> {
    let (head, rest) = doc.split_once("\n\n").unwrap();
    assert!(
        head.contains(&format!(
            "Content-Type: multipart/mixed; boundary=\"{BOUNDARY}\""
        )),
        "{head}"
    );
    let close = format!("\n--{BOUNDARY}--\n");
    assert!(rest.ends_with(&close), "no closing delimiter");
    let body = &rest[..rest.len() - close.len() + 1];
    body.split(&format!("--{BOUNDARY}\n"))
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (h, b) = p.split_once("\n\n").unwrap();
            // The newline before a delimiter belongs to the delimiter.
            let b = b.strip_suffix('\n').unwrap();
            Part {
                headers: h.to_ascii_lowercase(),
                body: b.to_string(),
            }
        })
        .collect()
}

/// The content of the here-document `put`ting `path` in the setup script.
fn embedded<'a>(script: &'a str, path: &str) -> &'a str {
    let start = format!("put '{path}' ");
    let from = script
        .find(&start)
        .unwrap_or_else(|| panic!("{path} is not written"));
    let rest = &script[from..];
    let body = &rest[rest.find('\n').unwrap() + 1..];
    &body[..body.find("\nEGRESS_PROXY_FILE_END\n").unwrap() + 1]
}

/// Line index of the first line containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{needle:?} not found in:\n{text}"))
}

#[test]
fn empty_settings_render_a_safe_proxy_in_a_script_part() {
    let doc = render_json(json!({})).unwrap();
    let ps = parts(&doc);
    assert_eq!(ps.len(), 1, "nothing optional by default: {ps:?}");
    assert!(
        ps[0].headers.contains("content-type: text/x-shellscript"),
        "{:?}",
        ps[0]
    );
    let script = &ps[0].body;
    assert!(script.starts_with("#!/bin/sh\n"));
    assert!(script.contains("\nset -eu\n"));

    let conf = embedded(script, TINYPROXY_CONF);
    assert_eq!(conf, render::tinyproxy_conf(&plan(json!({}))));
    for line in [
        "User tinyproxy",
        "Group tinyproxy",
        "Port 3128",
        "PidFile \"/run/tinyproxy/tinyproxy.pid\"",
        "MaxClients 512",
        "DisableViaHeader Yes",
        "Allow 10.0.0.0/8",
        "Allow 172.16.0.0/12",
        "Allow 192.168.0.0/16",
        "ConnectPort 443",
    ] {
        assert!(conf.lines().any(|l| l == line), "{line:?} missing:\n{conf}");
    }
    assert_eq!(
        conf.lines()
            .filter(|l| l.starts_with("ConnectPort "))
            .count(),
        1
    );
    assert_eq!(conf.lines().filter(|l| l.starts_with("Allow ")).count(), 3);
    assert!(!conf.contains("ViaProxyName"), "{conf}");

    let fw = embedded(script, FIREWALL_SCRIPT);
    for rule in [
        "meta skuid != $uid return",
        "meta l4proto != tcp return",
        "ct state != new return",
        "fib daddr type local counter reject with tcp reset",
        "ip daddr 127.0.0.0/8 counter reject with tcp reset",
        "ip daddr 169.254.0.0/16 counter reject with tcp reset",
        "ip daddr 0.0.0.0/8 counter reject with tcp reset",
        "ip daddr 100.100.100.200/32 counter reject with tcp reset",
        "ip6 daddr ::1/128 counter reject with tcp reset",
        "ip6 daddr fe80::/10 counter reject with tcp reset",
        "ip6 daddr fd00:ec2::254/128 counter reject with tcp reset",
        "ip daddr $net counter reject with tcp reset",
        "ip6 daddr $net counter reject with tcp reset",
        "ip \"$1\" -o route show table main",
    ] {
        assert!(fw.contains(rule), "{rule:?} missing:\n{fw}");
    }
    assert!(
        !fw.contains("accept comment"),
        "no exemption by default:\n{fw}"
    );

    let drop_in = embedded(script, DROP_IN);
    assert!(
        drop_in.contains(&format!("\nExecStartPre={FIREWALL_SCRIPT}\n")),
        "{drop_in}"
    );

    // Installation of only what is missing, then files, then firewall, then the start.
    assert!(script.contains("for pkg in 'tinyproxy' 'nftables' 'iproute2' 'qemu-guest-agent'; do"));
    let install = line_of(script, "install --no-install-recommends");
    let conf_at = line_of(script, &format!("put '{TINYPROXY_CONF}'"));
    let fw_at = line_of(script, &format!("put '{FIREWALL_SCRIPT}'"));
    let drop_at = line_of(script, &format!("put '{DROP_IN}'"));
    let applied = line_of(script, &format!("{FIREWALL_SCRIPT} || fail"));
    let enable = line_of(script, "systemctl enable tinyproxy.service");
    let restart = line_of(script, "systemctl restart tinyproxy.service");
    assert!(
        install < conf_at && conf_at < fw_at && fw_at < drop_at,
        "{script}"
    );
    assert!(
        drop_at < applied && applied < enable && enable < restart,
        "{script}"
    );
    assert!(script.contains("ss -Hltn \"sport = :3128\""));
}

#[test]
fn full_settings_render_every_value_with_exemptions_first() {
    let settings = json!({
        "listenPort": 8080,
        "allowedClientCidrs": ["10.20.0.0/16", "fd12::/64", "10.20.0.7/16"],
        "connectPorts": [8443, 443, 8443],
        "allowedDestinationCidrs": ["10.203.0.1/32", "127.0.0.53/32"],
        "deniedDestinationCidrs": ["192.0.2.0/24", "2001:db8::/32"],
        "maxClients": 77,
        "ntpServers": ["ntp.example.org", "192.0.2.123"],
        "extraPackages": ["curl", "tinyproxy"],
    });
    let doc = render_json(settings.clone()).unwrap();
    let ps = parts(&doc);
    assert_eq!(ps.len(), 2, "{ps:?}");
    let script = &ps[0].body;

    let conf = embedded(script, TINYPROXY_CONF);
    let allows: Vec<&str> = conf.lines().filter(|l| l.starts_with("Allow ")).collect();
    // Canonical networks, in order, duplicates (after canonical form) dropped.
    assert_eq!(allows, ["Allow 10.20.0.0/16", "Allow fd12::/64"]);
    let connects: Vec<&str> = conf
        .lines()
        .filter(|l| l.starts_with("ConnectPort "))
        .collect();
    assert_eq!(connects, ["ConnectPort 443", "ConnectPort 8443"]);
    assert!(conf.lines().any(|l| l == "Port 8080"));
    assert!(conf.lines().any(|l| l == "MaxClients 77"));

    let fw = embedded(script, FIREWALL_SCRIPT);
    let accept1 = line_of(
        fw,
        "ip daddr 10.203.0.1/32 counter accept comment \"allowedDestinationCidrs/0\"",
    );
    let accept2 = line_of(
        fw,
        "ip daddr 127.0.0.53/32 counter accept comment \"allowedDestinationCidrs/1\"",
    );
    let first_reject = fw.lines().position(|l| l.contains("reject")).unwrap();
    assert!(
        accept1 < accept2 && accept2 < first_reject,
        "exemptions come first:\n{fw}"
    );
    assert!(
        first_reject == line_of(fw, "fib daddr type local counter reject"),
        "{fw}"
    );
    assert!(line_of(fw, "ct state != new return") < accept1, "{fw}");
    line_of(
        fw,
        "ip daddr 192.0.2.0/24 counter reject with tcp reset comment \"deniedDestinationCidrs/0\"",
    );
    line_of(
        fw,
        "ip6 daddr 2001:db8::/32 counter reject with tcp reset comment \"deniedDestinationCidrs/1\"",
    );
    // The on-link networks are appended after the static rules at run time.
    assert!(line_of(fw, "for net in $link4") > line_of(fw, "deniedDestinationCidrs/1"));

    // Extra packages join the required ones, once each.
    assert!(
        script
            .contains("for pkg in 'tinyproxy' 'nftables' 'iproute2' 'qemu-guest-agent' 'curl'; do")
    );
    assert!(script.contains("ss -Hltn \"sport = :8080\""));

    // The optional part carries only ntp.
    assert!(ps[1].headers.contains("content-type: text/cloud-config"));
    assert_eq!(
        ps[1].body,
        "#cloud-config\nntp:\n  enabled: true\n  servers:\n  - ntp.example.org\n  - 192.0.2.123\n"
    );
    // Deterministic.
    assert_eq!(render_json(settings).unwrap(), doc);
}

#[test]
fn air_gapped_renders_no_package_installation_at_all() {
    let doc = render_json(json!({"installPackages": false})).unwrap();
    let ps = parts(&doc);
    assert_eq!(ps.len(), 1);
    for word in ["apt", "dpkg", "packages:", "package_update", "install --no"] {
        assert!(
            !doc.contains(word),
            "{word:?} in the air-gapped render:\n{doc}"
        );
    }
    let script = &ps[0].body;
    assert!(script.contains("for cmd in tinyproxy nft ip ss awk id; do"));
    // Everything else is the same as with installation.
    let with = parts(&render_json(json!({})).unwrap()).remove(0).body;
    for path in [TINYPROXY_CONF, FIREWALL_SCRIPT, DROP_IN] {
        assert_eq!(embedded(script, path), embedded(&with, path), "{path}");
    }
}

#[test]
fn settings_errors_name_their_pointer() {
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"listenPort": 0}), "/listenPort", "0"),
        (json!({"listenPort": 70000}), "/listenPort", "70000"),
        (json!({"maxClients": 0}), "/maxClients", "1..=100000"),
        (
            json!({"allowedClientCidrs": []}),
            "/allowedClientCidrs",
            "open proxy",
        ),
        (
            json!({"allowedClientCidrs": ["10.0.0.0/8", "10.0.0.0"]}),
            "/allowedClientCidrs/1",
            "CIDR",
        ),
        (json!({"connectPorts": []}), "/connectPorts", "every port"),
        (json!({"connectPorts": [443, 0]}), "/connectPorts/1", "0"),
        (
            json!({"connectPorts": [443, 65536]}),
            "/connectPorts/1",
            "65536",
        ),
        (
            json!({"allowedDestinationCidrs": ["10.0.0.0/8", "10.0.0.0/40"]}),
            "/allowedDestinationCidrs/1",
            "prefix length",
        ),
        (
            json!({"deniedDestinationCidrs": ["nope"]}),
            "/deniedDestinationCidrs/0",
            "CIDR",
        ),
        (
            json!({"deniedDestinationCidrs": ["::ffff:127.0.0.1/128"]}),
            "/deniedDestinationCidrs/0",
            "IPv4-mapped",
        ),
        (
            json!({"ntpServers": ["bad host"]}),
            "/ntpServers/0",
            "host name",
        ),
        (
            json!({"extraPackages": ["Curl"]}),
            "/extraPackages/0",
            "package name",
        ),
        (
            json!({"installPackages": false, "extraPackages": ["curl"]}),
            "/extraPackages",
            "installPackages is false",
        ),
        (
            json!({"installPackages": false, "ntpServers": ["192.0.2.1"]}),
            "/ntpServers",
            "installPackages is false",
        ),
        (
            json!({"installPackages": "no"}),
            "/installPackages",
            "boolean",
        ),
        (json!({"listenport": 1}), "/listenport", "unknown field"),
    ];
    for (settings, pointer, words) in cases {
        let got = problems(settings.clone());
        assert_eq!(got.len(), 1, "{settings}: {got:?}");
        assert_eq!(got[0].0, pointer, "{settings}: {got:?}");
        assert!(got[0].1.contains(words), "{settings}: {got:?}");
        // Render refuses what validation refuses.
        assert!(
            render_json(settings.clone()).is_err(),
            "{settings} rendered"
        );
    }
    // Several problems are all reported.
    let got = problems(json!({"connectPorts": [], "allowedClientCidrs": ["x", "y"]}));
    let pointers: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        pointers,
        [
            "/connectPorts",
            "/allowedClientCidrs/0",
            "/allowedClientCidrs/1"
        ]
    );
    assert!(problems(json!({})).is_empty());
}

#[test]
fn hostile_values_are_refused_and_never_reach_the_output() {
    let hostile = [
        "10.0.0.0/8\nAllow 0.0.0.0/0",
        "10.0.0.0/8\"; reboot; \"",
        "$(reboot)/8",
        "10.0.0.0/8 accept",
        "'/8",
        "10.0.0.0/8\nEGRESS_PROXY_FILE_END\nreboot",
    ];
    for h in hostile {
        for key in [
            "allowedClientCidrs",
            "allowedDestinationCidrs",
            "deniedDestinationCidrs",
        ] {
            let settings = json!({ key: [h] });
            let got = problems(settings.clone());
            assert_eq!(got.len(), 1, "{settings}");
            assert_eq!(got[0].0, format!("/{key}/0"));
            let err = render_json(settings).unwrap_err();
            assert!(err.contains(&format!("/{key}/0")), "{err}");
        }
        for key in ["extraPackages", "ntpServers"] {
            let settings = json!({ key: [h] });
            assert_eq!(problems(settings.clone())[0].0, format!("/{key}/0"));
            assert!(render_json(settings).is_err());
        }
    }
    for p in ["a;rm", "-oAPT::x", "a b", "pkg'", "a$(x)", "a\nb", "*"] {
        assert_eq!(
            problems(json!({"extraPackages": [p]}))[0].0,
            "/extraPackages/0",
            "{p:?}"
        );
    }
    // Values that pass are written canonically: nothing of the settings text but the
    // parsed value reaches the output.
    let doc = render_json(json!({"allowedClientCidrs": ["10.1.2.3/8"]})).unwrap();
    assert!(doc.contains("Allow 10.0.0.0/8\n") && !doc.contains("10.1.2.3"));
    // The Proxy's name is not written anywhere.
    assert!(!doc.contains("office-egress"));
}

#[test]
fn the_output_passes_the_operators_format_rules() {
    // Mirrors operator/src/templates/check: a MIME document whose header block names a
    // multipart type with a boundary that the body uses.
    for settings in [json!({}), json!({"ntpServers": ["192.0.2.1"]})] {
        let doc = render_json(settings).unwrap();
        let head: Vec<&str> = doc.lines().take_while(|l| !l.trim().is_empty()).collect();
        assert_eq!(head.len(), 2, "{head:?}");
        assert!(
            head[0]
                .to_ascii_lowercase()
                .starts_with("content-type: multipart/mixed;")
        );
        assert!(doc.contains(&format!("\n--{BOUNDARY}\n")));
        assert!(doc.is_ascii());
        assert!(doc.len() < 64 * 1024, "{} bytes", doc.len());
    }
}

/// Skips a test that needs something this machine lacks; in CI and as root that is a
/// failure (as `integration_tests::harness::cannot_run`: root can install what is
/// missing, so a skip there hides a broken machine). The `SKIPPED:` line goes straight to
/// stderr, past libtest's capture, so `make test`'s summary counts it.
fn cannot_run(reason: &str) -> bool {
    use std::io::Write as _;
    let ci = std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"));
    assert!(
        !ci,
        "CI must run this test, but it cannot run here: {reason}"
    );
    assert!(
        !running_as_root(),
        "as root every test must run (`make setup` installs what they need), but this one cannot: {reason}"
    );
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("SKIPPED: {reason}\n").as_bytes());
    true
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

fn found(program: &str) -> bool {
    ["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin"]
        .iter()
        .any(|d| Path::new(d).join(program).exists())
}

#[test]
fn rendered_scripts_pass_shellcheck() {
    if !found("shellcheck") && cannot_run("shellcheck is not installed (make setup installs it)") {
        return;
    }
    let dir = tempfile_dir("shellcheck");
    for (name, settings) in [
        ("default", json!({})),
        ("air-gapped", json!({"installPackages": false})),
        (
            "full",
            json!({"allowedDestinationCidrs": ["10.0.0.1/32"], "extraPackages": ["curl"]}),
        ),
    ] {
        let p = plan(settings);
        for (kind, text) in [
            ("setup", render::setup_script(&p).unwrap()),
            ("firewall", render::firewall_script(&p).unwrap()),
            ("netwatch", crate::netwatch::script()),
        ] {
            let file = dir.join(format!("{name}-{kind}.sh"));
            std::fs::write(&file, &text).unwrap();
            let out = Command::new("shellcheck")
                .args(["--shell=sh", "--severity=style"])
                .arg(&file)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name} {kind} script:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh directory under the system's temp dir (no extra dependency for tempfile).
fn tempfile_dir(tag: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("vendor-data-default-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the rendered firewall script in a network and mount namespace of its own (a
/// veth link with 10.77.0.2/24 and fd77::2/64 (and a lone 10.99.0.1/32) as "the network this VM sits on", a
/// default route into it, /run on a tmpfs), with root as the filtered user instead of
/// tinyproxy, around an HTTP server listening on every address. It dials as root before
/// and after the firewall, and as another user after it. curl's exit code tells the
/// outcome: 0 served, 7 connection refused (a reset), anything else (a timeout: the veth
/// peer answers nothing) means neither.
#[test]
fn the_firewall_resets_forbidden_destinations_in_a_namespace() {
    if !running_as_root() && cannot_run("needs root for a network namespace") {
        return;
    }
    for tool in ["nft", "unshare", "curl", "ip", "python3", "setpriv"] {
        if !found(tool) && cannot_run(&format!("{tool} is not installed")) {
            return;
        }
    }
    let p = plan(json!({
        "allowedDestinationCidrs": ["10.77.0.9/32"],
        "deniedDestinationCidrs": ["10.88.0.0/16"],
    }));
    let script = render::firewall_script(&p)
        .unwrap()
        .replace("id -u tinyproxy", "id -u root");
    assert!(script.contains("uid=$(id -u root)"));
    let dir = tempfile_dir("netns");
    let fw = dir.join("firewall.sh");
    std::fs::write(&fw, script).unwrap();
    let probe = format!(
        r#"set -u
mount -t tmpfs tmpfs /run
ip link set lo up
ip link add d0 type veth peer name d1
ip link set d1 up
ip addr add 10.77.0.2/24 dev d0
ip addr add 10.77.0.9/24 dev d0
ip addr add 10.99.0.1/32 dev d0
ip addr add fd77::2/64 dev d0 nodad
ip link set d0 up
ip route add default via 10.77.0.1
/usr/bin/python3 -m http.server --bind :: --directory {dir} 8000 >/dev/null 2>&1 &
srv=$!
trap 'kill $srv' EXIT
tries=0
until curl -s -o /dev/null http://127.0.0.1:8000/; do
	tries=$((tries + 1)); [ $tries -lt 100 ] || exit 91; sleep 0.1
done
dial() {{ curl -s -o /dev/null --max-time 5 "http://$2/"; echo "$1 $2 $?"; }}
for a in 127.0.0.1:8000 '[::1]:8000' 10.77.0.2:8000 10.77.0.9:8000 '[fd77::2]:8000' 10.99.0.1:8000; do
	dial before "$a"
done
/bin/sh {fw} || exit 90
nft list table inet egress_proxy >&2
for a in 127.0.0.1:8000 127.1:8000 0.0.0.0:8000 '[::1]:8000' 10.77.0.2:8000 '[fd77::2]:8000' 10.99.0.1:8000 \
	10.77.0.5:80 '[fd77::5]:80' 10.88.1.1:80 169.254.169.254:80 10.77.0.9:8000; do
	dial after "$a"
done
for a in 127.0.0.1:8000 10.77.0.2:8000; do
	echo "other $a $(setpriv --reuid=65534 --regid=65534 --clear-groups curl -s -o /dev/null --max-time 5 "http://$a/"; echo $?)"
done
"#,
        fw = fw.display(),
        dir = dir.display(),
    );
    let out = Command::new("unshare")
        .args([
            "--net",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &probe,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let got: Vec<&str> = stdout.lines().collect();
    let want = [
        "before 127.0.0.1:8000 0",
        "before [::1]:8000 0",
        "before 10.77.0.2:8000 0",
        "before 10.77.0.9:8000 0",
        "before [fd77::2]:8000 0",
        "before 10.99.0.1:8000 0",
        // The VM's own addresses, whatever their spelling.
        "after 127.0.0.1:8000 7",
        "after 127.1:8000 7",
        "after 0.0.0.0:8000 7",
        "after [::1]:8000 7",
        "after 10.77.0.2:8000 7",
        "after [fd77::2]:8000 7",
        // An address of the VM in no on-link network (a /32): only `fib daddr type local`.
        "after 10.99.0.1:8000 7",
        // The on-link networks learnt from the routes, both families.
        "after 10.77.0.5:80 7",
        "after [fd77::5]:80 7",
        // A configured denial and the metadata address (routed by the default route).
        "after 10.88.1.1:80 7",
        "after 169.254.169.254:80 7",
        // An exemption comes before every refusal, the VM's own addresses included.
        "after 10.77.0.9:8000 0",
        // Only the proxy's user is filtered.
        "other 127.0.0.1:8000 0",
        "other 10.77.0.2:8000 0",
    ];
    assert_eq!(got, want, "{stderr}");
    assert!(
        stderr.contains("ip daddr 10.77.0.0/24 counter packets"),
        "{stderr}"
    );
    assert!(
        stderr.contains("ip6 daddr fd77::/64 counter packets"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The firewall is not a snapshot: with the watcher running (in a network namespace of
/// its own, root standing in for tinyproxy), a family with no network yet is refused
/// whole; an IPv4 lease that comes after the IPv6 route, and an IPv6 /64 learnt later,
/// are refused within moments of appearing; an `nft flush ruleset` is undone.
#[test]
fn the_firewall_follows_new_networks_and_comes_back_after_a_flush() {
    if !running_as_root() && cannot_run("needs root for a network namespace") {
        return;
    }
    for tool in ["nft", "unshare", "curl", "ip", "python3", "setsid"] {
        if !found(tool) && cannot_run(&format!("{tool} is not installed")) {
            return;
        }
    }
    let p = plan(json!({}));
    let dir = tempfile_dir("netwatch");
    let fw = dir.join("firewall.sh");
    std::fs::write(
        &fw,
        render::firewall_script(&p)
            .unwrap()
            .replace("id -u tinyproxy", "id -u root"),
    )
    .unwrap();
    let watch = dir.join("netwatch.sh");
    let script = crate::netwatch::script()
        .replace(FIREWALL_SCRIPT, &format!("/bin/sh {}", fw.display()))
        .replace("systemctl stop tinyproxy.service", "echo STOPPED");
    assert!(script.contains("echo STOPPED"));
    std::fs::write(&watch, script).unwrap();
    let probe = format!(
        r#"set -u
mount -t tmpfs tmpfs /run
ip link set lo up
ip link add d0 type veth peer name d1
ip link set d1 up
ip addr add fd77::2/64 dev d0 nodad
ip link set d0 up
/usr/bin/python3 -m http.server --bind :: --directory {dir} 8000 >/dev/null 2>&1 &
srv=$!
setsid sh {watch} >/dev/null 2>{dir}/watch.log &
w=$!
trap 'kill $srv; /bin/kill -TERM -- -$w' EXIT
listed() {{ nft list table inet egress_proxy 2>/dev/null | grep -q "$1"; }}
wait_rule() {{
	t=0
	until listed "$1"; do
		t=$((t + 1)); [ $t -lt 100 ] || {{ echo "never: $1"; return 1; }}; sleep 0.1
	done
}}
dial() {{ curl -s -o /dev/null --max-time 3 "http://$2/"; echo "$1 $2 $?"; }}
wait_rule 'ip6 daddr fd77::/64' || exit 91
listed 'no IPv4 network known yet' && echo "ipv4 refused while unknown"
ip addr add 10.66.0.2/24 dev d0
wait_rule 'ip daddr 10.66.0.0/24' || exit 92
listed 'no IPv4 network known yet' || echo "ipv4 known"
dial lease4 10.66.0.5:80
ip addr add fd78::2/64 dev d0 nodad
wait_rule 'ip6 daddr fd78::/64' || exit 93
dial ra6 '[fd78::5]:80'
# Let the burst of events of the new address pass: the flush must be found by the
# watcher's table check, not by a late route event.
sleep 3
nft flush ruleset
wait_rule 'ip daddr 10.66.0.0/24' || exit 94
dial flushed 10.66.0.5:80
dial flushed '[fd78::5]:80'
"#,
        dir = dir.display(),
        watch = watch.display(),
    );
    let out = Command::new("unshare")
        .args([
            "--net",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &probe,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let log = std::fs::read_to_string(dir.join("watch.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "{}: {stdout}\n{}\nwatcher:\n{log}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        got,
        [
            "ipv4 refused while unknown",
            "ipv4 known",
            // Reset by the new rules; without them the dial would time out (28): the veth
            // peer answers nothing.
            "lease4 10.66.0.5:80 7",
            "ra6 [fd78::5]:80 7",
            "flushed 10.66.0.5:80 7",
            "flushed [fd78::5]:80 7",
        ],
        "watcher:\n{log}"
    );
    assert!(log.contains("is gone: applying it again"), "{log}");
    assert!(!log.contains("STOPPED"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
