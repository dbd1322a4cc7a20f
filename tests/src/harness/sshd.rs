//! OpenSSH's sshd on 127.0.0.1, started per test with its own keys, so the SSH
//! transport is tested against the real server a libvirt host runs.

use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

use super::process::{self, LOG_TAIL_LINES};
use super::{owner_is_gone, temp_dir_with_owner};

/// sshd must be started by absolute path: it re-executes itself per connection.
const SSHD: &str = "/usr/sbin/sshd";
/// sshd refuses to start without its privilege separation directory, which only
/// the (absent) init scripts would create.
const PRIVSEP_DIR: &str = "/run/sshd";
/// Prefix of our temp dirs; the owning test's PID follows, so a later run can
/// tell leftovers of a killed test run from a live one.
const DIR_PREFIX: &str = "eotest-sshd-";
/// The account tests log in as: tests run as root, and root is the only account
/// whose home and shell are certain to exist.
const USER: &str = "root";
/// How long sshd may take to listen: it starts in milliseconds, the rest is
/// headroom for a machine busy compiling.
const START_TIMEOUT: Duration = Duration::from_secs(15);
/// How often a start is retried on a fresh port when another process took the
/// port between our probe and sshd's bind.
const PORT_ATTEMPTS: usize = 5;
/// How long a restart waits for the old port to become bindable again.
const RESTART_TIMEOUT: Duration = Duration::from_secs(15);
/// How long stopped processes get to disappear after SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Per-probe connect/read timeout while waiting for the banner.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// A running sshd and everything a client needs to log in to it. Stopped (with
/// all its connection processes) and its files removed on drop, also when the
/// test panics.
#[derive(Debug)]
pub struct Sshd {
    dir: TempDir,
    port: u16,
    host_public_key: String,
    child: Option<Child>,
    /// `AllowStreamLocalForwarding`: the libvirt tunnel needs it.
    streamlocal: bool,
    /// The address sshd listens on: loopback, or the node tier's host address, which
    /// pods reach.
    listen: Ipv4Addr,
}

impl Sshd {
    /// Generates keys and config in a fresh temp dir and starts sshd on a free
    /// loopback port. Returns once sshd answers with its SSH banner.
    pub fn start() -> Result<Sshd> {
        Self::start_on(Ipv4Addr::LOCALHOST)
    }

