"""Bokeh figures for pilab: live while a run goes on, and from result / study dicts afterwards.

Every function takes plain dicts (a ``train.run`` result, a ``pilab.study.scaling.study`` result, or their JSON) and
returns a Bokeh figure or layout, so notebooks and the HTML report draw the same pictures::

    from pilab import plots
    plots.setup_notebook()                 # BokehJS inline: works offline, no CDN
    live = plots.LivePlot()
    live.widget()                          # a jupyter_bokeh BokehModel; display it, then:
    run = lab.train(cfg, callbacks=[live]) # each event streams into the plots

    plots.show(plots.result_layout(result))          # one run: curves + per-rank time split
    html = bokeh.embed.file_html(plots.report_layout(study), INLINE, "scaling")   # the report
"""
from __future__ import annotations

import html

import os
import threading
from html import escape
from typing import Any, Mapping, Sequence

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, HoverTool, LabelSet, Legend, Range1d
from bokeh.palettes import Category10
from bokeh.plotting import figure

from .study import verdict as judging

__all__ = ["setup_notebook", "show", "LivePlot", "loss_figure", "accuracy_figure",
           "throughput_figure", "timeline_figure", "result_layout", "speedup_figure",
           "efficiency_figure", "study_accuracy_figure", "curves_by_np", "scaling_dashboard",
           "report_layout", "remedies_figure", "models_figure", "run_summary", "study_cells", "Table",
           "Paragraph", "STEP_SOURCE", "EPOCH_SOURCE", "RANK_SOURCE"]

# Names of the live ColumnDataSources; a browser finds them with doc.get_model_by_name(...).
STEP_SOURCE = "pilab_steps"
EPOCH_SOURCE = "pilab_epochs"
RANK_SOURCE = "pilab_ranks"

W, H = 430, 260  # one panel, pixels
# How a rank's wall time splits: these parts add up to it (the last two known once the run ended).
# Communication overlapped with the backward pass is *inside* compute, so it is drawn over the compute
# bar, not stacked after it (stacked, the bars added up to more than the run took).
PARTS = ("compute", "comm_exposed", "data", "evaluation", "other")
PART_LABELS = {"compute": "compute", "comm_exposed": "communication (waited for)",
               "comm_hidden": "communication overlapped with compute (inside it)", "data": "data loading",
               "evaluation": "evaluation", "other": "start-up and the rest"}
PART_COLORS = {"compute": "#4c78a8", "comm_exposed": "#e45756", "comm_hidden": "#f2b8b5",
               "data": "#72b7b2", "evaluation": "#b279a2", "other": "#bab0ac"}


def setup_notebook() -> None:
    """Load BokehJS into the notebook page from the installed bokeh package (inline, not the CDN,
    which an offline lab or a Binder behind a proxy cannot reach)."""
    from bokeh.io import output_notebook
    from bokeh.resources import INLINE

    output_notebook(INLINE, hide_banner=True)


def show(obj) -> None:
    """Display a Bokeh figure/layout in a notebook as a jupyter_bokeh widget."""
    from IPython.display import display
    from jupyter_bokeh import BokehModel

    display(BokehModel(obj))


# The committed full-size results live in the source tree (a clone, Binder), not in an installed wheel.
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def show_committed(figure_path: str = "fast-but-wrong/compare.png", caption: str = "") -> None:
    """Display a committed result's figure (``docs/<figure_path>``) in a notebook, labelled as such, beside
    the small live run a notebook makes; one line saying where to find it outside a clone. Returns
    nothing (a cell showing it prints no stray ``True``)::

        plots.show_committed("fast-but-wrong/compare.png", "the committed study: 15,000 images, 10 epochs")
    """
    from IPython.display import HTML, Image, display

    path = os.path.join(DOCS, figure_path)
    if not os.path.exists(path):
        print(f"pilab: the committed figure docs/{figure_path} is in pilab's source repository, not in this "
              "install")
        return
    display(HTML(f"<b>Committed result, not this notebook's run</b>: <code>docs/{escape(figure_path)}</code>"
                 + (f" — {escape(caption)}" if caption else "")))
    display(Image(filename=path))


