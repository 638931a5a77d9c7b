"""Performance model: time per epoch at any np, from an np=1 run and an Allreduce micro-benchmark.

Calibrate on your machine, then predict (everything returns dicts / lists of dicts)::

    python -m pilab train --width 0.25 --train-subset 960 --test-subset 200 --epochs 1 --threads 1 \\
        --out runs/np1                                                   # the np=1 run
    python -m pilab perfmodel bench --np 2 3          # launches mpiexec; runs/perfmodel/comm_bench.json
    python -m pilab perfmodel calibrate --result runs/np1/result.json \\
        --bench runs/perfmodel/comm_bench.json        # -> runs/perfmodel/calibration.json
    python -m pilab perfmodel table --calibration runs/perfmodel/calibration.json --nps 1 2 3 --width 0.25 ...
    python -m pilab perfmodel table --published       # the Pi table beside the published figures

    from pilab import perfmodel
    cal = perfmodel.calibrate(json.load(open("runs/np1/result.json")),
                              json.load(open("runs/perfmodel/comm_bench.json")))
    perfmodel.predict(Config(width=0.25), 2, cal)                      # one dict
    perfmodel.predict_table(Config(), [2, 4, 8, 48], "pi4b_cluster", "naive", baseline_np=2)
    perfmodel.pi_table()                                                # both profiles + published figures

The model, per optimizer step on every rank (synchronous, so the slowest rank sets the pace):

    step = data + compute + straggler + exposed comm + overhead
    compute   = (per-step work + per-rank batch x work per image) / rate (at the rank's threads,
                slowed by oversubscription); work = FLOPs + a memory-bound term per activation element,
                rate from the np=1 run
    straggler = E[max of np normal draws] x compute x cv  (per-step jitter measured at np=1)
    comm      = alpha-beta cost of each Allreduce, simulated round by round over the real schedule
                (ring | recursive doubling | Rabenseifner | MPICH's choice by message size), with
                block placement of ranks on nodes: a round that crosses nodes pays the inter-node link,
                and flows that leave one node in the same round share its NIC.
    exposed   = pilab: fused buckets posted during backward, queued on the network; what does not fit
                behind the rest of backward (the last bucket plus any backlog) is exposed.
                naive: one blocking Allreduce per parameter tensor after backward: all exposed.
    epoch     = steps x step + evaluation (pilab: test set sharded over ranks; naive: every rank
                evaluates the whole test set)

See docs/perfmodel.md for the assumptions and the Raspberry Pi table.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "speedup", "efficiency", "karp_flatt", "PUBLISHED", "published_table",
    "Link", "Cluster", "Calibration", "allreduce_rounds", "allreduce_time", "ALGORITHMS",
    "comm_bench", "run_comm_bench", "fit_alpha_beta", "calibrate",
    "this_box", "pi4b_cluster", "cluster_from_calibration", "PRESETS", "resolve_cluster",
    "gradient_layout", "buckets_for", "work_per_image", "predict", "predict_table", "pi_table",
    "markdown_table", "add_cli", "FLOPS_PER_ACTIVATION_CPU", "STEP_WORK_PER_TENSOR_CPU",
]

# Stated modelling assumptions (docs/perfmodel.md explains each).
BACKWARD_FRACTION = 2 / 3  # backward ~ 2x the forward FLOPs: 2/3 of a step's compute
THREAD_EXPONENT = 0.8  # compute time ~ threads^-0.8 (intra-op scaling of small 32x32 convs)
ELEMENT_BYTES = 4  # fp32 gradients
METRIC_BYTES = 24  # pilab's per-step Allreduce of [loss sum, correct, stop vote] (float64)
# A CPU training step of these 32x32 networks is bound by memory traffic as much as by FLOPs: one
# activation element written by a layer costs about as much time as this many training FLOPs.
# Measured once on an x86 core with PyTorch's CPU build (benchmarks/bench_perfmodel.py --split prints
# the fit); it sets how compute time moves with width, not its level, which the np=1 run calibrates.
FLOPS_PER_ACTIVATION_CPU = 230.0
# Each step also pays a cost that does not grow with the batch (operator dispatch, autograd
# bookkeeping, the optimizer's per-tensor loops): ~20 ms per step for MobileNetV2 here at one thread,
# at every width. In the same work units, per parameter tensor of the model; it matters when the
# per-rank batch is small (a fixed global batch at large np). Measured like the constant above (fits
# over batches 4..64 and widths 0.25..1 gave 170-360 for the one above and 3-7e6 for this one).
STEP_WORK_PER_TENSOR_CPU = 5.0e6


# ----------------------------------------------------------------------------------------------
# scaling metrics (plain functions: the published figures are checked with them)
# ----------------------------------------------------------------------------------------------
def speedup(t_base: float, t: float) -> float:
    """S = t_base / t: how many times faster than the baseline run."""
    return t_base / t


def efficiency(S: float, p: int, p0: int = 1) -> float:
    """E = S * p0 / p: speedup per added process, against a baseline of ``p0`` processes."""
    return S * p0 / p


def karp_flatt(S: float, p: int, p0: int = 1) -> float:
    """Experimentally determined serial fraction e = (1/S - 1/n) / (1 - 1/n), n = p / p0.

    A serial fraction that grows with p points at overhead (communication, duplicated work);
    a constant one at a genuinely serial part. NaN at p == p0.
    """
    n = p / p0
    if n == 1:
        return float("nan")
    return (1 / S - 1 / n) / (1 - 1 / n)


# The original study: MobileNetV2 on CIFAR-10, 24 Raspberry Pi 4B nodes x 2 MPI ranks, 1 GbE,
# against a one-node baseline of p0 = 2 processes. Only these three figures were published.
PUBLISHED = {
    "baseline_np": 2,
    "rows": [
        {"np": 4, "efficiency": 0.909},
        {"np": 8, "efficiency": 0.523},
        {"np": 48, "speedup": 9.99, "efficiency": 0.416},
    ],
}


def published_table() -> list[dict]:
    """The published figures, each completed with E = S * p0 / p (or S = E * p / p0) and Karp-Flatt."""
    p0 = PUBLISHED["baseline_np"]
    out = []
    for row in PUBLISHED["rows"]:
        p = row["np"]
        S = row.get("speedup")
        E = row.get("efficiency")
        if S is None:
            S = E * p / p0
        computed_E = efficiency(S, p, p0)
        out.append({"np": p, "speedup": S, "efficiency": E if E is not None else computed_E,
                    "efficiency_from_speedup": computed_E, "karp_flatt": karp_flatt(S, p, p0),
                    "speedup_published": "speedup" in row})
    return out


# ----------------------------------------------------------------------------------------------
# the machine: links, nodes, compute rates
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """Cost of one message of n bytes on a link: alpha + n * beta seconds."""
    alpha: float  # seconds per message (latency)
    beta: float  # seconds per byte (1 / bandwidth)


ALGORITHMS = ("mpich", "ring", "recursive_doubling", "rabenseifner", "hierarchical")


@dataclass(frozen=True)
class Cluster:
    """Everything the model knows about a machine. ``this_box(cal)`` and ``pi4b_cluster()`` build one."""
    name: str
    nodes: int  # nodes available (0: as many as needed)
    ranks_per_node: int  # MPI ranks placed on one node, block placement (0: all ranks on one node)
    cores_per_node: int
    ref_threads: int  # torch threads per rank at which the rates below hold
    # achieved training GFLOP/s per rank (fwd + bwd + optimizer), at ref_threads, counting as "work"
    # the FLOPs plus flops_per_activation for each activation element (see work_per_image)
    train_gflops: float
    eval_gflops: float  # the same for the forward pass in evaluation (a third of the work)
    data_s_per_image: float  # batch augmentation + input conversion, per image
    step_overhead_s: float  # per-step time outside compute/data/comm (Python, .item(), logging)
    warmup_s: float  # one-time extra of the first step of a run (allocations)
    compute_cv: float  # coefficient of variation of per-step compute (jitter -> stragglers)
    intra: Link  # two ranks on one node (shared memory)
    inter: Link  # two nodes (NIC + switch); flows leaving one node in the same round share it
    gamma: float = 0.0  # seconds per byte to add two buffers (0: folded into beta by the fit)
    algorithm: str = "mpich"  # one of ALGORITHMS
    short_msg_bytes: int = 2048  # "mpich": recursive doubling up to this size, Rabenseifner above
    backward_fraction: float = BACKWARD_FRACTION
    overlap: float = 1.0  # fraction of the remaining backward that can hide posted buckets
    oversub_alpha: float = 0.0  # extra s per Allreduce round when a node has more ranks than cores
    available_cores: float = 0.0  # cores one job gets per node on a shared machine (0: all of them)
    flops_per_activation: float = 0.0  # memory-bound cost per activation element (0: FLOPs only)
    step_work_per_tensor: float = 0.0  # per-step work independent of the batch, per parameter tensor
    notes: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Cluster":
        d = dict(d)
        d["intra"] = Link(**d["intra"])
        d["inter"] = Link(**d["inter"])
        return cls(**d)

    def node_of(self, rank: int, np_: int) -> int:
        rpn = self.ranks_per_node or np_
        return rank // rpn


# ----------------------------------------------------------------------------------------------
# Allreduce schedules, simulated round by round
# ----------------------------------------------------------------------------------------------
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
        # MPICH ch4's node-aware composition: reduce to a node leader, leaders allreduce, bcast.
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
    if algorithm not in ("recursive_doubling", "rabenseifner"):
        raise ValueError(f"algorithm={algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
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


@functools.lru_cache(maxsize=65536)
def allreduce_time(nbytes: float, p: int, cluster: Cluster, algorithm: str | None = None,
                   oversubscribed: bool = False) -> float:
    """Seconds for one Allreduce of ``nbytes`` per rank over ``p`` ranks of ``cluster``
    (``oversubscribed``: more ranks than cores on a node, each round pays ``cluster.oversub_alpha``)."""
    rounds = allreduce_rounds(p, nbytes, algorithm or cluster.algorithm, cluster.ranks_per_node,
                              cluster.short_msg_bytes)
    cache: dict[int, float] = {}
    total = len(rounds) * cluster.oversub_alpha if oversubscribed else 0.0
    for rnd in rounds:  # ring repeats one round object 2(p-1) times: time it once
        key = id(rnd)
        if key not in cache:
            cache[key] = _round_time(rnd, cluster, p)
        total += cache[key]
    return total


def _critical_counts(p: int, nbytes: float, algorithm: str, short_msg_bytes: int = 2048):
    """(rounds, bytes on the critical path) on one flat link: the alpha and beta coefficients."""
    rounds = allreduce_rounds(p, nbytes, algorithm, 0, short_msg_bytes)
    return len(rounds), sum(max(b for _, _, b, _ in rnd) for rnd in rounds)


# ----------------------------------------------------------------------------------------------
# the micro-benchmark (runs under mpiexec) and the alpha-beta fit
# ----------------------------------------------------------------------------------------------
DEFAULT_SIZES = (4, 64, 1024, 16 * 1024, 128 * 1024, 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20)


def comm_bench(comm, sizes: Sequence[int] = DEFAULT_SIZES, *, trials: int = 5,
               min_time: float = 0.03, max_reps: int = 2000) -> dict:
    """Time ``Allreduce`` (in place, float32, SUM) of each size in bytes; call on every rank.

        mpiexec -n 2 python -c "from mpi4py import MPI; from pilab.perfmodel import comm_bench; \\
            print(comm_bench(MPI.COMM_WORLD))"

    Each trial repeats the call enough times to last ``min_time`` (the same count on every rank) and
    keeps the slowest rank's time per call; the median over ``trials`` is reported. Returns the same
    dict on every rank.
    """
    import numpy as np
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    hosts = comm.allgather(MPI.Get_processor_name())
    med, best = [], []
    for nbytes in sizes:
        buf = np.zeros(max(1, int(nbytes) // 4), dtype=np.float32)
        for _ in range(2):  # warm up: connections, registration
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Barrier()
        t = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        one = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
        reps = int(min(max_reps, max(1, min_time / max(one, 1e-7))))
        per = []
        for _ in range(trials):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(reps):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            per.append(comm.allreduce((time.perf_counter() - t) / reps, op=MPI.MAX))
        med.append(statistics.median(per))
        best.append(min(per))
    return {
        "np": size, "ranks_per_node": local, "cores": os.cpu_count(), "hosts": sorted(set(hosts)),
        "sizes_bytes": [int(s) for s in sizes], "seconds": med, "seconds_min": best,
        "trials": trials, "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                         MPI.THREAD_SERIALIZED: "serialized",
                         MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?"),
    }


def _bench_runs(bench) -> list[dict]:
    """Accept one comm_bench dict, a list of them, or run_comm_bench's {"runs": [...]}."""
    if isinstance(bench, Mapping) and "runs" in bench:
        return list(bench["runs"])
    if isinstance(bench, Mapping):
        return [dict(bench)]
    return list(bench)


