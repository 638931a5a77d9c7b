"""The one training loop, over either of the two ways to run its ranks.

``train(cfg, ranks)`` runs synchronous data-parallel SGD over a *rank backend*:

* ``MPIRanks(comm)`` — this process is one rank of an MPI job (or the only process, ``comm=None``):
  gradients averaged by ``GradSync``, metrics and the stop vote riding with its last bucket,
  BatchNorm buffers settled by ``dist.sync_buffers_``, checkpoints and resume;
* ``VirtualRanks(np_)`` — the simulator: np ranks emulated in this process, each rank's sub-batch
  through its own forward (ghost BatchNorm per virtual rank, dropout per rank seed), gradients
  accumulated in rank order as MPI sums them, the same buffer policy over the virtual rows.

(Both live in ``pilab.engine.ranks``, with the pieces they share; this module re-exports them.)
Everything else — data, schedule, step log, epoch record, evaluation cadence, events, result — is this
module's, once. The public entry points are thin: ``pilab.engine.train.run(cfg, comm=...)`` and
``pilab.engine.simulate.run(cfg, np_=...)``::

    from pilab.engine import loop as engine
    result, model = engine.train(Config(epochs=1), engine.VirtualRanks(4))
    session = engine.Session(cfg, engine.MPIRanks(comm))      # one step at a time (tests)
    session.step(epoch=0, step=0)

``callbacks`` are called on rank 0 with event dicts (``kind`` = start | step | epoch | end); ``stop`` is
polled on every rank each step and any rank's True stops all ranks together after that step.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import os
import socket
import time
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from .. import __version__
from . import checkpoint, localsgd, noise
from .. import data as data_mod
from .checkpoint import CheckpointError, WriteError
from ..config import Config
from ..launch import launcher_local_size
from .ema import WeightAverage
from .dist import bn_buffers, world
from ..files import save_json
from ..models import memory
from .optim import build_optimizer, lr_at, set_lr
# the rank backends and the pieces they share, re-exported: ``loop`` is the engine's one public face
from .ranks import (EVAL_BATCH, NUM_CLASSES, MPIRanks, StepResult, VirtualRanks,  # noqa: F401 (re-exported)
                    base_model, environment, evaluate, load_data, peak_mem_mb, resolve_device)

__all__ = ["train", "Session", "Keeper", "failure_reason", "result_from_checkpoint", "MPIRanks", "VirtualRanks",
           "StepResult", "load_data", "evaluate", "resolve_device", "environment", "peak_mem_mb", "NUM_CLASSES",
           "EVAL_BATCH", "Handoff"]

# comm_wait is the part of comm_exposed spent waiting for a slower rank to reach the gradient Allreduce
# (a straggler); comm_exposed - comm_wait is what the network itself cost (see MPIRanks.step).
STEP_KEYS = ("loss", "lr", "time", "compute", "comm", "comm_exposed", "data", "comm_wait")
TIME_KEYS = ("compute", "comm", "comm_exposed", "data", "comm_wait")
# --checkpoint-minutes default (-1) on a run whose ranks are on more than one host
MULTI_NODE_CHECKPOINT_MINUTES = 10.0
# A run stopped early evaluates only if that is cheap: at most one evaluation batch per rank.
EVAL_ON_STOP_MAX = EVAL_BATCH


# ----------------------------------------------------------------------------------------------
# the session: set-up once, then steps
# ----------------------------------------------------------------------------------------------
class Handoff:
    """A data set given to the Session for good (``data=Handoff(ds)``, then drop your own ``ds``): like
    ``data=None`` a static-sharded rank then keeps only its shard of the training images, and any MPI
    rank only its share of the test images, while a plain ``data=ds`` keeps them all (the caller may
    still use them; every frame on the way holds it)::

        ds = load_data(cfg, comm); cfg.check_world(comm.Get_size(), len(ds.y_train))
        train.run(cfg, comm, data=Handoff(ds)); del ds      # the CLI's ranks
    """

    def __init__(self, ds):
        self._ds = ds

    def take(self):
        ds, self._ds = self._ds, None
        return ds


class Session:
    """A run set up on ``ranks``: data, model, optimizer, schedule; ``step`` trains one step."""

    def __init__(self, cfg: Config, ranks, *, data=None):
        owned = data is None or isinstance(data, Handoff)
        if isinstance(data, Handoff):
            data = data.take()
        ranks.check(cfg)
        self.cfg, self.ranks = cfg, ranks
        self.np_, self.rank = ranks.np_, ranks.rank
        # malloc kept "fast" (a step reuses the last step's freed memory, no page faults) where this
        # node's ranks fit with it, else "lean" (pilab.models.memory); the numbers computed are the same
        self.allocator = memory.choose_allocator(cfg, np_=None if ranks.simulated else self.np_,
                                                 ranks_per_node=local_ranks(ranks),
                                                 node_bytes=memory.host_memory_bytes())
        memory.tune_allocator(self.allocator)
        self.device = resolve_device(cfg)
        self.threads = ranks.threads(cfg)
        torch.set_num_threads(self.threads)
        self.ds = data if data is not None else ranks.load(cfg)
        data = None  # no second reference here: what the Session drops below (data it owns) is freed at once
        cfg.check_world(self.np_, len(self.ds.y_train))
        if owned and not ranks.simulated and self.np_ > 1:
            # Evaluation reads only this rank's test_shard (see evaluate): the other ranks' test images
            # need no memory here (15 MB of the 31 MB test set at np=2). Before the loader copies the
            # training shard, so that the two copies of the test rows are never held beside it.
            self.ds = self.ds.with_test_rows(data_mod.test_shard(len(self.ds.y_test), self.np_, self.rank))
        self.batch = cfg.per_rank_batch(self.np_)
        self.accounting = data_mod.epoch_accounting(self.ds.y_train, self.np_, self.batch, cfg.sharding,
                                                    seed=cfg.seed)
        self.model = ranks.build(cfg, self.device, self.ds, self.batch)
        self.first_batch = self.batch
        spe = self.steps_per_epoch = ranks.steps_per_epoch  # the first epoch's (a batch ramp changes it)
        # a noise-driven ramp (batch_ramp="gns:MAX") measures the gradient noise scale over each epoch and
        # chooses the next epoch's batch from it (pilab.engine.noise); the choices so far are an explicit
        # ramp, which the rest of the Session follows as it follows a given one
        self.noise = noise.NoiseScale() if cfg.gns_max else None
        self._set_plan(replace(cfg, batch_ramp="") if self.noise is not None else cfg)
        self.peak_lr = cfg.peak_lr(self.np_)
        self.optimizer = build_optimizer(self.model, cfg, self.peak_lr)
        ck = _load_checkpoint(cfg, ranks, self.model, self.optimizer) if cfg.resume else {}
        self.start_epoch, self.history = ck.get("epoch", 0), ck.get("history", [])
        self.start_step = ck.get("step_in_epoch", 0)  # steps of start_epoch already done
        self.partial = ck.get("partial")  # that epoch's sums so far
        if self.noise is not None and ck.get("gns"):  # the batches chosen so far, the noise measured so far
            self._set_plan(replace(cfg, batch_ramp=ck["gns"]["plan"]))
            self.noise.restore(ck["gns"]["noise"])
        self.resumed_np = ck.get("np", self.np_)
        if cfg.batch_ramp and self.resumed_np != self.np_:
            raise CheckpointError(f"{cfg.resume} was made at np={self.resumed_np} with a batch ramp, whose epochs "
                                  f"have another number of steps at np={self.np_}; resume it at np={self.resumed_np}")
        # the np whose data order the current epoch follows: a resume at another np (batch_mode=global)
        # finishes the interrupted epoch in the order it began with, regrouped over the new ranks
        self.order_np = ck.get("order_np", self.np_) if self.start_step else self.np_
        if self.order_np != self.np_:
            ranks.carry(self.start_epoch, _epoch_plan(cfg, self.ds, self.order_np, self.start_epoch, spe),
                        self.ds)
        if owned and not ranks.simulated and cfg.sharding == "static" and self.order_np == self.np_:
            # The loader copied this rank's shard; the whole training set stays only where it is shared
            # (a caller's data, the simulator's ranks, reshuffled shards): a rank holds 1/np of it.
            # A new empty array, not x_train[:0]: a view would keep the whole array alive.
            self.ds = dataclasses.replace(self.ds, x_train=np.empty((0, *self.ds.x_train.shape[1:]),
                                                                    dtype=self.ds.x_train.dtype))
        if cfg.local_steps > 1 and self.start_step and self.resumed_np != self.np_ and \
                localsgd.phase(cfg, spe, self.start_epoch, self.start_step - 1).local:
            raise CheckpointError(f"{cfg.resume} was taken between two parameter averages of local SGD, where "
                                  f"each of its {self.resumed_np} ranks holds its own weights; resume it at "
                                  f"np={self.resumed_np}, or from an epoch's checkpoint (checkpoint-eNNNN.pt)")
        ranks.start(cfg, self.model, self.optimizer)
        if ck.get("has_ranks") and self.resumed_np == self.np_:
            ranks.restore_rank_states(self.model, ck["ranks"] if self.rank == 0 else None)
        # The weights' moving average (cfg.ema_epochs: its time constant), updated where every rank's
        # weights are the same: the same average on every rank with no communication (pilab.engine.ema)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.ema = WeightAverage(self.params, math.exp(-1 / (cfg.ema_epochs * spe))) if cfg.ema_epochs else None
        self.enter_epoch(self.start_epoch)
        self.ema_pending = ck.get("ema_pending", 0)  # steps since its last update
        if self.ema is not None and ck.get("ema") is not None:
            self.ema.load(ck["ema"])
        # Mid-epoch checkpoints: every K steps, and/or every M minutes (rank 0's clock, voted with the
        # step so every rank saves after the same one); -1 minutes means 10 on a multi-node run.
        minutes = cfg.checkpoint_minutes
        if minutes < 0:
            hosts = ranks.hosts()
            minutes = MULTI_NODE_CHECKPOINT_MINUTES if cfg.out and len(set(hosts)) > 1 else 0.0
        self.checkpoint_minutes = minutes
        self.step_checkpoints = bool(cfg.out) and bool(cfg.checkpoint_every_steps or minutes)
        self.last_save = time.monotonic()
        self.saves: list[dict] = []  # seconds, bytes, path of each checkpoint written (rank 0)

    def _set_plan(self, bcfg: Config) -> None:
        """Follow ``bcfg``'s batches (``cfg``, or under a noise-driven ramp the choices so far): every
        epoch's steps, the global steps where each starts, the schedule's and the run's steps."""
        cfg, spe = self.cfg, self.steps_per_epoch
        self.bcfg = bcfg
        self.epoch_steps = [spe if bcfg.per_rank_batch(self.np_, e) == self.first_batch else data_mod.epoch_accounting(
            len(self.ds.y_train), self.np_, bcfg.per_rank_batch(self.np_, e), cfg.sharding, seed=cfg.seed)["steps"]
            for e in range(cfg.epochs)]
        self.epoch_start = list(itertools.accumulate([0] + self.epoch_steps))  # each epoch's first global step
        # The schedule spans all epochs; max_steps only cuts the run short (an interruption), so a run
        # resumed from its checkpoint follows the same learning rates as an uninterrupted one.
        self.schedule_steps = self.epoch_start[-1]
        self.total_steps = min(self.schedule_steps, cfg.max_steps) if cfg.max_steps else self.schedule_steps
        whole, part = int(cfg.warmup_epochs), cfg.warmup_epochs % 1
        self.warmup_steps = round(cfg.warmup_epochs * spe) if not cfg.batch_ramp else \
            self.epoch_start[whole] + (round(part * self.epoch_steps[whole]) if whole < cfg.epochs else 0)

    def choose_batch(self, epoch: int) -> dict:
        """After every step of ``epoch`` (a noise-driven ramp only): the epoch's gradient noise scale and
        the per-rank batch it chooses for the next epoch, which the plan then follows. The same numbers on
        every rank (their norms travel exactly), so every rank chooses alike, with no collective."""
        value = self.noise.value()
        cur = self.bcfg.per_rank_batch(self.np_, epoch)
        nxt = noise.next_batch(cur, self.cfg.gns_ladder_per_rank(self.np_), self.np_, value)
        self.noise.reset()
        if nxt != cur and epoch + 1 < self.cfg.epochs:
            sense = nxt if self.cfg.batch_mode == "per_rank" else nxt * self.np_
            self._set_plan(replace(self.cfg, batch_ramp=",".join(filter(None, [self.bcfg.batch_ramp,
                                                                                f"{epoch + 1}:{sense}"]))))
        return {**noise.record(value), "next_per_rank_batch": nxt if epoch + 1 < self.cfg.epochs else None}

    def enter_epoch(self, epoch: int) -> int:
        """The ranks set up for ``epoch`` (under a batch ramp: its batch); its number of steps."""
        if epoch < self.cfg.epochs and self.cfg.batch_ramp:
            b = self.bcfg.per_rank_batch(self.np_, epoch)
            if b != self.batch:
                self.batch = b
                self.ranks.set_batch(b)
            if self.ema is not None:  # the same time constant in epochs, whatever the steps
                self.ema.decay = math.exp(-1 / (self.cfg.ema_epochs * self.epoch_steps[epoch]))
        return self.epoch_steps[epoch] if epoch < self.cfg.epochs else 0

    def lr(self, global_step: int) -> float:
        peak, cfg = self.peak_lr, self.cfg
        if cfg.batch_ramp:  # the lr rule follows each epoch's global batch
            epoch = min(bisect.bisect_right(self.epoch_start, global_step) - 1, cfg.epochs - 1)
            peak = self.bcfg.peak_lr(self.np_, epoch)
        if self.noise is None:
            return lr_at(global_step, peak_lr=peak, total_steps=self.schedule_steps,
                         warmup_steps=self.warmup_steps, schedule=cfg.schedule)
        # A noise-driven ramp's later epochs have steps not yet known: its schedule runs in epochs, counted
        # in the first epoch's steps (so that epoch's learning rates are those of a run without the ramp)
        unit = self.epoch_steps[0]
        at = (epoch + (global_step - self.epoch_start[epoch]) / self.epoch_steps[epoch]) * unit
        return lr_at(at, peak_lr=peak, total_steps=cfg.epochs * unit, warmup_steps=cfg.warmup_epochs * unit,
                     schedule=cfg.schedule)

    def step(self, epoch: int, step: int, *, stop=None) -> tuple[StepResult, float]:
        """Train step ``step`` of ``epoch`` on every rank; returns (the step, its learning rate).

        ``stop()`` is polled once the step's work is done; its vote travels with the step's metrics,
        and so does the vote for a checkpoint after this step (``StepResult.save_votes``)."""
        self.enter_epoch(epoch)
        gstep = self.epoch_start[epoch] + step
        lr = self.lr(gstep)
        set_lr(self.optimizer, lr)
        st = self.ranks.step(self.cfg, self.model, self.optimizer, epoch, step, stop,
                             lambda: self._save_due(gstep + 1))
        if self.noise is not None and st.avg_grad_sq is not None:
            self.noise.add(st.ranks_grad_sq, st.avg_grad_sq, self.batch, self.np_)
        if self.ema is not None:
            self.ema_pending += 1
            ph = localsgd.phase(self.cfg, self.epoch_steps[epoch], epoch, step)
            if not ph.local or ph.average:
                self.ema.update(self.params, steps=self.ema_pending)
                self.ema_pending = 0
        return st, lr

    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy of the model, or of its weights' moving average (``cfg.ema_epochs``)."""
        if self.ema is None:
            return self.ranks.evaluate(self.model, self.ds)
        with self.ema.applied(self.params):
            return self.ranks.evaluate(self.model, self.ds)

    def _save_due(self, steps_done: int) -> bool:
        k, m = self.cfg.checkpoint_every_steps, self.checkpoint_minutes
        if not self.cfg.out:
            return False
        if k and steps_done % k == 0:
            return True
        return bool(m) and self.rank == 0 and time.monotonic() - self.last_save >= m * 60

    def save_checkpoint(self, epoch: int, global_step: int, history: list, *, step_in_epoch: int = 0,
                        partial: dict | None = None, states: list | None = None) -> str:
        """``<out>/checkpoint-eNNNN.pt`` (``-sNNNNN`` mid-epoch; + ``checkpoint.pt``), checksummed (see
        ``pilab.engine.checkpoint``); raises ``WriteError`` with the earlier checkpoints intact. ``epoch`` is
        the number of full epochs done, ``step_in_epoch`` the steps of the next one done."""
        ck = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
              "epoch": epoch, "step": global_step, "np": self.np_, "config": self.cfg.to_dict(),
              "history": history, "pilab_version": __version__, "step_in_epoch": step_in_epoch,
              "order_np": self.order_np if step_in_epoch else self.np_, "partial": partial,
              "ranks": states}
        if self.ema is not None:
            ck.update(ema=self.ema.state(), ema_pending=self.ema_pending)
        if self.noise is not None:
            ck["gns"] = {"plan": self.bcfg.batch_ramp, "noise": self.noise.state()}
        return checkpoint.save(self.cfg.out, ck, keep=self.cfg.keep)


