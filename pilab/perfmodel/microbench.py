"""The Allreduce micro-benchmark: ``comm_bench`` times Allreduce on every rank of an MPI job,
``run_comm_bench`` launches such jobs (``pilab.perfmodel.ranks`` on every rank) at several np and fits
alpha and beta.

    python -m pilab perfmodel bench --np 2,3          # = run_comm_bench((2, 3)); writes the JSON

    from pilab.perfmodel import run_comm_bench
    res = run_comm_bench((2, 3))                      # {"runs": [...], "fit": fit_alpha_beta(...)}
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Iterable, Mapping, Sequence

from ..config import ConfigError
from ..launch import mpi_library, run_job
from .fit import fit_alpha_beta

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
    # on the ranks of a launched job only: importing mpi4py initialises MPI, which a process that only
    # predicts or launches must not do
    from ..launch import mpi
    MPI = mpi()

    size = comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    hosts = comm.allgather(MPI.Get_processor_name())
    med, best = [], []
    import numpy as np  # here, not at import: `python -m pilab --help` loads this module

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
        "trials": trials, "mpi_library": mpi_library(MPI),
        "thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                         MPI.THREAD_SERIALIZED: "serialized",
                         MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?"),
    }


def run_comm_bench(nps: Iterable[int] = (2, 3), *, sizes: Sequence[int] = DEFAULT_SIZES,
                   mpiexec: str | None = None, env: Mapping[str, str] | None = None,
                   timeout: float = 300, extra_args: Sequence[str] = ()) -> dict:
    """Launch ``mpiexec -n p`` for each p, run ``comm_bench`` there, merge, and fit alpha and beta.

        run_comm_bench((2,), extra_args=["-ppn", "1", "-hosts", "n01,n02"])   # the inter-node link

    Returns {"runs": [bench at each np], "fit": fit_alpha_beta(...)}; the JSON the CLI writes.
    ``env``: the jobs' whole environment (default: this process's). Raises ``ConfigError`` for an np
    below 2 or a size below 1 byte, ``LaunchError`` without a launcher, ``launch.JobError`` (a
    RuntimeError, with the job's exit code and stderr) when a launched job fails or times out.
    """
    nps = [int(p) for p in nps]
    if not nps or min(nps) < 2:
        raise ConfigError(f"nps={nps}: every np must be >= 2 (an Allreduce needs two ranks)")
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"sizes={list(sizes)}: message sizes are bytes >= 1")
    # each np is one job whose ranks run pilab.perfmodel.ranks (comm_bench); rank 0 answers
    runs = [run_job(p, "pilab.perfmodel.ranks", {"sizes": list(sizes)}, name=f"comm bench at np={p}",
                    mpiexec=mpiexec, extra=extra_args, env=env, timeout=timeout) for p in nps]
    return {"runs": runs, "fit": fit_alpha_beta(runs)}
