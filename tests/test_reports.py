"""What a new user sees of the reports and the CLI (issue 24, item 5): figures that fit their data,
`compare` that says what it compares, `remedies` that names its candidates, `--help` for every command."""
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict

import pytest
from bokeh.models import LabelSet, LogScale, Range1d, Scatter
from bokeh.plotting import figure

from pilab import plots, resultfile
from pilab.cli import COMMANDS, build_parser
from pilab.config import DEMO, Config
from pilab.study import ablation, analysis, compare, remedies, report, scaling, tables

from test_verdict import _run, _study


def _pi_study():
    """np 1/2 measured, 8/48 simulated, speed predicted for the Pi (baseline np=2): np=1 at 177 %."""
    runs = {1: _run(1, [0.3, 0.5], 10.0), 2: _run(2, [0.3, 0.49], 6.0), 8: _run(8, [0.1, 0.1], 2.0),
            48: _run(48, [0.1, 0.1], 1.0, gb=48)}
    pred = {1: {"epoch_time": 43.7, "eval_time": 1.0}, 2: {"epoch_time": 38.6, "eval_time": 1.0},
            8: {"epoch_time": 9.0, "eval_time": 0.5}, 48: {"epoch_time": 1.3, "eval_time": 0.2}}
    crit = analysis.Criteria(baseline_np=2)
    rows, meta = analysis.rows_from_runs(runs, crit, target="pi4b_cluster", target_predicted=pred)
    return {"rows": rows, "runs": {str(k): v for k, v in runs.items()}, "criteria": asdict(crit), **meta}


def _figures(layout):
    return [m for m in layout.references() if isinstance(m, figure)]


def test_report_figures_fit_their_data_and_bake_in_no_toolbar():
    st = _pi_study()
    figs = {f.title.text: f for f in _figures(plots.report_layout(st))}
    assert all(f.toolbar.autohide for f in figs.values())  # the PNG is a screenshot: no toolbar in it
    eff = figs["efficiency and communication"]
    top = max(r["efficiency"] for r in st["rows"])
    assert top > 1.7 and isinstance(eff.y_range, Range1d) and eff.y_range.end > top  # np=1's 177 % shows
    labels = [m for m in eff.references() if isinstance(m, LabelSet)]
    assert labels and labels[0].source.data["t"] == ["177%* vs np=2"]
    for title in ("speedup vs processes", "efficiency and communication", "final accuracy vs processes"):
        assert isinstance(figs[title].x_scale, LogScale), title  # np 1 and 2 do not run together
        assert list(figs[title].xaxis[0].ticker.ticks) == [1, 2, 8, 48]
    # np=8 and np=48 both sit at chance: told apart by dash and marker, np=8 drawn over np=48
    acc = figs["test accuracy per epoch, by np"]
    dashes = [tuple(r.glyph.line_dash) for r in acc.renderers if not isinstance(r.glyph, Scatter)]
    assert len(dashes) == len(set(dashes)) == 4
    markers = [r.glyph.marker for r in acc.renderers if isinstance(r.glyph, Scatter)]
    assert len(set(markers)) == 4
    # energy labels: the range leaves room around every point, right-half labels point left
    en = figs["energy vs time vs accuracy (pi4b_cluster)"]
    lab = next(m for m in en.references() if isinstance(m, LabelSet))
    ts = lab.source.data["time"]
    assert en.x_range.start < min(ts) and en.x_range.end > max(ts)
    assert [a for t, a in zip(ts, lab.source.data["align"]) if t == max(ts)] == ["right"]
    assert all(f.xaxis[0].major_label_text_font_size == "12px" for f in figs.values() if f.xaxis)


