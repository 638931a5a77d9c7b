"""Memory per rank: the predicted peak RSS of one training rank, and the nodes it has to fit in.

    from pilab.engine.memory import predict_peak_bytes, NODE_MEMORY, fit_warning
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
  autograd saves, the backward's gradients in flight and what the allocator keeps between steps,
  measured on the registered networks. Your own model (``package.module:builder``) keeps its own share
  (a plain 3x3-conv ResNet at 32x32 keeps as much again as it saves, MobileNetV2 half as much):
  ``step_memory``, below measures its step (``warm + per_image * batch``) in a child process, about 2 s
  of CPU once per setting; where the probe cannot run (a builder defined in ``__main__``, not Linux) the registered networks' factor stands in;
* evaluation: ``EVAL_BYTES_PER_ELEMENT`` per element of the largest layer output, times the images of
  one forward (``eval_batch``, at most ``config.EVAL_CHUNK``);
  the larger of training and evaluation counts, as they never run at the same time;
* loading: the whole decoded source and a subset's copy of it;
* set-up: the training images and, beside them, the loader's copy of the shard, the rank's test
  images, the parameters and GradSync's gradient buckets (plus ``SETUP_BYTES``), before the Session
  drops the whole training set; the peak is the largest of loading, set-up and training.

What a model's training step costs in memory beyond its saved activations, measured on the model itself.

    from pilab.engine.memory import step_memory
    warm, per_image = step_memory("mynets:resnet8", width=1.0, timesteps=None, shape=(3, 32, 32),
                                  threads=1, malloc=(("MALLOC_MMAP_THRESHOLD_", "1073741824"),))
    # bytes, bytes per image

This module predicts the activations of a training step from the elements its layers write
and a factor measured on the registered networks (MobileNetV2's: autograd's saved tensors, the backward's
gradients in flight, glibc keeping freed blocks, oneDNN's scratch). That factor is the model's, not a
constant: beyond its saved activations a plain 3x3-convolution ResNet at full 32x32 resolution keeps about
as much again (small_resnet at 256 images: 173 MB saved, 150-190 MB more), MobileNetV2 about half as much. For a
model pilab has not calibrated, this module measures it: a child process (so the caller's RSS is not
touched) builds the model, with malloc set as a rank's (``malloc``: glibc's variables, which
``memory.tune_allocator`` sets with mallopt in a rank) and, in a fresh fork
per batch size, runs ``STEPS`` SGD steps on random images; the growth of its peak RSS (VmHWM) over the
RSS before the first step, less the model state and the input, is ``warm + per_image * batch``, fitted on
the two batch sizes ``BATCHES``.

Cost: one python with torch imported, then ``REPEATS`` forks of ``STEPS`` steps at each of 16 and 64 images:
about 2 s of CPU for small_resnet (width 1.0, 32x32), 4-7 s wall on a shared 2-core machine; once per
setting and process (cached), and ``memory.choose_allocator`` / ``fit_warning`` only ask for it near the
node's limit.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from ..config import EVAL_CHUNK, Config, ConfigError
from ..dist import codec_for

__all__ = ["predict_peak_bytes", "breakdown", "NODE_MEMORY", "NODE_RESERVE_BYTES", "node_bytes", "fit_warning",
           "ALLOCATORS", "choose_allocator", "tune_allocator", "MemoryConfigError", "step_memory", "BATCHES", "STEPS",
           "ProbeError"]

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
def _model_facts(model: str, width: float, timesteps: int, image_size: int = 32) -> tuple[int, int, int]:
    """(parameters, activation elements of one image, elements of the largest layer output), measured
    on ``models.probe_model`` (the global RNG untouched), for square images of ``image_size``."""
    from ..models import TAKES_TIMESTEPS, activation_elements, count_parameters, largest_output_elements, probe_model
    ts = timesteps if model in TAKES_TIMESTEPS else None
    return (count_parameters(probe_model(model, width=width, timesteps=ts)),
            activation_elements(model, width, image_size=image_size, timesteps=ts),
            largest_output_elements(model, width, image_size=image_size, timesteps=ts))


def _step_memory(cfg: Config, shape: tuple[int, int, int], allocator: str) -> tuple[int, int] | None:
    """(warm bytes, bytes per image) of a training step of your own model, measured (``step_memory``, below);
    None for a registered model (its constants are measured) or where the probe cannot run."""
    from ..models import is_builder_spec
    if not is_builder_spec(cfg.model):
        return None
    try:  # a rank's own threads (1 where cfg.threads is auto: a Pi's ranks get one or two cores each)
        return step_memory(cfg.model, float(cfg.width), cfg.timesteps, shape, cfg.threads or 1,
                           _malloc_env(allocator))
    except ProbeError:
        return None


def data_facts(cfg: Config) -> tuple[int, int, tuple[int, int, int]]:
    """(training images, test images, (C, H, W) of one image) of ``cfg.data``: a data set saved by
    ``pilab.data.save`` (a .npz) is read from its array headers; any other source is taken for CIFAR-10
    (the embedded subset's or the full set's counts, 3x32x32)::

        data_facts(Config(data="my.npz"))      # (n_train, n_test, (1, 8, 8)) for 8x8 grey images
    """
    src_train, src_test = SOURCE_SIZES.get(cfg.data, CIFAR10_SIZES)
    if str(cfg.data).endswith(".npz") and os.path.isfile(cfg.data):
        import numpy as np

        try:
            with open(cfg.data, "rb") as f, np.load(f, allow_pickle=False) as z:
                shapes = {}
                for key in ("x_train", "x_test"):
                    with z.zip.open(key + ".npy") as member:
                        version = np.lib.format.read_magic(member)
                        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                            np.lib.format.read_array_header_2_0
                        shapes[key] = read(member)[0]
            n, h, w, *c = shapes["x_train"]  # (n, H, W, C) as pilab.data keeps images; grey may drop C
            return n, shapes["x_test"][0], (c[0] if c else 1, h, w)
        except Exception:  # unreadable: the ranks will say so; predict as for CIFAR-10
            pass
    return src_train, src_test, (3, 32, 32)


def breakdown(cfg: Config, *, np_: int | None = None, allocator: str = "fast", probe: bool = True) -> dict:
    """The predicted peak of one rank, itemised (bytes): runtime, data, model, activations, and peak.

        breakdown(Config(width=0.5), np_=2)["activations"]

    ``np_`` None: the rank holds the whole training and test sets (the bound for any np); else static
    sharding gives it 1/np of the training images, and it keeps 1/np of the test images. ``allocator``:
    how the rank's malloc is set (``ALLOCATORS``; "fast" keeps more of a step's freed activations).
    ``probe``: for your own model, measure its step's memory (``step_memory``, below, ~2 s once); False takes
    the registered networks' factor instead (a quick bound, as ``choose_allocator`` uses first)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator={allocator!r}; use one of {', '.join(ALLOCATORS)}")
    src_train, src_test, shape = data_facts(cfg)
    pixel_bytes, side = shape[0] * shape[1] * shape[2], shape[1]
    image_bytes = pixel_bytes + LABEL_BYTES
    n_train = cfg.train_subset or src_train
    n_test = cfg.test_subset or src_test
    ranks = np_ or 1
    shard = -(-n_train // ranks) if cfg.sharding == "static" else n_train
    params, act, largest = _model_facts(cfg.model, cfg.width, cfg.timesteps, side)
    # the images a rank's forward holds activations for: batch augmentation's copies count
    batch = (cfg.per_rank_batch(ranks) if np_ else cfg.batch_size) * cfg.batch_aug
    # parameters, their gradients (GradSync's flat buckets), the optimizer's state (SGD/LARS: the momentum
    # buffer; LAMB: Adam's two moments), Lookahead's slow copy; a codec's wire copy
    state = 2 if cfg.optimizer == "lamb" else (1 if cfg.momentum else 0)
    model = params * 4 * (2 + state + (cfg.lookahead_steps > 0)) + codec_for(cfg.compression).extra_bytes(params)
    train = TRAIN_BYTES_PER_ELEMENT * act * batch * (1 + ALLOCATOR_RETAIN[allocator])
    warm = WARM_BYTES
    measured = _step_memory(cfg, shape, allocator) if probe else None
    if measured is not None:  # your own model: its step measured (what it adds once, and per image)
        warm, per_image = measured
        train = per_image * batch
    # each rank evaluates its test_shard, and keeps only its pixels (engine.Session; all the labels)
    test_share = -(-n_test // ranks)
    eval_ = EVAL_BYTES_PER_ELEMENT * largest * min(cfg.eval_batch, EVAL_CHUNK, test_share)
    data = shard * image_bytes + test_share * pixel_bytes + n_test * LABEL_BYTES
    # Loading: the decoded source and a subset's copy of it.
    subset = (n_train if cfg.train_subset else 0) + (n_test if cfg.test_subset else 0)
    load = RUNTIME_BYTES + (src_train + src_test + subset) * image_bytes
    # Set-up: the training images beside the loader's copy of the static shard (reshuffle copies
    # nothing), the parameters and the gradient buckets; the momentum comes with the first step.
    setup = (RUNTIME_BYTES + SETUP_BYTES + data + params * 4 * 2
             + (n_train * image_bytes if cfg.sharding == "static" else 0))
    steady = RUNTIME_BYTES + warm + data + model + max(train, eval_)
    parts = {"runtime": RUNTIME_BYTES + warm, "data": data, "model": model, "activations": max(train, eval_),
             "train_activations": train, "eval_activations": eval_, "load": load, "setup": setup,
             "steady": steady}
    parts["peak"] = max(load, setup, steady)
    return {k: int(v) for k, v in parts.items()}


def predict_peak_bytes(cfg: Config, *, np_: int | None = None, allocator: str = "fast", probe: bool = True) -> int:
    """Predicted peak RSS of ONE rank training ``cfg`` (bytes)::

        predict_peak_bytes(Config(width=1.0, batch_size=32))          # ~0.9e9 (see BENCHMARKS.md)
        2 * predict_peak_bytes(cfg) <= NODE_MEMORY["pi4b_4gb"] - NODE_RESERVE_BYTES

    ``np_``, ``allocator`` and ``probe`` as in ``breakdown`` (``np_`` None: the whole training set on this
    rank, an upper bound)."""
    return breakdown(cfg, np_=np_, allocator=allocator, probe=probe)["peak"]


# Your own model's quick prediction (the registered networks' factor) is off by up to ~25%: where
# even this margin over it fits, the measured one is not needed (no probe at every rank's start).
QUICK_MARGIN = 1.5


def _fits(cfg: Config, np_, ranks_per_node: int, have: int, allocator: str) -> tuple[bool, int]:
    """(ranks_per_node ranks fit in ``have`` bytes, the peak of one), probing your own model only if close."""
    quick = predict_peak_bytes(cfg, np_=np_, allocator=allocator, probe=False)
    if ranks_per_node * quick * QUICK_MARGIN <= have:
        return True, quick
    peak = predict_peak_bytes(cfg, np_=np_, allocator=allocator)
    return ranks_per_node * peak <= have, peak


# glibc's malloc, set one of two ways for a training rank (``tune_allocator``):
# * "fast": large freed blocks stay in the process (mmap threshold 1 GiB, no trimming), so a step reuses
#   the memory the last step's activations had. glibc's default hands every block above its (moving) mmap
#   threshold back to the kernel at free and page-faults it in again at the next step: measured here,
#   MobileNetV2 1.0 at 64 images, 66,000 minor faults and 12% of the step in the kernel; with a 1 MiB
#   threshold 507,000 faults, half the step in the kernel and the step 2.4x as long; "fast": 500 faults,
#   0.1%. The price: more of the training activations stay resident at the peak (ALLOCATOR_RETAIN; measured
#   +21% of them at the study's setting, 941 vs 850 MB a rank, and +38% at 64 images a rank).
# * "lean": blocks from 1 MiB up mapped on their own and returned at once: the lowest peak (what the
#   tensors need), for a node where "fast" would not fit.
ALLOCATORS = ("fast", "lean")
ALLOCATOR_RETAIN = {"fast": 0.3, "lean": 0.0}  # extra share of the train activations kept resident
_MALLOPT = {"fast": ((-3, 1 * GiB), (-1, 2 ** 31 - 1)),  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD (malloc.h)
            "lean": ((-3, 1 * MiB),)}


def _malloc_env(mode: str) -> tuple:
    """glibc's variables setting malloc as ``tune_allocator(mode)`` does (for a child process); none where
    the user set their own (they win there too)."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return ()
    names = {-3: "MALLOC_MMAP_THRESHOLD_", -1: "MALLOC_TRIM_THRESHOLD_"}
    return tuple((names[param], str(value)) for param, value in _MALLOPT[mode])


def choose_allocator(cfg: Config, *, np_: int, ranks_per_node: int, node_bytes: int,
                     reserve: int = NODE_RESERVE_BYTES) -> str:
    """"fast" where ``ranks_per_node`` ranks of ``cfg`` fit the node with it (or its memory is unknown:
    ``node_bytes`` 0), else "lean"; ``PILAB_ALLOCATOR`` (fast or lean) decides instead where set::

        choose_allocator(cfg, np_=48, ranks_per_node=2, node_bytes=NODE_MEMORY["pi4b_4gb"])
    """
    forced = os.environ.get("PILAB_ALLOCATOR", "").strip()
    if forced:
        if forced not in ALLOCATORS:
            raise MemoryConfigError(f"PILAB_ALLOCATOR={forced!r} is not understood; use fast or lean, or unset it")
        return forced
    if not node_bytes:
        return "fast"
    return "fast" if _fits(cfg, np_, ranks_per_node, node_bytes - reserve, "fast")[0] else "lean"


def tune_allocator(mode: str) -> bool:
    """Set this process's glibc malloc to ``mode`` (``ALLOCATORS``); True if set::

        memory.tune_allocator("fast")   # engine.Session calls it; the numbers computed are the same

    Not on other C libraries (musl, macOS: no mallopt), and not when ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_`` is set (the user's choice wins)."""
    if mode not in ALLOCATORS:
        raise ValueError(f"mode={mode!r}; use one of {', '.join(ALLOCATORS)}")
    if not sys.platform.startswith("linux") or \
            {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        return all(libc.mallopt(param, value) == 1 for param, value in _MALLOPT[mode])
    except (OSError, AttributeError):
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
    """This machine's MemTotal (bytes), or this process's memory cgroup limit where tighter (a container,
    a testbed node); 0 where /proc/meminfo does not exist."""
    total = _mem_total()
    limits = [lim for lim in _cgroup_limits() if lim]
    return min([total] + limits) if total else 0


def free_bytes() -> int:
    """Memory free for a new allocation now (bytes): /proc/meminfo's MemAvailable, or this process's
    memory cgroup's room (its limit less its usage, v1 or v2) where tighter; 0 where unknown."""
    avail = _meminfo("MemAvailable")
    rooms = [lim - use for lim, use in _cgroup_limits(usage=True)]
    return min([avail] + rooms) if avail else (min(rooms) if rooms else 0)


def _cgroup_limits(usage: bool = False) -> list:
    """The memory limits (bytes) of this process's cgroup and its parents, v1 or v2; none where unlimited
    (``usage``: (limit, usage) pairs)."""
    out = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        v2 = ctrls == ""
        if not v2 and "memory" not in ctrls.split(","):
            continue
        base = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory"
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):
            try:
                with open(os.path.join(base, *parts[:k], "memory.max" if v2 else "memory.limit_in_bytes")) as f:
                    value = f.read().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < (1 << 60):
                if not usage:
                    out.append(int(value))
                    continue
                try:
                    with open(os.path.join(base, *parts[:k], "memory.current" if v2 else "memory.usage_in_bytes")) as f:
                        out.append((int(value), int(f.read().strip())))
                except (OSError, ValueError):
                    continue
    return out


def _meminfo(key: str) -> int:
    """/proc/meminfo's ``key`` in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mem_total() -> int:
    return _meminfo("MemTotal")


def fit_warning(cfg: Config, *, np_: int, ranks_per_node: int, node_bytes: int,
                reserve: int = NODE_RESERVE_BYTES) -> str | None:
    """One line when ``ranks_per_node`` ranks of ``cfg`` are predicted not to fit in a node of
    ``node_bytes`` (less ``reserve`` for the OS and an engine stack); None when they fit::

        msg = fit_warning(cfg, np_=2, ranks_per_node=2, node_bytes=NODE_MEMORY["pi4b_4gb"])
    """
    # the ranks keep less when "fast" would not fit (choose_allocator): warn only if "lean" does not fit either
    have = node_bytes - reserve
    if not node_bytes or _fits(cfg, np_, ranks_per_node, have, "fast")[0]:
        return None
    fits, peak = _fits(cfg, np_, ranks_per_node, have, "lean")
    if fits:
        return None
    need = ranks_per_node * peak
    return (f"pilab: warning: {ranks_per_node} rank(s) per node x {peak / 1e9:.2f} GB predicted peak = "
            f"{need / 1e9:.2f} GB exceeds the node's {node_bytes / 1e9:.2f} GB less "
            f"{reserve / 1e9:.2f} GB for the OS; use fewer ranks per node, a smaller --batch-size or "
            "--width, or a smaller --eval-batch")



BATCHES = (16, 64)  # images per step: small enough to be cheap, far enough apart for a slope
REPEATS = 3  # forks per batch size, their median taken: where glibc's heap lands varies by some 15% at 128 images
STEPS = 2  # the first step pages in the kernels and fills oneDNN's cache; the second reuses freed blocks


class ProbeError(RuntimeError):
    """The probe could not measure the model (it does not import in a child process, or its step failed)."""


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


@functools.lru_cache(maxsize=None)
def step_memory(model: str, width: float, timesteps: int | None, shape: tuple[int, int, int], threads: int,
                malloc: tuple = (), num_classes: int = 10) -> tuple[int, int]:
    """(bytes a training step adds once, bytes per image of the batch) for ``model`` on images of ``shape``
    (C, H, W), measured in a child process (see the module's docstring); raises ProbeError."""
    if not sys.platform.startswith("linux"):
        raise ProbeError("the probe reads /proc/self/status (Linux only)")
    from ..models import LOCAL_BUILDERS
    if model in LOCAL_BUILDERS or model.startswith("__main__:"):  # a function defined in __main__ or a notebook cell: no child process can import it
        raise ProbeError(f"{model} is defined in this process only; put it in a .py file to have it measured")
    args = [model, repr(width), repr(timesteps), ",".join(map(str, shape)), str(threads), str(num_classes)]
    env = dict(os.environ, **dict(malloc))
    # the builder is imported by its string there: give the child every directory this process imports from
    env["PYTHONPATH"] = os.pathsep.join([p or os.getcwd() for p in sys.path])
    try:
        p = subprocess.run([sys.executable, "-m", "pilab.engine.memory", *args], capture_output=True,
                           text=True, timeout=600, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ProbeError(f"the memory probe of {model} did not run: {e}") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeError(f"the memory probe of {model} failed: {last}")
    grown = json.loads(p.stdout.strip().splitlines()[-1])
    (b1, e1), (b2, e2) = sorted((int(b), e) for b, e in grown.items())
    per_image = max(0.0, (e2 - e1) / (b2 - b1))
    return int(max(0.0, e1 - per_image * b1)), int(per_image)


def _one_batch(model: str, width: float, timesteps, shape, num_classes: int, batch: int) -> int:
    """In a forked child: the RSS ``STEPS`` training steps of ``batch`` images add, less model state and input."""
    import torch
    import torch.nn.functional as F

    from .optim import SGD
    from ..models import build_model

    torch.manual_seed(0)
    net = build_model(model, num_classes=num_classes, width=width, timesteps=timesteps)
    net = net.train().to(memory_format=torch.channels_last)  # as engine.backend builds a rank's model
    opt = SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, *shape).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, num_classes, (batch,))
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS (Linux >= 4.0)
        f.write("5")
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    state = sum(p.numel() * p.element_size() * 3 for p in net.parameters())  # weights' grads and momentum
    return _status("VmHWM") - before - state


def main(argv: list[str]) -> int:
    model, width, timesteps, shape, threads, num_classes = argv
    import torch  # imported here, in the parent, before any fork: each child starts with it

    from .optim import SGD  # noqa: F401
    from ..models import build_model  # noqa: F401

    torch.set_num_threads(int(threads))
    ts = None if timesteps == "None" else int(timesteps)
    shape = tuple(int(s) for s in shape.split(","))
    out = {}
    for batch in BATCHES:
        got = sorted(_in_a_fork(model, float(width), ts, shape, int(num_classes), batch) for _ in range(REPEATS))
        if None in got:
            return 1
        out[batch] = got[len(got) // 2]
    print(json.dumps(out))
    return 0


def _in_a_fork(model: str, width: float, ts, shape, num_classes: int, batch: int) -> int | None:
    """``_one_batch`` in a fresh process (it reuses none of another batch's free blocks); None if it failed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        code = 1
        try:
            os.write(w, str(_one_batch(model, width, ts, shape, num_classes, batch)).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001  (the parent says what failed)
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    return int(got) if status == 0 and got else None


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
