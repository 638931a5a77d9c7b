"""Helpers built on the MPI primitives (``pilab.dist.comm``), as in Horovod's torch package: parameters,
optimizer state and BatchNorm buffers broadcast or settled over the ranks, per-rank values reduced or
gathered, and a job ended cleanly when one rank fails. The communicator is always passed in;
``comm=None`` means one process and every call is a no-op::

    from mpi4py import MPI
    broadcast_module_(model, MPI.COMM_WORLD)       # every rank starts from rank 0's weights
    sync_buffers_(model, MPI.COMM_WORLD, "average")
"""
from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from ..launch import launcher_size
from .comm import MPI, allreduce_, broadcast_, world


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _flat_apply_(tensors: list[torch.Tensor], fn) -> None:
    """Pack same-dtype tensors into one flat buffer, apply ``fn`` to it in place, unpack.

    One message per dtype instead of one per tensor: MobileNetV2 has 158 parameter tensors and ~100
    BatchNorm buffers, and per-message latency dominates on 1 GbE.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        fn(flat)
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n


def broadcast_module_(model: nn.Module, comm, root: int = 0) -> None:
    """Make every rank's parameters AND buffers equal to ``root``'s (call once before training)."""
    if comm is None or comm.Get_size() == 1:
        return
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    _flat_apply_(tensors, lambda flat: broadcast_(flat, comm, root=root))


def broadcast_optimizer_state_(optimizer: torch.optim.Optimizer, comm, root: int = 0) -> None:
    """Give every rank ``root``'s optimizer state (momentum buffers, step counts).

    Uses a pickled ``bcast`` once, at start or resume — never per step — because other ranks may
    hold an empty state whose structure differs from root's.
    """
    if comm is None or comm.Get_size() == 1:
        return
    state = comm.bcast(optimizer.state_dict() if comm.Get_rank() == root else None, root=root)
    optimizer.load_state_dict(state)


def bn_buffers(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm running statistics (floating buffers); ``num_batches_tracked`` is excluded. Any module
    holding both (torch's BatchNorm, and pilab.engine.layers' ghost/renormalising one, which this module
    cannot import: layers builds on it); a BatchNorm that tracks none holds None."""
    out = []
    for m in model.modules():
        rm, rv = getattr(m, "running_mean", None), getattr(m, "running_var", None)
        if isinstance(rm, torch.Tensor) and isinstance(rv, torch.Tensor):
            out += [rm, rv]
    return out


def sync_buffers_(model: nn.Module, comm, policy: str = "broadcast", root: int = 0) -> None:
    """Make BatchNorm running statistics identical on all ranks before evaluation or checkpoint.

    ``policy="broadcast"`` takes ``root``'s (the default: cheap and what most frameworks do);
    ``"average"`` takes the mean over ranks, an estimate from np times more batches.
    """
    if comm is None or comm.Get_size() == 1:
        return
    floats = bn_buffers(model)
    if policy == "broadcast":
        _flat_apply_(floats, lambda flat: broadcast_(flat, comm, root=root))
    elif policy == "average":
        _flat_apply_(floats, lambda flat: allreduce_(flat, comm, op="mean"))
    else:
        raise ValueError(f"bn buffer policy {policy!r}; use broadcast or average")
    counters = [b for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]
    if counters:
        _flat_apply_(counters, lambda flat: broadcast_(flat, comm, root=root))


def reduce_sums(values, comm) -> np.ndarray:
    """Sum a short float vector over ranks (metrics: loss sums, correct counts, image counts)."""
    arr = np.asarray(values, dtype=np.float64).copy()
    if comm is not None and comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
    return arr


def gather_floats(values, comm, root: int = 0) -> np.ndarray | None:
    """Gather a fixed-length float vector from every rank, in rank order: shape (size, len) on root."""
    arr = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    if comm is None or comm.Get_size() == 1:
        return arr[None, :]
    rank, size = world(comm)
    out = np.empty((size, arr.size), dtype=np.float64) if rank == root else None
    comm.Gather(arr, out, root=root)
    return out


@contextmanager
def abort_on_error(comm, code: int = 1, *, on_error=None):
    """On an exception in one rank, print it and ``Abort`` the whole job, so no other rank is left
    waiting in a collective forever. Wrap the outermost call on every rank::

        with abort_on_error(MPI.COMM_WORLD):
            pilab.train(cfg, MPI.COMM_WORLD)

    ``on_error(exception)`` runs first (the CLI has rank 0 keep what was done: ``engine.Keeper``).
    """
    try:
        yield
    except Exception as e:
        if comm is None or comm.Get_size() == 1:
            raise
        rank = comm.Get_rank()
        print(f"pilab: rank {rank} failed; aborting all {comm.Get_size()} ranks", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        if on_error is not None:
            try:
                on_error(e)
            except Exception:  # what ends the job must not fail to end it
                traceback.print_exc()
        comm.Abort(code)
        # Abort does not return while the job stands; where it does (the launcher already tearing the job
        # down) the exception must go on up, or the block's caller carries on as if it had finished
        raise


class LauncherError(RuntimeError):
    """mpiexec and the MPI library don't belong together."""


def check_launcher(comm) -> None:
    """Refuse a world of size 1 when the launcher started several processes.

    That is a launcher and MPI library that don't belong together (e.g. Debian's ``mpiexec`` with
    pip's MPICH): every rank would silently train alone.
    """
    started = launcher_size()
    if comm is not None and comm.Get_size() == 1 and started > 1:
        raise LauncherError(
            f"the launcher started {started} processes but MPI sees a world of size 1 in each: "
            "mpiexec and mpi4py's MPI library don't match; use the mpiexec of the same MPI "
            "(e.g. the one next to this Python) or `python -m pilab train --np N`")
