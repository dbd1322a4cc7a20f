//! The product's whole path on a real guest: `egress-operator provision` (as a process)
//! creates proxy VMs from the Debian guest image (`make guest-image`) on the harness's
//! libvirtd, and the test then uses them as a consumer would, from inside the namespace.
//!
//! Two VMs boot at once: one with a static address from the host's pool (reported with
//! source `static`, nothing detected), one on DHCP (its address found through the guest
//! agent and checked against dnsmasq's lease). For both, `provision` waits until the
//! operator's own probe passes (a CONNECT through the VM's proxy). Then: a GET through
//! the proxy from an allowed client returns the namespace's page; a client outside the
//! allowed CIDRs gets 403; the proxy refuses to reach its own loopback and addresses,
//! and the bridge network except what settings allow; with tinyproxy stopped inside the
//! guest, the probe fails. Finally both are deleted and nothing is left.
//!
//! Software emulation on 2 cores: the boots take minutes; the hang guards are generous
//! and nothing here asserts a duration.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use integration_tests::guest_lab::{Finished, GuestLab, HELLO, run_guarded};
use integration_tests::harness::{self, Need};

/// Image upload, two Debian boots under TCG and cloud-init: generous.
const PROVISION_GUARD: Duration = Duration::from_secs(1500);
const SHORT_GUARD: Duration = Duration::from_secs(180);

const STATIC_UID: &str = "5eed0000-0000-4000-8000-0000000e2e01";
const DHCP_UID: &str = "5eed0000-0000-4000-8000-0000000e2e02";

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

fn write_proxy(dir: &Path, name: &str, uid: &str) -> PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: egress-operator.dev/v1alpha1\nkind: Proxy\nmetadata:\n  name: {name}\n  \
             namespace: e2e\n  uid: {uid}\nspec:\n  provider: kvm2\n"
        ),
    )
    .unwrap();
    path
}

fn provision(config: &Path, proxy: &Path, extra: &[&str], guard: Duration) -> Finished {
    let mut cmd = Command::new(binary());
    cmd.arg("provision")
        .args(["--no-progress", "--config"])
        .arg(config)
        .arg("--proxy")
        .arg(proxy)
        .args(extra)
        .env("RUST_LOG", "info");
    run_guarded(&mut cmd, guard, &format!("provision {}", proxy.display())).unwrap()
}

/// The value of a `key: value` line of provision's report.
fn field<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim_start_matches(':').trim())
}

fn first_v4(out: &str) -> Ipv4Addr {
    field(out, "addresses")
        .and_then(|a| a.split(',').next())
        .and_then(|a| a.trim().parse().ok())
        .unwrap_or_else(|| panic!("no IPv4 address in provision's report:\n{out}"))
}

