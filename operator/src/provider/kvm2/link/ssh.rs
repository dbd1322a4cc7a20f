//! One SSH session to a libvirt host, over russh.
//!
//! [`connect`] does, in order and under one deadline (`connectTimeoutSeconds`):
//!
//! 1. local checks that need no network: the private key file (OpenSSH's rule: a key
//!    we own must be closed to group and others, a key someone else owns, such as a
//!    Kubernetes Secret mount, must be closed to others) and the known_hosts file;
//! 2. name resolution and the TCP connect;
//! 3. the SSH handshake, where russh calls our `check_server_key`: the offered host key
//!    must be in known_hosts ([`super::known_hosts`]), unless the host is configured with
//!    `insecureIgnoreHostKey`, which is logged as a warning on every dial;
//! 4. public-key authentication (ed25519, ECDSA, or RSA signed with rsa-sha2-512/256,
//!    never the SHA-1 `ssh-rsa`).
//!
//! A dead or half-open link is noticed within [`SshTarget::half_open_bound`]
//! (`keepaliveIntervalSeconds × (keepaliveMaxMissed + 1)`, 60 s by default), whatever is in
//! flight, and [`SshSession::is_closed`] turns true:
//!
//! - idle or not, SSH keepalives go out every `keepaliveIntervalSeconds`; after
//!   `keepaliveMaxMissed` of them pass with nothing at all received, russh ends the session;
//! - with data in flight to a peer that stopped acknowledging it (a half-open TCP
//!   connection), writes block and russh's loop never gets to count keepalives:
//!   `TCP_USER_TIMEOUT` makes the kernel fail the socket after the bound; a write blocked
//!   on a peer that acknowledges but never reads (a frozen middlebox) is ended by russh's
//!   inactivity timeout one keepalive interval later (later than the keepalives, so an
//!   idle dead link is reported as missed keepalives, the clearer reason).
//!
//! Each resolved address gets its own share of the connect timeout (at least
//! [`MIN_ADDRESS_TIMEOUT`]), so a black-holed IPv6 address does not eat the whole budget
//! before IPv4 is tried.
//!
//! Nothing leaks when a dial fails half-way: the TCP stream is wrapped so that the
//! dial's drop (or [`SshSession`]'s drop) closes it even while russh's background task is
//! stuck in a key exchange with a silent server.

use std::fmt;
use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use russh::keys::{Algorithm, HashAlg, PrivateKey, PrivateKeyWithHashAlg, PublicKeyOrCertificate};
use russh::{cipher, client};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch};

use super::errors::SshError;
use super::known_hosts::{HostKeyError, KnownHosts};
use crate::config::{DEFAULT_SSH_PORT, HostConfig, SshConfig};

/// Group and other permission bits: OpenSSH refuses a private key *it owns* with any of
/// them set ("UNPROTECTED PRIVATE KEY FILE", `sshkey_perm_ok`), and so do we.
const KEY_FILE_FORBIDDEN_MODE: u32 = 0o077;

/// Other (world) permission bits: refused on a key file whoever owns it. A key owned by
/// someone else is what a Kubernetes Secret mount gives us: root-owned, group `fsGroup`,
/// and the kubelet ORs group read into `defaultMode`, so 0400 arrives as 0440. OpenSSH
/// accepts any mode on a key it does not own; we still refuse one the world may read.
const KEY_FILE_FORBIDDEN_MODE_NOT_OWNED: u32 = 0o007;

/// How long [`SshSession::close`] waits for the server to acknowledge our disconnect
/// before cutting the TCP connection: long enough for one round trip on a slow link,
/// short enough that shutdown is never held up by a dead host.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The least time one resolved address gets to accept a TCP connection when several are
/// tried in turn.
pub const MIN_ADDRESS_TIMEOUT: Duration = Duration::from_secs(1);

/// The description sent with our disconnect message (sshd logs it).
const DISCONNECT_DESCRIPTION: &str = "egress-operator closing the connection";

/// The stream returned by [`SshSession::open_streamlocal`]: tokio `AsyncRead` +
/// `AsyncWrite` over one SSH channel. Dropping it closes the channel. A newtype, so
/// russh's type stays out of our API and the stream can say where it goes in `Debug`.
pub struct ChannelStream {
    inner: russh::ChannelStream<client::Msg>,
    target: String,
}

impl fmt::Debug for ChannelStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelStream")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl AsyncRead for ChannelStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ChannelStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Everything needed to dial one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshTarget {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    /// TCP port of sshd.
    pub port: u16,
    /// Remote user.
    pub user: String,
    /// OpenSSH or PEM private key file (ed25519, ECDSA or RSA), unencrypted.
    pub private_key_file: PathBuf,
    /// known_hosts file the host key is verified against.
    pub known_hosts_file: PathBuf,
    /// Skip host-key verification (logged as a warning on every dial).
    pub insecure_ignore_host_key: bool,
    /// Deadline of the whole dial: DNS, TCP, handshake and authentication.
    pub connect_timeout: Duration,
    /// Interval between SSH keepalives when the link is quiet.
    pub keepalive_interval: Duration,
    /// Unanswered keepalives after which the session is declared dead.
    pub keepalive_max_missed: u32,
}

