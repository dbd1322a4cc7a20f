//! The SSH layer against the real daemons the harness starts: OpenSSH's sshd on
//! 127.0.0.1 and an isolated libvirtd. libvirt is reached only through our tunnel.
//!
//! The tests run one at a time (a process-wide lock taken before each builds its
//! runtime), so the leak test's counts of `/proc/self/fd` and `/proc/self/task` see no
//! other test's sockets or threads.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::future::Future;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use egress_operator::Classified as _;
use egress_operator::config::LibvirtDriver;
use egress_operator::provider::kvm2::ssh::{self, SshSession, SshTarget};
use egress_operator::provider::kvm2::tunnel::Tunnel;
use integration_tests::harness::{self, Libvirtd, Need, Sshd};
use russh::keys::{HashAlg, PublicKey};

/// Generous guard around calls that should take a second or two: a hang fails the
/// test instead of blocking CI; it is not a performance assertion.
const HANG_GUARD: Duration = Duration::from_secs(30);

/// Dial/close cycles of the leak test (the number deliverable 8 of issue 4 names).
const LEAK_CYCLES: usize = 500;

/// Slack for the leak counts: tokio's blocking pool (used by tokio::fs) may keep a
/// thread or two, and the runtime's driver may hold an fd it opened lazily. A leak of
/// one fd or thread per cycle would show as hundreds.
const FD_SLACK: usize = 8;
const THREAD_SLACK: usize = 4;

/// Serialises the tests of this file (see the module docs).
static SERIAL: Mutex<()> = Mutex::new(());

fn run<F: Future>(f: F) -> F::Output {
    let _serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let out = rt.block_on(f);
    drop(rt);
    out
}

async fn guard<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, f)
        .await
        .expect("hang guard: the call did not finish")
}

fn target(sshd: &Sshd) -> SshTarget {
    SshTarget {
        host: "127.0.0.1".into(),
        port: sshd.port(),
        user: sshd.user().into(),
        private_key_file: sshd.client_key(),
        known_hosts_file: sshd.known_hosts(),
        insecure_ignore_host_key: false,
        connect_timeout: Duration::from_secs(10),
        keepalive_interval: Duration::from_secs(15),
        keepalive_max_missed: 3,
    }
}

fn host_fingerprint(sshd: &Sshd) -> String {
    PublicKey::from_openssh(sshd.host_public_key())
        .unwrap()
        .fingerprint(HashAlg::Sha256)
        .to_string()
}

/// Runs virsh (a blocking child process) off the async threads.
async fn virsh(libvirtd: &Arc<Libvirtd>, uri: String, args: &'static [&'static str]) -> String {
    let l = Arc::clone(libvirtd);
    guard(tokio::task::spawn_blocking(move || l.virsh(&uri, args)))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("virsh failed: {e:#}"))
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).unwrap().count()
}

#[test]
fn libvirt_round_trip_through_the_tunnel() {
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return;
    }
    run(async {
        let sshd = Sshd::start().unwrap();
        let libvirtd = Arc::new(Libvirtd::start().unwrap());
        let session = Arc::new(guard(ssh::connect(&target(&sshd))).await.unwrap());
        let tunnel = Tunnel::start(
            Arc::clone(&session),
            libvirtd.socket_path().display().to_string(),
        )
        .await
        .unwrap();

        // libvirt's test driver: the daemon and its RPC, no QEMU.
        let out = virsh(
            &libvirtd,
            tunnel.libvirt_uri(LibvirtDriver::Test),
            &["list", "--all"],
        )
        .await;
        assert!(
            out.contains("test"),
            "test driver lists its default domain: {out}"
        );
        // The QEMU driver through the same tunnel.
        let out = virsh(&libvirtd, tunnel.libvirt_uri(LibvirtDriver::Qemu), &["uri"]).await;
        assert!(out.contains("qemu"), "{out}");
        let out = virsh(
            &libvirtd,
            tunnel.libvirt_uri(LibvirtDriver::Qemu),
            &["version"],
        )
        .await;
        assert!(out.contains("Running hypervisor: QEMU"), "{out}");

        // Every virsh run was a connection through our one SSH session.
        assert_eq!(sshd.accepted_connections(), 1, "{}", sshd.log());
        let dir = tunnel.local_socket_path().parent().unwrap().to_path_buf();
        guard(tunnel.close()).await;
        assert!(!dir.exists());
        guard(session.close()).await;
        assert!(session.is_closed());
    });
}

