//! When to look at a Proxy again, from the class of what went wrong.
//!
//! Transient errors back off exponentially with jitter (so a fleet of Proxies on a host
//! that just went down does not retry in lockstep); quota errors retry on a slower ladder
//! (capacity frees up in minutes, not seconds); a missing object (a Secret not created
//! yet) sits in between; permanent errors wait for a change and only re-check hourly, so
//! a bad Proxy never hot-loops. The attempt count per Proxy resets on the first success.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::Duration;

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
                max: Duration::from_secs(300),
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

/// Consecutive failures per Proxy UID.
#[derive(Debug, Default)]
pub struct Attempts(Mutex<HashMap<String, u32>>);

impl Attempts {
    /// Counts one more failure and returns the count before it.
    pub fn fail(&self, uid: &str) -> u32 {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(uid.to_string()).or_insert(0);
        let before = *n;
        *n = n.saturating_add(1);
        before
    }

    /// Forgets the failures (a success, or the Proxy is gone).
    pub fn reset(&self, uid: &str) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(uid);
    }
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
            Duration::from_secs(300)
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
    fn attempts_count_per_proxy_and_reset() {
        let a = Attempts::default();
        assert_eq!(a.fail("u1"), 0);
        assert_eq!(a.fail("u1"), 1);
        assert_eq!(a.fail("u2"), 0);
        a.reset("u1");
        assert_eq!(a.fail("u1"), 0);
    }
}
