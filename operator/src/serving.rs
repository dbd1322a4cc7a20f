//! The proxy probe: does a proxy VM actually proxy?
//!
//! A VM that runs and has an address may still serve nothing (the guest never read its
//! cloud-init seed, the proxy crashed, it listens on another port). The probe asks the
//! proxy itself: it opens TCP to the proxy port, sends `CONNECT target HTTP/1.1`, reads
//! the status line (at most [`MAX_STATUS_LINE`] bytes) and classifies the answer
//! ([`ProbeOutcome`]). With a configured target only a 2xx passes (the proxy reached the
//! target); without one, the CONNECT names a host that cannot resolve ([`NO_TARGET`]) and
//! any well-formed HTTP status line passes: it proves that an HTTP proxy answers on the
//! port, not that it reaches anything.
//!
//! Every probe is bounded by its timeout as a whole (connect, request and answer); a
//! [`Prober`] also bounds how many run at once across all Proxies, so a fleet whose
//! proxies all hang costs at most `concurrency` sockets. The connection goes through a
//! [`Dialer`], so tests probe loopback servers and a caller can dial from elsewhere (e.g.
//! inside a network namespace).
//!
//! Used by the controller (the `Serving` condition) and by `provision`.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// The longest the fast probe's all-fail hold in discovery distrusts a fleet-wide failure
/// before it believes the probe again. A cut in the operator's own path is usually mended within minutes; a fleet that
/// is really dead must still be emptied from the slices, its leases rebound and its VMs
/// replaced, so the hold is bounded.
pub const GUARD_MAX_HOLD: Duration = Duration::from_secs(120);

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::config::ServingConfig;

/// What the probe CONNECTs to when no target is configured: an IP literal, so the proxy
/// asks no resolver (an air-gapped guest's resolver made `probe.invalid` wait out its
/// 10 s timeout before tinyproxy answered), and port 0, which no socket can be connected
/// to, so the proxy answers at once with an error status without opening anything. The
/// probe then only learns that an HTTP proxy listens and answers.
pub const NO_TARGET: &str = "0.0.0.0:0";

/// Longest status line read. `HTTP/1.1 200 Connection established` is 36 bytes and
/// proxies' reason phrases are short; anything longer without a line end is not a proxy.
pub const MAX_STATUS_LINE: usize = 1024;

/// How much of a bad answer a message quotes.
const QUOTE: usize = 64;

/// A future that the [`Dialer`] returns.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// A connection the probe can talk over.
pub trait ProbeStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> ProbeStream for T {}

/// Opens the connection to a proxy.
pub trait Dialer: Send + Sync {
    /// Connects to `addr`. A refused connection must come back as
    /// [`io::ErrorKind::ConnectionRefused`], so the probe can tell "nothing listens".
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn ProbeStream>>>;
}

/// Plain TCP from the operator's own network namespace.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpDialer;

impl Dialer for TcpDialer {
    fn dial(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn ProbeStream>>> {
        Box::pin(async move {
            let s = tokio::net::TcpStream::connect(addr).await?;
            // One small request, one small answer: no reason to wait for Nagle.
            s.set_nodelay(true)?;
            Ok(Box::new(s) as Box<dyn ProbeStream>)
        })
    }
}

/// How a probe ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// The proxy answered: any status without a target, a 2xx with one.
    Serving {
        /// From the start of the connect to the end of the status line.
        latency: Duration,
        /// The HTTP status the proxy sent.
        status: u16,
    },
    /// Nothing listens on the proxy port (the guest's kernel refused the connection).
    Refused,
    /// No (complete) answer within the timeout: a proxy that hangs, a guest that drops
    /// packets, or no guest at that address.
    Timeout {
        /// The probe's budget.
        after: Duration,
    },
    /// Something answered that is not an HTTP status line (or closed without one).
    BadAnswer {
        /// The start of what came back, quoted for the message.
        answer: String,
    },
    /// A proxy answered, but not with a 2xx to the configured target: it refused the
    /// target (or the prober as a client) or could not reach it.
    TargetRefused {
        /// The HTTP status the proxy sent.
        status: u16,
    },
    /// The connection failed otherwise (no route, reset, ...).
    Unreachable {
        /// The operating system's error.
        error: String,
    },
    /// There is no address to probe.
    NoAddress,
}

