"""What the CLI prints and a notebook shows: each table is a :class:`pilab.plots.Table` (plain text in a
terminal, an HTML table as the last expression of a cell) and each interpretation a
:class:`pilab.plots.Paragraph`; the words come from the study's own modules and :mod:`pilab.verdict`::

    from pilab.study import tables
    tables.table(study)                       # a scaling study's rows and verdict
    tables.interpretation(study)              # what it showed, for the end of a notebook
    tables.models_table({"MobileNetV2": a, "SqueezeNet 1.1": b})
    tables.remedies_table(search)             # a remedies search; tables.ablation_table(ablations)
"""
from __future__ import annotations

from .. import plots, verdict as judging
from .ablation import ablation_summary
from .compare import models_interpretation as _models_words, models_summary, with_committed
from .remedies import search_summary, target_text


def table(study_: dict) -> str:
    """A plain-text table of the rows (what the CLI prints); with a target machine, its times first
    and this machine's beside them. Verdicts, target and the paragraph under it: :mod:`pilab.verdict`.
    It is a :class:`pilab.plots.Table`: the last expression of a notebook cell shows it as HTML."""
    machine = study_.get("machine", "this machine")
    two = machine != "this machine"
    pa = study_["accuracy_baseline_np"]
    base, target = study_["baseline_test_acc"], study_["target_accuracy"]
    lines = [f"baseline np={pa}  final test acc " + (f"{base:.3f}" if base is not None else "–") + "  "
             + (f"target {target:.3f}" if target is not None else "no target (the reference has not learned)")]
    if two:
        lines.append(f"times: {machine} (predicted), speed baseline np={study_['baseline_np']}"
                     + (" (predicted only, no run)" if study_.get("baseline_predicted_only") else "")
                     + "; 'here' = this machine")
    lines.append(f"{'np':>4} {'kind':>9} {'glob.batch':>10} {'s/epoch':>8} "
                 + (f"{'here':>8} " if two else "")
                 + f"{'speedup':>8} {'eff.':>6} {'test acc':>8} {'time→target':>12}  verdict")
    for r in study_["rows"]:
        def n(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "–"
        ttt = ("–" if r["time_per_epoch"] is None else "not reached" if target is not None else "no target") \
            if r["time_to_target"] is None else f"{r['time_to_target']:.1f}s"
        here = f"{n(r.get('here_time_per_epoch'), '8.1f'):>8} " if two else ""
        eff = n(r["efficiency"], ".0%") + ("*" if r.get("efficiency_note") else "")
        lines.append(f"{r['np']:>4} {plots.row_kind(r):>9} {r['global_batch']:>10} "
                     f"{n(r['time_per_epoch'], '8.1f'):>8} {here}{n(r['speedup'], '8.2f'):>8} "
                     f"{eff:>6} {n(r['final_test_acc'], '8.3f'):>8} {ttt:>12}  {judging.cell(r)}")
    lines += plots.table_notes(study_)
    lines += ["", judging.summary(study_)]
    # in a notebook the same rows as an HTML table (the report's cells), the verdict under it
    head, cells, notes = plots.study_cells(study_, steps=True)
    return plots.Table("\n".join(lines), head, cells, notes=notes, caption=judging.summary(study_), kind="study")


def interpretation(study_: dict) -> str:
    """What a study showed, for the end of a notebook: the verdict paragraph (:mod:`pilab.verdict`), then
    why -- the optimizer steps each np got -- and the size of the run it came from::

        tables.interpretation(study)      # the last line of a cell: a paragraph
    """
    st = study_
    parts = [judging.summary(st)]
    runs = st.get("runs") or {}
    steps = [(r["np"], runs[str(r["np"])]["total_steps"], r["global_batch"]) for r in st["rows"]
             if str(r["np"]) in runs and runs[str(r["np"])].get("total_steps")]
    cfg = st.get("config") or {}
    if len(steps) > 1 and cfg.get("batch_mode") == "per_rank":
        parts.append("Why: with " + f"{cfg['batch_size']} images per rank and {cfg['epochs']} epochs, the global "
                     "batch grows with np and the optimizer steps fall: "
                     + ", ".join(f"np={p} {n} steps of {gb}" for p, n, gb in steps)
                     + f" (learning rate rule: {cfg['lr_scaling']}). 03_fast_but_wrong separates this cause from "
                     "the others.")
    if cfg:
        parts.append(f"This run: {cfg['model']} width {cfg['width']:g}, "
                     f"{cfg['train_subset'] or 'all':,} training and {cfg['test_subset'] or 'all':,} test images, "
                     f"{cfg['epochs']} epochs: small, so its accuracies are a few points apart from seed to seed.")
    return plots.Paragraph("\n\n".join(parts))


def models_summary_markdown(rows: list[dict]) -> str:
    def kj(v, r):
        return f"{v / 1e3:.2f} kJ" if v is not None else ("not reached" if r.get("judged", True) else "no target")
    head = ("model", "test acc (np ref)", "test acc (largest np)", "speedup at largest np",
            "energy to target (np ref)", "energy to target (largest np)", "first fast-but-wrong np")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fbw = (r["first_fast_but_wrong_np"] or "none") if r.get("judged", True) else \
            f"not judged (np={r['reference_np']} has not learned)"
        sp = f"{r['speedup_at_largest']:.1f} (vs np={r['baseline_np']}, {r['machine']})" \
            if r["speedup_at_largest"] else "–"
        lines.append(f"| {r['label']} | {r['reference_acc']:.3f} (np={r['reference_np']}) | "
                     f"{r['largest_np_acc']:.3f} (np={r['largest_np']}) | {sp} | "
                     f"{kj(r['energy_to_target_reference_j'], r)} | {kj(r['energy_to_target_largest_j'], r)} | "
                     f"{fbw} |")
    return "\n".join(lines)


def models_table(studies: dict[str, dict], *, at_np: int | None = None, committed: str | None = None) -> str:
    """The three-model comparison (:func:`pilab.study.compare.models_summary`) as Markdown text, and in a notebook as an HTML
    table with what it says under it (:func:`models_interpretation`); ``committed`` (e.g.
    ``"three-models"``) adds the committed studies of experiments/<committed>/ that are not among ``studies``
    (by model), labelled as such::

        tables.models_table({"MobileNetV2": a, "SqueezeNet 1.1": b})     # the last line of a cell
        tables.models_table({"spiking CNN (this run)": c}, at_np=8, committed="three-models")
    """
    studies = with_committed(studies, committed) if committed else studies
    rows = models_summary(studies, at_np=at_np)
    md = models_summary_markdown(rows).splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in md[2:]]
    return plots.Table("\n".join(md), head, cells, caption=_models_words(studies, at_np=at_np),
                       kind="models")