def _fig(title: str, x_label: str, y_label: str, **kw) -> figure:
    p = figure(title=title, width=kw.pop("width", W), height=kw.pop("height", H),
               x_axis_label=x_label, y_axis_label=y_label, toolbar_location="right",
               tools="pan,wheel_zoom,box_zoom,reset,save", **kw)
    p.toolbar.autohide = True  # on hover only: a screenshot (the report's PNG) shows no toolbar
    p.title.text_font_size = "11pt"
    for axis in (p.xaxis, p.yaxis):  # >= 10 px where the PNG is shown scaled down
        axis.major_label_text_font_size = "12px"
        axis.axis_label_text_font_size = "12px"
    return p


def _legend_below(p: figure, ncols: int = 3) -> None:
    """The legend under the plot, off the data (curves that climb to the top right, or start there)."""
    if p.legend:
        legend = p.legend[0]
        p.add_layout(legend, "below")
        legend.orientation, legend.location, legend.ncols = "horizontal", "center", ncols
        legend.label_text_font_size = "10pt"
        legend.click_policy = "hide"
        legend.border_line_alpha = 0
        p.height = H + 40


def _legend_outside(p: figure) -> None:
    if p.legend:
        p.legend.location = "top_left"
        p.legend.click_policy = "hide"
        p.legend.label_text_font_size = "10pt"
        p.legend.background_fill_alpha = 0.6


# ----------------------------------------------------------------------------------------------
# per-run figures (shared by LivePlot and the static views)
# ----------------------------------------------------------------------------------------------
def _loss(src: ColumnDataSource) -> figure:
    p = _fig("training loss per step", "step", "loss (mean over ranks)")
    p.line("global_step", "loss", source=src, color=Category10[10][0], line_width=1.5)
    p.add_tools(HoverTool(tooltips=[("step", "@global_step"), ("epoch", "@epoch"),
                                    ("loss", "@loss{0.000}"), ("lr", "@lr{0.0000}")]))
    return p


def _accuracy(src: ColumnDataSource) -> figure:
    p = _fig("accuracy per epoch", "epoch", "accuracy")
    p.y_range = Range1d(0, 1)
    p.xaxis.ticker.min_interval = 1  # whole epochs, not 1.5
    for key, label, color in (("train_acc", "train", Category10[10][0]),
                              ("test_acc", "test", Category10[10][1])):
        p.line("epoch", key, source=src, color=color, line_width=2, legend_label=label)
        p.scatter("epoch", key, source=src, color=color, size=6, legend_label=label)
    p.add_tools(HoverTool(tooltips=[("epoch", "@epoch"), ("train", "@train_acc{0.000}"),
                                    ("test", "@test_acc{0.000}")]))
    _legend_outside(p)
    return p


def _throughput(src: ColumnDataSource) -> figure:
    p = _fig("throughput", "step", "images / s (all ranks)")
    p.line("global_step", "images_per_s", source=src, color=Category10[10][2], line_width=1.5)
    return p


def _timeline(src: ColumnDataSource, title: str = "where each rank's time went") -> figure:
    p = _fig(title, "seconds (the run's wall time, once it ended)", "rank",
             y_range=list(src.data["rank"]) or ["0"])
    renderers = p.hbar_stack(list(PARTS), y="rank", height=0.7, source=src,
                             color=[PART_COLORS[k] for k in PARTS])
    hidden = p.hbar(y="rank", left=0, right="comm_hidden", height=0.22, source=src,
                    color=PART_COLORS["comm_hidden"], line_color="#c44")
    items = [(PART_LABELS[k], [r]) for k, r in zip(PARTS, renderers)] + [(PART_LABELS["comm_hidden"], [hidden])]
    legend = Legend(items=items, label_text_font_size="10pt", location="center", ncols=2,
                    orientation="horizontal")
    p.add_layout(legend, "below")
    p.height = H + 90
    p.add_tools(HoverTool(tooltips=[("rank", "@rank"), ("compute", "@compute{0.00} s"),
                                    ("comm waited", "@comm_exposed{0.00} s"),
                                    ("comm overlapped (in compute)", "@comm_hidden{0.00} s"),
                                    ("data", "@data{0.00} s"), ("evaluation", "@evaluation{0.00} s"),
                                    ("start-up, rest", "@other{0.00} s")]))
    return p


