"""Predictions over several np (``predict_table``, the Pi table) and as GitHub tables.

    from pilab.perfmodel import markdown_table, pi_table_markdown, predict_table
    print(markdown_table(predict_table(Config(), [2, 4, 8], "pi4b_cluster"), TABLE_COLUMNS))
    print(pi_table_markdown())          # the Pi table beside the published figures (docs/perfmodel.md)
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from ..config import ConfigError
from .predict import _as_config, predict
from .presets import PI_TABLE_NPS, PUBLISHED, pi4b_cluster, pi_config, published_table, resolve_cluster

def predict_table(cfg, nps: Iterable[int], cluster, profile: str = "pilab",
                  baseline_np: int | None = None, **kwargs) -> list[dict]:
    """``predict`` at each np, with speedup/efficiency against ``baseline_np`` (default: the first)."""
    nps = list(nps)
    if not nps:
        raise ConfigError("predict_table needs at least one np")
    base = nps[0] if baseline_np is None else baseline_np
    return [predict(cfg, p, cluster, profile, baseline_np=base, **kwargs) for p in nps]


def pi_table(cfg=None, nps: Iterable[int] = PI_TABLE_NPS, cluster=None) -> list[dict]:
    """Predicted Pi-cluster scaling for both profiles beside the published figures (p0 = 2)."""
    cfg = pi_config() if cfg is None else _as_config(cfg)
    cl = pi4b_cluster() if cluster is None else resolve_cluster(cluster)
    p0 = PUBLISHED["baseline_np"]
    published = {r["np"]: r for r in published_table()}
    rows = []
    for p in nps:
        pil = predict(cfg, p, cl, "pilab", baseline_np=p0)
        nai = predict(cfg, p, cl, "naive", baseline_np=p0)
        pub = published.get(p, {})
        rows.append({
            "np": p, "nodes": pil["nodes"],
            "published_speedup": pub.get("speedup"), "published_efficiency": pub.get("efficiency"),
            "naive_speedup": nai["speedup"], "naive_efficiency": nai["efficiency"],
            "pilab_speedup": pil["speedup"], "pilab_efficiency": pil["efficiency"],
            "naive_epoch_s": nai["epoch_time"], "pilab_epoch_s": pil["epoch_time"],
            "naive_comm_exposed_s": nai["comm_exposed"], "pilab_comm_exposed_s": pil["comm_exposed"],
            "naive_eval_s": nai["eval_time"], "pilab_eval_s": pil["eval_time"],
        })
    return rows


def balance_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """``predict_table``'s rows on a mixed cluster as the comparison of its sharings: per np the step and
    speedup with equal shares and with shares by speed, each step as a multiple of the ideal one (np
    where every rank runs at one speed have no comparison: off = balanced)."""
    out = []
    for r in rows:
        b = r.get("balancing")
        row = {"np": r["np"], "nodes": r["nodes"]}
        if b is None:
            row.update(step_off=r["step_time"], step_balanced=r["step_time"], step_ideal=r["step_time"],
                       speedup_off=r.get("speedup"), speedup_balanced=r.get("speedup"), off_of_ideal=1.0,
                       balanced_of_ideal=1.0)
        else:
            row.update(step_off=b["off"]["step_time"], step_balanced=b["balanced"]["step_time"],
                       step_ideal=b["ideal"]["step_time"], speedup_off=b["off"]["speedup"],
                       speedup_balanced=b["balanced"]["speedup"], off_of_ideal=b["off"]["of_ideal"],
                       balanced_of_ideal=b["balanced"]["of_ideal"])
        out.append(row)
    return out


# `pilab perfmodel table`'s comparison on a mixed cluster (balance_rows)
BALANCE_COLUMNS = ["np", "nodes", "step_off", "step_balanced", "step_ideal", "off_of_ideal", "balanced_of_ideal",
                   "speedup_off", "speedup_balanced"]
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
