#!/usr/bin/env bash
# Installs exactly what the build and the tests need, and nothing else.
#
# Idempotent and fast when everything is already there: it asks dpkg and rustup
# first and only touches apt when something is missing. Runs as root on Debian 12
# (bookworm); every other case gets a clear message instead of a half-done install.
set -euo pipefail

# Packages from bookworm itself.
#   pkg-config, libvirt-dev      build the `virt` crate (libvirt client library)
#   libvirt-daemon-system,       libvirtd + virtlogd for the integration tests
#   libvirt-clients              virsh, virt-xml-validate
#   libxml2-utils                xmllint, which virt-xml-validate runs
#   openssh-server               sshd for the SSH transport tests
#   netcat-openbsd               `nc -U`: the remote end of libvirt's own qemu+ssh://
#                                transport, the peer `make bench` measures ours against
#                                (its default far end, virt-ssh-helper, ignores `socket=`
#                                and would reach the system daemon, not the test one)
#   socat                        the plain one-hop relay `make bench` measures as the
#                                floor under any tunnel
#   xorriso                      reads seed ISOs back in tests
#   iproute2                     network namespaces and bridges for test VMs
#   dnsmasq-base                 DHCP on the demo's isolated bridge
#   syslinux mtools dosfstools   build the demo's tiny bootable image (scripts/demo-image.sh)
#   python3 curl                 the proxy lab's HTTP server inside the namespace, and the
#                                client that fetches through the proxy VM (demo, e2e test)
#   python3-yaml                 PyYAML, which cloud-init loads cloud-config with: the
#                                vendor-data parity test compares its keys with ours
#   cloud-init                   the guest's own reader (22.4, as on a Debian 12 guest):
#                                the vendor-data parity test runs its Python library
#                                (user_data, handlers, mergers) on generated documents.
#                                Only the library is used; none of its services runs: the
#                                policy-rc.d guard below keeps apt from starting them, a
#                                container without systemd has no init to start them, and
#                                /etc/cloud/cloud-init.disabled (keep_cloud_init_off) stops
#                                them at boot on a machine that has one
#   nftables shellcheck          vendor-data-default's tests: its rendered scripts under
#                                the shellcheck linter, its firewall in a test namespace
#   prometheus                   promtool: checks and unit-tests the alerts and the
#                                dashboard's queries (config/prometheus)
#   containerd runc              the node tier's container runtime (scripts/node.sh);
#   containernetworking-plugins  its pod network (bridge + host-local); no service is
#                                started: policy-rc.d below, and there is no init system
#   buildah                      builds the node tier's images (pause, workload, operator)
#                                with no daemon and no registry
#   busybox-static gcc libc6-dev the workload image's shell and tools; the static pause
#   debootstrap                  the images' debian:12-slim base, made here
#   docker-registry              the CNCF distribution registry (2.8): the harness starts
#                                its own on a loopback port to test OCI plugin push/pull;
#                                the package's service is not started (policy-rc.d below)
#   apache2-utils                htpasswd: the bcrypt password file of that registry
BOOKWORM_PKGS=(pkg-config libvirt-dev libvirt-daemon-system libvirt-clients libxml2-utils
  openssh-server netcat-openbsd socat xorriso iproute2 dnsmasq-base syslinux mtools dosfstools
  python3 python3-yaml cloud-init curl shellcheck nftables prometheus containerd runc
  containernetworking-plugins buildah busybox-static gcc libc6-dev debootstrap docker-registry
  apache2-utils)
# QEMU 10 from bookworm-backports: the emulator and qemu-img (qemu-utils) from the same
# suite. Some machines come with qemu-utils 10 preinstalled (apt refuses to mix suites
# then); on others libvirt-daemon-system would pull bookworm's qemu-utils 7.2 beside a
# QEMU 10, so both are installed from backports first, and a non-backports qemu-utils
# counts as missing.
BACKPORTS_PKGS=(qemu-system-x86 qemu-utils)
# kubectl, kube-apiserver and etcd are not Debian packages here (bookworm's kubectl 1.20
# is too old for the API server the tests run): scripts/controlplane.sh builds them with Go.
RUST_TARGETS=(wasm32-wasip2)
BACKPORTS_LIST=/etc/apt/sources.list.d/bookworm-backports.sources

