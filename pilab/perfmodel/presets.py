"""Machine presets, and the facts of the original Raspberry Pi study in one place.

    from pilab.perfmodel import presets
    presets.pi4b_cluster(train_gflops=3.0)         # the Pi cluster with one assumption changed
    presets.resolve_cluster("pi4b_cluster")        # a name, a Cluster/Calibration or its JSON path
    presets.resolve_cluster("pi4b:12,pi5:12")      # a mixed cluster: 12 Pi 4B, then 12 Pi 5 (BOARDS)
    presets.pi_config(epochs=1)                    # the study's training setting
    presets.published_table()                      # its three published figures, completed

The study: MobileNetV2 on CIFAR-10, 24 Raspberry Pi 4B nodes x 2 MPI ranks, 1 GbE, against a
one-node baseline of p0 = 2 processes. The PI_* constants are its facts (``pilab.study``'s Pi study
preset uses them too); the rates in ``pi4b_cluster`` are assumptions stated in docs/perfmodel.md.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Mapping

from ..config import Config, ConfigError
from ..files import load_json
from .calibrate import Calibration, this_box
from .machine import Cluster, Link
from .metrics import efficiency, karp_flatt

PI_NODES = 24  # Raspberry Pi 4B boards
PI_RANKS_PER_NODE = 2  # MPI ranks per board
PI_CORES_PER_NODE = 4  # Cortex-A72 cores per board
PI_THREADS_PER_RANK = 2  # torch threads per rank: 2 ranks x 2 threads fill a board
PI_GBE_GOODPUT = 117e6  # bytes/s of TCP payload on the boards' 1 GbE (one NIC shared by both ranks)
PI_BASELINE_NP = 2  # p0 of the published speedups and efficiencies: one board, both ranks
PI_STUDY_NPS = (2, 4, 8, 16, 32, 48)  # process counts of the Pi study preset (`pilab scale`)
PI_TABLE_NPS = (2, 4, 8, 16, 24, 32, 48)  # the model's Pi table: the study's counts and 12 boards

# Only these three figures were published.
PUBLISHED = {
    "baseline_np": PI_BASELINE_NP,
    "rows": [
        {"np": 4, "efficiency": 0.909},
        {"np": 8, "efficiency": 0.523},
        {"np": 48, "speedup": 9.99, "efficiency": 0.416},
    ],
}


def published_table() -> list[dict]:
    """The published figures, each completed with E = S * p0 / p (or S = E * p / p0) and Karp-Flatt."""
    p0 = PUBLISHED["baseline_np"]
    out = []
    for row in PUBLISHED["rows"]:
        p = row["np"]
        S = row.get("speedup")
        E = row.get("efficiency")
        if S is None:
            S = E * p / p0
        computed_E = efficiency(S, p, p0)
        out.append({"np": p, "speedup": S, "efficiency": E if E is not None else computed_E,
                    "efficiency_from_speedup": computed_E, "karp_flatt": karp_flatt(S, p, p0),
                    "speedup_published": "speedup" in row})
    return out


def pi4b_cluster(**overrides) -> Cluster:
    """The study's cluster: 24 Raspberry Pi 4B nodes x 2 ranks (2 threads each; the PI_* constants),
    one shared 1 GbE NIC per node.

    Every number is an assumption stated in docs/perfmodel.md, none fitted to the published figures;
    override any of them: ``pi4b_cluster(train_gflops=3.0)``.
    """
    base = dict(
        name="pi4b_cluster", nodes=PI_NODES, ranks_per_node=PI_RANKS_PER_NODE,
        cores_per_node=PI_CORES_PER_NODE, ref_threads=PI_THREADS_PER_RANK,
        # Cortex-A72 @ 1.5 GHz: 8 fp32 FLOP/cycle/core nominal -> 24 GFLOP/s for two cores. PyTorch's
        # training step of MobileNetV2 on 32x32 images is dominated by memory-bound depthwise convs,
        # BN and ReLU6; assume ~6% of nominal (this x86 box reaches ~10% of its own nominal peak on
        # the same step, and the Pi's LPDDR4 is relatively weaker).
        train_gflops=1.5,
        eval_gflops=2.0,  # inference at batch 500: no backward, larger GEMMs, a little better
        data_s_per_image=2e-4,  # batched crop/flip/normalise, ~5x this box's per-image cost
        step_overhead_s=2e-3,  # Python per step, ~10x this box
        warmup_s=0.5,
        compute_cv=0.03,  # OS jitter, thermal throttling under a fan
        intra=Link(alpha=2e-6, beta=1 / 1.5e9),  # shared memory: ~2 us, ~1.5 GB/s effective copy
        inter=Link(alpha=75e-6, beta=1 / PI_GBE_GOODPUT),  # TCP through a switch: 50-100 us latency
        gamma=1 / 1.5e9,  # summing float32 buffers, memory bound: ~1.5 GB/s of output
        algorithm="mpich", short_msg_bytes=2048,  # Raspberry Pi OS's MPICH 3.x defaults
        notes="assumptions, not fits: see docs/perfmodel.md",
    )
    base.update(overrides)
    return Cluster(**base)


def relinked(cluster: Cluster, *, alpha: float | None = None, mbps: float | None = None) -> Cluster:
    """``cluster`` with its inter-node latency (seconds per message) and/or bandwidth (MB/s) replaced,
    e.g. by the ones measured across two nodes: ``relinked(pi4b_cluster(), alpha=150e-6)``."""
    return replace(cluster, inter=Link(cluster.inter.alpha if alpha is None else alpha,
                                       cluster.inter.beta if mbps is None else 1 / (mbps * 1e6)))


# Each board's speed on pilab's training step as a multiple of the Pi 4B at 1.5 GHz (pi4b_cluster's rates).
# Estimates, not measurements of this step: no one has run it on these boards here. What they rest on:
# - pi5 (BCM2712, 4x Cortex-A76 @ 2.4 GHz, LPDDR4X-4267): HPL 30.2 Gflops at launch, 35.2 on the 8 GB board
#   and 37.9 on the 16 GB one (github.com/geerlingguy/top500-benchmark, issues 18 and 51, and its README's
#   table), against 11.4 for a CM4 at 1.5 GHz and 11.9 for a Pi 4B at 1.8 GHz: 2.6-3.3x
#   on dense FP64 matrix work; sysbench's one-core prime search 2737 against 1478 events/s, 1.85x
#   (leoncode.co.uk/articles/raspberry-pi-benchmarks); Raspberry Pi's own launch claim, 2-3x the CPU
#   performance of a Pi 4. MobileNetV2's step is mostly memory-bound depthwise convolutions, BatchNorm and
#   ReLU6, between those two kinds of work: 2.5x, inside both 1.85-3.3 and Raspberry Pi's 2-3x.
# - pi4b_1250: the "1.25 GHz edition" of the Pi 4B sold in 2026 (github.com/geerlingguy/sbc-reviews
#   issue 110, sbc-bench's report in github.com/ThomasKaiser/sbc-bench issue 136: cpufreq at 1250 MHz, a
#   BCM2711 B0 like the 1.5 GHz board, nothing on the board tells them apart). The same core and memory
#   at 1250/1500 of the clock: 0.83x, an upper bound on the slowdown, since the memory-bound part of the
#   step does not slow with the core's clock.
BOARDS = {"pi4b": 1.0, "pi4b_1250": 1250 / 1500, "pi5": 2.5}


def mixed_cluster(spec: str, *, name: str | None = None, **overrides) -> Cluster:
    """A Pi cluster of several boards from ``"BOARD:NODES,..."`` (boards of ``BOARDS``), nodes in that
    order (the hostfile's: rank 0 on the first), 2 ranks a node, each node at its board's speed
    (``Cluster.node_speeds``) over pi4b_cluster's rates; ``overrides`` as for ``pi4b_cluster``::

        mixed_cluster("pi4b:12,pi5:12")          # 12 Pi 4B, then 12 Pi 5
        mixed_cluster("pi4b:23,pi4b_1250:1")     # one 1.25 GHz board among the 1.5 GHz ones
    """
    speeds: list[float] = []
    for part in spec.split(","):
        board, _, count = part.strip().partition(":")
        if board not in BOARDS or not count.strip().isdigit() or int(count) < 1:
            raise ConfigError(f"cluster {spec!r}: {part.strip()!r} is not BOARD:NODES with BOARD one of "
                              f"{', '.join(BOARDS)} (e.g. pi4b:12,pi5:12)")
        speeds += [BOARDS[board]] * int(count)
    return pi4b_cluster(**{"name": name or spec, "nodes": len(speeds), "node_speeds": tuple(speeds),
                           "notes": "board speeds are estimates: see pilab/perfmodel/presets.py", **overrides})


def is_board_spec(spec) -> bool:
    """Whether ``spec`` is meant as a ``mixed_cluster`` spec ("pi4b:12,pi5:12"): BOARD:NODES parts, not a
    file (``mixed_cluster`` says what is wrong with one)."""
    return isinstance(spec, str) and ":" in spec and not os.path.isfile(spec)


def is_pi_cluster(spec) -> bool:
    """Whether ``spec`` names a Pi cluster: a preset name or a mixed cluster's boards."""
    return isinstance(spec, str) and (spec in PRESETS or is_board_spec(spec))


PRESETS = {"pi4b_cluster": pi4b_cluster,
           "pi5_cluster": lambda: mixed_cluster(f"pi5:{PI_NODES}", name="pi5_cluster"),
           "pi4b_1250_cluster": lambda: mixed_cluster(f"pi4b_1250:{PI_NODES}", name="pi4b_1250_cluster")}


def resolve_cluster(spec) -> Cluster:
    """A Cluster from a Cluster, a Calibration, a preset name, or a dict/JSON path of either."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Calibration):
        return this_box(spec)
    if isinstance(spec, str):
        if spec in PRESETS:
            return PRESETS[spec]()
        if is_board_spec(spec):
            return mixed_cluster(spec)
        if spec == "this_box":
            raise ConfigError("preset this_box needs a calibration: pass a Calibration or its JSON path")
        if not os.path.isfile(spec):
            raise ConfigError(f"unknown preset {spec!r}; choose one of {', '.join(PRESETS)}, boards "
                              f"BOARD:NODES,... of {', '.join(BOARDS)} (e.g. pi4b:12,pi5:12), this_box (with a "
                              "calibration), or a JSON file")
        try:
            path, spec = spec, load_json(spec)
        except ValueError as e:  # not JSON
            raise ConfigError(f"{spec} is not a JSON file ({e})") from None
    else:
        path = "the dict"
    if isinstance(spec, Mapping):
        try:
            if "compute_s_per_image" in spec:
                return this_box(Calibration.from_dict(spec))
            return Cluster.from_dict(spec)
        except (KeyError, TypeError) as e:  # missing or unknown fields: name the file, not a traceback
            why = f"no field {e}" if isinstance(e, KeyError) else str(e)
            raise ConfigError(f"{path} is neither a Cluster nor a Calibration ({why})") from None
    raise TypeError(f"cannot make a Cluster from {type(spec).__name__}")


def pi_config(**overrides) -> Config:
    """The study's setting: MobileNetV2-CIFAR width 1.0, full CIFAR-10, 32 images per rank.

        pi_config(epochs=1, width=0.5)
    """
    return Config(**{"data": "cifar10", "width": 1.0, "batch_size": 32, **overrides})
