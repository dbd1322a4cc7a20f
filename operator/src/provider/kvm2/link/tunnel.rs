//! The host's libvirt socket, reachable as a private local unix socket.
//!
//! Why this shape: the `virt` crate (libvirt's C client) opens its own connections from
//! a URI. Its transports are unix sockets, TLS, TCP and `ssh`/`libssh` (which need an
//! `ssh` binary or libssh2 settings we do not control, and bypass our host-key checks and
//! deadlines). A unix socket of our own is the one transport that lets us keep the SSH
//! session in Rust: libvirt connects to `qemu+unix:///system?socket=<path>` (or
//! `test+unix:///default?socket=<path>`), and every connection it makes on that socket is
//! carried over one `direct-streamlocal@openssh.com` channel of the host's SSH session to
//! the host's libvirt socket (like `ssh -L local.sock:/var/run/libvirt/libvirt-sock`).
//!
//! The socket lives in a fresh directory with mode 0700, so only the operator's user can
//! connect: the socket is as good as an authenticated libvirt connection. Closing or
//! dropping the [`Tunnel`] stops accepting, closes every forwarded connection and its
//! channel, and removes the socket and its directory (invariant 3).

use std::fmt;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tempfile::TempDir;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::{JoinHandle, JoinSet};

use super::errors::SshError;
use super::ssh::SshSession;
use crate::config::LibvirtDriver;

/// Owner-only: anyone who can connect to the socket speaks to libvirt as our SSH user.
const TUNNEL_DIR_MODE: u32 = 0o700;

/// Name of the socket inside the private directory.
const SOCKET_NAME: &str = "libvirt-sock";

/// Pause after a failed accept (e.g. out of file descriptors) so the loop does not spin
/// while the condition lasts; short, because a libvirt client is waiting.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// Buffer of the libvirt → host direction of each forwarded connection. tokio's default
/// of 8 KiB cut an image upload into 8 KiB SSH packets, a quarter of what OpenSSH's
/// sshd accepts (32 KiB), so sshd and libvirtd paid their per-packet cost (a read, a
/// decrypt, a write) four times per byte. This holds a whole libvirt stream message
/// (256 KiB of data plus its header) in one read, which then leaves as packets of the
/// peer's maximum size.
const UP_BUFFER: usize = 256 * 1024 + 4096;

/// Buffer of the host → libvirt direction: replies and the occasional volume download;
/// large enough to fill the peer's 32 KiB packets twice.
const DOWN_BUFFER: usize = 64 * 1024;

/// A local unix socket forwarding every connection to a unix socket on an SSH host.
pub struct Tunnel {
    socket_path: PathBuf,
    remote_socket: String,
    addr: String,
    active: Arc<AtomicUsize>,
    /// Why the last channel to the remote socket could not be opened: libvirt only sees
    /// its local connection close, so the dial asks here for the real reason.
    refused: Arc<Mutex<Option<SshError>>>,
    /// The accept loop; it owns the listener and every forwarding task.
    task: Option<JoinHandle<()>>,
    /// Removed (with the socket) when the tunnel is closed or dropped.
    dir: Option<TempDir>,
}

impl fmt::Debug for Tunnel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tunnel")
            .field("socket_path", &self.socket_path)
            .field("remote_socket", &self.remote_socket)
            .field("addr", &self.addr)
            .field("active", &self.active_connections())
            .finish_non_exhaustive()
    }
}

impl Tunnel {
    /// Creates the private socket and starts accepting. Each accepted connection opens its
    /// own channel to `remote_socket` on `session`'s host. Must run inside a tokio runtime.
    pub async fn start(
        session: Arc<SshSession>,
        remote_socket: impl Into<String>,
    ) -> Result<Self, SshError> {
        let dir = tempfile::Builder::new()
            .prefix("egress-operator-ssh-")
            .permissions(std::fs::Permissions::from_mode(TUNNEL_DIR_MODE))
            .tempdir()
            .map_err(|source| SshError::Tunnel {
                path: std::env::temp_dir(),
                source,
            })?;
        let socket_path = dir.path().join(SOCKET_NAME);
        let listener = UnixListener::bind(&socket_path).map_err(|source| SshError::Tunnel {
            path: socket_path.clone(),
            source,
        })?;
        let remote_socket = remote_socket.into();
        let addr = session.addr().to_string();
        let active = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(Mutex::new(None));
        let task = tokio::spawn(accept_loop(
            listener,
            session,
            remote_socket.clone(),
            Arc::clone(&active),
            Arc::clone(&refused),
        ));
        tracing::debug!(host = %addr, local = %socket_path.display(), remote = %remote_socket, "tunnel started");
        Ok(Self {
            socket_path,
            remote_socket,
            addr,
            active,
            refused,
            task: Some(task),
            dir: Some(dir),
        })
    }

