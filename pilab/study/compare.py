"""Several studies side by side: what differs between them (a comparison by learning-rate rule, by
model), their rows per (label, np), and the three-model summary and its interpretation::

    from pilab.study import compare
    cmp = compare.compare({"naive": naive_study, "linear": linear_study})
    compare.compare_title(cmp)                      # "by learning-rate rule"
    compare.models_summary({"MobileNetV2": a, "SqueezeNet": b})

The tables and pages made of them: :mod:`pilab.study.tables`, :mod:`pilab.study.report`.

The study beside the paper it reproduces: the published speedups on the 24-node Raspberry Pi 4B cluster,
what pilab's performance model predicts for the same points (the naive code the paper likely ran, and
pilab's own), and the accuracy each study measured — one table, one figure and a paragraph generated
from the numbers; the page is :func:`pilab.study.report.paper_html`'s::

    from pilab.study import compare, scaling
    studies = {"50k naive": scaling.load_study("experiments/paper-size/naive", planned=compare.PAPER_NPS),
               "15k naive": scaling.load_study("experiments/fast-but-wrong/naive")}
    side = compare.beside_paper(studies)
    print(compare.markdown(side)); print(side["verdict"])
    print(compare.points_markdown(side))  # every finished point: per-epoch accuracy, Pi time, energy, target

    python -m pilab compare experiments/paper-size/naive experiments/fast-but-wrong/naive --labels 50k,15k --paper --out runs/p

A point that has not finished is *pending* (None in the dicts), never a number. Published: speedup 9.99 at
np=48 (41.6% efficiency against one node of 2 processes), efficiency 90.9% at np=4 and 52.3% at np=8,
and test accuracy collapsing toward chance (10%) at large np (``perfmodel.PUBLISHED``; the accuracy was
described, not tabulated).
"""
from __future__ import annotations

import glob
import os
from dataclasses import replace

from .. import perfmodel, plots, verdict as judging
from ..config import Config
from ..plots import EXPERIMENTS
from .analysis import final_value, sized_for_model
from .points import NOT_TRAINING, mode_ran, read_json


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
_NOT_SETTINGS = ("threads", "device", *NOT_TRAINING)


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


def with_committed(studies: dict[str, dict], committed: str) -> dict[str, dict]:
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
        st = read_json(d)
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
    studies = with_committed(studies, committed) if committed else studies
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


PAPER_NPS = (1, 2, 4, 8, 16, 24, 32, 48)  # the paper's process counts (2..48), and np=1 as the reference
CHANCE = 0.10  # ten classes
NEAR_CHANCE = 0.15  # an accuracy under this is "at chance" (as pilab.study.compare counts epochs)
SPEED_CLOSE = 0.10  # a predicted efficiency within 10 points of the published one reproduces it
ACC_WRONG = 0.10  # 10 points below the reference: accuracy has fallen (analysis.Criteria.wrong_gap)


# What the paper-size study trains (experiments/paper-size/run.sh) when none of its points has finished yet: the
# Pi predictions need a configuration before any run exists.
PAPER_SIZE = Config(data="cifar10", model="mobilenetv2_cifar", width=0.25, train_subset=50000,
                    test_subset=10000, epochs=10, batch_size=32, lr_ref_batch=32)


def _model_config(studies: dict[str, dict]) -> Config:
    """The configuration the Pi predictions are for: the first study's (the paper-size study, given
    first), with its image counts spelled out for the model; PAPER_SIZE while it has no finished point."""
    st = next(iter(studies.values()))
    if not st.get("config"):
        return replace(PAPER_SIZE, threads=0)
    cfg = Config.from_dict(st["config"])
    runs = {int(p): r for p, r in st.get("runs", {}).items()}
    return replace(sized_for_model(cfg, runs), threads=0)  # the Pi places its threads


def _reference(st: dict):
    """(np, final test accuracy) of a study's accuracy reference: its np=1 point, None if pending."""
    r = st.get("runs", {}).get("1")
    return (1, final_value(r, "test_acc")) if r else (None, None)