def rank_label(rank: int, marks: Mapping[int, str] | None = None) -> str:
    """The per-rank bar's label: ``"2"``, or ``"2 ! compute +45%"`` for a straggler (``marks``)."""
    mark = (marks or {}).get(rank)
    return f"{rank} ! {mark}" if mark else str(rank)


def _rank_columns(per_rank: Mapping[str, list], marks: Mapping[int, str] | None = None,
                  result: Mapping | None = None) -> dict:
    """Columns for the per-rank stacked bars from an epoch record's ``per_rank`` (or sums of them);
    ``marks`` (rank -> short note) marks the stragglers' bars in their labels. With the run's
    ``result``, evaluation and the rest of its wall time (start-up, data set-up, the final sync) are
    added, so each bar is as long as the run took."""
    compute = list(per_rank.get("compute", []))
    n = len(compute)
    comm = list(per_rank.get("comm", [0.0] * n))
    exposed = list(per_rank.get("comm_exposed", [0.0] * n))
    data = list(per_rank.get("data", [0.0] * n))
    evaluation, other = [0.0] * n, [0.0] * n
    if result is not None and result.get("wall_time"):
        ev = sum(e.get("eval_time") or 0.0 for e in result.get("epochs") or [])
        evaluation = [ev] * n
        other = [max(result["wall_time"] - (c + x + d) - ev, 0.0) for c, x, d in zip(compute, exposed, data)]
    return {"rank": [rank_label(r, marks) for r in range(n)], "compute": compute, "comm_exposed": exposed,
            "comm_hidden": [max(c - e, 0.0) for c, e in zip(comm, exposed)], "data": data,
            "evaluation": evaluation, "other": other}


def _sum_per_rank(epochs: list[Mapping]) -> dict:
    total: dict[str, list] = {}
    for e in epochs:
        for k, vals in (e.get("per_rank") or {}).items():
            if k not in total:
                total[k] = [0.0] * len(vals)
            total[k] = [a + (b or 0.0) for a, b in zip(total[k], vals)]
    return total


