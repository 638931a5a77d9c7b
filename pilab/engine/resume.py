"""Checkpoints as the loop writes and resumes them: ``write`` (a collective: every rank's own state
gathered, rank 0 writes, every rank learns whether it failed), ``load`` (rank 0 reads and verifies,
every rank gets the position or the same error), the data order of an epoch resumed at another np
(``epoch_plan``), and what the run's checkpoints cost (``summary``). The file format is
``pilab.engine.checkpoint``'s; what goes into a checkpoint is ``Session.save_checkpoint``'s, every
component's state under its name::

    failed = resume.write(session, epoch, gstep, epochs_log)      # None, or why (every rank)
    position = resume.load(cfg, ranks, model, optimizer)           # epoch, step_in_epoch, history, ...
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch
from torch import nn

from . import checkpoint
from .. import data as data_mod
from .checkpoint import CheckpointError, WriteError
from ..config import Config
from ..dist.helpers import bn_buffers, world


def summary(s: Session) -> dict:
    """What the run's checkpoints cost (rank 0's seconds, bytes per file) and the newest one's path."""
    secs = [x["seconds"] for x in s.saves]
    return {"count": len(s.saves), "every_steps": s.cfg.checkpoint_every_steps,
            "every_minutes": s.checkpoint_minutes, "seconds": secs,
            "mean_s": sum(secs) / len(secs) if secs else None,
            "bytes": s.saves[-1]["bytes"] if s.saves else None,
            "last": s.saves[-1]["path"] if s.saves else (checkpoint.latest(s.cfg.out) if s.cfg.out else None)}


def write(s: Session, epoch: int, gstep: int, epochs_log: list, *, step_in_epoch: int = 0,
                acc=None) -> str | None:
    """Rank 0 writes the checkpoint (``epoch`` full epochs and ``step_in_epoch`` steps done); every
    rank learns whether it failed (the reason) or not (None). A collective: every rank's own state
    (BatchNorm buffers, RNG) is gathered into it."""
    failed = None
    t = time.perf_counter()
    states = s.ranks.rank_states(s.model)
    if s.rank == 0:
        try:
            path = s.save_checkpoint(epoch, gstep, epochs_log, step_in_epoch=step_in_epoch,
                                     partial=acc.state() if step_in_epoch and acc is not None else None,
                                     states=states)
            s.saves.append({"at": t, "seconds": time.perf_counter() - t, "bytes": os.path.getsize(path),
                            "path": os.path.join(s.cfg.out, checkpoint.NAME), "step": gstep})
            s.last_save = time.monotonic()
        except WriteError as e:
            prev = checkpoint.epoch_files(s.cfg.out)
            failed = f"{e}; " + (f"the previous checkpoint ({os.path.basename(prev[-1][1])}) is intact"
                                 if prev else "there is no earlier checkpoint")
    if s.ranks.comm is not None and s.np_ > 1:
        failed = s.ranks.comm.bcast(failed, root=0)
    return failed


def epoch_plan(cfg: Config, ds, order_np: int, epoch: int, steps: int) -> np.ndarray:
    """(steps, global batch) training indices of ``epoch`` as a run at ``order_np`` ranks draws them:
    step s's global batch is rank 0's batch, then rank 1's, ... (what every rank computes alone)."""
    b = cfg.global_batch(order_np) // order_np
    plan = np.concatenate([data_mod.epoch_batches(ds.y_train, order_np, r, b, epoch, cfg.seed, cfg.sharding)
                           for r in range(order_np)], axis=1)
    if len(plan) != steps:
        raise CheckpointError(f"{cfg.resume} was made at np={order_np}, whose epochs have {len(plan)} steps; "
                              f"at this np they have {steps}, so the schedule would change; resume at "
                              f"np={order_np}, or at an np whose shards give the same steps")
    return plan


def _regroup_(state: dict, model: nn.Module, policy: str) -> None:
    """Resume at another np in the simulator: per-virtual-rank BatchNorm rows (np_old, C) are settled
    by ``policy`` (row 0 or the mean) and spread to this run's rows -- per-rank statistics regroup."""
    mine = model.state_dict()
    for k, v in state.items():
        if k in mine and v.shape != mine[k].shape and v.dim() == 2 and v.shape[1:] == mine[k].shape[-1:]:
            row = v[0] if policy == "broadcast" else v.mean(0)
            state[k] = row.expand_as(mine[k]).contiguous().clone()


def _average_saved_buffers_(model: nn.Module, states: list) -> None:
    """Resume at another np under MPI with bn_buffers=average: start from the mean of every saved
    rank's statistics (rank 0's alone under broadcast, which the model already holds)."""
    with torch.no_grad():
        for i, b in enumerate(bn_buffers(model)):
            b.copy_(torch.stack([st["bn"][i] for st in states]).mean(0))


def sources(cfg: Config, ds) -> dict:
    """What a run reads and builds from, as a checkpoint records it: the data set's checksum (its contents
    as loaded, subset included) and your model builder's file digest (``models.custom.source_digest``;
    None for a registered model)::

        resume.sources(cfg, ds)   # {"data_checksum": "5e1f...", "model_source": None}
    """
    from ..models.custom import source_digest
    return {"data_checksum": ds.checksum, "model_source": source_digest(cfg.model)}


def check_unchanged(cfg: Config, ds) -> None:
    """CheckpointError when ``cfg.resume`` was made on other data than ``ds`` or with another version of
    the model builder (``checkpoint.check_sources``); before any rank trains (``harness.prepare``)."""
    checkpoint.check_sources(checkpoint.read(cfg.resume), cfg.resume, **sources(cfg, ds))


def load(cfg: Config, ranks, model, optimizer, *, sources: dict | None = None) -> dict:
    """Rank 0 reads and verifies ``cfg.resume`` (checksum, settings, np; with ``sources``, the data and
    model source it was made with); every rank gets the position (epoch, step in epoch, history, partial
    sums, np, order np), rank 0 also the per-rank states (key ``ranks``), or every rank the same
    CheckpointError (never one rank failing while the others wait)."""
    comm, np_ = ranks.comm, ranks.np_
    rank, size = world(comm)
    meta = error = states = None
    if rank == 0:
        try:
            ck = checkpoint.load(cfg.resume, cfg, np_, **(sources or {}))
            other_np = int(ck["np"]) != np_
            if other_np and ranks.simulated:
                _regroup_(ck["model"], model, cfg.bn_buffers)
            checkpoint.apply(ck, model, optimizer, cfg.resume)
            states = ck["ranks"]
            if other_np and states and not ranks.simulated and cfg.bn_buffers == "average":
                _average_saved_buffers_(model, states)
            meta = {"epoch": int(ck["epoch"]), "history": list(ck["history"]),
                    "step_in_epoch": int(ck["step_in_epoch"]), "partial": ck["partial"], "np": int(ck["np"]),
                    "order_np": int(ck["order_np"]), "has_ranks": states is not None,
                    "components": ck["components"]}
        except CheckpointError as e:
            error = str(e)
    if size > 1:
        meta, error = comm.bcast((meta, error), root=0)
    if error:
        raise CheckpointError(error)
    meta["ranks"] = states if rank == 0 else None
    return meta
