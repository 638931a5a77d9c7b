"""Every file a study writes, in one place: study.json and study.csv, the self-contained HTML reports
(BokehJS inline, figures from :mod:`pilab.plots`) and their static figures, for ``pilab scale``,
``pilab remedies`` and ``pilab compare`` alike::

    from pilab.study import report
    report.write(study, "runs/demo")            # study.json, study.csv, report.html, report.png + .svg
    report.write_remedies(search, "runs/rem")   # report.html, report.png beside remedies.json
    report.write_compare(cmp, "runs/cmp")       # compare.json, compare.html, compare.png

The PNG (and an SVG beside it) is drawn with matplotlib by :mod:`pilab.plots.static`: no browser needed.
"""
from __future__ import annotations

import csv
import io
import os
from html import escape

from bokeh.embed import file_html
from bokeh.layouts import column, row
from bokeh.models import Div
from bokeh.resources import INLINE

from .. import plots, verdict as judging
from ..files import atomic_write_text, save_json
from ..plots import html_table, static
from . import compare as paper
from .compare import compare_title, differing_settings
from .points import stored
from .remedies import target_text
from .tables import remedies_table


ROW_KEYS = ("np", "simulated", "simulate_mode", "machine", "time_source", "per_rank_batch", "global_batch", "steps_per_epoch",
            "peak_lr", "threads", "time_per_epoch", "here_time_per_epoch", "here_time_source", "speedup",
            "efficiency", "karp_flatt", "images_per_s", "comm_share", "comm_exposed_share", "peak_mem_mb",
            "final_train_acc", "final_test_acc", "final_train_loss", "final_test_loss", "time_to_target",
            "speedup_to_target", "target_reached", "energy_per_epoch_j", "energy_j", "energy_to_target_j",
            "energy_source", "fast_but_wrong", "verdict", "verdict_why", "efficiency_note")


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=ROW_KEYS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        # no number to a target: "not reached", or "no target" where the reference did not learn
        missing = "no target" if r.get("target_reached") is None else "not reached"
        w.writerow({k: (missing if k in ("time_to_target", "speedup_to_target", "energy_to_target_j")
                        and r.get(k) is None and (k != "energy_to_target_j" or r.get("energy_j") is not None)
                        else r.get(k)) for k in ROW_KEYS})
    return buf.getvalue()


def write_partial(study_: dict, out: str) -> None:
    """study.json and study.csv of an interrupted study (the JSON is the record; no report)."""
    save_json(stored(study_, out), os.path.join(out, "study.json"))
    atomic_write_text(os.path.join(out, "study.csv"), to_csv(study_["rows"]))


def write(study_: dict, out: str) -> dict:
    """study.json, study.csv, report.html (self-contained, BokehJS inline) and report.png if possible."""
    os.makedirs(out, exist_ok=True)
    save_json(stored(study_, out), os.path.join(out, "study.json"))
    atomic_write_text(os.path.join(out, "study.csv"), to_csv(study_["rows"]))
    html_path = os.path.join(out, "report.html")
    atomic_write_text(html_path, report_html(study_))
    paths = {"json": os.path.join(out, "study.json"), "csv": os.path.join(out, "study.csv"),
             "html": html_path}
    png = static.write_study(study_, os.path.join(out, "report.png"))  # matplotlib: PNG + SVG, no browser
    if png:
        paths["png"] = png
    return paths


