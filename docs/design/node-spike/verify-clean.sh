#!/usr/bin/env bash
# Prints anything the spike may have left behind; silent sections mean clean.
S=/work/node-spike
echo "== processes"; ps -eo pid,args | grep -E "$S|containerd|kubelet|kube-proxy" | grep -vE 'grep|verify-clean' | cut -c1-160
echo "== mounts"; grep -E "$S|/run/netns|/run/containerd" /proc/self/mountinfo
echo "== links"; ip -br link | diff "$S/baseline/ip-link.txt" - | grep '^[<>]'
echo "== routes"; ip route | diff "$S/baseline/ip-route.txt" - | grep '^[<>]'
echo "== iptables"; iptables-save 2>/dev/null | grep -i kube; ip6tables-save 2>/dev/null | grep -i kube
echo "== nft"; nft list ruleset | diff "$S/baseline/nft.txt" - | grep '^[<>]' | head
echo "== cgroups"; ls -d /sys/fs/cgroup/*/kubepods* 2>/dev/null
echo "== sysctl"; while read -r k _ v; do case $v in ''|sysctl:*) continue;; esac; n=$(sysctl -n "$k"); [ "$n" = "$v" ] || echo "$k=$n (baseline $v)"; done < "$S/baseline/sysctl.txt"
echo "== paths"; ls -d /var/lib/kubelet /var/log/containers /var/log/pods /usr/libexec/kubernetes /run/containerd /run/netns /var/lib/containers /var/lib/cni /etc/cni /var/lib/containerd 2>/dev/null
echo "== ports"; ss -ltn | grep -E ':(23791|23801|26443|10248|10249|10250|10256) '
