"""Virtual-rank simulator: emulate np data-parallel ranks exactly, in one process.

What an MPI run at np ranks computes, step by step, is reproduced here: the global batch is the
concatenation of the per-rank batches (same shards, same sharding policy, same per-rank augmentation
randomness), BatchNorm statistics are taken per rank sub-batch (or per ghost batch), running statistics
are kept per virtual rank and settled by the same buffer policy, dropout masks are drawn per rank from the
same seeds, and gradients are averaged over ranks. Weights after N steps match a real ``mpiexec`` run to
~1e-6, so accuracy at np=48 can be studied on a laptop (or a GPU) without 48 processes::

    from pilab.config import Config
    from pilab import simulate
    result = simulate.run(Config(width=0.5, epochs=3), np_=48)     # same schema as train.run

    python -m pilab simulate --np 48 --width 0.5 --epochs 3

Virtual ranks are processed one at a time on CPU (``ranks_per_chunk=1``: bit-identical per-rank arithmetic)
with gradient accumulation, so memory stays bounded at any np; on CUDA several ranks share a forward pass
(exact up to float summation order).
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import data as data_mod
from .config import Config, ConfigError

__all__ = ["GhostBatchNorm2d", "use_ghost_batchnorm", "run", "train", "check_supported"]


# ----------------------------------------------------------------------------------------------
# modules that know about virtual ranks
# ----------------------------------------------------------------------------------------------
class _Context:
    """Which virtual ranks the current forward covers, and the step (for dropout seeds)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.ranks = (0, 1)
        self.epoch = 0
        self.step = 0


