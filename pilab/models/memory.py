"""Memory per rank: the predicted peak RSS of one training rank, and the nodes it has to fit in.

    from pilab.models.memory import predict_peak_bytes, NODE_MEMORY, fit_warning
    peak = predict_peak_bytes(cfg)                 # bytes, one rank, the whole training set on it
    peak = predict_peak_bytes(cfg, np_=48)         # this rank's shard only (static sharding)
    fit_warning(cfg, np_=2, ranks_per_node=2, node_bytes=NODE_MEMORY["pi4b_4gb"])   # None: it fits

The prediction is a sum of parts, each from the model and the data sizes, plus constants measured by
``python -m pilab bench --sections memory`` (BENCHMARKS.md, "Memory per rank"):

* ``RUNTIME_BYTES``: the interpreter with torch, numpy and mpi4py imported, before any tensor, and
  ``WARM_BYTES`` that a rank adds once it has run a step (the code pages of the kernels it ran,
  oneDNN's primitive cache, glibc's free lists);
* the data this rank holds: its shard of the training images (uint8) and its share of the test set
  (the whole of both where ``np_`` is None);
* the model state: parameters, gradients (views into GradSync's buckets), the momentum buffer;
* the activations at the peak of a training step: ``TRAIN_BYTES_PER_ELEMENT`` per element every leaf
  layer writes for one image (``models.activation_elements``) times the batch; the factor holds what
  autograd saves, the backward's gradients in flight and what the allocator keeps between steps;
* evaluation: ``EVAL_BYTES_PER_ELEMENT`` per element of the largest layer output, times the images of
  one forward (``eval_batch``, at most ``config.EVAL_CHUNK``);
  the larger of training and evaluation counts, as they never run at the same time;
* loading: the whole decoded source and a subset's copy of it;
* set-up: the training images and, beside them, the loader's copy of the shard, the rank's test
  images, the parameters and GradSync's gradient buckets (plus ``SETUP_BYTES``), before the Session
  drops the whole training set; the peak is the largest of loading, set-up and training.
"""
from __future__ import annotations

import functools
import os
import sys

from ..config import EVAL_CHUNK, Config, ConfigError

__all__ = ["predict_peak_bytes", "breakdown", "NODE_MEMORY", "NODE_RESERVE_BYTES", "node_bytes",
           "fit_warning", "limit_allocator_caches", "MemoryConfigError"]

MiB = 2 ** 20
GiB = 2 ** 30

# Memory of the boards as the OS sees it (MemTotal; the firmware and the kernel keep the rest of the
# 4 / 8 GiB). Assumed, not measured here: no Pi was at hand; `free -b` on a node gives the real figure
# (pass it as --node-memory).
NODE_MEMORY = {"pi4b_4gb": 3_880 * MiB, "pi4b_8gb": 7_810 * MiB}
# What a node needs besides the ranks: the OS with sshd, Hydra's proxy and an ipyparallel engine stack
# (controller client + engine process). An assumption (~0.5 GiB), not a measurement.
NODE_RESERVE_BYTES = 512 * MiB

# Measured on this repository's bench machine (x86-64, torch CPU wheel; see BENCHMARKS.md):
RUNTIME_BYTES = 244 * MiB  # python + torch + numpy + mpi4py imported, no tensors yet
WARM_BYTES = 44 * MiB  # once a step has run: kernels' code pages, oneDNN's primitive cache, free lists
SETUP_BYTES = 10 * MiB  # building the model and the first collectives, besides what set-up counts
TRAIN_BYTES_PER_ELEMENT = 2.8  # per activation element of one image, per image of the batch
EVAL_BYTES_PER_ELEMENT = 12.9  # per element of the largest layer output, per evaluation image
PIXEL_BYTES, LABEL_BYTES = 32 * 32 * 3, 8  # one CIFAR-10 image (uint8 HWC), its int64 label
IMAGE_BYTES = PIXEL_BYTES + LABEL_BYTES
SOURCE_SIZES = {"embedded": (5_000, 1_000)}  # (train, test) images; every other source: CIFAR-10's
CIFAR10_SIZES = (50_000, 10_000)


class MemoryConfigError(ConfigError):
    """A node-memory setting is invalid (one line naming it and the fix)."""


@functools.lru_cache(maxsize=None)
def _model_facts(model: str, width: float, timesteps: int) -> tuple[int, int, int]:
    """(parameters, activation elements of one image, elements of the largest layer output), measured
    on ``models.probe_model`` (the global RNG untouched)."""
    from .zoo import _TAKES_TIMESTEPS, activation_elements, count_parameters, largest_output_elements, \
        probe_model
    ts = timesteps if model in _TAKES_TIMESTEPS else None
    return (count_parameters(probe_model(model, width=width, timesteps=ts)), activation_elements(model, width, timesteps=ts),
            largest_output_elements(model, width, timesteps=ts))


