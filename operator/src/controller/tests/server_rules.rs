//! What a real API server demands and a lenient mock would not show: a lost finalizer
//! race is a 422, event notes are limited to 1024 bytes, a Proxy's name must be a DNS
//! label, user-data Secrets must opt in, and a Proxy written against a newer CRD is
//! refused by name instead of stopping the watch.

use super::*;

/// The API server's answer to a JSON patch whose `test` op failed: the finalizer list
/// changed since the controller read it.
fn test_op_failed() -> Value {
    status_error(
        422,
        "Invalid",
        "the server rejected our request due to an error in our request",
    )
}

#[tokio::test]
async fn a_lost_finalizer_race_is_transient_and_retried_in_seconds() {
    let mut p = proxy();
    p.metadata.finalizers = Some(vec!["example.org/other".into()]);
    let w = World::build(
        &p,
        &[],
        Some(Box::new(|s: &Seen| {
            s.is_finalizer_patch().then(|| (422, test_op_failed()))
        })),
    );

    let (e, action) = w.reconcile_err(&p).await;

    assert!(matches!(e, ControllerError::FinalizerRace(_)), "{e:?}");
    assert_eq!(e.class(), ErrorClass::Transient);
    assert_eq!(action, requeue(5));
    assert_eq!(w.ctx.metrics.reconciles("transient"), 1);
    assert_eq!(w.ctx.metrics.reconciles("permanent"), 0);
    assert!(w.fake.calls().is_empty());

    // The same when the finalizer comes off.
    let d = deleting(proxy());
    let w = World::build(
        &d,
        &[],
        Some(Box::new(|s: &Seen| {
            s.is_finalizer_patch().then(|| (422, test_op_failed()))
        })),
    );
    let (e, action) = w.reconcile_err(&d).await;
    assert!(matches!(e, ControllerError::FinalizerRace(_)), "{e:?}");
    assert_eq!(action, requeue(5));
}

/// A 422 that names the object and a field (a CRD rule, an admission policy) is a refusal:
/// permanent, never a race retried every few seconds.
#[tokio::test]
async fn a_finalizer_patch_refused_by_validation_is_permanent() {
    let mut p = proxy();
    p.metadata.finalizers = Some(vec!["example.org/other".into()]);
    let w = World::build(
        &p,
        &[],
        Some(Box::new(|s: &Seen| {
            s.is_finalizer_patch().then(|| {
                let mut body = status_error(
                    422,
                    "Invalid",
                    "Proxy.egress-operator.dev \"p\" is invalid: metadata.finalizers: \
                     Forbidden: finalizers are not allowed here",
                );
                body["details"] = json!({"causes": [{"reason": "FieldValueForbidden",
                    "message": "finalizers are not allowed here",
                    "field": "metadata.finalizers"}]});
                (422, body)
            })
        })),
    );
    let (e, _) = w.reconcile_err(&p).await;
    assert!(matches!(e, ControllerError::Kube(_)), "{e:?}");
    assert_eq!(e.class(), ErrorClass::Permanent);
}

#[test]
fn event_notes_are_cut_to_1024_bytes_on_a_character_boundary() {
    assert_eq!(event_note("short".into()), "short");
    let exact = "x".repeat(MAX_EVENT_NOTE);
    assert_eq!(event_note(exact.clone()), exact);
    // Three-byte characters: a cut in the middle of one must step back.
    let long = "€".repeat(2000);
    let cut = event_note(long);
    assert!(cut.len() <= MAX_EVENT_NOTE, "{}", cut.len());
    assert!(cut.ends_with(" [truncated]"), "{cut}");
    assert!(
        cut.trim_end_matches(" [truncated]")
            .chars()
            .all(|c| c == '€')
    );
}

#[tokio::test]
async fn an_error_over_2_kb_still_produces_an_event() {
    let p = proxy();
    let w = World::new(&p);
    // A spec with many unknown fields: an InvalidSpec message far over 1024 bytes.
    let fields: Vec<String> = (0..60)
        .map(|i| format!("spec.someFieldFromANewerOperatorVersion{i:03}"))
        .collect();
    w.ctx.skew.set(UID, fields);

    let (e, _) = w.reconcile_err(&p).await;

    assert!(e.to_string().len() > 2048, "{}", e.to_string().len());
    let events = w.timeline.event_summary();
    assert_eq!(events.len(), 1, "{events:?}");
    let note = &events[0].2;
    assert!(note.len() <= MAX_EVENT_NOTE, "{}", note.len());
    assert!(note.starts_with("the Proxy does not fit"), "{note}");
    assert!(note.ends_with(" [truncated]"), "{note}");
}

#[tokio::test]
async fn a_dotted_or_long_name_is_refused_naming_metadata_name() {
    for name in ["office.egress", &"a".repeat(64)] {
        let mut p = proxy();
        p.metadata.name = Some(name.to_string());
        let w = World::new(&p);

        let (e, action) = w.reconcile_err(&p).await;

        assert!(matches!(e, ControllerError::InvalidSpec(_)), "{e:?}");
        assert_eq!(e.class(), ErrorClass::Permanent);
        assert_eq!(action, requeue(3600));
        let text = e.to_string();
        assert!(
            text.contains("metadata.name") && text.contains("DNS-1123 label"),
            "{text}"
        );
        assert!(
            !text.contains("dropped"),
            "no misleading plugin text: {text}"
        );
        assert!(w.fake.calls().is_empty(), "{:?}", w.fake.calls());
    }
}

/// Not opted in reads as "not found" (waited for, like a Secret not made yet): a different
/// class or requeue would tell a Proxy creator which Secrets exist.
#[tokio::test]
async fn a_secret_that_did_not_opt_in_is_not_used() {
    let p = with_user_data(proxy());
    let mut s = user_data_secret();
    s.metadata.labels = None;
    let w = World::build(&p, &[s.clone()], None);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::NotFound);
    assert_eq!(e.reason(), "UserDataUnavailable");
    assert_eq!(action, requeue(30));
    assert!(e.to_string().contains(USER_DATA_LABEL), "{e}");
    assert!(w.fake.calls().is_empty(), "{:?}", w.fake.calls());
    assert_no_secret_in_requests(&w.timeline);

    // Any other value is no opt-in either.
    s.metadata.labels = Some([(USER_DATA_LABEL.to_string(), "yes".to_string())].into());
    let w = World::build(&p, &[s], None);
    let (e, _) = w.reconcile_err(&p).await;
    assert_eq!(e.class(), ErrorClass::NotFound);
    assert!(w.fake.calls().is_empty());
}

#[tokio::test]
async fn unknown_spec_fields_refuse_the_create_but_not_the_delete() {
    let p = proxy();
    let w = World::new(&p);
    w.ctx.skew.set(UID, vec!["spec.dnsServers".into()]);

    let (e, action) = w.reconcile_err(&p).await;

    assert_eq!(e.class(), ErrorClass::Permanent);
    assert_eq!(action, requeue(3600));
    assert!(e.to_string().contains("spec.dnsServers"), "{e}");
    assert!(w.fake.calls().is_empty());

    // Deleting it works as for any Proxy: the finalizer comes off.
    let d = deleting(proxy());
    let w = World::new(&d);
    w.ctx.skew.set(UID, vec!["spec.dnsServers".into()]);
    w.reconcile(&d).await.unwrap();
    assert!(
        w.labels().contains(&"finalizer:remove".to_string()),
        "{:?}",
        w.labels()
    );
}
