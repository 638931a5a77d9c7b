"""Where the ranks will land, and whether Slurm will let them: one check per host (``placement``).

MPI fills the hosts in order, each up to its slots (Hydra with a hostfile; Slurm's block distribution
inside an allocation: :func:`pilab.launch.hosts.place`). The memory and CPU checks assume ``ranks_per_node``
ranks on every host; a host given fewer or more slots gets another count, and its checks were about a
different run. Inside an allocation the doctor also asks Slurm for each node's state: a node drained or
down keeps the job's ranks from starting there (or Slurm ends them)::

    placement_checks([("node01", 2), ("node02", 2)], ranks_per_node=2)   # {"node01": {"ok": True, ...}}
"""
from __future__ import annotations

import os
import subprocess

from .hosts import HostsError, in_allocation, place, total_slots

__all__ = ["placement_checks", "slurm_states"]

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
