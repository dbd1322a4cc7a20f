//! The controller's side of "Ready means it proxies": what it concludes about an
//! instance's proxy ([`check`], the `Serving` condition), when it looks again
//! ([`retry_after`]), when a proxy that does not serve is replaced ([`overdue`]),
//! and what it remembers per Proxy between reconciles ([`Memory`]).
//!
//! A proxy that serves is probed every `serving.periodSeconds`; the provider is asked for
//! the instance only every `ready_refresh` meanwhile (the probe is the cheap, direct
//! check; a provider `get` costs a libvirt round trip and address detection on the
//! host). A probe that fails makes the next reconcile ask the provider again, so a lost or
//! crashed VM is noticed at the next retry. A proxy that does not serve is probed again
//! after 5 s, doubling up to the period.
//!
//! Replacement: an instance whose proxy has not served for `serving.replaceAfterSeconds`
//! is replaced, counted from the later of its creation and the last time it served. The
//! last time it served is the `Serving` condition's `lastTransitionTime` (it moves only
//! when the condition flips), so the count survives a restart or a new leader and a flap
//! shorter than the grace starts it over. An instance that was not running (paused) at
//! the last check starts its grace again when it runs: it could not serve before.
//!
//! The prober guard: probes leave from the operator, so a cut in the operator's own
//! network path (a NetworkPolicy, a route) looks like every proxy failing. When most of
//! the proxies recently probed on the instance's host, or in the whole fleet, failed on
//! the path (a timeout or no route) at once, the prober is suspected, not the proxies:
//! nothing is replaced, and the `Serving` condition says [`PROBER_SUSPECTED`]
//! ([`Memory::prober_suspected`]). Like the fast probe's all-fail hold in discovery, it
//! judges from what it sees now (no earlier verdict of this process is needed, so a new
//! leader is as careful as an old one), and it withholds replacements for at most
//! [`crate::serving::GUARD_MAX_HOLD`] per scope (a host, the fleet), counted from the
//! first replacement it withheld there: then the probe is believed and overdue proxies
//! are replaced, as a whole fleet can die too (issue 33, item 2).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::api::proxy::ProxyStatus;
use crate::provider::{Instance, InstanceId, InstanceState};
use crate::serving::{ProbeOutcome, Prober};

use super::status::{self, SERVING};

/// `Serving` reason: the guest never read its cloud-init seed.
pub const SEED_NOT_READ: &str = "SeedNotRead";
/// `Serving` reason: the instance is not running (paused, shutting down, ...).
pub const NOT_RUNNING: &str = "NotRunning";
/// `Serving` reason: the probe failed, but so did most probes of the host or the fleet at
/// once, so the operator's own network path is suspected and nothing is replaced.
pub const PROBER_SUSPECTED: &str = "ProberSuspected";

/// The prober guard's quorum: fewer proxies probed recently (on a host, or in the fleet)
/// say nothing about the prober, so one or two failing proxies are still replaced.
pub const SUSPECT_MIN_PROXIES: usize = 3;

/// First retry of a proxy that does not serve: a proxy restarting or a guest finishing
/// its boot answers within seconds; the retries double up to the probe period.
pub const RETRY_BASE: Duration = Duration::from_secs(5);

/// What the controller concluded about an instance's proxy: the `Serving` condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Whether it serves.
    pub serving: bool,
    /// The condition's reason: a [`ProbeOutcome::reason`], [`SEED_NOT_READ`] or
    /// [`NOT_RUNNING`].
    pub reason: &'static str,
    /// The condition's message.
    pub message: String,
    /// Whether the instance runs: not serving is then the guest's fault (no address, no
    /// seed, no proxy) and counts towards replacement. A paused VM does not count.
    pub running: bool,
}

impl Check {
    /// Not serving, without a probe.
    fn not(reason: &'static str, message: String, running: bool) -> Self {
        Self {
            serving: false,
            reason,
            message,
            running,
        }
    }

    /// Whether the guest never read its seed.
    pub fn seed_not_read(&self) -> bool {
        self.reason == SEED_NOT_READ
    }

