//! What a lease does next: pure functions of the lease, what the pool's Proxies say (their
//! lease label included) and the time, so every binding rule is tested without an API
//! server.
//!
//! The protocol (the Metal3 lesson: record the choice, then take with a guarded write):
//!
//! 1. [`plan`] keeps the bound proxies that still name the lease, starts the loss timer of
//!    one that stops serving and gives it up after `rebindAfterSeconds`, and chooses
//!    serving, unleased proxies for what is missing. The choices go into
//!    `status.claims`, written with the lease's resourceVersion.
//! 2. The controller then takes each claimed proxy: a patch that sets the lease label and
//!    carries the Proxy's resourceVersion, so of two leases taking one proxy the API server
//!    lets exactly one through (the other gets 409 Conflict).
//! 3. [`promote`] moves the taken claims to `status.proxies` (both sides now agree) and
//!    sets `Bound` when `count` are bound, written with the resourceVersion of step 1.
//!
//! A proxy released by a lease (lost, expired, deleted) is first dropped from the lease's
//! status, and only then recycled, so no reader sees one proxy bound to two leases.
//!
//! The lease's status is the record of what it holds; a proxy's lease label only mirrors
//! it. Anyone allowed to patch Proxies can write that label, so a label is believed only
//! where a status agrees with it: a lease binds a proxy that names it only if its own
//! `status.claims` lists it (claims are written before the take, so a take whose status
//! write was lost is still found), a lease keeps a bound proxy whose label was changed
//! behind its back and writes the label back, and a proxy that another lease's status
//! lists is never free, never adopted and never released by anyone else.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::proxy_lease::{
    BoundProxy, LeasePhase, ProxyClaim, ProxyLeaseSpec, ProxyLeaseStatus,
};
use crate::controller::status::set_condition;

use super::super::Member;

/// Condition type: `count` proxies are bound.
pub const BOUND: &str = "Bound";
/// Separates a loss's reason from what the lost lease waits for in the condition message.
const WAITING: &str = " - now: ";

/// A Proxy of the lease's pool as the lease sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    /// The fleet's view of it.
    pub member: Member,
    /// Its lease label: the UID of the lease that holds it.
    pub holder: Option<String>,
    /// Whether the pool controls it (a copied pool label does not make a proxy the pool's).
    pub in_pool: bool,
    /// Whether another lease's status lists it (bound or claimed): then it is that lease's,
    /// whatever its label says.
    pub listed_elsewhere: bool,
}

impl Seen {
    /// Whether a lease may take it: the pool's, serving, not leaving or failed, with an
    /// address, unleased, and listed by no other lease.
    pub fn free(&self) -> bool {
        self.in_pool && self.holder.is_none() && !self.listed_elsewhere && self.usable()
    }

    /// Whether it serves and stays (a lease may keep or adopt it).
    fn usable(&self) -> bool {
        let m = &self.member;
        m.serving && !m.leaving() && !m.failed && m.address.is_some()
    }

    fn held_by(&self, lease_uid: &str) -> bool {
        self.holder.as_deref() == Some(lease_uid)
    }
}

/// The lease's next step.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The status to write (with the lease's resourceVersion) before anything else.
    pub status: ProxyLeaseStatus,
    /// Claimed proxies to take after the status write.
    pub take: Vec<ProxyClaim>,
    /// Proxies to recycle (by name) after the status write: lost ones the lease still
    /// holds, and ones it holds without listing them and does not need.
    pub release: Vec<String>,
    /// Proxies given up this step, with the reason (for events and metrics).
    pub lost: Vec<(String, String)>,
    /// Out-of-date proxies given back this step because an up-to-date one took their
    /// place (`replaceOutOfDate`), with what happened (for events and metrics).
    pub swapped: Vec<(String, String)>,
    /// Bound proxies whose label someone else changed: the lease writes its label back
    /// (a guarded take) after the status write.
    pub restore: Vec<ProxyClaim>,
    /// When to look again at the latest (a loss timer running out).
    pub requeue: Option<Duration>,
}

