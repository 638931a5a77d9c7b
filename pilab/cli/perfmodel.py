"""``pilab perfmodel {bench,calibrate,predict,table,trace,validate}``: the performance model (``pilab.perfmodel``).

    python -m pilab perfmodel bench --np 2,3          # launches mpiexec; runs/perfmodel/comm_bench.json
    python -m pilab perfmodel calibrate --result runs/np1/result.json --bench runs/perfmodel/comm_bench.json
    python -m pilab perfmodel predict --np 48 --profile both --baseline-np 2      # Pi preset, one np
    python -m pilab perfmodel table --published       # the Pi table beside the published figures
    python -m pilab perfmodel trace --np 48 --cluster pi4b_cluster --out runs/pi48/predicted.json
    python -m pilab perfmodel validate runs/x/trace.json --calibration runs/perfmodel/calibration.json

Unlike the other command modules this one imports its library at the top: the flags' defaults and
choices come from it (one source), and ``pilab.perfmodel`` loads neither torch nor MPI.
"""
from __future__ import annotations

import dataclasses
import math
import shlex
import sys

from .. import perfmodel as pm
from ..config import Config
from ..files import load_json, save_json
from ..launch import under_mpi
from .common import (TRUST_MODEL, UsageError, add_config_arguments, add_int_list, add_launch_arguments,
                     config_from_args)


def add_parser(sub) -> None:
    """Register ``python -m pilab perfmodel {bench,calibrate,predict,table,trace,validate}``."""
    p = sub.add_parser("perfmodel", help="performance model: micro-benchmark, calibrate, predict",
                       description="Predict time per epoch at any np from an np=1 run and an Allreduce "
                                   "micro-benchmark (see docs/perfmodel.md).")
    ps = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    _add_bench(ps)
    _add_calibrate(ps)

    pr = ps.add_parser("predict", help="predicted epoch time at one np",
                       description="One prediction: step and epoch times, communication, evaluation.")
    pr.add_argument("--np", type=int, required=True, help="number of MPI ranks")
    _add_machine_arguments(pr)
    pr.set_defaults(func=run_predict)

    t = ps.add_parser("table", help="predicted scaling table over several np",
                      description="Predictions at each --nps with speedup and efficiency against "
                                  "--baseline-np (default: the first). --published prints the Pi "
                                  "table beside the original study's figures.")
    add_int_list(t, "--nps", default=list(pm.PI_TABLE_NPS), help="process counts")
    t.add_argument("--published", action="store_true",
                   help=f"both profiles beside the published Pi figures (baseline np={pm.PI_BASELINE_NP})")
    _add_machine_arguments(t)
    t.set_defaults(func=run_table)
    _add_trace(ps)
    _add_validate(ps)


def _add_trace(ps) -> None:
    tr = ps.add_parser("trace", help="one predicted step as a Chrome trace (open it with `pilab trace`)",
                       description="The performance model's prediction of one step of the configured run, "
                                   "as a trace in the format of `train --trace`: forward, backward, each "
                                   "bucket's Allreduce posted when backward has filled it with its intra- "
                                   "and inter-node phases, the exposed tail, the optimizer. One process "
                                   "per node, one track per rank.")
    tr.add_argument("--np", type=int, required=True, help="number of MPI ranks")
    _add_machine_arguments(tr)
    tr.set_defaults(func=run_trace, out=None)


def _add_validate(ps) -> None:
    v = ps.add_parser("validate", help="a measured trace beside its prediction: per bucket and step errors",
                      description="Predicts the run a measured trace recorded (its config and np) and "
                                  "prints per bucket the predicted and measured Allreduce time and the "
                                  "error, and the same for the step time and the exposed tail.")
    v.add_argument("trace", metavar="MEASURED_TRACE", help="a run's trace.json (or its run directory)")
    v.add_argument("--model", default=None, metavar="BUILDER", help=TRUST_MODEL)
    v.add_argument("--preset", "--cluster", default="pi4b_cluster",
                   help="a preset name or a Cluster/Calibration JSON (default: %(default)s)")
    v.add_argument("--calibration", default=None, help="the measuring machine's calibration JSON "
                                                       "(overrides --preset)")
    v.add_argument("--algorithm", default=None, choices=pm.ALGORITHMS, help="Allreduce algorithm")
    v.add_argument("--step-goal", dest="step_goal", type=float, default=None,
                   help="show whether the step's error is within this fraction (e.g. 0.10)")
    v.add_argument("--tail-goal", dest="tail_goal", type=float, default=None,
                   help="show whether the exposed tail's error is within this fraction (e.g. 0.20)")
    v.add_argument("--out", default=None, help="also write the comparison as JSON here")
    v.add_argument("--predicted-out", dest="predicted_out", default=None,
                   help="also write the predicted trace here (side by side in Perfetto)")
    v.set_defaults(func=run_validate, train_gflops=None, inter_alpha=None, inter_mbps=None)


