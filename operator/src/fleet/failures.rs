//! A pool's memory of members that failed in a row (issue 33, item 6).
//!
//! A template whose proxies all fail (a render error, an image that does not boot) made
//! the pool loop: each reconcile deleted the `Failed` member and created another one, so
//! VMs churned as fast as they failed, and the error was lost with each deleted Proxy.
//! Now each failure of a member made from the current template is counted once, its
//! message is kept (the pool's `Degraded` condition and a Warning event), and creates back
//! off exponentially: none before the backoff ends, then one member on trial at a time. A
//! member created after the last failure that serves proves the template and clears the
//! streak.
//!
//! The memory is the leader's, in process: a new leader starts without a streak, so it
//! may try once at once before backing off again. That costs one VM per leadership change,
//! never a loop.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use super::Member;
use super::plan::CreateGate;

/// How creates back off while members keep failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreateBackoff {
    /// The wait after the first failure; doubled for each failure after it.
    pub first: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Default for CreateBackoff {
    /// 5 s, doubling up to 5 minutes, as a kubelet's crash-loop backoff.
    fn default() -> Self {
        Self {
            first: Duration::from_secs(5),
            max: Duration::from_secs(300),
        }
    }
}

impl CreateBackoff {
    /// The wait after the `count`-th failure in a row (1-based).
    pub fn after(&self, count: u32) -> Duration {
        let doublings = count.saturating_sub(1).min(31);
        self.first.saturating_mul(1u32 << doublings).min(self.max)
    }
}

/// A pool's failures in a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Streak {
    /// The template whose members failed: a new template starts without a streak.
    pub template_hash: String,
    /// The config generation they failed under: a reload starts without a streak.
    pub config_generation: u64,
    /// How many members of that template failed since one last proved it.
    pub count: u32,
    /// When the last one was seen failed.
    pub last_at: jiff::Timestamp,
    /// `<proxy> on <host>: <reason>: <message>` of the last one.
    pub last: String,
    /// No create before this.
    pub until: jiff::Timestamp,
}

/// What one look at a pool's members found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Failures seen for the first time: (proxy, what failed).
    pub new: Vec<(String, String)>,
    /// The streak after this look (None: the template is proven, or nothing failed).
    pub streak: Option<Streak>,
    /// Whether a streak ended now (a member made after it serves, or the pool is whole).
    pub cleared: bool,
}

impl Observed {
    /// The gate for the pool's plan.
    pub fn gate(&self) -> CreateGate {
        self.streak
            .as_ref()
            .map_or(CreateGate::Open, |s| CreateGate::Backoff {
                until: s.until,
                since: s.last_at,
            })
    }
}

/// A pool's memory: its streak, and the failed members already counted.
#[derive(Debug, Default)]
struct PoolMemory {
    streak: Option<Streak>,
    /// UIDs of failed members counted (each failure counts once, however often it is
    /// seen, and also after the streak it belonged to has ended).
    counted: BTreeSet<String>,
}

/// Whether `m` has not served since it was made, for `deadline` or longer (zero: never
/// late). A member whose `Serving` turned False well after it was made served once: what
/// it does now is the replacement grace's business, not the rollout's.
fn missed_deadline(m: &Member, deadline: Duration, now: jiff::Timestamp) -> bool {
    let Ok(deadline) = jiff::SignedDuration::try_from(deadline) else {
        return false;
    };
    if deadline.is_zero() || m.serving || m.ready || m.failed {
        return false;
    }
    let never_served = m
        .not_serving_since
        .is_none_or(|since| since.duration_since(m.created) < deadline);
    never_served && now.duration_since(m.created) >= deadline
}

/// The leader's streaks, by pool UID.
#[derive(Debug, Default)]
pub struct FailureBook {
    pools: Mutex<HashMap<String, PoolMemory>>,
}

/// What a pool's members are made from now, and what it asks of new ones: the streak is of
/// members of this template under this config.
#[derive(Debug, Clone, Copy)]
pub struct Current<'a> {
    /// The pool's template hash.
    pub template_hash: &'a str,
    /// The config generation in force ([`crate::config::live::Snapshot::generation`]).
    pub config_generation: u64,
    /// `progressDeadlineSeconds` (zero: none).
    pub deadline: Duration,
    /// How many members the pool wants.
    pub replicas: usize,
}