def _step_columns(result: Mapping) -> dict:
    steps = result.get("steps") or {}
    loss = list(steps.get("loss", []))
    n = len(loss)
    spe = result.get("steps_per_epoch") or max(n, 1)
    start = (result.get("resumed_from_epoch") or 0) * spe
    times = list(steps.get("time", [None] * n))
    gb = result.get("global_batch") or 0
    return {"global_step": list(range(start + 1, start + n + 1)), "loss": loss,
            "lr": list(steps.get("lr", [None] * n)),
            "epoch": [start // spe + i // spe + 1 for i in range(n)],
            "images_per_s": [gb / t if t else None for t in times]}


def _epoch_columns(result: Mapping) -> dict:
    ep = result.get("epochs") or []
    return {k: [e.get(k) for e in ep] for k in
            ("epoch", "train_acc", "test_acc", "train_loss", "test_loss", "images_per_s")}


def loss_figure(result: Mapping) -> figure:
    """Training loss per step of one run."""
    return _loss(ColumnDataSource(_step_columns(result)))


def accuracy_figure(result: Mapping) -> figure:
    """Train and test accuracy per epoch of one run."""
    return _accuracy(ColumnDataSource(_epoch_columns(result)))


def throughput_figure(result: Mapping) -> figure:
    """Images per second at each step of one run."""
    return _throughput(ColumnDataSource(_step_columns(result)))


def timeline_figure(result: Mapping) -> figure:
    """Per-rank compute / communication / data seconds over the whole run, as stacked bars."""
    wall = f", {result['wall_time']:.0f} s in all" if result.get("wall_time") else ""
    return _timeline(ColumnDataSource(_rank_columns(_sum_per_rank(result.get("epochs") or []), result=result)),
                     title=f"where each rank's time went (np={result.get('np', '?')}{wall})")


def _summary(result: Mapping) -> str:
    ep = (result.get("epochs") or [{}])[-1]
    acc = ep.get("test_acc")
    ips = result.get("images_per_s")
    bits = [f"np={result.get('np')}", f"{len(result.get('epochs') or [])} epoch(s)",
            f"test acc {acc:.3f}" if acc is not None else "no test accuracy",
            f"{ips:.0f} images/s" if ips else "",
            f"wall {result.get('wall_time', 0):.1f} s",
            "stopped early" if result.get("stopped_early") else ""]
    return " · ".join(b for b in bits if b)


def run_summary(result: Mapping) -> "Paragraph":
    """What one run showed, in words from its numbers: how it trained, whether it learned (against
    chance and the verdict floor, pilab.study.verdict), and where rank 0's wall time went::

        plots.run_summary(result)          # the last line of a notebook cell
    """
    cfg = result.get("config") or {}
    ep = result.get("epochs") or []
    if not ep:
        return Paragraph("The run ended before its first epoch: nothing to say yet.")
    np_, gb = result.get("np", 1), result.get("global_batch") or 0
    done = result.get("steps_done", result.get("total_steps"))
    model = cfg.get("model", "the model") + (f" (width {cfg['width']:g})" if str(cfg.get("model", "")).startswith(
        "mobilenetv2") else "")
    images = (result.get("data") or {}).get("n_train") or cfg.get("train_subset")
    parts = [f"{np_} rank{'s' if np_ > 1 else ''} trained {model}"
             + (f" on {images:,} images" if images else "")
             + f" for {len(ep)} epoch{'s' if len(ep) > 1 else ''}: {done} synchronous steps of {gb} images"
             + (f" ({gb // np_} per rank), the gradients averaged over the ranks after each" if np_ > 1 else "")
             + "."]
    if result.get("stopped_early"):
        parts.append(f"It was stopped early, after {done} of {result.get('total_steps')} steps.")
    accs = [e.get("test_acc") for e in ep if e.get("test_acc") is not None]
    if accs:
        first, last = accs[0], accs[-1]
        if judging.learned(last):
            parts.append(f"Test accuracy went from {first:.1%} after the first epoch to {last:.1%}: well above "
                         f"chance ({judging.CHANCE:.0%}), so it learned.")
        else:
            parts.append(f"Test accuracy ends at {last:.1%}, near chance ({judging.CHANCE:.0%}): too few steps "
                         "to learn; more epochs (or images) would.")
    cols = _rank_columns(_sum_per_rank(ep), result=result)
    wall = result.get("wall_time")
    if cols["compute"] and wall:
        share = {k: cols[k][0] / wall for k in ("compute", "comm_exposed", "data", "evaluation", "other")}
        parts.append(f"Of its {wall:.0f} s, rank 0 spent {share['compute']:.0%} computing, "
                     f"{share['comm_exposed']:.0%} waiting for the other ranks and the network, "
                     f"{share['data']:.0%} preparing batches, {share['evaluation']:.0%} evaluating and "
                     f"{share['other']:.0%} starting up.")
    if np_ > 1:
        parts.append("Ranks on one machine share its cores, so more ranks here are not faster; whether "
                     "adding nodes pays, and when it turns fast-but-wrong, is 02_strong_scaling's question.")
    return Paragraph(" ".join(parts))


def result_layout(result: Mapping):
    """One run at a glance: loss, accuracy, throughput and the per-rank time split."""
    return column(Div(text=f"<b>{_summary(result)}</b>"),
                  row(loss_figure(result), accuracy_figure(result)),
                  row(throughput_figure(result), timeline_figure(result)))


# ----------------------------------------------------------------------------------------------
# live
# ----------------------------------------------------------------------------------------------
class LivePlot:
    """Plots that follow a run: call it with each train event (it is a ``train.run`` callback)::

        live = plots.LivePlot()
        live.widget()                               # display first (a jupyter_bokeh BokehModel)
        result = train.run(cfg, callbacks=[live])   # or lab.train(cfg, callbacks=[live])

    Step events stream into the loss and throughput plots, epoch events into the accuracy plot and the
    per-rank time split; a start event clears everything for the new run. Safe to call from the
    watcher thread of a :class:`pilab.lab.cluster.Run` (updates are serialised).
    """

    def __init__(self):
        self.steps = ColumnDataSource({"global_step": [], "loss": [], "lr": [], "epoch": [],
                                       "images_per_s": []}, name=STEP_SOURCE)
        self.epochs = ColumnDataSource({k: [] for k in ("epoch", "train_acc", "test_acc",
                                                        "train_loss", "test_loss", "images_per_s")},
                                       name=EPOCH_SOURCE)
        self.ranks = ColumnDataSource(_rank_columns({}), name=RANK_SOURCE)
        self.title = Div(text="<b>waiting for a run</b>", name="pilab_status")
        self.timeline = _timeline(self.ranks)
        self.note = Div(text="", name="pilab_straggler_note")  # the last straggler warning line
        # rows, not a gridplot: a gridplot aligned the throughput plot's frame with the taller time split
        # beside it and squashed it (overlapping ticks)
        self.layout = column(self.title, self.note, row(_loss(self.steps), _accuracy(self.epochs)),
                             row(_throughput(self.steps), self.timeline))
        self._lock = threading.Lock()
        self._widget = None
        self._per_rank: dict[str, list] = {}
        self._epochs_done = 0
        self.marks: dict[int, str] = {}  # stragglers: rank -> "compute +45%" (their bars' labels)


    def widget(self):
        """The jupyter_bokeh widget showing these plots (one per LivePlot)."""
        if self._widget is None:
            from jupyter_bokeh import BokehModel

            self._widget = BokehModel(self.layout)
        return self._widget

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget())

    def __call__(self, event: Mapping[str, Any]) -> None:
        kind = event.get("kind")
        with self._lock:
            if kind == "start":
                self._reset(event)
            elif kind == "step":
                self.steps.stream({"global_step": [event["global_step"]], "loss": [event["loss"]],
                                   "lr": [event["lr"]], "epoch": [event["epoch"]],
                                   "images_per_s": [event["images_per_s"]]})
            elif kind == "epoch":
                self._epoch(event)
            elif kind == "straggler":
                self._straggler(event)
            elif kind == "end":
                self.title.text = f"<b>{_summary(event['result'])}</b>"
                if self._per_rank:  # now the bars can show the whole wall time
                    self.ranks.data = _rank_columns(self._per_rank, self.marks, event["result"])
            elif kind == "error":
                self.title.text = f"<b style='color:#c00'>{event.get('message', 'run failed')}</b>"

    def _reset(self, event: Mapping) -> None:
        self.steps.data = {k: [] for k in self.steps.data}
        self.epochs.data = {k: [] for k in self.epochs.data}
        n = int(event.get("np", 1))
        self.ranks.data = _rank_columns({k: [0.0] * n for k in ("compute", "comm", "comm_exposed",
                                                                 "data")})
        self.timeline.y_range.factors = [str(r) for r in range(n)]
        self._per_rank = {}
        self.marks, self.note.text = {}, ""
        cfg = event.get("config") or {}
        self.title.text = (f"<b>running on {n} rank(s): {cfg.get('model', '')} width "
                           f"{cfg.get('width', '')}, {event.get('epochs', '?')} epoch(s) of "
                           f"{event.get('steps_per_epoch', '?')} steps</b>")

    def _epoch(self, event: Mapping) -> None:
        self.epochs.stream({k: [event.get(k)] for k in self.epochs.data})
        per_rank = event.get("per_rank")
        if per_rank:
            for k, vals in per_rank.items():
                prev = self._per_rank.get(k, [0.0] * len(vals))
                self._per_rank[k] = [a + (b or 0.0) for a, b in zip(prev, vals)]
            self.ranks.data = _rank_columns(self._per_rank, self.marks)

    def _straggler(self, event: Mapping) -> None:
        """Mark each straggler's bar and show the warning line (``pilab.engine.stragglers``)."""
        for s in event.get("stragglers") or []:
            self.marks[int(s["rank"])] = f"{s['kind']} +{100 * s['slowdown']:.0f}%"
        n = len(self.timeline.y_range.factors)
        self.timeline.y_range.factors = [rank_label(r, self.marks) for r in range(n)]
        if self._per_rank:
            self.ranks.data = _rank_columns(self._per_rank, self.marks)
        else:
            self.ranks.data = dict(self.ranks.data, rank=[rank_label(r, self.marks) for r in range(n)])
        self.note.text = f"<span style='color:#b60'>{html.escape(event.get('line', ''))}</span>"


