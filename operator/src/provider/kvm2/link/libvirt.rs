//! Calls into libvirt (the `virt` crate) with a deadline each, off the async executor.
//!
//! libvirt's client API is blocking: a call on a dead link can sit in `read()` until TCP
//! gives up, minutes later. So every call here
//! - runs on tokio's blocking threads, bounded by a semaphore so a flood of slow calls
//!   cannot grow threads without limit;
//! - is wrapped in a deadline: past it the caller gets a transient timeout at once, the
//!   connection is marked dead (the next call redials), and the thread stuck in libvirt is
//!   released when the transport under it is torn down (closing the SSH channel makes the
//!   blocked read return);
//! - maps libvirt's error to a class ([`super::virt_error`]) and marks the link dead when
//!   the error says the transport broke.
//!
//! libvirt's own keepalive (which notices a silent peer) needs libvirt's event loop to be
//! running: [`ensure_event_loop`] starts it once per process on a dedicated thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::Semaphore;
use virt::connect::Connect;

use super::virt_error;
use crate::error::{Classified, ErrorClass};

/// Blocking libvirt calls that may run at once, per pool. Far above what a reconcile
/// needs, low enough that stuck calls cannot exhaust tokio's blocking threads (512).
pub const DEFAULT_MAX_BLOCKING_CALLS: usize = 64;

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
    fn from_virt(op: &'static str, e: &virt::error::Error) -> Self {
        LibvirtError::Virt {
            op,
            code: format!("{:?}", e.code()),
            message: e.message().to_string(),
            class: virt_error::classify(e),
            link_failure: virt_error::is_link_failure(e),
        }
    }

    /// Whether the connection must be redialled after this error.
    pub fn is_link_failure(&self) -> bool {
        match self {
            LibvirtError::Timeout { .. } | LibvirtError::Dead { .. } => true,
            LibvirtError::Virt { link_failure, .. } => *link_failure,
            LibvirtError::Runtime { .. } => false,
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

/// A bounded set of blocking threads for libvirt calls.
#[derive(Debug, Clone)]
pub struct BlockingPool {
    permits: Arc<Semaphore>,
}

impl Default for BlockingPool {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_BLOCKING_CALLS)
    }
}

impl BlockingPool {
    /// A pool running at most `max` calls at once.
    pub fn new(max: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max.max(1))),
        }
    }

    /// Runs `f` on a blocking thread, waiting at most `deadline` for a permit and the
    /// result together. A call past its deadline keeps its permit until its thread
    /// returns, so stuck calls count against the bound.
    pub async fn run<T, F>(
        &self,
        op: &'static str,
        deadline: Duration,
        f: F,
    ) -> Result<T, LibvirtError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, virt::error::Error> + Send + 'static,
    {
        let permits = self.permits.clone();
        let work = async move {
            let permit = permits
                .acquire_owned()
                .await
                .map_err(|e| LibvirtError::Runtime {
                    op,
                    reason: e.to_string(),
                })?;
            let handle = tokio::task::spawn_blocking(move || {
                let _permit = permit;
                f()
            });
            match handle.await {
                Ok(result) => result.map_err(|e| LibvirtError::from_virt(op, &e)),
                Err(e) => Err(LibvirtError::Runtime {
                    op,
                    reason: e.to_string(),
                }),
            }
        };
        tokio::time::timeout(deadline, work)
            .await
            .unwrap_or(Err(LibvirtError::Timeout {
                op,
                after: deadline,
            }))
    }

    /// Permits free right now (for tests and metrics).
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }
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
            .run("open", deadline, move || {
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

    /// Runs `f` against the connection on the blocking pool within `deadline`.
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
        let conn = match (&self.conn, self.is_dead()) {
            (Some(c), false) => c.clone(),
            _ => {
                return Err(LibvirtError::Dead {
                    uri: self.uri.clone(),
                });
            }
        };
        let result = self.pool.run(op, deadline, move || f(&conn.0)).await;
        if let Err(e) = &result
            && e.is_link_failure()
        {
            self.mark_dead();
        }
        result
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
    async fn a_call_past_its_deadline_times_out_and_keeps_its_permit_until_done() {
        let pool = BlockingPool::new(2);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let r = pool
            .run("stuck", Duration::from_millis(50), move || {
                let _ = rx.recv();
                Ok(())
            })
            .await;
        assert!(
            matches!(r, Err(LibvirtError::Timeout { op: "stuck", .. })),
            "{r:?}"
        );
        assert!(r.as_ref().is_err_and(LibvirtError::is_link_failure));
        assert_eq!(r.unwrap_err().class(), ErrorClass::Transient);
        // The stuck thread still holds its permit: the pool stays bounded.
        assert_eq!(pool.available(), 1);
        tx.send(()).unwrap();
        for _ in 0..200 {
            if pool.available() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            pool.available(),
            2,
            "the released thread gave its permit back"
        );
    }

    #[tokio::test]
    async fn errors_are_classified() {
        let pool = BlockingPool::new(1);
        let r: Result<(), _> = pool
            .run("open", Duration::from_secs(30), || {
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
