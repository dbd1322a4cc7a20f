#!/usr/bin/env bash
# Spike: build kubelet + kube-proxy from the copied tests/controlplane module.
set -euo pipefail
cd /work/node-spike/src
v=v1.33.13; major=1; minor=33
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
start=$(date +%s)
nice -n 19 go build -ldflags "$ldflags" -o /work/node-spike/bin/ \
  k8s.io/kubernetes/cmd/kube-scheduler
echo "kube-scheduler build took $(( $(date +%s) - start ))s"
