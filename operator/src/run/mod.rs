//! `egress-operator run`: the operator in a cluster.
//!
//! Start-up refuses a bad providers config at once (the pod fails visibly instead of
//! running half-configured), and so a refused `--plugin-cache-dir` or `--plugin-ca-file`;
//! then it serves `/metrics`, `/healthz`, `/readyz`, loads the template plugins in the
//! background ([`plugins`]: transient failures such as a download that does not answer
//! are retried with backoff, and the replica is ready but degraded meanwhile), reaches the
//! API server, and waits for the leader Lease. While leading, the Proxy controller, the
//! garbage collector, the provider health monitor and the fleet controllers (pools,
//! discovery, leases, the fast liveness probe: [`crate::fleet`]) run; when the lease is lost they
//! stop and the replica stands by again. The controller and the garbage collector reach
//! the providers only through a fence on the lease ([`Fenced`]): once it is lost no new
//! provider call starts, a Create checks it right before define and start, and calls in
//! flight are cancelled after [`LEASE_LOST_GRACE`]; then the replica cuts itself off the
//! hosts (which releases threads still blocked in libvirt) and waits for them, all within
//! the elector's fencing margin, before the new leader can take the lease over, so the two
//! replicas never act on one VM at once. SIGTERM stops
//! taking new work, lets reconciles in flight finish (a Create either completes, with its
//! status written, or cleans up what it made), releases the lease so the other replica
//! takes over at once, closes every SSH connection, and exits 0.

pub mod api_metrics;
pub mod endpoints;
pub mod plugins;
pub mod reload;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{self, ValidConfig};
use crate::controller::{self, ControllerMetrics};
use crate::error::{Classified, ErrorClass};
use crate::fleet::FleetMetrics;
use crate::gc::{GarbageCollector, GcMetrics, KubeProxyIndex};
use crate::leader::{LeaderElector, LeaderError, LeaderMetrics, LeaderOptions};
use crate::provider::decorate::Fenced;
use crate::provider::kvm2::backend::Kvm2Options;
use crate::provider::registry::Registry;
use crate::provider::{Fence, SharedProvider};
use crate::providerhealth::{HealthMetrics, HealthMonitor, KubeSink, MonitorOptions};
use crate::telemetry::LogFormat;
use crate::templates::{EngineOptions, TemplateEngine, TemplateSet};
use endpoints::{Probes, Role};
use plugins::{LoadBackoff, PluginLoader, PluginMetrics};

/// How long the process waits at exit for blocking threads still busy (a plugin download
/// abandoned at shutdown is bounded only by its own, longer timeout): everything that
/// matters has been awaited by then, so a short wait keeps SIGTERM prompt.
const EXIT_BLOCKING_GRACE: Duration = Duration::from_secs(5);
/// Largest `--plugin-ca-file` read: a CA bundle of a few hundred certificates.
const MAX_CA_FILE_BYTES: u64 = 1024 * 1024;
/// How long a provider call in flight may go on after this replica lost the lease. The
/// elector steps down at least its fencing margin (5 s by default) before the other
/// replica may take the lease over; the grace, the cut after it and the wait for the
/// released threads ([`SEVER_BOUND`]) fit in that margin (a test checks the sum).
pub const LEASE_LOST_GRACE: Duration = Duration::from_secs(2);
/// After the grace, how long the deposed replica waits for the blocking calls it cut off
/// to return: closing a tunnel releases a thread blocked in libvirt at once, so this is
/// only a backstop; a thread still running after it is reported
/// (`egress_fence_calls_still_running`).
pub const SEVER_BOUND: Duration = Duration::from_secs(2);
/// After the lease is lost, how long the components get to stop once their provider calls
/// were cancelled (status writes and events of the reconciles cut short are skipped, so
/// this is only the loops winding down); then they are aborted.
const LEASE_LOST_STOP: Duration = Duration::from_secs(5);

