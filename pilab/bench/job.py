"""What every rank of a benchmark job shares (``pilab.bench.mpijobs``, ``pilab.bench.syncways``): the world
communicator, a barrier that naps, the slower rank's time, the model every contender starts from::

    from pilab.bench.job import COMM, nap_barrier, slowest
    nap_barrier(); t = slowest(time.perf_counter() - t0)
"""
from __future__ import annotations

import time

import torch

from ..config import Config
from .. import engine
from ..dist.helpers import broadcast_module_
from ..launch import mpi

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


def _model(cfg: Config):
    m = engine.base_model(cfg, torch.device("cpu"))
    broadcast_module_(m, COMM)
    return m.train()
