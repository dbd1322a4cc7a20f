//! A private OCI registry: the CNCF distribution registry (Debian's `docker-registry`,
//! 2.8) on 127.0.0.1 and a free port, with TLS from a CA made for this instance and
//! htpasswd (bcrypt) basic auth for one user.
//!
//! The package's own service is never used (it would listen on a shared port); each test
//! starts its own registry with its storage in a temp dir and stops it on drop. A test
//! process killed before its drop ran leaves a registry whose temp dir names a PID that is
//! gone: the next start kills it and removes the dir.

use std::fs::{self, File};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

use super::process::{self, LOG_TAIL_LINES};
use super::{owner_is_gone, temp_dir_with_owner};

/// The registry binary of Debian's `docker-registry`.
pub const REGISTRY: &str = "docker-registry";
/// apache2-utils' htpasswd, which writes the bcrypt password file.
pub const HTPASSWD: &str = "htpasswd";
/// Temp dirs (and so registry command lines) carry this prefix and the owner's PID.
const DIR_PREFIX: &str = "eotest-registry-";
/// The registry starts in well under a second; a loaded machine may take a few.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Attempts at a free port: another process can take the probed port before the
/// registry binds it.
const PORT_ATTEMPTS: usize = 5;
/// bcrypt's lowest cost: the password file guards a throwaway registry, and every
/// request checks it.
const BCRYPT_COST: &str = "4";

/// A running registry.
#[derive(Debug)]
pub struct Registry {
    dir: TempDir,
    port: u16,
    user: String,
    password: String,
    child: Option<Child>,
}

impl Registry {
    /// Starts a registry on 127.0.0.1 that admits `user` with `password`.
    pub fn start(user: &str, password: &str) -> Result<Registry> {
        reap_stale();
        let dir = temp_dir_with_owner(DIR_PREFIX)?;
        let base = dir.path().to_path_buf();
        let pki = Pki::generate()?;
        fs::write(base.join("ca.pem"), &pki.ca_pem)?;
        fs::write(base.join("server.pem"), &pki.server_pem)?;
        fs::write(base.join("server.key"), &pki.server_key_pem)?;
        let hash = process::run(
            Command::new(HTPASSWD)
                .args(["-n", "-b", "-B", "-C", BCRYPT_COST])
                .arg(user)
                .arg(password),
        )?;
        fs::write(base.join("htpasswd"), hash.trim_end())?;
        let mut registry = Registry {
            dir,
            port: 0,
            user: user.into(),
            password: password.into(),
            child: None,
        };
        for attempt in 1..=PORT_ATTEMPTS {
            registry.port = free_port()?;
            registry.write_config()?;
            match registry.spawn_and_wait() {
                Ok(()) => return Ok(registry),
                Err(e) if attempt < PORT_ATTEMPTS && registry.lost_port_race() => {
                    eprintln!(
                        "harness: registry lost port {}: {e:#}; retrying",
                        registry.port
                    );
                }
                Err(e) => return Err(e),
            }
        }
        bail!("no free port for the registry after {PORT_ATTEMPTS} attempts")
    }

    /// `127.0.0.1:PORT`, the registry part of a reference.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `oci://127.0.0.1:PORT/<repository>`.
    pub fn reference(&self, repository: &str) -> String {
        format!("oci://{}/{repository}", self.host())
    }

    /// The PEM of the CA that signed the registry's certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The user and password the registry admits.
    pub fn credentials(&self) -> (&str, &str) {
        (&self.user, &self.password)
    }

    /// Writes a Docker config JSON with an `auths` entry for this registry (what a
    /// `kubernetes.io/dockerconfigjson` Secret holds) to `path`.
    pub fn write_docker_config(&self, path: &Path) -> Result<()> {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD
            .encode(format!("{}:{}", self.user, self.password));
        let doc = serde_json::json!({ "auths": { self.host(): { "auth": auth } } });
        fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("cannot write {}", path.display()))
    }

    /// Where the registry stores the blob of that sha256 (filesystem driver layout), so a
    /// test can tamper with what it serves.
    pub fn blob_path(&self, sha256: &str) -> PathBuf {
        self.dir
            .path()
            .join("storage/docker/registry/v2/blobs/sha256")
            .join(&sha256[..2])
            .join(sha256)
            .join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("registry.log")
    }

    fn write_config(&self) -> Result<()> {
        let base = self.dir.path();
        let config = format!(
            "version: 0.1\n\
             log:\n  level: info\n  formatter: text\n\
             storage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: true\n\
             http:\n  addr: 127.0.0.1:{port}\n  secret: eotest-{port}\n  \
             tls:\n    certificate: {base}/server.pem\n    key: {base}/server.key\n\
             auth:\n  htpasswd:\n    realm: eotest\n    path: {base}/htpasswd\n",
            root = base.join("storage").display(),
            port = self.port,
            base = base.display(),
        );
        fs::write(base.join("config.yml"), config)?;
        Ok(())
    }

    fn spawn_and_wait(&mut self) -> Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(REGISTRY)
            .arg("serve")
            .arg(self.dir.path().join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {REGISTRY}"))?;
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let ready = process::wait_until(START_TIMEOUT, || {
            if let Some(status) = self
                .child
                .as_mut()
                .map(Child::try_wait)
                .transpose()?
                .flatten()
            {
                bail!("{REGISTRY} exited with {status}");
            }
            Ok(TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())
        });
        match ready {
            Ok(true) => Ok(()),
            Ok(false) | Err(_) => {
                let why = match ready {
                    Err(e) => format!("{e:#}"),
                    _ => format!("nothing listens on {addr} after {START_TIMEOUT:?}"),
                };
                let tail = process::tail(&self.log_path(), LOG_TAIL_LINES);
                self.stop();
                bail!("{REGISTRY} did not start: {why}; log tail:\n{tail}")
            }
        }
    }

    fn lost_port_race(&self) -> bool {
        fs::read_to_string(self.log_path()).is_ok_and(|l| l.contains("address already in use"))
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Best effort: the registry may have exited already.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Kills registries of test processes that are gone, and removes their dirs.
fn reap_stale() {
    let Ok(entries) = fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !text.contains(REGISTRY) {
            continue;
        }
        let Some(start) = text.find(DIR_PREFIX) else {
            continue;
        };
        let name = text[start..].split('/').next().unwrap_or_default();
        if owner_is_gone(name, DIR_PREFIX) {
            process::kill_tree(pid);
        }
    }
    super::remove_stale_temp_dirs(DIR_PREFIX);
}

struct Pki {
    ca_pem: String,
    server_pem: String,
    server_key_pem: String,
}

impl Pki {
    /// A CA of its own and a server certificate for 127.0.0.1 signed by it.
    fn generate() -> Result<Pki> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "egress-operator test registry CA");
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);
        let server_key = KeyPair::generate()?;
        let mut server =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
        server
            .distinguished_name
            .push(DnType::CommonName, "test registry");
        let server_cert = server.signed_by(&server_key, &issuer)?;
        Ok(Pki {
            ca_pem: ca_cert.pem(),
            server_pem: server_cert.pem(),
            server_key_pem: server_key.serialize_pem(),
        })
    }
}
