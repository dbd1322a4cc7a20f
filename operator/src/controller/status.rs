//! The Proxy's status: computed whole from what the controller saw, then written with
//! server-side apply (the controller owns every status field, so each write carries all
//! of them and a field it no longer sets disappears).
//!
//! Conditions follow the Kubernetes shape: `Provisioned` says whether an instance exists,
//! `Serving` whether its proxy answered the last probe (see [`super::serving`]), `Ready`
//! whether it serves: running, with an address, and `Serving`. `phase` stays about the VM
//! (a running VM whose proxy fails is `Running`, not `Ready`). `lastTransitionTime` only
//! moves when a condition's status flips, so watchers can tell how long something has
//! been so (and the controller, how long a proxy has not served).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::api::proxy::{ProxyPhase, ProxyStatus};
use crate::error::ErrorClass;
use crate::provider::{Instance, InstanceState};

use super::serving::Check;

/// Condition type: an instance exists for this Proxy.
pub const PROVISIONED: &str = "Provisioned";
/// Condition type: the instance runs, has an address and its proxy serves.
pub const READY: &str = "Ready";
/// Condition type: the instance's proxy answered the last probe.
pub const SERVING: &str = "Serving";
/// Condition type: the instance was made from what is configured now (see
/// [`crate::revision`]); False names the inputs that changed since.
pub const UP_TO_DATE: &str = "UpToDate";

/// Longest condition message we write; provider errors can be long.
const MAX_MESSAGE: usize = 1024;

/// Sets (or adds) a condition, keeping its transition time when the status is unchanged.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: jiff::Timestamp,
) {
    let status = if status { "True" } else { "False" };
    let message = truncate(message);
    // The API server keeps whole seconds: a status must compare equal to its round trip,
    // or an unchanged status would look changed and be written again.
    let now = jiff::Timestamp::from_second(now.as_second()).unwrap_or(now);
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Time(now);
            }
            c.status = status.into();
            c.reason = reason.into();
            c.message = message;
            c.observed_generation = generation;
        }
        None => conditions.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            observed_generation: generation,
            last_transition_time: Time(now),
        }),
    }
}

/// The condition of that type, if set.
pub fn condition<'a>(status: &'a ProxyStatus, type_: &str) -> Option<&'a Condition> {
    status.conditions.iter().find(|c| c.type_ == type_)
}

/// Whether `Ready` is `True`.
pub fn is_ready(status: &ProxyStatus) -> bool {
    condition(status, READY).is_some_and(|c| c.status == "True")
}

/// Whether `Serving` is `True`.
pub fn is_serving(status: &ProxyStatus) -> bool {
    condition(status, SERVING).is_some_and(|c| c.status == "True")
}

/// Whether two statuses differ at most in the probe latency, which only a passing
/// probe's `Serving` message carries: a steady proxy must not cost a status write per
/// probe. The message then shows the latency of the probe that last changed the status
/// (the live figure is the probe latency metric).
pub fn same_apart_from_latency(a: &ProxyStatus, b: &ProxyStatus) -> bool {
    let strip = |s: &ProxyStatus| {
        let mut s = s.clone();
        for c in &mut s.conditions {
            if c.type_ == SERVING && c.status == "True" {
                c.message.clear();
            }
        }
        s
    };
    strip(a) == strip(b)
}

fn truncate(message: &str) -> String {
    if message.len() <= MAX_MESSAGE {
        return message.to_string();
    }
    let mut end = MAX_MESSAGE;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &message[..end])
}

