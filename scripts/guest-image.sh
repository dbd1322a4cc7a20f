#!/usr/bin/env bash
# guest-image.sh OUT.qcow2 -- builds the real Debian 12 guest that the proxy tests and the
# demo boot: cloud-init (NoCloud), qemu-guest-agent, tinyproxy, Debian's cloud kernel.
#
# What the guest is: Debian 12 (bookworm) debootstrapped with --variant=minbase, plus
#   linux-image-cloud-amd64  the kernel of Debian's genericcloud images: virtio drivers,
#                            NO AHCI/SATA (a seed ISO must be attached as a virtio disk)
#   cloud-init               datasource_list [ NoCloud, None ]: it reads a `cidata` seed
#                            and never waits on EC2/OpenStack metadata timeouts; network
#                            config is rendered for systemd-networkd (v2 static by MAC
#                            match, or DHCP when the seed has no network-config)
#   qemu-guest-agent         started by udev when the org.qemu.guest_agent.0 port appears
#   tinyproxy                installed but disabled: only vendor-data enables it, so a
#                            guest that never read its seed proxies nothing
#   nftables, cloud-guest-utils (growpart), iproute2, curl
# systemd-networkd-wait-online is bounded (--any --ipv4 --timeout=10), so an air-gapped boot
# without DHCP does not stall cloud-init for two minutes.
#
# Layout (legacy BIOS / SeaBIOS; built on plain files: no loop devices, no mounts):
#   MBR       SYSLINUX's mbr.bin boot code, DOS partition table (sfdisk)
#   part 1    FAT16, active, SYSLINUX (ldlinux.sys via `syslinux --install --offset`),
#             syslinux.cfg, vmlinuz, initrd.img; kernel command line
#             `root=UUID=... ro console=ttyS0,115200`
#   part 2    ext4 (label egress-root), made by `mkfs.ext4 -d ROOTFS -E offset=...`
#             straight into the disk file; last, so cloud-init's growpart can grow it
#             when the VM's overlay is larger than the image
# then converted to a compressed qcow2 whose virtual size is the smallest whole GiB
# that holds it (the operator refuses a machine type whose diskGib is smaller).
# SYSLINUX rather than GRUB: the demo image already boots with it, it installs into a
# FAT file with mtools (GRUB's BIOS core would need grub-mkimage, a core.img embedded
# behind the MBR and a grub.cfg that finds the root by UUID: more parts, same result).
#
# Packages come only from the Debian archive apt is configured with here (the URIs of
# the bookworm, bookworm-updates and bookworm-security entries in /etc/apt/sources*):
# debootstrap fetches the base from the bookworm mirror, then apt inside the chroot,
# reading the HOST's package indexes (copied in), upgrades it and installs the rest.
# So the versions installed are the host apt's candidates, which is what the stamp
# records. Every .deb is kept in ${GUEST_IMAGE_CACHE:-/var/cache/egress-guest}/debs,
# so a rebuild downloads only what changed. The inputs (this script's hash, the
# mirror, the candidate versions of the packages named here and of the build tools)
# and the output's sha256 are recorded in OUT.inputs; when they still match, the
# script does nothing. OUT.manifest lists every package in the image.
#
# Needs root (debootstrap, chroot). Concurrent runs take turns (flock on the cache). Mounts made by debootstrap and for the chroot
# (/proc) live in a private mount namespace (unshare), so they vanish with it on every
# exit path; the work directory is removed by an EXIT trap.
set -Eeuo pipefail

log() { printf 'guest-image: %s\n' "$*"; }
die() {
  printf 'guest-image: error: %s\n' "$*" >&2
  exit 1
}
on_err() {
  printf 'guest-image: error: command failed (exit %s) at line %s: %s\n' "$1" "$2" "$3" >&2
}
trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR

