"""Alternated measurements and their summaries: every figure is a ratio against a baseline measured
in the same run, one ratio per alternation, reported as the median and its spread.

    samples = alternate({"bare": bare_step, "pilab": pilab_step}, rounds=10, repeat=3)
    summary(ratios(samples, "bare", "pilab"))    # {"median": 0.99, "p10": .., "p90": .., "min": .., "max": .., "n": 10}

What every rank of a benchmark job shares (``pilab.bench.mpijobs``, ``pilab.bench.mpijobs``): the world
communicator, a barrier that naps, the slower rank's time, the model every contender starts from::

    from pilab.bench.stats import COMM, nap_barrier, slowest
    nap_barrier(); t = slowest(time.perf_counter() - t0)
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import engine
from ..config import Config
from ..dist import broadcast_module_
from ..launch import mpi


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


MPI = mpi()  # this module runs on the ranks of a launched job only
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def nap_barrier() -> None:
    """A barrier that sleeps while it waits (a busy one would take CPU from the rank still working)."""
    req = COMM.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def slowest(seconds: float) -> float:
    return COMM.allreduce(seconds, op=MPI.MAX)  # the slower rank's time: what a synchronous step waits for


def start_model(cfg: Config):
    m = engine.base_model(cfg, torch.device("cpu"))
    broadcast_module_(m, COMM)
    return m.train()
