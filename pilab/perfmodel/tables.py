"""Markdown output: predictions and the Pi table as GitHub tables.

    from pilab.perfmodel import markdown_table, pi_table_markdown, predict_table
    print(markdown_table(predict_table(Config(), [2, 4, 8], "pi4b_cluster"), TABLE_COLUMNS))
    print(pi_table_markdown())          # the Pi table beside the published figures (docs/perfmodel.md)
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from .predict import pi_table

# the columns `pilab perfmodel table` prints of each predict() row
TABLE_COLUMNS = ["np", "nodes", "threads", "per_rank_batch", "steps_per_epoch", "step_time",
                 "time", "comm", "comm_exposed", "eval_time", "epoch_time", "images_per_s",
                 "speedup", "efficiency"]
# the columns of the Pi table in docs/perfmodel.md
PI_TABLE_COLUMNS = ["np", "nodes", "published_speedup", "published_efficiency", "naive_speedup",
                    "naive_efficiency", "pilab_speedup", "pilab_efficiency", "naive_epoch_s",
                    "pilab_epoch_s"]


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   digits: int = 3) -> str:
    """A GitHub Markdown table of ``rows`` (None shows as an em dash; fractions named *efficiency*
    as percentages)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())

    def fmt(k, v):
        if v is None:
            return "—"
        if isinstance(v, float):
            if math.isnan(v):
                return "—"
            if "efficiency" in k:
                return f"{100 * v:.1f}%"
            return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(k, r.get(k)) for k in columns) + " |" for r in rows]
    return "\n".join(lines)


def pi_table_markdown(cfg=None, **kwargs) -> str:
    """``pi_table(cfg, **kwargs)`` as Markdown: speedups, efficiencies and epoch times.

        pi_table_markdown(nps=(2, 4, 48))
    """
    return markdown_table(pi_table(cfg, **kwargs), PI_TABLE_COLUMNS)
