"""One run's figures -- loss, accuracy, throughput, where each rank's time went -- live while it goes
on (:class:`LivePlot`, a ``train.run`` callback) and from its result dict afterwards::

    plots.show(plots.result_layout(result))
"""
from __future__ import annotations

import html
import threading
from typing import Any, Mapping

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, HoverTool, Legend, Range1d
from bokeh.palettes import Category10
from bokeh.plotting import figure

from .. import verdict as judging
from .lanes import LiveLanes
from .base import H, PARTS, PART_LABELS, PART_COLORS, STEP_SOURCE, EPOCH_SOURCE, RANK_SOURCE, _fig, _legend_outside, Paragraph


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
    chance and the verdict floor, pilab.verdict), and where rank 0's wall time went::

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
    return column(Div(text=f"<b>{html.escape(_summary(result))}</b>"),
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
    per-rank time split, a traced run's lane events into the swim-lane of its last steps under it
    (``pilab.plots.lanes.LiveLanes``); a start event clears everything for the new run. Safe to call from the
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
        # a traced run's last steps, rank x time, under the per-rank bars (hidden without trace)
        self.lanes = LiveLanes()
        self.layout = column(self.title, self.note, row(_loss(self.steps), _accuracy(self.epochs)),
                             row(_throughput(self.steps), self.timeline), self.lanes.figure)
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
            elif kind == "lane":
                self.lanes(event)
            elif kind == "end":
                self.title.text = f"<b>{html.escape(_summary(event['result']))}</b>"
                if self._per_rank:  # now the bars can show the whole wall time
                    self.ranks.data = _rank_columns(self._per_rank, self.marks, event["result"])
            elif kind == "error":
                self.title.text = f"<b style='color:#c00'>{html.escape(str(event.get('message', 'run failed')))}</b>"

    def _reset(self, event: Mapping) -> None:
        self.steps.data = {k: [] for k in self.steps.data}
        self.epochs.data = {k: [] for k in self.epochs.data}
        n = int(event.get("np", 1))
        self.ranks.data = _rank_columns({k: [0.0] * n for k in ("compute", "comm", "comm_exposed",
                                                                 "data")})
        self.timeline.y_range.factors = [str(r) for r in range(n)]
        self._per_rank = {}
        self.marks, self.note.text = {}, ""
        self.lanes(event)
        cfg = event.get("config") or {}
        self.title.text = "<b>" + html.escape(f"running on {n} rank(s): {cfg.get('model', '')} width "
                                              f"{cfg.get('width', '')}, {event.get('epochs', '?')} epoch(s) of "
                                              f"{event.get('steps_per_epoch', '?')} steps") + "</b>"

    def _epoch(self, event: Mapping) -> None:
        self.epochs.stream({k: [event.get(k)] for k in self.epochs.data})
        per_rank = event.get("per_rank")
        if per_rank:
            for k, vals in per_rank.items():
                prev = self._per_rank.get(k, [0.0] * len(vals))
                self._per_rank[k] = [a + (b or 0.0) for a, b in zip(prev, vals)]
            self.ranks.data = _rank_columns(self._per_rank, self.marks)

    def _straggler(self, event: Mapping) -> None:
        """Mark each straggler's bar and show the warning line (``pilab.trace.stragglers``)."""
        for s in event.get("stragglers") or []:
            self.marks[int(s["rank"])] = f"{s['kind']} +{100 * s['slowdown']:.0f}%"
        n = len(self.timeline.y_range.factors)
        self.timeline.y_range.factors = [rank_label(r, self.marks) for r in range(n)]
        if self._per_rank:
            self.ranks.data = _rank_columns(self._per_rank, self.marks)
        else:
            self.ranks.data = dict(self.ranks.data, rank=[rank_label(r, self.marks) for r in range(n)])
        self.note.text = f"<span style='color:#b60'>{html.escape(event.get('line', ''))}</span>"