/// Status after the provider reported the instance and the controller checked its proxy.
pub fn observed(
    prev: &ProxyStatus,
    generation: Option<i64>,
    instance: &Instance,
    serving: &Check,
    now: jiff::Timestamp,
) -> ProxyStatus {
    let mut s = prev.clone();
    let running = instance.state == InstanceState::Running;
    let address = instance.addresses.first().map(ToString::to_string);
    s.phase = Some(if running {
        ProxyPhase::Running
    } else {
        ProxyPhase::Degraded
    });
    s.host = Some(instance.id.host.clone());
    s.instance_id = Some(instance.id.to_string());
    s.instance_state = Some(instance.state.as_str().to_string());
    s.addresses = instance.addresses.iter().map(ToString::to_string).collect();
    s.address = address.clone();
    s.address_source = instance
        .address_source
        .filter(|_| address.is_some())
        .map(|o| o.as_str().to_string());
    s.observed_generation = generation;
    s.last_error_class = None;
    set_condition(
        &mut s.conditions,
        PROVISIONED,
        true,
        "InstanceExists",
        &format!("instance {} on host {}", instance.id, instance.id.host),
        generation,
        now,
    );
    let resumed = serving.running
        && condition(prev, SERVING).is_some_and(|c| c.reason == super::serving::NOT_RUNNING);
    set_condition(
        &mut s.conditions,
        SERVING,
        serving.serving,
        serving.reason,
        &serving.message,
        generation,
        now,
    );
    if resumed
        && !serving.serving
        && let Some(c) = s.conditions.iter_mut().find(|c| c.type_ == SERVING)
    {
        // Not running until now, so it could not serve: the replacement grace counts
        // from here ([`super::serving::overdue`]), not from before the pause.
        c.last_transition_time = Time(jiff::Timestamp::from_second(now.as_second()).unwrap_or(now));
    }
    let (ready, reason, message) = match (running, &address) {
        (true, Some(a)) if serving.serving => (true, "Serving", format!("serving at {a}")),
        (true, Some(_)) if serving.seed_not_read() => {
            (false, serving.reason, serving.message.clone())
        }
        (true, Some(_)) => (false, "NotServing", serving.message.clone()),
        (true, None) => (
            false,
            "WaitingForAddress",
            "running; no address reported yet".to_string(),
        ),
        (false, _) => (
            false,
            "NotRunning",
            format!("instance is {}", instance.state),
        ),
    };
    set_condition(
        &mut s.conditions,
        READY,
        ready,
        reason,
        &message,
        generation,
        now,
    );
    s
}

/// Status while an instance is being created or replaced. `Serving` starts over: the
/// new instance's replacement grace counts from here.
pub fn provisioning(
    prev: &ProxyStatus,
    generation: Option<i64>,
    reason: &str,
    message: &str,
    now: jiff::Timestamp,
) -> ProxyStatus {
    let mut s = prev.clone();
    s.phase = Some(ProxyPhase::Provisioning);
    s.instance_state = None;
    s.address = None;
    s.address_source = None;
    s.addresses.clear();
    s.observed_generation = generation;
    set_condition(
        &mut s.conditions,
        PROVISIONED,
        false,
        reason,
        message,
        generation,
        now,
    );
    s.conditions.retain(|c| c.type_ != SERVING);
    set_condition(
        &mut s.conditions,
        SERVING,
        false,
        reason,
        message,
        generation,
        now,
    );
    set_condition(
        &mut s.conditions,
        READY,
        false,
        reason,
        message,
        generation,
        now,
    );
    s
}

/// Status after a failed reconcile: what was known stays, the error is recorded.
pub fn errored(
    prev: &ProxyStatus,
    generation: Option<i64>,
    class: ErrorClass,
    reason: &str,
    message: &str,
    now: jiff::Timestamp,
) -> ProxyStatus {
    let mut s = prev.clone();
    s.last_error_class = Some(class_label(class).to_string());
    s.observed_generation = generation;
    if class == ErrorClass::Permanent {
        s.phase = Some(ProxyPhase::Failed);
    } else if s.phase.is_none() {
        s.phase = Some(ProxyPhase::Pending);
    }
    if s.instance_id.is_none() {
        set_condition(
            &mut s.conditions,
            PROVISIONED,
            false,
            reason,
            message,
            generation,
            now,
        );
    }
    set_condition(
        &mut s.conditions,
        READY,
        false,
        reason,
        message,
        generation,
        now,
    );
    s
}

/// Status while the finalizer deletes the instance.
pub fn deleting(prev: &ProxyStatus, generation: Option<i64>, now: jiff::Timestamp) -> ProxyStatus {
    let mut s = prev.clone();
    s.phase = Some(ProxyPhase::Deleting);
    set_condition(
        &mut s.conditions,
        READY,
        false,
        "Deleting",
        "the Proxy is being deleted",
        generation,
        now,
    );
    s
}

