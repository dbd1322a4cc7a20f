//! The test harness against the real daemons: sshd accepts exactly the right
//! key and host, forwards unix sockets, survives stop/restart; libvirtd answers
//! through its socket, runs a QEMU domain on the isolated bridge, and everything
//! is gone after drop.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::io::{BufRead, BufReader};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use integration_tests::harness::{self, Libvirtd, Need, Sshd};

/// Bound for waits in these tests; generous for a machine that is compiling.
const WAIT: Duration = Duration::from_secs(30);

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).output().expect("command runs")
}

fn assert_ok(output: &Output, what: &str) -> String {
    assert!(
        output.status.success(),
        "{what} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(50));
    }
}

fn netns_exists(name: &str) -> bool {
    let out = assert_ok(
        &run(Command::new("ip").args(["netns", "list"])),
        "ip netns list",
    );
    out.lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !matches!(
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next()),
                Some("Z" | "X")
            )
        })
        .unwrap_or(false)
}

/// A process's `Cpus_allowed_list` (`pid` may be "self").
fn cpus_allowed(pid: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"));
    line.unwrap().trim().to_string()
}

/// Starts `ssh ... sleep 60` and returns once the remote command runs. Waiting
/// for the command, not just the login, matters: killing a session while the
/// login shell still reads root's ~/.bashrc can leave that shell's tools in a
/// bad state (a killed `pyenv rehash` left a lock that stalled later logins).
fn start_long_session(sshd: &Sshd) -> Child {
    let mut session = sshd
        .ssh_command()
        .arg("echo started; exec sleep 60")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(session.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "started");
    session
}

#[test]
fn ssh_with_the_right_key_and_host_runs_a_command() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    let sshd = Sshd::start().unwrap();
    assert_eq!(sshd.address(), format!("127.0.0.1:{}", sshd.port()));
    assert_eq!(sshd.user(), "root");
    assert!(sshd.host_public_key().starts_with("ssh-ed25519 "));
    let known_hosts = std::fs::read_to_string(sshd.known_hosts()).unwrap();
    assert_eq!(
        known_hosts.trim(),
        format!("[127.0.0.1]:{} {}", sshd.port(), sshd.host_public_key())
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(sshd.client_key())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    let out = run(sshd.ssh_command().arg("echo hello-from-sshd"));
    assert_eq!(assert_ok(&out, "ssh").trim(), "hello-from-sshd");
    assert_eq!(sshd.accepted_connections(), 1);
    assert_ok(&run(sshd.ssh_command().arg("true")), "second ssh");
    assert_eq!(sshd.accepted_connections(), 2);
}

#[test]
fn ssh_refuses_a_host_with_the_wrong_key() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let wrong = sshd.wrong_known_hosts().unwrap();
    let out = run(sshd
        .ssh_command_with(&sshd.client_key(), &wrong)
        .arg("true"));
    assert!(!out.status.success(), "ssh accepted a wrong host key");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("REMOTE HOST IDENTIFICATION HAS CHANGED")
            || stderr.contains("Host key verification failed"),
        "unexpected ssh error: {stderr}"
    );
    assert_eq!(sshd.accepted_connections(), 0);
}

#[test]
fn ssh_with_an_unauthorized_key_fails_authentication() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let key = sshd.unauthorized_client_key().unwrap();
    let out = run(sshd.ssh_command_with(&key, &sshd.known_hosts()).arg("true"));
    assert!(!out.status.success(), "sshd accepted an unauthorized key");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Permission denied"),
        "unexpected ssh error: {stderr}"
    );
    assert_eq!(sshd.accepted_connections(), 0);
}

#[test]
fn sshd_stops_drops_connections_and_restarts_on_the_same_port() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    let mut sshd = Sshd::start().unwrap();
    let port = sshd.port();
    // A session that would run for a minute; stop() must cut it.
    let mut long = start_long_session(&sshd);
    assert_eq!(sshd.accepted_connections(), 1);

    sshd.stop().unwrap();
    assert!(!sshd.is_running());
    let started = Instant::now();
    wait_for("the long session to drop", || {
        long.try_wait().unwrap().is_some()
    });
    assert!(started.elapsed() < WAIT);
    assert!(!run(sshd.ssh_command().arg("true")).status.success());

    sshd.restart().unwrap();
    assert!(sshd.is_running());
    assert_eq!(sshd.port(), port);
    assert_ok(&run(sshd.ssh_command().arg("true")), "ssh after restart");
    assert_eq!(sshd.accepted_connections(), 2);
}

