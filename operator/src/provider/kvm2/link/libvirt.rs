//! Calls into libvirt (the `virt` crate) with a deadline each, off the async executor.
//!
//! libvirt's client API is blocking: a call on a dead link can sit in `read()` until TCP
//! gives up, minutes later. So every call here
//! - runs on tokio's blocking threads, in the host's bounded pool ([`super::pool`]), so a
//!   flood of slow calls cannot grow threads without limit or starve other hosts;
//! - is wrapped in a deadline: past it the caller gets a transient timeout at once; the
//!   hosts table then probes the link and tears it down only if the probe finds it dead
//!   (tearing down the transport is what releases a thread stuck in libvirt);
//! - maps libvirt's error to a class ([`super::virt_error`]) and marks the link dead when
//!   the error says the transport broke.
//!
//! libvirt's own keepalive (which notices a silent peer) needs libvirt's event loop to be
//! running: [`ensure_event_loop`] starts it once per process on a dedicated thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use virt::connect::Connect;

pub use super::pool::{BlockingPool, DEFAULT_MAX_BLOCKING_CALLS, Lane, PoolLimits};
use super::virt_error;
use crate::error::{Classified, ErrorClass};

/// A failed libvirt call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LibvirtError {
    /// The call did not finish within its deadline.
    #[error("libvirt {op} timed out after {after:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// libvirt returned an error.
    #[error("libvirt {op} failed: {message} (code {code})")]
    Virt {
        /// The operation.
        op: &'static str,
        /// libvirt's error code name.
        code: String,
        /// libvirt's message.
        message: String,
        /// Its class.
        class: ErrorClass,
        /// Whether the connection is broken.
        link_failure: bool,
    },
    /// No slot of the host's pool came free within the call's deadline: the host is busy
    /// (or its calls are stuck), which says nothing about the link itself.
    #[error("libvirt {op}: no free {lane} slot on this host within {}", humantime::format_duration(*waited))]
    Busy {
        /// The operation.
        op: &'static str,
        /// The lane of the pool (`call` or `transfer`).
        lane: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// The connection was already marked dead; redial first.
    #[error("libvirt connection {uri} is dead")]
    Dead {
        /// The connection URI.
        uri: String,
    },
    /// The blocking task itself failed (it panicked or the runtime is shutting down).
    #[error("libvirt {op} could not run: {reason}")]
    Runtime {
        /// The operation.
        op: &'static str,
        /// Why.
        reason: String,
    },
}

impl LibvirtError {
    pub(super) fn from_virt(op: &'static str, e: &virt::error::Error) -> Self {
        LibvirtError::Virt {
            op,
            code: format!("{:?}", e.code()),
            message: e.message().to_string(),
            class: virt_error::classify(e),
            link_failure: virt_error::is_link_failure(e),
        }
    }

    /// The operation that failed, when known.
    pub fn op(&self) -> Option<&'static str> {
        match self {
            LibvirtError::Timeout { op, .. }
            | LibvirtError::Virt { op, .. }
            | LibvirtError::Busy { op, .. }
            | LibvirtError::Runtime { op, .. } => Some(op),
            LibvirtError::Dead { .. } => None,
        }
    }

    /// Whether this error is evidence that the connection is broken and must be
    /// redialled. A timeout is not: the call may just be slow; the hosts table probes the
    /// link before giving it up.
    pub fn is_link_failure(&self) -> bool {
        match self {
            LibvirtError::Dead { .. } => true,
            LibvirtError::Virt { link_failure, .. } => *link_failure,
            LibvirtError::Timeout { .. }
            | LibvirtError::Runtime { .. }
            | LibvirtError::Busy { .. } => false,
        }
    }
}

impl Classified for LibvirtError {
    fn class(&self) -> ErrorClass {
        match self {
            LibvirtError::Virt { class, .. } => *class,
            _ => ErrorClass::Transient,
        }
    }
}

static EVENT_LOOP: OnceLock<Result<(), String>> = OnceLock::new();

/// Starts libvirt's default event loop on its own thread, once per process, and stops
/// libvirt from printing errors to stderr (we log them ourselves, with context).
///
/// The thread lives as long as the process: libvirt has no way to stop its default loop.
pub fn ensure_event_loop() -> Result<(), String> {
    EVENT_LOOP
        .get_or_init(|| {
            virt::error::clear_error_callback();
            virt::event::event_register_default_impl().map_err(|e| e.to_string())?;
            std::thread::Builder::new()
                .name("libvirt-events".into())
                .spawn(|| {
                    loop {
                        if virt::event::event_run_default_impl().is_err() {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                })
                .map(drop)
                .map_err(|e| e.to_string())
        })
        .clone()
}

/// libvirt keepalive: probe every `interval` seconds, give up after `count` misses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Seconds between probes.
    pub interval_seconds: i32,
    /// Unanswered probes before libvirt closes the connection.
    pub count: u32,
}

/// A `virt` connection that is closed when dropped (virt 0.4 leaves that to the caller).
/// Shared behind an `Arc`, so the last holder, a call in flight or the connection itself,
/// closes it.
struct OwnedConnect(Connect);

impl Drop for OwnedConnect {
    fn drop(&mut self) {
        if let Err(e) = self.0.close() {
            tracing::debug!(error = %e, "closing a libvirt connection failed");
        }
    }
}

/// One libvirt connection with a liveness flag.
pub struct LibvirtConn {
    conn: Option<Arc<OwnedConnect>>,
    uri: String,
    pool: BlockingPool,
    dead: Arc<AtomicBool>,
}

impl std::fmt::Debug for LibvirtConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibvirtConn")
            .field("uri", &self.uri)
            .field("dead", &self.is_dead())
            .finish_non_exhaustive()
    }
}