/// Arguments of `run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The providers config (YAML), e.g. the mounted ConfigMap.
    #[arg(long)]
    pub config: PathBuf,
    /// Address of the /metrics, /healthz and /readyz endpoints.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Cache of compiled template plugins. It holds native code, so it must be owned by
    /// this user and not writable by group or others, else start-up fails; a missing one
    /// is created 0700 (the Deployment points it below an emptyDir).
    #[arg(long, value_name = "DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
    /// PEM certificates to trust for `url` plugin downloads (instead of Mozilla's roots)
    /// and `oci://` pulls (instead of the system's): a site's internal CA.
    #[arg(long, value_name = "FILE")]
    pub plugin_ca_file: Option<PathBuf>,
    /// Run without leader election (a single replica only).
    #[arg(long)]
    pub no_leader_election: bool,
    /// Namespace of the leader Lease; POD_NAMESPACE when left out.
    #[arg(long)]
    pub lease_namespace: Option<String>,
    /// Name of the leader Lease.
    #[arg(long, default_value = crate::leader::DEFAULT_LEASE_NAME)]
    pub lease_name: String,
    /// This replica's identity in the election and in events; POD_NAME (else the host
    /// name) when left out.
    #[arg(long)]
    pub identity: Option<String>,
    /// Proxies reconciled at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: u16,
}

