"""The MPI rank backend (``pilab.engine.backend.RankBackend``): ``MPIRanks(comm)`` -- this process is one
rank of an MPI job (or the only process, ``comm=None``): gradients averaged by ``GradSync``, metrics and
the stop vote riding with its last bucket, BatchNorm buffers settled by ``sync_buffers_``. The
simulator's backend, ``VirtualRanks``, is ``pilab.engine.virtual``'s.

A backend builds the model and its loaders, takes one step (``step``: a ``StepResult`` that every rank
agrees on; its components' in-step moments see a ``pilab.component.RankStep``), re-cuts its batches for a
batch ramp, settles, gathers and restores per-rank state for checkpoints, and evaluates. What both
backends use (the forward-and-loss recipe, the model, the evaluation) is ``pilab.engine.backend``'s; the
loop that drives them is ``pilab.engine.loop``'s::

    from pilab import engine
    result, model = engine.fit(cfg, engine.MPIRanks(comm))
"""
from __future__ import annotations

import copy
import os
import socket
import time

import torch
from torch import nn

from .. import data as data_mod
from ..component import SYNC, Phase, RankStep, has
from ..config import Config
from ..dist import (GradSync, Slots, bn_buffers, broadcast_module_, broadcast_optimizer_state_,
                    convert_sync_batchnorm, gather_floats, sync_buffers_, world)
from ..launch import mpi
from .backend import (StepResult, base_model, environment, evaluate, forward_loss, phase_spans, slot_sizes,
                      usable_cores)
from .layers import step_seed
from .optim import SubsetStep

_SUMS = ("loss_sum", "correct", "stop_votes", "save_votes")  # MPIRanks' slots summed with the last bucket