if [ $# -ne 1 ] || [ -z "$1" ]; then die "usage: $0 OUT.qcow2"; fi
OUT=$1
INPUTS_FILE="$OUT.inputs"
MANIFEST_FILE="$OUT.manifest"
CACHE=$(realpath -m "${GUEST_IMAGE_CACHE:-/var/cache/egress-guest}")
DEB_CACHE="$CACHE/debs"
SUITE=bookworm
# Build tools, installed with apt when dpkg says they are missing.
TOOL_PKGS=(debootstrap syslinux syslinux-common mtools dosfstools e2fsprogs fdisk qemu-utils)
# What apt installs into the minbase system (no Recommends). systemd-sysv, udev, kmod
# and dbus are not in minbase; initramfs-tools builds the initrd that loads virtio_blk.
GUEST_PKGS=(
  systemd-sysv udev kmod dbus initramfs-tools linux-image-cloud-amd64
  cloud-init cloud-guest-utils qemu-guest-agent tinyproxy nftables iproute2 curl
)
# Kernel command line. Only the serial console: a VGA console under TCG costs boot time.
CMDLINE_EXTRA="ro console=ttyS0,115200 net.ifnames=1"
# Root file system: free space kept beyond what the files use (the VM's overlay is
# usually larger and growpart takes the rest), and the largest image we accept.
ROOT_SLACK_MIB=192
MAX_DISK_GIB=2
BOOT_START_SECTOR=2048 # 1 MiB alignment
SYSLINUX_MBR=/usr/lib/syslinux/mbr/mbr.bin

[ "$(dpkg --print-architecture 2>/dev/null)" = amd64 ] || die "needs a Debian amd64 host (dpkg --print-architecture)"
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap and chroot)"

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
  log "apt-get update"
  apt-get update -qq || log "apt-get update reported errors (continuing)"
  APT_UPDATED=1
}

ensure_tools() {
  local missing
  mapfile -t missing < <(missing_pkgs "${TOOL_PKGS[@]}")
  [ ${#missing[@]} -eq 0 ] && return
  apt_update
  log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    die "apt-get install ${missing[*]} failed"
}

# ---------------------------------------------------------------- apt sources

# debian_sources: "URI SUITE" for every enabled `deb` entry with component main in
# apt's sources (deb822 .sources files and one-line .list files).
debian_sources() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '
      function flush(  n, m, i, j, u, s) {
        if (types ~ /(^| )deb( |$)/ && comps ~ /(^| )main( |$)/ && enabled != "no") {
          n = split(uris, u, " "); m = split(suites, s, " ")
          for (i = 1; i <= n; i++) for (j = 1; j <= m; j++) { sub(/\/$/, "", u[i]); print u[i], s[j] }
        }
        types = uris = suites = comps = enabled = ""
      }
      /^[ \t]*$/ { flush(); next }
      /^#/ || /^[ \t]/ { next }
      {
        key = tolower($1); sub(/:$/, "", key); val = $0; sub(/^[^:]*:[ \t]*/, "", val)
        if (key == "types") types = val; else if (key == "uris") uris = val
        else if (key == "suites") suites = val; else if (key == "components") comps = val
        else if (key == "enabled") enabled = tolower(val)
      }
      END { flush() }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk '/^[ \t]*deb[ \t]/ {
      line = $0; gsub(/\[[^]]*\]/, "", line); n = split(line, f, " ")
      for (i = 4; i <= n; i++) if (f[i] == "main") { sub(/\/$/, "", f[2]); print f[2], f[3]; break }
    }' "$f"
  done
}

# source_uri SUITE: the first configured URI serving SUITE, empty if none.
source_uri() { debian_sources | awk -v s="$1" '$2 == s { print $1; exit }'; }

