//! The operator at scale, measured: the real `egress-operator run` process (as its
//! ServiceAccount, with the shipped RBAC, against the local control plane) driving the
//! real kvm2 provider over real SSH links (the harness's OpenSSH sshd on 127.0.0.1) to N
//! simulated hosts: N isolated libvirtd daemons, each reached through its test driver
//! (`test+unix:///default`), where domains, volumes, pools and metadata are libvirt's own
//! objects. What is not real: the test driver has no volume streams, so for such hosts the
//! operator consumes an upload's bytes and keeps only a 4 KiB header of it in memory (the
//! image is still downloaded over HTTP and its sha256 verified; see
//! `operator/src/provider/kvm2/domain/streamless.rs`), and
//! its domains run no guest, so each proxy is stood in for by a CONNECT responder on the
//! proxy's static loopback address (`127.78.0.0/16` and up, one /16 per host), which the
//! operator's real Serving probe reaches.
//!
//! One run: apply all Proxies at once, wait until all are `Ready`, hold at rest, delete
//! them all, wait until all are gone, and look on every host for anything left. Each
//! phase records what the API server's audit log says the operator's ServiceAccount did
//! (by verb and resource), the operator's CPU time and peak RSS (`/proc/PID/stat`,
//! `VmHWM` reset through `/proc/PID/clear_refs` at the phase's start), its own metrics
//! (provider and libvirt calls, GC sweep time) and the probes the responder answered.
//! `tests/benches/scale.rs` prints the figures beside their goals; `tests/tests/scale.rs`
//! checks the counts on a small run.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use egress_operator::api::proxy::Proxy;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use crate::connect_responder::ConnectResponder;
use crate::harness::TestNamespace;
use crate::harness::controlplane::OPERATOR_NAMESPACE;
use crate::harness::{ControlPlane, Libvirtd, Sshd};
use crate::http::{HttpServer, Route};
use crate::operator_process::{OperatorOptions, OperatorProcess};

/// First octets of the hosts' loopback address ranges: host `i` hands out `127.(78+i).x.y`.
const FIRST_NET: u8 = 78;
/// Requests of the bench's own client in flight while it applies or deletes Proxies.
const CLIENT_PARALLEL: usize = 32;
/// How often the bench looks at the Proxies while it waits.
const POLL: Duration = Duration::from_secs(1);

/// What one run does. [`ScaleOptions::from_env`] reads overrides from the environment.
#[derive(Debug, Clone)]
pub struct ScaleOptions {
    /// Proxies applied at once (`EGRESS_SCALE_PROXIES`).
    pub proxies: usize,
    /// Simulated hosts (`EGRESS_SCALE_HOSTS`).
    pub hosts: usize,
    /// How long to hold at rest once all are Ready (`EGRESS_SCALE_REST_SECONDS`).
    pub rest: Duration,
    /// The operator's `--concurrency`; `None` keeps its default (`EGRESS_SCALE_CONCURRENCY`).
    pub concurrency: Option<u16>,
    /// Each host's `maxConcurrentCreates`; `None` keeps the default
    /// (`EGRESS_SCALE_CREATES_PER_HOST`).
    pub creates_per_host: Option<u32>,
    /// `serving.periodSeconds`; `None` keeps the default (`EGRESS_SCALE_PROBE_PERIOD`).
    pub probe_period_seconds: Option<u32>,
    /// `gc.periodSeconds`; `None` keeps the default (`EGRESS_SCALE_GC_PERIOD`).
    pub gc_period_seconds: Option<u32>,
    /// Hang guard of each wait (never a performance limit).
    pub guard: Duration,
    /// Apply this many first, wait until they are Ready, then the rest: the two waves'
    /// costs per Create side by side show whether a Create's cost grows with the fleet
    /// (issue 32). `None`: all at once.
    pub first_wave: Option<usize>,
}

fn env_num<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| anyhow!("{name}={v:?} is not a number")),
        Err(_) => Ok(None),
    }
}

impl ScaleOptions {
    /// `proxies` on `hosts` held `rest` at rest, every knob at the operator's default;
    /// then overridden by the `EGRESS_SCALE_*` variables.
    pub fn from_env(proxies: usize, hosts: usize, rest: Duration) -> Result<ScaleOptions> {
        let proxies = env_num("EGRESS_SCALE_PROXIES")?.unwrap_or(proxies);
        let hosts: usize = env_num("EGRESS_SCALE_HOSTS")?.unwrap_or(hosts);
        ensure!(
            proxies > 0 && (1..=100).contains(&hosts),
            "need at least one Proxy and 1 to 100 hosts"
        );
        Ok(ScaleOptions {
            proxies,
            hosts,
            rest: env_num::<u64>("EGRESS_SCALE_REST_SECONDS")?
                .map(Duration::from_secs)
                .unwrap_or(rest),
            concurrency: env_num("EGRESS_SCALE_CONCURRENCY")?,
            creates_per_host: env_num("EGRESS_SCALE_CREATES_PER_HOST")?,
            probe_period_seconds: env_num("EGRESS_SCALE_PROBE_PERIOD")?,
            gc_period_seconds: env_num("EGRESS_SCALE_GC_PERIOD")?,
            first_wave: None,
            guard: Duration::from_secs(
                env_num("EGRESS_SCALE_GUARD_SECONDS")?.unwrap_or(600.max(proxies as u64)),
            ),
        })
    }

