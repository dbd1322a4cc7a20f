//! When to look at a Proxy again, from the class of what went wrong.
//!
//! Transient errors back off exponentially with jitter (so a fleet of Proxies on a host
//! that just went down does not retry in lockstep); quota errors retry on a slower ladder
//! (capacity frees up in minutes, not seconds); a missing object (a Secret not created
//! yet) sits in between; permanent errors wait for a change and only re-check hourly, so
//! a bad Proxy never hot-loops.
//!
//! The delay only holds if nothing else runs the Proxy earlier. The controller's own
//! status writes come back as watch events, and every failed reconcile writes one (with a
//! new message when the error text moves: elapsed times, byte counts), so [`Attempts`]
//! remembers per Proxy (by UID, in memory) when its next reconcile is due and what would
//! justify an earlier one ([`trigger_of`]: a new generation, finalizers, deletion, or an
//! annotation someone set to ask for one). Anything else, our status writes included, is
//! deferred to the due time. The failure count lives there too: it grows with every
//! failure whatever the message says, and resets on a success or a new generation.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tokio::time::Instant;

use crate::error::ErrorClass;

/// One backoff ladder: `base * 2^attempt`, capped, then +/- `jitter` (a fraction).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ladder {
    /// First delay.
    pub base: Duration,
    /// Largest delay.
    pub max: Duration,
}

impl Ladder {
    /// The delay before retry number `attempt` (0 = first retry), without jitter.
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(20)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }
}

/// The whole policy.
#[derive(Debug, Clone, PartialEq)]
pub struct RequeuePolicy {
    /// Transient failures (network, timeouts, conflicts).
    pub transient: Ladder,
    /// Something the Proxy refers to does not exist (yet).
    pub not_found: Ladder,
    /// A capacity limit.
    pub quota: Ladder,
    /// Re-check of a Proxy that failed permanently (in case the config was fixed).
    pub permanent: Duration,
    /// Jitter as a fraction of the delay (0.2 = +/- 20 %).
    pub jitter: f64,
    /// Status refresh of a ready Proxy.
    pub ready_refresh: Duration,
    /// Status refresh of a Proxy that exists but is not ready yet (no address, paused).
    pub not_ready_refresh: Duration,
}

impl Default for RequeuePolicy {
    fn default() -> Self {
        Self {
            transient: Ladder {
                base: Duration::from_secs(5),
                // controller-runtime's per-item limiter stops at about 1000 s. A Create
                // that keeps failing costs an image check, volumes and a define on a
                // host each time; 15 minutes keeps it to four or five tries an hour.
                max: TRANSIENT_MAX,
            },
            not_found: Ladder {
                base: Duration::from_secs(30),
                max: Duration::from_secs(600),
            },
            quota: Ladder {
                base: Duration::from_secs(120),
                max: Duration::from_secs(1800),
            },
            permanent: Duration::from_secs(3600),
            jitter: 0.2,
            ready_refresh: Duration::from_secs(300),
            not_ready_refresh: Duration::from_secs(15),
        }
    }
}

impl RequeuePolicy {
    /// Delay after the `attempt`-th consecutive failure of this class; `unit` in [0, 1)
    /// picks the point within the jitter band (random in production, fixed in tests).
    pub fn after_error(&self, class: ErrorClass, attempt: u32, unit: f64) -> Duration {
        let ladder = match class {
            ErrorClass::Transient => self.transient,
            ErrorClass::NotFound => self.not_found,
            ErrorClass::Quota => self.quota,
            ErrorClass::Permanent => return self.permanent,
        };
        let d = ladder.delay(attempt).as_secs_f64();
        let spread = self.jitter.clamp(0.0, 1.0) * (2.0 * unit.clamp(0.0, 1.0) - 1.0);
        Duration::from_secs_f64((d * (1.0 + spread)).max(0.1))
    }
}

/// The longest transient backoff.
pub const TRANSIENT_MAX: Duration = Duration::from_secs(900);

/// What the controller remembers about each Proxy between reconciles, by UID: its failure
/// streak, the warnings already published for it, and when its next reconcile is due.
/// In memory only: a restarted or newly elected replica reconciles every Proxy once and
/// starts counting again, which costs one attempt per Proxy, not a loop.
#[derive(Debug, Default)]
pub struct Attempts {
    entries: Mutex<HashMap<String, Entry>>,
    /// Proxies whose finalizer this replica removed, and when. A reconcile queued behind
    /// the one that removed it still sees the finalizer in a cache that has not caught up;
    /// without this it would run the whole cleanup again (a status patch, a listing of
    /// every host, a second `Deleted` event) only to be told 404 by the API server.
    released: Mutex<HashMap<String, Instant>>,
}

/// How long a released Proxy is remembered: far longer than a watch event takes to
/// arrive, short enough that the memory of a mass deletion drains on its own.
const RELEASED_MEMORY: Duration = Duration::from_secs(600);

/// One Proxy's memory.
#[derive(Debug, Default)]
struct Entry {
    /// The generation the failures were counted against.
    generation: Option<i64>,
    /// Consecutive failures at that generation.
    failures: u32,
    /// Warning reasons published since the streak began.
    announced: BTreeSet<String>,
    /// The trigger of the reconcile that set `due`.
    trigger: Option<u64>,
    /// When the next reconcile is due; `None` waits for a change.
    due: Option<Instant>,
}

