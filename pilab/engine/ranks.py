"""The two ways to run a training loop's ranks, and the pieces both use.

* ``MPIRanks(comm)`` — this process is one rank of an MPI job (or the only process, ``comm=None``):
  gradients averaged by ``GradSync``, metrics and the stop vote riding with its last bucket,
  BatchNorm buffers settled by ``dist.sync_buffers_``;
* ``VirtualRanks(np_)`` — the simulator: np ranks emulated in this process, each rank's sub-batch
  through its own forward (ghost BatchNorm per virtual rank, dropout per rank seed), gradients
  accumulated in rank order as MPI sums them, the same buffer policy over the virtual rows.

A backend builds the model and its loaders, takes one synchronous step (``step``: a ``StepResult`` that
every rank agrees on), re-cuts its batches for a batch ramp, settles, gathers and restores per-rank state
for checkpoints, and evaluates. The loop that drives them (schedule, records, checkpoints, events) is
``pilab.engine.loop``, which re-exports everything here::

    from pilab.engine import loop as engine
    result, model = engine.train(cfg, engine.VirtualRanks(4))
"""
from __future__ import annotations

import os
import platform
import resource
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import __version__
from . import localsgd
from .. import data as data_mod
from ..config import EVAL_CHUNK, Config, ConfigError
from ..launch import mpi, mpi_versions
from .dist import (GradSync, bn_buffers, broadcast_module_, broadcast_optimizer_state_, gather_floats,
                   reduce_sums, share_of_mean, squared_norm, sync_buffers_, world)
from .exactness import check_custom_model
from .layers import (RankContext, convert_sync_batchnorm, step_seed, sync_virtual_buffers_, use_batch_renorm,
                     use_ghost_batchnorm, use_rank_dropout)
from ..models.names import is_builder_spec
from ..models.zoo import build_model

NUM_CLASSES = 10
EVAL_BATCH = Config.eval_batch  # the default; a run uses cfg.eval_batch
FAST_CHUNK_IMAGES = 512  # simulate_mode=fast: images per forward (memory stays bounded at any np)
# what MPIRanks.step sums over ranks with the last bucket: a stop or a checkpoint asked for by any rank
# (rank 0's clock decides a --checkpoint-minutes save) happens on every rank after the same step
_META = ("loss_sum", "correct", "stop_votes", "save_votes")


# ----------------------------------------------------------------------------------------------
# pieces every backend uses
# ----------------------------------------------------------------------------------------------
def resolve_device(cfg: Config) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; use device=cpu")
    return torch.device(cfg.device)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; all cores where affinity is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def load_data(cfg: Config, comm=None) -> "data_mod.CIFAR10":
    """Load the dataset named by ``cfg.data``; rank 0 first so only one rank decodes and caches it."""
    rank, size = world(comm)
    kwargs = dict(train_subset=cfg.train_subset, test_subset=cfg.test_subset, seed=cfg.seed,
                  image_size=cfg.image_size)
    if rank == 0:
        ds = data_mod.load(cfg.data, **kwargs)
    if size > 1:
        comm.Barrier()
    if rank != 0:
        ds = data_mod.load(cfg.data, **kwargs)
    return ds


