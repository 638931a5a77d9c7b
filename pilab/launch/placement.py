"""Where the ranks will land, and whether Slurm will let them: one check per host (``placement``).

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
import socket
import subprocess

from .hosts import HostsError, in_allocation, place, total_slots

__all__ = ["placement_checks", "slurm_states", "machines", "ranks_on"]

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