log() { printf 'setup: %s\n' "$*"; }

missing_pkgs() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || printf '%s\n' "$p"
  done
}

# Backports packages count as present only at a backports version.
missing_backports() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${db:Status-Status} ${Version}' "$p" 2>/dev/null | grep -q '^installed .*~bpo12' \
      || printf '%s\n' "$p"
  done
}

ensure_backports_source() {
  if grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    return
  fi
  log "adding bookworm-backports to apt sources"
  cat >"$BACKPORTS_LIST" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
}

apt_update() {
  # Third-party sources on some images are unreachable here; apt keeps going
  # without them, and a missing Debian index shows up as an install failure below.
  apt-get update -qq || log "apt-get update reported errors (continuing; install will fail loudly if Debian's indexes are missing)"
}

install_apt() {
  local main_missing bp_missing
  mapfile -t main_missing < <(missing_pkgs "${BOOKWORM_PKGS[@]}")
  mapfile -t bp_missing < <(missing_backports "${BACKPORTS_PKGS[@]}")
  if [ ${#main_missing[@]} -eq 0 ] && [ ${#bp_missing[@]} -eq 0 ]; then
    log "Debian packages present"
    return
  fi
  if [ "$(id -u)" -ne 0 ]; then
    log "missing packages: ${main_missing[*]} ${bp_missing[*]}; run 'make setup' as root" >&2
    exit 1
  fi
  if printf '%s\n' "${main_missing[@]}" | grep -qx cloud-init; then
    CLOUD_INIT_FRESH=1
  fi
  ensure_backports_source
  apt_update
  # Keep package scripts from starting system daemons: there is no init system
  # here, and tests start their own isolated daemons anyway.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    created_policy=1
  fi
  local rc=0
  export DEBIAN_FRONTEND=noninteractive
  if [ ${#bp_missing[@]} -gt 0 ]; then
    log "installing from bookworm-backports: ${bp_missing[*]}"
    apt-get install -y -qq --no-install-recommends -t bookworm-backports "${bp_missing[@]}" || rc=$?
  fi
  if [ $rc -eq 0 ] && [ ${#main_missing[@]} -gt 0 ]; then
    log "installing: ${main_missing[*]}"
    apt-get install -y -qq --no-install-recommends "${main_missing[@]}" || rc=$?
  fi
  [ $created_policy -eq 1 ] && rm -f "$policy"
  if [ $rc -ne 0 ]; then
    log "apt-get install failed with exit code $rc" >&2
    exit $rc
  fi
}

install_rust_targets() {
  local t installed
  installed=$(rustup target list --installed)
  for t in "${RUST_TARGETS[@]}"; do
    if grep -qx "$t" <<<"$installed"; then
      log "rust target $t present"
    else
      log "adding rust target $t"
      rustup target add "$t"
    fi
  done
}

check_go() {
  # Go builds the test control plane (scripts/controlplane.sh); the machines ship it.
  if command -v go >/dev/null 2>&1; then
    log "go present ($(go version | awk '{print $3}'))"
  else
    log "Go is missing: the test control plane (kube-apiserver, etcd) is built with Go 1.24 or newer" >&2
    exit 1
  fi
}

# cloud-init's packaging enables its boot units. When this script installed it, its own
# switch keeps them from ever running here (its systemd generator then leaves
# cloud-init.target out of the boot): this machine is not a guest, and its network must
# stay as it is. A cloud-init that was there before is the machine's own and left alone.
CLOUD_INIT_FRESH=0
keep_cloud_init_off() {
  local flag=/etc/cloud/cloud-init.disabled
  if [ "$CLOUD_INIT_FRESH" -ne 1 ] || [ -e "$flag" ]; then
    return
  fi
  mkdir -p /etc/cloud
  : >"$flag"
  log "cloud-init's boot stages disabled ($flag)"
}

install_apt
keep_cloud_init_off
install_rust_targets
check_go
log "done"
