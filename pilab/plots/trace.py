"""A trace drawn as swim lanes: one lane per rank (grouped by host), time across, a rectangle per span
coloured by its name, each bucket's Allreduce a thin bar above its rank's lane (its intra-/inter-node
phases, in a predicted trace, thinner still). Takes a checked trace document (``pilab.tracefile.read``)::

    from pilab import tracefile as tf
    from pilab.plots import trace as tp
    doc = tf.read("runs/x/trace.json")
    tp.write_html(doc, "runs/x/trace.html")          # Bokeh, zoomable; BokehJS inline (works offline)
    tp.write_step_png(doc, 12, "runs/x/step12.png")  # one step, matplotlib: .png and .svg

``python -m pilab trace RUN_DIR`` calls both.
"""
from __future__ import annotations

from bokeh.models import ColumnDataSource, HoverTool
from bokeh.plotting import figure

from ..files import atomic_write_text

SPAN_COLORS = {"data": "#9d9d9d", "forward": "#72b7b2", "backward": "#4c78a8", "wait": "#e45756",
               "optimizer": "#54a24b", "eval": "#b279a2", "checkpoint": "#9d755d"}
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
    from .static import _pyplot, save

    plt = _pyplot()
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
