"""One run's figures -- loss, accuracy, throughput, where each rank's time went -- live while it goes
on (:class:`LivePlot`, a ``pilab.train`` callback) and from its result dict afterwards::

    plots.show(plots.result_layout(result))

A trace drawn as swim lanes: one lane per rank (grouped by host), time across, a rectangle per span
coloured by its name, each bucket's Allreduce a thin bar above its rank's lane (its intra-/inter-node
phases, in a predicted trace, thinner still). Takes a checked trace document (``pilab.trace.format.read``)::

    from pilab.trace import format as tf
    from pilab.plots import run as tp
    doc = tf.read("runs/x/trace.json")
    tp.write_html(doc, "runs/x/trace.html")          # Bokeh, zoomable; BokehJS inline (works offline)
    tp.write_step_png(doc, 12, "runs/x/step12.png")  # one step, matplotlib: .png and .svg

``python -m pilab trace RUN_DIR`` calls both. Live, from a traced run's ``lane`` events (rank 0's, each
step: ``pilab.trace.recorder``), :class:`LiveLanes` draws the last steps; ``plots.LivePlot`` shows it under
the per-rank bars when the run has ``trace`` on.
"""
from __future__ import annotations

import html
import threading
from collections import deque
from typing import Any, Mapping

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, HoverTool, Legend, Range1d
from bokeh.palettes import Category10
from bokeh.plotting import figure

from .. import verdict as judging
from ..files import atomic_write_text
from .base import (EPOCH_SOURCE, LANE_SOURCE, PARTS, PART_COLORS, PART_LABELS, RANK_SOURCE, STEP_SOURCE, H,
                   Paragraph, legend_outside, new_figure)


SPAN_COLORS = {"data": "#9d9d9d", "forward": "#72b7b2", "backward": "#4c78a8", "wait": "#e45756",
               "optimizer": "#54a24b", "eval": "#b279a2", "checkpoint": "#9d755d",
               "data+forward+backward": "#4c78a8"}  # the live lane's estimate for ranks other than 0
BUCKET_COLOR = "#f58518"
PHASE_COLORS = {"intra": "#ffbf79", "inter": "#b35806"}
OTHER_COLOR = "#bab0ac"


def lanes(doc: dict) -> tuple[list, dict]:
    """([(pid, tid, label)] top to bottom, {(pid, tid): row}): one row per rank, grouped by host."""
    pname, tname, tracks = {}, {}, set()
    for ev in doc["traceEvents"]:
        if ev["ph"] == "M" and ev["name"] == "process_name":
            pname[ev["pid"]] = ev["args"]["name"]
        elif ev["ph"] == "M" and ev["name"] == "thread_name":
            tname[(ev["pid"], ev["tid"])] = ev["args"]["name"]
        elif ev["ph"] != "M":
            tracks.add((ev["pid"], ev["tid"]))
    order = sorted(tracks)
    rows = [(p, t, f"{pname.get(p, f'host {p}')} · {tname.get((p, t), f'rank {t}')}") for p, t in order]
    return rows, {(p, t): i for i, (p, t, _) in enumerate(rows)}


def shapes(doc: dict, step: int | None = None) -> list[dict]:
    """Every span and flight as a rectangle: {kind: span|flight|phase, name, row, start, end (us),
    step}; ``step``: only that step's."""
    _, row = lanes(doc)
    out, begins = [], {}
    for ev in doc["traceEvents"]:
        args = ev.get("args") or {}
        if ev["ph"] == "X":
            if step is None or args.get("step") == step:
                out.append({"kind": "span", "name": ev["name"], "row": row[(ev["pid"], ev["tid"])],
                            "start": ev["ts"], "end": ev["ts"] + ev["dur"], "step": args.get("step")})
        elif ev["ph"] == "b":
            begins[(ev.get("cat"), ev["id"])] = ev
        elif ev["ph"] == "e":
            b = begins.pop((ev.get("cat"), ev["id"]), None)
            if b is None or (step is not None and (b.get("args") or {}).get("step") != step):
                continue
            kind = "phase" if b.get("cat") == "allreduce-phase" else "flight"
            out.append({"kind": kind, "name": b["name"], "row": row[(b["pid"], b["tid"])], "start": b["ts"],
                        "end": ev["ts"], "step": (b.get("args") or {}).get("step"),
                        "phase": (b.get("args") or {}).get("phase"), "bucket": (b.get("args") or {}).get("bucket")})
    return out


