//! The hosts table: one cached link (SSH session + tunnel + libvirt connection) per host.
//!
//! How failures stay contained (each rule answers a way one slow call or one bad host used
//! to spread failures across the fleet):
//!
//! - **Single flight, for failures too.** One dial per host at a time, run on its own task:
//!   every caller that arrives meanwhile waits on it and gets its result, the link or the
//!   classified error with its reason (a wrong host key is `host-key`/permanent for all
//!   fifty waiters, not fifty dials). A caller that gives up waiting does not cancel the
//!   dial, so its outcome still lands in the table and feeds the backoff.
//! - **Backoff that remembers.** After a failed dial, callers within the backoff window
//!   ([`BACKOFF_BASE`] doubling up to [`BACKOFF_MAX`]) get the remembered error at once
//!   instead of redialling.
//! - **Eviction only on evidence.** A link is dropped when its SSH session has closed
//!   (keepalives missed, server gone), when libvirt reports a broken transport, or when a
//!   liveness probe ([`PROBE_DEADLINE`]: an SSH ping and libvirt's own keepalive state)
//!   fails after a call timed out. A timeout alone is not evidence: a slow call must not
//!   kill the other calls in flight on the same link, uploads included.
//! - **Nothing waits on a lock across I/O.** The table's lock is held for a copy in or
//!   out only; evicting never waits behind a dial, and closing runs in the background,
//!   bounded by [`SshSession::close`]'s own grace periods.
//! - **Per-host slots.** Every call runs in its host's blocking pool ([`super::pool`]);
//!   a full pool is `busy`, never a link failure.
//!
//! - **A missing libvirt socket is transient until it has stayed missing.** A socket that
//!   answered before in this process is libvirtd restarting ([`HostError::SocketGone`]).
//!   One that never answered may be a wrong path, or a host that booted sshd before
//!   libvirtd, or a new replica that never saw it answer: the table asks again for
//!   [`SOCKET_PATIENCE`] from the first refusal ([`HostError::SocketNotYet`], transient)
//!   and calls it permanent only when every dial in that window was refused. The
//!   evidence is time, which a restart of the operator does not fake.
//!
//! [`Hosts::close`] closes every link concurrently, within [`CLOSE_BOUND`]; dropping the
//! table aborts dials and closes links without waiting. [`Hosts::sever`] closes them too
//! and refuses every new link until [`Hosts::reconnect`]: a replica that lost the leader
//! lease cuts itself off the hosts that way, so no request of its reaches a host after.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::AbortHandle;
use virt::connect::Connect;

use super::errors::SshError;
use super::libvirt::{BlockingPool, Keepalive, Lane, LibvirtConn, LibvirtError};
use super::observe::CallMetrics;
use super::ssh::{self, SshSession, SshTarget};
use super::tunnel::Tunnel;
use crate::config::{HostConfig, SshConfig};
use crate::error::{Classified, ErrorClass};

/// Default deadline of one libvirt call: generous for a define or start over a WAN.
pub const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(30);
/// First redial delay after a failed dial.
pub const BACKOFF_BASE: Duration = Duration::from_millis(200);
/// Longest redial delay: a recovered host is back in use within this.
pub const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// How long a libvirt socket that never answered is asked again before its refusal is
/// called permanent: a rebooting host starts libvirtd well within this after sshd, and
/// a wrong path is reported as permanent soon enough for an admin to act on it.
pub const SOCKET_PATIENCE: Duration = Duration::from_secs(120);

/// Bound of the liveness probe run after a call timed out: an SSH round trip, however
/// slow the link, answers well within it.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(5);
/// Bound of [`Hosts::close`]: every link's close runs at once, each bounded by its own
/// grace periods; this is the backstop.
pub const CLOSE_BOUND: Duration = Duration::from_secs(10);
/// How often [`Hosts::sever`] looks whether the threads it released have returned.
const SEVER_POLL: Duration = Duration::from_millis(20);
/// libvirt keepalive: probe every 5 s, give up after 3 misses (15 s), well before the
/// default call deadline, so an idle dead link is noticed by libvirt too.
pub const LIBVIRT_KEEPALIVE: Keepalive = Keepalive {
    interval_seconds: 5,
    count: 3,
};

