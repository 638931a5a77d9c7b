#!/usr/bin/env bash
# An aarch64 "Pi" on this x86 machine: a Debian bookworm arm64 root file system (debootstrap +
# qemu-user-static through binfmt_misc), and inside it what a Raspberry Pi OS user runs, as user `pi`:
# a clone of this repository, ./lab.sh setup with pip's MPICH and again with the system MPI
# (PILAB_SYSTEM_MPI=1, Debian's packages), then pilab --help, a 3-step `train --np 2`, a `simulate --np 8`
# step and `doctor` on localhost, all with small settings (emulation runs a step in minutes). Emulation is
# slow (hours the first time); run it in the background and read the log:
#
#   sudo setsid nohup nice -n 10 scripts/arm64_node.sh > /var/lib/pilab-arm64.out 2>&1 &
#   scripts/arm64_node.sh --help
#
# The root lives OUTSIDE any git tree (default /var/lib/pilab-arm64/root) and is reused once finished;
# the clone inside it is refreshed to this checkout's HEAD (commit first what you want tested). Root
# chroots into it and mounts inside it, so it must be root's: the script refuses a location that another
# account owns or could write (every directory above it too: a world-writable one only with the sticky
# bit), and runs git as the owner of the tree git works in (the clone inside: user pi), never as root in
# another account's tree, where that tree's git config and hooks would run as root. Bind
# mounts (/proc, /sys, /dev, /dev/pts) are always unmounted on exit, also on failure or Ctrl-C.
# Every step is timed; the summary at the end of the log is what docs/arm64.md records.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/arm64_node.sh [--root DIR] [--log FILE] [--only STEPS] [--mirror URL] [--np-sim N]
                             [--host-cpuinfo] [--torch SPEC] [--testbed NAME --subnet CIDR [--head-python PY]]
                             [--help]

Build (or reuse) a Debian bookworm arm64 root with debootstrap + qemu-user-static and run pilab in it
as a Raspberry Pi OS user would. Run as root.

  --root DIR     where the arm64 root goes (default /var/lib/pilab-arm64/root); must be outside any
                 git work tree, and it and every directory above it root's, writable by root alone
  --log FILE     the log (default DIR/../arm64_node-<UTC time>.log); the summary is at its end
  --only STEPS   comma-separated subset of: pip,system (default pip,system: both ways of ./lab.sh setup);
                 none: only the root (and --testbed, which uses the pip way's venv)
  --mirror URL   Debian mirror for debootstrap (default http://deb.debian.org/debian)
  --np-sim N     virtual ranks of the simulate step (default 8)
  --host-cpuinfo  leave the host's (x86) /proc/cpuinfo visible inside; by default a Raspberry Pi 4B's
                 (Cortex-A72, one entry per host core) is bound over it: qemu-user 7.2 passes the host's
                 through, and torch's cpuinfo library segfaults parsing it (`import torch` dies)
  --torch SPEC   the torch ./lab.sh installs (its PILAB_TORCH), e.g. torch==2.8.0: a CPU-only
                 aarch64 build on PyPI (102 MB), where the default torch==2.13.0 from PyPI is a CUDA build
                 (5 GB with its nvidia-* libraries) while PyTorch's CPU index is out of reach
  --testbed NAME  afterwards, a 2-node testbed NAME (pilab/testbed/) whose node02 runs its processes
                 inside the arm64 root, and a synchronous 3-step `train` over x86 node01 + arm64 node02
                 (pip's MPICH on both); the testbed is taken down on exit
  --subnet CIDR  the testbed's private range (required with --testbed, e.g. 10.77.0.0/24)
  --head-python PY  the x86 Python with pilab's stack for node01 and mpiexec (default: the repo's
                 .venv/bin/python)
  -h, --help     this text
EOF
}

root=/var/lib/pilab-arm64/root
log=""
only=pip,system
mirror=http://deb.debian.org/debian
np_sim=8
tb_name=""
subnet=""
head_python=""
host_cpuinfo=0
torch=""
die() { echo "arm64_node.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --root) [ $# -ge 2 ] || die "--root needs a directory, e.g. --root /var/lib/pilab-arm64/root"
                root=$2; shift 2 ;;
        --log) [ $# -ge 2 ] || die "--log needs a file name, e.g. --log /var/lib/pilab-arm64/run.log"; log=$2; shift 2 ;;
        --only) [ $# -ge 2 ] || die "--only needs a list, e.g. --only pip"; only=$2; shift 2 ;;
        --mirror) [ $# -ge 2 ] || die "--mirror needs a URL, e.g. --mirror http://deb.debian.org/debian"
                  mirror=$2; shift 2 ;;
        --testbed) [ $# -ge 2 ] || die "--testbed needs a testbed name, e.g. --testbed plarm"; tb_name=$2; shift 2 ;;
        --subnet) [ $# -ge 2 ] || die "--subnet needs a private range, e.g. --subnet 10.77.0.0/24"; subnet=$2; shift 2 ;;
        --head-python) [ $# -ge 2 ] || die "--head-python needs a path, e.g. --head-python .venv/bin/python"
                       head_python=$2; shift 2 ;;
        --host-cpuinfo) host_cpuinfo=1; shift ;;
        --torch) [ $# -ge 2 ] || die "--torch needs a requirement, e.g. --torch torch==2.8.0"; torch=$2; shift 2 ;;
        --np-sim) [ $# -ge 2 ] || die "--np-sim needs a number, e.g. --np-sim 8"; np_sim=$2; shift 2 ;;
        *) die "unknown argument '$1'; see --help" ;;
    esac