def _add_bench(ps) -> None:
    b = ps.add_parser("bench", help="Allreduce micro-benchmark at several np; fits alpha and beta",
                      description="Launches mpiexec -n P for each --np, times in-place float32 "
                                  "Allreduce at each size, writes the timings and the alpha-beta fit.")
    add_int_list(b, "--np", default=[2, 3], help="process counts to benchmark")
    add_int_list(b, "--sizes", default=list(pm.DEFAULT_SIZES), help="message sizes in bytes",
                 shown="4 B .. 16 MiB")
    b.add_argument("--out", default="runs/perfmodel/comm_bench.json",
                   help="JSON file for the timings and the fit (default: %(default)s)")
    add_launch_arguments(b, what="the benchmark's ranks")
    b.add_argument("--launcher-args", default=None,
                   help='extra mpiexec arguments, e.g. "-ppn 1 -hosts pi01,pi02" to time the '
                        "inter-node link of a cluster")
    b.set_defaults(func=run_bench)


def _add_calibrate(ps) -> None:
    c = ps.add_parser("calibrate", help="make a calibration from an np=1 result + a bench JSON",
                      description="Reads an np=1 result.json and a `perfmodel bench` JSON; writes "
                                  "the Calibration (the this_box preset) as JSON.")
    c.add_argument("--result", required=True, help="result.json of an np=1 `pilab train` run")
    c.add_argument("--model", default=None, metavar="BUILDER", help=TRUST_MODEL)
    c.add_argument("--bench", required=True, help="JSON written by `pilab perfmodel bench`")
    c.add_argument("--out", default="runs/perfmodel/calibration.json",
                   help="where to write the calibration (default: %(default)s)")
    c.add_argument("--flops-per-activation", dest="flops_per_activation", type=float,
                   default=pm.FLOPS_PER_ACTIVATION_CPU,
                   help="memory-bound cost of one activation element in training FLOPs: how compute "
                        "time moves with width (default %(default)s, measured on x86; 0: FLOPs only)")
    c.add_argument("--step-work-per-tensor", dest="step_work_per_tensor", type=float,
                   default=pm.STEP_WORK_PER_TENSOR_CPU,
                   help="per-step work that does not grow with the batch, per parameter tensor, in "
                        "the same units: how compute moves with the batch (default %(default)s; 0: "
                        "proportional)")
    c.add_argument("--inter-bench", default=None,
                   help="a `perfmodel bench` JSON run with one rank per node: also write a Cluster "
                        "with that inter-node link")
    c.add_argument("--nodes", type=int, default=None, help="with --inter-bench: nodes in the cluster")
    c.add_argument("--ranks-per-node", dest="ranks_per_node", type=int, default=None,
                   help="with --inter-bench: MPI ranks per node")
    c.add_argument("--cluster-out", default=None,
                   help="with --inter-bench: where to write the Cluster JSON (for --preset)")
    c.set_defaults(func=run_calibrate)


def _add_machine_arguments(q) -> None:
    pi = pm.pi4b_cluster()
    g = q.add_argument_group("machine")
    g.add_argument("--preset", "--cluster", default="pi4b_cluster",
                   help=f"{', '.join(pm.PRESETS)}; a mixed cluster BOARD:NODES,... of {', '.join(pm.BOARDS)} "
                        "(e.g. pi4b:12,pi5:12: a mixed cluster is priced with and without balanced shares); "
                        "or a Cluster/Calibration JSON file (default: %(default)s)")
    g.add_argument("--calibration", default=None,
                   help="a calibration JSON: predict for this box (overrides --preset)")
    g.add_argument("--profile", default="pilab", choices=(*pm.PROFILES, "both"),
                   help="pilab: fused overlapped buckets, sharded eval; naive: per-tensor blocking "
                        "Allreduce, unsharded eval; naive_comm / naive_eval: one half of naive; "
                        "both: pilab and naive (default: %(default)s)")
    g.add_argument("--algorithm", default=None, choices=pm.ALGORITHMS,
                   help="Allreduce algorithm (default: the machine's, mpich = by message size)")
    g.add_argument("--train-gflops", dest="train_gflops", type=float, default=None,
                   help=f"Pi presets: achieved training GFLOP/s per rank of a Pi 4B at 1.5 GHz (the other boards "
                        f"scale it by their speed) (default {pi.train_gflops})")
    g.add_argument("--inter-alpha", dest="inter_alpha", type=float, default=None,
                   help=f"Pi presets: inter-node latency, seconds per message (default "
                        f"{pi.inter.alpha * 1e6:g}e-6)")
    g.add_argument("--inter-mbps", dest="inter_mbps", type=float, default=None,
                   help=f"Pi presets: inter-node bandwidth in MB/s (default {1 / pi.inter.beta / 1e6:g})")
    g.add_argument("--baseline-np", dest="baseline_np", type=int, default=None,
                   help="np the speedup and efficiency are measured against")
    g.add_argument("--out", default=None, help="also write the result as JSON here")
    add_config_arguments(q, skip=("out", "resume", "checkpoint_every", "device"))


