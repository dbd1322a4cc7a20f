#!/usr/bin/env bash
# Pre-create the pod bridge (its gateway address doubles as the node IP) and a
# forward guard: nothing routed between spk0 and any other interface.
set -euo pipefail
ip link show spk0 >/dev/null 2>&1 || ip link add spk0 type bridge
ip addr replace 10.244.0.1/24 dev spk0
ip link set spk0 up
# Forward only what arrives on spk0 (pod -> Service -> pod); global ip_forward stays as it is.
sysctl -qw net.ipv4.conf.spk0.forwarding=1
nft -f - <<'EON'
table inet spike_guard {
  chain forward {
    type filter hook forward priority -10; policy accept;
    iifname "spk0" oifname != "spk0" counter drop
    oifname "spk0" iifname != "spk0" counter drop
  }
}
EON