/// When the lease expires, and the renewal that was counted. A renewal is counted from
/// `spec.renewTime`, or from when the controller first saw it if that is earlier (a time
/// in the future buys nothing). Without a renewal the lease runs from its creation.
///
/// An expiry never moves earlier: a renewal older than the one counted (a holder replica
/// whose clock is behind), a `renewTime` removed, or a shorter `durationSeconds` leaves the
/// recorded expiry as it is; only a later one extends it. Expiry is final, so a lease that
/// could be shortened behind its holder's back could be ended by a slow clock. A lease is
/// ended early by deleting it.
pub fn expiry(
    spec: &ProxyLeaseSpec,
    status: &ProxyLeaseStatus,
    created: jiff::Timestamp,
    now: jiff::Timestamp,
) -> (jiff::Timestamp, Option<Time>) {
    let duration = jiff::SignedDuration::from_secs(i64::from(spec.duration_seconds));
    let from = |t: jiff::Timestamp| t.checked_add(duration).unwrap_or(jiff::Timestamp::MAX);
    // The API server keeps a status time in whole seconds: compare and store whole
    // seconds, or every reconcile would see a change and write again.
    let now = whole_seconds(now);
    let renew = spec.renew_time.as_ref().map(|r| Time(whole_seconds(r.0)));
    let recorded = status.expiry_time.as_ref().map(|t| t.0);
    let at_least = |t: jiff::Timestamp| recorded.map_or(t, |r| r.max(t));
    match &renew {
        Some(r) if status.observed_renew_time.as_ref() == Some(r) => (
            recorded.unwrap_or_else(|| from(r.0.min(now))),
            Some(r.clone()),
        ),
        Some(r) => (at_least(from(r.0.min(now))), Some(r.clone())),
        None => (at_least(from(whole_seconds(created))), None),
    }
}

