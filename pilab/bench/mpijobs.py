"""The benchmarks that need real ranks, one MPI job (every rank runs this module)::

    mpiexec -n 2 python -m pilab.bench.mpijobs OUT.json [--quick] [--sections memory,comm,e2e,sync]

``pilab.bench.suite.run`` launches it. Sections, all in one job so that every ratio is between contenders
measured in the same run, alternated round by round:

* memory: the default training run for a few steps (first, so the peak RSS is that run's), and that a
  static-sharded rank's loader holds only its shard;
* comm: GradSync's effective bandwidth vs one raw Allreduce of the same bytes, the bucket-size sweep with
  the share of communication hidden behind backward, and the small costs of a step (Testall, copies);
* e2e: one synchronous step, pilab vs DDP-gloo (loopback), the sync-only floor, the no-exchange ceiling
  and one rank alone (strong scaling);
* sync (``--sections sync`` only; ``pilab.bench`` runs it again under ``MPIR_CVAR_ASYNC_PROGRESS=1``): the
  ways to average a step's gradients, per-tensor and fused blocking Allreduce, GradSync, fp16
  (``pilab.bench.mpijobs``);
* trace (``--sections trace`` only): a training step with ``Config.trace`` against the same step without it
  (``pilab.trace.recorder``'s overhead), two sessions alternated round by round.

The ways to average one step's gradients, against each other (``pilab.bench.mpijobs --sections sync``): per-tensor
and fused blocking Allreduce, GradSync, GradSync with fp16 compression, and GradSync under MPICH's async
progress thread::

    mpiexec -n 2 python -m pilab.bench.mpijobs OUT.json --sections sync
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import time
import warnings
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from .. import engine
from ..config import Config
from ..dist import GradSync
from ..engine import build_optimizer
from ..launch import mpi_library
from .stats import COMM, MPI, RANK, SIZE, nap_barrier, ratios, slowest, start_model, summary

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
        model = start_model(cfg)
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


def memory(quick: bool) -> dict:
    steps = 4 if quick else 10
    cfg = Config(max_steps=steps, threads=1)  # the default run, cut short: its peak is reached in step 1
    result = engine.train(cfg, COMM)
    sess = engine.Session(replace(cfg, max_steps=1), engine.MPIRanks(COMM))
    loader = sess.ranks.loader
    shard = {"rank": RANK, "loader_images": int(loader._x.shape[0]), "shard_size": int(loader.shard_size),
             "train_images": int(len(sess.ds.y_train)), "loader_mb": loader._x.numel() / 2 ** 20,
             "full_train_set_mb": len(sess.ds.y_train) * 32 * 32 * 3 / 2 ** 20,
             # what else of the training images the Session still references (none: it dropped them)
             "session_keeps_full_train_array": len(sess.ds.x_train) > 0}
    sess.ranks.close()
    shards = COMM.gather(shard, root=0)
    return {"config": "Config() defaults, max_steps=%d, threads=1" % steps,
            "peak_rss_mb_per_rank": result["peak_mem_mb"], "shards": shards}


def comm_section(cfg: Config, rounds: int, repeat: int, buckets) -> dict:
    """GradSync's bandwidth against a raw Allreduce, the bucket-size sweep, the small costs of a step."""
    sess = engine.Session(cfg, engine.MPIRanks(COMM))
    x, y = sess.ranks.loader.batch(0, 0)
    model = start_model(cfg)
    out = {"bandwidth": _bandwidth(model, cfg, rounds, repeat),
           "bucket_sweep": _bucket_sweep(cfg, rounds, repeat, buckets, x, y),
           "micro": _micro(model, x, y)}
    sess.ranks.close()
    return out