/// Why the operator could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The config file was refused.
    #[error("{0}")]
    Config(#[from] config::ConfigError),
    /// The plugin engine could not start.
    #[error("template engine: {0}")]
    Templates(String),
    /// The providers could not be built.
    #[error("providers: {0}")]
    Providers(String),
    /// No Kubernetes client configuration (in-cluster or KUBECONFIG).
    #[error("kubernetes client: {0}")]
    Client(String),
    /// The HTTP port could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Leader election failed to start or stopped.
    #[error("leader election: {0}")]
    Leader(#[from] LeaderError),
    /// The cluster identity could not be read or does not fit.
    #[error("cluster identity: {0}")]
    Identity(String),
    /// The lease namespace is not known.
    #[error("--lease-namespace is required when POD_NAMESPACE is not set")]
    NoLeaseNamespace,
    /// The controller, GC or health monitor ended without being asked to.
    #[error("a component stopped unexpectedly")]
    ComponentStopped,
    /// Signal handlers could not be installed.
    #[error("signals: {0}")]
    Signals(std::io::Error),
}

impl Classified for RunError {
    fn class(&self) -> ErrorClass {
        match self {
            RunError::Leader(e) => e.class(),
            RunError::Listen { .. } | RunError::Signals(_) => ErrorClass::Transient,
            _ => ErrorClass::Permanent,
        }
    }
}

/// Loads and checks the config, then runs until SIGTERM/SIGINT. Returns the exit code.
pub fn run(args: &RunArgs, err: &mut dyn std::io::Write) -> std::io::Result<u8> {
    let config = match config::load_file(&args.config) {
        Ok(c) => c,
        Err(e) => {
            writeln!(err, "{e}")?;
            return Ok(1);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("egress-operator")
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            writeln!(err, "cannot start the async runtime: {e}")?;
            return Ok(2);
        }
    };
    let result = runtime.block_on(serve(args.clone(), Arc::new(config)));
    runtime.shutdown_timeout(EXIT_BLOCKING_GRACE);
    match result {
        Ok(()) => Ok(0),
        Err(e) => {
            tracing::error!(error = %e, class = %e.class(), "operator stopped");
            writeln!(err, "egress-operator: {e}")?;
            Ok(1)
        }
    }
}

/// Everything built once at start and shared by every leadership term.
struct Parts {
    /// The config read at start (the fields a reload cannot change).
    config: Arc<ValidConfig>,
    /// The config and plugins in force.
    live: Arc<crate::config::live::Live>,
    /// Watches the config file; the leader runs it during its terms.
    reloader: Arc<tokio::sync::Mutex<reload::Reloader>>,
    providers: Arc<Registry>,
    templates: Arc<TemplateSet>,
    boards: BTreeMap<String, crate::provider::health::HealthBoard>,
    controller_metrics: ControllerMetrics,
    gc_metrics: GcMetrics,
    fence_metrics: crate::provider::decorate::FenceMetrics,
    health_metrics: HealthMetrics,
    fleet_metrics: FleetMetrics,
    lease_metrics: crate::fleet::lease::LeaseMetrics,
    leader_metrics: LeaderMetrics,
    /// Proxies, pools and leases as the controllers' caches hold them, at scrape time.
    state_metrics: crate::state_metrics::StateMetrics,
    /// Requests to the Kubernetes API.
    api_metrics: api_metrics::ApiMetrics,
    identity: String,
    /// Providers whose leftover volumes the collector sweeps (kvm2).
    volumes: Vec<Arc<dyn crate::gc::VolumeCollector>>,
}

impl Parts {
    fn provider_list(&self) -> Vec<SharedProvider> {
        self.providers
            .names()
            .filter_map(|n| self.providers.get(n).cloned())
            .collect()
    }

    /// The providers behind a fence on `leading`, for one leadership term.
    fn fenced(&self, fence: &Fence) -> Registry {
        let mut fenced = Registry::new();
        for p in self.provider_list() {
            fenced.insert(Arc::new(
                Fenced::new(p, fence.clone(), LEASE_LOST_GRACE)
                    .with_metrics(self.fence_metrics.clone()),
            ));
        }
        fenced
    }
}

async fn serve(args: RunArgs, config: Arc<ValidConfig>) -> Result<(), RunError> {
    let mut registry = prometheus_client::registry::Registry::default();
    // The engine only checks its flags (cache directory, CA file): a refusal is a
    // start-up error. Loading the plugins comes after the endpoints are up.
    let engine = Arc::new(engine(&args)?);
    let templates = Arc::new(TemplateSet::loading(&config.kvm2.templates));
    let plugin_metrics = PluginMetrics::register(&mut registry);
    let live = Arc::new(crate::config::live::Live::new(
        config.clone(),
        templates.clone(),
    ));
    let (providers, kvm2) =
        Registry::from_live(live.clone(), Kvm2Options::default(), Some(&mut registry))
            .map_err(|e| RunError::Providers(e.to_string()))?;
    let reload_state = Arc::new(reload::ReloadState::default());
    let reloader = reload::Reloader::new(
        args.config.clone(),
        live.clone(),
        engine.clone(),
        reload_state.clone(),
        reload::ReloadMetrics::register(&mut registry),
    );
    let mut boards = BTreeMap::new();
    boards.insert(
        crate::provider::registry::KVM2.to_string(),
        kvm2.health.clone(),
    );
    let identity = match &args.identity {
        Some(i) => i.clone(),
        None => crate::leader::resolve_identity()?,
    };
    let replace_after = config.serving.replace_after_seconds;
    let controller_metrics = ControllerMetrics::register(&mut registry);
    let parts = Parts {
        config,
        live: live.clone(),
        reloader: Arc::new(tokio::sync::Mutex::new(reloader)),
        providers: Arc::new(providers),
        templates: templates.clone(),
        boards,
        fleet_metrics: FleetMetrics::register(&mut registry).sharing(&controller_metrics),
        controller_metrics,
        gc_metrics: GcMetrics::register(&mut registry),
        fence_metrics: crate::provider::decorate::FenceMetrics::register(&mut registry),
        health_metrics: HealthMetrics::register(&mut registry),
        lease_metrics: crate::fleet::lease::LeaseMetrics::register(&mut registry),
        leader_metrics: LeaderMetrics::register(&mut registry),
        state_metrics: crate::state_metrics::StateMetrics::register(&mut registry, replace_after),
        api_metrics: api_metrics::ApiMetrics::register(&mut registry),
        identity,
        volumes: vec![kvm2.provider.clone()],
    };

    let probes = Arc::new(Probes::default());
    probes.set_watch(parts.controller_metrics.watch.clone());
    probes.set_live(live, reload_state);
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|source| RunError::Listen {
            addr: args.http_addr,
            source,
        })?;
    let (http_stop, mut http_stop_rx) = watch::channel(false);
    let app = endpoints::router(
        probes.clone(),
        Arc::new(registry),
        Some(parts.templates.clone()),
    );
    let http = tokio::spawn(async move {
        let stopped = async move {
            let _ = http_stop_rx.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(stopped)
            .await
        {
            tracing::error!(error = %e, "HTTP endpoint failed");
        }
    });
    tracing::info!(addr = %args.http_addr, identity = %parts.identity, "serving /metrics, /healthz, /readyz");

    let (term_tx, term_rx) = watch::channel(false);
    spawn_signal_watch(term_tx)?;
    // Until a plugin is loaded, Creates that need it fail transiently and are requeued.
    let loader = PluginLoader::new(
        templates,
        engine,
        parts.config.kvm2.templates.clone(),
        LoadBackoff::default(),
        plugin_metrics,
    );
    let (loader_stop, loader_stopped) = watch::channel(false);
    let loading = tokio::spawn(loader.run(terminated(loader_stopped)));
    let result = lead_until_terminated(&args, &parts, &probes, term_rx).await;

    probes.set_role(Role::Stopping);
    let _ = loader_stop.send(true);
    let _ = loading.await;
    kvm2.hosts.close().await;
    let _ = http_stop.send(true);
    let _ = http.await;
    tracing::info!("stopped");
    result
}

/// The template engine the flags ask for; a cache directory that is not private to this
/// user, or an unreadable or empty CA file, is refused here, naming the path and why.
fn engine(args: &RunArgs) -> Result<TemplateEngine, RunError> {
    let download_ca_pem = match &args.plugin_ca_file {
        None => None,
        Some(path) => Some(read_ca_file(path).map_err(|e| {
            RunError::Templates(format!("--plugin-ca-file {}: {e}", path.display()))
        })?),
    };
    TemplateEngine::with_options(&EngineOptions {
        cache_dir: args.plugin_cache_dir.clone(),
        download_ca_pem,
    })
    .map_err(|e| RunError::Templates(e.to_string()))
}

pub(crate) fn read_ca_file(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_CA_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_CA_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_CA_FILE_BYTES} bytes"
        )));
    }
    Ok(bytes)
}

