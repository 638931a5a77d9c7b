"""A scaling study's figures against np (speedup, efficiency, accuracy, energy, the per-np curves), its
table, and the whole report page::

    html = bokeh.embed.file_html(plots.report_layout(study), INLINE, "scaling")

A remedies search and a fast-and-right study over seeds: accuracy per candidate, and against the
predicted time on the Pi cluster with the Pareto front named::

    plots.show(plots.remedies_figure(res))

Studies side by side: one per model against np, a comparison's accuracy per epoch per np, and the
published paper's speedups beside pilab's predictions::

    plots.show(plots.models_figure({"MobileNetV2": a, "SqueezeNet 1.1": b}))
"""
from __future__ import annotations

from html import escape
from typing import Mapping

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, HoverTool, LabelSet, Range1d
from bokeh.palettes import Category10
from bokeh.plotting import figure

from .. import verdict as judging
from .base import H, html_table, legend_below, legend_outside, new_figure
from .run import epoch_columns, timeline_figure


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
    q = new_figure(f"accuracy vs predicted time{where}", "predicted training time (s)", "test accuracy")
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
    p = new_figure(f"final test accuracy vs predicted whole-run time on {tab['calibration']}",
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


# ----------------------------------------------------------------------------------------------
# scaling studies
# ----------------------------------------------------------------------------------------------
def _rows(study: Mapping) -> list[Mapping]:
    # judged by pilab.verdict when the study was made: drawn as they are
    return study.get("rows") or []


# What "sim exact" and "sim fast" mean, under any table that shows them.
MODE_NOTE = ("sim exact: the simulator's exact mode, MPI's arithmetic bit for bit; sim fast: its fast mode, the same "
             "mathematics to float rounding (--simulate-mode; auto, the default, runs fast unless the run needs exact "
             "or is long enough to time both)")


def row_kind(row: Mapping) -> str:
    """How a row's run was made: ``measured`` (real MPI ranks), ``sim exact`` or ``sim fast`` (the
    simulator's mode that ran: the row's ``simulate_mode``), ``sim`` where nothing says; a study's row, a
    comparison's or the paper table's::

        [plots.row_kind(r) for r in study["rows"]]     # ['measured', 'measured', 'sim fast', 'sim fast']
    """
    if not row.get("simulated"):
        return "measured"
    return f"sim {row['simulate_mode']}" if row.get("simulate_mode") else "sim"


def table_notes(study: Mapping) -> list[str]:
    """The notes under a table of the study: the verdicts' (pilab.verdict) and, where a row was simulated,
    what its mode means."""
    notes = judging.footnotes(study)
    if any(r.get("simulated") for r in _rows(study)):
        notes.append(MODE_NOTE)
    return notes


def _row_source(study: Mapping) -> ColumnDataSource:
    rows = _rows(study)
    keys = ("np", "speedup", "efficiency", "karp_flatt", "images_per_s", "comm_share",
            "comm_exposed_share", "final_train_acc", "final_test_acc", "time_per_epoch",
            "wall_time", "speedup_to_target")
    cols = {k: [r.get(k) for r in rows] for k in keys}
    p0 = study.get("baseline_np") or (rows[0]["np"] if rows else 1)
    cols["ideal"] = [r["np"] / p0 for r in rows]
    # this machine's speedup beside a target's (measured points, or predicted-here simulated ones)
    base_here = next((r.get("here_time_per_epoch") for r in rows if r["np"] == p0), None)
    cols["here_speedup"] = [base_here / r["here_time_per_epoch"] if base_here and r.get("here_time_per_epoch")
                            else None for r in rows]
    cols["kind"] = [row_kind(r) for r in rows]
    cols["verdict"] = [judging.cell(r) for r in rows]
    cols["color"] = [judging.color(r) for r in rows]
    return ColumnDataSource(cols)


def _np_axis(p: figure, study: Mapping) -> None:
    nps = [r["np"] for r in _rows(study)]
    if nps:
        p.xaxis.ticker = nps
        p.xaxis.major_label_overrides = {n: str(n) for n in nps}


def _np_fig(title: str, y_label: str) -> figure:
    """A figure against np on a log axis: np 1, 2, 8, 48 spread out instead of 1 and 2 run together."""
    return new_figure(title, "processes (np, log scale)", y_label, x_axis_type="log")


def speedup_figure(study: Mapping) -> figure:
    """Measured speedup against np with the ideal line; fast-but-wrong points in red."""
    src = _row_source(study)
    machine = study.get("machine", "this machine")
    p0 = study.get("baseline_np") or 1
    p = _np_fig("speedup vs processes", f"speedup (time per image vs np={p0})")
    p.line("np", "ideal", source=src, color="gray", line_dash="dashed", legend_label="ideal")
    label = "this machine" if machine == "this machine" else f"{machine} (predicted)"
    p.line("np", "speedup", source=src, color="#1f77b4", line_width=2, legend_label=label)
    p.scatter("np", "speedup", source=src, color="color", size=9, legend_label=label)
    if machine != "this machine":
        p.line("np", "here_speedup", source=src, color="#999999", line_width=1.5, legend_label="this machine")
    p.add_tools(HoverTool(tooltips=[("np", "@np"), ("speedup", "@speedup{0.00}"),
                                    ("efficiency", "@efficiency{0%}"), ("", "@verdict (@kind)")]))
    _np_axis(p, study)
    legend_below(p)
    return p


def efficiency_figure(study: Mapping) -> figure:
    """Parallel efficiency and the communication share of step time against np."""
    src = _row_source(study)
    p = _np_fig("efficiency and communication", "fraction")
    rows = _rows(study)
    # the axis fits the data: np below the speed baseline can read above 100% (pilab.verdict)
    top = max([r["efficiency"] for r in rows if r.get("efficiency") is not None] + [1.0])
    p.y_range = Range1d(0, top * 1.12 if top > 1.0 else 1.05)
    noted = [r for r in rows if r.get("efficiency_note") and r.get("efficiency") is not None]
    if noted:
        p0 = study.get("baseline_np")
        p.add_layout(LabelSet(x="np", y="e", text="t", x_offset=8, y_offset=-5, text_font_size="10pt",
                              source=ColumnDataSource({"np": [r["np"] for r in noted],
                                                       "e": [r["efficiency"] for r in noted],
                                                       "t": [f"{r['efficiency']:.0%}* vs np={p0}" for r in noted]})))
    p.line("np", "efficiency", source=src, color="#1f77b4", line_width=2, legend_label="efficiency")
    p.scatter("np", "efficiency", source=src, color="color", size=8, legend_label="efficiency")
    p.line("np", "comm_exposed_share", source=src, color="#e45756", line_width=2,
           legend_label="communication waited for (share of step)")
    p.add_tools(HoverTool(tooltips=[("np", "@np"), ("efficiency", "@efficiency{0%}"),
                                    ("comm waited", "@comm_exposed_share{0%}"),
                                    ("Karp-Flatt", "@karp_flatt{0.000}")]))
    _np_axis(p, study)
    legend_outside(p)
    # below the plot: np=1's point (and its label) sits where a top-left legend would be
    if p.legend:
        legend = p.legend[0]
        p.add_layout(legend, "below")
        legend.orientation, legend.location = "horizontal", "center"
        p.height = H + 40
    return p


def study_accuracy_figure(study: Mapping) -> figure:
    """Final train and test accuracy against np: where faster stops meaning as good."""
    src = _row_source(study)
    p = _np_fig("final accuracy vs processes", "accuracy")
    p.y_range = Range1d(0, 1)
    for key, label, color in (("final_train_acc", "train", Category10[10][0]),
                              ("final_test_acc", "test", Category10[10][1])):
        p.line("np", key, source=src, color=color, line_width=2, legend_label=label)
        p.scatter("np", key, source=src, color=color, size=8, legend_label=label)
    p.add_tools(HoverTool(tooltips=[("np", "@np"), ("train", "@final_train_acc{0.000}"),
                                    ("test", "@final_test_acc{0.000}"), ("", "@verdict")]))
    _np_axis(p, study)
    legend_below(p)
    return p


def _runs(study: Mapping) -> list[tuple[int, Mapping]]:
    runs = study.get("runs") or {}
    return sorted(((int(k), v) for k, v in runs.items()), key=lambda kv: kv[0])


def curves_by_np(study: Mapping):
    """Per-np curves: test accuracy per epoch and training loss per step, one line per np."""
    acc = new_figure("test accuracy per epoch, by np", "epoch", "test accuracy")
    acc.y_range = Range1d(0, 1)
    acc.xaxis.ticker.min_interval = 1
    loss = new_figure("training loss by np", "fraction of training", "loss")
    runs = _runs(study)
    palette = Category10[10]
    # Curves that coincide (np=8 and np=48 both at chance) stay apart by dash and marker, the larger np
    # drawn first and wider, so the smaller one shows on top of it.
    dashes, markers = ("solid", "dashed", "dotted", "dashdot"), ("circle", "square", "triangle", "diamond")
    order = sorted(enumerate(runs), key=lambda x: -x[1][0])
    for i, (np_, res) in order:
        color = palette[i % 10]
        ep = epoch_columns(res)
        pts = [(e, a) for e, a in zip(ep["epoch"], ep["test_acc"]) if a is not None]
        if pts:
            width = 2 + 1.5 * (len(runs) - 1 - i) / max(len(runs) - 1, 1)
            acc.line([p[0] for p in pts], [p[1] for p in pts], color=color, line_width=width,
                     line_dash=dashes[i % 4], legend_label=f"np={np_}")
            acc.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, size=5 + 4 * (len(runs) - 1 - i)
                        / max(len(runs) - 1, 1), marker=markers[i % 4], legend_label=f"np={np_}")
        losses = list((res.get("steps") or {}).get("loss", []))
        if losses:
            # Steps per epoch shrink as np grows: put every run on the same 0..1 axis.
            xs = [(j + 1) / len(losses) for j in range(len(losses))]
            loss.line(xs, losses, color=color, line_width=1.2, legend_label=f"np={np_}")
    for p in (acc, loss):
        # legend in np order, whatever order the curves were drawn in; under the plot: the loss curves
        # start at its top left
        if p.legend:
            p.legend[0].items = sorted(p.legend[0].items, key=lambda it: int(it.label.value.split("=")[1]))
        legend_below(p, ncols=4)
    return row(acc, loss)