/// A failure reaching or using a host.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The host is not in the config.
    #[error("host {0:?} is not configured")]
    Unknown(String),
    /// The SSH layer failed.
    #[error(transparent)]
    Ssh(#[from] SshError),
    /// libvirt failed.
    #[error("host {host}: {source}")]
    Libvirt {
        /// The host.
        host: String,
        /// The libvirt error.
        #[source]
        source: LibvirtError,
    },
    /// The host's libvirt socket refused our channel although it worked before in this
    /// process: libvirtd is most likely restarting, so this passes (a socket that never
    /// worked is a wrong path, which does not).
    #[error("host {host}: {source} (it answered before: libvirtd may be restarting)")]
    SocketGone {
        /// The host.
        host: String,
        /// The channel refusal.
        #[source]
        source: SshError,
    },
    /// The host's libvirt socket refused our channel, and has not answered in this process
    /// yet, but the first refusal is recent: libvirtd may still be starting (a host that
    /// booted, a new replica), so this is asked again before it is called permanent.
    #[error(
        "host {host}: {source} (refused for {waited_secs} s of the {patience_secs} s it is \
         asked again before this is called permanent: libvirtd may still be starting)"
    )]
    SocketNotYet {
        /// The host.
        host: String,
        /// The channel refusal (boxed: it keeps every error of a host call small).
        #[source]
        source: Box<SshError>,
        /// Seconds since the first refusal.
        waited_secs: u64,
        /// [`SOCKET_PATIENCE`] as configured.
        patience_secs: u64,
    },
    /// The hosts table was closed while the call waited for a dial.
    #[error("host {0:?}: the hosts table is closed")]
    Closed(String),
    /// This replica lost the leader lease and cut itself off the hosts ([`Hosts::sever`]).
    #[error("host {0:?}: cut off: this replica lost the leader lease")]
    Severed(String),
    /// A dial's failure, shared by every caller that waited on that dial or came during
    /// its backoff window: the same reason and class for all of them.
    #[error(transparent)]
    Shared(Arc<HostError>),
}

impl HostError {
    /// A short, stable reason code for status, metrics and the `check` command.
    pub fn reason_code(&self) -> &'static str {
        match self {
            HostError::Unknown(_) => "unknown-host",
            HostError::Ssh(e) => e.reason_code(),
            HostError::Libvirt { source, .. } => match source {
                LibvirtError::Timeout { .. } => "timeout",
                LibvirtError::Busy { .. } => "busy",
                LibvirtError::Dead { .. } => "disconnected",
                _ => "libvirt",
            },
            HostError::SocketGone { .. } | HostError::SocketNotYet { .. } => "libvirt-socket",
            HostError::Closed(_) => "closed",
            HostError::Severed(_) => "severed",
            HostError::Shared(e) => e.reason_code(),
        }
    }

    /// The stage of a dial that failed (`dns`, `tcp-connect`, `ssh-handshake`,
    /// `ssh-auth`, `channel`, `libvirt-open`, ...), when this is a dial failure.
    pub fn stage(&self) -> Option<&'static str> {
        match self {
            HostError::Unknown(_) => Some("config"),
            HostError::Ssh(e) | HostError::SocketGone { source: e, .. } => e.stage(),
            HostError::SocketNotYet { source, .. } => source.stage(),
            HostError::Libvirt { source, .. } => {
                (source.op() == Some("open")).then_some("libvirt-open")
            }
            HostError::Closed(_) | HostError::Severed(_) => None,
            HostError::Shared(e) => e.stage(),
        }
    }

    /// The libvirt error, if that is what failed.
    pub fn libvirt(&self) -> Option<&LibvirtError> {
        match self {
            HostError::Libvirt { source, .. } => Some(source),
            HostError::Shared(e) => e.libvirt(),
            _ => None,
        }
    }
}

/// Whether sshd refused the channel to the libvirt socket for a reason other than
/// forwarding being forbidden (socket missing, connection refused).
fn e_is_refusal(e: &SshError) -> bool {
    matches!(e, SshError::Channel { .. }) && e.reason_code() == "libvirt-socket"
}

