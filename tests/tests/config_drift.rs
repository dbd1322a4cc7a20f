#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Config drift (issue 30) on the real control plane: the real `egress-operator run` as its
//! ServiceAccount, the kvm2 provider over real SSH to libvirtd test-driver hosts, stand-in
//! proxies on loopback (the scale rig, `integration_tests::scale`).
//!
//! One story, each step building on the last:
//! 1. a pool of 3 (`maxUnavailable: 0`) converges; each member records its revision and is
//!    `UpToDate`;
//! 2. the config file's domain plugin is replaced by a build with another sha256 (the same
//!    component with one more custom section), without restarting the operator: the
//!    reload is installed, every member turns `UpToDate=False` naming `domainPlugin`, and
//!    the pool rolls them all, surge-first. A sampler reads the members every 100 ms
//!    throughout: those that serve and do not drain never drop below 3;
//! 3. a config whose domain plugin is not a component is refused whole: `/readyz` and
//!    the metric say so, and no member changes;
//! 4. the old config put back rolls the pool back to the first revision;
//! 5. a config whose new proxies cannot be made (a wrong image sha256) stalls the rollout
//!    (`Progressing=False`, `RolloutStalled`) with every old member in place and serving;
//!    the fixed config resumes it, keeping the members of the restored revision.
//!
//! Timeouts are hang guards only.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use egress_operator::api::proxy::Proxy;
use egress_operator::api::proxy_pool::{DRAINING_ANNOTATION, POOL_LABEL, ProxyPool};
use egress_operator::controller::status;
use integration_tests::harness::{self, Need};
use integration_tests::scale::{ScaleOptions, ScaleRig, metric};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, ResourceExt};
use tokio::time::Instant;

const GUARD: Duration = Duration::from_secs(300);
const POOL: &str = "drift";
const REPLICAS: usize = 3;

fn reload_period() -> Duration {
    egress_operator::run::reload::PERIOD
}

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

async fn members(api: &Api<Proxy>) -> Vec<Proxy> {
    api.list(&ListParams::default().labels(&format!("{POOL_LABEL}={POOL}")))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

fn condition(p: &Proxy, type_: &str) -> Option<(String, String)> {
    let c = status::condition(p.status.as_ref()?, type_)?;
    Some((c.status.clone(), c.message.clone()))
}

fn serving_not_draining(p: &Proxy) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && !p.annotations().contains_key(DRAINING_ANNOTATION)
        && condition(p, status::READY).is_some_and(|(s, _)| s == "True")
}

fn revision(p: &Proxy) -> Option<String> {
    Some(p.status.as_ref()?.revision.as_ref()?.hash.clone())
}

