#!/usr/bin/env bash
# demo-image.sh OUT.qcow2 -- builds the tiny guest image that `make demo` boots.
#
# What the guest does: boot (legacy BIOS / SeaBIOS) from a virtio disk, load the
# virtio-net driver, run busybox udhcpc on the first NIC so that the libvirt
# network's dnsmasq hands out (and records) a lease, print
# "egress-demo: got address A.B.C.D/N on ethX" on the serial console (ttyS0), then
# idle forever, renewing the lease. It never mounts its disk and ignores any other
# device (the cloud-init seed CD-ROM included).
#
# Layout: the whole disk is one unpartitioned FAT file system ("superfloppy"), made
# with mkfs.vfat on a plain file, with the SYSLINUX boot sector and ldlinux.sys
# installed by Debian's mtools-based `syslinux --install`, and three files copied
# in with mcopy:
#   syslinux.cfg   boot vmlinuz + initrd.gz at once, console=ttyS0
#   vmlinuz        Debian 12's stock kernel (the package linux-image-amd64 points at)
#   initrd.gz      newc cpio: busybox-static, /init (below), and the few kernel
#                  modules it insmods in dependency order (Debian builds virtio,
#                  virtio_pci and virtio_net as modules)
# then converted to qcow2 (the demo uses it as the backing file of an overlay).
#
# Why this way: everything comes from Debian 12 packages (no other download), the
# build needs neither root-only loop devices nor mounts nor a container runtime,
# the image is ~12 MB, and an initramfs-only guest with no init system reaches its
# DHCP request in seconds even under TCG (no KVM).
#
# Inputs: the kernel and busybox-static .debs are fetched with `apt-get download`
# (never installed) and kept in ${DEMO_IMAGE_CACHE:-/var/cache/egress-demo}, so a
# second run needs no network. The build tools (syslinux, mtools, dosfstools,
# qemu-utils) are installed with apt only when dpkg says they are missing. The
# inputs (package versions, this script's hash) and the output's sha256 are recorded
# in OUT.inputs; when they still match, the script does nothing.
set -Eeuo pipefail

log() { printf 'demo-image: %s\n' "$*"; }
die() {
  printf 'demo-image: error: %s\n' "$*" >&2
  exit 1
}
on_err() {
  printf 'demo-image: error: command failed (exit %s) at line %s: %s\n' "$1" "$2" "$3" >&2
}
trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR

if [ $# -ne 1 ] || [ -z "$1" ]; then die "usage: $0 OUT.qcow2"; fi
OUT=$1
INPUTS_FILE="$OUT.inputs"
CACHE=${DEMO_IMAGE_CACHE:-/var/cache/egress-demo}
# Debian packages installed (if missing) for the build tools.
TOOL_PKGS=(syslinux mtools dosfstools qemu-utils)
KERNEL_META=linux-image-amd64
BUSYBOX_PKG=busybox-static
# Modules /init loads; their dependencies are found from the .ko files themselves.
MODULES=(virtio_pci virtio_net)
CMDLINE="console=ttyS0,115200 quiet loglevel=3 panic=10"

[ "$(dpkg --print-architecture 2>/dev/null)" = amd64 ] || die "needs a Debian amd64 host (dpkg --print-architecture)"

# ---------------------------------------------------------------- build tools

missing_pkgs() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || printf '%s\n' "$p"
  done
}

APT_UPDATED=0
apt_update() {
  [ "$APT_UPDATED" -eq 1 ] && return
  [ "$(id -u)" -eq 0 ] || die "apt indexes need refreshing; run as root"
  log "apt-get update"
  apt-get update -qq || log "apt-get update reported errors (continuing)"
  APT_UPDATED=1
}