#[test]
fn proxies_on_a_real_guest_serve_only_what_they_should() {
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return;
    }
    let image = GuestLab::default_image();
    if !image.exists()
        && harness::cannot_run(&format!(
            "{} is missing: `make test` builds it (make guest-image)",
            image.display()
        ))
    {
        return;
    }
    let lab = GuestLab::start(&image, true).unwrap();
    let plugins = integration_tests::target_dir().join("plugins");
    // CONNECT to 3128 is allowed here on purpose: the proxy itself listens there, so a
    // CONNECT to the guest's own loopback would succeed if only ConnectPort stood in the
    // way; the guest's firewall must refuse it.
    let static_config = lab.dir().join("static.yaml");
    std::fs::write(
        &static_config,
        lab.config_yaml(true, &plugins, &[443, 3128]),
    )
    .unwrap();
    let dhcp_config = lab.dir().join("dhcp.yaml");
    std::fs::write(&dhcp_config, lab.config_yaml(false, &plugins, &[443, 3128])).unwrap();
    let static_proxy = write_proxy(lab.dir(), "static-egress", STATIC_UID);
    let dhcp_proxy = write_proxy(lab.dir(), "dhcp-egress", DHCP_UID);

    // Both at once: two boots overlap, and two Creates race for the one image upload.
    let wait = ["--wait-serving-seconds", "1200"];
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| provision(&static_config, &static_proxy, &wait, PROVISION_GUARD));
        let b = s.spawn(|| provision(&dhcp_config, &dhcp_proxy, &wait, PROVISION_GUARD));
        (a.join().unwrap(), b.join().unwrap())
    });
    for (what, f) in [("static", &a), ("dhcp", &b)] {
        assert_eq!(
            f.code, 0,
            "provision ({what}) failed:\n{}\n{}",
            f.stdout, f.stderr
        );
        assert!(
            f.stdout.contains("created in"),
            "a first provision says it created the VM:\n{}",
            f.stdout
        );
        assert!(
            field(&f.stdout, "serving").is_some_and(|s| s.starts_with("yes")),
            "provision ({what}) did not see the proxy serve:\n{}",
            f.stdout
        );
        assert_eq!(
            field(&f.stdout, "seed"),
            Some("applied (the guest's host name is the seed's)"),
            "{}",
            f.stdout
        );
    }

    // The static VM: its address from the pool, reported without detection.
    let static_addr = first_v4(&a.stdout);
    assert_eq!(
        field(&a.stdout, "address source"),
        Some("static"),
        "{}",
        a.stdout
    );
    let host_part = static_addr.octets()[3];
    assert!(
        (10..=49).contains(&host_part),
        "{static_addr} is outside the pool's range"
    );
    // The DHCP VM: found by the guest agent, and it is the address dnsmasq leased.
    let dhcp_addr = first_v4(&b.stdout);
    assert_eq!(
        field(&b.stdout, "address source"),
        Some("agent"),
        "{}",
        b.stdout
    );
    let leases = lab.leases();
    assert!(
        leases.iter().any(|(_, ip)| ip == &dhcp_addr.to_string()),
        "{dhcp_addr} is not among dnsmasq's leases {leases:?}"
    );

    for proxy in [static_addr, dhcp_addr] {
        // Allowed client, allowed destination: the page comes back through the proxy.
        let (code, body) = lab
            .curl_via(proxy, lab.client(), &lab.hello_url(), false)
            .unwrap();
        assert_eq!(code, 200, "GET through {proxy}: HTTP {code} {body}");
        assert!(
            body.contains(HELLO),
            "GET through {proxy} returned {body:?}"
        );
        // A client outside the allowed CIDRs.
        let (code, _) = lab
            .curl_via(proxy, lab.outsider(), &lab.hello_url(), false)
            .unwrap();
        assert_eq!(
            code, 403,
            "a client outside the allowed CIDRs got HTTP {code} from {proxy}"
        );
        // The bridge network is refused except `.1`: `.2` serves the same page directly.
        let other = format!("http://{}:8080/hello", lab.outsider());
        let (code, body) = lab.curl_via(proxy, lab.client(), &other, false).unwrap();
        assert!(
            code != 200 && !body.contains(HELLO),
            "{proxy} fetched {other} on its bridge network (HTTP {code})"
        );
        // A CONNECT to an allowed destination and port opens the tunnel (the control
        // for the refusals below: the proxy's answer to CONNECT is what is compared).
        let tls = format!("http://{}:443/", lab.client());
        let (code, _) = lab.curl_via(proxy, lab.client(), &tls, true).unwrap();
        assert_eq!(code, 200, "CONNECT {tls} through {proxy}");
        // The proxy's own loopback and its own address, by CONNECT to its own port
        // (allowed as a CONNECT port here): the guest's firewall refuses them, so the
        // proxy answers with an error instead of opening the tunnel.
        for own in ["127.0.0.1".to_string(), proxy.to_string()] {
            let url = format!("http://{own}:3128/");
            let (code, _) = lab.curl_via(proxy, lab.client(), &url, true).unwrap();
            assert!(
                (400..600).contains(&code),
                "{proxy} answered CONNECT {own}:3128 with {code}, not an error"
            );
        }
        // A CONNECT port outside the allowed ones.
        let (code, _) = lab
            .curl_via(
                proxy,
                lab.client(),
                &format!("http://{}:8080/", lab.client()),
                true,
            )
            .unwrap();
        assert_eq!(
            code, 403,
            "{proxy} tunnelled to port 8080 (not a CONNECT port)"
        );
    }

    // A second provision adopts and says so.
    let again = provision(&static_config, &static_proxy, &[], SHORT_GUARD);
    assert_eq!(again.code, 0, "{}\n{}", again.stdout, again.stderr);
    assert!(
        again.stdout.contains("adopted the existing instance"),
        "{}",
        again.stdout
    );
    assert_eq!(
        first_v4(&again.stdout),
        static_addr,
        "adoption keeps the address"
    );

    // With tinyproxy stopped inside the guest, the probe fails.
    let domain = format!("egress-{STATIC_UID}");
    let stop = r#"{"execute":"guest-exec","arguments":{"path":"/usr/bin/systemctl","arg":["stop","tinyproxy"]}}"#;
    lab.libvirtd
        .virsh(
            &lab.libvirtd.qemu_uri(),
            &["qemu-agent-command", &domain, stop],
        )
        .unwrap();
    let down = provision(
        &static_config,
        &static_proxy,
        &["--wait-serving-seconds", "20"],
        SHORT_GUARD,
    );
    assert_ne!(
        down.code, 0,
        "provision must fail when the proxy does not serve:\n{}",
        down.stdout
    );
    assert!(
        field(&down.stdout, "serving").is_some_and(|s| s.starts_with("no")),
        "{}\n{}",
        down.stdout,
        down.stderr
    );

    for proxy in [&static_proxy, &dhcp_proxy] {
        let config = if proxy == &static_proxy {
            &static_config
        } else {
            &dhcp_config
        };
        let del = provision(config, proxy, &["--delete"], SHORT_GUARD);
        assert_eq!(del.code, 0, "{}\n{}", del.stdout, del.stderr);
    }
    let uri = lab.libvirtd.qemu_uri();
    let domains = lab
        .libvirtd
        .virsh(&uri, &["list", "--all", "--name"])
        .unwrap();
    assert!(domains.trim().is_empty(), "domains left: {domains}");
    let volumes = lab.libvirtd.virsh(&uri, &["vol-list", "default"]).unwrap();
    for uid in [STATIC_UID, DHCP_UID] {
        assert!(!volumes.contains(uid), "volumes of {uid} left:\n{volumes}");
    }
}