def breakdown(cfg: Config, *, np_: int | None = None) -> dict:
    """The predicted peak of one rank, itemised (bytes): runtime, data, model, activations, and peak.

        breakdown(Config(width=0.5), np_=2)["activations"]

    ``np_`` None: the rank holds the whole training and test sets (the bound for any np); else static
    sharding gives it 1/np of the training images, and it keeps 1/np of the test images."""
    src_train, src_test = SOURCE_SIZES.get(cfg.data, CIFAR10_SIZES)
    n_train = cfg.train_subset or src_train
    n_test = cfg.test_subset or src_test
    ranks = np_ or 1
    shard = -(-n_train // ranks) if cfg.sharding == "static" else n_train
    params, act, largest = _model_facts(cfg.model, cfg.width, cfg.timesteps)
    batch = cfg.per_rank_batch(ranks) if np_ else cfg.batch_size
    # parameters, their gradients (GradSync's flat buckets), the momentum buffer; fp16's wire copy
    model = params * 4 * (3 if cfg.momentum else 2) + (params * 2 if cfg.compression == "fp16" else 0)
    train = TRAIN_BYTES_PER_ELEMENT * act * batch
    # each rank evaluates its test_shard, and keeps only its pixels (engine.Session; all the labels)
    test_share = -(-n_test // ranks)
    eval_ = EVAL_BYTES_PER_ELEMENT * largest * min(cfg.eval_batch, EVAL_CHUNK, test_share)
    data = shard * IMAGE_BYTES + test_share * PIXEL_BYTES + n_test * LABEL_BYTES
    # Loading: the decoded source and a subset's copy of it.
    subset = (n_train if cfg.train_subset else 0) + (n_test if cfg.test_subset else 0)
    load = RUNTIME_BYTES + (src_train + src_test + subset) * IMAGE_BYTES
    # Set-up: the training images beside the loader's copy of the static shard (reshuffle copies
    # nothing), the parameters and the gradient buckets; the momentum comes with the first step.
    setup = (RUNTIME_BYTES + SETUP_BYTES + data + params * 4 * 2
             + (n_train * IMAGE_BYTES if cfg.sharding == "static" else 0))
    steady = RUNTIME_BYTES + WARM_BYTES + data + model + max(train, eval_)
    parts = {"runtime": RUNTIME_BYTES + WARM_BYTES, "data": data, "model": model, "activations": max(train, eval_),
             "train_activations": train, "eval_activations": eval_, "load": load, "setup": setup,
             "steady": steady}
    parts["peak"] = max(load, setup, steady)
    return {k: int(v) for k, v in parts.items()}


def predict_peak_bytes(cfg: Config, *, np_: int | None = None) -> int:
    """Predicted peak RSS of ONE rank training ``cfg`` (bytes)::

        predict_peak_bytes(Config(width=1.0, batch_size=32))          # ~0.9e9 (see BENCHMARKS.md)
        2 * predict_peak_bytes(cfg) <= NODE_MEMORY["pi4b_4gb"] - NODE_RESERVE_BYTES

    ``np_`` as in ``breakdown`` (None: the whole training set on this rank, an upper bound)."""
    return breakdown(cfg, np_=np_)["peak"]


# glibc serves allocations from this size up with their own mmap and returns them on free; its default
# moves the threshold up to 32 MiB as the program frees large blocks, and the activations of a step
# (1-13 MB each) then stay on the heap's free lists between steps and fragment it (~100 MB at the
# study's setting, see BENCHMARKS.md). 1 MiB keeps the peak at what the tensors need.
MMAP_THRESHOLD_BYTES = 1 * MiB
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)


def limit_allocator_caches() -> bool:
    """Make glibc give large freed blocks back at once (``MMAP_THRESHOLD_BYTES``); True if set.

        memory.limit_allocator_caches()   # engine.Session calls it; the numbers computed are the same

    Not on other C libraries, and not when ``MALLOC_MMAP_THRESHOLD_`` is set (the user's choice wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False


def node_bytes(spec: str) -> int:
    """A node's memory from a preset name (``pi4b_4gb``, ``pi4b_8gb``), ``host`` (this machine's
    MemTotal) or a size (``3.5GB``, ``900MB``, ``4GiB``, bytes); raises MemoryConfigError otherwise."""
    s = str(spec).strip()
    if s in NODE_MEMORY:
        return NODE_MEMORY[s]
    if s == "host":
        return host_memory_bytes()
    units = {"gib": GiB, "mib": MiB, "gb": 10 ** 9, "mb": 10 ** 6, "g": GiB, "m": MiB, "": 1}
    low = s.lower()
    for unit in sorted(units, key=len, reverse=True):
        if low.endswith(unit):
            try:
                value = float(low[:len(low) - len(unit)] if unit else low)
            except ValueError:
                break
            if value > 0:
                return int(value * units[unit])
            break
    raise MemoryConfigError(f"node memory {spec!r} is not understood; give {', '.join(NODE_MEMORY)}, host, "
                       "or a size such as 4GB or 3500MB")


def host_memory_bytes() -> int:
    """This machine's MemTotal (bytes); 0 where /proc/meminfo does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fit_warning(cfg: Config, *, np_: int, ranks_per_node: int, node_bytes: int,
                reserve: int = NODE_RESERVE_BYTES) -> str | None:
    """One line when ``ranks_per_node`` ranks of ``cfg`` are predicted not to fit in a node of
    ``node_bytes`` (less ``reserve`` for the OS and an engine stack); None when they fit::

        msg = fit_warning(cfg, np_=2, ranks_per_node=2, node_bytes=NODE_MEMORY["pi4b_4gb"])
    """
    peak = predict_peak_bytes(cfg, np_=np_)
    need, have = ranks_per_node * peak, node_bytes - reserve
    if not node_bytes or need <= have:
        return None
    return (f"pilab: warning: {ranks_per_node} rank(s) per node x {peak / 1e9:.2f} GB predicted peak = "
            f"{need / 1e9:.2f} GB exceeds the node's {node_bytes / 1e9:.2f} GB less "
            f"{reserve / 1e9:.2f} GB for the OS; use fewer ranks per node, a smaller --batch-size or "
            "--width, or a smaller --eval-batch")