def _table(study: Mapping) -> Div:
    head, rows, notes = study_cells(study)
    notes = "".join(f"<p style='font-size:10pt;margin:2px'>{escape(n)}</p>" for n in notes)
    return Div(text=html_table(head, rows) + notes)


def study_cells(study: Mapping, *, steps: bool = False) -> tuple[tuple, list[tuple], list[str]]:
    """(head, rows of cells, notes under the table) of a study, judged by pilab.verdict: the report's
    table, and the narrower one ``pilab.study.tables.table`` shows in a notebook (``steps=True``: each row's kind,
    global batch and optimizer steps -- what fast-but-wrong is about -- instead of images/s, the
    communication share and energy per epoch, which the dashboard plots)."""
    machine = study.get("machine", "this machine")
    two = machine != "this machine"
    runs = study.get("runs") or {}
    rows = []
    for r in _rows(study):
        def f(k, fmt):
            v = r.get(k)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "–"
        missing = "no target" if r.get("target_reached") is None else "not reached"
        kj = (lambda k: format(r[k] / 1e3, ".2f") if r.get(k) is not None else "–")
        n = (runs.get(str(r["np"])) or {}).get("total_steps")
        cells = {
            "np": str(r["np"]),
            "kind": row_kind(r),
            "global batch": f("global_batch", "d"),
            "steps": str(n) if n is not None else "–",
            f"s/epoch ({machine})": f("time_per_epoch", ".1f"),
            "s/epoch (this machine)": f"{f('here_time_per_epoch', '.1f')} ({r.get('here_time_source') or '–'})"
            if two else f("time_per_epoch", ".1f"),
            "speedup": f("speedup", ".2f"),
            "efficiency": f("efficiency", ".0%") + ("*" if r.get("efficiency_note") else ""),
            "images/s": f("images_per_s", ".0f"),
            "comm waited": f("comm_exposed_share", ".0%"),
            "test acc": f("final_test_acc", ".3f"),
            "time to target": f("time_to_target", ".0f") + " s" if r.get("time_to_target") is not None else
            (missing if r.get("time_per_epoch") is not None else "–"),
            "energy/epoch kJ": kj("energy_per_epoch_j"),
            "energy to target kJ": kj("energy_to_target_j") if r.get("energy_to_target_j") is not None else
            (missing if r.get("energy_j") is not None else "–"),
            "verdict": judging.cell(r)}
        rows.append(cells)
    speed = [f"s/epoch ({machine})"] + (["s/epoch (this machine)"] if two else [])
    if steps:
        head = ["np", "kind", "global batch", "steps", *speed, "speedup", "efficiency", "test acc",
                "time to target", "energy to target kJ", "verdict"]
    else:
        head = ["np", *speed, "speedup", "efficiency", "images/s", "comm waited", "test acc", "time to target",
                "energy/epoch kJ", "energy to target kJ", "verdict"]
    return tuple(head), [tuple(c[h] for h in head) for c in rows], table_notes(study)


