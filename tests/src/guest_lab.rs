//! The proxy lab: everything a real proxy VM needs to be provisioned and used on one
//! machine, with nothing reaching outside it. `make demo` and the end-to-end test
//! (`tests/tests/guest_e2e.rs`) share it, so the demo shows exactly what the test proves.
//!
//! - OpenSSH's sshd on 127.0.0.1 and an isolated libvirtd in its own network namespace;
//! - the namespace's bridge `10.213.K.0/24`: `.1` is the client side and the gateway,
//!   `.2` a client outside the proxy's allowed CIDRs; static addresses come from
//!   `.10-.49`, dnsmasq (when asked for) leases `.50-.99`;
//! - inside the namespace, on `.1`: an HTTP server (`:8080`, the request the proxy must
//!   carry) and a TCP listener on `:443` (the target of the operator's CONNECT probe);
//! - a route from here into the namespace ([`NamespaceRoute`]), so the operator reaches
//!   the VM's proxy port as it would on a real bridge; the namespace routes nothing else;
//! - the image, served from a loopback HTTP server.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

use crate::harness::node::{self, HOST_ADDRESS, POD_NET};
use crate::harness::{Libvirtd, NamespaceLink, NamespaceRoute, Sshd, subnet_index};
use crate::http::{HttpServer, Route};

/// The body the namespace's HTTP server answers with: a proxied response carries it.
pub const HELLO: &str = "hello from inside the namespace, fetched through the proxy VM";

/// What the proxy listens on (the default vendor-data plugin's `listenPort`).
pub const PROXY_PORT: u16 = 3128;

/// A child process killed (and reaped) on drop.
#[derive(Debug)]
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The lab. Fields drop in declaration order: the namespace's servers first, the
/// daemons last.
#[derive(Debug)]
pub struct GuestLab {
    /// Held for its drop: stops the namespace's servers.
    _servers: Killed,
    dnsmasq: Option<Killed>,
    /// The veth from the node tier's namespace, for a lab on the node.
    node_link: Option<NamespaceLink>,
    route: NamespaceRoute,
    image_server: HttpServer,
    image_sha256: String,
    /// The isolated libvirtd.
    pub libvirtd: Libvirtd,
    /// The sshd the operator logs in to.
    pub sshd: Sshd,
    k: u8,
    work: TempDir,
}

impl GuestLab {
    /// Starts the lab for `image` (a qcow2); `dhcp` adds dnsmasq on the bridge.
    pub fn start(image: &Path, dhcp: bool) -> Result<Self> {
        Self::start_on(image, dhcp, Ipv4Addr::LOCALHOST)
    }

