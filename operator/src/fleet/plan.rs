//! What a pool does next: a pure function of the pool's spec, its members and the hosts,
//! so every rule is tested without an API server (and with paused time in the `sim` tests).
//!
//! Rules:
//!
//! - **Old** members are made from an older template or from inputs the config no longer
//!   has (their `UpToDate` is False: a plugin, image or machine type changed), or are
//!   broken: the Proxy controller gave up on them (`Failed`), they have not served for
//!   `replaceAfter`, or they sit on a host ProviderHealth marks unreachable and do not
//!   serve. **New** members are the rest.
//!   Leased members are never removed, drained or replaced by the pool (the lease recycles
//!   them); they count as members.
//! - **Surge-first**: new members are created up to `replicas`, and beyond the members
//!   there are up to `replicas + maxSurge` (draining ones count: they are still VMs). A
//!   member is removed only while at least `replicas - maxUnavailable` members stay and,
//!   when it serves, at least `replicas - maxUnavailable` serving ones stay. So an old
//!   serving member goes only once a new one serves in its place (with `maxUnavailable`
//!   0), which is invariant F2.
//! - **Removal order**: members that do not serve first, then serving old ones, then
//!   (scale-in) the newest; among equals the one on the host with the most members, so
//!   removals even out the spread. A serving member is drained (listed `terminating`) for
//!   `drainSeconds`, then deleted; one that does not serve is deleted at once.
//! - **Spread**: a new member goes to the usable host (healthy, with room) with the fewest
//!   members, at most `ceil(replicas / usable hosts)` per host; a surge member may pass
//!   that cap for the time of the rollout. Nothing moves only to rebalance: a host that
//!   comes back fills up through later creates.

use std::collections::BTreeMap;
use std::time::Duration;

use super::Member;

/// The parts of a pool's spec the plan reads.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolShape {
    /// `spec.replicas`.
    pub replicas: usize,
    /// `spec.maxSurge`.
    pub max_surge: usize,
    /// `spec.maxUnavailable`.
    pub max_unavailable: usize,
    /// `spec.drainSeconds`.
    pub drain: Duration,
    /// The current template's hash.
    pub template_hash: String,
    /// A member that has not served for this long is replaced (zero: never).
    pub replace_after: Duration,
    /// Whether creates may go ahead (held back while members keep failing).
    pub creates: CreateGate,
    /// How long a new member may take to serve before it counts as failed (zero: no
    /// deadline); see [`super::failures`].
    pub progress_deadline: Duration,
}

/// Whether the pool may create members now. A template whose proxies all fail (a render
/// error, a bad image) would otherwise loop: each reconcile deletes the `Failed` member and
/// creates another, churning VMs as fast as they fail (issue 33, item 6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CreateGate {
    /// No failure since a member of the current template last proved it serves.
    #[default]
    Open,
    /// Members of the current template failed in a row: no create before `until`; after
    /// it, one member at a time, and only while no member made since the last failure is
    /// still on trial (neither serving nor failed yet).
    Backoff {
        /// The end of the current backoff.
        until: jiff::Timestamp,
        /// When the last failure was seen: members made after it are on trial.
        since: jiff::Timestamp,
    },
}

/// A host the pool may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSlot {
    /// Host name.
    pub name: String,
    /// Whether ProviderHealth reports it reachable (or says nothing about it).
    pub healthy: bool,
    /// How many more Proxies it can carry (its `maxDomains` minus every Proxy on it).
    pub room: usize,
}

/// What to do now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// New members, by host.
    pub create: Vec<String>,
    /// Members to start draining.
    pub drain: Vec<String>,
    /// Members to delete.
    pub delete: Vec<String>,
    /// Creates were needed that no usable host could take.
    pub insufficient_hosts: bool,
    /// Creates were needed that the create backoff held back (so whether the hosts could
    /// take them is not known).
    pub held_back: bool,
    /// When to look again at the latest (a drain ending).
    pub requeue: Option<Duration>,
    /// Counts for status.
    pub counts: Counts,
}

