"""The strong-scaling study: the same training at several process counts, and where it turns
fast-but-wrong.

Measured points are real MPI jobs (``mpiexec -n np python -m pilab train ...``, threads per rank held
constant); simulated points run the virtual-rank simulator for accuracy, with times from the
performance model. Speedup S(p) = T(p0)/T(p), efficiency E(p) = S(p)·p0/p, Karp–Flatt serial fraction,
time to a target accuracy and the speedup measured on it::

    from pilab.config import Config
    from pilab import scaling
    study = scaling.study(Config(width=0.25, epochs=4, train_subset=2000), nps=(1, 2),
                          simulate_nps=(8, 48), out="runs/demo")
    study["rows"]          # one dict per np; study["runs"][np] is that run's full result

    python -m pilab scale --out runs/demo                 # the README's demo
    python -m pilab scale --preset pi --hostfile hosts    # 2..48 ranks on a Pi cluster, baseline 2
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from html import escape

from bokeh.embed import file_html
from bokeh.layouts import column, row
from bokeh.models import Div, Range1d
from bokeh.palettes import Category10
from bokeh.plotting import figure
from bokeh.resources import INLINE

from . import perfmodel, plots, simulate
from .config import Config, ConfigError, small_mode
from .files import atomic_write_text, save_json
from .launch import LaunchError, pilab_command
from .perfmodel import efficiency, karp_flatt, speedup
from .plots import html_table

# Defaults of the demo: small enough for ~6 minutes on a 2-core laptop, big enough to show the effect.
DEMO = Config(width=0.25, train_subset=2000, test_subset=1000, epochs=4, batch_size=32, lr=0.05,
              lr_ref_batch=32)


def notebook_sweep(simulate_nps=(8, 48), small_simulate_nps=(4,)) -> dict:
    """Process counts for the notebooks: the demo's, or tiny ones under CI / nbval (PILAB_NB_SMALL),
    so the same notebook runs in seconds in CI and shows the effect on a laptop::

        study = scaling.study(cfg, **scaling.notebook_sweep(), out="runs/nb")
    """
    return {"nps": (1, 2), "simulate_nps": small_simulate_nps if small_mode() else simulate_nps}


@dataclass(frozen=True)
class Criteria:
    """How runs are judged; shown in the report and saved with the study."""
    baseline_np: int = 0  # p0 of S and E; 0 = the smallest measured np
    target_fraction: float = 0.9  # target accuracy = this × the baseline's final test accuracy
    wrong_gap: float = 0.10  # fast-but-wrong: final test accuracy this far below the baseline's...
    wrong_floor: float = 0.20  # ...or under this (twice chance on CIFAR-10)

    def __post_init__(self):
        if not 0 < self.target_fraction <= 1:
            raise ConfigError(f"target_fraction={self.target_fraction} must be in (0, 1]")
        if self.wrong_gap < 0 or not 0 <= self.wrong_floor < 1:
            raise ConfigError("wrong_gap must be >= 0 and wrong_floor in [0, 1)")


# ----------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------
def _karp_flatt(s: float, p: int, p0: int) -> float | None:
    """Karp–Flatt serial fraction, None (not NaN: JSON has none) at the baseline itself."""
    e = karp_flatt(s, p, p0)
    return None if math.isnan(e) else e


def time_to_target(result: dict, target: float, epoch_times: list[float] | None = None) -> float | None:
    """Training seconds until the first evaluated epoch with test accuracy >= target; None if never."""
    elapsed = 0.0
    times = epoch_times or [e["time"] for e in result["epochs"]]
    for e, t in zip(result["epochs"], times):
        elapsed += t
        if e.get("test_acc") is not None and e["test_acc"] >= target:
            return elapsed
    return None


def final_value(result: dict, key: str):
    for e in reversed(result["epochs"]):
        if e.get(key) is not None:
            return e[key]
    return None


def rows_from_runs(runs: dict[int, dict], criteria: Criteria = Criteria(),
                   predicted: dict[int, dict] | None = None) -> tuple[list[dict], dict]:
    """One row per np from run results (measured or simulated), judged against the baseline run."""
    predicted = predicted or {}
    nps = sorted(runs)
    measured = [p for p in nps if not runs[p].get("simulated")]
    p0 = criteria.baseline_np or (measured[0] if measured else nps[0])
    if p0 not in runs:
        raise ConfigError(f"baseline np={p0} is not among the runs {nps}; measure it or pick another")
    base = runs[p0]
    base_acc = final_value(base, "test_acc") or 0.0
    target = criteria.target_fraction * base_acc

    def epoch_times(p):
        if not runs[p].get("simulated"):
            return [e["time"] for e in runs[p]["epochs"]]
        pr = predicted.get(p)
        return [pr["epoch_time"]] * len(runs[p]["epochs"]) if pr else None

    # Simulated runs without a calibrated performance model have accuracy but no times.
    base_times = epoch_times(p0)
    t0 = sum(base_times) / len(base_times) if base_times else None
    ttt0 = time_to_target(base, target, base_times) if base_times else None
    rows = []
    for p in nps:
        r = runs[p]
        times = epoch_times(p)
        tpe = sum(times) / len(times) if times else None
        s = speedup(t0, tpe) if (tpe and t0) else None
        ep = [e for e in r["epochs"]]
        train_time = sum(e["time"] for e in ep)
        comm = sum(e["comm"] for e in ep)
        exposed = sum(e["comm_exposed"] for e in ep)
        acc = final_value(r, "test_acc")
        ttt = time_to_target(r, target, times) if times else None
        pr = predicted.get(p) or {}
        rows.append({
            "np": p, "simulated": bool(r.get("simulated")),
            "time_source": "predicted" if r.get("simulated") else "measured",
            "per_rank_batch": r["per_rank_batch"], "global_batch": r["global_batch"],
            "steps_per_epoch": r["steps_per_epoch"], "peak_lr": r["peak_lr"],
            "threads": r["threads"],
            "wall_time": r["wall_time"] if not r.get("simulated") else None,
            "time_per_epoch": tpe,
            "speedup": s, "efficiency": efficiency(s, p, p0) if s else None,
            "karp_flatt": _karp_flatt(s, p, p0) if s else None,
            "images_per_s": (r["per_rank_batch"] * p * r["steps_per_epoch"] / tpe) if tpe else None,
            "comm_share": (comm / train_time if not r.get("simulated") else pr.get("comm_share")),
            "comm_exposed_share": (exposed / train_time if not r.get("simulated")
                                   else pr.get("comm_exposed_share")),
            "peak_mem_mb": max(r["peak_mem_mb"]) if r.get("peak_mem_mb") else None,
            "final_train_acc": final_value(r, "train_acc"), "final_test_acc": acc,
            "final_train_loss": final_value(r, "train_loss"), "final_test_loss": final_value(r, "test_loss"),
            "time_to_target": ttt,
            "speedup_to_target": (ttt0 / ttt) if (ttt and ttt0) else None,
            "target_reached": ttt is not None,
            "fast_but_wrong": bool(acc is None or acc < base_acc - criteria.wrong_gap
                                   or acc < criteria.wrong_floor),
        })
    meta = {"baseline_np": p0, "baseline_test_acc": base_acc, "target_accuracy": target}
    return rows, meta


# ----------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------
def config_to_argv(cfg: Config) -> list[str]:
    """CLI flags that reproduce ``cfg`` (every field, so the command line is self-contained)."""
    argv = []
    for f in fields(Config):
        v = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            argv.append(flag if v else "--no-" + f.name.replace("_", "-"))
        elif v != "" or f.name not in ("out", "resume"):
            argv += [flag, str(v)]
    return argv


def run_measured(cfg: Config, np_: int, out: str, *, mpiexec: str | None = None,
                 hostfile: str | None = None, timeout: float | None = None) -> dict:
    """One real MPI job; returns its result.json. Raises RuntimeError with the job's last lines."""
    cmd = pilab_command(np_, ["train", "--quiet", *config_to_argv(replace(cfg, out=out))],
                        mpiexec=mpiexec, hostfile=hostfile)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"np={np_} run failed (exit {p.returncode}):\n{tail}")
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def _predict(cfg: Config, nps, calibration) -> dict[int, dict]:
    """Predicted epoch times (and comm shares) from the performance model, where it is available."""
    if calibration is None:
        return {}
    out = {}
    for p in nps:
        pr = perfmodel.predict(cfg, p, calibration)
        # "time" is training only, like a measured epoch's "time" (evaluation is timed apart)
        out[p] = {"epoch_time": pr["time"], "comm_share": pr["comm"] / pr["time"],
                  "comm_exposed_share": pr["comm_exposed"] / pr["time"]}
    return out


