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
//! shorter than the grace starts it over.

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
}

/// Probes the instance's proxy when there is something to probe: a running instance that
/// read its seed and has an address (its first, the one status publishes).
pub async fn check(prober: &Prober, instance: &Instance) -> Check {
    if instance.state != InstanceState::Running {
        return Check::not(
            NOT_RUNNING,
            format!("instance is {}", instance.state),
            false,
        );
    }
    if instance.seed_applied == Some(false) {
        // Counts towards replacement: a new VM may well read its seed.
        return Check::not(
            SEED_NOT_READ,
            "the guest never read its cloud-init seed (its host name is not the seed's), so \
             the proxy was never configured; not probed"
                .into(),
            true,
        );
    }
    let Some(ip) = instance.addresses.first() else {
        let out = ProbeOutcome::NoAddress;
        return Check::not(out.reason(), out.describe(None, None), true);
    };
    let outcome = prober.probe(*ip).await;
    Check {
        serving: outcome.is_serving(),
        reason: outcome.reason(),
        message: outcome.describe(Some(prober.addr(*ip)), prober.target()),
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
    // recorded, e.g. just upgraded): since now, the grace starts here.
    let flipped = status::condition(prev, SERVING)
        .filter(|c| c.status == "False")
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
pub struct Memory(Mutex<HashMap<String, Entry>>);

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

    /// Records a check; returns the failures before it (0 for the first of a streak).
    pub fn checked(&self, uid: &str, serving: bool) -> u32 {
        self.with(uid, |e| {
            let before = e.failures;
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
        assert_eq!(m.checked("u1", true), 0);
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
        assert_eq!(m.checked("u1", false), 0);
        assert_eq!(m.checked("u1", false), 1);
        assert_eq!(
            m.fresh("u1", &i.id, 7, Duration::from_secs(300)),
            None,
            "failed"
        );
        assert_eq!(m.checked("u1", true), 2);
        assert_eq!(m.checked("u1", false), 0);
    }
}
