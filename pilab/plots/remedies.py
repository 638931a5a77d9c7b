"""A remedies search and a fast-and-right study over seeds: accuracy per candidate, and against the
predicted time on the Pi cluster with the Pareto front named::

    plots.show(plots.remedies_figure(res))
"""
from __future__ import annotations

from typing import Mapping

from bokeh.layouts import row
from bokeh.models import ColumnDataSource, HoverTool, LabelSet, Range1d
from bokeh.plotting import figure

from .base import _fig


def remedies_figure(res: Mapping):
    """Final test accuracy of each remedy candidate at np (Pareto-front members in red), with the
    target accuracy; beside it accuracy against predicted time when the performance model gave times."""
    rows = [r for r in res.get("candidates", []) if "skipped" not in r]
    labels = [r["label"] for r in rows][::-1]
    src = ColumnDataSource({"label": labels,
                            "acc": [r["final_test_acc"] for r in rows][::-1],
                            "color": ["#d62728" if r.get("pareto") else "#4c78a8" for r in rows][::-1]})
    p = figure(title=f"remedies at np={res.get('np')}: final test accuracy", y_range=labels,
               width=560, height=max(200, 28 * len(labels) + 60), x_axis_label="test accuracy",
               toolbar_location=None)
    p.x_range = Range1d(0, 1)
    p.hbar(y="label", right="acc", height=0.7, color="color", source=src)
    target = res.get("target_accuracy")
    if target:
        p.ray(x=[target], y=[0], length=0, angle=1.5708, color="gray", line_dash="dashed")
    p.add_tools(HoverTool(tooltips=[("", "@label"), ("test acc", "@acc{0.000}")]))
    timed = [r for r in rows if r.get("epochs_time")]
    if not timed:
        return p
    where = f" on {res['machine']}" if res.get("machine") else ""
    q = _fig(f"accuracy vs predicted time{where}", "predicted training time (s)", "test accuracy")
    ts = [r["epochs_time"] for r in timed]
    mid = (min(ts) + max(ts)) / 2
    src_t = ColumnDataSource({"t": ts, "acc": [r["final_test_acc"] for r in timed],
                              "label": [r["label"] for r in timed],
                              "name": [r["label"] if r.get("pareto") else "" for r in timed],
                              # labels of the right half point left, so none runs off the plot
                              "align": ["right" if t > mid else "left" for t in ts],
                              "dx": [-8 if t > mid else 8 for t in ts],
                              "color": ["#d62728" if r.get("pareto") else "#4c78a8" for r in timed]})
    q.scatter("t", "acc", size=9, color="color", source=src_t)
    # room around the points for their labels (a label at the top or the right edge was cut off)
    accs = src_t.data["acc"] + ([target] if target else [])
    pad_t = (max(ts) - min(ts)) or max(ts) or 1.0
    q.x_range = Range1d(min(ts) - 0.08 * pad_t, max(ts) + 0.08 * pad_t)
    q.y_range = Range1d(max(min(accs) - 0.05, 0.0), min(max(accs) + 0.08, 1.0))
    # the front's members named on the picture itself (the PNG has no hover)
    q.add_layout(LabelSet(x="t", y="acc", text="name", source=src_t, x_offset="dx", y_offset=-5,
                          text_align="align", text_font_size="10pt"))
    if target:
        q.line([min(src_t.data["t"]), max(src_t.data["t"])], [target, target], color="gray",
               line_dash="dashed")
    q.add_tools(HoverTool(tooltips=[("", "@label"), ("time", "@t{0} s"), ("test acc", "@acc{0.000}")]))
    q.width, q.height = 480, 360
    return row(p, q)


def seeds_figure(tab: Mapping):
    """A fast-and-right study over seeds (experiments/fast-but-wrong/remedies/seeds_table.py): each row's
    final accuracy (mean, with its seeds' sd) against its predicted whole-run time on the Pi cluster (log scale), np=1 as squares,
    the Pareto front in red and named, the target dashed."""
    from bokeh.models import FixedTicker, Whisker
    rows = tab["rows"]
    t = [r["predicted_pi_time_s"] / 60 for r in rows]
    acc = [r["acc_mean"] for r in rows]
    sd = [r["acc_sd"] or 0.0 for r in rows]
    src = ColumnDataSource({"t": t, "acc": acc, "lo": [a - d for a, d in zip(acc, sd)],
                            "hi": [a + d for a, d in zip(acc, sd)], "n": [r["n"] for r in rows],
                            "label": [f"{r['label']} (np={r['np']})" for r in rows],
                            "name": [f"{r['label']} (np={r['np']})" if r.get("front") else "" for r in rows],
                            "marker": ["square" if r["np"] == 1 else "circle" for r in rows],
                            "color": ["#d62728" if r.get("front") else "#4c78a8" for r in rows]})
    p = _fig(f"final test accuracy vs predicted whole-run time on {tab['calibration']}",
             "predicted whole run on the Pi cluster (min, log scale)", "test accuracy (all 10,000 images)",
             x_axis_type="log", width=760, height=440)
    p.scatter("t", "acc", marker="marker", size=10, color="color", source=src)
    p.add_layout(Whisker(base="t", lower="lo", upper="hi", source=src, line_color="gray"))
    p.add_layout(LabelSet(x="t", y="acc", text="name", source=src, x_offset=8, y_offset=-5, text_font_size="9pt"))
    p.line([min(t) * 0.8, max(t) * 1.25], [tab["target"]] * 2, color="gray", line_dash="dashed",
           legend_label=f"target {tab['target']:.3f} (np=1 - {100 * tab['goal_points']:.0f} point)")
    p.x_range = Range1d(min(t) * 0.8, max(t) * 2.5)  # room on the right for the names
    p.xaxis.ticker = FixedTicker(ticks=[v * 10 ** k for k in range(-1, 4) for v in (1, 2, 5)])
    p.y_range = Range1d(0.0, min(1.0, max(acc + [tab["target"]]) + 0.08))
    p.legend.location = "bottom_right"
    p.add_tools(HoverTool(tooltips=[("", "@label"), ("time", "@t{0.0} min"), ("acc", "@acc{0.000} (n=@n)")]))
    return p