def study(cfg: Config = DEMO, nps=(1, 2), *, simulate_nps=(), criteria: Criteria = Criteria(),
          out: str | None = None, mpiexec: str | None = None, hostfile: str | None = None,
          calibration=None, callbacks=(), command: str | None = None) -> dict:
    """Run the study; returns {"rows", "runs", "criteria", "config", ...} and writes it under ``out``.

    ``callbacks`` receive {"kind": "run", "np", "simulated", "result"} after each run, so a notebook
    can draw the dashboard as it fills.
    """
    nps = sorted(set(int(p) for p in nps))
    simulate_nps = sorted(set(int(p) for p in simulate_nps) - set(nps))
    if not nps and not simulate_nps:
        raise ConfigError("give at least one process count to measure or simulate")
    # The simulator uses the threads asked for (0: all cores); measured runs hold them constant.
    sim_threads = cfg.threads
    if cfg.threads == 0 and nps:
        # Threads per rank constant across the sweep: what the largest run can give every rank.
        cores = os.cpu_count() or 1
        cfg = replace(cfg, threads=max(1, cores // max(nps)) if not hostfile else 2)
    t_start = time.time()
    runs: dict[int, dict] = {}
    for p in nps:
        run_out = os.path.join(out, f"np{p}") if out else _tmpdir()
        runs[p] = run_measured(cfg, p, run_out, mpiexec=mpiexec, hostfile=hostfile)
        for cb in callbacks:
            cb({"kind": "run", "np": p, "simulated": False, "result": runs[p]})
    if simulate_nps:
        sim_cfg = replace(cfg, threads=sim_threads, out="")
        for p in simulate_nps:
            # each run's result.json is written as it completes: a long study keeps what it did
            runs[p] = simulate.run(replace(sim_cfg, out=os.path.join(out, f"np{p}") if out else ""), p)
            for cb in callbacks:
                cb({"kind": "run", "np": p, "simulated": True, "result": runs[p]})
    if calibration is None and simulate_nps and nps and nps[0] == 1:
        calibration = calibrate_from(runs[1], mpiexec)
    predicted = _predict(cfg, simulate_nps, calibration)
    rows, meta = rows_from_runs(runs, criteria, predicted)
    result = {
        "kind": "pilab.scaling.study", "config": cfg.to_dict(), "criteria": asdict(criteria),
        "nps": nps, "simulate_nps": simulate_nps, **meta, "rows": rows,
        "runs": {str(p): r for p, r in runs.items()},
        "calibration": _jsonable(calibration), "seconds": time.time() - t_start,
        "command": command,
    }
    if out:
        write(result, out)
    return result


def _tmpdir() -> str:
    return tempfile.mkdtemp(prefix="pilab-run-")


def _jsonable(obj):
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    try:
        return asdict(obj)
    except TypeError:
        return obj


def calibrate_from(np1_result: dict, mpiexec: str | None = None):
    """This machine's performance model from an np=1 run (+ a short comm micro-benchmark under
    mpiexec); None, with a one-line note, when the micro-benchmark cannot run here."""
    try:
        bench = perfmodel.run_comm_bench(nps=(2,), mpiexec=mpiexec)
    except (RuntimeError, OSError, LaunchError, subprocess.TimeoutExpired) as e:
        print(f"pilab: comm micro-benchmark failed ({e}); simulated rows get no predicted times",
              file=sys.stderr)
        return None
    return perfmodel.calibrate(np1_result, bench)


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------
ROW_KEYS = ("np", "simulated", "time_source", "per_rank_batch", "global_batch", "steps_per_epoch",
            "peak_lr", "threads", "time_per_epoch", "speedup", "efficiency", "karp_flatt",
            "images_per_s", "comm_share", "comm_exposed_share", "peak_mem_mb", "final_train_acc",
            "final_test_acc", "final_train_loss", "final_test_loss", "time_to_target",
            "speedup_to_target", "fast_but_wrong")


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=ROW_KEYS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("not reached" if k in ("time_to_target", "speedup_to_target")
                        and r.get(k) is None else r.get(k)) for k in ROW_KEYS})
    return buf.getvalue()


