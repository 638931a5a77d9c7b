"""Judging a strong-scaling study: the one place that decides what each row's verdict is and what the
paragraph above the table says, so the CLI table, the HTML/PNG report, ``compare`` and the notebooks
cannot disagree with each other or with their numbers::

    from pilab import verdict
    rows = verdict.judge(rows, reference_np=1, speed_baseline_np=2, reference_acc=0.64)   # what a study does
    [(r["np"], verdict.label(r), r["verdict_why"]) for r in study["rows"]]                 # a study is judged
    verdict.summary(study)                   # the paragraph; verdict.footnotes(study): notes under a table

A study is judged once, when it is made (``pilab.study.analysis.rows_from_runs``); what reads it (tables,
reports, ``compare``, notebooks) reads its rows' verdicts and never judges again.

The rules (each one is a case in tests/test_verdict.py):

- A reference (the smallest np, np=1 where it ran) that has not learned — final test accuracy under
  ``wrong_floor``, twice chance on CIFAR-10 — cannot judge anything: no row is fast-but-wrong, no target
  is set (a target at or below chance would be "reached" by a model that guesses), and the rows say so.
- A row is fast-but-wrong when its accuracy is more than ``wrong_gap`` below the reference's or under the
  floor *and* it is faster than the reference (or no time says otherwise); slower and less accurate is
  "wrong". Better than the reference is never wrong.
- "ok" beside "not reached" always carries its reason (within the gap, short of the target).
- Efficiency E = S·p0/p is against the speed baseline p0; a row with np < p0 (np=1 against one Pi node =
  np 2) gets a note saying why it can read above 100%.

Pure Python on plain dicts (rows as ``pilab.study.analysis.rows_from_runs`` makes them, or a committed study.json), a
leaf module that imports nothing from pilab, so every layer may use it (``pilab.plots`` draws what it judged).
"""
from __future__ import annotations

from typing import Mapping, Sequence

CHANCE = 0.10  # CIFAR-10: ten balanced classes
VERDICTS = ("reference", "ok", "fast-but-wrong", "wrong", "not judged")
_LABELS = {"reference": "reference", "ok": "ok", "fast-but-wrong": "FAST-BUT-WRONG", "wrong": "WRONG",
           "not judged": "not judged"}
_DEFAULTS = {"target_fraction": 0.9, "wrong_gap": 0.10, "wrong_floor": 0.20, "chance": CHANCE}


def _crit(criteria: Mapping | None) -> dict:
    return {**_DEFAULTS, **{k: v for k, v in (criteria or {}).items() if v is not None}}


def learned(reference_acc: float | None, criteria: Mapping | None = None) -> bool:
    """True if the reference learned enough to judge others against it (at least ``wrong_floor``)."""
    c = _crit(criteria)
    return reference_acc is not None and reference_acc >= max(c["wrong_floor"], c["chance"])


def target_accuracy(reference_acc: float | None, criteria: Mapping | None = None) -> float | None:
    """The target accuracy (``target_fraction`` × the reference's), or None where there is no fair one:
    the reference has not learned, or the target would not be above chance::

        target_accuracy(0.341)  # 0.3069        target_accuracy(0.102)  # None
    """
    c = _crit(criteria)
    if not learned(reference_acc, c):
        return None
    t = c["target_fraction"] * reference_acc
    return t if t > c["chance"] else None


