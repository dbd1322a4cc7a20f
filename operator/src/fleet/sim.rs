//! The pool's rules run against a simulated world with paused time: Proxies that take a
//! while to serve, hosts that fail and come back, and a sample of the listed endpoints at
//! every step (invariant F2). Then the liveness guard against a dialer that fails every
//! proxy at once (invariant F3).

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::ObjectMeta;
use tokio::time::Instant;

use super::discovery::listed;
use super::liveness::{Liveness, LivenessOptions, PoolKey, Target};
use super::plan::{HostSlot, PoolShape, plan};
use super::{FleetMetrics, LivenessBoard, Member};
use crate::api::proxy::{Proxy, ProxySpec, ProxyStatus};
use crate::serving::{BoxFuture, Dialer, ProbeStream};

/// How long a new proxy takes to serve in the simulation (boot, cloud-init).
const BOOT: Duration = Duration::from_secs(20);
const TICK: Duration = Duration::from_secs(1);

struct SimProxy {
    name: String,
    host: String,
    hash: String,
    created: Instant,
    draining: Option<Instant>,
    /// The proxy software answers (tests break it on purpose).
    works: bool,
}

struct World {
    start: Instant,
    epoch: jiff::Timestamp,
    proxies: Vec<SimProxy>,
    hosts: Vec<HostSlot>,
    next: usize,
    shape: PoolShape,
    /// Serving endpoints at every step.
    samples: Vec<usize>,
    log: Vec<String>,
}

impl World {
    fn new(replicas: usize, hosts: &[&str]) -> Self {
        Self {
            start: Instant::now(),
            epoch: jiff::Timestamp::from_second(1_800_000_000).unwrap(),
            proxies: Vec::new(),
            hosts: hosts
                .iter()
                .map(|h| HostSlot {
                    name: (*h).into(),
                    healthy: true,
                    room: 100,
                })
                .collect(),
            next: 0,
            shape: PoolShape {
                replicas,
                max_surge: 1,
                max_unavailable: 0,
                drain: Duration::from_secs(5),
                template_hash: "t1".into(),
                replace_after: Duration::from_secs(900),
                creates: super::plan::CreateGate::Open,
                progress_deadline: Duration::ZERO,
            },
            samples: Vec::new(),
            log: Vec::new(),
        }
    }

    fn ts(&self, at: Instant) -> jiff::Timestamp {
        let d = jiff::SignedDuration::try_from(at - self.start).unwrap();
        self.epoch + d
    }

    fn host_up(&self, h: &str) -> bool {
        self.hosts.iter().any(|s| s.name == h && s.healthy)
    }

    fn members(&self) -> Vec<Member> {
        let now = Instant::now();
        self.proxies
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let serving =
                    p.works && self.host_up(&p.host) && now.duration_since(p.created) >= BOOT;
                Member {
                    name: p.name.clone(),
                    uid: format!("uid-{}", p.name),
                    address: Some(IpAddr::from([192, 0, 2, u8::try_from(i % 250).unwrap()])),
                    host: Some(p.host.clone()),
                    created: self.ts(p.created),
                    template_hash: Some(p.hash.clone()),
                    draining_since: p.draining.map(|d| self.ts(d)),
                    leased: false,
                    deleting: false,
                    ready: serving,
                    serving,
                    failed: false,
                    not_serving_since: (!serving).then(|| self.ts(p.created)),
                    outdated: false,
                }
            })
            .collect()
    }

    fn serving_endpoints(&self) -> usize {
        listed(&self.members(), 3128)
            .iter()
            .filter(|l| l.endpoint.ready)
            .count()
    }

    /// One reconcile, applied at once; then time moves one tick.
    async fn step(&mut self) {
        let members = self.members();
        let now = Instant::now();
        let p = plan(&self.shape, &members, &self.hosts, self.ts(now));
        for name in &p.delete {
            self.proxies.retain(|x| &x.name != name);
            self.log.push(format!("delete {name}"));
        }
        for name in &p.drain {
            if let Some(x) = self.proxies.iter_mut().find(|x| &x.name == name) {
                x.draining = Some(now);
            }
            self.log.push(format!("drain {name}"));
        }
        for host in &p.create {
            self.next += 1;
            let name = format!("p{}", self.next);
            self.log.push(format!("create {name} on {host}"));
            self.proxies.push(SimProxy {
                name,
                host: host.clone(),
                hash: self.shape.template_hash.clone(),
                created: now,
                draining: None,
                works: true,
            });
        }
        self.samples.push(self.serving_endpoints());
        tokio::time::sleep(TICK).await;
    }

    async fn run_until(&mut self, what: &str, done: impl Fn(&World) -> bool) {
        for _ in 0..600 {
            if done(self) {
                return;
            }
            self.step().await;
        }
        panic!("{what}: not reached in 600 steps; log: {:?}", self.log);
    }

    fn settled(&self) -> bool {
        let m = self.members();
        m.len() == self.shape.replicas
            && m.iter().all(|m| {
                m.serving
                    && m.draining_since.is_none()
                    && m.template_hash.as_deref() == Some(&self.shape.template_hash)
            })
    }

    fn per_host(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for p in &self.proxies {
            *out.entry(p.host.clone()).or_insert(0) += 1;
        }
        out
    }
}

