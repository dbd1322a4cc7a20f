//! A real Kubernetes control plane for the cluster tier: etcd, kube-apiserver and the
//! namespace and garbage-collector controllers of kube-controller-manager, built here from
//! their Go modules (`scripts/controlplane.sh`) and started on loopback, as
//! controller-runtime's envtest does, with RBAC on.
//!
//! - [`ControlPlane::shared`] starts one per test binary on first use; tests share it, each
//!   in its own [`TestNamespace`]. [`ControlPlane::start`] gives a test one of its own (to
//!   restart the API server, or to run an operator that watches every namespace).
//! - With `KUBECONFIG` set, both return that cluster instead (kind, k3d): nothing is
//!   started, and what only a local plane can do ([`ControlPlane::restart_apiserver`]) is
//!   an error.
//! - Nothing is left behind: a dedicated plane stops on drop; the shared one, and any plane
//!   of a test process that was killed, is stopped by a watchdog process that waits for the
//!   test process to end, then kills the daemons and removes their directory.
//!
//! Identities: an admin (client certificate in `system:masters`), and any ServiceAccount
//! through a token from the TokenRequest API ([`ControlPlane::service_account_kubeconfig`]),
//! so the operator runs with exactly the RBAC that `config/rbac` grants it.
//!
//! ```no_run
//! # async fn t() -> anyhow::Result<()> {
//! use integration_tests::harness::ControlPlane;
//! let cp = ControlPlane::shared()?;
//! cp.install_crds().await?;
//! let ns = cp.namespace("example").await?;
//! let client = cp.client().await?;
//! # let _ = (ns.name(), client);
//! # Ok(())
//! # }
//! ```

use std::fs;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tempfile::TempDir;

use super::process::{self, LOG_TAIL_LINES};
use super::{owner_is_gone, remove_stale_temp_dirs, temp_dir_with_owner};

/// Prefix of a local plane's directory (certificates, etcd's data, logs, kubeconfigs).
const DIR_PREFIX: &str = "eotest-cp-";
/// How long the API server may take to answer `/readyz`: it bootstraps RBAC roles and
/// priority levels on a fresh etcd in 5-15 s; the rest is headroom for a busy machine.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long etcd may take to accept clients.
const ETCD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long stopped daemons get to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How often a start is retried on fresh ports when another process took one of them.
const PORT_ATTEMPTS: usize = 3;
/// How long a ServiceAccount token is valid: longer than any test run.
const TOKEN_DURATION: &str = "12h";
/// The range the API server allocates Service cluster IPs from. Nothing routes there: no
/// kube-proxy runs, and tests never send traffic to a cluster IP.
const SERVICE_CIDR: &str = "10.0.0.0/24";
/// The operator's ServiceAccount as `config/rbac` ships it.
pub const OPERATOR_NAMESPACE: &str = "egress-system";
/// See [`OPERATOR_NAMESPACE`].
pub const OPERATOR_SERVICE_ACCOUNT: &str = "egress-operator";

/// The operator's ServiceAccount as the API server names it in its audit log.
pub fn operator_user() -> String {
    format!("system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SERVICE_ACCOUNT}")
}

/// Kills the daemons and removes the plane's directory once the test process is gone,
/// whatever way it ended. `setsid` keeps it out of a Ctrl-C to the test's process group,
/// and it ignores the signals that end a session, so the daemons (kube-apiserver hangs in
/// its graceful shutdown once etcd is gone) are always killed.
///
/// The daemons are found by their command lines, which all name the directory, not by the
/// PID files in it: the directory can vanish under a dead owner before the watchdog looks
/// (the next test binary's stale sweep removes it within the poll), and a watchdog that
/// took a missing directory for an orderly stop leaked every daemon. After an orderly stop
/// (the daemons stopped, then the directory removed) the scan finds nothing. The directory
/// comes in the environment, not in argv, so the scan cannot match the watchdog itself; the
/// scan uses only builtins, so no helper process of ours is on the list either.
const WATCHDOG: &str = r#"
trap '' TERM HUP INT
owner="$1"; dir="$EOTEST_PLANE_DIR"
[ -n "$dir" ] || exit 1
while kill -0 "$owner" 2>/dev/null && [ -d "$dir" ]; do sleep 0.2; done
for p in /proc/[0-9]*; do
  mapfile -d '' args 2>/dev/null < "$p/cmdline" || continue
  case "${args[*]}" in *"$dir/"*) kill -KILL "${p#/proc/}" 2>/dev/null;; esac
