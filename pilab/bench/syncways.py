"""The ways to average one step's gradients, against each other (``pilab.bench.mpijobs --sections sync``): per-tensor
and fused blocking Allreduce, GradSync, GradSync with fp16 compression, and GradSync under MPICH's async
progress thread::

    mpiexec -n 2 python -m pilab.bench.mpijobs OUT.json --sections sync
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from ..config import Config
from ..dist import GradSync
from .job import COMM, MPI, RANK, SIZE, _model, nap_barrier, slowest
from .stats import summary


# Ways to average one step's gradients: each is made for its own model and, called after backward,
# returns (messages, bytes sent[, exposed seconds as GradSync measures them]).
def _per_tensor(model, cfg):
    params = list(model.parameters())
    nbytes = 4 * sum(p.numel() for p in params)

    def average():
        for p in params:
            buf = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            COMM.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
            buf.div_(SIZE)
            if buf is not p.grad:
                p.grad.copy_(buf)
        return len(params), nbytes
    return average


def _fused(model, cfg):
    params = list(model.parameters())

    def average():
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        COMM.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
        flat.div_(SIZE)
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()
        return 1, 4 * flat.numel()
    return average


def _gradsync(**kw):
    def make(model, cfg):
        gs = GradSync(model, COMM, bucket_mb=cfg.bucket_mb, **kw)

        def average():
            st = gs.finish()
            return st.messages, st.bytes_sent, st.exposed
        average.gs = gs
        return average
    return make


SYNC_VARIANTS = {  # key: (label, maker); e runs under MPIR_CVAR_ASYNC_PROGRESS=1
    "a": ("per-tensor blocking", _per_tensor), "b": ("fused blocking", _fused),
    "c": ("GradSync", _gradsync()), "fp16": ("GradSync fp16", _gradsync(compression="fp16")),
    "e": ("GradSync async progress", _gradsync())}
THREAD_LEVELS = ("THREAD_SINGLE", "THREAD_FUNNELED", "THREAD_SERIALIZED", "THREAD_MULTIPLE")


def sync(cfg: Config, rounds: int, repeat: int) -> dict:
    """Ways to average the gradients of one step at one bucket size (``cfg.bucket_mb``), each on its own
    copy of the model, the same batch: per-tensor blocking Allreduce (a, the baseline), one fused
    blocking Allreduce (b), GradSync (c: polling from its hooks), GradSync with fp16 compression. Under
    ``MPIR_CVAR_ASYNC_PROGRESS=1`` (a progress thread per rank; ``pilab.bench`` runs a second job) the
    contenders are a and GradSync (e). Forward + backward +
    averaging, no optimizer step (the same for all); the slower rank's step per round."""
    async_progress = os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0") not in ("", "0")
    g = torch.Generator().manual_seed(1 + RANK)  # each rank its own batch, as in training
    x = torch.randn(cfg.batch_size, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (cfg.batch_size,), generator=g)
    keys = ["a", "e"] if async_progress else ["a", "b", "c", "fp16"]
    contenders = {}
    for k in keys:
        model = _model(cfg)
        contenders[k] = (model, SYNC_VARIANTS[k][1](model, cfg))
    rec = {k: {"step": [], "exposed": []} for k in keys}
    sent = {}
    for r in range(-1, rounds):  # round -1: the warm-up, not kept
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            model, average = contenders[k]
            st, ex = [], []
            nap_barrier()
            for _ in range(repeat):
                model.zero_grad(set_to_none=False)
                t = time.perf_counter()
                F.cross_entropy(model(x), y).backward()
                t_backward = time.perf_counter()
                msgs, nbytes, *exposed = average()
                st.append(time.perf_counter() - t)
                ex.append(exposed[0] if exposed else time.perf_counter() - t_backward)
                sent[k] = (msgs, nbytes)
            if r >= 0:
                rec[k]["step"].append(slowest(float(np.median(st))))
                rec[k]["exposed"].append(slowest(float(np.median(ex))))
    for _, average in contenders.values():
        if hasattr(average, "gs"):
            average.gs.remove()
    rows = [{"variant": k, "label": SYNC_VARIANTS[k][0], "messages": sent[k][0], "bytes_per_step": sent[k][1],
             "step_s": summary(rec[k]["step"]), "exposed_s": summary(rec[k]["exposed"]),
             "step_vs_a": summary([s / b for s, b in zip(rec[k]["step"], rec["a"]["step"])]),
             "exposed_vs_a": summary([e / b for e, b in zip(rec[k]["exposed"], rec["a"]["exposed"]) if b > 0])}
            for k in keys]
    level = next((k[7:].lower() for k in THREAD_LEVELS if getattr(MPI, k) == MPI.Query_thread()), "?")
    return {"model": cfg.model, "width": cfg.width, "per_rank_batch": cfg.batch_size, "bucket_mb": cfg.bucket_mb,
            "async_progress": async_progress, "thread_level": level, "rounds": rounds, "steps_per_round": repeat,
            "rows": rows, "raw": rec}
