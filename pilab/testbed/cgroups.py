"""A node's processes and its cgroups: what runs on each node (``processes``, ``ps``), a slower board
(``throttle``: a CPU quota) and a smaller one (``limit_memory``)."""
from __future__ import annotations

import contextlib
import os
import time

from .nodes import Testbed, TestbedError, _run


def processes(tb: Testbed) -> dict:
    """Pids still running on each node (for 'no orphan processes' checks)."""
    return {h: [int(p) for p in _run("ip", "netns", "pids", tb.netns(h), check=False).stdout.split()]
            for h in tb.hosts}


def ps(tb: Testbed) -> str:
    """What runs on each node, one line a process: pid, state, what it waits in (wchan), CPU seconds,
    its cgroups' limits, the command. For a job that does not end: which process holds it up, where::

        print(testbed.ps(tb))     # node02 12345 S futex_wait_queue 3.1s cpu=15000/100000 python -m pilab...
    """
    lines = []
    tick = os.sysconf("SC_CLK_TCK")
    for host, pids in processes(tb).items():
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/wchan") as f:
                    wchan = f.read().strip() or "-"
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
                threads = len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue  # ended meanwhile
            cpu_s = (int(stat[11]) + int(stat[12])) / tick
            limit = ""
            quota = os.path.join(_cgroup(tb.name, host) or "/nonexistent", "cpu.cfs_quota_us")
            with contextlib.suppress(OSError), open(quota) as f:
                limit = f" cpu_quota_us={f.read().strip()}"
            lines.append(f"{host} {pid} {stat[0]} {wchan} {cpu_s:.1f}s threads={threads}{limit} {cmd}")
    return "\n".join(lines) or "(no process on any node)"


def _cgroup(tb_name: str, host: str) -> str | None:
    """The node's CPU-quota cgroup directory (cgroup v1 cpu controller, else v2), None if neither."""
    for root, v2 in (("/sys/fs/cgroup/cpu", False), ("/sys/fs/cgroup/unified", True),
                     ("/sys/fs/cgroup", True)):
        if os.path.isfile(os.path.join(root, "cpu.max" if v2 else "cpu.cfs_quota_us")) or \
                (not v2 and os.path.isdir(root) and os.path.isfile(os.path.join(root, "cpu.cfs_period_us"))):
            return os.path.join(root, f"{tb_name}-{host}")
    return None


def _remove_cgroup(path: str, unlimited: list[tuple[str, str]], wait_s: float = 5.0) -> None:
    """Lift a node's limit: first write ``unlimited`` into its knobs (so that whatever is still in the
    group runs free from now on), then move what is left to the parent group and remove the group.

    Why not just rmdir: right after a job was killed its processes may still be exiting, and rmdir of
    a group that holds any fails (EBUSY) -- the limit would silently stay on the node for every later
    job (a test that timed out would slow down all the tests after it)."""
    if not os.path.isdir(path):
        return
    for knob, value in unlimited:  # in order; a knob the group does not have is skipped
        with contextlib.suppress(OSError), open(os.path.join(path, knob), "w") as f:
            f.write(value)
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
            for pid in f.read().split():
                with contextlib.suppress(OSError), \
                        open(os.path.join(os.path.dirname(path), "cgroup.procs"), "w") as parent:
                    parent.write(pid)
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # unlimited already: the group is harmless; `testbed down` removes it
            time.sleep(0.2)


def throttle(tb: Testbed, host: str, cpus: float) -> None:
    """Give every process started on ``host`` from now on at most ``cpus`` cores in total (a CPU quota:
    a slower board); ``cpus=0`` lifts it. The shim puts what it starts into the node's cgroup."""
    tb.index(host)
    path = _cgroup(tb.name, host)
    if path is None:
        raise TestbedError("no cgroup cpu controller at /sys/fs/cgroup: cannot throttle a node here")
    if cpus <= 0:
        _remove_cgroup(path, [("cpu.max", "max"), ("cpu.cfs_quota_us", "-1")])
        return
    os.makedirs(path, exist_ok=True)
    period = 100_000
    if os.path.exists(os.path.join(path, "cpu.max")):
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{int(cpus * period)} {period}")
    else:
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(cpus * period)))


def _memory_cgroup(tb_name: str, host: str) -> tuple[str, bool] | None:
    """The node's memory cgroup directory and whether it is cgroup v2; None without a memory controller."""
    if os.path.isfile("/sys/fs/cgroup/memory/memory.limit_in_bytes") or \
            os.path.isdir("/sys/fs/cgroup/memory") and os.path.isfile("/sys/fs/cgroup/memory/cgroup.procs"):
        return os.path.join("/sys/fs/cgroup/memory", f"{tb_name}-{host}"), False
    if os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        with open("/sys/fs/cgroup/cgroup.controllers") as f:
            if "memory" in f.read().split():
                return os.path.join("/sys/fs/cgroup", f"{tb_name}-{host}"), True
    return None


def limit_memory(tb: Testbed, host: str, nbytes: int) -> None:
    """Give every process started on ``host`` from now on at most ``nbytes`` of memory in total (a
    memory cgroup: a board with less RAM); ``nbytes=0`` lifts it. cgroup v1 (``memory.limit_in_bytes``)
    or v2 (``memory.max``). The shim puts what it starts into the node's cgroup::

        testbed.limit_memory(tb, "node02", 800 * 2**20)   # node02 is now an 800 MiB board
    """
    tb.index(host)
    found = _memory_cgroup(tb.name, host)
    if found is None:
        raise TestbedError("no cgroup memory controller at /sys/fs/cgroup: cannot limit a node's memory here")
    path, v2 = found
    if nbytes <= 0:
        # v1 wants memsw >= the limit at every moment: memsw is raised first
        _remove_cgroup(path, [("memory.max", "max"), ("memory.swap.max", "max"),
                              ("memory.memsw.limit_in_bytes", "-1"), ("memory.limit_in_bytes", "-1")])
        return
    if v2:  # the controller must be enabled for the children of the root
        with contextlib.suppress(OSError), open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
            f.write("+memory")
    os.makedirs(path, exist_ok=True)
    if v2:
        for knob, value in (("memory.max", str(int(nbytes))), ("memory.swap.max", "0")):
            with contextlib.suppress(OSError), open(os.path.join(path, knob), "w") as f:
                f.write(value)
    else:
        # a board has no swap to fall back on (where the kernel accounts swap at all); memsw must stay
        # >= the limit, so it is written on both sides of it (raising and lowering both work)
        memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
        for knob in (memsw, os.path.join(path, "memory.limit_in_bytes"), memsw):
            with contextlib.suppress(OSError), open(knob, "w") as f:
                f.write(str(int(nbytes)))
        with open(os.path.join(path, "memory.limit_in_bytes")) as f:
            if int(f.read()) > nbytes:
                raise TestbedError(f"cannot set {path}/memory.limit_in_bytes to {nbytes}")
