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
                runtime.spawn(serve(addr, port, listener, rx, answered));
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
        tx.send_replace(up);
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
) {
    let mut listener = tokio::net::TcpListener::from_std(first).ok();
    loop {
        match &listener {
            Some(l) => {
                tokio::select! {
                    accepted = l.accept() => {
                        if let Ok((stream, _)) = accepted {
                            tokio::spawn(answer(stream, answered.clone()));
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
/// holds the connection until the client closes it, as a tunnel would.
async fn answer(mut stream: tokio::net::TcpStream, answered: Arc<AtomicU64>) {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
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
