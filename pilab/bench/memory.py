"""Peak memory of one training rank, itemised, on real ranks (every rank runs this module)::

    mpiexec -n 2 python -m pilab.bench.memory OUT.json --data ../shared/data/cifar10-jpeg.tar.gz \\
        --width 1.0 --batch-size 32 --threads 2 --steps 3

``pilab.bench.suite.run`` launches it (section ``memory``), once per setting. Each rank measures its resident
set at every phase (Linux's VmHWM, reset between phases through /proc/self/clear_refs) and the sizes of
what it holds, and rank 0 writes, per rank:

* ``runtime``: RSS with python, torch, numpy, mpi4py and pilab imported, before any tensor;
* ``data``: this rank's training shard (uint8) and the test images it keeps (its share of the
  test set, ``CIFAR10.test_rows``), from the arrays' sizes;
* ``model``: parameters, gradients (GradSync's buckets) and optimizer state, from the tensors' sizes;
* ``activations``: what autograd saved in the forward of a training step (unique storages, counted by
  a saved-tensors hook), the largest over the steps;
* ``allocator``: the rest of the peak: gradients in flight in the backward, glibc's free lists and
  oneDNN's primitive caches;
* ``phases``: the high-water mark of load, set-up, training steps and evaluation; ``peak`` is their
  largest, ``predicted`` is ``pilab.engine.memory.predict_peak_bytes`` for the same setting.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    """Make VmHWM the current RSS (Linux >= 4.0), so the next reading is one phase's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


RUNTIME = _status()["VmRSS"] if sys.platform.startswith("linux") else 0

import torch  # noqa: E402  (after the first reading: the runtime includes torch)
from ..launch import mpi  # noqa: E402

from .. import engine  # noqa: E402
from ..config import Config  # noqa: E402
from ..files import atomic_write_text  # noqa: E402
from ..engine import breakdown  # noqa: E402

RUNTIME_WITH_TORCH = _status()["VmRSS"]


def measure(cfg: Config, steps: int, comm) -> dict:
    """One rank's itemised peak for ``cfg`` (``steps`` training steps, then one evaluation)."""
    phases = {}

    def phase(name):
        phases[name] = _status()["VmHWM"]
        _reset_peak()

    _reset_peak()
    ds = engine.load_data(cfg, comm)
    phase("load")
    data, ds = engine.Handoff(ds), None  # as `pilab train`'s ranks: the Session keeps only the shard
    sess = engine.Session(cfg, engine.MPIRanks(comm), data=data)
    phase("setup")
    saved = [0]

    def pack(t):
        store = t.untyped_storage()
        seen.setdefault(store.data_ptr(), store.nbytes())
        return t

    for step in range(steps):
        seen: dict = {}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sess.step(0, step)
        saved[0] = max(saved[0], sum(seen.values()))
    phase("train")
    sess.ranks.settle(sess.model, cfg.bn_buffers)
    sess.ranks.evaluate(sess.model, sess.ds)
    phase("eval")
    loader = sess.ranks.loader
    ds = sess.ds  # the test images it holds: its rows only (CIFAR10.test_rows), the rest untouched pages
    data = (loader._x.nbytes + loader._y.nbytes + ds.x_test[ds.test_rows or slice(None)].nbytes
            + ds.y_test.nbytes + ds.x_train.nbytes)
    tensors = {id(p): p.numel() * p.element_size() for p in sess.model.parameters()}
    for b in sess.ranks.gsync.buckets:  # the gradients are views into these
        tensors[id(b.flat)] = b.flat.nbytes
        if b.wire is not b.flat:
            tensors[id(b.wire)] = b.wire.nbytes
    for state in sess.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tensors[id(v)] = v.numel() * v.element_size()
    model = sum(tensors.values())
    sess.ranks.close()
    peak = max(phases.values())
    runtime = RUNTIME_WITH_TORCH
    return {"rank": comm.Get_rank(), "peak": peak, "phases": phases, "runtime": runtime,
            "python_only": RUNTIME, "data": data, "model": model, "activations": saved[0],
            "allocator": peak - runtime - data - model - saved[0], "malloc": sess.allocator,
            "maxrss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="itemised peak RSS per rank (run under mpiexec)")
    p.add_argument("out")
    p.add_argument("--data", default="embedded")
    p.add_argument("--model", default=Config.model, help="a registered name or package.module:builder")
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=Config.eval_batch)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--train-subset", type=int, default=0)
    p.add_argument("--test-subset", type=int, default=0)
    a = p.parse_args(argv)
    comm = mpi().COMM_WORLD
    cfg = Config(data=a.data, model=a.model, width=a.width, batch_size=a.batch_size, eval_batch=a.eval_batch,
                 threads=a.threads, max_steps=a.steps, train_subset=a.train_subset,
                 test_subset=a.test_subset)
    rank = measure(cfg, a.steps, comm)
    ranks = comm.gather(rank, root=0)
    if comm.Get_rank() == 0:
        res = {"config": cfg.to_dict(), "np": comm.Get_size(), "steps": a.steps,
               "env": {k: os.environ[k] for k in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_",
                                                  "ONEDNN_PRIMITIVE_CACHE_CAPACITY") if k in os.environ},
               "ranks": ranks, "peak_max": max(r["peak"] for r in ranks),
               "malloc": ranks[0]["malloc"],
               "predicted": breakdown(cfg, np_=comm.Get_size(), allocator=ranks[0]["malloc"])}
        atomic_write_text(a.out, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
