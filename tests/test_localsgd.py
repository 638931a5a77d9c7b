"""Local SGD and the few-step recipe in the simulator: the plan of local steps and averages, a resume
between two averages, what cannot run, and the pieces (schedule, weight average). Their exactness
against real `mpiexec` ranks is tests/test_mpi.py's (local_run)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pilab import engine
from pilab.engine import localsgd
from pilab.engine.checkpoint import CheckpointError
from pilab.config import Config, ConfigError
from pilab.engine.ema import WeightAverage
from pilab.engine.optim import lr_at

TINY = Config(width=0.25, train_subset=160, test_subset=50, batch_size=8, epochs=2, lr=0.05, lr_ref_batch=8,
              threads=1, seed=5, local_steps=4, local_after=0.5, ema_epochs=0.5, label_smoothing=0.1)


def test_the_plan_is_synchronous_first_then_local_with_an_average_every_h_steps_and_at_each_epochs_end():
    cfg = Config(epochs=3, local_steps=4, local_after=1)
    plan = [[localsgd.phase(cfg, 10, e, s) for s in range(10)] for e in range(3)]
    assert all(p == localsgd.SYNC for p in plan[0])
    for e in (1, 2):
        assert [s for s in range(10) if plan[e][s].average] == [3, 7, 9]
        assert all(p.local for p in plan[e])
    assert localsgd.phase(Config(), 10, 1, 3) == localsgd.SYNC  # local_steps=1: plain synchronous SGD
    assert localsgd.averages_per_epoch(4, 10) == 3


@pytest.mark.parametrize("bad, words", [
    (dict(local_steps=0), "local_steps=0"),
    (dict(local_steps=2, bn="sync"), "bn='local'"),
    (dict(local_steps=2, compression="fp16"), "compression=none"),
    (dict(local_after=11), "local_after=11"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(ema_epochs=-1.0), "ema_epochs=-1.0"),
])
def test_settings_that_cannot_run_are_refused_with_the_fix(bad, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        Config(**bad)


def test_the_fast_simulator_refuses_local_sgd():
    with pytest.raises(ConfigError, match="simulate_mode=exact"):
        engine.fit(replace(TINY, simulate_mode="fast", data="embedded"), engine.VirtualRanks(4))


def test_the_simulator_runs_sync_batchnorm_as_one_forward_and_refuses_what_that_cannot_be():
    sync = replace(TINY, local_steps=1, local_after=0.0, ema_epochs=0.0, bn="sync", data="embedded", epochs=1,
                   max_steps=2)
    res = engine.simulate(sync, 4)
    assert res["ranks_per_chunk"] == 4 and res["steps_done"] == 2  # every rank's images in one forward
    with pytest.raises(ConfigError, match="ranks_per_chunk=2; leave it 0"):
        engine.simulate(sync, 4, ranks_per_chunk=2)
    with pytest.raises(ConfigError, match="needs each rank's own gradient"):
        engine.simulate(replace(sync, batch_size=4, batch_ramp="gns:8"), 4)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    d = tmp_path_factory.mktemp("whole")
    res, model = engine.fit(replace(TINY, out=str(d)), engine.VirtualRanks(4))
    return res, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_simulated_run_resumes_between_two_averages_bitwise(whole, tmp_path):
    res, state = whole
    spe = res["steps_per_epoch"]
    k = round(TINY.local_after * spe) + 1  # a local step that is not an average
    assert not localsgd.phase(TINY, spe, *divmod(k - 1, spe)).average
    engine.fit(replace(TINY, out=str(tmp_path), checkpoint_every_steps=k, max_steps=k), engine.VirtualRanks(4))
    again, model = engine.fit(replace(TINY, out=str(tmp_path), resume=str(tmp_path / "checkpoint.pt")),
                              engine.VirtualRanks(4))
    assert again["resumed_from_step"] == k
    assert max(float((model.state_dict()[n] - v).abs().max()) for n, v in state.items()
               if v.is_floating_point()) == 0.0
    assert again["epochs"][-1]["test_acc"] == res["epochs"][-1]["test_acc"]
    assert again["steps"]["loss"] == res["steps"]["loss"][k:]
    # ... but not at another np: between two averages each rank's weights are its own
    with pytest.raises(CheckpointError, match="resume it at np=4"):
        engine.fit(replace(TINY, batch_mode="global", batch_size=32, out=str(tmp_path / "g"),
                               checkpoint_every_steps=k, max_steps=k), engine.VirtualRanks(4))
        engine.fit(replace(TINY, batch_mode="global", batch_size=32, out=str(tmp_path / "g"),
                               resume=str(tmp_path / "g" / "checkpoint.pt")), engine.VirtualRanks(2))


def test_local_steps_change_the_run_and_the_recipe_pieces_change_the_evaluation(whole):
    res, _ = whole
    # local SGD runs the exact mode (simulate_mode auto picks it); the synchronous run is asked for the same
    sync, _ = engine.fit(replace(TINY, local_steps=1, simulate_mode="exact"), engine.VirtualRanks(4))
    assert sync["steps"]["loss"][:round(TINY.local_after * res["steps_per_epoch"])] == \
        res["steps"]["loss"][:round(TINY.local_after * res["steps_per_epoch"])]  # the synchronous part is shared
    assert sync["steps"]["loss"] != res["steps"]["loss"]
    plain, _ = engine.fit(replace(TINY, ema_epochs=0.0), engine.VirtualRanks(4))
    assert plain["steps"]["loss"] == res["steps"]["loss"]  # the average is evaluated, never trained
    assert plain["epochs"][-1]["test_loss"] != res["epochs"][-1]["test_loss"]


def test_the_linear_schedule_warms_up_then_falls_to_zero():
    lrs = [lr_at(s, peak_lr=1.0, total_steps=10, warmup_steps=2, schedule="linear") for s in range(11)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[6] == pytest.approx(0.5)
    assert lrs[10] == 0.0


def test_the_weight_average_decays_per_step_however_the_updates_are_grouped():
    p = [torch.ones(3), torch.full((2,), 4.0)]
    one, two = WeightAverage([torch.zeros(3), torch.zeros(2)], 0.9), WeightAverage([torch.zeros(3), torch.zeros(2)], 0.9)
    one.update(p)
    one.update(p)
    two.update(p, steps=2)
    assert all(torch.allclose(a, b) for a, b in zip(one.shadow, two.shadow))
    assert torch.allclose(two.shadow[0], torch.full((3,), 1 - 0.81))
    live = [torch.nn.Parameter(torch.zeros(3))]
    avg = WeightAverage(live, 0.5)
    avg.update([torch.ones(3)])
    with avg.applied(live):
        assert live[0].tolist() == [0.5] * 3
    assert live[0].tolist() == [0.0] * 3


def test_the_performance_model_prices_a_local_step_and_the_averages():
    import math

    from pilab.perfmodel.predict import predict
    cfg = Config(width=0.25, train_subset=15000, test_subset=2000, epochs=10, batch_size=32)
    sync = predict(cfg, 48, "pi4b_cluster")
    local = predict(replace(cfg, local_steps=8), 48, "pi4b_cluster")
    post = predict(replace(cfg, local_steps=8, local_after=5), 48, "pi4b_cluster")
    spe = sync["steps_per_epoch"]
    # parameters averaged every 8 steps and at each epoch's end: ceil(spe / 8) of spe steps send them
    assert local["bytes_per_step"] == pytest.approx(sync["bytes_per_step"] * math.ceil(spe / 8) / spe)
    assert local["step"]["comm_exposed"] < sync["step"]["comm_exposed"] / 2
    assert local["step"]["compute"] == sync["step"]["compute"]
    # half the run synchronous: half-way between the two
    assert post["step"]["comm_exposed"] == pytest.approx((sync["step"]["comm_exposed"] + local["step"]["comm_exposed"]) / 2)
    assert predict(replace(cfg, tta=True), 48, "pi4b_cluster")["eval_time"] > sync["eval_time"]


def test_a_batch_ramp_cuts_the_same_shards_into_bigger_batches_and_the_model_prices_each_epoch():
    from pilab.perfmodel.predict import predict
    cfg = replace(TINY, local_steps=1, ema_epochs=0.0, batch_size=4, batch_ramp="1:8", epochs=2, lr_scaling="linear")
    res, _ = engine.fit(cfg, engine.VirtualRanks(4))
    assert res["batch_plan"] == [{"epoch": 1, "per_rank_batch": 4, "steps": 10},
                                 {"epoch": 2, "per_rank_batch": 8, "steps": 5}]
    assert [e["steps"] for e in res["epochs"]] == [10, 5] and res["total_steps"] == 15 and res["epochs_done"] == 2
    assert res["epochs"][0]["images"] == res["epochs"][1]["images"] == 160  # every image once an epoch
    assert res["steps"]["lr"][10] > res["steps"]["lr"][9]  # the lr rule follows the doubled batch
    pred = predict(replace(cfg, data="embedded", train_subset=160, test_subset=50), 4, "pi4b_cluster")
    assert [p["steps"] for p in pred["batch_plan"]] == [10, 5] and pred["steps_per_epoch"] == 7.5
    with pytest.raises(ConfigError, match="EPOCH:BATCH"):
        Config(batch_ramp="1-8")


def test_every_remedy_label_can_be_named_to_only():
    # the fast-and-right study's candidates (kept beside its results): pilab's default ones and its own
    from pathlib import Path
    from pilab.study import remedies
    cands = remedies.load_candidates(str(Path(__file__).resolve().parents[1] / "experiments" / "fast-but-wrong"
                                         / "remedies" / "candidates.py"))
    cfg = Config(width=0.25, train_subset=15000, epochs=10, batch_size=32, lr=0.05, lr_ref_batch=32)
    labels = remedies.candidate_labels(cfg, 48, cands)
    assert len(labels) == len(set(labels)) == 46
    assert not [label for label in labels if "," in label]  # --only splits on commas
    # an installed pilab has the same list by name (--candidates toolbox), the study's file imports it
    assert remedies.candidate_labels(cfg, 48, remedies.load_candidates("toolbox")) == labels
    # --only takes a label or the folder its run is kept in; one that is neither is refused, naming both
    only = ["sqrt-lr-warmup", "fixed global batch 192 + few-step recipe + SyncBatchNorm", "lars"]
    picked = remedies.chosen(cands(cfg, 48), only, 48)
    assert [label for label, _ in picked] == ["lars", "sqrt lr + warmup",
                                              "fixed global batch 192 + few-step recipe + SyncBatchNorm"]
    with pytest.raises(ConfigError, match=r"'sqrt-lr-warm' is not a candidate at np=48; .*sqrt lr \+ warmup \(sqrt-lr-warmup\)"):
        remedies.chosen(cands(cfg, 48), ["sqrt-lr-warm"], 48)
    # the folders of the committed fast-and-right points are candidates' folder names
    committed = Path(__file__).resolve().parents[1] / "experiments" / "fast-but-wrong" / "remedies" / "full-test"
    folders = {d.name for d in (committed / "np48" / "seed0").iterdir() if d.is_dir()}
    assert len(folders) > 30 and folders <= {remedies.slug(label) for label in labels}, \
        folders - {remedies.slug(label) for label in labels}
