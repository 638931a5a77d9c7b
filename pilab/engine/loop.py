"""The one training loop, over a rank backend (``pilab.engine.backend.RankBackend``): ``MPIRanks(comm)``
(this process is one rank of an MPI job, ``pilab.engine.mpi``) or ``VirtualRanks(np_)`` (the simulator,
``pilab.engine.virtual``). The loop owns data, schedule, steps, evaluation cadence, checkpoints, events
and the result; each feature (the weights' EMA, gradient clipping, local SGD, the noise-driven batch ramp,
the straggler monitor, the trace, and yours) is a component it calls at fixed moments (``pilab.component``,
``pilab.engine.features``)::

    from pilab import engine
    result, model = engine.fit(Config(epochs=1), engine.VirtualRanks(4))
    session = engine.Session(cfg, engine.MPIRanks(comm))      # one step at a time (tests)
    session.step(epoch=0, step=0)

``callbacks`` are called on rank 0 with event dicts (``kind`` = start | step | straggler | epoch | end);
``stop`` is polled on every rank each step and any rank's True stops all ranks together after that step.

What stays the loop's own, not a component, and why:

* checkpoints, mid-epoch ones included (``_set_checkpoints``, ``_save_due``, ``checkpoint.write_position``): a
  checkpoint *is* the loop's position (epoch, step in the epoch, the epoch's partial sums, the history,
  the data order's np), written between two steps with the loop's sums, and a failed write stops the loop
  after that step; the every-K-steps / M-minutes vote rides with the step's metrics like the stop vote.
  Components take part through ``state_dict`` / ``load_state_dict``, saved under their names.
* a resume regrouped at another np (``_resume``, ``checkpoint.epoch_plan``, ``ranks.carry``): it is the data
  order of the interrupted epoch and the model as loaded, settled before any component exists (the
  components start on the model already resumed).
* a fixed batch ramp (``Config.batch_ramp``): the batch plan is the schedule's input, as the learning
  rate is (``follow_plan``, ``lr``, ``enter_epoch``); a feature that *chooses* the plan as it goes is a
  component that calls ``session.follow_plan`` (``pilab.engine.noise.NoiseRamp``).
* deferred metrics (``VirtualRanks(defer_metrics=True)``): how a backend returns the step's sums (0-d
  device tensors, for ``scripts/gpu_check.py``'s Session), not a moment of the loop.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import itertools
import os
import time

import numpy as np
import torch
from torch import nn

from .. import __version__, data as data_mod, resultfile
from ..component import SYNC
from ..config import Config
from ..perfmodel import model_profile
from . import checkpoint, features, memory, records
from .backend import StepResult, load_data, local_ranks, resolve_device, split_sync_groups
from .checkpoint import CheckpointError
from .optim import build_optimizer, lr_at, set_lr
from .ownmodel import with_model
from .records import STEP_KEYS, TIME_KEYS, failure_reason

MULTI_NODE_CHECKPOINT_MINUTES = 10.0  # --checkpoint-minutes default (-1) on a run whose ranks span hosts


class Handoff:
    """A data set given to the Session for good (``data=Handoff(ds)``, then drop your own ``ds``): like
    ``data=None`` a static-sharded rank then keeps only its shard of the training images, and any MPI
    rank only its share of the test images, while a plain ``data=ds`` keeps them all (the caller may
    still use them; every frame on the way holds it)::

        ds = load_data(cfg, comm); cfg.check_world(comm.Get_size(), len(ds.y_train))
        pilab.train(cfg, comm, data=Handoff(ds)); del ds      # the CLI's ranks
    """

    def __init__(self, ds):
        self._ds = ds

    def take(self):
        ds, self._ds = self._ds, None
        return ds


class Session:
    """A run set up on ``ranks``: data, model, optimizer, schedule; ``step`` trains one step."""

    @functools.cached_property
    def model_profile(self) -> dict | None:
        """What analysis needs of the model (perfmodel.model_profile), on rank 0: measured where its code runs
        anyway, so reading the result never builds it again. Measured on first use -- when the result is
        written, after training -- because its probe models took ~80 MB more at setup, stacked on the
        training's own peak (tests/test_memory.py's prediction of a rank's peak)."""
        return model_profile(self.cfg.model, self.cfg.width, self.cfg.timesteps) if self.rank == 0 else None

    def __init__(self, cfg: Config, ranks, *, data=None, components=()):
        owned = data is None or isinstance(data, Handoff)
        self.cfg, self.ranks = cfg, ranks
        self.np_, self.rank = ranks.np_, ranks.rank
        self.components = features.chosen(cfg, ranks, components)  # each may refuse cfg here, before any work
        self.yours = [c.name or type(c).__name__ for c in components]  # result.json says they ran
        ranks.check(cfg, self.components)
        self.device = resolve_device(cfg)
        self.threads = ranks.threads(cfg)
        torch.set_num_threads(self.threads)  # before the memory probe's forward, which runs as the run will
        # malloc kept "fast" (a step reuses the last step's freed memory, no page faults) where this
        # node's ranks fit with it, else "lean" (pilab.engine.memory); the numbers computed are the same
        self.allocator = memory.choose_allocator(cfg, np_=None if ranks.simulated else self.np_,
                                                 ranks_per_node=local_ranks(ranks),
                                                 node_bytes=memory.host_memory_bytes())
        memory.tune_allocator(self.allocator)
        self._set_data(data.take() if isinstance(data, Handoff) else data, owned)
        self.model = ranks.build(cfg, self.device, self.ds, self.batch, self.components)
        # data and builder digests (a resume on other ones is refused)
        self.sources = checkpoint.sources(cfg, self.ds)
        self.first_batch = self.batch
        self.steps_per_epoch = ranks.steps_per_epoch  # the first epoch's (a batch ramp changes it)
        self.schedule_in_epochs = False  # a feature that chooses the batches as it goes sets it (see lr)
        self.follow_plan(cfg)
        self.peak_lr = cfg.peak_lr(self.np_)
        self.optimizer = build_optimizer(self.model, cfg, self.peak_lr)
        ck = self._resume(owned)
        ranks.start(cfg, self.model, self.optimizer, self.components)
        if ck.get("has_ranks") and self.resumed_np == self.np_:
            ranks.restore_rank_states(self.model, ck["ranks"] if self.rank == 0 else None)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._start_components(ck.get("components") or {})
        self._set_checkpoints()

    def _set_data(self, data, owned: bool) -> None:
        """The data set (``data``, else loaded), this rank's share of its test images, the batch."""
        cfg, ranks = self.cfg, self.ranks
        self.ds = data if data is not None else load_data(cfg, ranks.comm)
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

    def _resume(self, owned: bool) -> dict:
        """The position ``cfg.resume`` holds (``{}`` without one): model and optimizer loaded, the
        interrupted epoch's data order regrouped over these ranks where the np changed."""
        cfg, ranks, spe = self.cfg, self.ranks, self.steps_per_epoch
        ck = checkpoint.load_position(cfg, ranks, self.model, self.optimizer, sources=self.sources) \
            if cfg.resume else {}
        self.start_epoch, self.history = ck.get("epoch", 0), ck.get("history", [])
        self.start_step = ck.get("step_in_epoch", 0)  # steps of start_epoch already done
        self.partial = ck.get("partial")  # that epoch's sums so far
        self.resumed_np = ck.get("np", self.np_)
        if cfg.batch_ramp and self.resumed_np != self.np_:
            raise CheckpointError(f"{cfg.resume} was made at np={self.resumed_np} with a batch ramp, whose epochs "
                                  f"have another number of steps at np={self.np_}; resume it at np={self.resumed_np}")
        # the np whose data order the current epoch follows: a resume at another np (batch_mode=global)
        # finishes the interrupted epoch in the order it began with, regrouped over the new ranks
        self.order_np = ck.get("order_np", self.np_) if self.start_step else self.np_
        if self.order_np != self.np_:
            ranks.carry(self.start_epoch, checkpoint.epoch_plan(cfg, self.ds, self.order_np, self.start_epoch, spe),
                        self.ds)
        if owned and not ranks.simulated and cfg.sharding == "static" and self.order_np == self.np_:
            # The loader copied this rank's shard; the whole training set stays only where it is shared
            # (a caller's data, the simulator's ranks, reshuffled shards): a rank holds 1/np of it.
            # A new empty array, not x_train[:0]: a view would keep the whole array alive.
            self.ds = dataclasses.replace(self.ds, x_train=np.empty((0, *self.ds.x_train.shape[1:]),
                                                                    dtype=self.ds.x_train.dtype))
        return ck

    def _start_components(self, saved: dict) -> None:
        """Every feature started on the set-up session, then given its state from the checkpoint."""
        for c in self.components:
            c.start(self)
        for c in self.components:
            if saved.get(c.name) is not None:
                c.load_state_dict(saved[c.name])
        self.enter_epoch(self.start_epoch)

    def _set_checkpoints(self) -> None:
        """Mid-epoch checkpoints: every K steps, and/or every M minutes (rank 0's clock, voted with the
        step so every rank saves after the same one); -1 minutes means 10 on a multi-node run."""
        minutes = self.cfg.checkpoint_minutes
        if minutes < 0:
            hosts = self.ranks.hosts()
            minutes = MULTI_NODE_CHECKPOINT_MINUTES if self.cfg.out and len(set(hosts)) > 1 else 0.0
        self.checkpoint_minutes = minutes
        self.step_checkpoints = bool(self.cfg.out) and bool(self.cfg.checkpoint_every_steps or minutes)
        self.last_save = time.monotonic()
        self.saves: list[dict] = []  # seconds, bytes, path of each checkpoint written (rank 0)

    def follow_plan(self, bcfg: Config) -> None:
        """Follow ``bcfg``'s batches (``cfg``, or the choices so far of a feature that chooses them, such as
        ``pilab.engine.noise.NoiseRamp``): every epoch's steps, the global steps where each starts, the
        schedule's and the run's steps."""
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

    def enter_epoch(self, epoch: int) -> int:
        """The ranks set up for ``epoch`` (under a batch ramp: its batch); its number of steps."""
        if epoch < self.cfg.epochs and self.cfg.batch_ramp:
            b = self.bcfg.per_rank_batch(self.np_, epoch)
            if b != self.batch:
                self.batch = b
                self.ranks.set_batch(b)
        for c in self.components:
            c.begin_epoch(self, epoch)
        return self.epoch_steps[epoch] if epoch < self.cfg.epochs else 0

    def lr(self, global_step: int) -> float:
        peak, cfg = self.peak_lr, self.cfg
        if cfg.batch_ramp:  # the lr rule follows each epoch's global batch
            epoch = min(bisect.bisect_right(self.epoch_start, global_step) - 1, cfg.epochs - 1)
            peak = self.bcfg.peak_lr(self.np_, epoch)
        if not self.schedule_in_epochs:
            return lr_at(global_step, peak_lr=peak, total_steps=self.schedule_steps,
                         warmup_steps=self.warmup_steps, schedule=cfg.schedule,
                         decay_steps=round(cfg.decay_epochs * self.steps_per_epoch))
        # A ramp chosen as it goes (a noise-driven one) has later epochs whose steps are not yet known: its
        # schedule runs in epochs, counted in the first epoch's steps (so that epoch's learning rates are
        # those of a run without the ramp)
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
        self.phase = SYNC  # unless a component says otherwise (local SGD)
        for c in self.components:
            c.before_step(self, epoch, step)
        st = self.ranks.step(self.cfg, self.model, self.optimizer, epoch, step, stop,
                             lambda: self._save_due(gstep + 1), phase=self.phase)
        self.events = [e for c in self.components for e in c.after_step(self, epoch, step, st)]
        return st, lr

    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy of the model (or what a component puts in its place: the weights'
        moving average: ``pilab.engine.ema``)."""
        with contextlib.ExitStack() as stack:
            for c in self.components:
                stack.enter_context(c.evaluating(self))
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
              "ranks": states, **self.sources}
        states = {c.name: c.state_dict() for c in self.components}
        ck["components"] = {k: v for k, v in states.items() if v is not None}
        return checkpoint.save(self.cfg.out, ck, keep=self.cfg.keep)


# ----------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------
def fit(cfg: Config, ranks, *, components=(), callbacks=(), stop=None, data=None, keeper=None,
        model_fn=None) -> tuple[dict, nn.Module]:
    """Train ``cfg`` on ``ranks`` (``MPIRanks(comm)`` or ``VirtualRanks(np_)``); returns the result (on
    every rank; rank 0 writes ``<out>/result.json``) and the trained model. ``components``: yours, beside
    the features ``cfg`` asks for (``pilab.component``); ``model_fn``: your own model's builder (a function
    taking num_classes), instead of ``cfg.model``.

    A stop (``stop()`` true on any rank) ends every rank after the same step; the partial epoch is
    evaluated only if cheap (at most one evaluation batch per rank; else ``test_skipped``), and the
    result says ``stopped_early``, ``stop_reason``, ``epochs_done`` and ``steps_done``. A checkpoint
    that cannot be written stops the run the same way after that epoch (the earlier checkpoints stay).
    A result.json that cannot be written is reported in the returned result's ``write_error``.

    ``keeper`` (a ``Keeper``): on rank 0 it can write what was done so far as result.json at any moment
    (``stopped_early``, ``aborted``, the reason) -- from the watchdog's thread before it ends the rank,
    when another rank reports its exception, or on this rank's own exception."""
    t_wall = time.perf_counter()
    s = Session(with_model(cfg, model_fn), ranks, data=data, components=components)
    s.env = ranks.environment(s.threads)  # a collective: now, so that an abort can still write it
    run = _Run(s, callbacks, t_wall)
    placement = split_sync_groups(cfg, s.np_, s.env["hostnames"]) if s.rank == 0 and not ranks.simulated else None
    run.emit({"kind": "start", "np": s.np_, "steps_per_epoch": s.steps_per_epoch, "epochs": cfg.epochs,
              "start_epoch": s.start_epoch, "start_step": s.start_step, "total_steps": s.total_steps,
              "steps_done": run.gstep, "config": cfg.to_dict(), "warnings": [placement] if placement else [],
              **({"simulated": True} if ranks.simulated else {})})
    s.model.train()
    if keeper is not None and s.rank == 0 and cfg.out:
        keeper.attach(lambda reason: _keep(run, reason), os.path.join(cfg.out, "result.json"),
                      progress=lambda: len(run.steps_log["loss"]))
    try:
        for epoch in range(s.start_epoch, cfg.epochs):
            if run.gstep >= s.total_steps or _train_epoch(run, epoch, stop):
                break
    except BaseException as e:  # a rank's exception, a second Ctrl-C: keep what was done (rank 0)
        if keeper is not None and not isinstance(e, SystemExit):
            keeper("interrupted again: exited at once" if isinstance(e, KeyboardInterrupt) else
                   failure_reason(s.rank, e))
        raise
    ranks.close()
    return _finish(run), s.model