/// Counts for the pool's status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Members not being deleted (draining ones included).
    pub replicas: usize,
    /// Members whose `Ready` is True.
    pub ready: usize,
    /// Non-leaving members of the current template that are not broken.
    pub updated: usize,
    /// Non-leaving members serving now.
    pub available: usize,
    /// Non-leaving members per host.
    pub hosts: BTreeMap<String, usize>,
    /// Whether a rollout, scale or drain is under way.
    pub progressing: bool,
}

fn is_old(m: &Member, shape: &PoolShape, hosts: &[HostSlot], now: jiff::Timestamp) -> bool {
    if m.template_hash.as_deref() != Some(shape.template_hash.as_str()) || m.failed || m.outdated {
        return true;
    }
    if m.serving {
        return false;
    }
    let host_down = m
        .host
        .as_ref()
        .is_some_and(|h| hosts.iter().any(|s| &s.name == h && !s.healthy));
    if host_down {
        return true;
    }
    let since = m.not_serving_since.map(|t| t.max(m.created));
    match (since, jiff::SignedDuration::try_from(shape.replace_after)) {
        (Some(since), Ok(grace)) if !shape.replace_after.is_zero() => {
            now.duration_since(since) >= grace
        }
        _ => false,
    }
}

/// Plans the pool's next step.
pub fn plan(
    shape: &PoolShape,
    members: &[Member],
    hosts: &[HostSlot],
    now: jiff::Timestamp,
) -> Plan {
    let mut out = Plan::default();
    let drain = jiff::SignedDuration::try_from(shape.drain).unwrap_or(jiff::SignedDuration::ZERO);

    // Draining members: deleted once their drain period is over, or at once when they do
    // not serve (nothing to drain).
    let mut draining = 0usize;
    for m in members.iter().filter(|m| !m.deleting) {
        let Some(since) = m.draining_since else {
            continue;
        };
        let waited = now.duration_since(since);
        if !m.serving || waited >= drain {
            out.delete.push(m.name.clone());
        } else {
            draining += 1;
            let left = Duration::try_from(drain - waited).unwrap_or_default();
            out.requeue = Some(out.requeue.map_or(left, |r| r.min(left)));
        }
    }

    let active: Vec<&Member> = members.iter().filter(|m| !m.leaving()).collect();
    let (old, new): (Vec<&Member>, Vec<&Member>) = active
        .iter()
        .partition(|m| !m.leased && is_old(m, shape, hosts, now));
    let new_n = new.len();
    let min_keep = shape.replicas.saturating_sub(shape.max_unavailable);

    let mut per_host: BTreeMap<String, usize> = BTreeMap::new();
    for m in &active {
        if let Some(h) = &m.host {
            *per_host.entry(h.clone()).or_default() += 1;
        }
    }
    let host_load = |m: &Member| {
        m.host
            .as_ref()
            .and_then(|h| per_host.get(h))
            .copied()
            .unwrap_or(0)
    };

    // Old members: the fullest host first (a rollout evens out the spread), then the
    // oldest. Surplus new members (scale-in): the newest first, then the fullest host.
    let by = |a: &&Member, b: &&Member, newest_first: bool| {
        let load = host_load(b).cmp(&host_load(a));
        if newest_first {
            b.created.cmp(&a.created).then(load)
        } else {
            load.then_with(|| a.created.cmp(&b.created))
        }
        .then_with(|| a.name.cmp(&b.name))
    };
    let surplus = new_n.saturating_sub(shape.replicas);
    let mut old_down: Vec<&Member> = old.iter().copied().filter(|m| !m.serving).collect();
    old_down.sort_by(|a, b| by(a, b, false));
    let mut old_up: Vec<&Member> = old.iter().copied().filter(|m| m.serving).collect();
    old_up.sort_by(|a, b| by(a, b, false));
    let removable_new: Vec<&Member> = new.iter().copied().filter(|m| !m.leased).collect();
    let mut new_down: Vec<&Member> = removable_new
        .iter()
        .copied()
        .filter(|m| !m.serving)
        .collect();
    new_down.sort_by(|a, b| by(a, b, true));
    let mut new_up: Vec<&Member> = removable_new
        .iter()
        .copied()
        .filter(|m| m.serving)
        .collect();
    new_up.sort_by(|a, b| by(a, b, true));

    let mut active_left = active.len();
    let mut serving_left = super::floor_count(&active, shape.max_unavailable);
    let mut new_surplus_left = surplus;
    let mut removed_new = 0usize;
    let mut consider = |m: &Member, is_new: bool, out: &mut Plan| {
        if is_new && new_surplus_left == 0 {
            return;
        }
        if active_left <= min_keep.max(if is_new { shape.replicas } else { 0 }) {
            return;
        }
        if m.serving {
            if serving_left <= min_keep {
                return;
            }
            serving_left -= 1;
            out.drain.push(m.name.clone());
        } else {
            out.delete.push(m.name.clone());
        }
        active_left -= 1;
        if is_new {
            new_surplus_left -= 1;
            removed_new += 1;
        }
    };
    for m in old_down {
        consider(m, false, &mut out);
    }
    for m in new_down {
        consider(m, true, &mut out);
    }
    for m in old_up {
        consider(m, false, &mut out);
    }
    for m in new_up {
        consider(m, true, &mut out);
    }
    let drained_now = out.drain.len();

    // Creates: towards `replicas` new members, within the surge budget, but always up to
    // `replicas` members.
    let new_kept = new_n - removed_new;
    let want = shape.replicas.saturating_sub(new_kept);
    let total = active_left + draining + drained_now;
    let budget = (shape.replicas + shape.max_surge)
        .saturating_sub(total)
        .max(shape.replicas.saturating_sub(active_left));
    let mut creates = want.min(budget);
    if let CreateGate::Backoff { until, since } = shape.creates
        && creates > 0
    {
        out.held_back = true;
        if now < until {
            creates = 0;
            let left = Duration::try_from(until.duration_since(now)).unwrap_or_default();
            out.requeue = Some(out.requeue.map_or(left, |r| r.min(left)));
        } else {
            // A member made since the last failure that has neither served nor failed
            // yet is the one on trial. Creation times are whole seconds: one made in the
            // second of the failure counts too (it is after the backoff's start anyway).
            let since = jiff::Timestamp::from_second(since.as_second()).unwrap_or(since);
            let on_trial = new
                .iter()
                .any(|m| !m.leased && !m.serving && !m.leaving() && m.created >= since);
            creates = if on_trial { 0 } else { 1 };
            out.held_back = creates < want.min(budget);
        }
    }

    let usable: Vec<&HostSlot> = hosts.iter().filter(|h| h.healthy && h.room > 0).collect();
    let cap = if usable.is_empty() {
        0
    } else {
        shape.replicas.div_ceil(usable.len()).max(1)
    };
    let mut room: BTreeMap<&str, usize> =
        usable.iter().map(|h| (h.name.as_str(), h.room)).collect();
    let mut load: BTreeMap<&str, usize> = usable
        .iter()
        .map(|h| (h.name.as_str(), per_host.get(&h.name).copied().unwrap_or(0)))
        .collect();
    for _ in 0..creates {
        // Fewest members first; under the cap preferred; ties by name (stable).
        let pick = load
            .iter()
            .filter(|(h, _)| room.get(*h).copied().unwrap_or(0) > 0)
            .min_by_key(|(h, n)| (**n >= cap, **n, **h))
            .map(|(h, _)| *h);
        let Some(h) = pick else {
            out.insufficient_hosts = true;
            break;
        };
        out.create.push(h.to_string());
        *load.entry(h).or_default() += 1;
        if let Some(r) = room.get_mut(h) {
            *r -= 1;
        }
    }

    out.counts = Counts {
        replicas: members.iter().filter(|m| !m.deleting).count(),
        ready: members.iter().filter(|m| m.ready && !m.deleting).count(),
        updated: new_n,
        available: active.iter().filter(|m| m.serving).count(),
        hosts: per_host,
        progressing: !out.create.is_empty()
            || !out.drain.is_empty()
            || !out.delete.is_empty()
            || draining > 0
            || !old.is_empty()
            || new_n < shape.replicas
            // Surplus the pool can still remove; leased surplus is the leases' to give
            // back, and waiting for it is not a rollout.
            || (new_n > shape.replicas && !removable_new.is_empty()),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn at(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn shape(replicas: usize) -> PoolShape {
        PoolShape {
            replicas,
            max_surge: 1,
            max_unavailable: 0,
            drain: Duration::from_secs(10),
            template_hash: "t2".into(),
            replace_after: Duration::from_secs(900),
            creates: CreateGate::Open,
            progress_deadline: Duration::ZERO,
        }
    }

    fn m(name: &str, host: &str, hash: &str, serving: bool, created: i64) -> Member {
        Member {
            name: name.into(),
            uid: format!("uid-{name}"),
            address: Some("192.0.2.1".parse().unwrap()),
            host: Some(host.into()),
            created: at(created),
            template_hash: Some(hash.into()),
            draining_since: None,
            leased: false,
            deleting: false,
            ready: serving,
            serving,
            failed: false,
            not_serving_since: None,
            outdated: false,
        }
    }

    fn hosts(names: &[&str]) -> Vec<HostSlot> {
        names
            .iter()
            .map(|n| HostSlot {
                name: (*n).into(),
                healthy: true,
                room: 10,
            })
            .collect()
    }

    #[test]
    fn an_empty_pool_spreads_at_most_ceil_per_host() {
        let p = plan(&shape(3), &[], &hosts(&["h1", "h2"]), at(0));
        assert_eq!(p.create, ["h1", "h2", "h1"]);
        let p = plan(&shape(5), &[], &hosts(&["h1", "h2", "h3"]), at(0));
        let mut c = p.create.clone();
        c.sort();
        assert_eq!(c, ["h1", "h1", "h2", "h2", "h3"]);
    }

    #[test]
    fn unhealthy_and_full_hosts_are_skipped() {
        let mut hs = hosts(&["h1", "h2", "h3"]);
        hs[0].healthy = false;
        hs[2].room = 0;
        let p = plan(&shape(2), &[], &hs, at(0));
        assert_eq!(p.create, ["h2", "h2"]);
        hs[1].room = 1;
        let p = plan(&shape(2), &[], &hs, at(0));
        assert_eq!(p.create, ["h2"]);
        assert!(p.insufficient_hosts);
    }

    #[test]
    fn a_template_change_surges_one_and_keeps_the_olds_until_it_serves() {
        let olds = vec![
            m("a", "h1", "t1", true, 0),
            m("b", "h2", "t1", true, 1),
            m("c", "h1", "t1", true, 2),
        ];
        let p = plan(&shape(3), &olds, &hosts(&["h1", "h2"]), at(100));
        assert_eq!(p.create, ["h2"], "one surge, on the emptier host");
        assert!(p.drain.is_empty() && p.delete.is_empty());

        let mut with_new = olds.clone();
        with_new.push(m("d", "h2", "t2", false, 100));
        let p = plan(&shape(3), &with_new, &hosts(&["h1", "h2"]), at(101));
        assert!(p.create.is_empty(), "the surge is used");
        assert!(p.drain.is_empty(), "nothing goes before the new one serves");

        with_new[3].serving = true;
        let p = plan(&shape(3), &with_new, &hosts(&["h1", "h2"]), at(102));
        assert_eq!(p.drain, ["a"], "the oldest on the fullest host");
        assert!(p.create.is_empty(), "the draining one still counts");
    }

    #[test]
    fn scale_in_removes_non_serving_first_then_the_newest_never_a_leased_one() {
        let mut ms = vec![
            m("a", "h1", "t2", true, 0),
            m("b", "h2", "t2", true, 1),
            m("c", "h1", "t2", false, 2),
            m("d", "h2", "t2", true, 3),
            m("e", "h1", "t2", true, 4),
        ];
        ms[4].leased = true;
        let p = plan(&shape(2), &ms, &hosts(&["h1", "h2"]), at(10));
        assert_eq!(p.delete, ["c"]);
        assert_eq!(p.drain, ["d", "b"], "newest first, e is leased");
        assert!(p.create.is_empty());
    }

    #[test]
    fn drained_members_are_deleted_after_the_drain_period() {
        let mut ms = vec![m("a", "h1", "t2", true, 0), m("b", "h1", "t2", true, 0)];
        ms[1].draining_since = Some(at(100));
        let p = plan(&shape(1), &ms, &hosts(&["h1"]), at(105));
        assert!(p.delete.is_empty());
        assert_eq!(p.requeue, Some(Duration::from_secs(5)));
        let p = plan(&shape(1), &ms, &hosts(&["h1"]), at(110));
        assert_eq!(p.delete, ["b"]);
    }

    #[test]
    fn members_on_a_lost_host_are_replaced_first_then_deleted() {
        let mut hs = hosts(&["h1", "h2"]);
        let mut ms = vec![
            m("a", "h1", "t2", true, 0),
            m("b", "h2", "t2", false, 0),
            m("c", "h1", "t2", true, 0),
        ];
        hs[1].healthy = false;
        let p = plan(&shape(3), &ms, &hs, at(10));
        assert_eq!(p.create, ["h1"], "a replacement on the healthy host");
        assert!(p.delete.is_empty(), "the lost one stays until replaced");
        ms.push(m("d", "h1", "t2", false, 10));
        let p = plan(&shape(3), &ms, &hs, at(11));
        assert_eq!(p.delete, ["b"]);
    }

    #[test]
    fn a_backoff_holds_creates_then_lets_one_member_on_trial_at_a_time() {
        let mut failing = shape(3);
        failing.creates = CreateGate::Backoff {
            until: at(20),
            since: at(15),
        };
        let mut failed = m("a", "h1", "t2", false, 0);
        failed.failed = true;
        let p = plan(
            &failing,
            std::slice::from_ref(&failed),
            &hosts(&["h1", "h2"]),
            at(10),
        );
        assert!(p.create.is_empty(), "no create during the backoff");
        assert!(p.held_back);
        assert_eq!(
            p.requeue,
            Some(Duration::from_secs(10)),
            "looked at again when it ends"
        );
        assert!(!p.insufficient_hosts);

        let p = plan(&failing, &[], &hosts(&["h1", "h2"]), at(20));
        assert_eq!(p.create.len(), 1, "then one at a time");
        let trial = m("b", "h1", "t2", false, 20);
        let p = plan(
            &failing,
            std::slice::from_ref(&trial),
            &hosts(&["h1", "h2"]),
            at(25),
        );
        assert!(p.create.is_empty(), "not while a member is on trial");
        // One made before the failure that does not serve is not on trial, nor a leased one.
        let mut stale = m("s", "h1", "t2", false, 1);
        let p = plan(
            &failing,
            std::slice::from_ref(&stale),
            &hosts(&["h1", "h2"]),
            at(25),
        );
        assert_eq!(p.create.len(), 1);
        stale.created = at(20);
        stale.leased = true;
        let p = plan(
            &failing,
            std::slice::from_ref(&stale),
            &hosts(&["h1", "h2"]),
            at(25),
        );
        assert_eq!(p.create.len(), 1);
        let mut proven = trial;
        proven.serving = true;
        let p = plan(&failing, &[proven], &hosts(&["h1", "h2"]), at(26));
        assert_eq!(
            p.create.len(),
            1,
            "still one at a time until the gate opens"
        );
        let p = plan(&shape(3), &[], &hosts(&["h1", "h2"]), at(26));
        assert_eq!(p.create.len(), 3, "an open gate creates them all");
    }

    #[test]
    fn leased_surplus_is_not_a_rollout() {
        // 2 replicas; 3 new members, one leased: the pool removes the unleased surplus.
        let mut ms = vec![
            m("a", "h1", "t2", true, 0),
            m("b", "h2", "t2", true, 1),
            m("c", "h1", "t2", true, 2),
        ];
        ms[0].leased = true;
        let p = plan(&shape(2), &ms, &hosts(&["h1", "h2"]), at(10));
        assert!(p.counts.progressing);
        assert_eq!(p.drain, ["c"]);
        // Both surplus members leased: nothing the pool can do, and nothing under way.
        ms[1].leased = true;
        ms.pop();
        ms.push(m("d", "h2", "t2", true, 3));
        ms[2].leased = true;
        let p = plan(&shape(1), &ms, &hosts(&["h1", "h2"]), at(10));
        assert!(p.drain.is_empty() && p.delete.is_empty() && p.create.is_empty());
        assert!(!p.counts.progressing, "{:?}", p.counts);
    }
}
