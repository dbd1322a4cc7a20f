use super::*;

const LEASE: &str = "lease-a";

fn t(s: i64) -> jiff::Timestamp {
    jiff::Timestamp::from_second(1_800_000_000 + s).unwrap()
}

fn spec(count: i32) -> ProxyLeaseSpec {
    ProxyLeaseSpec {
        pool: "office".into(),
        count,
        duration_seconds: 60,
        holder: "crawler".into(),
        renew_time: None,
        rebind_after_seconds: 30,
        service: true,
        replace_out_of_date: false,
    }
}

fn seen(name: &str, serving: bool, holder: Option<&str>) -> Seen {
    let n: u8 = name.bytes().last().unwrap() % 200;
    Seen {
        member: Member {
            name: name.into(),
            uid: format!("uid-{name}"),
            address: Some(format!("192.0.2.{n}").parse().unwrap()),
            host: None,
            created: t(0),
            template_hash: None,
            draining_since: None,
            leased: holder.is_some(),
            deleting: false,
            ready: serving,
            serving,
            failed: false,
            not_serving_since: None,
            outdated: false,
        },
        holder: holder.map(str::to_string),
        in_pool: true,
        listed_elsewhere: false,
    }
}

fn bound(name: &str) -> BoundProxy {
    bound_of(&seen(name, true, Some(LEASE)), 3128)
}

fn run(spec: &ProxyLeaseSpec, status: &ProxyLeaseStatus, s: &[Seen], now: i64) -> Step {
    plan(
        LEASE,
        spec,
        status,
        s,
        "office",
        3128,
        Some(1),
        t(now),
        true,
    )
}

fn reason(st: &ProxyLeaseStatus) -> String {
    st.conditions
        .iter()
        .find(|c| c.type_ == BOUND)
        .map(|c| c.reason.clone())
        .unwrap()
}

#[test]
fn a_new_lease_claims_a_free_serving_proxy_and_binds_it_only_once_taken() {
    let pool = [
        seen("p1", true, Some("lease-b")),
        seen("p2", false, None),
        seen("p3", true, None),
    ];
    let step = run(&spec(1), &ProxyLeaseStatus::default(), &pool, 0);
    // Recorded first: a claim, not a binding.
    assert_eq!(step.take.len(), 1);
    assert_eq!(step.take[0].name, "p3");
    assert!(step.status.proxies.is_empty());
    assert_eq!(step.status.claims, step.take);
    assert_eq!(step.status.phase, Some(LeasePhase::Pending));
    assert_eq!(reason(&step.status), "Binding");
    // Taken: both sides agree, Bound.
    let bound = promote(
        &step.status,
        &["uid-p3".into()],
        &pool,
        1,
        "office",
        3128,
        Some(1),
        t(0),
    );
    assert_eq!(bound.phase, Some(LeasePhase::Bound));
    assert_eq!(bound.proxies.len(), 1);
    assert_eq!(bound.proxies[0].uid, "uid-p3");
    assert_eq!(bound.addresses.as_deref(), Some("192.0.2.51"));
    assert!(bound.claims.is_empty());
    // A take that lost the race leaves the claim for the next reconcile.
    let lost_race = promote(&step.status, &[], &pool, 1, "office", 3128, Some(1), t(0));
    assert_eq!(lost_race.phase, Some(LeasePhase::Pending));
    assert_eq!(lost_race.claims.len(), 1);
}

#[test]
fn with_nothing_free_the_lease_is_pending_with_a_reason() {
    let mut draining = seen("p2", true, None);
    draining.member.draining_since = Some(t(0));
    let mut foreign = seen("p3", true, None);
    foreign.in_pool = false;
    let mut failed = seen("p4", true, None);
    failed.member.failed = true;
    let pool = [seen("p1", true, Some("lease-b")), draining, foreign, failed];
    let step = run(&spec(1), &ProxyLeaseStatus::default(), &pool, 0);
    assert!(step.take.is_empty());
    assert_eq!(step.status.phase, Some(LeasePhase::Pending));
    assert_eq!(reason(&step.status), "NoFreeProxy");
}

