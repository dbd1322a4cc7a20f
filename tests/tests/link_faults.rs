//! Faults of the connection layer under load, against real daemons: OpenSSH's sshd on
//! 127.0.0.1 (sometimes behind a relay this test can freeze) and an isolated libvirtd.
//!
//! Each test counts what matters (sshd's accepted connections, dials and evictions by
//! cause, fds, threads and tokio tasks after the fault) rather than timing anything; the
//! only clocks are generous hang guards.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use egress_operator::Classified as _;
use egress_operator::config::{HostConfig, LibvirtDriver, SshConfig, ValidConfig};
use egress_operator::error::ErrorClass;
use egress_operator::provider::kvm2::check::check_host;
use egress_operator::provider::kvm2::hosts::{HostError, Hosts};
use egress_operator::provider::kvm2::libvirt::{BlockingPool, Lane, PoolLimits};
use egress_operator::provider::kvm2::observe::CallMetrics;
use egress_operator::provider::kvm2::ops::{HostOps as _, LibvirtOps};
use integration_tests::harness::{self, Libvirtd, Need, Sshd};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// A hang fails the test instead of blocking CI; never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(90);
/// Deadline of calls that must succeed.
const CALL_DEADLINE: Duration = Duration::from_secs(20);
/// Deadline of calls meant to give up: short, so the fault shows at once.
const SHORT_DEADLINE: Duration = Duration::from_millis(300);
/// Slack for the fd and thread counts: tokio keeps idle blocking threads for a while and
/// a closing libvirt connection holds its fd until its blocking close has run.
const FD_SLACK: usize = 8;
const THREAD_SLACK: usize = 6;

/// Serialises these tests: they count sshd logins, fds and threads of the process.
static SERIAL: Mutex<()> = Mutex::new(());

fn run<F: Future>(f: F) -> F::Output {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(f)
}

async fn guard<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, f)
        .await
        .expect("hang guard: the call did not finish")
}

fn daemons() -> Option<(Sshd, Libvirtd)> {
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return None;
    }
    Some((Sshd::start().unwrap(), Libvirtd::start().unwrap()))
}

fn config(sshd: &Sshd, libvirtd: &Libvirtd) -> ValidConfig {
    integration_tests::harness_config(sshd, libvirtd, LibvirtDriver::Test, "h1", &sshd.address())
        .unwrap()
}

fn table(ssh: &SshConfig, host: &HostConfig, limits: PoolLimits) -> (Arc<Hosts>, Arc<CallMetrics>) {
    let metrics = Arc::new(CallMetrics::unregistered());
    let hosts = Hosts::new(
        ssh,
        std::slice::from_ref(host),
        BlockingPool::with_limits(limits),
        metrics.clone(),
    )
    .unwrap()
    .with_call_deadline(CALL_DEADLINE);
    (Arc::new(hosts), metrics)
}

/// [`table`] whose missing libvirt socket turns permanent after `patience`.
fn table_with_patience(
    ssh: &SshConfig,
    host: &HostConfig,
    patience: Duration,
) -> (Arc<Hosts>, Arc<CallMetrics>) {
    let metrics = Arc::new(CallMetrics::unregistered());
    let hosts = Hosts::new(
        ssh,
        std::slice::from_ref(host),
        BlockingPool::with_limits(small_pool()),
        metrics.clone(),
    )
    .unwrap()
    .with_call_deadline(CALL_DEADLINE)
    .with_socket_patience(patience);
    (Arc::new(hosts), metrics)
}

fn small_pool() -> PoolLimits {
    PoolLimits {
        calls_per_host: 2,
        transfers_per_host: 1,
        total: 64,
    }
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).unwrap().count()
}

/// What the process holds now: fds and threads.
fn resources() -> (usize, usize) {
    (count_dir("/proc/self/fd"), count_dir("/proc/self/task"))
}

