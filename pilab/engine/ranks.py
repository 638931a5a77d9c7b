"""The two ways to run a training loop's ranks (``pilab.engine.backend.RankBackend``).

* ``MPIRanks(comm)`` — this process is one rank of an MPI job (or the only process, ``comm=None``):
  gradients averaged by ``GradSync``, metrics and the stop vote riding with its last bucket,
  BatchNorm buffers settled by ``dist.sync_buffers_``;
* ``VirtualRanks(np_)`` — the simulator: np ranks emulated in this process (``cfg.simulate_mode``): each
  rank's sub-batch through its own forward, gradients accumulated in rank order as MPI sums them (exact),
  or the global batch in one forward (fast); either way ghost BatchNorm per virtual rank, dropout per rank
  seed, the same buffer policy over the virtual rows.

A backend builds the model and its loaders, takes one synchronous step (``step``: a ``StepResult`` that
every rank agrees on), re-cuts its batches for a batch ramp, settles, gathers and restores per-rank state
for checkpoints, and evaluates. What both use (the forward-and-loss recipe, the model, the evaluation)
is ``pilab.engine.backend``'s. The loop that drives them (schedule, records, checkpoints, events) is
``pilab.engine.loop``, which re-exports everything here::

    from pilab.engine import loop as engine
    result, model = engine.train(cfg, engine.VirtualRanks(4))
"""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import torch
from torch import nn

from . import localsgd
from .. import data as data_mod
from ..config import Config, ConfigError
from ..launch import mpi
# the pieces every backend uses, re-exported (``pilab.engine.loop`` re-exports them again)
from .backend import (EVAL_BATCH, NUM_CLASSES, RankBackend, StepResult, base_model,  # noqa: F401
                      environment, evaluate, forward_loss, load_data, peak_mem_mb, resolve_device, usable_cores)
from .dist import (GradSync, Slots, bn_buffers, broadcast_module_, broadcast_optimizer_state_, gather_floats,
                   share_of_mean, squared_norm, sync_buffers_, world)
from .layers import RankContext, convert_sync_batchnorm, step_seed, sync_virtual_buffers_
from .optim import SubsetStep
from .trace import Timeline

# simulate_mode=fast runs the global batch in one forward (the memory of one process training it, the
# physical bound); on a GPU the exact mode's chunks are about this many images
EXACT_CUDA_CHUNK_IMAGES = 256
_SUMS = ("loss_sum", "correct", "stop_votes", "save_votes")  # MPIRanks' slots summed with the last bucket


def mode_used(cfg: Config) -> str:
    """The simulator's mode for ``cfg``: ``simulate_mode`` itself, or for ``auto`` the fast mode (the same
    mathematics to float rounding, at about one process's cost) unless the run needs each rank's own
    weights or gradient (local SGD, a noise-driven batch ramp), which only the exact mode runs::

        mode_used(Config())                 # "fast"
        mode_used(Config(local_steps=4))    # "exact"
    """
    if cfg.simulate_mode != "auto":
        return cfg.simulate_mode
    return "exact" if cfg.local_steps > 1 or cfg.gns_max else "fast"


def _on_grads(fns, params: list) -> None:
    """The components' ``on_grads`` moment: the gradients a backend is about to step with."""
    for fn in fns:
        fn([p.grad for p in params])


