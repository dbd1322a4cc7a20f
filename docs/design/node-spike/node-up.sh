#!/usr/bin/env bash
# Full spike bring-up from a clean state, with timings:
# bridge+guard -> containerd -> images -> etcd/apiserver/KCM -> kubelet (Ready)
# -> kube-proxy (nftables by default) -> pod + Service reachable.
set -euo pipefail
S=/work/node-spike; cd "$S"
cp=/root/.cache/egress-operator/controlplane/k8s-v1.33.13-etcd-v3.5.21-2b88551e7ad0
K="$cp/kubectl"; export KUBECONFIG=$S/kubeconfig/admin.kubeconfig
mode=${1:-nftables}
variant=${VARIANT:-flat}   # flat: node in the host netns; netns: node in netns spk-node
now() { date +%s.%N; }
el() { printf '%.2f' "$(echo "$(now) - $1" | bc)"; }
log() { printf 'node-up: %s\n' "$*" >&2; }
T0=$(now)
rm -rf etcd kubelet containerd pod-logs apiserver-certs run kubelet-plugins
mkdir -p logs pids run
if [ "$variant" = netns ]; then
  export NETNS=spk-node APISERVER_IP=10.245.0.1
  ./net-up-netns.sh
else
  export APISERVER_IP=10.244.0.1
  ./net-up.sh
  ip route replace 10.0.0.0/24 dev spk0 src 10.244.0.1   # service CIDR never leaves via eth0
fi
mkdir -p cni/net.d; cp "cni/bridge-$variant.conflist" cni/net.d/10-spike.conflist
./pki.sh; ./kubeconfigs.sh
t=$(now); ./start-containerd.sh >/dev/null; log "containerd up: $(el $t)s"
t=$(now)
for i in pause busybox kubectl; do
  ctr -a run/containerd/containerd.sock -n k8s.io images import "image/$i.tar" >/dev/null
done
log "images imported: $(el $t)s"
t=$(now); ./start-controlplane.sh >/dev/null; log "etcd+apiserver ready: $(el $t)s"
t=$(now); ./start-kubelet.sh
until [ "$($K get node spike-node -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]; do
  sleep 0.2; [ "$(echo "$(now) - $t > 90" | bc)" = 1 ] && { log "node not Ready after 90s"; exit 1; }
done
log "node Ready: $(el $t)s after kubelet start"
t=$(now); ./start-kube-proxy.sh "$mode"
until grep -q 'SyncProxyRules complete' "logs/kube-proxy-$mode.log" 2>/dev/null; do sleep 0.1; done
log "kube-proxy ($mode) first sync: $(el $t)s"
until $K get sa default >/dev/null 2>&1; do sleep 0.2; done
t=$(now); $K apply -f manifests/pod-web.yaml -f manifests/svc-web.yaml >/dev/null
$K wait --for=condition=Ready pod/web --timeout=60s >/dev/null
log "pod web Ready: $(el $t)s after create"
ip=$($K get svc web -o jsonpath='{.spec.clusterIP}')
until curl -s --max-time 1 "http://$ip/" >/dev/null; do sleep 0.2; done
log "service $ip answers: $(el $t)s after pod create"
log "total: $(el $T0)s"
