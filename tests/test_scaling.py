"""The strong-scaling study: metrics, judging runs, the CLI end to end, remedies."""
import json
import subprocess
import sys

import pytest

from conftest import mpi_env
from pilab import remedies, scaling
from pilab.config import Config


def test_published_speedups_turn_back_into_published_efficiencies():
    # The original Pi study: S=9.99 at 48 processes, quoted as 41.6% efficiency. Only a one-node
    # baseline (p0=2 processes) makes those agree; against one process it would be 20.8%.
    from pilab.perfmodel import efficiency, karp_flatt
    assert efficiency(9.99, 48, p0=2) == pytest.approx(0.416, abs=5e-4)
    assert efficiency(9.99, 48, p0=1) == pytest.approx(0.208, abs=5e-4)
    # 90.9% at np=4 and 52.3% at np=8 are speedups of 1.818 and 2.092 over two processes
    for p, e in ((4, 0.909), (8, 0.523)):
        s = e * p / 2
        assert efficiency(s, p, p0=2) == pytest.approx(e)
    assert karp_flatt(9.99, 48, p0=2) == pytest.approx((1 / 9.99 - 1 / 24) / (1 - 1 / 24))
    assert scaling._karp_flatt(1.0, 2, p0=2) is None


def _run(np_, accs, t_epoch, simulated=False, gb=32):
    return {"np": np_, "simulated": simulated, "per_rank_batch": gb // np_ if gb >= np_ else 1,
            "global_batch": gb, "steps_per_epoch": 10, "peak_lr": 0.1, "threads": 1,
            "wall_time": t_epoch * len(accs), "peak_mem_mb": [100.0] * np_, "total_steps": 10 * len(accs),
            "epochs": [{"epoch": i + 1, "time": t_epoch, "comm": 0.1 * t_epoch, "comm_exposed": 0.05 * t_epoch,
                        "train_acc": a, "test_acc": a, "train_loss": 1.0, "test_loss": 1.0}
                       for i, a in enumerate(accs)]}


def test_rows_judge_speed_and_accuracy():
    runs = {1: _run(1, [0.3, 0.5, 0.6], 10.0), 2: _run(2, [0.2, 0.45, 0.56], 6.0),
            4: _run(4, [0.1, 0.12, 0.15], 4.0), 8: _run(8, [0.1, 0.3, 0.45], 2.5)}
    rows, meta = scaling.rows_from_runs(runs, scaling.Criteria())
    by = {r["np"]: r for r in rows}
    assert meta["baseline_np"] == 1 and meta["target_accuracy"] == pytest.approx(0.54)
    assert by[2]["speedup"] == pytest.approx(10 / 6) and by[2]["efficiency"] == pytest.approx(10 / 12)
    assert not by[2]["fast_but_wrong"]                       # 4 points below: fine
    assert by[4]["fast_but_wrong"] and by[8]["fast_but_wrong"]  # under 20% / 15 points below
    assert by[1]["time_to_target"] == pytest.approx(30.0)
    assert by[2]["time_to_target"] == pytest.approx(18.0)
    assert by[2]["speedup_to_target"] == pytest.approx(30 / 18)
    assert by[4]["time_to_target"] is None and by[4]["speedup_to_target"] is None
    assert by[2]["comm_share"] == pytest.approx(0.1)
    csv = scaling.to_csv(rows)
    assert "not reached" in csv.splitlines()[3]
    rows2, meta2 = scaling.rows_from_runs(runs, scaling.Criteria(baseline_np=2))
    assert meta2["baseline_np"] == 2
    assert {r["np"]: r for r in rows2}[4]["efficiency"] == pytest.approx(6 / 4 * 2 / 4)