def _oversubscribed(run: Mapping[str, Any]) -> bool:
    cores = run.get("cores")
    return bool(cores) and int(run.get("ranks_per_node", run["np"])) > int(cores)


def _wls(rows, use_alpha: bool = True, use_beta: bool = True):
    """Weighted (1/t: relative error) least squares of t ~ n_a*alpha + n_b*beta, both kept >= 0."""
    def solve(ua, ub):
        a11 = a12 = a22 = b1 = b2 = 0.0
        for t, n_a, n_b in rows:
            x1, x2 = (n_a / t if ua else 0.0), (n_b / t if ub else 0.0)
            a11 += x1 * x1
            a12 += x1 * x2
            a22 += x2 * x2
            b1 += x1
            b2 += x2
        if ua and ub:
            det = a11 * a22 - a12 * a12
            if det <= 1e-12 * (a11 * a22 or 1.0):
                return None
            return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if ua:
            return (b1 / a11 if a11 else 0.0), 0.0
        return 0.0, (b2 / a22 if a22 else 0.0)

    if use_alpha and use_beta:
        sol = solve(True, True)
        if sol is not None and sol[0] >= 0 and sol[1] >= 0:
            return sol
        a_only, b_only = solve(True, False), solve(False, True)

        def cost(ab):
            return sum(((n_a * ab[0] + n_b * ab[1]) / t - 1) ** 2 for t, n_a, n_b in rows)
        return min((a_only, b_only), key=cost)
    return solve(use_alpha, use_beta)