done
sleep 1
rm -rf "$dir"
"#;

/// Metadata of every request once it is answered: who, what, and the status code.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Metadata
";

/// One request as the API server's audit log recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditedRequest {
    /// `system:serviceaccount:NS:NAME`, `admin`, ...
    pub user: String,
    /// get, list, watch, create, update, patch, delete, deletecollection.
    pub verb: String,
    /// API group ("" for core).
    pub group: String,
    /// Resource, with `/subresource` when there is one (`proxies/status`).
    pub resource: String,
    /// Namespace, if namespaced.
    pub namespace: Option<String>,
    /// Object name, if the request named one.
    pub name: Option<String>,
    /// The HTTP status code of the answer.
    pub code: u16,
    /// The request URI.
    pub uri: String,
    /// When the API server received it (the audit event's `requestReceivedTimestamp`,
    /// RFC 3339).
    pub received: Option<String>,
}

/// A Kubernetes API server the tests talk to: a local one we started, or the cluster of
/// `KUBECONFIG`.
#[derive(Debug)]
pub struct ControlPlane {
    kubeconfig: PathBuf,
    kubectl: PathBuf,
    local: Option<Local>,
    /// Kubeconfigs of ServiceAccounts, written once per account.
    tokens: Mutex<Vec<(String, PathBuf)>>,
    /// Where ServiceAccount kubeconfigs of an external cluster go.
    scratch: TempDir,
    /// Whether this process applied the CRDs already: each test calls
    /// [`ControlPlane::install_crds`], and applying them again while another test has
    /// changed a CRD on purpose (a newer version's field) would undo that mid-test.
    crds_installed: tokio::sync::Mutex<bool>,
    /// Whether this process applied the operator's namespace and RBAC already: tests that
    /// applied them at once raced (`kubectl apply` read, then both created the namespace,
    /// and one got `AlreadyExists`).
    rbac_installed: Mutex<bool>,
}

#[derive(Debug)]
struct Local {
    dir: TempDir,
    binaries: PathBuf,
    server: String,
    etcd: Mutex<Option<Child>>,
    apiserver: Mutex<Option<Child>>,
    controllers: Mutex<Option<Child>>,
    apiserver_args: Vec<String>,
}

static SHARED: OnceLock<std::result::Result<ControlPlane, String>> = OnceLock::new();

