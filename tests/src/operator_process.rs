//! `egress-operator run` as a process, as a Deployment's container would run it: its own
//! kubeconfig (a ServiceAccount's token), its own HTTP endpoints, logs drained all along
//! into a buffer tests can read while it runs, and SIGTERM then SIGKILL on drop, so no
//! replica outlives its test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

/// How long a stopped operator gets to exit after SIGTERM before SIGKILL: its own
/// shutdown waits for reconciles to wind down.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// A running operator replica.
#[derive(Debug)]
pub struct OperatorProcess {
    child: Option<Child>,
    log: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
    http_addr: String,
    identity: String,
}

/// How to start one replica.
#[derive(Debug, Clone)]
pub struct OperatorOptions {
    /// The `egress-operator` binary (`CARGO_BIN_EXE_operator-under-test` in tests).
    pub binary: PathBuf,
    /// The providers config file.
    pub config: PathBuf,
    /// The kubeconfig it acts with.
    pub kubeconfig: PathBuf,
    /// Its identity in the election and in events (POD_NAME).
    pub identity: String,
    /// Namespace of the leader Lease (POD_NAMESPACE).
    pub namespace: String,
    /// Where compiled plugins are cached (created 0700 by the operator).
    pub plugin_cache_dir: PathBuf,
    /// More arguments after `run`.
    pub extra_args: Vec<String>,
    /// `RUST_LOG`.
    pub log_filter: String,
}

impl OperatorProcess {
    /// Starts `run --log-format json` with `options`; returns at once (see
    /// [`wait_ready`](Self::wait_ready)).
    pub fn start(options: &OperatorOptions) -> Result<OperatorProcess> {
        let http_addr = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
            probe.local_addr()?.to_string()
        };
        let mut child = Command::new(&options.binary)
            .args(["run", "--config"])
            .arg(&options.config)
            .args(["--http-addr", &http_addr, "--log-format", "json"])
            .arg("--plugin-cache-dir")
            .arg(&options.plugin_cache_dir)
            .args(&options.extra_args)
            .env("KUBECONFIG", &options.kubeconfig)
            .env("POD_NAME", &options.identity)
            .env("POD_NAMESPACE", &options.namespace)
            .env("RUST_LOG", &options.log_filter)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", options.binary.display()))?;
        let mut pipe = child
            .stderr
            .take()
            .ok_or_else(|| anyhow!("no stderr pipe"))?;
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        let reader = std::thread::spawn(move || {
            use std::io::BufRead;
            let reader = std::io::BufReader::new(&mut pipe);
            for line in reader.lines() {
                let Ok(line) = line else { break };
                if let Ok(mut text) = sink.lock() {
                    text.push_str(&line);
                    text.push('\n');
                }
            }
        });
        Ok(OperatorProcess {
            child: Some(child),
            log,
            reader: Some(reader),
            http_addr,
            identity: options.identity.clone(),
        })
    }

    /// Its identity (POD_NAME).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The process ID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Everything it logged so far (JSON lines).
    pub fn log(&self) -> String {
        self.log.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Log lines at WARN or ERROR.
    pub fn warnings(&self) -> Vec<String> {
        self.log()
            .lines()
            .filter(|l| l.contains("\"level\":\"WARN\"") || l.contains("\"level\":\"ERROR\""))
            .map(str::to_string)
            .collect()
    }

    /// `GET path` on its HTTP endpoints: (status code, body), or None when it does not
    /// answer.
    pub fn http_get(&self, path: &str) -> Option<(u16, String)> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.http_addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let code = out.get(9..12)?.parse().ok()?;
        Some((
            code,
            out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string(),
        ))
    }

    /// Whether the process has exited (and with what).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Polls `/readyz` until it answers 200, under `guard` (a hang guard); fails with the
    /// log when the process exits or the guard runs out.
    pub fn wait_ready(&mut self, guard: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if matches!(self.http_get("/readyz"), Some((200, _))) {
                return Ok(());
            }
            if let Some(status) = self.exited() {
                return Err(anyhow!(
                    "the operator exited ({status}); it logged:\n{}",
                    self.log()
                ));
            }
            if start.elapsed() > guard {
                return Err(anyhow!(
                    "the operator was not ready within {guard:?} (hang guard); it logged:\n{}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGTERM, then waits for the exit under the grace; SIGKILL after it. Returns the
    /// exit status.
    pub fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow!("already stopped"))?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if start.elapsed() > STOP_GRACE {
                let _ = child.kill();
                break child.wait()?;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        Ok(status)
    }

    /// SIGKILL at once, as a crashed or evicted replica.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        Ok(())
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.terminate();
        }
    }
}

/// The operator's default test log filter: our crate at debug, libraries at warn.
pub const DEFAULT_LOG_FILTER: &str = "warn,egress_operator=info";

impl OperatorOptions {
    /// Options for `binary` with `config`, acting as `kubeconfig`, identity `identity`,
    /// leader Lease in `namespace`, plugin cache below `dir`.
    pub fn new(
        binary: &Path,
        config: &Path,
        kubeconfig: &Path,
        identity: &str,
        namespace: &str,
        dir: &Path,
    ) -> OperatorOptions {
        OperatorOptions {
            binary: binary.to_path_buf(),
            config: config.to_path_buf(),
            kubeconfig: kubeconfig.to_path_buf(),
            identity: identity.to_string(),
            namespace: namespace.to_string(),
            plugin_cache_dir: dir.join(format!("plugin-cache-{identity}")),
            extra_args: Vec::new(),
            log_filter: DEFAULT_LOG_FILTER.to_string(),
        }
    }
}