def fit_alpha_beta(bench, algorithm: str = "mpich", short_msg_bytes: int = 2048) -> dict:
    """Least-squares alpha (s/message) and beta (s/byte) from micro-benchmark timings.

    Each timing is modelled as ``rounds * alpha + critical_bytes * beta`` for the schedule of
    ``algorithm`` (one node: one link type), minimising relative residuals (sizes span 4 B..16 MiB),
    both kept >= 0. Runs with more ranks than cores (oversubscribed: a busy-polling peer may be
    descheduled) are left out of that fit and give ``oversub_alpha`` instead: the extra seconds per
    round they need. Returns {"alpha", "beta", "oversub_alpha", "rel_rms", "points": [...]}.
    """
    rows = []
    for run in _bench_runs(bench):
        p = int(run["np"])
        over = _oversubscribed(run)
        for nbytes, t in zip(run["sizes_bytes"], run["seconds"]):
            n_a, n_b = _critical_counts(p, nbytes, algorithm, short_msg_bytes)
            if n_a and t > 0:
                rows.append((p, nbytes, t, n_a, n_b, over))
    if not rows:
        raise ValueError("no usable timings: the benchmark needs np >= 2")
    fit_rows = [r for r in rows if not r[5]] or rows
    alpha, beta = _wls([(t, n_a, n_b) for _, _, t, n_a, n_b, _ in fit_rows])
    over_rows = [r for r in rows if r[5]] if len(fit_rows) < len(rows) else []
    oversub_alpha = 0.0
    if over_rows:
        # median extra per round: robust to the scheduler's erratic wake-ups
        oversub_alpha = max(0.0, statistics.median(
            (t - (n_a * alpha + n_b * beta)) / n_a for _, _, t, n_a, n_b, _ in over_rows))
    points = []
    for p, nbytes, t, n_a, n_b, over in rows:
        model = n_a * (alpha + (oversub_alpha if over else 0.0)) + n_b * beta
        points.append({"np": p, "bytes": nbytes, "measured_s": t, "model_s": model,
                       "rel_err": (model - t) / t, "oversubscribed": over})

    def rms(pts):
        return math.sqrt(sum(pt["rel_err"] ** 2 for pt in pts) / len(pts)) if pts else None
    return {"alpha": alpha, "beta": beta, "oversub_alpha": oversub_alpha,
            "bandwidth_MBps": (1 / beta / 1e6) if beta > 0 else None, "algorithm": algorithm,
            "rel_rms": rms([pt for pt in points if not pt["oversubscribed"]] or points),
            "rel_rms_oversubscribed": rms([pt for pt in points if pt["oversubscribed"]]),
            "points": points}


def run_comm_bench(nps: Iterable[int] = (2, 3), *, sizes: Sequence[int] = DEFAULT_SIZES,
                   mpiexec: str | None = None, env: Mapping[str, str] | None = None,
                   timeout: float = 300, extra_args: Sequence[str] = ()) -> dict:
    """Launch ``mpiexec -n p`` for each p, run ``comm_bench`` there, merge, and fit alpha and beta.

    Returns {"runs": [bench at each np], "fit": fit_alpha_beta(...)}; the JSON the CLI writes.
    """
    from .cli import find_mpiexec
    launcher = find_mpiexec(mpiexec)
    runs = []
    with tempfile.TemporaryDirectory(prefix="pilab-bench-") as tmp:
        for p in nps:
            part = os.path.join(tmp, f"np{p}.json")
            cmd = [launcher, "-n", str(p), *extra_args, sys.executable, "-m", "pilab", "perfmodel",
                   "bench", "--part-out", part, "--sizes", *[str(s) for s in sizes]]
            proc = subprocess.run(cmd, env=dict(env) if env is not None else None, timeout=timeout,
                                  capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.exists(part):
                raise RuntimeError(f"comm bench at np={p} failed (exit {proc.returncode}): "
                                   f"{proc.stderr.strip()[-800:]}")
            with open(part) as f:
                runs.append(json.load(f))
    return {"runs": runs, "fit": fit_alpha_beta(runs)}


# ----------------------------------------------------------------------------------------------
# calibration from an np=1 result + the micro-benchmark
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """What an np=1 run and the Allreduce micro-benchmark say about this machine (JSON-able)."""
    model: str
    width: float
    per_rank_batch: int
    threads: int
    cores_per_node: int
    flops_per_image: float  # training FLOPs per image of (model, width)
    compute_s_per_image: float  # forward + backward + optimizer, per image, steady state
    data_s_per_image: float
    eval_s_per_image: float  # per test image (np=1 evaluates all of them)
    step_overhead_s: float  # per step, outside compute and data
    warmup_s: float  # first step's extra time over the steady mean (may be < 0 in a warm process)
    compute_cv: float  # std / mean of per-step compute, first step excluded
    alpha: float  # s per message, intra-node (fitted)
    beta: float  # s per byte, intra-node (fitted)
    fit_rel_rms: float
    oversub_alpha: float = 0.0  # extra s per round with more ranks than cores (fitted)
    available_cores: float = 0.0  # cores the np=1 run actually got on a shared machine (0: all it wanted)
    bench_nps: tuple = ()
    mpi_library: str = ""
    host: str = ""
    source: str = ""
    activations_per_image: float = 0.0  # activation elements per image of (model, width)
    flops_per_activation: float = 0.0  # the model constant used (FLOPS_PER_ACTIVATION_CPU)
    step_work_per_tensor: float = 0.0  # the model constant used (STEP_WORK_PER_TENSOR_CPU)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["bench_nps"] = list(self.bench_nps)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calibration":
        d = dict(d)
        d["bench_nps"] = tuple(d.get("bench_nps", ()))
        return cls(**d)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Calibration":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def calibrate(np1_result: Mapping[str, Any], comm_bench: Any, *, source: str = "",
              available_cores: float | None = None,
              flops_per_activation: float = FLOPS_PER_ACTIVATION_CPU,
              step_work_per_tensor: float = STEP_WORK_PER_TENSOR_CPU) -> Calibration:
    """Calibration from an np=1 ``result.json`` (dict) and a micro-benchmark (``run_comm_bench``'s
    dict, one ``comm_bench`` dict or a list of them).

        cal = calibrate(json.load(open("runs/np1/result.json")), json.load(open("runs/bench.json")))

    ``available_cores``: on a shared machine, the CPU cores the np=1 run actually got (its CPU time
    over its wall time, when that is below its threads); its times are scaled back to a run that got
    every core it asked for. None (the default) takes the run as it was. ``flops_per_activation``:
    see ``FLOPS_PER_ACTIVATION_CPU`` (0 makes compute time scale with FLOPs alone);
    ``step_work_per_tensor``: see ``STEP_WORK_PER_TENSOR_CPU`` (0: compute proportional to the batch).
    """
    from .models import activation_elements, train_flops_per_image

    if int(np1_result.get("np", 0)) != 1:
        raise ValueError(f"calibrate needs the result of an np=1 run; this one has "
                         f"np={np1_result.get('np')}")
    cfg = np1_result["config"]
    b = int(np1_result["per_rank_batch"])
    steps = np1_result["steps"]
    comp = list(steps["compute"])
    if len(comp) < 3:
        raise ValueError("the np=1 run is too short to calibrate from: give it at least 3 steps")
    steady = comp[1:]
    c_step = statistics.fmean(steady)
    epochs = np1_result["epochs"]
    n_steps = sum(e["steps"] for e in epochs)
    t_time = sum(e["time"] for e in epochs)
    t_comp = sum(e["compute"] for e in epochs)
    t_data = sum(e["data"] for e in epochs)
    evals = [e for e in epochs if e.get("test_acc") is not None]
    n_test = int(np1_result["data"]["n_test"])
    eval_s = (statistics.fmean(e["eval_time"] for e in evals) / n_test) if evals else 0.0
    fit = fit_alpha_beta(comm_bench)
    runs = _bench_runs(comm_bench)
    env = np1_result.get("env", {})
    threads = int(np1_result["threads"])
    cores = int(env.get("cpu_count") or os.cpu_count())
    # the share of the run's time it would have taken with all the cores it asked for
    idle = min(1.0, available_cores / threads) if available_cores else 1.0
    return Calibration(
        model=cfg["model"], width=float(cfg["width"]), per_rank_batch=b,
        threads=threads, cores_per_node=cores,
        flops_per_image=train_flops_per_image(cfg["model"], float(cfg["width"])),
        compute_s_per_image=idle * c_step / b, data_s_per_image=idle * t_data / (n_steps * b),
        eval_s_per_image=idle * eval_s,
        step_overhead_s=idle * max(0.0, (t_time - t_comp - t_data) / n_steps),
        # signed: in a process that has already run torch the first step is not slower, and the
        # np=1 prediction must still give back the run it came from
        warmup_s=idle * (comp[0] - c_step),
        compute_cv=statistics.pstdev(steady) / c_step if len(steady) > 1 else 0.0,
        alpha=fit["alpha"], beta=fit["beta"], fit_rel_rms=fit["rel_rms"],
        oversub_alpha=fit["oversub_alpha"], available_cores=float(available_cores or 0.0),
        bench_nps=tuple(int(r["np"]) for r in runs), mpi_library=str(runs[0].get("mpi_library", "")),
        host=",".join(env.get("hostnames", [])[:1]), source=source,
        activations_per_image=float(activation_elements(cfg["model"], float(cfg["width"]))),
        flops_per_activation=float(flops_per_activation),
        step_work_per_tensor=float(step_work_per_tensor))


