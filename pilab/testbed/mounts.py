"""What a node's processes see of the file system: the cgroup file systems mounted again inside a node,
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