    /// Whether the probe failed on the network path (no answer in time, no route): what a
    /// cut between the operator and the bridges looks like. A refused connection or a
    /// wrong answer came from the guest, so the path works.
    pub fn path_failure(&self) -> bool {
        !self.serving && matches!(self.reason, "Timeout" | "Unreachable")
    }

    /// This failed check, reported as the prober's suspected fault (`why`).
    pub fn suspected(self, why: &str) -> Self {
        Self {
            reason: PROBER_SUSPECTED,
            message: format!("{}; not replaced: {why}", self.message),
            ..self
        }
    }
}

/// Probes the instance's proxy when there is something to probe: a running instance with
/// an address (its first, the one status publishes).
///
/// "Seed read" is decided by the probe, not by the guest's host name: user-data's
/// `hostname`, `fqdn` or `preserve_hostname` win over meta-data's `local-hostname`, so a
/// guest that read its seed can report another name. A host name that is not the seed's
/// ([`Instance::seed_applied`] `Some(false)`) is only a hint: a proxy that answers read
/// its seed; one that does not is reported as [`SEED_NOT_READ`] with the probe's outcome.
pub async fn check(prober: &Prober, instance: &Instance) -> Check {
    if instance.state != InstanceState::Running {
        return Check::not(
            NOT_RUNNING,
            format!("instance is {}", instance.state),
            false,
        );
    }
    let renamed = instance.seed_applied == Some(false);
    let Some(ip) = instance.addresses.first() else {
        let out = ProbeOutcome::NoAddress;
        return Check::not(out.reason(), out.describe(None, None), true);
    };
    let outcome = prober.probe(*ip).await;
    let message = outcome.describe(Some(prober.addr(*ip)), prober.target());
    let path = matches!(
        outcome,
        ProbeOutcome::Timeout { .. } | ProbeOutcome::Unreachable { .. }
    );
    // A failure on the path keeps its own reason: the prober guard counts it.
    if renamed && !outcome.is_serving() && !path {
        // Counts towards replacement: a new VM may well read its seed.
        return Check::not(
            SEED_NOT_READ,
            format!(
                "{message}; the guest's host name is not its seed's local-hostname, so it \
                 may never have read its cloud-init seed (or its user-data set another host \
                 name)"
            ),
            true,
        );
    }
    Check {
        serving: outcome.is_serving(),
        reason: outcome.reason(),
        message,
        running: true,
    }
}

/// When a proxy that does not serve is due for replacement: `Some(since)`, the time it
/// has not served since, when that is at least `replace_after` ago (zero: never).
/// `prev` is the status before this check (its `Serving` condition says since when the
/// proxy has not served); only a running instance whose proxy fails counts.
pub fn overdue(
    replace_after: Duration,
    prev: &ProxyStatus,
    instance: &Instance,
    check: &Check,
    now: jiff::Timestamp,
) -> Option<jiff::Timestamp> {
    if replace_after.is_zero() || check.serving || !check.running {
        return None;
    }
    // Not serving before this check: since the condition flipped. Serving before (or not
    // recorded, e.g. just upgraded): since now, the grace starts here. Not running at the
    // last check (paused): since now too, it could not serve before (status then moves
    // the transition time here, [`status::observed`]).
    let flipped = status::condition(prev, SERVING)
        .filter(|c| c.status == "False" && c.reason != NOT_RUNNING)
        .map_or(now, |c| c.last_transition_time.0);
    // A new instance gets its whole grace, whatever its predecessor did.
    let since = match instance.created_at.parse::<jiff::Timestamp>() {
        Ok(created) => flipped.max(created),
        Err(_) => flipped,
    };
    let waited = now.duration_since(since);
    let grace = jiff::SignedDuration::try_from(replace_after).ok()?;
    (waited >= grace).then_some(since)
}

/// What the controller remembers about each Proxy's proxy between reconciles, by UID. In
/// memory only: after a restart the first reconcile asks the provider and probes, and
/// the replacement grace comes from status, not from here.
#[derive(Debug, Default)]
pub struct Memory(
    Mutex<HashMap<String, Entry>>,
    /// When each scope (`host <name>`, `fleet`) first withheld a replacement, and last
    /// did, while the suspicion lasts there.
    Mutex<HashMap<String, (Instant, Instant)>>,
);

