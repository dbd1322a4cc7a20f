#!/usr/bin/env bash
# Node-in-a-netns variant: kubelet, containerd, kube-proxy and the pod bridge live in
# netns spk-node; one veth pair joins it to the host (host 10.245.0.1, node 10.245.0.2).
# The netns has no default route, so nothing from it can leave; its netfilter rules,
# bridge, routes and net.* sysctls vanish with `ip netns del spk-node`.
set -euo pipefail
N=spk-node
# Remember whether /run/netns existed: other tests on this machine use ip-netns too, so
# teardown removes /run/netns only if this script brought it into being.
[ -e /run/netns ] || touch /work/node-spike/pids/created-run-netns
ip netns list | grep -qw "$N" || ip netns add "$N"
ip link show spkh0 >/dev/null 2>&1 || ip link add spkh0 type veth peer name spkn0 netns "$N"
ip addr replace 10.245.0.1/30 dev spkh0
ip link set spkh0 up
ip -n "$N" link set lo up
ip -n "$N" addr replace 10.245.0.2/30 dev spkn0
ip -n "$N" link set spkn0 up
ip -n "$N" link show spk0 >/dev/null 2>&1 || ip -n "$N" link add spk0 type bridge
ip -n "$N" addr replace 10.244.0.1/24 dev spk0
ip -n "$N" link set spk0 up
ip netns exec "$N" sysctl -qw net.ipv4.ip_forward=1        # the netns's own, not the host's
ip -n "$N" route replace 10.0.0.0/24 dev spk0 src 10.244.0.1  # service CIDR stays on the bridge
# Host side: pods and Service IPs are reached through the veth (no host forwarding needed).
ip route replace 10.244.0.0/24 via 10.245.0.2 dev spkh0
ip route replace 10.0.0.0/24 via 10.245.0.2 dev spkh0