impl SshTarget {
    /// The target for one configured host, with the shared SSH settings. The address was
    /// validated when the config was loaded; it is parsed again here, so an unvalidated
    /// config still yields an error rather than a wrong dial.
    pub fn from_config(ssh: &SshConfig, host: &HostConfig) -> Result<Self, SshError> {
        let (name, port) =
            crate::validation::host_port(&host.address, DEFAULT_SSH_PORT).map_err(|reason| {
                SshError::Config {
                    address: host.address.clone(),
                    reason,
                }
            })?;
        Ok(Self {
            host: name,
            port,
            user: ssh.user.clone(),
            private_key_file: PathBuf::from(&ssh.private_key_file),
            known_hosts_file: PathBuf::from(&ssh.known_hosts_file),
            insecure_ignore_host_key: host.insecure_ignore_host_key,
            connect_timeout: Duration::from_secs(u64::from(ssh.connect_timeout_seconds)),
            keepalive_interval: Duration::from_secs(u64::from(ssh.keepalive_interval_seconds)),
            keepalive_max_missed: ssh.keepalive_max_missed,
        })
    }

    /// How long a link may stay silent (nothing received, or written data not
    /// acknowledged) before it is declared dead: one keepalive interval per allowed miss,
    /// plus one for the probe in flight.
    pub fn half_open_bound(&self) -> Duration {
        self.keepalive_interval
            .saturating_mul(self.keepalive_max_missed.saturating_add(1))
    }

    /// `host:port`, with brackets around an IPv6 address: the form used in every message.
    pub fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// The steps of a dial, so a timeout can say which one was under way.
const STAGES: [&str; 5] = [
    "reading the key files",
    "dns lookup",
    "tcp connect",
    "ssh handshake",
    "ssh authentication",
];

/// Dials `target` and authenticates. See the module docs for the steps; the whole dial
/// is bounded by `target.connect_timeout`.
pub async fn connect(target: &SshTarget) -> Result<SshSession, SshError> {
    let addr = target.addr();
    let stage = Arc::new(AtomicU8::new(0));
    // Dropping `kill` (on any error or timeout below, or with the session) makes the TCP
    // stream fail, which ends russh's background task whatever state it is in.
    let (kill, killed) = oneshot::channel();
    let (done_tx, done) = watch::channel(());
    let closed_reason = Arc::new(Mutex::new(None));
    let dial = dial(
        target,
        Arc::clone(&stage),
        killed,
        done_tx,
        Arc::clone(&closed_reason),
    );
    match tokio::time::timeout(target.connect_timeout, dial).await {
        Ok(Ok(handle)) => Ok(SshSession {
            handle,
            addr,
            channel_timeout: target.connect_timeout,
            kill: Mutex::new(Some(kill)),
            done,
            closed_reason,
        }),
        Ok(Err(e)) => Err(e),
        Err(_elapsed) => {
            let at = usize::from(stage.load(Ordering::Relaxed));
            Err(SshError::Timeout {
                addr,
                stage: STAGES.get(at).copied().unwrap_or("connect"),
                after: target.connect_timeout,
            })
        }
    }
}

/// The body of [`connect`], without its deadline.
async fn dial(
    target: &SshTarget,
    stage: Arc<AtomicU8>,
    killed: oneshot::Receiver<()>,
    done: watch::Sender<()>,
    closed_reason: Arc<Mutex<Option<String>>>,
) -> Result<client::Handle<ClientHandler>, SshError> {
    let addr = target.addr();
    let set = |s: u8| stage.store(s, Ordering::Relaxed);

    set(0);
    let key = load_private_key(&target.private_key_file).await?;
    let policy = if target.insecure_ignore_host_key {
        HostKeyPolicy::Insecure
    } else {
        let known = KnownHosts::load(&target.known_hosts_file)
            .await
            .map_err(|source| SshError::HostKey {
                addr: addr.clone(),
                source,
            })?;
        HostKeyPolicy::Verify(known)
    };

    set(1);
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|source| SshError::Dns {
            host: target.host.clone(),
            source,
        })?
        .collect();
    if addrs.is_empty() {
        return Err(SshError::Dns {
            host: target.host.clone(),
            source: io::Error::new(io::ErrorKind::NotFound, "no addresses"),
        });
    }