    /// The local socket libvirt connects to.
    pub fn local_socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// The libvirt URI for this tunnel: `qemu+unix:///system?socket=...` or
    /// `test+unix:///default?socket=...`. The path is ours (temp dir plus a fixed name),
    /// made of characters that need no escaping in a URI query.
    pub fn libvirt_uri(&self, driver: LibvirtDriver) -> String {
        let (scheme, path) = match driver {
            LibvirtDriver::Qemu => ("qemu", "system"),
            LibvirtDriver::Test => ("test", "default"),
        };
        format!(
            "{scheme}+unix:///{path}?socket={}",
            self.socket_path.display()
        )
    }

    /// Takes the reason the last channel open was refused, if one was (e.g. the remote
    /// socket does not exist, or sshd forbids streamlocal forwarding).
    pub fn take_channel_error(&self) -> Option<SshError> {
        self.refused.lock().ok().and_then(|mut r| r.take())
    }

    /// Forwarded connections currently open.
    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Stops accepting, closes every forwarded connection (and its channel), and removes
    /// the socket and its directory; returns once all of that is done.
    pub async fn close(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // Cancelled is the expected outcome; a panic inside would be a bug to report.
            if let Err(e) = task.await
                && e.is_panic()
            {
                tracing::error!(host = %self.addr, "tunnel task panicked");
            }
        }
        if let Some(dir) = self.dir.take() {
            let path = dir.path().to_path_buf();
            if let Err(e) = dir.close() {
                tracing::warn!(dir = %path.display(), error = %e, "cannot remove tunnel directory");
            }
        }
    }
}

impl Drop for Tunnel {
    fn drop(&mut self) {
        // Aborting drops the accept loop at its next poll, which drops the listener and
        // the JoinSet, which aborts every forwarding task (closing its channel and local
        // stream). The directory goes now, with `dir`.
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Accepts local connections until aborted; forwards each on its own task, all owned by
/// one JoinSet so that aborting this loop ends them too.
async fn accept_loop(
    listener: UnixListener,
    session: Arc<SshSession>,
    remote: String,
    active: Arc<AtomicUsize>,
    refused: Arc<Mutex<Option<SshError>>>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((local, _)) => {
                    let guard = ActiveGuard::new(Arc::clone(&active));
                    conns.spawn(forward(
                        local,
                        Arc::clone(&session),
                        remote.clone(),
                        Arc::clone(&refused),
                        guard,
                    ));
                }
                Err(e) => {
                    tracing::warn!(host = %session.addr(), error = %e, "tunnel accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                }
            },
            // Reap finished forwards so the set does not grow without bound.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Copies one local connection to a fresh channel and back until either side closes.
async fn forward(
    mut local: UnixStream,
    session: Arc<SshSession>,
    remote: String,
    refused: Arc<Mutex<Option<SshError>>>,
    _guard: ActiveGuard,
) {
    let mut channel = match session.open_streamlocal(&remote).await {
        Ok(c) => c,
        Err(e) => {
            // Kept for the dial to report (libvirt sees only its connection close, which
            // it does at once when `local` drops below).
            tracing::warn!(host = %session.addr(), error = %e, "tunnel: cannot open channel");
            if let Ok(mut r) = refused.lock() {
                *r = Some(e);
            }
            return;
        }
    };
    match tokio::io::copy_bidirectional_with_sizes(&mut local, &mut channel, UP_BUFFER, DOWN_BUFFER)
        .await
    {
        Ok((up, down)) => {
            tracing::trace!(host = %session.addr(), up, down, "tunnel connection closed");
        }
        Err(e) => {
            tracing::debug!(host = %session.addr(), error = %e, "tunnel connection ended");
        }
    }
}

/// Counts a forwarded connection for as long as its task lives (also when aborted).
struct ActiveGuard(Arc<AtomicUsize>);

impl ActiveGuard {
    fn new(active: Arc<AtomicUsize>) -> Self {
        active.fetch_add(1, Ordering::Relaxed);
        Self(active)
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