# ----------------------------------------------------------------------------------------------
# checks and helpers shared by the actions
# ----------------------------------------------------------------------------------------------
def _check_range(args, dest: str, least: float, strict: bool = False) -> None:
    """UsageError unless every value of ``--dest`` (one or a list; None: not given) is >= ``least``
    (> with ``strict``: rates and bandwidths) and finite."""
    values = getattr(args, dest, None)
    for v in values if isinstance(values, list) else [values]:
        if v is None or ((v > least if strict else v >= least) and math.isfinite(v)):
            continue  # NaN fails both comparisons, so it lands below
        flag = "--" + dest.replace("_", "-")
        raise UsageError(f"{flag} {v} must be {'>' if strict else '>='} {least:g}"
                         + (" and finite" if isinstance(v, float) else ""))


def _read_json(path: str, flag: str):
    try:
        return load_json(path)
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except (OSError, ValueError) as e:  # unreadable, or not JSON
        raise UsageError(f"{flag} {path}: cannot read it as JSON ({e})") from None


def _read_result(path: str) -> dict:
    from .. import resultfile
    try:
        return resultfile.load(path)
    except FileNotFoundError:
        raise UsageError(f"--result {path}: no such file") from None
    except OSError as e:
        raise UsageError(f"--result {path}: cannot read it ({e})") from None
    except resultfile.ResultFileError as e:
        raise UsageError(f"--result {e}") from None


def _load_calibration(path: str) -> pm.Calibration:
    try:
        return pm.Calibration.from_dict(_read_json(path, "--calibration"))
    except TypeError as e:  # missing or unknown fields
        raise UsageError(f"--calibration {path}: not a `perfmodel calibrate` JSON ({e})") from None


def _write_json(obj, path: str | None) -> None:
    if path:
        save_json(obj, path)
        print(f"wrote {path}")


def _defaults(args) -> Config:
    """The Pi study's setting with a Pi preset, else Config's defaults."""
    if pm.is_pi_cluster(args.preset) and not args.calibration:
        return pm.pi_config()
    return Config()


def _cluster(args) -> pm.Cluster:
    """The machine the flags describe: a calibration, a preset with the Pi overrides, an algorithm."""
    for dest in ("train_gflops", "inter_mbps"):
        _check_range(args, dest, 0, strict=True)
    _check_range(args, "inter_alpha", 0)
    if args.calibration:
        cl = pm.this_box(_load_calibration(args.calibration))
    elif pm.is_pi_cluster(args.preset):
        cl = pm.resolve_cluster(args.preset)
        if args.train_gflops is not None:  # the Pi 4B's rate; the other boards' follow from their speeds
            cl = dataclasses.replace(cl, train_gflops=args.train_gflops)
        cl = pm.relinked(cl, alpha=args.inter_alpha, mbps=args.inter_mbps)
    else:
        cl = pm.resolve_cluster(args.preset)
    if args.algorithm:
        cl = dataclasses.replace(cl, algorithm=args.algorithm)
    return cl


def _profiles(args) -> tuple[str, ...]:
    return ("pilab", "naive") if args.profile == "both" else (args.profile,)


