"""Synchronous data-parallel training over MPI: one model, np ranks, averaged gradients.

From Python (one process, or every rank of an MPI job)::

    from mpi4py import MPI
    from pilab.config import Config
    from pilab.engine import train
    result = train.run(Config(epochs=2, width=0.5), comm=MPI.COMM_WORLD)

From the shell: ``mpiexec -n 2 python -m pilab train --epochs 2`` or ``python -m pilab train --np 2``.

``callbacks`` are called on rank 0 with event dicts (``kind`` = start | step | epoch | end) while the run
goes on; ``stop`` is polled on every rank each step and any rank's True stops all ranks together after
that step. The result (returned on every rank, written by rank 0 as ``<out>/result.json``) holds the
config, environment, per-epoch metrics, per-step timings and peak memory per rank. The loop itself is
``pilab.engine.loop``'s, run on ``engine.MPIRanks(comm)``.
"""
from __future__ import annotations

from torch import nn

from . import loop as engine
from ..config import Config
from .ownmodel import with_model
from .loop import load_data  # noqa: F401  (part of this module's API: rank 0 decodes first)

__all__ = ["run", "train", "load_data"]


def run(cfg: Config, comm=None, *, callbacks=(), stop=None, data=None, keeper=None, model_fn=None) -> dict:
    """Train ``cfg`` on all ranks of ``comm`` (None: one process); see the module docstring.
    ``keeper`` (``engine.Keeper``) writes what was done when the run cannot finish. ``model_fn``: your own
    model's builder (a function taking num_classes), instead of ``cfg.model``."""
    return train(cfg, comm, callbacks=callbacks, stop=stop, data=data, keeper=keeper, model_fn=model_fn)[0]


def train(cfg: Config, comm=None, *, callbacks=(), stop=None, data=None,
          keeper=None, model_fn=None) -> tuple[dict, nn.Module]:
    """Like ``run`` but also returns the trained model (tests compare weights across ranks)."""
    cfg = with_model(cfg, model_fn)
    return engine.train(cfg, engine.MPIRanks(comm), callbacks=callbacks, stop=stop, data=data, keeper=keeper)
