"""Alternated measurements and their summaries: every figure is a ratio against a baseline measured
in the same run, one ratio per alternation, reported as the median and its spread.

    samples = alternate({"bare": bare_step, "pilab": pilab_step}, rounds=10, repeat=3)
    summary(ratios(samples, "bare", "pilab"))    # {"median": 0.99, "p10": .., "p90": .., "min": .., "max": .., "n": 10}
"""
from __future__ import annotations

import time

import numpy as np


def summary(values) -> dict:
    """Median, p10/p90, min/max and count of ``values`` (None if empty)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return {"median": None, "p10": None, "p90": None, "min": None, "max": None, "n": 0}
    return {"median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
            "p90": float(np.percentile(v, 90)), "min": float(v.min()), "max": float(v.max()),
            "n": int(v.size)}


def ratios(samples: dict, num: str, den: str) -> list[float]:
    """Per-alternation ratios ``samples[num][i] / samples[den][i]``."""
    return [a / b for a, b in zip(samples[num], samples[den]) if a and b]


def alternate(contenders: dict, rounds: int, repeat: int = 1, *, warmup: int = 1) -> dict[str, list[float]]:
    """Run every contender ``repeat`` times per round, ``rounds`` times, the order rotated each round so
    that a load change on a shared machine hits them all alike; returns per round the median seconds
    of one call. Each contender is called ``warmup`` times before the first round (untimed)."""
    return alternate_clocks(contenders, rounds, repeat, warmup=warmup)["wall"]


def alternate_clocks(contenders: dict, rounds: int, repeat: int = 1, *, warmup: int = 1) -> dict:
    """:func:`alternate` timing each call by two clocks: ``"wall"`` (perf_counter) and ``"cpu"``, the
    process's own CPU time (``time.process_time``: user + system of all its threads, torch's intra-op
    pool included). Other jobs on a shared machine stretch the wall time of a call by the time it waits
    for a core; its CPU time they leave nearly alone, so the CPU ratio is the one load does not swing::

        t = alternate_clocks({"a": f, "b": g}, rounds=5)
        summary(ratios(t["cpu"], "a", "b")), summary(ratios(t["wall"], "a", "b"))
    """
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    out = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            wall, cpu = [], []
            for _ in range(repeat):
                t, c = time.perf_counter(), time.process_time()
                contenders[name]()
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - t)
            out["wall"][name].append(float(np.median(wall)))
            out["cpu"][name].append(float(np.median(cpu)))
    return out
