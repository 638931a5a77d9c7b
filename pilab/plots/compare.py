"""Studies side by side: one per model against np, a comparison's accuracy per epoch per np, and the
published paper's speedups beside pilab's predictions::

    plots.show(plots.models_figure({"MobileNetV2": a, "SqueezeNet 1.1": b}))
"""
from __future__ import annotations

from typing import Mapping

from bokeh.layouts import row
from bokeh.models import Range1d
from bokeh.palettes import Category10
from bokeh.plotting import figure

from .. import verdict as judging
from .base import H
from .study import _rows, _np_fig


def models_figure(studies: Mapping[str, Mapping]):
    """Several studies (e.g. one per model) on two plots against np: final test accuracy, and speedup
    with the ideal line -- which keeps its accuracy, which gains more from more ranks::

        plots.show(plots.models_figure({"MobileNetV2": a, "SqueezeNet 1.1": b}))
    """
    acc = _np_fig("final test accuracy vs processes", "test accuracy")
    acc.y_range = Range1d(0, 1)
    speed = _np_fig("speedup vs processes", "speedup")
    nps = sorted({r["np"] for st in studies.values() for r in _rows(st)})
    markers = ("circle", "square", "triangle", "diamond")
    for i, (label, st) in enumerate(studies.items()):
        rows = _rows(st)
        color = Category10[10][i % 10]
        xs = [r["np"] for r in rows]
        acc.line(xs, [r["final_test_acc"] for r in rows], color=color, line_width=2, legend_label=label)
        acc.scatter(xs, [r["final_test_acc"] for r in rows], color=color, size=9, marker=markers[i % 4],
                    legend_label=label)
        timed = [r for r in rows if r.get("speedup")]
        speed.line([r["np"] for r in timed], [r["speedup"] for r in timed], color=color, line_width=2,
                   legend_label=label)
        speed.scatter([r["np"] for r in timed], [r["speedup"] for r in timed], color=color, size=9,
                      marker=markers[i % 4], legend_label=label)
    acc.line([min(nps), max(nps)], [judging.CHANCE] * 2, color="gray", line_dash="dotted", legend_label="chance")
    p0 = next((st.get("baseline_np") for st in studies.values() if st.get("baseline_np")), 1)
    speed.line(nps, [p / p0 for p in nps], color="gray", line_dash="dashed", legend_label="ideal")
    machine = next((st.get("machine") for st in studies.values() if st.get("machine")), "this machine")
    speed.yaxis.axis_label = f"speedup vs np={p0} ({machine}{', predicted' if machine != 'this machine' else ''})"
    for p in (acc, speed):
        p.xaxis.ticker = nps
        p.xaxis.major_label_overrides = {n: str(n) for n in nps}
        legend = p.legend[0]  # below the plot: off the points
        p.add_layout(legend, "below")
        legend.orientation, legend.location, legend.ncols = "horizontal", "center", 2
        legend.label_text_font_size = "10pt"
        p.height = H + 70
    return row(acc, speed)


def compare_figures(cmp: dict) -> list:
    """One figure per np of a comparison (:func:`pilab.study.compare.compare`): each study's test
    accuracy per epoch, chance dotted."""
    nps = sorted({r["np"] for r in cmp["rows"]})
    n_epochs = max((len(r["test_acc_curve"]) for r in cmp["rows"]), default=1)
    figs = []
    for p in nps:
        f = figure(title=f"test accuracy per epoch, np={p}", width=330, height=330,
                   x_axis_label="epoch", y_axis_label="test accuracy", tools="pan,box_zoom,reset,save")
        f.toolbar.autohide = True  # shown on hover in the HTML, never baked into its PNG
        f.y_range = Range1d(0, 1)
        f.x_range = Range1d(0.5, n_epochs + 0.5)
        for r in (x for x in cmp["rows"] if x["np"] == p):
            xs = list(range(1, len(r["test_acc_curve"]) + 1))
            color = Category10[10][cmp["labels"].index(r["label"]) % 10]
            f.line(xs, r["test_acc_curve"], color=color, line_width=2, legend_label=r["label"])
            # markers: a study with one evaluation per curve is a point, not an empty plot
            f.scatter(xs, r["test_acc_curve"], color=color, size=6, legend_label=r["label"])
        f.line([0.5, n_epochs + 0.5], [0.1, 0.1], color="gray", line_dash="dotted", legend_label="chance")
        legend = f.legend[0]  # below the plot, off the curves
        f.add_layout(legend, "below")
        legend.orientation, legend.ncols, legend.location = "horizontal", 2, "center"
        legend.label_text_font_size = "10pt"
        legend.border_line_alpha = 0
        f.title.text_font_size = "11pt"
        figs.append(f)
    return figs


def paper_figures(side: dict) -> tuple:
    """Two panels of the paper comparison (:func:`pilab.study.paper.beside_paper`): speedup vs np (published,
    both predicted profiles, ideal) and final test accuracy vs np per study (finished points only,
    chance dotted)."""
    nps = [r["np"] for r in side["rows"]]
    p0 = side["baseline_np"]
    sp = figure(title=f"speedup vs one Pi node (np={p0}): published and predicted", width=480, height=360,
                x_axis_label="np (MPI processes)", y_axis_label="speedup")
    sp.line(nps, [p / p0 for p in nps], color="gray", line_dash="dashed", legend_label="ideal")
    for prof, color in (("naive", "#e45756"), ("pilab", "#4c78a8")):
        ys = [r[f"{prof}_speedup"] for r in side["rows"]]
        sp.line(nps, ys, color=color, line_width=2, legend_label=f"predicted, {prof} code")
        sp.scatter(nps, ys, color=color, size=5)
    pub = [r for r in side["rows"] if r["published_speedup"] is not None]
    sp.scatter([r["np"] for r in pub], [r["published_speedup"] for r in pub], color="black", size=11,
               marker="diamond", legend_label="published")
    sp.legend.location = "top_left"
    acc = figure(title="final test accuracy vs np (pending points absent)", width=480, height=360,
                 x_axis_label="np (MPI processes)", y_axis_label="final test accuracy")
    acc.y_range = Range1d(0, 1)
    for i, label in enumerate(side["labels"]):
        pts = [(r["np"], r["studies"][label]["final_test_acc"]) for r in side["rows"]
               if r["studies"][label]["final_test_acc"] is not None]
        color = Category10[10][i % 10]
        if pts:
            acc.line([x for x, _ in pts], [y for _, y in pts], color=color, line_width=2, legend_label=label)
            acc.scatter([x for x, _ in pts], [y for _, y in pts], color=color, size=6, legend_label=label)
    acc.line([min(nps), max(nps)], [judging.CHANCE, judging.CHANCE], color="gray", line_dash="dotted", legend_label="chance")
    acc.legend.location = "top_right"
    acc.legend.label_text_font_size = "8pt"
    return sp, acc
