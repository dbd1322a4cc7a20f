//! `make demo`: the main job end to end on one machine, with nothing reaching outside it.
//!
//! Starts the proxy lab ([`integration_tests::guest_lab`]: sshd on 127.0.0.1, an isolated
//! libvirtd in its own network namespace with a bridge that routes nowhere, an HTTP server
//! inside the namespace, the Debian guest image served from loopback), writes a providers
//! config with a static address pool, then runs the real `egress-operator provision`:
//! image download, verify, upload, overlay, seed ISO (with the address in its
//! network-config), domain from the plugins, start, and it waits until the VM's proxy
//! answers the operator's own probe. Then it fetches a page THROUGH the VM's proxy from
//! the bridge side, shows that a client outside the allowed networks is refused, deletes
//! the VM and shows that nothing is left. Every daemon stops on exit.
//!
//! Usage: `egress-demo GUEST.qcow2 PATH/TO/egress-operator`
#![allow(clippy::print_stdout)]

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use integration_tests::guest_lab::{GuestLab, HELLO};
use integration_tests::harness::{self, Need};

/// A fixed UID, so a demo interrupted half-way is adopted and cleaned by the next run.
const DEMO_UID: &str = "5eed0000-0000-4000-8000-00000000de70";

fn step(title: &str) {
    println!("\n==> {title}");
}

/// Runs `cmd` with its output shown and also returned.
fn run_captured(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
    }
    Ok(text)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (image, operator) = match args.as_slice() {
        [_, image, operator] => (PathBuf::from(image), PathBuf::from(operator)),
        _ => bail!("usage: egress-demo GUEST.qcow2 PATH/TO/egress-operator"),
    };
    if let Some(reason) = harness::skip_reason(&[Need::Sshd, Need::Libvirtd]) {
        bail!("the demo cannot run here: {reason}");
    }

    step(
        "starting sshd on 127.0.0.1, an isolated libvirtd in its own network namespace, and an HTTP server inside it",
    );
    let lab = GuestLab::start(&image, false)?;
    println!(
        "    libvirtd in netns {}, bridge {} ({}, no route out); HTTP server at {}",
        lab.libvirtd.netns(),
        lab.libvirtd.bridge(),
        lab.bridge_net(),
        lab.hello_url()
    );
    println!(
        "    the operator reaches the bridge through a route into the namespace (from {})",
        lab.operator_side()
    );

    step("writing a providers config (static address pool, proxy settings, probe) and a Proxy");
    let plugins = integration_tests::target_dir().join("plugins");
    let config = lab.dir().join("providers-config.yaml");
    std::fs::write(&config, lab.config_yaml(true, &plugins, &[443]))?;
    let proxy = lab.dir().join("proxy.yaml");
    std::fs::write(
        &proxy,
        format!(
            "apiVersion: egress-operator.dev/v1alpha1\nkind: Proxy\nmetadata:\n  name: demo-egress\n  \
             namespace: default\n  uid: {DEMO_UID}\nspec:\n  provider: kvm2\n"
        ),
    )?;
    print!("{}", std::fs::read_to_string(&config)?);
    run_captured(
        Command::new(&operator)
            .arg("validate-config")
            .arg(&config)
            .arg("--proxy")
            .arg(&proxy),
    )?;

    step("egress-operator provision: create the proxy VM and wait until its proxy serves");
    let cache = lab.dir().join("plugin-cache");
    let started = Instant::now();
    let out = run_captured(
        Command::new(&operator)
            .args([
                "provision",
                "--no-progress",
                "--wait-serving-seconds",
                "600",
            ])
            .arg("--config")
            .arg(&config)
            .arg("--proxy")
            .arg(&proxy)
            .arg("--cache-dir")
            .arg(&cache),
    )?;
    println!(
        "    (provision took {:.0} s, boot of the guest included)",
        started.elapsed().as_secs_f64()
    );
    // The address is the operator's own report, not read from a lease file.
    let address: Ipv4Addr = out
        .lines()
        .find_map(|l| l.strip_prefix("addresses: "))
        .and_then(|a| a.split(',').next())
        .and_then(|a| a.trim().parse().ok())
        .context("provision printed no IPv4 address")?;
    println!("    the operator reports the proxy at {address}");

    step("a request from the bridge side, THROUGH the VM's proxy");
    let (code, body) = lab.curl_via(address, lab.client(), &lab.hello_url(), false)?;
    println!(
        "    curl --interface {} -x http://{address}:3128 {} -> HTTP {code}: {}",
        lab.client(),
        lab.hello_url(),
        body.trim()
    );
    if code != 200 || !body.contains(HELLO) {
        bail!("the proxied request did not come back (HTTP {code})");
    }

    step("a client outside the allowed CIDRs is refused");
    let (code, _) = lab.curl_via(address, lab.outsider(), &lab.hello_url(), false)?;
    println!(
        "    curl --interface {} -x http://{address}:3128 {} -> HTTP {code}",
        lab.outsider(),
        lab.hello_url()
    );
    if code != 403 {
        bail!("a client outside the allowed CIDRs got HTTP {code}, not 403");
    }

    step("egress-operator provision --delete: remove it again");
    run_captured(
        Command::new(&operator)
            .args(["provision", "--delete"])
            .arg("--config")
            .arg(&config)
            .arg("--proxy")
            .arg(&proxy),
    )?;
    let uri = lab.libvirtd.qemu_uri();
    let domains = lab.libvirtd.virsh(&uri, &["list", "--all", "--name"])?;
    let volumes = lab.libvirtd.virsh(&uri, &["vol-list", "default"])?;
    println!(
        "    domains left: {}",
        if domains.trim().is_empty() {
            "none"
        } else {
            domains.trim()
        }
    );
    println!("    volumes left (the verified base image stays cached for the next Create):");
    print!("{volumes}");
    if !domains.trim().is_empty() || volumes.contains(DEMO_UID) {
        bail!("something of the demo VM was left behind");
    }

    step("stopping the namespace's servers, libvirtd and sshd");
    drop(lab);
    println!(
        "demo finished: provisioned one proxy VM at {address}, fetched through it, deleted it; nothing left"
    );
    Ok(())
}