def beside_paper(studies: dict[str, dict], *, nps=PAPER_NPS, cluster="pi4b_cluster") -> dict:
    """One row per np: the published speedup/efficiency, the predicted Pi speedup/efficiency of the
    naive and the pilab profile (against one node, np=2), and per study (label -> study dict, e.g.
    from :func:`pilab.study.scaling.load_study`) the final test accuracy, epochs at chance, optimizer steps
    and this machine's wall time (None: pending). ``verdict`` is the paragraph :func:`verdict` writes."""
    cfg = _model_config(studies)
    p0 = perfmodel.PUBLISHED["baseline_np"]
    published = {r["np"]: r for r in perfmodel.published_table()}
    rows = []
    for p in nps:
        nai = perfmodel.predict(cfg, p, cluster, "naive", baseline_np=p0)
        pil = perfmodel.predict(cfg, p, cluster, "pilab", baseline_np=p0)
        pub = published.get(p, {})
        per = {}
        for label, st in studies.items():
            r = st.get("runs", {}).get(str(p))
            sr = next((x for x in st.get("rows", ()) if x["np"] == p), {}) if r else {}
            # pending: planned and not finished yet; a finished study without the np did not run it
            missing = set(st.get("missing") or ())
            curve = [e.get("test_acc") for e in r["epochs"]] if r else []
            per[label] = {
                "final_test_acc": final_value(r, "test_acc") if r else None,
                "epochs_near_chance": sum(1 for a in curve if a is not None and a < NEAR_CHANCE) if r else None,
                "epochs": len(curve) if r else None,
                "steps": r["total_steps"] if r else None,
                "simulated": bool(r.get("simulated")) if r else None,
                "simulate_mode": mode_ran(r),
                "wall_time_here": r.get("wall_time") if r else None,
                "test_acc_curve": curve if r else None,
                # the study's own row, predicted for its target machine (the Pi cluster): every point's
                # Pi time, energy and time to the study's target accuracy (90% of its np=1)
                "pi_time_per_epoch": sr.get("time_per_epoch"), "pi_energy_j": sr.get("energy_j"),
                "pi_time_to_target": sr.get("time_to_target"), "pi_speedup_to_target": sr.get("speedup_to_target"),
                "target_acc": st.get("target_accuracy") if r else None,
                "pending": r is None and p in missing,
                "not_run": r is None and p not in missing,
            }
        rows.append({
            "np": p, "nodes": nai["nodes"], "global_batch": nai["global_batch"],
            "steps_per_epoch": nai["steps_per_epoch"],
            "published_speedup": pub.get("speedup"), "published_efficiency": pub.get("efficiency"),
            "published_speedup_given": pub.get("speedup_published"),
            "naive_speedup": nai["speedup"], "naive_efficiency": nai["efficiency"],
            "pilab_speedup": pil["speedup"], "pilab_efficiency": pil["efficiency"],
            "studies": per})
    refs = {label: _reference(st)[1] for label, st in studies.items()}
    out = {"kind": "pilab.paper.beside", "labels": list(studies), "baseline_np": p0, "cluster": cluster,
           "model_config": cfg.to_dict(), "reference_acc": refs, "rows": rows,
           "published_accuracy": "test accuracy collapsing toward 10% (chance) at large np",
           "pending": {label: [r["np"] for r in rows if r["studies"][label]["pending"]] for label in studies}}
    out["verdict"] = verdict(out)
    return out


def _pct(v) -> str:
    return f"{v * 100:.1f}%"