#[tokio::test(start_paused = true)]
async fn a_pool_spreads_rolls_surge_first_and_never_serves_fewer_than_replicas() {
    let mut w = World::new(3, &["h1", "h2"]);
    w.run_until("converge", World::settled).await;
    assert_eq!(
        w.per_host(),
        BTreeMap::from([("h1".into(), 2), ("h2".into(), 1)])
    );

    w.samples.clear();
    w.shape.template_hash = "t2".into();
    w.run_until("rollout", World::settled).await;
    assert!(
        w.samples.iter().all(|&n| n >= 3),
        "serving endpoints fell below replicas during the rollout: {:?}\n{:?}",
        w.samples,
        w.log
    );
    assert!(w.per_host().values().all(|&n| n <= 2), "{:?}", w.per_host());
    // Surge-first: every drain comes after the create of its replacement, and never more
    // than replicas + maxSurge proxies exist.
    let creates = w.log.iter().filter(|l| l.starts_with("create")).count();
    assert_eq!(creates, 6, "3 first, 3 replacements: {:?}", w.log);
    let first_drain = w.log.iter().position(|l| l.starts_with("drain")).unwrap();
    let fourth_create = w
        .log
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("create"))
        .nth(3)
        .unwrap()
        .0;
    assert!(fourth_create < first_drain, "{:?}", w.log);
}

#[tokio::test(start_paused = true)]
async fn scale_out_then_in_removes_the_non_serving_first_then_the_newest() {
    let mut w = World::new(2, &["h1", "h2"]);
    w.run_until("converge", World::settled).await;
    w.shape.replicas = 5;
    w.run_until("scale out", World::settled).await;
    assert_eq!(w.proxies.len(), 5);
    assert!(w.per_host().values().all(|&n| n <= 3), "{:?}", w.per_host());
    // p2 (an old one) stops serving; the newest is p5.
    w.proxies[1].works = false;
    let broken = w.proxies[1].name.clone();
    w.samples.clear();
    w.shape.replicas = 2;
    w.log.clear();
    w.run_until("scale in", |w| {
        w.proxies.len() == 2 && w.proxies.iter().all(|p| p.draining.is_none())
    })
    .await;
    assert_eq!(w.log[0], format!("delete {broken}"), "{:?}", w.log);
    // p3, p4 and p5 were made in the same reconcile, so none is newer: the fuller host
    // (h1 carries p1, p3 and p5) gives up its two, which leaves one proxy per host.
    let drained: Vec<&String> = w.log.iter().filter(|l| l.starts_with("drain")).collect();
    assert_eq!(drained, ["drain p3", "drain p5"], "{:?}", w.log);
    let left: Vec<&str> = w.proxies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(left, ["p1", "p4"]);
    assert!(w.per_host().values().all(|&n| n == 1), "{:?}", w.per_host());
    assert!(w.samples.iter().all(|&n| n >= 2), "{:?}", w.samples);
}

#[tokio::test(start_paused = true)]
async fn a_lost_host_is_replaced_elsewhere_and_a_later_rollout_rebalances() {
    let mut w = World::new(4, &["h1", "h2"]);
    w.run_until("converge", World::settled).await;
    assert_eq!(
        w.per_host(),
        BTreeMap::from([("h1".into(), 2), ("h2".into(), 2)])
    );
    w.hosts[1].healthy = false;
    w.run_until("replaced", |w| {
        w.settled() && w.proxies.iter().all(|p| p.host == "h1")
    })
    .await;
    // h2 returns: nothing moves only to rebalance.
    w.hosts[1].healthy = true;
    for _ in 0..60 {
        w.step().await;
    }
    assert_eq!(w.per_host(), BTreeMap::from([("h1".into(), 4)]));
    // A rollout places the new proxies on the emptier host first.
    w.shape.template_hash = "t2".into();
    w.samples.clear();
    w.run_until("rollout", World::settled).await;
    assert_eq!(
        w.per_host(),
        BTreeMap::from([("h1".into(), 2), ("h2".into(), 2)])
    );
    assert!(w.samples.iter().all(|&n| n >= 4), "{:?}", w.samples);
}