#[derive(Debug, Default)]
struct Entry {
    /// Consecutive checks that did not serve.
    failures: u32,
    /// Whether the last check served.
    served: bool,
    /// The instance as the provider last reported it.
    fetched: Option<Fetched>,
    /// The status this controller last wrote (`None` after a failed write).
    written: Option<ProxyStatus>,
    /// The last check: when, on which host, and whether it failed on the path.
    seen: Option<Seen>,
}

#[derive(Debug)]
struct Seen {
    at: Instant,
    host: String,
    path_failure: bool,
}

#[derive(Debug)]
struct Fetched {
    at: Instant,
    trigger: u64,
    instance: Instance,
}

impl Memory {
    fn with<T>(&self, uid: &str, f: impl FnOnce(&mut Entry) -> T) -> T {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(m.entry(uid.to_string()).or_default())
    }

    /// The instance the provider reported less than `max_age` ago, when it is the one
    /// status names, nothing that justifies a look (the trigger) changed, and its proxy
    /// served at the last check: then only the probe is repeated.
    pub fn fresh(
        &self,
        uid: &str,
        id: &InstanceId,
        trigger: u64,
        max_age: Duration,
    ) -> Option<Instance> {
        self.with(uid, |e| {
            let f = e.fetched.as_ref()?;
            (e.served && f.trigger == trigger && &f.instance.id == id && f.at.elapsed() < max_age)
                .then(|| f.instance.clone())
        })
    }

    /// Records what the provider just reported.
    pub fn fetched(&self, uid: &str, trigger: u64, instance: &Instance) {
        self.with(uid, |e| {
            e.fetched = Some(Fetched {
                at: Instant::now(),
                trigger,
                instance: instance.clone(),
            });
        });
    }

    /// Records a check of an instance on `host`; returns the failures before it (0 for
    /// the first of a streak).
    pub fn checked(&self, uid: &str, host: &str, check: &Check) -> u32 {
        let serving = check.serving;
        self.with(uid, |e| {
            let before = e.failures;
            e.seen = Some(Seen {
                at: Instant::now(),
                host: host.to_string(),
                path_failure: check.path_failure(),
            });
            e.served = serving;
            e.failures = if serving {
                0
            } else {
                e.failures.saturating_add(1)
            };
            before
        })
    }

    /// Records a status write (`None`: it failed, what the API server has is unknown).
    pub fn written(&self, uid: &str, status: Option<&ProxyStatus>) {
        self.with(uid, |e| e.written = status.cloned());
    }

    /// Whether `new` must be written: it differs (apart from the probe latency) from the
    /// status the object showed, or from the one this controller last wrote (the object
    /// may not show our last write yet).
    pub fn needs_write(&self, uid: &str, shown: &ProxyStatus, new: &ProxyStatus) -> bool {
        if !status::same_apart_from_latency(shown, new) {
            return true;
        }
        self.with(uid, |e| {
            e.written
                .as_ref()
                .is_some_and(|w| !status::same_apart_from_latency(w, new))
        })
    }