#[test]
fn a_claim_taken_by_another_lease_is_dropped_and_another_chosen() {
    let status = ProxyLeaseStatus {
        claims: vec![ProxyClaim {
            name: "p1".into(),
            uid: "uid-p1".into(),
        }],
        ..Default::default()
    };
    let pool = [seen("p1", true, Some("lease-b")), seen("p2", true, None)];
    let step = run(&spec(1), &status, &pool, 0);
    assert_eq!(step.status.claims.len(), 1);
    assert_eq!(step.status.claims[0].name, "p2");
    assert!(step.release.is_empty(), "never touch another lease's proxy");
}

#[test]
fn a_claim_whose_take_went_through_is_bound_on_the_next_look() {
    let status = ProxyLeaseStatus {
        phase: Some(LeasePhase::Pending),
        claims: vec![ProxyClaim {
            name: "p1".into(),
            uid: "uid-p1".into(),
        }],
        ..Default::default()
    };
    let step = run(&spec(1), &status, &[seen("p1", true, Some(LEASE))], 0);
    assert!(step.take.is_empty());
    assert_eq!(step.status.phase, Some(LeasePhase::Bound));
    assert_eq!(step.status.proxies[0].name, "p1");
}

#[test]
fn a_proxy_naming_the_lease_unlisted_is_never_adopted_only_given_back() {
    // A label set by hand (or a release cut short): the lease claims what it binds, so
    // these are released, and the lease takes a free proxy of its own choosing.
    let mut others = seen("p3", true, Some(LEASE));
    others.listed_elsewhere = true;
    let pool = [
        seen("p1", true, Some(LEASE)),
        seen("p2", true, Some(LEASE)),
        others,
        seen("p4", true, None),
    ];
    let step = run(&spec(1), &ProxyLeaseStatus::default(), &pool, 0);
    assert!(step.status.proxies.is_empty());
    assert_eq!(
        step.release,
        ["p1", "p2"],
        "another lease's proxy is left alone"
    );
    assert_eq!(step.take.len(), 1);
    assert_eq!(step.take[0].name, "p4");
    assert!(
        !needs_others(LEASE, &spec(1), &step.status, &[], true),
        "nothing seen, nothing to compare"
    );
    assert!(needs_others(
        LEASE,
        &spec(1),
        &ProxyLeaseStatus::default(),
        &pool,
        false
    ));
}

#[test]
fn a_bound_proxy_that_stops_serving_is_lost_after_rebind_after_then_a_spare_is_taken() {
    let status = ProxyLeaseStatus {
        phase: Some(LeasePhase::Bound),
        proxies: vec![bound("p1")],
        ..Default::default()
    };
    let pool = [seen("p1", false, Some(LEASE)), seen("p2", true, None)];
    // The timer starts; the proxy stays bound meanwhile.
    let step = run(&spec(1), &status, &pool, 100);
    assert!(step.lost.is_empty());
    assert_eq!(step.status.phase, Some(LeasePhase::Bound));
    assert_eq!(
        step.status.proxies[0].not_serving_since.as_ref().unwrap().0,
        t(100)
    );
    assert_eq!(step.requeue, Some(Duration::from_secs(30)));
    // It serves again: the timer resets.
    let back = run(
        &spec(1),
        &step.status,
        &[seen("p1", true, Some(LEASE)), seen("p2", true, None)],
        110,
    );
    assert!(back.status.proxies[0].not_serving_since.is_none());
    // Still down after 30 s: Lost with the reason, released, a spare claimed.
    let later = run(&spec(1), &step.status, &pool, 130);
    assert_eq!(later.lost.len(), 1);
    assert!(
        later.lost[0].1.contains("does not serve"),
        "{:?}",
        later.lost
    );
    assert_eq!(later.release, ["p1"]);
    assert_eq!(later.status.phase, Some(LeasePhase::Lost));
    assert_eq!(reason(&later.status), "ProxyLost");
    assert!(later.status.proxies.is_empty());
    assert_eq!(later.take[0].name, "p2");
    let rebound = promote(
        &later.status,
        &["uid-p2".into()],
        &pool,
        1,
        "office",
        3128,
        Some(1),
        t(130),
    );
    assert_eq!(rebound.phase, Some(LeasePhase::Bound));
    assert_eq!(rebound.rebinds, 1);
}