    /// [`Sshd::start`] on `listen` (the node tier's [`super::node::HOST_ADDRESS`], which
    /// an operator in a pod reaches) instead of loopback.
    pub fn start_on(listen: Ipv4Addr) -> Result<Sshd> {
        reap_stale();
        fs::create_dir_all(PRIVSEP_DIR).with_context(|| format!("cannot create {PRIVSEP_DIR}"))?;
        fs::set_permissions(PRIVSEP_DIR, fs::Permissions::from_mode(0o755))?;

        let dir = temp_dir_with_owner(DIR_PREFIX)?;
        let base = dir.path().to_path_buf();
        keygen(&base.join("host_ed25519"), "eotest host key")?;
        keygen(&base.join("client_ed25519"), "eotest client key")?;
        fs::set_permissions(
            base.join("client_ed25519"),
            fs::Permissions::from_mode(0o600),
        )?;
        fs::copy(
            base.join("client_ed25519.pub"),
            base.join("authorized_keys"),
        )?;
        let host_public_key = public_key(&base.join("host_ed25519.pub"))?;

        let mut sshd = Sshd {
            dir,
            port: 0,
            host_public_key,
            child: None,
            streamlocal: true,
            listen,
        };
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            sshd.port = free_port(listen)?;
            sshd.write_config()?;
            write_known_hosts(
                &sshd.known_hosts(),
                listen,
                sshd.port,
                &sshd.host_public_key,
            )?;
            match sshd.spawn_and_wait(START_TIMEOUT) {
                Ok(()) => return Ok(sshd),
                Err(e) if sshd.lost_port_race() => last_error = Some(e),
                Err(e) => return Err(e),
            }
        }
        match last_error {
            Some(e) => Err(e.context(format!("no free port after {PORT_ATTEMPTS} attempts"))),
            None => bail!("sshd did not start"),
        }
    }

    /// The listening port (on 127.0.0.1 unless started with [`Sshd::start_on`]).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `ADDRESS:PORT`, the form the providers config uses for a host address.
    pub fn address(&self) -> String {
        format!("{}:{}", self.listen, self.port)
    }

    /// The login user.
    pub fn user(&self) -> &'static str {
        USER
    }

    /// The authorised client private key (ed25519, mode 0600, no passphrase).
    pub fn client_key(&self) -> PathBuf {
        self.dir.path().join("client_ed25519")
    }

    /// A known_hosts file holding the real host key as `[ADDRESS]:PORT`.
    pub fn known_hosts(&self) -> PathBuf {
        self.dir.path().join("known_hosts")
    }

    /// The host public key as `ssh-ed25519 BASE64` (no comment).
    pub fn host_public_key(&self) -> &str {
        &self.host_public_key
    }

    /// The temp dir holding keys, config and log; tests may put files there.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// sshd's log (LogLevel VERBOSE); restarts append to it.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("sshd.log")
    }

    /// The whole log, for assertions and for failure messages.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// How many public-key logins sshd accepted since start (across restarts):
    /// tests use it to prove connection reuse or redialling.
    pub fn accepted_connections(&self) -> usize {
        self.log()
            .lines()
            .filter(|line| line.contains("Accepted publickey"))
            .count()
    }

    /// How many TCP connections sshd took since start (across restarts), whether or not
    /// they got as far as a login: tests count dials that fail in the handshake with it.
    pub fn tcp_connections(&self) -> usize {
        self.log()
            .lines()
            .filter(|line| line.contains("Connection from"))
            .count()
    }

    /// A known_hosts file naming this server with a different, freshly made host
    /// key: a client that verifies host keys must refuse it.
    pub fn wrong_known_hosts(&self) -> Result<PathBuf> {
        let key = self.dir.path().join("other_host_ed25519");
        if !key.exists() {
            keygen(&key, "eotest impostor host key")?;
        }
        let path = self.dir.path().join("known_hosts_wrong");
        write_known_hosts(
            &path,
            self.listen,
            self.port,
            &public_key(&key.with_extension("pub"))?,
        )?;
        Ok(path)
    }

    /// A client private key (mode 0600) that is NOT in authorized_keys: logins
    /// with it must fail authentication.
    pub fn unauthorized_client_key(&self) -> Result<PathBuf> {
        let key = self.dir.path().join("unauthorized_ed25519");
        if !key.exists() {
            keygen(&key, "eotest unauthorized key")?;
            fs::set_permissions(&key, fs::Permissions::from_mode(0o600))?;
        }
        Ok(key)
    }

    /// An `ssh` client command for this server with the given key and known_hosts:
    /// no user config, no agent, no prompts, strict host key checking. Append the
    /// remote command (or `-N` and forwards) and run it.
    pub fn ssh_command_with(&self, key: &Path, known_hosts: &Path) -> Command {
        let mut cmd = Command::new("ssh");
        cmd.arg("-F")
            .arg("/dev/null")
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-i")
            .arg(key)
            .args(["-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none"])
            .args(["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"])
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", known_hosts.display()))
            .args([
                "-o",
                "GlobalKnownHostsFile=/dev/null",
                "-o",
                "ConnectTimeout=10",
            ])
            .arg("-l")
            .arg(USER)
            .arg(self.listen.to_string());
        cmd
    }

    /// [`Sshd::ssh_command_with`] with the authorised key and the right known_hosts.
    pub fn ssh_command(&self) -> Command {
        self.ssh_command_with(&self.client_key(), &self.known_hosts())
    }

    /// Whether the listening sshd is running (false after [`Sshd::stop`]).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Kills sshd and every connection it serves (SIGKILL, like a crashed or
    /// unplugged host: clients see their connection drop). Idempotent.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pids = process::kill_tree(child.id());
        child.wait().context("cannot reap sshd")?;
        if !process::wait_gone(&pids, STOP_TIMEOUT) {
            bail!("sshd processes {pids:?} survived SIGKILL for {STOP_TIMEOUT:?}");
        }
        Ok(())
    }

    /// Starts sshd again on the same port with the same keys and config, so
    /// clients configured for the old one can reconnect.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        let deadline = Instant::now() + RESTART_TIMEOUT;
        loop {
            match self.spawn_and_wait(START_TIMEOUT) {
                Ok(()) => return Ok(()),
                Err(e) if self.lost_port_race() && Instant::now() < deadline => {
                    drop(e);
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(e.context(format!("cannot restart sshd on port {}", self.port)));
                }
            }
        }
    }

    /// Restarts sshd with streamlocal forwarding allowed or forbidden (what an admin's
    /// `AllowStreamLocalForwarding no` does to the libvirt tunnel).
    pub fn set_streamlocal_forwarding(&mut self, allowed: bool) -> Result<()> {
        self.streamlocal = allowed;
        self.write_config()?;
        self.restart()
    }

    fn write_config(&self) -> Result<()> {
        let dir = self.dir.path().display();
        let config = format!(
            "# Written by the integration test harness.\n\
             ListenAddress {listen}\n\
             Port {port}\n\
             HostKey {dir}/host_ed25519\n\
             PidFile {dir}/sshd.pid\n\
             AuthorizedKeysFile {dir}/authorized_keys\n\
             UsePAM no\n\
             StrictModes no\n\
             PubkeyAuthentication yes\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             PermitRootLogin prohibit-password\n\
             AllowStreamLocalForwarding {streamlocal}\n\
             # OpenSSH 9.2 also gates direct-streamlocal (ssh -L to a unix socket,\n\
             # the libvirt tunnel) on AllowTcpForwarding: with `no` every such\n\
             # request is \"denied\". `local` is the least that works; a PermitOpen\n\
             # list would deny unix socket paths as well, so there is none.\n\
             AllowTcpForwarding local\n\
             GatewayPorts no\n\
             AllowAgentForwarding no\n\
             X11Forwarding no\n\
             PermitTunnel no\n\
             UseDNS no\n\
             PrintMotd no\n\
             LogLevel VERBOSE\n\
             # Tests open many connections at once; the default (10:30:100) would\n\
             # drop some of them at random.\n\
             MaxStartups 100:30:200\n\
             MaxSessions 100\n",
            port = self.port,
            listen = self.listen,
            streamlocal = if self.streamlocal { "yes" } else { "no" },
        );
        fs::write(self.dir.path().join("sshd_config"), config)?;
        Ok(())
    }

    /// Starts the sshd process and waits for its banner. On failure the process is
    /// reaped and the error carries the log tail.
    fn spawn_and_wait(&mut self, timeout: Duration) -> Result<()> {
        let stderr = File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join("sshd.stderr"))?;
        let child = Command::new(SSHD)
            .arg("-D")
            .arg("-e")
            .arg("-f")
            .arg(self.dir.path().join("sshd_config"))
            .arg("-E")
            .arg(self.log_path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("cannot start {SSHD}"))?;
        self.child = Some(child);
        match self.wait_ready(timeout) {
            Ok(()) => Ok(()),
            Err(e) => {
                let tail = process::tail(&self.log_path(), LOG_TAIL_LINES);
                // Best effort: the error below is what matters.
                let _ = self.stop();
                Err(e.context(format!(
                    "sshd on port {} did not start; log tail:\n{tail}",
                    self.port
                )))
            }
        }
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let addr = SocketAddr::from((self.listen, self.port));
        let ready = process::wait_until(timeout, || {
            let exited = match self.child.as_mut() {
                Some(child) => child.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                bail!("sshd exited with {status}");
            }
            Ok(has_ssh_banner(addr))
        })?;
        if !ready {
            bail!("no SSH banner on {addr} within {timeout:?}");
        }
        Ok(())
    }

    /// Whether the last start failed because the port was taken.
    fn lost_port_race(&self) -> bool {
        let log = self.log();
        log.contains("Address already in use") || log.contains("Bind to port")
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("harness: stopping sshd: {e:#}");
        }
    }
}

