"""Several studies side by side: what differs between them (a comparison by learning-rate rule, by
model), their rows per (label, np), and the three-model summary and its interpretation::

    from pilab.study import compare
    cmp = compare.compare({"naive": naive_study, "linear": linear_study})
    compare.compare_title(cmp)                      # "by learning-rate rule"
    compare.models_summary({"MobileNetV2": a, "SqueezeNet": b})

The tables and pages made of them: :mod:`pilab.study.tables`, :mod:`pilab.study.report`.
"""
from __future__ import annotations

import glob
import os

from .. import verdict as judging
from ..plots import EXPERIMENTS
from ..config import Config
from .points import _NOT_TRAINING, _load_json, mode_ran


# Settings that belong together when studies differ (one "what varies" in a comparison's title).
SETTING_GROUPS = {
    "learning-rate rule": ("lr", "lr_scaling", "lr_ref_batch", "warmup_epochs", "optimizer", "schedule",
                           "momentum", "nesterov", "lars_eta", "bn_lr_scale", "lookahead_steps", "decay_epochs",
                           "muon_lr", "muon_momentum", "muon_on"),
    "model": ("model", "width", "timesteps", "zero_init_residual", "whiten_stem", "dirac_init", "freeze_bn_scale"),
    "batch": ("batch_mode", "batch_size", "batch_aug"),
    "BatchNorm": ("bn", "bn_buffers", "ghost_batch", "bn_group"),
    "data": ("data", "train_subset", "test_subset", "augment", "sharding"),
}


# not the training's: where it writes, how often it checkpoints or watches stragglers, where it runs
_NOT_SETTINGS = ("threads", "device", *_NOT_TRAINING)


