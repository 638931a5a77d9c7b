"""The gradient noise scale and the batch ramp it drives (``batch_ramp="gns:MAX"``) in the simulator: the
estimator against a known truth, the ramp's choices, its schedule, a resume after a choice, what cannot
run. Its agreement with real ``mpiexec`` ranks is tests/test_mpi.py's (case gns)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from pilab.config import Config, ConfigError
from pilab import engine
from pilab.engine import noise
from pilab.perfmodel.predict import predict
from pilab.study.points import trained_config

CFG = Config(width=0.25, train_subset=240, test_subset=50, batch_size=4, batch_ramp="gns:16", epochs=3,
             lr=0.05, lr_ref_batch=16, threads=1, seed=3, data="embedded")


def test_the_estimator_recovers_a_known_noise_scale_from_rank_and_average_norms():
    # per-image gradients G + N(0, sigma^2 I) in d dimensions: the noise scale is d sigma^2 / |G|^2
    gen = torch.Generator().manual_seed(0)
    d, sigma, np_, b = 64, 0.5, 8, 4
    true_g = torch.randn(d, generator=gen, dtype=torch.float64) * 0.2
    ns = noise.NoiseScale()
    for _ in range(3000):
        per_image = true_g + sigma * torch.randn(np_, b, d, generator=gen, dtype=torch.float64)
        shares = per_image.mean(1) / np_  # each rank's gradient as sent: its share of the average
        ns.add([float(s @ s) for s in shares], float(shares.sum(0) @ shares.sum(0)), b, np_)
    truth = d * sigma ** 2 / float(true_g @ true_g)
    assert ns.value() == pytest.approx(truth, rel=0.05)
    assert ns.state() == {"g2": ns.g2, "s": ns.s, "steps": 3000}
    ns.reset()
    assert ns.value() is None


def test_the_ramp_takes_the_largest_batch_within_the_noise_scale_and_never_shrinks():
    ladder = [4, 8, 16]
    assert noise.next_batch(4, ladder, 4, 70.0) == 16  # 64 images fit in 70
    assert noise.next_batch(4, ladder, 4, 40.0) == 8
    assert noise.next_batch(4, ladder, 4, 10.0) == 4
    assert noise.next_batch(16, ladder, 4, 10.0) == 16  # a noisier epoch gives nothing back
    assert noise.next_batch(8, ladder, 4, None) == 8
    assert noise.next_batch(4, ladder, 4, float("inf")) == 16  # noise dominates: the largest batch
    # ... which the epoch's record says in words, JSON having no infinity
    rec = noise.record(float("inf"))
    assert rec["noise_scale"] is None and "noise dominates" in rec["noise_scale_note"]
    assert noise.record(1823.5) == {"noise_scale": 1823.5}


@pytest.fixture(scope="module")
def ramped():
    res, model = engine.fit(CFG, engine.VirtualRanks(4))
    return res, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_noise_driven_ramp_follows_its_own_measurements(ramped):
    res, _ = ramped
    eps = res["epochs"]
    assert all(e["noise_scale"] > 0 for e in eps)
    json.dumps(res, allow_nan=False)  # strict JSON: an unbounded noise scale is recorded as None and a note
    plan = [p["per_rank_batch"] for p in res["batch_plan"]]
    assert plan[0] == 4
    for e in range(1, len(eps)):  # each epoch trains at the batch the one before chose
        assert plan[e] == eps[e - 1]["next_per_rank_batch"]
        assert plan[e] == noise.next_batch(plan[e - 1], [4, 8, 16], 4, eps[e - 1]["noise_scale"])
    assert plan[-1] > plan[0], plan  # here the noise scale allows bigger batches
    assert [e["steps"] for e in eps] == [p["steps"] for p in res["batch_plan"]]
    assert res["batch_ramp_chosen"] == ",".join(f"{e}:{plan[e]}" for e in range(1, 3) if plan[e] != plan[e - 1])
    # its first epoch is the run without a ramp, learning rates included (the schedule runs in epochs)
    # the ramp runs the exact mode (simulate_mode auto picks it for a gns: ramp); the plain run is asked for it
    plain, _ = engine.fit(replace(CFG, batch_ramp="", max_steps=eps[0]["steps"], simulate_mode="exact"),
                          engine.VirtualRanks(4))
    assert res["steps"]["lr"][:eps[0]["steps"]] == plain["steps"]["lr"]
    assert res["steps"]["loss"][:eps[0]["steps"]] == plain["steps"]["loss"]
    # what the CLI prints: the batch it ended at, and from when
    from pilab.cli.common import batch_text
    grown = next(p for p in res["batch_plan"] if p["per_rank_batch"] != 4)
    assert batch_text(res).startswith(f"global batch=16, ramped to {grown['per_rank_batch'] * 4} from epoch "
                                       f"{grown['epoch']}")
    # the performance model prices the run at the batches it chose
    pred = predict(trained_config(res), 4, "pi4b_cluster")
    assert [p["steps"] for p in pred["batch_plan"]] == [p["steps"] for p in res["batch_plan"]]


def test_a_run_stopped_after_a_choice_and_mid_epoch_resumes_as_if_never_stopped(ramped, tmp_path):
    res, state = ramped
    k = res["epochs"][0]["steps"] + 2  # two steps into the second epoch: a choice made, noise half-measured
    engine.fit(replace(CFG, out=str(tmp_path), checkpoint_every_steps=k, max_steps=k), engine.VirtualRanks(4))
    again, model = engine.fit(replace(CFG, out=str(tmp_path), resume=str(tmp_path / "checkpoint.pt")),
                              engine.VirtualRanks(4))
    assert again["resumed_from_step"] == k
    assert max(float((model.state_dict()[n] - v).abs().max()) for n, v in state.items()
               if v.is_floating_point()) == 0.0
    assert [e["noise_scale"] for e in again["epochs"]] == [e["noise_scale"] for e in res["epochs"]]
    assert again["batch_plan"] == res["batch_plan"]


@pytest.mark.parametrize("change, np_, words", [
    ({}, 1, "needs np >= 2"),
    (dict(simulate_mode="fast"), 4, "simulate_mode=exact"),
    (dict(batch_ramp="gns:6"), 4, "MAX >= 2 x batch_size=8"),
    (dict(local_steps=4), 4, "local SGD"),
])
def test_what_a_noise_driven_ramp_cannot_run_is_refused_with_the_fix(change, np_, words):
    with pytest.raises(ConfigError, match=words):
        engine.fit(replace(CFG, **change), engine.VirtualRanks(np_))