/// Waits until the pool has exactly `REPLICAS` members, all Ready and UpToDate, none of
/// them named in `not`; returns them.
async fn settled(api: &Api<Proxy>, not: &BTreeSet<String>, what: &str) -> Vec<Proxy> {
    let deadline = Instant::now() + GUARD;
    loop {
        let ms = members(api).await;
        let done = ms.len() == REPLICAS
            && ms.iter().all(|p| {
                serving_not_draining(p)
                    && condition(p, status::UP_TO_DATE).is_some_and(|(s, _)| s == "True")
                    && !not.contains(&p.name_any())
            });
        if done {
            return ms;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not settled within {GUARD:?} (hang guard); members: {:#?}",
            ms.iter()
                .map(|p| (p.name_any(), p.status.clone()))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn names(ps: &[Proxy]) -> BTreeSet<String> {
    ps.iter().map(ResourceExt::name_any).collect()
}

/// The domain plugin with one more custom section: the same component, another sha256.
fn rebuilt_plugin(dir: &std::path::Path) -> PathBuf {
    let original = integration_tests::plugin_path("domain-default").unwrap();
    let mut bytes = std::fs::read(original).unwrap();
    let name = b"egress-drift-test";
    let payload = b"rebuilt";
    let size = 1 + name.len() + payload.len();
    bytes.push(0); // custom section
    bytes.push(u8::try_from(size).unwrap()); // its size (< 128: one LEB128 byte)
    bytes.push(u8::try_from(name.len()).unwrap());
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(payload);
    let out = dir.join("domain-rebuilt.wasm");
    std::fs::write(&out, bytes).unwrap();
    out
}

/// Replaces the config file as a ConfigMap volume does: a new file renamed over it.
fn swap_config(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn wait_metric(rig: &ScaleRig, name: &str, filter: &[(&str, &str)], want: f64) {
    let deadline = Instant::now() + GUARD;
    loop {
        if let Some((200, text)) = rig.operator_get("/metrics")
            && metric(&text, name, filter) >= want
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} {filter:?} never reached {want}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_plugin_rolls_the_pool_live_a_bad_config_changes_nothing_and_a_rollback_restores()
{
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return;
    }
    let mut options = ScaleOptions::from_env(2 * REPLICAS, 2, Duration::ZERO).unwrap();
    options.probe_period_seconds = Some(5);
    let rig = ScaleRig::start(binary(), options)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let api: Api<Proxy> = Api::namespaced(rig.client().clone(), rig.namespace());
    let pools: Api<ProxyPool> = Api::namespaced(rig.client().clone(), rig.namespace());
    let scratch = tempfile::tempdir().unwrap();

    // 1. The pool converges, every member recording its revision.
    let pool: ProxyPool = serde_json::from_value(serde_json::json!({
        "apiVersion": "egress-operator.dev/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": POOL},
        "spec": {
            "replicas": REPLICAS,
            "maxSurge": 1,
            "maxUnavailable": 0,
            "drainSeconds": 1,
            "template": {"provider": "kvm2"}
        }
    }))
    .unwrap();
    pools.create(&PostParams::default(), &pool).await.unwrap();
    let first = settled(&api, &BTreeSet::new(), "the first rollout").await;
    let first_rev: BTreeSet<String> = first.iter().filter_map(revision).collect();
    assert_eq!(first_rev.len(), 1, "one revision for all: {first_rev:?}");
    println!("converged: {:?} at revision {first_rev:?}", names(&first));

    // The floor sampler: members that serve and are not draining, every 100 ms.
    let low = Arc::new(AtomicUsize::new(usize::MAX));
    let samples = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (api, low, samples, stop) = (api.clone(), low.clone(), samples.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let n = members(&api)
                    .await
                    .iter()
                    .filter(|p| serving_not_draining(p))
                    .count();
                low.fetch_min(n, Ordering::SeqCst);
                samples.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // 2. Another domain plugin digest, without a restart. (First an edit that changes
    // only a comment: nothing is installed, nothing rolls.)
    let config_path = rig.config_path();
    let original = std::fs::read_to_string(&config_path).unwrap();
    swap_config(&config_path, &format!("{original}\n# edited by hand\n"));
    tokio::time::sleep(reload_period() * 3).await;
    let (_, text) = rig.operator_get("/metrics").unwrap();
    assert_eq!(
        metric(
            &text,
            "egress_config_reloads_total",
            &[("result", "installed")]
        ),
        0.0,
        "a comment edit installed a config"
    );
    let domain = integration_tests::plugin_path("domain-default").unwrap();
    let rebuilt = rebuilt_plugin(scratch.path());
    let changed = original.replace(
        &format!("domain: {{path: {}}}", domain.display()),
        &format!("domain: {{path: {}}}", rebuilt.display()),
    );
    assert_ne!(
        changed, original,
        "the config names the domain plugin as expected"
    );
    swap_config(&config_path, &changed);
    wait_metric(
        &rig,
        "egress_config_reloads_total",
        &[("result", "installed")],
        1.0,
    )
    .await;
    // Seen out of date, naming the input, before they are replaced.
    let deadline = Instant::now() + GUARD;
    let named = loop {
        let hit = members(&api).await.into_iter().find_map(|p| {
            condition(&p, status::UP_TO_DATE)
                .filter(|(s, m)| s == "False" && m.contains("domainPlugin"))
        });
        if let Some(h) = hit {
            break h;
        }
        assert!(Instant::now() < deadline, "no member turned UpToDate=False");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("out of date: {named:?}");
    let second = settled(&api, &names(&first), "the plugin rollout").await;
    let second_rev: BTreeSet<String> = second.iter().filter_map(revision).collect();
    assert_eq!(second_rev.len(), 1, "{second_rev:?}");
    assert_ne!(second_rev, first_rev, "a new revision");
    println!(
        "rolled to {second_rev:?}: {:?}; lowest serving count {} over {} samples",
        names(&second),
        low.load(Ordering::SeqCst),
        samples.load(Ordering::SeqCst)
    );
    assert!(
        low.load(Ordering::SeqCst) >= REPLICAS,
        "serving dropped to {} during the rollout (maxUnavailable 0)",
        low.load(Ordering::SeqCst)
    );

    // 3. A bad config: refused whole, nothing changes.
    let garbage = scratch.path().join("not-a-component.wasm");
    std::fs::write(&garbage, b"this is not a wasm component").unwrap();
    let bad = original.replace(
        &format!("domain: {{path: {}}}", domain.display()),
        &format!("domain: {{path: {}}}", garbage.display()),
    );
    swap_config(&config_path, &bad);
    wait_metric(
        &rig,
        "egress_config_reloads_total",
        &[("result", "refused")],
        1.0,
    )
    .await;
    let (code, body) = rig.operator_get("/readyz").unwrap();
    println!("/readyz ({code}):\n{body}");
    assert!(body.contains("config: reload refused"), "{body}");
    assert!(
        body.contains("not-a-component.wasm"),
        "names the plugin: {body}"
    );
    // And an event on the ProviderHealth object users watch.
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::all(rig.client().clone());
    let deadline = Instant::now() + GUARD;
    let refused = loop {
        let found = events
            .list(&ListParams::default().fields("reason=ConfigRefused"))
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|e| e.involved_object.kind.as_deref() == Some("ProviderHealth"));
        if let Some(e) = found {
            break e;
        }
        assert!(Instant::now() < deadline, "no ConfigRefused event");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let note = refused.message.unwrap_or_default();
    println!("event ConfigRefused on ProviderHealth/kvm2: {note}");
    assert!(note.contains("not-a-component.wasm"), "{note}");
    // Several probe periods later, the same members, all up to date.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let still = settled(&api, &BTreeSet::new(), "after the refusal").await;
    assert_eq!(
        names(&still),
        names(&second),
        "a refused config changed the pool"
    );

    // 4. The old config back: the pool rolls back to the first revision.
    swap_config(&config_path, &original);
    wait_metric(
        &rig,
        "egress_config_reloads_total",
        &[("result", "installed")],
        2.0,
    )
    .await;
    let third = settled(&api, &names(&second), "the rollback").await;
    let third_rev: BTreeSet<String> = third.iter().filter_map(revision).collect();
    assert_eq!(
        third_rev, first_rev,
        "the rollback restores the first revision"
    );
    println!(
        "rolled back to {third_rev:?}; lowest serving count over both rollouts {}",
        low.load(Ordering::SeqCst)
    );

    // 5. A config whose new proxies cannot be made (the image's sha256 is not the file's):
    // the rollout halts with every old member in place, then resumes when the config is
    // fixed.
    let sha = original
        .split("sha256: \"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap()
        .to_string();
    let broken = original.replace(&sha, &"1".repeat(64));
    swap_config(&config_path, &broken);
    wait_metric(
        &rig,
        "egress_config_reloads_total",
        &[("result", "installed")],
        3.0,
    )
    .await;
    let deadline = Instant::now() + GUARD;
    let stalled = loop {
        let p = pools.get(POOL).await.unwrap();
        let progressing = p.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Progressing")
                .cloned()
        });
        if let Some(c) = progressing.filter(|c| c.reason == "RolloutStalled") {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "the rollout never stalled: {:#?}",
            p.status
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(stalled.status, "False");
    println!("stalled: {}", stalled.message);
    let now_members = members(&api).await;
    for name in names(&third) {
        let m = now_members
            .iter()
            .find(|p| p.name_any() == name)
            .unwrap_or_else(|| panic!("old member {name} was removed during a stalled rollout"));
        assert!(
            serving_not_draining(m),
            "old member {name} no longer serves"
        );
    }
    swap_config(&config_path, &original);
    wait_metric(
        &rig,
        "egress_config_reloads_total",
        &[("result", "installed")],
        4.0,
    )
    .await;
    let fixed = settled(&api, &BTreeSet::new(), "after the fix").await;
    assert_eq!(
        names(&fixed),
        names(&third),
        "the members of the restored revision stay; the failed ones go"
    );
    stop.store(true, Ordering::SeqCst);
    sampler.await.unwrap();
    println!(
        "lowest serving count over the whole story: {}",
        low.load(Ordering::SeqCst)
    );
    assert!(low.load(Ordering::SeqCst) >= REPLICAS);

    pools.delete(POOL, &DeleteParams::default()).await.unwrap();
    let deadline = Instant::now() + GUARD;
    while !members(&api).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "members left after the pool's delete"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let log = rig.operator_log();
    rig.stop().unwrap_or_else(|e| panic!("{e:#}\n{log}"));
}
