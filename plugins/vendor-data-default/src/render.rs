//! The rendered vendor-data: a MIME multipart whose essential part is a shell script.
//!
//! cloud-init merges vendor-data under user-data by replacing whole top-level keys, so a
//! Proxy's user-data with its own `runcmd:`, `write_files:` or `packages:` would silently
//! drop those keys of a `#cloud-config` vendor-data. A `text/x-shellscript` part is run by
//! the `scripts_vendor` module instead, which no user-data key replaces; only user-data's
//! `vendor_data: {enabled: false}` turns it off. So everything the proxy needs (packages,
//! config files, the destination firewall, the systemd drop-in, enable and start) is in
//! the script, and only the optional `ntp` key is cloud-config.
//!
//! Everything written is built from a checked [`Plan`]: numbers, canonical networks,
//! package names of a restricted alphabet (quoted anyway), and constant text.

use std::fmt::Write as _;

use serde::Serialize;
use templates_sdk::cloud_config::CloudConfig;

use crate::cidr::Cidr;
use crate::settings::{DEFAULT_DENIED, Plan};

/// Where tinyproxy reads its configuration (the path compiled into Debian's binary).
pub const TINYPROXY_CONF: &str = "/etc/tinyproxy/tinyproxy.conf";
/// The firewall script, run before every start of tinyproxy.
pub const FIREWALL_SCRIPT: &str = "/usr/local/sbin/egress-proxy-firewall";
/// The drop-in that runs the firewall script and orders tinyproxy after the network.
pub const DROP_IN: &str = "/etc/systemd/system/tinyproxy.service.d/egress-proxy.conf";
/// tinyproxy's PID file. Debian 12's unit runs `tinyproxy -d` (Type=simple), older ones
/// are Type=forking with `PIDFile=` this path; systemd-tmpfiles creates its directory
/// owned by the tinyproxy user. Writing it suits both.
pub const PID_FILE: &str = "/run/tinyproxy/tinyproxy.pid";
/// The nftables table the firewall script owns (replaced whole at each start).
pub const NFT_TABLE: &str = "egress_proxy";
/// The multipart boundary; checked to appear in no part.
pub const BOUNDARY: &str = "==egress-operator-vendor-data-7c1e==";
/// Delimiter of the here-documents that carry files in the setup script; checked to
/// appear as a line in none of them.
const FILE_EOF: &str = "EGRESS_PROXY_FILE_END";
/// How long the firewall script waits for an on-link route (a DHCP lease) before it
/// refuses to start tinyproxy: below systemd's default start timeout of 90 s, and long
/// enough for a slow DHCP server. systemd then retries (Restart=on-failure).
const ROUTE_WAIT_TRIES: u32 = 30;
/// Seconds between those tries.
const ROUTE_WAIT_STEP_S: u32 = 2;
/// How long the setup script waits for tinyproxy to listen after its start: a
/// Type=simple unit reports started before the program has bound its port.
const LISTEN_WAIT_S: u32 = 30;

/// The PATH every script sets: cloud-init and systemd pass different ones.
const PATH_LINE: &str =
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nexport PATH\n";

/// The whole vendor-data document.
pub fn vendor_data(plan: &Plan) -> Result<String, String> {
    let mut parts = vec![Part {
        content_type: "text/x-shellscript",
        filename: "egress-proxy-setup.sh",
        body: setup_script(plan)?,
    }];
    if let Some(doc) = optional_cloud_config(plan)? {
        parts.push(Part {
            content_type: "text/cloud-config",
            filename: "egress-proxy-optional.cfg",
            body: doc,
        });
    }
    multipart(&parts)
}

/// One part of the multipart document.
struct Part {
    content_type: &'static str,
    filename: &'static str,
    body: String,
}