impl ControlPlane {
    /// The control plane this test binary's tests share: started on first use (or the
    /// `KUBECONFIG` cluster). Blocks while it starts; call it before heavy async work.
    pub fn shared() -> Result<&'static ControlPlane> {
        SHARED
            .get_or_init(|| Self::start().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("the shared control plane did not start: {e}"))
    }

    /// A control plane of the caller's own (or the `KUBECONFIG` cluster), stopped on drop.
    pub fn start() -> Result<ControlPlane> {
        let binaries = binaries_dir()?;
        let kubectl = binaries.join("kubectl");
        let scratch = temp_dir_with_owner("eotest-kube-")?;
        if let Some(path) = external_kubeconfig() {
            return Ok(ControlPlane {
                kubeconfig: path,
                kubectl,
                local: None,
                tokens: Mutex::new(Vec::new()),
                crds_installed: tokio::sync::Mutex::new(false),
                rbac_installed: Mutex::new(false),
                scratch,
            });
        }
        remove_stale_planes();
        remove_stale_temp_dirs("eotest-kube-");
        let mut last = None;
        for _ in 0..PORT_ATTEMPTS {
            match Local::start(&binaries) {
                Ok((local, kubeconfig)) => {
                    return Ok(ControlPlane {
                        kubeconfig,
                        kubectl,
                        local: Some(local),
                        tokens: Mutex::new(Vec::new()),
                        crds_installed: tokio::sync::Mutex::new(false),
                        rbac_installed: Mutex::new(false),
                        scratch,
                    });
                }
                Err(e) => {
                    eprintln!(
                        "control plane: start attempt failed (retrying on fresh ports): {e:#}"
                    );
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow!("no start attempt")))
    }

    /// Whether this is a plane we started (not a `KUBECONFIG` cluster).
    pub fn is_local(&self) -> bool {
        self.local.is_some()
    }

    /// The admin kubeconfig (cluster-admin rights).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The kubectl built with the API server (same version), for tests and the demo.
    pub fn kubectl_path(&self) -> &Path {
        &self.kubectl
    }

    /// `kubectl` as the admin.
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

    /// A client acting as the admin.
    pub async fn client(&self) -> Result<kube::Client> {
        client_for(&self.kubeconfig).await
    }

    /// A client from any kubeconfig file (a ServiceAccount's, say).
    pub async fn client_for(&self, kubeconfig: &Path) -> Result<kube::Client> {
        client_for(kubeconfig).await
    }

    /// Applies `config/crd/bases` by server-side apply, as a platform team would, and waits
    /// until every CRD there is Established; once per process (later calls return at once:
    /// see [`ControlPlane::reinstall_crds`]).
    pub async fn install_crds(&self) -> Result<()> {
        let mut installed = self.crds_installed.lock().await;
        if !*installed {
            self.reinstall_crds().await?;
            *installed = true;
        }
        Ok(())
    }

    /// Applies `config/crd/bases` again, even if this process did already (to put back
    /// a CRD a test changed), and waits until they are established.
    pub async fn reinstall_crds(&self) -> Result<()> {
        let crds = crate::workspace_root().join("config/crd/bases");
        let crds = crds.to_string_lossy();
        self.kubectl_run(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=egress-operator-tests",
            "-f",
            &crds,
        ])?;
        self.kubectl_run(&[
            "wait",
            "--for=condition=Established",
            "--timeout=120s",
            "-f",
            &crds,
        ])?;
        Ok(())
    }

    /// Creates the operator's namespace and applies `config/rbac` as shipped (kustomize);
    /// once per process, the tests that call it at once wait for the first.
    pub fn install_rbac(&self) -> Result<()> {
        let mut installed = self
            .rbac_installed
            .lock()
            .map_err(|_| anyhow!("rbac flag poisoned"))?;
        if *installed {
            return Ok(());
        }
        let namespace = crate::workspace_root().join("config/manager/namespace.yaml");
        self.kubectl_run(&["apply", "-f", &namespace.to_string_lossy()])?;
        let rbac = crate::workspace_root().join("config/rbac");
        self.kubectl_run(&["apply", "-k", &rbac.to_string_lossy()])?;
        *installed = true;
        Ok(())
    }

    /// A kubeconfig acting as ServiceAccount `namespace/name`, with a token from the
    /// TokenRequest API. The account must exist.
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let key = format!("{namespace}/{name}");
        let mut tokens = self
            .tokens
            .lock()
            .map_err(|_| anyhow!("token cache poisoned"))?;
        if let Some((_, path)) = tokens.iter().find(|(k, _)| *k == key) {
            return Ok(path.clone());
        }
        let token = self.kubectl_run(&[
            "create",
            "token",
            name,
            "-n",
            namespace,
            &format!("--duration={TOKEN_DURATION}"),
        ])?;
        let token = token.trim();
        anyhow::ensure!(!token.is_empty(), "kubectl create token printed no token");
        let view = self.kubectl_run(&["config", "view", "--raw", "--minify", "-o", "json"])?;
        let view: serde_json::Value =
            serde_json::from_str(&view).context("kubectl config view printed no JSON")?;
        let cluster = view["clusters"][0]["cluster"].clone();
        let config = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": key, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": key, "namespace": namespace}}],
            "current-context": "test",
        });
        let dir = match &self.local {
            Some(local) => local.dir.path(),
            None => self.scratch.path(),
        };
        let path = dir.join(format!("kubeconfig-{namespace}-{name}.json"));
        write_private(&path, serde_json::to_string_pretty(&config)?.as_bytes())?;
        tokens.push((key, path.clone()));
        Ok(path)
    }

    /// The operator's ServiceAccount (`egress-system/egress-operator`) after
    /// [`install_rbac`](Self::install_rbac).
    pub fn operator_kubeconfig(&self) -> Result<PathBuf> {
        self.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT)
    }

    /// A fresh namespace `PREFIX-<suffix>`, deleted when the handle drops.
    pub async fn namespace(&self, prefix: &str) -> Result<TestNamespace> {
        let name = format!("{prefix}-{}", suffix());
        let manifest = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/created-by": "egress-operator-tests"}},
        });
        let mut child = self
            .kubectl()
            .args(["create", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot run kubectl")?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(manifest.to_string().as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "creating namespace {name}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(TestNamespace {
            name,
            kubectl: self.kubectl.clone(),
            kubeconfig: self.kubeconfig.clone(),
        })
    }

    /// The API server's URL.
    pub fn server(&self) -> Result<String> {
        match &self.local {
            Some(local) => Ok(local.server.clone()),
            None => {
                let url = self.kubectl_run(&[
                    "config",
                    "view",
                    "--minify",
                    "-o",
                    "jsonpath={.clusters[0].cluster.server}",
                ])?;
                Ok(url.trim().to_string())
            }
        }
    }

    /// Stops kube-apiserver and starts it again on the same port and etcd (watches end;
    /// clients must resume). Only for a local plane of the caller's own.
    pub fn restart_apiserver(&self) -> Result<()> {
        let local = self
            .local
            .as_ref()
            .ok_or_else(|| anyhow!("cannot restart the API server of an external cluster"))?;
        local.stop_apiserver()?;
        local.spawn_apiserver()?;
        local.wait_ready(&self.kubectl, &self.kubeconfig)
    }

    /// How many requests of the operator's ServiceAccount so far `keep` holds for (0 on an
    /// external cluster, whose audit log is not ours to read).
    pub fn operator_requests(&self, keep: impl Fn(&AuditedRequest) -> bool) -> Result<usize> {
        let user = operator_user();
        Ok(self.audit()?.map_or(0, |log| {
            log.iter().filter(|r| r.user == user && keep(r)).count()
        }))
    }

    /// Every request the API server answered so far, from its audit log; `None` for an
    /// external cluster (its audit log is not ours to read).
    pub fn audit(&self) -> Result<Option<Vec<AuditedRequest>>> {
        let Some(local) = &self.local else {
            return Ok(None);
        };
        let text = fs::read_to_string(local.dir.path().join("audit.log")).unwrap_or_default();
        let mut out = Vec::new();
        for line in text.lines() {
            // The log may end in a line still being written.
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if v["stage"] != "ResponseComplete" && v["stage"] != "Panic" {
                continue;
            }
            let obj = &v["objectRef"];
            let str_of = |x: &serde_json::Value| x.as_str().map(str::to_string);
            let mut resource = str_of(&obj["resource"]).unwrap_or_default();
            if let Some(sub) = str_of(&obj["subresource"]) {
                resource = format!("{resource}/{sub}");
            }
            out.push(AuditedRequest {
                user: str_of(&v["user"]["username"]).unwrap_or_default(),
                verb: str_of(&v["verb"]).unwrap_or_default(),
                group: str_of(&obj["apiGroup"]).unwrap_or_default(),
                resource,
                namespace: str_of(&obj["namespace"]),
                name: str_of(&obj["name"]),
                code: v["responseStatus"]["code"].as_u64().unwrap_or_default() as u16,
                uri: str_of(&v["requestURI"]).unwrap_or_default(),
                received: str_of(&v["requestReceivedTimestamp"]),
            });
        }
        Ok(Some(out))
    }

    /// The local plane's directory (certificates, etcd's data, logs, kubeconfigs).
    pub fn dir(&self) -> Option<&Path> {
        self.local.as_ref().map(|l| l.dir.path())
    }

    /// PIDs of the local plane's daemons (etcd, kube-apiserver, kube-controller-manager).
    pub fn pids(&self) -> Vec<u32> {
        let Some(local) = &self.local else {
            return Vec::new();
        };
        [&local.etcd, &local.apiserver, &local.controllers]
            .iter()
            .filter_map(|m| m.lock().ok().and_then(|c| c.as_ref().map(Child::id)))
            .collect()
    }

    /// kube-apiserver's log (local planes only).
    pub fn apiserver_log(&self) -> Option<PathBuf> {
        self.local
            .as_ref()
            .map(|l| l.dir.path().join("kube-apiserver.log"))
    }
}

