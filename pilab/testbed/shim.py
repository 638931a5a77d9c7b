"""The files ``up`` writes: the ssh shim Hydra calls to start a command on a node, the hostfile and env.sh;
and what a node's processes see of the file system: the cgroup file systems mounted again inside a node,
and ``overlay``'s per-node bind mounts (a changed file on one board)."""
from __future__ import annotations

import ipaddress
import json
import os
import shlex

from ..files import atomic_write_text, save_json
from .nodes import Testbed, TestbedError


def _mounts_file(tb: Testbed) -> str:
    return os.path.join(tb.state_dir, "mounts.sh")


def _read_overlays(tb: Testbed) -> list[tuple[str, str, str]]:
    path = os.path.join(tb.state_dir, "overlays.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [tuple(x) for x in json.load(f)]


def _cgroup_mounts() -> list[str]:
    """Shell lines that mount this machine's cgroup file systems again inside a node: ``ip netns
    exec`` mounts a sysfs of the namespace over /sys, hiding /sys/fs/cgroup, where a board's
    processes (the doctor's probe) read their memory limit and CPU quota. Same hierarchies, so a
    node's processes see the cgroups `limit_memory` and `throttle` put them in."""
    lines = []
    try:
        with open("/proc/mounts") as f:
            mounts = [ln.split() for ln in f]
    except OSError:
        return lines
    for dev, where, fstype, opts, *_ in mounts:
        if not where.startswith("/sys/fs/cgroup"):
            continue
        if fstype == "tmpfs":
            lines.append(f"mount -t tmpfs -o mode=755 cgroup_root {where} 2>/dev/null")
        elif fstype in ("cgroup", "cgroup2"):
            lines.append(f"{{ mkdir -p {where} && mount -t {fstype} -o {opts} {fstype} {where}; }} "
                         "2>/dev/null")
    return lines


def _etc_hosts(tb: Testbed) -> str:
    """The nodes' /etc/hosts (the head, node01...), bound over /etc/hosts inside a node only, as a small
    cluster's hosts file: Hydra's proxies started by Slurm reach mpiexec by its node's name. This
    machine's own /etc/hosts is left as it is; no name lookup leaves the machine."""
    path = os.path.join(tb.state_dir, "etc-hosts")
    head = ipaddress.ip_network(tb.subnet).network_address + 2  # Slurm's head namespace (testbed.slurmd)
    lines = ["127.0.0.1 localhost", f"{head} head", *(f"{tb.address(h)} {h}" for h in tb.hosts)]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return f"mount --bind {shlex.quote(path)} /etc/hosts 2>/dev/null"


def _write_mounts(tb: Testbed, overlays: list) -> None:
    """The shim sources this inside each job's mount namespace on a node (``$1`` = the host)."""
    lines = [f"# pilab testbed {tb.name}: mounts made inside a node's mount namespace (the cgroup file "
             "systems, testbed.overlay's binds); sourced by the shim with $1 = the node",
             *_cgroup_mounts(), _etc_hosts(tb)]
    for host, src, dst in overlays:
        lines.append(f'[ "$1" != {host} ] || mount --bind {shlex.quote(src)} {shlex.quote(dst)} || '
                     f'{{ echo "pilab testbed: cannot bind {src} over {dst} on {host}" >&2; exit 1; }}')
    lines.append("true")
    save_json([list(o) for o in overlays], os.path.join(tb.state_dir, "overlays.json"))
    atomic_write_text(_mounts_file(tb), "\n".join(lines) + "\n")


def overlay(tb: Testbed, host: str, src: str, dst: str) -> None:
    """Make ``src`` appear at ``dst`` for every process started on ``host`` from now on, and only
    there: a bind mount inside the node's own mount namespace (another package version, a data file
    changed or missing on one board). ``dst`` must exist and be of the same kind (file or directory)::

        testbed.overlay(tb, "node02", "/tmp/old/version.py", torch.version.__file__)
        testbed.clear_overlays(tb, "node02")
    """
    tb.index(host)
    for p, what in ((src, "src"), (dst, "dst")):
        if not os.path.exists(p):
            raise TestbedError(f"overlay {what} {p} does not exist")
    if os.path.isdir(src) != os.path.isdir(dst):
        raise TestbedError(f"overlay {src} over {dst}: both must be files or both directories")
    _write_mounts(tb, [*_read_overlays(tb), (host, os.path.abspath(src), os.path.abspath(dst))])


def clear_overlays(tb: Testbed, host: str | None = None) -> None:
    """Remove the overlays of ``host`` (all hosts when None); jobs started from now on see the real files."""
    _write_mounts(tb, [o for o in _read_overlays(tb) if host is not None and o[0] != host])


SHIM = """#!/bin/sh
# pilab testbed {name}: Hydra's ssh launcher calls `shim -x HOST command...`. Run the command on HOST
# as ssh would (one shell command line), inside HOST's network namespace, with HOST's hostname (UTS
# namespace), a /dev/shm of its own (mount namespace) and a pid namespace of its own: a separate board
# on one machine.
#
# Nothing it starts outlives mpiexec, as nothing a command run by ssh starts outlives its session:
# - this process (every step below execs, so it keeps the pid mpiexec started) gets SIGKILL when
#   mpiexec ends (setpriv --pdeathsig). A launch failing on another host ends mpiexec within
#   milliseconds, possibly before that is set or even before this shim runs: then the parent is
#   init (pid 1) or no longer the one this shim started with, and it starts nothing (under a
#   subreaper other than pid 1 the first case can slip through; `testbed down` still clears it);
# - unshare --fork --kill-child: its child, the first process of the node's pid namespace, gets
#   SIGKILL when unshare dies;
# - when that first process (the Hydra proxy) ends, the kernel kills every process left in the pid
#   namespace: ranks the proxy forked, and anything they started, even if detached (setsid).
while [ $# -gt 0 ]; do
    case "$1" in
        -x|-q|-T|-n) shift ;;
        -o|-p|-l) shift 2 ;;
        *) break ;;
    esac
done
host=$1
shift
case "$host" in
{cases}
    *) echo "ssh: Could not resolve hostname $host: not a host of pilab testbed {name} ({hosts})" >&2
       sleep 1  # let mpiexec forward this line before it sees the launch fail and exits
       exit 255 ;;
esac
# a node slowed by `testbed.throttle` (a CPU-quota cgroup of its own) or made smaller by
# `testbed.limit_memory` (a memory cgroup): everything started on it joins
for cg in /sys/fs/cgroup/cpu/{name}-"$name" /sys/fs/cgroup/unified/{name}-"$name" /sys/fs/cgroup/{name}-"$name"; do
    [ -f "$cg/cpu.cfs_quota_us" ] || [ -f "$cg/cpu.max" ] || continue
    echo $$ > "$cg/cgroup.procs" 2>/dev/null && break
done
for cg in /sys/fs/cgroup/memory/{name}-"$name" /sys/fs/cgroup/{name}-"$name"; do
    [ -f "$cg/memory.limit_in_bytes" ] || [ -f "$cg/memory.max" ] || continue
    echo $$ > "$cg/cgroup.procs" 2>/dev/null && break
done
[ "$PPID" != 1 ] || {{ echo "pilab testbed: the launcher is gone; not starting on $name" >&2; exit 255; }}
exec setpriv --pdeathsig KILL sh -c '
    [ "$PPID" = "$1" ] || {{ echo "pilab testbed: the launcher (pid $1) is gone; not starting on $3" >&2; exit 255; }}
    ns=$2; name=$3; shift 3
    exec ip netns exec "$ns" unshare --uts --mount --propagation private --pid --fork --kill-child \\
        --mount-proc sh -c "hostname \\"\\$1\\" && mount -t tmpfs -o mode=1777,size=50% tmpfs /dev/shm && . {mounts} && shift && exec sh -c \\"\\$*\\"" sh "$name" "$@"
' sh "$PPID" "$ns" "$name" "$@"
"""


def write_files(tb: Testbed) -> None:
    os.makedirs(tb.state_dir, exist_ok=True)
    cases = "\n".join(f"    {h}|{tb.address(h)}) ns={tb.netns(h)}; name={h} ;;" for h in tb.hosts)
    shim = SHIM.format(name=tb.name, cases=cases, hosts=" ".join(tb.hosts), mounts=_mounts_file(tb))
    if not os.path.exists(_mounts_file(tb)):
        _write_mounts(tb, [])
    atomic_write_text(tb.shim, shim, mode=0o755)
    # Addresses, not names: no name lookup of node01 can leave this machine (there is no DNS entry).
    # Hydra takes whole-line comments only.
    lines = [f"# pilab testbed {tb.name}: MPICH hostfile (host:slots); rank 0 on the first host",
             "# " + "  ".join(f"{tb.address(h)}={h}" for h in tb.hosts),
             *(f"{tb.address(h)}:{tb.slots}" for h in tb.hosts)]
    atomic_write_text(tb.hostfile, "\n".join(lines) + "\n")
    with open(os.path.join(tb.state_dir, "env.sh"), "w") as f:
        f.write("# eval this (or `eval \"$(python -m pilab testbed env)\"`) before mpiexec / ipcluster\n")
        for k, v in tb.env_vars().items():
            f.write(f"export {k}={shlex.quote(v)}\n")
    save_json(tb.to_dict(), os.path.join(tb.state_dir, "testbed.json"))
