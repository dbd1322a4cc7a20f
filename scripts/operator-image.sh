#!/usr/bin/env bash
# Builds the operator image from the Dockerfile, and the node tier's workload image, with
# buildah: no daemon, and no registry (none can be reached here).
#
#   scripts/operator-image.sh OUT BINARY PLUGIN_DIR
#   scripts/operator-image.sh base      only make the base (make test runs this beside the
#                                       compile, so the build later finds it cached)
#
# - debian:12-slim, the runtime stage's base, is made here: debootstrap --variant=minbase
#   of bookworm from this machine's apt source, trimmed as the slim image is (no docs, man
#   pages or locales), imported under the name the Dockerfile uses. It is cached by this
#   script's digest in buildah's storage.
# - The runtime stage is the Dockerfile's own, run by `buildah bud`: its apt-get, useradd,
#   USER and ENTRYPOINT are what users get. The Rust build stage's base (rust:1.95-bookworm)
#   cannot be made here, so the binary and plugins come in with --build-arg
#   BINARIES=prebuilt (see the Dockerfile): BINARY (debug info stripped) and
#   PLUGIN_DIR/{domain-default,vendor-data-default}.wasm.
# - The workload image (tests/node/workload.Dockerfile: curl on the same base) is built
#   the same way.
#
# Writes OUT/egress-operator.tar and OUT/workload.tar (OCI archives that
# `ctr images import` registers as egress-operator:0.1.0 and localhost/eotest/workload:1),
# prints each image's size, layers and user, and prints OUT on its last line. Archives in
# OUT built from the same inputs (OUT/inputs.sha256) are kept, not rebuilt.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
log() { printf 'operator-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

BASE_ONLY=0
if [ $# -eq 1 ] && [ "$1" = base ]; then
  BASE_ONLY=1
else
  [ $# -eq 3 ] || die "usage: $0 OUT BINARY PLUGIN_DIR | $0 base"
  OUT="$(realpath -m "$1")"; BINARY="$2"; PLUGINS="$3"
  [ -x "$BINARY" ] || die "$BINARY: no operator binary (cargo build -p egress-operator)"
  for p in domain-default vendor-data-default; do
    [ -f "$PLUGINS/$p.wasm" ] || die "$PLUGINS/$p.wasm is missing (make plugins)"
  done
fi
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, buildah's chroot isolation)"
for c in buildah debootstrap objcopy; do
  command -v "$c" >/dev/null || die "$c is not installed (make setup installs it)"
done

OPERATOR_IMAGE=egress-operator:0.1.0
WORKLOAD_IMAGE=localhost/eotest/workload:1
BASE_IMAGE=docker.io/library/debian:12-slim
CACHE="${EGRESS_CACHE_DIR:-$HOME/.cache/egress-operator}/buildah"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
# vfs: no overlay-on-overlay questions; chroot isolation: RUN needs no runc, no netns.
B=(buildah --root "$CACHE/root" --runroot "$CACHE/runroot" --storage-driver vfs)
export BUILDAH_ISOLATION=chroot
# buildah writes a blob-info cache and a CNI lock outside its root whatever it is told.
created=()
for p in /var/lib/containers /etc/cni; do [ -e "$p" ] || created+=("$p"); done
work="$(mktemp -d "${TMPDIR:-/tmp}/eotest-image.XXXXXX")"
cleanup() {
  "${B[@]}" rm -a >/dev/null 2>&1 || true
  rm -rf "$work"
  local p
  for p in "${created[@]}"; do rm -rf "$p"; done
}
trap cleanup EXIT

# ---------------------------------------------------------------- the base
# The first deb source serving bookworm main, as scripts/guest-image.sh finds it.
mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] && awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && awk '/^URIs:/ {u=$2} /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == "bookworm") {print u; exit}}' "$f"
  done
}
base_key="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)"
if [ "$("${B[@]}" inspect --type image --format '{{index .OCIv1.Config.Labels "eotest.base"}}' "$BASE_IMAGE" 2>/dev/null)" != "$base_key" ]; then
  url="$(mirror | head -n1)"
  [ -n "$url" ] || die "no apt source serves bookworm (read /etc/apt/sources.list*)"
  log "making $BASE_IMAGE: debootstrap minbase bookworm from $url"
  t=$SECONDS
  debootstrap --variant=minbase --components=main bookworm "$work/rootfs" "$url" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
  # Trimmed as the slim image is; apt's settings of this machine's mirror (a snapshot
  # mirror needs Check-Valid-Until off) go with it, so RUN apt-get works the same.
  rm -rf "$work"/rootfs/usr/share/{doc,man,info,locale}/* "$work"/rootfs/var/cache/apt/*.bin \
    "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
  for f in /etc/apt/apt.conf.d/99*; do [ -f "$f" ] && cp "$f" "$work/rootfs/etc/apt/apt.conf.d/"; done
  tar -C "$work/rootfs" --numeric-owner -cf "$work/rootfs.tar" .
  rm -rf "$work/rootfs"
  c="$("${B[@]}" from scratch)"
  "${B[@]}" add "$c" "$work/rootfs.tar" / >/dev/null
  "${B[@]}" config --created-by "debootstrap --variant=minbase bookworm (scripts/operator-image.sh)" --cmd '["bash"]' --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --label "eotest.base=$base_key" "$c"
  "${B[@]}" commit -q --rm "$c" "$BASE_IMAGE" >/dev/null
  rm -f "$work/rootfs.tar"
  log "made $BASE_IMAGE in $((SECONDS - t))s"
fi

if [ $BASE_ONLY -eq 1 ]; then
  log "$BASE_IMAGE is ready"
  exit 0
fi

# ---------------------------------------------------------------- the images
mkdir -p "$OUT"
# Both archives are rebuilt only when an input changed: the binary, the plugins, the
# Dockerfiles and this script (which also keys the base). Each test binary of the node
# tier asks for them once, with the same inputs.
inputs="$(sha256sum "$BINARY" "$PLUGINS/domain-default.wasm" "$PLUGINS/vendor-data-default.wasm" \
  "$here/Dockerfile" "$here/tests/node/workload.Dockerfile" "${BASH_SOURCE[0]}" | cut -c1-64 | sha256sum | cut -c1-64)"
if [ -f "$OUT/egress-operator.tar" ] && [ -f "$OUT/workload.tar" ] \
  && [ "$(cat "$OUT/inputs.sha256" 2>/dev/null)" = "$inputs" ]; then
  log "up to date: $OPERATOR_IMAGE ($(du -sh "$OUT/egress-operator.tar" | cut -f1)) and $WORKLOAD_IMAGE ($(du -sh "$OUT/workload.tar" | cut -f1)), inputs ${inputs:0:12}"
  echo "$OUT"
  exit 0
fi
rm -f "$OUT/inputs.sha256"
describe() { # image
  local size layers user
  user="$("${B[@]}" inspect --type image --format '{{.OCIv1.Config.User}}' "$1")"
  user="${user:-root}"
  layers="$("${B[@]}" inspect --type image --format '{{len .OCIv1.RootFS.DiffIDs}}' "$1")"
  size="$(du -sh "$OUT/$2.tar" | cut -f1)"
  log "$1: $size (OCI archive), $layers layers, user $user"
  "${B[@]}" inspect --type image --format '{{range .History}}{{println .CreatedBy}}{{end}}' "$1" \
    | sed '/^$/d; s/^/  layer: /' | cut -c1-150 >&2
}

ctx="$work/context"
mkdir -p "$ctx/image-input/plugins"
objcopy --strip-debug "$BINARY" "$ctx/image-input/egress-operator"
cp "$PLUGINS/domain-default.wasm" "$PLUGINS/vendor-data-default.wasm" "$ctx/image-input/plugins/"
t=$SECONDS
"${B[@]}" bud -q --pull=never --network host --layers=false --build-arg BINARIES=prebuilt \
  -f "$here/Dockerfile" -t "$OPERATOR_IMAGE" "$ctx" >"$work/bud.log" 2>&1 \
  || { tail -n 30 "$work/bud.log" >&2; die "buildah bud of the Dockerfile failed"; }
rm -f "$OUT/egress-operator.tar"
"${B[@]}" push -q "$OPERATOR_IMAGE" "oci-archive:$OUT/egress-operator.tar:docker.io/library/$OPERATOR_IMAGE"
log "built $OPERATOR_IMAGE from the Dockerfile in $((SECONDS - t))s"
describe "$OPERATOR_IMAGE" egress-operator

t=$SECONDS
"${B[@]}" bud -q --pull=never --network host --layers=false \
  -f "$here/tests/node/workload.Dockerfile" -t "$WORKLOAD_IMAGE" "$work/context" >"$work/bud.log" 2>&1 \
  || { tail -n 30 "$work/bud.log" >&2; die "buildah bud of the workload image failed"; }
rm -f "$OUT/workload.tar"
"${B[@]}" push -q "$WORKLOAD_IMAGE" "oci-archive:$OUT/workload.tar:$WORKLOAD_IMAGE"
log "built $WORKLOAD_IMAGE in $((SECONDS - t))s"
describe "$WORKLOAD_IMAGE" workload
# Only the base is kept between runs.
"${B[@]}" rmi "$OPERATOR_IMAGE" "$WORKLOAD_IMAGE" >/dev/null 2>&1 || true
echo "$inputs" >"$OUT/inputs.sha256"
echo "$OUT"