def test_compare_draws_points_titles_by_what_varies_and_warns_on_mixed_settings():
    a = _study({1: _run(1, [0.5], 10.0), 8: _run(8, [0.3], 2.0)})
    b = _study({1: _run(1, [0.5], 10.0), 8: _run(8, [0.45], 2.0)})
    a["config"] = Config(lr_scaling="none", epochs=1).to_dict()
    b["config"] = Config(lr_scaling="linear", epochs=1).to_dict()
    cmp = compare.compare({"naive": a, "linear": b})
    assert compare.compare_title(cmp) == "by learning-rate rule" and cmp["warning"] is None
    assert report.compare_markdown(cmp).startswith("| learning-rate rule | np |")
    html = report.compare_html(cmp)
    assert "fast-but-wrong, by learning-rate rule" in html
    assert html.count('"name":"Scatter"') >= 4  # one-epoch curves are points with markers, not empty plots
    # another model and another epoch count as well: said in the title and in a warning naming them
    c = {**b, "config": Config(lr_scaling="linear", epochs=2, model="squeezenet1_1", width=1.0).to_dict()}
    mixed = compare.compare({"naive": a, "squeeze": c})
    assert compare.compare_title(mixed) == "by epochs, learning-rate rule and model"
    assert "more than one kind of setting" in mixed["warning"]
    for name in ("lr_scaling (naive none, squeeze linear)", "model (naive mobilenetv2_cifar, squeeze squeezenet1_1)",
                 "epochs (naive 1, squeeze 2)"):
        assert name in mixed["warning"], mixed["warning"]
    assert "Warning:" in report.compare_html(mixed)
    # a study written before a setting existed trained as its default does, and how often a run checkpoints
    # is not its training: neither is a difference (the committed 15k studies lack tta, ema_epochs, ...)
    old = {**a, "config": {k: v for k, v in a["config"].items() if k not in ("tta", "ema_epochs", "bn")}}
    new = {**b, "config": {**b["config"], "checkpoint_minutes": 1.0, "straggler_steps": 3}}
    assert compare.compare({"old": old, "new": new})["varies"] == {
        "learning-rate rule": {"lr_scaling": {"old": "none", "new": "linear"}}}