def _speed_sentences(side: dict) -> list[str]:
    pub = [r for r in side["rows"] if r["published_efficiency"] is not None]
    if not pub:
        return []
    figures = ", ".join(f"{_pct(r['published_efficiency'])} at np={r['np']}" for r in pub)
    top = max(pub, key=lambda r: r["np"])
    out = [f"Speed: the paper's efficiency against one node (np={side['baseline_np']}) is {figures} "
           f"(speedup {top['published_speedup']:.2f} at np={top['np']})."]
    for prof, what in (("naive", "the naive code (one blocking Allreduce per tensor after backward, every "
                                 "rank evaluating the whole test set), as the paper's likely was"),
                       ("pilab", "pilab's own (fused buckets overlapped with backward, sharded evaluation)")):
        close = [r["np"] for r in pub if abs(r[f"{prof}_efficiency"] - r["published_efficiency"]) <= SPEED_CLOSE]
        off = [r for r in pub if r["np"] not in close]
        pred = ", ".join(_pct(r[f"{prof}_efficiency"]) for r in pub)
        s = (f"The performance model predicts {pred} for {what}, speedup {top[f'{prof}_speedup']:.2f} at "
             f"np={top['np']}: ")
        if not off:
            s += f"within {SPEED_CLOSE * 100:.0f} points of every published figure."
        else:
            s += ((f"within {SPEED_CLOSE * 100:.0f} points at np {', '.join(map(str, close))}; " if close else "")
                  + "off by " + ", ".join(f"{(r[f'{prof}_efficiency'] - r['published_efficiency']) * 100:+.0f} "
                                           f"points at np={r['np']}" for r in off) + ".")
        out.append(s)
    return out


def _accuracy_sentence(label: str, side: dict) -> str:
    ref = side["reference_acc"].get(label)
    done = [r for r in side["rows"] if r["studies"][label]["final_test_acc"] is not None and r["np"] > 1]
    pending = [p for p in side["pending"][label]]
    tail = f" (pending: np {', '.join(map(str, pending))})" if pending else ""
    if ref is None:
        return (f"{label}: its np=1 reference is pending, so its accuracy cannot be judged yet"
                + ("; finished: " + ", ".join(f"np={r['np']} {_pct(r['studies'][label]['final_test_acc'])}"
                                               for r in done) if done else "") + f"{tail}.")
    if not done:
        return f"{label}: np=1 ends at {_pct(ref)}; no larger np has finished yet{tail}."
    top = max(done, key=lambda r: r["np"])
    a = top["studies"][label]
    acc = a["final_test_acc"]
    if acc < NEAR_CHANCE:
        how = (f"collapses to chance: {_pct(acc)} at np={top['np']} against {_pct(ref)} at np=1 — the paper's "
               "collapse reproduces")
    elif acc < ref - ACC_WRONG:
        how = (f"falls to {_pct(acc)} at np={top['np']}, {(ref - acc) * 100:.0f} points below np=1's {_pct(ref)}, "
               "but stays above chance — the paper's collapse reproduces only in part")
    else:
        how = (f"holds: {_pct(acc)} at np={top['np']} against {_pct(ref)} at np=1 — the paper's collapse does "
               "not reproduce")
    first_wrong = next((r["np"] for r in sorted(done, key=lambda r: r["np"])
                        if r["studies"][label]["final_test_acc"] < ref - ACC_WRONG), None)
    extra = f"; accuracy first falls more than {ACC_WRONG * 100:.0f} points at np={first_wrong}" \
        if first_wrong and first_wrong != top["np"] else ""
    return (f"{label}: accuracy {how} ({a['steps']} optimizer steps, {a['epochs_near_chance']}/{a['epochs']} "
            f"epochs near chance){extra}{tail}.")


def verdict(side: dict) -> str:
    """What reproduces and what does not, from the numbers: the speed figures against both profiles,
    then each study's accuracy at its largest finished np against its np=1 reference."""
    parts = _speed_sentences(side)
    parts.append(f"Accuracy: the paper reports {side['published_accuracy']}.")
    parts += [_accuracy_sentence(label, side) for label in side["labels"]]
    return " ".join(parts)


_HEAD_FIXED = ("np", "nodes", "global batch", "published speedup (eff.)", "predicted Pi, naive code",
               "predicted Pi, pilab")


def _speed(s, e) -> str:
    return f"{s:.2f} ({e * 100:.1f}%)" if s is not None and e is not None else "–"


