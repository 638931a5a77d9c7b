"""The machine the model predicts for: links between ranks, nodes, compute rates.

    from pilab.perfmodel import Cluster, Link, pi4b_cluster
    cl = pi4b_cluster()                                   # or this_box(calibration), or Cluster(...)
    cl.inter                                              # Link(alpha=7.5e-05, beta=8.5e-09)
    dataclasses.replace(cl, inter=Link(50e-6, 1 / 1e9))   # the same cluster on a faster network

The performance model's stated assumptions, in one place (docs/perfmodel.md explains each).

    from pilab.perfmodel.machine import THREAD_EXPONENT
    compute_s * (ref_threads / threads) ** THREAD_EXPONENT     # compute time at another thread count
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import ConfigError

BACKWARD_FRACTION = 2 / 3  # backward ~ 2x the forward FLOPs: 2/3 of a step's compute
THREAD_EXPONENT = 0.8  # compute time ~ threads^-0.8 (intra-op scaling of small 32x32 convs)
ELEMENT_BYTES = 4  # fp32 gradients
METRIC_BYTES = 24  # pilab's per-step Allreduce of [loss sum, correct, stop vote] (float64)

# A CPU training step of these 32x32 networks is bound by memory traffic as much as by FLOPs: one
# activation element written by a layer costs about as much time as this many training FLOPs.
# Measured once on an x86 core with PyTorch's CPU build (`python -m pilab bench --sections perfmodel`
# prints the fit); it sets how compute time moves with width, not its level, which the np=1 run calibrates.
FLOPS_PER_ACTIVATION_CPU = 230.0
# Each step also pays a cost that does not grow with the batch (operator dispatch, autograd
# bookkeeping, the optimizer's per-tensor loops): ~20 ms per step for MobileNetV2 here at one thread,
# at every width. In the same work units, per parameter tensor of the model; it matters when the
# per-rank batch is small (a fixed global batch at large np). Measured like the constant above (fits
# over batches 4..64 and widths 0.25..1 gave 170-360 for the one above and 3-7e6 for this one).
STEP_WORK_PER_TENSOR_CPU = 5.0e6


ALGORITHMS = ("mpich", "ring", "recursive_doubling", "rabenseifner", "hierarchical")


@dataclass(frozen=True)
class Link:
    """Cost of one message of n bytes on a link: alpha + n * beta seconds."""
    alpha: float  # seconds per message (latency)
    beta: float  # seconds per byte (1 / bandwidth)

    def __post_init__(self):
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ConfigError(f"Link {name}={v!r} must be a finite number >= 0")


# Fields of Cluster that must be > 0 (rates divide) and those that must be >= 0 (0 has a meaning or
# is simply free); warmup_s is signed (see Calibration.warmup_s).
_POSITIVE = ("cores_per_node", "ref_threads", "train_gflops", "eval_gflops")
_NON_NEGATIVE = ("nodes", "ranks_per_node", "data_s_per_image", "step_overhead_s", "compute_cv",
                 "gamma", "short_msg_bytes", "oversub_alpha", "available_cores",
                 "flops_per_activation", "step_work_per_tensor", "gamma_fp16")


@dataclass(frozen=True)
class Cluster:
    """Everything the model knows about a machine. ``this_box(cal)`` and ``pi4b_cluster()`` build one.

    Out-of-range numbers (a rate <= 0, a negative count) raise ``ConfigError`` when it is built."""
    name: str
    nodes: int  # nodes available (0: as many as needed)
    ranks_per_node: int  # MPI ranks placed on one node, block placement (0: all ranks on one node)
    cores_per_node: int
    ref_threads: int  # torch threads per rank at which the rates below hold
    # achieved training GFLOP/s per rank (fwd + bwd + optimizer), at ref_threads, counting as "work"
    # the FLOPs plus flops_per_activation for each activation element (see work_per_image)
    train_gflops: float
    eval_gflops: float  # the same for the forward pass in evaluation (a third of the work)
    data_s_per_image: float  # batch augmentation + input conversion, per image
    step_overhead_s: float  # per-step time outside compute/data/comm (Python, .item(), logging)
    warmup_s: float  # one-time extra of the first step of a run (allocations)
    compute_cv: float  # coefficient of variation of per-step compute (jitter -> stragglers)
    intra: Link  # two ranks on one node (shared memory)
    inter: Link  # two nodes (NIC + switch); flows leaving one node in the same round share it
    gamma: float = 0.0  # seconds per byte to add two buffers (0: folded into beta by the fit)
    algorithm: str = "mpich"  # one of ALGORITHMS
    short_msg_bytes: int = 2048  # "mpich": recursive doubling up to this size, Rabenseifner above
    backward_fraction: float = BACKWARD_FRACTION
    overlap: float = 1.0  # fraction of the remaining backward that can hide posted buckets
    # share of its own rate that an Allreduce across nodes keeps while the ranks compute backward (the
    # CPU the kernel's TCP and the MPI progress get then; measured by pilab.bench.wire's probe: 0.4-1.0
    # on the testbed); 1: full rate, as the model assumed before
    overlap_rate: float = 1.0
    gamma_fp16: float = 0.0  # seconds per byte of an fp16 Allreduce beyond moving it (MPICH's software sum)
    oversub_alpha: float = 0.0  # extra s per Allreduce round when a node has more ranks than cores
    available_cores: float = 0.0  # cores one job gets per node on a shared machine (0: all of them)
    flops_per_activation: float = 0.0  # memory-bound cost per activation element (0: FLOPs only)
    step_work_per_tensor: float = 0.0  # per-step work independent of the batch, per parameter tensor
    # each node's speed as a multiple of the rates above, in hostfile order (a mixed or hot cluster: a Pi 5
    # beside Pi 4Bs, a throttled board); every per-rank cost on that node (compute, data, overhead) is
    # divided by it. Empty: every node runs at the rates above
    node_speeds: tuple = ()
    notes: str = ""

    def __post_init__(self):
        for name in _POSITIVE + _NON_NEGATIVE:
            v = getattr(self, name)
            least = "> 0" if name in _POSITIVE else ">= 0"
            ok = isinstance(v, (int, float)) and (v > 0 if name in _POSITIVE else v >= 0)
            if not ok:
                raise ConfigError(f"cluster {self.name!r}: {name}={v!r} must be {least}")
        fractions = {k: getattr(self, k) for k in ("backward_fraction", "overlap", "overlap_rate")}
        bad = {k: v for k, v in fractions.items() if not 0 <= v <= 1}
        if bad:
            raise ConfigError(f"cluster {self.name!r}: " + ", ".join(f"{k}={v}" for k, v in bad.items())
                              + " must be a fraction in [0, 1]")
        speeds = tuple(self.node_speeds)
        object.__setattr__(self, "node_speeds", speeds)
        if any(not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)) for v in speeds):
            raise ConfigError(f"cluster {self.name!r}: node_speeds={speeds!r} must all be numbers > 0")
        if speeds and self.nodes != len(speeds):
            raise ConfigError(f"cluster {self.name!r}: {len(speeds)} node_speeds for nodes={self.nodes}; "
                              "give one speed per node")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"cluster {self.name!r}: algorithm={self.algorithm!r}; choose one of "
                              f"{', '.join(ALGORITHMS)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Cluster":
        d = dict(d)
        d["intra"] = Link(**d["intra"])
        d["inter"] = Link(**d["inter"])
        return cls(**d)

    def node_of(self, rank: int, np_: int) -> int:
        rpn = self.ranks_per_node or np_
        return rank // rpn

    def rank_speeds(self, np_: int) -> list[float] | None:
        """Each of ``np_`` ranks' speed (its node's, block placement), None when every node runs at
        the cluster's rates::

            resolve_cluster("pi4b:1,pi5:1").rank_speeds(4)      # [1.0, 1.0, 2.5, 2.5]
        """
        if not self.node_speeds:
            return None
        return [float(self.node_speeds[self.node_of(r, np_)]) for r in range(np_)]