impl ProbeOutcome {
    /// Whether the proxy serves.
    pub fn is_serving(&self) -> bool {
        matches!(self, ProbeOutcome::Serving { .. })
    }

    /// A stable CamelCase label: the `Serving` condition's reason and the metrics label.
    pub fn reason(&self) -> &'static str {
        match self {
            ProbeOutcome::Serving { .. } => "Serving",
            ProbeOutcome::Refused => "ConnectionRefused",
            ProbeOutcome::Timeout { .. } => "Timeout",
            ProbeOutcome::BadAnswer { .. } => "BadAnswer",
            ProbeOutcome::TargetRefused { .. } => "TargetRefused",
            ProbeOutcome::Unreachable { .. } => "Unreachable",
            ProbeOutcome::NoAddress => "NoAddress",
        }
    }

    /// A sentence for people: what was asked of whom and what came back. `target` is the
    /// configured one (`None`: the probe asked for [`NO_TARGET`]).
    pub fn describe(&self, addr: Option<SocketAddr>, target: Option<&str>) -> String {
        let at = addr.map_or_else(|| "the proxy".to_string(), |a| a.to_string());
        let asked = target.unwrap_or(NO_TARGET);
        match self {
            ProbeOutcome::Serving { latency, status } => format!(
                "{at} answered CONNECT {asked} with {status} in {} ms",
                latency.as_millis()
            ),
            ProbeOutcome::Refused => {
                format!("{at} refused the connection: nothing listens on the proxy port")
            }
            ProbeOutcome::Timeout { after } => format!(
                "{at} gave no answer to CONNECT {asked} within {} s",
                after.as_secs_f64()
            ),
            ProbeOutcome::BadAnswer { answer } => {
                format!("{at} answered CONNECT {asked} with something that is not HTTP: {answer}")
            }
            ProbeOutcome::TargetRefused { status } => format!(
                "{at} answered CONNECT {asked} with {status}, not 2xx: the proxy refused the \
                 target (or this client) or could not reach it"
            ),
            ProbeOutcome::Unreachable { error } => format!("{at} is unreachable: {error}"),
            ProbeOutcome::NoAddress => "the instance reports no address to probe".to_string(),
        }
    }
}

/// Probes the proxy at `addr` over plain TCP; see [`probe_with`].
pub async fn probe(addr: SocketAddr, target: Option<&str>, timeout: Duration) -> ProbeOutcome {
    probe_with(&TcpDialer, addr, target, timeout).await
}

/// Probes the proxy at `addr` through `dialer`: the whole exchange within `timeout`.
pub async fn probe_with(
    dialer: &dyn Dialer,
    addr: SocketAddr,
    target: Option<&str>,
    timeout: Duration,
) -> ProbeOutcome {
    let started = Instant::now();
    let asked = target.unwrap_or(NO_TARGET);
    match tokio::time::timeout(timeout, exchange(dialer, addr, asked)).await {
        Err(_) => ProbeOutcome::Timeout { after: timeout },
        Ok(Err(Failed::Refused)) => ProbeOutcome::Refused,
        Ok(Err(Failed::Io(e))) => ProbeOutcome::Unreachable {
            error: e.to_string(),
        },
        Ok(Err(Failed::NotHttp(answer))) => ProbeOutcome::BadAnswer { answer },
        Ok(Ok(status)) if target.is_some() && !(200..300).contains(&status) => {
            ProbeOutcome::TargetRefused { status }
        }
        Ok(Ok(status)) => ProbeOutcome::Serving {
            latency: started.elapsed(),
            status,
        },
    }
}

