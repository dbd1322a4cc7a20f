//! Config drift: the revision a Create records, the `UpToDate` condition, adoption of
//! instances made before revisions were kept, and `updatePolicy: Replace`.

use super::*;
use crate::api::proxy::UpdatePolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

fn revision_of(s: &Value) -> &Value {
    &s["revision"]
}

fn created(w: &World, p: &Proxy) -> Proxy {
    after_our_write(p, w)
}

#[tokio::test]
async fn a_create_records_its_revision_and_a_changed_input_turns_up_to_date_false() {
    let p = proxy();
    let w = World::new(&p);
    w.fake
        .set_inputs(&[("image", "i1"), ("domainPlugin", "d1")]);
    w.reconcile(&p).await.unwrap();
    let s = w.timeline.last_status();
    let rev = revision_of(&s);
    assert_eq!(rev["parts"]["image"], "i1", "{s:#}");
    assert_eq!(rev["parts"]["userData"], "none");
    assert_eq!(rev["parts"]["hostPolicy"], "host-h1");
    assert!(rev.get("adopted").is_none(), "{rev:#}");
    assert_eq!(condition(&s, "UpToDate")["status"], "True");
    assert_eq!(condition(&s, "UpToDate")["reason"], "Current");
    let first_hash = rev["hash"].clone();

    // The config changes the image: named, and nothing is replaced (Manual).
    let made = created(&w, &p);
    w.fake
        .set_inputs(&[("image", "i2"), ("domainPlugin", "d1")]);
    w.timeline.clear();
    w.reconcile(&made).await.unwrap();
    let s = w.timeline.last_status();
    let up = condition(&s, "UpToDate");
    assert_eq!(up["status"], "False", "{s:#}");
    assert_eq!(up["reason"], "InputsChanged");
    let message = up["message"].as_str().unwrap();
    assert!(message.contains("image"), "{message}");
    assert!(!message.contains("domainPlugin"), "{message}");
    // The record stays what the instance was made from.
    assert_eq!(revision_of(&s)["hash"], first_hash);
    assert_eq!(w.fake.create_requests().len(), 1, "nothing replaced");
    assert_eq!(condition(&s, "Ready")["status"], "True", "it still serves");
}

#[tokio::test]
async fn an_instance_made_before_revisions_adopts_the_current_one_and_rolls_on_later_changes() {
    let running = instance(
        id("h2", &our_name()),
        UID,
        InstanceState::Running,
        Some("198.51.100.4"),
    );
    let p = with_status(proxy(), status_before_probes(&running));
    let w = World::new(&p);
    w.fake.insert(running);
    w.fake.set_inputs(&[("image", "i1")]);
    w.reconcile(&p).await.unwrap();
    let s = w.timeline.last_status();
    assert_eq!(revision_of(&s)["adopted"], true, "{s:#}");
    assert_eq!(revision_of(&s)["parts"]["hostPolicy"], "host-h2");
    assert!(
        revision_of(&s)["parts"].get("userData").is_none(),
        "what the user-data was is not known"
    );
    assert_eq!(condition(&s, "UpToDate")["status"], "True");
    assert_eq!(condition(&s, "UpToDate")["reason"], "Adopted");

    let adopted = after_our_write(&p, &w);
    w.fake.set_inputs(&[("image", "i2")]);
    w.timeline.clear();
    w.reconcile(&adopted).await.unwrap();
    let s = w.timeline.last_status();
    assert_eq!(condition(&s, "UpToDate")["status"], "False", "{s:#}");
    assert!(w.fake.create_requests().is_empty());
}

#[tokio::test]
async fn a_provider_that_cannot_tell_leaves_the_condition_alone() {
    let p = proxy();
    let w = World::new(&p);
    w.reconcile(&p).await.unwrap();
    let s = w.timeline.last_status();
    assert!(s.get("revision").is_none(), "{s:#}");
    let conditions = s["conditions"].as_array().unwrap();
    assert!(
        conditions.iter().all(|c| c["type"] != "UpToDate"),
        "{conditions:#?}"
    );
}

#[tokio::test]
async fn update_policy_replace_replaces_an_out_of_date_standalone_instance_in_place() {
    let mut p = proxy();
    p.spec.update_policy = Some(UpdatePolicy::Replace);
    let w = World::new(&p);
    w.fake.set_inputs(&[("image", "i1")]);
    w.reconcile(&p).await.unwrap();
    let made = created(&w, &p);
    w.fake.set_inputs(&[("image", "i2")]);
    w.timeline.clear();
    w.reconcile(&made).await.unwrap();
    let l = w.labels();
    let at = |x: &str| {
        l.iter()
            .position(|s| s == x)
            .unwrap_or_else(|| panic!("{x} not in {l:?}"))
    };
    assert!(at("status:Provisioning") < at("provider:create"), "{l:?}");
    assert!(at("event:Normal:InstanceOutOfDate") < at("provider:create"));
    assert!(at("provider:create") < at("event:Normal:Replaced"));
    assert_eq!(w.fake.create_requests().len(), 2);
    assert_eq!(w.ctx.metrics.instances("replaced-out-of-date"), 1);
    let s = w.timeline.last_status();
    assert_eq!(revision_of(&s)["parts"]["image"], "i2", "{s:#}");
    assert_eq!(condition(&s, "UpToDate")["status"], "True");
    let note = &w.timeline.event_summary()[0].2;
    assert!(
        note.contains("image") && note.contains("updatePolicy Replace"),
        "{note}"
    );
}

#[tokio::test]
async fn a_pool_member_is_never_replaced_by_its_own_policy() {
    let mut p = proxy();
    p.spec.update_policy = Some(UpdatePolicy::Replace);
    p.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "egress-operator.dev/v1alpha1".into(),
        kind: "ProxyPool".into(),
        name: "office".into(),
        uid: "pool-uid".into(),
        controller: Some(true),
        ..Default::default()
    }]);
    let w = World::new(&p);
    w.fake.set_inputs(&[("image", "i1")]);
    w.reconcile(&p).await.unwrap();
    let made = created(&w, &p);
    w.fake.set_inputs(&[("image", "i2")]);
    w.reconcile(&made).await.unwrap();
    assert_eq!(w.fake.create_requests().len(), 1, "the pool rolls it");
    let s = w.timeline.last_status();
    assert_eq!(condition(&s, "UpToDate")["status"], "False");
}
