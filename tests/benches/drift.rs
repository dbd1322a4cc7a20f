//! `make bench`, drift (issue 30, item 7): a pool of 1000 proxies on 4 simulated hosts (the
//! scale rig: the real `egress-operator run`, the kvm2 provider over SSH to libvirtd's test
//! driver, stand-in proxies on loopback; see `integration_tests::scale`) is rolled after
//! its domain plugin changes in the config file, without a restart. Printed: the time
//! until every member is up to date beside the provider's bound (the Creates' time over
//! the Creates at once, plus the Deletes' time over the workers), the operator's API writes per rolled proxy (audit log), and
//! the serving floor sampled every 500 ms throughout. A floor below `replicas -
//! maxUnavailable`, a refused request or a leftover fails the bench; times are printed,
//! never asserted.
//!
//! The pool: `maxSurge` a quarter of the replicas (at most 100, the schema's bound),
//! `maxUnavailable: 0`, `drainSeconds: 0` (a drain only waits; it is not the provider's
//! cost). `EGRESS_SCALE_PROXIES` and `EGRESS_SCALE_HOSTS` change the size. Under `cargo
//! test --benches` (part of `make test`) it rolls 12 members on 2 hosts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a bench fails loudly

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_pool::{DRAINING_ANNOTATION, POOL_LABEL, ProxyPool};
use integration_tests::bench::{self, verdict};
use integration_tests::harness::{self, Need};
use integration_tests::scale::{ScaleOptions, ScaleRig, metric};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, ResourceExt};

const POOL: &str = "rolled";

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

fn condition_is(p: &Proxy, type_: &str, status: &str) -> bool {
    p.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == status)
    })
}

fn serving(p: &Proxy) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && !p.annotations().contains_key(DRAINING_ANNOTATION)
        && condition_is(p, "Ready", "True")
}