ensure_tools() {
  local missing
  mapfile -t missing < <(missing_pkgs "${TOOL_PKGS[@]}")
  [ ${#missing[@]} -eq 0 ] && return
  [ "$(id -u)" -eq 0 ] || die "missing packages: ${missing[*]}; run as root (or install them)"
  apt_update
  log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    die "apt-get install ${missing[*]} failed"
}

# ---------------------------------------------------------------- cached .debs

# candidate_version PKG: apt's candidate version, empty when apt knows none.
candidate_version() {
  apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p' | grep -vx '(none)' || true
}

# kernel_pkg: the versioned kernel package that linux-image-amd64's candidate needs.
kernel_pkg() {
  local ver
  ver=$(candidate_version "$KERNEL_META")
  [ -n "$ver" ] || return 0
  apt-cache show "$KERNEL_META=$ver" 2>/dev/null | sed -n 's/^Depends: //p' | head -n1 |
    sed 's/[,|]/\n/g' | sed 's/^ *//; s/ .*//' | grep -m1 '^linux-image-' || true
}

# cached_deb PKG [VERSION]: path of the cached .deb (newest if no VERSION), or empty.
cached_deb() {
  local pkg=$1 ver=${2:-} f
  if [ -n "$ver" ]; then
    f="$CACHE/${pkg}_${ver//:/%3a}_amd64.deb"
    [ -s "$f" ] && printf '%s\n' "$f"
    return 0
  fi
  find "$CACHE" -maxdepth 1 -name "${pkg}_*_amd64.deb" -size +0 2>/dev/null | sort -V | tail -n1
}

# fetch_deb PKG VERSION: makes sure $CACHE holds PKG=VERSION, downloading it if not.
fetch_deb() {
  local pkg=$1 ver=$2 dl
  [ -n "$(cached_deb "$pkg" "$ver")" ] && return 0
  mkdir -p "$CACHE"
  dl=$(mktemp -d "$CACHE/.download.XXXXXX")
  log "downloading $pkg=$ver into $CACHE"
  if ! (cd "$dl" && apt-get -q -o APT::Sandbox::User=root download "$pkg=$ver" >/dev/null); then
    # The index may be stale (Debian drops superseded kernel ABIs): refresh once.
    apt_update
    (cd "$dl" && apt-get -q -o APT::Sandbox::User=root download "$pkg=$ver" >/dev/null) || {
      rm -rf "$dl"
      die "apt-get download $pkg=$ver failed"
    }
  fi
  mv "$dl"/"${pkg}"_*.deb "$CACHE/${pkg}_${ver//:/%3a}_amd64.deb"
  rm -rf "$dl"
}

# resolve NAME PKG-OR-EMPTY: sets RESOLVED_PKG/RESOLVED_VER, preferring apt's
# candidate, falling back to the newest cached .deb when apt knows nothing (no
# indexes, offline), and refreshing the indexes as a last resort.
resolve() {
  local what=$1 pkg=$2 ver="" f
  if [ "$what" = kernel ]; then pkg=$(kernel_pkg); fi
  if [ -n "$pkg" ]; then ver=$(candidate_version "$pkg"); fi
  if [ -z "$ver" ]; then
    if [ "$what" = kernel ]; then
      f=$(find "$CACHE" -maxdepth 1 -name 'linux-image-*-amd64_*_amd64.deb' -size +0 2>/dev/null | sort -V | tail -n1)
    else
      f=$(cached_deb "$pkg")
    fi
    if [ -n "$f" ]; then
      pkg=$(dpkg-deb -f "$f" Package)
      ver=$(dpkg-deb -f "$f" Version)
      log "apt knows no candidate for the $what; using cached $pkg=$ver"
    else
      apt_update
      if [ "$what" = kernel ]; then pkg=$(kernel_pkg); fi
      if [ -n "$pkg" ]; then ver=$(candidate_version "$pkg"); fi
      [ -n "$ver" ] || die "apt has no candidate for the $what ($KERNEL_META / $BUSYBOX_PKG); check the Debian sources"
    fi
  fi
  RESOLVED_PKG=$pkg
  RESOLVED_VER=$ver
}

# ---------------------------------------------------------------- guest files

write_init() {
  cat >"$1" <<'EOF'
#!/bin/busybox sh
# egress-demo guest /init: load virtio-net, DHCP on the first NIC, idle forever.
/bin/busybox mkdir -p /proc /sys /dev /run /tmp /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
[ -c /dev/console ] && exec </dev/console >/dev/console 2>&1
say() { echo "egress-demo: $*"; }
say "init started (kernel $(uname -r), uptime $(cut -d' ' -f1 /proc/uptime)s)"
while read -r m; do
  insmod "/lib/modules/$m" || say "insmod $m failed"
done </lib/modules/load-order
ip link set lo up
iface=""
i=0
while [ -z "$iface" ] && [ $i -lt 100 ]; do
  for d in /sys/class/net/*; do
    n=${d##*/}
    [ "$n" = lo ] || { iface=$n; break; }
  done
  [ -n "$iface" ] || { sleep 0.1; i=$((i + 1)); }
done
if [ -z "$iface" ]; then
  say "no network interface found; idling"
  while :; do sleep 3600; done
fi
mac=$(cat "/sys/class/net/$iface/address")
name="egress-demo-$(echo "$mac" | tr -d : | cut -c7-12)"
hostname "$name"
say "bringing up $iface ($mac), DHCP as $name"
ip link set "$iface" up
# udhcpc stays in the foreground for good: it renews the lease and rediscovers
# after a failure; the loop only guards against it exiting.
while :; do
  udhcpc -f -i "$iface" -s /etc/udhcpc.script -x "hostname:$name" -t 5 -T 2 -A 5
  say "udhcpc exited ($?); restarting in 5s"
  sleep 5
done
EOF
}

write_udhcpc_script() {
  cat >"$1" <<'EOF'
#!/bin/sh
# udhcpc event hook: configure the address and announce it on the console.
# udhcpc passes the event as $1 and the lease in $interface, $ip, $mask (prefix
# length), $router and $lease.
say() { echo "egress-demo: $*"; }
case "$1" in
deconfig)
  ip -4 addr flush dev "$interface"
  ip link set "$interface" up
  ;;
bound | renew)
  if ! ip -4 addr show dev "$interface" | grep -q " $ip/${mask:-24} "; then
    ip -4 addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
  fi
  if [ -n "${router:-}" ]; then
    ip route replace default via "${router%% *}" dev "$interface" 2>/dev/null || true
  fi
  # One ping to the DHCP server: the host then has this guest in its neighbour
  # table, which is where libvirt's ARP address source looks.
  ping -c 1 -W 2 "${serverid:-${router%% *}}" >/dev/null 2>&1 || true
  if [ "$1" = bound ]; then
    say "got address $ip/${mask:-24} on $interface (router ${router:-none}, lease ${lease:-?}s)"
  else
    say "renewed $ip/${mask:-24} on $interface (lease ${lease:-?}s)"
  fi
  ;;
