"""Synchronous data-parallel training over MPI: one model, np ranks, averaged gradients.

From Python (one process, or every rank of an MPI job)::

    from mpi4py import MPI
    from pilab.config import Config
    from pilab import train
    result = train.run(Config(epochs=2, width=0.5), comm=MPI.COMM_WORLD)

From the shell: ``mpiexec -n 2 python -m pilab train --epochs 2`` or ``python -m pilab train --np 2``.

``callbacks`` are called on rank 0 with event dicts (``kind`` = start | step | epoch | end) while the run
goes on; ``stop`` is polled on every rank each step and any rank's True stops all ranks together after
that step. The result (returned on every rank, written by rank 0 as ``<out>/result.json``) holds the
config, environment, per-epoch metrics, per-step timings and peak memory per rank.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import socket
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import __version__
from . import data as data_mod
from .config import Config, ConfigError
from .dist import (GradSync, broadcast_module_, broadcast_optimizer_state_,
                   convert_sync_batchnorm, gather_floats, reduce_sums, sync_buffers_, world)
from .models import build_model
from .optim import build_optimizer, lr_at, set_lr

NUM_CLASSES = 10
EVAL_BATCH = 500


# ----------------------------------------------------------------------------------------------
# pieces shared with the simulator
# ----------------------------------------------------------------------------------------------
def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """Seed of the global torch RNG for one step on one rank (dropout draws from it)."""
    return int(np.random.SeedSequence([seed, epoch, step, rank, 0x5EED]).generate_state(1)[0])


def resolve_threads(cfg: Config, comm) -> int:
    """Torch threads per rank: ``cfg.threads``, or cores per node divided by ranks on this node."""
    if cfg.threads:
        return cfg.threads
    local = 1
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_size()
        node.Free()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    # Under mpiexec a rank may be bound to one core; the node's core count is what we divide.
    cores = max(cores, os.cpu_count() or 1)
    return max(1, cores // local)


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


def make_model(cfg: Config, device: torch.device) -> nn.Module:
    """The model with identical initial weights on every rank (seeded; broadcast later anyway)."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, num_classes=NUM_CLASSES, width=cfg.width)
    if cfg.ghost_batch:
        from .simulate import use_ghost_batchnorm
        use_ghost_batchnorm(model, ranks=1, ghost_batch=cfg.ghost_batch)
    return model.to(device=device, memory_format=torch.channels_last)


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; use device=cpu")
    return torch.device(cfg.device)


@torch.no_grad()
def evaluate(model: nn.Module, ds, comm, device, *, np_: int | None = None,
             rank: int | None = None) -> tuple[float, float]:
    """Test loss and accuracy; each test image is evaluated exactly once over the ranks and the
    sums (not per-rank averages) are reduced, so uneven shards weigh correctly."""
    r, s = world(comm)
    np_ = s if np_ is None else np_
    rank = r if rank is None else rank
    sl = data_mod.test_shard(len(ds.y_test), np_, rank)
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
        import mpi4py
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


def atomic_write(path: str, write) -> None:
    """Write via a temporary file in the same directory + rename: never a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _plain(o):
    """JSON for numpy scalars and arrays (metrics reduced with MPI come back as numpy values)."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def save_json(obj, path: str) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=_plain)
    atomic_write(path, write)


# Settings that may differ between a run and its resumption (they don't change the computation).
_RESUMABLE = ("out", "resume", "checkpoint_every", "max_steps", "eval_every", "threads")


def _load_checkpoint(cfg: Config, comm, model, optimizer) -> tuple[int, list]:
    rank, _ = world(comm)
    ck = None
    if rank == 0:
        if not os.path.exists(cfg.resume):
            raise ConfigError(f"resume={cfg.resume!r} does not exist; give a checkpoint.pt path")
        ck = torch.load(cfg.resume, map_location="cpu", weights_only=False)
        saved = Config.from_dict(ck["config"])
        mine = {k: v for k, v in cfg.to_dict().items() if k not in _RESUMABLE}
        theirs = {k: v for k, v in saved.to_dict().items() if k not in _RESUMABLE}
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
# the run
# ----------------------------------------------------------------------------------------------
def run(cfg: Config, comm=None, *, callbacks=(), stop=None, data=None) -> dict:
    """Train ``cfg`` on all ranks of ``comm`` (None: one process); see the module docstring."""
    return train(cfg, comm, callbacks=callbacks, stop=stop, data=data)[0]


