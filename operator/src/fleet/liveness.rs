//! The fast liveness signal behind discovery.
//!
//! The `Serving`/`Ready` probe of the Proxy controller is thorough (a CONNECT to the
//! configured target) and slow on purpose (every `serving.periodSeconds`, 30 s by
//! default). Discovery must drop a proxy within seconds, so every pool Proxy with an
//! address is also probed every [`LivenessOptions::period`] (1 s) by the same probe code
//! ([`crate::serving::probe_with`]) without a target: a TCP connect plus a well-formed
//! HTTP answer to `CONNECT 0.0.0.0:0`, within [`LivenessOptions::timeout`].
//! [`LivenessOptions::failure_threshold`] failures in a row (2) mark it down; one pass marks
//! it up again. Worst case from a failure to the verdict: one period to the next probe,
//! then `threshold` probes of at most `timeout` each, about 3 s with the defaults; the
//! EndpointSlice write follows at once.
//!
//! Cost at 1000 proxies: one short-lived socket per proxy per second, at most
//! [`LivenessOptions::concurrency`] (256) open at once; a proxy answers in milliseconds, so
//! a healthy round of 1000 takes a few milliseconds of wall time and on the order of 1000
//! connects and 100 kB of traffic per second. When every proxy hangs, a round takes
//! ceil(1000 / 256) timeouts (4 s): the concurrency bounds the sockets, not the latency.
//!
//! The guard (invariant F3): when a round probes at least [`GUARD_MIN_PROXIES`] proxies,
//! every one fails, and some of them were up, the failures are not believed (a cut
//! operator network, a full conntrack table, an exhausted fd limit look exactly like
//! that). The last verdicts stay, [`LivenessBoard::held`] is set, and discovery raises
//! `EndpointsHeld` on every pool. The first round where anything passes applies again.
//!
//! - "Up" before this process probed a proxy is what its `Ready` says (what the slices
//!   list when there is no verdict yet). So a new leader's first rounds start from the
//!   slices as they are: a leader that reaches no proxy holds them instead of emptying
//!   them, and a proxy needs `failure_threshold` failures to go down, as any other.
//! - The hold is bounded ([`crate::serving::GUARD_MAX_HOLD`]): after that long of rounds that all fail, the probe
//!   is believed again (a whole fleet can die), and no new hold begins until a round
//!   passes somewhere.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::broadcast;
use tokio::time::Instant;

use crate::api::proxy::Proxy;
use crate::api::proxy_pool::POOL_LABEL;
use crate::serving::{Dialer, TcpDialer, probe_with};

use super::metrics::FleetMetrics;

/// Below this many proxies an all-fail round is believed: one or two proxies failing
/// together is an ordinary event, and with a single proxy there is nothing to compare.
pub const GUARD_MIN_PROXIES: usize = 3;

/// Knobs of the fast probe.
#[derive(Debug, Clone)]
pub struct LivenessOptions {
    /// How often every pool proxy is probed: 1 s keeps the removal well within 5 s.
    pub period: Duration,
    /// Budget of one probe. A proxy on the bridge answers in milliseconds; 1 s leaves
    /// room for a loaded guest without stretching the removal past the bound.
    pub timeout: Duration,
    /// Failures in a row that mark a proxy down: 2, so one lost packet does not flap it.
    pub failure_threshold: u32,
    /// Probes in flight at once, across all pools.
    pub concurrency: usize,
    /// The proxy port (`serving.port`).
    pub port: u16,
}

impl Default for LivenessOptions {
    fn default() -> Self {
        Self {
            period: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            failure_threshold: 2,
            concurrency: 256,
            port: 3128,
        }
    }
}

/// A pool, by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    /// Namespace.
    pub namespace: String,
    /// Pool name.
    pub name: String,
}

/// One proxy to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Proxy UID.
    pub uid: String,
    /// Its pool.
    pub pool: PoolKey,
    /// Its address.
    pub ip: IpAddr,
    /// Whether its `Ready` is True: the verdict before its first probe here.
    pub ready: bool,
}

#[derive(Debug)]
struct Entry {
    ip: IpAddr,
    pool: PoolKey,
    up: bool,
    failures: u32,
    /// The first failing probe of the current streak, while it is down or going down:
    /// discovery reads it when it removes the endpoint (the removal histogram).
    failing_since: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    held: bool,
    /// The first round of the current streak of all-fail rounds (the hold's start).
    all_failing_since: Option<Instant>,
}

/// The verdicts of the fast probe, shared by the liveness loop (writer), discovery and the
/// pool controller (readers). A change notifies [`LivenessBoard::subscribe`]rs.
#[derive(Debug)]
pub struct LivenessBoard {
    inner: Mutex<Inner>,
    changed: broadcast::Sender<()>,
    max_hold: Duration,
}

