//! `make demo`: the main job end to end on one machine, with nothing reaching outside it.
//!
//! Starts OpenSSH's sshd on 127.0.0.1 and an isolated libvirtd (its own network namespace,
//! a bridge with no route out, dnsmasq answering DHCP on it only), serves the demo image
//! from a loopback HTTP server, writes a providers config for them, then runs the real
//! `egress-operator provision` command to create one proxy VM (image download, verify,
//! upload, overlay, seed ISO, domain from the plugins, start), shows its domain XML, state
//! and address, deletes it, and shows that nothing is left. Every daemon stops on exit.
//!
//! Usage: `egress-demo IMAGE.qcow2 PATH/TO/egress-operator`
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};
use integration_tests::harness::{self, Libvirtd, Need, Sshd};
use integration_tests::http::{HttpServer, Route};

/// The demo network inside the namespace: the host side is .1, dnsmasq leases .50-.99.
const HOST_ADDRESS: &str = "10.213.0.1/24";
const DHCP_RANGE: &str = "10.213.0.50,10.213.0.99,255.255.255.0,1h";
/// A fixed UID, so a demo interrupted half-way is adopted and cleaned by the next run.
const DEMO_UID: &str = "5eed0000-0000-4000-8000-00000000de70";

/// dnsmasq inside the namespace, killed on drop.
struct Dnsmasq(Child);

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn step(title: &str) {
    println!("\n==> {title}");
}

