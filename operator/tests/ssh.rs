//! The SSH layer against an in-process russh server: the faults real sshd will not
//! produce on demand (wrong key, silence, a frozen link), and the tunnel's life cycle.
//!
//! Network rule: everything listens on and dials 127.0.0.1 only.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egress_operator::config::LibvirtDriver;
use egress_operator::provider::kvm2::errors::SshError;
use egress_operator::provider::kvm2::ssh::{self, SshTarget};
use egress_operator::provider::kvm2::tunnel::Tunnel;
use egress_operator::{Classified, ErrorClass};
use russh::keys::ssh_key::LineEnding;
use russh::keys::ssh_key::private::Ed25519Keypair;
use russh::keys::{Algorithm, HashAlg, PrivateKey, PublicKey};
use russh::server::{Auth, Msg, Session};
use russh::{Channel, ChannelOpenFailure};
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UnixStream};

/// Generous guard around calls that should finish in a second or two: a hang fails the
/// test instead of blocking CI; it is not a performance assertion.
const HANG_GUARD: Duration = Duration::from_secs(30);

async fn guard<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, f)
        .await
        .expect("hang guard: the call did not finish")
}

/// A fresh ed25519 key: seeded from the process id, the clock and a counter, which is
/// plenty for test keys that only need to differ.
fn fresh_key() -> PrivateKey {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = Sha256::new();
    h.update(std::process::id().to_le_bytes());
    h.update(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            .to_le_bytes(),
    );
    h.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let seed: [u8; 32] = h.finalize().into();
    PrivateKey::from(Ed25519Keypair::from_seed(&seed))
}

fn write_file(path: &Path, text: &str, mode: u32) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .unwrap();
    f.write_all(text.as_bytes()).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn write_key(path: &Path, key: &PrivateKey) {
    write_file(path, &key.to_openssh(LineEnding::LF).unwrap(), 0o600);
}

/// A key file made by ssh-keygen, for key types we cannot seed (RSA, ECDSA).
fn keygen(dir: &Path, kind: &str) -> (PathBuf, PublicKey) {
    let path = dir.join(format!("id_{kind}"));
    let status = std::process::Command::new("ssh-keygen")
        .args(["-q", "-N", "", "-C", "", "-t", kind, "-f"])
        .arg(&path)
        .status()
        .expect("ssh-keygen (openssh-client) is installed by scripts/setup.sh");
    assert!(status.success());
    let key = russh::keys::load_secret_key(&path, None).unwrap();
    (path, key.public_key().clone())
}

/// What the fake server does with a streamlocal channel.
#[derive(Clone, Copy, Debug)]
enum ChannelMode {
    Echo,
    Reject,
}

#[derive(Clone)]
struct ServerHandler {
    authorized: PublicKey,
    mode: ChannelMode,
    /// Signature algorithms of successful public-key logins.
    seen: Arc<Mutex<Vec<Algorithm>>>,
    /// Socket paths channels were opened to.
    paths: Arc<Mutex<Vec<String>>>,
    /// Sizes of the data packets received, in order.
    packets: Arc<Mutex<Vec<usize>>>,
}

impl russh::server::Handler for ServerHandler {
    type Error = russh::Error;

    async fn auth_publickey_offered(
        &mut self,
        _user: &str,
        offer: russh::server::PublicKeyOffer<'_>,
    ) -> Result<Auth, Self::Error> {
        Ok(
            if offer.public_key.key_data() == self.authorized.key_data() {
                Auth::Accept
            } else {
                Auth::reject()
            },
        )
    }

    async fn auth_publickey(
        &mut self,
        _user: &str,
        key: russh::server::VerifiedPublicKey<'_>,
    ) -> Result<Auth, Self::Error> {
        if key.public_key.key_data() == self.authorized.key_data() {
            self.seen.lock().unwrap().push(key.algorithm.clone());
            Ok(Auth::Accept)
        } else {
            Ok(Auth::reject())
        }
    }