fn spawn_signal_watch(term: watch::Sender<bool>) -> Result<(), RunError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut sigterm = signal(SignalKind::terminate()).map_err(RunError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(RunError::Signals)?;
    tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => tracing::info!("SIGTERM: finishing work in flight, then stopping"),
            _ = sigint.recv() => tracing::info!("SIGINT: finishing work in flight, then stopping"),
        }
        let _ = term.send(true);
    });
    Ok(())
}

async fn terminated(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|t| *t).await;
}

async fn lead_until_terminated(
    args: &RunArgs,
    parts: &Parts,
    probes: &Arc<Probes>,
    term: watch::Receiver<bool>,
) -> Result<(), RunError> {
    let client = tokio::select! {
        c = async {
            let client = connect(probes, &parts.api_metrics).await?;
            identify(&client, &parts.config).await?;
            Ok::<_, RunError>(client)
        } => c?,
        () = terminated(term.clone()) => return Ok(()),
    };
    if args.no_leader_election {
        tracing::warn!("leader election disabled: run a single replica only");
        probes.set_role(Role::Leading);
        parts.leader_metrics.set_leading(true);
        let (_tx, never_lost) = watch::channel(true);
        return match run_term(parts, args, &client, term.clone(), never_lost).await {
            TermEnd::ComponentStopped => Err(RunError::ComponentStopped),
            TermEnd::Terminated | TermEnd::LeaseLost => Ok(()),
        };
    }
    let namespace = match &args.lease_namespace {
        Some(n) => n.clone(),
        None => std::env::var("POD_NAMESPACE")
            .ok()
            .filter(|s| !s.is_empty())
            .ok_or(RunError::NoLeaseNamespace)?,
    };
    let mut options = LeaderOptions::new(namespace, parts.identity.clone());
    options.lease_name = args.lease_name.clone();
    options.validate()?;
    let (mut leadership, elector) =
        LeaderElector::start_with_metrics(client.clone(), options, parts.leader_metrics.clone())
            .await?;
    let result = loop {
        probes.set_role(Role::Standby);
        tokio::select! {
            r = leadership.acquired() => if let Err(e) = r { break Err(e.into()) },
            () = terminated(term.clone()) => break Ok(()),
        }
        probes.set_role(Role::Leading);
        tracing::info!(identity = %parts.identity, "leading: starting the controller, GC and health monitor");
        match run_term(parts, args, &client, term.clone(), leadership.subscribe()).await {
            TermEnd::Terminated => break Ok(()),
            TermEnd::ComponentStopped => break Err(RunError::ComponentStopped),
            TermEnd::LeaseLost => {
                tracing::warn!("lost the lease: reconciling stopped; standing by");
            }
        }
    };
    probes.set_role(Role::Stopping);
    match elector.shutdown().await {
        // The elector ended on its own (a Lease the Role does not cover): that error,
        // not "stopped", is what the operator exits with.
        Err(e) if matches!(result, Err(RunError::Leader(LeaderError::Stopped))) => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, "could not release the lease; the other replica waits for it to expire");
            result
        }
        Ok(()) => result,
    }
}

