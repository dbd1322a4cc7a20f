#!/usr/bin/env bash
# The node tier: a one-node Kubernetes cluster on this machine, for the tests and the demo
# that run the operator as users run it (its image, its Deployment) and send workload
# traffic through the pools' Services.
#
#   scripts/node.sh up DIR BIN_DIR   start everything; state, logs and kubeconfigs in DIR
#   scripts/node.sh down DIR         stop everything and remove DIR (idempotent; also after
#                                    a crash or SIGKILL); exits 1 and prints what is left
#                                    if anything is
#   scripts/node.sh leftovers DIR    print what a node in DIR left on the machine; exit 1 if
#                                    anything
#   scripts/node.sh images OUT       build the pause and busybox images (OCI archives)
#
# BIN_DIR is scripts/controlplane.sh's output: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy and kubectl, built from the pinned Go modules.
# The runtime is Debian's containerd 1.6 + runc + CNI plugins (make setup installs them).
#
# Layout (docs/design/node-spike/REPORT.md has the findings behind each choice):
# - The node lives in its own network namespace ($NETNS): containerd, kubelet, kube-proxy,
#   the pod bridge and every netfilter rule the node makes are inside it, and vanish with
#   it. One veth joins it to the host: host $HOST_IP, node $NODE_LINK_IP. The namespace has
#   no default route, so nothing a pod sends can leave the machine.
# - Pods get $POD_NET on the bridge; Services $SERVICE_NET. The host routes both into the
#   namespace, so tests on the host reach pods and ClusterIPs (kube-proxy translates in
#   the namespace's PREROUTING). The host forwards nothing.
# - etcd listens on loopback, kube-apiserver on $HOST_IP:$API_PORT, which the host,
#   kubelet and pods all reach; the `kubernetes` Service has that real endpoint.
# - kube-proxy runs in nftables mode: GA in 1.33, one table per family that it owns
#   whole, and on this machine iptables is iptables-nft anyway (README, "The node tier").
# - Host-global state a kubelet cannot avoid, restored by `down` from DIR/baseline: four
#   sysctls kubelet sets (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops,
#   vm.panic_on_oom), its /kubepods cgroups, and paths it or containerd hard-code
#   (/var/lib/kubelet/device-plugins, /var/log/containers, /run/containerd/s, /var/lib/cni).
#   So one node runs per machine: `up` refuses while another's owner lives, and clears a
#   dead owner's node first.
#
# containerd needs `restrict_oom_score_adj`: this machine's bounding set lacks
# CAP_SYS_RESOURCE, so runc cannot lower a sandbox's oom_score_adj below containerd's own.
set -euo pipefail

NETNS=eotest-node
HOST_IF=eonode0
NODE_IF=eonode1
BRIDGE=eonode-br
HOST_IP=10.245.0.1
NODE_LINK_IP=10.245.0.2
POD_NET=10.244.0.0/24
NODE_IP=10.244.0.1
SERVICE_NET=10.246.0.0/24
SERVICE_API_IP=10.246.0.1
# The lab's range: local to the host and routed from the node, so stand-ins for proxy VMs
# listen where the operator's probe and the pods reach them (tests/src/harness/node.rs).
LAB_NET=10.247.0.0/24
NODE_NAME=eotest-node
ETCD_PORT=23791
ETCD_PEER_PORT=23801
API_PORT=26443
PAUSE_IMAGE=localhost/eotest/pause:1
BUSYBOX_IMAGE=localhost/eotest/busybox:1
# The lock serialising ups and downs, and the record of which DIR holds the node.
STATE=/run/egress-operator-node
# Paths outside DIR that kubelet, containerd, CNI or buildah create; `down` removes those
# the baseline says did not exist.
OUTSIDE_PATHS=(/var/lib/kubelet /var/log/containers /var/log/pods /usr/libexec/kubernetes
  /run/containerd /var/lib/cni /etc/cni /var/lib/containers)
SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward
  net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables
  net.bridge.bridge-nf-call-ip6tables)
DAEMONS=(kube-proxy kubelet containerd kube-scheduler kube-controller-manager kube-apiserver etcd)
here="$(cd "$(dirname "$0")/.." && pwd)"