    async fn channel_open_direct_streamlocal(
        &mut self,
        channel: Channel<Msg>,
        socket_path: &str,
        reply: russh::server::ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.paths.lock().unwrap().push(socket_path.to_string());
        match self.mode {
            ChannelMode::Echo => {
                reply.accept().await;
                tokio::spawn(async move {
                    let (mut r, mut w) = tokio::io::split(channel.into_stream());
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
            ChannelMode::Reject => reply.reject(ChannelOpenFailure::ConnectFailed).await,
        }
        Ok(())
    }

    async fn data(
        &mut self,
        _channel: russh::ChannelId,
        data: &[u8],
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.packets.lock().unwrap().push(data.len());
        Ok(())
    }
}

/// An in-process SSH server on 127.0.0.1 with a fresh host key.
struct TestServer {
    port: u16,
    host_key: PublicKey,
    handler: ServerHandler,
    /// Server-side handles of every session, to hang up on clients.
    sessions: Arc<Mutex<Vec<russh::server::Handle>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestServer {
    async fn start(authorized: PublicKey, mode: ChannelMode) -> Self {
        let key = fresh_key();
        let host_key = key.public_key().clone();
        let config = Arc::new(russh::server::Config {
            keys: vec![key],
            auth_rejection_time: Duration::from_millis(1),
            auth_rejection_time_initial: Some(Duration::ZERO),
            ..Default::default()
        });
        let handler = ServerHandler {
            authorized,
            mode,
            seen: Arc::default(),
            paths: Arc::default(),
            packets: Arc::default(),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let h = handler.clone();
        let sessions: Arc<Mutex<Vec<russh::server::Handle>>> = Arc::default();
        let handles = Arc::clone(&sessions);
        let task = tokio::spawn(async move {
            let mut running = tokio::task::JoinSet::new();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (config, h) = (Arc::clone(&config), h.clone());
                let handles = Arc::clone(&handles);
                running.spawn(async move {
                    if let Ok(session) = russh::server::run_stream(config, tcp, h).await {
                        handles.lock().unwrap().push(session.handle());
                        let _ = session.await;
                    }
                });
            }
        });
        Self {
            port,
            host_key,
            handler,
            sessions,
            task,
        }
    }

    /// Sends a disconnect to every client, as a server shutting down does.
    async fn hang_up(&self) {
        let handles: Vec<_> = self.sessions.lock().unwrap().drain(..).collect();
        for h in handles {
            let _ = h
                .disconnect(
                    russh::Disconnect::ByApplication,
                    "going away".into(),
                    "en".into(),
                )
                .await;
        }
    }
}

/// A client side: key file and known_hosts in a temp dir.
struct Client {
    dir: tempfile::TempDir,
    key: PrivateKey,
}

impl Client {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let key = fresh_key();
        write_key(&dir.path().join("id"), &key);
        Self { dir, key }
    }

    fn public(&self) -> PublicKey {
        self.key.public_key().clone()
    }

    fn known_hosts(&self) -> PathBuf {
        self.dir.path().join("known_hosts")
    }

    /// known_hosts holding `key` for 127.0.0.1 on `port`.
    fn trust(&self, port: u16, key: &PublicKey) {
        write_file(
            &self.known_hosts(),
            &format!("# test\n[127.0.0.1]:{port} {}\n", key.to_openssh().unwrap()),
            0o644,
        );
    }

    fn target(&self, port: u16) -> SshTarget {
        SshTarget {
            host: "127.0.0.1".into(),
            port,
            user: "egress".into(),
            private_key_file: self.dir.path().join("id"),
            known_hosts_file: self.known_hosts(),
            insecure_ignore_host_key: false,
            connect_timeout: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(15),
            keepalive_max_missed: 3,
        }
    }
}

async fn echo_through(stream: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin)) {
    let msg = b"hello through the tunnel";
    stream.write_all(msg).await.unwrap();
    let mut buf = vec![0u8; msg.len()];
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, msg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_verifies_and_opens_streamlocal() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    client.trust(server.port, &server.host_key);
    let session = guard(ssh::connect(&client.target(server.port)))
        .await
        .unwrap();
    assert!(!session.is_closed());
    guard(session.check_alive(Duration::from_secs(5)))
        .await
        .unwrap();
    let mut ch = guard(session.open_streamlocal("/var/run/libvirt/libvirt-sock"))
        .await
        .unwrap();
    guard(echo_through(&mut ch)).await;
    drop(ch);
    assert_eq!(
        server.handler.paths.lock().unwrap().as_slice(),
        ["/var/run/libvirt/libvirt-sock"]
    );
    guard(session.close()).await;
    assert!(session.is_closed());
    let e = guard(session.open_streamlocal("/s")).await.unwrap_err();
    assert_eq!(e.reason_code(), "disconnected", "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsa_and_ecdsa_keys_sign_with_sha2() {
    for kind in ["rsa", "ecdsa"] {
        let client = Client::new();
        let (path, public) = keygen(client.dir.path(), kind);
        let server = TestServer::start(public, ChannelMode::Echo).await;
        client.trust(server.port, &server.host_key);
        let mut target = client.target(server.port);
        target.private_key_file = path;
        let session = guard(ssh::connect(&target)).await.unwrap();
        guard(session.close()).await;
        let seen = server.handler.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "{kind}: {seen:?}");
        if kind == "rsa" {
            assert!(
                matches!(seen[0], Algorithm::Rsa { hash: Some(_) }),
                "RSA must sign with rsa-sha2-*: {seen:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_host_key_is_refused_with_fingerprint_and_path() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    // known_hosts lists another key for this exact host and port.
    client.trust(server.port, fresh_key().public_key());
    let e = guard(ssh::connect(&client.target(server.port)))
        .await
        .unwrap_err();
    let msg = e.to_string();
    let fp = server.host_key.fingerprint(HashAlg::Sha256).to_string();
    assert_eq!(e.reason_code(), "host-key", "{msg}");
    assert_eq!(e.class(), ErrorClass::Permanent);
    assert!(msg.contains(&fp), "fingerprint {fp} not in {msg}");
    assert!(
        msg.contains(&client.known_hosts().display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("MISMATCH"), "{msg}");
    assert!(
        server.handler.seen.lock().unwrap().is_empty(),
        "must not authenticate"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_host_is_refused() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    // The right key, but recorded for another port: OpenSSH treats that as unknown.
    client.trust(server.port.wrapping_add(1).max(1), &server.host_key);
    let e = guard(ssh::connect(&client.target(server.port)))
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert_eq!(e.reason_code(), "host-key", "{msg}");
    assert!(msg.contains("no entry"), "{msg}");
    assert!(
        msg.contains(&server.host_key.fingerprint(HashAlg::Sha256).to_string()),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("[127.0.0.1]:{}", server.port)),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_known_hosts_is_refused_unless_insecure() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    let mut target = client.target(server.port);
    let e = guard(ssh::connect(&target)).await.unwrap_err();
    assert_eq!(e.reason_code(), "host-key", "{e}");
    assert!(e.to_string().contains("known_hosts"), "{e}");

    target.insecure_ignore_host_key = true;
    let session = guard(ssh::connect(&target)).await.unwrap();
    guard(session.close()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_failure_is_its_own_error() {
    let client = Client::new();
    // The server authorizes someone else's key.
    let server = TestServer::start(fresh_key().public_key().clone(), ChannelMode::Echo).await;
    client.trust(server.port, &server.host_key);
    let e = guard(ssh::connect(&client.target(server.port)))
        .await
        .unwrap_err();
    assert_eq!(e.reason_code(), "auth", "{e}");
    assert_eq!(e.class(), ErrorClass::Permanent);
    let fp = client.public().fingerprint(HashAlg::Sha256).to_string();
    assert!(e.to_string().contains(&fp), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_file_readable_by_others_is_refused() {
    let client = Client::new();
    let key_file = client.dir.path().join("id");
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    // No server at all: the check happens before any network traffic.
    let e = guard(ssh::connect(&client.target(1))).await.unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SshError::KeyFile { .. }), "{msg}");
    assert_eq!(e.reason_code(), "key-file");
    assert!(msg.contains(&key_file.display().to_string()), "{msg}");
    assert!(msg.contains("0644"), "{msg}");
    // No key material in the message.
    assert!(!msg.contains("PRIVATE KEY"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_key_files_are_refused_without_leaking_content() {
    let client = Client::new();
    let path = client.dir.path().join("id");
    let pem = client.key.to_openssh(LineEnding::LF).unwrap();
    let cases = [
        ("garbage", "not a key at all\n".to_string()),
        ("truncated", pem[..pem.len() / 2].to_string()),
    ];
    for (name, text) in cases {
        write_file(&path, &text, 0o600);
        let e = guard(ssh::connect(&client.target(1))).await.unwrap_err();
        assert_eq!(e.reason_code(), "key-file", "{name}: {e}");
        let msg = format!("{e} {e:?}");
        assert!(!msg.contains(&text[..20.min(text.len())]), "{name}: {msg}");
    }
    std::fs::remove_file(&path).unwrap();
    let e = guard(ssh::connect(&client.target(1))).await.unwrap_err();
    assert_eq!(e.reason_code(), "key-file", "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_port_is_a_connect_error() {
    let client = Client::new();
    // Bind then drop: the port is (almost certainly) closed right after.
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    client.trust(port, fresh_key().public_key());
    let e = guard(ssh::connect(&client.target(port))).await.unwrap_err();
    assert_eq!(e.reason_code(), "connect", "{e}");
    assert_eq!(e.class(), ErrorClass::Transient);
}

/// Accepts TCP connections and never answers; optionally sends the SSH banner first so
/// the client is stuck inside the key exchange rather than before it. Reports on the
/// channel when the client closes its end (what it sends is read and ignored).
async fn silent_server(
    banner: bool,
) -> (
    u16,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (closed_tx, closed) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut tcp, _)) = listener.accept().await {
            let closed_tx = closed_tx.clone();
            conns.spawn(async move {
                if banner {
                    let _ = tcp.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await;
                }
                let mut sink = vec![0u8; 4096];
                while let Ok(n) = tcp.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
                let _ = closed_tx.send(());
            });
        }
    });
    (port, closed, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_server_hits_the_connect_timeout_and_nothing_lingers() {
    for banner in [false, true] {
        let client = Client::new();
        let (port, mut closed, task) = silent_server(banner).await;
        client.trust(port, fresh_key().public_key());
        let mut target = client.target(port);
        target.connect_timeout = Duration::from_secs(1);
        let e = guard(ssh::connect(&target)).await.unwrap_err();
        assert_eq!(e.reason_code(), "timeout", "{e}");
        assert_eq!(e.class(), ErrorClass::Transient);
        assert!(e.to_string().contains("ssh handshake"), "{e}");
        // The abandoned dial closed its socket: with the banner sent, russh's session
        // task was already running and is only stopped by our kill switch.
        guard(closed.recv()).await.unwrap();
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_channel_is_a_channel_error() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Reject).await;
    client.trust(server.port, &server.host_key);
    let session = guard(ssh::connect(&client.target(server.port)))
        .await
        .unwrap();
    let e = guard(session.open_streamlocal("/nope")).await.unwrap_err();
    assert_eq!(e.reason_code(), "libvirt-socket", "{e}");
    assert!(e.to_string().contains("/nope"), "{e}");
    assert!(
        !session.is_closed(),
        "a refused channel leaves the session usable"
    );
    guard(session.close()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_round_trip_and_cleanup() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    client.trust(server.port, &server.host_key);
    let session = Arc::new(
        guard(ssh::connect(&client.target(server.port)))
            .await
            .unwrap(),
    );

    // Closed explicitly: everything is gone when close() returns.
    let tunnel = Tunnel::start(Arc::clone(&session), "/run/libvirt/libvirt-sock")
        .await
        .unwrap();
    let sock = tunnel.local_socket_path().to_path_buf();
    let dir = sock.parent().unwrap().to_path_buf();
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    assert_eq!(
        tunnel.libvirt_uri(LibvirtDriver::Test),
        format!("test+unix:///default?socket={}", sock.display())
    );
    let mut a = guard(UnixStream::connect(&sock)).await.unwrap();
    let mut b = guard(UnixStream::connect(&sock)).await.unwrap();
    guard(echo_through(&mut a)).await;
    guard(echo_through(&mut b)).await;
    assert_eq!(tunnel.active_connections(), 2);
    guard(tunnel.close()).await;
    assert!(!dir.exists(), "tunnel dir must be removed on close");
    // The forwarded connections were closed: reads see EOF (or a reset).
    let mut buf = [0u8; 1];
    let n = guard(a.read(&mut buf)).await.unwrap_or(0);
    assert_eq!(n, 0);

    // Dropped: the directory goes at once, the connections shortly after.
    let tunnel = Tunnel::start(Arc::clone(&session), "/run/libvirt/libvirt-sock")
        .await
        .unwrap();
    let sock = tunnel.local_socket_path().to_path_buf();
    let mut c = guard(UnixStream::connect(&sock)).await.unwrap();
    guard(echo_through(&mut c)).await;
    drop(tunnel);
    assert!(
        !sock.parent().unwrap().exists(),
        "tunnel dir must be removed on drop"
    );
    let n = guard(c.read(&mut buf)).await.unwrap_or(0);
    assert_eq!(n, 0);

    assert!(
        !session.is_closed(),
        "closing a tunnel leaves the session alone"
    );
    guard(session.close()).await;
    assert_eq!(
        Arc::strong_count(&session),
        1,
        "tunnel tasks released the session"
    );
}

/// A bulk write through the tunnel (an image upload) leaves in SSH packets of the
/// server's maximum size, not in pieces of a small copy buffer: with tokio's default
/// 8 KiB buffer every packet was 8 KiB, and the host paid its per-packet cost four times
/// over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_sends_bulk_data_in_full_size_packets() {
    // Under the test server's 100-message channel buffer even in 8 KiB packets: past
    // that, this in-process server stops reading while its echo waits on our window.
    const BULK: usize = 512 << 10;
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    client.trust(server.port, &server.host_key);
    let session = Arc::new(
        guard(ssh::connect(&client.target(server.port)))
            .await
            .unwrap(),
    );
    let tunnel = Tunnel::start(Arc::clone(&session), "/run/libvirt/libvirt-sock")
        .await
        .unwrap();
    let stream = guard(UnixStream::connect(tunnel.local_socket_path()))
        .await
        .unwrap();
    let (mut r, mut w) = stream.into_split();
    let data: Vec<u8> = (0..BULK).map(|i| (i % 251) as u8).collect();
    let writer = tokio::spawn(async move {
        w.write_all(&data).await.unwrap();
        data
    });
    let mut back = vec![0u8; BULK];
    guard(r.read_exact(&mut back)).await.unwrap();
    let data = guard(writer).await.unwrap();
    assert!(back == data, "the echo differs from what was sent");

    let packets = server.handler.packets.lock().unwrap().clone();
    assert_eq!(packets.iter().sum::<usize>(), BULK);
    let max_packet = usize::try_from(russh::server::Config::default().maximum_packet_size).unwrap();
    let full = packets.iter().filter(|n| **n == max_packet).count();
    // Most bytes travel in full packets; a read of the local socket may end short now
    // and then, which leaves one smaller packet behind it.
    assert!(
        full * max_packet >= BULK / 2,
        "{full} of {} packets are full-size ({max_packet} bytes); sizes seen: {:?}",
        packets.len(),
        packets.iter().take(16).collect::<Vec<_>>()
    );
    guard(tunnel.close()).await;
    guard(session.close()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_on_a_closed_session_drops_connections() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    client.trust(server.port, &server.host_key);
    let session = Arc::new(
        guard(ssh::connect(&client.target(server.port)))
            .await
            .unwrap(),
    );
    let tunnel = Tunnel::start(Arc::clone(&session), "/s").await.unwrap();
    guard(session.close()).await;
    let mut c = guard(UnixStream::connect(tunnel.local_socket_path()))
        .await
        .unwrap();
    let mut buf = [0u8; 1];
    let n = guard(c.read(&mut buf)).await.unwrap_or(0);
    assert_eq!(n, 0, "the client sees the connection closed, not a hang");
    guard(tunnel.close()).await;
}

/// A TCP relay between client and server that can be frozen: it then holds both
/// connections open and forwards nothing, like a link whose far end vanished.
async fn freezable_relay(server_port: u16) -> (u16, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let frozen = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&frozen);
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let up = TcpStream::connect(("127.0.0.1", server_port))
                .await
                .unwrap();
            let (dr, dw) = down.into_split();
            let (ur, uw) = up.into_split();
            tokio::spawn(pump(dr, uw, Arc::clone(&f)));
            tokio::spawn(pump(ur, dw, Arc::clone(&f)));
        }
    });
    (port, frozen)
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            // Hold both sockets, forward nothing, forever (until the test ends).
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missed_keepalives_declare_the_link_dead() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    let (relay_port, frozen) = freezable_relay(server.port).await;
    client.trust(relay_port, &server.host_key);
    let mut target = client.target(relay_port);
    target.keepalive_interval = Duration::from_millis(300);
    target.keepalive_max_missed = 2;
    let session = guard(ssh::connect(&target)).await.unwrap();
    // Alive across several keepalive intervals while the link works.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!session.is_closed());

    frozen.store(true, Ordering::SeqCst);
    guard(async {
        while !session.is_closed() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let reason = session.closed_reason().unwrap_or_default();
    assert!(reason.to_lowercase().contains("keepalive"), "{reason}");
    let e = guard(session.open_streamlocal("/s")).await.unwrap_err();
    assert_eq!(e.reason_code(), "disconnected", "{e}");
    assert!(e.to_string().to_lowercase().contains("keepalive"), "{e}");
    guard(session.close()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_going_away_closes_the_session() {
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    client.trust(server.port, &server.host_key);
    let session = guard(ssh::connect(&client.target(server.port)))
        .await
        .unwrap();
    server.hang_up().await;
    guard(async {
        while !session.is_closed() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let e = guard(session.check_alive(Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert_eq!(e.reason_code(), "disconnected", "{e}");
    assert!(e.to_string().contains("going away"), "{e}");
}

/// Counts WARN events whose message contains a needle; a minimal subscriber so the test
/// needs no extra crate.
struct WarnCounter {
    needle: &'static str,
    hits: Arc<AtomicU64>,
}

impl tracing::Subscriber for WarnCounter {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        if *event.metadata().level() == tracing::Level::WARN {
            let mut m = Message(String::new());
            event.record(&mut m);
            if m.0.contains(self.needle) {
                self.hits.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

// current_thread: russh's session task runs on this thread, under this subscriber.
#[tokio::test(flavor = "current_thread")]
async fn insecure_ignore_host_key_warns_on_every_dial() {
    let hits = Arc::new(AtomicU64::new(0));
    let _subscriber = tracing::subscriber::set_default(WarnCounter {
        needle: "host key NOT verified",
        hits: Arc::clone(&hits),
    });
    let client = Client::new();
    let server = TestServer::start(client.public(), ChannelMode::Echo).await;
    // known_hosts even holds a wrong key: insecure mode does not look at it.
    client.trust(server.port, fresh_key().public_key());
    let mut target = client.target(server.port);
    target.insecure_ignore_host_key = true;
    for dial in 1..=3 {
        let session = guard(ssh::connect(&target)).await.unwrap();
        guard(session.close()).await;
        assert_eq!(hits.load(Ordering::SeqCst), dial, "one warning per dial");
    }
}