    set(2);
    let tcp = connect_any(&addrs, &addr, target.connect_timeout).await?;
    // libvirt RPC is small request/response messages: Nagle's delay would dominate.
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(host = %addr, error = %e, "cannot set TCP_NODELAY");
    }
    // Data the peer stopped acknowledging fails the socket after the bound, instead of
    // after the kernel's retransmission limit (about 15 minutes).
    if let Err(e) =
        socket2::SockRef::from(&tcp).set_tcp_user_timeout(Some(target.half_open_bound()))
    {
        tracing::debug!(host = %addr, error = %e, "cannot set TCP_USER_TIMEOUT");
    }

    set(3);
    let config = client_config(target, &policy);
    let handler = ClientHandler {
        policy,
        host: target.host.clone(),
        port: target.port,
        addr: addr.clone(),
        _done: done,
        closed_reason,
    };
    let stream = Killable {
        inner: tcp,
        kill: killed,
        killed: false,
    };
    let mut handle = client::connect_stream(Arc::new(config), stream, handler)
        .await
        .map_err(|e| match e {
            HandlerError::HostKey(source) => SshError::HostKey {
                addr: addr.clone(),
                source,
            },
            HandlerError::Russh(source) => SshError::Handshake {
                addr: addr.clone(),
                source: Box::new(source),
            },
        })?;

    set(4);
    authenticate(&mut handle, target, key).await?;
    Ok(handle)
}

/// The time each of `count` addresses gets out of `budget`: an equal share, at least
/// [`MIN_ADDRESS_TIMEOUT`] (the dial's own deadline still bounds the sum).
fn per_address_timeout(budget: Duration, count: usize) -> Duration {
    let count = u32::try_from(count.max(1)).unwrap_or(u32::MAX);
    (budget / count).max(MIN_ADDRESS_TIMEOUT)
}

/// Connects to the first address that accepts, like OpenSSH, giving each its share of
/// `budget`; the last error otherwise.
async fn connect_any(
    addrs: &[SocketAddr],
    addr: &str,
    budget: Duration,
) -> Result<TcpStream, SshError> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no addresses");
    let each = per_address_timeout(budget, addrs.len());
    for a in addrs {
        match tokio::time::timeout(each, TcpStream::connect(a)).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = e,
            Err(_) => {
                last = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{a} did not accept within {each:?}"),
                );
            }
        }
    }
    Err(SshError::Connect {
        addr: addr.to_string(),
        source: last,
    })
}

/// russh's client config: our keepalives, and host-key algorithms ordered so that the
/// ones known_hosts lists for this host come first (as OpenSSH orders them), so a server
/// with several host keys offers one we can check. SHA-1 `ssh-rsa` host signatures are
/// left out, as OpenSSH 8.8+ does.
fn client_config(target: &SshTarget, policy: &HostKeyPolicy) -> client::Config {
    let mut preferred = russh::Preferred::default();
    let mut algorithms: Vec<Algorithm> = preferred
        .key
        .iter()
        .filter(|a| **a != Algorithm::Rsa { hash: None })
        .cloned()
        .collect();
    if let HostKeyPolicy::Verify(known) = policy {
        let listed = known.algorithms_for(&target.host, target.port);
        let is_listed = |a: &Algorithm| listed.iter().any(|k| k == a || (is_rsa(k) && is_rsa(a)));
        // A stable sort keeps russh's order within each group.
        algorithms.sort_by_key(|a| !is_listed(a));
    }
    preferred.key = algorithms.into();
    preferred.cipher = cipher_order(&preferred.cipher, hardware_aes()).into();
    client::Config {
        // Bounds a write to a peer that stopped reading (see the module docs); a healthy
        // idle link answers every keepalive well within it.
        inactivity_timeout: Some(target.half_open_bound() + target.keepalive_interval),
        keepalive_interval: Some(target.keepalive_interval),
        keepalive_max: usize::try_from(target.keepalive_max_missed).unwrap_or(usize::MAX),
        preferred,
        nodelay: true,
        ..client::Config::default()
    }
}

/// russh's cipher list, with AES-GCM moved ahead of chacha20-poly1305 when the CPU has
/// AES and carry-less multiply instructions. Both are AEADs of the same strength; what
/// differs is the cost on *both* ends of the link. ring (ours) and OpenSSL (sshd's) run
/// AES-GCM in hardware there, while OpenSSH computes chacha20-poly1305's Poly1305 in
/// portable C: profiling an image upload showed sshd's Poly1305 as one of the larger
/// costs on the host. Without those instructions chacha20-poly1305 stays first (it is
/// the faster and the constant-time one in software), as in OpenSSH's own default.
fn cipher_order(russh: &[cipher::Name], hardware_aes: bool) -> Vec<cipher::Name> {
    let mut order = russh.to_vec();
    if hardware_aes {
        let is_gcm = |c: &cipher::Name| *c == cipher::AES_256_GCM || *c == cipher::AES_128_GCM;
        // A stable sort keeps russh's order within each group.
        order.sort_by_key(|c| !is_gcm(c));
    }
    order
}

/// Whether this CPU runs AES-GCM in hardware (see [`cipher_order`]).
fn hardware_aes() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
            && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// Whether `a` is an RSA algorithm, whatever its hash (`Algorithm::is_rsa` takes `self`
/// by value, and `Algorithm` is not `Copy`).
fn is_rsa(a: &Algorithm) -> bool {
    matches!(a, Algorithm::Rsa { .. })
}