# lists_prefix URI SUITE: apt's file name prefix for that suite's indexes in
# /var/lib/apt/lists (scheme dropped, slashes as underscores).
lists_prefix() {
  local u=${1#*://}
  printf '%s_dists_%s_' "${u//\//_}" "$2"
}

MIRROR=${GUEST_IMAGE_MIRROR:-$(source_uri "$SUITE")}
[ -n "$MIRROR" ] || die "no apt source serves '$SUITE' main (read /etc/apt/sources.list*); set GUEST_IMAGE_MIRROR"
UPDATES_URI=$(source_uri "$SUITE-updates")
SECURITY_URI=$(source_uri "$SUITE-security")

# ---------------------------------------------------------------- inputs

# candidates PKG...: "PKG VERSION" for each PKG apt has a candidate for on this host
# (one apt-cache call: each loads the whole cache, seconds apiece).
candidates() {
  apt-cache policy "$@" 2>/dev/null |
    awk '/^[^ ]/ { pkg = $1; sub(/:$/, "", pkg) } /^ +Candidate:/ && $2 != "(none)" { print pkg, $2 }'
}

# compute_inputs: the recipe, one line per input, into INPUTS.
compute_inputs() {
  local p v lines cands
  lines="script-sha256=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
suite=$SUITE mirror=$MIRROR updates=${UPDATES_URI:-none} security=${SECURITY_URI:-none}"
  cands=$(candidates "${GUEST_PKGS[@]}")
  for p in "${GUEST_PKGS[@]}"; do
    v=$(awk -v p="$p" '$1 == p { print $2; exit }' <<<"$cands")
    [ -n "$v" ] || return 1
    lines+=$'\n'"guest:$p=$v"
  done
  for p in debootstrap syslinux e2fsprogs dosfstools; do
    lines+=$'\n'"tool:$p=$(dpkg-query -W -f='${Version}' "$p")"
  done
  INPUTS=$lines
}

ensure_tools
# One build at a time per cache (make test and make demo may both ask for the image):
# the second waits, then finds the image up to date.
mkdir -p "$DEB_CACHE"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build holds $CACHE/.lock; waiting (up to 30 min)"
  flock -w 1800 9 || die "gave up waiting for $CACHE/.lock after 30 min"
fi
if ! compute_inputs; then
  apt_update
  compute_inputs || die "apt has no candidate for one of: ${GUEST_PKGS[*]}; check the Debian sources"
fi

if [ -f "$OUT" ] && [ -f "$INPUTS_FILE" ]; then
  if [ "$(grep -v '^output-sha256=' "$INPUTS_FILE")" = "$INPUTS" ] &&
    [ "$(sed -n 's/^output-sha256=//p' "$INPUTS_FILE")" = "$(sha256sum "$OUT" | cut -d' ' -f1)" ]; then
    log "$OUT is up to date ($(grep -E '^guest:(linux-image-cloud-amd64|cloud-init)=' <<<"$INPUTS" | sed 's/^guest://' | tr '\n' ' '))"
    exit 0
  fi
  log "$OUT is out of date; rebuilding"
fi

START=$SECONDS
TMP=$(mktemp -d "${TMPDIR:-/tmp}/guest-image.XXXXXX")
# --one-file-system: should a mount ever outlive its namespace, rm stops at it.
cleanup() { rm -rf --one-file-system "$TMP"; }
trap cleanup EXIT
ROOT="$TMP/root"

# ---------------------------------------------------------------- root file system

# in_chroot CMD...: runs CMD in the rootfs with a fresh /proc, in private mount and PID
# namespaces (nothing to unmount afterwards, no daemon survives it).
in_chroot() {
  unshare --mount --propagation private --pid --fork --mount-proc="$ROOT/proc" \
    chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive DEBCONF_NONINTERACTIVE_SEEN=true "$@"
}

log "debootstrap $SUITE (minbase) from $MIRROR (cache $DEB_CACHE)"
if ! unshare --mount --propagation private \
  debootstrap --variant=minbase --components=main --cache-dir="$DEB_CACHE" \
  "$SUITE" "$ROOT" "$MIRROR" >"$TMP/debootstrap.out" 2>&1; then
  tail -n 20 "$TMP/debootstrap.out" >&2
  [ -f "$ROOT/debootstrap/debootstrap.log" ] && tail -n 20 "$ROOT/debootstrap/debootstrap.log" >&2
  die "debootstrap $SUITE from $MIRROR failed (output above)"
fi

# Before any package is unpacked: no docs/man pages/translations, no Recommends, and
# no service started inside the chroot (policy-rc.d; removed again below).
cat >"$ROOT/etc/dpkg/dpkg.cfg.d/01-egress-nodoc" <<'EOF'
# egress guest image: keep the image small (copyright files stay).
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/usr/share/lintian/*
EOF
cat >"$ROOT/etc/apt/apt.conf.d/90-egress" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
chmod 0755 "$ROOT/usr/sbin/policy-rc.d"

# The chroot's apt uses the host's sources and package indexes, so it installs the
# candidates that compute_inputs recorded.
write_chroot_sources() {
  local key=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    printf 'deb [signed-by=%s] %s %s main\n' "$key" "$MIRROR" "$SUITE"
    [ -n "$UPDATES_URI" ] && printf 'deb [signed-by=%s] %s %s main\n' "$key" "$UPDATES_URI" "$SUITE-updates"
    [ -n "$SECURITY_URI" ] && printf 'deb [signed-by=%s] %s %s main\n' "$key" "$SECURITY_URI" "$SUITE-security"
    true
  } >"$ROOT/etc/apt/sources.list"
  rm -f "$ROOT"/var/lib/apt/lists/*_dists_* 2>/dev/null || true
  local uri suite prefix f n
  while read -r uri suite; do
    prefix=$(lists_prefix "$uri" "$suite")
    n=0
    for f in /var/lib/apt/lists/"$prefix"{InRelease,Release,Release.gpg,main_binary-amd64_Packages*}; do
      [ -f "$f" ] || continue
      cp "$f" "$ROOT/var/lib/apt/lists/"
      n=$((n + 1))
    done
    [ "$n" -ge 2 ] || { [ "$suite" = "$SUITE" ] && return 1; log "no host index for $suite (skipped)"; }
  done < <(printf '%s %s\n' "$MIRROR" "$SUITE"
    [ -n "$UPDATES_URI" ] && printf '%s %s\n' "$UPDATES_URI" "$SUITE-updates"
    [ -n "$SECURITY_URI" ] && printf '%s %s\n' "$SECURITY_URI" "$SUITE-security"
    true)
}

# install_guest_pkgs: upgrade the base and install GUEST_PKGS, .debs from the cache.
install_guest_pkgs() {
  local archives="$ROOT/var/cache/apt/archives"
  find "$DEB_CACHE" -maxdepth 1 -name '*.deb' -exec cp -l -n -t "$archives" {} + 2>/dev/null ||
    find "$DEB_CACHE" -maxdepth 1 -name '*.deb' -exec cp -n -t "$archives" {} +
  in_chroot apt-get -q -y -o Dpkg::Use-Pty=0 -o Dpkg::Options::=--force-confold upgrade &&
    in_chroot apt-get -q -y -o Dpkg::Use-Pty=0 -o Dpkg::Options::=--force-confold \
      install "${GUEST_PKGS[@]}"
  local rc=$?
  # Keep what was downloaded, even after a failure.
  find "$archives" -maxdepth 1 -name '*.deb' -exec cp -l -n -t "$DEB_CACHE" {} + 2>/dev/null ||
    find "$archives" -maxdepth 1 -name '*.deb' -exec cp -n -t "$DEB_CACHE" {} +
  return $rc
}

write_chroot_sources || {
  apt_update
  write_chroot_sources || die "the host has no package index for $SUITE from $MIRROR (apt-get update failed?)"
}
# fstab before the kernel: initramfs-tools copies fsck into the initrd only when the
# root entry asks for a check.
ROOT_UUID=$(cat /proc/sys/kernel/random/uuid)
cat >"$ROOT/etc/fstab" <<EOF
# <file system>  <mount point>  <type>  <options>  <dump>  <pass>
UUID=$ROOT_UUID  /  ext4  errors=remount-ro  0  1
EOF
# Initramfs: every block/virtio driver ("most"), so the cloud kernel finds its virtio root.
mkdir -p "$ROOT/etc/initramfs-tools/conf.d"
printf 'MODULES=most\n' >"$ROOT/etc/initramfs-tools/conf.d/egress.conf"

log "installing ${GUEST_PKGS[*]} in the chroot"
if ! install_guest_pkgs >"$TMP/apt.out" 2>&1; then
  # The host's index may name versions the mirror has dropped: refresh once and retry.
  if [ "$APT_UPDATED" -eq 0 ]; then
    log "apt in the chroot failed; refreshing the host's indexes and retrying"
    apt_update
    write_chroot_sources || die "the host has no package index for $SUITE from $MIRROR"
    install_guest_pkgs >"$TMP/apt.out" 2>&1 || {
      tail -n 30 "$TMP/apt.out" >&2
      die "apt-get install in the chroot failed (output above)"
    }
    compute_inputs || die "apt has no candidate for one of: ${GUEST_PKGS[*]}"
  else
    tail -n 30 "$TMP/apt.out" >&2
    die "apt-get install in the chroot failed (output above)"
  fi
fi

log "configuring the guest"
# cloud-init: the NoCloud seed only; networkd renders the network config (no ifupdown,
# no netplan in the image); no SSH host keys (no sshd in the image: an empty ssh_keys
# map makes cc_ssh generate none; `ssh_genkeytypes: []` fails the schema check); no
# grub-dpkg (SYSLINUX boots it; the module costs seconds under TCG); a locale that
# needs no locale-gen at boot.
cat >"$ROOT/etc/cloud/cloud.cfg.d/90-egress-guest.cfg" <<'EOF'
# egress guest image (scripts/guest-image.sh)
# NoCloud only: a seed ISO labelled cidata. None keeps cloud-init's modules running
# (no vendor-data, so no proxy) when there is no seed; nothing waits on a metadata URL.
datasource_list: [ NoCloud, None ]
system_info:
  network:
    renderers: [ networkd ]
locale: C.UTF-8
ssh_keys: {}
grub_dpkg:
  enabled: false
EOF
printf 'LANG=C.UTF-8\n' >"$ROOT/etc/default/locale"
# Air-gapped boots must not stall: wait-online returns once any link is configured
# with an IPv4 address (DHCP: when the lease arrives), or after 10s. A static-only
# network-config always takes the 10s: networkd keeps the link "configuring" while
# IPv6 router discovery waits for a router that an isolated bridge never has, and
# cloud-init 22.4's networkd renderer writes `accept-ra: false` only for DHCPv6 links.
mkdir -p "$ROOT/etc/systemd/system/systemd-networkd-wait-online.service.d"
cat >"$ROOT/etc/systemd/system/systemd-networkd-wait-online.service.d/egress-bounded.conf" <<'EOF'
# egress guest image: tests run air-gapped; do not hold boot for the default 120s.
[Service]
ExecStart=
ExecStart=/lib/systemd/systemd-networkd-wait-online --any --ipv4 --timeout=10
EOF
in_chroot systemctl enable systemd-networkd.service >/dev/null 2>&1 || die "systemctl enable systemd-networkd failed"
# tinyproxy stays off until vendor-data turns it on.
in_chroot systemctl disable tinyproxy.service >/dev/null 2>&1 || die "systemctl disable tinyproxy failed"
[ "$(in_chroot systemctl is-enabled tinyproxy.service 2>/dev/null || true)" = disabled ] ||
  die "tinyproxy.service is still enabled in the image"
# No background work that competes with cloud-init under TCG (e2scrub_reap alone takes
# ~20s of the one vCPU at first boot), no apt on timers.
for t in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer; do
  if [ -e "$ROOT/lib/systemd/system/$t" ]; then in_chroot systemctl mask "$t" >/dev/null 2>&1; fi
done

printf 'debian\n' >"$ROOT/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tdebian\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$ROOT/etc/hosts"

in_chroot dpkg-query -W -f='${Package} ${Version}\n' >"$TMP/manifest"

# Leave nothing behind that belongs to this build or to one machine.
rm -f "$ROOT/usr/sbin/policy-rc.d"
in_chroot apt-get clean
rm -rf "${ROOT:?}"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/debconf/*-old \
  "$ROOT"/var/lib/dpkg/*-old "$ROOT"/var/log/apt/* "$ROOT"/var/log/bootstrap.log "$ROOT"/debootstrap \
  "$ROOT"/var/lib/cloud/* "$ROOT"/tmp/* "$ROOT"/var/tmp/*
mkdir -p "$ROOT/var/lib/apt/lists/partial"
# Empty machine-id: systemd makes a new one on first boot (each VM its own).
: >"$ROOT/etc/machine-id"
rm -f "$ROOT/var/lib/dbus/machine-id"

# ---------------------------------------------------------------- disk

mapfile -t kernels < <(find "$ROOT/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V)
[ ${#kernels[@]} -eq 1 ] || die "expected one kernel in /boot, found ${#kernels[@]}"
VMLINUZ=${kernels[0]}
KREL=${VMLINUZ##*/vmlinuz-}
INITRD="$ROOT/boot/initrd.img-$KREL"
[ -s "$INITRD" ] || die "no initrd for $KREL (update-initramfs failed in the chroot?)"
case "$KREL" in *-cloud-amd64) ;; *) die "kernel $KREL is not Debian's cloud kernel" ;; esac

