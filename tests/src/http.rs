//! A plain HTTP/1.1 image server on 127.0.0.1 for provider tests and the demo: fixed
//! routes, faults on purpose (a body shorter than its Content-Length, no Content-Length,
//! redirects, a slow body), a request count per path. Bodies are streamed from memory or a file.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::Context;

/// What a route answers.
#[derive(Debug, Clone)]
pub enum Route {
    /// 200 with this body and its Content-Length.
    Body(Arc<Vec<u8>>),
    /// 200 streaming this file, with its Content-Length.
    File(PathBuf),
    /// 200 claiming `declared` bytes, sending only the body, then closing.
    Truncated {
        /// The body actually sent.
        body: Arc<Vec<u8>>,
        /// The Content-Length claimed.
        declared: u64,
    },
    /// 302 to this location (absolute, or a path on this server).
    Redirect(String),
    /// 200 whose body is the client's address, which [`HttpServer::peers`] also records:
    /// behind a proxy, the address of the proxy that carried the request.
    Peer,
    /// 200 with this body and its Content-Length, sent `chunk` bytes at a time with
    /// `pause` between chunks: a server that is never idle for long but slow overall.
    Slow {
        /// The body.
        body: Arc<Vec<u8>>,
        /// Bytes per write.
        chunk: usize,
        /// Pause after each write.
        pause: std::time::Duration,
    },
}

/// A running server; stops on drop.
#[derive(Debug)]
pub struct HttpServer {
    addr: std::net::Ipv4Addr,
    port: u16,
    peers: Arc<Mutex<Vec<std::net::IpAddr>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Starts serving `routes`; other paths get 404.
    pub fn start(routes: Vec<(String, Route)>) -> anyhow::Result<Self> {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST, routes)
    }

    /// [`HttpServer::start`] on `addr` (the node tier's host address, which pods reach)
    /// instead of loopback.
    pub fn start_on(
        addr: std::net::Ipv4Addr,
        routes: Vec<(String, Route)>,
    ) -> anyhow::Result<Self> {
        let listener = TcpListener::bind((addr, 0)).with_context(|| format!("binding {addr}:0"))?;
        let port = listener.local_addr()?.port();
        let peers = Arc::new(Mutex::new(Vec::new()));
        let hits = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let routes = Arc::new(routes);
        let (h, flag, seen) = (hits.clone(), stop.clone(), peers.clone());
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if flag.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (routes, hits, peers) = (routes.clone(), h.clone(), seen.clone());
                // One thread per connection: concurrent downloads must not queue.
                std::thread::spawn(move || {
                    let _ = serve(stream, &routes, &hits, &peers, (addr, port));
                });
            }
        });
        Ok(Self {
            addr,
            port,
            peers,
            hits,
            stop,
            thread: Some(thread),
        })
    }

    /// `http://ADDRESS:PORT/path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}:{}{path}", self.addr, self.port)
    }

    /// The client address of every request answered by a [`Route::Peer`], in order.
    pub fn peers(&self) -> Vec<std::net::IpAddr> {
        self.peers.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Requests for `path` so far.
    pub fn hits(&self, path: &str) -> usize {
        self.hits
            .lock()
            .map(|h| h.get(path).copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect((self.addr, self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    mut tcp: TcpStream,
    routes: &[(String, Route)],
    hits: &Mutex<HashMap<String, usize>>,
    peers: &Mutex<Vec<std::net::IpAddr>>,
    (addr, port): (std::net::Ipv4Addr, u16),
) -> anyhow::Result<()> {
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tcp.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        request.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&request);
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
    if let Ok(mut h) = hits.lock() {
        *h.entry(path.clone()).or_default() += 1;
    }
    let route = routes
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, r)| r.clone());
    match route {
        None => tcp.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )?,
        Some(Route::Redirect(to)) => {
            let to = if to.starts_with('/') {
                format!("http://{addr}:{port}{to}")
            } else {
                to
            };
            write!(
                tcp,
                "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )?;
        }
        Some(Route::Peer) => {
            let peer = tcp.peer_addr()?.ip();
            if let Ok(mut p) = peers.lock() {
                p.push(peer);
            }
            let body = format!("{peer}\n");
            write!(
                tcp,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )?;
        }
        Some(Route::Body(body)) => {
            write!(
                tcp,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )?;
            tcp.write_all(&body)?;
        }
        Some(Route::Truncated { body, declared }) => {
            write!(
                tcp,
                "HTTP/1.1 200 OK\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n"
            )?;
            tcp.write_all(&body)?;
        }
        Some(Route::Slow { body, chunk, pause }) => {
            write!(
                tcp,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )?;
            for part in body.chunks(chunk.max(1)) {
                tcp.write_all(part)?;
                tcp.flush()?;
                std::thread::sleep(pause);
            }
        }
        Some(Route::File(file)) => {
            let mut f = std::fs::File::open(&file)?;
            let len = f.metadata()?.len();
            write!(
                tcp,
                "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
            )?;
            std::io::copy(&mut f, &mut tcp)?;
        }
    }
    tcp.flush()?;
    Ok(())
}
