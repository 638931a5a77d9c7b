"""BatchNorm per group of images (the fast simulator's per-rank BatchNorm, issue 42) in three eager forms,
forward + backward, against native BatchNorm on the whole batch (the bound: one process on the global
batch). Alternated rounds; the ratio per round by the process's CPU time and by wall time, median
(p10-p90) -- on a quiet machine (a loaded one inflates both: OpenMP threads spin waiting for a core)::

    python scripts/grouped_bn_forms.py --threads 2 --rounds 9
    python scripts/grouped_bn_forms.py --threads 2 --rounds 9 --compiled       # ... and torch.compile's form
    python scripts/grouped_bn_forms.py --threads 2 --rounds 5 --end-to-end     # fast-mode steps, eager vs compiled

Forms: ``grouped`` is pilab's ``layers.GroupedBN`` (batched mean, centred copy, batched dot, fused
scale-and-shift); ``var_mean`` takes one Welford pass (``torch.var_mean`` over each group) and keeps the input
instead of the centred copy; ``native_t`` copies the batch into a (rows, groups x channels) layout so that
one native BatchNorm call normalises every group, and copies back; ``compiled`` is the same mathematics as
plain tensor operations given to ``torch.compile`` (``layers.compiled_grouped_bn``: inductor's C++ kernels,
one compilation per shape; it needs a C++ compiler). The shapes are MobileNetV2-CIFAR layers at 32 images x 8 ranks (width 1.0) and at
32 x 48 (width 0.25).

``--end-to-end`` times whole steps of the fast simulator with ``compile_bn=off`` (every layer ``GroupedBN``) and
``compile_bn=on`` (pilab.engine.compilebn: the compiled form on layers of 1M+ activations), each against one
process training the global batch, alternated: what the per-layer figures are worth in a step.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pilab.bench.stats import alternate_clocks, ratios, summary
from pilab.engine.layers import GroupedBN, compiled_grouped_bn
from pilab import engine

EPS = 1e-5


class _VarMeanBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups: int):
        c = x.shape[1]
        xv = x.permute(0, 2, 3, 1).reshape(groups, -1, c)  # channels-last: a view
        var, mean = torch.var_mean(xv, dim=1, correction=0)
        invstd = torch.rsqrt(var + EPS)
        scale = invstd * weight
        y = torch.empty_like(x, memory_format=torch.channels_last)
        torch.addcmul((bias - mean * scale)[:, None], xv, scale[:, None],
                      out=y.permute(0, 2, 3, 1).view(xv.shape))
        ctx.save_for_backward(x, mean, invstd, scale)
        ctx.groups = groups
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mean, invstd, scale = ctx.saved_tensors
        c = x.shape[1]
        xv = x.permute(0, 2, 3, 1).reshape(ctx.groups, -1, c)
        m = xv.shape[1]
        dyv = dy.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(xv.shape)
        sdy = dyv.sum(1)
        sdxc = torch.linalg.vecdot(dyv, xv, dim=1) - mean * sdy
        k_xc = (scale * invstd * invstd * sdxc).div_(-m)
        k_0 = (scale * sdy).div_(-m) - mean * k_xc
        dx = torch.empty_like(dy, memory_format=torch.channels_last)
        torch.addcmul(k_0[:, None], xv, k_xc[:, None], out=dx.permute(0, 2, 3, 1).view(xv.shape))
        dx.permute(0, 2, 3, 1).view(xv.shape).addcmul_(dyv, scale[:, None])
        return dx, (sdxc * invstd).sum(0), sdy.sum(0), None


def forms(x, dy, weight, bias, groups: int, with_compiled: bool = False) -> dict:
    def run(bn):
        def call():
            xx = x.detach().requires_grad_()
            bn(xx).backward(dy)
        return call

    def native_t(xx):
        n, c, h, w = xx.shape
        rows = xx.permute(0, 2, 3, 1).reshape(groups, -1, c).transpose(0, 1).reshape(-1, groups * c)
        z = F.batch_norm(rows, None, None, weight.repeat(groups), bias.repeat(groups), True, 0.1, EPS)
        return z.view(-1, groups, c).transpose(0, 1).reshape(n, h, w, c).permute(0, 3, 1, 2)

    out = {"native": run(lambda xx: F.batch_norm(xx, None, None, weight, bias, True, 0.1, EPS)),
           "grouped": run(lambda xx: GroupedBN.apply(xx, weight, bias, groups, EPS)[0]),
           "var_mean": run(lambda xx: _VarMeanBN.apply(xx, weight, bias, groups)),
           "native_t": run(native_t)}
    if with_compiled:
        out["compiled"] = run(lambda xx: compiled_grouped_bn()(xx, weight, bias, groups, EPS)[0])
        out["compiled"]()  # compiled outside the timed rounds
    return out


def end_to_end(rounds: int, threads: int) -> None:
    """Fast-mode steps with the eager BatchNorm (``compile_bn=off``: "fast") and compiled where pilab
    compiles it (``compile_bn=on``: layers of ``compilebn.MIN_ELEMENTS`` activations or more), each
    against one process on the global batch ("global"), alternated rounds."""
    from dataclasses import replace

    from pilab.bench.local import stepper
    from pilab.bench.stats import alternate_clocks as clocks_of
    from pilab.config import Config
    from pilab.data import load

    ds = load("embedded")
    for model, width, b, np_ in (("mobilenetv2_cifar", 1.0, 32, 8), ("mobilenetv2_cifar", 1.0, 4, 48),
                                 ("mobilenetv2_cifar", 0.25, 4, 8), ("mobilenetv2_cifar", 0.25, 32, 48)):
        cfg = Config(model=model, width=width, batch_size=b, threads=threads, epochs=100, test_subset=10,
                     simulate_mode="fast")
        t0 = time.perf_counter()
        sessions = {"global": engine.Session(replace(cfg, batch_size=np_ * b), engine.MPIRanks(None), data=ds),
                    "fast": engine.Session(replace(cfg, compile_bn="off"), engine.VirtualRanks(np_), data=ds),
                    "compiled": engine.Session(replace(cfg, compile_bn="on"), engine.VirtualRanks(np_), data=ds)}
        steps = {m: stepper(s) for m, s in sessions.items()}
        steps["compiled"](), steps["compiled"]()  # compiles every layer's shape outside the timed rounds
        warm = time.perf_counter() - t0
        clocks = clocks_of(steps, rounds)
        cells = []
        for m in ("fast", "compiled"):
            cpu, wall = (summary(ratios(clocks[c], m, "global")) for c in ("cpu", "wall"))
            cells.append(f"{m} {cpu['median']:.2f} ({cpu['p10']:.2f}-{cpu['p90']:.2f}), wall {wall['median']:.2f}")
        print(f"{model} {width} {b} x {np_}: global {summary(clocks['wall']['global'])['median']:.3f} s wall; "
              f"ratio to global by CPU (p10-p90), by wall: {'; '.join(cells)}; set-up with compiling {warm:.0f} s",
              flush=True)
        del sessions


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--compiled", action="store_true", help="add torch.compile's form (needs a C++ compiler)")
    p.add_argument("--end-to-end", action="store_true", help="time fast-mode steps, eager vs compiled")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.end_to_end:
        return end_to_end(a.rounds, a.threads)
    # (images, channels, side, groups)
    for n, c, side, groups in ((256, 96, 16, 8), (256, 144, 8, 8), (256, 32, 32, 8), (1536, 16, 32, 48)):
        x = (torch.randn(n, c, side, side) * 2 + 0.5).contiguous(memory_format=torch.channels_last)
        dy = torch.randn_like(x)
        weight, bias = (torch.rand(c) + 0.5).requires_grad_(), torch.randn(c).requires_grad_()
        clocks = alternate_clocks(forms(x, dy, weight, bias, groups, a.compiled), a.rounds, repeat=3)
        cells = []
        for form in ("grouped", "var_mean", "native_t") + (("compiled",) if a.compiled else ()):
            cpu, wall = (summary(ratios(clocks[k], form, "native")) for k in ("cpu", "wall"))
            cells.append(f"{form} {cpu['median']:.2f} ({cpu['p10']:.2f}-{cpu['p90']:.2f}), wall {wall['median']:.2f}")
        native_ms = summary(clocks["wall"]["native"])["median"] * 1e3
        print(f"{n} x {c} x {side}x{side}, {groups} groups: native {native_ms:.1f} ms wall; ratio to native by CPU "
              "(p10-p90), by wall: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