def _epoch_plan(cfg: Config, ds, order_np: int, epoch: int, steps: int) -> np.ndarray:
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


def _load_checkpoint(cfg: Config, ranks, model, optimizer) -> dict:
    """Rank 0 reads and verifies ``cfg.resume`` (checksum, settings, np); every rank gets the position
    (epoch, step in epoch, history, partial sums, np, order np), rank 0 also the per-rank states (key
    ``ranks``), or every rank the same CheckpointError (never one rank failing while the others wait)."""
    comm, np_ = ranks.comm, ranks.np_
    rank, size = world(comm)
    meta = error = states = None
    if rank == 0:
        try:
            ck = checkpoint.load(cfg.resume, cfg, np_)
            other_np = int(ck.get("np", np_)) != np_
            if other_np and ranks.simulated:
                _regroup_(ck["model"], model, cfg.bn_buffers)
            checkpoint.apply(ck, model, optimizer, cfg.resume)
            states = ck.get("ranks")
            if other_np and states and not ranks.simulated and cfg.bn_buffers == "average":
                _average_saved_buffers_(model, states)
            meta = {"epoch": int(ck["epoch"]), "history": list(ck["history"]),
                    "step_in_epoch": int(ck.get("step_in_epoch") or 0), "partial": ck.get("partial"),
                    "np": int(ck.get("np", np_)), "order_np": int(ck.get("order_np") or ck.get("np", np_)),
                    "has_ranks": states is not None, "ema": ck.get("ema"), "ema_pending": int(ck.get("ema_pending") or 0),
                    "gns": ck.get("gns")}
        except CheckpointError as e:
            error = str(e)
    if size > 1:
        meta, error = comm.bcast((meta, error), root=0)
    if error:
        raise CheckpointError(error)
    meta["ranks"] = states if rank == 0 else None
    return meta


