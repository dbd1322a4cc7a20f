//! An isolated libvirtd (QEMU and test drivers) for one test, inside a network
//! namespace of its own. Its unix socket lives in a temp dir outside the
//! namespace's private mounts, so the test, and sshd, reach it like a real
//! host's socket.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

use super::process::{self, LOG_TAIL_LINES};
use super::{owner_is_gone, temp_dir_with_owner};

/// Namespace names are `eotest-<pid>-<n>`: the PID tells a later run whether the
/// owner is gone, `n` keeps concurrent tests in one process apart.
const NETNS_PREFIX: &str = "eotest-";
/// Prefix of our temp dirs (socket, config, logs, pools); the owner PID follows.
const DIR_PREFIX: &str = "eotest-libvirt-";
/// The VM bridge inside the namespace. Each namespace has its own interfaces,
/// so one fixed name is enough and later tests can put it in configs.
const BRIDGE: &str = "eobr0";
/// State directories libvirtd and virtlogd write to; each gets a private tmpfs
/// so nothing is shared with a system daemon or another test.
const PRIVATE_DIRS: &[&str] = &[
    "/run",
    "/var/lib/libvirt",
    "/var/cache/libvirt",
    "/var/log/libvirt",
    "/etc/libvirt",
];
/// Shared across tests and runs: QEMU capability probes cost seconds per
/// emulator, and libvirt re-validates a cached entry (QEMU and libvirt
/// versions, ctimes, host CPU) before using it, so sharing is safe.
const CAPS_CACHE_DIR: &str = "eotest-qemu-capabilities";
/// Where libvirtd keeps that cache, inside its private mounts.
const CAPS_DIR_IN_NS: &str = "var/cache/libvirt/qemu/capabilities";
/// How long libvirtd may take to answer after start: with a warm capability
/// cache it answers in well under a second; a cold one probes two emulators,
/// slow on a machine that is also compiling.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Upper bound for one virsh call, so a wedged daemon fails a test instead of
/// hanging it.
const VIRSH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long libvirtd gets to exit on SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long teardown keeps killing what the namespace still holds.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(20);

/// Keeps namespace names unique among the tests of one process.
static NEXT_ID: AtomicU32 = AtomicU32::new(0);

/// Runs inside `ip netns exec NS unshare -m --propagation private`: private
/// state dirs, config, the capability cache, an isolated bridge (no address, no
/// uplink, no NAT), then the daemons. It ends as `sleep`, which holds the mount
/// namespace for a later `restart_libvirtd` and is the process we own.
/// Arguments: $1 our temp dir, $2 bridge name, $3 shared capability cache,
/// $4 the CPU libvirtd is pinned to (see [`libvirtd_cpu`]), then the directories
/// to make private ([`PRIVATE_DIRS`]).
const SETUP_SCRIPT: &str = r#"set -eu
dir=$1 bridge=$2 cache=$3 cpu=$4
shift 4
for d in "$@"; do
  mount -t tmpfs -o mode=0755 eotest "$d"