/// Stops the daemons before the directory goes: also when a start attempt fails half-way
/// (an early return drops the half-made plane; its watchdog, seeing the directory gone,
/// would otherwise leave them running).
impl Drop for Local {
    fn drop(&mut self) {
        self.stop_all();
    }
}

impl Local {
    /// Certificates, etcd, kube-apiserver, the controllers; returns once `/readyz` answers.
    fn start(binaries: &Path) -> Result<(Local, PathBuf)> {
        let dir = temp_dir_with_owner(DIR_PREFIX)?;
        let base = dir.path().to_path_buf();
        spawn_watchdog(&base)?;
        let pki = Pki::generate()?;
        pki.write(&base)?;
        fs::write(base.join("audit-policy.yaml"), AUDIT_POLICY)?;
        let etcd_client = free_port()?;
        let etcd_peer = free_port()?;
        let secure = free_port()?;
        let server = format!("https://127.0.0.1:{secure}");
        let kubeconfig = base.join("admin.kubeconfig");
        write_private(&kubeconfig, pki.admin_kubeconfig(&server).as_bytes())?;

        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--secure-port={secure}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--cert-dir={}", base.join("apiserver-certs").display()),
            format!("--tls-cert-file={}", base.join("apiserver.crt").display()),
            format!(
                "--tls-private-key-file={}",
                base.join("apiserver.key").display()
            ),
            format!("--client-ca-file={}", base.join("ca.crt").display()),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            // Verification wants the public key; signing the private one (PKCS#8).
            format!(
                "--service-account-key-file={}",
                base.join("sa.pub").display()
            ),
            format!(
                "--service-account-signing-key-file={}",
                base.join("sa.key").display()
            ),
            "--authorization-mode=RBAC".into(),
            // Every request, with its user, verb, resource and answer: tests check that
            // the operator was never refused (403) and count its writes.
            format!(
                "--audit-policy-file={}",
                base.join("audit-policy.yaml").display()
            ),
            format!("--audit-log-path={}", base.join("audit.log").display()),
            "--audit-log-format=json".into(),
            "--audit-log-mode=blocking".into(),
            "--allow-privileged=false".into(),
            // The `kubernetes` Service cannot point at a loopback address; nothing in
            // the tests uses it.
            "--endpoint-reconciler-type=none".into(),
            // No kubelet, no nodes: nothing to ask for logs or exec.
            "--enable-logs-handler=false".into(),
            "--v=1".into(),
        ];
        let local = Local {
            dir,
            binaries: binaries.to_path_buf(),
            server,
            etcd: Mutex::new(None),
            apiserver: Mutex::new(None),
            controllers: Mutex::new(None),
            apiserver_args,
        };
        let etcd = Command::new(binaries.join("etcd"))
            .args([
                "--name=test".to_string(),
                format!("--data-dir={}", base.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-cluster=test=http://127.0.0.1:{etcd_peer}"),
                // A test's etcd lives in a temp dir: durability buys nothing, and fsync on
                // every write would dominate a busy test run.
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ])
            .stdin(Stdio::null())
            .stdout(log_file(&base, "etcd.log")?)
            .stderr(log_file(&base, "etcd.log")?)
            .spawn()
            .context("cannot start etcd")?;
        record_pid(&base, "etcd", etcd.id())?;
        *lock(&local.etcd)? = Some(etcd);
        local.wait_etcd(etcd_client)?;
        local.spawn_apiserver()?;
        let kubectl = binaries.join("kubectl");
        local.wait_ready(&kubectl, &kubeconfig)?;
        local.spawn_controllers(&kubeconfig)?;
        Ok((local, kubeconfig))
    }

