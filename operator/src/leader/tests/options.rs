//! Options, identity, error classes.

use super::*;

#[test]
fn defaults_are_valid_and_bad_timings_are_refused() {
    let good = LeaderOptions::new("ns", "pod-a");
    good.validate().unwrap();
    assert_eq!(good.lease_name, DEFAULT_LEASE_NAME);

    let bad: [fn(&mut LeaderOptions); 8] = [
        |o| o.renew_before_expiry = o.lease_duration,
        |o| o.renew_before_expiry = Duration::ZERO,
        |o| o.lease_duration = Duration::from_secs(1),
        |o| o.lease_duration = Duration::from_millis(15_500),
        |o| o.retry_period = Duration::ZERO,
        |o| o.retry_period = o.lease_duration,
        |o| o.identity = " ".to_string(),
        |o| o.namespace = String::new(),
    ];
    for (i, spoil) in bad.iter().enumerate() {
        let mut options = good.clone();
        spoil(&mut options);
        let err = options.validate().unwrap_err();
        assert!(
            matches!(err, LeaderError::InvalidOptions(_)),
            "case {i}: {err}"
        );
        assert_eq!(err.class(), ErrorClass::Permanent, "case {i}");
    }
}

#[tokio::test]
async fn start_refuses_bad_options_without_calling_the_api() {
    let fake = Arc::new(FakeApi::default());
    let mut options = options("replica-a", 4, 2);
    options.renew_before_expiry = Duration::from_secs(4);
    let err = LeaderElector::start(client(&fake), options)
        .await
        .unwrap_err();
    assert!(matches!(err, LeaderError::InvalidOptions(_)), "{err}");
    assert!(fake.state.lock().unwrap().leases.is_empty());
}

#[test]
fn identity_is_the_pod_name_else_the_host_name() {
    let s = |v: &str| Some(v.to_string());
    assert_eq!(identity_from(s("pod-a"), s("host")).unwrap(), "pod-a");
    assert_eq!(identity_from(s(" "), s("host\n")).unwrap(), "host");
    assert_eq!(identity_from(None, s("host")).unwrap(), "host");
    assert!(matches!(
        identity_from(None, s("")),
        Err(LeaderError::NoIdentity)
    ));
    assert!(matches!(
        identity_from(None, None),
        Err(LeaderError::NoIdentity)
    ));
}

#[test]
fn api_failures_are_classified_by_status_code() {
    let api = |code: u16| {
        LeaderError::Lease {
            namespace: "ns".into(),
            name: "l".into(),
            source: kube::Error::Api(
                kube::core::Status::failure("x", "y")
                    .with_code(code)
                    .boxed(),
            ),
        }
        .class()
    };
    assert_eq!(api(403), ErrorClass::Permanent);
    assert_eq!(api(404), ErrorClass::NotFound);
    assert_eq!(api(409), ErrorClass::Transient);
    assert_eq!(api(429), ErrorClass::Transient);
    assert_eq!(api(503), ErrorClass::Transient);
}
