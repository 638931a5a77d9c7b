"""The micro-benchmark's rank side: every rank of the job runs this module, rank 0 writes the timings::

    mpiexec -n 2 python -m pilab.perfmodel.ranks OUT.json --sizes 4 1024 65536

``run_comm_bench`` launches it once per np (``pilab.launch.run_job``); :func:`comm_bench` does the
timing. A module of its own so that ``pilab perfmodel bench`` has no hidden rank-side flags.
"""
from __future__ import annotations

import argparse

from ..files import save_json
from ..launch import mpi
from .microbench import DEFAULT_SIZES, comm_bench


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="time Allreduce on every rank of this job (run under mpiexec)")
    p.add_argument("out", help="where rank 0 writes the timings (JSON)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="message sizes in bytes")
    a = p.parse_args(argv)
    comm = mpi().COMM_WORLD  # on the ranks of a launched job only: importing mpi4py initialises MPI
    res = comm_bench(comm, a.sizes)
    if comm.Get_rank() == 0:
        save_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