def judge(rows: Sequence[Mapping], *, reference_np: int, speed_baseline_np: int,
          reference_acc: float | None, criteria: Mapping | None = None) -> list[dict]:
    """New row dicts with ``verdict`` (one of VERDICTS), ``verdict_why`` (a few words, "" if none are
    needed), ``fast_but_wrong``, ``wrong`` (accuracy lost) and ``efficiency_note``; ``target_reached`` is
    None where there is no target."""
    c = _crit(criteria)
    target = target_accuracy(reference_acc, c)
    judged = learned(reference_acc, c)
    ref_row = next((r for r in rows if r["np"] == reference_np), None)
    ref_speed = ref_row.get("speedup") if ref_row else None
    out = []
    for r in rows:
        r = dict(r)
        acc, p = r.get("final_test_acc"), r["np"]
        if target is None:
            r["target_reached"] = None
        why, wrong = "", False
        if p == reference_np:
            v = "reference"
            why = "the accuracy reference" + ("" if judged else f": {acc:.1%}, has not learned (under "
                                              f"{c['wrong_floor']:.0%}), so nothing is judged")
        elif not judged:
            v = "not judged"
            ref = "no accuracy" if reference_acc is None else f"{reference_acc:.1%}"
            why = f"np={reference_np} at {ref} has not learned enough to judge"
        elif acc is None:
            v, why = "not judged", "no test accuracy"
        else:
            gap = reference_acc - acc
            wrong = gap > c["wrong_gap"] or acc < c["wrong_floor"]
            if wrong:
                below = (f"{gap * 100:.0f} points below np={reference_np}" if gap > c["wrong_gap"]
                         else f"under the {c['wrong_floor']:.0%} floor")
                speed = r.get("speedup")
                faster = speed is None or ref_speed is None or speed > ref_speed
                v = "fast-but-wrong" if faster else "wrong"
                why = below if faster else below + f", and not faster than np={reference_np}"
            else:
                v = "ok"
                if acc > reference_acc:
                    why = f"better than np={reference_np}"
                if target is not None and not r.get("target_reached"):
                    why = (f"{why}; " if why else "") + (
                        f"short of the target {target:.3f}, but within {c['wrong_gap'] * 100:.0f} points "
                        f"of np={reference_np}")
        r.update(verdict=v, verdict_why=why, wrong=wrong, fast_but_wrong=v == "fast-but-wrong",
                 efficiency_note=efficiency_note(p, speed_baseline_np) if r.get("efficiency") is not None
                 else "")
        out.append(r)
    return out


def efficiency_note(p: int, p0: int) -> str:
    """Why an efficiency below the speed baseline's np reads as it does ("" at or above p0)."""
    if p >= p0:
        return ""
    return (f"np={p} is below the speed baseline np={p0}: E = S·{p0}/{p} compares each of its ranks with "
            f"one of np={p0}'s, so it reads above 100% when np={p} does more than {p}/{p0} of np={p0}'s work")


def label(row: Mapping) -> str:
    """The verdict as a table shows it: ``ok``, ``FAST-BUT-WRONG``, ``WRONG``, ``reference``, ``not judged``."""
    return _LABELS[row["verdict"]]


def cell(row: Mapping) -> str:
    """The verdict with its reason, for a table cell: ``ok (short of the target 0.307, …)``."""
    why = row.get("verdict_why")
    return f"{label(row)} ({why})" if why and row.get("verdict") != "reference" else label(row)


def color(row: Mapping) -> str:
    """Red for a row that lost accuracy, gray where nothing is judged, blue otherwise."""
    if row.get("wrong") or row.get("fast_but_wrong"):
        return "#d62728"
    return "#999999" if row.get("verdict") == "not judged" else "#1f77b4"


def _pct_list(nps) -> str:
    return ", ".join(str(p) for p in nps)