/// Waits (within the hang guard) until the fds and threads are back near `before` and
/// every tokio task but the caller's is gone: nothing a fault path made is left behind.
async fn assert_nothing_left(before: (usize, usize), what: &str) {
    let handle = tokio::runtime::Handle::current();
    let settled = tokio::time::timeout(HANG_GUARD, async {
        loop {
            let (fds, threads) = resources();
            let tasks = handle.metrics().num_alive_tasks();
            if fds <= before.0 + FD_SLACK && threads <= before.1 + THREAD_SLACK && tasks == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let (fds, threads) = resources();
    assert!(
        settled.is_ok(),
        "{what}: leaked: fds {} -> {fds}, threads {} -> {threads}, tasks alive {}",
        before.0,
        before.1,
        handle.metrics().num_alive_tasks()
    );
}

/// A call that holds its pool slot (and its libvirt connection) until `release` fires,
/// then proves the link still works with a real libvirt call.
fn held_call(
    hosts: &Arc<Hosts>,
    lane: Lane,
    op: &'static str,
) -> (
    mpsc::Sender<()>,
    tokio::task::JoinHandle<Result<String, HostError>>,
) {
    let (tx, rx) = mpsc::channel::<()>();
    let rx = Arc::new(Mutex::new(rx));
    let h = hosts.clone();
    let task = tokio::spawn(async move {
        h.call_in("h1", lane, op, HANG_GUARD * 2, move |c| {
            let _ = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
            c.get_hostname()
        })
        .await
    });
    (tx, task)
}

async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    guard(async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let _ = what;
}

#[test]
fn a_held_pool_slot_is_busy_and_costs_no_redial() {
    let Some((sshd, libvirtd)) = daemons() else {
        return;
    };
    let config = config(&sshd, &libvirtd);
    run(async {
        let (hosts, metrics) = table(&config.kvm2.ssh, &config.kvm2.hosts[0], small_pool());
        guard(hosts.call("h1", "warm", |c| c.get_lib_version()))
            .await
            .unwrap();
        let before = resources();
        let accepted = sshd.accepted_connections();

        // Both ordinary slots held by calls in flight.
        let holders = [
            held_call(&hosts, Lane::Call, "hold-1"),
            held_call(&hosts, Lane::Call, "hold-2"),
        ];
        let pool = hosts.pool("h1").unwrap().clone();
        wait_until("slots held", || pool.available_in(Lane::Call) == 0).await;

        // Twenty short calls find no slot: `busy`, transient, and the link stays.
        let short: Vec<_> = (0..20)
            .map(|_| {
                let h = hosts.clone();
                tokio::spawn(async move {
                    h.call_within("h1", "short", SHORT_DEADLINE, |c| c.get_hostname())
                        .await
                })
            })
            .collect();
        for s in short {
            let e = guard(s).await.unwrap().unwrap_err();
            assert_eq!(e.reason_code(), "busy", "{e}");
            assert_eq!(e.class(), ErrorClass::Transient, "{e}");
        }
        for (tx, task) in holders {
            tx.send(()).unwrap();
            guard(task)
                .await
                .unwrap()
                .expect("the held call finishes on the same link");
        }
        guard(hosts.call("h1", "after", |c| c.get_hostname()))
            .await
            .unwrap();

        assert_eq!(
            sshd.accepted_connections() - accepted,
            0,
            "a full pool must not cost a redial"
        );
        assert_eq!(metrics.dials("h1", None), 1, "one dial in all");
        for cause in ["closed", "transport", "probe"] {
            assert_eq!(metrics.evictions("h1", cause), 0, "evicted for {cause}");
        }
        hosts.close().await;
        drop(hosts);
        assert_nothing_left(before, "after busy calls").await;
    });
}

#[test]
fn a_timed_out_call_does_not_kill_a_concurrent_long_call() {
    let Some((sshd, libvirtd)) = daemons() else {
        return;
    };
    let config = config(&sshd, &libvirtd);
    run(async {
        let (hosts, metrics) = table(&config.kvm2.ssh, &config.kvm2.hosts[0], small_pool());
        guard(hosts.call("h1", "warm", |c| c.get_lib_version()))
            .await
            .unwrap();
        let before = resources();
        let accepted = sshd.accepted_connections();

        // A long transfer in flight on the shared link...
        let (release, upload) = held_call(&hosts, Lane::Transfer, "long-transfer");
        let pool = hosts.pool("h1").unwrap().clone();
        wait_until("transfer running", || {
            pool.available_in(Lane::Transfer) == 0
        })
        .await;
        // ...while a slow call times out on the same link.
        let slow = guard(hosts.call_within("h1", "slow", SHORT_DEADLINE, |c| {
            std::thread::sleep(Duration::from_secs(2));
            c.get_hostname()
        }))
        .await
        .unwrap_err();
        assert_eq!(slow.reason_code(), "timeout", "{slow}");
        // The timeout made the table probe the link, which answered: it stays.
        wait_until("the probe ran", || {
            metrics.probes("h1", true) + metrics.probes("h1", false) > 0
        })
        .await;
        assert_eq!(
            metrics.probes("h1", true),
            1,
            "the live link passed its probe"
        );
        release.send(()).unwrap();
        guard(upload)
            .await
            .unwrap()
            .expect("the long call survives another call's timeout");
        guard(hosts.call("h1", "after", |c| c.get_hostname()))
            .await
            .unwrap();
        assert_eq!(sshd.accepted_connections() - accepted, 0, "no redial");
        assert_eq!(metrics.evictions("h1", "probe"), 0);
        hosts.close().await;
        drop(hosts);
        assert_nothing_left(before, "after a timeout").await;
    });
}

#[test]
fn fifty_calls_against_a_wrong_host_key_share_a_dial_and_its_permanent_reason() {
    let Some((sshd, libvirtd)) = daemons() else {
        return;
    };
    let config = config(&sshd, &libvirtd);
    let mut ssh = config.kvm2.ssh.clone();
    ssh.known_hosts_file = sshd.wrong_known_hosts().unwrap().display().to_string();
    run(async {
        let before = resources();
        let connections = sshd.tcp_connections();
        let (hosts, metrics) = table(&ssh, &config.kvm2.hosts[0], small_pool());
        let calls: Vec<_> = (0..50)
            .map(|_| {
                let h = hosts.clone();
                tokio::spawn(async move { h.call("h1", "version", |c| c.get_lib_version()).await })
            })
            .collect();
        for c in calls {
            let e = guard(c).await.unwrap().unwrap_err();
            assert_eq!(e.reason_code(), "host-key", "{e}");
            assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
            assert_eq!(e.stage(), Some("ssh-handshake"), "{e}");
        }
        let dials = metrics.dials("h1", Some("host-key"));
        // sshd may log the last connection a moment after our side gave up on it.
        wait_until("sshd logged the dials", || {
            sshd.tcp_connections() > connections
        })
        .await;
        let seen = sshd.tcp_connections() - connections;
        assert!(
            (1..=3).contains(&dials) && (1..=3).contains(&seen),
            "50 callers must share dials: {dials} dials, {seen} connections at sshd"
        );
        hosts.close().await;
        drop(hosts);
        assert_nothing_left(before, "after refused dials").await;
    });
}

/// How long the tests below let a socket that never answered be asked again.
const PATIENCE: Duration = Duration::from_millis(800);

/// A call after [`PATIENCE`] (and the dial backoff) ran out.
async fn after_patience() {
    tokio::time::sleep(PATIENCE + Duration::from_millis(400)).await;
}

#[test]
fn a_wrong_socket_path_and_forbidden_forwarding_are_reported_and_permanent() {
    let Some((mut sshd, libvirtd)) = daemons() else {
        return;
    };
    let config = config(&sshd, &libvirtd);
    let mut host = config.kvm2.hosts[0].clone();
    host.libvirt_socket = "/nonexistent/libvirt-sock".into();
    run(async {
        let before = resources();
        let (hosts, _) = table_with_patience(&config.kvm2.ssh, &host, PATIENCE);
        // Refused, but never seen to answer: asked again before it is called permanent.
        let e = guard(hosts.call("h1", "version", |c| c.get_lib_version()))
            .await
            .unwrap_err();
        assert_eq!(
            (e.reason_code(), e.class(), e.stage()),
            ("libvirt-socket", ErrorClass::Transient, Some("channel")),
            "{e}"
        );
        after_patience().await;
        let e = guard(hosts.call("h1", "version", |c| c.get_lib_version()))
            .await
            .unwrap_err();
        assert_eq!(
            (e.reason_code(), e.class(), e.stage()),
            ("libvirt-socket", ErrorClass::Permanent, Some("channel")),
            "{e}"
        );
        assert!(e.to_string().contains("/nonexistent/libvirt-sock"), "{e}");
        // `check` says the same, on its own connection.
        let report = guard(check_host(
            &config.kvm2.ssh,
            &host,
            &[],
            &BlockingPool::default(),
            CALL_DEADLINE,
        ))
        .await;
        assert_eq!(
            report.reason.as_deref(),
            Some("libvirt-socket"),
            "{report:?}"
        );
        assert_eq!(report.stage.as_deref(), Some("channel"), "{report:?}");
        assert!(report.reachable, "SSH itself worked: {report:?}");
        hosts.close().await;
        drop(hosts);
        assert_nothing_left(before, "after a refused channel").await;
    });

    // sshd forbids streamlocal forwarding: an admin must change the host.
    sshd.set_streamlocal_forwarding(false).unwrap();
    let config = self::config(&sshd, &libvirtd);
    run(async {
        let (hosts, _) = table_with_patience(&config.kvm2.ssh, &config.kvm2.hosts[0], PATIENCE);
        let _ = guard(hosts.call("h1", "version", |c| c.get_lib_version())).await;
        after_patience().await;
        let e = guard(hosts.call("h1", "version", |c| c.get_lib_version()))
            .await
            .unwrap_err();
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        assert_eq!(e.stage(), Some("channel"), "{e}");
        // OpenSSH answers "connect failed" here too, as for a missing socket (only
        // "administratively prohibited" would give `forwarding-disabled`): the reason
        // stays `libvirt-socket` and the message names the sshd settings to check.
        assert_eq!(e.reason_code(), "libvirt-socket", "{e}");
        assert!(e.to_string().contains("AllowStreamLocalForwarding"), "{e}");
        hosts.close().await;
    });
}

/// Issue 19, finding 4: a host rebooted and sshd came up before libvirtd, seen by a
/// fresh operator (a new table that never saw the socket answer). The missing socket is
/// transient, and the first dial after the socket appears works.
#[test]
fn a_fresh_table_waits_for_a_libvirt_socket_that_appears_late() {
    let Some((sshd, libvirtd)) = daemons() else {
        return;
    };
    let config = config(&sshd, &libvirtd);
    let dir = tempfile::tempdir().unwrap();
    let late = dir.path().join("libvirt-sock");
    let mut host = config.kvm2.hosts[0].clone();
    host.libvirt_socket = late.to_string_lossy().into_owned();
    run(async {
        // The default patience: what a fresh operator does.
        let metrics = Arc::new(CallMetrics::unregistered());
        let hosts = Hosts::new(
            &config.kvm2.ssh,
            std::slice::from_ref(&host),
            BlockingPool::with_limits(small_pool()),
            metrics,
        )
        .unwrap()
        .with_call_deadline(CALL_DEADLINE);
        for _ in 0..3 {
            let e = guard(hosts.call("h1", "version", |c| c.get_lib_version()))
                .await
                .unwrap_err();
            assert_eq!(
                (e.reason_code(), e.class()),
                ("libvirt-socket", ErrorClass::Transient),
                "libvirtd may still be starting: {e}"
            );
            assert!(e.to_string().contains("may still be starting"), "{e}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        // libvirtd is up.
        std::os::unix::fs::symlink(libvirtd.socket_path(), &late).unwrap();
        let mut answered = None;
        for _ in 0..50 {
            match guard(hosts.call("h1", "version", |c| c.get_lib_version())).await {
                Ok(v) => {
                    answered = Some(v);
                    break;
                }
                Err(e) => {
                    assert_eq!(e.class(), ErrorClass::Transient, "{e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        assert!(answered.is_some(), "the socket answered once it was there");
        hosts.close().await;
    });
}

#[test]
fn a_health_probe_dials_its_own_connection_when_the_pool_is_full() {
    let Some((sshd, libvirtd)) = daemons() else {
        return;
    };
    libvirtd.define_dir_pool("default").unwrap();
    let config = integration_tests::harness_config(
        &sshd,
        &libvirtd,
        LibvirtDriver::Qemu,
        "h1",
        &sshd.address(),
    )
    .unwrap();
    run(async {
        let (hosts, _) = table(&config.kvm2.ssh, &config.kvm2.hosts[0], small_pool());
        guard(hosts.call("h1", "warm", |c| c.get_lib_version()))
            .await
            .unwrap();
        let before = resources();
        let holders = [
            held_call(&hosts, Lane::Call, "hold-1"),
            held_call(&hosts, Lane::Call, "hold-2"),
        ];
        let pool = hosts.pool("h1").unwrap().clone();
        wait_until("slots held", || pool.available_in(Lane::Call) == 0).await;
        let accepted = sshd.accepted_connections();
        let ops = LibvirtOps::new(hosts.clone());
        let space = guard(ops.health_probe("h1", "default", CALL_DEADLINE))
            .await
            .expect("the probe does not wait for the host's full pool");
        assert!(space.capacity > 0, "{space:?}");
        assert_eq!(
            sshd.accepted_connections() - accepted,
            1,
            "one dedicated connection per probe"
        );
        for (tx, task) in holders {
            tx.send(()).unwrap();
            guard(task).await.unwrap().unwrap();
        }
        hosts.close().await;
        drop((hosts, ops));
        assert_nothing_left(before, "after a dedicated probe").await;
    });
}

/// A TCP relay to `upstream` that can be frozen: while frozen it neither reads nor writes,
/// but keeps both sockets open, like a middlebox that lost its state or a peer whose
/// kernel still holds the connection while nothing gets through.
struct Relay {
    addr: SocketAddr,
    frozen: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let f = frozen.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((down, _)) = listener.accept().await else {
                    return;
                };
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                conns.spawn(pump(dr, uw, f.clone()));
                conns.spawn(pump(ur, dw, f.clone()));
            }
        });
        Self { addr, frozen, task }
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` until either closes; while frozen, stops moving bytes and holds
/// both ends open forever.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if frozen.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let n = match tokio::time::timeout(Duration::from_millis(50), from.read(&mut buf)).await {
            Err(_) => continue,
            Ok(Ok(0) | Err(_)) => return,
            Ok(Ok(n)) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[test]
fn a_frozen_link_with_a_call_in_flight_is_noticed_and_close_is_prompt() {
    let Some((sshd, libvirtd)) = daemons() else {
        return;
    };
    let config = config(&sshd, &libvirtd);
    let (mut ssh, mut host) = (config.kvm2.ssh.clone(), config.kvm2.hosts[0].clone());
    run(async {
        let before = resources();
        let relay = Relay::start(sshd.address().parse().unwrap()).await;
        // The relay has its own port: the known_hosts line names it.
        let known = sshd.dir().join("relay_known_hosts");
        std::fs::write(
            &known,
            format!(
                "[127.0.0.1]:{} {}\n",
                relay.addr.port(),
                sshd.host_public_key()
            ),
        )
        .unwrap();
        ssh.known_hosts_file = known.display().to_string();
        host.address = relay.addr.to_string();
        let bound = Duration::from_secs(u64::from(
            ssh.keepalive_interval_seconds * (ssh.keepalive_max_missed + 1),
        ));
        let (hosts, metrics) = table(&ssh, &host, small_pool());
        guard(hosts.call("h1", "warm", |c| c.get_lib_version()))
            .await
            .unwrap();

        relay.freeze();
        // A call whose own deadline is far away: only noticing the dead link ends it.
        let started = std::time::Instant::now();
        let in_flight =
            guard(hosts.call_within("h1", "in-flight", HANG_GUARD * 10, |c| c.get_hostname()))
                .await
                .unwrap_err();
        eprintln!(
            "frozen link noticed after {:?} (bound {bound:?}): {in_flight}",
            started.elapsed()
        );
        assert_eq!(in_flight.class(), ErrorClass::Transient, "{in_flight}");
        wait_until("the dead link is dropped", || {
            metrics.evictions("h1", "transport") + metrics.evictions("h1", "closed") > 0
        })
        .await;

        // Closing with the relay still frozen returns promptly (bounded disconnect).
        tokio::time::timeout(Duration::from_secs(20), hosts.close())
            .await
            .expect("close() must not wait on a frozen peer");
        drop(hosts);
        drop(relay);
        assert_nothing_left(before, "after a frozen link").await;
    });
}