    /// Why the prober, not the proxies, is suspected, when it is: more than half of the
    /// proxies checked within `window` on `host`, or in the whole fleet, failed on the
    /// path ([`Check::path_failure`]), and they are at least [`SUSPECT_MIN_PROXIES`]; and
    /// the scope has withheld replacements for less than
    /// [`crate::serving::GUARD_MAX_HOLD`]. Called when a replacement is due: the bound
    /// counts from the first call that withheld one in the scope, and starts afresh once
    /// the scope is no longer suspected, or withheld nothing for two windows (the
    /// suspicion ended between calls).
    pub fn prober_suspected(&self, host: &str, window: Duration) -> Option<String> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let recent: Vec<&Seen> = m
            .values()
            .filter_map(|e| e.seen.as_ref())
            .filter(|s| s.at.elapsed() <= window)
            .collect();
        let judge = |scope: String, seen: &[&Seen]| {
            let failed = seen.iter().filter(|s| s.path_failure).count();
            (seen.len() >= SUSPECT_MIN_PROXIES && failed * 2 > seen.len()).then(|| {
                format!(
                    "{failed} of the {} proxies probed {scope} in the last {} s timed out or \
                     were unreachable at once, so the operator's own network path is suspected",
                    seen.len(),
                    window.as_secs()
                )
            })
        };
        let on_host: Vec<&Seen> = recent.iter().copied().filter(|s| s.host == host).collect();
        let verdicts = [
            (
                format!("host {host}"),
                judge(format!("on host {host}"), &on_host),
            ),
            ("fleet".to_string(), judge("in the fleet".into(), &recent)),
        ];
        drop(m);
        let mut since = self.1.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let mut out = None;
        for (scope, why) in verdicts {
            let Some(why) = why else {
                since.remove(&scope);
                continue;
            };
            let (start, last) = since.entry(scope).or_insert((now, now));
            if now.duration_since(*last) > 2 * window {
                *start = now;
            }
            *last = now;
            if out.is_none() && now.duration_since(*start) < crate::serving::GUARD_MAX_HOLD {
                out = Some(why);
            }
        }
        out
    }

    /// Forgets the Proxy (it is gone).
    pub fn forget(&self, uid: &str) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(uid);
    }
}