# ----------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------
class _Epoch:
    """Sums over one epoch's steps (global loss/correct/images, this rank's times)."""

    def __init__(self):
        self.loss = self.correct = self.images = 0.0
        self.times = dict.fromkeys(TIME_KEYS, 0.0)
        self.steps = 0

    def state(self) -> dict:
        """The sums so far (a mid-epoch checkpoint keeps them for the epoch's record)."""
        return {"loss": self.loss, "correct": self.correct, "images": self.images, "steps": self.steps,
                "times": dict(self.times)}

    def restore(self, d: dict) -> None:
        self.loss, self.correct, self.images, self.steps = d["loss"], d["correct"], d["images"], d["steps"]
        self.times.update(d["times"])

    def add(self, st: StepResult, images: int) -> None:
        self.loss += st.loss_sum
        self.correct += st.correct
        self.images += images
        self.steps += 1
        for k in TIME_KEYS:
            self.times[k] += getattr(st, k)


def train(cfg: Config, ranks, *, callbacks=(), stop=None, data=None, keeper=None) -> tuple[dict, nn.Module]:
    """Train ``cfg`` on ``ranks`` (``MPIRanks(comm)`` or ``VirtualRanks(np_)``); returns the result (on
    every rank; rank 0 writes ``<out>/result.json``) and the trained model.

    A stop (``stop()`` true on any rank) ends every rank after the same step; the partial epoch is
    evaluated only if cheap (at most one evaluation batch per rank; else ``test_skipped``), and the
    result says ``stopped_early``, ``stop_reason``, ``epochs_done`` and ``steps_done``. A checkpoint
    that cannot be written stops the run the same way after that epoch (the earlier checkpoints stay).
    A result.json that cannot be written is reported in the returned result's ``write_error``.

    ``keeper`` (a ``Keeper``): on rank 0 it can write what was done so far as result.json at any moment
    (``stopped_early``, ``aborted``, the reason) -- from the watchdog's thread before it ends the rank,
    when another rank reports its exception, or on this rank's own exception."""
    t_wall = time.perf_counter()
    s = Session(cfg, ranks, data=data)
    s.env = ranks.environment(s.threads)  # a collective: now, so that an abort can still write it
    spe = s.steps_per_epoch

    def emit(event):
        if s.rank == 0:
            for cb in callbacks:
                cb(event)

    placement = split_sync_groups(cfg, s.np_, s.env["hostnames"]) if s.rank == 0 and not ranks.simulated else None
    emit({"kind": "start", "np": s.np_, "steps_per_epoch": spe, "epochs": cfg.epochs,
          "start_epoch": s.start_epoch, "start_step": s.start_step, "total_steps": s.total_steps,
          "steps_done": s.epoch_start[min(s.start_epoch, cfg.epochs)] + s.start_step,
          "config": cfg.to_dict(), "warnings": [placement] if placement else [],
          **({"simulated": True} if ranks.simulated else {})})
    steps_log = {k: [] for k in STEP_KEYS}
    epochs_log = list(s.history)
    bytes_per_step, stopped, stop_reason, write_error = 0, False, None, None
    gstep = s.epoch_start[min(s.start_epoch, cfg.epochs)] + s.start_step
    s.model.train()
    run_started_at = time.time()  # wall clock (and epoch_started_at): joins a power meter's log
    monitor = None
    if s.rank == 0 and not ranks.simulated and s.np_ > 1 and cfg.straggler_threshold > 0:
        from .stragglers import Monitor
        monitor = Monitor(s.env["hostnames"], threshold=cfg.straggler_threshold, steps=cfg.straggler_steps,
                          window=2 * cfg.straggler_steps)
    if keeper is not None and s.rank == 0 and cfg.out:
        keeper.attach(lambda reason: _keep(s, epochs_log, steps_log, t_wall, run_started_at, reason, monitor),
                      os.path.join(cfg.out, "result.json"), progress=lambda: len(steps_log["loss"]))
    try:
        for epoch in range(s.start_epoch, cfg.epochs):
            if gstep >= s.total_steps:
                break
            acc, t_epoch = _Epoch(), time.perf_counter()
            spe = s.enter_epoch(epoch)
            images_per_step = s.batch * s.np_
            first = s.start_step if epoch == s.start_epoch else 0
            if first and s.partial:
                acc.restore(s.partial)
            epoch_started_at = time.time()
            save_at_end = False
            for step in range(first, spe):
                if gstep >= s.total_steps:
                    break
                st, lr = s.step(epoch, step, stop=stop)
                acc.add(st, images_per_step)
                bytes_per_step = st.bytes_sent
                mean_loss = st.loss_sum / images_per_step
                for k, v in zip(STEP_KEYS, (mean_loss, lr, st.time, st.compute, st.comm, st.comm_exposed,
                                            st.data, st.comm_wait)):
                    steps_log[k].append(v)
                gstep += 1
                emit({"kind": "step", "epoch": epoch + 1, "step": step + 1, "global_step": gstep,
                      "total_steps": s.total_steps, "loss": mean_loss, "lr": lr,
                      "images_per_s": images_per_step / st.time, "time": st.time,
                      **{k: getattr(st, k) for k in TIME_KEYS}})
                if monitor is not None and st.ranks_compute is not None:
                    for line in monitor.add(gstep, st.ranks_compute, st.ranks_network, st.network_bytes):
                        emit({"kind": "straggler", "line": line, "global_step": gstep,
                              "stragglers": monitor.summary()})
                ending = st.stop_votes > 0 or gstep >= s.total_steps
                # a checkpoint asked for (every K steps, M minutes), or the last step of a stopped run
                if st.save_votes > 0 or (ending and s.step_checkpoints):
                    if step + 1 < spe:  # mid-epoch: now, before any BatchNorm buffers are settled
                        failed = _checkpoint(s, epoch, gstep, epochs_log, step_in_epoch=step + 1, acc=acc)
                        if failed:
                            stopped, stop_reason, write_error = True, failed, failed
                            break
                    else:  # the epoch's last step: the epoch's own checkpoint
                        save_at_end = True
                if st.stop_votes > 0:
                    stopped = True
                    stop_reason = (getattr(stop, "reason", None) if s.rank == 0 else None) or \
                        f"stop requested on {int(st.stop_votes)} of {s.np_} rank(s)"
                    break
            # a noise-driven ramp chooses the next epoch's batch after each whole epoch (before its checkpoint)
            chosen = s.choose_batch(epoch) if s.noise is not None and acc.steps == s.epoch_steps[epoch] else {}
            record, checkpoint_now = _end_epoch(s, epoch, acc, time.perf_counter() - t_epoch, steps_log,
                                                stopped, gstep, force=save_at_end)
            record.update(chosen)
            record["started_at"] = epoch_started_at
            epochs_log.append(record)
            emit({"kind": "epoch", **record})
            if checkpoint_now and cfg.out:
                failed = _checkpoint(s, epoch + 1, gstep, epochs_log)
                if failed:  # every rank stops here, after this full epoch
                    stopped, stop_reason, write_error = True, failed, failed
            if stopped:
                break
    except BaseException as e:  # a rank's exception, a second Ctrl-C: keep what was done (rank 0)
        if keeper is not None and not isinstance(e, SystemExit):
            keeper("interrupted again: exited at once" if isinstance(e, KeyboardInterrupt) else
                   failure_reason(s.rank, e))
        raise
    ranks.close()
    result = _result(s, epochs_log, steps_log, bytes_per_step, stopped, time.perf_counter() - t_wall)
    if s.rank == 0:
        result["stragglers"] = monitor.summary() if monitor is not None else []
        result["straggler_lines"] = monitor.lines if monitor is not None else []
        result["checkpoints"] = _checkpoint_summary(s)
        result["last_checkpoint"] = result["checkpoints"]["last"]
    result["stop_reason"] = stop_reason
    result["started_at"], result["ended_at"] = run_started_at, time.time()  # see pilab.study.energy
    if write_error:
        result["write_error"] = write_error
    if s.rank == 0 and cfg.out:
        try:
            save_json(result, os.path.join(cfg.out, "result.json"))
        except OSError as e:  # rank 0 alone: report it, don't fail one rank of a finished job
            result["write_error"] = "; ".join(filter(None, [write_error, (
                f"cannot write {os.path.join(cfg.out, 'result.json')}: {e.strerror or e} (an earlier "
                "result.json there is intact)")]))
    emit({"kind": "end", "result": result})
    return result, s.model