    fn wait_etcd(&self, port: u16) -> Result<()> {
        let deadline = Instant::now() + ETCD_TIMEOUT;
        loop {
            if std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(());
            }
            if let Some(status) = lock(&self.etcd)?
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "etcd exited ({status}); its log:\n{}",
                    process::tail(&self.dir.path().join("etcd.log"), LOG_TAIL_LINES)
                );
            }
            if Instant::now() > deadline {
                bail!("etcd did not listen on 127.0.0.1:{port} within {ETCD_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn spawn_apiserver(&self) -> Result<()> {
        let base = self.dir.path();
        let child = Command::new(self.binaries.join("kube-apiserver"))
            .args(&self.apiserver_args)
            .stdin(Stdio::null())
            .stdout(log_file(base, "kube-apiserver.log")?)
            .stderr(log_file(base, "kube-apiserver.log")?)
            .spawn()
            .context("cannot start kube-apiserver")?;
        record_pid(base, "kube-apiserver", child.id())?;
        *lock(&self.apiserver)? = Some(child);
        Ok(())
    }

    /// kube-controller-manager with only the controllers tests rely on: namespace deletion,
    /// the garbage collector (ownerReference cascades) and resource quota (it fills in the
    /// usage that quota admission checks). No kubelet, so nothing else.
    fn spawn_controllers(&self, kubeconfig: &Path) -> Result<()> {
        let base = self.dir.path();
        let child = Command::new(self.binaries.join("kube-controller-manager"))
            .args([
                format!("--kubeconfig={}", kubeconfig.display()),
                "--controllers=namespace,garbagecollector,resourcequota".into(),
                // A quota on a custom resource is counted once the controller has found the
                // resource by discovery and then resynced; the default (5 min) would make a
                // quota test wait that long.
                "--resource-quota-sync-period=5s".into(),
                "--leader-elect=false".into(),
                // Serve nothing: no port to collide with, no probes needed.
                "--secure-port=0".into(),
                "--v=1".into(),
            ])
            .stdin(Stdio::null())
            .stdout(log_file(base, "kube-controller-manager.log")?)
            .stderr(log_file(base, "kube-controller-manager.log")?)
            .spawn()
            .context("cannot start kube-controller-manager")?;
        record_pid(base, "kube-controller-manager", child.id())?;
        *lock(&self.controllers)? = Some(child);
        Ok(())
    }

    fn wait_ready(&self, kubectl: &Path, kubeconfig: &Path) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let log = self.dir.path().join("kube-apiserver.log");
        loop {
            let out = process::output(Command::new(kubectl).env("KUBECONFIG", kubeconfig).args([
                "get",
                "--raw=/readyz",
                "--request-timeout=5s",
            ]))?;
            if out.status.success() {
                return Ok(());
            }
            if let Some(status) = lock(&self.apiserver)?
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "kube-apiserver exited ({status}); its log:\n{}",
                    process::tail(&log, LOG_TAIL_LINES)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver was not ready within {READY_TIMEOUT:?} ({}); its log:\n{}",
                    String::from_utf8_lossy(&out.stderr).trim(),
                    process::tail(&log, LOG_TAIL_LINES)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn stop_apiserver(&self) -> Result<()> {
        if let Some(child) = lock(&self.apiserver)?.take() {
            stop(child);
        }
        Ok(())
    }

    fn stop_all(&self) {
        for slot in [&self.controllers, &self.apiserver, &self.etcd] {
            if let Ok(mut guard) = slot.lock()
                && let Some(child) = guard.take()
            {
                stop(child);
            }
        }
    }
}

/// SIGTERM, a grace period, then SIGKILL; always reaped.
fn stop(mut child: Child) {
    process::signal(&[child.id()], "TERM");
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| anyhow!("control plane state poisoned"))
}

