//! A tiny HTTPS server on 127.0.0.1 for download tests, with a fresh self-signed
//! certificate. It serves fixed routes, counts requests, and stops on drop.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use anyhow::Context;

/// What a route answers.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 200 with this body.
    Body(Vec<u8>),
    /// 302 to this location (absolute or path).
    Redirect(String),
    /// This status with an empty body.
    Status(u16),
}

/// A running server.
#[derive(Debug)]
pub struct HttpsServer {
    port: u16,
    ca_pem: String,
    requests: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HttpsServer {
    /// Starts serving `routes` (path → reply); unknown paths get 404.
    pub fn start(routes: Vec<(String, Reply)>) -> anyhow::Result<Self> {
        let key = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])
            .context("generating a certificate")?;
        let ca_pem = key.cert.pem();
        let cert_der = key.cert.der().clone();
        let key_der =
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS versions")?
            .with_no_client_auth()
            .with_single_cert(vec![cert_der], key_der)
            .context("server certificate")?;
        let config = Arc::new(config);
        let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let requests = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, flag) = (requests.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if flag.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                count.fetch_add(1, Ordering::SeqCst);
                let _ = serve(stream, config.clone(), &routes, port);
            }
        });
        Ok(Self {
            port,
            ca_pem,
            requests,
            stop,
            thread: Some(thread),
        })
    }

    /// `https://127.0.0.1:PORT/path`.
    pub fn url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}{path}", self.port)
    }

    /// The certificate to trust, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Connections accepted so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for HttpsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
    routes: &[(String, Reply)],
    port: u16,
) -> anyhow::Result<()> {
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let conn = rustls::ServerConnection::new(config)?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tls.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        request.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&request);
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
    let reply = routes
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, r)| r.clone())
        .unwrap_or(Reply::Status(404));
    let (status, headers, body) = match reply {
        Reply::Body(b) => ("200 OK".to_string(), String::new(), b),
        Reply::Redirect(to) => {
            let to = if to.starts_with('/') {
                format!("https://127.0.0.1:{port}{to}")
            } else {
                to
            };
            (
                "302 Found".to_string(),
                format!("Location: {to}\r\n"),
                Vec::new(),
            )
        }
        Reply::Status(code) => (format!("{code} Status"), String::new(), Vec::new()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes())?;
    tls.write_all(&body)?;
    tls.flush()?;
    tls.conn.send_close_notify();
    let _ = tls.flush();
    Ok(())
}
