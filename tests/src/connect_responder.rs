//! Stand-in proxies for cluster tests whose VMs do not boot: one listener per address on
//! loopback (`127.77.x.y`, all of 127/8 is local on Linux) that answers an HTTP `CONNECT`
//! with `200 Connection established`, as tinyproxy does, so the operator's Serving probe
//! passes for instances whose static address comes from a loopback address pool.
//!
//! A test can take one address down ([`ConnectResponder::set_up`]): its listener is closed,
//! so connections are refused as with a stopped proxy, and it comes back on the same port.
//! Nothing here sends traffic anywhere; it only answers on loopback.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

/// How often binding all addresses on one port is tried with a fresh port.
const PORT_ATTEMPTS: usize = 5;

/// Listeners answering CONNECT on a set of loopback addresses, all on one port.
#[derive(Debug)]
pub struct ConnectResponder {
    port: u16,
    up: Mutex<HashMap<Ipv4Addr, watch::Sender<bool>>>,
    answered: Arc<AtomicU64>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl ConnectResponder {
    /// Listens on every address of `addresses` (loopback only) on one free port.
    pub fn start(addresses: impl IntoIterator<Item = Ipv4Addr>) -> Result<ConnectResponder> {
        let addresses: Vec<Ipv4Addr> = addresses.into_iter().collect();
        if let Some(a) = addresses.iter().find(|a| !a.is_loopback()) {
            return Err(anyhow!(
                "{a} is not a loopback address: the responder stays on loopback"
            ));
        }
        Self::listen(addresses, None)
    }

    /// Stand-in proxies that carry traffic, for the node tier: listens on `addresses` of
    /// the node tier's lab range ([`crate::harness::node::LAB_NET`], local to this host
    /// and routed from the pods), and tunnels a `CONNECT` to `tunnel_to`, and only to it,
    /// from the listening address, as a proxy VM does from its own address: the server
    /// at `tunnel_to` sees which proxy carried a request. Any other `CONNECT` (the
    /// operator's probe) is answered as by [`ConnectResponder::start`].
    pub fn start_tunnelling(
        addresses: impl IntoIterator<Item = Ipv4Addr>,
        tunnel_to: SocketAddr,
    ) -> Result<ConnectResponder> {
        let addresses: Vec<Ipv4Addr> = addresses.into_iter().collect();
        if let Some(a) = addresses
            .iter()
            .find(|a| !crate::harness::node::in_lab_net(**a))
        {
            return Err(anyhow!(
                "{a} is not in the node tier's lab range: the responder stays on this host"
            ));
        }
        Self::listen(addresses, Some(tunnel_to))
    }

    fn listen(addresses: Vec<Ipv4Addr>, tunnel_to: Option<SocketAddr>) -> Result<ConnectResponder> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("connect-responder")
            .enable_all()
            .build()?;
        let answered = Arc::new(AtomicU64::new(0));
        let mut last = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
                .local_addr()?
                .port();
            let bound: Result<Vec<_>> = addresses
                .iter()
                .map(|a| {
                    let l = std::net::TcpListener::bind((*a, port))
                        .with_context(|| format!("cannot listen on {a}:{port}"))?;
                    l.set_nonblocking(true)?;
                    Ok((*a, l))
                })
                .collect();
            let bound = match bound {
                Ok(b) => b,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let mut up = HashMap::new();
            for (addr, listener) in bound {
                let (tx, rx) = watch::channel(true);
                up.insert(addr, tx);
                let answered = answered.clone();
                runtime.spawn(serve(addr, port, listener, rx, answered, tunnel_to));
            }
            return Ok(ConnectResponder {
                port,
                up: Mutex::new(up),
                answered,
                runtime: Some(runtime),
            });
        }
        Err(last.unwrap_or_else(|| anyhow!("no port")))
    }

    /// The port every address listens on (the providers config's `serving.port`).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Takes `addr` down (connections refused) or brings it back.
    pub fn set_up(&self, addr: Ipv4Addr, up: bool) -> Result<()> {
        let map = self.up.lock().map_err(|_| anyhow!("poisoned"))?;
        let tx = map
            .get(&addr)
            .ok_or_else(|| anyhow!("{addr} is not one of the responder's addresses"))?;
        // Only a change wakes the listener: callers may repeat the same state often.
        tx.send_if_modified(|now| std::mem::replace(now, up) != up);
        Ok(())
    }

    /// CONNECT requests answered so far.
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }
}

impl Drop for ConnectResponder {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

async fn serve(
    addr: Ipv4Addr,
    port: u16,
    first: std::net::TcpListener,
    mut up: watch::Receiver<bool>,
    answered: Arc<AtomicU64>,
    tunnel_to: Option<SocketAddr>,
) {
    let mut listener = tokio::net::TcpListener::from_std(first).ok();
    loop {
        match &listener {
            Some(l) => {
                tokio::select! {
                    accepted = l.accept() => {
                        if let Ok((stream, _)) = accepted {
                            tokio::spawn(answer(stream, answered.clone(), addr, tunnel_to));
                        }
                    }
                    changed = up.changed() => {
                        if changed.is_err() { return; }
                        if !*up.borrow() { listener = None; }
                    }
                }
            }
            None => {
                if up.changed().await.is_err() {
                    return;
                }
                if *up.borrow() {
                    // Rebinding right after close can race TIME_WAIT-free reuse; retry briefly.
                    for _ in 0..50 {
                        if let Ok(l) =
                            tokio::net::TcpListener::bind(SocketAddr::from((addr, port))).await
                        {
                            listener = Some(l);
                            break;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                }
            }
        }
    }
}

/// Reads the request head and answers a CONNECT with 200, anything else with 405; then
/// holds the connection until the client closes it, as a tunnel would. A CONNECT to
/// `tunnel_to` is a real tunnel, opened from `from`.
async fn answer(
    mut stream: tokio::net::TcpStream,
    answered: Arc<AtomicU64>,
    from: Ipv4Addr,
    tunnel_to: Option<SocketAddr>,
) {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    if let Some(to) = tunnel_to
        && head.starts_with(format!("CONNECT {to} ").as_bytes())
    {
        answered.fetch_add(1, Ordering::Relaxed);
        tunnel(stream, &head, from, to).await;
        return;
    }
    let reply: &[u8] = if head.starts_with(b"CONNECT ") {
        answered.fetch_add(1, Ordering::Relaxed);
        b"HTTP/1.1 200 Connection established\r\n\r\n"
    } else {
        b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n"
    };
    if stream.write_all(reply).await.is_err() {
        return;
    }
    let mut rest = [0u8; 1024];
    while let Ok(n) = stream.read(&mut rest).await {
        if n == 0 {
            break;
        }
    }
}

/// Opens `to` from `from`, says `200` and copies both ways until either side closes.
/// Bytes the client sent after the request head go first.
async fn tunnel(mut client: tokio::net::TcpStream, head: &[u8], from: Ipv4Addr, to: SocketAddr) {
    let upstream = async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from((from, 0)))?;
        socket.connect(to).await
    };
    let mut upstream = match upstream.await {
        Ok(u) => u,
        Err(_) => {
            let _ = client
                .write_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                .await;
            return;
        }
    };
    if client
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await
        .is_err()
    {
        return;
    }
    let end = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(head.len(), |i| i + 4);
    if upstream.write_all(&head[end..]).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}