impl Classified for HostError {
    fn class(&self) -> ErrorClass {
        match self {
            HostError::Unknown(_) => ErrorClass::Permanent,
            HostError::Ssh(e) => e.class(),
            HostError::Libvirt { source, .. } => source.class(),
            HostError::SocketGone { .. }
            | HostError::SocketNotYet { .. }
            | HostError::Closed(_)
            | HostError::Severed(_) => ErrorClass::Transient,
            HostError::Shared(e) => e.class(),
        }
    }
}

/// A live connection to one host's libvirt.
pub struct HostLink {
    conn: LibvirtConn,
    /// Taken out when the link is closed, possibly while calls still hold the link.
    tunnel: std::sync::Mutex<Option<Tunnel>>,
    session: Arc<SshSession>,
    /// A liveness probe is running (one at a time per link).
    probing: AtomicBool,
}

impl std::fmt::Debug for HostLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLink")
            .field("conn", &self.conn)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl HostLink {
    /// Dials SSH, starts the tunnel, and opens libvirt through it. Whatever was set up
    /// before a failure is closed before returning.
    pub async fn dial(
        target: &SshTarget,
        host: &HostConfig,
        pool: &BlockingPool,
        open_deadline: Duration,
    ) -> Result<Self, HostError> {
        let session = Arc::new(ssh::connect(target).await?);
        let tunnel = match Tunnel::start(session.clone(), host.libvirt_socket.clone()).await {
            Ok(t) => t,
            Err(e) => {
                session.close().await;
                return Err(e.into());
            }
        };
        let uri = tunnel.libvirt_uri(host.driver);
        match LibvirtConn::open(pool, &uri, open_deadline, Some(LIBVIRT_KEEPALIVE)).await {
            Ok(conn) => Ok(Self {
                conn,
                tunnel: std::sync::Mutex::new(Some(tunnel)),
                session,
                probing: AtomicBool::new(false),
            }),
            Err(source) => {
                // When sshd refused the channel to the libvirt socket, libvirt only saw
                // the local end close; the tunnel kept sshd's reason: report that.
                let refused = tunnel.take_channel_error();
                tunnel.close().await;
                session.close().await;
                Err(match refused {
                    Some(e) => HostError::Ssh(e),
                    None => HostError::Libvirt {
                        host: host.name.clone(),
                        source,
                    },
                })
            }
        }
    }

    /// Whether this link must be replaced.
    pub fn is_dead(&self) -> bool {
        self.conn.is_dead() || self.session.is_closed()
    }

    /// The libvirt connection.
    pub fn conn(&self) -> &LibvirtConn {
        &self.conn
    }

    /// Whether the link still works, within `deadline`: an SSH ping answered (the
    /// transport and sshd are alive) and libvirt's keepalive has not given up on the
    /// connection (libvirtd answers). Neither needs a slot of the host's pool.
    pub async fn probe(&self, deadline: Duration) -> Result<(), HostError> {
        if self.is_dead() {
            return Err(HostError::Libvirt {
                host: self.session.addr().to_string(),
                source: LibvirtError::Dead {
                    uri: self.conn.uri().to_string(),
                },
            });
        }
        self.session.check_alive(deadline).await?;
        if self.conn.is_alive(deadline).await {
            Ok(())
        } else {
            Err(HostError::Libvirt {
                host: self.session.addr().to_string(),
                source: LibvirtError::Dead {
                    uri: self.conn.uri().to_string(),
                },
            })
        }
    }

    /// Closes the tunnel (which releases any thread blocked in libvirt, even while calls
    /// still hold this link), then the SSH session. The libvirt connection itself is
    /// closed on a blocking thread when the last holder drops the link. Bounded: the
    /// tunnel closes at once, the session within its grace periods.
    pub async fn close(&self) {
        self.conn.mark_dead();
        let tunnel = self.tunnel.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = tunnel {
            t.close().await;
        }
        self.session.close().await;
    }
}

/// The outcome of one dial, as every waiter sees it.
type DialOutcome = Result<Arc<HostLink>, Arc<HostError>>;

/// A dial in progress.
struct DialInFlight {
    done: watch::Receiver<Option<DialOutcome>>,
    task: AbortHandle,
}