def remedies_table(res: dict) -> str:
    """A remedies search as fixed-width text (the CLI), and in a notebook as an HTML table with where each
    run came from and what the rows say under it (:func:`pilab.study.remedies.search_summary`)."""
    w = max([36] + [len(r["label"]) + 2 for r in res["candidates"]])  # the label column
    base = f", speedup vs np={res['speed_baseline_np']} of the baseline" if res.get("speed_baseline_np") else ""
    lines = [f"np={res['np']}  reference accuracy {res['reference_acc']:.3f}  " + target_text(res)
             + (f"  times predicted for {res['machine']}{base}" if res.get("machine")
                else "  (no times: no target)"),
             f"{'candidate':<{w}}{'glob.batch':>10}{'peak lr':>9}{'steps':>7}{'test acc':>9}"
             f"{'time s':>9}{'speedup':>8}{'→target':>13}{'energy kJ':>10}  pareto"]
    for r in res["candidates"]:
        if "skipped" in r:
            lines.append(f"{r['label']:<{w}}skipped: {r['skipped']}")
            continue
        t = f"{r['epochs_time']:.0f}" if r["epochs_time"] else "–"
        sp = f"{r['speedup']:.1f}" if r.get("speedup") else "–"
        ttt = f"{r['time_to_target']:.0f}s" if r["time_to_target"] else (
            "no target" if r["reached_target"] is None else "not reached" if not r["reached_target"] else "–")
        kj = f"{r['energy_j'] / 1e3:.2f}" if r.get("energy_j") is not None else "–"
        lines.append(f"{r['label']:<{w}}{r['global_batch']:>10}{r['peak_lr']:>9.3g}{r['steps']:>7}"
                     f"{r['final_test_acc']:>9.3f}{t:>9}{sp:>8}{ttt:>13}{kj:>10}  {'*' if r.get('pareto') else ''}")
    # in a notebook: the same rows as an HTML table, where each run came from, what they say under it
    where = res.get("machine") or "–"
    head = ("candidate", "global batch", "peak lr", "steps", "test acc", f"time s ({where})", "speedup",
            "time to target", "energy kJ", "fast and right", "run")
    cells = []
    for r in res["candidates"]:
        if "skipped" in r:
            cells.append((r["label"], *(["–"] * 9), "skipped: " + r["skipped"]))
            continue
        ttt = f"{r['time_to_target']:.0f} s" if r["time_to_target"] else (
            "no target" if r["reached_target"] is None else "not reached" if not r["reached_target"] else "–")
        cells.append((r["label"], r["global_batch"], f"{r['peak_lr']:.3g}", r["steps"], f"{r['final_test_acc']:.3f}",
                      f"{r['epochs_time']:.0f}" if r["epochs_time"] else "–",
                      f"{r['speedup']:.1f}" if r.get("speedup") else "–", ttt,
                      f"{r['energy_j'] / 1e3:.2f}" if r.get("energy_j") is not None else "–",
                      "on the front" if r.get("pareto") else "", r.get("kept") or "run now"))
    return plots.Table("\n".join(lines), head, cells, caption=search_summary(res), kind="remedies")