    /// Most domains per host: an even share with room for an uneven placement, within
    /// the config's limit of 1000.
    fn max_domains(&self) -> usize {
        ((self.proxies.div_ceil(self.hosts) * 5).div_ceil(4) + 2).min(1000)
    }
}

/// The operator's requests in one phase, from the audit log: (verb, resource) → count.
pub type Requests = BTreeMap<(String, String), u64>;

/// What one phase measured.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// Wall time.
    pub wall: Duration,
    /// The operator's CPU seconds (user + system).
    pub cpu_seconds: f64,
    /// The operator's peak RSS in this phase, KiB.
    pub peak_rss_kib: u64,
    /// The operator's requests, by verb and resource.
    pub requests: Requests,
    /// Requests the API server refused with 403.
    pub refused: u64,
    /// The operator's provider calls (`egress_provider_calls_total` by op), this phase.
    pub provider_calls: BTreeMap<String, f64>,
    /// The operator's libvirt calls (`egress_libvirt_calls_total` by op, all hosts).
    pub libvirt_calls: BTreeMap<String, f64>,
    /// CONNECTs the stand-in proxies answered (the operator's Serving probes).
    pub probes: u64,
    /// The kvm2 domain index's checks of hosts by kind (`names`, `full`, `cached`).
    pub index_checks: BTreeMap<String, f64>,
    /// Domains whose state and XML the provider read, by way (`full`: a full listing;
    /// `bulk`: a names check that found many new domains; `lookup`: one new domain).
    pub domains_read: BTreeMap<String, f64>,
    /// GC sweeps in this phase.
    pub gc_sweeps: f64,
    /// Mean duration of the provider Creates that succeeded in this phase.
    pub mean_create: Option<Duration>,
    /// The Proxy controller's reconcile latency in this phase, p50 and p99 in seconds,
    /// read from its histogram's buckets (so as coarse as they are).
    pub reconcile_p50_p99: Option<(f64, f64)>,
}

impl Phase {
    /// The Create and Delete paths' work on the hosts, in libvirt round trips: each
    /// names-only check is one, each domain read two (state and XML) plus its lookup; the
    /// full listings (the GC's sweeps, a host's first look) are left out, as they are
    /// per period, not per Proxy.
    pub fn path_round_trips(&self) -> f64 {
        let get = |m: &BTreeMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(0.0);
        get(&self.index_checks, "names")
            + 3.0 * get(&self.domains_read, "lookup")
            + 2.0 * get(&self.domains_read, "bulk")
    }
}

impl Phase {
    /// Writes (create, update, patch, delete) to `resource` (all resources with `None`).
    pub fn writes(&self, resource: Option<&str>) -> u64 {
        self.requests
            .iter()
            .filter(|((verb, res), _)| {
                is_write(verb)
                    && resource.is_none_or(|r| res == r || res.starts_with(&format!("{r}/")))
            })
            .map(|(_, n)| n)
            .sum()
    }

    /// Writes by resource.
    pub fn writes_by_resource(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for ((verb, res), n) in &self.requests {
            if is_write(verb) {
                *out.entry(res.clone()).or_default() += n;
            }
        }
        out
    }
}

fn is_write(verb: &str) -> bool {
    matches!(
        verb,
        "create" | "update" | "patch" | "delete" | "deletecollection"
    )
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The options of the run.
    pub proxies: usize,
    /// Simulated hosts.
    pub hosts: usize,
    /// The operator's `--concurrency` in effect.
    pub concurrency: u16,
    /// Each host's `maxConcurrentCreates` in effect.
    pub creates_per_host: u32,
    /// Apply until all Ready.
    pub create: Phase,
    /// Held at rest.
    pub rest: Phase,
    /// Delete until all gone.
    pub delete: Phase,
    /// Mean duration of one provider Create in the create phase (operator's histogram).
    pub mean_create: Duration,
    /// Duration of the last GC sweep at rest (all instances), seconds.
    pub gc_sweep_seconds: Option<f64>,
    /// Sweeps the collector made at rest.
    pub gc_sweeps_at_rest: f64,
    /// Domains and instance volumes left on the hosts after the delete.
    pub leftovers: Vec<String>,
    /// Proxies per host once all were Ready.
    pub proxies_per_host: BTreeMap<String, usize>,
    /// The operator's first warnings (at most 5), to tell a figure's cause.
    pub first_warnings: Vec<String>,
    /// With [`ScaleOptions::first_wave`]: each wave's size and what it cost, until all
    /// its Proxies were Ready.
    pub waves: Vec<(usize, Phase)>,
    /// One Proxy applied to the empty fleet: the time until it was Ready (issue 32, item 4).
    pub solo_empty: Option<Duration>,
    /// One Proxy applied to the whole fleet at rest: the time until it was Ready.
    pub solo_at_rest: Option<Duration>,
    /// Events in the run's namespace by reason, once all were Ready.
    pub events_by_reason: BTreeMap<String, usize>,
}