# ----------------------------------------------------------------------------------------------
# rank backends
# ----------------------------------------------------------------------------------------------
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

    def check(self, cfg: Config) -> None:
        """Settings this backend cannot run (MPI ranks run them all)."""

    def build(self, cfg: Config, device, ds, batch: int) -> nn.Module:
        self.loader = data_mod.ShardLoader(ds, self.np_, self.rank, batch, seed=cfg.seed,
                                           policy=cfg.sharding, augment=cfg.augment)
        self.steps_per_epoch = self.loader.steps_per_epoch
        self.batch, self.device, self.eval_batch, self.tta = batch, device, cfg.eval_batch, cfg.tta
        model = base_model(cfg, device, steps_per_epoch=self.steps_per_epoch, data=ds)
        if cfg.bn == "sync":
            convert_sync_batchnorm(model, self.comm, cfg.sync_group(self.np_))
        return model

    def start(self, cfg: Config, model: nn.Module, optimizer, on_grads=()) -> None:
        """Every rank starts identical: rank 0's parameters, buffers and optimizer state. ``on_grads``:
        callables given the gradients (``p.grad`` of the trainable parameters) before every optimizer
        step, once they are averaged (a local-SGD step: this rank's own)."""
        broadcast_module_(model, self.comm)
        broadcast_optimizer_state_(optimizer, self.comm)
        # The step's sums ride with the last gradient bucket (plus every rank's ready time, which GradSync
        # adds), so a step has one synchronisation point, not two: the loss and correct images, the votes
        # to stop or checkpoint after this step (any rank's, so every rank acts after the same step; rank
        # 0's clock decides a --checkpoint-minutes save), and each rank's network time of the step before
        # (one slot per rank), which rank 0's straggler monitor compares live (pilab.engine.stragglers)
        self.slots = Slots()
        for name in _SUMS:
            self.slots.declare(name)
        self.slots.declare("network", self.np_)
        self.trace = cfg.trace  # each step's phase boundaries and messages' flights (pilab.engine.trace)
        self.gsync = GradSync(model, self.comm, bucket_mb=cfg.bucket_mb, tail_mb=cfg.bucket_tail_mb,
                              compression=cfg.compression, meta=self.slots, norms=bool(cfg.gns_max), observe=cfg.trace)
        self.on_grads = tuple(on_grads)
        self._prev_net, self._prev_sent = 0.0, None
        self.optimizer, self.local = optimizer, cfg.local_steps > 1
        # each bucket's parameters stepped as its average lands, inside the wait (bitwise the same step);
        # not with on_grads, which must see every averaged gradient before any step
        self.stepper = (SubsetStep.of(optimizer) if cfg.step_as_landed and not self.on_grads
                        and self.np_ > 1 else None)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, cfg: Config, model, optimizer, epoch: int, step: int, stop=None, save=None) -> StepResult:
        sync = self.gsync
        ph = localsgd.phase(cfg, self.steps_per_epoch, epoch, step)
        sync.exchange = not ph.local  # a local-SGD step sends only the metrics and votes
        t0 = time.perf_counter()
        sync.begin(t0)
        x, y = self.loader.batch(epoch, step)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t1 = time.perf_counter()
        torch.manual_seed(step_seed(cfg.seed, epoch, step, self.rank))
        optimizer.zero_grad(set_to_none=False)
        out, loss = forward_loss(model, x, y, cfg, self.device)
        # The step's metrics and the stop vote are known once the forward is done; they ride with the
        # last gradient bucket (GradSync's meta), so the step synchronises the ranks once, not twice.
        # On CPU reading them here costs nothing; the stop is polled before backward, and still takes
        # effect after this step on every rank.
        want_stop = bool(stop()) if stop is not None else False
        with torch.no_grad():
            correct = (out.argmax(1) == y).sum()
        want_save = bool(save()) if save is not None else False
        meta, at = sync.meta, self.slots
        meta[[at[k].start for k in _SUMS]] = (loss.item() * self.batch, correct.item(), want_stop, want_save)
        nets = meta[at["network"]]
        nets[:] = 0.0
        nets[self.rank] = self._prev_net
        tf = time.perf_counter() if self.trace else 0.0
        sync.backward(loss)
        stepper = self.stepper if sync.exchange else None
        cstats = sync.finish(step=stepper) if stepper is not None else sync.finish()
        grad_sq = avg_sq = None
        if sync.norms and sync.exchange:  # every rank's, exact (see GradSync's norms); the average's
            grad_sq, avg_sq = meta[at["grad_sq"]].copy(), squared_norm([p.grad for p in self.params])
        _on_grads(self.on_grads, self.params)
        if stepper is not None:
            stepper.rest()
        else:
            optimizer.step()
        averaged, sent = 0.0, cstats.bytes_sent
        if ph.average:  # local SGD: the ranks' parameters and BatchNorm statistics averaged, blocking
            ta = time.perf_counter()
            sent += sync.average_parameters_()
            sync_buffers_(model, self.comm, "average")
            averaged = time.perf_counter() - ta
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss_sum, correct_sum, votes, saves = (float(meta[at[k]][0]) for k in _SUMS)
        # Every step starts together (right after the previous step's exchange), so a rank whose last
        # gradient was ready `max(ready) - ready` before the slowest rank's waited that long for it;
        # the rest of the exposed time is the network's.
        ready = meta[at["ready"]]
        wait = min(cstats.exposed, max(0.0, float(ready.max() - ready[self.rank]))) if self.np_ > 1 else 0.0
        self._prev_net = cstats.exposed - wait + averaged
        # the first step reports no network time yet (0 s): any payload pairs with it
        net_bytes, self._prev_sent = (sent if self._prev_sent is None else self._prev_sent), sent
        # compute: forward + backward + optimizer, the time spent waiting in finish() (and averaging) taken out
        return StepResult(loss_sum, correct_sum, votes, time=t2 - t0,
                          compute=(t2 - t1) - cstats.exposed - averaged, comm=cstats.total + averaged,
                          comm_exposed=cstats.exposed + averaged, data=t1 - t0,
                          bytes_sent=sent, comm_wait=wait, save_votes=saves,
                          ranks_compute=ready.copy(), ranks_network=meta[at["network"]].copy(),
                          network_bytes=net_bytes,
                          ranks_grad_sq=grad_sq, avg_grad_sq=avg_sq, timeline=self._timeline(t0, t1, tf, cstats, t2))

    def _timeline(self, t0: float, t1: float, tf: float, cstats, t2: float):
        """With ``Config.trace``, the step's phases (data from t0, forward from t1, backward from tf, the
        wait from the end of backward, the optimizer from the wait's end to t2) and its messages' flights."""
        if not self.trace:
            return None
        tw = cstats.backward_end + cstats.exposed if cstats.backward_end else cstats.ready  # one rank: no wait
        return Timeline(self.rank, (t0, t1, tf, cstats.backward_end or tw, tw, t2), cstats.flights)

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
        if self.local:  # local SGD: this rank's own parameters and momentum (see pilab.engine.localsgd)
            mine["local"] = localsgd.rank_state(self.params, self.optimizer)
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
        if self.local and "local" in states:
            localsgd.load_rank_state_(self.params, self.optimizer, states["local"])
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
        return evaluate(model, ds, self.comm, self.device, self.eval_batch, tta=self.tta)

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


