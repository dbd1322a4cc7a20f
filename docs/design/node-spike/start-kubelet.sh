#!/usr/bin/env bash
set -euo pipefail
cd /work/node-spike
setsid ${NETNS:+nsenter --net=/run/netns/$NETNS} bin/kubelet --config=conf/kubelet.yaml \
  --kubeconfig=kubeconfig/kubelet.kubeconfig \
  --root-dir=/work/node-spike/kubelet --cert-dir=/work/node-spike/kubelet/pki \
  --node-ip=10.244.0.1 --hostname-override=spike-node --v=2 \
  > logs/kubelet.log 2>&1 < /dev/null &
echo $! > pids/kubelet
