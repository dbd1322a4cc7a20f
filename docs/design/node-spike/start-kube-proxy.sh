#!/usr/bin/env bash
# usage: start-kube-proxy.sh iptables|nftables
set -euo pipefail
cd /work/node-spike
mode=${1:-iptables}
setsid ${NETNS:+nsenter --net=/run/netns/$NETNS} bin/kube-proxy --config=conf/kube-proxy-$mode.yaml --v=2 > logs/kube-proxy-$mode.log 2>&1 < /dev/null &
echo $! > pids/kube-proxy
