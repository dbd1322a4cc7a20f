#!/usr/bin/env bash
# Teardown for the node spike. Idempotent; safe to run after a crash.
# Order: pods via API (so kubelet runs CNI DEL) -> kube-proxy (+ --cleanup) -> kubelet
# -> container processes (by cgroup) -> containerd + shims -> control plane -> mounts
# -> cgroups -> network -> netfilter -> sysctls -> stray files outside /work/node-spike.
set -uo pipefail
S=/work/node-spike
cp=/root/.cache/egress-operator/controlplane/k8s-v1.33.13-etcd-v3.5.21-2b88551e7ad0
export KUBECONFIG=$S/kubeconfig/admin.kubeconfig
log() { printf 'node-down: %s %s\n' "$(date +%T.%N | cut -c1-12)" "$*" >&2; }
# running = exists and not a zombie (our daemons are re-parented to PID 1, which reaps late)
running() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
alive() { [ -f "$S/pids/$1" ] && running "$(cat "$S/pids/$1")"; }
stop() { # name [timeout-seconds]
  alive "$1" || { rm -f "$S/pids/$1"; return 0; }
  local pid; pid=$(cat "$S/pids/$1"); kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 $((${2:-10} * 10))); do running "$pid" || break; sleep 0.1; done
  running "$pid" && { log "$1 ($pid) did not stop, SIGKILL"; kill -KILL "$pid"; sleep 0.2; }
  rm -f "$S/pids/$1"; log "stopped $1 ($pid)"
}

# 1. Pods, while kubelet + containerd still run: kubelet stops containers and calls CNI DEL.
if alive kubelet && alive kube-apiserver; then
  "$cp/kubectl" delete pods --all -A --grace-period=1 --wait=true --timeout=30s >/dev/null 2>&1 \
    && log "pods deleted via API" || log "pod deletion via API incomplete"
fi
# 2. kube-proxy, then its own cleanup of iptables/ipvs/nftables rules.
stop kube-proxy 5
for m in iptables nftables; do
  "$S/bin/kube-proxy" --cleanup --config="$S/conf/kube-proxy-$m.yaml" >>"$S/logs/kube-proxy-cleanup.log" 2>&1
done
# 3. kubelet.
stop kubelet 10
# 4. Anything still in a pod cgroup (kubelet gone, so nothing restarts them).
for c in /sys/fs/cgroup/*/kubepods; do
  [ -d "$c" ] || continue
  find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u | while read -r pid; do
    kill -KILL "$pid" 2>/dev/null && log "killed pod process $pid"
  done
done
# 5. containerd, then any shim still bound to our containerd socket.
stop containerd 10
for p in /proc/[0-9]*; do
  tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -q -- "-address $S/run/containerd/containerd.sock" || continue
  kill -KILL "${p#/proc/}" 2>/dev/null && log "killed shim ${p#/proc/}"
done
# 6. Control plane.
stop kube-scheduler 5
stop kube-controller-manager 5
stop kube-apiserver 10
stop etcd 5
sleep 0.5
# 7. Mounts under $S, deepest first (kubelet bind-mounts its root dir onto itself).
for _ in 1 2 3; do
  awk -v s="$S" '$5 == s || index($5, s "/") == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "cannot umount $m"
  done
done
# 8. Pod cgroups made by kubelet (v1: one tree per controller; plus the named/unified ones).
for c in /sys/fs/cgroup/*/kubepods; do
  [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null
  [ -d "$c" ] && log "cgroup left: $c"
done
# 9. Network: veths on spk0 (gone with their netns normally), the bridge and its routes, netns.
for v in $(ip -o link show master spk0 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
  ip link del "$v" 2>/dev/null && log "deleted $v"
done
ip link del spk0 2>/dev/null && log "deleted bridge spk0"
# netns variant: the node's netns holds spk0, the veths, kubelet/kube-proxy netfilter rules.
if ip netns list 2>/dev/null | grep -qw spk-node; then ip netns del spk-node && log "deleted netns spk-node"; fi
ip link del spkh0 2>/dev/null && log "deleted veth spkh0"
nft delete table inet spike_guard 2>/dev/null && log "deleted nft table inet spike_guard"
# 10. Netfilter left by kubelet (KUBE-KUBELET-CANARY, KUBE-FIREWALL) and kube-proxy.
for fam in ip ip6; do nft delete table $fam kube-proxy 2>/dev/null; done
for cmd in iptables ip6tables; do
  for t in filter nat mangle; do
    # rules in built-in chains that jump to KUBE-* chains
    $cmd-save -t $t 2>/dev/null | grep -E '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j KUBE-' | while read -r _ rest; do
      eval "$cmd -t $t -D $rest" 2>/dev/null
    done
    chains=$($cmd-save -t $t 2>/dev/null | awk '/^:KUBE-/ {print substr($1, 2)}')
    for ch in $chains; do $cmd -t $t -F "$ch" 2>/dev/null; done
    for ch in $chains; do $cmd -t $t -X "$ch" 2>/dev/null; done
  done
done
# iptables-nft leaves empty tables behind; the baseline had none, so drop tables with no rules.
for t in $(nft list tables 2>/dev/null | awk '$2 == "ip" || $2 == "ip6" {print $2 ":" $3}'); do
  fam=${t%%:*}; name=${t#*:}
  case $name in filter|nat|mangle|raw|security) ;; *) continue;; esac
  # any line that is not a table/chain header, a hook/policy line or a brace is a rule
  nft list table "$fam" "$name" | grep -vqE '^\s*(table |chain |type |\}|$)' && continue
  nft delete table "$fam" "$name" && log "deleted empty nft table $fam $name"
done
# 11. Sysctls kubelet / the bridge plugin changed (values from baseline/sysctl.txt).
while read -r key _ val; do
  case $val in ''|sysctl:*) continue;; esac
  [ "$(sysctl -n "$key" 2>/dev/null)" = "$val" ] || { sysctl -qw "$key=$val" && log "restored $key=$val"; }
done < "$S/baseline/sysctl.txt"
# 12. Paths outside $S that kubelet / containerd / buildah create (none existed before).
rm -rf /var/lib/kubelet /var/log/containers /usr/libexec/kubernetes /run/containerd /var/lib/containers /var/lib/cni /etc/cni
# /run/netns: ip-netns (used while testing) bind-mounts it onto itself
# (only if net-up-netns.sh created it and nobody else has a netns there now)
if [ -f "$S/pids/created-run-netns" ]; then
  if [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then umount /run/netns 2>/dev/null; rmdir /run/netns; fi
  rm -f "$S/pids/created-run-netns"
fi
rm -rf "$S/run"
log "done"