/// The effective uid of this process, from `/proc/self/status` (std has no `geteuid`);
/// `None` where that cannot be read, and then every key file gets the strict rule.
fn current_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    // Real, effective, saved and filesystem uid.
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Why a key file with permission bits `mode`, owned by `owner`, must not be used by a
/// process running as `me` (`None`: unknown, treated as the owner); `None` if it may.
fn key_file_mode_problem(mode: u32, owner: u32, me: Option<u32>) -> Option<String> {
    let ours = me.is_none_or(|me| me == owner);
    if ours && mode & KEY_FILE_FORBIDDEN_MODE != 0 {
        return Some(format!(
            "has mode {mode:04o}, readable by group or others; a private key must be 0600 \
             or 0400 (in Kubernetes, mount the Secret with defaultMode 0400)"
        ));
    }
    if !ours && mode & KEY_FILE_FORBIDDEN_MODE_NOT_OWNED != 0 {
        return Some(format!(
            "has mode {mode:04o}, accessible by others (it is owned by uid {owner}, not by \
             us); a private key owned by another user must not be accessible by others, \
             e.g. 0440 or 0400 (in Kubernetes, mount the Secret with defaultMode 0400)"
        ));
    }
    None
}

/// Reads the private key: refuses a file whose mode lets others read it (see
/// [`key_file_mode_problem`]), and keeps the file's bytes only as long as parsing takes
/// (then zeroes them).
async fn load_private_key(path: &Path) -> Result<PrivateKey, SshError> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    let fail = |reason: String| SshError::KeyFile {
        path: path.to_path_buf(),
        reason,
    };
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(|e| fail(format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(fail("is not a regular file".into()));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if let Some(problem) = key_file_mode_problem(mode, meta.uid(), current_uid()) {
        return Err(fail(problem));
    }
    let mut bytes = tokio::fs::read(path)
        .await
        .map_err(|e| fail(format!("cannot read it: {e}")))?;
    let parsed = match std::str::from_utf8(&bytes) {
        Ok(text) => russh::keys::decode_secret_key(text, None).map_err(|e| match e {
            russh::keys::Error::KeyIsEncrypted => {
                "is encrypted with a passphrase, which is not supported; store the key \
                 unencrypted in the Secret"
                    .to_string()
            }
            russh::keys::Error::UnsupportedKeyType { .. } => {
                "holds an unsupported key type; use ed25519, ECDSA or RSA".to_string()
            }
            // Only the kind of failure: the error types never quote key bytes, but the
            // message does not depend on that.
            _ => "is not a valid OpenSSH or PEM private key".to_string(),
        }),
        Err(_) => Err("is not a text (OpenSSH or PEM) key file".to_string()),
    };
    bytes.fill(0);
    let key = parsed.map_err(fail)?;
    match key.algorithm() {
        Algorithm::Ed25519 | Algorithm::Ecdsa { .. } | Algorithm::Rsa { .. } => Ok(key),
        other => Err(fail(format!(
            "holds a {} key; use ed25519, ECDSA or RSA",
            other.as_str()
        ))),
    }
}

/// Public-key authentication; RSA keys sign with SHA-2 only.
async fn authenticate(
    handle: &mut client::Handle<ClientHandler>,
    target: &SshTarget,
    key: PrivateKey,
) -> Result<(), SshError> {
    let addr = target.addr();
    let auth_error = |reason: String| SshError::Auth {
        user: target.user.clone(),
        addr: addr.clone(),
        reason,
    };
    let fingerprint = key.public_key().fingerprint(HashAlg::Sha256).to_string();
    let algorithm = key.algorithm();
    let hash = if is_rsa(&algorithm) {
        match handle.best_supported_rsa_hash().await {
            Ok(Some(Some(hash))) => Some(hash),
            Ok(Some(None)) => {
                return Err(auth_error(
                    "the server accepts RSA signatures only with SHA-1 (ssh-rsa), which \
                     we refuse; use an ed25519 key or enable rsa-sha2-256/512 on the host"
                        .into(),
                ));
            }
            // No server-sig-algs extension: every server with SHA-2 support since
            // OpenSSH 7.2 understands rsa-sha2-256.
            Ok(None) => Some(HashAlg::Sha256),
            Err(source) => {
                return Err(SshError::Handshake {
                    addr: addr.clone(),
                    source: Box::new(source),
                });
            }
        }
    } else {
        None
    };
    let result = handle
        .authenticate_publickey(
            target.user.clone(),
            PrivateKeyWithHashAlg::new(Arc::new(key), hash),
        )
        .await
        .map_err(|source| SshError::Handshake {
            addr: addr.clone(),
            source: Box::new(source),
        })?;
    match result {
        client::AuthResult::Success => Ok(()),
        client::AuthResult::Failure {
            partial_success: true,
            ..
        } => Err(auth_error(format!(
            "the server accepted key {fingerprint} but asks for a further authentication \
             method, which the operator does not have"
        ))),
        client::AuthResult::Failure { .. } => Err(auth_error(format!(
            "the server refused {} key {fingerprint}; add its public key to the user's \
             authorized_keys",
            algorithm.as_str()
        ))),
    }
}

/// How the server's host key is judged.
enum HostKeyPolicy {
    /// Against this known_hosts file.
    Verify(KnownHosts),
    /// Not at all (`insecureIgnoreHostKey`); warned on every dial.
    Insecure,
}

/// Errors the russh handler can end a session with: russh's own, or our host-key verdict
/// (carried out of the handshake as an error, so its message reaches the caller intact).
#[derive(Debug)]
enum HandlerError {
    Russh(russh::Error),
    HostKey(HostKeyError),
}

impl From<russh::Error> for HandlerError {
    fn from(e: russh::Error) -> Self {
        HandlerError::Russh(e)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Russh(e) => e.fmt(f),
            HandlerError::HostKey(e) => e.fmt(f),
        }
    }
}