def split_sync_groups(cfg: Config, np_: int, hostnames: list[str]) -> str | None:
    """A warning when SyncBatchNorm's groups of ``cfg.bn_group`` consecutive ranks span hosts (their
    Allreduces then cross the network at every BatchNorm layer), else None::

        split_sync_groups(Config(bn="sync", bn_group=2), 4, ["pi01", "pi02", "pi01", "pi02"])  # a warning
    """
    g = cfg.sync_group(np_)
    if not 1 < g < np_ or len(hostnames) != np_:
        return None
    split = [r for r in range(0, np_, g) if len(set(hostnames[r:r + g])) > 1]
    if not split:
        return None
    r = split[0]
    return (f"bn_group={g}: {len(split)} of {np_ // g} SyncBatchNorm groups span hosts (ranks {r}-{r + g - 1} on "
            f"{', '.join(dict.fromkeys(hostnames[r:r + g]))}), so their Allreduces cross the network; give each host "
            f"its slot count in the hosts file (e.g. '{hostnames[r]}:{g}') so consecutive ranks share a node")


def local_ranks(ranks) -> int:
    """The ranks on this node, as the launcher says (``launch.launcher_local_size``); one for a single
    process (the simulator, np=1, an unknown launcher)."""
    if getattr(ranks, "simulated", False):
        return 1
    return max(1, launcher_local_size())


