"""The fast simulator's per-rank BatchNorm on large layers as ``torch.compile``'s fused kernels.

The fast mode normalises every virtual rank's images in one vectorised pass (``layers.GroupedBN``): the
same mathematics as one BatchNorm per rank, but four passes over the activations each way where native
BatchNorm makes one or two, which is the whole of its excess over one process training the global batch
at MobileNetV2-CIFAR 1.0 (the simulator section of benchmarks/LOG.md). Given to ``torch.compile`` as plain
tensor operations (``layers.grouped_bn``), inductor fuses them into C++ kernels that take 11-15% off a step there;
on small layers (under ``MIN_ELEMENTS`` activations: 4-image batches at width 0.25) a compiled call costs
more than it saves, so those stay eager. Compiling takes 10-45 s (one kernel per layer shape, in the
first steps) and needs a C++ compiler, so ``compile_bn=auto`` turns it on only for CPU runs of
``modepick.MIN_STEPS`` steps or more, after a probe (one small layer compiled forward and backward); where
the probe fails, the run goes on eager and result.json says why. It is the loop component ``CompiledBN``
(``pilab.component``); result.json gets ``compile_bn_used`` (True, or the reason it is not)::

    python -m pilab simulate --np 48 --epochs 10                     # auto: "compile_bn_used": true
    python -m pilab simulate --np 48 --epochs 1 --compile-bn off     # always eager

The same mathematics to float rounding (tests/test_performance.py holds it to the fast mode's bound
against the exact mode), so a run's ``simulate_mode_used`` stays a setting a rerun can give.
"""
from __future__ import annotations

import sys

import torch

from ..component import Component, Stage
from .modepick import MIN_STEPS

# Activations of a layer (N*C*H*W) from which its BatchNorm runs compiled: below it the eager form was
# as fast (MobileNetV2-CIFAR 0.25 at 4 x 8, 32 images: 1.42x the global batch compiled vs 1.38x eager when
# this was set; 5 of its 52 layers reach 1M, 30 at 4 x 48)
MIN_ELEMENTS = 1 << 20


def probe() -> str:
    """'' where ``torch.compile`` builds and runs ``layers.grouped_bn`` forward and backward here, else
    why not, in one line (a missing C++ compiler, a torch built without inductor)."""
    from .layers import compiled_grouped_bn
    try:
        # its own generator: the probe runs after the run is seeded and must not move the run's random stream
        x = torch.randn(4, 8, 4, 4, generator=torch.Generator().manual_seed(0))
        x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
        y, _, _ = compiled_grouped_bn()(x, w, b, 2, 1e-5)
        y.sum().backward()
        return ""
    except Exception as e:  # noqa: BLE001 -- any failure to compile means: run eager, and say why
        # the first sentence of inductor's message (it goes on about debugging flags)
        line = " ".join(str(e).split()).split(" Set TORCHDYNAMO_VERBOSE")[0][:200] or type(e).__name__
        return f"torch.compile failed ({type(e).__name__}: {line}); set CXX to a C++ compiler, or compile_bn=off"


def why_not(cfg, device, total_steps: int) -> str:
    """Why this run does not compile ('' when it does, before the probe)::

        why_not(Config(), torch.device("cpu"), 320)      # ''
        why_not(Config(), torch.device("cpu"), 12)       # '12 steps < 200: compiling would not pay'
    """
    if cfg.compile_bn == "off":
        return "compile_bn=off"
    if cfg.compile_bn == "auto" and device.type != "cpu":
        return "auto compiles on a CPU only (measured there)"
    if cfg.compile_bn == "auto" and total_steps < MIN_STEPS:
        return f"{total_steps} steps < {MIN_STEPS}: compiling would not pay"
    return ""


class CompiledBN(Component):
    """``compile_bn`` on the simulator's fast mode (or ``auto``, which may run fast): decides at the
    start, before ``ModePick``'s trial times the fast mode, so the trial times what the run would run."""

    name = "compile_bn"
    stage = Stage.COMPILE

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return bool(getattr(ranks, "simulated", False)) and cfg.simulate_mode != "exact" \
            and getattr(ranks, "np_", 1) > 1

    def __init__(self, cfg, ranks):
        super().__init__(cfg, ranks)
        self.used: bool | str = False

    def start(self, session) -> None:
        done = session.epoch_start[session.start_epoch] + session.start_step
        why = why_not(session.cfg, session.device, session.total_steps - done)
        if not why:
            why = probe()
            if why:  # the user asked for it, or auto expected it: say once why the run is slower than it could be
                print(f"pilab: {why}: the run goes on with the eager BatchNorm", file=sys.stderr, flush=True)
        session.ranks.context.compiled_from = None if why else MIN_ELEMENTS
        self.used = why or True

    def result(self) -> dict:
        return {"compile_bn_used": self.used}
