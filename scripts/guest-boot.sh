#!/usr/bin/env bash
# guest-boot.sh -- boots a guest image (scripts/guest-image.sh) under QEMU the way the
# operator's hosts run it, waits until cloud-init is done, and leaves it running for
# inspection through its guest agent. A developer tool, and the proof that the image
# boots, reads its NoCloud seed and answers on the guest agent.
#
# Usage:
#   guest-boot.sh [OPTIONS] IMAGE SEED_DIR LOG   boot; wait for cloud-init; leave running
#   guest-boot.sh --stop NAME                    kill QEMU (and dnsmasq), delete netns + state
#   guest-boot.sh --qga NAME REQUEST             one guest-agent request; prints the reply
#                                                (REQUEST: JSON, or a bare command name
#                                                such as guest-ping)
#   guest-boot.sh --exec NAME CMD [ARG...]       runs CMD in the guest (guest-exec); prints
#                                                its stdout/stderr, exits with its status
#   guest-boot.sh --list                         the VMs this tool runs
# Options for a boot:
#   --name NAME     short name ([a-z0-9-], at most 12; default gb<PID>)
#   --dhcp          run a dnsmasq on the bridge (range 10.203.0.100-200, no DNS)
#   --mac MAC       the NIC's MAC (default 52:54:00 + 3 bytes derived from NAME)
#   --memory MIB    guest memory (default 512)   --cpus N   vCPUs (default 1)
#   --accel A       tcg, kvm or auto (default auto: kvm only if a probe VM starts)
#   --disk-gib N    the overlay's virtual size (default: the image's; growpart fills it)
#   --timeout S     how long to wait for cloud-init (default 900)
#   --keep          leave the VM running even when the wait fails (for debugging)
#   --seed-bus B    virtio (default) or sata: a SATA CD-ROM, which Debian's cloud kernel
#                   cannot see (no AHCI driver); shows what a guest without its seed does
# Exit status: 0 booted and read the seed (or SEED_DIR is none); 3 booted and left
# running, but cloud-init found no seed although one was attached; 1 failed.
#
# SEED_DIR holds meta-data (required), user-data (default: an empty #cloud-config),
# vendor-data and network-config (optional). They become a NoCloud ISO (label
# cidata) attached as a second VIRTIO disk: Debian's cloud kernel has no AHCI driver.
# SEED_DIR `none` attaches no seed: cloud-init then ends with DataSourceNone (what a
# guest that cannot see its seed does; it must not proxy anything).
#
# Network: one virtio NIC on a tap in a bridge br0 (10.203.0.1/24) inside a fresh
# network namespace egb-NAME. Nothing routes out of it: no uplink, no NAT, no
# forwarding. Reach the guest with `ip netns exec egb-NAME ...`.
#
# The base image is never written: the VM runs on a qcow2 overlay in the state
# directory ${GUEST_BOOT_STATE_DIR:-/run/egress-guest-boot}/NAME, which also holds the
# guest agent socket (qga.sock), a QMP socket, PID files and info.env (shell
# variables describing the VM, for scripts). Needs root (netns, tap).
set -Eeuo pipefail

log() { printf 'guest-boot: %s\n' "$*"; }
die() {
  printf 'guest-boot: error: %s\n' "$*" >&2
  exit 1
}
on_err() {
  printf 'guest-boot: error: command failed (exit %s) at line %s: %s\n' "$1" "$2" "$3" >&2
}
trap 'on_err $? $LINENO "$BASH_COMMAND"' ERR

STATE_ROOT=${GUEST_BOOT_STATE_DIR:-/run/egress-guest-boot}
BRIDGE=br0
TAP=tap0
BRIDGE_ADDR=10.203.0.1/24
DHCP_RANGE=10.203.0.100,10.203.0.200,255.255.255.0,1h
# Never a pyenv shim or a virtualenv: the agent client uses only the standard library.
PYTHON=/usr/bin/python3
# How long one guest-agent request may take (the agent answers in milliseconds once up).
QGA_TIMEOUT=${GUEST_BOOT_QGA_TIMEOUT:-20}
# The line cloud-init's final stage prints on the console when it is done.
DONE_RE='Cloud-init v\. [0-9.]+ finished at'

valid_name() { [[ $1 =~ ^[a-z0-9][a-z0-9-]{0,11}$ ]]; }
netns_of() { printf 'egb-%s' "$1"; }
netns_exists() { ip netns list 2>/dev/null | awk -v n="$1" '$1 == n { f = 1 } END { exit !f }'; }

