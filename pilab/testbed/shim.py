"""The files ``up`` writes: the ssh shim Hydra calls to start a command on a node, the hostfile and env.sh."""
from __future__ import annotations

import os
import shlex

from ..files import atomic_write_text, save_json
from .mounts import _mounts_file, _write_mounts
from .nodes import Testbed


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


def _write_files(tb: Testbed) -> None:
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