class GhostBatchNorm2d(nn.Module):
    """BatchNorm2d with statistics per group of ``ghost_batch`` images and running statistics per
    virtual rank (``ranks`` rows; one row is stored with BatchNorm2d's shapes, so state_dicts match).

    In training, a batch of R ranks × k groups × g images is normalised group by group, and each group
    updates its rank's running mean/var in turn, as k small batches would (k=1 is exactly BatchNorm2d
    on the rank's sub-batch). In eval, row 0 is used: the buffer policy makes all rows equal before
    any evaluation, as MPI ranks are made equal.
    """

    def __init__(self, bn: nn.BatchNorm2d, ranks: int, ghost_batch: int = 0, context=None):
        super().__init__()
        c = bn.num_features
        self.num_features, self.eps = c, bn.eps
        self.momentum = bn.momentum if bn.momentum is not None else 0.1
        self.ranks, self.ghost_batch = ranks, ghost_batch
        self.context = context
        self.weight = nn.Parameter(bn.weight.detach().clone())
        self.bias = nn.Parameter(bn.bias.detach().clone())
        shape = (c,) if ranks == 1 else (ranks, c)
        self.register_buffer("running_mean", bn.running_mean.detach().clone().expand(shape).contiguous())
        self.register_buffer("running_var", bn.running_var.detach().clone().expand(shape).contiguous())
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked.detach().clone())

    def _rows(self):
        return self.running_mean.view(-1, self.num_features), self.running_var.view(-1, self.num_features)

    def forward(self, x):
        rm, rv = self._rows()
        if not self.training:
            return F.batch_norm(x, rm[0], rv[0], self.weight, self.bias, False, 0.0, self.eps)
        r0, r1 = self.context.ranks if self.context is not None else (0, 1)
        per_rank = x.shape[0] // (r1 - r0)
        g = self.ghost_batch or per_rank
        # One native batch_norm call per group, not a vectorised re-derivation: the native kernel's
        # sums are what an MPI rank computes, so the simulator stays bit-close to real ranks
        # (a hand-written (x - mean) * rsqrt(var) differs by ~1e-3 in gradients after a few layers).
        outs = [F.batch_norm(part, rm[r0 + i * g // per_rank], rv[r0 + i * g // per_rank],
                             self.weight, self.bias, True, self.momentum, self.eps)
                for i, part in enumerate(x.split(g))]
        if r0 == 0:
            with torch.no_grad():
                self.num_batches_tracked += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class RankDropout(nn.Module):
    """Dropout that draws each virtual rank's mask from that rank's step seed, as an MPI rank does."""

    def __init__(self, p: float, context: _Context):
        super().__init__()
        self.p, self.context = p, context

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        from .train import step_seed
        ctx = self.context
        r0, r1 = ctx.ranks
        parts = x.chunk(r1 - r0)
        out = []
        for r, part in zip(range(r0, r1), parts):
            torch.manual_seed(step_seed(ctx.seed, ctx.epoch, ctx.step, r))
            out.append(F.dropout(part, self.p, True))
        return torch.cat(out)


def _replace(module: nn.Module, make) -> None:
    for name, child in module.named_children():
        new = make(child)
        if new is not None:
            setattr(module, name, new)
        else:
            _replace(child, make)


def use_ghost_batchnorm(model: nn.Module, ranks: int, ghost_batch: int = 0, context=None) -> nn.Module:
    """Replace every BatchNorm2d with a GhostBatchNorm2d (in place); returns the model."""
    _replace(model, lambda m: GhostBatchNorm2d(m, ranks, ghost_batch, context)
             if isinstance(m, nn.BatchNorm2d) else None)
    return model


def sync_virtual_buffers_(model: nn.Module, policy: str) -> None:
    """The buffer policy across virtual ranks: rank 0's rows (broadcast) or their mean (average)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GhostBatchNorm2d) and m.ranks > 1:
                for buf in m._rows():
                    src = buf[0].clone() if policy == "broadcast" else buf.sum(0) / m.ranks
                    buf.copy_(src.expand_as(buf))


# ----------------------------------------------------------------------------------------------
def check_supported(cfg: Config) -> None:
    """Refuse settings the simulator does not emulate exactly."""
    if cfg.bn == "sync":
        raise ConfigError("the simulator does not emulate bn=sync (statistics over the whole global "
                          "batch); run it under mpiexec, or use bn=local")
    if cfg.compression != "none":
        raise ConfigError("the simulator does not emulate compression=fp16; use compression=none")
    if cfg.resume or cfg.checkpoint_every:
        raise ConfigError("the simulator does not checkpoint or resume; drop --resume/--checkpoint-every")


def run(cfg: Config, np_: int, *, callbacks=(), stop=None, data=None,
        ranks_per_chunk: int = 0) -> dict:
    """Emulate ``np_`` ranks training ``cfg``; returns a result shaped like ``train.run``'s."""
    return train(cfg, np_, callbacks=callbacks, stop=stop, data=data,
                 ranks_per_chunk=ranks_per_chunk)[0]


def train(cfg: Config, np_: int, *, callbacks=(), stop=None, data=None,
          ranks_per_chunk: int = 0) -> tuple[dict, nn.Module]:
    from . import __version__
    from .models import build_model
    from .optim import build_optimizer, lr_at, set_lr
    from .train import (NUM_CLASSES, environment, evaluate, load_data, peak_mem_mb, resolve_device,
                        save_json, step_seed)

    check_supported(cfg)
    t_wall = time.perf_counter()
    device = resolve_device(cfg)
    threads = cfg.threads or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    ds = data if data is not None else load_data(cfg)
    cfg.check_world(np_, len(ds.y_train))
    b = cfg.per_rank_batch(np_)
    loaders = [data_mod.ShardLoader(ds, np_, r, b, seed=cfg.seed, policy=cfg.sharding,
                                    augment=cfg.augment) for r in range(np_)]
    accounting = data_mod.epoch_accounting(ds.y_train, np_, b, cfg.sharding, seed=cfg.seed)
    spe = loaders[0].steps_per_epoch
    # The schedule spans all epochs; max_steps only cuts the run short (an interruption), so a run
    # resumed from its checkpoint follows the same learning rates as an uninterrupted one.
    schedule_steps = cfg.epochs * spe
    total_steps = min(schedule_steps, cfg.max_steps) if cfg.max_steps else schedule_steps
    warmup_steps = round(cfg.warmup_epochs * spe)
    peak_lr = cfg.peak_lr(np_)
    # One rank per forward on CPU reproduces an MPI rank's arithmetic exactly (same conv kernels on
    # the same batch). Several ranks per forward are faster on a GPU but sum weight gradients in
    # another order, and BatchNorm's shift invariance amplifies that float noise (~1e-3 after a step).
    chunk = ranks_per_chunk or (max(1, min(np_, 256 // b)) if device.type == "cuda" else 1)

    ctx = _Context(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, num_classes=NUM_CLASSES, width=cfg.width)
    use_ghost_batchnorm(model, np_, cfg.ghost_batch, ctx)
    _replace(model, lambda m: RankDropout(m.p, ctx) if isinstance(m, nn.Dropout) else None)
    model = model.to(device=device, memory_format=torch.channels_last)
    optimizer = build_optimizer(model, cfg, peak_lr)
    use_amp = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    # Averaged gradient, built as MPI builds it: each rank's mean-loss gradient divided by np, summed
    # in rank order (GradSync pre-divides, then Allreduce sums).
    avg = [torch.zeros_like(p) for p in params]

    def emit(ev):
        for cb in callbacks:
            cb(ev)

    emit({"kind": "start", "np": np_, "steps_per_epoch": spe, "epochs": cfg.epochs, "start_epoch": 0,
          "total_steps": total_steps, "config": cfg.to_dict(), "simulated": True})
    steps_log = {k: [] for k in ("loss", "lr", "time", "compute", "comm", "comm_exposed", "data")}
    epochs_log, gstep, stopped = [], 0, False
    model.train()
    for epoch in range(cfg.epochs):
        if gstep >= total_steps:
            break
        loss_sum = correct = images = t_data = t_compute = 0.0
        t_epoch = time.perf_counter()
        for step in range(spe):
            if gstep >= total_steps:
                break
            t0 = time.perf_counter()
            lr = lr_at(gstep, peak_lr=peak_lr, total_steps=schedule_steps, warmup_steps=warmup_steps,
                       schedule=cfg.schedule)
            set_lr(optimizer, lr)
            for a in avg:
                a.zero_()
            ctx.epoch, ctx.step = epoch, step
            step_loss = step_correct = 0.0
            for r0 in range(0, np_, chunk):
                r1 = min(np_, r0 + chunk)
                td = time.perf_counter()
                parts = [loaders[r].batch(epoch, step) for r in range(r0, r1)]
                x = torch.cat([p[0] for p in parts]).to(device, non_blocking=True)
                y = torch.cat([p[1] for p in parts]).to(device, non_blocking=True)
                x = x.contiguous(memory_format=torch.channels_last)
                t_data += time.perf_counter() - td
                ctx.ranks = (r0, r1)
                # Without dropout nothing else draws from the global RNG; seed it as rank r0 would.
                torch.manual_seed(step_seed(cfg.seed, epoch, step, r0))
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                    out = model(x)
                    loss = F.cross_entropy(out.float(), y)
                optimizer.zero_grad(set_to_none=False)
                # the mean loss over these ranks' images (one rank: exactly an MPI rank's loss)
                loss.backward()
                with torch.no_grad():
                    for a, p in zip(avg, params):
                        a.add_(p.grad / np_ if r1 - r0 == 1 else p.grad * ((r1 - r0) / np_))
                step_loss += loss.item() * b * (r1 - r0)
                step_correct += (out.argmax(1) == y).sum().item()
            with torch.no_grad():
                for a, p in zip(avg, params):
                    p.grad.copy_(a)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            gstep += 1
            loss_sum += step_loss
            correct += step_correct
            images += b * np_
            step_time = t1 - t0
            t_compute += step_time
            for k, v in (("loss", step_loss / (b * np_)), ("lr", lr), ("time", step_time),
                         ("compute", step_time), ("comm", 0.0), ("comm_exposed", 0.0), ("data", 0.0)):
                steps_log[k].append(v)
            emit({"kind": "step", "epoch": epoch + 1, "step": step + 1, "global_step": gstep,
                  "total_steps": total_steps, "loss": step_loss / (b * np_), "lr": lr,
                  "images_per_s": b * np_ / step_time, "time": step_time, "compute": step_time,
                  "comm": 0.0, "comm_exposed": 0.0, "data": 0.0})
            if stop is not None and stop():
                stopped = True
                break
        train_time = time.perf_counter() - t_epoch
        last = stopped or gstep >= total_steps or epoch + 1 == cfg.epochs
        test_loss = test_acc = None
        t_eval = time.perf_counter()
        if last or (epoch + 1) % cfg.eval_every == 0:
            sync_virtual_buffers_(model, cfg.bn_buffers)
            test_loss, test_acc = evaluate(model, ds, None, device)
        record = {"epoch": epoch + 1, "steps": int(images // (b * np_)),
                  "train_loss": loss_sum / max(images, 1), "train_acc": correct / max(images, 1),
                  "test_loss": test_loss, "test_acc": test_acc,
                  "lr": steps_log["lr"][-1] if steps_log["lr"] else None,
                  "time": train_time, "eval_time": time.perf_counter() - t_eval, "images": int(images),
                  "images_per_s": images / train_time if train_time else None,
                  "compute": t_compute - t_data, "comm": 0.0, "comm_exposed": 0.0, "data": t_data}
        epochs_log.append(record)
        emit({"kind": "epoch", **record})
        if stopped:
            break

    train_total = sum(e["time"] for e in epochs_log)
    result = {
        "pilab_version": __version__, "simulated": True, "config": cfg.to_dict(),
        "np": np_, "threads": threads, "per_rank_batch": b, "global_batch": b * np_,
        "peak_lr": peak_lr, "warmup_steps": warmup_steps, "steps_per_epoch": spe,
        "total_steps": total_steps, "ranks_per_chunk": chunk,
        "data": {"source": ds.source, "checksum": ds.checksum, "n_train": int(len(ds.y_train)),
                 "n_test": int(len(ds.y_test)), "sharding": cfg.sharding, **accounting},
        "env": environment(None, threads, device), "epochs": epochs_log, "steps": steps_log,
        "bytes_per_step": 0, "wall_time": time.perf_counter() - t_wall, "train_time": train_total,
        "images_per_s": sum(e["images"] for e in epochs_log) / train_total if train_total else None,
        "peak_mem_mb": [peak_mem_mb()], "stopped_early": stopped, "resumed_from_epoch": 0,
    }
    if cfg.out:
        save_json(result, os.path.join(cfg.out, "result.json"))
    emit({"kind": "end", "result": result})
    return result, model


def virtual_state(model: nn.Module, rank: int = 0) -> dict:
    """Parameters and buffers as virtual rank ``rank`` holds them, keyed like a plain model's."""
    out = {}
    for name, t in model.state_dict().items():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if isinstance(mod, GhostBatchNorm2d) and leaf in ("running_mean", "running_var") and mod.ranks > 1:
            t = t[rank]
        out[name] = t.detach().cpu().clone()
    return out


# ----------------------------------------------------------------------------------------------
def add_cli(sub) -> None:
    from .cli import add_config_arguments
    p = sub.add_parser("simulate", help="emulate np ranks exactly in one process",
                       description="Run the same training as `pilab train --np N` would, in one "
                                   "process, with virtual ranks (CPU, or CUDA with bf16 autocast).")
    p.add_argument("--np", type=int, required=True, help="number of virtual ranks")
    p.add_argument("--ranks-per-chunk", type=int, default=0,
                   help="virtual ranks per forward pass (memory vs speed; default: ~256 images)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_arguments(p, Config(out="runs/simulate"))
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args, argv) -> int:
    from .cli import _progress_callbacks, config_from_args
    cfg = config_from_args(args, Config(out="runs/simulate"))
    if args.np < 1:
        raise ConfigError(f"--np {args.np} must be >= 1")
    res = run(cfg, args.np, callbacks=_progress_callbacks(args.quiet),
              ranks_per_chunk=args.ranks_per_chunk)
    last = res["epochs"][-1] if res["epochs"] else {}
    print(f"simulated np={args.np} global batch={res['global_batch']} peak lr={res['peak_lr']:.4g} "
          f"final test acc {last.get('test_acc')}")
    if cfg.out:
        print(f"result: {os.path.join(cfg.out, 'result.json')}")
    return 0
