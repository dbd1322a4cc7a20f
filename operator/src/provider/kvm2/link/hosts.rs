//! The hosts table: one cached link (SSH session + tunnel + libvirt connection) per host.
//!
//! - Concurrent callers share one dial (single flight): the first caller dials while
//!   holding the host's lock, the others wait on it and then use the same link, so a burst
//!   of reconciles opens one SSH connection, not a hundred.
//! - A link is dropped and redialled when its SSH session has closed (keepalives missed,
//!   server gone), when a libvirt call reports a transport failure, or when a call runs past
//!   its deadline. Redials back off exponentially after failures, bounded by
//!   [`BACKOFF_MAX`], so a dead host is not hammered and a recovered one is found quickly.
//! - Every call is observed ([`super::observe`]) and runs under a deadline on the bounded
//!   blocking pool ([`super::libvirt`]).
//! - [`Hosts::close`] closes every part of every link; dropping the table does the same
//!   without waiting.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use virt::connect::Connect;

use super::errors::SshError;
use super::libvirt::{BlockingPool, Keepalive, LibvirtConn, LibvirtError};
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
}

impl HostError {
    /// A short, stable reason code for status, metrics and the `check` command.
    pub fn reason_code(&self) -> &'static str {
        match self {
            HostError::Unknown(_) => "unknown-host",
            HostError::Ssh(e) => match e {
                SshError::Channel { .. } => "libvirt-socket",
                other => other.reason_code(),
            },
            HostError::Libvirt { source, .. } => match source {
                LibvirtError::Timeout { .. } => "timeout",
                LibvirtError::Dead { .. } => "disconnected",
                _ => "libvirt",
            },
        }
    }

    /// The libvirt error, if that is what failed.
    pub fn libvirt(&self) -> Option<&LibvirtError> {
        match self {
            HostError::Libvirt { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl Classified for HostError {
    fn class(&self) -> ErrorClass {
        match self {
            HostError::Unknown(_) => ErrorClass::Permanent,
            HostError::Ssh(e) => e.class(),
            HostError::Libvirt { source, .. } => source.class(),
        }
    }
}

/// A live connection to one host's libvirt.
pub struct HostLink {
    conn: LibvirtConn,
    /// Taken out when the link is closed, possibly while calls still hold the link.
    tunnel: std::sync::Mutex<Option<Tunnel>>,
    session: Arc<SshSession>,
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
            }),
            Err(source) => {
                tunnel.close().await;
                session.close().await;
                // A libvirt open that fails because the remote socket is missing shows up
                // as the channel open failing inside the tunnel; say so.
                Err(HostError::Libvirt {
                    host: host.name.clone(),
                    source,
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

    /// Closes the tunnel (which releases any thread blocked in libvirt, even while calls
    /// still hold this link), then the SSH session. The libvirt connection itself is
    /// closed on a blocking thread when the last holder drops the link.
    pub async fn close(&self) {
        self.conn.mark_dead();
        let tunnel = self.tunnel.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = tunnel {
            t.close().await;
        }
        self.session.close().await;
    }
}

struct Entry {
    host: HostConfig,
    target: SshTarget,
    link: Mutex<Slot>,
}

#[derive(Default)]
struct Slot {
    link: Option<Arc<HostLink>>,
    failures: u32,
    last_failure: Option<Instant>,
}

/// The table of all configured hosts.
pub struct Hosts {
    entries: BTreeMap<String, Arc<Entry>>,
    pool: BlockingPool,
    metrics: Arc<CallMetrics>,
    call_deadline: Duration,
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

impl Hosts {
    /// A table for `hosts`, logging in with `ssh`. Nothing is dialled until first use.
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
                    host: h.clone(),
                    target,
                    link: Mutex::new(Slot::default()),
                }),
            );
        }
        Ok(Self {
            entries,
            pool,
            metrics,
            call_deadline: DEFAULT_CALL_DEADLINE,
        })
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

    fn entry(&self, host: &str) -> Result<&Arc<Entry>, HostError> {
        self.entries
            .get(host)
            .ok_or_else(|| HostError::Unknown(host.to_string()))
    }

    /// The live link to `host`, dialling (once, for all concurrent callers) if needed.
    pub async fn link(&self, host: &str) -> Result<Arc<HostLink>, HostError> {
        let entry = self.entry(host)?;
        let mut slot = entry.link.lock().await;
        if let Some(link) = &slot.link {
            if !link.is_dead() {
                return Ok(link.clone());
            }
            tracing::info!(host, "libvirt link is dead; redialling");
            if let Some(old) = slot.link.take() {
                close_in_background(old);
            }
        }
        if let Some(at) = slot.last_failure {
            let wait = backoff(slot.failures).saturating_sub(at.elapsed());
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
        match HostLink::dial(&entry.target, &entry.host, &self.pool, self.call_deadline).await {
            Ok(link) => {
                let link = Arc::new(link);
                slot.link = Some(link.clone());
                slot.failures = 0;
                slot.last_failure = None;
                Ok(link)
            }
            Err(e) => {
                slot.failures = slot.failures.saturating_add(1);
                slot.last_failure = Some(Instant::now());
                tracing::warn!(host, reason = e.reason_code(), error = %e, "dial failed");
                Err(e)
            }
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

    /// Runs `f` against `host`'s libvirt within `deadline`.
    ///
    /// A transport failure (the daemon restarted, the SSH link dropped) evicts the link and
    /// `f` is retried once on a fresh one: every operation the provider makes is
    /// idempotent, and this is what lets the first call after a libvirtd restart succeed.
    /// A timeout is not retried (its deadline is spent); it evicts the link, which frees
    /// the thread stuck in libvirt, and the next call redials.
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
        let f = Arc::new(f);
        let metrics = self.metrics.clone();
        metrics
            .observe(host, op, async {
                let started = tokio::time::Instant::now();
                let mut retried = false;
                loop {
                    // The dial counts against the call's deadline too; a cancelled dial
                    // closes whatever it had opened.
                    let remaining = deadline.saturating_sub(started.elapsed());
                    let link = tokio::time::timeout(remaining, self.link(host))
                        .await
                        .map_err(|_| HostError::Libvirt {
                            host: host.to_string(),
                            source: LibvirtError::Timeout { op, after: deadline },
                        })??;
                    let g = f.clone();
                    let remaining = deadline.saturating_sub(started.elapsed());
                    let result = link.conn().call(op, remaining, move |c| g(c)).await;
                    match result {
                        Ok(v) => return Ok(v),
                        Err(e) if e.is_link_failure() => {
                            self.evict(host, &link).await;
                            let timed_out = matches!(e, LibvirtError::Timeout { .. });
                            if retried || timed_out || started.elapsed() >= deadline {
                                return Err(HostError::Libvirt {
                                    host: host.to_string(),
                                    source: e,
                                });
                            }
                            tracing::info!(host, op, error = %e, "link failed; retrying once on a fresh link");
                            retried = true;
                        }
                        Err(source) => {
                            return Err(HostError::Libvirt {
                                host: host.to_string(),
                                source,
                            });
                        }
                    }
                }
            })
            .await
    }

    /// Drops `link` from the table if it is still the current one, and closes it, which
    /// also frees any thread blocked on it.
    async fn evict(&self, host: &str, link: &Arc<HostLink>) {
        let Ok(entry) = self.entry(host) else { return };
        let mut slot = entry.link.lock().await;
        if slot.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link))
            && let Some(old) = slot.link.take()
        {
            close_in_background(old);
        }
    }

    /// Closes every link and waits until each is closed.
    pub async fn close(&self) {
        for entry in self.entries.values() {
            let old = entry.link.lock().await.link.take();
            if let Some(link) = old {
                link.close().await;
            }
        }
    }
}

/// Closes a link without holding up the caller (who holds a host's lock).
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