#[derive(Default)]
struct State {
    link: Option<Arc<HostLink>>,
    dial: Option<DialInFlight>,
    failures: u32,
    last_failure: Option<(Instant, Arc<HostError>)>,
    /// A dial of this host has succeeded in this process (see [`HostError::SocketGone`]).
    worked: bool,
    /// Since when every dial was refused by the libvirt socket (see
    /// [`HostError::SocketNotYet`]).
    refused_since: Option<Instant>,
}

struct Entry {
    name: String,
    host: HostConfig,
    target: SshTarget,
    pool: BlockingPool,
    state: Mutex<State>,
}

impl Entry {
    /// The table's lock: held only for a copy in or out, never across an `.await`. A
    /// panic while it is held cannot leave the state half-written (every write is a field
    /// store), so a poisoned lock is still consistent.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drops `link` from the table if it is still the current one, and closes it in the
    /// background (which also frees any thread blocked on it).
    fn evict(&self, link: &Arc<HostLink>, cause: &'static str, metrics: &CallMetrics) {
        let old = {
            let mut st = self.state();
            if st.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
                st.link.take()
            } else {
                None
            }
        };
        if let Some(old) = old {
            tracing::info!(host = %self.name, cause, "dropping the host's link");
            metrics.evicted(&self.name, cause);
            close_in_background(old);
        }
    }
}

/// The table of all configured hosts.
pub struct Hosts {
    entries: BTreeMap<String, Arc<Entry>>,
    metrics: Arc<CallMetrics>,
    call_deadline: Duration,
    socket_patience: Duration,
    /// Set by [`Hosts::sever`], cleared by [`Hosts::reconnect`]: no link is handed out.
    severed: AtomicBool,
}