def differing_settings(configs: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """{group: {setting: {label: value}}} for every setting that is not the same in all ``configs``
    (label -> config dict), grouped as SETTING_GROUPS; a setting outside them is a group of its own::

        differing_settings({"a": {"lr": 0.1, "epochs": 4}, "b": {"lr": 0.2, "epochs": 4}})
        # {"learning-rate rule": {"lr": {"a": 0.1, "b": 0.2}}}
    """
    configs = {label: Config.from_dict(c).to_dict() for label, c in configs.items()}  # read as Config reads it
    keys = sorted({k for c in configs.values() for k in c} - set(_NOT_SETTINGS))
    out: dict[str, dict[str, dict]] = {}
    for k in keys:
        values = {label: c.get(k) for label, c in configs.items()}
        if len({repr(v) for v in values.values()}) > 1:
            group = next((g for g, ks in SETTING_GROUPS.items() if k in ks), k.replace("_", " "))
            out.setdefault(group, {})[k] = values
    return out


def data_set(study: dict) -> str | None:
    """What a study's data set is, as its runs recorded it, not where it lay: its sizes and the digest
    of its arrays (``result["data"]["checksum"]``), so one archive named by two paths is one data set;
    None where no run recorded it::

        data_set(st)      # "50000 train / 10000 test, sha256 7da6a56bd03f"
    """
    seen = sorted({f"{d['n_train']} train / {d['n_test']} test, sha256 {d['checksum'][:12]}"
                   for r in (study.get("runs") or {}).values() if isinstance(r, dict)
                   for d in [r.get("data") or {}] if d.get("checksum") and "n_train" in d})
    return " | ".join(seen) or None


def compare(studies: dict[str, dict]) -> dict:
    """Put several studies (label -> study dict) side by side: per (label, np) final accuracy, the
    test-accuracy curve, and how many evaluated epochs sat at chance level (< 15%); ``varies``: the
    settings that differ (see :func:`differing_settings`), ``warning``: a line when more than one kind
    of setting differs (the comparison then does not isolate one cause)."""
    table_rows = []
    for label, st in studies.items():
        for r in st["rows"]:
            res = st["runs"][str(r["np"])]
            curve = [e["test_acc"] for e in res["epochs"]]
            table_rows.append({
                "label": label, "np": r["np"], "simulated": r["simulated"],
                "simulate_mode": mode_ran(res),
                "global_batch": r["global_batch"], "peak_lr": r["peak_lr"],
                "steps": res["total_steps"], "final_test_acc": r["final_test_acc"],
                "test_acc_curve": curve,
                "epochs_near_chance": sum(1 for a in curve if a is not None and a < 0.15),
                "fast_but_wrong": r["fast_but_wrong"], "verdict": r["verdict"],
                "verdict_why": r["verdict_why"]})
    # a study with no finished point yet (one being run, see load_study) has no settings to compare
    configs = {k: v["config"] for k, v in studies.items() if v.get("config") is not None}
    # the data set by what it is (its runs' record), not by the path it was read from
    varies = differing_settings({k: {**c, "data": data_set(studies[k]) or c.get("data")}
                                 for k, c in configs.items()})
    warning = None
    if len(varies) > 1:
        warning = ("these studies differ in more than one kind of setting, so a difference between them "
                   "has more than one cause: " + "; ".join(
                       f"{k} ({', '.join(f'{lab} {v}' for lab, v in vals.items())})"
                       for settings in varies.values() for k, vals in settings.items()))
    return {"kind": "pilab.scaling.compare", "labels": list(studies), "rows": table_rows,
            "configs": configs, "commands": {k: v.get("command") for k, v in studies.items()},
            "varies": varies, "warning": warning}


def compare_title(cmp: dict) -> str:
    """What the comparison is by: the kinds of setting that differ ("learning-rate rule", "model")."""
    varies = cmp["varies"]
    if not varies:
        return "studies of the same settings"
    kinds = list(varies)
    return "by " + (", ".join(kinds[:-1]) + " and " if len(kinds) > 1 else "") + kinds[-1]


def models_summary(studies: dict[str, dict], *, at_np: int | None = None) -> list[dict]:
    """One row per study (e.g. per model): accuracy at the reference np, speedup and energy to target at
    the largest np (``at_np``: at that np, where a study has it, so studies of different sweeps compare
    at one np), and the smallest np up to it that turned fast-but-wrong — the three-model comparison::

        rows = compare.models_summary({"MobileNetV2": a, "SqueezeNet": b, "spiking CNN": c})
        print(tables.models_summary_markdown(rows))
    """
    out = []
    for label, st in studies.items():
        rows = st["rows"]
        ref = next(r for r in rows if r["np"] == st.get("accuracy_baseline_np", rows[0]["np"]))
        top = next((r for r in rows if r["np"] == at_np), rows[-1])
        wrong = [r["np"] for r in rows if r["fast_but_wrong"] and r["np"] <= top["np"]]
        out.append({"label": label, "model": st["config"]["model"], "machine": st.get("machine"),
                    "reference_np": ref["np"], "reference_acc": ref["final_test_acc"],
                    "largest_np": top["np"], "largest_np_acc": top["final_test_acc"],
                    "speedup_at_largest": top.get("speedup"), "baseline_np": st["baseline_np"],
                    "energy_to_target_reference_j": ref.get("energy_to_target_j"),
                    "energy_to_target_largest_j": top.get("energy_to_target_j"),
                    "energy_source": top.get("energy_source"),
                    "first_fast_but_wrong_np": wrong[0] if wrong else None,
                    "judged": st["reference_learned"]})
    return out


def _with_committed(studies: dict[str, dict], committed: str) -> dict[str, dict]:
    """``studies`` and, after them, the committed studies of experiments/<committed>/ of the other models."""
    have = {(st.get("config") or {}).get("model") for st in studies.values()}
    return {**studies, **{f"{label} (committed)": st for label, st in committed_studies(committed).items()
                          if st["config"]["model"] not in have}}


def committed_studies(name: str) -> dict[str, dict]:
    """The committed studies of experiments/<name>/ (one directory per model, e.g. ``"three-models"``), by a
    model label; empty outside pilab's source repository::

        compare.committed_studies("three-models")      # {"MobileNetV2-CIFAR 0.25": {...}, ...}
    """
    found = {}
    for d in sorted(glob.glob(os.path.join(glob.escape(os.path.join(EXPERIMENTS, name)), "*", "study.json"))):
        st = _load_json(d)
        found[_model_label(st["config"])] = st
    return found


def common_np(studies: dict[str, dict]) -> int | None:
    """The largest np that every study has a row at (None where they share none but the reference's)::

        common_np({"this run": small, "committed": full})     # 8 where one ran 1, 2, 8 and the other 1, 2, 8, 48
    """
    shared = set.intersection(*[{r["np"] for r in st["rows"]} for st in studies.values()]) if studies else set()
    return max(shared) if len(shared) > 1 else None


# A speedup within this fraction of another model's is "about the same" (the performance model's
# predictions are not finer than that).
SAME_SPEED = 0.1


def models_interpretation(studies: dict[str, dict], *, committed: str | None = None,
                          at_np: int | None = None) -> str:
    """Which model scales better, from the studies' numbers: speed (predicted speedup at the largest np)
    and accuracy (what each keeps at scale, where its reference learned enough to judge); "too small to
    tell" where a reference has not. ``committed``: a directory under experiments/ with one study per model
    (``"three-models"``), whose answer is added after this run's::

        compare.models_interpretation({"MobileNetV2": a, "SqueezeNet 1.1": b}, committed="three-models")
    """
    studies = _with_committed(studies, committed) if committed else studies
    if at_np is None:  # compare like with like: the largest np every study ran (this run's 8, a committed 48)
        at_np = common_np(studies)
    rows = models_summary(studies, at_np=at_np)
    parts = []
    timed = [r for r in rows if r.get("speedup_at_largest")]
    if len(timed) > 1:
        fast = max(timed, key=lambda r: r["speedup_at_largest"])
        slow = min(timed, key=lambda r: r["speedup_at_largest"])
        sp = ", ".join(f"{r['label']} {r['speedup_at_largest']:.1f}" for r in timed)
        machine = timed[0].get("machine") or "this machine"
        if fast["speedup_at_largest"] <= slow["speedup_at_largest"] * (1 + SAME_SPEED):
            parts.append(f"Speed: about the same speedup at np={fast['largest_np']} ({sp}; {machine}, against "
                         f"np={fast['baseline_np']}).")
        else:
            parts.append(f"Speed: {fast['label']} scales better ({sp} at np={fast['largest_np']}; {machine}, "
                         f"against np={fast['baseline_np']}).")
    judged = [r for r in rows if r["judged"]]
    for r in rows:
        if not r["judged"]:
            parts.append(f"Accuracy: {r['label']} has not learned at this size (its reference, np={r['reference_np']}, "
                         f"ends at {r['reference_acc']:.1%}, under the {2 * judging.CHANCE:.0%} floor), so how its "
                         "accuracy scales is too small to tell here.")

    def kept(r):  # the share of what it learned (above chance) that it keeps at the larger np
        return max(r["largest_np_acc"] - judging.CHANCE, 0.0) / (r["reference_acc"] - judging.CHANCE)
    for r in judged:
        drop = r["reference_acc"] - r["largest_np_acc"]
        fbw = (f"fast-but-wrong from np={r['first_fast_but_wrong_np']}" if r["first_fast_but_wrong_np"]
               else "never fast-but-wrong here")
        parts.append(f"Accuracy: {r['label']} goes from {r['reference_acc']:.1%} (np={r['reference_np']}) to "
                     f"{r['largest_np_acc']:.1%} at np={r['largest_np']} ("
                     + (f"{100 * drop:.0f} points lower" if drop >= 0.005 else f"{-100 * drop:.0f} points higher"
                        if drop <= -0.005 else "the same") + f"; {kept(r):.0%} of what it learned kept), {fbw}.")
    if len(judged) > 1:
        best = max(judged, key=kept)
        if all(abs(kept(best) - kept(o)) < 0.15 for o in judged):
            parts.append("Neither keeps clearly more of what it learned at scale"
                         + (": all are at chance there." if all(kept(o) == 0 for o in judged) else "."))
        else:
            parts.append(f"{best['label']} keeps the most of what it learned at scale.")
    elif len(rows) > 1:
        parts.append("So this run cannot say which scales better in accuracy"
                     + ("" if judged else ": no reference learned") + ".")
    text = " ".join(parts)
    if committed:
        text += "\n\n" + _committed_models(committed)
    return text


def _committed_models(name: str) -> str:
    """The committed comparison's answer (experiments/<name>/<model>/study.json), in the same words."""
    found = committed_studies(name)
    if not found:
        return f"(The committed comparison experiments/{name}/ is in pilab's source repository, not in this install.)"
    some = next(iter(found.values()))["config"]
    head = (f"The committed comparison (experiments/{name}/: {some['train_subset'] or 'all':,} images, {some['epochs']} "
            f"epochs, np up to {max(int(p) for st in found.values() for p in st['runs'])}): ")
    return head + models_interpretation(found)


def _model_label(cfg: dict) -> str:
    """"MobileNetV2-CIFAR 0.25", "SqueezeNet 1.1", "spiking CNN": a model as a table names it."""
    names = {"mobilenetv2_cifar": "MobileNetV2-CIFAR", "mobilenetv2": "MobileNetV2",
             "squeezenet1_1": "SqueezeNet 1.1", "spiking_cnn": "spiking CNN"}
    name = names.get(cfg["model"], cfg["model"])
    return f"{name} {cfg['width']:g}" if cfg["model"].startswith("mobilenetv2") else name