/// The delay before probing a proxy that does not serve again, after `failures_before`
/// earlier failures: [`RETRY_BASE`] doubling up to `period`, spread by `jitter` (a
/// fraction) at `unit` in [0, 1), so a host's proxies that failed together do not retry
/// in lockstep.
pub fn retry_after(failures_before: u32, period: Duration, jitter: f64, unit: f64) -> Duration {
    let ladder = super::requeue::Ladder {
        base: RETRY_BASE.min(period),
        max: period,
    };
    let d = ladder.delay(failures_before).as_secs_f64();
    let spread = jitter.clamp(0.0, 1.0) * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
    Duration::from_secs_f64((d * (1.0 + spread)).max(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::ProxyRef;

    fn at(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn instance(created: i64) -> Instance {
        Instance {
            id: InstanceId {
                host: "h1".into(),
                name: "egress-u1".into(),
            },
            proxy: ProxyRef {
                namespace: "ns".into(),
                name: "p".into(),
                uid: "u1".into(),
            },
            state: InstanceState::Running,
            addresses: vec!["192.0.2.7".parse().unwrap()],
            address_source: None,
            seed_applied: None,
            created_at: at(created).to_string(),
        }
    }

    fn failing() -> Check {
        Check {
            serving: false,
            reason: "ConnectionRefused",
            message: "refused".into(),
            running: true,
        }
    }

    fn passing() -> Check {
        Check {
            serving: true,
            reason: "Serving",
            message: "answered".into(),
            running: true,
        }
    }

    fn timed_out() -> Check {
        Check {
            reason: "Timeout",
            message: "no answer".into(),
            ..failing()
        }
    }

    fn status_not_serving_since(t: i64) -> ProxyStatus {
        let mut s = ProxyStatus::default();
        status::set_condition(
            &mut s.conditions,
            SERVING,
            false,
            "Timeout",
            "x",
            None,
            at(t),
        );
        s
    }

    #[test]
    fn the_grace_counts_from_the_later_of_creation_and_the_last_flip() {
        let grace = Duration::from_secs(900);
        let i = instance(0);
        // Never served, created at 0: due at 900, not before.
        let none = ProxyStatus::default();
        assert_eq!(overdue(grace, &none, &i, &failing(), at(899)), None);
        let prev = status_not_serving_since(-5000);
        assert_eq!(overdue(grace, &prev, &i, &failing(), at(899)), None);
        assert_eq!(overdue(grace, &prev, &i, &failing(), at(900)), Some(at(0)));
        // Stopped serving at 2000: due at 2900.
        let prev = status_not_serving_since(2000);
        assert_eq!(overdue(grace, &prev, &i, &failing(), at(2899)), None);
        assert_eq!(
            overdue(grace, &prev, &i, &failing(), at(2900)),
            Some(at(2000))
        );
        // Serving until this check: the grace starts now.
        let mut serving = ProxyStatus::default();
        status::set_condition(
            &mut serving.conditions,
            SERVING,
            true,
            "Serving",
            "",
            None,
            at(1),
        );
        assert_eq!(overdue(grace, &serving, &i, &failing(), at(99_999)), None);
    }

    #[test]
    fn zero_a_pass_or_a_paused_instance_never_replaces() {
        let prev = status_not_serving_since(0);
        let i = instance(0);
        let late = at(1_000_000);
        assert_eq!(overdue(Duration::ZERO, &prev, &i, &failing(), late), None);
        let pass = Check {
            serving: true,
            reason: "Serving",
            ..failing()
        };
        assert_eq!(
            overdue(Duration::from_secs(60), &prev, &i, &pass, late),
            None
        );
        let paused = Check::not(NOT_RUNNING, "paused".into(), false);
        assert_eq!(
            overdue(Duration::from_secs(60), &prev, &i, &paused, late),
            None
        );
    }

    #[test]
    fn retries_double_up_to_the_period() {
        let period = Duration::from_secs(30);
        let d: Vec<u64> = (0..6)
            .map(|n| retry_after(n, period, 0.2, 0.5).as_secs())
            .collect();
        assert_eq!(d, [5, 10, 20, 30, 30, 30]);
        let lo = retry_after(0, period, 0.2, 0.0);
        assert_eq!(lo, Duration::from_secs(4));
    }

    #[test]
    fn a_status_is_written_when_the_object_or_our_last_write_differs() {
        let i = instance(0);
        let pass = Check {
            serving: true,
            reason: "Serving",
            message: "answered in 3 ms".into(),
            running: true,
        };
        let serving = status::observed(&ProxyStatus::default(), None, &i, &pass, at(0));
        let down = status::observed(&serving, None, &i, &failing(), at(30));
        let m = Memory::default();
        // Nothing written yet: the object's status decides.
        assert!(!m.needs_write("u1", &serving, &serving));
        assert!(m.needs_write("u1", &serving, &down));
        // We wrote `down`, but the object still shows `serving` (the watch lags): a
        // status like `serving` again must be written, or `down` would stay.
        m.written("u1", Some(&down));
        assert!(m.needs_write("u1", &serving, &serving));
        // Once the object shows our write, only a change is written.
        assert!(!m.needs_write("u1", &down, &down));
        m.written("u1", None);
        assert!(
            !m.needs_write("u1", &down, &down),
            "a failed write: the object decides"
        );
    }

    #[test]
    fn failures_count_until_a_pass_and_a_cached_instance_needs_a_pass() {
        let m = Memory::default();
        let i = instance(0);
        m.fetched("u1", 7, &i);
        assert_eq!(
            m.fresh("u1", &i.id, 7, Duration::from_secs(300)),
            None,
            "never served"
        );
        assert_eq!(m.checked("u1", "h1", &passing()), 0);
        assert_eq!(
            m.fresh("u1", &i.id, 7, Duration::from_secs(300)),
            Some(i.clone())
        );
        assert_eq!(
            m.fresh("u1", &i.id, 8, Duration::from_secs(300)),
            None,
            "trigger"
        );
        assert_eq!(m.fresh("u1", &i.id, 7, Duration::ZERO), None, "too old");
        assert_eq!(m.checked("u1", "h1", &failing()), 0);
        assert_eq!(m.checked("u1", "h1", &failing()), 1);
        assert_eq!(
            m.fresh("u1", &i.id, 7, Duration::from_secs(300)),
            None,
            "failed"
        );
        assert_eq!(m.checked("u1", "h1", &passing()), 2);
        assert_eq!(m.checked("u1", "h1", &failing()), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn most_of_a_host_or_the_fleet_timing_out_at_once_suspects_the_prober() {
        let window = Duration::from_secs(60);
        let m = Memory::default();
        // Two of two on h1 time out: too few to tell.
        m.checked("a", "h1", &timed_out());
        m.checked("b", "h1", &timed_out());
        assert_eq!(m.prober_suspected("h1", window), None);
        // Three of four on h1: the prober is suspected on h1.
        m.checked("c", "h1", &timed_out());
        m.checked("d", "h1", &passing());
        let why = m.prober_suspected("h1", window).expect("suspected");
        assert!(
            why.contains("3 of the 4 proxies probed on host h1"),
            "{why}"
        );
        // Refusals come from the guests: the path works.
        for uid in ["a", "b", "c"] {
            m.checked(uid, "h1", &failing());
        }
        assert_eq!(m.prober_suspected("h1", window), None);
        // Over the fleet: one timeout per host, on three of four hosts.
        let m = Memory::default();
        m.checked("a", "h1", &timed_out());
        m.checked("b", "h2", &timed_out());
        m.checked("c", "h3", &timed_out());
        m.checked("d", "h4", &passing());
        let why = m.prober_suspected("h4", window).expect("suspected");
        assert!(why.contains("in the fleet"), "{why}");
    }

    /// Issue 33, item 2: a fleet whose every proxy kept timing out was never replaced (the
    /// guard held for ever). Now it holds for the bound from the first withheld
    /// replacement, and a new suspicion after the path worked again starts a new hold.
    #[tokio::test(start_paused = true)]
    async fn the_prober_guard_withholds_at_most_its_bound() {
        let window = Duration::from_secs(60);
        let step = Duration::from_secs(10);
        let m = Memory::default();
        let fail_all = || {
            for uid in ["a", "b", "c"] {
                m.checked(uid, "h1", &timed_out());
            }
        };
        fail_all();
        assert!(m.prober_suspected("h1", window).is_some());
        let mut held = Duration::ZERO;
        while held + step < crate::serving::GUARD_MAX_HOLD {
            tokio::time::advance(step).await;
            held += step;
            fail_all();
            assert!(m.prober_suspected("h1", window).is_some(), "at {held:?}");
        }
        tokio::time::advance(2 * step).await;
        fail_all();
        assert_eq!(m.prober_suspected("h1", window), None, "believed again");
        // The path works again, then a new cut: a new hold.
        for uid in ["a", "b", "c"] {
            m.checked(uid, "h1", &failing());
        }
        assert_eq!(m.prober_suspected("h1", window), None);
        fail_all();
        assert!(m.prober_suspected("h1", window).is_some(), "a new hold");
        // A suspicion that ended between calls (none withheld for two windows) does not
        // count against the next one.
        tokio::time::advance(3 * window).await;
        fail_all();
        assert!(m.prober_suspected("h1", window).is_some(), "a fresh hold");
    }

    #[tokio::test(start_paused = true)]
    async fn old_checks_say_nothing_about_the_prober() {
        let window = Duration::from_secs(60);
        let m = Memory::default();
        m.checked("a", "h1", &timed_out());
        m.checked("b", "h1", &timed_out());
        tokio::time::advance(Duration::from_secs(61)).await;
        m.checked("c", "h1", &timed_out());
        assert_eq!(m.prober_suspected("h1", window), None);
    }

    #[test]
    fn a_paused_instance_gets_its_whole_grace_once_it_runs_again() {
        let grace = Duration::from_secs(900);
        let i = instance(0);
        // Not serving since 100, then paused (the last check saw it not running): at its
        // first failed probe after the resume, its grace starts then.
        let mut prev = ProxyStatus::default();
        status::set_condition(
            &mut prev.conditions,
            SERVING,
            false,
            NOT_RUNNING,
            "instance is paused",
            None,
            at(100),
        );
        assert_eq!(overdue(grace, &prev, &i, &failing(), at(3700)), None);
        // ... and status moved the transition time to that probe.
        let after = status::observed(&prev, None, &i, &failing(), at(3700));
        assert_eq!(overdue(grace, &after, &i, &failing(), at(4599)), None);
        assert_eq!(
            overdue(grace, &after, &i, &failing(), at(4600)),
            Some(at(3700))
        );
    }
}