# pid_is PIDFILE PATTERN: prints the PID in PIDFILE if that process still runs and
# its command line contains PATTERN (so a recycled PID is never signalled).
pid_is() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(tr -dc 0-9 <"$1")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2" || return 1
  printf '%s\n' "$pid"
}

# stop_pid PID: TERM, then KILL after 10s.
stop_pid() {
  local pid=$1 _
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}

# teardown NAME: everything a boot made, whatever state it reached.
teardown() {
  local name=$1 state="$STATE_ROOT/$1" ns pid
  ns=$(netns_of "$name")
  if pid=$(pid_is "$state/qemu.pid" "$state/"); then stop_pid "$pid"; fi
  if pid=$(pid_is "$state/dnsmasq.pid" "$state/"); then stop_pid "$pid"; fi
  if netns_exists "$ns"; then
    # Anything else still inside the namespace was started in it by this tool.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do stop_pid "$pid"; done
    ip netns del "$ns" || log "could not delete netns $ns"
  fi
  rm -rf --one-file-system "$state"
}

qga() { "$PYTHON" - "$@" <<'PY'; }
# Guest agent client: qga.py SOCKET TIMEOUT (request JSON | exec CMD ARG...)
import base64, json, random, socket, sys, time

sock_path, timeout, rest = sys.argv[1], float(sys.argv[2]), sys.argv[3:]


def fail(msg):
    print(f"guest-boot: error: {msg}", file=sys.stderr)
    sys.exit(2)


try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(sock_path)
    f = s.makefile("rb")
except OSError as e:
    fail(f"cannot connect to the guest agent socket {sock_path}: {e}")


def send(obj):
    s.sendall(json.dumps(obj).encode() + b"\n")


def reply():
    line = f.readline()
    if not line:
        fail("the guest agent closed the connection")
    msg = json.loads(line)
    if "error" in msg:
        fail(f"guest agent error: {msg['error'].get('desc', msg['error'])}")
    return msg.get("return")


def sync():
    # guest-sync-delimited: the agent answers with 0xFF before the reply, so stale output
    # of an earlier client is skipped; the leading 0xFF resets the agent's parser.
    want = random.randint(1, 2**31 - 1)
    s.sendall(b"\xff")
    send({"execute": "guest-sync-delimited", "arguments": {"id": want}})
    while True:
        b = f.read(1)
        if not b:
            fail("the guest agent closed the connection during sync")
        if b == b"\xff":
            got = reply()
            if got == want:
                return


try:
    sync()
    if rest[0] == "exec":
        send({"execute": "guest-exec",
              "arguments": {"path": rest[1], "arg": rest[2:], "capture-output": True}})
        pid = reply()["pid"]
        deadline = time.monotonic() + 300
        while True:
            send({"execute": "guest-exec-status", "arguments": {"pid": pid}})
            st = reply()
            if st.get("exited"):
                break
            if time.monotonic() > deadline:
                fail(f"guest-exec {rest[1]} still running after 300s")
            time.sleep(0.2)
        sys.stdout.buffer.write(base64.b64decode(st.get("out-data", "")))
        sys.stderr.buffer.write(base64.b64decode(st.get("err-data", "")))
        sys.exit(st.get("exitcode", 1 if st.get("signal") else 0))
    req = rest[0]
    obj = json.loads(req) if req.lstrip().startswith("{") else {"execute": req}
    send(obj)
    print(json.dumps({"return": reply()}))
except socket.timeout:
    fail(f"the guest agent did not answer within {timeout:g}s")
PY

# ---------------------------------------------------------------- subcommands

state_of() {
  valid_name "$1" || die "bad NAME '$1' ([a-z0-9-], at most 12)"
  [ -d "$STATE_ROOT/$1" ] || die "no VM named $1 (see --list)"
}