impl std::fmt::Debug for Hosts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hosts")
            .field("hosts", &self.entries.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

fn backoff(failures: u32) -> Duration {
    let factor = 1u32
        .checked_shl(failures.saturating_sub(1).min(16))
        .unwrap_or(u32::MAX);
    BACKOFF_BASE.saturating_mul(factor).min(BACKOFF_MAX)
}

/// Dials `entry`'s host and records the outcome in its state, then tells the waiters.
/// Runs on its own task, so a waiter that gives up does not cancel it.
async fn dial_task(
    entry: Arc<Entry>,
    metrics: Arc<CallMetrics>,
    open_deadline: Duration,
    socket_patience: Duration,
    done: watch::Sender<Option<DialOutcome>>,
) {
    let result = HostLink::dial(&entry.target, &entry.host, &entry.pool, open_deadline).await;
    let outcome = {
        let mut st = entry.state();
        st.dial = None;
        match result {
            Ok(link) => {
                let link = Arc::new(link);
                st.link = Some(link.clone());
                st.failures = 0;
                st.last_failure = None;
                st.worked = true;
                st.refused_since = None;
                Ok(link)
            }
            Err(e) => {
                let refused = matches!(&e, HostError::Ssh(source) if e_is_refusal(source));
                if !refused {
                    st.refused_since = None;
                }
                let e = match e {
                    HostError::Ssh(source) if st.worked && e_is_refusal(&source) => {
                        HostError::SocketGone {
                            host: entry.name.clone(),
                            source,
                        }
                    }
                    HostError::Ssh(source) if e_is_refusal(&source) => {
                        let since = *st.refused_since.get_or_insert_with(Instant::now);
                        let waited = since.elapsed();
                        if waited < socket_patience {
                            HostError::SocketNotYet {
                                host: entry.name.clone(),
                                source: Box::new(source),
                                waited_secs: waited.as_secs(),
                                patience_secs: socket_patience.as_secs(),
                            }
                        } else {
                            HostError::Ssh(source)
                        }
                    }
                    other => other,
                };
                let e = Arc::new(e);
                st.failures = st.failures.saturating_add(1);
                st.last_failure = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    };
    match &outcome {
        Ok(_) => metrics.dialled(&entry.name, None),
        Err(e) => {
            metrics.dialled(&entry.name, Some(e.reason_code()));
            tracing::warn!(host = %entry.name, reason = e.reason_code(), stage = e.stage().unwrap_or(""),
                class = e.class().as_str(), error = %e, "dial failed");
        }
    }
    done.send_replace(Some(outcome));
}

impl Hosts {
    /// A table for `hosts`, logging in with `ssh`. Each host gets its own lanes of
    /// blocking slots with `pool`'s limits, all under `pool`'s process-wide bound.
    /// Nothing is dialled until first use.
    pub fn new(
        ssh_config: &SshConfig,
        hosts: &[HostConfig],
        pool: BlockingPool,
        metrics: Arc<CallMetrics>,
    ) -> Result<Self, HostError> {
        let mut entries = BTreeMap::new();
        for h in hosts {
            let target = SshTarget::from_config(ssh_config, h)?;
            entries.insert(
                h.name.clone(),
                Arc::new(Entry {
                    name: h.name.clone(),
                    host: h.clone(),
                    target,
                    pool: pool.for_host(&h.name, metrics.clone()),
                    state: Mutex::new(State::default()),
                }),
            );
        }
        Ok(Self {
            entries,
            metrics,
            call_deadline: DEFAULT_CALL_DEADLINE,
            socket_patience: SOCKET_PATIENCE,
            severed: AtomicBool::new(false),
        })
    }

    /// Sets how long a libvirt socket that never answered is asked again before its
    /// refusal is permanent (default [`SOCKET_PATIENCE`]).
    pub fn with_socket_patience(mut self, patience: Duration) -> Self {
        self.socket_patience = patience;
        self
    }

    /// Sets the default deadline of calls.
    pub fn with_call_deadline(mut self, deadline: Duration) -> Self {
        self.call_deadline = deadline;
        self
    }

    /// Configured host names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The libvirt driver `host` is configured with (`None` for an unknown host).
    pub fn driver(&self, host: &str) -> Option<crate::config::LibvirtDriver> {
        self.entries.get(host).map(|e| e.host.driver)
    }

    fn entry(&self, host: &str) -> Result<&Arc<Entry>, HostError> {
        self.entries
            .get(host)
            .ok_or_else(|| HostError::Unknown(host.to_string()))
    }

    /// `host`'s blocking pool (tests and metrics).
    pub fn pool(&self, host: &str) -> Result<&BlockingPool, HostError> {
        Ok(&self.entry(host)?.pool)
    }

    /// The live link to `host`, waiting at most `deadline`: the cached one, or the result
    /// of the one dial in flight (started now if none is and the backoff allows).
    pub async fn link(&self, host: &str, deadline: Duration) -> Result<Arc<HostLink>, HostError> {
        let link = self.link_unchecked(host, deadline).await?;
        // Checked after the wait too: a dial that began before a cut must not be used.
        if self.severed.load(Ordering::SeqCst) {
            return Err(HostError::Severed(host.to_string()));
        }
        Ok(link)
    }

    async fn link_unchecked(
        &self,
        host: &str,
        deadline: Duration,
    ) -> Result<Arc<HostLink>, HostError> {
        let entry = self.entry(host)?;
        if self.severed.load(Ordering::SeqCst) {
            return Err(HostError::Severed(host.to_string()));
        }
        let mut done = {
            let mut st = entry.state();
            if let Some(link) = &st.link {
                if !link.is_dead() {
                    return Ok(link.clone());
                }
                if let Some(old) = st.link.take() {
                    tracing::info!(host, "libvirt link is dead; redialling");
                    self.metrics.evicted(host, "closed");
                    close_in_background(old);
                }
            }
            match &st.dial {
                Some(d) => d.done.clone(),
                None => {
                    if let Some((at, e)) = &st.last_failure
                        && at.elapsed() < backoff(st.failures)
                    {
                        return Err(HostError::Shared(e.clone()));
                    }
                    let (tx, rx) = watch::channel(None);
                    let task = tokio::spawn(dial_task(
                        entry.clone(),
                        self.metrics.clone(),
                        self.call_deadline,
                        self.socket_patience,
                        tx,
                    ));
                    st.dial = Some(DialInFlight {
                        done: rx.clone(),
                        task: task.abort_handle(),
                    });
                    rx
                }
            }
        };
        let waited = tokio::time::timeout(deadline, async {
            done.wait_for(Option::is_some).await.map(|v| v.clone())
        })
        .await;
        match waited {
            Err(_) => Err(HostError::Libvirt {
                host: host.to_string(),
                source: LibvirtError::Timeout {
                    op: "dial",
                    after: deadline,
                },
            }),
            Ok(Err(_)) | Ok(Ok(None)) => Err(HostError::Closed(host.to_string())),
            Ok(Ok(Some(Ok(link)))) => Ok(link),
            Ok(Ok(Some(Err(e)))) => Err(HostError::Shared(e)),
        }
    }

    /// Runs `f` against `host`'s libvirt with the default deadline.
    pub async fn call<T, F>(&self, host: &str, op: &'static str, f: F) -> Result<T, HostError>
    where
        T: Send + 'static,
        F: Fn(&Connect) -> Result<T, virt::error::Error> + Send + Sync + 'static,
    {
        self.call_within(host, op, self.call_deadline, f).await
    }

    /// Runs `f` against `host`'s libvirt within `deadline`, in the ordinary lane.
    pub async fn call_within<T, F>(
        &self,
        host: &str,
        op: &'static str,
        deadline: Duration,
        f: F,
    ) -> Result<T, HostError>
    where
        T: Send + 'static,
        F: Fn(&Connect) -> Result<T, virt::error::Error> + Send + Sync + 'static,
    {
        self.call_in(host, Lane::Call, op, deadline, f).await
    }

    /// Runs `f` against `host`'s libvirt within `deadline`, in `lane` of the host's pool.
    ///
    /// A transport failure (the daemon restarted, the SSH link dropped) evicts the link and
    /// `f` is retried once on a fresh one: every operation the provider makes is
    /// idempotent, and this is what lets the first call after a libvirtd restart succeed.
    /// A timeout is not retried (its deadline is spent) and evicts nothing by itself: a
    /// bounded liveness probe runs in the background and evicts only a link that fails it.
    pub async fn call_in<T, F>(
        &self,
        host: &str,
        lane: Lane,
        op: &'static str,
        deadline: Duration,
        f: F,
    ) -> Result<T, HostError>
    where
        T: Send + 'static,
        F: Fn(&Connect) -> Result<T, virt::error::Error> + Send + Sync + 'static,
    {
        let entry = self.entry(host)?.clone();
        let f = Arc::new(f);
        let metrics = self.metrics.clone();
        metrics
            .observe(host, op, async {
                let started = tokio::time::Instant::now();
                let mut retried = false;
                loop {
                    let remaining = deadline.saturating_sub(started.elapsed());
                    let link = self.link(host, remaining).await?;
                    let g = f.clone();
                    let remaining = deadline.saturating_sub(started.elapsed());
                    let result = link.conn().call_in(lane, op, remaining, move |c| g(c)).await;
                    let wrap = |source| HostError::Libvirt {
                        host: host.to_string(),
                        source,
                    };
                    match result {
                        Ok(v) => return Ok(v),
                        Err(e @ LibvirtError::Timeout { .. }) => {
                            probe_in_background(entry.clone(), link, self.metrics.clone());
                            return Err(wrap(e));
                        }
                        Err(e) if e.is_link_failure() => {
                            entry.evict(&link, "transport", &self.metrics);
                            if retried || started.elapsed() >= deadline {
                                return Err(wrap(e));
                            }
                            tracing::info!(host, op, error = %e, "link failed; retrying once on a fresh link");
                            retried = true;
                        }
                        Err(e) => return Err(wrap(e)),
                    }
                }
            })
            .await
    }

    /// Dials `host` on a connection of its own (never the shared link, so a check cannot
    /// disturb running calls and always exercises a fresh handshake), runs `f` on it in a
    /// small pool of its own (so it answers even when the host's pool is full), and closes
    /// it: all within `deadline`, the close within its own bound.
    pub async fn with_dedicated_link<T, F>(
        &self,
        host: &str,
        op: &'static str,
        deadline: Duration,
        f: F,
    ) -> Result<T, HostError>
    where
        T: Send + 'static,
        F: FnOnce(&Connect) -> Result<T, virt::error::Error> + Send + 'static,
    {
        let entry = self.entry(host)?;
        let pool = BlockingPool::with_limits(super::pool::PoolLimits {
            calls_per_host: 1,
            transfers_per_host: 1,
            total: 1,
        });
        let started = tokio::time::Instant::now();
        let link = tokio::time::timeout(
            deadline,
            HostLink::dial(&entry.target, &entry.host, &pool, deadline),
        )
        .await
        .map_err(|_| HostError::Libvirt {
            host: host.to_string(),
            source: LibvirtError::Timeout {
                op: "dial",
                after: deadline,
            },
        })??;
        let remaining = deadline.saturating_sub(started.elapsed());
        let result =
            link.conn()
                .call(op, remaining, f)
                .await
                .map_err(|source| HostError::Libvirt {
                    host: host.to_string(),
                    source,
                });
        link.close().await;
        result
    }

    /// Closes every link (and aborts every dial in flight) concurrently, within
    /// [`CLOSE_BOUND`].
    pub async fn close(&self) {
        let links = self.take_all();
        let closes = futures_util::future::join_all(links.iter().map(|l| l.close()));
        if tokio::time::timeout(CLOSE_BOUND, closes).await.is_err() {
            tracing::warn!(bound = ?CLOSE_BOUND, "some links did not close in time; they are dropped");
        }
    }

    /// Cuts this process off every host: no link is handed out any more (a call gets
    /// [`HostError::Severed`], transient, and is not retried), every link is closed, which
    /// closes its tunnel at once and so returns every thread blocked in libvirt with a
    /// transport error and drops what was still queued for the host; then waits at most
    /// `bound` for those threads to give their slots back. Health checks, on connections
    /// of their own, are not affected.
    pub async fn sever(&self, bound: Duration) -> crate::provider::Severed {
        self.severed.store(true, Ordering::SeqCst);
        let at_cut = self.blocking_in_flight();
        // Each close shuts its tunnel first (that is what releases the threads); the SSH
        // goodbye after it may take its grace periods, which the cut does not wait for.
        for link in self.take_all() {
            close_in_background(link);
        }
        let started = tokio::time::Instant::now();
        let mut still_running = self.blocking_in_flight();
        while still_running > 0 && started.elapsed() < bound {
            tokio::time::sleep(SEVER_POLL).await;
            still_running = self.blocking_in_flight();
        }
        crate::provider::Severed {
            at_cut,
            still_running,
        }
    }

    /// Lifts [`Hosts::sever`]: the next call dials again.
    pub fn reconnect(&self) {
        self.severed.store(false, Ordering::SeqCst);
    }

    /// Blocking libvirt calls of every host running now (threads holding a slot).
    pub fn blocking_in_flight(&self) -> usize {
        self.entries.values().map(|e| e.pool.in_flight()).sum()
    }

    /// Empties the table: aborts dials, returns the links.
    fn take_all(&self) -> Vec<Arc<HostLink>> {
        let mut links = Vec::new();
        for entry in self.entries.values() {
            let mut st = entry.state();
            if let Some(d) = st.dial.take() {
                d.task.abort();
            }
            if let Some(l) = st.link.take() {
                links.push(l);
            }
        }
        links
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for link in self.take_all() {
            close_in_background(link);
        }
    }
}

/// Runs one liveness probe of `link` (at most one at a time per link) and evicts it if
/// the probe fails. In the background: the caller whose call timed out has no deadline
/// left to spend on it.
fn probe_in_background(entry: Arc<Entry>, link: Arc<HostLink>, metrics: Arc<CallMetrics>) {
    if link.probing.swap(true, Ordering::SeqCst) {
        return;
    }
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    handle.spawn(async move {
        let verdict = link.probe(PROBE_DEADLINE).await;
        metrics.probed(&entry.name, verdict.is_ok());
        match verdict {
            Ok(()) => {
                tracing::debug!(host = %entry.name, "a call timed out but the link answers; keeping it");
            }
            Err(e) => {
                tracing::info!(host = %entry.name, error = %e, "the link failed its probe after a timeout");
                entry.evict(&link, "probe", &metrics);
            }
        }
        link.probing.store(false, Ordering::SeqCst);
    });
}

/// Closes a link without holding up the caller; bounded by [`HostLink::close`].
fn close_in_background(link: Arc<HostLink>) {
    link.conn().mark_dead();
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move { link.close().await });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_exponential_and_bounded() {
        assert_eq!(backoff(1), BACKOFF_BASE);
        assert_eq!(backoff(2), BACKOFF_BASE * 2);
        assert_eq!(backoff(3), BACKOFF_BASE * 4);
        assert_eq!(backoff(30), BACKOFF_MAX);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }
}