# ----------------------------------------------------------------------------------------------
# the actions
# ----------------------------------------------------------------------------------------------
def run_bench(args, argv) -> int:
    if under_mpi():  # every rank would launch its own jobs
        raise UsageError("perfmodel bench launches its own mpiexec jobs; run it without mpiexec")
    if any(p < 2 for p in args.np):
        raise UsageError("--np values must be >= 2 (an Allreduce needs two ranks)")
    _check_range(args, "sizes", 1)
    from .common import mpi_or_error
    mpi_or_error()  # the benchmark's ranks need an MPI library: say how to get one, before launching
    try:
        res = pm.run_comm_bench(args.np, sizes=args.sizes, mpiexec=args.mpiexec,
                                extra_args=(["-f", args.hostfile] if args.hostfile else [])
                                + shlex.split(args.launcher_args or ""))
    except RuntimeError as e:  # a launched job failed: its stderr tail says why; no traceback of ours
        print(f"pilab: error: {e}", file=sys.stderr)
        return 1
    fit = res["fit"]
    print(f"{'np':>3} {'bytes':>10} {'measured us':>12} {'model us':>10} {'err':>7}")
    for pt in fit["points"]:
        print(f"{pt['np']:>3} {pt['bytes']:>10} {pt['measured_s'] * 1e6:>12.1f} "
              f"{pt['model_s'] * 1e6:>10.1f} {100 * pt['rel_err']:>6.0f}%")
    print(f"alpha = {fit['alpha'] * 1e6:.2f} us/message, beta = {fit['beta'] * 1e9:.3f} ns/byte "
          f"({fit['bandwidth_MBps'] or float('inf'):.0f} MB/s), relative rms {100 * fit['rel_rms']:.0f}%")
    _write_json(res, args.out)
    return 0


def run_calibrate(args, argv) -> int:
    for dest in ("flops_per_activation", "step_work_per_tensor"):
        _check_range(args, dest, 0)
    for dest in ("nodes", "ranks_per_node"):
        _check_range(args, dest, 1)
    if args.inter_bench and not (args.nodes and args.ranks_per_node and args.cluster_out):
        raise UsageError("--inter-bench needs --nodes, --ranks-per-node and --cluster-out")
    result = _read_result(args.result)
    bench = _read_json(args.bench, "--bench")
    inter_bench = _read_json(args.inter_bench, "--inter-bench") if args.inter_bench else None
    try:
        cal = pm.calibrate(result, bench, source=args.result,
                           flops_per_activation=args.flops_per_activation,
                           step_work_per_tensor=args.step_work_per_tensor)
        cl = None if inter_bench is None else pm.cluster_from_calibration(
            cal, nodes=args.nodes, ranks_per_node=args.ranks_per_node, inter_bench=inter_bench)
    except (KeyError, TypeError) as e:  # a JSON of another kind: name the files, not a traceback
        raise UsageError(f"--result {args.result}, --bench {args.bench}"
                         + (f", --inter-bench {args.inter_bench}" if args.inter_bench else "")
                         + f": not an np=1 result.json and `perfmodel bench` JSON "
                           f"({type(e).__name__}: {e})") from None
    for k, v in cal.to_dict().items():
        print(f"{k:>22}: {v}")
    if args.out:
        cal.save(args.out)
        print(f"wrote {args.out}")
    if cl is not None:
        _write_json(cl.to_dict(), args.cluster_out)
        print(f"use it with --preset {args.cluster_out}")
    return 0


def run_predict(args, argv) -> int:
    _check_range(args, "np", 1)
    _check_range(args, "baseline_np", 1)
    cfg = config_from_args(args, _defaults(args))
    cl = _cluster(args)
    profiles = _profiles(args)
    outs = {}
    for prof in profiles:
        out = outs[prof] = pm.predict(cfg, args.np, cl, prof, baseline_np=args.baseline_np)
        print(f"\n{cl.name}, profile {prof}")
        for k, v in out.items():
            if k == "balancing":
                continue
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    print(f"{k + '.' + k2:>20}: {v2:.4g}")
            elif isinstance(v, list):
                print(f"{k:>20}: {_runs(v)}")
            else:
                print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")
        if "balancing" in out:
            print(_balancing_lines(out["balancing"]))
    _write_json(outs if len(outs) > 1 else outs[profiles[0]], args.out)
    return 0


def _runs(values: list) -> str:
    """A per-rank list, runs of equal values as VALUE x COUNT: "18 x 24, 46 x 24"."""
    out: list[list] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return ", ".join(f"{v:g}" + (f" x {n}" if n > 1 else "") for v, n in out)


