"""The one training loop, and the two ways to run its ranks.

``train(cfg, ranks)`` runs synchronous data-parallel SGD over a *rank backend*:

* ``MPIRanks(comm)`` — this process is one rank of an MPI job (or the only process, ``comm=None``):
  gradients averaged by ``GradSync``, metrics and the stop vote in one small Allreduce per step,
  BatchNorm buffers settled by ``dist.sync_buffers_``, checkpoints and resume;
* ``VirtualRanks(np_)`` — the simulator: np ranks emulated in this process, each rank's sub-batch
  through its own forward (ghost BatchNorm per virtual rank, dropout per rank seed), gradients
  accumulated in rank order as MPI sums them, the same buffer policy over the virtual rows.

Everything else — data, schedule, step log, epoch record, evaluation cadence, events, result — is this
module's, once. The public entry points are thin: ``pilab.train.run(cfg, comm=...)`` and
``pilab.simulate.run(cfg, np_=...)``::

    from pilab import engine
    result, model = engine.train(Config(epochs=1), engine.VirtualRanks(4))
    session = engine.Session(cfg, engine.MPIRanks(comm))      # one step at a time (tests)
    session.step(epoch=0, step=0)

``callbacks`` are called on rank 0 with event dicts (``kind`` = start | step | epoch | end); ``stop`` is
polled on every rank each step and any rank's True stops all ranks together after that step.
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

from . import __version__
from . import data as data_mod
from .config import Config, ConfigError
from .dist import (GradSync, broadcast_module_, broadcast_optimizer_state_, gather_floats, reduce_sums,
                   sync_buffers_, world)
from .files import atomic_write, save_json
from .layers import (RankContext, convert_sync_batchnorm, step_seed, sync_virtual_buffers_,
                     use_ghost_batchnorm, use_rank_dropout)
from .models import build_model
from .optim import build_optimizer, lr_at, set_lr

__all__ = ["train", "Session", "MPIRanks", "VirtualRanks", "StepResult", "load_data", "evaluate",
           "resolve_device", "environment", "peak_mem_mb", "NUM_CLASSES", "EVAL_BATCH"]

NUM_CLASSES = 10
EVAL_BATCH = 500
STEP_KEYS = ("loss", "lr", "time", "compute", "comm", "comm_exposed", "data")
TIME_KEYS = ("compute", "comm", "comm_exposed", "data")
# Settings that may differ between a run and its resumption (they don't change the computation).
RESUMABLE = ("out", "resume", "checkpoint_every", "max_steps", "eval_every", "threads")


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
    kwargs = dict(train_subset=cfg.train_subset, test_subset=cfg.test_subset, seed=cfg.seed)
    if rank == 0:
        ds = data_mod.load(cfg.data, **kwargs)
    if size > 1:
        comm.Barrier()
    if rank != 0:
        ds = data_mod.load(cfg.data, **kwargs)
    return ds


def base_model(cfg: Config, device: torch.device, *, ranks: int = 1, context=None) -> nn.Module:
    """The model with identical initial weights on every rank (seeded; broadcast later anyway);
    ghost BatchNorm when ``cfg.ghost_batch`` or ``ranks`` > 1 (virtual ranks) asks for it."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, num_classes=NUM_CLASSES, width=cfg.width)
    if cfg.ghost_batch or ranks > 1 or context is not None:
        use_ghost_batchnorm(model, ranks=ranks, ghost_batch=cfg.ghost_batch, context=context)
    if context is not None:
        use_rank_dropout(model, context)
    return model.to(device=device, memory_format=torch.channels_last)