async fn members(api: &Api<Proxy>) -> Vec<Proxy> {
    api.list(&ListParams::default().labels(&format!("{POOL_LABEL}={POOL}")))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

/// Polls until `n` members serve, all up to date and none named in `not`.
async fn settled(
    api: &Api<Proxy>,
    n: usize,
    not: &BTreeSet<String>,
    guard: Duration,
) -> Vec<Proxy> {
    let start = Instant::now();
    loop {
        let ms = members(api).await;
        if ms.len() == n
            && ms.iter().all(|p| {
                serving(p) && condition_is(p, "UpToDate", "True") && !not.contains(&p.name_any())
            })
        {
            return ms;
        }
        let up = ms
            .iter()
            .filter(|p| condition_is(p, "UpToDate", "True"))
            .count();
        assert!(
            start.elapsed() < guard,
            "not settled within {guard:?} (hang guard): {} members, {up} up to date",
            ms.len()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The provider's time in `op` calls so far, and their count.
fn call_seconds(metrics: &str, op: &str) -> (f64, f64) {
    let f = [("op", op), ("outcome", "ok")];
    (
        metric(metrics, "egress_provider_call_duration_seconds_sum", &f),
        metric(metrics, "egress_provider_call_duration_seconds_count", &f),
    )
}

fn main() {
    if let Some(reason) = harness::skip_reason(&[Need::Sshd, Need::Libvirtd]) {
        harness::cannot_run(&format!("drift bench: {reason}"));
        return;
    }
    bench::announce("drift");
    let (n, hosts) = bench::pick((1000, 4), (12, 2));
    let options = ScaleOptions::from_env(n, hosts, Duration::ZERO).unwrap();
    let n = options.proxies;
    let guard = options.guard * 3;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let rig = ScaleRig::start(binary(), options.clone())
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let api: Api<Proxy> = Api::namespaced(rig.client().clone(), rig.namespace());
        let pools: Api<ProxyPool> = Api::namespaced(rig.client().clone(), rig.namespace());
        let surge = (n / 4).clamp(1, 100);
        let pool: ProxyPool = serde_json::from_value(serde_json::json!({
            "apiVersion": "egress-operator.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": POOL},
            "spec": {
                "replicas": n,
                "maxSurge": surge,
                "maxUnavailable": 0,
                "drainSeconds": 0,
                "template": {"provider": "kvm2"}
            }
        }))
        .unwrap();
        pools.create(&PostParams::default(), &pool).await.unwrap();
        let t = Instant::now();
        let first = settled(&api, n, &BTreeSet::new(), guard).await;
        println!(
            "drift: a pool of {n} on {hosts} hosts serves after {:.1} s (maxSurge {surge}, \
             maxUnavailable 0, drainSeconds 0)",
            t.elapsed().as_secs_f64()
        );
        let old: BTreeSet<String> = first.iter().map(ResourceExt::name_any).collect();

        // The floor sampler, then the plugin change.
        let low = Arc::new(AtomicUsize::new(usize::MAX));
        let samples = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (api, low, samples, stop) =
                (api.clone(), low.clone(), samples.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let up = members(&api).await.iter().filter(|p| serving(p)).count();
                    low.fetch_min(up, Ordering::SeqCst);
                    samples.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
        };
        let before = rig.operator_metrics().unwrap();
        let mark = rig.begin().unwrap();
        let path = rig.config_path();
        let original = std::fs::read_to_string(&path).unwrap();
        let plugin = integration_tests::plugin_path("domain-default").unwrap();
        let mut bytes = std::fs::read(&plugin).unwrap();
        // One more custom section: the same component, another sha256.
        bytes.extend_from_slice(&[0, 13, 5]);
        bytes.extend_from_slice(b"drift");
        bytes.extend_from_slice(b"rebuilt");
        let rebuilt = path.with_file_name("domain-rebuilt.wasm");
        std::fs::write(&rebuilt, bytes).unwrap();
        let changed = original.replace(
            &format!("domain: {{path: {}}}", plugin.display()),
            &format!("domain: {{path: {}}}", rebuilt.display()),
        );
        assert_ne!(changed, original);
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, changed).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        let t = Instant::now();
        settled(&api, n, &old, guard).await;
        let rolled_in = t.elapsed();
        let phase = rig.end(&mark).unwrap();
        stop.store(true, Ordering::SeqCst);
        sampler.await.unwrap();
        let after = rig.operator_metrics().unwrap();

        // The provider's own work in the rollout: every Create (at most `at_once` at a time:
        // the workers, the hosts' create slots, the surge) and every Delete (at most one
        // per worker).
        let spent = |op: &str| {
            let ((s0, c0), (s1, c1)) = (call_seconds(&before, op), call_seconds(&after, op));
            (s1 - s0, c1 - c0)
        };
        let (create_s, creates) = spent("create");
        let (delete_s, deletes) = spent("delete");
        let mean = create_s / creates.max(1.0);
        let at_once = usize::from(rig.concurrency())
            .min(hosts * rig.creates_per_host() as usize)
            .min(surge)
            .max(1);
        let workers = f64::from(rig.concurrency().max(1));
        let bound = create_s / at_once as f64 + delete_s / workers;
        let ratio = rolled_in.as_secs_f64() / bound.max(f64::EPSILON);
        let writes = ["proxies", "events"]
            .iter()
            .map(|r| phase.writes(Some(r)))
            .sum::<u64>() as f64
            / n as f64;
        let floor = low.load(Ordering::SeqCst);
        println!("drift: rolled {n} members after a domain plugin change, no restart:");
        println!(
            "  time to all up to date: {:.1} s; provider bound {bound:.1} s ({creates:.0} \
             Creates of mean {mean:.2} s, {at_once} at once; {deletes:.0} Deletes of mean \
             {:.2} s, {workers:.0} at once): {ratio:.2}x",
            rolled_in.as_secs_f64(),
            delete_s / deletes.max(1.0),
        );
        println!(
            "  API writes per rolled proxy (Proxies, their status and events; creates and \
             deletes): {writes:.2}; by resource: {:?}",
            phase.writes_by_resource()
        );
        println!(
            "  serving floor: lowest {floor} of {n} over {} samples (goal >= {n}): {}",
            samples.load(Ordering::SeqCst),
            verdict(floor >= n)
        );
        println!(
            "  operator: peak RSS {:.1} MiB, CPU {:.1} s; provider calls {:?}",
            phase.peak_rss_kib as f64 / 1024.0,
            phase.cpu_seconds,
            phase.provider_calls
        );
        println!(
            "  Proxy reconcile latency during the rollout (histogram buckets' upper bounds): {}",
            phase
                .reconcile_p50_p99
                .map(|(a, b)| format!("p50 <= {a} s, p99 <= {b} s"))
                .unwrap_or_else(|| "none ended".into())
        );
        assert!(floor >= n, "the serving floor dropped to {floor} of {n}");
        assert_eq!(phase.refused, 0, "requests refused: {:#?}", phase.requests);

        pools.delete(POOL, &DeleteParams::default()).await.unwrap();
        let start = Instant::now();
        while !members(&api).await.is_empty() {
            assert!(
                start.elapsed() < guard,
                "members left after the pool's delete"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let left = tokio::task::block_in_place(|| rig.leftovers_now()).unwrap();
        assert!(left.is_empty(), "left on the hosts: {left:#?}");
        println!("drift: all gone; leftovers on the hosts: none");
        rig.stop().unwrap();
    });
}
