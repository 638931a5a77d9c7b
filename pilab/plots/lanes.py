"""A trace drawn as swim lanes: one lane per rank (grouped by host), time across, a rectangle per span
coloured by its name, each bucket's Allreduce a thin bar above its rank's lane (its intra-/inter-node
phases, in a predicted trace, thinner still). Takes a checked trace document (``pilab.trace.format.read``)::

    from pilab.trace import format as tf
    from pilab.plots import lanes as tp
    doc = tf.read("runs/x/trace.json")
    tp.write_html(doc, "runs/x/trace.html")          # Bokeh, zoomable; BokehJS inline (works offline)
    tp.write_step_png(doc, 12, "runs/x/step12.png")  # one step, matplotlib: .png and .svg

``python -m pilab trace RUN_DIR`` calls both. Live, from a traced run's ``lane`` events (rank 0's, each
step: ``pilab.trace.recorder``), :class:`LiveLanes` draws the last steps; ``plots.LivePlot`` shows it under
the per-rank bars when the run has ``trace`` on.
"""
from __future__ import annotations

from collections import deque

from bokeh.models import ColumnDataSource, HoverTool, Range1d
from bokeh.plotting import figure

from ..files import atomic_write_text
from .base import LANE_SOURCE, new_figure

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