fn spawn_watchdog(dir: &Path) -> Result<()> {
    Command::new("setsid")
        .args(["bash", "-c", WATCHDOG, "watchdog"])
        .arg(std::process::id().to_string())
        .env("EOTEST_PLANE_DIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the control plane's watchdog (setsid, bash)")?;
    Ok(())
}

/// Removes the planes of test processes that are gone, killing their daemons first. The
/// owner's watchdog normally does both, but it may not have looked yet (it polls), or it may
/// have been killed itself; a directory removed under running daemons would leave nothing
/// that names them. Daemons are found by their command lines (see [`WATCHDOG`]).
fn remove_stale_planes() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry
            .file_name()
            .to_str()
            .is_some_and(|n| owner_is_gone(n, DIR_PREFIX));
        if !stale {
            continue;
        }
        let dir = entry.path();
        let daemons = process::naming(&dir);
        process::signal(&daemons, "KILL");
        if !process::wait_gone(&daemons, STOP_GRACE) {
            eprintln!(
                "control plane: daemons of the stale plane {} outlived SIGKILL: {daemons:?}",
                dir.display()
            );
        }
        // Best effort: a leftover directory harms nobody once its daemons are gone.
        let _ = fs::remove_dir_all(&dir);
    }
}

fn record_pid(dir: &Path, name: &str, pid: u32) -> Result<()> {
    fs::write(dir.join(format!("{name}.pid")), pid.to_string())
        .with_context(|| format!("cannot record the PID of {name}"))
}