def report_html(study_: dict) -> str:
    crit = study_["criteria"]
    cfg = study_["config"]
    machine = study_.get("machine", "this machine")
    pa = study_.get("accuracy_baseline_np", study_["baseline_np"])
    times = ("Times are measured on this machine for measured points and predicted for it by the "
             "performance model for simulated ones." if machine == "this machine" else
             f"Speedup, efficiency, time and energy to target are <b>predicted for {escape(machine)}</b> for "
             "every point (the performance model and power model of that machine's preset); the table also "
             "shows this machine's times ('here': measured, or predicted for simulated points).")
    times += (" Speedup compares time per training image: at larger np each rank's shard is rounded down "
              "to whole batches, so an epoch drops more leftover images.")
    head = (
        "<h2>pilab strong-scaling study</h2>"
        f"<p><b>Verdict.</b> {escape(judging.summary(study_))}</p>"
        f"<p><b>command:</b> <code>{escape(study_.get('command') or 'python API')}</code></p>"
        f"<p>model {escape(str(cfg['model']))} width {cfg['width']}, {cfg['epochs']} epochs, batch {cfg['batch_size']} "
        f"({cfg['batch_mode']}), lr {cfg['lr']} per {cfg['lr_ref_batch']} scaled {cfg['lr_scaling']}, "
        f"warmup {cfg['warmup_epochs']} epochs, sharding {cfg['sharding']}, BN {cfg['bn']}, "
        f"threads/rank {cfg['threads']}, data {escape(str(cfg['data']))} "
        f"(train subset {cfg['train_subset'] or 'all'})</p>"
        f"<p>Speed baseline np={study_['baseline_np']}"
        f"{' (its time predicted; no accuracy run at that np)' if study_.get('baseline_predicted_only') else ''}"
        f"; accuracy reference np={pa} (final test accuracy "
        + (f"{study_['baseline_test_acc']:.3f}" if study_['baseline_test_acc'] is not None else "–") + "). "
        + (f"Target accuracy {study_['target_accuracy']:.3f} = "
           if study_["target_accuracy"] is not None else
           "<b>No target accuracy and no verdicts</b>: the reference has not learned (under "
           f"{crit['wrong_floor']:.0%}), and a target at chance would say nothing. Otherwise the target is ")
        + f"{crit['target_fraction']:.0%} of the reference's, fixed before the other runs; time to target "
        "counts training and every evaluation up to the first that reaches it, and a run that never "
        "reaches it is <i>not reached</i> (MLPerf / DAWNBench conventions). A run is "
        f"<b>fast-but-wrong</b> when its final test accuracy is more than {crit['wrong_gap'] * 100:.0f} "
        f"points below the reference's or under {crit['wrong_floor']:.0%}. Measured points are real MPI "
        f"jobs; simulated points are exact virtual-rank emulations. {times}</p>")
    return file_html(column(Div(text=head, width=900), plots.report_layout(study_)), INLINE,
                     "pilab scaling study")


_COMPARE_HEAD = ("study", "np", "kind", "global batch", "peak lr", "steps", "final test acc",
                 "epochs near chance", "verdict")


def _compare_head(cmp: dict) -> tuple:
    """The table's header; its first column named by what varies when one kind of setting does."""
    varies = cmp.get("varies") if cmp.get("varies") is not None else differing_settings(cmp.get("configs") or {})
    return ((next(iter(varies)) if len(varies) == 1 else "study"),) + _COMPARE_HEAD[1:]


def _compare_cells(r: dict) -> list[str]:
    """One row of the comparison table, as text (shared by the markdown and HTML forms)."""
    return [r["label"], str(r["np"]), plots.row_kind(r),
            str(r["global_batch"]), f"{r['peak_lr']:.3g}", str(r["steps"]), f"{r['final_test_acc']:.3f}",
            f"{r['epochs_near_chance']}/{len(r['test_acc_curve'])}", judging.cell(r)]


def compare_markdown(cmp: dict) -> str:
    head = _compare_head(cmp)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_compare_cells(r)) + " |" for r in cmp["rows"]]
    return "\n".join(lines)


def compare_html(cmp: dict) -> str:
    return file_html(compare_layout(cmp), INLINE, "pilab fast-but-wrong")


def compare_layout(cmp: dict):
    """The comparison as one Bokeh layout: accuracy per epoch for each np and rule, then the table."""
    figs = plots.compare_figures(cmp)
    head = f"<h2>pilab: fast-but-wrong, {escape(compare_title(cmp))}</h2>"
    if cmp.get("warning"):
        head += f"<p style='color:#b00'><b>Warning:</b> {escape(cmp['warning'])}</p>"
    for label, cmd in cmp["commands"].items():
        head += f"<p style='font-size:11pt'><b>{escape(label)}:</b> <code>{escape(str(cmd))}</code></p>"
    table = html_table(_compare_head(cmp), [_compare_cells(r) for r in cmp["rows"]])
    # three plots a row: the page (and its PNG) stays 1,000 px wide, readable where it is shown
    grid = [row(*figs[i:i + 3]) for i in range(0, len(figs), 3)]
    return column(Div(text=head, width=1000), *grid, Div(text=table, width=1000))