/// The russh client handler of one session.
struct ClientHandler {
    policy: HostKeyPolicy,
    host: String,
    port: u16,
    addr: String,
    /// Dropped with the handler, i.e. when russh's session task ends: that is how
    /// [`SshSession`] learns the session is over.
    _done: watch::Sender<()>,
    /// Why the session ended, for later error messages.
    closed_reason: Arc<Mutex<Option<String>>>,
}

impl client::Handler for ClientHandler {
    type Error = HandlerError;

    async fn check_server_key(
        &mut self,
        offered: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let (key, is_certificate) = match offered {
            PublicKeyOrCertificate::PublicKey { key, .. } => (key.clone(), false),
            // We never ask for host certificates; should a server send one anyway, only
            // its bare key can be checked, against the same plain lines.
            PublicKeyOrCertificate::Certificate(cert) => (
                russh::keys::PublicKey::from(cert.public_key().clone()),
                true,
            ),
        };
        match &self.policy {
            HostKeyPolicy::Insecure => {
                tracing::warn!(
                    host = %self.addr,
                    fingerprint = %key.fingerprint(HashAlg::Sha256),
                    "host key NOT verified: insecureIgnoreHostKey is set for this host, so \
                     this connection could be intercepted"
                );
                Ok(true)
            }
            HostKeyPolicy::Verify(known) => match known.verify(&self.host, self.port, &key) {
                Ok(()) => Ok(true),
                Err(HostKeyError::Unknown { offered }) if is_certificate => {
                    Err(HandlerError::HostKey(HostKeyError::Certificate { offered }))
                }
                Err(e) => {
                    tracing::warn!(host = %self.addr, error = %e, "refusing SSH host key");
                    Err(HandlerError::HostKey(e))
                }
            },
        }
    }

    async fn disconnected(
        &mut self,
        reason: client::DisconnectReason<Self::Error>,
    ) -> Result<(), Self::Error> {
        let (text, result) = match reason {
            client::DisconnectReason::ReceivedDisconnect(info) => (
                format!(
                    "the server disconnected ({:?}: {})",
                    info.reason_code, info.message
                ),
                Ok(()),
            ),
            client::DisconnectReason::Error(e) => (e.to_string(), Err(e)),
        };
        tracing::debug!(host = %self.addr, reason = %text, "SSH session ended");
        if let Ok(mut slot) = self.closed_reason.lock() {
            slot.get_or_insert(text);
        }
        result
    }
}

/// An authenticated SSH session. Cheap to share behind an `Arc`: channels are opened
/// through `&self`. Dropping it ends the session and closes the TCP connection.
pub struct SshSession {
    handle: client::Handle<ClientHandler>,
    addr: String,
    channel_timeout: Duration,
    /// Dropping the sender kills the transport (see [`Killable`]).
    kill: Mutex<Option<oneshot::Sender<()>>>,
    /// Closed (its sender dropped) when russh's session task has ended.
    done: watch::Receiver<()>,
    closed_reason: Arc<Mutex<Option<String>>>,
}

impl fmt::Debug for SshSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SshSession")
            .field("addr", &self.addr)
            .field("closed", &self.is_closed())
            .finish_non_exhaustive()
    }
}

impl SshSession {
    /// `host:port` of the server.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// True once the session is over: closed by us, by the server, by a transport error
    /// or by missed keepalives. A closed session never comes back; dial a new one.
    pub fn is_closed(&self) -> bool {
        self.handle.is_closed() || self.done.has_changed().is_err()
    }

    /// Why the session ended, if it has and the reason is known.
    pub fn closed_reason(&self) -> Option<String> {
        self.closed_reason.lock().ok().and_then(|r| r.clone())
    }

    /// Sends an SSH ping (a keepalive that wants a reply) and waits for the answer, at
    /// most `deadline`. A health check for an idle link.
    pub async fn check_alive(&self, deadline: Duration) -> Result<(), SshError> {
        if self.is_closed() {
            return Err(self.disconnected());
        }
        match tokio::time::timeout(deadline, self.handle.send_ping()).await {
            Err(_) => Err(SshError::Timeout {
                addr: self.addr.clone(),
                stage: "keepalive probe",
                after: deadline,
            }),
            // russh reports success even when the session ended before the reply.
            Ok(Ok(())) if !self.is_closed() => Ok(()),
            Ok(_) => Err(self.disconnected()),
        }
    }

