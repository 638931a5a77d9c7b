"""The paper-size study beside the published figures (pilab.paper, `pilab compare --paper`): on a tiny real
study of the real archive, and on whatever points of experiments/paper-size/ have finished."""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import mpi_env
from pilab import perfmodel, resultfile
from pilab.study import analysis, compare as paper, points, scaling
from pilab.config import Config, ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FBW = os.path.join(REPO, "experiments", "fast-but-wrong")
PS = os.path.join(REPO, "experiments", "paper-size")


def _pilab(*args, cwd=REPO, timeout=600):
    p = subprocess.run([sys.executable, "-m", "pilab", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _pct(v):
    return f"{v * 100:.1f}%"


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory, cifar_archive):
    """A real np=1 run and an exact np=48 simulation of 480 images of the real archive, one epoch,
    written one point at a time as experiments/paper-size/run.sh writes them (no study.json)."""
    d = tmp_path_factory.mktemp("paper") / "naive"
    proto = ["--data", str(cifar_archive), "--model", "mobilenetv2_cifar", "--width", "0.25",
             "--train-subset", "480", "--test-subset", "100", "--batch-size", "4", "--lr-ref-batch", "32",
             "--lr", "0.05", "--epochs", "1", "--threads", "1", "--quiet"]
    _pilab("train", *proto, "--checkpoint-every", "1", "--out", str(d / "np1"))
    _pilab("simulate", "--np", "48", *proto, "--out", str(d / "np48"))
    return d


def test_compare_paper_sets_a_tiny_real_study_beside_the_published_figures(tiny_study, tmp_path):
    out = tmp_path / "cmp"
    p = _pilab("compare", str(tiny_study), os.path.join(FBW, "naive"), "--labels", "tiny,15k", "--paper",
               "--out", str(out))
    cmp = json.loads((out / "compare.json").read_text())
    side = cmp["paper"]
    rows = {r["np"]: r for r in side["rows"]}
    assert sorted(rows) == list(paper.PAPER_NPS)
    res = {n: json.loads((tiny_study / f"np{n}" / "result.json").read_text()) for n in (1, 48)}
    # the finished points carry their own numbers; the others are pending, never a number
    for n, r in rows.items():
        a = r["studies"]["tiny"]
        if n in res:
            assert a["final_test_acc"] == res[n]["epochs"][-1]["test_acc"] and not a["pending"]
            assert a["steps"] == res[n]["total_steps"] and a["simulated"] == (n == 48)
        else:
            assert a["pending"] and a["final_test_acc"] is None
    assert side["pending"]["tiny"] == [2, 4, 8, 16, 24, 32]
    # a finished study without an np did not run it: not pending
    fbw = scaling.load_study(os.path.join(FBW, "naive"))
    assert rows[4]["studies"]["15k"]["not_run"] and not rows[4]["studies"]["15k"]["pending"]
    assert rows[48]["studies"]["15k"]["final_test_acc"] == fbw["runs"]["48"]["epochs"][-1]["test_acc"]
    # the published figures, and the Pi predictions of both profiles for the first study's settings
    assert (rows[4]["published_efficiency"], rows[8]["published_efficiency"]) == (0.909, 0.523)
    assert rows[48]["published_speedup"] == 9.99 and rows[48]["published_efficiency"] == 0.416
    assert rows[16]["published_speedup"] is None
    cfg = Config.from_dict({**res[1]["config"], "threads": 0})
    for n in (4, 48):
        for prof in ("naive", "pilab"):
            pr = perfmodel.predict(cfg, n, "pi4b_cluster", prof, baseline_np=2)
            assert rows[n][f"{prof}_speedup"] == pytest.approx(pr["speedup"])
    # the paragraph is made of these numbers
    v = side["verdict"]
    assert "90.9% at np=4, 52.3% at np=8, 41.6% at np=48 (speedup 9.99 at np=48)" in v
    assert f"{rows[48]['naive_speedup']:.2f} at np=48" in v and f"{rows[48]['pilab_speedup']:.2f} at np=48" in v
    ref, acc48 = (res[n]["epochs"][-1]["test_acc"] for n in (1, 48))
    tiny = v[v.index("tiny:"):v.index("15k:")]
    assert _pct(acc48) in tiny and _pct(ref) in tiny and "(pending: np 2, 4, 8, 16, 24, 32)" in tiny
    expected = "collapses to chance" if acc48 < 0.15 else "falls to" if acc48 < ref - 0.10 else "holds"
    assert expected in tiny, tiny
    assert "15k: accuracy falls to 37.9% at np=48, 26 points below np=1's 63.9%" in v  # committed study
    # the printed table: one line per np, its accuracy cells as in compare.json
    lines = [ln for ln in p.stdout.splitlines() if re.match(r"\| \d+ \|", ln)][:len(rows)]
    assert [int(ln.split("|")[1]) for ln in lines] == list(paper.PAPER_NPS)
    cells = {int(ln.split("|")[1]): [c.strip() for c in ln.split("|")[1:-1]] for ln in lines}
    assert cells[48][3] == "9.99 (41.6%)" and cells[4][3] == "1.82 (90.9%) *"
    assert cells[48][6].startswith(f"{acc48:.3f}") and cells[2][6] == "pending" and cells[4][7] == "–"
    assert cells[48][7].startswith(f"{fbw['runs']['48']['epochs'][-1]['test_acc']:.3f}")
    # every finished point in detail: its curve, and the study's own Pi row (time, energy, time to target)
    own = {r["np"]: r for r in scaling.study_from_points(str(tiny_study))["rows"]}
    for n in (1, 48):
        a = rows[n]["studies"]["tiny"]
        assert a["test_acc_curve"] == [e["test_acc"] for e in res[n]["epochs"]]
        assert (a["pi_time_per_epoch"], a["pi_energy_j"], a["pi_time_to_target"]) == \
            (own[n]["time_per_epoch"], own[n]["energy_j"], own[n]["time_to_target"])
        assert a["pi_time_per_epoch"] > 0 and a["pi_energy_j"] > 0
    assert rows[48]["studies"]["tiny"]["pi_time_per_epoch"] < rows[1]["studies"]["tiny"]["pi_time_per_epoch"]
    detail = [c.strip() for c in next(ln for ln in p.stdout.splitlines() if ln.startswith("| tiny | 48 |"))
              .split("|")[1:-1]]
    assert detail[4] == " ".join(f"{e['test_acc']:.3f}" for e in res[48]["epochs"])
    assert detail[5] == f"{own[48]['time_per_epoch']:.0f} s" and detail[6] == f"{own[48]['energy_j'] / 1e3:.1f} kJ"
    assert sum(bool(re.match(r"\| 15k \| \d+ \| (measured|sim exact) \| \d+ \| (\d\.\d{3} )+\d\.\d{3} \|", ln)) for ln in p.stdout.splitlines()) \
        == len(fbw["runs"])
    html = (out / "compare.html").read_text()
    assert "cdn.bokeh.org" not in html and "beside the paper" in html and "Every finished point" in html
    # the partial study is not written back as study.json (its points are the only copy)
    assert not (tiny_study / "study.json").exists()


def test_the_full_set_gets_its_image_counts_from_the_runs_for_the_performance_model(tiny_study, cifar_archive):
    r = resultfile.load(str(tiny_study / "np1" / "result.json"))
    whole = Config(data=str(cifar_archive), width=0.25)  # train_subset=0: all the images
    # the study loaded the archive, so its cache gives the counts; the cache is keyed by content, so a
    # byte-identical copy elsewhere has them too, and a file whose content was never loaded has none
    assert perfmodel.predict(whole, 2, "pi4b_cluster")["n_train"] == 50000
    other = tiny_study.parent / "never-loaded.tar.gz"
    shutil.copyfile(cifar_archive, other)
    assert perfmodel.predict(dataclasses.replace(whole, data=str(other)), 2, "pi4b_cluster")["n_train"] == 50000
    with open(other, "r+b") as f:  # one byte changed: other content
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ConfigError, match="n_train"):
        perfmodel.predict(dataclasses.replace(whole, data=str(other)), 2, "pi4b_cluster")
    sized = analysis.sized_for_model(whole, {1: r})
    assert (sized.train_subset, sized.test_subset) == (r["data"]["n_train"], r["data"]["n_test"])
    assert perfmodel.predict(sized, 2, "pi4b_cluster")["n_train"] == 480
    # one directory holds one training: a point of other settings is refused, naming the np
    other = resultfile.load(str(tiny_study / "np48" / "result.json"))
    bad = tiny_study.parent / "mixed"
    for n, res in ((1, r), (48, {**other, "config": {**other["config"], "lr": 0.2}})):
        resultfile.save(res, str(bad / f"np{n}" / "result.json"))
    with pytest.raises(ConfigError, match=r"np \[48\]"):
        scaling.study_from_points(str(bad))