#[test]
fn a_lost_lease_without_a_spare_stays_lost_and_keeps_the_reason() {
    let status = ProxyLeaseStatus {
        phase: Some(LeasePhase::Bound),
        proxies: vec![bound("p1")],
        ..Default::default()
    };
    // The proxy is gone: lost at once, nothing to release.
    let step = run(&spec(1), &status, &[], 0);
    assert_eq!(step.status.phase, Some(LeasePhase::Lost));
    assert!(step.release.is_empty());
    let msg = |s: &ProxyLeaseStatus| s.conditions[0].message.clone();
    assert!(msg(&step.status).contains("p1 is gone"));
    let again = run(&spec(1), &step.status, &[], 5);
    assert_eq!(again.status.phase, Some(LeasePhase::Lost));
    assert!(msg(&again.status).contains("p1 is gone"));
    let third = run(&spec(1), &again.status, &[], 10);
    assert_eq!(
        msg(&third.status),
        msg(&again.status),
        "the message does not grow"
    );
}

#[test]
fn a_bound_proxy_relabelled_by_hand_is_kept_and_its_label_written_back() {
    let status = ProxyLeaseStatus {
        phase: Some(LeasePhase::Bound),
        proxies: vec![bound("p1")],
        ..Default::default()
    };
    for label in [Some("lease-b"), None] {
        let pool = [seen("p1", true, label), seen("p2", true, None)];
        assert!(needs_others(LEASE, &spec(1), &status, &pool, true));
        let step = run(&spec(1), &status, &pool, 0);
        assert_eq!(
            step.status.proxies, status.proxies,
            "{label:?}: still bound"
        );
        assert_eq!(step.status.phase, Some(LeasePhase::Bound));
        assert!(step.lost.is_empty() && step.take.is_empty() && step.release.is_empty());
        assert_eq!(step.restore.len(), 1);
        assert_eq!(step.restore[0].uid, "uid-p1");
    }
    // Another lease's status lists it: it was taken through the protocol, so it is lost.
    let mut taken = seen("p1", true, Some("lease-b"));
    taken.listed_elsewhere = true;
    let step = run(&spec(1), &status, &[taken], 0);
    assert!(step.status.proxies.is_empty());
    assert!(step.release.is_empty() && step.restore.is_empty());
    assert_eq!(step.status.phase, Some(LeasePhase::Lost));
    // A proxy another lease lists is never free, even unlabelled (a claim in flight).
    let mut claimed = seen("p2", true, None);
    claimed.listed_elsewhere = true;
    assert!(!claimed.free());
}

#[test]
fn a_settled_lease_needs_no_read_of_other_leases() {
    let status = ProxyLeaseStatus {
        phase: Some(LeasePhase::Bound),
        proxies: vec![bound("p1")],
        ..Default::default()
    };
    let pool = [seen("p1", true, Some(LEASE)), seen("p2", true, None)];
    assert!(!needs_others(LEASE, &spec(1), &status, &pool, true));
    // Short of proxies with a candidate: it does.
    assert!(needs_others(LEASE, &spec(2), &status, &pool, true));
    assert!(!needs_others(LEASE, &spec(2), &status, &pool, false));
}

#[test]
fn count_is_filled_one_claim_per_missing_proxy_and_never_beyond() {
    let pool: Vec<Seen> = (1..=5)
        .map(|i| seen(&format!("p{i}"), true, None))
        .collect();
    let step = run(&spec(3), &ProxyLeaseStatus::default(), &pool, 0);
    assert_eq!(step.take.len(), 3);
    let taken: Vec<String> = step.take.iter().map(|c| c.uid.clone()).collect();
    let all = promote(
        &step.status,
        &taken,
        &pool,
        3,
        "office",
        3128,
        Some(1),
        t(0),
    );
    assert_eq!(all.proxies.len(), 3);
    assert_eq!(all.phase, Some(LeasePhase::Bound));
    let part = promote(
        &step.status,
        &taken[..2],
        &pool,
        3,
        "office",
        3128,
        Some(1),
        t(0),
    );
    assert_eq!(part.phase, Some(LeasePhase::Pending));
}

