"""Ablations: which cause costs the accuracy at large np, one simulated run per ingredient of a
large-np run, each compared with the row it differs from by that cause alone::

    from pilab.study import ablation, tables
    res = ablation.ablations(Config(width=0.25, epochs=3, train_subset=2000), np_=16)
    ablation.ablation_summary(res)     # what the rows say, in words
    tables.ablation_table(res)          # the rows (the CLI's text, a notebook's HTML table)
"""
from __future__ import annotations

from dataclasses import replace

from .. import engine, verdict as judging
from ..config import Config, ConfigError
from ..engine import load_data
from .points import step_events
from .remedies import announce_point


def ablations(cfg: Config, np_: int, *, data=None, log=None, callbacks=(), causes=None) -> dict:
    """Separate the causes of the accuracy drop at ``np_`` ranks, one simulated run each.

    Starting from one process, each row adds one ingredient of a large-np run:
    the bigger global batch and fewer steps (np=1 with np× the batch), per-rank BatchNorm statistics
    (the same with ghost batches of the per-rank size), then the real np-rank run with static shards
    (shard composition), with reshuffled shards, and the LR rule with and without warmup::

        res = ablation.ablations(Config(width=0.25, epochs=3, train_subset=2000), np_=16)
        [(r["label"], r["final_test_acc"]) for r in res["rows"]]
        ablation.ablation_summary(res)      # what the rows say, in words

    ``causes``: run only the rows of these causes (the reference always runs), e.g. the step count
    and BatchNorm rows alone: ``causes=("global batch & steps", "per-rank BN batch")``; each row is
    compared with the one it differs from by its cause alone (``compared_with``, ``change``).
    ``res["runs"]`` holds each row's full result (``search(..., known=res["runs"])`` re-runs none of
    them); ``callbacks`` receive {"kind": "point", "label", "index", "of"} before each run, its
    {"kind": "step"} events and {"kind": "run", "label", "result"} after it (``widgets.Progress``).
    """
    ds = data if data is not None else load_data(cfg)
    plan, first_base, ref = _plan(cfg, np_, causes)
    rows, runs = [], []
    labels = [x[0] for x in plan]
    for label, cause, c, p, base in plan:
        while base is not None and base not in labels:  # its own base row was left out: the one before it
            base = first_base.get(base) or ref
        announce_point(callbacks, labels, label)
        res = engine.simulate(c, p, data=ds, callbacks=[step_events(callbacks)])
        res = {**res, "known_as": label}
        runs.append(res)
        for cb in callbacks:
            cb({"kind": "run", "label": label, "result": res})
        rows.append(_row(label, cause, c, p, res, base, rows))
        if log:
            log(f"  {label:<52} test acc {res['epochs'][-1]['test_acc']:.3f}")
    return {"kind": "pilab.ablations", "np": np_, "config": cfg.to_dict(), "rows": rows, "runs": runs}


def _plan(cfg: Config, np_: int, causes) -> tuple[list, dict, str]:
    """(the runs as (label, cause, settings, np, the row it differs from by exactly that cause), each
    label's own base row, the reference's label), only the rows of ``causes`` where given."""
    b = cfg.per_rank_batch(np_)
    big = replace(cfg, batch_mode="per_rank", batch_size=b * np_, out="")
    warm = max(1.0, round(cfg.epochs / 5, 1))
    ref, one_big, ghost = "1 rank, batch b", f"1 rank, batch {b * np_} (global batch, step count)", \
        f"1 rank, batch {b * np_}, BN over groups of {b}"
    static, linear = f"{np_} ranks, static shards", f"{np_} ranks, linear lr"
    plan = [
        (ref, "reference", replace(cfg, out=""), 1, None),
        (one_big, "global batch & steps", big, 1, ref),
        (ghost, "per-rank BN batch", replace(big, ghost_batch=b), 1, one_big),
        (static, "shard composition", replace(cfg, out=""), np_, ghost),
        (f"{np_} ranks, reshuffled shards", "reshuffled shards",
         replace(cfg, sharding="reshuffle", out=""), np_, static),
        (linear, "LR rule", replace(cfg, lr_scaling="linear", out=""), np_, static),
        (f"{np_} ranks, linear lr + {warm:g} ep warmup", "LR rule & warmup",
         replace(cfg, lr_scaling="linear", warmup_epochs=warm, out=""), np_, linear),
    ]
    first_base = {x[0]: x[4] for x in plan}
    if causes is not None:
        unknown = set(causes) - {x[1] for x in plan}
        if unknown:
            raise ConfigError(f"unknown cause(s) {', '.join(sorted(unknown))}; the causes are: "
                              + "; ".join(dict.fromkeys(x[1] for x in plan[1:])))
        plan = [x for x in plan if x[1] == "reference" or x[1] in causes]
    return plan, first_base, ref