leasefail | nak)
  say "DHCP $1 on $interface; retrying"
  ;;
esac
exit 0
EOF
}

write_syslinux_cfg() {
  cat >"$1" <<EOF
SERIAL 0 115200
DEFAULT egress-demo
PROMPT 0
TIMEOUT 0
LABEL egress-demo
  KERNEL vmlinuz
  INITRD initrd.gz
  APPEND $CMDLINE
EOF
}

# module_deps KO: the module names KO depends on (from its .modinfo section).
module_deps() {
  tr '\0' '\n' <"$1" | sed -n 's/^depends=//p' | head -n1 | tr ',' '\n' | sed '/^$/d'
}

# add_module NAME: copies NAME's dependencies, then NAME, into the initramfs and
# appends them to the load order (depth first, each once).
add_module() {
  local name=$1 ko dep
  grep -qx "$name.ko" "$INITRD_DIR/lib/modules/load-order" 2>/dev/null && return 0
  ko=$(find "$MODDIR/kernel" -name "$name.ko" -o -name "${name//_/-}.ko" | head -n1)
  [ -n "$ko" ] || die "module $name not found in $KERNEL_PKG (compressed modules are not handled)"
  for dep in $(module_deps "$ko"); do add_module "${dep//-/_}"; done
  cp "$ko" "$INITRD_DIR/lib/modules/$name.ko"
  printf '%s.ko\n' "$name" >>"$INITRD_DIR/lib/modules/load-order"
}

# ---------------------------------------------------------------- main

ensure_tools
resolve kernel ""
KERNEL_PKG=$RESOLVED_PKG KERNEL_VER=$RESOLVED_VER
resolve busybox "$BUSYBOX_PKG"
BUSYBOX_VER=$RESOLVED_VER
SYSLINUX_VER=$(dpkg-query -W -f='${Version}' syslinux)

SCRIPT_SHA=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
INPUTS="script-sha256=$SCRIPT_SHA
kernel=$KERNEL_PKG $KERNEL_VER
busybox=$BUSYBOX_PKG $BUSYBOX_VER
syslinux=$SYSLINUX_VER"

if [ -f "$OUT" ] && [ -f "$INPUTS_FILE" ]; then
  if [ "$(grep -v '^output-sha256=' "$INPUTS_FILE")" = "$INPUTS" ] &&
    [ "$(sed -n 's/^output-sha256=//p' "$INPUTS_FILE")" = "$(sha256sum "$OUT" | cut -d' ' -f1)" ]; then
    log "$OUT is up to date ($KERNEL_PKG $KERNEL_VER, $BUSYBOX_PKG $BUSYBOX_VER)"
    exit 0
  fi
  log "$OUT is out of date; rebuilding"
