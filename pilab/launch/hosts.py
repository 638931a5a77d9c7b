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
inside an allocation: :func:`pilab.launch.hosts.place`). A machine the host list names more than once -- the
same name twice, or its name and its address, or two aliases -- gets the ranks of every line that names
it: :func:`machines` finds them (by what each probe answered: the host's own name and its address on the
hosts' network) and :func:`ranks_on` counts them, which is what the memory and CPU checks then assume.
The run the doctor checks has ``ranks_per_node`` ranks on every line; a machine that gets another count
fails this check, naming the count and the names it goes by. Inside an allocation the doctor also asks
Slurm for each node's state: a node drained or down keeps the job's ranks from starting there (or Slurm
ends them)::

    placement_checks([("node01", 2), ("node02", 2)], ranks_per_node=2)   # {"node01": {"ok": True, ...}}
    ranks_on([("10.0.0.11", 2), ("node01", 2)], 2, probes)                # {"10.0.0.11": 4, "node01": 4}
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess

__all__ = ["HostsError", "check_host", "read_hostfile", "parse_hosts", "expand_nodelist", "expand_tasks",
           "allocation", "in_allocation", "place", "total_slots", "placement_checks", "slurm_states", "machines",
           "ranks_on"]


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


def _address(name: str) -> str | None:
    """``name`` as an IPv4 address (itself, or what it resolves to here), None where it does not resolve."""
    try:
        return str(ipaddress.IPv4Address(name))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return None


def machines(hosts: list[tuple[str, int]], probes: dict | None = None) -> list[list[str]]:
    """The machines ``hosts`` names: each a list of the distinct names it goes by, in the order they first
    appear. Two names are one machine where their probes (``probes``: name -> the host probe's answer, None
    for a host that did not answer) gave the same host name and the same address toward the head (boards
    may all be called "raspberrypi"; their addresses differ), or where a name resolves, or is, an address
    another one's probe answered from::

        machines([("10.0.0.11", 2), ("node01", 2), ("node02", 2)], probes)   # [["10.0.0.11", "node01"], ["node02"]]
    """
    probes = probes or {}
    groups: list[list[str]] = []
    keys: list[set] = []
    for name in dict.fromkeys(h for h, _ in hosts):
        p = probes.get(name) or {}
        addr = (p.get("iface") or {}).get("address")
        mine = {("addr", a) for a in (addr, _address(name)) if a}
        if p.get("hostname") and addr:
            mine.add(("probe", p["hostname"], addr))
        mine.add(("name", name))
        for g, k in zip(groups, keys):
            if k & mine:
                g.append(name)
                k |= mine
                break
        else:
            groups.append([name])
            keys.append(mine)
    return groups


def ranks_on(hosts: list[tuple[str, int]], ranks_per_node: int, probes: dict | None = None) -> dict[str, int]:
    """name -> the ranks its machine gets in a run of ``ranks_per_node`` ranks on every line of ``hosts``
    (Hydra's placement, :func:`pilab.launch.hosts.place`), summed over every line that names that machine."""
    np_ = ranks_per_node * len(hosts)
    try:
        landed = place(hosts, np_)
    except HostsError:  # fewer slots than the run's ranks: show where the slots there are go
        landed = place(hosts, total_slots(hosts))
    per_name: dict[str, int] = {}
    for host, n in landed:
        per_name[host] = per_name.get(host, 0) + n
    out = {}
    for group in machines(hosts, probes):
        total = sum(per_name.get(h, 0) for h in group)
        out.update({h: total for h in group})
    return out


def placement_checks(hosts: list[tuple[str, int]], ranks_per_node: int, *, env: dict | None = None,
                     probes: dict | None = None) -> dict:
    """One check per host name: the ranks MPI will put on its machine (every line naming it counted,
    :func:`ranks_on`) equal ``ranks_per_node``, and (inside a Slurm allocation) the node is neither drained
    nor down."""
    env = dict(os.environ if env is None else env)
    slurm = in_allocation(env)
    counts = ranks_on(hosts, ranks_per_node, probes)
    named = {h: g for g in machines(hosts, probes) for h in g}
    lines = {h: sum(1 for x, _ in hosts if x in named[h]) for h in named}
    slots = {h: sum(s for x, s in hosts if x in named[h]) for h in named}
    states = slurm_states(list(named), env) if slurm else {}
    out = {}
    for host in named:
        n = counts.get(host, 0)
        state, reason = states.get(host, ("", ""))
        also = [x for x in named[host] if x != host]
        listed = f"listed {lines[host]} times" + (f" (also as {', '.join(also)})" if also else "")
        if any(s in state for s in BAD_STATES):
            out[host] = {"ok": False, "detail": f"Slurm says {host} is {state}" + (f" ({reason})" if reason else ""),
                         "fix": f"fix what the reason says, then `scontrol update nodename={host} state=resume`; "
                                f"or run without it (salloc/sbatch --exclude {host})"}
        elif lines[host] > 1 and n != ranks_per_node:
            out[host] = {"ok": False, "detail": f"MPI puts {n} ranks on this machine, {listed}, {slots[host]} "
                                                f"slot(s) in all; the memory and CPU checks count {n}",
                         "fix": f"name each machine once, with its slots ('{named[host][0]}:{ranks_per_node}' "
                                "in the hostfile)"}
        elif n != ranks_per_node:
            out[host] = {"ok": False, "detail": f"MPI puts {n} rank(s) here ({slots[host]} slot(s)); the memory "
                                                f"and CPU checks count {n}, the run assumed {ranks_per_node}",
                         "fix": _fix_slots(host, ranks_per_node, slurm)}
        else:
            out[host] = {"ok": True, "detail": f"{n} ranks here, as checked" + (f", {listed}" if lines[host] > 1 else "")
                         + (f"; Slurm: {state}" if state else ""), "fix": ""}
    return out