def _row(label: str, cause: str, c: Config, p: int, res: dict, base, rows: list) -> dict:
    """One ablation row: the run's numbers and its change against the row ``base`` among ``rows``."""
    last = res["epochs"][-1]
    before = next((r for r in rows if r["label"] == base), None)
    return {"label": label, "cause": cause, "np": p, "global_batch": res["global_batch"],
            "per_rank_batch": res["per_rank_batch"], "steps": res["total_steps"],
            "peak_lr": res["peak_lr"], "final_test_acc": last["test_acc"],
            "final_train_loss": last["train_loss"],
            "test_acc_curve": [e["test_acc"] for e in res["epochs"]],
            # what this one cause does: the accuracy against the row it differs from by it alone
            "compared_with": base, "ghost_batch": c.ghost_batch,
            "change": last["test_acc"] - before["final_test_acc"] if before else None}


NOISE = 0.04  # accuracy differences smaller than this (4 points) are not read as an effect: one seed of a
# short run on a few hundred test images moves by about that much (binomial s.d. ~2 points at 500 images)


def _points(d: float) -> str:
    return f"{abs(100 * d):.0f} point{'s' if round(abs(100 * d)) != 1 else ''}"


def ablation_summary(res: dict) -> str:
    """What the ablation rows say, from their numbers: how much each cause costs at this np, which one
    matters most, and whether the LR rule wins it back (``NOISE``: smaller changes are not effects)."""
    rows = res["rows"]
    by_cause = {}
    for r in rows:
        by_cause.setdefault(r["cause"], r)  # the first row of a cause (static shards before reshuffled)
    ref = rows[0]
    if not judging.learned(ref["final_test_acc"]):
        return (f"The reference ({ref['label']}, {ref['steps']} steps) ends at {ref['final_test_acc']:.1%}: "
                "it has not learned, so the rows cannot tell one cause from another; train it longer first.")
    parts = [f"The reference, one process with batch {ref['global_batch']}, takes {ref['steps']} steps to "
             f"{ref['final_test_acc']:.1%}."]
    effects = {}

    def effect(r, what):
        d = r.get("change")
        if d is None:
            return ""
        effects[what] = d
        if abs(d) < NOISE:
            return f"within {_points(NOISE)} of {r['compared_with']}: no clear effect at this size"
        return (f"{_points(d)} {'lost' if d < 0 else 'gained'} against {r['compared_with']}")

    big = by_cause.get("global batch & steps")
    if big:
        parts.append(f"Step count: the same single process with the {res['np']}-rank global batch "
                     f"{big['global_batch']} takes {big['steps']} steps (same lr) and ends at "
                     f"{big['final_test_acc']:.1%}, {effect(big, 'the step count')}.")
    bn = by_cause.get("per-rank BN batch")
    if bn:
        parts.append(f"Batch statistics: BatchNorm over groups of {bn['ghost_batch']} images, as each rank "
                     f"sees them, ends at {bn['final_test_acc']:.1%}, {effect(bn, 'the batch statistics')}.")
    st = by_cause.get("shard composition")
    if st:
        parts.append(f"Shards: {st['label']} end at {st['final_test_acc']:.1%}, {effect(st, 'the shards')}.")
    lr = by_cause.get("LR rule")
    if lr:
        lost = ref["final_test_acc"] - (st or lr)["final_test_acc"]
        d = lr.get("change") or 0.0
        back = (f"winning back {_points(d)} of the {_points(lost)} lost" if d >= NOISE and lost > NOISE else
                "which does not win the accuracy back here" if d < NOISE else "")
        parts.append(f"LR rule: scaling the lr with the global batch (peak lr {lr['peak_lr']:.3g}) gives "
                     f"{lr['final_test_acc']:.1%}" + (f", {back}" if back else "") + ".")
    parts.append(_causes_sentence(effects, res["np"]))
    return " ".join(parts)


def _causes_sentence(effects: dict, np_: int) -> str:
    """The closing sentence: which cause costs the most, which others cost or give back accuracy, and which
    are within the noise -- a gain is never called "does not matter"::

        _causes_sentence({"the step count": -0.15, "the batch statistics": 0.08, "the shards": -0.07}, 4)
        # "At np=4 the accuracy is lost mainly to the step count (15 points), and also to the shards
        #  (7 points); the batch statistics give 8 points back."
    """
    lost = {k: -v for k, v in effects.items() if v <= -NOISE}
    gained = {k: v for k, v in effects.items() if v >= NOISE}
    none = [k for k in effects if k not in lost and k not in gained]
    if lost:
        main, *also = sorted(lost, key=lost.get, reverse=True)
        text = f"At np={np_} the accuracy is lost mainly to {main} ({_points(lost[main])})" + "".join(
            f", and also to {k} ({_points(lost[k])})" for k in also)
    else:
        text = f"No cause costs more than {_points(NOISE)} at np={np_} at this size"
    text += "".join(f"; {k} give{'' if k.endswith('s') else 's'} {_points(v)} back" for k, v in gained.items())
    if none:
        text += f"; {' and '.join(none)} {'make' if len(none) > 1 else 'makes'} no clear difference at this size"
    return text + "."