MIB=1048576
boot_mib=$((($(stat -c %s "$VMLINUZ") + $(stat -c %s "$INITRD") + MIB - 1) / MIB + 8))
[ "$boot_mib" -ge 32 ] || boot_mib=32
used_mib=$(du -s -B1M --one-file-system "$ROOT" | cut -f1)
# ext4 metadata (inode tables, journal) costs about a tenth on a small file system.
min_root_mib=$((used_mib * 11 / 10 + ROOT_SLACK_MIB))
start_mib=$((BOOT_START_SECTOR / 2048))
disk_gib=$(((start_mib + boot_mib + min_root_mib + 1023) / 1024))
[ "$disk_gib" -le "$MAX_DISK_GIB" ] || die "the image needs ${disk_gib} GiB (rootfs ${used_mib} MiB), more than $MAX_DISK_GIB"
root_start_sector=$(((start_mib + boot_mib) * 2048))
root_sectors=$((disk_gib * 1024 * 2048 - root_start_sector))
log "making a ${disk_gib} GiB disk: boot ${boot_mib} MiB (FAT, SYSLINUX), root $((root_sectors / 2048)) MiB (ext4, ${used_mib} MiB used; kernel $KREL)"

RAW="$TMP/disk.raw"
truncate -s "${disk_gib}G" "$RAW"
sfdisk --quiet "$RAW" <<EOF
label: dos
unit: sectors
start=$BOOT_START_SECTOR, size=$((boot_mib * 2048)), type=6, bootable
start=$root_start_sector, size=$root_sectors, type=83
EOF
[ -f "$SYSLINUX_MBR" ] || die "$SYSLINUX_MBR missing (package syslinux-common)"
dd if="$SYSLINUX_MBR" of="$RAW" bs=440 count=1 conv=notrunc status=none