def failure_reason(rank: int, e: BaseException) -> str:
    """One line naming the rank, its host and the exception (a result's ``stop_reason``)."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"rank {rank} ({socket.gethostname()}) failed: {type(e).__name__}" + (f": {text}" if text else "")


class Keeper:
    """Keeps what a run did when it cannot finish: ``keeper(reason)`` writes ``<out>/result.json`` with
    ``stopped_early``, ``aborted``, ``stop_reason`` (naming the rank and host), the steps and epochs
    done and the last checkpoint, once; a no-op on ranks other than 0 and before the run started.
    Thread-safe, and no collective: it runs while the other ranks are gone::

        keeper = engine.Keeper()
        with Watchdog(comm, hang_s, on_end=keeper) as wd:
            train.run(cfg, comm, stop=wd.polled(), keeper=keeper)
    """

    SETTLE_S, SETTLE_MAX_S = 0.5, 3.0

    def __init__(self):
        import threading
        self._lock = threading.RLock()  # a signal handler may call it on the thread that holds it
        self._write = None
        self._progress = None
        self.written: str | None = None  # the path written

    def attach(self, write, path: str = "", progress=None) -> None:
        """``write(reason)`` writes the result; ``progress()`` counts the steps the run has recorded."""
        self._write, self._path, self._progress = write, path, progress

    def _settle(self) -> None:
        # Called from another thread (a peer said it failed, the watchdog fired), the training thread
        # may be between a step's finished exchange and its record: a failed peer lets it finish at most
        # that one step, so wait until the count stops moving (briefly: the peer waits for our "ok").
        import threading
        if self._progress is None or threading.current_thread() is threading.main_thread():
            return
        end, last, since = time.monotonic() + self.SETTLE_MAX_S, self._progress(), time.monotonic()
        while time.monotonic() < end and time.monotonic() - since < self.SETTLE_S:
            time.sleep(0.05)
            now = self._progress()
            if now != last:
                last, since = now, time.monotonic()

    def cleanup(self) -> None:
        """Remove a temporary file a write cut short left (a process about to ``os._exit``)."""
        tmp = f"{getattr(self, '_path', '')}.tmp{os.getpid()}"
        if getattr(self, "_path", "") and os.path.exists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass

    def __call__(self, reason: str) -> str | None:
        if self._write is not None and self.written is None:
            self._settle()
        with self._lock:
            if self._write is None or self.written is not None:
                return self.written
            try:
                self.written = self._write(reason)
            except OSError:
                pass  # a disk that fails now is no reason to hide the run's own failure
            return self.written


def _keep(s: Session, epochs_log: list, steps_log: dict, t_wall: float, started_at: float,
          reason: str, monitor=None) -> str:
    """The result of a run ended by ``reason`` after what is in the logs (rank 0, no collective)."""
    res = _result(s, list(epochs_log), {k: list(v) for k, v in steps_log.items()}, 0, True,
                  time.perf_counter() - t_wall, collective=False)
    res.update(stop_reason=reason, aborted=True, started_at=started_at, ended_at=time.time(),
               checkpoints=_checkpoint_summary(s))
    res["last_checkpoint"] = res["checkpoints"]["last"]
    res["stragglers"] = monitor.summary() if monitor is not None else []
    path = os.path.join(s.cfg.out, "result.json")
    save_json(res, path)
    return path


def result_from_checkpoint(cfg: Config, np_: int, reason: str) -> dict:
    """A result for a run whose ranks all died without writing one (what a launcher can still say):
    ``stopped_early``, ``aborted``, the reason, and the steps and epochs its newest checkpoint in
    ``cfg.out`` holds (0 without one; every step after it is lost)."""
    latest = checkpoint.latest(cfg.out) if cfg.out else None
    ck = None
    if latest:
        try:
            ck = checkpoint.read(latest)
        except CheckpointError:
            ck = None
    history = list(ck["history"]) if ck else []
    return {"pilab_version": __version__, "config": cfg.to_dict(), "np": np_, "epochs": history,
            "stopped_early": True, "aborted": True, "stop_reason": reason, "steps_done": int(ck["step"]) if ck else 0,
            "epochs_done": int(ck["epoch"]) if ck else 0, "last_checkpoint": latest if ck else None,
            "steps_done_is": "the newest checkpoint's step (steps after it are lost)", "ended_at": time.time()}


def _checkpoint_summary(s: Session) -> dict:
    """What the run's checkpoints cost (rank 0's seconds, bytes per file) and the newest one's path."""
    secs = [x["seconds"] for x in s.saves]
    return {"count": len(s.saves), "every_steps": s.cfg.checkpoint_every_steps,
            "every_minutes": s.checkpoint_minutes, "seconds": secs,
            "mean_s": sum(secs) / len(secs) if secs else None,
            "bytes": s.saves[-1]["bytes"] if s.saves else None,
            "last": s.saves[-1]["path"] if s.saves else (checkpoint.latest(s.cfg.out) if s.cfg.out else None)}