def _bandwidth(model, cfg: Config, rounds: int, repeat: int) -> dict:
    """GradSync's exchange alone (all buckets posted at once, after backward) vs one raw Allreduce of a
    flat buffer with the same bytes. The buffers are refilled (untimed) each time."""
    gs = GradSync(model, COMM, bucket_mb=cfg.bucket_mb)
    gs.remove()  # no hooks: finish() then posts every bucket itself
    nbytes = sum(b.flat.numel() * 4 for b in gs.buckets)
    flat = np.ones(nbytes // 4, dtype=np.float32)
    # The third contender separates GradSync's own cost from MPI's: the same buckets as bare mpi4py
    # Iallreduce requests and one Waitall (MPICH's non-blocking path, which GradSync must use to overlap).
    views = [b.flat.numpy() for b in gs.buckets]

    def run(name):
        if name == "raw":
            COMM.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        elif name == "gradsync":
            gs.seeded = True  # as in training: backward (GradSync.backward) already divided them
            gs.finish()
        else:
            MPI.Request.Waitall([COMM.Iallreduce(MPI.IN_PLACE, v, op=MPI.SUM) for v in views])
    names = ["raw", "gradsync", "iallreduce"]
    samples = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            ts = []
            for _ in range(repeat):
                flat.fill(1.0)
                for b in gs.buckets:
                    b.flat.fill_(1.0)
                nap_barrier()
                t = time.perf_counter()
                run(name)
                ts.append(slowest(time.perf_counter() - t))
            samples[name].append(float(np.median(ts)))
    return {"bytes": nbytes, "buckets": len(gs.buckets), "seconds": {n: summary(v) for n, v in samples.items()},
            "raw_gb_per_s": summary([nbytes / t / 1e9 for t in samples["raw"]]),
            "gradsync_gb_per_s": summary([nbytes / t / 1e9 for t in samples["gradsync"]]),
            "iallreduce_gb_per_s": summary([nbytes / t / 1e9 for t in samples["iallreduce"]]),
            "effective_bw_ratio": summary(ratios(samples, "raw", "gradsync")),
            "gradsync_vs_bare_iallreduce": summary(ratios(samples, "iallreduce", "gradsync")),
            "bare_iallreduce_vs_raw": summary(ratios(samples, "raw", "iallreduce")), "raw": samples}


def _bucket_sweep(cfg: Config, rounds: int, repeat: int, buckets, x, y) -> dict:
    """Forward + backward + exchange per bucket size, and the share hidden behind backward."""
    variants = {}
    for mb in buckets:
        m = start_model(cfg)
        variants[mb] = (m, GradSync(m, COMM, bucket_mb=mb), build_optimizer(m, cfg, 0.01))
    rec = {mb: {"step": [], "exposed": [], "total": []} for mb in buckets}
    for r in range(rounds):
        for mb in buckets[r % len(buckets):] + buckets[:r % len(buckets)]:
            m, g, opt = variants[mb]
            st, ex, to = [], [], []
            nap_barrier()
            for _ in range(repeat):
                t = time.perf_counter()
                opt.zero_grad(set_to_none=False)
                g.backward(F.cross_entropy(m(x), y))
                cs = g.finish()
                st.append(time.perf_counter() - t)
                ex.append(cs.exposed)
                to.append(cs.total)
            rec[mb]["step"].append(slowest(float(np.median(st))))
            rec[mb]["exposed"].append(float(np.median(ex)))
            rec[mb]["total"].append(float(np.median(to)))
    for _, g, _ in variants.values():
        g.remove()
    ref = 1.0 if 1.0 in buckets else buckets[0]
    return {str(mb): {
        "buckets": len(variants[mb][1].buckets),
        "step_s": summary(rec[mb]["step"]),
        "step_vs_%gMiB" % ref: summary([a / b for a, b in zip(rec[mb]["step"], rec[ref]["step"])]),
        "exposed_s": summary(rec[mb]["exposed"]), "comm_total_s": summary(rec[mb]["total"]),
        "hidden_share": summary([1 - e / t for e, t in zip(rec[mb]["exposed"], rec[mb]["total"]) if t > 0]),
    } for mb in buckets}


def _per_call(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def _micro(model, x, y) -> dict:
    """The small costs of one step, measured directly (rank 0's, seconds)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None] or \
        [torch.ones_like(p) for p in model.parameters()]
    buf = torch.empty(sum(t.numel() for t in grads))

    def copy_in_and_out():  # the copy into the buckets and back that views remove
        off = 0
        for gr in grads:
            n = gr.numel()
            buf[off:off + n].copy_(gr.reshape(-1))
            gr.copy_(buf[off:off + n].view_as(gr))
            off += n
    copy_s = _per_call(copy_in_and_out, 20)
    MPI.Request.Waitall([COMM.Iallreduce(MPI.IN_PLACE, np.zeros(1), op=MPI.SUM)])
    reqs = [COMM.Iallreduce(MPI.IN_PLACE, np.zeros(1), op=MPI.SUM) for _ in range(8)]
    test_s = _per_call(lambda: MPI.Request.Testall(reqs), 2000)
    MPI.Request.Waitall(reqs)
    loss = F.cross_entropy(model(x), y)
    item_s = _per_call(loss.item, 200)
    nap_barrier()
    tiny_s = _per_call(lambda: COMM.Allreduce(MPI.IN_PLACE, np.zeros(6), op=MPI.SUM), 200)
    return {"copy_in_and_out_s": copy_s, "testall_call_s": test_s, "item_s": item_s, "tiny_allreduce_s": tiny_s,
            "gradient_tensors": len(grads), "testall_calls_per_step_before": len(grads)}


def e2e(cfg: Config, rounds: int, repeat: int) -> dict:
    """One synchronous step, every contender on its own copy of the model, the same batches."""
    import torch.distributed as tdist

    # DDP over gloo, on loopback only: rank 0 picks a free port on 127.0.0.1 and tells the others.
    port = None
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = COMM.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    tdist.init_process_group("gloo", rank=RANK, world_size=SIZE)
    ds = engine.load_data(cfg, COMM)  # shared by the sessions below (a Session keeps data it is given)
    sess = engine.Session(cfg, engine.MPIRanks(COMM), data=ds)
    sess.model.train()
    contenders, records = _e2e_contenders(cfg, ds, sess)
    timings, gc_stats = _e2e_rounds(contenders, rounds, repeat)
    rs = {"pilab_over_floor": ratios(timings, "pilab", "floor"),
          "pilab_over_ddp": ratios(timings, "pilab", "ddp_gloo"),
          "pilab_over_ceiling": ratios(timings, "pilab", "ceiling"),
          "floor_over_ceiling": ratios(timings, "floor", "ceiling"), "ddp_over_ceiling": ratios(timings, "ddp_gloo", "ceiling"),
          "scaling_efficiency": ratios(timings, "np1", "pilab")}
    parts = {k: summary([getattr(st, k) for st in records[1:]])  # the first one was the warm-up
             for k in ("time", "compute", "comm", "comm_exposed", "comm_wait", "data")}
    sess.ranks.close()
    tdist.destroy_process_group()
    return {"model": cfg.model, "width": cfg.width, "per_rank_batch": sess.batch, "threads": cfg.threads,
            "bucket_mb": cfg.bucket_mb, "rounds": rounds, "steps_per_round": repeat,
            "step_s": {n: summary(v) for n, v in timings.items()}, "ratios": {k: summary(v) for k, v in rs.items()},
            "raw": timings, "pilab_step_parts": parts, "gc": {**gc_stats, "pilab_steps": rounds * repeat}}


def _e2e_contenders(cfg: Config, ds, sess) -> tuple[dict, list]:
    """The contenders of one step (name -> a call that takes one), and the list pilab's steps go to."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    loader, spe, b = sess.ranks.loader, sess.steps_per_epoch, sess.batch
    counter = {"k": 0}

    def batch():
        k = counter["k"]
        counter["k"] += 1
        return loader.batch(*divmod(k % spe, spe))

    def plain(model, opt, after=None):
        def step():
            x, y = batch()
            opt.zero_grad(set_to_none=False)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            correct = (out.argmax(1) == y).sum().item()
            if after is not None:
                after(loss.item() * b, correct)
        return step

    contenders, records = {}, []
    m = start_model(cfg)
    contenders["ceiling"] = plain(m, build_optimizer(m, cfg, 0.01))  # no exchange at all
    m = start_model(cfg)
    tiny = np.zeros(1)
    contenders["floor"] = plain(m, build_optimizer(m, cfg, 0.01),   # one 8-byte Allreduce per step
                                after=lambda *_: COMM.Allreduce(MPI.IN_PLACE, tiny, op=MPI.SUM))
    with warnings.catch_warnings():  # broadcast_buffers=False: BN statistics stay per rank, as in pilab
        warnings.simplefilter("ignore", FutureWarning)
        m = DDP(start_model(cfg), broadcast_buffers=False)
    contenders["ddp_gloo"] = plain(m, build_optimizer(m.module, cfg, 0.01))

    def pilab():
        k = counter["k"]
        counter["k"] += 1
        records.append(sess.step(*divmod(k % spe, spe))[0])
    contenders["pilab"] = pilab
    # one rank alone (strong scaling, per-rank batch fixed): rank 0 trains, rank 1 sleeps
    solo = engine.Session(cfg, engine.MPIRanks(None), data=ds) if RANK == 0 else None
    solo_k = {"k": 0}

    def alone():
        if solo is not None:
            solo.step(*divmod(solo_k["k"] % solo.steps_per_epoch, solo.steps_per_epoch))
            solo_k["k"] += 1
    contenders["np1"] = alone
    return contenders, records


def _e2e_rounds(contenders: dict, rounds: int, repeat: int) -> tuple[dict, dict]:
    """Every contender ``repeat`` steps a round, alternated round by round; the slower rank's median
    step per round, and the garbage collector's pauses during pilab's steps."""
    gc_pauses, gc_t = [], {}

    def gc_cb(phase, info):
        if phase == "start":
            gc_t["t"] = time.perf_counter()
        elif "t" in gc_t:
            gc_pauses.append(time.perf_counter() - gc_t.pop("t"))
    names = list(contenders)
    for n in names:  # warm-up
        nap_barrier()
        contenders[n]()
    timings = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            nap_barrier()
            ts = []
            if n == "pilab":
                gc.callbacks.append(gc_cb)
            for _ in range(repeat):
                t = time.perf_counter()
                contenders[n]()
                ts.append(time.perf_counter() - t)
            if n == "pilab":
                gc.callbacks.remove(gc_cb)
            mine = float(np.median(ts)) if (n != "np1" or RANK == 0) else 0.0
            timings[n].append(slowest(mine))
    return timings, {"collections": len(gc_pauses), "total_s": float(sum(gc_pauses)),
                     "max_s": float(max(gc_pauses)) if gc_pauses else 0.0}


def trace_cost(cfg: Config, rounds: int, repeat: int) -> dict:
    """``Session.step`` with ``trace=True`` vs without: two sessions on their own models, the same data,
    ``repeat`` steps each per round, alternated (order rotated), the slower rank's median step per round."""
    ds = engine.load_data(cfg, COMM)
    sessions = {"plain": engine.Session(cfg, engine.MPIRanks(COMM), data=ds),
                "traced": engine.Session(replace(cfg, trace=True), engine.MPIRanks(COMM), data=ds)}
    counters = {n: 0 for n in sessions}

    def stepper(name):
        sess = sessions[name]
        sess.model.train()

        def step():
            spe = sess.steps_per_epoch
            sess.step(*divmod(counters[name] % spe, spe))
            counters[name] += 1
        return step
    steps = {n: stepper(n) for n in sessions}
    for n in steps:  # warm-up
        nap_barrier()
        steps[n]()
    timings = {n: [] for n in steps}
    names = list(steps)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            nap_barrier()
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                steps[n]()
                ts.append(time.perf_counter() - t)
            timings[n].append(slowest(float(np.median(ts))))
    for sess in sessions.values():
        sess.ranks.close()
    return {"model": cfg.model, "width": cfg.width, "per_rank_batch": cfg.batch_size, "bucket_mb": cfg.bucket_mb,
            "threads": cfg.threads, "rounds": rounds, "steps_per_round": repeat,
            "step_s": {n: summary(v) for n, v in timings.items()},
            "traced_over_plain": summary(ratios(timings, "traced", "plain")), "raw": timings}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="pilab benchmarks that need ranks (run under mpiexec)")
    p.add_argument("out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sections", default="memory,comm,e2e", help="memory,comm,e2e and/or sync, trace")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    sections = a.sections.split(",")
    q = a.quick
    cfg = Config(width=0.25 if q else 1.0, batch_size=8 if q else 64, threads=1, bucket_mb=1.0,
                 train_subset=512 if q else 0)
    res = {"np": SIZE, "mpi_library": mpi_library(MPI),
           "mpi4py": __import__("mpi4py").__version__, "torch": torch.__version__}
    t = time.perf_counter()
    if "memory" in sections:
        res["memory"] = memory(q)
    if "comm" in sections:
        res["comm"] = comm_section(cfg, 5, 2 if q else 3, [0.25, 1.0, 4.0] if q else
                                   [0.25, 1.0, 4.0, 16.0, 64.0])
    if "e2e" in sections:
        res["e2e"] = e2e(cfg, 5 if q else 10, 2)
    if "sync" in sections:  # a smaller batch than the step's: communication is a larger share
        res["sync"] = sync(replace(cfg, batch_size=4 if q else 16), 5 if q else 10, 2 if q else 3)
    if "trace" in sections:  # a shorter step than e2e's (tracing's cost per step is a larger share of it), and
        # many short rounds: on a shared machine the load moves less within one round
        res["trace"] = trace_cost(replace(cfg, width=0.25 if q else 0.5, batch_size=8 if q else 32,
                                          straggler_threshold=0), 5 if q else 31, 3)
    res["wall_s"] = time.perf_counter() - t
    if RANK == 0:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
