"""Hosts and slots: one structure, ``[(host, slots), ...]`` in rank order, from wherever a cluster says
it -- an MPICH hostfile, a ``--hosts`` list, or a Slurm allocation::

    hosts.read_hostfile("profiles/profile_pi/hosts")         # [("pi01", 2), ("pi02", 2), ...]
    hosts.parse_hosts("pi01,pi02", slots=2)                  # [("pi01", 2), ("pi02", 2)]
    hosts.allocation()                                       # inside salloc/sbatch: [("node01", 2), ...]
    hosts.place(hosts.allocation(), 3)                       # [("node01", 2), ("node02", 1)]

``place`` is where ranks land: hosts filled in order, each up to its slots, as Hydra's hostfile
placement and Slurm's block distribution both do. Loads nothing heavy (no torch, no MPI).
"""
from __future__ import annotations

import os
import re

__all__ = ["HostsError", "check_host", "read_hostfile", "parse_hosts", "expand_nodelist", "expand_tasks",
           "allocation", "in_allocation", "place", "total_slots"]


class HostsError(ValueError):
    """A hostfile, host list or allocation that cannot be read, or too few slots; the message names the
    fix (the CLI exits 2)."""


# A host name or IPv4 address, as Hydra hands it to `ssh HOST`: letters, digits, '.', '_' and '-', not
# starting with '-' (ssh would take it for an option) and nothing a shell would read (';', '$', spaces...).
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def check_host(host: str, where: str) -> str:
    """``host`` if it is a plain host name or address, else HostsError naming ``where`` it came from::

        check_host("pi01", "--hosts")          # "pi01"
        check_host("-oProxyCommand=x", "--hosts")   # HostsError
    """
    if not _HOST.match(host or "") or len(host) > 253:
        raise HostsError(f"{where}: {host!r} is not a host name or address (letters, digits, '.', '_', '-'; "
                         "not starting with '-'); give the node's name or IPv4 address")
    return host


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
            out.append((check_host(host.strip(), f"hostfile {path} line {n}"), int(slots) if slots.strip() else 1))
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
        out.append((check_host(host, f"--hosts {text!r}"), int(s) if s else slots))
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
    nodes = [check_host(n, "SLURM_JOB_NODELIST") for n in expand_nodelist(env["SLURM_JOB_NODELIST"])]
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
