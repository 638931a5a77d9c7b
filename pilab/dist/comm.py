"""MPI primitives: ``world``, ``allreduce_``, ``broadcast_`` -- thin, in-place (trailing ``_``), ``root=``
keyword, ``comm=None`` meaning one process (every call a no-op) -- and the exact arithmetic an MPI rank
and the simulator share: ``share_of_mean``, ``squared_norm``, and the named ``Slots`` that ride with the
last gradient bucket. The one module that imports mpi4py for training (``pilab.launch`` loads it for
the rest)::

    from pilab.dist import allreduce_, world
    rank, size = world(comm)
    allreduce_(t, comm, op="mean")
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

try:  # mpi4py is a dependency, but keep single-process use importable without an MPI library:
    from mpi4py import MPI  # ImportError without mpi4py, RuntimeError without the library it needs
except (ImportError, RuntimeError):  # pragma: no cover - exercised only on machines without MPI
    MPI = None


# ----------------------------------------------------------------------------------------------
# primitives
# ----------------------------------------------------------------------------------------------
def world(comm) -> tuple[int, int]:
    """(rank, size) of ``comm``; (0, 1) for ``comm=None``."""
    if comm is None:
        return 0, 1
    return comm.Get_rank(), comm.Get_size()


def mpi_buffer(t: torch.Tensor):
    """A numpy view sharing memory with a contiguous CPU tensor (what mpi4py's buffer API wants)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("MPI buffers must be contiguous CPU tensors")
    return t.detach().numpy()


def allreduce_(t: torch.Tensor, comm, op: str = "sum") -> torch.Tensor:
    """In-place Allreduce of a contiguous CPU tensor: ``op`` is sum, max, min or mean."""
    if comm is None or comm.Get_size() == 1:
        return t
    mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
    comm.Allreduce(MPI.IN_PLACE, mpi_buffer(t), op=mpi_op)
    if op == "mean":
        t.div_(comm.Get_size())
    return t


def broadcast_(t: torch.Tensor, comm, root: int = 0) -> torch.Tensor:
    """In-place Bcast of a contiguous CPU tensor from ``root``."""
    if comm is not None and comm.Get_size() > 1:
        comm.Bcast(mpi_buffer(t), root=root)
    return t


class Slots:
    """Named places in the float64 vector that rides with the last gradient bucket (``GradSync.meta``),
    summed over the ranks with it: whoever needs a value summed each step declares a slot of its own
    instead of an offset counted by hand. Declared in order, before the vector is made::

        slots = Slots()
        slots.declare("loss_sum"); slots.declare("network", np_)    # one per rank: rank r writes row r
        sync = GradSync(model, comm, meta=slots)                     # adds its own: "ready" (and "grad_sq")
        sync.meta[slots["loss_sum"]] = loss.item()
    """

    def __init__(self):
        self._at: dict[str, slice] = {}
        self.size = 0

    def declare(self, name: str, n: int = 1) -> slice:
        if name in self._at:
            raise ValueError(f"slot {name!r} is declared twice")
        self._at[name] = slice(self.size, self.size + n)
        self.size += n
        return self._at[name]

    def __getitem__(self, name: str) -> slice:
        return self._at[name]

    def __contains__(self, name: str) -> bool:
        return name in self._at


def share_of_mean(loss: torch.Tensor, size: int) -> torch.Tensor:
    """``loss`` times 1/size: its backward starts from 1/size, so each gradient comes out as this rank's
    share of the average over ``size`` ranks (``GradSync.backward``; the simulator's ranks use the same,
    so its sums match MPI's bit for bit). A product, not ``backward(gradient=...)``: torch checks an
    explicit gradient's shape with its symbolic-shape module, whose import brings sympy (~70 MB a rank)."""
    return loss * (1.0 / size)


def squared_norm(tensors) -> float:
    """The squared L2 norm of ``tensors`` together, in float64 and the same bits wherever the same values
    are: each tensor in its logical order, summed by numpy (pairwise, one thread, whatever torch's thread
    count or the tensor's memory layout), the tensors' sums added exactly (``math.fsum``, so their order
    does not matter either). An MPI rank's bucket slots and the simulator's ``p.grad`` agree bit for bit.

        squared_norm([p.grad for p in params])
    """
    out = []
    for t in tensors:
        a = t.detach().reshape(-1)
        out.append(float(np.square(a.cpu().numpy(), dtype=np.float64).sum()))
    return math.fsum(out)


# ----------------------------------------------------------------------------------------------
# waiting for requests
# ----------------------------------------------------------------------------------------------
SPIN_S = 2e-3  # finish() polls without napping this long first: a transfer in flight finishes at full speed
# ... or longer when much was posted at the end: the time those bytes take at this (conservative) rate, so
# naps never slow a transfer that is still moving (a bucket of 8.5 MB took 2.3 ms here; napping after 2 ms
# cost GradSync a third of the raw bandwidth in BENCHMARKS.md).
SPIN_BYTES_PER_S = 1e9
SLEEP_S = 50e-6  # then one nap between Testall calls (Linux timer slack adds ~50 us)


def wait_polling(reqs, spin_s: float = SPIN_S, test=None) -> None:
    """Wait for ``reqs`` as GradSync does: Testall busily for ``spin_s``, then with a nap between calls.
    MPICH moves a shared-memory Allreduce only inside MPI calls, so napping between calls slows a
    transfer in flight (measured: 0.28x the raw bandwidth with naps alone); a long wait is a slower rank
    still computing, and a nap leaves it the CPU. ``test``: a callable polled instead of Testall (True
    when all are done; GradSync's observed wait, which notes when each message completes)."""
    spin_until = time.perf_counter() + spin_s
    if test is not None:
        while not test():
            if time.perf_counter() > spin_until:
                time.sleep(SLEEP_S)
        return
    while not MPI.Request.Testall(reqs):
        if time.perf_counter() > spin_until:
            time.sleep(SLEEP_S)