impl Report {
    /// Creates that can run at once: the operator's concurrency or the hosts' slots.
    pub fn effective_concurrency(&self) -> usize {
        usize::from(self.concurrency).min(self.hosts * self.creates_per_host as usize)
    }

    /// The provider's lower bound for the create phase: each Create's time × Proxies /
    /// Creates at once.
    pub fn create_bound(&self) -> Duration {
        self.mean_create
            .mul_f64(self.proxies as f64 / self.effective_concurrency().max(1) as f64)
    }
}

/// The running rig: control plane, hosts, stand-in proxies, image server, the operator.
pub struct ScaleRig {
    options: ScaleOptions,
    plane: &'static ControlPlane,
    client: kube::Client,
    ns: TestNamespace,
    _sshd: Sshd,
    libvirtds: Vec<Libvirtd>,
    _http: HttpServer,
    responder: ConnectResponder,
    operator: OperatorProcess,
    _holders: Vec<TestDriverHolder>,
    _relays: Vec<TcpRelay>,
    concurrency: u16,
    creates_per_host: u32,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for ScaleRig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScaleRig")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// The default of the operator's `--concurrency` (read from its own argument parser).
fn default_concurrency() -> u16 {
    use clap::Parser as _;
    match egress_operator::cli::Cli::try_parse_from(["egress-operator", "run", "--config", "x"]) {
        Ok(egress_operator::cli::Cli {
            command: egress_operator::cli::Command::Run(args),
            ..
        }) => args.concurrency,
        _ => 8,
    }
}

fn host_net(i: usize) -> Result<u8> {
    u8::try_from(i)
        .ok()
        .and_then(|i| FIRST_NET.checked_add(i))
        .filter(|n| *n < 255)
        .ok_or_else(|| anyhow!("too many hosts for the loopback ranges"))
}

/// Host `i`'s `k`-th static address.
fn host_address(i: usize, k: usize) -> Result<Ipv4Addr> {
    let net = host_net(i)?;
    let k = u32::try_from(k + 10)?;
    ensure!(k < 65_000, "too many addresses on one host");
    Ok(Ipv4Addr::new(127, net, (k >> 8) as u8, (k & 0xff) as u8))
}

impl ScaleRig {
    /// Starts everything and waits until the operator leads. `binary` is the operator
    /// (`CARGO_BIN_EXE_operator-under-test`).
    pub async fn start(binary: PathBuf, options: ScaleOptions) -> Result<ScaleRig> {
        let plane = tokio::task::block_in_place(ControlPlane::shared)?;
        plane.install_crds().await?;
        plane.install_rbac()?;
        let operator_kubeconfig = plane.operator_kubeconfig()?;
        let client = plane.client().await?;
        let ns = plane.namespace("egress-scale").await?;

        let dir = tempfile::tempdir()?;
        let sshd = Sshd::start()?;
        let mut libvirtds = Vec::new();
        let mut holders = Vec::new();
        for _ in 0..options.hosts {
            let l = Libvirtd::start()?;
            holders.push(TestDriverHolder::start(&l)?);
            libvirtds.push(l);
        }
        let (image, sha) = crate::small_qcow2(dir.path(), "scale")?;
        let http = HttpServer::start(vec![("/base.qcow2".to_string(), Route::File(image))])?;
        let per_host = options.max_domains();
        let mut addresses = Vec::new();
        for i in 0..options.hosts {
            for k in 0..per_host {
                addresses.push(host_address(i, k)?);
            }
        }
        let responder = ConnectResponder::start(addresses)?;

        // One sshd serves every simulated host, but the config refuses one address twice
        // (it would count a host's capacity twice): host i > 0 dials a relay of its own on
        // 127.0.0.(i+1), and known_hosts names the same host key at each address.
        let mut relays = Vec::new();
        let mut known = std::fs::read_to_string(sshd.known_hosts())?;
        let key_part = known
            .lines()
            .next()
            .and_then(|l| l.split_once(' '))
            .map(|(_, k)| k.to_string())
            .ok_or_else(|| anyhow!("empty known_hosts"))?;
        let mut host_addresses = vec![sshd.address()];
        for i in 1..options.hosts {
            let ip = Ipv4Addr::new(127, 0, 0, u8::try_from(i + 1)?);
            let relay = TcpRelay::start(ip, sshd.port()).await?;
            known.push_str(&format!("[{ip}]:{} {key_part}\n", relay.port));
            host_addresses.push(format!("{ip}:{}", relay.port));
            relays.push(relay);
        }
        let known_hosts = dir.path().join("known_hosts");
        std::fs::write(&known_hosts, &known)?;

        let mut hosts = String::new();
        for (i, l) in libvirtds.iter().enumerate() {
            let net = host_net(i)?;
            let creates = options
                .creates_per_host
                .map(|c| format!(", maxConcurrentCreates: {c}"))
                .unwrap_or_default();
            hosts.push_str(&format!(
                "    - {{name: h{i}, address: \"{address}\", libvirtSocket: {socket}, driver: test, \
                 storagePool: default, bridge: {bridge}, disableKvm: true, maxDomains: {per_host}{creates}, \
                 addressPool: {{cidr: 127.{net}.0.0/16, rangeStart: {first}, rangeEnd: {last}}}}}\n",
                address = host_addresses[i],
                socket = l.socket_path().display(),
                bridge = l.bridge(),
                first = host_address(i, 0)?,
                last = host_address(i, per_host - 1)?,
            ));
        }
        let mut serving = format!("port: {}", responder.port());
        if let Some(p) = options.probe_period_seconds {
            // The probe's budget must stay under its period.
            let timeout = p.saturating_sub(1).clamp(1, 5);
            serving.push_str(&format!(", periodSeconds: {p}, timeoutSeconds: {timeout}"));
        }
        let gc = options
            .gc_period_seconds
            .map(|p| format!("gc: {{periodSeconds: {p}}}\n"))
            .unwrap_or_default();
        let yaml = format!(
            r#"clusterId: scale
kvm2:
  ssh:
    user: {user}
    privateKeyFile: {key}
    knownHostsFile: {known}
  hosts:
{hosts}  images:
    - {{name: base, url: "{url}", sha256: "{sha}", format: qcow2, allowHttp: true, allowPrivateAddresses: true}}
  machineTypes:
    - {{name: small, vcpus: 1, memoryMiB: 128, diskGiB: 1}}
  defaults: {{machineType: small, image: base}}
  templates:
    domain: {{path: {domain}}}
    vendorData:
      path: {vendor}
      settings: {{listenPort: 3128, allowedClientCidrs: [10.0.0.0/8]}}
serving: {{{serving}}}
{gc}"#,
            user = sshd.user(),
            key = sshd.client_key().display(),
            known = known_hosts.display(),
            url = http.url("/base.qcow2"),
            domain = crate::plugin_path("domain-default")?.display(),
            vendor = crate::plugin_path("vendor-data-default")?.display(),
        );
        let config = dir.path().join("providers-config.yaml");
        std::fs::write(&config, &yaml)?;

        let concurrency = options.concurrency.unwrap_or_else(default_concurrency);
        let creates_per_host = options
            .creates_per_host
            .unwrap_or_else(egress_operator::config::types::defaults::max_concurrent_creates);
        let mut op_options = OperatorOptions::new(
            &binary,
            &config,
            &operator_kubeconfig,
            "egress-operator-scale",
            OPERATOR_NAMESPACE,
            dir.path(),
        );
        // Per-Proxy info lines would dominate the run's cost; warnings still show.
        op_options.log_filter = "warn".into();
        if let Some(c) = options.concurrency {
            op_options.extra_args = vec!["--concurrency".into(), c.to_string()];
        }
        let mut operator = OperatorProcess::start(&op_options)?;
        tokio::task::block_in_place(|| operator.wait_ready(options.guard))?;
        // Ready comes before the plugins are loaded (a degraded replica is ready); a
        // deployed operator has its plugins long before a fleet is applied, so the run
        // starts once both are up (else every first Create fails transiently).
        let start = Instant::now();
        loop {
            let up = match operator.http_get("/metrics") {
                Some((200, text)) => metric(&text, "egress_template_plugin_up", &[]),
                _ => 0.0,
            };
            if up >= 2.0 {
                break;
            }
            if start.elapsed() > options.guard {
                bail!(
                    "the plugins were not loaded within {:?} (hang guard)",
                    options.guard
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(ScaleRig {
            options,
            plane,
            client,
            ns,
            _sshd: sshd,
            libvirtds,
            _http: http,
            responder,
            operator,
            _holders: holders,
            _relays: relays,
            concurrency,
            creates_per_host,
            _dir: dir,
        })
    }

    /// The admin client of the control plane.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    /// The namespace the rig made for its Proxies.
    pub fn namespace(&self) -> &str {
        self.ns.name()
    }

    /// The providers config file the operator reads (and reloads when it changes).
    pub fn config_path(&self) -> PathBuf {
        self._dir.path().join("providers-config.yaml")
    }

    /// GET `path` on the operator's HTTP endpoint.
    pub fn operator_get(&self, path: &str) -> Option<(u16, String)> {
        self.operator.http_get(path)
    }

    /// Starts a phase's counters (peak RSS, CPU, the audit log, metrics, probes), for a
    /// caller's own phase (the drift bench's rollout).
    pub fn begin(&self) -> Result<Mark> {
        self.mark()
    }

    /// Ends a phase begun with [`ScaleRig::begin`].
    pub fn end(&self, mark: &Mark) -> Result<Phase> {
        self.phase(mark)
    }

    /// The operator's metrics exposition now.
    pub fn operator_metrics(&self) -> Result<String> {
        self.metrics()
    }

    /// What is left on the hosts: domains, and volumes other than the cached base image.
    pub fn leftovers_now(&self) -> Result<Vec<String>> {
        self.leftovers()
    }

    /// The operator's `--concurrency`.
    pub fn concurrency(&self) -> u16 {
        self.concurrency
    }

    /// Each host's `maxConcurrentCreates`.
    pub fn creates_per_host(&self) -> u32 {
        self.creates_per_host
    }

    /// The operator's log so far (for failures).
    pub fn operator_log(&self) -> String {
        self.operator.log()
    }

    fn pid(&self) -> Result<u32> {
        self.operator
            .pid()
            .ok_or_else(|| anyhow!("the operator is not running"))
    }

    /// The operator's CPU seconds so far.
    fn cpu_seconds(&self) -> Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()?))?;
        let rest = stat
            .rsplit_once(") ")
            .map(|(_, r)| r)
            .ok_or_else(|| anyhow!("cannot read /proc/PID/stat"))?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // After the command: state(0) ... utime(11) stime(12), in clock ticks.
        let ticks = |i: usize| -> Result<f64> {
            Ok(fields
                .get(i)
                .ok_or_else(|| anyhow!("short /proc/PID/stat"))?
                .parse::<f64>()?)
        };
        Ok((ticks(11)? + ticks(12)?) / clock_ticks())
    }