    /// [`GuestLab::start`] with sshd and the image server on `listen` (the node tier's
    /// host address, which an operator in a pod reaches) instead of loopback.
    pub fn start_on(image: &Path, dhcp: bool, listen: Ipv4Addr) -> Result<Self> {
        let sshd = Sshd::start_on(listen)?;
        let libvirtd = Libvirtd::start()?;
        libvirtd.define_dir_pool("default")?;
        let k = subnet_index()?;
        let ns = libvirtd.netns().to_string();
        let bridge = libvirtd.bridge().to_string();
        for addr in [format!("10.213.{k}.1/24"), format!("10.213.{k}.2/24")] {
            run(libvirtd
                .in_netns("ip")
                .args(["addr", "add", &addr, "dev", &bridge]))?;
        }
        let route = NamespaceRoute::start(&ns, &format!("10.213.{k}.0/24"), k)?;
        let work = crate::harness::temp_dir_with_owner("egress-lab")?;
        let servers = Killed(
            libvirtd
                .in_netns("python3")
                .arg("-c")
                .arg(SERVERS_PY)
                .arg(HELLO)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(std::fs::File::create(
                    work.path().join("servers.log"),
                )?))
                .spawn()
                .context("starting python3 (the namespace's HTTP server) inside the namespace")?,
        );
        let dnsmasq = if dhcp {
            Some(Killed(
                libvirtd
                    .in_netns("dnsmasq")
                    .args([
                        "--keep-in-foreground",
                        "--no-daemon",
                        "--conf-file=/dev/null",
                        "--no-resolv",
                        "--no-hosts",
                        "--bind-interfaces",
                        "--except-interface=lo",
                        &format!("--interface={bridge}"),
                        &format!("--dhcp-range=10.213.{k}.50,10.213.{k}.99,255.255.255.0,1h"),
                        &format!("--dhcp-leasefile={}", work.path().join("leases").display()),
                        &format!("--pid-file={}", work.path().join("dnsmasq.pid").display()),
                    ])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting dnsmasq inside the namespace")?,
            ))
        } else {
            None
        };
        let bytes = std::fs::read(image).with_context(|| format!("reading {}", image.display()))?;
        let image_sha256 = crate::sha256_hex(&bytes);
        drop(bytes);
        let image_server = HttpServer::start_on(
            listen,
            vec![("/guest.qcow2".into(), Route::File(image.to_path_buf()))],
        )?;
        let lab = Self {
            _servers: servers,
            dnsmasq,
            node_link: None,
            route,
            image_server,
            image_sha256,
            libvirtd,
            sshd,
            k,
            work,
        };
        lab.wait_for_servers()?;
        Ok(lab)
    }

    /// The lab for the node tier (which must be up): sshd and the image server on the
    /// node tier's host address, where the operator's pods reach them, and a veth from the
    /// node's namespace to libvirtd's, so pods reach the VMs' bridge and the VMs answer the
    /// pods; neither namespace gains a default route.
    pub fn start_for_node(image: &Path) -> Result<Self> {
        let mut lab = Self::start_on(image, false, HOST_ADDRESS)?;
        lab.node_link = Some(NamespaceLink::start(
            node::NETNS,
            lab.libvirtd.netns(),
            lab.k,
            &[&lab.bridge_net()],
            &[POD_NET],
        )?);
        Ok(lab)
    }

    /// The providers config for an operator running as its Deployment on the node tier
    /// ([`GuestLab::start_for_node`]): [`GuestLab::config_yaml`] with a static pool and
    /// CONNECT to 443, the pods allowed as clients, and the key, known_hosts and plugins
    /// at the paths the Deployment mounts and the image holds. Returns (the config as a
    /// process here would read it, for `validate-config`; the config as shipped).
    pub fn node_config_yaml(&self, plugins: &Path) -> (String, String) {
        let local = self.config_yaml_for(true, plugins, &[443], &[POD_NET]);
        let shipped = crate::installed::as_shipped(&local, &self.sshd, plugins);
        (local, shipped)
    }

    /// The lab's subnet index `K` (see [`crate::harness::subnet_index`]).
    pub fn subnet(&self) -> u8 {
        self.k
    }

    /// The bridge network, `10.213.K.0/24`.
    pub fn bridge_net(&self) -> String {
        format!("10.213.{}.0/24", self.k)
    }

    /// The client side of the bridge and the guests' gateway (`.1`); the namespace's
    /// servers listen here.
    pub fn client(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.k, 1)
    }

    /// A client on the bridge that the proxy must refuse (`.2`).
    pub fn outsider(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.k, 2)
    }

    /// Where the operator's probes come from (this side of the route).
    pub fn operator_side(&self) -> Ipv4Addr {
        self.route.root_address()
    }

    /// The URL a proxied request fetches.
    pub fn hello_url(&self) -> String {
        format!("http://{}:8080/hello", self.client())
    }

    /// The work directory (configs, logs).
    pub fn dir(&self) -> &Path {
        self.work.path()
    }

    /// Whether dnsmasq was started.
    pub fn has_dhcp(&self) -> bool {
        self.dnsmasq.is_some()
    }

    /// A providers config: one host `local` (static addresses from `.10-.49` when
    /// `static_pool`), the image, a machine type that fits the guest, the default
    /// plugins with the proxy allowing `.1` and the operator's side as clients and `.1`
    /// as the one allowed destination on the bridge, air-gapped, and the probe CONNECTing
    /// to `.1:443`. The proxy tunnels (CONNECT) only to `connect_ports`.
    pub fn config_yaml(&self, static_pool: bool, plugins: &Path, connect_ports: &[u16]) -> String {
        self.config_yaml_for(static_pool, plugins, connect_ports, &[])
    }

    /// [`GuestLab::config_yaml`] with `more_clients` (CIDRs, e.g. the node tier's pods)
    /// allowed to use the proxy too.
    pub fn config_yaml_for(
        &self,
        static_pool: bool,
        plugins: &Path,
        connect_ports: &[u16],
        more_clients: &[&str],
    ) -> String {
        let k = self.k;
        let more_clients: String = more_clients.iter().map(|c| format!(", {c}")).collect();
        let connect_ports = connect_ports
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let pool = if static_pool {
            format!(
                "\n      addressPool: {{cidr: 10.213.{k}.0/24, gateway: 10.213.{k}.1, \
                 rangeStart: 10.213.{k}.10, rangeEnd: 10.213.{k}.49}}\n      maxDomains: 8"
            )
        } else {
            String::new()
        };
        format!(
            r#"clusterId: lab
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
      disableKvm: true{pool}
  images:
    - name: debian-12
      url: {url}
      sha256: {sha}
      format: qcow2
      maxSizeMiB: 2048
      # The image server is on this machine, over plain http: allowed for this entry only.
      allowHttp: true
      allowPrivateAddresses: true
  machineTypes:
    - {{name: small, vcpus: 1, memoryMiB: 768, diskGiB: 3}}
  defaults: {{machineType: small, image: debian-12}}
  templates:
    domain: {{path: {plugins}/domain-default.wasm}}
    vendorData:
      path: {plugins}/vendor-data-default.wasm
      settings:
        listenPort: {PROXY_PORT}
        allowedClientCidrs: [{client}/32, {operator}/32{more_clients}]
        allowedDestinationCidrs: [{client}/32]
        connectPorts: [{connect_ports}]
        installPackages: false
serving:
  port: {PROXY_PORT}
  target: "{client}:443"
  timeoutSeconds: 5
  periodSeconds: 30
"#,
            user = self.sshd.user(),
            key = self.sshd.client_key().display(),
            known = self.sshd.known_hosts().display(),
            address = self.sshd.address(),
            socket = self.libvirtd.socket_path().display(),
            bridge = self.libvirtd.bridge(),
            url = self.image_server.url("/guest.qcow2"),
            sha = self.image_sha256,
            plugins = plugins.display(),
            client = self.client(),
            operator = self.operator_side(),
        )
    }

    /// `curl` inside the namespace from `from` through the proxy at `proxy`: the HTTP
    /// status and body. `connect` uses a CONNECT tunnel (`-p`) to `url`'s host and port,
    /// and the status is then the proxy's answer to the CONNECT (200: the tunnel is up),
    /// not the tunnelled request's: what a test of the proxy's refusals must look at.
    pub fn curl_via(
        &self,
        proxy: Ipv4Addr,
        from: Ipv4Addr,
        url: &str,
        connect: bool,
    ) -> Result<(u16, String)> {
        let mut cmd = self.libvirtd.in_netns("curl");
        let status = if connect {
            "\n%{http_connect}"
        } else {
            "\n%{http_code}"
        };
        cmd.args(["-sS", "--max-time", "30", "--noproxy", "", "-o", "-"])
            .args(["-w", status, "--interface", &from.to_string()])
            .args(["-x", &format!("http://{proxy}:{PROXY_PORT}")]);
        if connect {
            cmd.arg("-p");
        }
        let out = cmd
            .arg(url)
            .output()
            .context("running curl inside the namespace")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", text.as_str()));
        let code: u16 = code.trim().parse().unwrap_or(0);
        if code == 0 && !out.status.success() && !connect {
            bail!(
                "curl through {proxy}:{PROXY_PORT} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok((code, body.to_string()))
    }

    /// The DHCP leases dnsmasq handed out, as `(mac, ip)`.
    pub fn leases(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(self.work.path().join("leases"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f.as_slice() {
                    [_, mac, ip, ..] => Some((mac.to_string(), ip.to_string())),
                    _ => None,
                }
            })
            .collect()
    }

    /// The guest image's default location (built by `make guest-image`).
    pub fn default_image() -> PathBuf {
        crate::target_dir().join("guest").join("debian-12.qcow2")
    }

    fn wait_for_servers(&self) -> Result<()> {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self
                .libvirtd
                .in_netns("curl")
                .args([
                    "-sS",
                    "--max-time",
                    "2",
                    "--noproxy",
                    "*",
                    &self.hello_url(),
                ])
                .output()?;
            if out.status.success() && String::from_utf8_lossy(&out.stdout).contains(HELLO) {
                return Ok(());
            }
            if Instant::now() > until {
                bail!(
                    "the namespace's HTTP server did not answer at {}: {}",
                    self.hello_url(),
                    std::fs::read_to_string(self.work.path().join("servers.log"))
                        .unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The namespace's servers, on every address of the namespace (`.1` and `.2` of the
/// bridge): `:8080` answers every GET with the hello text and the address the request came
/// from (the proxy VM that carried it); `:443` accepts TCP and closes
/// (all a CONNECT probe needs: the proxy answers 200 once its connection to the target
/// is up). Listening on `.2` too lets a test tell "the proxy refused a bridge
/// destination" from "nothing listens there".
const SERVERS_PY: &str = r#"
import http.server, socket, sys, threading
hello = sys.argv[1].encode()
addr = ""
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = hello + b" (from " + self.client_address[0].encode() + b")\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        sys.stderr.write("%s %s\n" % (self.client_address[0], self.requestline))
def tls_port():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 443))
    s.listen(64)
    while True:
        c, peer = s.accept()
        sys.stderr.write("443 from %s\n" % (peer[0],))
        c.close()
threading.Thread(target=tls_port, daemon=True).start()
http.server.ThreadingHTTPServer((addr, 8080), H).serve_forever()
"#;

/// What a finished process printed.
#[derive(Debug)]
pub struct Finished {
    /// Exit code (-1 when killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `cmd` to completion, draining both pipes on threads (a chatty process never
/// blocks on a full pipe). A process still running after `hang_guard` is killed and
/// reported as an error naming `what`: a hang fails instead of blocking CI. Never a
/// timing assertion: the guard is generous.
pub fn run_guarded(cmd: &mut Command, hang_guard: Duration, what: &str) -> Result<Finished> {
    use std::io::Read as _;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let mut stdout = child.stdout.take().context("stdout pipe")?;
    let mut stderr = child.stderr.take().context("stderr pipe")?;
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > hang_guard {
            let _ = child.kill();
            let _ = child.wait();
            let tail = err.join().unwrap_or_default();
            let tail = &tail[tail.len().saturating_sub(4000)..];
            bail!("hang guard: {what} did not finish within {hang_guard:?}; stderr tail:\n{tail}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Ok(Finished {
        code: status.code().unwrap_or(-1),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}