#[test]
fn leases_prefer_different_proxies() {
    let pool: Vec<Seen> = (1..=10)
        .map(|i| seen(&format!("p{i}"), true, None))
        .collect();
    let firsts: std::collections::BTreeSet<String> = (0..40)
        .map(|i| {
            plan(
                &format!("lease-{i}"),
                &spec(1),
                &ProxyLeaseStatus::default(),
                &pool,
                "office",
                3128,
                None,
                t(0),
                true,
            )
            .take[0]
                .name
                .clone()
        })
        .collect();
    assert!(firsts.len() > 3, "{firsts:?}");
}

#[test]
fn expiry_counts_from_creation_then_from_each_renewal_never_from_the_future() {
    let mut s = spec(1);
    let status = ProxyLeaseStatus::default();
    assert_eq!(expiry(&s, &status, t(0), t(10)), (t(60), None));
    s.renew_time = Some(Time(t(50)));
    let (e, seen_renew) = expiry(&s, &status, t(0), t(55));
    assert_eq!(e, t(110));
    // A renewal dated in the future counts from when it was first seen.
    s.renew_time = Some(Time(t(10_000)));
    let (e, seen_renew2) = expiry(&s, &status, t(0), t(70));
    assert_eq!(e, t(130));
    // Once recorded, the expiry stays put until the next renewal.
    let recorded = ProxyLeaseStatus {
        expiry_time: Some(Time(t(130))),
        observed_renew_time: seen_renew2,
        ..Default::default()
    };
    assert_eq!(expiry(&s, &recorded, t(0), t(125)).0, t(130));
    assert_ne!(seen_renew, recorded.observed_renew_time);
}

#[test]
fn an_expiry_never_moves_earlier() {
    let mut s = spec(1);
    s.renew_time = Some(Time(t(100)));
    let (e, observed) = expiry(&s, &ProxyLeaseStatus::default(), t(0), t(100));
    assert_eq!(e, t(160));
    let recorded = ProxyLeaseStatus {
        expiry_time: Some(Time(e)),
        observed_renew_time: observed,
        ..Default::default()
    };
    // A renewal dated earlier (a holder whose clock is behind) shortens nothing.
    s.renew_time = Some(Time(t(90)));
    assert_eq!(
        expiry(&s, &recorded, t(0), t(110)),
        (t(160), Some(Time(t(90))))
    );
    // Nor does a removed renewTime, or a shorter duration.
    s.renew_time = None;
    assert_eq!(expiry(&s, &recorded, t(0), t(110)).0, t(160));
    s.duration_seconds = 10;
    s.renew_time = Some(Time(t(105)));
    assert_eq!(expiry(&s, &recorded, t(0), t(110)).0, t(160));
    // A later renewal extends it.
    s.duration_seconds = 60;
    s.renew_time = Some(Time(t(150)));
    assert_eq!(expiry(&s, &recorded, t(0), t(150)).0, t(210));
}

#[test]
fn an_ended_lease_lists_nothing_and_releases_all_it_held() {
    let status = ProxyLeaseStatus {
        phase: Some(LeasePhase::Bound),
        proxies: vec![bound("p1")],
        claims: vec![ProxyClaim {
            name: "p2".into(),
            uid: "uid-p2".into(),
        }],
        addresses: Some("192.0.2.49".into()),
        ..Default::default()
    };
    let pool = [
        seen("p1", true, Some(LEASE)),
        seen("p3", true, Some(LEASE)),
        seen("p4", true, Some("lease-b")),
    ];
    let e = ended(&status, true, Some(1), t(0));
    assert_eq!(e.phase, Some(LeasePhase::Expired));
    assert!(e.proxies.is_empty() && e.claims.is_empty() && e.addresses.is_none());
    assert_eq!(reason(&e), "Expired");
    assert_eq!(to_release(LEASE, &status, &pool), ["p1", "p2", "p3"]);
    let d = ended(&status, false, Some(1), t(0));
    assert_eq!(reason(&d), "Released");
}

