//! The firewall follows the VM's networks (`/usr/local/sbin/egress-proxy-netwatch`).
//!
//! The firewall script reads the on-link networks when it runs, so on its own it would
//! keep a snapshot: an IPv6 /64 learnt later from router advertisements, an IPv4 lease
//! that comes after the IPv6 route, or a renewal into another subnet would stay open to
//! tinyproxy, and an `nft flush ruleset` (in user-data, say) would drop the table for
//! good. This watcher runs beside tinyproxy and applies the firewall again on every
//! change of the VM's addresses or routes, and within [`TABLE_CHECK_S`] seconds of the
//! table disappearing. When applying fails, it stops tinyproxy: the proxy never runs
//! with rules it cannot vouch for. Between a change and its re-application, a family
//! with no known network is refused whole by the firewall itself (fail closed).

use crate::render::{FIREWALL_SCRIPT, NFT_TABLE};

/// The watcher script.
pub const NETWATCH_SCRIPT: &str = "/usr/local/sbin/egress-proxy-netwatch";
/// Its systemd unit.
pub const NETWATCH_UNIT: &str = "/etc/systemd/system/egress-proxy-netwatch.service";
/// How often the watcher checks that the table is still there (a flush sends no route
/// or address event).
pub const TABLE_CHECK_S: u32 = 2;

/// The watcher script.
pub fn script() -> String {
    format!(
        r#"#!/bin/sh
# egress-proxy-netwatch: written by egress-operator's vendor-data-default plugin.
#
# Applies the destination firewall ({FIREWALL_SCRIPT}) again on every change of this
# VM's addresses or routes, and when its table is gone, so its list of "networks this VM
# sits on" is never a stale snapshot. When applying fails, tinyproxy is stopped.
set -u
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

log() {{
	echo "egress-proxy-netwatch: $*" >&2
	logger -t egress-proxy-netwatch -- "$*" 2>/dev/null || true
}}

apply() {{
	if ! {FIREWALL_SCRIPT}; then
		log "the firewall could not be applied after a change: stopping tinyproxy"
		systemctl stop tinyproxy.service || log "could not stop tinyproxy"
	fi
}}

# The table disappears without a route or address event (nft flush ruleset).
(
	while sleep {TABLE_CHECK_S}; do
		if ! nft list table inet {NFT_TABLE} >/dev/null 2>&1; then
			log "table inet {NFT_TABLE} is gone: applying it again"
			apply
		fi
	done
) &
checker=$!
# systemd stops the whole unit (its cgroup); this covers a stop of the shell alone.
trap 'kill "$checker" 2>/dev/null' EXIT
trap 'exit 0' INT TERM

# Anything that came before the monitor started is covered by one application now.
apply
ip monitor address route | while read -r _; do
	apply
done
log "ip monitor ended"
exit 1
"#
    )
}

/// The watcher's systemd unit: it runs while tinyproxy runs, and comes back if it dies.
pub fn unit() -> String {
    format!(
        "# Written by egress-operator's vendor-data-default plugin.\n\
         [Unit]\n\
         Description=egress proxy: the destination firewall follows this VM's networks\n\
         After=tinyproxy.service\n\
         BindsTo=tinyproxy.service\n\
         \n\
         [Service]\n\
         ExecStart={NETWATCH_SCRIPT}\n\
         Restart=always\n\
         RestartSec=2s\n\
         \n\
         [Install]\n\
         WantedBy=tinyproxy.service\n"
    )
}