def test_scale_cli_end_to_end(tmp_path):
    out = tmp_path / "study"
    p = subprocess.run(
        [sys.executable, "-m", "pilab", "scale", "--nps", "1,2", "--simulate-nps", "4",
         "--width", "0.25", "--train-subset", "256", "--test-subset", "100", "--epochs", "2",
         "--batch-size", "16", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    st = json.loads((out / "study.json").read_text())
    assert [r["np"] for r in st["rows"]] == [1, 2, 4]
    assert [r["simulated"] for r in st["rows"]] == [False, False, True]
    assert st["config"]["threads"] == 1  # constant across the sweep: 2 cores / 2 ranks
    assert all(st["runs"][k]["threads"] == 1 for k in ("1", "2"))
    r2 = st["rows"][1]
    assert r2["speedup"] > 0 and r2["efficiency"] == pytest.approx(r2["speedup"] / 2)
    assert (out / "np2" / "result.json").exists() and (out / "study.csv").exists()
    html = (out / "report.html").read_text()
    assert "cdn.bokeh.org" not in html and "Bokeh" in html  # BokehJS inline: works offline
    assert "FAST-BUT-WRONG" in p.stdout or " ok" in p.stdout


def test_compare_cli_on_the_committed_study(tmp_path):
    """`pilab compare` on docs/fast-but-wrong's study files, and the shape those files must show."""
    import os
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = os.path.join(repo, "docs", "fast-but-wrong")
    rules = ["naive", "linear", "linear-warmup"]
    p = subprocess.run([sys.executable, "-m", "pilab", "compare", *[os.path.join(docs, r) for r in rules],
                        "--labels", "naive,linear,warmup", "--out", str(tmp_path / "cmp")],
                       cwd=repo, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    cmp = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    acc = {(r["label"], r["np"]): r for r in cmp["rows"]}
    assert sorted(acc) == sorted((lab, n) for lab in ("naive", "linear", "warmup") for n in (1, 8, 48))
    html = (tmp_path / "cmp" / "compare.html").read_text()
    # the table is a Div inside Bokeh's document JSON (escaped there); BokehJS itself contains
    # "<table", so look for the Div's own styled table
    assert "table style=" in html and "linear" in html and "cdn.bokeh.org" not in html
    # the pass criteria, on the committed real-data run
    chance, n_epochs = 0.10, len(acc[("naive", 1)]["test_acc_curve"])
    assert acc[("warmup", 1)]["final_test_acc"] > 2 * chance
    assert acc[("warmup", 8)]["final_test_acc"] > 2 * chance
    assert acc[("linear", 48)]["epochs_near_chance"] >= n_epochs / 2
    assert (acc[("linear", 48)]["final_test_acc"] < acc[("naive", 48)]["final_test_acc"]
            < acc[("warmup", 8)]["final_test_acc"])
    # a study directory that does not exist: one clear line, non-zero exit, nothing written
    bad = subprocess.run([sys.executable, "-m", "pilab", "compare", str(tmp_path / "nope"),
                          "--out", str(tmp_path / "cmp2")], cwd=repo, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "does not exist" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "cmp2").exists()


def test_remedies_search_runs_candidates(tmp_path):
    cfg = Config(width=0.25, train_subset=256, test_subset=100, epochs=1, batch_size=16,
                 threads=1, lr_ref_batch=16)
    res = remedies.search(cfg, 4, only=["baseline", "linear lr", "fixed global batch 16"],
                          reference_acc=0.3)
    labels = [c["label"] for c in res["candidates"]]
    assert labels == ["baseline", "linear lr", "fixed global batch 16"]
    base, lin, fixed = res["candidates"]
    assert base["global_batch"] == 64 and lin["peak_lr"] == pytest.approx(0.05 * 4)
    assert fixed["global_batch"] == 16 and fixed["per_rank_batch"] == 4
    assert all(0 <= c["final_test_acc"] <= 1 for c in res["candidates"])
    assert "baseline" in remedies.table(res)


def test_pareto_front():
    pts = [{"epochs_time": 10, "final_test_acc": 0.5}, {"epochs_time": 5, "final_test_acc": 0.5},
           {"epochs_time": 20, "final_test_acc": 0.7}, {"epochs_time": 30, "final_test_acc": 0.6}]
    assert remedies.pareto(pts) == [False, True, True, False]


def test_ablations_separate_the_causes():
    cfg = Config(width=0.25, train_subset=128, test_subset=64, epochs=1, batch_size=8, threads=1,
                 lr_ref_batch=8)
    res = remedies.ablations(cfg, 4)
    rows = {r["cause"] + ":" + str(r["np"]): r for r in res["rows"]}
    assert [r["np"] for r in res["rows"]] == [1, 1, 1, 4, 4, 4, 4]
    ref, big = res["rows"][0], res["rows"][1]
    assert ref["global_batch"] == 8 and big["global_batch"] == 32
    assert big["steps"] == res["rows"][3]["steps"], "same global batch -> same step count as np=4"
    assert res["rows"][5]["peak_lr"] == 4 * res["rows"][3]["peak_lr"]
    assert "shard composition:4" in rows and "test acc" in remedies.ablation_table(res)