case "${1:-}" in
--stop)
  [ $# -eq 2 ] || die "usage: $0 --stop NAME"
  valid_name "$2" || die "bad NAME '$2'"
  teardown "$2"
  log "stopped $2 (netns $(netns_of "$2") deleted)"
  exit 0
  ;;
--qga)
  [ $# -eq 3 ] || die "usage: $0 --qga NAME REQUEST"
  state_of "$2"
  # The reply's status is the result: no ERR trace for it.
  trap - ERR
  set +e
  qga "$STATE_ROOT/$2/qga.sock" "$QGA_TIMEOUT" "$3"
  exit
  ;;
--exec)
  [ $# -ge 3 ] || die "usage: $0 --exec NAME CMD [ARG...]"
  state_of "$2"
  sock="$STATE_ROOT/$2/qga.sock"
  shift 2
  trap - ERR
  set +e
  qga "$sock" "$QGA_TIMEOUT" exec "$@"
  exit
  ;;
--list)
  for d in "$STATE_ROOT"/*/; do
    [ -d "$d" ] || continue
    n=$(basename "$d")
    if pid=$(pid_is "$d/qemu.pid" "$d"); then echo "$n running pid=$pid netns=$(netns_of "$n")"; else echo "$n not running (--stop $n cleans up)"; fi
  done
  exit 0
  ;;
esac

# ---------------------------------------------------------------- boot

NAME="gb$$"
DHCP=0
MAC=""
MEMORY=512
CPUS=1
ACCEL=auto
DISK_GIB=""
TIMEOUT=900
KEEP=0
SEED_BUS=virtio
while [ $# -gt 0 ]; do
  case "$1" in
  --name) NAME=${2:?--name needs a value}; shift 2 ;;
  --dhcp) DHCP=1; shift ;;
  --mac) MAC=${2:?--mac needs a value}; shift 2 ;;
  --memory) MEMORY=${2:?--memory needs a value}; shift 2 ;;
  --cpus) CPUS=${2:?--cpus needs a value}; shift 2 ;;
  --accel) ACCEL=${2:?--accel needs a value}; shift 2 ;;
  --disk-gib) DISK_GIB=${2:?--disk-gib needs a value}; shift 2 ;;
  --timeout) TIMEOUT=${2:?--timeout needs a value}; shift 2 ;;
  --keep) KEEP=1; shift ;;
  --seed-bus) SEED_BUS=${2:?--seed-bus needs a value}; shift 2 ;;
  --) shift; break ;;
  -*) die "unknown option $1 (see the header of $0)" ;;
  *) break ;;
  esac
done
[ $# -eq 3 ] || die "usage: $0 [OPTIONS] IMAGE SEED_DIR LOG | --stop NAME | --qga NAME REQ | --exec NAME CMD... | --list"
IMAGE=$(realpath -e "$1") || die "image $1 not found"
SEED_DIR=$2
LOG=$(realpath -m "$3")
valid_name "$NAME" || die "bad --name '$NAME' ([a-z0-9-], at most 12)"
[[ $MEMORY =~ ^[0-9]+$ && $CPUS =~ ^[0-9]+$ && $TIMEOUT =~ ^[0-9]+$ ]] || die "--memory, --cpus and --timeout take numbers"
[ -z "$DISK_GIB" ] || [[ $DISK_GIB =~ ^[0-9]+$ ]] || die "--disk-gib takes a number"
case "$ACCEL" in tcg | kvm | auto) ;; *) die "--accel is tcg, kvm or auto" ;; esac
case "$SEED_BUS" in virtio | sata) ;; *) die "--seed-bus is virtio or sata" ;; esac
[ "$SEED_DIR" = none ] || [ -f "$SEED_DIR/meta-data" ] || die "$SEED_DIR/meta-data missing (NoCloud needs it: instance-id, local-hostname)"
[ "$(id -u)" -eq 0 ] || die "needs root (network namespace, tap device)"
for t in qemu-system-x86_64 qemu-img ip; do command -v "$t" >/dev/null || die "$t not found (packages qemu-system-x86, qemu-utils, iproute2)"; done
[ -x "$PYTHON" ] || die "$PYTHON not found (package python3)"
if command -v genisoimage >/dev/null; then MKISO=(genisoimage); elif command -v xorriso >/dev/null; then MKISO=(xorriso -as mkisofs); else die "genisoimage or xorriso needed to make the seed ISO"; fi
[ "$DHCP" -eq 0 ] || command -v dnsmasq >/dev/null || die "--dhcp needs dnsmasq (package dnsmasq-base)"

STATE="$STATE_ROOT/$NAME"
NS=$(netns_of "$NAME")
[ ! -e "$STATE" ] || die "$NAME already exists ($STATE); run $0 --stop $NAME first"
netns_exists "$NS" && die "netns $NS already exists; run $0 --stop $NAME first"
if [ -z "$MAC" ]; then
  MAC=52:54:00:$(printf '%s' "$NAME" | sha256sum | sed 's/^\(..\)\(..\)\(..\).*/\1:\2:\3/')
fi
[[ $MAC =~ ^([0-9a-f]{2}:){5}[0-9a-f]{2}$ ]] || die "bad MAC '$MAC' (lower-case aa:bb:cc:dd:ee:ff)"