    /// Opens a `direct-streamlocal@openssh.com` channel to a unix socket on the host (as
    /// `ssh -L local:/remote/socket` does) and returns it as a byte stream. Bounded by
    /// the connect timeout, so a server that never answers cannot hang the caller.
    pub async fn open_streamlocal(&self, socket_path: &str) -> Result<ChannelStream, SshError> {
        if self.is_closed() {
            return Err(self.disconnected());
        }
        let open = self.handle.channel_open_direct_streamlocal(socket_path);
        match tokio::time::timeout(self.channel_timeout, open).await {
            Err(_) => Err(SshError::Timeout {
                addr: self.addr.clone(),
                stage: "opening a channel",
                after: self.channel_timeout,
            }),
            Ok(Ok(channel)) => Ok(ChannelStream {
                inner: channel.into_stream(),
                target: format!("{}:{socket_path}", self.addr),
            }),
            Ok(Err(source @ russh::Error::ChannelOpenFailure(_))) => Err(SshError::Channel {
                addr: self.addr.clone(),
                target: socket_path.to_string(),
                source: Box::new(source),
            }),
            Ok(Err(e)) if self.is_closed() => {
                tracing::debug!(host = %self.addr, error = %e, "channel open on a closed session");
                Err(self.disconnected())
            }
            Ok(Err(source)) => Err(SshError::Channel {
                addr: self.addr.clone(),
                target: socket_path.to_string(),
                source: Box::new(source),
            }),
        }
    }

    /// Ends the session: sends a disconnect message, waits briefly for russh to finish,
    /// then cuts the TCP connection regardless. When this returns, the socket is closed
    /// and russh's task is gone (or going: it has nothing left to wait for). Returns
    /// within three [`CLOSE_GRACE`] periods whatever the peer does.
    pub async fn close(&self) {
        if !self.is_closed() {
            // Queuing the message waits on russh's session loop, which a frozen peer can
            // hold in a blocked write: bounded like the rest.
            let disconnect = self.handle.disconnect(
                russh::Disconnect::ByApplication,
                DISCONNECT_DESCRIPTION,
                "en",
            );
            let sent = matches!(
                tokio::time::timeout(CLOSE_GRACE, disconnect).await,
                Ok(Ok(()))
            );
            if sent && self.wait_done(CLOSE_GRACE).await {
                self.kill_transport();
                return;
            }
        }
        self.kill_transport();
        if !self.wait_done(CLOSE_GRACE).await {
            tracing::debug!(host = %self.addr, "SSH session task still running after close");
        }
    }

    /// Waits until russh's session task has ended; false if `deadline` passed first.
    async fn wait_done(&self, deadline: Duration) -> bool {
        let mut done = self.done.clone();
        tokio::time::timeout(deadline, async { while done.changed().await.is_ok() {} })
            .await
            .is_ok()
    }

    /// Drops the kill switch: the transport fails on its next poll.
    fn kill_transport(&self) {
        if let Ok(mut kill) = self.kill.lock() {
            kill.take();
        }
    }

    /// The error for an operation on a session that is over.
    fn disconnected(&self) -> SshError {
        SshError::Disconnected {
            addr: self.addr.clone(),
            reason: self
                .closed_reason()
                .unwrap_or_else(|| "the session has ended".to_string()),
        }
    }
}

/// A stream that fails (and wakes its reader) as soon as its kill switch is dropped.
///
/// russh runs each session on a spawned task that owns the TCP stream. A task stuck in a
/// key exchange with a silent server does not notice that its handle was dropped; this
/// wrapper makes sure it does, so an abandoned dial never keeps a socket or a task.
struct Killable<S> {
    inner: S,
    kill: oneshot::Receiver<()>,
    killed: bool,
}

impl<S> Killable<S> {
    /// Polls the kill switch (registering the waker); true once it is dropped or fired.
    fn is_killed(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.killed && Pin::new(&mut self.kill).poll(cx).is_ready() {
            self.killed = true;
        }
        self.killed
    }
}

