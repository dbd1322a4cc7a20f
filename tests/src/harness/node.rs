//! The node tier: a one-node Kubernetes cluster (etcd, kube-apiserver, the controllers,
//! kube-scheduler, kubelet, kube-proxy, containerd) that runs pods, started by
//! `scripts/node.sh`. It is the tier where the operator runs from its image as its
//! Deployment, and where workloads send traffic through the pools' Services.
//!
//! - [`Node::shared`] starts one per test binary on first use. One node runs per machine
//!   (kubelet's cgroups, sysctls and some paths are machine-wide), so a second test binary
//!   waits in `node.sh up` for the first one's teardown.
//! - Nothing is left behind: a watchdog process waits for the test process to end,
//!   whatever way it ended, then runs `node.sh down`, which checks what is left and says so.
//! - The node sits in its own network namespace; the host reaches it over one veth at
//!   [`HOST_ADDRESS`]. Pods and Service IPs are routed from the host into that namespace,
//!   and nothing routes out of it.
//!
//! There is no `KUBECONFIG` path here: this tier needs a node it controls (it deletes pods
//! under traffic and checks the machine after teardown), so it always starts its own.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};

use super::controlplane::{binaries_dir, client_for};
use super::process;

/// The host's end of the veth into the node's namespace: the API server listens here, and
/// pods reach the host (an sshd, a libvirtd, an HTTP server) at this address.
pub const HOST_ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 245, 0, 1);
/// The lab's range: local to the host (a `local` route) and routed from the node's
/// namespace to [`HOST_ADDRESS`], so stand-ins for proxy VMs can listen on addresses that
/// the operator's probe and the pods' traffic reach. Nothing else is in it.
pub const LAB_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 247, 0, 0), 24);

/// Whether `ip` is in [`LAB_NET`].
pub fn in_lab_net(ip: Ipv4Addr) -> bool {
    let (net, len) = LAB_NET;
    u32::from(ip) >> (32 - len) == u32::from(net) >> (32 - len)
}

/// The node's network namespace (made by `scripts/node.sh up`).
pub const NETNS: &str = "eotest-node";
/// The pods' network, on the node's bridge.
pub const POD_NET: &str = "10.244.0.0/24";

/// The node's name as the API server knows it.
pub const NODE_NAME: &str = "eotest-node";
/// The busybox image every node has imported (`sh`, `httpd`, `nc`, ...).
pub const BUSYBOX_IMAGE: &str = "localhost/eotest/busybox:1";
/// Prefix of a node's directory in the temp dir: `eotest-node-<pid>-<random>`.
const DIR_PREFIX: &str = "eotest-node-";

/// Runs `node.sh down DIR` once the test process is gone. `setsid` keeps it out of a
/// Ctrl-C to the test's process group, and it ignores the signals that end a session. An
/// orderly [`Node::down`] removes DIR first; the loop then ends and `down` finds nothing.
const WATCHDOG: &str = r#"
trap '' TERM HUP INT
owner="$1"; script="$2"; dir="$EOTEST_NODE_DIR"
[ -n "$dir" ] || exit 1
while kill -0 "$owner" 2>/dev/null && [ -d "$dir" ]; do sleep 0.2; done
exec bash "$script" down "$dir" >/dev/null 2>&1
"#;

/// A running node tier, torn down by [`Node::down`] or, for the shared one, by its
/// watchdog when the test process ends.
#[derive(Debug)]
pub struct Node {
    dir: PathBuf,
    kubeconfig: PathBuf,
    kubectl: PathBuf,
}

static SHARED: OnceLock<std::result::Result<Node, String>> = OnceLock::new();

