"""A node's processes and its cgroups: what runs on each node (``processes``, ``ps``), a slower board
(``throttle``: a CPU quota, also while a job runs; ``quota`` reads it) and a smaller one (``limit_memory``).

A node's link: pulled or put back (``link``), slowed (``shape``), and the bytes it carried (``traffic``).
"""
from __future__ import annotations

import contextlib
import os
import time

from ..files import save_json
from .nodes import NODE_IFACE, Testbed, TestbedError, parse_rate, run_cmd, tc_shape


def processes(tb: Testbed) -> dict:
    """Pids still running on each node (for 'no orphan processes' checks)."""
    return {h: [int(p) for p in run_cmd("ip", "netns", "pids", tb.netns(h), check=False).stdout.split()]
            for h in tb.hosts}


def ps(tb: Testbed) -> str:
    """What runs on each node, one line a process: pid, state, what it waits in (wchan), CPU seconds,
    its cgroups' limits, the command. For a job that does not end: which process holds it up, where::

        print(testbed.ps(tb))     # node02 12345 S futex_wait_queue 3.1s threads=3 cpus=0.15 python -m pilab...
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
            cpus = quota(tb, host)
            limit = "" if cpus is None else f" cpus={cpus:g}"
            lines.append(f"{host} {pid} {stat[0]} {wchan} {cpu_s:.1f}s threads={threads}{limit} {cmd}")
    return "\n".join(lines) or "(no process on any node)"


def _cpu_root() -> tuple[str, bool] | None:
    """(root, is v2) of the cgroup tree with the cpu controller: v1's cpu hierarchy, else the v2 tree
    (hybrid's /sys/fs/cgroup/unified, then pure v2's /sys/fs/cgroup); None without one."""
    if os.path.isfile("/sys/fs/cgroup/cpu/cpu.cfs_period_us"):
        return "/sys/fs/cgroup/cpu", False
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return root, True
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


def cpu_quota(name: str, cpus: float, pids=()) -> str:
    """Make the cgroup ``name`` (under the cpu controller's root, v1 or v2) allow at most ``cpus`` cores
    in total, move ``pids`` into it and return its directory; ``cpus=0`` lifts the quota and removes
    the group (what is still in it goes back to the parent). A process joins by writing its pid to
    ``<dir>/cgroup.procs``; one already running slows down at once::

        cg = cpu_quota("pilab-slow", 0.5)          # then: echo $$ > {cg}/cgroup.procs && exec ...
        cpu_quota("pilab-slow", 0)
    """
    found = _cpu_root()
    if found is None:
        raise TestbedError("no cgroup cpu controller at /sys/fs/cgroup (v1's cpu, or v2 with cpu in "
                           "cgroup.controllers): cannot set a CPU quota here")
    root, v2 = found
    path = os.path.join(root, name)
    if cpus <= 0:
        _remove_cgroup(path, [("cpu.max", "max"), ("cpu.cfs_quota_us", "-1")])
        return path
    if v2:  # the controller must be enabled for the root's children
        with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
            f.write("+cpu")
    try:
        os.makedirs(path, exist_ok=True)
        period = 100_000
        quota = max(1000, int(cpus * period))  # the kernel's least quota is 1 ms a period
        knobs = [("cpu.max", f"{quota} {period}")] if v2 else \
            [("cpu.cfs_period_us", str(period)), ("cpu.cfs_quota_us", str(quota))]
        for knob, value in knobs:
            with open(os.path.join(path, knob), "w") as f:
                f.write(value)
    except OSError as e:
        raise TestbedError(f"cannot set a CPU quota at {path} ({e.strerror}): run as root") from None
    for pid in pids:
        with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid))  # gone meanwhile: nothing to slow down
    return path


def throttle(tb: Testbed, host: str, cpus: float) -> None:
    """Give ``host`` at most ``cpus`` cores in total from now on (a CPU quota: a slower or hotter board);
    ``cpus=0`` lifts it. What already runs there is moved under the quota too, so a node can be slowed
    (or freed) while a job runs; what the shim starts later joins it::

        testbed.throttle(tb, "node02", 0.5)    # node02 is now half a core
        testbed.throttle(tb, "node02", 0)      # and the whole machine again
    """
    tb.index(host)
    cpu_quota(f"{tb.name}-{host}", cpus, processes(tb)[host] if cpus > 0 else ())


def quota(tb: Testbed, host: str) -> float | None:
    """The cores ``host`` may use (its ``throttle``), None when it has no quota."""
    found = _cpu_root()
    if found is None:
        return None
    path, v2 = os.path.join(found[0], f"{tb.name}-{host}"), found[1]
    try:
        if v2:
            with open(os.path.join(path, "cpu.max")) as f:
                q, per = f.read().split()
            return None if q == "max" else int(q) / int(per)
        with open(os.path.join(path, "cpu.cfs_quota_us")) as f, open(os.path.join(path, "cpu.cfs_period_us")) as g:
            q, per = int(f.read()), int(g.read())
        return None if q <= 0 else q / per
    except (OSError, ValueError):
        return None


def memory_cgroup(tb_name: str, host: str) -> tuple[str, bool] | None:
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
    found = memory_cgroup(tb.name, host)
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


# ----------------------------------------------------------------------------------------------
# faults and measurements
# ----------------------------------------------------------------------------------------------
def link(tb: Testbed, host: str, state: str) -> None:
    """Take ``host``'s link down or up (``state`` = "down" | "up"): its cable pulled or put back."""
    if state not in ("up", "down"):
        raise TestbedError(f"link state {state!r}: up or down")
    run_cmd("ip", "link", "set", tb.veth(host), state)


def shape(tb: Testbed, host: str, rate: str) -> Testbed:
    """Set ``host``'s link rate (both directions), e.g. 10x slower for a straggler; returns the new
    Testbed (also saved, so ``status`` shows it)."""
    parse_rate(rate)
    tc_shape(tb.veth(host), rate)
    tc_shape(NODE_IFACE, rate, ns=tb.netns(host))
    new = Testbed(**{**tb.to_dict(), "rates": {**tb.rates, host: rate}})
    save_json(new.to_dict(), os.path.join(tb.state_dir, "testbed.json"))
    return new


def traffic(tb: Testbed) -> dict:
    """Bytes each node has sent and received on its link, and on its own loopback::

        before = testbed.traffic(tb); ...; after = testbed.traffic(tb)
    """
    out = {}
    for h in tb.hosts:
        stats = {}
        for dev, key in ((NODE_IFACE, "link"), ("lo", "lo")):
            p = run_cmd("cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
                     f"/sys/class/net/{dev}/statistics/rx_bytes", ns=tb.netns(h), check=False)
            vals = [int(v) for v in p.stdout.split()] or [0, 0]
            stats[f"{key}_tx"], stats[f"{key}_rx"] = vals[0], vals[-1]
        out[h] = stats
    return out


def traffic_delta(before: dict, after: dict) -> dict:
    return {h: {k: after[h][k] - before[h].get(k, 0) for k in after[h]} for h in after}