fn whole_seconds(t: jiff::Timestamp) -> jiff::Timestamp {
    jiff::Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// A stable, per-lease order of proxies, so leases racing for a pool try different proxies
/// first instead of all colliding on the same one.
fn preference(lease_uid: &str, proxy_uid: &str) -> u64 {
    let mut h = DefaultHasher::new();
    (lease_uid, proxy_uid).hash(&mut h);
    h.finish()
}

fn bound_of(s: &Seen, port: i32) -> BoundProxy {
    BoundProxy {
        name: s.member.name.clone(),
        uid: s.member.uid.clone(),
        address: s.member.address.map(|a| a.to_string()),
        port,
        not_serving_since: None,
    }
}

/// Plans one reconcile of a lease that has not expired. `seen` is a fresh read of the
/// pool's Proxies. `trusted` is the liveness board's verdict on itself: while it is false
/// (every probe fails at once, the operator's own path is suspect) a bound proxy is not
/// given up for not serving; its loss timer waits for a trusted look.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    lease_uid: &str,
    spec: &ProxyLeaseSpec,
    status: &ProxyLeaseStatus,
    seen: &[Seen],
    pool: &str,
    port: i32,
    generation: Option<i64>,
    now: jiff::Timestamp,
    trusted: bool,
) -> Step {
    let count = usize::try_from(spec.count).unwrap_or(1).max(1);
    let rebind_after = jiff::SignedDuration::from_secs(i64::from(spec.rebind_after_seconds));
    let by_uid = |uid: &str| seen.iter().find(|s| s.member.uid == uid);
    let mut proxies: Vec<BoundProxy> = Vec::new();
    let mut claims: Vec<ProxyClaim> = Vec::new();
    let mut take = Vec::new();
    let mut release = Vec::new();
    let mut lost = Vec::new();
    let mut restore = Vec::new();
    let mut requeue: Option<Duration> = None;
    let mut wake = |left: jiff::SignedDuration| {
        let left = Duration::try_from(left).unwrap_or_default();
        requeue = Some(requeue.map_or(left, |r: Duration| r.min(left)));
    };

    // 1. The bound proxies: kept while they name the lease; the loss timer runs while one
    // does not serve.
    for b in &status.proxies {
        let Some(s) = by_uid(&b.uid) else {
            lost.push((b.name.clone(), format!("proxy {} is gone", b.name)));
            continue;
        };
        if !s.held_by(lease_uid) {
            if s.listed_elsewhere {
                lost.push((
                    b.name.clone(),
                    format!("proxy {} is bound to another lease", b.name),
                ));
                continue;
            }
            // No lease's status agrees with the label: the operator did not write it.
            restore.push(ProxyClaim {
                name: b.name.clone(),
                uid: b.uid.clone(),
            });
        }
        if s.usable() {
            proxies.push(bound_of(s, port));
            continue;
        }
        // Only the probe says it is down (it stays, has not failed, has its address), and
        // the probe is not trusted now: keep it as it was.
        let probe_only = !s.member.serving
            && !s.member.leaving()
            && !s.member.failed
            && s.member.address.is_some();
        if probe_only && !trusted {
            let mut kept = bound_of(s, port);
            kept.not_serving_since = b.not_serving_since.clone();
            proxies.push(kept);
            // Look again at the pace the timer would have had, whether or not the end of
            // the hold is announced.
            wake(rebind_after.max(jiff::SignedDuration::from_secs(1)));
            continue;
        }
        let since = b
            .not_serving_since
            .as_ref()
            .map_or_else(|| whole_seconds(now), |t| t.0);
        let waited = now.duration_since(since);
        if waited >= rebind_after {
            let why = if s.member.leaving() {
                "is leaving the pool"
            } else {
                "does not serve"
            };
            lost.push((
                b.name.clone(),
                format!(
                    "proxy {} {why} since {since} ({} s, rebindAfterSeconds {})",
                    b.name,
                    waited.as_secs(),
                    spec.rebind_after_seconds
                ),
            ));
            release.push(b.name.clone());
        } else {
            let mut kept = bound_of(s, port);
            kept.not_serving_since = Some(Time(since));
            proxies.push(kept);
            wake(rebind_after - waited);
        }
    }

    // 1b. Swaps (`replaceOutOfDate`): more bound than `count` means a replacement was
    // bound beside an out-of-date proxy (make before break), so the excess goes back,
    // out-of-date ones first, then the latest bound.
    let outdated = |uid: &str| by_uid(uid).is_some_and(|s| s.member.outdated);
    let mut swapped = Vec::new();
    while proxies.len() > count {
        let at = proxies
            .iter()
            .rposition(|b| outdated(&b.uid))
            .unwrap_or(proxies.len() - 1);
        let gone = proxies.remove(at);
        let why = if outdated(&gone.uid) {
            format!(
                "proxy {} was made from inputs that changed since: given back, an up-to-date \
                 proxy took its place",
                gone.name
            )
        } else {
            format!("proxy {} is beyond count {count}: given back", gone.name)
        };
        release.push(gone.name.clone());
        swapped.push((gone.name, why));
    }
    // How many more than `count` the lease may hold for a moment: one per out-of-date
    // bound proxy, each filled only by an up-to-date one.
    let swaps = if spec.replace_out_of_date {
        proxies.iter().filter(|b| outdated(&b.uid)).count()
    } else {
        0
    };

    // 2. The claims: a taken one is bound (both sides agree), a free one is taken again,
    // the rest are dropped. A claim past `count` (a swap) must still be up to date.
    for c in &status.claims {
        let Some(s) = by_uid(&c.uid) else { continue };
        let have = proxies.len() + claims.len();
        if s.held_by(lease_uid) {
            if !proxies.iter().any(|p| p.uid == c.uid)
                && (proxies.len() < count || (!s.member.outdated && proxies.len() < count + swaps))
            {
                proxies.push(bound_of(s, port));
            }
        } else if s.free() && (have < count || (!s.member.outdated && have < count + swaps)) {
            claims.push(c.clone());
            take.push(c.clone());
        }
    }

    // 3. Proxies that name the lease but that it does not list: never adopted (only a
    // claim is taken, so a label set by hand gains nothing). One another lease lists is
    // that lease's, and left alone; the rest (a release cut short, a claim dropped above)
    // are given back.
    let listed = |uid: &str, proxies: &[BoundProxy], claims: &[ProxyClaim]| {
        proxies.iter().any(|p| p.uid == uid) || claims.iter().any(|c| c.uid == uid)
    };
    for s in seen.iter().filter(|s| s.held_by(lease_uid)) {
        if listed(&s.member.uid, &proxies, &claims)
            || release.contains(&s.member.name)
            || s.listed_elsewhere
        {
            continue;
        }
        release.push(s.member.name.clone());
    }

    // 4. What is missing, and the swaps: free proxies, up-to-date ones first, then in the
    // lease's own order. A swap is filled only by an up-to-date proxy.
    let have = proxies.len() + claims.len();
    let plain = count.saturating_sub(have);
    let need = (count + swaps).saturating_sub(have);
    if need > 0 {
        let mut free: Vec<&Seen> = seen
            .iter()
            .filter(|s| s.free() && !listed(&s.member.uid, &proxies, &claims))
            .collect();
        free.sort_by_key(|s| {
            (
                s.member.outdated,
                preference(lease_uid, &s.member.uid),
                s.member.name.clone(),
            )
        });
        for (i, s) in free.into_iter().take(need).enumerate() {
            if i >= plain && s.member.outdated {
                break;
            }
            let c = ProxyClaim {
                name: s.member.name.clone(),
                uid: s.member.uid.clone(),
            };
            claims.push(c.clone());
            take.push(c);
        }
    }

    let lost_now: Vec<String> = lost.iter().map(|(_, why)| why.clone()).collect();
    let mut next = ProxyLeaseStatus {
        proxies,
        claims,
        ..status.clone()
    };
    settle(&mut next, status, count, pool, &lost_now, generation, now);
    restore.retain(|r| next.proxies.iter().any(|p| p.uid == r.uid));
    Step {
        status: next,
        take,
        release,
        lost,
        swapped,
        restore,
        requeue,
    }
}