impl Node {
    /// The node this test binary's tests share, started on first use. Blocks while it
    /// starts (seconds once the images are cached); call it before heavy async work.
    pub fn shared() -> Result<&'static Node> {
        SHARED
            .get_or_init(|| Self::start().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("the node tier did not start: {e}"))
    }

    /// A node of the caller's own: call [`Node::down`] to stop it (its watchdog stops it
    /// when the process ends otherwise).
    pub fn start() -> Result<Node> {
        let binaries = binaries_dir()?;
        let dir =
            std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{}", std::process::id(), unique()));
        let script = crate::workspace_root().join("scripts/node.sh");
        // The watchdog first: a test process killed while `up` runs still gets its `down`.
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Command::new("setsid")
            .args(["bash", "-c", WATCHDOG, "watchdog"])
            .arg(std::process::id().to_string())
            .arg(&script)
            .env("EOTEST_NODE_DIR", &dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start the node's watchdog (setsid, bash)")?;
        let out = process::output(
            Command::new("bash")
                .arg(&script)
                .arg("up")
                .arg(&dir)
                .arg(&binaries)
                .env("NODE_OWNER_PID", std::process::id().to_string())
                .stderr(Stdio::piped()),
        )?;
        if !out.status.success() {
            bail!(
                "scripts/node.sh up failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let kubeconfig = stdout
            .lines()
            .last()
            .map(|l| PathBuf::from(l.trim()))
            .ok_or_else(|| anyhow!("scripts/node.sh up printed no kubeconfig"))?;
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        Ok(Node {
            dir,
            kubeconfig,
            kubectl: binaries.join("kubectl"),
        })
    }

    /// Stops everything and checks the machine: an error lists what was left behind.
    pub fn down(self) -> Result<()> {
        down(&self.dir)
    }

    /// The node's directory: state, logs (`logs/`), kubeconfigs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The admin's kubeconfig (`system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// `kubectl` with the admin's kubeconfig.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(&self.kubectl);
        cmd.env("KUBECONFIG", &self.kubeconfig);
        cmd
    }

    /// Runs `kubectl ARGS` as the admin and returns its stdout; a failure names the command
    /// and carries kubectl's stderr.
    pub fn kubectl_run(&self, args: &[&str]) -> Result<String> {
        process::run(self.kubectl().args(args))
    }

    /// `kubectl apply -f -` of `manifest`, as the admin.
    pub fn apply(&self, manifest: &str) -> Result<String> {
        use std::io::Write as _;
        let mut child = self
            .kubectl()
            .args(["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run kubectl")?;
        child
            .stdin
            .take()
            .ok_or_else(|| anyhow!("kubectl has no stdin"))?
            .write_all(manifest.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl apply failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A client as the admin.
    pub async fn client(&self) -> Result<kube::Client> {
        client_for(&self.kubeconfig).await
    }

    /// Imports an OCI archive (from [`images`]) into the node's containerd, where the
    /// kubelet finds it: nothing is pulled here, so pods use `imagePullPolicy: Never` or
    /// `IfNotPresent` with an imported name.
    pub fn import_image(&self, archive: &Path) -> Result<()> {
        process::run(
            Command::new("ctr")
                .arg("--address")
                .arg(self.dir.join("run/containerd/containerd.sock"))
                .args(["-n", "k8s.io", "images", "import"])
                .arg(archive),
        )?;
        Ok(())
    }

    /// The last `lines` lines of a daemon's log (`kubelet`, `containerd`, `kube-proxy`,
    /// `kube-apiserver`, ...), for failure messages.
    pub fn log_tail(&self, daemon: &str, lines: usize) -> String {
        process::tail(&self.dir.join("logs").join(format!("{daemon}.log")), lines)
    }
}

/// The operator image (built from the Dockerfile, with `binary` as its operator) and the
/// workload image (curl), as OCI archives: `scripts/operator-image.sh`, once per process.
/// Returns the directory holding `egress-operator.tar` and `workload.tar`.
pub fn images(binary: &Path) -> Result<&'static Path> {
    static DIR: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = crate::target_dir().join("node-images");
        let script = crate::workspace_root().join("scripts/operator-image.sh");
        process::run(
            Command::new("bash")
                .arg(&script)
                .arg(&out)
                .arg(binary)
                .arg(crate::target_dir().join("plugins"))
                .stderr(Stdio::inherit()),
        )
        .map(|_| out)
        .map_err(|e| format!("{e:#}"))
    })
    .as_deref()
    .map_err(|e| anyhow!("the node tier's images: {e}"))
}

/// `node.sh down DIR`: an error carries its report of what was left behind.
pub fn down(dir: &Path) -> Result<()> {
    let script = crate::workspace_root().join("scripts/node.sh");
    let out = process::output(Command::new("bash").arg(&script).arg("down").arg(dir))?;
    if !out.status.success() {
        bail!(
            "scripts/node.sh down {} failed ({}):\n{}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `node.sh leftovers DIR`: what a node in DIR left on the machine, if anything.
pub fn leftovers(dir: &Path) -> Result<Option<String>> {
    let script = crate::workspace_root().join("scripts/node.sh");
    let out = process::output(Command::new("bash").arg(&script).arg("leftovers").arg(dir))?;
    Ok((!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// A short random suffix, so a node's directory is never reused.
fn unique() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{nanos:08x}")
}