def cells(side: dict) -> tuple[list[str], list[list[str]]]:
    """The table as text: head and one row per np (shared by the Markdown and HTML forms)."""
    head = list(_HEAD_FIXED) + [f"{label} test acc" for label in side["labels"]]
    out = []
    for r in side["rows"]:
        pub = _speed(r["published_speedup"], r["published_efficiency"])
        if r["published_speedup"] is not None and not r["published_speedup_given"]:
            pub += " *"
        accs = []
        for label in side["labels"]:
            a = r["studies"][label]
            wall = f", {a['wall_time_here'] / 60:.0f} min here" if a.get("wall_time_here") else ""
            accs.append("pending" if a["pending"] else "–" if a["not_run"] else
                        f"{a['final_test_acc']:.3f}" + (" at chance" if a["final_test_acc"] < NEAR_CHANCE else "")
                        + f" ({'sim' if a['simulated'] else 'real'}{wall})")
        out.append([str(r["np"]), str(r["nodes"]), str(r["global_batch"]), pub if r["published_efficiency"]
                    is not None else "–", _speed(r["naive_speedup"], r["naive_efficiency"]),
                    _speed(r["pilab_speedup"], r["pilab_efficiency"])] + accs)
    return head, out


def points_cells(side: dict) -> tuple[list[str], list[list[str]], str]:
    """Every finished point of every study, one row each: accuracy per epoch, the predicted Pi time per
    epoch, energy and time to the study's target accuracy (its speedup over np=1's), and this machine's
    wall time -- the detail under :func:`cells`' one row per np; (head, rows, note under them)."""
    def num(v, fmt, unit=""):
        return "–" if v is None else format(v, fmt) + unit

    head = ["study", "np", "kind", "steps", "test accuracy per epoch", "Pi s/epoch", "Pi energy",
            "Pi time to target (speedup)", "wall time here"]
    out = []
    for label in side["labels"]:
        for r in side["rows"]:
            a = r["studies"][label]
            if a["final_test_acc"] is None:
                continue
            if a["pi_time_to_target"] is None:
                ttt = "not reached" if a["target_acc"] is not None else "–"
            else:
                ttt = num(a["pi_time_to_target"] / 60, ".0f", " min") \
                    + (f" ({a['pi_speedup_to_target']:.1f}×)" if a["pi_speedup_to_target"] else "")
            out.append([label, str(r["np"]), plots.row_kind(a), str(a["steps"]),
                        " ".join(f"{x:.3f}" for x in a["test_acc_curve"] if x is not None),
                        num(a["pi_time_per_epoch"], ".0f", " s"),
                        num(a["pi_energy_j"] and a["pi_energy_j"] / 1e3, ".1f", " kJ"), ttt,
                        num(a["wall_time_here"] and a["wall_time_here"] / 60, ".0f", " min")])
    target = {label: a["target_acc"] for r in side["rows"] for label, a in r["studies"].items()
              if a["target_acc"] is not None}
    targets = ", ".join(f"{label} {_pct(target[label])}" for label in side["labels"] if label in target)
    note = (f"Pi: predicted for the {side['cluster']} target (pilab's own code); energy from its power model; "
            f"target accuracy = 90% of each study's np=1 ({targets}); time to target counts evaluation; "
            "its speedup is over np=1's time to the same target.")
    return head, out, note


def points_markdown(side: dict) -> str:
    head, rows, note = points_cells(side)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in rows] + ["", note])


def markdown(side: dict) -> str:
    head, rows = cells(side)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c) + " |" for c in rows]
    lines.append("")
    lines.append(f"Speedup and efficiency against one node (np={side['baseline_np']}, 2 processes); pending: "
                 "planned, not finished yet; –: not part of that study; * published "
                 "as an efficiency only (speedup = efficiency × np / 2). Predictions: pilab's performance model "
                 f"of the 24-node Raspberry Pi 4B cluster, {side['model_config']['model']} width "
                 f"{side['model_config']['width']}, {side['model_config']['train_subset']} training images.")
    return "\n".join(lines)