/// Writes the parts as `multipart/mixed` the way cloud-init's own `make-mime` does:
/// 7-bit text parts, so a reader of the seed sees the script as it runs.
fn multipart(parts: &[Part]) -> Result<String, String> {
    let mut out =
        format!("Content-Type: multipart/mixed; boundary=\"{BOUNDARY}\"\nMIME-Version: 1.0\n\n");
    for p in parts {
        if p.body.contains(BOUNDARY) {
            return Err(format!("part {} contains the MIME boundary", p.filename));
        }
        if !p.body.is_ascii() || p.body.lines().any(|l| l.len() > 998) {
            return Err(format!(
                "part {} is not 7-bit text with lines of at most 998 characters",
                p.filename
            ));
        }
        let _ = write!(
            out,
            "--{BOUNDARY}\nContent-Type: {}; charset=\"us-ascii\"\nMIME-Version: 1.0\n\
             Content-Transfer-Encoding: 7bit\nContent-Disposition: attachment; filename=\"{}\"\n\n{}\n",
            p.content_type, p.filename, p.body
        );
    }
    let _ = writeln!(out, "--{BOUNDARY}--");
    Ok(out)
}

/// The optional cloud-config part: NTP servers, when set. `None` when there is nothing
/// optional to say.
fn optional_cloud_config(plan: &Plan) -> Result<Option<String>, String> {
    if plan.ntp_servers.is_empty() {
        return Ok(None);
    }
    #[derive(Serialize)]
    struct Ntp<'a> {
        enabled: bool,
        servers: &'a [String],
    }
    let doc = CloudConfig::new()
        .set(
            "ntp",
            Ntp {
                enabled: true,
                servers: &plan.ntp_servers,
            },
        )?
        .render()?;
    Ok(Some(doc))
}

/// tinyproxy's configuration. Only numbers, canonical networks and constant strings.
pub fn tinyproxy_conf(plan: &Plan) -> String {
    let mut c = String::new();
    c.push_str(
        "# Written by egress-operator's vendor-data-default plugin; rewritten on every setup.\n",
    );
    c.push_str("User tinyproxy\nGroup tinyproxy\n");
    let _ = writeln!(c, "Port {}", plan.listen_port);
    let _ = writeln!(c, "PidFile \"{PID_FILE}\"");
    c.push_str("Timeout 600\n");
    let _ = writeln!(c, "MaxClients {}", plan.max_clients);
    c.push_str("LogLevel Info\nSyslog On\n");
    // No Via header: it would carry the VM's host name to every destination.
    c.push_str("DisableViaHeader Yes\n");
    c.push_str("# Clients: every other address gets 403.\n");
    for cidr in &plan.clients {
        let _ = writeln!(c, "Allow {cidr}");
    }
    c.push_str("# CONNECT only to these ports (tinyproxy allows all when none is listed).\n");
    for port in &plan.connect_ports {
        let _ = writeln!(c, "ConnectPort {port}");
    }
    c
}

/// The systemd drop-in for tinyproxy.service.
pub fn drop_in() -> String {
    format!(
        "# Written by egress-operator's vendor-data-default plugin.\n\
         # The destination firewall is applied before every start of tinyproxy; when it\n\
         # fails, tinyproxy does not start (and systemd retries).\n\
         [Unit]\n\
         Wants=network-online.target\n\
         After=network-online.target nftables.service\n\
         # Restarting nftables.service flushes every table, ours included: restart with it.\n\
         PartOf=nftables.service\n\
         \n\
         [Service]\n\
         ExecStartPre={FIREWALL_SCRIPT}\n\
         Restart=on-failure\n\
         RestartSec=5s\n"
    )
}

/// One nftables rule line of the output chain.
fn rule(out: &mut String, matcher: &str, verdict: &str, comment: &str) {
    let _ = writeln!(out, "\t\t{matcher} {verdict} comment \"{comment}\"");
}