/// After the takes: the claims in `taken` (by UID) are bound, with what `seen` says of
/// them; the rest stay claims for the next reconcile to retry or drop.
#[allow(clippy::too_many_arguments)]
pub fn promote(
    planned: &ProxyLeaseStatus,
    taken: &[String],
    seen: &[Seen],
    count: i32,
    pool: &str,
    port: i32,
    generation: Option<i64>,
    now: jiff::Timestamp,
) -> ProxyLeaseStatus {
    let count = usize::try_from(count).unwrap_or(1).max(1);
    let mut next = planned.clone();
    let (done, open): (Vec<ProxyClaim>, Vec<ProxyClaim>) = planned
        .claims
        .iter()
        .cloned()
        .partition(|c| taken.contains(&c.uid));
    for c in done {
        if let Some(s) = seen.iter().find(|s| s.member.uid == c.uid) {
            next.proxies.push(bound_of(s, port));
        }
    }
    next.claims = open;
    settle(&mut next, planned, count, pool, &[], generation, now);
    next
}

/// Phase, `Bound` condition, addresses and the rebind count of `next`, given the status
/// `prev` it follows and the losses of this step.
fn settle(
    next: &mut ProxyLeaseStatus,
    prev: &ProxyLeaseStatus,
    count: usize,
    pool: &str,
    lost_now: &[String],
    generation: Option<i64>,
    now: jiff::Timestamp,
) {
    let bound = next.proxies.len();
    let was = prev.phase;
    // `count` bound is Bound even with claims in flight: those are swaps, never a want.
    let (phase, reason, message) = if bound >= count {
        (
            LeasePhase::Bound,
            "Bound",
            if next.claims.is_empty() {
                format!("{bound} proxies of pool {pool} are bound")
            } else {
                format!(
                    "{bound} proxies of pool {pool} are bound; taking {} up-to-date one(s) \
                     to replace out-of-date ones",
                    next.claims.len()
                )
            },
        )
    } else if !lost_now.is_empty() {
        (LeasePhase::Lost, "ProxyLost", lost_now.join("; "))
    } else if was == Some(LeasePhase::Lost) {
        // Still short of a spare: keep the loss's reason, say what is missing.
        let before = prev
            .conditions
            .iter()
            .find(|c| c.type_ == BOUND)
            .and_then(|c| c.message.split(WAITING).next().map(str::to_string))
            .unwrap_or_default();
        let waiting = if next.claims.is_empty() {
            format!("no serving, unleased proxy in pool {pool} to rebind to")
        } else {
            "taking a spare".to_string()
        };
        (
            LeasePhase::Lost,
            "ProxyLost",
            format!("{before}{WAITING}{waiting}"),
        )
    } else if next.claims.is_empty() {
        (
            LeasePhase::Pending,
            "NoFreeProxy",
            format!("{bound} of {count} bound: no serving, unleased proxy in pool {pool}"),
        )
    } else {
        (
            LeasePhase::Pending,
            "Binding",
            format!("{bound} of {count} bound, taking {}", next.claims.len()),
        )
    };
    if phase == LeasePhase::Bound && was == Some(LeasePhase::Lost) {
        next.rebinds = prev.rebinds.saturating_add(1);
    }
    next.phase = Some(phase);
    set_condition(
        &mut next.conditions,
        BOUND,
        phase == LeasePhase::Bound,
        reason,
        &message,
        generation,
        now,
    );
    next.addresses = addresses(&next.proxies);
    next.observed_generation = generation;
}

