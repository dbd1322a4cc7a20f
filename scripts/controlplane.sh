#!/usr/bin/env bash
# Builds the test control plane: etcd, kube-apiserver, kube-controller-manager (the cluster
# tier runs only its namespace and garbage-collector controllers: namespace deletion and
# ownerReference cascades) and kubectl, plus the node tier's kube-scheduler, kubelet and
# kube-proxy (scripts/node.sh), from their Go modules at the versions pinned in tests/controlplane/go.mod. No such binary can be downloaded
# here, and `go install k8s.io/kubernetes/...` is refused (its go.mod replaces the staging
# modules with local paths), so tests/controlplane is a small module of ours that requires
# k8s.io/kubernetes, points each staging module at its published release, and builds the
# commands from it. etcd comes from the same dependency graph (the go.etcd.io/etcd/server/v3
# version kube-apiserver's module pins), so the two halves always match.
#
# The binaries are cached outside the tree, keyed by version and by the module's files:
#   ${EGRESS_CACHE_DIR:-~/.cache/egress-operator}/controlplane/<key>/{etcd,kube-apiserver,...}
# A second run finds them and returns at once. Prints the directory on its last line.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
module="$here/tests/controlplane"
k8s_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$module/go.mod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2; exit}' "$module/go.mod")"
[ -n "$k8s_version" ] && [ -n "$etcd_version" ] || {
  echo "controlplane: cannot read the pinned versions from $module/go.mod" >&2
  exit 1
}
# The key changes with any file of the module (versions, replaces, go.sum, main.go).
digest="$(cd "$module" && find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) -print0 \
  | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)"
cache="${EGRESS_CACHE_DIR:-$HOME/.cache/egress-operator}/controlplane"
out="$cache/k8s-$k8s_version-etcd-$etcd_version-$digest"
log() { printf 'controlplane: %s\n' "$*" >&2; }

binaries=(etcd kube-apiserver kube-controller-manager kubectl kube-scheduler kubelet kube-proxy)
up_to_date() {
  local b
  for b in "${binaries[@]}"; do [ -x "$out/$b" ] || return 1; done
}

mkdir -p "$cache"
# One build at a time per cache: `make test` and `make demo` may both ask; the second
# waits and then finds the binaries.
exec 9>"$cache/.lock"
flock 9
if up_to_date; then
  log "up to date: kubernetes $k8s_version, etcd $etcd_version"
  echo "$out"
  exit 0
fi

command -v go >/dev/null || { echo "controlplane: Go is not installed (the machines ship Go 1.26)" >&2; exit 1; }
work="$(mktemp -d "${TMPDIR:-/tmp}/egress-controlplane.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# Build a copy: with -mod=mod, go may add go.sum lines, and the tree stays untouched.
cp -r "$module/." "$work/src"
minor="${k8s_version#v}"; major="${minor%%.*}"; minor="${minor#*.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
log "building kubernetes $k8s_version (${binaries[*]:1}) and etcd $etcd_version with $(go version | awk '{print $3}')"
start=$(date +%s)
(
  cd "$work/src"
  export GOTOOLCHAIN=local GOFLAGS=-mod=mod
  go build -ldflags "$ldflags" -o "$work/bin/" \
    ./cmd/etcd k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
)
mkdir -p "$out.tmp"
for b in "${binaries[@]}"; do mv "$work/bin/$b" "$out.tmp/"; done
rm -rf "$out"
mv "$out.tmp" "$out"
# Older builds (other versions or module contents) are of no further use.
find "$cache" -mindepth 1 -maxdepth 1 -type d -name 'k8s-*' ! -name "$(basename "$out")" -exec rm -rf {} +
log "built in $(( $(date +%s) - start ))s: $out"
echo "$out"