def train(cfg: Config, comm=None, *, callbacks=(), stop=None, data=None) -> tuple[dict, nn.Module]:
    """Like ``run`` but also returns the trained model (tests compare weights across ranks)."""
    t_wall = time.perf_counter()
    rank, size = world(comm)
    device = resolve_device(cfg)
    threads = resolve_threads(cfg, comm)
    torch.set_num_threads(threads)
    ds = data if data is not None else load_data(cfg, comm)
    cfg.check_world(size, len(ds.y_train))
    b = cfg.per_rank_batch(size)
    loader = data_mod.ShardLoader(ds, size, rank, b, seed=cfg.seed, policy=cfg.sharding,
                                  augment=cfg.augment)
    accounting = data_mod.epoch_accounting(ds.y_train, size, b, cfg.sharding, seed=cfg.seed)
    spe = loader.steps_per_epoch
    # The schedule spans all epochs; max_steps only cuts the run short (an interruption), so a run
    # resumed from its checkpoint follows the same learning rates as an uninterrupted one.
    schedule_steps = cfg.epochs * spe
    total_steps = min(schedule_steps, cfg.max_steps) if cfg.max_steps else schedule_steps
    warmup_steps = round(cfg.warmup_epochs * spe)
    peak_lr = cfg.peak_lr(size)

    model = make_model(cfg, device)
    if cfg.bn == "sync":
        convert_sync_batchnorm(model, comm)
    optimizer = build_optimizer(model, cfg, peak_lr)
    start_epoch, history = 0, []
    if cfg.resume:
        start_epoch, history = _load_checkpoint(cfg, comm, model, optimizer)
    broadcast_module_(model, comm)
    broadcast_optimizer_state_(optimizer, comm)
    gsync = GradSync(model, comm, bucket_mb=cfg.bucket_mb, compression=cfg.compression)

    def emit(event):
        if rank == 0:
            for cb in callbacks:
                cb(event)

    emit({"kind": "start", "np": size, "steps_per_epoch": spe, "epochs": cfg.epochs,
          "start_epoch": start_epoch, "total_steps": total_steps, "config": cfg.to_dict()})
    steps_log = {k: [] for k in ("loss", "lr", "time", "compute", "comm", "comm_exposed", "data")}
    epochs_log = list(history)
    bytes_per_step = 0
    stopped = False
    gstep = start_epoch * spe
    model.train()
    for epoch in range(start_epoch, cfg.epochs):
        if gstep >= total_steps:
            break
        acc = dict(loss=0.0, correct=0.0, images=0.0, compute=0.0, comm=0.0, comm_exposed=0.0,
                   data=0.0)
        t_epoch = time.perf_counter()
        for step in range(spe):
            if gstep >= total_steps:
                break
            t0 = time.perf_counter()
            x, y = loader.batch(epoch, step)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t1 = time.perf_counter()
            torch.manual_seed(step_seed(cfg.seed, epoch, step, rank))
            lr = lr_at(gstep, peak_lr=peak_lr, total_steps=schedule_steps,
                       warmup_steps=warmup_steps, schedule=cfg.schedule)
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=False)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            cstats = gsync.finish()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            # One small Allreduce per step carries the metrics and the stop vote together.
            want_stop = bool(stop()) if stop is not None else False
            correct = (out.argmax(1) == y).sum().item()
            t3 = time.perf_counter()
            loss_sum, correct_sum, votes = map(float, reduce_sums([loss.item() * b, correct, want_stop],
                                                                  comm))
            t4 = time.perf_counter()
            compute = (t2 - t1) - cstats.exposed
            comm_t = cstats.total + (t4 - t3)
            exposed = cstats.exposed + (t4 - t3)
            acc["loss"] += loss_sum
            acc["correct"] += correct_sum
            acc["images"] += b * size
            acc["compute"] += compute
            acc["comm"] += comm_t
            acc["comm_exposed"] += exposed
            acc["data"] += t1 - t0
            bytes_per_step = cstats.bytes_sent
            step_time = t4 - t0
            mean_loss = loss_sum / (b * size)
            for k, v in (("loss", mean_loss), ("lr", lr), ("time", step_time), ("compute", compute),
                         ("comm", comm_t), ("comm_exposed", exposed), ("data", t1 - t0)):
                steps_log[k].append(v)
            gstep += 1
            emit({"kind": "step", "epoch": epoch + 1, "step": step + 1, "global_step": gstep,
                  "total_steps": total_steps, "loss": mean_loss, "lr": lr,
                  "images_per_s": b * size / step_time, "time": step_time, "compute": compute,
                  "comm": comm_t, "comm_exposed": exposed, "data": t1 - t0})
            if votes > 0:
                stopped = True
                break
        train_time = time.perf_counter() - t_epoch
        last = stopped or gstep >= total_steps or epoch + 1 == cfg.epochs
        evaluate_now = last or (epoch + 1) % cfg.eval_every == 0
        checkpoint_now = bool(cfg.checkpoint_every) and (epoch + 1) % cfg.checkpoint_every == 0 \
            and not stopped and acc["images"] == spe * b * size
        t_eval = time.perf_counter()
        test_loss = test_acc = None
        if evaluate_now or checkpoint_now:
            # All ranks must evaluate (and checkpoint) the same model: settle BN statistics first.
            sync_buffers_(model, comm, cfg.bn_buffers)
        if evaluate_now:
            test_loss, test_acc = evaluate(model, ds, comm, device)
        eval_time = time.perf_counter() - t_eval
        per_rank = gather_floats([acc["compute"], acc["comm"], acc["comm_exposed"], acc["data"]],
                                 comm)
        record = {
            "epoch": epoch + 1, "steps": int(acc["images"] // (b * size)),
            "train_loss": acc["loss"] / max(acc["images"], 1),
            "train_acc": acc["correct"] / max(acc["images"], 1),
            "test_loss": test_loss, "test_acc": test_acc, "lr": steps_log["lr"][-1] if steps_log["lr"] else None,
            "time": train_time, "eval_time": eval_time, "images": int(acc["images"]),
            "images_per_s": acc["images"] / train_time if train_time > 0 else None,
            "compute": acc["compute"], "comm": acc["comm"], "comm_exposed": acc["comm_exposed"],
            "data": acc["data"],
        }
        if rank == 0:
            record["per_rank"] = {k: per_rank[:, i].tolist() for i, k in
                                  enumerate(("compute", "comm", "comm_exposed", "data"))}
        epochs_log.append(record)
        emit({"kind": "epoch", **record})
        if checkpoint_now and cfg.out and rank == 0:
            ck = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "epoch": epoch + 1, "step": gstep, "config": cfg.to_dict(), "history": epochs_log}
            atomic_write(os.path.join(cfg.out, "checkpoint.pt"), lambda p: torch.save(ck, p))
        if stopped:
            break

    gsync.remove()
    mem = gather_floats([peak_mem_mb()], comm)
    env = environment(comm, threads, device)
    wall = time.perf_counter() - t_wall
    train_total = sum(e["time"] for e in epochs_log[len(history):])
    images_total = sum(e["images"] for e in epochs_log[len(history):])
    result = {
        "pilab_version": __version__,
        "config": cfg.to_dict(),
        "np": size, "threads": threads,
        "per_rank_batch": b, "global_batch": b * size, "peak_lr": peak_lr,
        "warmup_steps": warmup_steps, "steps_per_epoch": spe, "total_steps": total_steps,
        "schedule_steps": schedule_steps,
        "data": {"source": ds.source, "checksum": ds.checksum, "n_train": int(len(ds.y_train)),
                 "n_test": int(len(ds.y_test)), "sharding": cfg.sharding, **accounting},
        "env": env,
        "epochs": epochs_log,
        "steps": steps_log,
        "bytes_per_step": bytes_per_step,
        "wall_time": wall, "train_time": train_total,
        "images_per_s": images_total / train_total if train_total else None,
        "peak_mem_mb": mem[:, 0].tolist() if rank == 0 else None,
        "stopped_early": stopped,
        "resumed_from_epoch": start_epoch,
    }
    if rank == 0 and cfg.out:
        save_json(result, os.path.join(cfg.out, "result.json"))
    emit({"kind": "end", "result": result})
    return result, model


def final_state(model: nn.Module) -> dict:
    """Parameters and buffers as CPU tensors (tests compare these across ranks and runs)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