done
cp -a "$dir/etc-libvirt/." /etc/libvirt/
mkdir -p /var/cache/libvirt/qemu/capabilities
cp "$cache"/*.xml /var/cache/libvirt/qemu/capabilities/ 2>/dev/null || true
ip link set lo up
ip link add "$bridge" type bridge
ip link set "$bridge" up
virtlogd -d
taskset -c "$cpu" libvirtd -d -f "$dir/libvirtd.conf" -p "$dir/libvirtd.pid"
echo "harness: libvirtd started"
exec sleep infinity
"#;

/// Our qemu.conf. QEMU runs as root because, with /dev/kvm root-only (no udev
/// here), libvirt finds KVM "unusable" for the libvirt-qemu user although the
/// root-run probe used it, calls every cached capability set outdated, and
/// re-probes QEMU on each lookup (a define took 36 s). Root also reaches disk
/// images in 0700 temp dirs. Domains still use TCG (`type='qemu'`).
const QEMU_CONF: &str =
    "# Written by the integration test harness.\nuser = \"root\"\ngroup = \"root\"\n";

/// A running isolated libvirtd with virtlogd and a VM bridge, in its own network
/// and mount namespace. Everything (daemons, QEMU, namespace, temp dir) goes on
/// drop, also when the test panics.
#[derive(Debug)]
pub struct Libvirtd {
    netns: String,
    dir: TempDir,
    /// The `sleep` that ends the setup script; alive as long as the namespace.
    anchor: Option<Child>,
    netns_created: bool,
}

impl Libvirtd {
    /// Creates the namespace, starts virtlogd and libvirtd in it and returns once
    /// libvirtd answers on its socket.
    pub fn start() -> Result<Libvirtd> {
        reap_stale();
        let netns = format!(
            "{NETNS_PREFIX}{}-{}",
            std::process::id(),
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        );
        // From here on, `daemon` cleans up on every early return.
        let mut daemon = Libvirtd {
            netns,
            dir: temp_dir_with_owner(DIR_PREFIX)?,
            anchor: None,
            netns_created: false,
        };
        process::run(Command::new("ip").args(["netns", "add", &daemon.netns]))?;
        daemon.netns_created = true;
        daemon.write_config()?;
        let cache = caps_cache_dir();
        fs::create_dir_all(&cache).with_context(|| format!("cannot create {}", cache.display()))?;

        let anchor = Command::new("ip")
            .args(["netns", "exec", &daemon.netns])
            .args(["unshare", "-m", "--propagation", "private"])
            .args(["sh", "-c", SETUP_SCRIPT, "sh"])
            .arg(daemon.dir.path())
            .arg(BRIDGE)
            .arg(&cache)
            .arg(libvirtd_cpu())
            .args(PRIVATE_DIRS)
            .stdin(Stdio::null())
            .stdout(daemon.setup_log()?)
            .stderr(daemon.setup_log()?)
            .spawn()
            .context("cannot start the libvirtd namespace")?;
        daemon.anchor = Some(anchor);
        let started = Instant::now();
        daemon.wait_ready()?;
        daemon.save_capabilities();
        // Shown only when the test fails: helps tell a slow start from a hang.
        eprintln!(
            "harness: libvirtd in {} ready after {:?}",
            daemon.netns,
            started.elapsed()
        );
        Ok(daemon)
    }

    /// libvirtd's read-write socket.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.path().join("sock").join("libvirt-sock")
    }

    /// URI of the QEMU driver through our socket.
    pub fn qemu_uri(&self) -> String {
        format!(
            "qemu+unix:///system?socket={}",
            self.socket_path().display()
        )
    }

    /// URI of libvirt's test driver (in-memory fake host) through our socket:
    /// exercises the daemon and the RPC path without starting QEMU.
    pub fn test_uri(&self) -> String {
        format!(
            "test+unix:///default?socket={}",
            self.socket_path().display()
        )
    }

    /// The network namespace name (for `ip netns exec`).
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// The isolated VM bridge inside the namespace.
    pub fn bridge(&self) -> &str {
        BRIDGE
    }

    /// The temp dir holding socket, config, logs and pools.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// libvirtd's log (warnings and errors).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("libvirtd.log")
    }

    /// `ip netns exec NS program`: a command that runs inside the namespace.
    pub fn in_netns(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.netns, program]);
        cmd
    }

    /// Runs `virsh -c URI ARGS...` with a deadline and returns its stdout; a
    /// failure carries virsh's stderr.
    pub fn virsh(&self, uri: &str, args: &[&str]) -> Result<String> {
        process::run(virsh_command(uri).args(args))
    }

    /// Defines and starts a `dir` storage pool named `name` in a fresh directory
    /// under our temp dir, and returns that directory.
    pub fn define_dir_pool(&self, name: &str) -> Result<PathBuf> {
        let path = self.dir.path().join("pools").join(name);
        fs::create_dir_all(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let target = path.to_str().context("pool path is not UTF-8")?;
        let uri = self.qemu_uri();
        self.virsh(&uri, &["pool-define-as", name, "dir", "--target", target])?;
        self.virsh(&uri, &["pool-start", name])?;
        Ok(path)
    }

    /// The smallest domain that boots here: software emulation, 64 MiB, no disk,
    /// no graphics, one virtio NIC on our bridge. `<acpi/>` is required: without
    /// it libvirt 9 passes `-no-acpi`, which QEMU 10 refuses. `name` must be
    /// XML-safe (tests pass literals).
    pub fn minimal_domain_xml(&self, name: &str) -> String {
        format!(
            "<domain type='qemu'>\n\
             \x20 <name>{name}</name>\n\
             \x20 <memory unit='MiB'>64</memory>\n\
             \x20 <vcpu>1</vcpu>\n\
             \x20 <os><type arch='x86_64' machine='pc'>hvm</type><boot dev='hd'/></os>\n\
             \x20 <features><acpi/></features>\n\
             \x20 <devices>\n\
             \x20   <interface type='bridge'><source bridge='{BRIDGE}'/><model type='virtio'/></interface>\n\
             \x20   <controller type='usb' model='none'/>\n\
             \x20   <memballoon model='none'/>\n\
             \x20 </devices>\n\
             </domain>\n"
        )
    }

    /// PID of the running libvirtd, if any.
    pub fn libvirtd_pid(&self) -> Option<u32> {
        let text = fs::read_to_string(self.dir.path().join("libvirtd.pid")).ok()?;
        let pid = text.trim().parse().ok()?;
        process::is_alive(pid).then_some(pid)
    }

    /// Stops libvirtd (SIGTERM, then SIGKILL after a bound) and waits until it is
    /// gone. virtlogd and running QEMU domains stay, as on a real host whose
    /// daemon restarts. Idempotent.
    pub fn stop_libvirtd(&self) -> Result<()> {
        let Some(pid) = self.libvirtd_pid() else {
            return Ok(());
        };
        let started = Instant::now();
        process::signal(&[pid], "TERM");
        if !process::wait_gone(&[pid], STOP_TIMEOUT) {
            process::signal(&[pid], "KILL");
            if !process::wait_gone(&[pid], STOP_TIMEOUT) {
                bail!("libvirtd {pid} survived SIGKILL");
            }
        }
        eprintln!("harness: libvirtd {pid} stopped in {:?}", started.elapsed());
        Ok(())
    }

    /// Starts libvirtd again in the same namespaces, with the same state (defined
    /// domains, pools) and socket, and waits until it answers.
    pub fn restart_libvirtd(&mut self) -> Result<()> {
        self.stop_libvirtd()?;
        let anchor = self.anchor_pid()?;
        let conf = self.dir.path().join("libvirtd.conf");
        let pid_file = self.dir.path().join("libvirtd.pid");
        let status = Command::new("nsenter")
            .arg("-t")
            .arg(anchor.to_string())
            .args([
                "-m",
                "-n",
                "taskset",
                "-c",
                &libvirtd_cpu(),
                "libvirtd",
                "-d",
                "-f",
            ])
            .arg(&conf)
            .arg("-p")
            .arg(&pid_file)
            .stdin(Stdio::null())
            .stdout(self.setup_log()?)
            .stderr(self.setup_log()?)
            .status()
            .context("cannot run nsenter")?;
        if !status.success() {
            bail!("libvirtd restart failed ({status}): {}", self.log_tails());
        }
        self.wait_ready()
    }

    fn anchor_pid(&mut self) -> Result<u32> {
        let Some(anchor) = self.anchor.as_mut() else {
            bail!("the namespace of {} is gone", self.netns);
        };
        if let Some(status) = anchor.try_wait()? {
            bail!("the namespace holder of {} exited ({status})", self.netns);
        }
        Ok(anchor.id())
    }

    fn write_config(&self) -> Result<()> {
        let dir = self.dir.path();
        fs::create_dir_all(dir.join("sock"))?;
        let etc = dir.join("etc-libvirt");
        fs::create_dir_all(&etc)?;
        // The packaged *.conf files (all defaults on Debian) keep libvirt's
        // behaviour as on a real host; definitions (qemu/, nwfilter/, the
        // packaged "default" NAT network) are left out on purpose.
        for entry in fs::read_dir("/etc/libvirt").context("cannot read /etc/libvirt")? {
            let entry = entry?;
            let name = entry.file_name();
            if entry.file_type()?.is_file() && name.to_string_lossy().ends_with(".conf") {
                fs::copy(entry.path(), etc.join(&name))?;
            }
        }
        fs::write(etc.join("qemu.conf"), QEMU_CONF)?;
        let conf = format!(
            "# Written by the integration test harness.\n\
             unix_sock_dir = \"{sock}\"\n\
             # Root-only access is enforced by the socket's directory (0700 temp dir).\n\
             auth_unix_rw = \"none\"\n\
             auth_unix_ro = \"none\"\n\
             log_outputs = \"3:file:{log}\"\n",
            sock = dir.join("sock").display(),
            log = self.log_path().display(),
        );
        fs::write(dir.join("libvirtd.conf"), conf)?;
        Ok(())
    }

    fn setup_log(&self) -> Result<File> {
        let path = self.dir.path().join("setup.log");
        File::options()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))
    }

    fn log_tails(&self) -> String {
        format!(
            "setup log:\n{}\nlibvirtd log:\n{}",
            process::tail(&self.dir.path().join("setup.log"), LOG_TAIL_LINES),
            process::tail(&self.log_path(), LOG_TAIL_LINES)
        )
    }

    fn wait_ready(&mut self) -> Result<()> {
        let uri = self.qemu_uri();
        let started = Instant::now();
        let ready = process::wait_until(START_TIMEOUT, || {
            let exited = match self.anchor.as_mut() {
                Some(anchor) => anchor.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                bail!("the namespace setup exited ({status})");
            }
            Ok(process::output(virsh_command(&uri).arg("version"))?
                .status
                .success())
        });
        match ready {
            Ok(true) => Ok(()),
            Ok(false) => bail!(
                "libvirtd in {} did not answer within {:?}; {}",
                self.netns,
                started.elapsed(),
                self.log_tails()
            ),
            Err(e) => Err(e.context(format!(
                "libvirtd in {} did not start; {}",
                self.netns,
                self.log_tails()
            ))),
        }
    }

    /// Copies libvirtd's freshly probed QEMU capabilities to the shared cache so
    /// the next daemon starts in milliseconds. Best effort: a miss only costs time.
    fn save_capabilities(&mut self) {
        let Ok(anchor) = self.anchor_pid() else {
            return;
        };
        let from = PathBuf::from(format!("/proc/{anchor}/root")).join(CAPS_DIR_IN_NS);
        let to = caps_cache_dir();
        let Ok(entries) = fs::read_dir(&from) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            // Write then rename, so a concurrently starting daemon never copies a
            // half-written file.
            let partial = to.join(format!(".{}.{}", name.to_string_lossy(), self.netns));
            if fs::copy(entry.path(), &partial).is_ok()
                && fs::rename(&partial, to.join(&name)).is_err()
            {
                let _ = fs::remove_file(&partial);
            }
        }
    }

    /// Kills everything in the namespace (libvirtd, virtlogd, QEMU, the holder),
    /// waits for it, and deletes the namespace. The private mounts vanish with
    /// the last process.
    fn shutdown(&mut self) -> Result<()> {
        let started = Instant::now();
        if self.netns_created {
            let deadline = Instant::now() + TEARDOWN_TIMEOUT;
            loop {
                let pids = netns_pids(&self.netns)?;
                if pids.is_empty() {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!("processes {pids:?} in {} survive SIGKILL", self.netns);
                }
                process::signal(&pids, "KILL");
                process::wait_gone(&pids, STOP_TIMEOUT);
            }
        }
        if let Some(mut anchor) = self.anchor.take() {
            // Already killed above; this reaps it (kill fails harmlessly if gone).
            let _ = anchor.kill();
            anchor.wait().context("cannot reap the namespace holder")?;
        }
        if self.netns_created {
            process::run(Command::new("ip").args(["netns", "del", &self.netns]))?;
            self.netns_created = false;
        }
        eprintln!(
            "harness: {} torn down in {:?}",
            self.netns,
            started.elapsed()
        );
        Ok(())
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("harness: tearing down {}: {e:#}", self.netns);
        }
    }
}

fn virsh_command(uri: &str) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args([
        "--kill-after=5",
        &VIRSH_TIMEOUT.as_secs().to_string(),
        "virsh",
        "-q",
        "-c",
        uri,
    ]);
    cmd
}

/// The CPU libvirtd runs on: always the same one, because libvirt's cached QEMU
/// capabilities record the host CPUID as seen by libvirtd, which includes the
/// x2APIC ID of the core it ran on; on another core the cache is "outdated" and
/// the start costs seconds of re-probing. libvirt sets each QEMU's affinity to
/// all host CPUs itself, so domains are not confined to this one.
fn libvirtd_cpu() -> String {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let list = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
            let first: String = list
                .trim()
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            (!first.is_empty()).then_some(first)
        })
        .unwrap_or_else(|| "0".into())
}

fn caps_cache_dir() -> PathBuf {
    std::env::temp_dir().join(CAPS_CACHE_DIR)
}

/// PIDs of the processes inside network namespace `netns`.
fn netns_pids(netns: &str) -> Result<Vec<u32>> {
    let out = process::run(Command::new("ip").args(["netns", "pids", netns]))?;
    Ok(out
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect())
}

/// Tears down namespaces and temp dirs left by test processes that no longer
/// exist (killed before their drops ran).
fn reap_stale() {
    if let Ok(list) = process::run(Command::new("ip").args(["netns", "list"])) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if !owner_is_gone(name, NETNS_PREFIX) {
                continue;
            }
            if let Ok(pids) = netns_pids(name) {
                process::signal(&pids, "KILL");
                process::wait_gone(&pids, STOP_TIMEOUT);
            }
            let _ = process::run(Command::new("ip").args(["netns", "del", name]));
        }
    }
    super::remove_stale_temp_dirs(DIR_PREFIX);
}
