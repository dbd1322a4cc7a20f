//! Counts the operator's requests to the Kubernetes API by method and status: the cost a
//! fleet puts on the API server, and the writes the scale work keeps per Proxy. A layer on
//! kube's client stack, so every controller's calls are counted without each one
//! remembering to.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    /// `GET`, `LIST`, `WATCH`, `POST`, `PUT`, `PATCH`, `DELETE`.
    verb: String,
    /// The status code, or `error` when no response came (connection, timeout).
    code: String,
}

/// The counter behind the layer; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct ApiMetrics {
    requests: Family<RequestLabels, Counter>,
}

impl ApiMetrics {
    /// Registered as `egress_kube_requests`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_kube_requests",
            "requests to the Kubernetes API by verb (GET, LIST, WATCH, POST, PUT, PATCH, \
             DELETE) and status code",
            m.requests.clone(),
        );
        m
    }

    /// Requests counted with this verb and code (for tests).
    pub fn requests(&self, verb: &str, code: &str) -> u64 {
        self.requests
            .get_or_create(&RequestLabels {
                verb: verb.into(),
                code: code.into(),
            })
            .get()
    }

    fn count(&self, verb: &'static str, code: String) {
        self.requests
            .get_or_create(&RequestLabels {
                verb: verb.into(),
                code,
            })
            .inc();
    }
}

/// The verb as the API server's audit log names it: a GET of a collection is a LIST, one
/// with `watch=true` a WATCH. Whether a path names a collection follows from its shape
/// (`/api/v1` or `/apis/GROUP/VERSION`, then `RESOURCE` or `namespaces/NS/RESOURCE`).
fn verb(method: &http::Method, uri: &http::Uri) -> &'static str {
    let watch = uri
        .query()
        .unwrap_or("")
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..),
        Some(&"apis") => segments.get(3..),
        _ => None,
    }
    .unwrap_or(&[]);
    let collection = matches!(rest, ["namespaces", _, _] | [_]);
    match *method {
        http::Method::GET if watch => "WATCH",
        http::Method::GET if collection => "LIST",
        http::Method::GET => "GET",
        http::Method::POST => "POST",
        http::Method::PUT => "PUT",
        http::Method::PATCH => "PATCH",
        http::Method::DELETE => "DELETE",
        _ => "OTHER",
    }
}

/// The tower layer to put on kube's client stack.
#[derive(Clone, Debug)]
pub struct CountLayer(pub ApiMetrics);

impl<S> tower_layer::Layer<S> for CountLayer {
    type Service = Count<S>;

    fn layer(&self, inner: S) -> Count<S> {
        Count {
            inner,
            metrics: self.0.clone(),
        }
    }
}

/// The service [`CountLayer`] makes.
#[derive(Clone, Debug)]
pub struct Count<S> {
    inner: S,
    metrics: ApiMetrics,
}

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower_service::Service<http::Request<B>> for Count<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Boxed<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let verb = verb(req.method(), req.uri());
        let metrics = self.metrics.clone();
        let response = self.inner.call(req);
        Box::pin(async move {
            let r = response.await;
            let code = match &r {
                Ok(resp) => resp.status().as_u16().to_string(),
                Err(_) => "error".to_string(),
            };
            metrics.count(verb, code);
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(method: http::Method, uri: &str) -> &'static str {
        verb(&method, &uri.parse().unwrap())
    }

    #[test]
    fn verbs_as_the_audit_log_names_them() {
        let proxies = "/apis/egress-operator.dev/v1alpha1/proxies";
        assert_eq!(
            v(http::Method::GET, &format!("{proxies}?limit=500")),
            "LIST"
        );
        assert_eq!(v(http::Method::GET, proxies), "LIST");
        assert_eq!(
            v(
                http::Method::GET,
                "/apis/egress-operator.dev/v1alpha1/namespaces/a/proxies"
            ),
            "LIST"
        );
        assert_eq!(
            v(http::Method::GET, "/api/v1/namespaces/kube-system"),
            "GET"
        );
        assert_eq!(v(http::Method::GET, "/api/v1/namespaces"), "LIST");
        assert_eq!(v(http::Method::GET, "/version"), "GET");
        assert_eq!(
            v(
                http::Method::GET,
                &format!("{proxies}?watch=true&resourceVersion=5")
            ),
            "WATCH"
        );
        assert_eq!(
            v(
                http::Method::GET,
                "/apis/egress-operator.dev/v1alpha1/namespaces/a/proxies/p"
            ),
            "GET"
        );
        assert_eq!(v(http::Method::PATCH, proxies), "PATCH");
        assert_eq!(v(http::Method::HEAD, proxies), "OTHER");
    }

    #[tokio::test]
    async fn counts_each_response_by_code_and_a_failure_as_error() {
        use tower_service::Service;
        let (mock, mut handle) = tower_test::mock::pair::<http::Request<()>, http::Response<()>>();
        let metrics = ApiMetrics::default();
        let mut svc = tower_layer::Layer::layer(&CountLayer(metrics.clone()), mock);
        let server = tokio::spawn(async move {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_response(http::Response::builder().status(409).body(()).unwrap());
            let (_, send) = handle.next_request().await.unwrap();
            send.send_error(std::io::Error::other("reset"));
        });
        std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
        let req = http::Request::patch("/api/v1/namespaces/a/pods/b")
            .body(())
            .unwrap();
        assert_eq!(svc.call(req).await.unwrap().status(), 409);
        std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
        let req = http::Request::post("/api/v1/namespaces/a/events")
            .body(())
            .unwrap();
        assert!(svc.call(req).await.is_err());
        server.await.unwrap();
        assert_eq!(metrics.requests("PATCH", "409"), 1);
        assert_eq!(metrics.requests("POST", "error"), 1);
        assert_eq!(metrics.requests("PATCH", "200"), 0);
    }
}
