"""Allreduce schedules, simulated round by round, and their alpha-beta cost on a Cluster.

    from pilab.perfmodel import allreduce_rounds, allreduce_time, pi4b_cluster
    allreduce_rounds(4, 1e6, "rabenseifner")        # 4 rounds of (src, dst, bytes, reduce_bytes) flows
    allreduce_time(4e6, 48, pi4b_cluster())         # seconds for one 4 MB Allreduce over 48 Pi ranks
    allreduce_phases(4e6, 48, pi4b_cluster())       # the same, split into intra- and inter-node phases
"""
from __future__ import annotations

import functools

from ..config import ConfigError
from .machine import ALGORITHMS, ELEMENT_BYTES, Cluster


def _pof2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _fold(p: int):
    """MPICH's non-power-of-two fold: (pof2, rem, newrank -> rank)."""
    pof2 = _pof2(p)
    rem = p - pof2

    def real(newrank: int) -> int:
        return 2 * newrank + 1 if newrank < rem else newrank + rem
    return pof2, rem, real


def allreduce_rounds(p: int, nbytes: float, algorithm: str, ranks_per_node: int = 0,
                     short_msg_bytes: int = 2048) -> list[list[tuple[int, int, float, float]]]:
    """The rounds of one Allreduce of ``nbytes`` per rank over ``p`` ranks.

    Each round is a list of flows ``(src, dst, bytes, reduce_bytes)``; the flows of a round run at once
    and the next round starts when the slowest ends. Schedules follow MPICH's implementations
    (``MPIR_Allreduce_intra_recursive_doubling``, ``..._reduce_scatter_allgather``, ring), including the
    fold that handles a non-power-of-two ``p``.

        allreduce_rounds(4, 1e6, "rabenseifner")   # 2 halving rounds + 2 doubling rounds
    """
    if p <= 1 or nbytes <= 0:
        return []
    if algorithm == "mpich":
        count = nbytes / ELEMENT_BYTES
        algorithm = "recursive_doubling" if (nbytes <= short_msg_bytes or count < _pof2(p)) \
            else "rabenseifner"
    rounds: list[list[tuple[int, int, float, float]]] = []
    if algorithm == "ring":
        chunk = nbytes / p
        flows_r = [(r, (r + 1) % p, chunk, chunk) for r in range(p)]
        flows_g = [(r, (r + 1) % p, chunk, 0.0) for r in range(p)]
        return [flows_r] * (p - 1) + [flows_g] * (p - 1)
    if algorithm == "hierarchical":
        return _hierarchical_rounds(p, nbytes, ranks_per_node, short_msg_bytes)
    if algorithm not in ("recursive_doubling", "rabenseifner"):
        raise ConfigError(f"algorithm={algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    pof2, rem, real = _fold(p)
    if rem:  # even ranks below 2*rem hand their data to the odd neighbour and sit out
        rounds.append([(r, r + 1, nbytes, nbytes) for r in range(0, 2 * rem, 2)])
    if algorithm == "recursive_doubling":
        mask = 1
        while mask < pof2:
            rounds.append([(real(n), real(n ^ mask), nbytes, nbytes) for n in range(pof2)])
            mask <<= 1
    else:  # reduce-scatter by recursive halving, then allgather by recursive doubling
        sizes, mask, size = [], 1, nbytes
        while mask < pof2:
            size /= 2
            rounds.append([(real(n), real(n ^ mask), size, size) for n in range(pof2)])
            sizes.append((mask, size))
            mask <<= 1
        for mask, size in reversed(sizes):
            rounds.append([(real(n), real(n ^ mask), size, 0.0) for n in range(pof2)])
    if rem:
        rounds.append([(r + 1, r, nbytes, 0.0) for r in range(0, 2 * rem, 2)])
    return rounds


def _hierarchical_rounds(p: int, nbytes: float, ranks_per_node: int, short_msg_bytes: int) -> list:
    """MPICH ch4's node-aware composition: reduce to a node leader, leaders allreduce, bcast."""
    rounds: list[list[tuple[int, int, float, float]]] = []
    rpn = ranks_per_node or p
    nodes = [list(range(s, min(s + rpn, p))) for s in range(0, p, rpn)]
    local = max(len(n) for n in nodes)
    dist = 1
    while dist < local:  # binomial reduce inside each node
        rounds.append([(n[i + dist], n[i], nbytes, nbytes) for n in nodes
                       for i in range(0, len(n), 2 * dist) if i + dist < len(n)])
        dist *= 2
    leaders = [n[0] for n in nodes]
    inner = allreduce_rounds(len(leaders), nbytes, "mpich", 0, short_msg_bytes)
    rounds += [[(leaders[s], leaders[d], b, rb) for s, d, b, rb in rnd] for rnd in inner]
    bc = []
    while dist > 1:  # binomial bcast back
        dist //= 2
        bc.append([(n[i], n[i + dist], nbytes, 0.0) for n in nodes
                   for i in range(0, len(n), 2 * dist) if i + dist < len(n)])
    return rounds + bc


def _round_time(flows, cluster: Cluster, p: int) -> float:
    node = [cluster.node_of(r, p) for r in range(p)]
    egress: dict[int, int] = {}
    ingress: dict[int, int] = {}
    for s, d, _, _ in flows:
        if node[s] != node[d]:
            egress[node[s]] = egress.get(node[s], 0) + 1
            ingress[node[d]] = ingress.get(node[d], 0) + 1
    worst = 0.0
    for s, d, b, rb in flows:
        if node[s] == node[d]:
            t = cluster.intra.alpha + b * cluster.intra.beta
        else:
            share = max(egress[node[s]], ingress[node[d]])
            t = cluster.inter.alpha + b * cluster.inter.beta * share
        worst = max(worst, t + rb * cluster.gamma)
    return worst


def _timed_rounds(nbytes: float, p: int, cluster: Cluster, algorithm: str | None,
                  oversubscribed: bool) -> tuple[float, list[tuple[bool, float]]]:
    """(the oversubscription's extra seconds, [(crosses nodes, seconds) per round]) of one Allreduce:
    what ``allreduce_time`` adds up and ``allreduce_phases`` splits by link."""
    rounds = allreduce_rounds(p, nbytes, algorithm or cluster.algorithm, cluster.ranks_per_node,
                              cluster.short_msg_bytes)
    node = [cluster.node_of(r, p) for r in range(p)]
    cache: dict[int, tuple[bool, float]] = {}
    out = []
    for rnd in rounds:  # ring repeats one round object 2(p-1) times: time it once
        key = id(rnd)
        if key not in cache:
            cache[key] = (any(node[s] != node[d] for s, d, _, _ in rnd), _round_time(rnd, cluster, p))
        out.append(cache[key])
    return (len(rounds) * cluster.oversub_alpha if oversubscribed else 0.0), out


@functools.lru_cache(maxsize=65536)
def allreduce_time(nbytes: float, p: int, cluster: Cluster, algorithm: str | None = None,
                   oversubscribed: bool = False) -> float:
    """Seconds for one Allreduce of ``nbytes`` per rank over ``p`` ranks of ``cluster``
    (``oversubscribed``: more ranks than cores on a node, each round pays ``cluster.oversub_alpha``)."""
    total, rounds = _timed_rounds(nbytes, p, cluster, algorithm, oversubscribed)
    for _, t in rounds:
        total += t
    return total


def allreduce_phases(nbytes: float, p: int, cluster: Cluster, algorithm: str | None = None,
                     oversubscribed: bool = False) -> list[tuple[str, float]]:
    """The same Allreduce as ``allreduce_time``, as its consecutive phases: ("intra" | "inter", seconds),
    a phase being a run of rounds that stay inside the nodes or cross them (what a predicted trace draws)::

        allreduce_phases(4e6, 48, pi4b_cluster())   # [("intra", ...), ("inter", ...), ("intra", ...)]
    """
    extra, rounds = _timed_rounds(nbytes, p, cluster, algorithm, oversubscribed)
    each = extra / len(rounds) if rounds else 0.0
    phases: list[list] = []
    for crosses, t in rounds:
        kind = "inter" if crosses else "intra"
        if phases and phases[-1][0] == kind:
            phases[-1][1] += t + each
        else:
            phases.append([kind, t + each])
    return [(k, t) for k, t in phases]


def critical_counts(p: int, nbytes: float, algorithm: str, short_msg_bytes: int = 2048):
    """(rounds, bytes on the critical path) on one flat link: the alpha and beta coefficients."""
    rounds = allreduce_rounds(p, nbytes, algorithm, 0, short_msg_bytes)
    return len(rounds), sum(max(b for _, _, b, _ in rnd) for rnd in rounds)