def base_model(cfg: Config, device: torch.device, *, ranks: int = 1, context=None,
               steps_per_epoch: int = 1, data=None) -> nn.Module:
    """The model with identical initial weights on every rank (seeded; broadcast later anyway);
    ghost BatchNorm when ``cfg.ghost_batch``, ``ranks`` > 1 (virtual ranks) or ``cfg.bn="renorm"`` asks
    for it; plain BatchNorm with ``cfg.bn="sync"`` (MPI ranks convert it to SyncBatchNorm; the simulator
    runs every virtual rank in one forward, so its statistics are the global batch's), ghost BatchNorm
    over groups of ``cfg.bn_group`` virtual ranks when that is fewer than all. Batch
    Renormalization is plain BatchNorm through the lr warmup (at least an epoch of ``steps_per_epoch``)
    while the running statistics settle, its limits widened over as many steps again."""
    torch.manual_seed(cfg.seed)
    classes = len(data.classes) if data is not None else NUM_CLASSES  # the data's (``data``: its CIFAR10)
    model = build_model(cfg.model, num_classes=classes, width=cfg.width, timesteps=cfg.timesteps)
    if is_builder_spec(cfg.model):  # your own model: its output and its layers checked before training
        check_custom_model(model, cfg.model, data.image_shape if data is not None else (3, 32, 32), classes)
    if cfg.bn != "sync" and (cfg.ghost_batch or ranks > 1 or context is not None or cfg.bn == "renorm"):
        use_ghost_batchnorm(model, ranks=ranks, ghost_batch=cfg.ghost_batch, context=context)
    elif cfg.sync_group(ranks) < ranks:  # SyncBatchNorm in groups over virtual ranks: each group's images
        use_ghost_batchnorm(model, ranks=ranks, context=context, rank_group=cfg.sync_group(ranks))
    if cfg.bn == "renorm":
        start = round(max(1.0, cfg.warmup_epochs) * steps_per_epoch)
        use_batch_renorm(model, start, 2 * start)
    if context is not None:
        use_rank_dropout(model, context)
    return model.to(device=device, memory_format=torch.channels_last)