def table(study_: dict) -> str:
    """A plain-text table of the rows (what the CLI prints)."""
    lines = [f"baseline np={study_['baseline_np']}  final test acc {study_['baseline_test_acc']:.3f}  "
             f"target {study_['target_accuracy']:.3f}"]
    lines.append(f"{'np':>4} {'kind':>9} {'glob.batch':>10} {'s/epoch':>8} {'speedup':>8} {'eff.':>6} "
                 f"{'test acc':>8} {'time→target':>12}  verdict")
    for r in study_["rows"]:
        def n(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "–"
        ttt = ("–" if r["time_per_epoch"] is None else "not reached") if r["time_to_target"] is None \
            else f"{r['time_to_target']:.1f}s"
        lines.append(f"{r['np']:>4} {'sim' if r['simulated'] else 'measured':>9} {r['global_batch']:>10} "
                     f"{n(r['time_per_epoch'], '8.1f')} {n(r['speedup'], '8.2f')} "
                     f"{n(r['efficiency'], '6.0%')} {n(r['final_test_acc'], '8.3f')} {ttt:>12}  "
                     f"{'FAST-BUT-WRONG' if r['fast_but_wrong'] else 'ok'}")
    return "\n".join(lines)


def write(study_: dict, out: str) -> dict:
    """study.json, study.csv, report.html (self-contained, BokehJS inline) and report.png if possible."""
    os.makedirs(out, exist_ok=True)
    save_json(study_, os.path.join(out, "study.json"))
    atomic_write_text(os.path.join(out, "study.csv"), to_csv(study_["rows"]))
    html_path = os.path.join(out, "report.html")
    atomic_write_text(html_path, report_html(study_))
    paths = {"json": os.path.join(out, "study.json"), "csv": os.path.join(out, "study.csv"),
             "html": html_path}
    png = export_png(html_path, os.path.join(out, "report.png"))
    if png:
        paths["png"] = png
    return paths


def report_html(study_: dict) -> str:
    crit = study_["criteria"]
    cfg = study_["config"]
    head = (
        "<h2>pilab strong-scaling study</h2>"
        f"<p><b>command:</b> <code>{study_.get('command') or 'python API'}</code></p>"
        f"<p>model {cfg['model']} width {cfg['width']}, {cfg['epochs']} epochs, batch {cfg['batch_size']} "
        f"({cfg['batch_mode']}), lr {cfg['lr']} per {cfg['lr_ref_batch']} scaled {cfg['lr_scaling']}, "
        f"warmup {cfg['warmup_epochs']} epochs, sharding {cfg['sharding']}, BN {cfg['bn']}, "
        f"threads/rank {cfg['threads']}, data {cfg['data']} (train subset {cfg['train_subset'] or 'all'})</p>"
        f"<p>Baseline np={study_['baseline_np']} (final test accuracy {study_['baseline_test_acc']:.3f}). "
        f"Target accuracy {study_['target_accuracy']:.3f} = {crit['target_fraction']:.0%} of the baseline's. "
        f"A run is <b>fast-but-wrong</b> when its final test accuracy is more than "
        f"{crit['wrong_gap'] * 100:.0f} points below the baseline's or under {crit['wrong_floor']:.0%}. "
        "Measured points are real MPI jobs; simulated points are exact virtual-rank emulations "
        "(accuracy) with times from the performance model.</p>")
    return file_html(column(Div(text=head, width=900), plots.report_layout(study_)), INLINE,
                     "pilab scaling study")


def export_png(html_path: str, png_path: str) -> str | None:
    """Screenshot the report with Debian's Chromium through Playwright, where both are installed."""
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        return None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=[
                "--no-sandbox", "--disable-background-networking", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            page.goto("file://" + os.path.abspath(html_path))
            page.wait_for_timeout(1500)
            page.screenshot(path=png_path, full_page=True)
            browser.close()
        return png_path
    except Exception as e:  # a report without its PNG is still a report
        print(f"pilab: PNG export skipped ({e.__class__.__name__}: {e})", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------------------------
# comparing studies (e.g. learning-rate rules) side by side
# ----------------------------------------------------------------------------------------------
def compare(studies: dict[str, dict]) -> dict:
    """Put several studies (label -> study dict) side by side: per (label, np) final accuracy, the
    test-accuracy curve, and how many evaluated epochs sat at chance level (< 15%)."""
    table_rows = []
    for label, st in studies.items():
        for r in st["rows"]:
            res = st["runs"][str(r["np"])]
            curve = [e["test_acc"] for e in res["epochs"]]
            table_rows.append({
                "label": label, "np": r["np"], "simulated": r["simulated"],
                "global_batch": r["global_batch"], "peak_lr": r["peak_lr"],
                "steps": res["total_steps"], "final_test_acc": r["final_test_acc"],
                "test_acc_curve": curve,
                "epochs_near_chance": sum(1 for a in curve if a is not None and a < 0.15),
                "fast_but_wrong": r["fast_but_wrong"]})
    return {"kind": "pilab.scaling.compare", "labels": list(studies), "rows": table_rows,
            "configs": {k: v["config"] for k, v in studies.items()},
            "commands": {k: v.get("command") for k, v in studies.items()}}


_COMPARE_HEAD = ("rule", "np", "kind", "global batch", "peak lr", "steps", "final test acc",
                 "epochs near chance", "verdict")


def _compare_cells(r: dict) -> list[str]:
    """One row of the comparison table, as text (shared by the markdown and HTML forms)."""
    return [r["label"], str(r["np"]), "simulated" if r["simulated"] else "measured",
            str(r["global_batch"]), f"{r['peak_lr']:.3g}", str(r["steps"]), f"{r['final_test_acc']:.3f}",
            f"{r['epochs_near_chance']}/{len(r['test_acc_curve'])}",
            "fast-but-wrong" if r["fast_but_wrong"] else "ok"]


def compare_markdown(cmp: dict) -> str:
    lines = ["| " + " | ".join(_COMPARE_HEAD) + " |", "|" + "---|" * len(_COMPARE_HEAD)]
    lines += ["| " + " | ".join(_compare_cells(r)) + " |" for r in cmp["rows"]]
    return "\n".join(lines)


def compare_html(cmp: dict) -> str:
    nps = sorted({r["np"] for r in cmp["rows"]})
    figs = []
    for p in nps:
        f = figure(title=f"test accuracy per epoch, np={p}", width=330, height=280,
                   x_axis_label="epoch", y_axis_label="test accuracy")
        f.y_range = Range1d(0, 1)
        for i, r in enumerate(x for x in cmp["rows"] if x["np"] == p):
            xs = list(range(1, len(r["test_acc_curve"]) + 1))
            f.line(xs, r["test_acc_curve"], color=Category10[10][cmp["labels"].index(r["label"]) % 10],
                   line_width=2, legend_label=r["label"])
        f.line([1, max(1, len(cmp["rows"][0]["test_acc_curve"]))], [0.1, 0.1], color="gray",
               line_dash="dotted", legend_label="chance")
        f.legend.location = "top_left"
        f.legend.label_text_font_size = "8pt"
        figs.append(f)
    head = "<h2>pilab: fast-but-wrong, by learning-rate rule</h2>"
    for label, cmd in cmp["commands"].items():
        head += f"<p><b>{escape(label)}:</b> <code>{escape(str(cmd))}</code></p>"
    table = html_table(_COMPARE_HEAD, [_compare_cells(r) for r in cmp["rows"]])
    return file_html(column(Div(text=head, width=1000), row(*figs), Div(text=table, width=1000)),
                     INLINE, "pilab fast-but-wrong")
