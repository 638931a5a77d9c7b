"""One synchronous step on the wire: every rank of a job on a testbed node runs this module,
and the contenders take turns, round by round, each on its own copy of the model, the same batches::

    mpiexec -hosts 10.84.0.11:1,10.84.0.12:1 ... python -m pilab.bench.wire OUT.json --master 10.84.0.11

* ``ceiling``: forward, backward, optimizer -- no exchange at all (also times the forward alone);
* ``pilab``: the engine's step (GradSync, default 1 MiB buckets posted during backward);
* ``pilab_fp16``: the same with fp16 compression (half the bytes);
* ``pilab_one_bucket``: one 64 MiB bucket, posted when backward ends (no overlap);
* ``ddp_gloo``: PyTorch DDP over gloo with its defaults (25 MiB buckets), BatchNorm buffers per rank as
  in pilab; ``ddp_gloo_1mb``: DDP with 1 MiB buckets, so the comparison is not only bucket size.

Beside them, not a contender, **the probe** measures two properties of the testbed's nodes that the
performance model takes as given (``perfmodel.Cluster.overlap_rate`` and ``gamma_fp16``): one Allreduce
alone, the same posted as backward starts (polled from the gradient hooks as GradSync polls) -- how much
of it moves while backward computes, as a share of its rate alone -- and the same elements in fp16 alone
(MPICH's software half-precision sum, per byte beyond the transfer). Its message is the gradient's bytes,
or up to 8x that where backward would hide all of it at full speed (then the rate is only bounded).

``pilab.bench.network`` launches it on its testbed (gloo's rendezvous at ``--master``, node01's address
on the testbed, its sockets on the nodes' ``eth0``) and adds the physical bound from the measured link
rate. Each contender's step per round is the slowest rank's median of ``--repeat`` steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from .. import engine
from ..config import Config
from ..dist import fp16_type, wait_polling
from ..engine import build_optimizer
from ..launch import mpi
from .stats import nap_barrier, ratios, slowest, summary

MPI = mpi()  # this module runs on the ranks of a launched job only
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
PORT = 29471  # gloo's rendezvous on the testbed's own addresses (nothing else listens there)
CONTENDERS = ("ceiling", "pilab", "pilab_fp16", "pilab_one_bucket", "ddp_gloo", "ddp_gloo_1mb")
PROBE_MAX_FACTOR = 8  # the probe's message: up to 8x the gradient's bytes (see run)
POLL_EVERY = 1  # the probe polls from every gradient hook, as GradSync does by default


class Probe:
    """The transfer's progress while backward computes, and fp16's reduction cost (see the module's
    docstring): ``alone()``, ``busy(x, y)`` and ``alone16()`` each return seconds on this rank."""

    def __init__(self, model, nbytes: int):
        self.model = model
        self.half = fp16_type()
        self.resize(nbytes)
        self.req, self.hooked = None, 0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._on_grad)

    def resize(self, nbytes: int):
        self.nbytes = nbytes
        self.buf = np.ones(nbytes // 4, dtype=np.float32)
        self.out = np.empty_like(self.buf)
        self.buf16 = self.buf.astype(np.float16)
        self.out16 = np.empty_like(self.buf16)

    def _on_grad(self, _p):
        self.hooked += 1
        if self.req is not None and self.hooked % POLL_EVERY == 0:
            self.req.Test()

    def alone(self) -> float:
        t = time.perf_counter()
        wait_polling([COMM.Iallreduce(self.buf, self.out)])
        return time.perf_counter() - t

    def alone16(self) -> float | None:
        if self.half is None:
            return None
        t = time.perf_counter()
        wait_polling([COMM.Iallreduce([self.buf16, self.half], [self.out16, self.half])])
        return time.perf_counter() - t

    def busy(self, x, y) -> tuple[float, float]:
        """(backward's seconds with the Allreduce posted at its start, the wait after it)."""
        self.model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.model(x), y)
        t0 = time.perf_counter()
        self.req = req = COMM.Iallreduce(self.buf, self.out)
        loss.backward()
        t1 = time.perf_counter()
        wait_polling([req])
        self.req = None
        return t1 - t0, time.perf_counter() - t1


def probe_figures(alone, busy, alone16, nbytes: int) -> dict:
    """The probe's figures from one round's medians on this rank, the slowest rank's where they differ:
    overlap_rate = (alone - tail) / backward, the share of its rate alone that the transfer kept while
    backward ran (1: all of it; ``saturated`` when nothing was left after backward, so it is a lower
    bound), and gamma_fp16 = (alone16 - alone / 2) / (nbytes / 2): seconds per fp16 byte beyond moving it."""
    a = slowest(float(np.median(alone)))
    bwd = float(np.median([b for b, _ in busy]))
    tail = float(np.median([w for _, w in busy]))
    rate = COMM.allreduce(min(1.0, max(0.0, (a - tail) / bwd)) if bwd > 0 else 1.0, op=MPI.MIN)
    out = {"alone_s": a, "backward_s": slowest(bwd), "tail_s": slowest(tail), "overlap_rate": rate,
           "saturated": bool(COMM.allreduce(tail < 2e-3, op=MPI.LAND))}
    if alone16:
        a16 = slowest(float(np.median(alone16)))
        out.update(alone16_s=a16, gamma_fp16=max(0.0, (a16 - a / 2) / (nbytes / 2)))
    return out