# ----------------------------------------------------------------------------------------------
# scaling studies
# ----------------------------------------------------------------------------------------------
def _rows(study: Mapping) -> list[Mapping]:
    # judged by pilab.study.verdict (the one logic), so a committed older study.json draws the same verdicts
    return judging.judge_study(study)["rows"] if study.get("rows") else []


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
    cols["kind"] = ["simulated" if r.get("simulated") else "measured" for r in rows]
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
    return _fig(title, "processes (np, log scale)", y_label, x_axis_type="log")


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
    _legend_below(p)
    return p


def efficiency_figure(study: Mapping) -> figure:
    """Parallel efficiency and the communication share of step time against np."""
    src = _row_source(study)
    p = _np_fig("efficiency and communication", "fraction")
    rows = _rows(study)
    # the axis fits the data: np below the speed baseline can read above 100% (pilab.study.verdict)
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
    _legend_outside(p)
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
    _legend_below(p)
    return p


def _runs(study: Mapping) -> list[tuple[int, Mapping]]:
    runs = study.get("runs") or {}
    return sorted(((int(k), v) for k, v in runs.items()), key=lambda kv: kv[0])


def curves_by_np(study: Mapping):
    """Per-np curves: test accuracy per epoch and training loss per step, one line per np."""
    acc = _fig("test accuracy per epoch, by np", "epoch", "test accuracy")
    acc.y_range = Range1d(0, 1)
    acc.xaxis.ticker.min_interval = 1
    loss = _fig("training loss by np", "fraction of training", "loss")
    runs = _runs(study)
    palette = Category10[10]
    # Curves that coincide (np=8 and np=48 both at chance) stay apart by dash and marker, the larger np
    # drawn first and wider, so the smaller one shows on top of it.
    dashes, markers = ("solid", "dashed", "dotted", "dashdot"), ("circle", "square", "triangle", "diamond")
    order = sorted(enumerate(runs), key=lambda x: -x[1][0])
    for i, (np_, res) in order:
        color = palette[i % 10]
        ep = _epoch_columns(res)
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
        _legend_below(p, ncols=4)
    return row(acc, loss)