class MPIRanks:
    """This process is rank ``comm.Get_rank()`` of ``comm`` (``None``: a single process, no MPI)."""

    simulated = False

    def __init__(self, comm=None):
        self.comm = comm
        self.rank, self.np_ = world(comm)
        self.gsync = None

    def threads(self, cfg: Config) -> int:
        """``cfg.threads``, or cores per node divided by the ranks on this node."""
        if cfg.threads:
            return cfg.threads
        local = 1
        if self.comm is not None and self.np_ > 1:
            node = self.comm.Split_type(mpi().COMM_TYPE_SHARED)  # a communicator: MPI is loaded
            local = node.Get_size()
            node.Free()
        # Under mpiexec a rank may be bound to one core; the node's core count is what we divide.
        cores = max(usable_cores(), os.cpu_count() or 1) if self.comm is not None else usable_cores()
        return max(1, cores // local)

    def check(self, cfg: Config, components=()) -> None:
        """Settings this backend cannot run (MPI ranks run them all)."""

    def build(self, cfg: Config, device, ds, batch: int, components=()) -> nn.Module:
        self.loader = data_mod.ShardLoader(ds, self.np_, self.rank, batch, seed=cfg.seed,
                                           policy=cfg.sharding, augment=cfg.augment,
                                           copies=cfg.batch_aug)
        self.steps_per_epoch = self.loader.steps_per_epoch
        self.batch, self.device, self.eval_batch, self.tta = batch, device, cfg.eval_batch, cfg.tta
        self.tta_translate = cfg.tta_translate
        model = base_model(cfg, device, steps_per_epoch=self.steps_per_epoch, data=ds)
        if cfg.bn == "sync":
            convert_sync_batchnorm(model, self.comm, cfg.sync_group(self.np_))
        return model

    def start(self, cfg: Config, model: nn.Module, optimizer, components=()) -> None:
        """Every rank starts identical: rank 0's parameters, buffers and optimizer state. ``components``:
        their in-step moments (``pilab.component``): ``on_rank_grads`` with each bucket this rank sends,
        ``on_grads`` before every optimizer step once the gradients are averaged (a local step: this
        rank's own), ``on_step`` after it; their slots ride with the last bucket."""
        broadcast_module_(model, self.comm)
        broadcast_optimizer_state_(optimizer, self.comm)
        # The step's sums ride with the last gradient bucket (plus every rank's ready time, which GradSync
        # adds), so a step has one synchronisation point, not two: the loss and correct images, the votes
        # to stop or checkpoint after this step (any rank's, so every rank acts after the same step; rank
        # 0's clock decides a --checkpoint-minutes save), each rank's network time of the step before
        # (one slot per rank: the straggler monitor compares them live), and the components' own slots
        self.slots = Slots()
        for name in _SUMS:
            self.slots.declare(name)
        self.slots.declare("network", self.np_)
        mine = slot_sizes(components, self.np_)
        for name, n in mine.items():
            self.slots.declare(name, n)
        self.components = list(components)
        self.rec = RankStep(self.rank, self.np_)
        sends = has(components, "on_rank_grads")
        self.gsync = GradSync(model, self.comm, bucket_mb=cfg.bucket_mb, tail_mb=cfg.bucket_tail_mb,
                              compression=cfg.compression, meta=self.slots,
                              on_send=self._on_send if sends else None,
                              observe=any(c.watch_messages for c in components))
        self.rec.send = self.rec.sums = {name: self.gsync.meta[self.slots[name]] for name in
                                         [*_SUMS, "network", *mine, "ready"]}
        self.own = list(mine)  # zeroed before each step: a rank writes only its own values
        self._prev_net = 0.0
        self.optimizer, self.own_weights = optimizer, False  # own_weights: a local step ran (local SGD)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step_as_landed = cfg.step_as_landed and self.np_ > 1
        self.stepper = SubsetStep.of(optimizer) if self.step_as_landed else None

    def _on_send(self, grads: list) -> None:
        for c in has(self.components, "on_rank_grads"):
            c.on_rank_grads(self.rec, grads)

    def step(self, cfg: Config, model, optimizer, epoch: int, step: int, stop=None, save=None,
             phase: Phase = SYNC) -> StepResult:
        sync, ph, rec = self.gsync, phase, self.rec
        sync.exchange = not ph.local  # a local-SGD step sends only the metrics and votes
        for name in self.own:
            rec.send[name][:] = 0.0
        t0 = time.perf_counter()
        sync.begin(t0)
        share = ph.share_of(self.rank)  # uneven shares (a component's, Phase.shares): this rank's images
        x, y = self.loader.batch(epoch, step, share=share)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t1 = time.perf_counter()
        torch.manual_seed(step_seed(cfg.seed, epoch, step, self.rank))
        optimizer.zero_grad(set_to_none=False)
        out, loss = forward_loss(model, x, y, cfg, self.device)
        self._fill_meta(loss, out, y, stop, save, self.batch if share is None else share[1])
        tf = time.perf_counter()
        sync.backward(loss, ph.weight_of(self.rank))
        grads = has(self.components, "on_grads")
        # each bucket's parameters stepped as its average lands, inside the wait (bitwise the same step);
        # not with on_grads, which must see every averaged gradient before any step
        stepper = self.stepper if sync.exchange and not grads else None
        cstats = sync.finish(step=stepper) if stepper is not None else sync.finish()
        for c in grads:
            c.on_grads([p.grad for p in self.params])
        if stepper is not None:
            stepper.rest()
        else:
            optimizer.step()
        averaged, sent = 0.0, cstats.bytes_sent
        if ph.local:
            self.own_weights = True
        if ph.average:  # the ranks' parameters and BatchNorm statistics averaged, blocking
            ta = time.perf_counter()
            sent += sync.average_parameters_()
            sync_buffers_(model, self.comm, "average")
            averaged = time.perf_counter() - ta
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        meta, at = sync.meta, self.slots
        loss_sum, correct_sum, votes, saves = (float(meta[at[k]][0]) for k in _SUMS)
        # Every step starts together (right after the previous step's exchange), so a rank whose last
        # gradient was ready `max(ready) - ready` before the slowest rank's waited that long for it;
        # the rest of the exposed time is the network's.
        ready = meta[at["ready"]]
        wait = min(cstats.exposed, max(0.0, float(ready.max() - ready[self.rank]))) if self.np_ > 1 else 0.0
        self._prev_net = cstats.exposed - wait + averaged
        tw = cstats.backward_end + cstats.exposed if cstats.backward_end else cstats.ready  # one rank: no wait
        rec.spans = phase_spans(self.rank, (t0, t1, tf, cstats.backward_end or tw, tw, t2))
        rec.flights = [(self.rank, k, n, a, b) for k, n, a, b in cstats.flights]
        for c in self.components:
            c.on_step(rec)
        # compute: forward + backward + optimizer, the time spent waiting in finish() (and averaging) taken out
        return StepResult(loss_sum, correct_sum, votes, time=t2 - t0,
                          compute=(t2 - t1) - cstats.exposed - averaged, comm=cstats.total + averaged,
                          comm_exposed=cstats.exposed + averaged, data=t1 - t0,
                          bytes_sent=sent, comm_wait=wait, save_votes=saves)

    def _fill_meta(self, loss, out, y, stop, save, images: int) -> None:
        """This rank's share of the values that ride with the last gradient bucket (``GradSync.meta``).

        The step's metrics and the stop vote are known once the forward is done; riding with the last
        bucket, the step synchronises the ranks once, not twice. On CPU reading them here costs nothing;
        the stop is polled before backward, and still takes effect after this step on every rank."""
        want_stop = bool(stop()) if stop is not None else False
        with torch.no_grad():
            correct = (out.argmax(1) == y).sum()
        want_save = bool(save()) if save is not None else False
        meta, at = self.gsync.meta, self.slots
        meta[[at[k].start for k in _SUMS]] = (loss.item() * images, correct.item(), want_stop, want_save)
        nets = meta[at["network"]]
        nets[:] = 0.0
        nets[self.rank] = self._prev_net

    def set_batch(self, batch: int) -> None:
        """A batch-size ramp's next batch: the same shard, cut into batches of ``batch``."""
        self.batch = batch
        self.loader.set_batch(batch)
        self.steps_per_epoch = self.loader.steps_per_epoch

    def settle(self, model, policy: str) -> None:
        """All ranks must evaluate (and checkpoint) the same model: settle BN statistics first."""
        sync_buffers_(model, self.comm, policy)

    def rank_states(self, model) -> list | None:
        """Every rank's own state, in rank order on rank 0 (None elsewhere): its BatchNorm running
        statistics (per rank with bn=local until settled) and its torch RNG state. A collective."""
        mine = {"bn": [b.detach().cpu().clone() for b in bn_buffers(model)], "rng": torch.get_rng_state()}
        if self.own_weights:  # after a local step: this rank's own parameters and momentum (local SGD)
            mine["local"] = {"params": [p.detach().clone() for p in self.params],
                             "opt": [copy.deepcopy(self.optimizer.state.get(p, {})) for p in self.params]}
        if self.comm is None or self.np_ == 1:
            return [mine]
        return self.comm.gather(mine, root=0)

    def restore_rank_states(self, model, states: list | None) -> None:
        """The inverse of ``rank_states`` at the same np: rank r gets row r (a collective)."""
        if self.comm is not None and self.np_ > 1:
            states = self.comm.scatter(states, root=0)
        else:
            states = states[0]
        with torch.no_grad():
            for b, v in zip(bn_buffers(model), states["bn"]):
                b.copy_(v)
            if "local" in states:  # each rank's own weights and momentum (local SGD)
                self.own_weights = True
                for p, v, st in zip(self.params, states["local"]["params"], states["local"]["opt"]):
                    p.copy_(v)
                    self.optimizer.state[p] = copy.deepcopy(st)
        torch.set_rng_state(states["rng"])

    def hosts(self) -> list[str]:
        host = socket.gethostname()
        return self.comm.allgather(host) if self.comm is not None and self.np_ > 1 else [host]

    def carry(self, epoch: int, plan, ds) -> None:
        """Epoch ``epoch`` follows ``plan`` (steps, global batch) of training indices: this rank takes
        its contiguous share of every global batch (a resume at another np, see ``Session``)."""
        b = self.batch
        self.loader.carry(epoch, plan[:, self.rank * b:(self.rank + 1) * b], ds)

    def evaluate(self, model, ds) -> tuple[float, float]:
        return evaluate(model, ds, self.comm, self.device, self.eval_batch, tta=self.tta,
                        translate=self.tta_translate)

    def per_rank(self, values: list[float]):
        """``values`` of every rank in rank order (rows), on rank 0; None elsewhere."""
        return gather_floats(values, self.comm)

    def environment(self, threads: int) -> dict:
        return environment(self.comm, threads, self.device)

    def close(self) -> None:
        if self.gsync is not None:
            self.gsync.remove()

    def extras(self) -> dict:
        return {}
