"""Static figures with matplotlib: PNG and SVG, no browser. The interactive Bokeh reports
(:mod:`pilab.plots`) stay as they are; these are the figures a paper or a code host shows::

    from pilab.plots import static
    static.write_study(study, "runs/demo/report.png")     # runs/demo/report.png and report.svg
    static.write_compare(cmp, "runs/cmp/compare.png")
    static.write_remedies(search, "runs/rem/report.png")
    static.write_seeds(table, "full-test/table.png")

Each returns the PNG's path, or None with one line on stderr saying why and what to install (a study's
JSON, CSV and HTML report are written without it). The committed figures under ``experiments/`` are made
from their committed JSON by::

    python -m pilab.plots.static experiments
"""
from __future__ import annotations

import glob
import json
import os
import sys

from ..files import atomic_write

CHANCE = 0.10
DPI = 120


def get_pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display, no browser)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    matplotlib.rcParams["svg.hashsalt"] = "pilab"  # the SVG's element ids the same on every run
    import matplotlib.pyplot as plt

    return plt


def save(fig, png_path: str) -> str:
    """``png_path`` and the same name with .svg; the figure is closed. Written to temporary names, then
    renamed, so a failure leaves no half-written figure."""
    plt = get_pyplot()
    base = os.path.splitext(png_path)[0]
    try:
        for ext in ("png", "svg"):
            atomic_write(f"{base}.{ext}", lambda tmp: fig.savefig(
                tmp, format=ext, dpi=DPI, bbox_inches="tight", metadata={"Date": None} if ext == "svg" else None))
    finally:
        plt.close(fig)
    return png_path


def _guard(write):
    """A figure is an extra: without matplotlib, or when it cannot be written, say so in one line."""
    def wrapped(obj, png_path: str):
        try:
            return save(write(obj), png_path)
        except ImportError as e:
            print(f"pilab: {os.path.basename(png_path)} not written: {e.name or 'matplotlib'} is not installed; "
                  "install it with `pip install matplotlib` (./lab.sh setup does)", file=sys.stderr)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"pilab: {png_path} not written ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    wrapped.__name__, wrapped.__doc__ = write.__name__, write.__doc__
    return wrapped


def _acc_axes(ax, title: str) -> None:
    ax.axhline(CHANCE, color="0.6", lw=0.8, ls=":")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)


def study_figure(study: dict):
    """A scaling study (``pilab scale``'s study.json): speedup against the ideal, efficiency, final test
    accuracy with the fast-but-wrong points marked, and test accuracy per epoch for each np."""
    plt = get_pyplot()
    rows = sorted(study["rows"], key=lambda r: r["np"])
    nps = [r["np"] for r in rows]
    p0 = study.get("baseline_np", nps[0])
    machine = study.get("machine") or "this machine"
    fig, axs = plt.subplots(2, 2, figsize=(10, 7.5))
    ax = axs[0][0]
    ax.plot(nps, [r["speedup"] for r in rows], "o-", label="speedup")
    ax.plot(nps, [p / p0 for p in nps], "--", color="0.5", label="ideal")
    ax.set(xscale="log", yscale="log", xlabel="processes (np)", ylabel=f"speedup vs np={p0}")
    ax.set_title(f"speedup ({machine})", fontsize=10)
    ax.legend(fontsize=8)
    ax = axs[0][1]
    ax.plot(nps, [100 * r["efficiency"] for r in rows], "o-")
    ax.set(xscale="log", xlabel="processes (np)", ylabel="efficiency (%)")
    ax.set_title("parallel efficiency", fontsize=10)
    ax = axs[1][0]
    acc = [r.get("final_test_acc") for r in rows]
    ax.plot(nps, acc, "o-", label="final test accuracy")
    wrong = [(r["np"], r["final_test_acc"]) for r in rows if r.get("fast_but_wrong")]
    if wrong:
        ax.plot(*zip(*wrong), "x", color="crimson", ms=10, mew=2, label="fast but wrong")
    if study.get("target_accuracy") is not None:
        ax.axhline(study["target_accuracy"], color="seagreen", lw=0.8, ls="--", label="target")
    ax.set(xscale="log", xlabel="processes (np)")
    _acc_axes(ax, "final test accuracy (dotted: chance)")
    ax.legend(fontsize=8)
    ax = axs[1][1]
    runs = study.get("runs") or {}
    for r in rows:
        run = runs.get(str(r["np"])) or runs.get(r["np"]) or {}
        curve = [e.get("test_acc") for e in run.get("epochs", [])]
        if curve:
            ax.plot(range(1, len(curve) + 1), curve, "o-", ms=3, label=f"np={r['np']}")
    ax.set_xlabel("epoch")
    _acc_axes(ax, "test accuracy per epoch")
    if ax.lines[1:]:
        ax.legend(fontsize=8, ncol=2)
    cfg = study.get("config") or {}
    fig.suptitle(f"pilab strong-scaling study: {cfg.get('model', '')} width {cfg.get('width', '')}, "
                 f"{cfg.get('epochs', '')} epochs, {cfg.get('batch_size', '')} images per rank", fontsize=11)
    fig.tight_layout()
    return fig


