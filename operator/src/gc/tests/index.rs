//! The Proxy index over the Kubernetes API.

use super::*;
use crate::gc::index::owner_of;

#[test]
fn owners_come_from_uid_status_and_deletion_timestamp() {
    use crate::api::proxy::{ProxySpec, ProxyStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    let mut p = Proxy::new("web", ProxySpec::default());
    p.metadata.namespace = Some("ns".into());
    assert_eq!(owner_of(&p), None, "no UID: cannot be keyed");

    p.metadata.uid = Some("u1".into());
    let (uid, o) = owner_of(&p).unwrap();
    assert_eq!(uid, "u1");
    assert_eq!((o.namespace.as_str(), o.name.as_str()), ("ns", "web"));
    assert_eq!(o.instance_id, None);
    assert!(!o.deleting);

    p.status = Some(ProxyStatus {
        instance_id: Some("kvm-a/egress-u1".into()),
        ..Default::default()
    });
    p.metadata.deletion_timestamp = Some(Time(now()));
    let (_, o) = owner_of(&p).unwrap();
    assert_eq!(o.instance_id, Some(id("kvm-a", "egress-u1")));
    assert!(o.deleting);

    p.status = Some(ProxyStatus {
        instance_id: Some("not an id".into()),
        ..Default::default()
    });
    assert_eq!(owner_of(&p).unwrap().1.instance_id, None);
    assert!(!owner_of(&p).unwrap().1.provisioning);

    p.status = Some(ProxyStatus {
        instance_id: Some("kvm-a/egress-u1".into()),
        phase: Some(crate::api::proxy::ProxyPhase::Provisioning),
        ..Default::default()
    });
    assert!(owner_of(&p).unwrap().1.provisioning);
}

/// The single read against a mock API server: it asks for the one Proxy by namespace
/// and name, and answers `None` when it is gone (404) or is another object now
/// (another UID under the same name).
#[tokio::test]
async fn the_kubernetes_index_rereads_one_proxy_by_name_and_uid() {
    use http::{Request, Response};
    use kube::client::Body;

    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let server = tokio::spawn(async move {
        let mut paths = Vec::new();
        for answer in ["u-a", "u-other", "404"] {
            let (request, send) = handle.next_request().await.expect("a get request");
            paths.push(request.uri().path().to_string());
            let (code, body) = if answer == "404" {
                (
                    404,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1",
                        "status": "Failure", "code": 404, "reason": "NotFound",
                        "message": "not found"}),
                )
            } else {
                (
                    200,
                    serde_json::json!({
                        "apiVersion": "egress-operator.dev/v1alpha1", "kind": "Proxy",
                        "metadata": {"name": "web", "namespace": "ns", "uid": answer},
                        "spec": {"provider": "kvm2"},
                        "status": {"instanceId": "h2/egress-u-a", "phase": "Provisioning"},
                    }),
                )
            };
            send.send_response(
                Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&body).unwrap()))
                    .unwrap(),
            );
        }
        paths
    });
    let index = KubeProxyIndex::new(kube::Client::new(service, "default"));
    let found = index.owner("u-a", "ns", "web").await.unwrap().unwrap();
    assert_eq!(found.instance_id, Some(id("h2", "egress-u-a")));
    assert!(found.provisioning);
    assert_eq!(index.owner("u-a", "ns", "web").await.unwrap(), None);
    assert_eq!(index.owner("u-a", "ns", "web").await.unwrap(), None);
    let paths = server.await.unwrap();
    assert!(
        paths
            .iter()
            .all(|p| p == "/apis/egress-operator.dev/v1alpha1/namespaces/ns/proxies/web"),
        "{paths:?}"
    );
}

/// The Kubernetes index against a mock API server: it follows continue tokens across
/// pages, keys owners by UID with the instance their status names, and a failing page
/// fails the whole listing (never a partial owner set, which would read as orphans).
#[tokio::test]
async fn the_kubernetes_index_reads_every_page_and_fails_whole() {
    use http::{Request, Response};
    use kube::client::Body;

    let proxy = |name: &str, uid: &str, instance: Option<&str>| {
        serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1", "kind": "Proxy",
            "metadata": {"name": name, "namespace": "ns", "uid": uid},
            "spec": {"provider": "kvm2"},
            "status": instance.map(|i| serde_json::json!({"instanceId": i})),
        })
    };
    let page = |items: Vec<serde_json::Value>, next: &str| {
        serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyList",
            "metadata": {"resourceVersion": "9", "continue": next}, "items": items,
        })
    };
    for fail_second_page in [false, true] {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pages = vec![
            page(vec![proxy("a", "u-a", Some("h1/egress-u-a"))], "tok-1"),
            page(vec![proxy("b", "u-b", None)], ""),
        ];
        let server = tokio::spawn(async move {
            let mut queries = Vec::new();
            for (n, body) in pages.into_iter().enumerate() {
                let (request, send) = handle.next_request().await.expect("a list request");
                assert_eq!(
                    request.uri().path(),
                    "/apis/egress-operator.dev/v1alpha1/proxies"
                );
                queries.push(request.uri().query().unwrap_or_default().to_string());
                let (code, body) = if n == 1 && fail_second_page {
                    (
                        503,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1",
                            "status": "Failure", "code": 503, "message": "busy"}),
                    )
                } else {
                    (200, body)
                };
                send.send_response(
                    Response::builder()
                        .status(code)
                        .body(Body::from(serde_json::to_vec(&body).unwrap()))
                        .unwrap(),
                );
            }
            queries
        });
        let index = KubeProxyIndex::new(kube::Client::new(service, "default"));
        let result = index.owners().await;
        let queries = server.await.unwrap();
        assert!(queries[0].contains("limit=500"), "{queries:?}");
        assert!(queries[1].contains("continue=tok-1"), "{queries:?}");
        if fail_second_page {
            let e = result.unwrap_err();
            assert_eq!(e.class(), ErrorClass::Transient, "{e}");
        } else {
            let owners = result.unwrap();
            assert_eq!(owners.len(), 2, "{owners:?}");
            assert_eq!(
                owners["u-a"].instance_id,
                Some(InstanceId::parse("h1/egress-u-a").unwrap())
            );
            assert_eq!(owners["u-b"].instance_id, None);
            assert_eq!(owners["u-b"].name, "b");
        }
    }
}
