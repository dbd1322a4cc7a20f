//! `make bench`, transport: libvirt calls through our SSH tunnel against their peers, each
//! printed as a median with the ratio that matters, all measured in the same run against
//! the harness's own daemons (OpenSSH's sshd on 127.0.0.1, an isolated libvirtd in a
//! network namespace), for libvirt's test driver and its QEMU driver.
//!
//! - Steady-state round trip of `get_lib_version` (an RPC the daemon answers without
//!   touching a driver's state, so the transport dominates) on a warmed connection: our
//!   tunnel vs the daemon's unix socket directly vs libvirt's own `+ssh://` transport
//!   (the OpenSSH client, `nc -U` on the far side). Measured through the library's call
//!   wrapper (`LibvirtConn::call`: blocking pool and deadline), through `Hosts::call` (the
//!   production path: link lookup, metrics, tracing), and as bare `virt` calls on one
//!   thread (the transport alone). The peer that matters is libvirt's own `+ssh://`
//!   (the former target, within 1.3x of the direct socket, was retired for that
//!   comparison; the ratio to the direct socket is printed as a plain figure). A fourth peer is the floor under any
//!   tunnel: one plain relay hop (socat between two unix sockets, no encryption, no SSH),
//!   so the ratio of a single extra process hop is printed next to ours, which crosses
//!   two (this process and sshd) and encrypts.
//! - Time to a first successful call (SSH dial, handshake and login, libvirt open, one
//!   call): ours (`HostLink::dial`) vs `+ssh://` (`LibvirtConn::open`). Target: ours faster.
//!   Every `+ssh://` dial runs a command, so the host starts the login user's shell; the
//!   bench measures that start-up too and prints the ratio without it, so a build
//!   machine's heavy `~/.bashrc` does not flatter us.
//!
//! Peers take turns (rounds of calls, one dial each per run), so load from elsewhere on
//! the machine falls on all of them alike. Nothing here leaves 127.0.0.1 and the
//! harness's namespace; the daemons stop when the bench ends. Under `cargo test --benches`
//! (part of `make test`) every step runs with a handful of calls, so a broken bench fails
//! CI.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a bench fails loudly

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_operator::config::{LibvirtDriver, ValidConfig};
use egress_operator::provider::kvm2::hosts::{HostLink, Hosts};
use egress_operator::provider::kvm2::libvirt::{BlockingPool, LibvirtConn};
use egress_operator::provider::kvm2::observe::CallMetrics;
use egress_operator::provider::kvm2::ssh::SshTarget;
use integration_tests::bench;
use integration_tests::harness::{self, Libvirtd, Need, Sshd};

/// Deadline of every call and dial here: far above anything on loopback, so only a hang
/// trips it (and fails the bench loudly); it is not a timing limit.
const CALL_DEADLINE: Duration = Duration::from_secs(30);
/// Calls per transport before sampling: the first calls pay for things made lazily
/// (blocking-pool threads, the daemon's per-client state, CPU clocks ramping up). Each
/// count is (full run, quick run).
const WARMUP_CALLS: (usize, usize) = (50, 2);
/// Rounds x calls per round = samples per transport (500); every transport takes its
/// turn in each round.
const ROUNDS: (usize, usize) = (5, 1);
const CALLS_PER_ROUND: (usize, usize) = (100, 5);
/// Fresh connections per transport for the time to a first call: each is a full SSH
/// login (tens of milliseconds), so 15 give a stable median in a few seconds.
const FIRST_CALL_RUNS: (usize, usize) = (15, 1);
/// Runs of the login shell's start-up measurement (a few ms to a few hundred each).
const SHELL_RUNS: (usize, usize) = (5, 1);

fn count(n: (usize, usize)) -> usize {
    bench::pick(n.0, n.1)
}
/// What the bench needs besides the harness's daemons: `nc -U` is the far end of
/// libvirt's `+ssh://` transport (package netcat-openbsd, installed by `make setup`).
const NETCAT: &str = "nc";
/// The plain relay of the floor peer (package socat, installed by `make setup`).
const SOCAT: &str = "socat";

