"""What the training loop asks of a rank backend (``RankBackend``), and the pieces every backend uses:
the device, the data's loading, the model as every rank starts it, the one forward-and-loss recipe, the
evaluation, the run's environment, and ``StepResult`` (one synchronous step as every rank agrees on it).

The two backends are in ``pilab.engine.mpi``: ``MPIRanks(comm)`` and ``VirtualRanks(np_)``;
tests/test_architecture.py checks that both implement ``RankBackend``::

    from pilab.engine.backend import RankBackend
    from pilab.engine import VirtualRanks
    isinstance(VirtualRanks(4), RankBackend)     # True

Test-time augmentation: a test image's logits averaged over views of it (``Config.tta``,
``Config.tta_translate``), as airbench's evaluation does::

    logits = tta_logits(model, x, flip=True)                   # (f(x) + f(mirror x)) / 2
    logits = tta_logits(model, x, flip=True, translate=True)   # six views, airbench's weights

With ``translate`` the image is also moved one pixel up-left and one down-right (reflect padding, as the
training crops pad), each with its mirror: half the weight on the plain pair, a quarter on each moved
pair. In eval mode a view's logits do not depend on the other images of the batch, so the views of a
rank's share of the test set are the same on every backend.
"""
from __future__ import annotations

import os
import platform
import resource
import socket
import sys
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import __version__, data as data_mod
from ..component import SYNC, Phase
from ..config import EVAL_CHUNK, Config, ConfigError
from ..dist import reduce_sums, world
from ..launch import launcher_local_size, mpi_versions
from ..models import (build_model, dirac_convs, freeze_bn_scale, is_builder_spec, sample_rows, whiten_stem,
                      zero_residual_bn)
from .layers import use_batch_renorm, use_ghost_batchnorm, use_rank_dropout
from .ownmodel import check_custom_model

def _pair(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) + model(x.flip(3))) / 2