impl FailureBook {
    /// Counts the failed members of `current` in `members` (what failed, by UID, in
    /// `messages`): those the Proxy controller gave up on, and those that never served
    /// within the deadline. The streak ends when the template or the config changes, when
    /// a member made after its last failure serves, or when `replicas` members of the
    /// template serve and none of them failed (the pool is whole: nothing waits for a
    /// create).
    pub fn observe(
        &self,
        pool_uid: &str,
        current: Current<'_>,
        members: &[Member],
        messages: &BTreeMap<String, String>,
        now: jiff::Timestamp,
        backoff: CreateBackoff,
    ) -> Observed {
        let Current {
            template_hash,
            config_generation,
            deadline,
            replicas,
        } = current;
        let Ok(mut pools) = self.pools.lock() else {
            return Observed::default();
        };
        let memory = pools.entry(pool_uid.to_string()).or_default();
        let current: Vec<&Member> = members
            .iter()
            .filter(|m| {
                m.template_hash.as_deref() == Some(template_hash) && !m.leaving() && !m.outdated
            })
            .collect();
        let mut out = Observed::default();
        if let Some(s) = &memory.streak {
            let other_template =
                s.template_hash != template_hash || s.config_generation != config_generation;
            let proven = current
                .iter()
                .any(|m| m.serving && !m.failed && m.created > s.last_at);
            let whole = !current.iter().any(|m| m.failed)
                && current.iter().filter(|m| m.serving).count() >= replicas.max(1);
            if other_template || proven || whole {
                memory.streak = None;
                out.cleared = !other_template;
            }
        }
        let late = |m: &Member| missed_deadline(m, deadline, now);
        for m in current.iter().filter(|m| m.failed || late(m)) {
            if !memory.counted.insert(m.uid.clone()) {
                continue;
            }
            let why = if m.failed {
                messages
                    .get(&m.uid)
                    .map_or_else(|| "failed".to_string(), Clone::clone)
            } else {
                format!(
                    "did not serve within progressDeadlineSeconds ({} s)",
                    deadline.as_secs()
                )
            };
            let what = format!(
                "{} on {}: {why}",
                m.name,
                m.host.as_deref().unwrap_or("no host"),
            );
            let s = memory.streak.get_or_insert_with(|| Streak {
                template_hash: template_hash.to_string(),
                config_generation,
                count: 0,
                last_at: now,
                last: String::new(),
                until: now,
            });
            s.count = s.count.saturating_add(1);
            s.last_at = now;
            s.last.clone_from(&what);
            let wait = jiff::SignedDuration::try_from(backoff.after(s.count))
                .unwrap_or(jiff::SignedDuration::ZERO);
            s.until = now.checked_add(wait).unwrap_or(now);
            out.new.push((m.name.clone(), what));
            out.cleared = false;
        }
        // Forget members that are gone: a UID is never reused.
        memory
            .counted
            .retain(|uid| members.iter().any(|m| &m.uid == uid));
        out.streak.clone_from(&memory.streak);
        out
    }

    /// Whether the pool `pool_uid` has a streak running (read only: a look from the
    /// caches must not count anything).
    pub fn in_streak(&self, pool_uid: &str) -> bool {
        self.pools
            .lock()
            .is_ok_and(|pools| pools.get(pool_uid).is_some_and(|m| m.streak.is_some()))
    }