@torch.no_grad()
def evaluate(model: nn.Module, ds, comm, device) -> tuple[float, float]:
    """Test loss and accuracy; each test image is evaluated exactly once over the ranks and the
    sums (not per-rank averages) are reduced, so uneven shards weigh correctly."""
    rank, size = world(comm)
    sl = data_mod.test_shard(len(ds.y_test), size, rank)
    model.eval()
    loss_sum = correct = 0.0
    x_all = torch.from_numpy(ds.x_test[sl])
    y_all = torch.from_numpy(ds.y_test[sl])
    for i in range(0, len(y_all), EVAL_BATCH):
        x = data_mod.to_input(x_all[i:i + EVAL_BATCH]).to(device)
        y = y_all[i:i + EVAL_BATCH].to(device)
        out = model(x)
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
        import mpi4py  # only with a communicator: a single process needs no MPI library
        from mpi4py import MPI
        env["mpi4py"] = mpi4py.__version__
        env["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
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
            from mpi4py import MPI  # a communicator exists, so MPI is loaded already
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
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
        self.batch, self.device = batch, device
        model = base_model(cfg, device)
        if cfg.bn == "sync":
            convert_sync_batchnorm(model, self.comm)
        return model

    def start(self, cfg: Config, model: nn.Module, optimizer) -> None:
        """Every rank starts identical: rank 0's parameters, buffers and optimizer state."""
        broadcast_module_(model, self.comm)
        broadcast_optimizer_state_(optimizer, self.comm)
        self.gsync = GradSync(model, self.comm, bucket_mb=cfg.bucket_mb, compression=cfg.compression)

    def step(self, cfg: Config, model, optimizer, epoch: int, step: int, stop=None) -> StepResult:
        t0 = time.perf_counter()
        x, y = self.loader.batch(epoch, step)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t1 = time.perf_counter()
        torch.manual_seed(step_seed(cfg.seed, epoch, step, self.rank))
        optimizer.zero_grad(set_to_none=False)
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        cstats = self.gsync.finish()
        optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        want_stop = bool(stop()) if stop is not None else False  # polled after the work of the step
        correct = (out.argmax(1) == y).sum().item()
        t3 = time.perf_counter()
        # One small Allreduce per step carries the metrics and the stop vote together.
        loss_sum, correct_sum, votes = map(float, reduce_sums(
            [loss.item() * self.batch, correct, want_stop], self.comm))
        t4 = time.perf_counter()
        return StepResult(loss_sum, correct_sum, votes, time=t4 - t0,
                          compute=(t2 - t1) - cstats.exposed, comm=cstats.total + (t4 - t3),
                          comm_exposed=cstats.exposed + (t4 - t3), data=t1 - t0,
                          bytes_sent=cstats.bytes_sent)

    def settle(self, model, policy: str) -> None:
        """All ranks must evaluate (and checkpoint) the same model: settle BN statistics first."""
        sync_buffers_(model, self.comm, policy)

    def evaluate(self, model, ds) -> tuple[float, float]:
        return evaluate(model, ds, self.comm, self.device)

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
    """``np_`` ranks emulated in this process, exactly (see ``pilab.simulate``)."""

    simulated = True
    rank = 0
    comm = None

    def __init__(self, np_: int, ranks_per_chunk: int = 0):
        if np_ < 1:
            raise ConfigError(f"np={np_} must be >= 1")
        self.np_, self.ranks_per_chunk = np_, ranks_per_chunk

    def threads(self, cfg: Config) -> int:
        return cfg.threads or usable_cores()

    def load(self, cfg: Config):
        return load_data(cfg)

    def check(self, cfg: Config) -> None:
        """Refuse settings the simulator does not emulate exactly."""
        if cfg.bn == "sync":
            raise ConfigError("the simulator does not emulate bn=sync (statistics over the whole global "
                              "batch); run it under mpiexec, or use bn=local")
        if cfg.compression != "none":
            raise ConfigError("the simulator does not emulate compression=fp16; use compression=none")
        if cfg.resume or cfg.checkpoint_every:
            raise ConfigError("the simulator does not checkpoint or resume; drop --resume/--checkpoint-every")

    def build(self, cfg: Config, device, ds, batch: int) -> nn.Module:
        np_ = self.np_
        self.loaders = [data_mod.ShardLoader(ds, np_, r, batch, seed=cfg.seed, policy=cfg.sharding,
                                             augment=cfg.augment) for r in range(np_)]
        self.steps_per_epoch = self.loaders[0].steps_per_epoch
        self.batch, self.device = batch, device
        # One rank per forward on CPU reproduces an MPI rank's arithmetic exactly (same conv kernels on
        # the same batch). Several ranks per forward are faster on a GPU but sum weight gradients in
        # another order, and BatchNorm's shift invariance amplifies that float noise (~1e-3 after a step).
        self.chunk = self.ranks_per_chunk or (max(1, min(np_, 256 // batch)) if device.type == "cuda" else 1)
        self.context = RankContext(cfg.seed)
        return base_model(cfg, device, ranks=np_, context=self.context)

    def start(self, cfg: Config, model: nn.Module, optimizer) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Averaged gradient, built as MPI builds it: each rank's mean-loss gradient divided by np,
        # summed in rank order (GradSync pre-divides, then Allreduce sums).
        self.avg = [torch.zeros_like(p) for p in self.params]

    def step(self, cfg: Config, model, optimizer, epoch: int, step: int, stop=None) -> StepResult:
        np_, b, device = self.np_, self.batch, self.device
        t0 = time.perf_counter()
        t_data = loss_sum = correct = 0.0
        for a in self.avg:
            a.zero_()
        self.context.epoch, self.context.step = epoch, step
        for r0 in range(0, np_, self.chunk):
            r1 = min(np_, r0 + self.chunk)
            td = time.perf_counter()
            parts = [self.loaders[r].batch(epoch, step) for r in range(r0, r1)]
            x = torch.cat([p[0] for p in parts]).to(device, non_blocking=True)
            y = torch.cat([p[1] for p in parts]).to(device, non_blocking=True)
            x = x.contiguous(memory_format=torch.channels_last)
            t_data += time.perf_counter() - td
            self.context.ranks = (r0, r1)
            # Without dropout nothing else draws from the global RNG; seed it as rank r0 would.
            torch.manual_seed(step_seed(cfg.seed, epoch, step, r0))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(x)
                loss = F.cross_entropy(out.float(), y)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()  # the mean loss over these ranks' images (one rank: exactly its loss)
            with torch.no_grad():
                for a, p in zip(self.avg, self.params):
                    a.add_(p.grad / np_ if r1 - r0 == 1 else p.grad * ((r1 - r0) / np_))
            loss_sum += loss.item() * b * (r1 - r0)
            correct += (out.argmax(1) == y).sum().item()
        with torch.no_grad():
            for a, p in zip(self.avg, self.params):
                p.grad.copy_(a)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        want_stop = bool(stop()) if stop is not None else False
        return StepResult(loss_sum, correct, float(want_stop), time=total, compute=total - t_data,
                          comm=0.0, comm_exposed=0.0, data=t_data)

    def settle(self, model, policy: str) -> None:
        sync_virtual_buffers_(model, policy)

    def evaluate(self, model, ds) -> tuple[float, float]:
        return evaluate(model, ds, None, self.device)

    def per_rank(self, values: list[float]):
        return None  # one process: there is no per-rank timeline to show

    def environment(self, threads: int) -> dict:
        return environment(None, threads, self.device)

    def close(self) -> None:
        pass

    def extras(self) -> dict:
        return {"simulated": True, "ranks_per_chunk": self.chunk}


# ----------------------------------------------------------------------------------------------
# the session: set-up once, then steps
# ----------------------------------------------------------------------------------------------
class Session:
    """A run set up on ``ranks``: data, model, optimizer, schedule; ``step`` trains one step."""

    def __init__(self, cfg: Config, ranks, *, data=None):
        ranks.check(cfg)
        self.cfg, self.ranks = cfg, ranks
        self.np_, self.rank = ranks.np_, ranks.rank
        self.device = resolve_device(cfg)
        self.threads = ranks.threads(cfg)
        torch.set_num_threads(self.threads)
        self.ds = data if data is not None else ranks.load(cfg)
        cfg.check_world(self.np_, len(self.ds.y_train))
        self.batch = cfg.per_rank_batch(self.np_)
        self.accounting = data_mod.epoch_accounting(self.ds.y_train, self.np_, self.batch, cfg.sharding,
                                                    seed=cfg.seed)
        self.model = ranks.build(cfg, self.device, self.ds, self.batch)
        spe = self.steps_per_epoch = ranks.steps_per_epoch
        # The schedule spans all epochs; max_steps only cuts the run short (an interruption), so a run
        # resumed from its checkpoint follows the same learning rates as an uninterrupted one.
        self.schedule_steps = cfg.epochs * spe
        self.total_steps = min(self.schedule_steps, cfg.max_steps) if cfg.max_steps else self.schedule_steps
        self.warmup_steps = round(cfg.warmup_epochs * spe)
        self.peak_lr = cfg.peak_lr(self.np_)
        self.optimizer = build_optimizer(self.model, cfg, self.peak_lr)
        self.start_epoch, self.history = (_load_checkpoint(cfg, ranks.comm, self.model, self.optimizer)
                                          if cfg.resume else (0, []))
        ranks.start(cfg, self.model, self.optimizer)

    def lr(self, global_step: int) -> float:
        return lr_at(global_step, peak_lr=self.peak_lr, total_steps=self.schedule_steps,
                     warmup_steps=self.warmup_steps, schedule=self.cfg.schedule)

    def step(self, epoch: int, step: int, *, stop=None) -> tuple[StepResult, float]:
        """Train step ``step`` of ``epoch`` on every rank; returns (the step, its learning rate).

        ``stop()`` is polled once the step's work is done; its vote travels with the step's metrics."""
        lr = self.lr(epoch * self.steps_per_epoch + step)
        set_lr(self.optimizer, lr)
        return self.ranks.step(self.cfg, self.model, self.optimizer, epoch, step, stop), lr

    def save_checkpoint(self, epoch: int, global_step: int, history: list) -> None:
        ck = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
              "epoch": epoch, "step": global_step, "config": self.cfg.to_dict(), "history": history}
        atomic_write(os.path.join(self.cfg.out, "checkpoint.pt"), lambda p: torch.save(ck, p))


def _load_checkpoint(cfg: Config, comm, model, optimizer) -> tuple[int, list]:
    rank, _ = world(comm)
    ck = None
    if rank == 0:
        if not os.path.exists(cfg.resume):
            raise ConfigError(f"resume={cfg.resume!r} does not exist; give a checkpoint.pt path")
        ck = torch.load(cfg.resume, map_location="cpu", weights_only=False)
        saved = Config.from_dict(ck["config"])
        mine = {k: v for k, v in cfg.to_dict().items() if k not in RESUMABLE}
        theirs = {k: v for k, v in saved.to_dict().items() if k not in RESUMABLE}
        diff = sorted(k for k in mine if mine[k] != theirs[k])
        if diff:
            raise ConfigError(f"checkpoint was made with different {', '.join(diff)}; "
                              "resume with the same settings")
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
    meta = (ck["epoch"], ck["history"]) if rank == 0 else None
    if comm is not None and comm.Get_size() > 1:
        meta = comm.bcast(meta, root=0)
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

    def add(self, st: StepResult, images: int) -> None:
        self.loss += st.loss_sum
        self.correct += st.correct
        self.images += images
        self.steps += 1
        for k in TIME_KEYS:
            self.times[k] += getattr(st, k)


def train(cfg: Config, ranks, *, callbacks=(), stop=None, data=None) -> tuple[dict, nn.Module]:
    """Train ``cfg`` on ``ranks`` (``MPIRanks(comm)`` or ``VirtualRanks(np_)``); returns the result (on
    every rank; rank 0 writes ``<out>/result.json``) and the trained model."""
    t_wall = time.perf_counter()
    s = Session(cfg, ranks, data=data)
    spe, images_per_step = s.steps_per_epoch, s.batch * s.np_

    def emit(event):
        if s.rank == 0:
            for cb in callbacks:
                cb(event)

    emit({"kind": "start", "np": s.np_, "steps_per_epoch": spe, "epochs": cfg.epochs,
          "start_epoch": s.start_epoch, "total_steps": s.total_steps, "config": cfg.to_dict(),
          **({"simulated": True} if ranks.simulated else {})})
    steps_log = {k: [] for k in STEP_KEYS}
    epochs_log = list(s.history)
    bytes_per_step, stopped, gstep = 0, False, s.start_epoch * spe
    s.model.train()
    for epoch in range(s.start_epoch, cfg.epochs):
        if gstep >= s.total_steps:
            break
        acc, t_epoch = _Epoch(), time.perf_counter()
        for step in range(spe):
            if gstep >= s.total_steps:
                break
            st, lr = s.step(epoch, step, stop=stop)
            acc.add(st, images_per_step)
            bytes_per_step = st.bytes_sent
            mean_loss = st.loss_sum / images_per_step
            for k, v in zip(STEP_KEYS, (mean_loss, lr, st.time, st.compute, st.comm, st.comm_exposed,
                                        st.data)):
                steps_log[k].append(v)
            gstep += 1
            emit({"kind": "step", "epoch": epoch + 1, "step": step + 1, "global_step": gstep,
                  "total_steps": s.total_steps, "loss": mean_loss, "lr": lr,
                  "images_per_s": images_per_step / st.time, "time": st.time,
                  **{k: getattr(st, k) for k in TIME_KEYS}})
            if st.stop_votes > 0:
                stopped = True
                break
        record, checkpoint_now = _end_epoch(s, epoch, acc, time.perf_counter() - t_epoch, steps_log,
                                            stopped, gstep)
        epochs_log.append(record)
        emit({"kind": "epoch", **record})
        if checkpoint_now and cfg.out and s.rank == 0:
            s.save_checkpoint(epoch + 1, gstep, epochs_log)
        if stopped:
            break
    ranks.close()
    result = _result(s, epochs_log, steps_log, bytes_per_step, stopped, time.perf_counter() - t_wall)
    if s.rank == 0 and cfg.out:
        save_json(result, os.path.join(cfg.out, "result.json"))
    emit({"kind": "end", "result": result})
    return result, s.model


def _end_epoch(s: Session, epoch: int, acc: _Epoch, train_time: float, steps_log: dict,
               stopped: bool, gstep: int) -> tuple[dict, bool]:
    """Evaluate if due, settle buffers for evaluation or checkpoint, and build the epoch record."""
    cfg = s.cfg
    last = stopped or gstep >= s.total_steps or epoch + 1 == cfg.epochs
    evaluate_now = last or (epoch + 1) % cfg.eval_every == 0
    full_epoch = acc.steps == s.steps_per_epoch
    checkpoint_now = bool(cfg.checkpoint_every) and (epoch + 1) % cfg.checkpoint_every == 0 \
        and not stopped and full_epoch
    t_eval = time.perf_counter()
    test_loss = test_acc = None
    if evaluate_now or checkpoint_now:
        s.ranks.settle(s.model, cfg.bn_buffers)
    if evaluate_now:
        test_loss, test_acc = s.ranks.evaluate(s.model, s.ds)
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
    if per_rank is not None and s.rank == 0:
        record["per_rank"] = {k: per_rank[:, i].tolist() for i, k in enumerate(TIME_KEYS)}
    return record, checkpoint_now


def _result(s: Session, epochs_log: list, steps_log: dict, bytes_per_step: int, stopped: bool,
            wall: float) -> dict:
    """The run's result: the config, environment, per-epoch metrics, per-step timings, peak memory."""
    cfg, ds = s.cfg, s.ds
    mem = s.ranks.per_rank([peak_mem_mb()])
    env = s.ranks.environment(s.threads)
    new = epochs_log[len(s.history):]
    train_total = sum(e["time"] for e in new)
    images_total = sum(e["images"] for e in new)
    return {
        "pilab_version": __version__, **s.ranks.extras(), "config": cfg.to_dict(),
        "np": s.np_, "threads": s.threads,
        "per_rank_batch": s.batch, "global_batch": s.batch * s.np_, "peak_lr": s.peak_lr,
        "warmup_steps": s.warmup_steps, "steps_per_epoch": s.steps_per_epoch,
        "total_steps": s.total_steps, "schedule_steps": s.schedule_steps,
        "data": {"source": ds.source, "checksum": ds.checksum, "n_train": int(len(ds.y_train)),
                 "n_test": int(len(ds.y_test)), "sharding": cfg.sharding, **s.accounting},
        "env": env, "epochs": epochs_log, "steps": steps_log, "bytes_per_step": bytes_per_step,
        "wall_time": wall, "train_time": train_total,
        "images_per_s": images_total / train_total if train_total else None,
        "peak_mem_mb": (mem[:, 0].tolist() if mem is not None else [peak_mem_mb()]) if s.rank == 0 else None,
        "stopped_early": stopped, "resumed_from_epoch": s.start_epoch,
    }