/// Whether planning needs to know which proxies other leases list (a read of the
/// namespace's leases): only when a label and this lease's status disagree, or when the
/// lease may take a proxy (`may_take`: it has not ended). A settled lease needs nothing
/// more than its pool's Proxies.
pub fn needs_others(
    lease_uid: &str,
    spec: &ProxyLeaseSpec,
    status: &ProxyLeaseStatus,
    seen: &[Seen],
    may_take: bool,
) -> bool {
    let count = usize::try_from(spec.count).unwrap_or(1).max(1);
    let lists = |uid: &str| {
        status.proxies.iter().any(|p| p.uid == uid) || status.claims.iter().any(|c| c.uid == uid)
    };
    let bound_mislabelled = status.proxies.iter().any(|b| {
        seen.iter()
            .any(|s| s.member.uid == b.uid && !s.held_by(lease_uid))
    });
    let unlisted = seen
        .iter()
        .any(|s| s.held_by(lease_uid) && !lists(&s.member.uid));
    let outdated = |uid: &str| {
        seen.iter()
            .any(|s| s.member.uid == uid && s.member.outdated)
    };
    let swap = spec.replace_out_of_date && status.proxies.iter().any(|b| outdated(&b.uid));
    let wants = status.proxies.len() < count || !status.claims.is_empty();
    let candidate = |up_to_date: bool| {
        seen.iter().any(|s| {
            s.in_pool && s.holder.is_none() && s.usable() && !(up_to_date && s.member.outdated)
        })
    };
    bound_mislabelled
        || unlisted
        || (may_take && wants && candidate(false))
        || (may_take && swap && candidate(true))
}

/// The bound proxies' addresses for `kubectl get`.
pub fn addresses(proxies: &[BoundProxy]) -> Option<String> {
    let list: Vec<&str> = proxies
        .iter()
        .filter_map(|p| p.address.as_deref())
        .collect();
    (!list.is_empty()).then(|| list.join(","))
}

/// The status of a lease that ends (expired, or deleted when `expired` is false): nothing
/// bound or claimed. The caller releases everything the old status listed, and every
/// proxy that still names the lease, after writing it.
pub fn ended(
    status: &ProxyLeaseStatus,
    expired: bool,
    generation: Option<i64>,
    now: jiff::Timestamp,
) -> ProxyLeaseStatus {
    let mut next = ProxyLeaseStatus {
        proxies: Vec::new(),
        claims: Vec::new(),
        addresses: None,
        ..status.clone()
    };
    let (reason, message) = if expired {
        next.phase = Some(LeasePhase::Expired);
        (
            "Expired",
            "not renewed within durationSeconds: the proxies were released",
        )
    } else {
        (
            "Released",
            "the lease is being deleted: its proxies are released",
        )
    };
    set_condition(
        &mut next.conditions,
        BOUND,
        false,
        reason,
        message,
        generation,
        now,
    );
    next.observed_generation = generation;
    next
}

/// The proxies an ending lease releases: what its status lists and what names it, except
/// what another lease lists (a label set by hand does not make a proxy this lease's).
pub fn to_release(lease_uid: &str, status: &ProxyLeaseStatus, seen: &[Seen]) -> Vec<String> {
    let mut out: Vec<String> = status
        .proxies
        .iter()
        .map(|p| p.name.clone())
        .chain(status.claims.iter().map(|c| c.name.clone()))
        .chain(
            seen.iter()
                .filter(|s| s.held_by(lease_uid) && !s.listed_elsewhere)
                .map(|s| s.member.name.clone()),
        )
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