# ----------------------------------------------------------------------------------------------
# presets
# ----------------------------------------------------------------------------------------------
def this_box(cal: Calibration) -> Cluster:
    """The calibrated machine: one node, all ranks on it, intra-node link from the fit."""
    link = Link(cal.alpha, cal.beta)
    work = cal.flops_per_image + cal.flops_per_activation * cal.activations_per_image
    # the calibration step did b images of work plus the per-step part, in b x compute_s_per_image
    step_fixed = cal.step_work_per_tensor * len(gradient_layout(cal.model, cal.width))
    return Cluster(
        name="this_box", nodes=1, ranks_per_node=0, cores_per_node=cal.cores_per_node,
        ref_threads=cal.threads,
        train_gflops=(work + step_fixed / cal.per_rank_batch) / cal.compute_s_per_image / 1e9,
        eval_gflops=(work / 3) / cal.eval_s_per_image / 1e9 if cal.eval_s_per_image else 1e9,
        flops_per_activation=cal.flops_per_activation, step_work_per_tensor=cal.step_work_per_tensor,
        data_s_per_image=cal.data_s_per_image, step_overhead_s=cal.step_overhead_s,
        warmup_s=cal.warmup_s, compute_cv=cal.compute_cv, intra=link, inter=link, gamma=0.0,
        algorithm="mpich", oversub_alpha=cal.oversub_alpha,
        notes=f"calibrated: {cal.source or 'np=1 run'} + comm bench at np "
              f"{','.join(map(str, cal.bench_nps))} ({cal.mpi_library})")


def cluster_from_calibration(cal: Calibration, *, nodes: int, ranks_per_node: int,
                             inter_bench=None, inter: Link | None = None, **overrides) -> Cluster:
    """Your own cluster: compute and the intra-node link from ``cal`` (one node), the inter-node link
    from a micro-benchmark with one rank per node (``inter_bench``) or given as ``inter``.

        python -m pilab perfmodel bench --np 2 --launcher-args "-ppn 1 -hosts n01,n02" --out inter.json
        cluster_from_calibration(cal, nodes=24, ranks_per_node=2, inter_bench=json.load(open("inter.json")))
    """
    if inter is None:
        if inter_bench is None:
            raise ValueError("give inter_bench (a one-rank-per-node micro-benchmark) or inter=Link(...)")
        fit = fit_alpha_beta(inter_bench)
        inter = Link(fit["alpha"], fit["beta"])
    base = dataclasses.replace(this_box(cal), name="calibrated_cluster", nodes=nodes,
                               ranks_per_node=ranks_per_node, inter=inter)
    return dataclasses.replace(base, **overrides)