/// The status spelling of an error class (camelCase, like other status enums).
pub fn class_label(class: ErrorClass) -> &'static str {
    match class {
        ErrorClass::Transient => "transient",
        ErrorClass::Permanent => "permanent",
        ErrorClass::NotFound => "notFound",
        ErrorClass::Quota => "quota",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{InstanceId, ProxyRef};

    fn at(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn instance(state: InstanceState, addr: bool) -> Instance {
        Instance {
            id: InstanceId {
                host: "kvm-a".into(),
                name: "egress-u1".into(),
            },
            proxy: ProxyRef {
                namespace: "ns".into(),
                name: "p".into(),
                uid: "u1".into(),
            },
            state,
            addresses: if addr {
                vec!["192.0.2.7".parse().unwrap(), "2001:db8::7".parse().unwrap()]
            } else {
                vec![]
            },
            address_source: addr.then_some(crate::provider::AddressOrigin::Agent),
            seed_applied: None,
            created_at: "2026-01-01T00:00:00Z".into(),
        }
    }

    fn passing() -> Check {
        Check {
            serving: true,
            reason: "Serving",
            message: "192.0.2.7:3128 answered CONNECT 0.0.0.0:0 with 500 in 3 ms".into(),
            running: true,
        }
    }

    fn failing(reason: &'static str) -> Check {
        Check {
            serving: false,
            reason,
            message: format!("failed: {reason}"),
            running: true,
        }
    }

    #[test]
    fn ready_requires_serving_and_serving_flips_on_its_own_time() {
        let running = instance(InstanceState::Running, true);
        let s1 = observed(
            &ProxyStatus::default(),
            Some(1),
            &running,
            &failing("ConnectionRefused"),
            at(0),
        );
        assert!(!is_ready(&s1));
        assert!(!is_serving(&s1));
        assert_eq!(
            s1.phase,
            Some(ProxyPhase::Running),
            "phase stays about the VM"
        );
        assert_eq!(condition(&s1, READY).unwrap().reason, "NotServing");
        assert_eq!(
            condition(&s1, READY).unwrap().message,
            "failed: ConnectionRefused"
        );
        assert_eq!(condition(&s1, SERVING).unwrap().reason, "ConnectionRefused");

        // Still failing, another way: the reason follows, the time stays.
        let s2 = observed(&s1, Some(1), &running, &failing("Timeout"), at(10));
        let c = condition(&s2, SERVING).unwrap();
        assert_eq!(
            (c.reason.as_str(), c.last_transition_time.clone()),
            ("Timeout", Time(at(0)))
        );

        let s3 = observed(&s2, Some(1), &running, &passing(), at(20));
        assert!(is_ready(&s3) && is_serving(&s3));
        assert_eq!(condition(&s3, READY).unwrap().reason, "Serving");
        assert_eq!(
            condition(&s3, READY).unwrap().message,
            "serving at 192.0.2.7"
        );
        assert_eq!(
            condition(&s3, SERVING).unwrap().last_transition_time,
            Time(at(20))
        );

        let seed = Check {
            reason: crate::controller::serving::SEED_NOT_READ,
            ..failing("x")
        };
        let s4 = observed(&s3, Some(1), &running, &seed, at(30));
        assert_eq!(condition(&s4, READY).unwrap().reason, "SeedNotRead");
        assert_eq!(
            condition(&s4, SERVING).unwrap().last_transition_time,
            Time(at(30))
        );
    }

    #[test]
    fn only_the_latency_of_a_pass_is_left_out_of_the_comparison() {
        let running = instance(InstanceState::Running, true);
        let a = observed(
            &ProxyStatus::default(),
            Some(1),
            &running,
            &passing(),
            at(0),
        );
        let slower = Check {
            message: "192.0.2.7:3128 answered CONNECT 0.0.0.0:0 with 500 in 950 ms".into(),
            ..passing()
        };
        let b = observed(&a, Some(1), &running, &slower, at(30));
        assert_ne!(a, b);
        assert!(same_apart_from_latency(&a, &b));
        let c = observed(&b, Some(1), &running, &failing("Timeout"), at(60));
        assert!(!same_apart_from_latency(&b, &c));
        // Only the Serving message differs: it counts when the probe failed.
        let mut d = c.clone();
        for x in &mut d.conditions {
            if x.type_ == SERVING {
                x.message = "other".into();
            }
        }
        assert!(
            !same_apart_from_latency(&c, &d),
            "a failure's message counts"
        );
    }

    #[test]
    fn provisioning_starts_serving_over() {
        let running = instance(InstanceState::Running, true);
        let old = observed(
            &ProxyStatus::default(),
            Some(1),
            &running,
            &failing("Timeout"),
            at(0),
        );
        let p = provisioning(&old, Some(1), "Replacing", "replacing it", at(500));
        let c = condition(&p, SERVING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "Replacing")
        );
        assert_eq!(c.last_transition_time, Time(at(500)));
    }

    #[test]
    fn running_with_address_is_ready_and_transition_time_moves_only_on_flips() {
        let s1 = observed(
            &ProxyStatus::default(),
            Some(1),
            &instance(InstanceState::Running, false),
            &passing(),
            at(0),
        );
        assert!(!is_ready(&s1));
        assert_eq!(condition(&s1, READY).unwrap().reason, "WaitingForAddress");
        assert_eq!(condition(&s1, PROVISIONED).unwrap().status, "True");
        assert_eq!(s1.phase, Some(ProxyPhase::Running));

        let s2 = observed(
            &s1,
            Some(1),
            &instance(InstanceState::Running, true),
            &passing(),
            at(10),
        );
        assert!(is_ready(&s2));
        assert_eq!(s2.address.as_deref(), Some("192.0.2.7"));
        assert_eq!(s2.addresses.len(), 2);
        assert_eq!(s2.instance_id.as_deref(), Some("kvm-a/egress-u1"));
        assert_eq!(
            condition(&s2, READY).unwrap().last_transition_time,
            Time(at(10))
        );
        // Provisioned stayed True: its time did not move.
        assert_eq!(
            condition(&s2, PROVISIONED).unwrap().last_transition_time,
            Time(at(0))
        );

        let s3 = observed(
            &s2,
            Some(1),
            &instance(InstanceState::Running, true),
            &passing(),
            at(20),
        );
        assert_eq!(
            condition(&s3, READY).unwrap().last_transition_time,
            Time(at(10))
        );

        let s4 = observed(
            &s3,
            Some(1),
            &instance(InstanceState::Paused, true),
            &passing(),
            at(30),
        );
        assert!(!is_ready(&s4));
        assert_eq!(s4.phase, Some(ProxyPhase::Degraded));
        assert_eq!(condition(&s4, READY).unwrap().reason, "NotRunning");
    }

    #[test]
    fn errors_keep_what_was_known_and_permanent_ones_fail_the_proxy() {
        let ok = observed(
            &ProxyStatus::default(),
            Some(1),
            &instance(InstanceState::Running, true),
            &passing(),
            at(0),
        );
        let e = errored(
            &ok,
            Some(1),
            ErrorClass::Transient,
            "ProviderError",
            "host down",
            at(5),
        );
        assert_eq!(e.instance_id, ok.instance_id);
        assert_eq!(e.phase, Some(ProxyPhase::Running));
        assert_eq!(e.last_error_class.as_deref(), Some("transient"));
        assert_eq!(condition(&e, PROVISIONED).unwrap().status, "True");
        assert!(!is_ready(&e));

        let p = errored(
            &ProxyStatus::default(),
            Some(2),
            ErrorClass::Permanent,
            "InvalidSpec",
            "bad",
            at(5),
        );
        assert_eq!(p.phase, Some(ProxyPhase::Failed));
        assert_eq!(condition(&p, PROVISIONED).unwrap().reason, "InvalidSpec");
        assert_eq!(p.observed_generation, Some(2));

        let back = observed(
            &e,
            Some(1),
            &instance(InstanceState::Running, true),
            &passing(),
            at(9),
        );
        assert_eq!(back.last_error_class, None);
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let long = "é".repeat(2000);
        let mut c = Vec::new();
        set_condition(&mut c, READY, false, "X", &long, None, at(0));
        assert!(c[0].message.len() <= MAX_MESSAGE + 3);
        assert!(c[0].message.ends_with("..."));
    }
}