class _Run:
    """What one ``train`` call has done so far: the logs, the global step, how it stopped."""

    def __init__(self, s: Session, callbacks, t_wall: float):
        self.s, self.callbacks, self.t_wall = s, callbacks, t_wall
        self.steps_log = {k: [] for k in STEP_KEYS}
        self.epochs_log = list(s.history)
        self.bytes_per_step, self.stopped, self.stop_reason, self.write_error = 0, False, None, None
        self.gstep = s.epoch_start[min(s.start_epoch, s.cfg.epochs)] + s.start_step
        self.started_at = time.time()  # wall clock (and each epoch's started_at): joins a power meter's log

    def emit(self, event: dict) -> None:
        if self.s.rank == 0:
            for cb in self.callbacks:
                cb(event)

    def fail(self, reason: str) -> None:
        self.stopped, self.stop_reason, self.write_error = True, reason, reason


def _train_epoch(run: _Run, epoch: int, stop) -> bool:
    """Epoch ``epoch``'s steps, its record and checkpoint; True if the run stops after it."""
    s, cfg = run.s, run.s.cfg
    acc, t_epoch = records.EpochSums(), time.perf_counter()
    spe = s.enter_epoch(epoch)
    first = s.start_step if epoch == s.start_epoch else 0
    if first and s.partial:
        acc.restore(s.partial)
    started_at, save_at_end = time.time(), False
    for step in range(first, spe):
        if run.gstep >= s.total_steps:
            break
        st = _train_step(run, epoch, step, stop, acc)
        ending = st.stop_votes > 0 or run.gstep >= s.total_steps
        # a checkpoint asked for (every K steps, M minutes), or the last step of a stopped run
        if st.save_votes > 0 or (ending and s.step_checkpoints):
            if step + 1 < spe:  # mid-epoch: now, before any BatchNorm buffers are settled
                failed = checkpoint.write_position(s, epoch, run.gstep, run.epochs_log, step_in_epoch=step + 1, acc=acc)
                if failed:
                    run.fail(failed)
                    break
            else:  # the epoch's last step: the epoch's own checkpoint
                save_at_end = True
        if st.stop_votes > 0:
            run.stopped = True
            run.stop_reason = (getattr(stop, "reason", None) if s.rank == 0 else None) or \
                f"stop requested on {int(st.stop_votes)} of {s.np_} rank(s)"
            break
    record, checkpoint_now = records.end_epoch(s, epoch, acc, time.perf_counter() - t_epoch, run.steps_log,
                                        run.stopped, run.gstep, force=save_at_end)
    for c in s.components:
        c.end_epoch(s, epoch, record)
    record["started_at"] = started_at
    run.epochs_log.append(record)
    run.emit({"kind": "epoch", **record})
    if checkpoint_now and cfg.out:
        failed = checkpoint.write_position(s, epoch + 1, run.gstep, run.epochs_log)
        if failed:  # every rank stops here, after this full epoch
            run.fail(failed)
    return run.stopped