/// True when something on `addr` speaks OpenSSH: a plain connect would also
/// succeed against another program that grabbed the port.
fn has_ssh_banner(addr: SocketAddr) -> bool {
    let Ok(stream) = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT) else {
        return false;
    };
    if stream.set_read_timeout(Some(PROBE_TIMEOUT)).is_err() {
        return false;
    }
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).is_ok() && line.starts_with("SSH-2.0-OpenSSH")
}

/// A port that was free a moment ago. sshd binds it right after; the rare race
/// with another process is handled by retrying.
fn free_port(on: Ipv4Addr) -> Result<u16> {
    let listener = TcpListener::bind((on, 0)).context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}

fn keygen(path: &Path, comment: &str) -> Result<()> {
    process::run(
        Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
            .arg(path),
    )?;
    Ok(())
}

/// `TYPE BASE64` from a `.pub` file, without the comment.
fn public_key(pub_file: &Path) -> Result<String> {
    let text = fs::read_to_string(pub_file)
        .with_context(|| format!("cannot read {}", pub_file.display()))?;
    let fields: Vec<&str> = text.split_whitespace().take(2).collect();
    if fields.len() != 2 {
        bail!("{} is not an OpenSSH public key", pub_file.display());
    }
    Ok(fields.join(" "))
}

fn write_known_hosts(path: &Path, on: Ipv4Addr, port: u16, key: &str) -> Result<()> {
    fs::write(path, format!("[{on}]:{port} {key}\n"))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Kills sshds (and their connections) left by test processes that no longer
/// exist, e.g. a test binary killed with SIGKILL before its drops ran, and
/// removes their temp dirs.
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
        // The listener rewrites its title ("sshd: /usr/sbin/sshd -D ... [listener]"),
        // so look for our config path anywhere in the command line.
        let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !text.contains("sshd") {
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