#[test]
fn a_settled_lease_plans_no_change_so_nothing_is_written_again() {
    let pool = [seen("p1", true, None), seen("p2", true, None)];
    let first = run(&spec(1), &ProxyLeaseStatus::default(), &pool, 0);
    let taken: Vec<String> = first.take.iter().map(|c| c.uid.clone()).collect();
    let bound = promote(
        &first.status,
        &taken,
        &pool,
        1,
        "office",
        3128,
        Some(1),
        t(0),
    );
    let holder = first.take[0].name.clone();
    let after: Vec<Seen> = pool
        .iter()
        .map(|s| {
            let mut s = s.clone();
            if s.member.name == holder {
                s.holder = Some(LEASE.into());
            }
            s
        })
        .collect();
    // Through a JSON round trip, as the API server hands it back.
    let stored: ProxyLeaseStatus =
        serde_json::from_value(serde_json::to_value(&bound).unwrap()).unwrap();
    for now in [1, 30, 500] {
        let again = run(&spec(1), &stored, &after, now);
        assert_eq!(again.status, stored, "at {now}");
        assert!(again.take.is_empty() && again.release.is_empty() && again.lost.is_empty());
    }
    // A proxy that stops serving starts a timer once; the next look changes nothing.
    let down: Vec<Seen> = after
        .iter()
        .map(|s| {
            let mut s = s.clone();
            s.member.serving = false;
            s
        })
        .collect();
    let timed = run(&spec(1), &stored, &down, 10);
    let stored: ProxyLeaseStatus =
        serde_json::from_value(serde_json::to_value(&timed.status).unwrap()).unwrap();
    assert_eq!(run(&spec(1), &stored, &down, 12).status, stored);
}

#[test]
fn while_the_probe_is_not_trusted_no_bound_proxy_is_given_up_for_not_serving() {
    let status = ProxyLeaseStatus {
        phase: Some(LeasePhase::Bound),
        proxies: vec![bound("p1")],
        ..Default::default()
    };
    let pool = [seen("p1", false, Some(LEASE)), seen("p2", true, None)];
    let held = |st: &ProxyLeaseStatus, now: i64| {
        plan(
            LEASE,
            &spec(1),
            st,
            &pool,
            "office",
            3128,
            Some(1),
            t(now),
            false,
        )
    };
    let step = held(&status, 100);
    assert!(step.lost.is_empty() && step.release.is_empty() && step.take.is_empty());
    assert_eq!(step.status.phase, Some(LeasePhase::Bound));
    assert_eq!(
        step.status.proxies[0].not_serving_since, None,
        "no timer starts"
    );
    // A timer started before the hold waits: past rebindAfterSeconds, nothing is lost.
    let timed = run(&spec(1), &status, &pool, 100).status;
    let step = held(&timed, 1_000);
    assert!(step.lost.is_empty() && step.release.is_empty());
    assert_eq!(step.status.proxies, timed.proxies);
    // Trusted again and still down: lost at once.
    assert_eq!(run(&spec(1), &timed, &pool, 1_000).release, ["p1"]);
    // What the probe does not decide still counts: a draining proxy is lost.
    let mut draining = seen("p1", true, Some(LEASE));
    draining.member.draining_since = Some(t(0));
    let step = plan(
        LEASE,
        &spec(1),
        &timed,
        &[draining],
        "office",
        3128,
        Some(1),
        t(1_000),
        false,
    );
    assert_eq!(step.release, ["p1"]);
}

fn outdated(mut s: Seen) -> Seen {
    s.member.outdated = true;
    s
}

fn bound_status(names: &[&str]) -> ProxyLeaseStatus {
    let mut st = ProxyLeaseStatus {
        phase: Some(LeasePhase::Bound),
        proxies: names.iter().map(|n| bound(n)).collect(),
        ..Default::default()
    };
    settle(
        &mut st,
        &ProxyLeaseStatus::default(),
        names.len(),
        "office",
        &[],
        Some(1),
        t(0),
    );
    st
}

#[test]
fn without_the_opt_in_an_out_of_date_bound_proxy_is_kept() {
    let status = bound_status(&["p1"]);
    let pool = [
        outdated(seen("p1", true, Some(LEASE))),
        seen("p2", true, None),
    ];
    let step = run(&spec(1), &status, &pool, 5);
    assert!(step.take.is_empty() && step.release.is_empty() && step.swapped.is_empty());
    assert_eq!(step.status.proxies, status.proxies);
    assert!(!needs_others(LEASE, &spec(1), &status, &pool, true));
}