#[test]
fn wrong_host_key_is_refused() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    run(async {
        let sshd = Sshd::start().unwrap();
        let mut t = target(&sshd);
        t.known_hosts_file = sshd.wrong_known_hosts().unwrap();
        let e = guard(ssh::connect(&t)).await.unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.reason_code(), "host-key", "{msg}");
        assert!(msg.contains(&host_fingerprint(&sshd)), "{msg}");
        assert!(
            msg.contains(&t.known_hosts_file.display().to_string()),
            "{msg}"
        );
        assert!(msg.contains("MISMATCH"), "{msg}");
        assert_eq!(sshd.accepted_connections(), 0);
    });
}

#[test]
fn unknown_host_is_refused() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    run(async {
        let sshd = Sshd::start().unwrap();
        let mut t = target(&sshd);
        // The right key, recorded for another address only.
        t.known_hosts_file = sshd.dir().join("known_hosts_other_host");
        std::fs::write(
            &t.known_hosts_file,
            format!("[127.0.0.2]:{} {}\n", sshd.port(), sshd.host_public_key()),
        )
        .unwrap();
        let e = guard(ssh::connect(&t)).await.unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.reason_code(), "host-key", "{msg}");
        assert!(msg.contains("no entry"), "{msg}");
        assert!(msg.contains(&host_fingerprint(&sshd)), "{msg}");
    });
}

#[test]
fn unauthorized_key_is_an_auth_failure() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    run(async {
        let sshd = Sshd::start().unwrap();
        let mut t = target(&sshd);
        t.private_key_file = sshd.unauthorized_client_key().unwrap();
        let e = guard(ssh::connect(&t)).await.unwrap_err();
        assert_eq!(e.reason_code(), "auth", "{e}");
        assert_eq!(e.class(), egress_operator::ErrorClass::Permanent);
    });
}

#[test]
fn key_file_with_open_permissions_is_refused() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    run(async {
        let sshd = Sshd::start().unwrap();
        let mut t = target(&sshd);
        let open = sshd.dir().join("client_key_0644");
        std::fs::copy(sshd.client_key(), &open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        t.private_key_file = open.clone();
        let e = guard(ssh::connect(&t)).await.unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.reason_code(), "key-file", "{msg}");
        assert!(
            msg.contains(&open.display().to_string()) && msg.contains("0644"),
            "{msg}"
        );
        assert_eq!(sshd.accepted_connections(), 0);
    });
}

/// One full cycle: dial, a channel to libvirt, a tunnel with one local connection,
/// then close everything.
async fn cycle(t: &SshTarget, libvirt_socket: &Path) {
    let session: Arc<SshSession> = Arc::new(guard(ssh::connect(t)).await.unwrap());
    let ch = guard(session.open_streamlocal(&libvirt_socket.display().to_string()))
        .await
        .unwrap();
    drop(ch);
    let tunnel = Tunnel::start(Arc::clone(&session), libvirt_socket.display().to_string())
        .await
        .unwrap();
    let local = guard(tokio::net::UnixStream::connect(tunnel.local_socket_path()))
        .await
        .unwrap();
    guard(tunnel.close()).await;
    drop(local);
    guard(session.close()).await;
    assert!(session.is_closed());
}

#[test]
fn dial_close_cycles_leak_no_fds_or_threads() {
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return;
    }
    run(async {
        let sshd = Sshd::start().unwrap();
        let libvirtd = Libvirtd::start().unwrap();
        let t = target(&sshd);
        let socket = libvirtd.socket_path();
        // Warm up: lazily created runtime resources (blocking-pool threads, the
        // signal/timer drivers) are not leaks.
        for _ in 0..5 {
            cycle(&t, &socket).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (fds, threads) = (count_dir("/proc/self/fd"), count_dir("/proc/self/task"));
        for _ in 0..LEAK_CYCLES {
            cycle(&t, &socket).await;
        }
        // Give russh's and the tunnel's tasks a moment to be dropped by the runtime.
        let deadline = tokio::time::Instant::now() + HANG_GUARD;
        loop {
            let (f, th) = (count_dir("/proc/self/fd"), count_dir("/proc/self/task"));
            if f <= fds + FD_SLACK && th <= threads + THREAD_SLACK {
                eprintln!("{LEAK_CYCLES} cycles: fds {fds} -> {f}, threads {threads} -> {th}");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "leak after {LEAK_CYCLES} cycles: fds {fds} -> {f}, threads {threads} -> {th}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(sshd.accepted_connections(), LEAK_CYCLES + 5);
    });
}