def _color(s: dict) -> str:
    if s["kind"] == "span":
        return SPAN_COLORS.get(s["name"], OTHER_COLOR)
    if s["kind"] == "phase":
        return PHASE_COLORS.get(s["phase"], BUCKET_COLOR)
    return BUCKET_COLOR


# where a shape sits in its lane (row r is drawn at y = -r, from -r-0.5 to -r+0.5): (centre's offset up,
# height); bucket flights above the spans, their phases above them
# (odd buckets a notch higher than even ones, so that queued buckets stay apart)
_PLACE = {"span": (-0.1, 0.55), "flight": (0.22, 0.08), "phase": (0.43, 0.06)}


def _place(s: dict) -> tuple[float, float]:
    off, h = _PLACE[s["kind"]]
    return (off + 0.1, h) if s["kind"] == "flight" and (s.get("bucket") or 0) % 2 else (off, h)


def swimlane(doc: dict, title: str = "trace"):
    """The Bokeh figure: x in milliseconds from the trace's start, y one lane per rank."""
    rows, _ = lanes(doc)
    sh = shapes(doc)
    t0 = min((s["start"] for s in sh), default=0.0)
    src = {k: [] for k in ("left", "right", "top", "bottom", "color", "name", "step", "ms")}
    for s in sh:
        off, h = _place(s)
        y = -s["row"] + off  # row 0 at the top
        src["left"].append((s["start"] - t0) / 1e3)
        src["right"].append((s["end"] - t0) / 1e3)
        src["top"].append(y + h / 2)
        src["bottom"].append(y - h / 2)
        src["color"].append(_color(s))
        src["name"].append(s["name"])
        src["step"].append(s["step"])
        src["ms"].append((s["end"] - s["start"]) / 1e3)
    p = figure(title=title, height=max(220, 40 + 34 * len(rows)), sizing_mode="stretch_width",
               x_axis_label="ms from the trace's start", tools="xpan,xwheel_zoom,box_zoom,reset,save",
               active_scroll="xwheel_zoom", y_range=(-len(rows) + 0.4, 0.6))
    p.quad(source=ColumnDataSource(src), left="left", right="right", top="top", bottom="bottom",
           fill_color="color", line_color=None)
    p.add_tools(HoverTool(tooltips=[("", "@name"), ("step", "@step"), ("ms", "@ms{0.000}")]))
    p.yaxis.ticker = [-i for i in range(len(rows))]
    p.yaxis.major_label_overrides = {-i: label for i, (_, _, label) in enumerate(rows)}
    p.ygrid.grid_line_color = None
    return p