    /// Resets the operator's RSS high-water mark (Linux ≥ 4.0).
    fn reset_peak(&self) -> Result<()> {
        std::fs::write(format!("/proc/{}/clear_refs", self.pid()?), "5").context("resetting VmHWM")
    }

    fn status_kib(&self, key: &str) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| anyhow!("no {key} in /proc/PID/status"))
    }

    /// The operator's own metrics, as text.
    fn metrics(&self) -> Result<String> {
        match self.operator.http_get("/metrics") {
            Some((200, body)) => Ok(body),
            other => bail!("GET /metrics: {other:?}"),
        }
    }

    fn audit_len(&self) -> Result<usize> {
        Ok(self.plane.audit()?.map(|a| a.len()).unwrap_or(0))
    }

    /// Starts a phase's counters.
    fn mark(&self) -> Result<Mark> {
        self.reset_peak()?;
        Ok(Mark {
            at: Instant::now(),
            cpu: self.cpu_seconds()?,
            audit: self.audit_len()?,
            metrics: self.metrics()?,
            probes: self.responder.answered(),
        })
    }

    /// Ends a phase begun at `mark`.
    fn phase(&self, mark: &Mark) -> Result<Phase> {
        let wall = mark.at.elapsed();
        let user = crate::harness::controlplane::operator_user();
        let mut requests = Requests::new();
        let mut refused = 0;
        if let Some(audit) = self.plane.audit()? {
            for r in audit.iter().skip(mark.audit).filter(|r| r.user == user) {
                *requests
                    .entry((r.verb.clone(), r.resource.clone()))
                    .or_default() += 1;
                if r.code == 403 {
                    refused += 1;
                }
            }
        }
        let metrics = self.metrics()?;
        let delta_by = |name: &str, key: &str| {
            let mut now = by_label(&metrics, name, key);
            for (op, v) in by_label(&mark.metrics, name, key) {
                *now.entry(op).or_default() -= v;
            }
            now.retain(|_, v| *v > 0.0);
            now
        };
        let delta = |name: &str| delta_by(name, "op");
        Ok(Phase {
            wall,
            cpu_seconds: self.cpu_seconds()? - mark.cpu,
            peak_rss_kib: self.status_kib("VmHWM")?,
            requests,
            refused,
            provider_calls: delta("egress_provider_calls_total"),
            libvirt_calls: delta("egress_libvirt_calls_total"),
            probes: self.responder.answered() - mark.probes,
            index_checks: delta_by("egress_kvm2_domain_index_checks_total", "via"),
            domains_read: delta_by("egress_kvm2_domains_read_total", "via"),
            gc_sweeps: metric(&metrics, "egress_gc_sweeps_total", &[])
                - metric(&mark.metrics, "egress_gc_sweeps_total", &[]),
            reconcile_p50_p99: reconcile_quantiles(&mark.metrics, &metrics),
            mean_create: {
                let ok = [("op", "create"), ("outcome", "ok")];
                let d = |name: &str| metric(&metrics, name, &ok) - metric(&mark.metrics, name, &ok);
                let count = d("egress_provider_call_duration_seconds_count");
                (count > 0.0).then(|| {
                    Duration::from_secs_f64(d("egress_provider_call_duration_seconds_sum") / count)
                })
            },
        })
    }

    fn proxies(&self) -> Api<Proxy> {
        Api::namespaced(self.client.clone(), self.ns.name())
    }

    /// Applies every Proxy at once (the bench's own client, [`CLIENT_PARALLEL`] requests
    /// in flight).
    async fn apply(&self, range: std::ops::Range<usize>) -> Result<()> {
        let sem = Arc::new(tokio::sync::Semaphore::new(CLIENT_PARALLEL));
        let mut tasks = tokio::task::JoinSet::new();
        for i in range {
            let api = self.proxies();
            let sem = sem.clone();
            tasks.spawn(async move {
                let _permit = sem.acquire_owned().await?;
                let proxy: Proxy = serde_json::from_value(serde_json::json!({
                    "apiVersion": "egress-operator.dev/v1alpha1",
                    "kind": "Proxy",
                    "metadata": {"name": format!("p{i:05}")},
                    "spec": {"provider": "kvm2"},
                }))?;
                api.create(&PostParams::default(), &proxy).await?;
                anyhow::Ok(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        Ok(())
    }

    async fn delete_all(&self) -> Result<()> {
        let sem = Arc::new(tokio::sync::Semaphore::new(CLIENT_PARALLEL));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..self.options.proxies {
            let api = self.proxies();
            let sem = sem.clone();
            tasks.spawn(async move {
                let _permit = sem.acquire_owned().await?;
                api.delete(&format!("p{i:05}"), &DeleteParams::default())
                    .await?;
                anyhow::Ok(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        Ok(())
    }

    /// Polls until `done(ready, total)` under the guard; names what it waited for.
    async fn wait(&self, what: &str, done: impl Fn(usize, usize) -> bool) -> Result<Vec<Proxy>> {
        let start = Instant::now();
        loop {
            let list = self.proxies().list(&ListParams::default()).await?.items;
            let ready = list.iter().filter(|p| is_ready(p)).count();
            if done(ready, list.len()) {
                return Ok(list);
            }
            if start.elapsed() > self.options.guard {
                let warnings = self.operator.warnings();
                let tail: Vec<&String> = warnings.iter().rev().take(20).collect();
                bail!(
                    "{what}: not within {:?} (hang guard): {ready} Ready of {} Proxies; the operator's last warnings:\n{tail:#?}",
                    self.options.guard,
                    list.len()
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// What is left on the hosts: domains, and volumes other than the cached base image.
    fn leftovers(&self) -> Result<Vec<String>> {
        let mut left = Vec::new();
        for (i, l) in self.libvirtds.iter().enumerate() {
            let uri = l.test_uri();
            let domains = l.virsh(&uri, &["list", "--all", "--name"])?;
            for d in domains.lines().map(str::trim).filter(|d| !d.is_empty()) {
                // The test driver's own sample domain is not ours.
                if d != "test" {
                    left.push(format!("h{i}: domain {d}"));
                }
            }
            let volumes = l.virsh(&uri, &["vol-list", "default", "--details"])?;
            for v in volumes
                .lines()
                .filter_map(|l| l.split_whitespace().next())
                .filter(|v| v.starts_with("egress-"))
                .filter(|v| {
                    // The image cache's own volumes stay: base data, commit marker, and the
                    // cluster's announcement of the images it uses.
                    !["egress-image-", "egress-imgok-", "egress-imguse-"]
                        .iter()
                        .any(|p| v.starts_with(p))
                })
            {
                left.push(format!("h{i}: volume {v}"));
            }
        }
        Ok(left)
    }

    /// One run: apply, all Ready, rest, delete, all gone, leftovers.
    pub async fn run(&self) -> Result<Report> {
        let n = self.options.proxies;
        let mut report = Report {
            proxies: n,
            hosts: self.options.hosts,
            concurrency: self.concurrency,
            creates_per_host: self.creates_per_host,
            ..Report::default()
        };

        report.solo_empty = Some(self.solo("solo-empty").await?);
        let mark = self.mark()?;
        let first = self.options.first_wave.filter(|k| (1..n).contains(k));
        if let Some(k) = first {
            self.apply(0..k).await?;
            self.wait("the first wave Ready", |r, _| r == k).await?;
            report.waves.push((k, self.phase(&mark)?));
            let second = self.mark()?;
            self.apply(k..n).await?;
            self.wait("all Proxies Ready", |r, _| r == n).await?;
            report.waves.push((n - k, self.phase(&second)?));
        } else {
            self.apply(0..n).await?;
        }
        let ready = self.wait("all Proxies Ready", |r, _| r == n).await?;
        report.create = self.phase(&mark)?;
        for p in &ready {
            let host = p
                .status
                .as_ref()
                .and_then(|s| s.host.clone())
                .unwrap_or_default();
            *report.proxies_per_host.entry(host).or_default() += 1;
        }
        let events: Api<k8s_openapi::api::core::v1::Event> =
            Api::namespaced(self.client.clone(), self.ns.name());
        for e in events.list(&ListParams::default()).await?.items {
            *report
                .events_by_reason
                .entry(e.reason.unwrap_or_default())
                .or_default() += 1;
        }
        let metrics = self.metrics()?;
        let sum = metric(
            &metrics,
            "egress_provider_call_duration_seconds_sum",
            &[("op", "create"), ("outcome", "ok")],
        );
        let count = metric(
            &metrics,
            "egress_provider_call_duration_seconds_count",
            &[("op", "create"), ("outcome", "ok")],
        );
        if count > 0.0 {
            report.mean_create = Duration::from_secs_f64(sum / count);
        }

        let mark = self.mark()?;
        let sweeps_before = metric(&mark.metrics, "egress_gc_sweeps_total", &[]);
        tokio::time::sleep(self.options.rest).await;
        report.rest = self.phase(&mark)?;
        let metrics = self.metrics()?;
        report.gc_sweeps_at_rest = metric(&metrics, "egress_gc_sweeps_total", &[]) - sweeps_before;
        report.gc_sweep_seconds =
            metric_opt(&metrics, "egress_gc_last_sweep_duration_seconds", &[]);
        let still = self
            .wait("all Proxies still Ready after the rest", |r, _| r == n)
            .await;
        still?;
        // Only where the hosts have room for one more (maxDomains is at most 1000).
        if self.options.max_domains() * self.options.hosts > n {
            report.solo_at_rest = Some(self.solo("solo-at-rest").await?);
        }

        let mark = self.mark()?;
        self.delete_all().await?;
        self.wait("all Proxies gone", |_, total| total == 0).await?;
        report.delete = self.phase(&mark)?;
        report.leftovers = tokio::task::block_in_place(|| self.leftovers())?;
        report.first_warnings = self.operator.warnings().into_iter().take(5).collect();
        Ok(report)
    }

    /// Applies one Proxy named `name`, times it to Ready (read every 50 ms), then deletes
    /// it and waits until it is gone.
    async fn solo(&self, name: &str) -> Result<Duration> {
        let api = self.proxies();
        let proxy: Proxy = serde_json::from_value(serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name},
            "spec": {"provider": "kvm2"},
        }))?;
        let start = Instant::now();
        api.create(&PostParams::default(), &proxy).await?;
        let took = loop {
            if api.get_opt(name).await?.as_ref().is_some_and(is_ready) {
                break start.elapsed();
            }
            ensure!(
                start.elapsed() < self.options.guard,
                "{name}: not Ready within {:?} (hang guard)",
                self.options.guard
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        api.delete(name, &DeleteParams::default()).await?;
        while api.get_opt(name).await?.is_some() {
            ensure!(
                start.elapsed() < 2 * self.options.guard,
                "{name}: not gone (hang guard)"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(took)
    }

    /// Stops the operator with SIGTERM; fails when it did not exit cleanly.
    pub fn stop(mut self) -> Result<()> {
        let status = self.operator.terminate()?;
        ensure!(
            status.success(),
            "the operator exited with {status}; it logged:\n{}",
            self.operator.log()
        );
        Ok(())
    }
}

/// A virsh session that keeps the daemon's `test:///default` driver alive: the daemon
/// frees its state when its last client disconnects, so without it a host would forget
/// everything between the operator's reconnects. It defines the `default` pool the
/// config names (the test driver's own is `default-pool`; its volumes take no disk).
struct TestDriverHolder {
    child: std::process::Child,
}

impl TestDriverHolder {
    fn start(l: &Libvirtd) -> Result<TestDriverHolder> {
        use std::io::Write as _;
        let uri = l.test_uri();
        let pool = l.dir().join("scale-pool.xml");
        std::fs::write(
            &pool,
            "<pool type='dir'><name>default</name>\
             <target><path>/var/lib/libvirt/images</path></target></pool>",
        )?;
        let child = std::process::Command::new("virsh")
            .args(["-q", "-c", &uri])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting virsh")?;
        let mut holder = TestDriverHolder { child };
        let stdin = holder
            .child
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow!("no stdin for virsh"))?;
        writeln!(stdin, "pool-define {}\npool-start default", pool.display())?;
        stdin.flush()?;
        let start = Instant::now();
        loop {
            if l.virsh(&uri, &["pool-info", "default"]).is_ok() {
                return Ok(holder);
            }
            if start.elapsed() > Duration::from_secs(30) {
                holder.stop();
                bail!("the test driver's pool `default` did not appear (hang guard)");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TestDriverHolder {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A TCP relay on a loopback address to the sshd's port: another address for the same
/// server. Its task ends when it is dropped.
struct TcpRelay {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl TcpRelay {
    async fn start(ip: Ipv4Addr, to: u16) -> Result<TcpRelay> {
        ensure!(ip.is_loopback(), "the relay stays on loopback");
        let listener = tokio::net::TcpListener::bind((ip, 0)).await?;
        let port = listener.local_addr()?.port();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) =
                        tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, to)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(TcpRelay { port, task })
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The counters at the start of a phase ([`ScaleRig::begin`]).
#[derive(Debug)]
pub struct Mark {
    at: Instant,
    cpu: f64,
    audit: usize,
    metrics: String,
    probes: u64,
}

fn is_ready(p: &Proxy) -> bool {
    p.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// p50 and p99 of the Proxy controller's reconcile latency between two scrapes, from the
/// histogram's cumulative buckets (every outcome), each the upper bound of the bucket it
/// falls in; `None` when no reconcile ended between them.
pub fn reconcile_quantiles(before: &str, after: &str) -> Option<(f64, f64)> {
    let name = "egress_controller_reconcile_duration_seconds_bucket";
    let buckets = |text: &str| {
        let mut by_le: BTreeMap<String, f64> = BTreeMap::new();
        for (labels, v) in samples(text, name) {
            if let Some(le) = label(labels, "le") {
                *by_le.entry(le.to_string()).or_default() += v;
            }
        }
        by_le
    };
    let (b, a) = (buckets(before), buckets(after));
    let mut cumulative: Vec<(f64, f64)> = a
        .iter()
        .map(|(le, v)| {
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            (bound, v - b.get(le).copied().unwrap_or(0.0))
        })
        .collect();
    cumulative.sort_by(|x, y| x.0.total_cmp(&y.0));
    let total = cumulative.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let at = |q: f64| {
        cumulative
            .iter()
            .find(|(_, c)| *c >= q * total)
            .map_or(f64::INFINITY, |(le, _)| *le)
    };
    Some((at(0.5), at(0.99)))
}

/// Label `key`'s value in a Prometheus sample line's label set.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Samples of `name`: (labels, value).
fn samples<'a>(text: &'a str, name: &str) -> impl Iterator<Item = (&'a str, f64)> {
    let name = name.to_string();
    text.lines().filter_map(move |l| {
        let (head, value) = l.rsplit_once(' ')?;
        let (n, labels) = match head.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}')?),
            None => (head, ""),
        };
        (n == name).then_some(())?;
        Some((labels, value.parse().ok()?))
    })
}

/// Sum of `name`'s samples whose labels match `filter`; 0 when there are none.
pub fn metric(text: &str, name: &str, filter: &[(&str, &str)]) -> f64 {
    metric_opt(text, name, filter).unwrap_or(0.0)
}

fn metric_opt(text: &str, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for (labels, v) in samples(text, name) {
        if filter
            .iter()
            .all(|(k, want)| label(labels, k) == Some(want))
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// `name`'s samples summed by the value of label `key`.
fn by_label(text: &str, name: &str, key: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (labels, v) in samples(text, name) {
        if let Some(k) = label(labels, key) {
            *out.entry(k.to_string()).or_default() += v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_read_by_name_and_labels() {
        let text = "# HELP x\n\
            egress_provider_calls_total{provider=\"kvm2\",op=\"create\",outcome=\"ok\"} 3\n\
            egress_provider_calls_total{provider=\"kvm2\",op=\"get\",outcome=\"ok\"} 2\n\
            egress_provider_calls_total{provider=\"kvm2\",op=\"create\",outcome=\"transient\"} 1\n\
            egress_gc_sweeps_total 4\n";
        assert_eq!(
            metric(text, "egress_provider_calls_total", &[("op", "create")]),
            4.0
        );
        assert_eq!(metric(text, "egress_gc_sweeps_total", &[]), 4.0);
        assert_eq!(metric_opt(text, "nope", &[]), None);
        let ops = by_label(text, "egress_provider_calls_total", "op");
        assert_eq!(ops.get("create"), Some(&4.0));
        assert_eq!(ops.get("get"), Some(&2.0));
    }

    #[test]
    fn each_host_has_its_own_loopback_range() {
        assert_eq!(host_address(0, 0).unwrap(), Ipv4Addr::new(127, 78, 0, 10));
        assert_eq!(host_address(1, 300).unwrap(), Ipv4Addr::new(127, 79, 1, 54));
        assert!(host_address(200, 0).is_err());
    }
}