fn run_shown(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (image, operator) = match args.as_slice() {
        [_, image, operator] => (PathBuf::from(image), PathBuf::from(operator)),
        _ => bail!("usage: egress-demo IMAGE.qcow2 PATH/TO/egress-operator"),
    };
    if let Some(reason) = harness::skip_reason(&[Need::Sshd, Need::Libvirtd]) {
        bail!("the demo cannot run here: {reason}");
    }
    for tool in ["dnsmasq"] {
        if !Path::new("/usr/sbin").join(tool).exists() {
            bail!("{tool} is missing (run `make setup` as root)");
        }
    }

    step("starting sshd on 127.0.0.1 and an isolated libvirtd in its own network namespace");
    let sshd = Sshd::start()?;
    let libvirtd = Libvirtd::start()?;
    libvirtd.define_dir_pool("default")?;
    run_shown(libvirtd.in_netns("ip").args([
        "addr",
        "add",
        HOST_ADDRESS,
        "dev",
        libvirtd.bridge(),
    ]))?;
    let work = tempfile::tempdir()?;
    let leases = work.path().join("dnsmasq.leases");
    let dnsmasq = Dnsmasq(
        libvirtd
            .in_netns("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--bind-interfaces",
                "--except-interface=lo",
                &format!("--interface={}", libvirtd.bridge()),
                &format!("--dhcp-range={DHCP_RANGE}"),
                &format!("--dhcp-leasefile={}", leases.display()),
                "--port=0",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting dnsmasq in the namespace")?,
    );
    println!(
        "    sshd 127.0.0.1:{}, libvirtd in netns {}, bridge {} ({HOST_ADDRESS}, DHCP, no route out)",
        sshd.port(),
        libvirtd.netns(),
        libvirtd.bridge()
    );

    step("serving the demo image from a loopback HTTP server");
    let bytes = std::fs::read(&image).with_context(|| format!("reading {}", image.display()))?;
    let sha = integration_tests::sha256_hex(&bytes);
    drop(bytes);
    let http = HttpServer::start(vec![("/demo.qcow2".into(), Route::File(image.clone()))])?;
    println!("    {} sha256 {sha}", http.url("/demo.qcow2"));

    step("writing a providers config and a Proxy for them");
    let plugins = integration_tests::target_dir().join("plugins");
    let config = work.path().join("providers-config.yaml");
    std::fs::write(
        &config,
        format!(
            r#"clusterId: demo
kvm2:
  ssh:
    user: {user}
    privateKeyFile: {key}
    knownHostsFile: {known}
  hosts:
    - name: local
      address: "{address}"
      libvirtSocket: {socket}
      storagePool: default
      bridge: {bridge}
      # Software emulation: KVM may be present but unusable on a nested build machine.
      disableKvm: true
  images:
    - name: demo
      url: {url}
      sha256: {sha}
      format: qcow2
      maxSizeMiB: 256
      # The image server is on loopback, over plain http: allowed for this entry only.
      allowHttp: true
      allowPrivateAddresses: true
  machineTypes:
    - {{name: tiny, vcpus: 1, memoryMiB: 256, diskGiB: 1}}
  defaults: {{machineType: tiny, image: demo}}
  templates:
    domain: {{path: {plugins}/domain-default.wasm}}
    vendorData:
      path: {plugins}/vendor-data-default.wasm
      settings: {{listenPort: 3128, allowedClientCidrs: [10.213.0.0/24]}}
"#,
            user = sshd.user(),
            key = sshd.client_key().display(),
            known = sshd.known_hosts().display(),
            address = sshd.address(),
            socket = libvirtd.socket_path().display(),
            bridge = libvirtd.bridge(),
            url = http.url("/demo.qcow2"),
            plugins = plugins.display(),
        ),
    )?;
    let proxy = work.path().join("proxy.yaml");
    std::fs::write(
        &proxy,
        format!(
            "apiVersion: egress-operator.dev/v1alpha1\nkind: Proxy\nmetadata:\n  name: demo-egress\n  \
             namespace: default\n  uid: {DEMO_UID}\nspec:\n  provider: kvm2\n"
        ),
    )?;
    println!("    {}", config.display());
    run_shown(
        Command::new(&operator)
            .arg("validate-config")
            .arg(&config)
            .arg("--proxy")
            .arg(&proxy),
    )?;

    step("egress-operator provision: create the proxy VM through SSH and libvirt");
    let cache = work.path().join("plugin-cache");
    run_shown(
        Command::new(&operator)
            .args(["provision", "--show-xml", "--wait-address-seconds", "45"])
            .arg("--config")
            .arg(&config)
            .arg("--proxy")
            .arg(&proxy)
            .arg("--cache-dir")
            .arg(&cache),
    )?;

    step("what libvirt says (virsh inside the namespace)");
    let uri = libvirtd.qemu_uri();
    print!("{}", libvirtd.virsh(&uri, &["list", "--all"])?);
    let name = format!("egress-{DEMO_UID}");
    let state = libvirtd.virsh(&uri, &["domstate", "--reason", &name])?;
    print!("    state: {state}");
    if !state.starts_with("running") {
        // Show QEMU's own log (inside the daemon's private mounts) to say why.
        if let Some(pid) = libvirtd.libvirtd_pid() {
            let log = Command::new("nsenter")
                .args(["-t", &pid.to_string(), "-m", "cat"])
                .arg(format!("/var/log/libvirt/qemu/{name}.log"))
                .output();
            if let Ok(o) = log {
                println!("    QEMU log:\n{}", String::from_utf8_lossy(&o.stdout));
            }
        }
    }
    print!("{}", libvirtd.virsh(&uri, &["vol-list", "default"])?);
    if let Ok(o) = libvirtd
        .in_netns("ip")
        .args(["neigh", "show", "dev", libvirtd.bridge()])
        .output()
    {
        println!(
            "    neighbours on {}: {}",
            libvirtd.bridge(),
            String::from_utf8_lossy(&o.stdout).trim()
        );
    }
    // The guest's address as the DHCP server handed it out. (libvirt reports addresses
    // from its own networks' leases, the guest agent, or the ARP table; libvirt 9.0's ARP
    // reader fails on recent kernels with "wrong nlmsg len", so on such hosts the
    // provider reports none for a plain bridge and says so rather than guessing.)
    match std::fs::read_to_string(&leases) {
        Ok(l) if !l.trim().is_empty() => {
            for lease in l.lines() {
                let f: Vec<&str> = lease.split_whitespace().collect();
                if let [_, mac, ip, host, ..] = f.as_slice() {
                    println!("    DHCP lease: {ip} for {mac} ({host})");
                }
            }
        }
        _ => println!("    DHCP lease: none yet (the guest is still booting)"),
    }

    step("egress-operator provision --delete: remove it again");
    run_shown(
        Command::new(&operator)
            .args(["provision", "--delete"])
            .arg("--config")
            .arg(&config)
            .arg("--proxy")
            .arg(&proxy),
    )?;
    let domains = libvirtd.virsh(&uri, &["list", "--all", "--name"])?;
    let volumes = libvirtd.virsh(&uri, &["vol-list", "default"])?;
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

    step("stopping dnsmasq, libvirtd and sshd");
    drop(dnsmasq);
    drop(libvirtd);
    drop(sshd);
    println!("demo finished: created, inspected and deleted one proxy VM; nothing left");
    Ok(())
}
