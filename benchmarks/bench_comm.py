"""Gradient averaging per step: per-tensor vs fused vs GradSync (polling, no polling, async progress).

    python benchmarks/bench_comm.py                           # launches mpiexec -n 2 itself (twice)
    mpiexec -n 2 python benchmarks/bench_comm.py              # one job: variants a-d + fp16, no (e)
    python benchmarks/bench_comm.py --widths 1.0 --batch 32 --steps 6 --out runs/bench_comm.json

MobileNetV2-CIFAR, one thread per rank, a fixed batch per rank; each step is forward + backward +
gradient averaging (no optimizer step: it is the same for every variant), timed between barriers on the
slowest rank. Variants, every one on its own copy of the model, interleaved step by step so that a load
change on a shared machine hits them all alike:

  a  blocking per-tensor Allreduce after backward (~158 messages)        -- the baseline
  b  one fused blocking Allreduce after backward
  c  GradSync: buckets posted from gradient hooks, Testall polling in the hooks    (0.25/1/4/16 MiB)
  d  GradSync without polling: MPICH progresses only inside finish()'s Waitall      (0.25/1/4/16 MiB)
  e  GradSync without polling under MPIR_CVAR_ASYNC_PROGRESS=1 (a progress thread per rank; needs
     MPI_THREAD_MULTIPLE, which mpi4py requests by default): a second mpiexec job  (0.25/1/4/16 MiB)
  fp16  GradSync with polling at 1 MiB and compression=fp16 (half the bytes)

Printed: median step time and exposed communication (time waiting after backward), both as ratios
against (a) measured in the same job, the bytes sent per step, and the bucket size with the fastest
step. Ratios across the two jobs (e vs the rest) compare medians of separate runs: read them loosely.
Nothing asserts on timings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=float, nargs="+", default=[1.0, 0.5],
                   help="MobileNetV2-CIFAR widths (default 1.0 0.5)")
    p.add_argument("--buckets", type=float, nargs="+", default=[0.25, 1.0, 4.0, 16.0],
                   help="GradSync bucket sizes in MiB (default 0.25 1 4 16)")
    p.add_argument("--batch", type=int, default=16, help="images per rank per step (default 16)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first (default 1)")
    p.add_argument("--np", type=int, default=2, help="ranks when launching itself (default 2)")
    p.add_argument("--no-async", action="store_true", help="skip the MPIR_CVAR_ASYNC_PROGRESS job (e)")
    p.add_argument("--mpiexec", default=None, help="launcher (default: next to this Python)")
    p.add_argument("--out", default=None, help="write all numbers as JSON here")
    p.add_argument("answer", nargs="?", default=None,
                   help="under mpiexec: where rank 0 writes the numbers (JSON) instead of printing them")
    p.add_argument("--job", default="main", choices=("main", "async"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# one MPI job (every rank runs this)
# ----------------------------------------------------------------------------------------------
def run_job(args) -> dict | None:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from pilab.dist import GradSync, broadcast_module_
    from pilab.models import build_model

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    thread_level = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                    MPI.THREAD_SERIALIZED: "serialized",
                    MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?")
    async_progress = os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0") not in ("", "0")

    def per_tensor(model):
        def sync():
            for p in model.parameters():
                g = p.grad
                buf = g if g.is_contiguous() else g.contiguous()
                comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
                buf.div_(size)
                if buf is not g:
                    g.copy_(buf)
            return None
        return sync

    def fused(model):
        params = list(model.parameters())

        def sync():
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            flat.div_(size)
            off = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n
            return None
        return sync

    out = {"np": size, "thread_level": thread_level, "async_progress": async_progress,
           "mpi_library": MPI.Get_library_version().splitlines()[0].strip(), "widths": {}}
    for width in args.widths:
        variants = []  # (key, label, bucket_mb, model, sync, gradsync)

        def fresh():
            torch.manual_seed(0)
            m = build_model("mobilenetv2_cifar", num_classes=10, width=width)
            m = m.to(memory_format=torch.channels_last)
            broadcast_module_(m, comm)
            return m

        def gradsync(key, label, mb, **kw):
            m = fresh()
            variants.append((key, label, mb, m, None, GradSync(m, comm, bucket_mb=mb, **kw)))

        if args.job == "main":
            m = fresh()
            variants.append(("a", "per-tensor blocking", None, m, per_tensor(m), None))
            m = fresh()
            variants.append(("b", "fused blocking", None, m, fused(m), None))
            for mb in args.buckets:
                gradsync("c", "GradSync poll", mb)
            for mb in args.buckets:
                gradsync("d", "GradSync no poll", mb, poll=False)
            gradsync("fp16", "GradSync poll fp16", 1.0, compression="fp16")
        else:
            for mb in args.buckets:
                gradsync("e", "GradSync async no poll", mb, poll=False)
            gradsync("e+poll", "GradSync async + poll", 1.0, poll=True)
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(args.batch, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        n = len(variants)
        steps = args.warmup + args.steps
        t_step = np.zeros((n, steps))
        t_exp = np.zeros((n, steps))
        t_comm = np.zeros((n, steps))
        nbytes = [0] * n
        nmsg = [0] * n
        for s in range(steps):
            for i, (key, _, _, model, sync, gs) in enumerate(variants):
                model.zero_grad(set_to_none=False)
                comm.Barrier()
                t0 = time.perf_counter()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                t1 = time.perf_counter()
                if gs is None:
                    sync()
                    t2 = time.perf_counter()
                    exposed = total = t2 - t1
                    nmsg[i] = 1 if key == "b" else sum(1 for _ in model.parameters())
                    nbytes[i] = 4 * sum(p.numel() for p in model.parameters())
                else:
                    st = gs.finish()
                    t2 = time.perf_counter()
                    exposed, total = st.exposed, st.total
                    nmsg[i], nbytes[i] = st.buckets, st.bytes_sent
                t_step[i, s], t_exp[i, s], t_comm[i, s] = t2 - t0, exposed, total
        for arr in (t_step, t_exp, t_comm):  # the slowest rank sets the pace
            comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.MAX)
        rows = []
        for i, (key, label, mb, *_rest) in enumerate(variants):
            w = slice(args.warmup, steps)
            rows.append({"variant": key, "label": label, "bucket_mb": mb, "messages": nmsg[i],
                         "bytes_per_step": nbytes[i],
                         "step_s": float(np.median(t_step[i, w])),
                         "exposed_s": float(np.median(t_exp[i, w])),
                         "comm_s": float(np.median(t_comm[i, w])),
                         "step_all_s": t_step[i, w].tolist()})
        out["widths"][str(width)] = rows
        for *_r, gs in variants:
            if gs is not None:
                gs.remove()
    return out if rank == 0 else None


# ----------------------------------------------------------------------------------------------
# the launcher side
# ----------------------------------------------------------------------------------------------
def launch(args, job: str, env_extra: dict) -> dict:
    from pilab.launch import run_job
    payload = {"job": job, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
               "widths": args.widths, "buckets": args.buckets}
    return run_job(args.np, "benchmarks.bench_comm", payload, name=f"the bench_comm {job} job",
                   mpiexec=args.mpiexec, env=dict(os.environ, OMP_NUM_THREADS="1", **env_extra), cwd=REPO)


def report(main: dict, extra: dict | None) -> dict:
    """Print the tables; return the recommendations."""
    rec = {}
    print(f"np={main['np']}, {main['mpi_library']}, thread level {main['thread_level']}"
          + (f"; async job thread level {extra['thread_level']}" if extra else ""))
    for width, rows in main["widths"].items():
        rows = rows + (extra["widths"].get(width, []) if extra else [])
        base = next(r for r in rows if r["variant"] == "a")
        print(f"\nMobileNetV2-CIFAR width {width}: {base['bytes_per_step'] / 2 ** 20:.2f} MiB of fp32 "
              f"gradients, baseline (a) step {base['step_s'] * 1e3:.0f} ms, exposed "
              f"{base['exposed_s'] * 1e3:.1f} ms")
        print(f"{'':7}{'variant':<24}{'MiB':>6}{'msgs':>6}{'MiB/step':>9}{'step ms':>9}"
              f"{'exposed ms':>11}{'step/a':>8}{'exposed/a':>10}")
        for r in rows:
            mb = "" if r["bucket_mb"] is None else f"{r['bucket_mb']:g}"
            print(f"{r['variant']:<7}{r['label']:<24}{mb:>6}{r['messages']:>6}"
                  f"{r['bytes_per_step'] / 2 ** 20:>9.2f}{r['step_s'] * 1e3:>9.0f}"
                  f"{r['exposed_s'] * 1e3:>11.1f}{r['step_s'] / base['step_s']:>8.3f}"
                  f"{r['exposed_s'] / max(base['exposed_s'], 1e-9):>10.3f}")
        gs = [r for r in rows if r["variant"] in ("c", "d", "e")]
        best = min(gs, key=lambda r: r["step_s"])
        by_strategy = {}
        for r in gs:
            by_strategy.setdefault(r["variant"], []).append(r["exposed_s"])
        rec[width] = {"fastest": {"variant": best["variant"], "label": best["label"],
                                  "bucket_mb": best["bucket_mb"], "step_ratio_vs_a":
                                  best["step_s"] / base["step_s"]},
                      "median_exposed_s_by_strategy": {k: statistics.median(v)
                                                       for k, v in by_strategy.items()}}
        poll = [r for r in rows if r["variant"] == "c"]
        best_poll = min(poll, key=lambda r: r["step_s"])
        rec[width]["recommended_bucket_mb_with_poll"] = best_poll["bucket_mb"]
        print(f"fastest GradSync: ({best['variant']}) {best['label']} at {best['bucket_mb']:g} MiB, "
              f"step x{best['step_s'] / base['step_s']:.3f} of (a); with polling the best bucket "
              f"is {best_poll['bucket_mb']:g} MiB; median exposed ms by strategy: "
              + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in rec[width]
                          ["median_exposed_s_by_strategy"].items()))
    return rec


def main(argv=None) -> int:
    args = parse(argv)
    from pilab.launch import launcher_size
    if launcher_size() > 0:  # a rank of an mpiexec job
        res = run_job(args)
        if res is not None:
            if args.answer:
                with open(args.answer, "w") as f:
                    json.dump(res, f)
            else:
                report(res, None)
        return 0
    t = time.perf_counter()
    main_res = launch(args, "main", {})
    extra = None
    if not args.no_async:
        extra = launch(args, "async", {"MPIR_CVAR_ASYNC_PROGRESS": "1"})
    rec = report(main_res, extra)
    print(f"\n({time.perf_counter() - t:.0f} s)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"main": main_res, "async": extra, "recommendation": rec}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