def summary(study: Mapping) -> str:
    """One plain-language paragraph from a study (its rows judged when it was made): how fast, up to which
    np it stays right, where it turns fast-but-wrong, who reaches the target. "Right" is the rows' own
    verdict (within ``wrong_gap`` of the reference and above the floor): one threshold for the table and
    the words."""
    st = study
    rows = st.get("rows")
    if not rows:
        return "No finished points."
    crit = _crit(st.get("criteria"))
    base, pa = st.get("baseline_test_acc"), st["accuracy_baseline_np"]
    machine = st.get("machine", "this machine")
    where = "on this machine" if machine == "this machine" else f"predicted for {machine}"
    parts = []
    timed = [r for r in rows if r.get("speedup")]
    if timed:
        top = max(timed, key=lambda r: r["np"])
        eff = f" ({top['efficiency']:.0%} efficiency)" if top.get("efficiency") is not None else ""
        parts.append(f"Speedup ({where}, against np={st.get('baseline_np', pa)}) reaches {top['speedup']:.1f} "
                     f"at np={top['np']}{eff}.")
    if not st["reference_learned"]:
        ref = "has no test accuracy" if base is None else f"ends at {base:.1%}, under the {crit['wrong_floor']:.0%} floor"
        parts.append(f"The reference run (np={pa}) {ref}: it has not learned enough to judge what scale "
                     "does to accuracy, so no run is called fast-but-wrong and no target accuracy is set; "
                     "train it longer (more epochs or images) or tune its learning rate first.")
        return " ".join(parts)
    gap = f"{crit['wrong_gap'] * 100:.0f} points"
    right = [r for r in rows if r["verdict"] in ("reference", "ok")]
    k = max(right, key=lambda r: r["np"])
    if k["np"] != pa:
        parts.append(f"np={k['np']} is the largest count that keeps test accuracy within {gap} of np={pa} "
                     f"({k['final_test_acc']:.1%} vs {base:.1%}); further below, a faster run is fast-but-wrong.")
    else:
        parts.append(f"No larger count keeps test accuracy within {gap} of np={pa} ({base:.1%}), the line below "
                     "which a faster run is fast-but-wrong.")
    wrong = [r for r in rows if r["verdict"] in ("fast-but-wrong", "wrong")]
    beyond = [r for r in wrong if r["np"] > k["np"]]
    if beyond:
        w = min(beyond, key=lambda r: r["np"])
        faster = f", although it is {w['speedup']:.1f}x faster" if w.get("speedup") and w["fast_but_wrong"] else ""
        run = (st.get("runs") or {}).get(str(w["np"]))
        steps = (f" and the whole run is {w['steps_per_epoch'] * len(run['epochs'])} optimizer steps"
                 if run and w.get("steps_per_epoch") else "")
        what = "fast but wrong" if w["fast_but_wrong"] else "wrong, and not faster"
        parts.append(f"{'Beyond it, ' if k['np'] != pa else ''}np={w['np']} ends at {w['final_test_acc']:.1%} "
                     f"({(base - w['final_test_acc']) * 100:.0f} points below){faster}: {what} — "
                     f"its global batch is {w['global_batch']}{steps}.")
    elif wrong:
        parts.append("Wrong at np=" + _pct_list(r["np"] for r in wrong)
                     + " although a larger count stays right: accuracy is not monotone in np here.")
    else:
        parts.append("No process count turned fast-but-wrong.")
    others = [r for r in rows if r["np"] != pa]
    if others:
        parts.append(_target_sentence(st["target_accuracy"], others, pa, crit))
    return " ".join(parts)


def _target_sentence(target_acc: float, others: list, pa: int, crit: dict) -> str:
    """Who of the rows other than the reference's reaches the target accuracy."""
    missed = [r["np"] for r in others if not r.get("target_reached")]
    target = f"The target accuracy {target_acc:.1%} ({crit['target_fraction']:.0%} of np={pa}'s) is "
    if len(missed) == len(others):
        return target + "reached by no run but the reference."
    if missed:
        short_ok = [r["np"] for r in others if not r.get("target_reached") and r["verdict"] == "ok"]
        return (target + f"not reached at np={_pct_list(missed)}"
                + (f" (np={_pct_list(short_ok)} still within {crit['wrong_gap'] * 100:.0f} points: ok)"
                   if short_ok else "") + ".")
    return target + "reached at every np."


def footnotes(study: Mapping) -> list[str]:
    """Notes a table of the study needs under it (``*`` marks the efficiency they explain)."""
    notes = {r["efficiency_note"] for r in study.get("rows") or [] if r.get("efficiency_note")}
    return [f"* {n}" for n in sorted(notes)]