#[test]
fn sshd_and_its_sessions_are_gone_after_drop() {
    if harness::skip(&[Need::Sshd]) {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let dir = sshd.dir().to_path_buf();
    let pid: u32 = std::fs::read_to_string(dir.join("sshd.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut session = start_long_session(&sshd);
    drop(sshd);
    assert!(!alive(pid), "sshd {pid} survived drop");
    wait_for("the session to end", || {
        session.try_wait().unwrap().is_some()
    });
    assert!(!dir.exists(), "{} survived drop", dir.display());
}

#[test]
fn libvirt_test_driver_answers_through_the_socket() {
    if harness::skip(&[Need::Libvirtd]) {
        return;
    }
    let libvirtd = Libvirtd::start().unwrap();
    assert_eq!(
        libvirtd.test_uri(),
        format!(
            "test+unix:///default?socket={}",
            libvirtd.socket_path().display()
        )
    );
    let list = libvirtd
        .virsh(&libvirtd.test_uri(), &["list", "--all"])
        .unwrap();
    // The test driver's default host has one running domain called "test".
    assert!(list.contains("test"), "unexpected list: {list}");
    let version = libvirtd.virsh(&libvirtd.qemu_uri(), &["version"]).unwrap();
    assert!(version.contains("QEMU"), "unexpected version: {version}");
}

#[test]
fn vm_network_is_an_isolated_bridge() {
    if harness::skip(&[Need::Libvirtd]) {
        return;
    }
    let libvirtd = Libvirtd::start().unwrap();
    let links = assert_ok(
        &run(libvirtd.in_netns("ip").args(["-o", "link", "show"])),
        "ip link",
    );
    let names: Vec<&str> = links
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|n| n.trim().split('@').next().unwrap_or_default())
        .collect();
    assert_eq!(
        names,
        ["lo", libvirtd.bridge()],
        "unexpected interfaces: {links}"
    );
    // No route anywhere: no addresses beyond loopback, no default route.
    let routes = assert_ok(
        &run(libvirtd
            .in_netns("ip")
            .args(["-4", "route", "show", "table", "all"])),
        "ip route",
    );
    assert!(
        routes.lines().all(|l| l.contains("dev lo")),
        "unexpected routes in {}: {routes}",
        libvirtd.netns()
    );
    let forward = assert_ok(
        &run(libvirtd
            .in_netns("cat")
            .arg("/proc/sys/net/ipv4/ip_forward")),
        "ip_forward",
    );
    assert_eq!(forward.trim(), "0");
    // libvirt has no network of its own (the packaged NAT "default" is not copied).
    let nets = libvirtd
        .virsh(&libvirtd.qemu_uri(), &["net-list", "--all", "--name"])
        .unwrap();
    assert_eq!(nets.trim(), "", "unexpected libvirt networks: {nets}");
}

#[test]
fn a_qemu_domain_runs_on_the_bridge_and_is_destroyed() {
    if harness::skip(&[Need::Libvirtd]) {
        return;
    }
    let libvirtd = Libvirtd::start().unwrap();
    let uri = libvirtd.qemu_uri();
    let xml = libvirtd.dir().join("vm.xml");
    std::fs::write(&xml, libvirtd.minimal_domain_xml("eotest-vm")).unwrap();
    libvirtd
        .virsh(&uri, &["define", xml.to_str().unwrap()])
        .unwrap();
    libvirtd.virsh(&uri, &["start", "eotest-vm"]).unwrap();
    let state = libvirtd.virsh(&uri, &["domstate", "eotest-vm"]).unwrap();
    assert_eq!(state.trim(), "running");
    let running = libvirtd.virsh(&uri, &["list", "--name"]).unwrap();
    assert!(
        running.lines().any(|l| l.trim() == "eotest-vm"),
        "not listed: {running}"
    );
    // The NIC's tap is a port of our bridge, inside our namespace.
    let ports = assert_ok(
        &run(libvirtd
            .in_netns("ip")
            .args(["-o", "link", "show", "master", libvirtd.bridge()])),
        "ip link master",
    );
    assert!(ports.contains("vnet"), "no tap on the bridge: {ports}");
    // libvirtd is pinned to one CPU (see the harness); QEMU must not inherit that.
    let daemon = libvirtd.libvirtd_pid().unwrap();
    let qemu = std::fs::read_to_string(format!(
        "/proc/{daemon}/root/run/libvirt/qemu/eotest-vm.pid"
    ))
    .unwrap();
    assert_eq!(cpus_allowed(qemu.trim()), cpus_allowed("self"));

    libvirtd.virsh(&uri, &["destroy", "eotest-vm"]).unwrap();
    let state = libvirtd.virsh(&uri, &["domstate", "eotest-vm"]).unwrap();
    assert_eq!(state.trim(), "shut off");
    libvirtd.virsh(&uri, &["undefine", "eotest-vm"]).unwrap();
}

#[test]
fn libvirtd_restarts_with_its_state() {
    if harness::skip(&[Need::Libvirtd]) {
        return;
    }
    let mut libvirtd = Libvirtd::start().unwrap();
    let uri = libvirtd.qemu_uri();
    let pool = libvirtd.define_dir_pool("eotest-pool").unwrap();
    assert!(pool.is_dir());
    let old = libvirtd.libvirtd_pid().unwrap();

    libvirtd.stop_libvirtd().unwrap();
    assert!(libvirtd.libvirtd_pid().is_none());
    assert!(libvirtd.virsh(&uri, &["version"]).is_err());

    libvirtd.restart_libvirtd().unwrap();
    let new = libvirtd.libvirtd_pid().unwrap();
    assert_ne!(old, new);
    // Same private state: the pool defined before the restart is still there.
    let pools = libvirtd
        .virsh(&uri, &["pool-list", "--all", "--name"])
        .unwrap();
    assert!(
        pools.lines().any(|l| l.trim() == "eotest-pool"),
        "pool lost: {pools}"
    );
}

#[test]
fn libvirtd_and_its_namespace_are_gone_after_drop() {
    if harness::skip(&[Need::Libvirtd]) {
        return;
    }
    let libvirtd = Libvirtd::start().unwrap();
    let netns = libvirtd.netns().to_string();
    let dir = libvirtd.dir().to_path_buf();
    let uri = libvirtd.qemu_uri();
    let xml = dir.join("vm.xml");
    std::fs::write(&xml, libvirtd.minimal_domain_xml("eotest-drop")).unwrap();
    libvirtd
        .virsh(&uri, &["create", xml.to_str().unwrap()])
        .unwrap();
    let pids: Vec<u32> = assert_ok(
        &run(Command::new("ip").args(["netns", "pids", &netns])),
        "ip netns pids",
    )
    .split_whitespace()
    .map(|p| p.parse().unwrap())
    .collect();
    // sleep (the namespace holder), virtlogd, libvirtd and QEMU at least.
    assert!(
        pids.len() >= 4,
        "expected our processes in {netns}: {pids:?}"
    );
    assert!(netns_exists(&netns));

    drop(libvirtd);
    assert!(!netns_exists(&netns), "{netns} survived drop");
    let survivors: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(
        survivors.is_empty(),
        "processes survived drop: {survivors:?}"
    );
    assert!(!dir.exists(), "{} survived drop", dir.display());
}

#[test]
fn libvirtd_is_cleaned_up_when_a_test_panics() {
    if harness::skip(&[Need::Libvirtd]) {
        return;
    }
    let netns = std::sync::Mutex::new(String::new());
    let result = std::panic::catch_unwind(|| {
        let libvirtd = Libvirtd::start().unwrap();
        *netns.lock().unwrap() = libvirtd.netns().to_string();
        panic!("test failure while libvirtd runs");
    });
    assert!(result.is_err());
    let netns = netns.into_inner().unwrap();
    assert!(!netns.is_empty());
    assert!(!netns_exists(&netns), "{netns} survived a panic");
}

/// Forwards a local unix socket to `remote` through sshd, as the operator's
/// tunnel does, and returns the ssh process once the local socket accepts.
fn forward_unix_socket(sshd: &Sshd, local: &Path, remote: &Path) -> Child {
    let mut ssh = sshd
        .ssh_command()
        .arg("-N")
        .args([
            "-o",
            "ExitOnForwardFailure=yes",
            "-o",
            "StreamLocalBindUnlink=yes",
        ])
        .arg("-L")
        .arg(format!("{}:{}", local.display(), remote.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the forwarded socket", || {
        if let Some(status) = ssh.try_wait().unwrap() {
            panic!("ssh -L exited early ({status})");
        }
        UnixStream::connect(local).is_ok_and(|s| s.shutdown(Shutdown::Both).is_ok())
    });
    ssh
}

#[test]
fn sshd_forwards_a_unix_socket_to_libvirtd() {
    if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
        return;
    }
    let sshd = Sshd::start().unwrap();
    let libvirtd = Libvirtd::start().unwrap();
    let local = sshd.dir().join("libvirt-forward.sock");
    let mut ssh = forward_unix_socket(&sshd, &local, &libvirtd.socket_path());

    let uri = format!("test+unix:///default?socket={}", local.display());
    let list = libvirtd
        .virsh(&uri, &["list"])
        .unwrap_or_else(|e| panic!("{e:#}\nsshd log:\n{}", sshd.log()));
    assert!(
        list.contains("test"),
        "unexpected list through the tunnel: {list}"
    );
    // The tunnel is the harness sshd's one login, not some other path.
    assert_eq!(sshd.accepted_connections(), 1);

    ssh.kill().unwrap();
    ssh.wait().unwrap();
}