def ablation_table(res: dict) -> str:
    """The ablation rows as fixed-width text (the CLI), and in a notebook as an HTML table with each
    row's change against the row it differs from by its one cause, and what the rows say under it
    (:func:`ablation_summary`)."""
    lines = [f"{'run':<54}{'cause':<22}{'glob.batch':>10}{'steps':>7}{'peak lr':>9}{'test acc':>9}"]
    for r in res["rows"]:
        lines.append(f"{r['label']:<54}{r['cause']:<22}{r['global_batch']:>10}{r['steps']:>7}"
                     f"{r['peak_lr']:>9.3g}{r['final_test_acc']:>9.3f}")
    head = ("run", "cause", "global batch", "steps", "peak lr", "test acc", "change", "against")
    cells = [(r["label"], r["cause"], r["global_batch"], r["steps"], f"{r['peak_lr']:.3g}",
              f"{r['final_test_acc']:.3f}",
              f"{100 * r['change']:+.1f} points" if r.get("change") is not None else "–",
              r.get("compared_with") or "–") for r in res["rows"]]
    return plots.Table("\n".join(lines), head, cells, caption=ablation_summary(res), kind="ablations")


def remedies_interpretation(ablations_: dict, search_: dict | None = None) -> str:
    """What the ablations and the search showed together, for the end of a notebook::

        tables.remedies_interpretation(ablations, search)     # the last line of a cell: a paragraph
    """
    parts = [ablation_summary(ablations_)]
    if search_:
        parts.append(search_summary(search_))
        taken = [r["label"] for r in search_["candidates"] if str(r.get("kept", "")).startswith("the run of")]
        if taken:
            parts.append(f"{len(taken)} of the search's {len(search_['candidates'])} candidates are runs the "
                         "ablations had made (" + ", ".join(taken) + "): taken from them, not run again.")
    cfg = ablations_.get("config") or {}
    if cfg:
        parts.append(f"All of it at {cfg['train_subset'] or 'all'} training images and {cfg['epochs']} "
                     f"epoch{'s' if cfg['epochs'] != 1 else ''} "
                     f"(np={ablations_['np']}): the committed search below is the full-size answer.")
    return plots.Paragraph("\n\n".join(parts))


def models_interpretation(studies: dict[str, dict], *, committed: str | None = None,
                          at_np: int | None = None) -> str:
    """Which model scales better (:func:`pilab.study.compare.models_interpretation`), as a paragraph::

        tables.models_interpretation({"MobileNetV2": a, "SqueezeNet 1.1": b}, committed="three-models")
    """
    return plots.Paragraph(_models_words(studies, committed=committed, at_np=at_np))