impl Attempts {
    fn with<T>(&self, uid: &str, f: impl FnOnce(&mut Entry) -> T) -> T {
        let mut m = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        f(m.entry(uid.to_string()).or_default())
    }

    /// The entry for `generation`: a new generation starts a new streak.
    fn streak<T>(&self, uid: &str, generation: Option<i64>, f: impl FnOnce(&mut Entry) -> T) -> T {
        self.with(uid, |e| {
            if e.generation != generation {
                e.generation = generation;
                e.failures = 0;
                e.announced.clear();
            }
            f(e)
        })
    }

    /// Counts one more failure at `generation` and returns the count before it (0 for the
    /// first failure of a streak), which picks the rung of the backoff ladder.
    pub fn fail(&self, uid: &str, generation: Option<i64>) -> u32 {
        self.streak(uid, generation, |e| {
            let before = e.failures;
            e.failures = e.failures.saturating_add(1);
            before
        })
    }

    /// Consecutive failures at `generation` so far.
    pub fn failures(&self, uid: &str, generation: Option<i64>) -> u32 {
        self.streak(uid, generation, |e| e.failures)
    }

    /// Whether a warning with this reason is news: true the first time in a failure
    /// streak, so a Proxy that keeps failing the same way publishes one event, not one per
    /// retry (the condition's message carries the latest text).
    pub fn announce(&self, uid: &str, generation: Option<i64>, reason: &str) -> bool {
        self.streak(uid, generation, |e| e.announced.insert(reason.to_string()))
    }

    /// Ends the failure streak (a success).
    pub fn succeeded(&self, uid: &str) {
        self.with(uid, |e| {
            e.failures = 0;
            e.announced.clear();
        });
    }

    /// Records when the next reconcile is due (`None`: on a change only), asked for by a
    /// reconcile of the object whose trigger was `trigger`.
    pub fn schedule(&self, uid: &str, trigger: u64, after: Option<Duration>) {
        let due = after.map(|d| Instant::now() + d);
        self.with(uid, |e| {
            e.trigger = Some(trigger);
            e.due = due;
        });
    }

    /// How long a reconcile of the object with this trigger must still wait: `Some` when
    /// nothing that justifies an early reconcile changed since the delay was set and it has
    /// not run out. The controller's own status writes are deferred this way.
    pub fn early(&self, uid: &str, trigger: u64) -> Option<Duration> {
        let m = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let e = m.get(uid)?;
        if e.trigger != Some(trigger) {
            return None;
        }
        let left = e.due?.checked_duration_since(Instant::now())?;
        (!left.is_zero()).then_some(left)
    }

    /// Forgets the Proxy (it is gone).
    pub fn forget(&self, uid: &str) {
        let mut m = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(uid);
    }

    /// Records that this Proxy's finalizer is off (its cleanup is done): the API server
    /// deletes it, and nothing of ours may act on it again.
    pub fn release(&self, uid: &str) {
        let now = Instant::now();
        let mut m = self.released.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|_, at| now.duration_since(*at) < RELEASED_MEMORY);
        m.insert(uid.to_string(), now);
    }

    /// Whether this Proxy's finalizer was removed by this replica (see [`Self::release`]).
    /// A finalizer cannot come back on an object being deleted, so a cached copy that
    /// still shows it is only behind.
    pub fn released(&self, uid: &str) -> bool {
        let m = self.released.lock().unwrap_or_else(|p| p.into_inner());
        m.contains_key(uid)
    }

    /// Makes the Proxy's next reconcile due now, as if its requeue delay had passed
    /// (tests that reconcile one Proxy several times in a row, also against a real API
    /// server in `tests/tests/cluster_api.rs`).
    pub fn expire(&self, uid: &str) {
        self.with(uid, |e| e.due = None);
    }
}

/// What a change must touch to run a Proxy before its requested delay: the generation
/// (spec), the finalizers, the deletion mark, and the annotations (so `kubectl annotate`
/// can ask for a reconcile now). Status, resourceVersion and managedFields are left out:
/// the controller's own status writes change those.
pub fn trigger_of(meta: &ObjectMeta) -> u64 {
    // `DefaultHasher::new()` has fixed keys: the same metadata hashes the same for the
    // life of the process, which is all the comparison needs.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    meta.generation.hash(&mut h);
    meta.finalizers.hash(&mut h);
    meta.deletion_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .hash(&mut h);
    meta.annotations.hash(&mut h);
    h.finish()
}

