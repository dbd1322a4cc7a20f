#!/usr/bin/env bash
set -euo pipefail
cd /work/node-spike
start=$(date +%s.%N)
setsid ${NETNS:+nsenter --net=/run/netns/$NETNS} containerd --config conf/containerd.toml > logs/containerd.log 2>&1 < /dev/null &
echo $! > pids/containerd
for i in $(seq 1 100); do
  ctr --address run/containerd/containerd.sock version >/dev/null 2>&1 && break
  sleep 0.1
done
echo "containerd up in $(echo "$(date +%s.%N) - $start" | bc)s"