cat >"$TMP/syslinux.cfg" <<EOF
SERIAL 0 115200
DEFAULT debian
PROMPT 0
TIMEOUT 0
LABEL debian
  KERNEL vmlinuz
  INITRD initrd.img
  APPEND root=UUID=$ROOT_UUID $CMDLINE_EXTRA
EOF
# Hidden sectors = the partition's start: SYSLINUX's boot sector adds them to find
# ldlinux.sys on the whole disk.
# (mkfs.vfat warns that the file is larger than the file system it was asked for.)
mkfs.vfat -F 16 -n EGRESSBOOT -i 45475245 -h "$BOOT_START_SECTOR" --offset="$BOOT_START_SECTOR" \
  "$RAW" $((boot_mib * 1024)) >"$TMP/mkfs.vfat.out" 2>&1 || {
  cat "$TMP/mkfs.vfat.out" >&2
  die "mkfs.vfat of the boot partition failed"
}
export MTOOLS_SKIP_CHECK=1
boot_fs="$RAW@@$((BOOT_START_SECTOR * 512))"
syslinux --install --offset $((BOOT_START_SECTOR * 512)) "$RAW" || die "syslinux --install failed"
mcopy -i "$boot_fs" "$TMP/syslinux.cfg" ::syslinux.cfg
mcopy -i "$boot_fs" "$VMLINUZ" ::vmlinuz
mcopy -i "$boot_fs" "$INITRD" ::initrd.img
mdir -i "$boot_fs" -a :: | grep -Eq '^ldlinux +sys ' || die "syslinux did not install ldlinux.sys"

mkfs.ext4 -q -F -L egress-root -U "$ROOT_UUID" -m 1 -d "$ROOT" \
  -E offset=$((root_start_sector * 512)) "$RAW" "$((root_sectors / 2))k" ||
  die "mkfs.ext4 -d of the root file system failed"

log "converting to a compressed qcow2"
qemu-img convert -c -f raw -O qcow2 "$RAW" "$TMP/out.qcow2"
mkdir -p "$(dirname "$OUT")"
cp "$TMP/out.qcow2" "$OUT.tmp.$$"
mv -f "$OUT.tmp.$$" "$OUT"
cp "$TMP/manifest" "$MANIFEST_FILE"
printf '%s\noutput-sha256=%s\n' "$INPUTS" "$(sha256sum "$OUT" | cut -d' ' -f1)" >"$INPUTS_FILE"
log "wrote $OUT ($(stat -c %s "$OUT") bytes, virtual size ${disk_gib} GiB, kernel $KREL, $(wc -l <"$MANIFEST_FILE") packages) in $((SECONDS - START))s; inputs in $INPUTS_FILE"