def energy_figure(study: Mapping) -> figure | None:
    """Energy against time per np, each point labelled with its np and final test accuracy (red:
    fast-but-wrong): what each process count costs in joules and seconds, and what it buys.
    None when the study has no energy figures (this machine without readable RAPL counters)."""
    rows = [r for r in _rows(study) if r.get("energy_j") is not None and r.get("time_per_epoch")]
    if not rows:
        return None
    epochs = {int(k): len(v["epochs"]) for k, v in (study.get("runs") or {}).items()}
    src = ColumnDataSource({
        "np": [r["np"] for r in rows],
        "time": [r["time_per_epoch"] * epochs.get(r["np"], 1) for r in rows],
        "energy_kj": [r["energy_j"] / 1e3 for r in rows],
        "acc": [r["final_test_acc"] for r in rows],
        "label": [f"np={r['np']} ({(r['final_test_acc'] or 0):.0%})" for r in rows],
        "color": [judging.color(r) for r in rows],
        "source": [r.get("energy_source") for r in rows]})
    machine = study.get("machine", "this machine")
    p = new_figure(f"energy vs time vs accuracy ({machine})", "training time, all epochs (s)", "energy (kJ)")
    ts, es = src.data["time"], src.data["energy_kj"]
    # room around the points for their labels; labels of the right half point left, so none is clipped
    pad_t, pad_e = (max(ts) - min(ts)) or max(ts) or 1.0, (max(es) - min(es)) or max(es) or 1.0
    p.x_range = Range1d(min(ts) - 0.08 * pad_t, max(ts) + 0.08 * pad_t)
    p.y_range = Range1d(min(es) - 0.12 * pad_e, max(es) + 0.15 * pad_e)
    mid = (min(ts) + max(ts)) / 2
    src.data["align"] = ["right" if t > mid else "left" for t in ts]
    src.data["dx"] = [-8 if t > mid else 8 for t in ts]
    p.scatter("time", "energy_kj", source=src, color="color", size=10)
    p.add_layout(LabelSet(x="time", y="energy_kj", text="label", source=src, x_offset="dx", y_offset=-5,
                          text_align="align", text_font_size="10pt"))
    p.add_tools(HoverTool(tooltips=[("np", "@np"), ("time", "@time{0.0} s"), ("energy", "@energy_kj{0.00} kJ"),
                                    ("test acc", "@acc{0.000}"), ("source", "@source")]))
    return p


