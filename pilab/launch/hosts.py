"""Hosts and slots: one structure, ``[(host, slots), ...]`` in rank order, from wherever a cluster says
it -- an MPICH hostfile, a ``--hosts`` list, or a Slurm allocation::

    hosts.read_hostfile("profiles/profile_pi/hosts")         # [("pi01", 2), ("pi02", 2), ...]
    hosts.parse_hosts("pi01,pi02", slots=2)                  # [("pi01", 2), ("pi02", 2)]
    hosts.allocation()                                       # inside salloc/sbatch: [("node01", 2), ...]
    hosts.place(hosts.allocation(), 3)                       # [("node01", 2), ("node02", 1)]

``place`` is where ranks land: hosts filled in order, each up to its slots, as Hydra's hostfile
placement and Slurm's block distribution both do. Loads nothing heavy (no torch, no MPI).

Where the ranks will land, and whether Slurm will let them: one check per host (``placement``).

MPI fills the hosts in order, each up to its slots (Hydra with a hostfile; Slurm's block distribution
inside an allocation: :func:`pilab.launch.hosts.place`). The memory and CPU checks assume ``ranks_per_node``
ranks on every host; a host given fewer or more slots gets another count, and its checks were about a
different run. Inside an allocation the doctor also asks Slurm for each node's state: a node drained or
down keeps the job's ranks from starting there (or Slurm ends them)::

    placement_checks([("node01", 2), ("node02", 2)], ranks_per_node=2)   # {"node01": {"ok": True, ...}}
"""
from __future__ import annotations

import os
import re
import subprocess

__all__ = ["HostsError", "read_hostfile", "parse_hosts", "expand_nodelist", "expand_tasks", "allocation",
           "in_allocation", "place", "total_slots", "placement_checks", "slurm_states"]


class HostsError(ValueError):
    """A hostfile, host list or allocation that cannot be read, or too few slots; the message names the
    fix (the CLI exits 2)."""


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """``[(host, slots), ...]`` from an MPICH hostfile (``host:slots`` lines, ``#`` comments)."""
    if not os.path.isfile(path):
        raise HostsError(f"hostfile {path} does not exist; give an MPICH hostfile (host:slots lines), "
                         "e.g. a copy of profiles/profile_pi/hosts.template")
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            host, _, slots = line.partition(":")
            if not host.strip() or (slots.strip() and not slots.strip().isdigit()):
                raise HostsError(f"hostfile {path} line {n}: {line!r} is not host or host:slots")
            out.append((host.strip(), int(slots) if slots.strip() else 1))
    if not out:
        raise HostsError(f"hostfile {path} lists no hosts; add lines such as 'pi01:2'")
    return out