/// Reaches the API server (retrying: it may come up after us), so readiness means it.
async fn connect(probes: &Probes, api: &api_metrics::ApiMetrics) -> Result<kube::Client, RunError> {
    let config = kube::Config::infer()
        .await
        .map_err(|e| RunError::Client(e.to_string()))?;
    let client = kube::client::ClientBuilder::try_from(config)
        .map_err(|e| RunError::Client(e.to_string()))?
        .with_layer(&api_metrics::CountLayer(api.clone()))
        .build();
    let mut wait = Duration::from_millis(500);
    loop {
        match client.apiserver_version().await {
            Ok(v) => {
                tracing::info!(version = %v.git_version, "Kubernetes API reached");
                return Ok(client);
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "Kubernetes API not reachable");
                probes.set_role(Role::Starting);
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Resolves the cluster identity from the `kube-system` namespace's UID before anything
/// can write a mark: retried while the API server fails, fatal when it refuses.
async fn identify(client: &kube::Client, config: &ValidConfig) -> Result<(), RunError> {
    let mut wait = Duration::from_millis(500);
    loop {
        match crate::cluster_identity::read_cluster_uid(client).await {
            Ok(uid) => {
                let me = config
                    .identity()
                    .resolve_in_cluster(&uid)
                    .map_err(|e| RunError::Identity(e.to_string()))?;
                tracing::info!(cluster = %me.describe(), "cluster identity");
                return Ok(());
            }
            Err(kube::Error::Api(e)) if matches!(e.code, 401 | 403 | 404) => {
                return Err(RunError::Identity(format!(
                    "cannot read namespace {}: {} (the operator's ClusterRole needs get on namespaces/{})",
                    crate::cluster_identity::SYSTEM_NAMESPACE,
                    e.message,
                    crate::cluster_identity::SYSTEM_NAMESPACE
                )));
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "cannot read the cluster identity yet");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Why a leadership term ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TermEnd {
    Terminated,
    LeaseLost,
    ComponentStopped,
}

/// The fleet controllers (pools, discovery, leases, the fast liveness probe) for one term. They
/// write only Kubernetes objects, and each write checks `leading` first.
fn spawn_fleet<S, F>(
    tasks: &mut tokio::task::JoinSet<()>,
    parts: &Parts,
    client: &kube::Client,
    leading: &watch::Receiver<bool>,
    stop: &S,
) where
    S: Fn() -> F,
    F: std::future::Future<Output = ()> + Send + Sync + 'static,
{
    use crate::fleet::liveness::{Liveness, LivenessOptions};
    let board = Arc::new(crate::fleet::LivenessBoard::default());
    let ctx = Arc::new(
        crate::fleet::pool::FleetContext::new(
            client.clone(),
            parts.config.clone(),
            board.clone(),
            parts.fleet_metrics.clone(),
            leading.clone(),
            Some(parts.identity.clone()),
        )
        .with_state(parts.state_metrics.clone())
        .with_live(parts.live.clone())
        .with_providers(parts.providers.clone()),
    );
    let options = LivenessOptions {
        port: parts.config.serving.port,
        ..LivenessOptions::default()
    };
    let liveness = Liveness::new(board, options, parts.fleet_metrics.clone());
    tasks.spawn(liveness.run(client.clone(), stop()));
    tasks.spawn(bounded_stop(
        crate::fleet::pool::run(ctx.clone(), stop()),
        stop(),
    ));
    tasks.spawn(bounded_stop(
        crate::fleet::discovery::run(ctx.clone(), stop()),
        stop(),
    ));
    let leases = Arc::new(crate::fleet::lease::LeaseContext::new(
        ctx,
        parts.lease_metrics.clone(),
    ));
    tasks.spawn(bounded_stop(
        crate::fleet::lease::run(leases, stop()),
        stop(),
    ));
}

/// How long a fleet controller may take to wind down after the stop: its writes are
/// idempotent, so what is cut off is redone by the next leader.
const FLEET_STOP_GRACE: Duration = Duration::from_secs(5);

/// Runs `component` until it ends, or until [`FLEET_STOP_GRACE`] after `stop`. A kube
/// `Controller` asked to stop gracefully first waits for its store to be ready; when its
/// CRD is not installed (an operator upgraded before its CRDs) that never happens, and the
/// process would not stop on SIGTERM.
async fn bounded_stop(
    component: impl std::future::Future<Output = ()>,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::select! {
        () = component => {}
        () = async {
            stop.await;
            tokio::time::sleep(FLEET_STOP_GRACE).await;
        } => tracing::warn!("a fleet controller did not wind down within its grace; stopped"),
    }
}

/// One leadership term: the three components run until SIGTERM or the lease is lost,
/// then stop together; the controller first lets reconciles in flight finish.
async fn run_term(
    parts: &Parts,
    args: &RunArgs,
    client: &kube::Client,
    term: watch::Receiver<bool>,
    leading: watch::Receiver<bool>,
) -> TermEnd {
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    // A term lost before cut this replica off the hosts; leading again, it reconnects.
    crate::provider::decorate::reconnect(&parts.provider_list(), &parts.fence_metrics);
    let fence = Fence::new(leading.clone());
    let fenced = Arc::new(parts.fenced(&fence));
    let gc_fence = fence.clone();
    let ctx = Arc::new(
        controller::Context::new(
            client.clone(),
            parts.config.clone(),
            fenced.clone(),
            parts.controller_metrics.clone(),
            Some(parts.identity.clone()),
        )
        .with_fence(fence)
        .with_state(parts.state_metrics.clone())
        .with_live(parts.live.clone()),
    );
    let gc = GarbageCollector::new(
        fenced
            .names()
            .filter_map(|n| fenced.get(n).cloned())
            .collect(),
        Arc::new(KubeProxyIndex::new(client.clone())),
        &parts.config.gc,
        parts.gc_metrics.clone(),
    )
    .with_events(Arc::new(crate::gc::events::KubeGcEvents::new(
        client.clone(),
        Some(parts.identity.clone()),
    )))
    .with_volumes(
        parts
            .volumes
            .iter()
            .map(|v| {
                Arc::new(
                    crate::provider::decorate::FencedVolumes::new(
                        v.clone(),
                        gc_fence.clone(),
                        LEASE_LOST_GRACE,
                    )
                    .with_metrics(parts.fence_metrics.clone()),
                ) as Arc<dyn crate::gc::VolumeCollector>
            })
            .collect(),
    );
    let monitor = HealthMonitor::new(
        parts.provider_list(),
        parts.boards.clone(),
        Arc::new(KubeSink::new(client.clone())),
        MonitorOptions::from_config(&parts.config.health_check),
        parts.health_metrics.clone(),
    )
    .with_live_plugins(crate::provider::registry::KVM2, parts.live.clone());
    let mut tasks = tokio::task::JoinSet::new();
    {
        let reloader = parts.reloader.clone();
        let (client, identity, stopped) = (client.clone(), parts.identity.clone(), stop());
        tasks.spawn(async move {
            let mut r = reloader.lock().await;
            r.set_events(client, identity, crate::provider::registry::KVM2);
            r.run(stopped).await;
        });
    }
    tasks.spawn(controller::run(ctx, args.concurrency, stop()));
    tasks.spawn(gc.run(stop()));
    tasks.spawn(monitor.run(stop()));
    spawn_fleet(&mut tasks, parts, client, &leading, &stop);

    let mut leading = leading;
    let end = tokio::select! {
        () = terminated(term) => TermEnd::Terminated,
        _ = leading.wait_for(|l| !*l) => TermEnd::LeaseLost,
        _ = tasks.join_next() => {
            tracing::error!("a component stopped by itself; stopping the others");
            TermEnd::ComponentStopped
        }
    };
    let _ = stop_tx.send(true);
    // A replica that no longer leads exports no object state (the next leader does).
    parts.state_metrics.clear();
    let wind_down = async { while tasks.join_next().await.is_some() {} };
    if end == TermEnd::LeaseLost {
        // Provider calls in flight end within the grace, and what still blocks a thread is
        // cut off after it; nothing else may hold us longer.
        crate::provider::decorate::fence_off(
            &parts.provider_list(),
            LEASE_LOST_GRACE,
            SEVER_BOUND,
            &parts.fence_metrics,
        )
        .await;
        if tokio::time::timeout(LEASE_LOST_STOP, wind_down)
            .await
            .is_err()
        {
            tracing::warn!("components did not stop after the lease was lost; aborting them");
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
        }
    } else {
        wind_down.await;
    }
    end
}

#[cfg(test)]
mod fencing_budget {
    use super::*;

    /// The deposed replica's whole fencing (grace, cut, wait for the released threads)
    /// must end before the new leader may act, which the elector keeps at least its
    /// fencing margin after the step-down.
    #[test]
    fn fencing_fits_in_the_electors_margin() {
        let options = LeaderOptions::new("ns", "pod");
        let fencing = LEASE_LOST_GRACE + crate::provider::decorate::CUT_AFTER_GRACE + SEVER_BOUND;
        assert!(
            fencing < options.fencing_margin(),
            "fencing takes {fencing:?}, the margin is {:?}",
            options.fencing_margin()
        );
    }
}