@torch.no_grad()
def evaluate(model: nn.Module, ds, comm, device, batch: int = EVAL_BATCH, *, tta: bool = False) -> tuple[float, float]:
    """Test loss and accuracy; each test image is evaluated exactly once over the ranks and the
    sums (not per-rank averages) are reduced, so uneven shards weigh correctly. The loss is summed per
    ``batch`` images (``cfg.eval_batch``); the model sees at most ``EVAL_CHUNK`` of them per forward,
    so the evaluation's memory does not grow with ``batch`` (the logits are the same: see
    ``pilab.config.EVAL_CHUNK``). ``tta``: the logits of each image and of its mirror image averaged."""
    rank, size = world(comm)
    sl = data_mod.test_shard(len(ds.y_test), size, rank)
    held = ds.test_rows
    if held is not None and not held.start <= sl.start <= sl.stop <= held.stop:
        raise data_mod.DataError(f"this data set holds test images {held.start}..{held.stop - 1} only, but rank "
                                 f"{rank} of {size} evaluates {sl.start}..{sl.stop - 1}; evaluate it at the np "
                                 "it was made for, or load the data set again")
    model.eval()
    loss_sum = correct = 0.0
    x_all = torch.from_numpy(ds.x_test[sl])
    y_all = torch.from_numpy(ds.y_test[sl])
    for i in range(0, len(y_all), batch):
        x = data_mod.to_input(x_all[i:i + batch], ds.mean, ds.std).to(device)
        y = y_all[i:i + batch].to(device)
        pieces = torch.tensor_split(x, -(-len(x) // EVAL_CHUNK))
        out = torch.cat([(model(piece) + model(piece.flip(3))) / 2 if tta else model(piece) for piece in pieces])
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
    model.train()
    loss_sum, correct, n = reduce_sums([loss_sum, correct, len(y_all)], comm)
    return float(loss_sum / n), float(correct / n)


def environment(comm, threads: int, device) -> dict:
    """Library versions, hosts and MPI library of the run (gathered once, in rank order)."""
    env = {
        "pilab": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "numpy": np.__version__, "platform": platform.platform(), "machine": platform.machine(),
        "threads_per_rank": threads, "device": str(device), "cpu_count": os.cpu_count(),
    }
    host = socket.gethostname()
    if comm is not None:
        # only with a communicator: a single process needs no MPI library
        env.update(mpi_versions())
        env["hostnames"] = comm.gather(host, root=0) if comm.Get_size() > 1 else [host]
    else:
        env["mpi_library"] = None
        env["hostnames"] = [host]
    return env


def peak_mem_mb() -> float:
    """Peak resident memory of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2 ** 20 if sys.platform == "darwin" else 2 ** 10)


@dataclass
class StepResult:
    """One synchronous step as every rank agrees on it: global sums, and this rank's times (s)."""
    loss_sum: float  # sum of per-image losses over the global batch
    correct: float  # correctly classified images of the global batch
    stop_votes: float  # ranks that asked to stop after this step
    time: float  # the whole step, data included
    compute: float  # forward + backward + optimizer, waiting excluded
    comm: float  # communication in flight (hidden or not)
    comm_exposed: float  # communication waited for
    data: float  # building the batch (indexing + augmentation)
    bytes_sent: int = 0
    # of comm_exposed: waiting for the slowest rank to finish its backward (the rest is network time)
    comm_wait: float = 0.0
    save_votes: float = 0.0  # ranks that asked for a checkpoint after this step
    # every rank's compute of this step and network time of the step before (s; MPI ranks only), and the
    # payload that network time moved (bytes: that step's bytes_sent, which local SGD makes vary)
    ranks_compute: object = None
    ranks_network: object = None
    network_bytes: int | None = None
    # a noise-driven batch ramp (batch_ramp="gns:MAX"): every rank's squared gradient norm as sent (of its
    # share g_r / np), and the averaged gradient's (see pilab.engine.noise)
    ranks_grad_sq: object = None
    avg_grad_sq: float | None = None


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

    def load(self, cfg: Config):
        return load_data(cfg, self.comm)

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

    def start(self, cfg: Config, model: nn.Module, optimizer) -> None:
        """Every rank starts identical: rank 0's parameters, buffers and optimizer state."""
        broadcast_module_(model, self.comm)
        broadcast_optimizer_state_(optimizer, self.comm)
        # meta: [loss sum, correct, stop votes] ride with the last gradient bucket (plus every rank's
        # ready time, which GradSync adds), so a step has one synchronisation point, not two.
        # ... and so does each rank's network time of the step before (one slot per rank), which
        # rank 0's straggler monitor compares live (pilab.engine.stragglers)
        self.gsync = GradSync(model, self.comm, bucket_mb=cfg.bucket_mb, compression=cfg.compression,
                              meta=len(_META) + self.np_, norms=bool(cfg.gns_max))
        self._prev_net, self._prev_sent = 0.0, None
        self.optimizer, self.local = optimizer, cfg.local_steps > 1
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
        out = model(x)
        loss = F.cross_entropy(out, y, label_smoothing=cfg.label_smoothing)
        # The step's metrics and the stop vote are known once the forward is done; they ride with the
        # last gradient bucket (GradSync's meta), so the step synchronises the ranks once, not twice.
        # On CPU reading them here costs nothing; the stop is polled before backward, and still takes
        # effect after this step on every rank.
        want_stop = bool(stop()) if stop is not None else False
        with torch.no_grad():
            correct = (out.argmax(1) == y).sum()
        want_save = bool(save()) if save is not None else False
        sync.meta[:len(_META)] = (loss.item() * self.batch, correct.item(), want_stop, want_save)
        nets = sync.meta[len(_META):len(_META) + self.np_]
        nets[:] = 0.0
        nets[self.rank] = self._prev_net
        sync.backward(loss)
        cstats = sync.finish()
        grad_sq = avg_sq = None
        if sync.norms and sync.exchange:  # every rank's, exact (see GradSync's norms); the average's
            n0 = len(_META) + 2 * self.np_
            grad_sq, avg_sq = sync.meta[n0:n0 + self.np_].copy(), squared_norm([p.grad for p in self.params])
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
        sums = sync.meta
        loss_sum, correct_sum, votes, saves = map(float, sums[:len(_META)])
        # Every step starts together (right after the previous step's exchange), so a rank whose last
        # gradient was ready `max(ready) - ready` before the slowest rank's waited that long for it;
        # the rest of the exposed time is the network's.
        ready = sums[len(_META) + self.np_:len(_META) + 2 * self.np_]
        wait = min(cstats.exposed, max(0.0, float(ready.max() - ready[self.rank]))) if self.np_ > 1 else 0.0
        self._prev_net = cstats.exposed - wait + averaged
        # the first step reports no network time yet (0 s): any payload pairs with it
        net_bytes, self._prev_sent = (sent if self._prev_sent is None else self._prev_sent), sent
        # compute: forward + backward + optimizer, the time spent waiting in finish() (and averaging) taken out
        return StepResult(loss_sum, correct_sum, votes, time=t2 - t0,
                          compute=(t2 - t1) - cstats.exposed - averaged, comm=cstats.total + averaged,
                          comm_exposed=cstats.exposed + averaged, data=t1 - t0,
                          bytes_sent=sent, comm_wait=wait, save_votes=saves,
                          ranks_compute=ready.copy(), ranks_network=sums[len(_META):len(_META) + self.np_].copy(),
                          network_bytes=net_bytes,
                          ranks_grad_sq=grad_sq, avg_grad_sq=avg_sq)

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

    def load(self, cfg: Config):
        return load_data(cfg)

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
        # simulate_mode=fast: several ranks per forward everywhere (up to FAST_CHUNK_IMAGES images), and
        # ghost BN vectorised over the ranks' groups; docs/simulator.md gives its measured deviation.
        fast = cfg.simulate_mode == "fast"
        auto = max(1, min(np_, (FAST_CHUNK_IMAGES if fast else 256) // batch))
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

    def start(self, cfg: Config, model: nn.Module, optimizer) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
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
        np_, b, device = self.np_, self.batch, self.device
        t0 = time.perf_counter()
        t_data = 0.0
        loss_sum = correct = 0  # python numbers, or 0-d device tensors with defer_metrics
        one_chunk = self.chunk >= np_  # the chunk's mean gradient is the average: nothing to accumulate
        grad_sq = [] if self.norms else None
        if not one_chunk:
            torch._foreach_zero_(self.avg)
        self.context.epoch, self.context.step = epoch, step
        for r0 in range(0, np_, self.chunk):
            r1 = min(np_, r0 + self.chunk)
            td = time.perf_counter()
            parts = [self.loaders[r].batch(epoch, step) for r in range(r0, r1)]
            x = (parts[0][0] if r1 - r0 == 1 else torch.cat([p[0] for p in parts])).to(device, non_blocking=True)
            y = (parts[0][1] if r1 - r0 == 1 else torch.cat([p[1] for p in parts])).to(device, non_blocking=True)
            x = x.contiguous(memory_format=torch.channels_last)
            t_data += time.perf_counter() - td
            self.context.ranks = (r0, r1)
            # Without dropout nothing else draws from the global RNG; seed it as rank r0 would.
            torch.manual_seed(step_seed(cfg.seed, epoch, step, r0))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(x)
                loss = F.cross_entropy(out.float(), y, label_smoothing=cfg.label_smoothing)
            optimizer.zero_grad(set_to_none=False)
            if one_chunk:
                loss.backward()  # the mean loss over every rank's images: the average itself
            elif r1 - r0 == 1:
                # as MPI forms it (GradSync.backward): each rank's loss scaled by 1/np, so its gradient
                # comes out divided, and the ranks' gradients added in rank order
                share_of_mean(loss, np_).backward()
                if grad_sq is not None:  # as GradSync's norms: this rank's share, as it would be sent
                    grad_sq.append(squared_norm([p.grad for p in self.params]))
                torch._foreach_add_(self.avg, [p.grad for p in self.params])
            else:  # several ranks per forward (the mean over their images): weighted by their share
                loss.backward()
                torch._foreach_add_(self.avg, torch._foreach_mul([p.grad for p in self.params], (r1 - r0) / np_))
            with torch.no_grad():
                if self.defer_metrics:
                    loss_sum = loss_sum + loss.detach() * (b * (r1 - r0))
                    correct = correct + (out.argmax(1) == y).sum()
                else:
                    loss_sum += loss.item() * b * (r1 - r0)
                    correct += (out.argmax(1) == y).sum().item()
        if not one_chunk:
            torch._foreach_copy_([p.grad for p in self.params], self.avg)
        avg_sq = squared_norm([p.grad for p in self.params]) if grad_sq is not None else None
        optimizer.step()
        if device.type == "cuda" and not self.defer_metrics:
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        want_stop = bool(stop()) if stop is not None else False
        want_save = bool(save()) if save is not None else False
        return StepResult(loss_sum, correct, float(want_stop), time=total, compute=total - t_data,
                          comm=0.0, comm_exposed=0.0, data=t_data, save_votes=float(want_save),
                          ranks_grad_sq=np.array(grad_sq) if grad_sq is not None else None, avg_grad_sq=avg_sq)

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
            out = model(x)
            loss = F.cross_entropy(out, y, label_smoothing=cfg.label_smoothing)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
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
        return {"simulated": True, "ranks_per_chunk": self.chunk}
