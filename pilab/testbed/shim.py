"""The files ``up`` writes: the ssh shim Hydra calls to start a command on a node, the hostfile and env.sh,
and -- for a testbed whose jobs run as a user -- the sudo rule that lets that user's own ``mpiexec`` use
the shim; and what a node's processes see of the file system: the cgroup file systems mounted again inside
a node, and ``overlay``'s per-node bind mounts (a changed file on one board)."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess

from ..files import atomic_write_text, save_json
from .nodes import Testbed, TestbedError, check_state_dir, job_ids

SUDOERS_DIR = "/etc/sudoers.d"


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
            lines.append(f"mount -t tmpfs -o mode=755 cgroup_root {shlex.quote(where)} 2>/dev/null")
        elif fstype in ("cgroup", "cgroup2"):
            lines.append(f"{{ mkdir -p {shlex.quote(where)} && mount -t {fstype} -o {shlex.quote(opts)} {fstype} "
                         f"{shlex.quote(where)}; }} 2>/dev/null")
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
        # every path quoted, in the message too: root sources this file (a `$(...)` in a name stays text)
        said = shlex.quote(f"pilab testbed: cannot bind {src} over {dst} on {host}")
        lines.append(f'[ "$1" != {shlex.quote(host)} ] || mount --bind {shlex.quote(src)} {shlex.quote(dst)} || '
                     f'{{ echo {said} >&2; exit 1; }}')
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


def write_files(tb: Testbed) -> None:
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