enum Failed {
    Refused,
    Io(io::Error),
    NotHttp(String),
}

/// Connect, ask, read the status line; the HTTP status.
async fn exchange(dialer: &dyn Dialer, addr: SocketAddr, asked: &str) -> Result<u16, Failed> {
    let mut stream = dialer.dial(addr).await.map_err(|e| {
        if e.kind() == io::ErrorKind::ConnectionRefused {
            Failed::Refused
        } else {
            Failed::Io(e)
        }
    })?;
    let request = format!(
        "CONNECT {asked} HTTP/1.1\r\nHost: {asked}\r\nUser-Agent: egress-operator-probe\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(after_connect)?;
    stream.flush().await.map_err(after_connect)?;
    let line = read_line(&mut stream).await?;
    status_of(&line).ok_or_else(|| Failed::NotHttp(quote(&line)))
}

/// An error once connected: a peer that cuts the connection instead of answering gave no
/// HTTP answer (e.g. a service that is not a proxy); anything else is the network's.
fn after_connect(e: io::Error) -> Failed {
    match e.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof => {
            Failed::NotHttp(format!("(closed the connection without an answer: {e})"))
        }
        _ => Failed::Io(e),
    }
}

/// Reads up to the first line end, at most [`MAX_STATUS_LINE`] bytes.
async fn read_line(stream: &mut Box<dyn ProbeStream>) -> Result<Vec<u8>, Failed> {
    let mut line = Vec::with_capacity(128);
    let mut chunk = [0u8; 256];
    loop {
        let room = (MAX_STATUS_LINE + 1)
            .saturating_sub(line.len())
            .min(chunk.len());
        let n = stream
            .read(&mut chunk[..room])
            .await
            .map_err(after_connect)?;
        if n == 0 {
            return if line.is_empty() {
                Err(Failed::NotHttp(
                    "(closed the connection without an answer)".into(),
                ))
            } else {
                Err(Failed::NotHttp(quote(&line)))
            };
        }
        line.extend_from_slice(&chunk[..n]);
        if let Some(end) = line.iter().position(|b| *b == b'\n') {
            line.truncate(end);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(line);
        }
        if line.len() > MAX_STATUS_LINE {
            return Err(Failed::NotHttp(format!(
                "{} (no line end within {MAX_STATUS_LINE} bytes)",
                quote(&line)
            )));
        }
    }
}

/// The status of an `HTTP/1.x NNN [reason]` line.
fn status_of(line: &[u8]) -> Option<u16> {
    let rest = line.strip_prefix(b"HTTP/1.")?;
    let (minor, rest) = rest.split_first()?;
    if !minor.is_ascii_digit() {
        return None;
    }
    let rest = rest.strip_prefix(b" ")?;
    let code = rest.get(..3)?;
    if !code.iter().all(u8::is_ascii_digit) || !(rest.len() == 3 || rest[3] == b' ') {
        return None;
    }
    let status = code.iter().fold(0u16, |n, d| n * 10 + u16::from(d - b'0'));
    (100..600).contains(&status).then_some(status)
}

fn quote(bytes: &[u8]) -> String {
    let shown = &bytes[..bytes.len().min(QUOTE)];
    let more = if bytes.len() > QUOTE { "..." } else { "" };
    format!("{:?}{more}", String::from_utf8_lossy(shown))
}

/// Probes with a shared bound on how many run at once, counted in [`ProbeMetrics`].
#[derive(Clone)]
pub struct Prober {
    dialer: Arc<dyn Dialer>,
    permits: Arc<Semaphore>,
    port: u16,
    target: Option<String>,
    timeout: Duration,
    metrics: ProbeMetrics,
}