fi

fetch_deb "$KERNEL_PKG" "$KERNEL_VER"
fetch_deb "$BUSYBOX_PKG" "$BUSYBOX_VER"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/demo-image.XXXXXX")
cleanup() { rm -rf "$TMP"; }
trap cleanup EXIT

log "extracting $KERNEL_PKG $KERNEL_VER"
dpkg-deb -x "$(cached_deb "$KERNEL_PKG" "$KERNEL_VER")" "$TMP/kernel"
KREL=${KERNEL_PKG#linux-image-}
VMLINUZ="$TMP/kernel/boot/vmlinuz-$KREL"
MODDIR="$TMP/kernel/lib/modules/$KREL"
[ -f "$VMLINUZ" ] || die "$KERNEL_PKG has no boot/vmlinuz-$KREL"
[ -d "$MODDIR" ] || die "$KERNEL_PKG has no lib/modules/$KREL"
log "extracting $BUSYBOX_PKG $BUSYBOX_VER"
dpkg-deb -x "$(cached_deb "$BUSYBOX_PKG" "$BUSYBOX_VER")" "$TMP/busybox"
BUSYBOX="$TMP/busybox/bin/busybox"
[ -x "$BUSYBOX" ] || die "$BUSYBOX_PKG has no bin/busybox"

log "assembling initramfs (busybox, modules: ${MODULES[*]})"
INITRD_DIR="$TMP/initrd"
mkdir -p "$INITRD_DIR"/{bin,dev,etc,lib/modules,proc,sys,run,tmp}
cp "$BUSYBOX" "$INITRD_DIR/bin/busybox"
write_init "$INITRD_DIR/init"
write_udhcpc_script "$INITRD_DIR/etc/udhcpc.script"
chmod 0755 "$INITRD_DIR/init" "$INITRD_DIR/etc/udhcpc.script"
: >"$INITRD_DIR/lib/modules/load-order"
for m in "${MODULES[@]}"; do add_module "$m"; done
log "module load order: $(tr '\n' ' ' <"$INITRD_DIR/lib/modules/load-order")"
# The kernel opens /dev/console before /init runs; without the node it warns and
# /init gets no stdio until devtmpfs is mounted (it redirects then anyway).
mknod -m 0600 "$INITRD_DIR/dev/console" c 5 1 2>/dev/null || log "mknod /dev/console not permitted; /init opens it from devtmpfs"
(cd "$INITRD_DIR" && find . -mindepth 1 | LC_ALL=C sort | "$BUSYBOX" cpio -o -H newc -R 0:0 2>/dev/null) |
  gzip -9n >"$TMP/initrd.gz"
[ -s "$TMP/initrd.gz" ] || die "building the initramfs failed"

write_syslinux_cfg "$TMP/syslinux.cfg"
payload=$(($(stat -c %s "$VMLINUZ") + $(stat -c %s "$TMP/initrd.gz")))
size_mib=$(((payload + 1048575) / 1048576 + 2))
[ "$size_mib" -ge 8 ] || size_mib=8
log "making a ${size_mib} MiB FAT disk with SYSLINUX (kernel $KREL, initrd $(stat -c %s "$TMP/initrd.gz") bytes)"
RAW="$TMP/disk.raw"
truncate -s "${size_mib}M" "$RAW"
mkfs.vfat -n EGRESSDEMO -i 45475244 "$RAW" >/dev/null
export MTOOLS_SKIP_CHECK=1
syslinux --install "$RAW"
mcopy -i "$RAW" "$TMP/syslinux.cfg" ::syslinux.cfg
mcopy -i "$RAW" "$VMLINUZ" ::vmlinuz
mcopy -i "$RAW" "$TMP/initrd.gz" ::initrd.gz
mdir -i "$RAW" -a :: | grep -Eq '^ldlinux +sys ' || die "syslinux did not install ldlinux.sys"

log "converting to qcow2"
qemu-img convert -f raw -O qcow2 "$RAW" "$TMP/out.qcow2"
mkdir -p "$(dirname "$OUT")"
cp "$TMP/out.qcow2" "$OUT.tmp.$$"
mv -f "$OUT.tmp.$$" "$OUT"
printf '%s\noutput-sha256=%s\n' "$INPUTS" "$(sha256sum "$OUT" | cut -d' ' -f1)" >"$INPUTS_FILE"
log "wrote $OUT ($(stat -c %s "$OUT") bytes, virtual size ${size_mib} MiB; inputs in $INPUTS_FILE)"