class VirtualRanks:
    """``np_`` ranks emulated in this process, exactly (see ``pilab.engine.simulate``)."""

    simulated = True
    rank = 0
    comm = None

    def __init__(self, np_: int, ranks_per_chunk: int = 0, *, defer_metrics: bool = False):
        if np_ < 1:
            raise ConfigError(f"np={np_} must be >= 1")
        self.np_, self.ranks_per_chunk = np_, ranks_per_chunk
        # defer_metrics: step() returns loss_sum and correct as 0-d device tensors and never waits for
        # the device (no .item(), no synchronize), so a GPU runs ahead of the host; the caller reads
        # them at the epoch's end (scripts/gpu_check.py). engine.train() needs floats: leave it False.
        self.defer_metrics = defer_metrics

    def threads(self, cfg: Config) -> int:
        return cfg.threads or usable_cores()

    def check(self, cfg: Config) -> None:
        """Refuse settings the simulator does not emulate exactly."""
        if cfg.bn == "sync" and self.ranks_per_chunk not in (0, self.np_):
            raise ConfigError(f"bn=sync runs all {self.np_} virtual ranks in one forward (BatchNorm over the "
                              f"global batch), but ranks_per_chunk={self.ranks_per_chunk}; leave it 0")
        if cfg.bn == "sync" and cfg.gns_max and self.np_ > 1:
            raise ConfigError(f"bn=sync runs all ranks in one forward, but batch_ramp={cfg.batch_ramp!r} needs "
                              "each rank's own gradient; use bn=local, or run it under mpiexec")
        if cfg.compression != "none":
            raise ConfigError("the simulator does not emulate compression=fp16; use compression=none")
        if cfg.local_steps > 1 and cfg.simulate_mode == "fast":
            raise ConfigError("simulate_mode=fast runs several ranks per forward, but local SGD (local_steps > 1) "
                              "gives each rank its own weights; use simulate_mode=exact")
        if cfg.gns_max and cfg.simulate_mode == "fast":
            raise ConfigError(f"simulate_mode=fast runs several ranks per forward, but batch_ramp={cfg.batch_ramp!r} "
                              "needs each rank's own gradient; use simulate_mode=exact")

    def build(self, cfg: Config, device, ds, batch: int) -> nn.Module:
        np_ = self.np_
        # On a GPU the images live and are augmented there (no per-step host-to-device copy).
        self.loaders = [data_mod.ShardLoader(ds, np_, r, batch, seed=cfg.seed, policy=cfg.sharding,
                                             augment=cfg.augment,
                                             device=device if device.type == "cuda" else None)
                        for r in range(np_)]
        self.steps_per_epoch = self.loaders[0].steps_per_epoch
        self.batch, self.device, self.eval_batch, self.tta = batch, device, cfg.eval_batch, cfg.tta
        # One rank per forward on CPU reproduces an MPI rank's arithmetic exactly (same conv kernels on
        # the same batch). Several ranks per forward are faster on a GPU but sum weight gradients in
        # another order, and BatchNorm's shift invariance amplifies that float noise (~1e-3 after a step).
        # simulate_mode=fast: the global batch in one forward (the memory of one process training it), ghost
        # BN vectorised over the ranks' groups (layers._GroupedBN); docs/simulator.md gives its deviation.
        self.mode = mode_used(cfg)
        fast = self.mode == "fast"
        auto = np_ if fast else max(1, min(np_, EXACT_CUDA_CHUNK_IMAGES // batch))
        self.chunk = self.ranks_per_chunk or (auto if fast or device.type == "cuda" else 1)
        if cfg.local_steps > 1 or cfg.gns_max:  # every rank's own weights, or its own gradient's norm
            self.chunk = 1
        if cfg.bn == "sync":
            # SyncBatchNorm's statistics are the global batch's: one forward over every rank's images is
            # that BatchNorm, and its mean loss's gradient is the ranks' average. The same mathematics as
            # MPI's SyncBatchNorm, not its arithmetic (MPI sums the statistics in float64, per rank), so
            # this is the one rule the simulator reproduces only to float rounding (docs/simulator.md).
            self.chunk = np_
        self.norms = bool(cfg.gns_max) and np_ > 1
        self.context = RankContext(cfg.seed)
        self.context.vectorised = fast
        return base_model(cfg, device, ranks=np_, context=self.context, steps_per_epoch=self.steps_per_epoch,
                          data=ds)

    def start(self, cfg: Config, model: nn.Module, optimizer, on_grads=()) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.on_grads = tuple(on_grads)  # as MPIRanks': on the averaged gradient (a local step: each rank's)
        # Averaged gradient, built as MPI builds it: each rank's loss scaled by 1/np before backward (so
        # its gradient comes out divided, as GradSync.backward does), the ranks' gradients summed in rank order.
        self.avg = [torch.zeros_like(p) for p in self.params]
        self.optimizer = optimizer
        self.replicas = None  # local SGD: every rank's weights and momentum, made at the first local step
        self._replica_state = None  # ... or from a checkpoint (restore_rank_states)

    def step(self, cfg: Config, model, optimizer, epoch: int, step: int, stop=None, save=None) -> StepResult:
        ph = localsgd.phase(cfg, self.steps_per_epoch, epoch, step)
        if ph.local:
            return self._local_step(cfg, model, optimizer, epoch, step, ph, stop, save)
        np_, device = self.np_, self.device
        t0 = time.perf_counter()
        t_data = 0.0
        loss_sum = correct = 0  # python numbers, or 0-d device tensors with defer_metrics
        one_chunk = self.chunk >= np_  # the chunk's mean gradient is the average: nothing to accumulate
        per_rank = self.chunk == 1  # MPI's arithmetic: each rank's gradient, summed in rank order
        grad_sq = [] if self.norms else None
        if per_rank and not one_chunk:
            torch._foreach_zero_(self.avg)
        if not per_rank:  # several ranks per forward: their shares of the mean loss accumulate in .grad
            optimizer.zero_grad(set_to_none=False)
        self.context.epoch, self.context.step = epoch, step
        spans = [] if cfg.trace else None  # Config.trace: each chunk's phases, on its first rank's track
        for r0 in range(0, np_, self.chunk):
            r1 = min(np_, r0 + self.chunk)
            td = time.perf_counter()
            x, y = self._images(r0, r1, epoch, step)
            t_data += (tx := time.perf_counter()) - td
            self.context.ranks = (r0, r1)
            # Without dropout nothing else draws from the global RNG; seed it as rank r0 would.
            torch.manual_seed(step_seed(cfg.seed, epoch, step, r0))
            out, loss = forward_loss(model, x, y, cfg, device)
            tb = time.perf_counter() if spans is not None else 0.0
            if one_chunk:
                if per_rank:
                    optimizer.zero_grad(set_to_none=False)
                loss.backward()  # the mean loss over every rank's images: the average itself
            elif per_rank:
                optimizer.zero_grad(set_to_none=False)
                # as MPI forms it (GradSync.backward): each rank's loss scaled by 1/np, so its gradient
                # comes out divided, and the ranks' gradients added in rank order
                share_of_mean(loss, np_).backward()
                if grad_sq is not None:  # as GradSync's norms: this rank's share, as it would be sent
                    grad_sq.append(squared_norm([p.grad for p in self.params]))
                torch._foreach_add_(self.avg, [p.grad for p in self.params])
            else:  # several ranks per forward (the mean over their images): weighted by their share
                (loss * ((r1 - r0) / np_)).backward()
            if spans is not None:
                spans += [(r0, "data", td, tx), (r0, "forward", tx, tb), (r0, "backward", tb, time.perf_counter())]
            loss_sum, correct = self._add_metrics(loss_sum, correct, loss, out, y, r1 - r0)
        if per_rank and not one_chunk:
            torch._foreach_copy_([p.grad for p in self.params], self.avg)
        avg_sq = squared_norm([p.grad for p in self.params]) if grad_sq is not None else None
        to = time.perf_counter() if spans is not None else 0.0
        _on_grads(self.on_grads, self.params)
        optimizer.step()
        if device.type == "cuda" and not self.defer_metrics:
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        want_stop = bool(stop()) if stop is not None else False
        want_save = bool(save()) if save is not None else False
        return StepResult(loss_sum, correct, float(want_stop), time=total, compute=total - t_data,
                          comm=0.0, comm_exposed=0.0, data=t_data, save_votes=float(want_save),
                          ranks_grad_sq=np.array(grad_sq) if grad_sq is not None else None, avg_grad_sq=avg_sq,
                          timeline=Timeline(0, spans=spans + [(0, "optimizer", to, t0 + total)]) if spans is not None
                          else None)

    def _add_metrics(self, loss_sum, correct, loss, out, y, ranks: int):
        """The sums so far plus a chunk of ``ranks`` ranks' loss and correct images: python numbers, or with
        defer_metrics 0-d device tensors (nothing waits for the device)."""
        with torch.no_grad():
            if self.defer_metrics:
                return loss_sum + loss.detach() * (self.batch * ranks), correct + (out.argmax(1) == y).sum()
            return loss_sum + loss.item() * self.batch * ranks, correct + (out.argmax(1) == y).sum().item()

    def _images(self, r0: int, r1: int, epoch: int, step: int):
        """Virtual ranks r0..r1-1's images and labels of this step, as one batch on the device."""
        parts = [self.loaders[r].batch(epoch, step) for r in range(r0, r1)]
        x = (parts[0][0] if r1 - r0 == 1 else torch.cat([p[0] for p in parts])).to(self.device, non_blocking=True)
        y = (parts[0][1] if r1 - r0 == 1 else torch.cat([p[1] for p in parts])).to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last), y

    def _local_step(self, cfg: Config, model, optimizer, epoch: int, step: int, ph, stop, save) -> StepResult:
        """A local-SGD step: each rank's own forward, backward and optimizer step on its own weights
        (``pilab.engine.localsgd.VirtualReplicas``), then, if due, the average MPI forms."""
        np_, device = self.np_, self.device
        t0 = time.perf_counter()
        t_data, loss_sum, correct = 0.0, 0.0, 0.0
        if self.replicas is None:
            self.replicas = localsgd.VirtualReplicas(self.params, optimizer, np_, state=self._replica_state)
            self._replica_state = None
        self.context.epoch, self.context.step = epoch, step
        for r in range(np_):
            self.replicas.enter(r)
            td = time.perf_counter()
            x, y = self.loaders[r].batch(epoch, step)
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            t_data += time.perf_counter() - td
            self.context.ranks = (r, r + 1)
            torch.manual_seed(step_seed(cfg.seed, epoch, step, r))
            out, loss = forward_loss(model, x, y, cfg, device)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            _on_grads(self.on_grads, self.params)
            optimizer.step()
            loss_sum += loss.item() * self.batch
            correct += (out.argmax(1) == y).sum().item()
        if ph.average:
            self.replicas.average_()
            sync_virtual_buffers_(model, "average")
        self.replicas.enter(0)  # the model is rank 0's, as an MPI job's rank 0 holds it
        total = time.perf_counter() - t0
        want_stop = bool(stop()) if stop is not None else False
        want_save = bool(save()) if save is not None else False
        return StepResult(loss_sum, correct, float(want_stop), time=total, compute=total - t_data,
                          comm=0.0, comm_exposed=0.0, data=t_data, save_votes=float(want_save))

    def set_batch(self, batch: int) -> None:
        self.batch = batch
        for loader in self.loaders:
            loader.set_batch(batch)
        self.steps_per_epoch = self.loaders[0].steps_per_epoch

    def settle(self, model, policy: str) -> None:
        sync_virtual_buffers_(model, policy)

    def rank_states(self, model) -> list:
        """The virtual ranks' BatchNorm rows are in the model's state_dict; the RNG is the process's;
        under local SGD every rank's weights and optimizer state."""
        st = {"rng": torch.get_rng_state()}
        if self.replicas is not None:
            st["replicas"] = self.replicas.state()
        return [st]

    def restore_rank_states(self, model, states: list) -> None:
        self._replica_state = states[0].get("replicas")
        torch.set_rng_state(states[0]["rng"])

    def hosts(self) -> list[str]:
        return [socket.gethostname()]

    def carry(self, epoch: int, plan, ds) -> None:
        b = self.batch
        for r, loader in enumerate(self.loaders):
            loader.carry(epoch, plan[:, r * b:(r + 1) * b], ds)

    def evaluate(self, model, ds) -> tuple[float, float]:
        return evaluate(model, ds, None, self.device, self.eval_batch, tta=self.tta)

    def per_rank(self, values: list[float]):
        return None  # one process: there is no per-rank timeline to show

    def environment(self, threads: int) -> dict:
        return environment(None, threads, self.device)

    def close(self) -> None:
        pass

    def extras(self) -> dict:
        return {"simulated": True, "ranks_per_chunk": self.chunk, "simulate_mode_used": self.mode}