/// Dials nothing: every connection is refused, as when the operator's own network is cut.
struct Refusing;

impl Dialer for Refusing {
    fn dial(&self, _: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn ProbeStream>>> {
        Box::pin(async { Err(io::ErrorKind::ConnectionRefused.into()) })
    }
}

/// Answers like a proxy on every address but the ones listed as down.
struct Answering(Vec<IpAddr>);

impl Dialer for Answering {
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn ProbeStream>>> {
        let down = self.0.contains(&addr.ip());
        Box::pin(async move {
            if down {
                return Err(io::ErrorKind::ConnectionRefused.into());
            }
            let (client, mut proxy) = tokio::io::duplex(1024);
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut head = [0u8; 256];
                let _ = proxy.read(&mut head).await;
                let _ = proxy
                    .write_all(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
                    .await;
            });
            Ok(Box::new(client) as Box<dyn ProbeStream>)
        })
    }
}

fn proxy(name: &str, ip: &str) -> Proxy {
    let mut p = Proxy::new(name, ProxySpec::default());
    p.metadata = ObjectMeta {
        name: Some(name.into()),
        namespace: Some("ns".into()),
        uid: Some(format!("uid-{name}")),
        ..Default::default()
    };
    p.status = Some(ProxyStatus {
        address: Some(ip.into()),
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: "Serving".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(jiff::Timestamp::UNIX_EPOCH),
        }],
        ..Default::default()
    });
    p
}

fn target(p: &Proxy) -> Target {
    Target {
        ready: true,
        uid: p.metadata.uid.clone().unwrap(),
        pool: PoolKey {
            namespace: "ns".into(),
            name: "pool".into(),
        },
        ip: p
            .status
            .as_ref()
            .unwrap()
            .address
            .as_ref()
            .unwrap()
            .parse()
            .unwrap(),
    }
}

#[tokio::test(start_paused = true)]
async fn every_proxy_failing_at_once_keeps_the_endpoints_and_one_failing_alone_leaves() {
    let proxies = [
        proxy("a", "192.0.2.1"),
        proxy("b", "192.0.2.2"),
        proxy("c", "192.0.2.3"),
    ];
    let targets: Vec<Target> = proxies.iter().map(target).collect();
    let board = Arc::new(LivenessBoard::default());
    let options = LivenessOptions::default();
    let listed_now = |board: &LivenessBoard| {
        let members: Vec<Member> = proxies.iter().map(|p| Member::of(p, board)).collect();
        listed(&members, 3128)
            .into_iter()
            .map(|l| l.endpoint.proxy)
            .collect::<Vec<_>>()
    };
    let up = Liveness::new(board.clone(), options.clone(), FleetMetrics::default())
        .with_dialer(Arc::new(Answering(vec![])));
    up.round(targets.clone()).await;
    assert_eq!(listed_now(&board), ["a", "b", "c"]);

    // The operator's path is cut: every probe fails, round after round.
    let cut = Liveness::new(board.clone(), options.clone(), FleetMetrics::default())
        .with_dialer(Arc::new(Refusing));
    for _ in 0..5 {
        let r = cut.round(targets.clone()).await;
        assert!(r.held);
        assert_eq!(listed_now(&board), ["a", "b", "c"], "F3: never emptied");
        tokio::time::sleep(options.period).await;
    }
    assert!(board.held());

    // One proxy really stops: it leaves after the threshold, the others stay.
    let b_down = Liveness::new(board.clone(), options.clone(), FleetMetrics::default())
        .with_dialer(Arc::new(Answering(vec!["192.0.2.2".parse().unwrap()])));
    let started = Instant::now();
    let mut rounds = 0;
    while listed_now(&board).len() == 3 {
        b_down.round(targets.clone()).await;
        rounds += 1;
        assert!(rounds < 10, "b never left");
        tokio::time::sleep(options.period).await;
    }
    assert!(!board.held());
    assert_eq!(listed_now(&board), ["a", "c"]);
    assert_eq!(rounds, usize::try_from(options.failure_threshold).unwrap());
    // Paused time: one period per round, so the removal took threshold periods.
    assert!(started.elapsed() <= options.period * options.failure_threshold);

    // It answers again: back after one round.
    up.round(targets.clone()).await;
    assert_eq!(listed_now(&board), ["a", "b", "c"]);
}