/// The drivers measured, each with the name of its host in the bench config.
const DRIVERS: [(LibvirtDriver, &str); 2] = [
    (LibvirtDriver::Test, "bench-test"),
    (LibvirtDriver::Qemu, "bench-qemu"),
];

fn main() {
    let reason = harness::skip_reason(&[Need::Sshd, Need::Libvirtd]).or_else(|| {
        [NETCAT, SOCAT]
            .into_iter()
            .find(|b| !on_path(b))
            .map(|b| format!("missing binary: {b} (run `make setup` as root)"))
    });
    if let Some(reason) = reason {
        // Fails in CI and as root, as a test's skip does; elsewhere prints `SKIPPED:`.
        harness::cannot_run(&format!("transport bench: {reason}"));
        return;
    }
    bench::announce("transport");
    let sshd = Sshd::start().unwrap();
    let libvirtd = Libvirtd::start().unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let ssh_command = write_ssh_command(scratch.path(), &sshd);

    let relay = Relay::start(scratch.path(), &libvirtd.socket_path());

    let shell = login_shell_start(sshd.user());
    println!(
        "login shell of {} (as sshd starts it for a command) median {:>7.1} ms ({} runs; every +ssh:// dial pays it, our tunnel does not)",
        sshd.user(),
        millis(shell),
        count(SHELL_RUNS)
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for (driver, host) in DRIVERS {
            let config = bench_config(&sshd, &libvirtd, driver, host);
            let direct = direct_uri(&libvirtd, driver);
            let uris = Uris {
                relay: direct.replace(
                    &libvirtd.socket_path().display().to_string(),
                    &relay.socket.display().to_string(),
                ),
                direct,
                ssh: ssh_uri(&sshd, &libvirtd, driver, &ssh_command),
            };
            round_trips(&config, driver, host, &uris).await;
            first_calls(&config, driver, host, &uris, shell).await;
        }
    });
    // Blocking closes queued by dropped connections finish before the daemons stop.
    drop(rt);
    drop(relay);
    drop(libvirtd);
    drop(sshd);
}

/// The peers' URIs for one driver.
struct Uris {
    /// The daemon's unix socket, no SSH.
    direct: String,
    /// libvirt's own SSH transport through OpenSSH.
    ssh: String,
    /// The daemon's socket through one plain relay hop (socat): the floor of any tunnel.
    relay: String,
}

/// `socat` relaying a unix socket of ours to the daemon's, one connection per client:
/// an extra process hop with nothing else (no encryption, no protocol).
struct Relay {
    child: std::process::Child,
    socket: PathBuf,
}