def _balancing_lines(b: dict) -> str:
    """A mixed cluster's step off, balanced and ideal, as lines of text."""
    lines = [f"\nnodes of different speeds (mean {b['mean_speed']:.3g}): every step waits for the slowest rank"]
    for key, what in (("off", "equal shares (--balance off)"), ("balanced", "shares by speed (--balance static)"),
                      ("ideal", "ideal: every node at the mean speed")):
        r = b[key]
        lines.append(f"{what:>38}: step {r['step_time']:.4g} s"
                     + (f" = {r['of_ideal']:.3f} x ideal" if "of_ideal" in r else "")
                     + (f", speedup {r['speedup']:.3g}" if r.get("speedup") is not None else "")
                     + f"; per-rank batch {_runs(r['shares'])}")
    return "\n".join(lines)


def run_table(args, argv) -> int:
    _check_range(args, "nps", 1)
    _check_range(args, "baseline_np", 1)
    cfg = config_from_args(args, _defaults(args))
    cl = _cluster(args)
    if args.published:
        rows = pm.pi_table(cfg, args.nps, cl)
        print(pm.markdown_table(rows, pm.PI_TABLE_COLUMNS))
        _write_json({"cluster": cl.to_dict(), "config": cfg.to_dict(), "rows": rows,
                     "published": pm.published_table()}, args.out)
        return 0
    result = {"cluster": cl.to_dict(), "config": cfg.to_dict(), "tables": {}}
    for prof in _profiles(args):
        rows = pm.predict_table(cfg, args.nps, cl, prof, baseline_np=args.baseline_np)
        result["tables"][prof] = rows
        print(f"\n{cl.name}, profile {prof}, baseline np={rows[0].get('baseline_np')}")
        print(pm.markdown_table(rows, pm.TABLE_COLUMNS))
        if cl.node_speeds:
            print(f"\nwith and without balanced shares (the step on the ideal cluster: every node at the "
                  "mean speed of the ranks)")
            print(pm.markdown_table(pm.balance_rows(rows), pm.BALANCE_COLUMNS))
    _write_json(result, args.out)
    return 0


def run_trace(args, argv) -> int:
    from ..trace import format as tf
    from ..trace import predicted_trace

    _check_range(args, "np", 1)
    if args.profile == "both":
        raise UsageError("--profile both: a trace draws one profile; pass --profile pilab")
    cfg = config_from_args(args, _defaults(args))
    cl = _cluster(args)
    events, meta = predicted_trace(cfg, args.np, cl, args.profile)
    p = meta["prediction"]
    print(f"{cl.name}, np={args.np}, profile {args.profile}: one step, predicted (ms)")
    for k in ("data", "compute", "straggler", "comm_exposed", "overhead"):
        print(f"{k:>14}: {1e3 * p[k]:10.2f}")
    print(f"{'step':>14}: {1e3 * p['step_time']:10.2f}")
    print(f"\n{'bucket':>6} {'MB':>7} {'posted':>9} {'start':>9} {'end':>9} {'on wire':>9} {'intra':>7} "
          f"{'inter':>7}  (ms; intra/inter: the phases' times on an idle wire)")
    for k, b in enumerate(p["buckets"]):
        alone = {kind: 1e3 * sum(t for q, t in b["phases"] if q == kind) for kind in ("intra", "inter")}
        print(f"{k:>6} {b['bytes'] / 1e6:>7.2f} {1e3 * b['posted']:>9.2f} {1e3 * b['start']:>9.2f} "
              f"{1e3 * b['end']:>9.2f} {1e3 * (b['end'] - b['start']):>9.2f} {alone['intra']:>7.2f} "
              f"{alone['inter']:>7.2f}")
    out = args.out or f"runs/perfmodel/predicted_np{args.np}.json"
    tf.write(out, events, meta=meta)
    print(f"\nwrote {out} (read it: python -m pilab trace {out}; or open it in ui.perfetto.dev)")
    return 0


def run_validate(args, argv) -> int:
    from ..trace import format as tf
    from ..trace import load
    from ..trace import table, validate

    _check_range(args, "step_goal", 0, strict=True)
    _check_range(args, "tail_goal", 0, strict=True)
    try:
        doc = load(args.trace)
        v = validate(doc, _cluster(args))
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    except tf.TraceError as e:
        raise UsageError(f"{args.trace}: not a pilab trace ({e})") from None
    print(f"{args.trace} at np={v['np']} beside its prediction on {v['predicted']['otherData']['cluster']}")
    print(table(v, step_goal=args.step_goal, tail_goal=args.tail_goal))
    if args.predicted_out:
        tf.write(args.predicted_out, v["predicted"]["traceEvents"], meta=v["predicted"]["otherData"])
        print(f"wrote {args.predicted_out}")
    _write_json({k: v[k] for k in ("np", "buckets", "step", "tail")}, args.out)
    return 0