BOOTED=0
on_exit() {
  local rc=$?
  if [ "$BOOTED" -eq 0 ]; then
    if [ "$KEEP" -eq 1 ] && [ -d "$STATE" ]; then
      log "boot failed; --keep: $NAME left as is (stop it with $0 --stop $NAME)"
    else
      teardown "$NAME"
    fi
  fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM
mkdir -p "$STATE"

# Seed ISO: NoCloud reads a file system labelled cidata.
SEED_ARGS=()
if [ "$SEED_DIR" = none ]; then
  log "seed: none (no seed disk)"
else
  mkdir "$STATE/seed"
  for f in meta-data user-data vendor-data network-config; do
    if [ -f "$SEED_DIR/$f" ]; then cp "$SEED_DIR/$f" "$STATE/seed/$f"; fi
  done
  [ -f "$STATE/seed/user-data" ] || printf '#cloud-config\n{}\n' >"$STATE/seed/user-data"
  "${MKISO[@]}" -quiet -output "$STATE/seed.iso" -volid cidata -joliet -rock "$STATE/seed" >"$STATE/mkiso.out" 2>&1 || {
    cat "$STATE/mkiso.out" >&2
    die "making the seed ISO failed"
  }
  if [ "$SEED_BUS" = virtio ]; then
    SEED_ARGS=(-drive "if=none,id=seed,file=$STATE/seed.iso,format=raw,readonly=on" -device "virtio-blk-pci,drive=seed")
  else
    # q35's built-in AHCI controller (buses ide.0 to ide.5).
    SEED_ARGS=(-drive "if=none,id=seed,file=$STATE/seed.iso,format=raw,readonly=on,media=cdrom" -device "ide-cd,drive=seed,bus=ide.0")
  fi
  log "seed: $(cd "$STATE/seed" && echo *) (NoCloud ISO on $SEED_BUS)"
fi

qemu-img create -q -f qcow2 -F qcow2 -b "$IMAGE" "$STATE/overlay.qcow2" ${DISK_GIB:+"${DISK_GIB}G"} ||
  die "qemu-img create of the overlay failed"

ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" link add "$BRIDGE" type bridge
ip -n "$NS" addr add "$BRIDGE_ADDR" dev "$BRIDGE"
ip -n "$NS" link set "$BRIDGE" up
ip -n "$NS" tuntap add dev "$TAP" mode tap
ip -n "$NS" link set "$TAP" master "$BRIDGE" up
if [ "$DHCP" -eq 1 ]; then
  ip netns exec "$NS" dnsmasq --conf-file=/dev/null --port=0 --user=root \
    --interface="$BRIDGE" --bind-interfaces --dhcp-authoritative --dhcp-range="$DHCP_RANGE" \
    --dhcp-leasefile="$STATE/leases" --pid-file="$STATE/dnsmasq.pid" \
    --log-dhcp --log-facility="$STATE/dnsmasq.log" || die "dnsmasq in $NS failed to start"
  log "dnsmasq on $BRIDGE in $NS (range ${DHCP_RANGE%,*,*}; leases in $STATE/leases)"
fi

# KVM only when it really runs a vCPU: on some nested hosts /dev/kvm opens but QEMU
# aborts while setting MSRs.
if [ "$ACCEL" = auto ]; then
  ACCEL=tcg
  if [ -w /dev/kvm ]; then
    # Still running when timeout stops it (124): KVM works. The subshell keeps bash's
    # "Aborted" report of a crashed probe out of the output.
    probe_rc=0
    (timeout 4 qemu-system-x86_64 -accel kvm -cpu host -machine q35 -nodefaults -display none \
      -monitor none -serial none -m 64; exit $?) >"$STATE/kvm-probe.out" 2>&1 || probe_rc=$?
    if [ "$probe_rc" -eq 124 ]; then ACCEL=kvm; else log "KVM probe failed (exit $probe_rc; $STATE/kvm-probe.out); using TCG"; fi
  fi
fi
if [ "$ACCEL" = kvm ]; then CPU=(-cpu host); else CPU=(-cpu max); fi
log "accelerator: $ACCEL$([ "$ACCEL" = tcg ] && echo ' (software emulation)')"

: >"$LOG"
ip netns exec "$NS" qemu-system-x86_64 -name "guest=$NAME" -machine q35 -accel "$ACCEL" "${CPU[@]}" \
  -m "$MEMORY" -smp "$CPUS" -nodefaults -no-user-config -display none \
  -chardev "file,id=ser0,path=$LOG" -serial chardev:ser0 \
  -chardev "socket,id=qga0,path=$STATE/qga.sock,server=on,wait=off" \
  -device virtio-serial-pci,id=vser0 \
  -device virtserialport,bus=vser0.0,chardev=qga0,name=org.qemu.guest_agent.0 \
  -qmp "unix:$STATE/qmp.sock,server=on,wait=off" \
  -drive "if=none,id=root,file=$STATE/overlay.qcow2,format=qcow2" \
  -device virtio-blk-pci,drive=root,bootindex=0 \
  "${SEED_ARGS[@]}" \
  -netdev "tap,id=net0,ifname=$TAP,script=no,downscript=no" \
  -device "virtio-net-pci,netdev=net0,mac=$MAC" \
  -device virtio-rng-pci \
  -daemonize -pidfile "$STATE/qemu.pid" 2>"$STATE/qemu.err" || {
  cat "$STATE/qemu.err" >&2
  die "QEMU failed to start"
}
QEMU_PID=$(pid_is "$STATE/qemu.pid" "$STATE/") || die "QEMU exited at once: $(cat "$STATE/qemu.err")"
log "QEMU pid $QEMU_PID; serial console -> $LOG; waiting up to ${TIMEOUT}s for cloud-init"

start=$SECONDS
last_report=$start
while :; do
  if grep -aEq "$DONE_RE" "$LOG"; then break; fi
  pid_is "$STATE/qemu.pid" "$STATE/" >/dev/null || {
    tail -n 20 "$LOG" >&2
    die "QEMU exited before cloud-init finished ($(cat "$STATE/qemu.err"))"
  }
  if grep -aq 'Kernel panic' "$LOG"; then
    grep -a -A5 'Kernel panic' "$LOG" >&2
    die "the guest kernel panicked"
  fi
  if [ $((SECONDS - start)) -ge "$TIMEOUT" ]; then
    tail -n 20 "$LOG" >&2
    die "cloud-init did not finish within ${TIMEOUT}s (console: $LOG)"
  fi
  if [ $((SECONDS - last_report)) -ge 30 ]; then
    stage=$(grep -aoE "Cloud-init v\. [0-9.]+ running '[a-z:-]+'" "$LOG" | tail -n1 | sed "s/.*running //" || true)
    log "  ... $((SECONDS - start))s${stage:+, cloud-init stage $stage}"
    last_report=$SECONDS
  fi
  sleep 1
done
elapsed=$((SECONDS - start))
final=$(grep -aE "$DONE_RE" "$LOG" | tail -n1 | tr -d '\r')
uptime=$(sed -n 's/.*Up \([0-9.]*\) seconds.*/\1/p' <<<"$final")
datasource=$(sed -n 's/.*Datasource \(.*\)\.  Up.*/\1/p' <<<"$final")
log "cloud-init done after ${elapsed}s (guest uptime ${uptime:-?}s, accel $ACCEL); datasource: ${datasource:-?}"
NO_SEED=0
if grep -aqE "$DONE_RE.*DataSourceNone" "$LOG"; then
  if [ "$SEED_DIR" = none ]; then log "cloud-init found no seed, as expected (DataSourceNone)"; else NO_SEED=1; fi
fi

ping_out=$(qga "$STATE/qga.sock" "$QGA_TIMEOUT" guest-ping 2>&1) || die "the guest agent does not answer: $ping_out"

cat >"$STATE/info.env" <<EOF
GUEST_NAME=$NAME
GUEST_NETNS=$NS
GUEST_BRIDGE=$BRIDGE
GUEST_BRIDGE_ADDR=$BRIDGE_ADDR
GUEST_MAC=$MAC
GUEST_QEMU_PID=$QEMU_PID
GUEST_QGA_SOCKET=$STATE/qga.sock
GUEST_QMP_SOCKET=$STATE/qmp.sock
GUEST_CONSOLE_LOG=$LOG
GUEST_ACCEL=$ACCEL
GUEST_BOOT_SECONDS=$elapsed
GUEST_UPTIME_AT_DONE=${uptime:-}
EOF
BOOTED=1
log "running: name $NAME, netns $NS (bridge $BRIDGE $BRIDGE_ADDR), MAC $MAC, QEMU pid $QEMU_PID"
log "guest agent: $STATE/qga.sock (answers guest-ping)"
log "  $0 --qga $NAME guest-network-get-interfaces"
log "  $0 --exec $NAME ip -4 addr"
log "  ip netns exec $NS curl ..."
log "variables: $STATE/info.env"
log "stop: $0 --stop $NAME"
if [ "$NO_SEED" -eq 1 ]; then
  printf 'guest-boot: error: cloud-init found no seed (DataSourceNone) although one was attached on %s; the VM is left running\n' "$SEED_BUS" >&2
  exit 3
fi