def run(cfg: Config, rounds: int, repeat: int, master: str) -> dict:
    """The contenders' step times (slowest rank per round) and their per-round ratios to the ceiling."""
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(PORT))
    tdist.init_process_group("gloo", rank=RANK, world_size=SIZE)
    ds = engine.load_data(cfg, COMM)
    sessions = {"pilab": engine.Session(cfg, engine.MPIRanks(COMM), data=ds),
                "pilab_fp16": engine.Session(Config(**{**cfg.to_dict(), "compression": "fp16"}),
                                             engine.MPIRanks(COMM), data=ds),
                "pilab_one_bucket": engine.Session(Config(**{**cfg.to_dict(), "bucket_mb": 64.0}),
                                                   engine.MPIRanks(COMM), data=ds)}
    steps, batch, forward, model = _contenders(cfg, sessions)
    n_params = sum(p.numel() for p in sessions["pilab"].model.parameters() if p.requires_grad)
    probe = Probe(model(), 4 * n_params)
    timings, probes = _rounds(steps, probe, batch, rounds, repeat, n_params)
    for s in sessions.values():
        s.ranks.close()
    tdist.destroy_process_group()
    fwd = slowest(float(np.median(forward[repeat:] or forward)))
    return {"np": SIZE, "model": cfg.model, "width": cfg.width, "per_rank_batch": cfg.batch_size,
            "threads": cfg.threads, "rounds": rounds, "steps_per_round": repeat, "params": n_params,
            "gradient_bytes": 4 * n_params, "forward_s": fwd,
            "step_s": {k: summary(v) for k, v in timings.items()},
            "over_ceiling": {k: summary(ratios(timings, k, "ceiling")) for k in CONTENDERS},
            "pilab_over_ddp": summary(ratios(timings, "pilab", "ddp_gloo")),
            "probe_bytes": probe.nbytes,
            "probe": {k: float(np.median([p[k] for p in probes])) for k in probes[0]
                      if k != "saturated"} | {"saturated": sum(p["saturated"] for p in probes)},
            "probe_rounds": probes, "raw": timings}


def _contenders(cfg: Config, sessions: dict):
    """(name -> one step, the shared batch source, the ceiling's forward times, a fresh seeded model)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = sessions["pilab"]
    loader, spe = base.ranks.loader, base.steps_per_epoch
    counter = {"k": 0}

    def batch():
        k = counter["k"]
        counter["k"] += 1
        return loader.batch(*divmod(k % spe, spe))

    forward = []

    def plain(model, opt, timed=False):
        def step():
            x, y = batch()
            opt.zero_grad(set_to_none=False)
            t = time.perf_counter()
            out = model(x)
            loss = F.cross_entropy(out, y)
            if timed:
                forward.append(time.perf_counter() - t)
            loss.backward()
            opt.step()
            (out.argmax(1) == y).sum().item()
        return step

    def model():
        torch.manual_seed(cfg.seed)
        return engine.base_model(cfg, torch.device("cpu"))

    def engine_step(session):
        def step():
            k = counter["k"]
            counter["k"] += 1
            session.step(*divmod(k % spe, spe))
        return step
    steps = {}
    m = model()
    steps["ceiling"] = plain(m, build_optimizer(m, cfg, 0.01), timed=True)
    for key, s in sessions.items():
        steps[key] = engine_step(s)
    with warnings.catch_warnings():  # broadcast_buffers=False: BN statistics stay per rank, as in pilab
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DDP(model(), broadcast_buffers=False)
        ddp1 = DDP(model(), broadcast_buffers=False, bucket_cap_mb=1)
    steps["ddp_gloo"] = plain(ddp, build_optimizer(ddp.module, cfg, 0.01))
    steps["ddp_gloo_1mb"] = plain(ddp1, build_optimizer(ddp1.module, cfg, 0.01))
    return steps, batch, forward, model


def _rounds(steps: dict, probe, batch, rounds: int, repeat: int, n_params: int) -> tuple[dict, list]:
    """The contenders alternated round by round, then the probe once a round (round -1: the warm-up)."""
    timings = {k: [] for k in CONTENDERS}
    probes = []
    for r in range(-1, rounds):  # round -1: the warm-up, not kept
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
        for k in order:
            nap_barrier()
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                steps[k]()
                ts.append(time.perf_counter() - t)
            if r >= 0:
                timings[k].append(slowest(float(np.median(ts))))
        nap_barrier()  # the probe, once per round after the contenders
        alone, busy, alone16 = [], [], []
        for _ in range(repeat):
            alone.append(probe.alone())
            busy.append(probe.busy(*batch()))
            alone16.append(probe.alone16())
        if r >= 0:
            probes.append(probe_figures(alone, busy, None if None in alone16 else alone16, probe.nbytes))
        else:  # after the warm-up: a message big enough that backward cannot hide it all at full speed
            # (else the probe only bounds the rate from below); the same factor on every rank
            a, b = slowest(float(np.median(alone))), slowest(float(np.median([x for x, _ in busy])))
            probe.resize(4 * n_params * min(PROBE_MAX_FACTOR, max(1, math.ceil(2 * b / a))))
    return timings, probes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one synchronous step on the wire, contenders alternated (mpiexec)")
    p.add_argument("out")
    p.add_argument("--master", required=True, help="rank 0's address on the testbed (gloo's rendezvous)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    # the setting: torchvision-layout MobileNetV2 1.0, 64 images per rank, one thread
    cfg = Config(model="mobilenetv2", width=0.25 if a.quick else 1.0, batch_size=16 if a.quick else 64,
                 threads=1, train_subset=1024 if a.quick else 4096, test_subset=100, straggler_threshold=0)
    res = run(cfg, 2 if a.quick else a.rounds, 2, a.master)
    if RANK == 0:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