/// The error a killed stream reports.
fn killed_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "SSH connection closed by the operator",
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for Killable<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.is_killed(cx) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Killable<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.is_killed(cx) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.is_killed(cx) {
            return Poll::Ready(Err(killed_error()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.is_killed(cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::config::LibvirtDriver;

    #[test]
    fn aes_gcm_leads_only_with_hardware_aes() {
        let russh = russh::Preferred::default().cipher.to_vec();
        assert_eq!(
            russh[0],
            cipher::CHACHA20_POLY1305,
            "russh's own order changed"
        );
        let hw = cipher_order(&russh, true);
        assert_eq!(hw[0], cipher::AES_256_GCM);
        assert_eq!(hw.len(), russh.len(), "nothing added or dropped");
        assert!(russh.iter().all(|c| hw.contains(c)));
        let pos = |c| hw.iter().position(|x| *x == c).unwrap();
        assert!(pos(cipher::CHACHA20_POLY1305) < pos(cipher::AES_256_CTR));
        assert_eq!(cipher_order(&russh, false), russh);
    }

    fn ssh_config() -> SshConfig {
        SshConfig {
            user: "egress".into(),
            private_key_file: "/k/id".into(),
            known_hosts_file: "/k/known_hosts".into(),
            connect_timeout_seconds: 7,
            keepalive_interval_seconds: 15,
            keepalive_max_missed: 3,
        }
    }

    fn host(address: &str) -> HostConfig {
        HostConfig {
            name: "h1".into(),
            address: address.into(),
            libvirt_socket: crate::config::DEFAULT_LIBVIRT_SOCKET.into(),
            driver: LibvirtDriver::Qemu,
            storage_pool: "default".into(),
            bridge: "br0".into(),
            max_domains: 1,
            max_concurrent_creates: 1,
            insecure_ignore_host_key: false,
            disable_kvm: false,
            address_pool: None,
            bridge_network: None,
            bridge_mtu: None,
            cpu_placement: None,
            nvram_templates: Vec::new(),
        }
    }

    #[test]
    fn target_from_config() {
        for (address, h, port, addr) in [
            ("kvm1.example", "kvm1.example", 22, "kvm1.example:22"),
            ("10.0.0.5:2222", "10.0.0.5", 2222, "10.0.0.5:2222"),
            ("[fd00::1]:2200", "fd00::1", 2200, "[fd00::1]:2200"),
        ] {
            let t = SshTarget::from_config(&ssh_config(), &host(address)).unwrap();
            assert_eq!(
                (t.host.as_str(), t.port, t.addr()),
                (h, port, addr.to_string())
            );
            assert_eq!(t.connect_timeout, Duration::from_secs(7));
            assert_eq!(t.keepalive_max_missed, 3);
            assert_eq!(t.private_key_file, PathBuf::from("/k/id"));
        }
        let e = SshTarget::from_config(&ssh_config(), &host("a:b:c")).unwrap_err();
        assert_eq!(e.reason_code(), "config");
    }

    #[test]
    fn half_open_bound_and_address_shares() {
        let t = SshTarget::from_config(&ssh_config(), &host("h1")).unwrap();
        assert_eq!(
            t.half_open_bound(),
            t.keepalive_interval * (t.keepalive_max_missed + 1)
        );
        let c = client_config(&t, &HostKeyPolicy::Insecure);
        assert_eq!(
            c.inactivity_timeout,
            Some(t.half_open_bound() + t.keepalive_interval),
            "after the keepalives, so a silent link is reported as missed keepalives"
        );
        assert_eq!(c.keepalive_interval, Some(t.keepalive_interval));
        // One address gets the whole budget; several share it, never below the floor.
        let budget = Duration::from_secs(10);
        assert_eq!(per_address_timeout(budget, 1), budget);
        assert_eq!(per_address_timeout(budget, 2), Duration::from_secs(5));
        assert_eq!(per_address_timeout(budget, 0), budget);
        assert_eq!(per_address_timeout(budget, 50), MIN_ADDRESS_TIMEOUT);
    }

    #[tokio::test]
    async fn a_black_holed_first_address_does_not_starve_the_next() {
        // A loopback listener whose accept queue is full drops further SYNs, so a connect
        // to it hangs like one to a black-holed address (tests stay on loopback).
        let full =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        full.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        full.listen(0).unwrap();
        let black_hole = full.local_addr().unwrap().as_socket().unwrap();
        let mut fillers = Vec::new();
        for _ in 0..4 {
            if let Ok(Ok(s)) =
                tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(black_hole))
                    .await
            {
                fillers.push(s);
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let good = listener.local_addr().unwrap();
        let budget = Duration::from_secs(4);
        let hang_guard = Duration::from_secs(60);
        let s = tokio::time::timeout(hang_guard, connect_any(&[black_hole, good], "t", budget))
            .await
            .expect("hang guard: the first address ate the whole budget")
            .expect("the second address accepts");
        assert_eq!(s.peer_addr().unwrap(), good);
    }

    /// A public key (from `ssh-keygen -t ecdsa`); only its type matters here.
    const ECDSA_PUB: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBME00delIglzsVDQ8y9tukVHIE8OTXQ2Kb+fXHuDLmkxRA0KRGvCeEuFTav/UsAjfSFGrwO32r7Q4pgMspsZzjE=";

    #[test]
    fn config_prefers_known_host_key_types_and_drops_sha1_rsa() {
        let t = SshTarget::from_config(&ssh_config(), &host("h1:2022")).unwrap();
        let known = KnownHosts::parse(&format!("[h1]:2022 {ECDSA_PUB}"), Path::new("/k"));
        let c = client_config(&t, &HostKeyPolicy::Verify(known));
        assert_eq!(
            c.preferred.key.first(),
            Some(&Algorithm::Ecdsa {
                curve: russh::keys::EcdsaCurve::NistP256
            })
        );
        assert!(c.preferred.key.contains(&Algorithm::Ed25519));
        assert!(!c.preferred.key.contains(&Algorithm::Rsa { hash: None }));
        assert_eq!(c.keepalive_interval, Some(Duration::from_secs(15)));
        assert_eq!(c.keepalive_max, 3);

        let c = client_config(&t, &HostKeyPolicy::Insecure);
        assert_eq!(c.preferred.key.first(), Some(&Algorithm::Ed25519));
    }

    const OWN_RULE: &str = "readable by group or others";
    const NOT_OWNED_RULE: &str = "accessible by others (it is owned by uid";

    #[test]
    fn key_mode_rule_follows_openssh() {
        let me = Some(1000);
        for (mode, owner, me, refused_by) in [
            // Our own key: closed to group and others, as OpenSSH requires.
            (0o600, 1000, me, None),
            (0o400, 1000, me, None),
            (0o640, 1000, me, Some(OWN_RULE)),
            (0o440, 1000, me, Some(OWN_RULE)),
            (0o620, 1000, me, Some(OWN_RULE)),
            (0o604, 1000, me, Some(OWN_RULE)),
            (0o644, 1000, me, Some(OWN_RULE)),
            // Someone else's key (a Secret mount: root-owned, group fsGroup): group
            // access is fine, others' is not.
            (0o440, 0, me, None),
            (0o400, 0, me, None),
            (0o640, 0, me, None),
            (0o444, 0, me, Some(NOT_OWNED_RULE)),
            (0o404, 0, me, Some(NOT_OWNED_RULE)),
            (0o442, 0, me, Some(NOT_OWNED_RULE)),
            (0o441, 0, me, Some(NOT_OWNED_RULE)),
            // Running as root, a root-owned key is ours.
            (0o440, 0, Some(0), Some(OWN_RULE)),
            (0o400, 0, Some(0), None),
            // Who we are is unknown: the strict rule for every file.
            (0o440, 0, None, Some(OWN_RULE)),
            (0o400, 0, None, None),
        ] {
            let got = key_file_mode_problem(mode, owner, me);
            match (refused_by, &got) {
                (None, None) => {}
                (Some(rule), Some(msg)) => {
                    assert!(
                        msg.contains(rule),
                        "{mode:04o} owner {owner} me {me:?}: {msg}"
                    );
                    assert!(msg.contains(&format!("{mode:04o}")), "{msg}");
                }
                _ => panic!("{mode:04o} owner {owner} me {me:?}: want {refused_by:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn current_uid_is_the_owner_of_files_we_create() {
        use std::os::unix::fs::MetadataExt as _;
        let file = tempfile::NamedTempFile::new().unwrap();
        assert_eq!(
            current_uid(),
            Some(file.as_file().metadata().unwrap().uid())
        );
    }

    /// A file that passes or fails the mode check: its content is not a key, so a file
    /// the check lets through fails later, in parsing.
    fn not_a_key(dir: &Path, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.join(format!("key_{mode:04o}"));
        std::fs::write(&path, "not a key\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    async fn key_file_reason(path: &Path) -> String {
        match load_private_key(path).await {
            Err(SshError::KeyFile { reason, .. }) => reason,
            other => panic!("{}: want a key-file error, got {other:?}", path.display()),
        }
    }

    #[tokio::test]
    async fn own_key_file_must_be_closed_to_group_and_others() {
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o440, 0o640, 0o644, 0o604] {
            let reason = key_file_reason(&not_a_key(dir.path(), mode)).await;
            assert!(
                reason.contains(OWN_RULE) && reason.contains(&format!("{mode:04o}")),
                "{reason}"
            );
        }
        for mode in [0o400, 0o600] {
            let reason = key_file_reason(&not_a_key(dir.path(), mode)).await;
            assert_eq!(reason, "is not a valid OpenSSH or PEM private key");
        }
    }

    /// Needs root (to give a file to another user); skipped otherwise.
    #[tokio::test]
    async fn key_file_owned_by_another_user_may_be_group_readable_but_not_world_readable() {
        if current_uid() != Some(0) {
            eprintln!("skipped: needs root to chown a file to another user");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        // What the kubelet makes of a Secret with defaultMode 0400 and fsGroup 65532, seen
        // from the other side: the file belongs to someone else, and its group may read it.
        let give_away = |path: &Path| std::os::unix::fs::chown(path, Some(65532), Some(65532));
        for mode in [0o440, 0o400, 0o640] {
            let path = not_a_key(dir.path(), mode);
            give_away(&path).unwrap();
            let reason = key_file_reason(&path).await;
            assert_eq!(
                reason, "is not a valid OpenSSH or PEM private key",
                "{mode:04o}"
            );
        }
        for mode in [0o444, 0o404, 0o644] {
            let path = not_a_key(dir.path(), mode);
            give_away(&path).unwrap();
            let reason = key_file_reason(&path).await;
            assert!(
                reason.contains(NOT_OWNED_RULE)
                    && reason.contains("uid 65532")
                    && reason.contains(&format!("{mode:04o}")),
                "{reason}"
            );
        }
    }
}