def test_compare_paper_on_the_committed_paper_size_points(tmp_path):
    """Whatever points of experiments/paper-size/ have finished are in the table with their own accuracy; the rest
    are pending; the committed compare.json is what `pilab compare --paper` makes of them."""
    rules = {"50k naive": "naive", "50k sqrt+warmup": "sqrt-warmup"}
    batch = os.path.join(REPO, "experiments", "paper-batch", "cpu",
                         "linear-warmup-5-few-step-zero-init-residual")
    muon = os.path.join(REPO, "experiments", "paper-batch", "cpu", "muon-0-004-sgd-0-00025-wsd-3")
    p = _pilab("compare", *[os.path.join(PS, r) for r in rules.values()], os.path.join(FBW, "naive"),
               os.path.join(FBW, "sqrt-warmup"), batch, muon, "--labels",
               "50k naive,50k sqrt+warmup,15k naive,15k sqrt+warmup,50k few-step+zero-init,50k Muon", "--paper",
               "--out", str(tmp_path / "c"))
    side = json.loads((tmp_path / "c" / "compare.json").read_text())["paper"]
    for label, r in rules.items():
        for row in side["rows"]:
            path = os.path.join(PS, r, f"np{row['np']}", "result.json")
            done = points.finished_run(path, row["np"], Config.from_dict(json.load(open(path))["config"]),
                                        row["np"] > 2) if os.path.exists(path) else None
            a = row["studies"][label]
            assert a["pending"] == (done is None), (label, row["np"])
            if done is not None:
                assert a["final_test_acc"] == done["epochs"][-1]["test_acc"]
                assert a["simulated"] == (row["np"] > 2)  # np 1 and 2 real runs, the rest simulated
    # the paper-batch screen's folders (npN-seedS): their seed 0 at np 1 and 48, and no other np pending
    for label, folder in (("50k few-step+zero-init", batch), ("50k Muon", muon)):
        seed0 = {n: json.load(open(os.path.join(folder, f"np{n}-seed0", "result.json"))) for n in (1, 48)}
        for row in side["rows"]:
            a = row["studies"][label]
            assert not a["pending"]
            assert a["final_test_acc"] == (seed0[row["np"]]["epochs"][-1]["test_acc"] if row["np"] in seed0 else None)
    committed = json.loads(open(os.path.join(PS, "compare.json")).read())
    assert committed["paper"]["rows"] == side["rows"], "re-run the compare command in experiments/paper-size/README.md"
    assert "pending" in p.stdout or all(not any(a["pending"] for a in r["studies"].values()) for r in side["rows"])
