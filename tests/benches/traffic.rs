//! `make bench`, traffic: a steady client's requests through a pool's Service while the
//! fleet changes, on the node tier (`integration_tests::node_lab`: the operator's image as
//! its Deployment on a real node, a workload pod, stand-in proxies that carry traffic).
//! Printed beside the goals of issue 29:
//!
//! - failed requests while a 3-proxy pool rolls onto a new template (surge-first, drain):
//!   goal 0;
//! - one proxy failing (its stand-in refuses connections, as a stopped tinyproxy does):
//!   the time from the failure to the end of the last failed request, p50 and p99 over
//!   the trials; goal p99 <= 3 s;
//! - failed requests while the leader's pod is deleted: goal 0.
//!
//! Wall-clock figures are printed, never asserted. Under `cargo test --benches` (part of
//! `make test`) it runs 2 failover trials instead of 5.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a bench fails loudly

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use integration_tests::bench::{self, verdict};
use integration_tests::harness::{self, Need};
use integration_tests::node_lab::{NodeLab, now, quantile};

const GOAL_FAILOVER_P99_SECONDS: f64 = 3.0;
/// Hang guard of every wait.
const GUARD: Duration = Duration::from_secs(300);
const NS: &str = "bench-traffic";

fn main() {
    if let Some(reason) = harness::skip_reason(&[Need::Node, Need::Sshd, Need::Libvirtd]) {
        harness::cannot_run(&format!("traffic bench: {reason}"));
        return;
    }
    bench::announce("traffic");
    let trials = bench::pick(5, 2);
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"));
    let mut lab = NodeLab::start(&binary, "").unwrap_or_else(|e| panic!("{e:#}"));
    let node = lab.node();
    lab.wait_operator(GUARD).unwrap_or_else(|e| panic!("{e:#}"));
    node.kubectl_run(&["create", "namespace", NS]).unwrap();
    node.apply(&format!(
        "apiVersion: egress-operator.dev/v1alpha1
kind: ProxyPool
metadata: {{name: office, namespace: {NS}}}
spec:
  replicas: 3
  template: {{provider: kvm2, machineType: small, image: base}}
  hosts: [h1]
  maxSurge: 1
  maxUnavailable: 0
  drainSeconds: 5
"
    ))
    .unwrap();
    lab.start_client(NS, "client").unwrap();
    lab.follow_proxies(NS);
    let ready3 = |what: &str| {
        lab.wait_for(what, GUARD, || {
            let ready = lab.ready_endpoints(NS, "office");
            (ready.len() == 3).then_some(ready)
        })
        .unwrap_or_else(|e| panic!("{e:#}"))
    };
    let before = ready3("3 serving members");
    let service = lab.service_address(NS, "office").unwrap();
    println!("pool office (3 proxies) serves on {before:?} behind {service}");

    // ---- A rollout under a steady client ----------------------------------------------
    let client = lab.steady_client(NS, "client", &service, 600);
    std::thread::sleep(Duration::from_secs(3));
    let started = now();
    node.kubectl_run(&[
        "patch",
        "proxypool",
        "office",
        "-n",
        NS,
        "--type=merge",
        "-p",
        r#"{"spec":{"template":{"machineType":"small2"}}}"#,
    ])
    .unwrap();
    let after = lab
        .wait_for(
            "the rollout done: 3 new proxies serving, the old ones gone",
            GUARD,
            || {
                let ready = lab.ready_endpoints(NS, "office");
                let proxies = node
                    .kubectl_run(&["get", "proxies", "-n", NS, "-o", "name"])
                    .ok()?;
                (ready.len() == 3
                    && ready.iter().all(|a| !before.contains(a))
                    && proxies.lines().count() == 3)
                    .then_some(ready)
            },
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    let rollout_seconds = now() - started;
    std::thread::sleep(Duration::from_secs(3));
    let rollout = client.finish().unwrap();
    println!(
        "rollout of 3 (surge 1, drain 5 s) onto {after:?} in {rollout_seconds:.1}s: \
         {} requests, {} failed (goal 0): {}",
        rollout.sent(),
        rollout.failed(),
        verdict(rollout.failed() == 0)
    );

    // ---- One proxy fails, over and over -----------------------------------------------
    let mut failovers = Vec::new();
    for trial in 0..trials {
        let members = ready3("3 serving members before a trial");
        let victim: Ipv4Addr = members[trial % members.len()].parse().unwrap();
        let client = lab.steady_client(NS, "client", &service, 120);
        std::thread::sleep(Duration::from_secs(2));
        let failed_at = now();
        lab.fail(victim, true).unwrap();
        let removed = lab
            .wait_for("the failed proxy out of the pool's slices", GUARD, || {
                (!lab
                    .ready_endpoints(NS, "office")
                    .contains(&victim.to_string()))
                .then(now)
            })
            .unwrap_or_else(|e| panic!("{e:#}"));
        // Long past kube-proxy's sync: any failure after this would be a late one.
        std::thread::sleep(Duration::from_secs(4));
        let seen = client.finish().unwrap();
        let last = seen.last_failure_after(failed_at);
        println!(
            "failover trial {}: {victim} down; out of the slices after {:.1}s; \
             last failed request ended {last:.2}s after the failure ({} of {} failed)",
            trial + 1,
            removed - failed_at,
            seen.failed(),
            seen.sent()
        );
        failovers.push(last);
        lab.fail(victim, false).unwrap();
    }
    let (p50, p99) = (quantile(&failovers, 0.5), quantile(&failovers, 0.99));
    println!(
        "failover, time from a proxy's failure to the end of the last failed request over {trials} trials: \
         p50 {p50:.2}s, p99 {p99:.2}s (goal p99 <= {GOAL_FAILOVER_P99_SECONDS} s): {}",
        verdict(p99 <= GOAL_FAILOVER_P99_SECONDS)
    );

    // ---- The leader's pod deleted under a steady client ---------------------------
    ready3("3 serving members before the leader's deletion");
    let client = lab.steady_client(NS, "client", &service, 300);
    std::thread::sleep(Duration::from_secs(3));
    let (leader, next) = lab.delete_leader(GUARD).unwrap_or_else(|e| panic!("{e:#}"));
    std::thread::sleep(Duration::from_secs(3));
    let loss = client.finish().unwrap();
    println!(
        "leader loss ({leader} deleted, {next} leads): {} requests, {} failed (goal 0): {}",
        loss.sent(),
        loss.failed(),
        verdict(loss.failed() == 0)
    );
    let outside = lab.peers_outside_pool();
    assert!(
        outside.is_empty(),
        "requests reached the web server another way: {outside:?}"
    );
}