fn log_file(dir: &Path, name: &str) -> Result<fs::File> {
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .with_context(|| format!("cannot open {name}"))
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(data)?;
    Ok(())
}

fn free_port() -> Result<u16> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("cannot bind a loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// A short, unique-enough suffix for names (no RNG crate needed).
fn suffix() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "{:06x}",
        (nanos ^ (std::process::id() << 8) ^ n.wrapping_mul(0x9e37)) & 0xff_ffff
    )
}

fn external_kubeconfig() -> Option<PathBuf> {
    let value = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty())?;
    // kubectl's list form (a:b) is not supported here: take the first file.
    let first = std::env::split_paths(&value).next()?;
    Some(first)
}

/// Where `scripts/controlplane.sh` keeps the binaries: `EGRESS_CONTROLPLANE_DIR` when
/// `make test` already ran it, else the script is run now (instant when they are cached;
/// a first build takes minutes, and concurrent callers wait for one build).
pub fn binaries_dir() -> Result<PathBuf> {
    static DIR: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("EGRESS_CONTROLPLANE_DIR").filter(|v| !v.is_empty()) {
            return Ok(PathBuf::from(dir));
        }
        let script = crate::workspace_root().join("scripts/controlplane.sh");
        let out = process::run(Command::new("bash").arg(&script).stderr(Stdio::inherit()))
            .map_err(|e| format!("{e:#}"))?;
        out.lines()
            .last()
            .map(|l| PathBuf::from(l.trim()))
            .ok_or_else(|| format!("{} printed no directory", script.display()))
    })
    .clone()
    .map_err(|e| anyhow!("the control plane binaries: {e}"))
}

pub(crate) async fn client_for(kubeconfig: &Path) -> Result<kube::Client> {
    let config = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config =
        kube::Config::from_custom_kubeconfig(config, &kube::config::KubeConfigOptions::default())
            .await
            .with_context(|| format!("kubeconfig {}", kubeconfig.display()))?;
    Ok(kube::Client::try_from(config)?)
}