/// The static rules of the output chain after the "tinyproxy's new TCP connections only"
/// guards: exemptions first, then the VM's own addresses, the default and configured
/// denials. The on-link networks follow at run time.
pub fn static_rules(plan: &Plan) -> Result<String, String> {
    const REJECT: &str = "counter reject with tcp reset";
    let mut r = String::new();
    for (i, c) in &plan.allowed_destinations {
        rule(
            &mut r,
            &c.nft_daddr(),
            "counter accept",
            &format!("allowedDestinationCidrs/{i}"),
        );
    }
    rule(
        &mut r,
        "fib daddr type local",
        REJECT,
        "an address of this VM",
    );
    for (cidr, why) in DEFAULT_DENIED {
        let c = Cidr::parse(cidr)?;
        rule(&mut r, &c.nft_daddr(), REJECT, why);
    }
    for (i, c) in &plan.denied_destinations {
        rule(
            &mut r,
            &c.nft_daddr(),
            REJECT,
            &format!("deniedDestinationCidrs/{i}"),
        );
    }
    Ok(r)
}

/// The firewall script (`/usr/local/sbin/egress-proxy-firewall`).
pub fn firewall_script(plan: &Plan) -> Result<String, String> {
    let rules = static_rules(plan)?;
    let mut s = String::new();
    s.push_str(
        "#!/bin/sh\n\
         # egress-proxy-firewall: written by egress-operator's vendor-data-default plugin.\n\
         #\n\
         # The egress proxy's destination policy, enforced by the kernel. A new TCP\n\
         # connection made by the tinyproxy user is reset when it goes to an address of\n\
         # this VM (loopback included), to a network this VM sits on, or to a denied\n\
         # range, unless an allowed range matches first. tinyproxy's own filters match\n\
         # host-name strings, which a name resolving to 127.0.0.1 or `CONNECT 127.1:22`\n\
         # defeats; the kernel sees the real address. Only TCP is filtered, so\n\
         # tinyproxy's DNS lookups (UDP/53) reach a resolver on the VM's own network.\n\
         #\n\
         # The networks this VM sits on are read from its on-link routes at each run\n\
         # (with DHCP they are unknown before the lease). tinyproxy.service runs this as\n\
         # ExecStartPre (drop-in egress-proxy.conf), so it is re-applied at every start\n\
         # and tinyproxy does not start when it fails.\n\
         set -eu\n",
    );
    s.push_str(PATH_LINE);
    let _ = write!(
        s,
        r#"
log() {{
	echo "egress-proxy-firewall: $*" >&2
}}

# Prints the destinations of one family's on-link routes (no gateway) of the main table
# in CIDR notation. Loopback and link-local routes are left out: those ranges are always
# denied, and an IPv6 link-local route exists before any lease.
on_link() {{
	routes=$(ip "$1" -o route show table main)
	printf '%s\n' "$routes" | awk -v host="$2" '
		/ via / || / dev lo( |$)/ {{ next }}
		$1 !~ /^[0-9a-fA-F:.]+(\/[0-9]+)?$/ {{ next }}
		$1 ~ /^[fF][eE][89abAB][0-9a-fA-F]?:/ {{ next }}
		{{ n = $1; if (n !~ /\//) n = n "/" host; print n }}'
}}

uid=$(id -u tinyproxy) || {{
	log "there is no tinyproxy user"
	exit 1
}}

tries=0
while :; do
	link4=$(on_link -4 32)
	link6=$(on_link -6 128)
	if [ -n "$link4$link6" ]; then
		break
	fi
	tries=$((tries + 1))
	if [ "$tries" -ge {ROUTE_WAIT_TRIES} ]; then
		log "no on-link route after {wait} s: the network this VM sits on is unknown, so tinyproxy does not start"
		exit 1
	fi
	sleep {ROUTE_WAIT_STEP_S}
done

rules=/run/egress-proxy-firewall.nft
{{
	cat <<'EGRESS_RULES_HEAD'
table inet {NFT_TABLE}
delete table inet {NFT_TABLE}
table inet {NFT_TABLE} {{
	chain output {{
		type filter hook output priority filter; policy accept;
EGRESS_RULES_HEAD
	echo "		meta skuid != $uid return comment \"only tinyproxy's connections\""
	cat <<'EGRESS_RULES_STATIC'
		meta l4proto != tcp return comment "only TCP: DNS lookups stay possible"
		ct state != new return comment "only new connections"
{rules}EGRESS_RULES_STATIC
	for net in $link4; do
		echo "		ip daddr $net counter reject with tcp reset comment \"a network this VM sits on\""
	done
	for net in $link6; do
		echo "		ip6 daddr $net counter reject with tcp reset comment \"a network this VM sits on\""
	done
	# A family whose networks are not known yet is refused whole until they are: the
	# watcher (egress-proxy-netwatch) applies this again when its first route appears.
	if [ -z "$link4" ]; then
		echo "		meta nfproto ipv4 counter reject with tcp reset comment \"no IPv4 network known yet\""
	fi
	if [ -z "$link6" ]; then
		echo "		meta nfproto ipv6 counter reject with tcp reset comment \"no IPv6 network known yet\""
	fi
	echo '	}}'
	echo '}}'
}} >"$rules.new"
nft -f "$rules.new"
mv -f "$rules.new" "$rules"
nets=$(printf '%s\n' "$link4" "$link6" | tr '\n' ' ')
log "applied table inet {NFT_TABLE} (see $rules); on-link networks: $nets"
"#,
        wait = ROUTE_WAIT_TRIES * ROUTE_WAIT_STEP_S,
    );
    Ok(s)
}

/// Single-quotes a word for the shell.
fn sh_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// Appends a here-document that writes `content` to `path` with `mode` (atomically).
fn put_file(s: &mut String, path: &str, mode: &str, content: &str) -> Result<(), String> {
    if content.lines().any(|l| l == FILE_EOF) || !content.ends_with('\n') {
        return Err(format!(
            "the content of {path} cannot be carried in a here-document"
        ));
    }
    let _ = write!(
        s,
        "put {} {mode} <<'{FILE_EOF}'\n{content}{FILE_EOF}\n",
        sh_quote(path)
    );
    Ok(())
}

/// The setup script: the essential, user-data-proof part of the vendor-data.
pub fn setup_script(plan: &Plan) -> Result<String, String> {
    let port = plan.listen_port;
    let ports: Vec<String> = plan.connect_ports.iter().map(u16::to_string).collect();
    let ports = ports.join(" ");
    let clients: Vec<String> = plan.clients.iter().map(Cidr::to_string).collect();
    let clients = clients.join(" ");

    let mut s = String::new();
    s.push_str(
        "#!/bin/sh\n\
         # egress-proxy-setup: written by egress-operator's vendor-data-default plugin.\n\
         #\n\
         # Turns this VM into an egress proxy: tinyproxy for the allowed clients, CONNECT\n\
         # only to the allowed ports, and a kernel firewall on its destinations\n\
         # (egress-proxy-firewall). cloud-init runs it once per instance from vendor-data\n\
         # (scripts_vendor), where no key of the Proxy's user-data can replace it. It is\n\
         # idempotent: a second run leaves the same state.\n\
         set -eu\n",
    );
    s.push_str(PATH_LINE);
    s.push_str(
        r#"
log() {
	echo "egress-proxy-setup: $*" >&2
	logger -t egress-proxy-setup -- "$*" 2>/dev/null || true
}
fail() {
	log "FAILED: $*"
	exit 1
}

"#,
    );
    let _ = writeln!(
        s,
        "log \"start: tinyproxy on port {port}, CONNECT to {ports}, clients {clients}\""
    );
    s.push('\n');

    if plan.install_packages {
        let quoted: Vec<String> = plan.packages.iter().map(|p| sh_quote(p)).collect();
        let _ = write!(
            s,
            r#"# Packages: only what is missing is installed, so a complete image needs no network.
if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
	fail "installPackages needs dpkg and apt-get; on another distribution preinstall the packages and set installPackages to false"
fi
missing=
for pkg in {list}; do
	# shellcheck disable=SC2016 # dpkg-query's format, not a shell expansion
	status=$(dpkg-query -W -f '${{db:Status-Status}}' "$pkg" 2>/dev/null) || status=
	if [ "$status" != installed ]; then
		missing="$missing $pkg"
	fi
done
if [ -n "$missing" ]; then
	log "installing:$missing"
	export DEBIAN_FRONTEND=noninteractive
	apt-get -q -o DPkg::Lock::Timeout=300 update || fail "apt-get update failed"
	# shellcheck disable=SC2086 # one word per package
	apt-get -q -y -o DPkg::Lock::Timeout=300 -o Dpkg::Options::=--force-confdef \
		-o Dpkg::Options::=--force-confold install --no-install-recommends $missing ||
		fail "could not install:$missing"
else
	log "all packages are installed"
fi
"#,
            list = quoted.join(" "),
        );
    } else {
        s.push_str(
            r#"# installPackages is false: nothing is installed; the image must have every program.
for cmd in tinyproxy nft ip ss awk id; do
	command -v "$cmd" >/dev/null 2>&1 ||
		fail "$cmd is missing and installPackages is false: the image must provide it"
done
log "installPackages is false: using the image's software"
"#,
        );
    }

    s.push_str(
        r#"
# Files are written whole (through a temporary file) at every run.
put() {
	cat >"$1.egress-new"
	chmod "$2" "$1.egress-new"
	mv -f "$1.egress-new" "$1"
}
install -d -m 0755 /etc/tinyproxy /etc/systemd/system/tinyproxy.service.d /usr/local/sbin
"#,
    );
    put_file(&mut s, TINYPROXY_CONF, "0644", &tinyproxy_conf(plan))?;
    put_file(&mut s, FIREWALL_SCRIPT, "0755", &firewall_script(plan)?)?;
    put_file(&mut s, DROP_IN, "0644", &drop_in())?;
    put_file(
        &mut s,
        crate::netwatch::NETWATCH_SCRIPT,
        "0755",
        &crate::netwatch::script(),
    )?;
    put_file(
        &mut s,
        crate::netwatch::NETWATCH_UNIT,
        "0644",
        &crate::netwatch::unit(),
    )?;

    let _ = write!(
        s,
        r#"
systemctl daemon-reload
# Applied here once for a clear log line; tinyproxy's ExecStartPre applies it again.
log "applying the destination firewall"
{FIREWALL_SCRIPT} || fail "the destination firewall could not be applied; tinyproxy stays stopped"
systemctl enable tinyproxy.service egress-proxy-netwatch.service
systemctl restart tinyproxy.service || fail "tinyproxy did not start: see journalctl -u tinyproxy"
# The firewall follows later changes of the networks (and comes back after a flush).
systemctl restart egress-proxy-netwatch.service || fail "the firewall watcher did not start: see journalctl -u egress-proxy-netwatch"
tries=0
until ss -Hltn "sport = :{port}" | grep -q .; do
	tries=$((tries + 1))
	if [ "$tries" -ge {LISTEN_WAIT_S} ]; then
		fail "tinyproxy is not listening on port {port} after {LISTEN_WAIT_S} s: see journalctl -u tinyproxy"
	fi
	sleep 1
done

# The operator reads the VM's address through the guest agent when the lease is unknown.
if [ -e /dev/virtio-ports/org.qemu.guest_agent.0 ]; then
	systemctl start qemu-guest-agent.service || log "warning: qemu-guest-agent did not start"
else
	log "warning: no guest agent channel; the operator finds the address another way"
fi
log "done: tinyproxy is listening on port {port}"
"#
    );
    Ok(s)
}