impl LibvirtConn {
    /// Opens `uri` (e.g. `qemu+unix:///system?socket=/path`) within `deadline`, with
    /// libvirt keepalive when given.
    pub async fn open(
        pool: &BlockingPool,
        uri: &str,
        deadline: Duration,
        keepalive: Option<Keepalive>,
    ) -> Result<Self, LibvirtError> {
        if keepalive.is_some() {
            ensure_event_loop().map_err(|reason| LibvirtError::Runtime {
                op: "event-loop",
                reason,
            })?;
        }
        let target = uri.to_string();
        let conn = pool
            .run("open", Lane::Call, deadline, move || {
                let conn = OwnedConnect(Connect::open(Some(&target))?);
                if let Some(k) = keepalive {
                    conn.0.set_keep_alive(k.interval_seconds, k.count)?;
                }
                Ok(conn)
            })
            .await?;
        Ok(Self {
            conn: Some(Arc::new(conn)),
            uri: uri.to_string(),
            pool: pool.clone(),
            dead: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The URI this connection was opened with.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Whether a transport failure or a timeout was seen.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Marks the connection dead (its transport is being torn down).
    pub fn mark_dead(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }

    /// Runs `f` against the connection in the pool's ordinary lane within `deadline`.
    pub async fn call<T, F>(
        &self,
        op: &'static str,
        deadline: Duration,
        f: F,
    ) -> Result<T, LibvirtError>
    where
        T: Send + 'static,
        F: FnOnce(&Connect) -> Result<T, virt::error::Error> + Send + 'static,
    {
        self.call_in(Lane::Call, op, deadline, f).await
    }

    /// Runs `f` against the connection in `lane` of the pool within `deadline`. A
    /// transport failure marks the connection dead; a timeout does not (the caller decides,
    /// after a liveness probe, whether the link is gone).
    pub async fn call_in<T, F>(
        &self,
        lane: Lane,
        op: &'static str,
        deadline: Duration,
        f: F,
    ) -> Result<T, LibvirtError>
    where
        T: Send + 'static,
        F: FnOnce(&Connect) -> Result<T, virt::error::Error> + Send + 'static,
    {
        let conn = match (&self.conn, self.is_dead()) {
            (Some(c), false) => c.clone(),
            _ => {
                return Err(LibvirtError::Dead {
                    uri: self.uri.clone(),
                });
            }
        };
        let result = self.pool.run(op, lane, deadline, move || f(&conn.0)).await;
        if let Err(e) = &result
            && e.is_link_failure()
        {
            self.mark_dead();
        }
        result
    }

    /// libvirt's own view of the connection (`virConnectIsAlive`: false once its
    /// keepalive gave up or the socket closed), within `deadline`. It reads client state
    /// and sends nothing, so it runs outside the pool's lanes: it must answer even when
    /// every slot is held by a stuck call.
    pub async fn is_alive(&self, deadline: Duration) -> bool {
        let conn = match (&self.conn, self.is_dead()) {
            (Some(c), false) => c.clone(),
            _ => return false,
        };
        let probe = tokio::task::spawn_blocking(move || conn.0.is_alive().unwrap_or(false));
        matches!(tokio::time::timeout(deadline, probe).await, Ok(Ok(true)))
    }
}

impl Drop for LibvirtConn {
    /// Closing a connection is a libvirt call too: it must not run on an executor thread,
    /// and on a dead link it may block until the transport is gone. Hand it to a blocking
    /// thread when inside a runtime.
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    drop(handle.spawn_blocking(move || drop(conn)));
                }
                Err(_) => drop(conn),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn errors_are_classified() {
        let pool = BlockingPool::new(1);
        let r: Result<(), _> = pool
            .run("open", Lane::Call, Duration::from_secs(30), || {
                Connect::open(Some("test+unix:///default?socket=/nonexistent/sock")).map(|mut c| {
                    let _ = c.close();
                })
            })
            .await;
        let e = r.unwrap_err();
        assert!(matches!(e, LibvirtError::Virt { .. }), "{e}");
        assert_eq!(e.class(), ErrorClass::Transient, "{e}");
    }
}