impl Relay {
    fn start(dir: &Path, target: &Path) -> Self {
        let socket = dir.join("relay.sock");
        let child = Command::new(SOCAT)
            .arg(format!("UNIX-LISTEN:{},fork", socket.display()))
            .arg(format!("UNIX-CONNECT:{}", target.display()))
            .spawn()
            .unwrap();
        let started = Instant::now();
        while !socket.exists() {
            assert!(started.elapsed() < CALL_DEADLINE, "socat did not listen");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { child, socket }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn driver_name(driver: LibvirtDriver) -> &'static str {
    match driver {
        LibvirtDriver::Test => "test",
        LibvirtDriver::Qemu => "qemu",
    }
}

fn direct_uri(libvirtd: &Libvirtd, driver: LibvirtDriver) -> String {
    match driver {
        LibvirtDriver::Test => libvirtd.test_uri(),
        LibvirtDriver::Qemu => libvirtd.qemu_uri(),
    }
}

/// libvirt's `+ssh://` URI for the harness's daemons. `netcat=` selects the `nc -U
/// SOCKET` proxy on the far side: the default proxy, virt-ssh-helper, finds the daemon's
/// socket from the driver name, not from `socket=`, and would reach the system daemon. `command=` is an OpenSSH wrapper that verifies the
/// host key against the harness's known_hosts (libvirt's `ssh` transport has no
/// known_hosts parameter); `no_tty=1` adds `-T -o BatchMode=yes -e none`.
fn ssh_uri(sshd: &Sshd, libvirtd: &Libvirtd, driver: LibvirtDriver, command: &Path) -> String {
    let path = match driver {
        LibvirtDriver::Test => "default",
        LibvirtDriver::Qemu => "system",
    };
    format!(
        "{scheme}+ssh://{user}@127.0.0.1:{port}/{path}?socket={socket}&keyfile={key}\
         &netcat={NETCAT}&no_tty=1&command={command}",
        scheme = driver_name(driver),
        user = sshd.user(),
        port = sshd.port(),
        socket = libvirtd.socket_path().display(),
        key = sshd.client_key().display(),
        command = command.display(),
    )
}

/// An `ssh` that reads no user config and trusts only the harness's known_hosts, as an
/// operator's `~/.ssh/config` entry would; `exec` keeps it to one extra exec per dial.
fn write_ssh_command(dir: &Path, sshd: &Sshd) -> PathBuf {
    let path = dir.join("ssh");
    let script = format!(
        "#!/bin/sh\n\
         exec ssh -F /dev/null -o IdentitiesOnly=yes -o IdentityAgent=none \
         -o StrictHostKeyChecking=yes -o UserKnownHostsFile='{known}' \
         -o GlobalKnownHostsFile=/dev/null \"$@\"\n",
        known = sshd.known_hosts().display()
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn on_path(binary: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {binary}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A providers config with one host, the harness's daemons behind `driver` (the config
/// refuses two hosts on one address, so each driver gets its own config).
fn bench_config(
    sshd: &Sshd,
    libvirtd: &Libvirtd,
    driver: LibvirtDriver,
    name: &str,
) -> ValidConfig {
    integration_tests::harness_config(sshd, libvirtd, driver, name, &sshd.address()).unwrap()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

fn verdict(met: bool) -> &'static str {
    bench::verdict(met)
}

/// One way of making the call, and its samples.
enum Via<'a> {
    /// The library's call wrapper: one blocking-pool task per call.
    Conn(&'a LibvirtConn),
    /// The production path: the hosts table's cached link.
    Hosts(&'a Hosts, &'static str),
    /// Bare `virt` calls back to back inside one blocking task, each timed there: the
    /// transport alone, without the hop to the blocking pool.
    Bare(&'a LibvirtConn),
}

impl Via<'_> {
    async fn sample(&self, n: usize) -> Vec<Duration> {
        let mut samples = Vec::with_capacity(n);
        match self {
            Via::Bare(conn) => {
                return conn
                    .call("version-batch", CALL_DEADLINE, move |c| {
                        (0..n)
                            .map(|_| {
                                let t = Instant::now();
                                std::hint::black_box(c.get_lib_version()?);
                                Ok(t.elapsed())
                            })
                            .collect()
                    })
                    .await
                    .unwrap();
            }
            Via::Conn(conn) => {
                for _ in 0..n {
                    let t = Instant::now();
                    conn.call("version", CALL_DEADLINE, |c| c.get_lib_version())
                        .await
                        .unwrap();
                    samples.push(t.elapsed());
                }
            }
            Via::Hosts(hosts, host) => {
                for _ in 0..n {
                    let t = Instant::now();
                    hosts
                        .call(host, "version", |c| c.get_lib_version())
                        .await
                        .unwrap();
                    samples.push(t.elapsed());
                }
            }
        }
        samples
    }
}

async fn round_trips(config: &ValidConfig, driver: LibvirtDriver, host: &'static str, uris: &Uris) {
    let name = driver_name(driver);
    let pool = BlockingPool::default();
    let hosts = Hosts::new(
        &config.kvm2.ssh,
        &config.kvm2.hosts,
        pool.clone(),
        Arc::new(CallMetrics::unregistered()),
    )
    .unwrap()
    .with_call_deadline(CALL_DEADLINE);
    hosts
        .call(host, "version", |c| c.get_lib_version())
        .await
        .unwrap();
    let link = hosts.link(host, CALL_DEADLINE).await.unwrap();
    let direct = LibvirtConn::open(&pool, &uris.direct, CALL_DEADLINE, None)
        .await
        .unwrap();
    let ssh = LibvirtConn::open(&pool, &uris.ssh, CALL_DEADLINE, None)
        .await
        .unwrap();
    let relay = LibvirtConn::open(&pool, &uris.relay, CALL_DEADLINE, None)
        .await
        .unwrap();

    let vias = [
        ("direct unix socket, LibvirtConn::call", Via::Conn(&direct)),
        (
            "our tunnel,         LibvirtConn::call",
            Via::Conn(link.conn()),
        ),
        (
            "our tunnel,         Hosts::call      ",
            Via::Hosts(&hosts, host),
        ),
        ("+ssh:// (OpenSSH),  LibvirtConn::call", Via::Conn(&ssh)),
        ("direct unix socket, bare virt call   ", Via::Bare(&direct)),
        (
            "our tunnel,         bare virt call   ",
            Via::Bare(link.conn()),
        ),
        ("+ssh:// (OpenSSH),  bare virt call   ", Via::Bare(&ssh)),
        ("plain relay (socat) LibvirtConn::call", Via::Conn(&relay)),
        ("plain relay (socat) bare virt call   ", Via::Bare(&relay)),
    ];
    for (_, via) in &vias {
        via.sample(count(WARMUP_CALLS)).await;
    }
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); vias.len()];
    for _ in 0..count(ROUNDS) {
        for ((_, via), s) in vias.iter().zip(&mut samples) {
            s.extend(via.sample(count(CALLS_PER_ROUND)).await);
        }
    }
    let medians: Vec<Duration> = samples.into_iter().map(median).collect();
    let calls = count(ROUNDS) * count(CALLS_PER_ROUND);
    for ((label, _), m) in vias.iter().zip(&medians) {
        println!(
            "round trip {name} {label} median {:>8.1} µs/call ({calls} calls)",
            micros(*m)
        );
    }
    let [
        conn_direct,
        conn_tunnel,
        hosts_tunnel,
        conn_ssh,
        bare_direct_m,
        bare_tunnel_m,
        bare_ssh_m,
        conn_relay,
        bare_relay_m,
    ] = medians[..]
    else {
        unreachable!("one median per way of calling")
    };
    println!(
        "ratio {name} tunnel Hosts::call / direct LibvirtConn::call     {:>5.2}x",
        ratio(hosts_tunnel, conn_direct)
    );
    println!(
        "ratio {name} tunnel / direct, both LibvirtConn::call           {:>5.2}x",
        ratio(conn_tunnel, conn_direct)
    );
    println!(
        "ratio {name} tunnel / direct, bare virt calls                  {:>5.2}x",
        ratio(bare_tunnel_m, bare_direct_m)
    );
    println!(
        "ratio {name} +ssh:// / direct, both LibvirtConn::call          {:>5.2}x",
        ratio(conn_ssh, conn_direct)
    );
    println!(
        "ratio {name} tunnel / +ssh://, both LibvirtConn::call          {:>5.2}x",
        ratio(conn_tunnel, conn_ssh)
    );
    println!(
        "ratio {name} tunnel / +ssh://, bare virt calls                 {:>5.2}x",
        ratio(bare_tunnel_m, bare_ssh_m)
    );

    println!(
        "ratio {name} one plain relay hop (socat) / direct, LibvirtConn  {:>5.2}x (the floor of one extra process hop; the tunnel crosses two and encrypts)",
        ratio(conn_relay, conn_direct)
    );
    println!(
        "ratio {name} one plain relay hop (socat) / direct, bare calls   {:>5.2}x",
        ratio(bare_relay_m, bare_direct_m)
    );

    // The connections close on blocking threads as they drop; the link closes with the
    // table.
    drop((direct, ssh, relay, link));
    hosts.close().await;
}

async fn first_calls(
    config: &ValidConfig,
    driver: LibvirtDriver,
    host: &'static str,
    uris: &Uris,
    shell: Duration,
) {
    let name = driver_name(driver);
    let pool = BlockingPool::default();
    let host = config.kvm2.hosts.iter().find(|h| h.name == host).unwrap();
    let target = SshTarget::from_config(&config.kvm2.ssh, host).unwrap();
    let (mut ours, mut ssh, mut direct) = (Vec::new(), Vec::new(), Vec::new());
    let runs = count(FIRST_CALL_RUNS);
    for _ in 0..runs {
        let t = Instant::now();
        let link = HostLink::dial(&target, host, &pool, CALL_DEADLINE)
            .await
            .unwrap();
        link.conn()
            .call("version", CALL_DEADLINE, |c| c.get_lib_version())
            .await
            .unwrap();
        ours.push(t.elapsed());
        link.close().await;
        drop(link);

        ssh.push(open_and_call(&pool, &uris.ssh).await);
        direct.push(open_and_call(&pool, &uris.direct).await);
    }
    let (ours, ssh, direct) = (median(ours), median(ssh), median(direct));
    println!(
        "first call {name} ours (HostLink::dial + call)          median {:>7.1} ms ({runs} runs)",
        millis(ours)
    );
    println!(
        "first call {name} +ssh:// (LibvirtConn::open + call)   median {:>7.1} ms ({runs} runs)",
        millis(ssh)
    );
    println!(
        "first call {name} direct unix socket (open + call)   median {:>7.1} ms ({runs} runs, no SSH)",
        millis(direct)
    );
    let r = ratio(ours, ssh);
    println!(
        "ratio {name} first call ours / +ssh://                         {r:>5.2}x (target < 1x, ours faster: {})",
        verdict(r < 1.0)
    );
    // The same comparison on a host whose login shell starts in no time.
    let lean = ssh.saturating_sub(shell);
    println!(
        "ratio {name} first call ours / (+ssh:// - login shell start)   {:>5.2}x (+ssh:// without the shell: {:.1} ms)",
        ratio(ours, lean),
        millis(lean)
    );
}

/// How long the login user's shell takes to run a command the way sshd starts it for
/// every `+ssh://` dial (bash reads `~/.bashrc` when `SSH_CLIENT` is set); our tunnel
/// runs no shell on the host. Measured because a build machine's root shell may do a lot
/// at start (pyenv, conda) where a libvirt host's rarely does, and that would flatter us.
fn login_shell_start(user: &str) -> Duration {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let entry: Vec<&str> = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() == 7 && f[0] == user)
        .unwrap_or_else(|| panic!("{user} is not in /etc/passwd"));
    let (home, shell) = (entry[5], entry[6]);
    let runs = (0..count(SHELL_RUNS))
        .map(|_| {
            let t = Instant::now();
            let status = Command::new(shell)
                .args(["-c", "true"])
                .env_clear()
                .env("HOME", home)
                .env("USER", user)
                .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                .env("SSH_CLIENT", "127.0.0.1 1 1")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .unwrap();
            assert!(status.success(), "{shell} -c true failed: {status}");
            t.elapsed()
        })
        .collect();
    median(runs)
}

/// Opens `uri` through the library's wrapper (on the blocking pool, as `HostLink::dial`
/// opens its connection), makes one call, and returns the time both took. The close runs
/// on a blocking thread when the connection drops, untimed.
async fn open_and_call(pool: &BlockingPool, uri: &str) -> Duration {
    let t = Instant::now();
    let conn = LibvirtConn::open(pool, uri, CALL_DEADLINE, None)
        .await
        .unwrap_or_else(|e| panic!("open {uri}: {e}"));
    conn.call("version", CALL_DEADLINE, |c| c.get_lib_version())
        .await
        .unwrap();
    t.elapsed()
}
