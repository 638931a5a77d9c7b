"""The files ``up`` writes: the ssh shim Hydra calls to start a command on a node, the hostfile and env.sh,
and -- for a testbed whose jobs run as a user -- the sudo rule that lets that user's own ``mpiexec`` use
the shim."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

from ..files import atomic_write_text, save_json
from .mounts import _mounts_file, _write_mounts
from .nodes import Testbed, TestbedError, check_state_dir, job_ids

SUDOERS_DIR = "/etc/sudoers.d"


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
#
# The command itself runs as {who}: entering a node needs root, the job does not. A user's own
# mpiexec runs this file through sudo (the rule in {rule}), and a watcher stands in for
# --pdeathsig, which sudo (set-user-ID) does not pass on.
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
if [ "$(id -u)" != 0 ]; then
    sudo -n -l {shim} >/dev/null 2>&1 || {{
        echo "pilab testbed {name}: $(id -un) cannot start jobs on its nodes (they run as {who}, started through sudo and the rule in {rule}); start the job as {who}, or as root, or have root run \\`pilab testbed up --name {name} --user $(id -un)\\`" >&2
        exit 255; }}
    exec sudo -n {shim} -x "$host" "$@"
fi
# the launcher this job belongs to: the parent, or through sudo the parent of sudo
launcher=$PPID
while [ "$(cat /proc/$launcher/comm 2>/dev/null)" = sudo ]; do
    launcher=$(sed 's/.*) //' /proc/$launcher/stat | cut -d' ' -f2)
done
[ "$launcher" != 1 ] || {{ echo "pilab testbed: the launcher is gone; not starting on $name" >&2; exit 255; }}
if [ "$launcher" != "$PPID" ]; then
    # when the launcher is gone, end this node's part of the job (as --pdeathsig below does for
    # root's own jobs); start times guard against a pid used again meanwhile
    born() {{ sed 's/.*) //' /proc/$1/stat 2>/dev/null | cut -d' ' -f20; }}
    me=$$ mine=$(born $$) theirs=$(born $launcher)
    (
        while [ "$(born $launcher)" = "$theirs" ] && [ "$(born $me)" = "$mine" ]; do sleep 1; done
        [ "$(born $me)" != "$mine" ] || kill -KILL $me
    ) </dev/null >/dev/null 2>&1 &
fi
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
exec setpriv --pdeathsig KILL sh -c '
    [ "$PPID" = "$1" ] || {{ echo "pilab testbed: the launcher (pid $1) is gone; not starting on $3" >&2; exit 255; }}
    ns=$2; name=$3; shift 3
    exec ip netns exec "$ns" unshare --uts --mount --propagation private --pid --fork --kill-child \\
        --mount-proc sh -c "hostname \\"\\$1\\" && mount -t tmpfs -o mode=1777,size=50% tmpfs /dev/shm && . {mounts} && shift && exec {drop}sh -c \\"\\$*\\"" sh "$name" "$@"
' sh "$PPID" "$ns" "$name" "$@"
"""


_SAFE_PATH = re.compile(r"^/[A-Za-z0-9/._-]+$")  # a path that sudoers and sh take as it is


def sudoers_rule(name: str) -> str:
    """Where ``up`` writes the sudo rule of testbed ``name`` (removed by ``down``)."""
    return os.path.join(SUDOERS_DIR, f"pilab-testbed-{name}")


def _drop(tb: Testbed) -> str:
    """The words before a job's command in the shim: none for root's testbed, else ``setpriv`` to the user."""
    if not tb.user:
        return ""
    uid, gid = job_ids(tb.user)
    return f"setpriv --reuid={uid} --regid={gid} --init-groups "


def _write_sudoers(tb: Testbed) -> None:
    """Let ``tb.user`` run the shim (and nothing else) as root, so that the user's own ``mpiexec`` reaches
    the nodes; the shim then runs the job as that user. Nothing where sudo is not installed."""
    path = sudoers_rule(tb.name)
    if not tb.user:
        if os.path.exists(path):
            os.remove(path)
        return
    if shutil.which("sudo") is None or not os.path.isdir(SUDOERS_DIR):
        return  # only root starts jobs then (job_access says so)
    rule = (f"# pilab testbed {tb.name} (`pilab testbed up`; `testbed down` removes it): {tb.user} starts jobs "
            f"on its nodes.\n# The shim enters a node as root and runs the job as {tb.user}.\n"
            f"Defaults!{tb.shim} !use_pty, !requiretty, env_reset\n"
            f"{tb.user} ALL=(root) NOPASSWD: {tb.shim}\n")
    tmp = os.path.join(tb.state_dir, "sudoers.new")  # checked by visudo before sudo can read it
    atomic_write_text(tmp, rule, mode=0o440)
    try:
        check = subprocess.run(["visudo", "-cqf", tmp], capture_output=True, text=True) \
            if shutil.which("visudo") else None
    finally:
        os.remove(tmp)
    if check is not None and check.returncode != 0:
        raise TestbedError(f"the sudo rule for {tb.user} does not pass visudo: "
                           f"{(check.stderr or check.stdout).strip()}")
    atomic_write_text(path, rule, mode=0o440)  # its temporary name has a dot: sudo skips it


def job_access(tb: Testbed) -> str:
    """Who runs the testbed's jobs and who may start them, in one line (``testbed up`` prints it)."""
    if not tb.user:
        return "jobs on the nodes run as root (no user recorded: `sudo pilab testbed up` from your account " \
               "records yours, or --user NAME)"
    if os.path.exists(sudoers_rule(tb.name)):
        return f"jobs on the nodes run as {tb.user}, who starts them with its own mpiexec (sudo rule " \
               f"{sudoers_rule(tb.name)}: the shim, nothing else)"
    return f"jobs on the nodes run as {tb.user}; only root can start them: sudo is not installed (apt-get " \
           "install sudo, then `testbed up` again)"


def _write_files(tb: Testbed) -> None:
    """Every file of the testbed, in its checked state directory, and the sudo rule where it has a user."""
    d = check_state_dir(tb.name, create=True)
    if not _SAFE_PATH.match(d):  # it goes into the shim's nested shell quoting and the sudo rule as it is
        raise TestbedError(f"state directory {d!r}: give PILAB_TESTBED_DIR a path of letters, digits and ./_-")
    cases = "\n".join(f"    {h}|{tb.address(h)}) ns={tb.netns(h)}; name={h} ;;" for h in tb.hosts)
    shim = SHIM.format(name=tb.name, cases=cases, hosts=" ".join(tb.hosts), mounts=shlex.quote(_mounts_file(tb)),
                       shim=shlex.quote(tb.shim), who=tb.user or "root", rule=sudoers_rule(tb.name),
                       drop=_drop(tb))
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
    _write_sudoers(tb)