log() { printf 'node: %s %s\n' "$(date +%T)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
# Running means it exists and is no zombie: the daemons are re-parented to PID 1, which
# may reap them late, and `kill -0` succeeds on a zombie.
running() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
alive() { [ -f "$DIR/pids/$1" ] && running "$(cat "$DIR/pids/$1")"; }

take_lock() {
  mkdir -p "$STATE"
  exec 8>"$STATE/lock"
  flock -n 8 && return
  log "waiting for another node up/down to finish ($STATE/lock)"
  flock -w 600 8 || die "another node up/down held $STATE/lock for 10 minutes"
}

# ---------------------------------------------------------------- images
# OCI archives of the pause and busybox images, built with buildah (no daemon, no
# registry) from files of this machine, cached by content.
build_images() {
  local out="$1" c stage B key
  command -v buildah >/dev/null || die "buildah is not installed (make setup installs it)"
  [ -x /bin/busybox ] || die "/bin/busybox is missing (make setup installs busybox-static)"
  key="$( { sha256sum "$here/tests/node/pause.c" "$here/scripts/node.sh" /bin/busybox; } | sha256sum | cut -c1-12)"
  if [ -f "$out/$key.done" ]; then echo "$out"; return; fi
  mkdir -p "$out"
  stage="$(mktemp -d "${TMPDIR:-/tmp}/eotest-node-images.XXXXXX")"
  local created=()
  for p in /var/lib/containers /etc/cni; do [ -e "$p" ] || created+=("$p"); done
  # On any exit, a failed step's too (build_images runs in its own subshell or ends the
  # script): the stage and what buildah made outside its root go.
  # shellcheck disable=SC2064
  trap "rm -rf '$stage' ${created[*]}" EXIT
  B=(buildah --root "$stage/root" --runroot "$stage/runroot" --storage-driver vfs)
  mkdir -p "$stage/pause" "$stage/busybox/bin"
  gcc -static -Os -s -o "$stage/pause/pause" "$here/tests/node/pause.c"
  cp /bin/busybox "$stage/busybox/bin/busybox"
  for app in sh httpd nc sleep hostname mkdir cat echo ls env wc grep; do
    ln -s busybox "$stage/busybox/bin/$app"
  done
  c=$("${B[@]}" from scratch)
  "${B[@]}" copy "$c" "$stage/pause/pause" /pause >/dev/null
  "${B[@]}" config --cmd '["/pause"]' --user 65535:65535 "$c"
  "${B[@]}" commit -q "$c" "$PAUSE_IMAGE" >/dev/null
  c=$("${B[@]}" from scratch)
  "${B[@]}" copy "$c" "$stage/busybox/" / >/dev/null
  "${B[@]}" config --cmd '["sh"]' --env PATH=/bin "$c"
  "${B[@]}" commit -q "$c" "$BUSYBOX_IMAGE" >/dev/null
  rm -f "$out"/*.tar "$out"/*.done
  "${B[@]}" push -q "$PAUSE_IMAGE" "oci-archive:$out/pause.tar:$PAUSE_IMAGE"
  "${B[@]}" push -q "$BUSYBOX_IMAGE" "oci-archive:$out/busybox.tar:$BUSYBOX_IMAGE"
  "${B[@]}" rm -a >/dev/null 2>&1 || true
  # buildah writes a blob-info cache and a CNI lock outside its root whatever it is told;
  # the EXIT trap above removes them with the stage.
  touch "$out/$key.done"
  echo "$out"
}

# ---------------------------------------------------------------- certificates
pki() {
  local d="$DIR/pki"
  mkdir -p "$d"
  (
    cd "$d"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
      -keyout ca.key -out ca.crt -subj "/CN=egress-operator node tier CA" 2>/dev/null
    cert() { # name subject [server SANs]
      local ext; ext="$(mktemp)"
      openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$1.key" \
        -out "$1.csr" -subj "$2" 2>/dev/null
      { echo "basicConstraints=CA:FALSE"; echo "keyUsage=critical,digitalSignature,keyEncipherment"
        if [ -n "${3:-}" ]; then echo "extendedKeyUsage=serverAuth"; echo "subjectAltName=$3"
        else echo "extendedKeyUsage=clientAuth"; fi; } >"$ext"
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -out "$1.crt" -extfile "$ext" 2>/dev/null
      rm -f "$ext" "$1.csr"
    }
    cert apiserver "/CN=kube-apiserver" \
      "IP:$HOST_IP,IP:$SERVICE_API_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
    cert kubelet-serving "/CN=$NODE_NAME" "IP:$NODE_IP,DNS:$NODE_NAME"
    cert admin "/O=system:masters/CN=admin"
    cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME"
    cert kube-proxy "/CN=system:kube-proxy"
    cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
    cert controller-manager "/CN=system:kube-controller-manager"
    cert scheduler "/CN=system:kube-scheduler"
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key 2>/dev/null
    openssl pkey -in sa.key -pubout -out sa.pub 2>/dev/null
    chmod 600 ./*.key
  )
  mkdir -p "$DIR/kubeconfig"
  local who
  for who in admin kubelet kube-proxy controller-manager scheduler; do
    cat >"$DIR/kubeconfig/$who.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: node
  cluster:
    server: https://$HOST_IP:$API_PORT
    certificate-authority: $d/ca.crt
users:
- name: $who
  user:
    client-certificate: $d/$who.crt
    client-key: $d/$who.key
contexts:
- name: node
  context: {cluster: node, user: $who}
current-context: node
EOF
  done
}

# ---------------------------------------------------------------- configuration
configs() {
  mkdir -p "$DIR/conf" "$DIR/cni"
  cat >"$DIR/conf/containerd.toml" <<EOF
version = 2
root = "$DIR/containerd/root"
state = "$DIR/run/containerd"
[grpc]
  address = "$DIR/run/containerd/containerd.sock"
[ttrpc]
  address = ""
[debug]
  address = ""
  level = "info"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$DIR/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$(command -v runc)"
        Root = "$DIR/run/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$DIR/cni"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = ""
EOF
  cat >"$DIR/cni/10-eotest.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "eotest",
  "plugins": [{
    "type": "bridge", "bridge": "$BRIDGE", "isGateway": false, "ipMasq": false,
    "hairpinMode": true,
    "ipam": {
      "type": "host-local",
      "ranges": [[{"subnet": "$POD_NET", "gateway": "$NODE_IP"}]],
      "dataDir": "$DIR/run/cni-ipam",
      "routes": [{"dst": "0.0.0.0/0", "gw": "$NODE_IP"}]
    }
  }]
}
EOF
  cat >"$DIR/conf/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $DIR/pki/kubelet-serving.crt
tlsPrivateKeyFile: $DIR/pki/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$DIR/run/containerd/containerd.sock
imageServiceEndpoint: unix://$DIR/run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupsPerQOS: true
enforceNodeAllocatable: ["pods"]
failSwapOn: false
failCgroupV1: false
podLogsDir: $DIR/pod-logs
volumePluginDir: $DIR/kubelet-plugins/volume/exec
resolvConf: ""
maxPods: 30
serializeImagePulls: true
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
  imagefs.inodesFree: "1%"
EOF
  cat >"$DIR/conf/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: $DIR/kubeconfig/kube-proxy.kubeconfig
hostnameOverride: $NODE_NAME
mode: nftables
clusterCIDR: $POD_NET
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["$NODE_IP/32"]
# Keep it off host-wide settings: -999 cannot be set here, and conntrack sysctls are global.
oomScoreAdj: 0
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
EOF
}

# ---------------------------------------------------------------- daemons
# start NAME [in-netns] -- ARGV...: setsid, stdin closed, log and pid file in DIR.
start() {
  local name="$1" ns="$2"; shift 3
  local pre=()
  [ "$ns" = netns ] && pre=(nsenter "--net=/run/netns/$NETNS")
  # 8>&-: the lock stays with this script, not with the daemons it starts.
  setsid "${pre[@]}" "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null 8>&- &
  echo $! >"$DIR/pids/$name"
}

# wait_for WHAT SECONDS COMMAND...: polls every 0.2 s.
wait_for() {
  local what="$1" limit="$2"; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt "$deadline" ] || { log "$what: not within ${limit}s"; return 1; }
    sleep 0.2
  done
}

kubectl_admin() { "$BIN/kubectl" --kubeconfig="$DIR/kubeconfig/admin.kubeconfig" "$@"; }

node_ready() {
  [ "$(kubectl_admin get node "$NODE_NAME" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

record_baseline() {
  mkdir -p "$DIR/baseline"
  local k p
  for k in "${SYSCTLS[@]}"; do
    if v="$(sysctl -n "$k" 2>/dev/null)"; then printf '%s %s\n' "$k" "$v"; fi
  done >"$DIR/baseline/sysctl"
  for p in "${OUTSIDE_PATHS[@]}"; do [ -e "$p" ] && echo "$p"; done >"$DIR/baseline/paths" || true
  nft list ruleset 2>/dev/null | grep -ci kube >"$DIR/baseline/nft-kube" || true
}

network_up() {
  ip netns add "$NETNS"
  ip link add "$HOST_IF" type veth peer name "$NODE_IF" netns "$NETNS"
  ip addr add "$HOST_IP/30" dev "$HOST_IF"
  ip link set "$HOST_IF" up
  ip -n "$NETNS" link set lo up
  ip -n "$NETNS" addr add "$NODE_LINK_IP/30" dev "$NODE_IF"
  ip -n "$NETNS" link set "$NODE_IF" up
  ip -n "$NETNS" link add "$BRIDGE" type bridge
  ip -n "$NETNS" addr add "$NODE_IP/24" dev "$BRIDGE"
  ip -n "$NETNS" link set "$BRIDGE" up
  # The namespace's own forwarding (pods <-> the veth), not the host's.
  nsenter "--net=/run/netns/$NETNS" sysctl -qw net.ipv4.ip_forward=1
  # Service IPs stay on the bridge until kube-proxy translates them.
  ip -n "$NETNS" route add "$SERVICE_NET" dev "$BRIDGE" src "$NODE_IP"
  ip route add "$POD_NET" via "$NODE_LINK_IP" dev "$HOST_IF"
  ip route add "$SERVICE_NET" via "$NODE_LINK_IP" dev "$HOST_IF"
  # The lab: every address of LAB_NET is the host's own (as 127/8 is), reached from the
  # node over the veth, so nothing forwards.
  ip route add local "$LAB_NET" dev lo
  ip -n "$NETNS" route add "$LAB_NET" via "$HOST_IP" dev "$NODE_IF"
}

cmd_up() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, cgroups, mounts)"
  local c
  for c in "${DAEMONS[@]}" kubectl; do
    [ "$c" = containerd ] && continue
    [ -x "$BIN/$c" ] || die "$BIN/$c is missing: run scripts/controlplane.sh (it builds the node binaries too)"
  done
  for c in containerd ctr runc nsenter ip nft openssl gcc; do
    command -v "$c" >/dev/null || die "$c is not installed (make setup installs the node tier's packages)"
  done
  if [ ! -x /usr/lib/cni/bridge ] || [ ! -x /usr/lib/cni/host-local ]; then
    die "/usr/lib/cni/{bridge,host-local} are missing (make setup installs containernetworking-plugins)"
  fi
  local images; images="$(build_images "${EGRESS_CACHE_DIR:-$HOME/.cache/egress-operator}/node-images")"
  take_lock
  if [ -f "$STATE/owner" ]; then
    local other owner
    other="$(head -n1 "$STATE/owner")"
    owner="$(cat "$other/owner-pid" 2>/dev/null || echo 0)"
    if [ "$owner" != 0 ] && running "$owner" && [ "$other" != "$DIR" ]; then
      die "a node is up in $other for process $owner (one node per machine: kubelet's cgroups, sysctls and paths are global)"
    fi
    log "clearing the node of a process that is gone ($other)"
    ( cmd_down_in "$other" ) || die "the stale node in $other could not be torn down (output above)"
  fi
  for c in /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/kubepods; do
    [ -d "$c" ] && die "$c exists: this machine already runs a kubelet, or a node was not torn down (scripts/node.sh down DIR)"
  done
  ip netns list | grep -qw "$NETNS" && die "netns $NETNS exists with no owner on record: remove it (ip netns del $NETNS)"
  for c in $ETCD_PORT $ETCD_PEER_PORT $API_PORT; do
    ss -Hltn "sport = :$c" | grep -q . && die "port $c is taken (etcd and kube-apiserver of the node tier use $ETCD_PORT, $ETCD_PEER_PORT, $API_PORT)"
  done
  mkdir -p "$DIR"/{logs,pids,run}
  echo "${NODE_OWNER_PID:-$PPID}" >"$DIR/owner-pid"
  ln -sfn "$BIN" "$DIR/bin"
  echo "$DIR" >"$STATE/owner"
  record_baseline
  trap 'trap - ERR; log "start failed; tearing down"; tail_logs; cmd_down_in "$DIR" >&2 || true; exit 1' ERR
  local t0=$SECONDS
  network_up
  pki
  configs
  start containerd netns -- containerd --config "$DIR/conf/containerd.toml"
  wait_for "containerd" 30 ctr --address "$DIR/run/containerd/containerd.sock" version
  local i
  for i in pause busybox; do
    ctr --address "$DIR/run/containerd/containerd.sock" -n k8s.io images import "$images/$i.tar" >/dev/null
  done
  local p="$DIR/pki"
  start etcd host -- "$BIN/etcd" --name=eotest-node --data-dir="$DIR/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="eotest-node=http://127.0.0.1:$ETCD_PEER_PORT" --unsafe-no-fsync --log-level=warn \
    --listen-metrics-urls=
  start kube-apiserver host -- "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --secure-port=$API_PORT --bind-address=$HOST_IP --advertise-address=$HOST_IP \
    --cert-dir="$DIR/apiserver-certs" --tls-cert-file="$p/apiserver.crt" --tls-private-key-file="$p/apiserver.key" \
    --client-ca-file="$p/ca.crt" \
    --kubelet-client-certificate="$p/apiserver-kubelet-client.crt" --kubelet-client-key="$p/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority="$p/ca.crt" --kubelet-preferred-address-types=InternalIP \
    --service-cluster-ip-range=$SERVICE_NET --service-node-port-range=30000-30999 \
    --service-account-issuer=https://kubernetes.default.svc \
    --service-account-key-file="$p/sa.pub" --service-account-signing-key-file="$p/sa.key" \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --allow-privileged=true --endpoint-reconciler-type=lease --v=1
  wait_for "kube-apiserver /readyz" 120 kubectl_admin get --raw=/readyz
  log "control plane ready ($((SECONDS - t0))s)"
  start kube-controller-manager host -- "$BIN/kube-controller-manager" \
    --kubeconfig="$DIR/kubeconfig/controller-manager.kubeconfig" \
    --controllers=serviceaccount,root-ca-cert-publisher,endpointslice,endpoint,namespace,garbagecollector,deployment,replicaset,clusterrole-aggregation,nodelifecycle \
    --root-ca-file="$p/ca.crt" --service-account-private-key-file="$p/sa.key" \
    --use-service-account-credentials=true --leader-elect=false --secure-port=0 --v=1
  start kube-scheduler host -- "$BIN/kube-scheduler" --kubeconfig="$DIR/kubeconfig/scheduler.kubeconfig" \
    --leader-elect=false --secure-port=0 --v=1
  start kubelet netns -- "$BIN/kubelet" --config="$DIR/conf/kubelet.yaml" \
    --kubeconfig="$DIR/kubeconfig/kubelet.kubeconfig" --root-dir="$DIR/kubelet" --cert-dir="$DIR/kubelet/pki" \
    --node-ip=$NODE_IP --hostname-override=$NODE_NAME --v=1
  wait_for "node $NODE_NAME Ready" 120 node_ready
  start kube-proxy netns -- "$BIN/kube-proxy" --config="$DIR/conf/kube-proxy.yaml" --v=2
  wait_for "kube-proxy's first sync" 60 grep -q 'SyncProxyRules complete' "$DIR/logs/kube-proxy.log"
  wait_for "the default ServiceAccount" 60 kubectl_admin get serviceaccount default
  trap - ERR
  log "node $NODE_NAME Ready, kube-proxy synced ($((SECONDS - t0))s); kubeconfig below"
  echo "$DIR/kubeconfig/admin.kubeconfig"
}

tail_logs() {
  local f
  for f in "$DIR"/logs/*.log; do
    [ -f "$f" ] || continue
    echo "--- $f (last 15 lines)" >&2
    tail -n 15 "$f" >&2
  done
}

# ---------------------------------------------------------------- teardown
stop() { # name timeout-seconds
  alive "$1" || { rm -f "$DIR/pids/$1"; return 0; }
  local pid; pid="$(cat "$DIR/pids/$1")"
  kill -TERM "$pid" 2>/dev/null || true
  local i
  for ((i = 0; i < $2 * 10; i++)); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then log "$1 ($pid) did not stop; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$DIR/pids/$1"
}

umount_under() {
  local root="$1" m i
  for i in 1 2 3; do
    awk -v s="$root" '$5 == s || index($5, s "/") == 1 {print $5}' /proc/self/mountinfo | sort -r \
      | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
  done
}

# Processes whose argv names DIR (daemons, shims, the apiserver's children), by /proc.
procs_of() {
  local p args
  for p in /proc/[0-9]*; do
    args="$( { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null)" || continue
    case "$args" in *"$1/"*) echo "${p#/proc/}";; esac
  done
}

cgroup_dirs() { ls -d /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/kubepods 2>/dev/null || true; }

# Whether the machine-wide record says DIR holds the node (or names no node at all).
owns_node() { [ ! -f "$STATE/owner" ] || [ "$(head -n1 "$STATE/owner")" = "$1" ]; }

cmd_down_in() {
  # Every step runs whatever the one before did: a teardown that stops halfway leaks.
  set +e
  DIR="$1"
  # The namespace, cgroups, sysctls and outside paths are torn down only for the node of
  # record: a watchdog that comes late must not take down the next node.
  local mine=0
  owns_node "$DIR" && mine=1
  [ -d "$DIR" ] || [ $mine -eq 1 ] || return 0
  # 1. Pods first, while kubelet and containerd run: kubelet stops them and calls CNI DEL.
  if alive kubelet && alive kube-apiserver; then
    kubectl_admin delete pods --all -A --grace-period=1 --wait=true --timeout=30s >/dev/null 2>&1 \
      || log "not every pod was deleted through the API; killing what is left"
  fi
  # 2. The node's daemons. Its netfilter rules go with the namespace (step 6).
  stop kube-proxy 5
  stop kubelet 10
  # 3. Whatever still runs in a pod cgroup: with kubelet gone nothing restarts it.
  local c pid
  [ $mine -eq 1 ] && for c in $(cgroup_dirs); do
    find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u | while read -r pid; do
      kill -KILL "$pid" 2>/dev/null || true
    done
  done
  stop containerd 10
  # Shims outlive containerd; their argv names the socket in DIR.
  for pid in $(procs_of "$DIR"); do kill -KILL "$pid" 2>/dev/null || true; done
  # 4. The control plane.
  stop kube-scheduler 5
  stop kube-controller-manager 5
  stop kube-apiserver 10
  stop etcd 5
  for pid in $(procs_of "$DIR"); do kill -KILL "$pid" 2>/dev/null || true; done
  sleep 0.3
  # 5. Mounts under DIR, deepest first (kubelet bind-mounts its root onto itself; tokens
  #    and secrets are tmpfs; sandboxes have shm and nsfs mounts; rootfs are overlays).
  umount_under "$DIR"
  # 6. cgroups, then the network: the namespace takes the bridge, the veths and every
  #    netfilter rule kubelet and kube-proxy made with it.
  if [ $mine -eq 1 ]; then
    teardown_host
  fi
  if [ -f "$STATE/owner" ] && [ "$(head -n1 "$STATE/owner")" = "$DIR" ]; then rm -f "$STATE/owner"; fi
  # 8. Check (while DIR still holds the baseline), then remove DIR unless a mount in it
  #    could not be undone.
  local rc=0
  leftovers_in "$DIR" keep-dir || rc=1
  if ! awk -v s="$DIR" 'index($5, s "/") == 1 {f=1} END {exit !f}' /proc/self/mountinfo; then
    rm -rf "$DIR"
  fi
  return $rc
}

# Steps 6 and 7 of a teardown: what is machine-wide.
teardown_host() {
  local c i
  # A cgroup can be removed only once its killed processes are reaped: retry for a while.
  for ((i = 0; i < 100; i++)); do
    for c in $(cgroup_dirs); do find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true; done
    [ -z "$(cgroup_dirs)" ] && break
    sleep 0.1
  done
  if ip netns list 2>/dev/null | grep -qw "$NETNS"; then ip netns del "$NETNS"; fi
  ip link del "$HOST_IF" 2>/dev/null || true
  ip route del "$POD_NET" 2>/dev/null || true
  ip route del "$SERVICE_NET" 2>/dev/null || true
  ip route del local "$LAB_NET" dev lo table local 2>/dev/null || true
  # 7. Sysctls kubelet changed, and paths outside DIR that did not exist before.
  if [ -f "$DIR/baseline/sysctl" ]; then
    local key val
    while read -r key val; do
      [ "$(sysctl -n "$key" 2>/dev/null)" = "$val" ] || sysctl -qw "$key=$val" || log "cannot restore $key=$val"
    done <"$DIR/baseline/sysctl"
    local p
    for p in "${OUTSIDE_PATHS[@]}"; do
      grep -qxF "$p" "$DIR/baseline/paths" || rm -rf "$p"
    done
  fi
}

# Everything a node in DIR could leave behind; prints each and fails if any. The
# machine-wide checks apply when DIR is the node of record or no node is on record.
leftovers_in() {
  local dir="$1" found=0 c
  say() { log "left behind: $*"; found=1; }
  if [ "${2:-}" != keep-dir ] && [ -d "$dir" ]; then say "directory $dir"; fi
  for c in $(procs_of "$dir"); do say "process $c: $(tr '\0' ' ' </proc/"$c"/cmdline 2>/dev/null | cut -c1-120)"; done
  awk -v s="$dir" '$5 == s || index($5, s "/") == 1 {print $5}' /proc/self/mountinfo \
    | while read -r c; do log "left behind: mount $c"; done
  awk -v s="$dir" '$5 == s || index($5, s "/") == 1 {f=1} END {exit !f}' /proc/self/mountinfo && found=1
  owns_node "$dir" || return $found
  ip netns list 2>/dev/null | grep -qw "$NETNS" && say "netns $NETNS"
  ip link show "$HOST_IF" >/dev/null 2>&1 && say "link $HOST_IF"
  for c in "$POD_NET" "$SERVICE_NET"; do ip route show "$c" | grep -q . && say "route $c"; done
  ip route show table local "$LAB_NET" | grep -q . && say "local route $LAB_NET"
  for c in $(cgroup_dirs); do say "cgroup $c"; done
  nft list tables 2>/dev/null | grep -q 'kube-proxy' && say "nft table kube-proxy in the host's namespace"
  if [ -f "$dir/baseline/sysctl" ]; then
    local key val
    while read -r key val; do
      [ "$(sysctl -n "$key" 2>/dev/null)" = "$val" ] || say "sysctl $key=$(sysctl -n "$key") (was $val)"
    done <"$dir/baseline/sysctl"
  fi
  for c in $ETCD_PORT $ETCD_PEER_PORT $API_PORT; do
    ss -Hltn "sport = :$c" | grep -q . && say "a listener on port $c"
  done
  [ -f "$STATE/owner" ] && [ "$(head -n1 "$STATE/owner")" = "$dir" ] && say "the owner record $STATE/owner"
  return $found
}

cmd_down() {
  take_lock
  cmd_down_in "$DIR"
}

case "${1:-}" in
  up)
    [ $# -eq 3 ] || die "usage: $0 up DIR BIN_DIR"
    DIR="$(realpath -m "$2")"; BIN="$(realpath "$3")"
    cmd_up
    ;;
  down)
    [ $# -eq 2 ] || die "usage: $0 down DIR"
    DIR="$(realpath -m "$2")"
    BIN="$(readlink -f "$DIR/bin" 2>/dev/null || echo /nonexistent)"
    cmd_down
    ;;
  leftovers)
    [ $# -eq 2 ] || die "usage: $0 leftovers DIR"
    leftovers_in "$(realpath -m "$2")"
    ;;
  images)
    [ $# -eq 2 ] || die "usage: $0 images OUT"
    build_images "$(realpath -m "$2")"
    ;;
  *)
    die "usage: $0 up DIR BIN_DIR | down DIR | leftovers DIR | images OUT"
    ;;
esac