def _checkpoint(s: Session, epoch: int, gstep: int, epochs_log: list, *, step_in_epoch: int = 0,
                acc: "_Epoch | None" = None) -> str | None:
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
            s.saves.append({"seconds": time.perf_counter() - t, "bytes": os.path.getsize(path),
                            "path": os.path.join(s.cfg.out, checkpoint.NAME), "step": gstep})
            s.last_save = time.monotonic()
        except WriteError as e:
            prev = checkpoint.epoch_files(s.cfg.out)
            failed = f"{e}; " + (f"the previous checkpoint ({os.path.basename(prev[-1][1])}) is intact"
                                 if prev else "there is no earlier checkpoint")
    if s.ranks.comm is not None and s.np_ > 1:
        failed = s.ranks.comm.bcast(failed, root=0)
    return failed


def _end_epoch(s: Session, epoch: int, acc: _Epoch, train_time: float, steps_log: dict,
               stopped: bool, gstep: int, *, force: bool = False) -> tuple[dict, bool]:
    """Evaluate if due, settle buffers for evaluation or checkpoint, and build the epoch record."""
    cfg = s.cfg
    last = stopped or gstep >= s.total_steps or epoch + 1 == cfg.epochs
    evaluate_now = last or (epoch + 1) % cfg.eval_every == 0
    # Stopped early (Ctrl-C, a batch system's SIGTERM, run.stop()): evaluate only if cheap, so the
    # ranks leave promptly. Decided from sizes alone, so every rank decides the same.
    per_rank_test = -(-len(s.ds.y_test) // (1 if s.ranks.simulated else s.np_))
    skip_test = stopped and per_rank_test > EVAL_ON_STOP_MAX
    evaluate_now = evaluate_now and not skip_test
    full_epoch = acc.steps == s.epoch_steps[epoch]
    checkpoint_now = full_epoch and (force or (bool(cfg.checkpoint_every) and (
        epoch + 1) % cfg.checkpoint_every == 0 and not stopped))
    t_eval = time.perf_counter()
    test_loss = test_acc = None
    if evaluate_now or checkpoint_now or last:  # the last model is the same on every rank
        s.ranks.settle(s.model, cfg.bn_buffers)
    if evaluate_now:
        test_loss, test_acc = s.evaluate()
    eval_time = time.perf_counter() - t_eval
    per_rank = s.ranks.per_rank([acc.times[k] for k in TIME_KEYS])
    images = max(acc.images, 1)
    record = {
        "epoch": epoch + 1, "steps": acc.steps,
        "train_loss": acc.loss / images, "train_acc": acc.correct / images,
        "test_loss": test_loss, "test_acc": test_acc,
        "lr": steps_log["lr"][-1] if steps_log["lr"] else None,
        "time": train_time, "eval_time": eval_time, "images": int(acc.images),
        "images_per_s": acc.images / train_time if train_time > 0 else None,
        **acc.times,
    }
    if skip_test:
        record["test_skipped"] = (f"stopped early; evaluating {per_rank_test} test images per rank "
                                  f"is more than the {EVAL_ON_STOP_MAX} done on a stop")
    if per_rank is not None and s.rank == 0:
        record["per_rank"] = {k: per_rank[:, i].tolist() for i, k in enumerate(TIME_KEYS)}
    return record, checkpoint_now


def _result(s: Session, epochs_log: list, steps_log: dict, bytes_per_step: int, stopped: bool,
            wall: float, *, collective: bool = True) -> dict:
    """The run's result: the config, environment, per-epoch metrics, per-step timings, peak memory."""
    cfg, ds = s.cfg, s.ds
    mem = s.ranks.per_rank([peak_mem_mb()]) if collective else None
    env = s.env
    new = epochs_log[len(s.history):]
    train_total = sum(e["time"] for e in new)
    images_total = sum(e["images"] for e in new)
    return {
        "pilab_version": __version__, **s.ranks.extras(), "config": cfg.to_dict(), "allocator": s.allocator,
        "np": s.np_, "threads": s.threads,
        "per_rank_batch": cfg.per_rank_batch(s.np_), "global_batch": cfg.global_batch(s.np_), "peak_lr": s.peak_lr,
        "warmup_steps": s.warmup_steps, "steps_per_epoch": s.steps_per_epoch,
        "total_steps": s.total_steps, "schedule_steps": s.schedule_steps,
        "data": {"source": ds.source, "checksum": ds.checksum, "n_train": int(len(ds.y_train)),
                 "n_test": int(len(ds.y_test)), "sharding": cfg.sharding, **s.accounting},
        "env": env, "epochs": epochs_log, "steps": steps_log, "bytes_per_step": bytes_per_step,
        "wall_time": wall, "train_time": train_total,
        "images_per_s": images_total / train_total if train_total else None,
        "peak_mem_mb": (mem[:, 0].tolist() if mem is not None else [peak_mem_mb()]) if s.rank == 0 else None,
        "stopped_early": stopped, "resumed_from_epoch": s.start_epoch,
        "resumed_from_step": s.epoch_start[s.start_epoch] + s.start_step, "resumed_from_np": s.resumed_np,
        "steps_done": len(steps_log["loss"]) + s.epoch_start[s.start_epoch] + s.start_step,
        "epochs_done": sum(1 for e in epochs_log if e["steps"] == s.epoch_steps[e["epoch"] - 1]),
        **({"batch_plan": [{"epoch": e + 1, "per_rank_batch": s.bcfg.per_rank_batch(s.np_, e), "steps": n}
                           for e, n in enumerate(s.epoch_steps)]} if cfg.batch_ramp else {}),
        **({"batch_ramp_chosen": s.bcfg.batch_ramp} if s.noise is not None else {}),
    }
