"""What every pilab figure shares: the panel size, the parts a rank's time splits into and their
colours, the names of the live sources, a figure with pilab's axes and legends, the committed figures,
and the Table and Paragraph a notebook shows as HTML::

    from pilab import plots
    plots.setup_notebook()       # BokehJS inline: works offline, no CDN
"""
from __future__ import annotations

import os
from html import escape
from typing import Any, Sequence

from bokeh.plotting import figure


# Names of the live ColumnDataSources; a browser finds them with doc.get_model_by_name(...).
STEP_SOURCE = "pilab_steps"
EPOCH_SOURCE = "pilab_epochs"
RANK_SOURCE = "pilab_ranks"
LANE_SOURCE = "pilab_lanes"  # the live swim-lane (pilab.plots.run.LiveLanes)

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


# The committed full-size results live in the source tree (a clone, Binder), not in an installed wheel:
# each experiment in experiments/<name>/ beside its driver and log.
EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "experiments")


def show_committed(figure_path: str = "fast-but-wrong/compare.png", caption: str = "") -> None:
    """Display a committed result's figure (``experiments/<figure_path>``) in a notebook, labelled as such, beside
    the small live run a notebook makes; one line saying where to find it outside a clone. Returns
    nothing (a cell showing it prints no stray ``True``)::

        plots.show_committed("fast-but-wrong/compare.png", "the committed study: 15,000 images, 10 epochs")
    """
    from IPython.display import HTML, Image, display

    path = os.path.join(EXPERIMENTS, figure_path)
    if not os.path.exists(path):
        print(f"pilab: the committed figure experiments/{figure_path} is in pilab's source repository, not in this "
              "install")
        return
    display(HTML(f"<b>Committed result, not this notebook's run</b>: <code>experiments/{escape(figure_path)}</code>"
                 + (f" — {escape(caption)}" if caption else "")))
    display(Image(filename=path))


def new_figure(title: str, x_label: str, y_label: str, **kw) -> figure:
    p = figure(title=title, width=kw.pop("width", W), height=kw.pop("height", H),
               x_axis_label=x_label, y_axis_label=y_label, toolbar_location="right",
               tools="pan,wheel_zoom,box_zoom,reset,save", **kw)
    p.toolbar.autohide = True  # on hover only: a screenshot (the report's PNG) shows no toolbar
    p.title.text_font_size = "11pt"
    for axis in (p.xaxis, p.yaxis):  # >= 10 px where the PNG is shown scaled down
        axis.major_label_text_font_size = "12px"
        axis.axis_label_text_font_size = "12px"
    return p


def legend_below(p: figure, ncols: int = 3) -> None:
    """The legend under the plot, off the data (curves that climb to the top right, or start there)."""
    if p.legend:
        legend = p.legend[0]
        p.add_layout(legend, "below")
        legend.orientation, legend.location, legend.ncols = "horizontal", "center", ncols
        legend.label_text_font_size = "10pt"
        legend.click_policy = "hide"
        legend.border_line_alpha = 0
        p.height = H + 40


def legend_outside(p: figure) -> None:
    if p.legend:
        p.legend.location = "top_left"
        p.legend.click_policy = "hide"
        p.legend.label_text_font_size = "10pt"
        p.legend.background_fill_alpha = 0.6


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