def scaling_dashboard(study: Mapping, *, table: bool = True):
    """Speedup vs ideal, efficiency, accuracy vs np, energy, and the per-np curves of a study; then its
    table (``table=False``: a notebook shows it apart, :func:`study_table`)."""
    # Plain rows and columns: a gridplot nested in columns renders blank in a standalone page.
    energy = energy_figure(study)
    return column(row(speedup_figure(study), efficiency_figure(study)),
                  row(study_accuracy_figure(study), *((energy,) if energy is not None else ())),
                  curves_by_np(study), *((_table(study),) if table else ()))


def report_layout(study: Mapping):
    """Everything the HTML report shows for a study: the dashboard, then the per-rank time split of
    the largest measured run::

        from bokeh.embed import file_html
        from bokeh.resources import INLINE
        html = file_html(plots.report_layout(study), INLINE, "pilab scaling study")
    """
    parts = [scaling_dashboard(study)]
    if study.get("remedies"):  # a remedies search run with the study: its Pareto front
        parts.append(remedies_figure(study["remedies"]))
    measured = [(np_, res) for np_, res in _runs(study)
                if not any(r.get("simulated") for r in _rows(study) if r["np"] == np_)]
    if measured:
        parts.append(timeline_figure(measured[-1][1]))
    return column(*parts)


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
    """Two panels of the paper comparison (:func:`pilab.study.compare.beside_paper`): speedup vs np (published,
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