#[test]
fn with_the_opt_in_an_out_of_date_proxy_is_swapped_make_before_break() {
    let mut opted = spec(1);
    opted.replace_out_of_date = true;
    let status = bound_status(&["p1"]);
    let pool = [
        outdated(seen("p1", true, Some(LEASE))),
        outdated(seen("p2", true, None)),
        seen("p3", true, None),
    ];
    assert!(needs_others(LEASE, &opted, &status, &pool, true));

    // 1. The up-to-date spare is claimed beside the bound proxy; nothing is given back
    // yet and the lease stays Bound (a swap is not a want).
    let step = run(&opted, &status, &pool, 5);
    let names = |c: &[ProxyClaim]| c.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&step.take), ["p3"], "only the up-to-date spare");
    assert!(step.release.is_empty() && step.swapped.is_empty());
    assert_eq!(step.status.phase, Some(LeasePhase::Bound));
    assert_eq!(step.status.proxies.len(), 1);

    // 2. Taken: both are bound for a moment (the Service lists both).
    let after = promote(
        &step.status,
        &["uid-p3".to_string()],
        &pool,
        1,
        "office",
        3128,
        Some(1),
        t(5),
    );
    assert_eq!(after.phase, Some(LeasePhase::Bound));
    assert_eq!(after.proxies.len(), 2);
    assert!(after.claims.is_empty());

    // 3. The next look gives the out-of-date one back.
    let pool = [
        outdated(seen("p1", true, Some(LEASE))),
        outdated(seen("p2", true, None)),
        seen("p3", true, Some(LEASE)),
    ];
    let step = run(&opted, &after, &pool, 6);
    assert_eq!(step.release, ["p1"]);
    assert_eq!(step.swapped.len(), 1);
    assert!(
        step.swapped[0].1.contains("changed since"),
        "{:?}",
        step.swapped
    );
    assert!(step.lost.is_empty(), "a swap is not a loss");
    assert_eq!(step.status.proxies.len(), 1);
    assert_eq!(step.status.proxies[0].name, "p3");
    assert_eq!(step.status.phase, Some(LeasePhase::Bound));
    assert_eq!(step.status.rebinds, 0);
    assert!(step.take.is_empty());

    // 4. Settled (office-a given back): nothing more to do.
    let pool = [
        outdated(seen("p1", true, None)),
        outdated(seen("p2", true, None)),
        seen("p3", true, Some(LEASE)),
    ];
    let settled = run(&opted, &step.status, &pool, 7);
    assert!(settled.take.is_empty() && settled.release.is_empty());
    assert_eq!(settled.status, step.status);
}

#[test]
fn a_swap_waits_for_an_up_to_date_spare_and_never_takes_an_out_of_date_one() {
    let mut opted = spec(2);
    opted.replace_out_of_date = true;
    let status = bound_status(&["p1", "p2"]);
    let pool = [
        outdated(seen("p1", true, Some(LEASE))),
        seen("p2", true, Some(LEASE)),
        outdated(seen("p3", true, None)),
        seen("p4", false, None),
    ];
    let step = run(&opted, &status, &pool, 5);
    assert!(step.take.is_empty(), "{:?}", step.take);
    assert_eq!(step.status.proxies, status.proxies);
    assert!(!needs_others(LEASE, &opted, &status, &pool, true));

    // A stale swap claim whose proxy went out of date meanwhile is dropped, not taken.
    let mut claimed = status.clone();
    claimed.claims = vec![ProxyClaim {
        name: "p3".into(),
        uid: "uid-p3".into(),
    }];
    let step = run(&opted, &claimed, &pool, 6);
    assert!(step.take.is_empty());
    assert!(step.status.claims.is_empty());
}

#[test]
fn a_lease_that_binds_prefers_up_to_date_proxies() {
    let pool = [
        outdated(seen("p1", true, None)),
        outdated(seen("p2", true, None)),
        seen("p3", true, None),
    ];
    let step = run(&spec(2), &ProxyLeaseStatus::default(), &pool, 0);
    let mut names: Vec<String> = step.take.iter().map(|c| c.name.clone()).collect();
    assert_eq!(names.len(), 2);
    assert_eq!(names.remove(0), "p3", "the up-to-date one first");
    // Short of up-to-date ones, an out-of-date proxy still fills `count`.
    assert!(names[0] == "p1" || names[0] == "p2");
}