def test_remedies_name_their_candidates_and_default_to_the_pi_like_scale(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pilab", "remedies", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0
    labels = remedies.candidate_labels(DEMO, 48)
    assert all(f"  {lab}  ({remedies.slug(lab)})\n" in p.stdout for lab in labels)  # each with its folder name
    assert "fixed global batch 384 + sqrt lr" in p.stdout
    out = tmp_path / "rem"
    bad = subprocess.run([sys.executable, "-m", "pilab", "remedies", "--only", "baseline,sqrt lr warmup",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "'sqrt lr warmup' is not a candidate at np=48" in bad.stderr and "sqrt lr + warmup (sqrt-lr-warmup);" in bad.stderr
    assert not out.exists()
    bad = subprocess.run([sys.executable, "-m", "pilab", "remedies", "--np", "1", "--recipes-of", "0",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--recipes-of 0 must be >= 1" in bad.stderr and not out.exists()
    parser = build_parser()
    assert parser.parse_args(["remedies"]).target == parser.parse_args(["scale"]).target == "pi4b_cluster"


def test_remedies_reference_run_reports_its_progress():
    cfg = Config(width=0.25, train_subset=128, test_subset=64, epochs=2, batch_size=16, threads=1,
                 lr_ref_batch=16)
    lines = []
    remedies.search(cfg, 2, only=["baseline"], log=lines.append)
    assert lines[0].startswith("  reference: the baseline at np=1, 2 epoch(s)")
    assert [ln.split("test acc")[0].strip() for ln in lines[1:3]] == ["reference np=1: epoch 1/2",
                                                                      "reference np=1: epoch 2/2"]
    assert lines[3].lstrip().startswith("baseline")


def test_help_lists_every_command():
    p = subprocess.run([sys.executable, "-m", "pilab", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0
    head = p.stdout.split("positional arguments")[0]
    for command in COMMANDS:
        name = command.__name__.rsplit(".", 1)[-1]
        assert f"python -m pilab {name}" in head, name


def test_remedies_command_is_recorded_shell_quoted():
    # what `pilab remedies` stores in remedies.json pastes back into a shell as the same arguments
    from pilab.cli import remedies as cli_remedies
    argv = ["--np", "4", "--only", "baseline,linear lr", "--out", "runs/r x"]
    assert shlex.split(cli_remedies.command_line(argv))[4:] == argv


# ---- what the notebooks show: tables as HTML, and words written from the numbers (issue 24) ----------
def test_tables_are_html_in_a_notebook_and_text_elsewhere():
    st = _pi_study()
    t = tables.table(st)
    assert isinstance(t, str) and "verdict" in t.splitlines()[2]  # the CLI's text, unchanged
    html = t._repr_html_()
    assert html.startswith("<table class='pilab-table' data-kind='study'") and "data-col='verdict'" in html
    assert "| np |" not in html and "<td data-col='steps'" in html  # not Markdown; steps shown
    assert "177%*" in html and "* np=1 is below the speed baseline" in html  # the note beside its star
    assert "class='pilab-verdict'" in html and "fast but wrong" in html  # the paragraph, from pilab.verdict
    p = plots.Paragraph("one.\n\ntwo.")
    assert p == "one.\n\ntwo." and p._repr_html_().count("<p>") == 2 and repr(p) == str(p)


def _ablations(accs):
    """ablation rows as ablation.ablations makes them, with these final accuracies."""
    labels = ["1 rank, batch b", "1 rank, batch 128 (global batch, step count)", "1 rank, batch 128, BN over groups of 32",
              "4 ranks, static shards", "4 ranks, linear lr"]
    causes = ["reference", "global batch & steps", "per-rank BN batch", "shard composition", "LR rule"]
    bases = [None, 0, 1, 2, 3]
    rows = []
    for i, (label, cause, a) in enumerate(zip(labels, causes, accs)):
        b = bases[i]
        rows.append({"label": label, "cause": cause, "np": 1 if i < 3 else 4, "global_batch": 32 if i == 0 else 128,
                     "per_rank_batch": 32 if i in (0, 3, 4) else 128, "steps": 248 if i == 0 else 62,
                     "peak_lr": 0.2 if i == 4 else 0.05, "final_test_acc": a, "final_train_loss": 1.0,
                     "test_acc_curve": [a], "ghost_batch": 32 if i == 2 else 0,
                     "compared_with": labels[b] if b is not None else None,
                     "change": a - accs[b] if b is not None else None})
    return {"np": 4, "rows": rows, "config": {"train_subset": 2000, "epochs": 4}}


def test_ablation_words_name_the_cause_the_rows_show():
    res = _ablations([0.34, 0.20, 0.21, 0.19, 0.28])
    words = ablation.ablation_summary(res)
    assert "lost mainly to the step count (14 points)" in words
    assert "the batch statistics" in words and "no clear effect" in words  # +1 point: noise, not a cause
    assert "winning back 9 points of the 15 points lost" in words
    html = tables.ablation_table(res)._repr_html_()
    assert re.search(r"data-col='change' style='[^']*'>-14.0 points<", html)
    # a reference that has not learned separates nothing
    assert "cannot tell one cause from another" in ablation.ablation_summary(_ablations([0.12, 0.1, 0.1, 0.1, 0.1]))


def _committed_output(notebook: str, startswith: str) -> str:
    """The committed text of the first output of ``notebook`` that starts with ``startswith``."""
    nb = json.load(open(os.path.join(os.path.dirname(__file__), "..", "notebooks", notebook)))
    texts = ["".join(o.get("data", {}).get("text/plain", o.get("text", ""))) for c in nb["cells"]
             for o in c.get("outputs", [])]
    return next(t for t in texts if t.startswith(startswith))


def test_ablation_words_on_notebook_03s_committed_rows():
    """issue 51: notebook 03's words called the batch statistics "does not matter" right after the table
    showed them 8 points better. The rows as committed (its ablation table), read back into the generator:
    a gain is said as a gain, a loss as a loss."""
    table = _committed_output("03_fast_but_wrong.ipynb", "run ")
    accs = [float(line.split()[-1]) for line in table.splitlines()[1:]]
    assert len(accs) == 4, table
    words = ablation.ablation_summary({**_ablations(accs + [accs[-1]]), "rows": _ablations(accs + [accs[-1]])["rows"][:4]})
    # the rows of the notebook's last run (small mode): the batch statistics gain 2.6 points, inside the
    # 4-point noise at this size, so they are neither a cost nor "do not matter"
    assert "lost mainly to the step count (9 points), and also to the shards (4 points)" in words, words
    assert "the batch statistics makes no clear difference" in words, words
    assert "not matter" not in words and "costs some" not in words


def test_models_words_compare_speed_at_an_np_every_study_ran():
    """issue 51: notebooks 04 and 05 set this run's np=8 speedup beside the committed studies' np=48 one.
    This run's np 1, 2, 8 beside the committed three-model studies (np up to 48): speed and accuracy are
    compared at np=8, which they all ran."""
    here = scaling.load_study(os.path.join(os.path.dirname(__file__), "..", "experiments", "three-models", "spiking"))
    small = {**here, "rows": [r for r in here["rows"] if r["np"] <= 8]}
    words = tables.models_interpretation({"spiking CNN (this run)": small}, committed="three-models")
    first = str(words).split("\n\n")[0]
    assert "at np=8" in first and "at np=48" not in first, first
    assert compare.common_np({"a": small, "b": here}) == 8 and compare.common_np({"a": here}) == 48


def test_search_words_never_call_a_missed_target_right():
    base = {"global_batch": 128, "per_rank_batch": 32, "peak_lr": 0.05, "steps": 62, "epochs_time": 10.0,
            "epoch_time": 10.0, "time_to_target": None, "energy_j": 100.0}
    res = {"np": 4, "reference_acc": 0.34, "target_accuracy": 0.306, "machine": "pi4b_cluster",
           "candidates": [{**base, "label": "baseline", "final_test_acc": 0.19, "reached_target": False,
                           "speedup": 1.9, "pareto": False, "kept": "the run of '4 ranks, static shards'"},
                          {**base, "label": "fixed global batch 32", "final_test_acc": 0.33, "reached_target": True,
                           "speedup": 0.6, "time_to_target": 40.0, "pareto": True, "kept": ""}]}
    words = remedies.search_summary(res)
    assert "reached by fixed global batch 32" in words and "baseline misses it" in words
    assert "baseline would be 1.9x faster predicted for pi4b_cluster and wrong" in words
    assert "On the fast-and-right front" in words and "front" not in words.split("front")[-1]
    nobody = {**res, "candidates": [dict(res["candidates"][0])]}
    assert "No candidate reaches it" in remedies.search_summary(nobody)
    none = {**res, "target_accuracy": None, "reference_acc": 0.12}
    assert "no target" in remedies.search_summary(none) and "reached by" not in remedies.search_summary(none)


def test_models_words_answer_or_say_too_small_to_tell():
    def st(acc1, acc8):
        return _study({1: _run(1, [acc1], 10.0), 8: _run(8, [acc8], 2.0)})
    words = tables.models_interpretation({"a": st(0.34, 0.30), "b": st(0.40, 0.10)})
    assert "a keeps the most of what it learned" in words
    words = tables.models_interpretation({"a": st(0.34, 0.10), "b": st(0.13, 0.10)})
    assert "b has not learned at this size" in words and "too small to tell" in words
    assert "cannot say which scales better" in words and "fast-but-wrong from np=8" in words
    words = tables.models_interpretation({"a": st(0.34, 0.10), "b": st(0.40, 0.10)})
    assert "Neither keeps clearly more" in words and "all are at chance" in words


def test_a_runs_summary_says_whether_it_learned():
    run = _run(2, [0.15, 0.33], 10.0, gb=64)
    run.update(config={"model": "mobilenetv2_cifar", "width": 0.25, "train_subset": 2000}, total_steps=20)
    words = plots.run_summary(run)
    assert "to 33.0%: well above chance" in words and "2 ranks" in words and "32 per rank" in words
    run["epochs"][-1]["test_acc"] = 0.11
    assert "near chance" in plots.run_summary(run)


def _experiment_module(path):
    """An experiment's driver (a script beside its results, not part of pilab) imported from its file."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_seeds_table_of_the_committed_fast_and_right_points(tmp_path):
    # the committed points of experiments/fast-but-wrong/remedies/full-test (real 10-epoch runs, all 10,000 test
    # images): each row is its result.json's final accuracy, judged against the np=1 baseline
    import json
    import shutil
    from pathlib import Path
    here = Path(__file__).resolve().parents[1] / "experiments" / "fast-but-wrong" / "remedies"
    seeds = _experiment_module(here / "seeds_table.py")
    script = [sys.executable, str(here / "seeds_table.py")]
    root = here / "full-test"
    tab = seeds.table(str(root))
    # the reference: np=1's baseline, the mean over its committed seeds (sample sd from two on)
    import statistics
    refs = [json.loads(f.read_text())["epochs"][-1]["test_acc"]
            for f in sorted(root.glob("np1/seed*/baseline/result.json"))]
    ref = statistics.fmean(refs)
    assert tab["reference_acc"] == ref and abs(tab["target"] - (ref - 0.01)) < 1e-12
    assert tab["reference_sd"] == (statistics.stdev(refs) if len(refs) > 1 else None)
    rows = {(r["np"], r["slug"]): r for r in tab["rows"]}
    base48 = json.loads((root / "np48" / "seed0" / "baseline" / "result.json").read_text())
    r = rows[(48, "baseline")]
    assert r["acc_mean"] == base48["epochs"][-1]["test_acc"] and r["acc_sd"] is None and r["n"] == 1
    assert r["delta_vs_np1_same_recipe"] == r["acc_mean"] - ref and r["goal"] is False
    assert r["time_to_target_speedup"] is None  # 0.37 never reaches the target: no time, not a number
    assert r["predicted_pi_speedup"] > 15  # fast (and wrong)
    assert rows[(1, "baseline")]["delta_vs_np1_baseline"] == 0.0
    text = seeds.markdown(tab)
    assert "| baseline | 48 |" in text
    # the goal is the mean of 3 seeds: a row that meets it on fewer is said to, and is not met
    met = [r for r in tab["rows"] if r["goal"]]
    assert all(r["np"] == 48 and r["n"] >= 3 for r in met)
    assert ("no candidate meets it yet" in text) == (not met)
    for row in tab["rows"]:
        assert not (row["goal"] and row["goal_on_fewer_seeds"])
        if row["goal_on_fewer_seeds"]:
            assert row["n"] < 3 and f"| {row['label']} | 48 | {row['acc_mean']:.4f} (n={row['n']})" in text
            assert f"met on n={row['n']} of 3 seeds |" in text
    # a row short of the goal says why: a criterion it misses, or (its mean close enough) the seeds whose
    # runs never reach the target, which leave it without a time to target
    for row in tab["rows"]:
        if row["np"] > 1 and not row["goal"] and not row["goal_on_fewer_seeds"]:
            assert row["misses"] and f"| not met ({'; '.join(row['misses'])}) |" in text, row["label"]
            assert ("accuracy" in row["misses"]) == (row["acc_mean"] < tab["target"])
            assert any(m.startswith("speedup") for m in row["misses"]) == (row["predicted_pi_speedup"] < 15)
    assert rows[(48, "baseline")]["misses"] == ["accuracy"]
    short = [(s, r["epochs"][-1]["test_acc"]) for s, r in sorted(
        (int(f.parts[-3][4:]), json.loads(f.read_text())) for f in root.glob(
            "np48/seed*/fixed-global-batch-192-few-step-recipe-syncbatchnorm-over-8-ranks/result.json"))
        if r["epochs"][-1]["test_acc"] < tab["target"]]
    eight = rows[(48, "fixed-global-batch-192-few-step-recipe-syncbatchnorm-over-8-ranks")]
    # (the committed over-8 row: +0.5 points on the mean at 16.2x, but seed 1 ends below the target)
    assert short and eight["acc_mean"] >= tab["target"] and eight["predicted_pi_speedup"] >= 15
    assert eight["time_to_target_speedup"] is None and eight["misses"] == [
        ", ".join(f"seed {s} ends at {a:.4f}" for s, a in short) + " below the target"]
    assert f"{eight['label']} ({eight['misses'][0]})" in text.splitlines()[-1]
    # the Pareto front over predicted Pi time, accuracy and energy: a row is on it exactly when no other row
    # is at least as good on all three and better on one
    def beats(q, p):
        axes = [(p["predicted_pi_time_s"] - q["predicted_pi_time_s"]), (q["acc_mean"] - p["acc_mean"]),
                (p["energy_j"] - q["energy_j"])]
        return all(d >= 0 for d in axes) and any(d > 0 for d in axes)
    for p in tab["rows"]:
        assert p["front"] == (not any(beats(q, p) for q in tab["rows"])), p["label"]
    assert rows[(1, "few-step-recipe")]["front"]  # the most accurate row
    assert not rows[(48, "local-sgd-h-8-at-8-per-rank-sqrt-lr")]["front"]  # at chance, and no faster
    # the CLI: the markdown, the JSON and the report with its figure
    p = subprocess.run([*script, str(root), "--out", str(tmp_path / "tab")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "tab.md").read_text() == text
    assert "final test accuracy vs predicted whole-run time" in (tmp_path / "tab.html").read_text()
    # re-priced on a measured latency: the same accuracies; SyncBatchNorm's two Allreduces per BatchNorm
    # layer a step make its rows lose more of their speedup than the baseline's few fused buckets
    from pilab import perfmodel
    assert seeds.table(str(root), calibration=perfmodel.pi4b_cluster())["rows"] == tab["rows"]
    slow = {(r["np"], r["slug"]): r for r in seeds.table(
        str(root), calibration=perfmodel.pi4b_cluster(inter=perfmodel.Link(300e-6, 1 / 117e6)))["rows"]}
    assert all(slow[k]["acc_mean"] == r["acc_mean"] for k, r in rows.items())
    sync = [k for k in rows if k[0] == 48 and "syncbatchnorm" in k[1]]
    recipe = (48, "fixed-global-batch-192-few-step-recipe")
    loss = {k: slow[k]["predicted_pi_speedup"] / rows[k]["predicted_pi_speedup"]
            for k in sync + [(48, "baseline"), recipe]}
    whole = [k for k in sync if "-over-" not in k[1]]
    assert whole and all(loss[k] < loss[(48, "baseline")] < 1 for k in whole), loss
    # ... except over each node's two ranks: those Allreduces never cross the network; over 8 ranks, between
    pair, eight = (48, "fixed-global-batch-192-few-step-recipe-syncbatchnorm-over-2-ranks"), \
        (48, "fixed-global-batch-192-few-step-recipe-syncbatchnorm-over-8-ranks")
    assert max(loss[k] for k in whole) < loss[eight] < loss[pair] == pytest.approx(loss[recipe], abs=1e-3), loss
    p = subprocess.run([*script, str(root), "--inter-alpha", "300e-6"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"| {slow[sync[0]]['label']} | 48 |"))
    assert f"| {slow[sync[0]]['predicted_pi_speedup']:.1f}× |" in line
    p = subprocess.run([*script, str(root), "--inter-alpha", "-1", "--out",
                        str(tmp_path / "neg")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--inter-alpha" in p.stderr and len(p.stderr.splitlines()) == 1
    assert not list(tmp_path.glob("neg*"))
    # a second seed of the np=48 baseline: mean and sample sd over the two
    copy = tmp_path / "study"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("*.pt", "*.html", "*.png", "remedies.json"))
    # (read and written by pilab.resultfile: a result is result.json and its per-step file)
    twin = resultfile.load(str(root / "np48" / "seed0" / "baseline" / "result.json"))
    twin["epochs"][-1]["test_acc"] = base48["epochs"][-1]["test_acc"] + 0.02
    resultfile.save(twin, str(copy / "np48" / "seed1" / "baseline" / "result.json"))
    r2 = {(r["np"], r["slug"]): r for r in seeds.table(str(copy))["rows"]}[(48, "baseline")]
    assert r2["n"] == 2 and abs(r2["acc_mean"] - (r["acc_mean"] + 0.01)) < 1e-12
    assert abs(r2["acc_sd"] - 0.02 / 2 ** 0.5) < 1e-12
    # without the np=1 baseline: one line, exit 2, nothing written
    shutil.rmtree(copy / "np1")
    p = subprocess.run([*script, str(copy), "--out", str(tmp_path / "t")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no finished np=1 baseline" in p.stderr and not list(tmp_path.glob("t.*"))