/// A namespace of one test. Dropping it deletes the namespace and strips the finalizers of
/// our kinds left in it (their controller may be gone), so it never hangs in Terminating.
#[derive(Debug)]
pub struct TestNamespace {
    name: String,
    kubectl: PathBuf,
    kubeconfig: PathBuf,
}

impl TestNamespace {
    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let kubectl = |args: &[&str]| {
            process::output(
                Command::new(&self.kubectl)
                    .env("KUBECONFIG", &self.kubeconfig)
                    .args(args),
            )
        };
        let _ = kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
        let kinds = kubectl(&[
            "api-resources",
            "--api-group=egress-operator.dev",
            "--namespaced=true",
            "-o",
            "name",
        ]);
        let Ok(kinds) = kinds else { return };
        for kind in String::from_utf8_lossy(&kinds.stdout).lines() {
            let Ok(objects) = kubectl(&["get", kind, "-n", &self.name, "-o", "name"]) else {
                continue;
            };
            for object in String::from_utf8_lossy(&objects.stdout).lines() {
                let _ = kubectl(&[
                    "patch",
                    object,
                    "-n",
                    &self.name,
                    "--type=merge",
                    "-p",
                    r#"{"metadata":{"finalizers":null}}"#,
                ]);
            }
        }
    }
}

/// The plane's certificates: one CA signs the API server's serving certificate and the
/// admin's client certificate; the ServiceAccount token signing key is separate.
struct Pki {
    ca_pem: String,
    server_pem: String,
    server_key_pem: String,
    admin_pem: String,
    admin_key_pem: String,
    sa_key_pem: String,
    sa_pub_pem: String,
}

impl Pki {
    fn generate() -> Result<Pki> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "egress-operator test CA");
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);

        let server_key = KeyPair::generate()?;
        let mut server = CertificateParams::new(vec![
            "127.0.0.1".to_string(),
            "localhost".to_string(),
            "kubernetes.default.svc".to_string(),
        ])?;
        server
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        let server_cert = server.signed_by(&server_key, &issuer)?;

        let admin_key = KeyPair::generate()?;
        let mut admin = CertificateParams::new(Vec::<String>::new())?;
        admin.distinguished_name.push(DnType::CommonName, "admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        let admin_cert = admin.signed_by(&admin_key, &issuer)?;

        let sa_key = KeyPair::generate()?;
        Ok(Pki {
            ca_pem: ca_cert.pem(),
            server_pem: server_cert.pem(),
            server_key_pem: server_key.serialize_pem(),
            admin_pem: admin_cert.pem(),
            admin_key_pem: admin_key.serialize_pem(),
            sa_key_pem: sa_key.serialize_pem(),
            sa_pub_pem: sa_key.public_key_pem(),
        })
    }

    fn write(&self, dir: &Path) -> Result<()> {
        write_private(&dir.join("ca.crt"), self.ca_pem.as_bytes())?;
        write_private(&dir.join("apiserver.crt"), self.server_pem.as_bytes())?;
        write_private(&dir.join("apiserver.key"), self.server_key_pem.as_bytes())?;
        write_private(&dir.join("sa.key"), self.sa_key_pem.as_bytes())?;
        write_private(&dir.join("sa.pub"), self.sa_pub_pem.as_bytes())?;
        Ok(())
    }

    fn admin_kubeconfig(&self, server: &str) -> String {
        use base64::Engine as _;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "egress-test", "cluster": {
                "server": server,
                "certificate-authority-data": b64(&self.ca_pem),
            }}],
            "users": [{"name": "admin", "user": {
                "client-certificate-data": b64(&self.admin_pem),
                "client-key-data": b64(&self.admin_key_pem),
            }}],
            "contexts": [{"name": "egress-test", "context": {"cluster": "egress-test", "user": "admin"}}],
            "current-context": "egress-test",
        })
        .to_string()
    }
}