impl Default for LivenessBoard {
    fn default() -> Self {
        Self::with_max_hold(crate::serving::GUARD_MAX_HOLD)
    }
}

/// What a round changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RoundReport {
    /// Proxies now down that were up.
    pub went_down: Vec<String>,
    /// Proxies now up that were down (or new).
    pub came_up: Vec<String>,
    /// Whether the guard holds the verdicts.
    pub held: bool,
}

impl LivenessBoard {
    /// A board whose all-fail hold lasts at most `max_hold` (tests shorten it).
    pub fn with_max_hold(max_hold: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            changed: broadcast::channel(16).0,
            max_hold,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The verdict for the Proxy `uid` at `ip`: `None` before its first probe at that
    /// address (the caller falls back on `Ready`).
    pub fn verdict(&self, uid: &str, ip: IpAddr) -> Option<bool> {
        let g = self.lock();
        g.entries.get(uid).filter(|e| e.ip == ip).map(|e| e.up)
    }

    /// Whether the all-fail guard holds the verdicts now.
    pub fn held(&self) -> bool {
        self.lock().held
    }

    /// Whether a "down" verdict may be acted on now: false while the guard holds (the
    /// operator's own network path is suspect). The lease controller gives up no bound
    /// proxy for not serving while this is false.
    pub fn trusted(&self) -> bool {
        !self.held()
    }

    /// Takes the start of the failure streak of a proxy whose endpoint was just removed.
    pub fn take_failing_since(&self, uid: &str) -> Option<Instant> {
        let mut g = self.lock();
        g.entries
            .get_mut(uid)
            .filter(|e| !e.up)
            .and_then(|e| e.failing_since.take())
    }

    /// Notified after every round that changed a verdict or the guard.
    pub fn subscribe(&self) -> broadcast::Receiver<()> {
        self.changed.subscribe()
    }

    /// Applies one round of results (`true`: passed). Proxies not in `results` are
    /// forgotten (gone, or no address any more).
    pub fn apply(&self, results: &[(Target, bool)], threshold: u32, now: Instant) -> RoundReport {
        let mut report = RoundReport::default();
        let mut g = self.lock();
        let probed: HashSet<&str> = results.iter().map(|(t, _)| t.uid.as_str()).collect();
        g.entries.retain(|uid, _| probed.contains(uid.as_str()));
        let all_failed = results.len() >= GUARD_MIN_PROXIES && results.iter().all(|(_, ok)| !ok);
        // Up as last judged here, else as `Ready` says (a new term starts from that).
        let some_up = results.iter().any(|(t, _)| match g.entries.get(&t.uid) {
            Some(e) if e.ip == t.ip => e.up,
            _ => t.ready,
        });
        if !all_failed {
            g.all_failing_since = None;
        }
        let hold = all_failed && some_up && {
            let since = *g.all_failing_since.get_or_insert(now);
            let within = now.duration_since(since) < self.max_hold;
            if !within && g.held {
                tracing::warn!(
                    held_for = ?self.max_hold,
                    "every pool proxy kept failing the fast probe: believing it again"
                );
            }
            within
        };
        if hold != g.held {
            g.held = hold;
            report.held = hold;
            if hold {
                tracing::warn!(
                    proxies = results.len(),
                    "every pool proxy failed the fast probe at once: keeping the last known \
                     endpoints (the operator's own network path is suspect)"
                );
            } else {
                tracing::info!("fast probes pass again: endpoints follow the probe again");
            }
        }
        report.held = hold;
        if hold {
            drop(g);
            let _ = self.changed.send(());
            return report;
        }
        for (t, ok) in results {
            // A proxy new here (or at a new address: a replaced VM) starts from `Ready`,
            // the verdict discovery used until now.
            let fresh = || Entry {
                ip: t.ip,
                pool: t.pool.clone(),
                up: t.ready,
                failures: 0,
                failing_since: None,
            };
            let e = g.entries.entry(t.uid.clone()).or_insert_with(fresh);
            if e.ip != t.ip {
                *e = fresh();
            }
            if *ok {
                e.failures = 0;
                e.failing_since = None;
                if !e.up {
                    e.up = true;
                    report.came_up.push(t.uid.clone());
                }
            } else {
                if e.failures == 0 {
                    e.failing_since = Some(now);
                }
                e.failures = e.failures.saturating_add(1);
                if e.up && e.failures >= threshold.max(1) {
                    e.up = false;
                    report.went_down.push(t.uid.clone());
                }
            }
        }
        let changed = !report.went_down.is_empty() || !report.came_up.is_empty();
        drop(g);
        if changed {
            let _ = self.changed.send(());
        }
        report
    }

    /// Pools with a proxy whose verdict is known (for metrics and tests).
    pub fn pools(&self) -> Vec<PoolKey> {
        let g = self.lock();
        let mut v: Vec<PoolKey> = g.entries.values().map(|e| e.pool.clone()).collect();
        v.sort();
        v.dedup();
        v
    }
}

/// The liveness loop: probes every pool proxy each period and updates the board.
pub struct Liveness {
    board: Arc<LivenessBoard>,
    dialer: Arc<dyn Dialer>,
    options: LivenessOptions,
    metrics: FleetMetrics,
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Liveness {
    /// A loop over plain TCP.
    pub fn new(board: Arc<LivenessBoard>, options: LivenessOptions, metrics: FleetMetrics) -> Self {
        Self {
            board,
            dialer: Arc::new(TcpDialer),
            options,
            metrics,
        }
    }

    /// The same loop dialling through `dialer` (tests probe in memory).
    pub fn with_dialer(mut self, dialer: Arc<dyn Dialer>) -> Self {
        self.dialer = dialer;
        self
    }

    /// Probes `targets` once (at most `concurrency` at a time) and applies the results.
    pub async fn round(&self, targets: Vec<Target>) -> RoundReport {
        let port = self.options.port;
        let timeout = self.options.timeout;
        let dialer = &*self.dialer;
        let results: Vec<(Target, bool)> = futures_util::stream::iter(targets)
            .map(|t| async move {
                let out = probe_with(dialer, SocketAddr::new(t.ip, port), None, timeout).await;
                (t, out.is_serving())
            })
            .buffer_unordered(self.options.concurrency.max(1))
            .collect()
            .await;
        self.metrics.liveness_round(results.len());
        let report = self
            .board
            .apply(&results, self.options.failure_threshold, Instant::now());
        self.metrics.set_held(report.held);
        report
    }

    /// Runs until `shutdown`: a reflector over pool Proxies feeds each round's targets.
    pub async fn run<F>(self, client: Client, shutdown: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let api = Api::<Proxy>::all(client);
        let (reader, writer) = reflector::store();
        let config = watcher::Config::default().labels(POOL_LABEL).any_semantic();
        let feed = reflector::reflector(writer, watcher(api, config))
            .default_backoff()
            .for_each(|_| async {});
        let mut tick = tokio::time::interval(self.options.period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let rounds = async {
            loop {
                tick.tick().await;
                if reader.wait_until_ready().await.is_err() {
                    return;
                }
                self.round(targets(&reader)).await;
            }
        };
        tokio::select! {
            () = feed => tracing::warn!("the liveness watch ended"),
            () = rounds => {},
            () = shutdown => {},
        }
    }
}

/// The probe targets among the Proxies in `store`: pool members with an address that are
/// not being deleted.
pub fn targets(store: &Store<Proxy>) -> Vec<Target> {
    store
        .state()
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let pool = p.labels().get(POOL_LABEL)?.clone();
            let status = p.status.as_ref()?;
            let ip = status.address.as_deref()?.parse().ok()?;
            Some(Target {
                ready: crate::controller::status::is_ready(status),
                uid: p.uid()?,
                pool: PoolKey {
                    namespace: p.namespace()?,
                    name: pool,
                },
                ip,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(uid: &str, ip: &str) -> Target {
        Target {
            uid: uid.into(),
            pool: PoolKey {
                namespace: "ns".into(),
                name: "p".into(),
            },
            ip: ip.parse().unwrap(),
            ready: true,
        }
    }

    fn round(board: &LivenessBoard, r: &[(&str, &str, bool)]) -> RoundReport {
        let results: Vec<_> = r.iter().map(|(u, ip, ok)| (t(u, ip), *ok)).collect();
        board.apply(&results, 2, Instant::now())
    }

    #[test]
    fn two_failures_mark_down_and_one_pass_marks_up() {
        let b = LivenessBoard::default();
        let ip = "192.0.2.1";
        round(&b, &[("a", ip, true), ("x", "192.0.2.9", true)]);
        assert_eq!(b.verdict("a", ip.parse().unwrap()), Some(true));
        let r = round(&b, &[("a", ip, false), ("x", "192.0.2.9", true)]);
        assert!(r.went_down.is_empty(), "one failure is not enough");
        assert_eq!(b.verdict("a", ip.parse().unwrap()), Some(true));
        let r = round(&b, &[("a", ip, false), ("x", "192.0.2.9", true)]);
        assert_eq!(r.went_down, ["a"]);
        assert_eq!(b.verdict("a", ip.parse().unwrap()), Some(false));
        assert!(b.take_failing_since("a").is_some());
        assert!(b.take_failing_since("a").is_none(), "taken once");
        let r = round(&b, &[("a", ip, true), ("x", "192.0.2.9", true)]);
        assert_eq!(r.came_up, ["a"]);
        // Another address: the old verdict does not apply to it.
        assert_eq!(b.verdict("a", "192.0.2.2".parse().unwrap()), None);
    }

    #[test]
    fn when_every_proxy_fails_at_once_the_last_verdicts_are_held() {
        let b = LivenessBoard::default();
        let ups = [
            ("a", "192.0.2.1", true),
            ("b", "192.0.2.2", true),
            ("c", "192.0.2.3", true),
        ];
        let downs = ups.map(|(u, ip, _)| (u, ip, false));
        round(&b, &ups);
        for _ in 0..5 {
            let r = round(&b, &downs);
            assert!(r.held);
            assert!(r.went_down.is_empty());
        }
        assert!(b.held());
        for (u, ip, _) in ups {
            assert_eq!(b.verdict(u, ip.parse().unwrap()), Some(true), "{u} kept");
        }
        // One passes: the guard lets go and the others' failures count again.
        let mixed = [
            ("a", "192.0.2.1", true),
            ("b", "192.0.2.2", false),
            ("c", "192.0.2.3", false),
        ];
        let r = round(&b, &mixed);
        assert!(!r.held && !b.held());
        let r = round(&b, &mixed);
        assert_eq!(r.went_down, ["b", "c"]);
    }

    /// Issue 33 item 2: a new term's board knows no verdict; the proxies `Ready` says are
    /// up count as up, so a first round in which everything fails is held, not believed.
    #[test]
    fn a_fresh_board_holds_a_first_round_that_fails_whole() {
        let b = LivenessBoard::default();
        let downs = [
            ("a", "192.0.2.1", false),
            ("b", "192.0.2.2", false),
            ("c", "192.0.2.3", false),
        ];
        for _ in 0..3 {
            let r = round(&b, &downs);
            assert!(r.held && r.went_down.is_empty());
        }
        assert_eq!(b.verdict("a", "192.0.2.1".parse().unwrap()), None);
    }

    #[test]
    fn a_proxy_first_seen_failing_needs_the_threshold_to_go_down() {
        let b = LivenessBoard::default();
        let ok = ("x", "192.0.2.9", true);
        let r = round(&b, &[("a", "192.0.2.1", false), ok]);
        assert!(r.went_down.is_empty());
        assert_eq!(b.verdict("a", "192.0.2.1".parse().unwrap()), Some(true));
        let r = round(&b, &[("a", "192.0.2.1", false), ok]);
        assert_eq!(r.went_down, ["a"]);
    }

    #[test]
    fn the_hold_lasts_at_most_its_bound_then_the_probe_is_believed() {
        let b = LivenessBoard::with_max_hold(Duration::from_secs(10));
        let ups = [
            ("a", "192.0.2.1", true),
            ("b", "192.0.2.2", true),
            ("c", "192.0.2.3", true),
        ];
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let results = |r: &[(&str, &str, bool)]| -> Vec<(Target, bool)> {
            r.iter().map(|(u, ip, ok)| (t(u, ip), *ok)).collect()
        };
        b.apply(&results(&ups), 2, at(0));
        let downs = results(&ups.map(|(u, ip, _)| (u, ip, false)));
        for s in 1..10 {
            assert!(b.apply(&downs, 2, at(s)).held, "held at {s} s");
        }
        let r = b.apply(&downs, 2, at(11));
        assert!(!r.held && !b.held(), "the bound ran out");
        let r = b.apply(&downs, 2, at(12));
        assert!(!r.held);
        assert_eq!(r.went_down.len(), 3, "believed: {r:?}");
        // Still failing, nothing up: no new hold.
        assert!(!b.apply(&downs, 2, at(13)).held);
        // A pass ends the streak: a later all-fail round is held again.
        b.apply(&results(&ups), 2, at(14));
        assert!(b.apply(&downs, 2, at(15)).held);
    }

    #[test]
    fn a_small_pool_that_fails_whole_is_believed() {
        let b = LivenessBoard::default();
        round(&b, &[("a", "192.0.2.1", true), ("b", "192.0.2.2", true)]);
        round(&b, &[("a", "192.0.2.1", false), ("b", "192.0.2.2", false)]);
        let r = round(&b, &[("a", "192.0.2.1", false), ("b", "192.0.2.2", false)]);
        assert!(!r.held);
        assert_eq!(r.went_down.len(), 2);
    }
}