def parse_hosts(text: str, slots: int = 1) -> list[tuple[str, int]]:
    """``"a,b"`` (or ``"a:2,b:2"``) -> [(a, 2), (b, 2)]."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        host, _, s = item.partition(":")
        if s and not s.isdigit():
            raise HostsError(f"--hosts {text!r}: {item!r} is not host or host:slots")
        out.append((host, int(s) if s else slots))
    if not out:
        raise HostsError(f"--hosts {text!r} names no host; give e.g. --hosts pi01,pi02")
    return out


def total_slots(hosts: list[tuple[str, int]]) -> int:
    return sum(s for _, s in hosts)


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``"a[1-2],b"`` -> ["a[1-2]", "b"]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [x for x in [*out, cur] if x]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list -> names: ``"node[01-03,07],login1"`` -> node01, node02, node03,
    node07, login1 (zero padding kept, as ``scontrol show hostnames`` does)."""
    names = []
    for part in _split_top(text.strip()):
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", part)
        if not m:
            names.append(part)
            continue
        head, ranges, tail = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise HostsError(f"Slurm node list {text!r}: cannot read {r!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                names.extend(f"{head}{i:0{len(lo)}d}{t}" for t in expand_nodelist(tail) or [""])
    return names


def expand_tasks(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` -> one count per node: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise HostsError(f"SLURM_TASKS_PER_NODE={text!r}: cannot read {part!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def in_allocation(env: dict | None = None) -> bool:
    """True inside a Slurm allocation (an ``salloc`` shell, an ``sbatch`` script, a job step)."""
    env = os.environ if env is None else env
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST"))


def allocation(env: dict | None = None) -> list[tuple[str, int]] | None:
    """The allocation's ``[(node, tasks), ...]`` from ``SLURM_JOB_NODELIST`` and
    ``SLURM_TASKS_PER_NODE`` (``SLURM_JOB_CPUS_PER_NODE`` when no task count was asked); None outside
    one."""
    env = os.environ if env is None else env
    if not in_allocation(env):
        return None
    nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
    per = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE") or "1"
    counts = expand_tasks(per)
    if len(counts) != len(nodes):
        raise HostsError(f"allocation: {len(nodes)} nodes ({env['SLURM_JOB_NODELIST']}) but tasks per node "
                         f"{per!r}; ask Slurm for whole nodes, e.g. salloc -N 2 --ntasks-per-node 2")
    return list(zip(nodes, counts))


def place(hosts: list[tuple[str, int]], np_: int) -> list[tuple[str, int]]:
    """Where ``np_`` ranks land: hosts filled in order up to their slots (Hydra's hostfile placement,
    Slurm's block distribution). Raises when the slots are fewer than ``np_``."""
    have = total_slots(hosts)
    if np_ > have:
        raise HostsError(f"{np_} ranks but only {have} slots on {len(hosts)} host(s); lower --np or ask for "
                         "more (a hostfile's host:slots, salloc -N/--ntasks-per-node)")
    out, left = [], np_
    for host, slots in hosts:
        if left <= 0:
            break
        out.append((host, min(slots, left)))
        left -= slots
    return out



BAD_STATES = ("drain", "down", "fail", "not_responding", "maint", "reboot", "unknown")


def slurm_states(nodes: list[str], env: dict | None = None) -> dict[str, tuple[str, str]]:
    """``{node: (state, reason)}`` from ``sinfo`` (long state names: "allocated", "draining", ...);
    empty when sinfo cannot answer."""
    try:
        p = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T|%E"],
                           capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in p.stdout.splitlines():
        node, state, reason = (line.split("|") + ["", ""])[:3]
        out[node.strip()] = (state.strip().lower(), "" if reason.strip() == "none" else reason.strip())
    return out


def _fix_slots(host: str, rpn: int, slurm: bool) -> str:
    return (f"ask Slurm for {rpn} tasks on every node (salloc/sbatch --ntasks-per-node {rpn})" if slurm
            else f"give every host {rpn} slots ('{host}:{rpn}' in the hostfile), or --ranks-per-node to match")


def placement_checks(hosts: list[tuple[str, int]], ranks_per_node: int, *, env: dict | None = None) -> dict:
    """One check per host: the ranks MPI will put there equal ``ranks_per_node``, and (inside a Slurm
    allocation) the node is neither drained nor down."""
    env = dict(os.environ if env is None else env)
    slurm = in_allocation(env)
    np_ = ranks_per_node * len(hosts)
    try:
        landed = dict(place(hosts, np_))
    except HostsError:  # fewer slots than the run's ranks: show where the slots there are go
        landed = dict(place(hosts, total_slots(hosts)))
    states = slurm_states([h for h, _ in hosts], env) if slurm else {}
    out = {}
    for host, slots in hosts:
        n = landed.get(host, 0)
        state, reason = states.get(host, ("", ""))
        if any(s in state for s in BAD_STATES):
            out[host] = {"ok": False, "detail": f"Slurm says {host} is {state}" + (f" ({reason})" if reason else ""),
                         "fix": f"fix what the reason says, then `scontrol update nodename={host} state=resume`; "
                                f"or run without it (salloc/sbatch --exclude {host})"}
        elif n != ranks_per_node:
            out[host] = {"ok": False, "detail": f"MPI puts {n} rank(s) here ({slots} slot(s)); the memory and "
                                                f"CPU checks assumed {ranks_per_node}",
                         "fix": _fix_slots(host, ranks_per_node, slurm)}
        else:
            out[host] = {"ok": True, "detail": f"{n} ranks here, as checked" + (f"; Slurm: {state}" if state else ""),
                         "fix": ""}
    return out
