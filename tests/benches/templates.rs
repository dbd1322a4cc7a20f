//! `make bench`: template host timings, each printed as a median with the ratio that
//! matters, measured against its peer in the same run.
//!
//! - render per call for both default plugins (a fresh store and instance each call);
//! - loading a component: cold compile with Cranelift vs loading the cached machine code.
//!   Target: cached load at least 20x faster than compiling.
//!
//! Under `cargo test --benches` (part of `make test`) each step runs a few times, so a
//! broken bench fails CI.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a bench fails loudly

use std::time::{Duration, Instant};

use egress_operator::api::proxy;
use egress_operator::config;
use egress_operator::render::{self, Facts};
use egress_operator::templates::{CacheOutcome, TemplateEngine};
use integration_tests::{bench, plugin_path, workspace_root};
use sha2::{Digest, Sha256};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<T>(n: usize, mut f: impl FnMut() -> T) -> Duration {
    let samples = (0..n)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .collect();
    median(samples)
}

fn main() {
    bench::announce("templates");
    let root = workspace_root().join("config/samples");
    let cfg = config::load_file(&root.join("providers-config.yaml")).unwrap();
    let proxy = proxy::load_manifest(&root.join("proxy_kvm2.yaml"), &cfg).unwrap();
    let inputs = render::inputs(
        &cfg,
        &proxy,
        None,
        &Facts::default(),
        "2026-01-01T00:00:00Z",
    )
    .unwrap();
    let mut t = cfg.kvm2.templates.clone();
    t.domain.path = Some(plugin_path("domain-default").unwrap().display().to_string());
    t.vendor_data.path = Some(
        plugin_path("vendor-data-default")
            .unwrap()
            .display()
            .to_string(),
    );

    let engine = TemplateEngine::new(None).unwrap();
    let domain = engine.load_domain(&t.domain).unwrap();
    let vendor = engine.load_vendor_data(&t.vendor_data).unwrap();
    let renders = bench::pick(300, 3);
    let d = time(renders, || domain.render(&inputs.domain).unwrap());
    let v = time(renders, || vendor.render(&inputs.vendor_data).unwrap());
    println!(
        "render domain-default       median {:>9.1} µs/call ({renders} calls, fresh store each)",
        d.as_secs_f64() * 1e6
    );
    println!(
        "render vendor-data-default  median {:>9.1} µs/call ({renders} calls, fresh store each)",
        v.as_secs_f64() * 1e6
    );

    for plugin in ["domain-default", "vendor-data-default"] {
        let bytes = std::fs::read(plugin_path(plugin).unwrap()).unwrap();
        let sha = hex::encode(Sha256::digest(&bytes));
        let cold = time(bench::pick(5, 1), || {
            let (_, outcome) = engine.compile(&bytes, &sha).unwrap();
            assert_eq!(outcome, CacheOutcome::Disabled);
        });
        let dir = tempfile::tempdir().unwrap();
        let cached_engine = TemplateEngine::new(Some(dir.path())).unwrap();
        let mut tc = if plugin == "domain-default" {
            t.domain.clone()
        } else {
            t.vendor_data.clone()
        };
        tc.path = Some(plugin_path(plugin).unwrap().display().to_string());
        // Fill the cache once, then time loads that hit it.
        let _ = cached_engine.compile(&bytes, &sha).unwrap();
        if plugin == "domain-default" {
            cached_engine.load_domain(&tc).unwrap();
        } else {
            cached_engine.load_vendor_data(&tc).unwrap();
        }
        let warm = time(bench::pick(30, 2), || {
            let (_, outcome) = cached_engine.compile(&bytes, &sha).unwrap();
            assert_eq!(outcome, CacheOutcome::Hit);
        });
        let ratio = cold.as_secs_f64() / warm.as_secs_f64();
        println!(
            "load {plugin:<20} cold compile median {:>8.1} ms, cached load median {:>7.2} ms, cached is {ratio:.0}x faster (target >= 20x: {})",
            cold.as_secs_f64() * 1e3,
            warm.as_secs_f64() * 1e3,
            bench::verdict(ratio >= 20.0)
        );
    }
}