    /// Forgets every pool whose UID is not in `live`.
    pub fn retain(&self, live: &std::collections::HashSet<String>) {
        if let Ok(mut pools) = self.pools.lock() {
            pools.retain(|uid, _| live.contains(uid));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn cur(template_hash: &str, config_generation: u64, deadline: Duration) -> Current<'_> {
        Current {
            template_hash,
            config_generation,
            deadline,
            replicas: 2,
        }
    }

    fn member(name: &str, hash: &str, created: i64, failed: bool, serving: bool) -> Member {
        Member {
            name: name.into(),
            uid: format!("uid-{name}"),
            address: None,
            host: Some("h1".into()),
            created: at(created),
            template_hash: Some(hash.into()),
            draining_since: None,
            leased: false,
            deleting: false,
            ready: serving,
            serving,
            failed,
            not_serving_since: None,
            outdated: false,
        }
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap() {
        let b = CreateBackoff::default();
        let secs: Vec<u64> = (1..=9).map(|n| b.after(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(b.after(u32::MAX).as_secs(), 300);
    }

    #[test]
    fn each_failure_counts_once_and_a_proven_template_clears_the_streak() {
        let book = FailureBook::default();
        let b = CreateBackoff::default();
        let look = |members: &[Member], now: i64| {
            let messages = BTreeMap::from([(
                "uid-a".to_string(),
                "RenderFailed: bad settings".to_string(),
            )]);
            book.observe(
                "pool",
                cur("t2", 0, Duration::ZERO),
                members,
                &messages,
                at(now),
                b,
            )
        };
        let a = member("a", "t2", 0, true, false);
        let old = member("o", "t1", 0, true, false);
        let seen = look(&[a.clone(), old], 10);
        assert_eq!(
            seen.new,
            [(
                "a".to_string(),
                "a on h1: RenderFailed: bad settings".to_string()
            )],
            "a failed member of an older template is not the current template's failure"
        );
        assert_eq!(
            seen.gate(),
            CreateGate::Backoff {
                until: at(15),
                since: at(10)
            }
        );

        let again = look(std::slice::from_ref(&a), 12);
        assert!(again.new.is_empty(), "seen once only");
        assert_eq!(again.streak.as_ref().map(|s| s.count), Some(1));

        let c = member("c", "t2", 16, true, false);
        let seen = look(&[a.clone(), c.clone()], 17);
        assert_eq!(seen.streak.as_ref().map(|s| s.count), Some(2));
        assert!(seen.streak.unwrap().last.ends_with(": failed"));

        // A member made before the last failure serving proves nothing.
        let early = member("e", "t2", 5, false, true);
        let kept = look(&[a.clone(), c.clone(), early.clone()], 30);
        assert!(kept.streak.is_some() && !kept.cleared);
        // One made after it does; the failed members still there are not counted again.
        let proven = member("d", "t2", 28, false, true);
        let cleared = look(&[a.clone(), c.clone(), early.clone(), proven.clone()], 40);
        assert!(cleared.cleared);
        assert_eq!(cleared.gate(), CreateGate::Open);
        let later = look(&[a, c, early, proven], 41);
        assert!(later.streak.is_none() && later.new.is_empty(), "{later:?}");
    }

    #[test]
    fn a_member_that_never_serves_by_the_deadline_counts_as_failed_once() {
        let book = FailureBook::default();
        let b = CreateBackoff::default();
        let none = BTreeMap::new();
        let deadline = Duration::from_secs(600);
        // Made at 0, never served.
        let mut silent = member("s", "t2", 0, false, false);
        silent.not_serving_since = Some(at(5));
        let look = |m: &Member, now: i64| {
            book.observe(
                "p",
                cur("t2", 0, deadline),
                std::slice::from_ref(m),
                &none,
                at(now),
                b,
            )
        };
        assert!(look(&silent, 599).streak.is_none(), "not late yet");
        let late = look(&silent, 600);
        let s = late.streak.expect("late: a failure");
        assert_eq!(s.count, 1);
        assert!(
            s.last
                .contains("did not serve within progressDeadlineSeconds (600 s)"),
            "{}",
            s.last
        );
        assert_eq!(look(&silent, 700).streak.unwrap().count, 1, "counted once");

        // One that served and stopped long after it was made is not the rollout's.
        let book = FailureBook::default();
        let mut stopped = member("x", "t2", 0, false, false);
        stopped.not_serving_since = Some(at(900));
        let seen = book.observe(
            "q",
            cur("t2", 0, deadline),
            std::slice::from_ref(&stopped),
            &none,
            at(1000),
            b,
        );
        assert!(seen.streak.is_none(), "{seen:?}");
        // No deadline: never late.
        let seen = book.observe(
            "r",
            cur("t2", 0, Duration::ZERO),
            std::slice::from_ref(&silent),
            &none,
            at(10_000),
            b,
        );
        assert!(seen.streak.is_none(), "{seen:?}");
    }

    #[test]
    fn a_new_template_or_a_whole_pool_ends_the_streak() {
        let book = FailureBook::default();
        let b = CreateBackoff::default();
        let none = BTreeMap::new();
        let a = member("a", "t2", 0, true, false);
        assert!(
            book.observe(
                "p",
                cur("t2", 0, Duration::ZERO),
                std::slice::from_ref(&a),
                &none,
                at(1),
                b
            )
            .streak
            .is_some()
        );
        let fixed = book.observe(
            "p",
            cur("t3", 0, Duration::ZERO),
            std::slice::from_ref(&a),
            &none,
            at(2),
            b,
        );
        assert!(fixed.streak.is_none(), "the template changed: {fixed:?}");

        // A reload (another config generation) ends it too: a stalled rollout resumes.
        let book = FailureBook::default();
        assert!(
            book.observe(
                "s",
                cur("t2", 0, Duration::ZERO),
                std::slice::from_ref(&a),
                &none,
                at(1),
                b
            )
            .streak
            .is_some()
        );
        let reloaded = book.observe("s", cur("t2", 1, Duration::ZERO), &[], &none, at(2), b);
        assert!(
            reloaded.streak.is_none(),
            "the config changed: {reloaded:?}"
        );
        // An out-of-date member that fails is not the current config's failure.
        let mut stale = member("o", "t2", 0, true, false);
        stale.outdated = true;
        let old = book.observe(
            "s",
            cur("t2", 1, Duration::ZERO),
            std::slice::from_ref(&stale),
            &none,
            at(3),
            b,
        );
        assert!(old.streak.is_none() && old.new.is_empty(), "{old:?}");

        let book = FailureBook::default();
        assert!(
            book.observe(
                "q",
                cur("t2", 0, Duration::ZERO),
                std::slice::from_ref(&a),
                &none,
                at(1),
                b
            )
            .streak
            .is_some()
        );
        // The failed one is gone and two made before the failure serve: nothing waits.
        let up = [
            member("x", "t2", 0, false, true),
            member("y", "t2", 0, false, true),
        ];
        let whole = book.observe("q", cur("t2", 0, Duration::ZERO), &up, &none, at(3), b);
        assert!(whole.cleared && whole.streak.is_none(), "{whole:?}");
        // An empty pool is not whole.
        assert!(
            book.observe(
                "r",
                cur("t2", 0, Duration::ZERO),
                std::slice::from_ref(&a),
                &none,
                at(1),
                b
            )
            .streak
            .is_some()
        );
        let empty = book.observe("r", cur("t2", 0, Duration::ZERO), &[], &none, at(3), b);
        assert!(empty.streak.is_some(), "{empty:?}");
    }
}