def pi4b_cluster(**overrides) -> Cluster:
    """24 Raspberry Pi 4B nodes x 2 ranks (2 threads each), one shared 1 GbE NIC per node.

    Every number is an assumption stated in docs/perfmodel.md, none fitted to the published figures;
    override any of them: ``pi4b_cluster(train_gflops=3.0)``.
    """
    base = dict(
        name="pi4b_cluster", nodes=24, ranks_per_node=2, cores_per_node=4, ref_threads=2,
        # Cortex-A72 @ 1.5 GHz: 8 fp32 FLOP/cycle/core nominal -> 24 GFLOP/s for two cores. PyTorch's
        # training step of MobileNetV2 on 32x32 images is dominated by memory-bound depthwise convs,
        # BN and ReLU6; assume ~6% of nominal (this x86 box reaches ~10% of its own nominal peak on
        # the same step, and the Pi's LPDDR4 is relatively weaker).
        train_gflops=1.5,
        eval_gflops=2.0,  # inference at batch 500: no backward, larger GEMMs, a little better
        data_s_per_image=2e-4,  # batched crop/flip/normalise, ~5x this box's per-image cost
        step_overhead_s=2e-3,  # Python per step, ~10x this box
        warmup_s=0.5,
        compute_cv=0.03,  # OS jitter, thermal throttling under a fan
        intra=Link(alpha=2e-6, beta=1 / 1.5e9),  # shared memory: ~2 us, ~1.5 GB/s effective copy
        inter=Link(alpha=75e-6, beta=1 / 117e6),  # TCP through a switch: 50-100 us, 117 MB/s goodput
        gamma=1 / 1.5e9,  # summing float32 buffers, memory bound: ~1.5 GB/s of output
        algorithm="mpich", short_msg_bytes=2048,  # Raspberry Pi OS's MPICH 3.x defaults
        notes="assumptions, not fits: see docs/perfmodel.md",
    )
    base.update(overrides)
    return Cluster(**base)


PRESETS = {"pi4b_cluster": pi4b_cluster}