impl fmt::Debug for Prober {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prober")
            .field("port", &self.port)
            .field("target", &self.target)
            .field("timeout", &self.timeout)
            .field("free", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl Prober {
    /// A prober for `config` over plain TCP.
    pub fn new(config: &ServingConfig, metrics: ProbeMetrics) -> Self {
        Self::with_dialer(config, Arc::new(TcpDialer), metrics)
    }

    /// A prober for `config` that connects through `dialer`.
    pub fn with_dialer(
        config: &ServingConfig,
        dialer: Arc<dyn Dialer>,
        metrics: ProbeMetrics,
    ) -> Self {
        Self {
            dialer,
            permits: Arc::new(Semaphore::new(config.concurrency.max(1) as usize)),
            port: config.port,
            target: config.target.clone(),
            timeout: Duration::from_secs(u64::from(config.timeout_seconds)),
            metrics,
        }
    }

    /// The address probed for a guest address.
    pub fn addr(&self, ip: IpAddr) -> SocketAddr {
        SocketAddr::new(ip, self.port)
    }

    /// The configured target (`None`: [`NO_TARGET`] and any HTTP answer passes).
    pub fn target(&self) -> Option<&str> {
        self.target.as_deref()
    }

    /// Probes the proxy at `ip`, waiting first for a free slot: the wait is not part of
    /// the probe's timeout (a queue must not turn into timeouts), but every probe ahead
    /// ends within its own timeout, so the wait is bounded too.
    pub async fn probe(&self, ip: IpAddr) -> ProbeOutcome {
        // The semaphore is never closed; if it were, probing unbounded beats not probing.
        let _permit = self.permits.acquire().await.ok();
        let _flight = InFlight::start(&self.metrics.in_flight);
        let outcome = probe_with(&*self.dialer, self.addr(ip), self.target(), self.timeout).await;
        self.metrics.observe(&outcome);
        outcome
    }
}

/// Counts a probe in flight until dropped (so a cancelled probe is uncounted too).
struct InFlight<'a>(&'a Gauge);

impl<'a> InFlight<'a> {
    fn start(g: &'a Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
}

/// Probe outcomes, latency of passing probes, probes in flight; cheap to clone.
#[derive(Clone, Debug)]
pub struct ProbeMetrics {
    outcomes: Family<Reason, Counter>,
    latency: Histogram,
    in_flight: Gauge,
}

impl Default for ProbeMetrics {
    fn default() -> Self {
        Self {
            outcomes: Family::default(),
            // A proxy on the same network answers in milliseconds; seconds mean a loaded
            // or emulated guest; the top bucket is the largest timeout.
            latency: Histogram::new([0.001, 0.005, 0.025, 0.1, 0.5, 2.0, 10.0, 120.0]),
            in_flight: Gauge::default(),
        }
    }
}

impl ProbeMetrics {
    /// Registered under `{prefix}_probe_*`.
    pub fn register(registry: &mut Registry, prefix: &str) -> Self {
        let m = Self::default();
        registry.register(
            format!("{prefix}_probes"),
            "proxy probes by outcome (the Serving condition's reason)",
            m.outcomes.clone(),
        );
        registry.register(
            format!("{prefix}_probe_latency_seconds"),
            "time from connect to the proxy's status line, of probes that passed",
            m.latency.clone(),
        );
        registry.register(
            format!("{prefix}_probes_in_flight"),
            "proxy probes running now (bounded by serving.concurrency)",
            m.in_flight.clone(),
        );
        m
    }

    fn observe(&self, outcome: &ProbeOutcome) {
        self.outcomes
            .get_or_create(&Reason {
                reason: outcome.reason().into(),
            })
            .inc();
        if let ProbeOutcome::Serving { latency, .. } = outcome {
            self.latency.observe(latency.as_secs_f64());
        }
    }

    /// Probes counted with this reason (for tests).
    pub fn outcomes(&self, reason: &str) -> u64 {
        self.outcomes
            .get_or_create(&Reason {
                reason: reason.into(),
            })
            .get()
    }