done
for way in ${only//,/ }; do
    case "$way" in pip|system|none) ;; *) die "--only: unknown step '$way'; use pip, system, pip,system or none" ;; esac
done
if [ -n "$tb_name" ]; then
    case "$tb_name" in [a-z]*) ;; *) die "--testbed: '$tb_name' is not a testbed name (a-z, 0-9, at most 8)" ;; esac
    [ -n "$subnet" ] || die "--testbed needs --subnet CIDR (a private range of its own, e.g. 10.77.0.0/24)"
elif [ -n "$subnet" ] || [ -n "$head_python" ]; then
    die "--subnet and --head-python go with --testbed NAME"
fi
# It goes into a shell command line inside the root: a requirement or a wheel's path, nothing else.
case "$torch" in *[!A-Za-z0-9._=\<\>!~,+/:-]*) die "--torch: '$torch' is not a requirement like torch==2.8.0 or a wheel's path" ;; esac
case "$np_sim" in ''|*[!0-9]*|0) die "--np-sim must be a positive whole number, not '$np_sim'" ;; esac
case "$root" in /*) ;; *) die "--root must be an absolute path, not '$root'" ;; esac
root=${root%/}
[ "$root" != "" ] && [ "$root" != / ] || die "--root must not be /"
# It goes into shell command lines (the node02 shim below): letters, digits and ./_- only.
case "$root" in *[!A-Za-z0-9/._-]*) die "--root '$root': use letters, digits and ./_- only" ;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
torch_env=${torch:+PILAB_TORCH=$torch}
if [ -n "$tb_name" ]; then
    head_python=${head_python:-$repo/.venv/bin/python}
    [ -x "$head_python" ] || die "--head-python $head_python is not an executable; run ./lab.sh setup or give --head-python PATH"
fi
# The root must not sit in a git work tree: git would see a whole Debian system as untracked files.
probe=$root
while [ ! -e "$probe" ]; do probe=$(dirname "$probe"); done
if git -C "$probe" rev-parse --show-toplevel >/dev/null 2>&1; then
    die "--root $root is inside the git work tree $(git -C "$probe" rev-parse --show-toplevel); use e.g. --root /var/lib/pilab-arm64/root"
fi
[ "$(id -u)" = 0 ] || die "run as root (debootstrap, chroot and mounts need it): sudo $0 $*"
# Root chroots into the root and mounts inside it: it must be root's, and nothing above it writable by
# another account (one that could swap in a tree of its own), a world-writable directory only with the
# sticky bit (as /tmp). Checked before anything is made.
unsafe() {  # unsafe DIR [parent]: why another account could change DIR, or nothing
    local owner mode
    owner=$(stat -c %u "$1") mode=$(stat -c %a "$1")
    [ "$owner" = 0 ] || { echo "$1 belongs to $(stat -c %U "$1"), not root"; return; }
    if [ $((8#$mode & 8#022)) != 0 ] && { [ "${2:-}" != parent ] || [ $((8#$mode & 8#1000)) = 0 ]; }; then
        echo "$1 is writable by others (mode $mode)"
    fi
}
check_location() {  # the root and its directory: root's alone; the directories above: no other writer
    local d=$root why
    while [ ! -e "$d" ] && [ ! -L "$d" ]; do d=$(dirname "$d"); done
    while :; do
        case "$d" in
            "$root"|"$(dirname "$root")")
                [ ! -L "$d" ] || die "--root $root: $d is a symbolic link; give the real directory"
                why=$(unsafe "$d") ;;
            *) why=$(unsafe "$d" parent) ;;
        esac
        [ -z "$why" ] || die "--root $root: $why; choose a location of root's (default /var/lib/pilab-arm64/root) or fix its owner and mode"
        [ "$d" != / ] || return 0
        d=$(dirname "$d")
    done
}
check_location

base=$(dirname "$root")
mkdir -p "$base"
check_location  # again: made by us, or by someone else in the moment between
[ -n "$log" ] || log=$base/arm64_node-$(date -u +%Y%m%dT%H%M%SZ).log
exec > >(tee -a "$log") 2>&1
summary=()
step_start=0
say() { printf '[arm64 %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# ---- always unmount, also on failure ----------------------------------------------------------
mounted=()
binfmt_was=enabled  # until the script has looked (an early exit leaves binfmt_misc alone)
tb_up=""
tb_link=""
cleanup() {
    rc=$?
    set +e
    # Processes this script started inside the root (e.g. a hung rank) would keep the mounts busy.
    for p in /proc/[0-9]*; do
        if [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ]; then kill -TERM "${p#/proc/}" 2>/dev/null; fi
    done
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount "${mounted[$i]}" 2>/dev/null || umount -l "${mounted[$i]}" || echo "could not unmount ${mounted[$i]}"
    done
    if [ -n "$tb_up" ]; then
        PYTHONPATH=$repo "$head_python" -m pilab testbed down --name "$tb_name" >/dev/null || echo "testbed down $tb_name failed"
    fi
    [ -z "$tb_link" ] || rm -f "$tb_link"
    # binfmt_misc is the kernel's (the whole machine's, not this script's): what host_tools turned on
    # is turned off again, so no aarch64 program runs through qemu here once the script has ended.
    if [ "$binfmt_was" != enabled ] && [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        update-binfmts --disable qemu-aarch64 2>/dev/null || echo -1 >/proc/sys/fs/binfmt_misc/qemu-aarch64 \
            || echo "could not unregister binfmt qemu-aarch64"
    fi
    if [ "$binfmt_was" = unmounted ] && [ -e /proc/sys/fs/binfmt_misc/register ]; then
        umount /proc/sys/fs/binfmt_misc || echo "could not unmount /proc/sys/fs/binfmt_misc"
    fi
    left=$(awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/mounts)
    [ -z "$left" ] || echo "WARNING: still mounted under $root: $left"
    echo
    echo "==== SUMMARY ($(date -u +%Y-%m-%dT%H:%MZ), exit $rc) ===="
    for line in "${summary[@]}"; do echo "$line"; done
    echo "log: $log"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

bind() {  # bind SRC DEST [ro]; a file (the Pi's cpuinfo) is bound over a file
    if [ -d "$1" ]; then mkdir -p "$2"; elif [ ! -e "$2" ]; then mkdir -p "$(dirname "$2")" && : >"$2"; fi
    mount --bind "$1" "$2"
    mounted+=("$2")
    if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$2"; fi
}

# step NAME COMMAND...: run, time, record "ok"/"FAILED" in the summary; a failed step stops the run.
step() {
    local name=$1; shift
    say "---- $name"
    local t0=$SECONDS pid
    # In the background + wait: bash runs the TERM/INT trap only once a foreground child has ended
    # (an hour of pip), but interrupts `wait` at once; the trap then ends what runs in the root.
    "$@" &
    pid=$!
    if wait "$pid"; then
        summary+=("$(printf '%-34s ok      %6d s' "$name" $((SECONDS - t0)))")
    else
        local rc=$?
        summary+=("$(printf '%-34s FAILED  %6d s (exit %d)' "$name" $((SECONDS - t0)) "$rc")")
        return "$rc"
    fi
}
# in_pi 'shell command': run as user pi in the clone, with a login-like environment.
# MPIR_CVAR_CH4_CMA_ENABLE=0: MPICH moves large messages between ranks of a node with cross-memory
# attach (process_vm_readv), which fails under qemu-user: a 1 MB MPI_Bcast (train's first parameter
# broadcast) ended in 'MPIC_Recv ... Other MPI error' with it on and works with it off. Open MPI's
# shared-memory transport (Debian's, the system way) uses the same system call; it is off likewise.
# Emulation only: a real Pi keeps both defaults.
in_pi() {
    chroot --userspec=1000:1000 --groups=1000 "$root" /usr/bin/env -i HOME=/home/pi USER=pi LANG=C.UTF-8 \
        PATH=/usr/local/bin:/usr/bin:/bin TERM=dumb MPIR_CVAR_CH4_CMA_ENABLE=0 \
        OMPI_MCA_btl_vader_single_copy_mechanism=none \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt /bin/bash -lc "cd /home/pi/pilab && $1"
}
in_root() {
    chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        DEBIAN_FRONTEND=noninteractive /bin/bash -c "$1"
}

# git runs as the account that owns the tree it works in: the clone inside belongs to pi (uid 1000), this
# checkout to whoever owns it. Never as root in another account's tree: its .git/config (core.fsmonitor,
# core.pager, hooks...) would run as root.
as_owner() {  # as_owner UID GID HOME command...
    local uid=$1 gid=$2 home=$3; shift 3
    setpriv --reuid="$uid" --regid="$gid" --clear-groups env HOME="$home" "$@"
}
repo_uid=$(stat -c %u "$repo") repo_gid=$(stat -c %g "$repo")
rgit() { as_owner "$repo_uid" "$repo_gid" /nonexistent git -C "$repo" "$@"; }
pgit() { as_owner 1000 1000 "$root/home/pi" git "$@"; }

# ---- host tools ---------------------------------------------------------------------------------
host_tools() {
    if ! command -v debootstrap >/dev/null || ! command -v update-binfmts >/dev/null || \
        { [ ! -e /usr/libexec/qemu-binfmt/aarch64-binfmt-P ] && [ ! -e /usr/bin/qemu-aarch64-static ]; }; then
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap qemu-user-static binfmt-support
    fi
    # binfmt_misc lets the kernel hand aarch64 binaries to qemu; the F flag (Debian's default) opens
    # the interpreter now, so it works inside the chroot without a copy of qemu there.
    [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
    grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || update-binfmts --enable qemu-aarch64
    grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64 || { echo "binfmt qemu-aarch64 is not enabled"; return 1; }
    say "binfmt: $(tr '\n' ' ' </proc/sys/fs/binfmt_misc/qemu-aarch64)"
}

# ---- the root file system -----------------------------------------------------------------------
# Finished = debootstrap's second stage removed /debootstrap and our marker is there.
rootfs() {
    if [ -f "$root/.pilab-rootfs-done" ] && [ ! -d "$root/debootstrap" ]; then
        say "reusing the finished root $root ($(cat "$root/.pilab-rootfs-done"))"
        return 0
    fi
    if [ -e "$root" ]; then
        say "removing the unfinished root $root"
        rm -rf --one-file-system "$root"
    fi
    # minbase + what Raspberry Pi OS Lite has and pilab needs: python3-venv for ./lab.sh, git for the
    # clone, procps for ps/free.
    debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-pip,git,ca-certificates,procps bookworm "$root" "$mirror"
    date -u +%Y-%m-%dT%H:%MZ >"$root/.pilab-rootfs-done"
}

# What /proc/cpuinfo says on a Raspberry Pi 4B, one entry per core of this host (what the root sees).
# qemu-user 7.2 (Debian bookworm's) shows aarch64 programs the host's x86 /proc/cpuinfo, and `import
# torch` (PyPI's 2.13.0 aarch64 build) dies there with SIGSEGV in `from torch._C import *`; with this
# Arm text bound over it the same import works (torch's cpuinfo library parses the file at load).
# qemu 8.1 added an emulated Arm /proc/cpuinfo of its own (not tried here).
pi_cpuinfo() {
    local i n
    n=$(nproc)
    for ((i = 0; i < n; i++)); do
        printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n' "$i"
        printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n'
    done
    printf 'Hardware\t: BCM2835\nRevision\t: c03114\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4 (emulated: qemu-user)\n'
}

mounts() {
    bind /proc "$root/proc"
    if [ "$host_cpuinfo" = 0 ]; then
        pi_cpuinfo >"$root/etc/pilab-cpuinfo"
        bind "$root/etc/pilab-cpuinfo" "$root/proc/cpuinfo" ro
    fi
    bind /sys "$root/sys" ro
    bind /dev "$root/dev"
    bind /dev/pts "$root/dev/pts"
    # a mount of its own, not carried by the bind of /dev: MPICH's and UCX's shared memory between ranks
    bind /dev/shm "$root/dev/shm"
    cp -f /etc/resolv.conf "$root/etc/resolv.conf"  # pip and apt inside reach PyPI / the mirror
    # Where this machine reaches the internet through a TLS-inspecting proxy, its local CAs
    # (/usr/local/share/ca-certificates) must be trusted inside too, by the system and by pip (whose
    # own bundle, certifi, knows only the public CAs; in_pi points PIP_CERT at the system's).
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        local crt fresh=0
        mkdir -p "$root/usr/local/share/ca-certificates"
        for crt in /usr/local/share/ca-certificates/*.crt; do
            cmp -s "$crt" "$root$crt" || { cp -f "$crt" "$root$crt"; fresh=1; }
        done
        [ "$fresh" = 0 ] || in_root 'update-ca-certificates >/dev/null 2>&1' || return 1
    fi
}

data_mount() {
    # The data archive, read-only, where pilab's tests and docs look for it (../shared/data beside the
    # clone); the runs below use the embedded subset, so a checkout without it still works.
    if [ -d "$repo/../shared/data" ]; then
        bind "$(cd "$repo/../shared/data" && pwd)" "$root/home/pi/shared/data" ro
    fi
}

user_and_clone() {
    # uid 1000, as the first user of a freshly flashed Pi; in_pi runs as that uid.
    in_root 'id pi >/dev/null 2>&1 || useradd -m -u 1000 -U -s /bin/bash pi'
    # A clone of this checkout's HEAD, made from outside (a worktree's .git points to a path the
    # chroot cannot see); a reused root gets the clone reset to HEAD.
    # The commit travels as a bundle: written by the checkout's owner, read by pi (who may not be able to
    # read the checkout itself, e.g. one under /root).
    local dest=$root/home/pi/pilab head drop bundle
    head=$(rgit rev-parse HEAD)
    drop=$(mktemp -d)
    chown "$repo_uid:$repo_gid" "$drop"
    bundle=$drop/head.bundle
    rgit bundle create -q "$bundle" HEAD
    chmod 755 "$drop" && chmod 644 "$bundle"
    chown -R 1000:1000 "$dest" 2>/dev/null || true  # what an earlier run made as root, now pi's (-R: links not followed)
    if [ ! -d "$dest/.git" ]; then
        pgit -c advice.detachedHead=false clone -q "$bundle" "$dest"
    fi
    pgit -C "$dest" fetch -q "$bundle" HEAD
    pgit -C "$dest" -c advice.detachedHead=false checkout -q --force "$head"
    pgit -C "$dest" clean -qfdx -e .venv-pip -e .venv-system -e "*.egg-info"
    rm -rf "$drop"
    say "clone: $(pgit -C "$dest" log -1 --format='%h %s')"
}

versions() {  # versions VENV
    in_pi "set -e; $1/bin/python - <<'EOF'
import platform, sys
import torch, numpy, mpi4py
from mpi4py import MPI
print('machine', platform.machine(), '| python', platform.python_version(), '| torch', torch.__version__,
      '| numpy', numpy.__version__, '| mpi4py', mpi4py.__version__, 'from', mpi4py.__file__)
print('mpi4py library:', MPI.Get_library_version().replace(chr(0), '').strip().splitlines()[0])
print('torch threads', torch.get_num_threads(), '| torch config:', torch.__config__.show().splitlines()[1:4])
EOF
echo \"mpiexec: \$(PATH=$1/bin:\$PATH command -v mpiexec) -> \$(readlink -f \$(PATH=$1/bin:\$PATH command -v mpiexec))\"
cat /etc/debian_version"
}

# What every pilab run inside trains: MobileNetV2 at width 0.25, 4 images per rank, 1 torch thread per
# rank, 256/100 images. Under emulation (qemu's TCG, not a Pi's speed) one step of width 0.25 with 32
# images per rank took ~5 min (run 3), and simulate --np 8 at 32 per rank did not finish one in 19 min.
small="--width 0.25 --batch-size 4 --threads 1 --train-subset 256 --test-subset 100"
# Each run is bounded: a step that hangs (in MPI, under emulation) ends with its limit instead of
# holding the script for ever; the limits are hours, far above what the runs took (docs/arm64.md).
limit="timeout -k 60"
# A train's result.json in one line (no single quotes: it goes into in_pi's command line in them).
result_py='import sys; from pilab import resultfile; r = resultfile.load(sys.argv[1]); e = r["env"]; print("result: np", r["np"],
    "steps", r["steps_done"], "step s", [round(t, 1) for t in r["steps"]["time"]], "test acc",
    r["epochs"][-1]["test_acc"], "| machine", e["machine"], "hosts", e["hostnames"], "threads/rank",
    e["threads_per_rank"], "torch", e["torch"], "|", e["mpi_library"])'

# The runs a Pi user makes after set-up, in VENV (PATH first, as `source .venv/bin/activate` would).
# versions and --help must work for anything else to; train, simulate and doctor are independent, so
# one that fails is recorded and the next still runs.
pilab_runs() {  # pilab_runs WAY VENV
    local way=$1 venv=$2 act="export PATH=$2/bin:\$PATH &&" rc=0
    step "$way: versions" versions "$venv" || return 1
    step "$way: pilab --help" in_pi "$act python -m pilab --help >/dev/null && python -m pilab train --help | head -3" || return 1
    # --hang-s 1800: a step under emulation takes minutes; the default 120 s watchdog ended run 3's ranks.
    step "$way: train --np 2 (3 steps)" in_pi "$act $limit 5400 python -m pilab train --np 2 --max-steps 3 --epochs 1 \
        --hang-s 1800 $small --out /tmp/pilab-arm64-$way/train --overwrite \
        && python -c '$result_py' /tmp/pilab-arm64-$way/train/result.json" || rc=1
    step "$way: simulate --np $np_sim (1 step)" in_pi "$act $limit 5400 python -m pilab simulate --np $np_sim \
        --max-steps 1 --epochs 1 $small --out /tmp/pilab-arm64-$way/simulate --overwrite" || rc=1
    # The doctor's own limits: its defaults (a host answers in 30 s, a probe ends in 300 s) are a Pi's;
    # here Python alone starts in ~10 s and import torch takes minutes, with the head's probe, the
    # host's and then a 2-rank network job (6 message sizes) sharing 2 loaded cores.
    step "$way: doctor --hosts localhost" in_pi "$act $limit 5400 python -m pilab doctor --hosts localhost \
        --answer-s 900 --timeout-s 3600 $small" || rc=1
    return $rc
}

way_pip() {
    step "pip: ./lab.sh setup (pip MPICH)" in_pi "$torch_env PILAB_VENV=/home/pi/pilab/.venv-pip ./lab.sh setup" || return 1
    pilab_runs pip /home/pi/pilab/.venv-pip
}

way_system() {
    # What a Raspberry Pi OS user installs for "the system MPI": Debian's MPICH and mpi4py.
    step "system: apt-get install mpich python3-mpi4py" in_root \
        'set -e; apt-get update -qq; apt-get install -y -qq mpich python3-mpi4py >/dev/null
         dpkg-query -W -f="\${Package} \${Version}\n" mpich python3-mpi4py libopenmpi3 openmpi-bin 2>/dev/null || true
         echo "mpiexec -> $(readlink -f /usr/bin/mpiexec)"; update-alternatives --query mpirun | grep -E "^(Value|Alternative|Priority)" || true' || return 1
    step "system: ./lab.sh setup (PILAB_SYSTEM_MPI=1)" in_pi \
        "$torch_env PILAB_SYSTEM_MPI=1 PILAB_VENV=/home/pi/pilab/.venv-system ./lab.sh setup" || return 1
    pilab_runs system /home/pi/pilab/.venv-system
}

# ---- stretch: one testbed node inside the arm64 root, a job over x86 + arm64 ------------------------
testbed_job() {
    # Hydra starts the proxy as <mpiexec's directory>/hydra_pmi_proxy and the ranks by the head's
    # absolute paths; inside the root those paths lead to the arm64 venv (pip's MPICH of the same
    # version), and the job's working directory exists on both sides.
    local hvenv wd=/tmp/pilab-arm64-testbed state shim node addr
    hvenv=$(cd "$(dirname "$head_python")/.." && pwd)
    if [ -e "$root$hvenv" ] && [ ! -L "$root$hvenv" ]; then
        echo "$root$hvenv exists and is not our link; remove it"; return 1
    fi
    mkdir -p "$(dirname "$root$hvenv")" "$wd" "$root$wd"
    ln -sfn /home/pi/pilab/.venv-pip "$root$hvenv"
    tb_link=$root$hvenv
    chmod 1777 "$root$wd"
    say "head: $("$head_python" -c 'import platform, torch, mpi4py; print(platform.machine(), platform.python_version(), torch.__version__, mpi4py.__version__)') $("$hvenv/bin/mpichversion" 2>/dev/null | head -1)"
    tb_up=1
    PYTHONPATH=$repo "$head_python" -m pilab testbed up --name "$tb_name" --nodes 2 --slots 1 --subnet "$subnet" --rate 1gbit
    state=$(PYTHONPATH=$repo "$head_python" -c "from pilab import testbed; print(testbed.load('$tb_name').state_dir)")
    node=$(PYTHONPATH=$repo "$head_python" -c "from pilab import testbed; print(testbed.load('$tb_name').hosts[1])")
    addr=$(PYTHONPATH=$repo "$head_python" -c "from pilab import testbed; t = testbed.load('$tb_name'); print(t.address(t.hosts[1]))")
    shim=$state/shim-arm64
    # the Pi's /proc/cpuinfo over that node's own /proc too (see pi_cpuinfo)
    local cpuinfo_mount=""
    [ "$host_cpuinfo" = 1 ] || cpuinfo_mount="&& mount --bind $root/etc/pilab-cpuinfo $root/proc/cpuinfo "
    # node02's commands: the testbed's own shim (namespaces, hostname, pid namespace), then, inside
    # that node's private mount namespace, /proc /dev /sys for the root and chroot into it. The mounts
    # die with the node's namespace; nothing is left mounted here.
    cat >"$shim" <<EOF_SHIM
#!/bin/sh
# pilab arm64_node.sh: as $state/shim, but $node ($addr) runs its commands inside $root
while [ \$# -gt 0 ]; do
    case "\$1" in -x|-q|-T|-n) shift ;; -o|-p|-l) shift 2 ;; *) break ;; esac
done
host=\$1; shift
case "\$host" in
    $node|$addr)
        cmd=\$(printf '%s' "\$*" | sed "s/'/'\\\\\\\\''/g")
        exec $state/shim -x "\$host" "mount -t proc proc $root/proc $cpuinfo_mount&& mount --rbind /dev $root/dev && mount --rbind /sys $root/sys && exec chroot $root /bin/sh -c 'cd $wd && \$cmd'" ;;
    *) exec $state/shim -x "\$host" "\$@" ;;
esac
EOF_SHIM
    chmod 755 "$shim"
    local mpirun=(timeout -k 60 5400 env UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 PYTHONPATH="$repo"
                  "$hvenv/bin/mpiexec" -f "$state/hosts" -launcher ssh -launcher-exec "$shim" -iface "$tb_name-br")
    step "testbed: mpi4py on x86 + arm64" bash -c 'cd "$0" && "$@"' "$wd" "${mpirun[@]}" -n 2 "$head_python" -c \
        "import platform, socket; from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.rank + 1); print('rank', c.rank, 'of', c.size, socket.gethostname(), platform.machine(), 'allreduce', s, MPI.Get_library_version().splitlines()[0], flush=True)" \
        || return 1
    step "testbed: train 3 steps x86 + arm64" bash -c 'cd "$0" && "$@"' "$wd" "${mpirun[@]}" -n 2 "$head_python" \
        -m pilab train --max-steps 3 --epochs 1 --hang-s 1800 $small --out "$wd/train" --overwrite || return 1
    "$head_python" -c "$result_py" "$wd/train/result.json"
}

say "pilab arm64 node: root $root, repo $repo ($(rgit log -1 --format=%h)), log $log"
# What binfmt_misc was before host_tools (run by step in a subshell, so it is noted here): cleanup
# leaves it so.
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then binfmt_was=unmounted
elif grep -qs '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64; then binfmt_was=enabled
else binfmt_was=disabled
fi
step "host tools + binfmt" host_tools
step "debootstrap bookworm arm64" rootfs
mounts
step "user pi + clone" user_and_clone
data_mount
say "inside: $(chroot "$root" uname -m) $(cat "$root/etc/debian_version"), $(chroot "$root" nproc) cores"
failed=0
for way in ${only//,/ }; do
    [ "$way" = none ] || "way_$way" || failed=1
done
if [ -n "$tb_name" ]; then
    testbed_job || failed=1
fi
exit $failed