def write_remedies(res: dict, out: str) -> dict:
    """report.html (self-contained: the table, the front, the command) and report.png + .svg
    (matplotlib), beside remedies.json; returns their paths."""
    head = (f"<h2>pilab remedies at np={res['np']}</h2>"
            f"<p><b>command:</b> <code>{escape(res.get('command') or 'python API')}</code></p>"
            f"<p>Reference accuracy {res['reference_acc']:.3f}; {target_text(res)}. "
            + (f"Times, speedup and energy predicted for <b>{escape(str(res['machine']))}</b>; speedup is "
               f"the whole run's against the un-remedied settings at np={res['speed_baseline_np']}. "
               if res.get("machine") else "No times (no target machine). ")
            + "Red: on the fast-and-right front (it reaches the target accuracy, and no other candidate that "
            "does is faster and more accurate"
            + (" and cheaper in energy" if any(r.get("energy_j") for r in res["candidates"]) else "")
            + f").</p><pre>{escape(remedies_table(res))}</pre>")
    html_path = os.path.join(out, "report.html")
    atomic_write_text(html_path, file_html(column(Div(text=head, width=1000), plots.remedies_figure(res)),
                                           INLINE, "pilab remedies"))
    paths = {"html": html_path}
    png = static.write_remedies(res, os.path.join(out, "report.png"))
    if png:
        paths["png"] = png
    return paths


def write_seeds(tab: dict, prefix: str, *, columns: tuple, cells: list, reference: str, goal: str) -> dict:
    """``<prefix>.html`` (the figure over seeds, then the table: ``columns`` and ``cells``, with the ``reference``
    and ``goal`` lines) and ``<prefix>.png`` + .svg (matplotlib), for a fast-and-right study's table
    (experiments/fast-but-wrong/remedies/seeds_table.py gives them); their paths."""
    head = ("<h2>Fast and right at np=48 in np=1's epochs: every point on all 10,000 test images</h2>"
            "<p>Red: the Pareto front (no other row is faster on the Pi, more accurate and cheaper in energy "
            "at once); squares: np=1; whiskers: the sd over seeds.</p>"
            f"<p>{escape(reference)}</p>")
    html_path = prefix + ".html"
    atomic_write_text(html_path, file_html(column(Div(text=head, width=1000), plots.seeds_figure(tab),
                                                  Div(text=html_table(columns, cells) + f"<p>{escape(goal)}</p>",
                                                      width=1000)),
                                           INLINE, "pilab fast and right"))
    paths = {"html": html_path}
    png = static.write_seeds(tab, prefix + ".png")
    if png:
        paths["png"] = png
    return paths


def write_compare(cmp: dict, out: str, side: dict | None = None) -> dict:
    """compare.json, compare.html (``side``: the studies beside the paper first, from
    :func:`pilab.paper.beside_paper`) and compare.png + .svg (matplotlib); their paths."""
    html_path = os.path.join(out, "compare.html")
    html = paper_html(side, cmp) if side is not None else compare_html(cmp)
    save_json(cmp, os.path.join(out, "compare.json"))
    atomic_write_text(html_path, html)
    paths = {"json": os.path.join(out, "compare.json"), "html": html_path}
    png = static.write_compare(dict(cmp, paper=side) if side is not None else cmp,
                               os.path.join(out, "compare.png"))
    if png:
        paths["png"] = png
    return paths


def paper_html(side: dict, cmp: dict | None = None) -> str:
    """The paper comparison, then (given ``cmp``, from :func:`pilab.study.compare.compare`) the studies'
    accuracy curves side by side; self-contained (BokehJS inline)."""
    parts = [paper_layout(side)]
    if cmp is not None:
        parts.append(compare_layout(cmp))
    return file_html(column(*parts), INLINE, "pilab beside the paper")


def paper_layout(side: dict):
    """The paper comparison's page: its verdict, table and note over the two panels of
    :func:`pilab.plots.paper_figures`."""
    sp, acc = plots.paper_figures(side)
    head, rows = paper.cells(side)
    text = (f"<h2>pilab beside the paper</h2><p>{escape(side['verdict'])}</p>"
            + html_table(head, rows)
            + f"<p>{escape(paper.markdown(side).splitlines()[-1])}</p>")
    ph, prows, pnote = paper.points_cells(side)
    text += f"<h3>Every finished point</h3>{html_table(ph, prows)}<p>{escape(pnote)}</p>"
    return column(Div(text=text, width=1000), row(sp, acc))