def write_html(doc: dict, path: str, title: str = "pilab trace") -> str:
    """The swim-lane page at ``path``, BokehJS inline (no CDN: it opens offline); returns ``path``."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    atomic_write_text(path, file_html(swimlane(doc, title), INLINE, title))
    return path


def write_step_png(doc: dict, step: int, png_path: str) -> str:
    """One step's lanes as a static figure (``png_path`` and the same name with .svg), x in ms from the
    step's start; returns the PNG's path."""
    from .static import get_pyplot, save

    plt = get_pyplot()
    rows, _ = lanes(doc)
    sh = shapes(doc, step)
    t0 = min((s["start"] for s in sh), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.4 * len(rows)))
    seen = set()
    for s in sh:
        off, h = _place(s)
        label = s["name"] if s["kind"] == "span" else ("bucket Allreduce" if s["kind"] == "flight"
                                                       else f"{s['phase']}-node phase")
        ax.broken_barh([((s["start"] - t0) / 1e3, (s["end"] - s["start"]) / 1e3)], (-s["row"] + off - h / 2, h),
                       facecolors=_color(s), label=None if label in seen else label)
        seen.add(label)
    ax.set_yticks([-i for i in range(len(rows))], [label for _, _, label in rows])
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.set_xlabel(f"ms from step {step}'s start")
    ax.set_title(f"step {step}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return save(fig, png_path)


# ----------------------------------------------------------------------------------------------
# live: the last steps from rank 0's lane events
# ----------------------------------------------------------------------------------------------
LANE_STEPS = 4  # steps the live swim-lane shows
_LANE_KEYS = ("left", "right", "top", "bottom", "color", "alpha", "name", "step", "ms", "rank")


def lane_columns(events, keep: int = LANE_STEPS) -> dict:
    """The live swim-lane's columns from ``lane`` events (``pilab.trace.recorder``): the last ``keep``
    steps' spans and bucket flights as rectangles, x in ms from the first kept step's start, rank r's
    lane at y = -r; estimated spans (another MPI rank's) drawn paler and named so."""
    evs = sorted(events, key=lambda e: e["global_step"])[-keep:] if keep else []
    cols = {k: [] for k in _LANE_KEYS}
    t0 = min((s[2] for e in evs for s in e["spans"]), default=0.0)
    shapes = [({"kind": "span", "name": n}, r, b, e, est, ev["global_step"]) for ev in evs
              for r, n, b, e, est in ev["spans"]]
    shapes += [({"kind": "flight", "name": f"bucket {k}", "bucket": k}, r, a, b, 0, ev["global_step"])
               for ev in evs for r, k, _, a, b in ev["flights"]]
    for s, r, b, e, est, g in shapes:
        off, h = _place(s)
        cols["left"].append((b - t0) * 1e3)
        cols["right"].append((e - t0) * 1e3)
        cols["top"].append(-r + off + h / 2)
        cols["bottom"].append(-r + off - h / 2)
        cols["color"].append(_color(s))
        cols["alpha"].append(0.45 if est else 1.0)
        cols["name"].append(s["name"] + (" (estimated)" if est else ""))
        cols["step"].append(g)
        cols["ms"].append((e - b) * 1e3)
        cols["rank"].append(r)
    return cols


class LiveLanes:
    """The swim-lane of a traced run's last ``keep`` steps, live: call it with each train event (a
    ``pilab.train`` callback, or through ``plots.LivePlot``)::

        lanes = LiveLanes()
        plots.show(lanes.figure)
        pilab.train(Config(trace=True, ...), comm, callbacks=[lanes])

    Rank 0's lane is measured; the other ranks' come from the per-rank times rank 0 receives with each
    step's last gradient (see ``pilab.trace.recorder.Trace._lane``): their compute, and the wait after it.
    The figure is hidden until a run with ``trace`` on starts."""

    def __init__(self, keep: int = LANE_STEPS):
        self.keep = keep
        self.events: deque = deque(maxlen=keep)
        self.source = ColumnDataSource({k: [] for k in _LANE_KEYS}, name=LANE_SOURCE)
        p = new_figure(f"every rank's last {keep} steps (trace on: rank 0 measured, the others estimated)",
                 "ms (rank 0's clock, from the first step shown)", "", y_range=Range1d(-0.6, 0.6))
        p.width = 2 * p.width
        p.quad(source=self.source, left="left", right="right", top="top", bottom="bottom", fill_color="color",
               fill_alpha="alpha", line_color=None)
        p.add_tools(HoverTool(tooltips=[("rank", "@rank"), ("", "@name"), ("step", "@step"), ("ms", "@ms{0.000}")]))
        p.ygrid.grid_line_color = None
        p.visible = False
        self.figure = p
        self._ranks(1)

    def _ranks(self, n: int) -> None:
        self.figure.y_range.start, self.figure.y_range.end = -n + 0.4, 0.6
        self.figure.yaxis.ticker = [-r for r in range(n)]
        self.figure.yaxis.major_label_overrides = {-r: f"rank {r}" for r in range(n)}

    def __call__(self, event) -> None:
        kind = event.get("kind")
        if kind == "start":
            self.events.clear()
            self.source.data = {k: [] for k in _LANE_KEYS}
            self._ranks(int(event.get("np", 1)))
            self.figure.visible = bool((event.get("config") or {}).get("trace"))
        elif kind == "lane":
            self.events.append(event)
            self.figure.visible = True
            self.source.data = lane_columns(self.events, self.keep)


# ----------------------------------------------------------------------------------------------
# per-run figures (shared by LivePlot and the static views)
# ----------------------------------------------------------------------------------------------
def _loss(src: ColumnDataSource) -> figure:
    p = new_figure("training loss per step", "step", "loss (mean over ranks)")
    p.line("global_step", "loss", source=src, color=Category10[10][0], line_width=1.5)
    p.add_tools(HoverTool(tooltips=[("step", "@global_step"), ("epoch", "@epoch"),
                                    ("loss", "@loss{0.000}"), ("lr", "@lr{0.0000}")]))
    return p


def _accuracy(src: ColumnDataSource) -> figure:
    p = new_figure("accuracy per epoch", "epoch", "accuracy")
    p.y_range = Range1d(0, 1)
    p.xaxis.ticker.min_interval = 1  # whole epochs, not 1.5
    for key, label, color in (("train_acc", "train", Category10[10][0]),
                              ("test_acc", "test", Category10[10][1])):
        p.line("epoch", key, source=src, color=color, line_width=2, legend_label=label)
        p.scatter("epoch", key, source=src, color=color, size=6, legend_label=label)
    p.add_tools(HoverTool(tooltips=[("epoch", "@epoch"), ("train", "@train_acc{0.000}"),
                                    ("test", "@test_acc{0.000}")]))
    legend_outside(p)
    return p


def _throughput(src: ColumnDataSource) -> figure:
    p = new_figure("throughput", "step", "images / s (all ranks)")
    p.line("global_step", "images_per_s", source=src, color=Category10[10][2], line_width=1.5)
    return p


def _timeline(src: ColumnDataSource, title: str = "where each rank's time went") -> figure:
    p = new_figure(title, "seconds (the run's wall time, once it ended)", "rank",
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


def rank_label(rank: int, marks: Mapping[int, str] | None = None, shares: list | None = None) -> str:
    """The per-rank bar's label: ``"2"``, ``"2 ! compute +45%"`` for a straggler (``marks``), and with uneven
    shares (``Config.balance``: ``shares``, each rank's images a step) ``"2 · 20 img ! compute +45%"``."""
    mark = (marks or {}).get(rank)
    name = f"{rank} · {shares[rank]} img" if shares and rank < len(shares) else str(rank)
    return f"{name} ! {mark}" if mark else name


def _rank_columns(per_rank: Mapping[str, list], marks: Mapping[int, str] | None = None,
                  result: Mapping | None = None, shares: list | None = None) -> dict:
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
    return {"rank": [rank_label(r, marks, shares) for r in range(n)], "compute": compute, "comm_exposed": exposed,
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


def epoch_columns(result: Mapping) -> dict:
    ep = result.get("epochs") or []
    return {k: [e.get(k) for e in ep] for k in
            ("epoch", "train_acc", "test_acc", "train_loss", "test_loss", "images_per_s")}


def loss_figure(result: Mapping) -> figure:
    """Training loss per step of one run."""
    return _loss(ColumnDataSource(_step_columns(result)))


def accuracy_figure(result: Mapping) -> figure:
    """Train and test accuracy per epoch of one run."""
    return _accuracy(ColumnDataSource(epoch_columns(result)))


def throughput_figure(result: Mapping) -> figure:
    """Images per second at each step of one run."""
    return _throughput(ColumnDataSource(_step_columns(result)))


def timeline_figure(result: Mapping) -> figure:
    """Per-rank compute / communication / data seconds over the whole run, as stacked bars."""
    wall = f", {result['wall_time']:.0f} s in all" if result.get("wall_time") else ""
    shares = (result.get("balance") or {}).get("shares")  # uneven shares: each bar says its rank's images a step
    return _timeline(ColumnDataSource(_rank_columns(_sum_per_rank(result.get("epochs") or []), result=result,
                                                    shares=shares)),
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
    """Plots that follow a run: call it with each train event (it is a ``pilab.train`` callback)::

        live = plots.LivePlot()
        live.widget()                               # display first (a jupyter_bokeh BokehModel)
        result = pilab.train(cfg, callbacks=[live])   # or lab.train(cfg, callbacks=[live])

    Step events stream into the loss and throughput plots, epoch events into the accuracy plot and the
    per-rank time split, a traced run's lane events into the swim-lane of its last steps under it
    (``pilab.plots.run.LiveLanes``); with uneven shares (``Config.balance``) each rank's bar is labelled with
    its images a step, from the ``shares`` events (``pilab.engine.balance.Balance``) and each epoch's record;
    a start event clears everything for the new run. Safe to call from the
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
        self.shares: list | None = None  # uneven shares: each rank's images a step (their bars' labels)


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
            elif kind == "shares":
                self.shares = list(event["shares"])
                self._relabel()
            elif kind == "end":
                self.title.text = f"<b>{html.escape(_summary(event['result']))}</b>"
                if self._per_rank:  # now the bars can show the whole wall time
                    self.ranks.data = _rank_columns(self._per_rank, self.marks, event["result"], self.shares)
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
        self.marks, self.note.text, self.shares = {}, "", None
        self.lanes(event)
        cfg = event.get("config") or {}
        self.title.text = "<b>" + html.escape(f"running on {n} rank(s): {cfg.get('model', '')} width "
                                              f"{cfg.get('width', '')}, {event.get('epochs', '?')} epoch(s) of "
                                              f"{event.get('steps_per_epoch', '?')} steps") + "</b>"

    def _epoch(self, event: Mapping) -> None:
        self.epochs.stream({k: [event.get(k)] for k in self.epochs.data})
        per_rank = event.get("per_rank")
        if event.get("shares"):
            self.shares = list(event["shares"])
        if per_rank:
            for k, vals in per_rank.items():
                prev = self._per_rank.get(k, [0.0] * len(vals))
                self._per_rank[k] = [a + (b or 0.0) for a, b in zip(prev, vals)]
        self._relabel()

    def _straggler(self, event: Mapping) -> None:
        """Mark each straggler's bar and show the warning line (``pilab.trace.stragglers``)."""
        for s in event.get("stragglers") or []:
            self.marks[int(s["rank"])] = f"{s['kind']} +{100 * s['slowdown']:.0f}%"
        self._relabel()
        self.note.text = f"<span style='color:#b60'>{html.escape(event.get('line', ''))}</span>"

    def _relabel(self) -> None:
        """The bars and their axis labelled with the marks and shares known now (the two must agree)."""
        n = len(self.timeline.y_range.factors)
        self.timeline.y_range.factors = [rank_label(r, self.marks, self.shares) for r in range(n)]
        if self._per_rank:
            self.ranks.data = _rank_columns(self._per_rank, self.marks, shares=self.shares)
        else:
            self.ranks.data = dict(self.ranks.data, rank=[rank_label(r, self.marks, self.shares) for r in range(n)])