/// A number in [0, 1) from the process's random hasher keys: jitter needs no more than
/// that, and it spares a dependency on a random number crate.
pub fn random_unit() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladders_grow_and_cap_and_permanent_never_hot_loops() {
        let p = RequeuePolicy::default();
        let mid = 0.5; // no jitter
        assert_eq!(
            p.after_error(ErrorClass::Transient, 0, mid),
            Duration::from_secs(5)
        );
        assert_eq!(
            p.after_error(ErrorClass::Transient, 1, mid),
            Duration::from_secs(10)
        );
        assert_eq!(
            p.after_error(ErrorClass::Transient, 3, mid),
            Duration::from_secs(40)
        );
        assert_eq!(
            p.after_error(ErrorClass::Transient, 40, mid),
            Duration::from_secs(900)
        );
        assert_eq!(
            p.after_error(ErrorClass::Quota, 0, mid),
            Duration::from_secs(120)
        );
        assert!(
            p.after_error(ErrorClass::Quota, 0, mid) > p.after_error(ErrorClass::Transient, 3, mid)
        );
        assert_eq!(
            p.after_error(ErrorClass::NotFound, 0, mid),
            Duration::from_secs(30)
        );
        assert_eq!(
            p.after_error(ErrorClass::Permanent, 0, mid),
            Duration::from_secs(3600)
        );
        assert_eq!(
            p.after_error(ErrorClass::Permanent, 9, 0.0),
            Duration::from_secs(3600)
        );
    }

    #[test]
    fn jitter_stays_in_its_band_and_spreads() {
        let p = RequeuePolicy::default();
        let lo = p.after_error(ErrorClass::Transient, 2, 0.0).as_secs_f64();
        let hi = p
            .after_error(ErrorClass::Transient, 2, 0.999_999)
            .as_secs_f64();
        assert!((lo - 16.0).abs() < 1e-6, "{lo}");
        assert!((hi - 24.0).abs() < 1e-3, "{hi}");
        let samples: Vec<f64> = (0..200).map(|_| random_unit()).collect();
        assert!(samples.iter().all(|u| (0.0..1.0).contains(u)));
        let distinct = samples
            .iter()
            .map(|u| (u * 10.0) as u32)
            .collect::<std::collections::BTreeSet<_>>();
        assert!(distinct.len() >= 5, "jitter does not spread: {distinct:?}");
    }

    #[test]
    fn attempts_count_per_proxy_and_generation_and_reset_on_success() {
        let a = Attempts::default();
        assert_eq!(a.fail("u1", Some(1)), 0);
        assert_eq!(a.fail("u1", Some(1)), 1);
        assert_eq!(a.fail("u2", Some(1)), 0);
        assert_eq!(a.fail("u1", Some(1)), 2);
        // A new spec starts a new streak.
        assert_eq!(a.fail("u1", Some(2)), 0);
        assert_eq!(a.failures("u1", Some(2)), 1);
        a.succeeded("u1");
        assert_eq!(a.fail("u1", Some(2)), 0);
        a.forget("u2");
        assert_eq!(a.failures("u2", Some(1)), 0);
    }

    #[test]
    fn a_reason_is_announced_once_per_streak() {
        let a = Attempts::default();
        assert!(a.announce("u1", Some(1), "ProviderError"));
        assert!(!a.announce("u1", Some(1), "ProviderError"));
        assert!(a.announce("u1", Some(1), "CapacityExceeded"));
        assert!(!a.announce("u1", Some(1), "ProviderError"));
        a.succeeded("u1");
        assert!(a.announce("u1", Some(1), "ProviderError"));
        assert!(a.announce("u1", Some(2), "ProviderError"), "new generation");
    }

    fn meta() -> ObjectMeta {
        ObjectMeta {
            name: Some("p".into()),
            generation: Some(3),
            resource_version: Some("41".into()),
            finalizers: Some(vec!["egress-operator.dev/instance".into()]),
            ..Default::default()
        }
    }

    #[test]
    fn the_trigger_ignores_what_a_status_write_changes_and_sees_the_rest() {
        let base = trigger_of(&meta());
        let mut status_write = meta();
        status_write.resource_version = Some("42".into());
        status_write.managed_fields = Some(vec![Default::default()]);
        assert_eq!(trigger_of(&status_write), base);
        let changes: [fn(&mut ObjectMeta); 4] = [
            |m| m.generation = Some(4),
            |m| m.finalizers = None,
            |m| {
                m.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    jiff::Timestamp::from_second(1_800_000_000).unwrap(),
                ))
            },
            |m| m.annotations = Some([("kick".to_string(), "1".to_string())].into()),
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut m = meta();
            change(&mut m);
            assert_ne!(trigger_of(&m), base, "change {i}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_trigger_before_the_due_time_waits_unless_it_changed_something() {
        let a = Attempts::default();
        let t = trigger_of(&meta());
        assert_eq!(a.early("u1", t), None, "never seen: runs");
        a.schedule("u1", t, Some(Duration::from_secs(60)));
        assert_eq!(a.early("u1", t), Some(Duration::from_secs(60)));
        tokio::time::advance(Duration::from_secs(45)).await;
        assert_eq!(a.early("u1", t), Some(Duration::from_secs(15)));
        let mut changed = meta();
        changed.generation = Some(4);
        assert_eq!(a.early("u1", trigger_of(&changed)), None);
        tokio::time::advance(Duration::from_secs(15)).await;
        assert_eq!(a.early("u1", t), None, "due");
        a.schedule("u1", t, None);
        assert_eq!(a.early("u1", t), None, "waits for a change: a trigger runs");
    }
}