    /// Probes running now.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.get()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::net::TcpListener;
    use tokio::sync::Notify;

    use super::*;

    /// Generous: a loopback answer takes microseconds; this only keeps a broken probe
    /// from hanging the test.
    const PATIENT: Duration = Duration::from_secs(30);
    const OK_200: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";
    const DENIED_403: &[u8] =
        b"HTTP/1.1 403 Access violation\r\nContent-Type: text/html\r\n\r\n<h1>no</h1>";

    /// A loopback server whose every connection gets `behave`; returns its address and
    /// the requests it read (up to the blank line).
    async fn server<F, Fut>(behave: F) -> (SocketAddr, Arc<Mutex<Vec<String>>>)
    where
        F: Fn(tokio::net::TcpStream, Arc<Mutex<Vec<String>>>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(behave(s, log.clone()));
            }
        });
        (addr, seen)
    }

    /// Reads the request head, records it, answers `answer`, keeps the connection open
    /// until the client goes (as a proxy holding a tunnel does).
    async fn answering(answer: &'static [u8]) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
        server(move |mut s, log| async move {
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && s.read(&mut b).await.unwrap_or(0) == 1 {
                head.push(b[0]);
            }
            log.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&head).into_owned());
            let _ = s.write_all(answer).await;
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        })
        .await
    }

    #[tokio::test]
    async fn a_proxy_that_connects_serves_and_gets_a_well_formed_request() {
        let (addr, seen) = answering(OK_200).await;

        let out = probe(addr, Some("example.org:443"), PATIENT).await;

        let ProbeOutcome::Serving { status, latency } = out else {
            panic!("{out:?}")
        };
        assert_eq!(status, 200);
        assert!(latency < PATIENT);
        assert_eq!(
            seen.lock().unwrap().as_slice(),
            [
                "CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\
              User-Agent: egress-operator-probe\r\n\r\n"
            ]
        );
    }

    #[tokio::test]
    async fn a_403_fails_a_target_but_proves_a_proxy_without_one() {
        let (addr, seen) = answering(DENIED_403).await;

        let with_target = probe(addr, Some("example.org:443"), PATIENT).await;
        let without = probe(addr, None, PATIENT).await;

        assert_eq!(with_target, ProbeOutcome::TargetRefused { status: 403 });
        assert!(
            matches!(without, ProbeOutcome::Serving { status: 403, .. }),
            "{without:?}"
        );
        assert!(
            seen.lock().unwrap()[1].starts_with(&format!("CONNECT {NO_TARGET} HTTP/1.1\r\n")),
            "{seen:?}"
        );
        assert!(
            with_target
                .describe(Some(addr), Some("example.org:443"))
                .contains("403")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_proxy_that_never_answers_times_out_within_the_budget() {
        let (addr, _) = server(|mut s, _| async move {
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        })
        .await;
        let budget = Duration::from_secs(5);
        let started = Instant::now();

        let out = probe(addr, None, budget).await;

        assert_eq!(out, ProbeOutcome::Timeout { after: budget });
        // Paused time: the whole probe took exactly its budget, not more.
        assert_eq!(started.elapsed(), budget);
    }

    #[tokio::test]
    async fn a_closed_port_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);

        assert_eq!(probe(addr, None, PATIENT).await, ProbeOutcome::Refused);
    }

    #[tokio::test]
    async fn something_that_is_not_http_is_a_bad_answer() {
        let (ssh, _) = answering(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n").await;
        let (silent_close, _) = server(|s, _| async move { drop(s) }).await;
        let (http2ish, _) = answering(b"HTTP/2 200\r\n\r\n").await;

        for addr in [ssh, silent_close, http2ish] {
            let out = probe(addr, None, PATIENT).await;
            assert!(
                matches!(out, ProbeOutcome::BadAnswer { .. }),
                "{addr}: {out:?}"
            );
            assert_eq!(out.reason(), "BadAnswer");
        }
        let out = probe(ssh, None, PATIENT).await;
        assert!(out.describe(Some(ssh), None).contains("SSH-2.0"), "{out:?}");
    }

    #[tokio::test]
    async fn an_endless_line_is_cut_at_the_cap() {
        let (addr, _) = server(|mut s, _| async move {
            let mut head = [0u8; 256];
            let _ = s.read(&mut head).await;
            let block = [b'A'; 4096];
            // Far more than the cap, never a line end: the probe must stop reading.
            for _ in 0..256 {
                if s.write_all(&block).await.is_err() {
                    break;
                }
            }
        })
        .await;

        let out = probe(addr, None, PATIENT).await;

        let ProbeOutcome::BadAnswer { answer } = &out else {
            panic!("{out:?}")
        };
        assert!(answer.contains(&format!("no line end within {MAX_STATUS_LINE} bytes")));
        assert!(
            answer.len() < 200,
            "the message quotes a bounded prefix: {answer}"
        );
    }

    #[test]
    fn status_lines_are_read_strictly() {
        for (line, want) in [
            (&b"HTTP/1.1 200 Connection established"[..], Some(200)),
            (b"HTTP/1.0 403 Forbidden", Some(403)),
            (b"HTTP/1.1 502", Some(502)),
            (b"HTTP/1.1 099 Low", None),
            (b"HTTP/1.1 20 Short", None),
            (b"HTTP/1.1 2000 Long", None),
            (b"HTTP/1.x 200 OK", None),
            (b"HTTP/2 200", None),
            (b"http/1.1 200 OK", None),
            (b"", None),
        ] {
            assert_eq!(status_of(line), want, "{:?}", String::from_utf8_lossy(line));
        }
    }

    /// Dials into memory; each connection is answered only when the test says so.
    struct Gated {
        dialled: AtomicUsize,
        release: Notify,
    }

    impl Dialer for Gated {
        fn dial(&self, _: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn ProbeStream>>> {
            self.dialled.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let (client, mut proxy) = tokio::io::duplex(1024);
                self.release.notified().await;
                tokio::spawn(async move {
                    let mut head = [0u8; 256];
                    let _ = proxy.read(&mut head).await;
                    let _ = proxy.write_all(OK_200).await;
                    let mut rest = Vec::new();
                    let _ = proxy.read_to_end(&mut rest).await;
                });
                Ok(Box::new(client) as Box<dyn ProbeStream>)
            })
        }
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_concurrency_probes_run_and_the_next_waits_for_a_slot() {
        let config = ServingConfig {
            concurrency: 2,
            timeout_seconds: 60,
            ..Default::default()
        };
        let gate = Arc::new(Gated {
            dialled: AtomicUsize::new(0),
            release: Notify::new(),
        });
        let metrics = ProbeMetrics::default();
        let prober = Prober::with_dialer(&config, gate.clone(), metrics.clone());
        let ip: IpAddr = "192.0.2.1".parse().unwrap();

        let probes: Vec<_> = (0..3)
            .map(|_| {
                let p = prober.clone();
                tokio::spawn(async move { p.probe(ip).await })
            })
            .collect();
        settle().await;
        assert_eq!(
            gate.dialled.load(Ordering::SeqCst),
            2,
            "the third must wait"
        );
        assert_eq!(metrics.in_flight(), 2);

        gate.release.notify_one();
        settle().await;
        assert_eq!(gate.dialled.load(Ordering::SeqCst), 3, "a slot freed up");
        assert_eq!(metrics.in_flight(), 2);

        gate.release.notify_one();
        gate.release.notify_one();
        for p in probes {
            let out = tokio::time::timeout(PATIENT, p).await.unwrap().unwrap();
            assert!(out.is_serving(), "{out:?}");
        }
        assert_eq!(metrics.in_flight(), 0);
        assert_eq!(metrics.outcomes("Serving"), 3);
    }
}