def tta_logits(model: nn.Module, x: torch.Tensor, *, flip: bool = False, translate: bool = False) -> torch.Tensor:
    """``model``'s logits for the normalised batch ``x`` (B, C, H, W), averaged over its views."""
    if not flip:
        return model(x)
    if not translate:
        return _pair(model, x)
    h, w = x.shape[2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    moved = [padded[:, :, :h, :w], padded[:, :, 2:, 2:]]  # content moved down-right, up-left by a pixel
    moved = [m.contiguous(memory_format=torch.channels_last) for m in moved]
    return 0.5 * _pair(model, x) + 0.25 * (_pair(model, moved[0]) + _pair(model, moved[1]))


NUM_CLASSES = 10
EVAL_BATCH = Config.eval_batch  # the default; a run uses cfg.eval_batch


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
    channels = data.image_shape[0] if data is not None else 3  # grey images: a first layer of one channel
    model = build_model(cfg.model, num_classes=classes, width=cfg.width, timesteps=cfg.timesteps,
                        in_channels=channels)
    if is_builder_spec(cfg.model):  # your own model: its output and its layers checked before training
        check_custom_model(model, cfg.model, data.image_shape if data is not None else (3, 32, 32), classes)
    if cfg.zero_init_residual:
        try:
            zero_residual_bn(model, cfg.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.dirac_init:  # before the whitening, which then sets the stem itself
        dirac_convs(model)
    if cfg.freeze_bn_scale:
        freeze_bn_scale(model)
    if cfg.bn_momentum != 0.1:  # before the per-rank copies, which take it from the layer
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.momentum is not None:
                m.momentum = cfg.bn_momentum
    if cfg.whiten_stem:
        if data is None:
            raise ConfigError("whiten_stem: the first convolution is made from the training images, and none "
                              "were given; build the model with data=")
        try:
            rows = sample_rows(len(data.x_train), cfg.seed)
            whiten_stem(model, data_mod.to_input(torch.from_numpy(data.x_train[rows]), data.mean, data.std))
        except ValueError as e:
            raise ConfigError(str(e)) from None
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
def evaluate(model: nn.Module, ds, comm, device, batch: int = EVAL_BATCH, *, tta: bool = False,
             translate: bool = False) -> tuple[float, float]:
    """Test loss and accuracy; each test image is evaluated exactly once over the ranks and the
    sums (not per-rank averages) are reduced, so uneven shards weigh correctly. The loss is summed per
    ``batch`` images (``cfg.eval_batch``); the model sees at most ``EVAL_CHUNK`` of them per forward,
    so the evaluation's memory does not grow with ``batch`` (the logits are the same: see
    ``pilab.config.EVAL_CHUNK``). ``tta``: the logits of each image and of its mirror image averaged;
    ``translate``: and of both moved a pixel each way (``pilab.engine.backend``)."""
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
        out = torch.cat([tta_logits(model, piece, flip=tta, translate=translate) for piece in pieces])
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
    model.train()
    loss_sum, correct, n = reduce_sums([loss_sum, correct, len(y_all)], comm)
    return float(loss_sum / n), float(correct / n)


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: Config, device) -> tuple:
    """A training step's forward and loss, the one recipe of every backend: (logits, mean loss).
    On CUDA the forward runs in bfloat16 (autocast) and the loss in float32; on a CPU autocast is off
    and ``out.float()`` is ``out`` itself, so the arithmetic is plain float32, bit for bit::

        out, loss = forward_loss(model, x, y, cfg, device)
        loss.backward()

    With batch augmentation ``x`` holds each image's ``copies`` augmented copies side by side (``y`` one
    label per image): the loss is the mean over every copy, the logits returned one row per image (the
    mean of its copies'), so the backends count images, not copies.
    """
    copies = x.shape[0] // y.shape[0]  # batch augmentation: each image's copies side by side (ShardLoader)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(x)
        loss = F.cross_entropy(out.float(), y if copies == 1 else y.repeat_interleave(copies),
                               label_smoothing=cfg.label_smoothing)
    if copies > 1:  # one row per image, as the backends count images: its copies' mean logits
        out = out.detach().view(y.shape[0], copies, -1).mean(1)
    return out, loss


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
    """One step as every rank agrees on it: global sums, and this rank's times (s). What a component needs
    beyond it (every rank's values of its slots, the step's spans) it takes in its ``on_step`` moment
    (``pilab.component.RankStep``)."""
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


@runtime_checkable
class RankBackend(Protocol):
    """The ranks a ``pilab.engine.loop.Session`` trains on. Attributes: ``simulated``, ``rank`` (this
    process's), ``np_``, ``comm`` (None for one process), ``steps_per_epoch`` (after ``build``). The
    core is set-up (``check``, ``threads``, ``build``, ``start``), one synchronous ``step`` (gradients
    averaged over every rank, or kept on each as ``phase`` says, its metrics and votes summed: the same
    ``StepResult`` everywhere), what a
    batch ramp or a resume needs (``set_batch``, ``carry``), settling and checkpointing per-rank state
    (``settle``, ``rank_states``, ``restore_rank_states``), ``evaluate``, and the run's facts (``hosts``,
    ``environment``, ``per_rank``, ``extras``, ``close``)."""

    simulated: bool
    rank: int
    np_: int
    comm: object

    def check(self, cfg: Config, components=()) -> None: ...
    def threads(self, cfg: Config) -> int: ...
    def build(self, cfg: Config, device, ds, batch: int, components=()) -> nn.Module: ...
    def start(self, cfg: Config, model: nn.Module, optimizer, components=()) -> None: ...
    def step(self, cfg: Config, model, optimizer, epoch: int, step: int, stop=None, save=None,
             phase: Phase = SYNC) -> StepResult: ...
    def set_batch(self, batch: int) -> None: ...
    def carry(self, epoch: int, plan, ds) -> None: ...
    def settle(self, model, policy: str) -> None: ...
    def rank_states(self, model) -> list | None: ...
    def restore_rank_states(self, model, states: list | None) -> None: ...
    def evaluate(self, model, ds) -> tuple[float, float]: ...
    def hosts(self) -> list[str]: ...
    def environment(self, threads: int) -> dict: ...
    def per_rank(self, values: list[float]): ...
    def extras(self) -> dict: ...
    def close(self) -> None: ...


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


PHASES = ("data", "forward", "backward", "wait", "optimizer")  # an MPI rank's step, in order


def phase_spans(rank: int, marks) -> list:
    """A step's spans on ``rank``'s track from its phase boundaries (``perf_counter`` seconds; the
    boundary before each of ``PHASES`` and the step's end)::

        phase_spans(0, (t_data, t_forward, t_backward, t_backward_end, t_wait_end, t_end))
    """
    return [(rank, name, marks[i], marks[i + 1]) for i, name in enumerate(PHASES)]


def slot_sizes(components, np_: int) -> dict:
    """Every component's slots, ``{name: count}``, in the components' order (each name once)."""
    out: dict = {}
    for c in components:
        for name, n in c.slots(np_).items():
            if name in out:
                raise ValueError(f"slot {name!r} is declared by two components; give each a name of its own")
            out[name] = n
    return out
