"""The alpha-beta fit: latency and bandwidth from Allreduce micro-benchmark timings.

    from pilab.perfmodel import fit_alpha_beta
    fit = fit_alpha_beta(json.load(open("runs/perfmodel/comm_bench.json")))
    fit["alpha"], fit["beta"], fit["rel_rms"]     # s/message, s/byte, how well the model fits
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Mapping

from ..config import ConfigError
from .allreduce import _critical_counts


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


def fit_alpha_beta(bench, algorithm: str = "mpich", short_msg_bytes: int = 2048, *,
                   min_bytes: int = 0, stat: str = "seconds") -> dict:
    """Least-squares alpha (s/message) and beta (s/byte) from micro-benchmark timings.

    Each timing is modelled as ``rounds * alpha + critical_bytes * beta`` for the schedule of
    ``algorithm`` (one node: one link type), minimising relative residuals (sizes span 4 B..16 MiB),
    both kept >= 0.

    ``min_bytes`` leaves out the smaller messages. Where their cost is not ``alpha + n * beta`` -- on a
    loaded machine a few-byte Allreduce over TCP costs what the scheduler takes to wake the peer, and
    1 KiB may cost twice 4 B -- relative least squares trades beta against them and can put the
    bandwidth above the link's line rate (a 100 Mbit/s testbed link fitted at 15 MB/s over 4 B..4 MiB,
    12.4 MB/s over 16 KiB..4 MiB). Fit the link that carries gradient buckets over the sizes they
    have: ``fit_alpha_beta(inter_bench, min_bytes=16 * 1024)``. ``stat``: ``"seconds"`` (the median
    over trials) or ``"seconds_min"`` (the fastest trial: other work only ever adds time). Runs with more ranks than cores (oversubscribed: a busy-polling peer may be
    descheduled) are left out of that fit and give ``oversub_alpha`` instead: the extra seconds per
    round they need. Returns {"alpha", "beta", "oversub_alpha", "rel_rms", "points": [...]}.
    """
    if stat not in ("seconds", "seconds_min"):
        raise ConfigError(f"stat={stat!r}: 'seconds' (median over trials) or 'seconds_min'")
    rows = []
    for run in _bench_runs(bench):
        p = int(run["np"])
        over = _oversubscribed(run)
        for nbytes, t in zip(run["sizes_bytes"], run.get(stat) or run["seconds"]):
            n_a, n_b = _critical_counts(p, nbytes, algorithm, short_msg_bytes)
            if n_a and t > 0 and nbytes >= min_bytes:
                rows.append((p, nbytes, t, n_a, n_b, over))
    if not rows:
        raise ConfigError("no usable timings: the benchmark needs np >= 2")
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