def _table(study: Mapping) -> Div:
    head, rows, notes = study_cells(study)
    notes = "".join(f"<p style='font-size:10pt;margin:2px'>{escape(n)}</p>" for n in notes)
    return Div(text=html_table(head, rows) + notes)


def study_cells(study: Mapping, *, steps: bool = False) -> tuple[tuple, list[tuple], list[str]]:
    """(head, rows of cells, notes under the table) of a study, judged by pilab.study.verdict: the report's
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
            "kind": "simulated" if r.get("simulated") else "measured",
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
    return tuple(head), [tuple(c[h] for h in head) for c in rows], judging.footnotes(judging.judge_study(study))


class Table(str):
    """A table that a notebook shows as HTML (the last expression of a cell) and that is its plain text
    everywhere else (``print``, a terminal, ``in``, ``splitlines``)::

        t = plots.Table("np  test acc\n 1  0.338", ["np", "test acc"], [[1, "0.338"]], caption="...")
        t                                  # in a notebook: an HTML table, its notes, the caption

    ``notes`` go under the table, ``caption`` (a paragraph: the verdict) under them. The HTML marks the
    table ``class="pilab-table"`` with ``data-kind``, and each cell with its column's name
    (``data-col``), so a browser test reads what a person reads.
    """

    def __new__(cls, text: str, head: Sequence[str], rows: Sequence[Sequence[Any]], *,
                notes: Sequence[str] = (), caption: str = "", kind: str = "table"):
        self = super().__new__(cls, text)
        self.head, self.rows = [str(h) for h in head], [[str(c) for c in r] for r in rows]
        self.notes, self.caption, self.kind = list(notes), caption, kind
        return self

    def _repr_html_(self) -> str:
        cell = "padding:3px 8px;text-align:right;vertical-align:top"
        out = (f"<table class='pilab-table' data-kind='{escape(self.kind)}' "
               "style='border-collapse:collapse;font-size:13px'><thead><tr>"
               + "".join(f"<th style='{cell};border-bottom:1px solid #999'>{escape(h)}</th>" for h in self.head)
               + "</tr></thead><tbody>")
        for r in self.rows:
            # short cells stay on one line; a verdict with its reason may wrap
            out += "<tr>" + "".join(f"<td data-col='{escape(h)}' style='{cell}"
                                    f"{';white-space:nowrap' if len(c) < 24 else ';min-width:160px'}'>"
                                    f"{escape(c)}</td>" for h, c in zip(self.head, r)) + "</tr>"
        out += "</tbody></table>"
        out += "".join(f"<p style='font-size:12px;margin:4px 0'>{escape(n)}</p>" for n in self.notes)
        if self.caption:
            out += f"<p class='pilab-verdict' style='max-width:900px'>{escape(self.caption)}</p>"
        return out

    def __repr__(self) -> str:
        return str(self)


class Paragraph(str):
    """Text a notebook shows as a paragraph (not as a quoted string); still a ``str`` everywhere else::

        plots.Paragraph("np=8 ended at chance.")     # the last expression of a cell
    """

    title = "What this shows"

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        paras = [escape(p) for p in str(self).split("\n\n") if p.strip()] or [""]
        paras[0] = f"<b>{escape(self.title)}.</b> " + paras[0]
        return ("<div class='pilab-summary' style='max-width:900px;border-left:4px solid #4c78a8;"
                "padding:2px 12px;background:#f5f8fc'>" + "".join(f"<p>{p}</p>" for p in paras) + "</div>")


def html_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain, escaped HTML table for a Bokeh ``Div``: ``Div(text=html_table(["np"], [[1], [2]]))``."""
    import html as _html

    out = "<table style='border-collapse:collapse;font-size:11pt'>"
    out += "<tr>" + "".join(f"<th style='padding:2px 8px;border-bottom:1px solid #999'>"
                            f"{_html.escape(str(h))}</th>" for h in head) + "</tr>"
    for cells in rows:
        out += "<tr>" + "".join(f"<td style='padding:2px 8px;text-align:right'>"
                                f"{_html.escape(str(c))}</td>" for c in cells) + "</tr>"
    return out + "</table>"


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
    p = _fig(f"energy vs time vs accuracy ({machine})", "training time, all epochs (s)", "energy (kJ)")
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
    """A fast-and-right study over seeds (:func:`pilab.study.seeds.table`): each row's final accuracy (mean,
    with its seeds' sd) against its predicted whole-run time on the Pi cluster (log scale), np=1 as squares,
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