def compare_figure(cmp: dict):
    """Studies side by side (``pilab compare``'s compare.json): final test accuracy against np per study,
    and each study's accuracy per epoch at its largest np."""
    plt = get_pyplot()
    side = cmp.get("paper")
    fig, axs = plt.subplots(1, 3 if side else 2, figsize=(16 if side else 11, 4.2))
    if side:  # beside the paper (``compare --paper``): published speedups and the model's two predictions
        ax = axs[2]
        rows = side["rows"]
        for key, label, style in (("published_speedup", "published", "ks"), ("naive_speedup", "predicted: naive code", "o--"),
                                  ("pilab_speedup", "predicted: pilab", "o-")):
            pts = [(r["np"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ax.set(xscale="log", yscale="log", xlabel="processes (np)",
               ylabel=f"speedup vs np={side.get('baseline_np', 2)}")
        ax.set_title(f"speedup on {side.get('cluster', 'the cluster')}", fontsize=10)
    for label in cmp["labels"]:
        rows = sorted((r for r in cmp["rows"] if r["label"] == label and r.get("final_test_acc") is not None),
                      key=lambda r: r["np"])
        if not rows:
            continue
        line, = axs[0].plot([r["np"] for r in rows], [r["final_test_acc"] for r in rows], "o-", label=label)
        last = rows[-1]
        curve = last.get("test_acc_curve") or []
        axs[1].plot(range(1, len(curve) + 1), curve, "o-", ms=3, color=line.get_color(),
                    label=f"{label}, np={last['np']}")
    axs[0].set(xscale="log", xlabel="processes (np)")
    _acc_axes(axs[0], "final test accuracy by study (dotted: chance)")
    axs[1].set_xlabel("epoch")
    _acc_axes(axs[1], "accuracy per epoch at each study's largest np")
    for ax in axs:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def remedies_figure(res: dict):
    """A remedies search (remedies.json): each candidate's final accuracy against its predicted time, the
    fast-and-right front in red, the target as a line."""
    plt = get_pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    cands = [c for c in res["candidates"] if c.get("final_test_acc") is not None]
    timed = [c for c in cands if c.get("epochs_time")]
    for c in timed:
        front = c.get("pareto")
        ax.plot(c["epochs_time"], c["final_test_acc"], "o", color="crimson" if front else "steelblue",
                ms=7 if front else 5)
        ax.annotate(c["label"], (c["epochs_time"], c["final_test_acc"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    if res.get("target_accuracy") is not None:
        ax.axhline(res["target_accuracy"], color="seagreen", lw=0.8, ls="--")
    ax.set_xlabel(f"predicted time of the run, s ({res.get('machine') or 'no target machine'})")
    _acc_axes(ax, f"remedies at np={res['np']}: red = fast-and-right front, dashed = target")
    fig.tight_layout()
    return fig


def seeds_figure(tab: dict):
    """A fast-and-right table over seeds (table.json): mean final accuracy ± sd against the predicted Pi
    speedup; squares np=1, the front in red, the target as a line."""
    plt = get_pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in tab["rows"]:
        colour = "crimson" if r.get("front") else "steelblue"
        ax.errorbar(r["predicted_pi_speedup"], r["acc_mean"], yerr=r.get("acc_sd") or 0,
                    fmt="s" if r["np"] == 1 else "o", color=colour, ms=5, capsize=2)
    if tab.get("target") is not None:
        ax.axhline(tab["target"], color="seagreen", lw=0.8, ls="--")
    ax.set_xlabel("predicted Pi speedup over one node")
    _acc_axes(ax, "fast and right: mean ± sd over seeds (squares np=1, red the front, dashed the target)")
    ax.set_ylim(0, max(0.8, max(r["acc_mean"] for r in tab["rows"]) + 0.05))
    fig.tight_layout()
    return fig


write_study = _guard(study_figure)
write_compare = _guard(compare_figure)
write_remedies = _guard(remedies_figure)
write_seeds = _guard(seeds_figure)


def study_with_runs(path: str) -> dict:
    """A committed study.json with each point's run read from the np<p>/result.json beside it (where the
    study names it instead of embedding it)."""
    with open(path) as f:
        study = json.load(f)
    runs = dict(study.get("runs") or {})
    for r in study["rows"]:
        res = os.path.join(os.path.dirname(path), f"np{r['np']}", "result.json")
        if not isinstance(runs.get(str(r["np"])), dict) or "epochs" not in runs[str(r["np"])]:
            if os.path.exists(res):
                from .. import resultfile
                runs[str(r["np"])] = resultfile.load(res)
    study["runs"] = runs
    return study


def regenerate(root: str) -> list[str]:
    """Every committed figure under ``root`` (experiments/) from the JSON beside it; the paths written."""
    done = []
    for js in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
        name = os.path.basename(js)
        if name == "study.json":
            png = write_study(study_with_runs(js), os.path.join(os.path.dirname(js), "report.png"))
        elif name == "compare.json":
            with open(js) as f:
                png = write_compare(json.load(f), os.path.join(os.path.dirname(js), "compare.png"))
        elif name == "remedies.json":
            with open(js) as f:
                png = write_remedies(json.load(f), os.path.join(os.path.dirname(js), "report.png"))
        elif name == "table.json":
            with open(js) as f:
                png = write_seeds(json.load(f), os.path.join(os.path.dirname(js), "table.png"))
        else:
            continue
        if png:
            done.append(png)
    return done


if __name__ == "__main__":
    for path in regenerate(sys.argv[1] if len(sys.argv) > 1 else "experiments"):
        print(f"wrote {path} and its .svg")