def _train_step(run: _Run, epoch: int, step: int, stop, acc: "records.EpochSums") -> StepResult:
    """One step, logged and emitted (with what the components say after it)."""
    s = run.s
    images_per_step = s.batch * s.np_
    st, lr = s.step(epoch, step, stop=stop)
    acc.add(st, images_per_step)
    run.bytes_per_step = st.bytes_sent
    mean_loss = st.loss_sum / images_per_step
    for k, v in zip(STEP_KEYS, (mean_loss, lr, st.time, st.compute, st.comm, st.comm_exposed,
                                st.data, st.comm_wait)):
        run.steps_log[k].append(v)
    run.gstep += 1
    run.emit({"kind": "step", "epoch": epoch + 1, "step": step + 1, "global_step": run.gstep,
              "total_steps": s.total_steps, "loss": mean_loss, "lr": lr,
              "images_per_s": images_per_step / st.time, "time": st.time,
              **{k: getattr(st, k) for k in TIME_KEYS}})
    for event in s.events:
        run.emit(event)
    return st


def _finish(run: _Run) -> dict:
    """The run's result, with every component's part; rank 0 writes it as result.json."""
    s, cfg = run.s, run.s.cfg
    result = records.result(s, run.epochs_log, run.steps_log, run.bytes_per_step, run.stopped,
                     time.perf_counter() - run.t_wall)
    for c in s.components:  # a component that runs on rank 0 alone (the straggler monitor) speaks there only
        result.update(c.result())
    if s.rank == 0:
        result["checkpoints"] = checkpoint.summary(s)
        result["last_checkpoint"] = result["checkpoints"]["last"]
    result["stop_reason"] = run.stop_reason
    result["started_at"], result["ended_at"] = run.started_at, time.time()  # see pilab.study.energy
    if run.write_error:
        result["write_error"] = run.write_error
    if s.rank == 0 and cfg.out:
        try:
            resultfile.save(result, os.path.join(cfg.out, "result.json"))
        except OSError as e:  # rank 0 alone: report it, don't fail one rank of a finished job
            result["write_error"] = "; ".join(filter(None, [run.write_error, (
                f"cannot write {os.path.join(cfg.out, 'result.json')}: {e.strerror or e} (an earlier "
                "result.json there is intact)")]))
    run.emit({"kind": "end", "result": result})
    return result


def _keep(run: _Run, reason: str) -> str:
    """The result of a run ended by ``reason`` after what is in the logs (rank 0, no collective)."""
    s = run.s
    res = records.result(s, list(run.epochs_log), {k: list(v) for k, v in run.steps_log.items()}, 0, True,
                  time.perf_counter() - run.t_wall, collective=False)
    res.update(stop_reason=reason, aborted=True, started_at=run.started_at, ended_at=time.time(),
               checkpoints=checkpoint.summary(s))
    res["last_checkpoint"] = res["checkpoints"]["last"]
    for c in s.components:
        res.update(c.result())
    path = os.path.join(s.cfg.out, "result.json")
    resultfile.save(res, path)
    return path