def resolve_cluster(spec) -> Cluster:
    """A Cluster from a Cluster, a Calibration, a preset name, or a dict/JSON path of either."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Calibration):
        return this_box(spec)
    if isinstance(spec, str):
        if spec in PRESETS:
            return PRESETS[spec]()
        if spec == "this_box":
            raise ValueError("preset this_box needs a calibration: pass a Calibration or its JSON path")
        if os.path.isfile(spec):
            with open(spec) as f:
                spec = json.load(f)
        else:
            raise ValueError(f"unknown preset {spec!r}; choose one of {', '.join(PRESETS)}, "
                             "this_box (with a calibration), or a JSON file")
    if isinstance(spec, Mapping):
        if "compute_s_per_image" in spec:
            return this_box(Calibration.from_dict(spec))
        return Cluster.from_dict(spec)
    raise TypeError(f"cannot make a Cluster from {type(spec).__name__}")


# ----------------------------------------------------------------------------------------------
# gradients: tensor sizes, the order they become ready in backward, GradSync's buckets
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def gradient_layout(model: str, width: float) -> tuple[tuple[int, float], ...]:
    """(numel, ready) per parameter tensor, in the reversed definition order GradSync buckets in.

    ``ready`` is the fraction of backward compute done when that tensor's gradient is complete,
    taking each module's backward to cost in proportion to its forward multiply-accumulates.
    Built on the meta device (no memory, no compute).
    """
    import torch
    from torch import nn

    from .models import build_model

    with torch.device("meta"):
        net = build_model(model, num_classes=10, width=width)
    order: list[nn.Module] = []
    macs: dict[int, float] = {}

    def hook(m, inp, out):
        order.append(m)
        o = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
            macs[id(m)] = macs.get(id(m), 0.0) + o[0].numel() * k
        elif isinstance(m, nn.Linear):
            macs[id(m)] = macs.get(id(m), 0.0) + o[0].numel() * m.in_features
    leaves = [m for m in net.modules() if not list(m.children()) and list(m.parameters(recurse=False))]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        net.eval()
        with torch.no_grad():
            net(torch.zeros(1, 3, 32, 32, device="meta"))
    finally:
        for h in handles:
            h.remove()
    total = sum(macs.values()) or 1.0
    done_after: dict[int, float] = {}
    acc = 0.0
    for m in reversed(order):  # backward visits modules in reverse forward order
        acc += macs.get(id(m), 0.0)
        done_after.setdefault(id(m), acc / total)
    owner = {}
    for m in leaves:
        for p in m.parameters(recurse=False):
            owner[id(p)] = id(m)
    params = [p for p in net.parameters() if p.requires_grad]
    return tuple((p.numel(), done_after.get(owner.get(id(p)), 1.0)) for p in reversed(params))


def buckets_for(layout, bucket_mb: float) -> list[tuple[int, float]]:
    """(numel, ready) per bucket, filled exactly as ``dist.GradSync`` fills them."""
    limit = max(1, int(bucket_mb * 2 ** 20 / 4))
    out, n, ready = [], 0, 0.0
    for numel, r in layout:
        if n and n + numel > limit:
            out.append((n, ready))
            n, ready = 0, 0.0
        n += numel
        ready = max(ready, r)
    if n:
        out.append((n, ready))
    return out


# ----------------------------------------------------------------------------------------------
# prediction
# ----------------------------------------------------------------------------------------------
_SOURCE_SIZES = {"embedded": (5000, 1000), "cifar10": (50000, 10000)}


def work_per_image(model: str, width: float, flops_per_activation: float = 0.0) -> float:
    """Training FLOPs of one image plus ``flops_per_activation`` for each activation element.

        work_per_image("mobilenetv2_cifar", 0.5, FLOPS_PER_ACTIVATION_CPU) / 1e9   # ~0.78
    """
    from .models import activation_elements, train_flops_per_image

    work = train_flops_per_image(model, width)
    if flops_per_activation:
        work += flops_per_activation * activation_elements(model, width)
    return work


def _sizes(cfg, n_train, n_test) -> tuple[int, int]:
    known = _SOURCE_SIZES.get(cfg.data)
    if n_train is None:
        n_train = cfg.train_subset or (known[0] if known else None)
    if n_test is None:
        n_test = cfg.test_subset or (known[1] if known else None)
    if n_train is None or n_test is None:
        raise ValueError(f"data={cfg.data!r}: pass n_train= and n_test= (image counts)")
    return int(n_train), int(n_test)


def _as_config(cfg):
    from .config import Config
    if isinstance(cfg, Config):
        return cfg
    if cfg is None:
        return Config()
    d = dict(cfg)
    d = d.get("config", d)  # a result dict carries its config
    return Config.from_dict(d)


def _expected_max_normal(n: int) -> float:
    """E[max of n standard normals] (Blom's approximation; 0 for n = 1)."""
    if n <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


# profile -> (gradient averaging, evaluation); the two halves of "naive" apart, to see what each costs
PROFILES = {
    "pilab": ("buckets", "sharded"),  # fused buckets posted during backward; test set split over ranks
    "naive": ("per_tensor", "full"),  # blocking Allreduce per tensor after backward; all ranks eval all
    "naive_comm": ("per_tensor", "sharded"),
    "naive_eval": ("buckets", "full"),
}


def predict(cfg, np_: int, cluster, profile: str = "pilab", *, baseline_np: int | None = None,
            n_train: int | None = None, n_test: int | None = None) -> dict:
    """Predicted time per epoch of ``cfg`` at ``np_`` ranks on ``cluster``.

    ``cluster``: a Calibration, a Cluster, a preset name ("pi4b_cluster") or a JSON path.
    ``profile``: "pilab" (fused buckets overlapped with backward, sharded evaluation) or "naive"
    (one blocking Allreduce per parameter tensor after backward, every rank evaluates everything);
    "naive_comm" and "naive_eval" take only one half of naive (see ``PROFILES``).
    ``baseline_np`` adds speedup, efficiency (E = S * p0 / p) and Karp-Flatt against that np.

        predict(Config(width=0.5), 8, "pi4b_cluster", "naive", baseline_np=2)["efficiency"]

    Times are seconds; "time" is the training part of an epoch (as in result.json's epochs[].time),
    "epoch_time" adds evaluation.
    """
    from .data import epoch_accounting

    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r}; use one of {', '.join(PROFILES)}")
    averaging, evaluation = PROFILES[profile]
    cfg = _as_config(cfg)
    cl = resolve_cluster(cluster)
    p = int(np_)
    if p < 1:
        raise ValueError(f"np={p} must be >= 1")
    if cl.nodes and cl.ranks_per_node and p > cl.nodes * cl.ranks_per_node:
        raise ValueError(f"np={p} exceeds {cl.name}: {cl.nodes} nodes x {cl.ranks_per_node} ranks")
    n_train, n_test = _sizes(cfg, n_train, n_test)
    b = cfg.per_rank_batch(p)
    steps = epoch_accounting(n_train, p, b, cfg.sharding, seed=cfg.seed)["steps"]

    # --- compute, per rank, per step
    rpn = min(p, cl.ranks_per_node or p)
    nodes = math.ceil(p / rpn)
    threads = cfg.threads or max(1, cl.cores_per_node // rpn)
    # more threads than the cores this job gets on a node: they time-share them
    avail = cl.available_cores or cl.cores_per_node
    oversub = max(1.0, rpn * threads / avail)
    thread_factor = (cl.ref_threads / threads) ** THREAD_EXPONENT
    work = work_per_image(cfg.model, cfg.width, cl.flops_per_activation)
    e_img = (work / 3) / (cl.eval_gflops * 1e9) * thread_factor * oversub
    d_img = cl.data_s_per_image * oversub
    layout = gradient_layout(cfg.model, cfg.width)
    step_work = b * work + cl.step_work_per_tensor * len(layout)
    compute = step_work / (cl.train_gflops * 1e9) * thread_factor * oversub
    data = b * d_img
    straggler = compute * cl.compute_cv * _expected_max_normal(p)

    # --- communication, per step
    wire = 2 if cfg.compression == "fp16" else ELEMENT_BYTES
    n_params = sum(n for n, _ in layout)
    crowded = rpn * threads > avail  # a rank may wait for a peer that is not scheduled

    def ar(nbytes):
        return allreduce_time(nbytes, p, cl, None, crowded)
    metric = ar(METRIC_BYTES) if p > 1 else 0.0
    if p == 1:
        messages, comm, exposed = 0, 0.0, 0.0
    elif averaging == "per_tensor":
        messages = len(layout)
        comm = sum(ar(n * ELEMENT_BYTES) for n, _ in layout)
        exposed = comm
    else:
        buckets = buckets_for(layout, cfg.bucket_mb)
        messages = len(buckets)
        t_fwd = compute * (1 - cl.backward_fraction)
        t_bwd = compute * cl.backward_fraction
        end = 0.0
        comm = 0.0
        for numel, ready in buckets:  # posted in order as they fill; one at a time on the wire
            t = ar(numel * wire)
            # overlap < 1: only that share of the remaining backward can hide communication
            post = t_fwd + t_bwd * (1 - cl.overlap * (1 - ready))
            end = max(end, post) + t
            comm += t
        exposed = max(0.0, end - (t_fwd + t_bwd))
    comm += metric
    exposed += metric
    overhead = cl.step_overhead_s
    step = data + compute + straggler + exposed + overhead

    # --- evaluation, per epoch
    if evaluation == "full":
        eval_time = n_test * e_img
    else:
        eval_time = math.ceil(n_test / p) * e_img
        if p > 1:  # settle BN statistics (one broadcast ~ one Allreduce) + reduce the sums
            eval_time += ar(_bn_bytes(cfg.model, cfg.width)) + metric
    # evaluation runs every eval_every epochs and after the last: its average share per epoch
    n_evals = len({e for e in range(1, cfg.epochs + 1) if e % cfg.eval_every == 0} | {cfg.epochs})
    evals_per_epoch = n_evals / cfg.epochs
    time_ = steps * step
    images = steps * b * p
    out = {
        "np": p, "profile": profile, "cluster": cl.name, "model": cfg.model, "width": cfg.width,
        "nodes": nodes, "ranks_per_node": rpn, "threads": threads, "oversubscription": oversub,
        "per_rank_batch": b, "global_batch": b * p, "steps_per_epoch": steps, "images": images,
        "n_train": n_train, "n_test": n_test,
        "params": n_params, "messages_per_step": messages, "bytes_per_step": n_params * wire,
        "algorithm": cl.algorithm,
        "step_time": step,
        "step": {"compute": compute, "data": data, "straggler": straggler, "comm": comm,
                 "comm_exposed": exposed, "overhead": overhead},
        "compute": steps * compute, "data": steps * data, "straggler": steps * straggler,
        "comm": steps * comm, "comm_exposed": steps * exposed, "overhead": steps * overhead,
        "time": time_, "eval_time": eval_time, "evals_per_epoch": evals_per_epoch,
        "epoch_time": time_ + evals_per_epoch * eval_time,
        "first_epoch_time": time_ + cl.warmup_s,
        "images_per_s": images / time_ if time_ > 0 else None,
    }
    if baseline_np is not None:
        base = out if baseline_np == p else predict(cfg, baseline_np, cl, profile,
                                                    n_train=n_train, n_test=n_test)
        S = speedup(base["epoch_time"], out["epoch_time"])
        out.update({"baseline_np": baseline_np, "speedup": S,
                    "efficiency": efficiency(S, p, baseline_np),
                    "karp_flatt": karp_flatt(S, p, baseline_np),
                    "train_speedup": speedup(base["time"], out["time"])})
    return out


@functools.lru_cache(maxsize=None)
def _bn_bytes(model: str, width: float) -> int:
    """Bytes of BatchNorm running mean + var (what sync_buffers_ broadcasts before evaluation)."""
    import torch
    from torch import nn

    from .models import build_model
    with torch.device("meta"):
        net = build_model(model, num_classes=10, width=width)
    return sum(2 * m.num_features * 4 for m in net.modules() if isinstance(m, nn.BatchNorm2d))


def predict_table(cfg, nps: Iterable[int], cluster, profile: str = "pilab",
                  baseline_np: int | None = None, **kwargs) -> list[dict]:
    """``predict`` at each np, with speedup/efficiency against ``baseline_np`` (default: the first)."""
    nps = list(nps)
    base = nps[0] if baseline_np is None else baseline_np
    return [predict(cfg, p, cluster, profile, baseline_np=base, **kwargs) for p in nps]


def pi_config(**overrides):
    """The study's setting: MobileNetV2-CIFAR width 1.0, full CIFAR-10, 32 images per rank."""
    from .config import Config
    return Config(**{"data": "cifar10", "width": 1.0, "batch_size": 32, **overrides})


def pi_table(cfg=None, nps: Iterable[int] = (2, 4, 8, 16, 24, 32, 48), cluster=None) -> list[dict]:
    """Predicted Pi-cluster scaling for both profiles beside the published figures (p0 = 2)."""
    cfg = pi_config() if cfg is None else _as_config(cfg)
    cl = pi4b_cluster() if cluster is None else resolve_cluster(cluster)
    p0 = PUBLISHED["baseline_np"]
    published = {r["np"]: r for r in published_table()}
    rows = []
    for p in nps:
        pil = predict(cfg, p, cl, "pilab", baseline_np=p0)
        nai = predict(cfg, p, cl, "naive", baseline_np=p0)
        pub = published.get(p, {})
        rows.append({
            "np": p, "nodes": pil["nodes"],
            "published_speedup": pub.get("speedup"), "published_efficiency": pub.get("efficiency"),
            "naive_speedup": nai["speedup"], "naive_efficiency": nai["efficiency"],
            "pilab_speedup": pil["speedup"], "pilab_efficiency": pil["efficiency"],
            "naive_epoch_s": nai["epoch_time"], "pilab_epoch_s": pil["epoch_time"],
            "naive_comm_exposed_s": nai["comm_exposed"], "pilab_comm_exposed_s": pil["comm_exposed"],
            "naive_eval_s": nai["eval_time"], "pilab_eval_s": pil["eval_time"],
        })
    return rows


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   digits: int = 3) -> str:
    """A GitHub Markdown table of ``rows`` (None shows as an em dash; fractions named *efficiency*
    as percentages)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())

    def fmt(k, v):
        if v is None:
            return "—"
        if isinstance(v, float):
            if math.isnan(v):
                return "—"
            if "efficiency" in k:
                return f"{100 * v:.1f}%"
            return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(k, r.get(k)) for k in columns) + " |" for r in rows]
    return "\n".join(lines)


def pi_table_markdown(cfg=None, **kwargs) -> str:
    cols = ["np", "nodes", "published_speedup", "published_efficiency", "naive_speedup",
            "naive_efficiency", "pilab_speedup", "pilab_efficiency", "naive_epoch_s", "pilab_epoch_s"]
    return markdown_table(pi_table(cfg, **kwargs), cols)


# ----------------------------------------------------------------------------------------------
# command line: python -m pilab perfmodel {bench,calibrate,predict,table}
# ----------------------------------------------------------------------------------------------
_TABLE_COLUMNS = ["np", "nodes", "threads", "per_rank_batch", "steps_per_epoch", "step_time",
                  "time", "comm", "comm_exposed", "eval_time", "epoch_time", "images_per_s",
                  "speedup", "efficiency"]


def _write_json(obj, path: str | None) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}")


def _cluster_from_args(args):
    if args.calibration:
        cl = this_box(Calibration.load(args.calibration))
    elif args.preset == "pi4b_cluster":
        base = pi4b_cluster()
        kw = {}
        if args.train_gflops is not None:
            kw["train_gflops"] = args.train_gflops
        if args.inter_alpha is not None or args.inter_mbps is not None:
            kw["inter"] = Link(base.inter.alpha if args.inter_alpha is None else args.inter_alpha,
                               base.inter.beta if args.inter_mbps is None else 1 / (args.inter_mbps * 1e6))
        cl = pi4b_cluster(**kw)
    else:
        cl = resolve_cluster(args.preset)
    if args.algorithm:
        cl = dataclasses.replace(cl, algorithm=args.algorithm)
    return cl


def cmd_bench(args, argv) -> int:
    from .cli import UsageError, _under_mpi
    if _under_mpi():  # a launched rank: run the benchmark, rank 0 writes its part
        from mpi4py import MPI
        res = comm_bench(MPI.COMM_WORLD, args.sizes)
        if MPI.COMM_WORLD.Get_rank() == 0 and args.part_out:
            _write_json(res, args.part_out)
        return 0
    if any(p < 2 for p in args.np):
        raise UsageError("--np values must be >= 2 (an Allreduce needs two ranks)")
    import shlex
    res = run_comm_bench(args.np, sizes=args.sizes, mpiexec=args.mpiexec,
                         extra_args=shlex.split(args.launcher_args or ""))
    fit = res["fit"]
    print(f"{'np':>3} {'bytes':>10} {'measured us':>12} {'model us':>10} {'err':>7}")
    for pt in fit["points"]:
        print(f"{pt['np']:>3} {pt['bytes']:>10} {pt['measured_s'] * 1e6:>12.1f} "
              f"{pt['model_s'] * 1e6:>10.1f} {100 * pt['rel_err']:>6.0f}%")
    print(f"alpha = {fit['alpha'] * 1e6:.2f} us/message, beta = {fit['beta'] * 1e9:.3f} ns/byte "
          f"({fit['bandwidth_MBps'] or float('inf'):.0f} MB/s), relative rms {100 * fit['rel_rms']:.0f}%")
    _write_json(res, args.out)
    return 0


def cmd_calibrate(args, argv) -> int:
    with open(args.result) as f:
        result = json.load(f)
    with open(args.bench) as f:
        bench = json.load(f)
    cal = calibrate(result, bench, source=args.result, flops_per_activation=args.flops_per_activation,
                    step_work_per_tensor=args.step_work_per_tensor)
    for k, v in cal.to_dict().items():
        print(f"{k:>22}: {v}")
    if args.out:
        cal.save(args.out)
        print(f"wrote {args.out}")
    if args.inter_bench:
        from .cli import UsageError
        if not (args.nodes and args.ranks_per_node and args.cluster_out):
            raise UsageError("--inter-bench needs --nodes, --ranks-per-node and --cluster-out")
        with open(args.inter_bench) as f:
            cl = cluster_from_calibration(cal, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                                          inter_bench=json.load(f))
        _write_json(cl.to_dict(), args.cluster_out)
        print(f"use it with --preset {args.cluster_out}")
    return 0


def cmd_predict(args, argv) -> int:
    from .cli import config_from_args
    cfg = config_from_args(args, _cli_defaults(args))
    cl = _cluster_from_args(args)
    profiles = ("pilab", "naive") if args.profile == "both" else (args.profile,)
    outs = {}
    for prof in profiles:
        out = outs[prof] = predict(cfg, args.np, cl, prof, baseline_np=args.baseline_np)
        print(f"\n{cl.name}, profile {prof}")
        for k, v in out.items():
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    print(f"{k + '.' + k2:>20}: {v2:.4g}")
            else:
                print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")
    _write_json(outs if len(outs) > 1 else outs[profiles[0]], args.out)
    return 0


def cmd_table(args, argv) -> int:
    from .cli import config_from_args
    cfg = config_from_args(args, _cli_defaults(args))
    cl = _cluster_from_args(args)
    if args.published:
        rows = pi_table(cfg, args.nps, cl)
        print(pi_table_markdown(cfg, nps=args.nps, cluster=cl))
        _write_json({"cluster": cl.to_dict(), "config": cfg.to_dict(), "rows": rows,
                     "published": published_table()}, args.out)
        return 0
    profiles = ("pilab", "naive") if args.profile == "both" else (args.profile,)
    result = {"cluster": cl.to_dict(), "config": cfg.to_dict(), "tables": {}}
    for prof in profiles:
        rows = predict_table(cfg, args.nps, cl, prof, baseline_np=args.baseline_np)
        result["tables"][prof] = rows
        print(f"\n{cl.name}, profile {prof}, baseline np={rows[0].get('baseline_np')}")
        print(markdown_table(rows, _TABLE_COLUMNS))
    _write_json(result, args.out)
    return 0


def _cli_defaults(args):
    from .config import Config
    if getattr(args, "preset", None) == "pi4b_cluster" and not getattr(args, "calibration", None):
        return pi_config()
    return Config()


def add_cli(sub) -> None:
    """Register ``python -m pilab perfmodel {bench,calibrate,predict,table}``."""
    import argparse

    from .cli import add_config_arguments

    p = sub.add_parser("perfmodel", help="performance model: micro-benchmark, calibrate, predict",
                       description="Predict time per epoch at any np from an np=1 run and an Allreduce "
                                   "micro-benchmark (see docs/perfmodel.md).")
    ps = p.add_subparsers(dest="action", required=True, parser_class=type(p))

    b = ps.add_parser("bench", help="Allreduce micro-benchmark at several np; fits alpha and beta",
                      description="Launches mpiexec -n P for each --np, times in-place float32 "
                                  "Allreduce at each size, writes the timings and the alpha-beta fit.")
    b.add_argument("--np", type=int, nargs="+", default=[2, 3],
                   help="process counts to benchmark (default: 2 3)")
    b.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                   help="message sizes in bytes (default: 4 B .. 16 MiB)")
    b.add_argument("--out", default="runs/perfmodel/comm_bench.json",
                   help="JSON file for the timings and the fit (default: %(default)s)")
    b.add_argument("--mpiexec", default=None,
                   help="launcher (default: the mpiexec next to this Python, then PATH)")
    b.add_argument("--launcher-args", default=None,
                   help='extra mpiexec arguments, e.g. "-ppn 1 -hosts pi01,pi02" to time the '
                        "inter-node link of a cluster")
    b.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    b.set_defaults(func=cmd_bench)

    c = ps.add_parser("calibrate", help="make a calibration from an np=1 result + a bench JSON",
                      description="Reads an np=1 result.json and a `perfmodel bench` JSON; writes "
                                  "the Calibration (the this_box preset) as JSON.")
    c.add_argument("--result", required=True, help="result.json of an np=1 `pilab train` run")
    c.add_argument("--bench", required=True, help="JSON written by `pilab perfmodel bench`")
    c.add_argument("--out", default="runs/perfmodel/calibration.json",
                   help="where to write the calibration (default: %(default)s)")
    c.add_argument("--flops-per-activation", dest="flops_per_activation", type=float,
                   default=FLOPS_PER_ACTIVATION_CPU,
                   help="memory-bound cost of one activation element in training FLOPs: how compute "
                        "time moves with width (default %(default)s, measured on x86; 0: FLOPs only)")
    c.add_argument("--step-work-per-tensor", dest="step_work_per_tensor", type=float,
                   default=STEP_WORK_PER_TENSOR_CPU,
                   help="per-step work that does not grow with the batch, per parameter tensor, in "
                        "the same units: how compute moves with the batch (default %(default)s; 0: "
                        "proportional)")
    c.add_argument("--inter-bench", default=None,
                   help="a `perfmodel bench` JSON run with one rank per node: also write a Cluster "
                        "with that inter-node link")
    c.add_argument("--nodes", type=int, default=None, help="with --inter-bench: nodes in the cluster")
    c.add_argument("--ranks-per-node", dest="ranks_per_node", type=int, default=None,
                   help="with --inter-bench: MPI ranks per node")
    c.add_argument("--cluster-out", default=None,
                   help="with --inter-bench: where to write the Cluster JSON (for --preset)")
    c.set_defaults(func=cmd_calibrate)

    def machine_args(q):
        g = q.add_argument_group("machine")
        g.add_argument("--preset", default="pi4b_cluster",
                       help="pi4b_cluster, or a Cluster/Calibration JSON file (default: %(default)s)")
        g.add_argument("--calibration", default=None,
                       help="a calibration JSON: predict for this box (overrides --preset)")
        g.add_argument("--profile", default="pilab", choices=(*PROFILES, "both"),
                       help="pilab: fused overlapped buckets, sharded eval; naive: per-tensor blocking "
                            "Allreduce, unsharded eval; naive_comm / naive_eval: one half of naive; "
                            "both: pilab and naive (default: %(default)s)")
        g.add_argument("--algorithm", default=None, choices=ALGORITHMS,
                       help="Allreduce algorithm (default: the machine's, mpich = by message size)")
        g.add_argument("--train-gflops", dest="train_gflops", type=float, default=None,
                       help="pi4b_cluster: achieved training GFLOP/s per rank (default 1.5)")
        g.add_argument("--inter-alpha", dest="inter_alpha", type=float, default=None,
                       help="pi4b_cluster: inter-node latency, seconds per message (default 75e-6)")
        g.add_argument("--inter-mbps", dest="inter_mbps", type=float, default=None,
                       help="pi4b_cluster: inter-node bandwidth in MB/s (default 117)")
        g.add_argument("--baseline-np", dest="baseline_np", type=int, default=None,
                       help="np the speedup and efficiency are measured against")
        g.add_argument("--out", default=None, help="also write the result as JSON here")
        add_config_arguments(q, skip=("out", "resume", "checkpoint_every", "device"))

    pr = ps.add_parser("predict", help="predicted epoch time at one np",
                       description="One prediction: step and epoch times, communication, evaluation.")
    pr.add_argument("--np", type=int, required=True, help="number of MPI ranks")
    machine_args(pr)
    pr.set_defaults(func=cmd_predict)

    t = ps.add_parser("table", help="predicted scaling table over several np",
                      description="Predictions at each --nps with speedup and efficiency against "
                                  "--baseline-np (default: the first). --published prints the Pi "
                                  "table beside the original study's figures.")
    t.add_argument("--nps", type=int, nargs="+", default=[2, 4, 8, 16, 24, 32, 48],
                   help="process counts (default: %(default)s)")
    t.add_argument("--published", action="store_true",
                   help="both profiles beside the published Pi figures (baseline np=2)")
    machine_args(t)
    t.set_defaults(func=cmd_table)
