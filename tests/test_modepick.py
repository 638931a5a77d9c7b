"""The simulator's ``auto`` mode times the fast and the exact mode on a long run's first batch and runs
the faster (pilab.engine.modepick): the run is then the chosen mode's run bit for bit (the trial puts
back weights, BatchNorm rows, optimizer state, RNG and dropout's per-rank streams), a resumed run keeps
the mode it began in, and a short run is not timed. Which mode is faster is the machine's business:
these tests hold whichever the trial picks (the simulator section of benchmarks/LOG.md has the speeds)."""
from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from pilab.config import Config
from pilab import engine
from pilab import engine
from pilab.engine import modepick

# MobileNetV2-CIFAR has dropout before its classifier: each virtual rank's own masks (layers.RankDropout)
TINY = Config(width=0.25, train_subset=96, test_subset=50, batch_size=4, epochs=2, threads=1, seed=3,
              eval_every=100, data="embedded")


def same(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """An auto run of 24 steps with the trial a long run gets (MIN_STEPS lowered to 0)."""
    d = tmp_path_factory.mktemp("auto")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modepick, "MIN_STEPS", 0)
        res, model = engine.fit(replace(TINY, out=str(d)), engine.VirtualRanks(4))
    return res, engine.virtual_state(model)


def test_auto_times_both_modes_and_runs_the_faster_bit_for_bit_as_if_named(timed):
    auto, state = timed
    trial = auto["simulate_mode_trial"]
    assert len(trial["wall_s"]["fast"]) == len(trial["wall_s"]["exact"]) == modepick.ROUNDS
    med = {m: statistics.median(v) for m, v in trial["wall_s"].items()}
    assert auto["simulate_mode_used"] == trial["chosen"] == min(med, key=med.get)
    named, model = engine.fit(replace(TINY, simulate_mode=trial["chosen"]), engine.VirtualRanks(4))
    assert named["steps"]["loss"] == auto["steps"]["loss"]
    assert same(engine.virtual_state(model), state) == 0.0
    assert named["epochs"][-1]["test_acc"] == auto["epochs"][-1]["test_acc"]


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_after_the_trial_either_mode_steps_as_a_run_that_never_had_one(mode):
    # whichever mode the trial picks, the step after it starts from the state before it
    tried = engine.Session(replace(TINY, simulate_mode="fast"), engine.VirtualRanks(4))
    modepick.pick(tried.ranks, tried.cfg, tried.model, tried.optimizer, 0, 0)
    tried.ranks.use(mode)
    plain = engine.Session(replace(TINY, simulate_mode=mode), engine.VirtualRanks(4))
    for s in (0, 1):
        a, _ = tried.step(0, s)
        b, _ = plain.step(0, s)
        assert a.loss_sum == b.loss_sum
    assert same(tried.model.state_dict(), plain.model.state_dict()) == 0.0


def test_a_resumed_auto_run_keeps_its_mode_and_a_short_one_is_not_timed(timed, tmp_path, monkeypatch):
    auto, state = timed
    monkeypatch.setattr(modepick, "MIN_STEPS", 0)
    k = auto["steps_per_epoch"] + 2
    cut, _ = engine.fit(replace(TINY, out=str(tmp_path), checkpoint_every_steps=k, max_steps=k), engine.VirtualRanks(4))
    again, model = engine.fit(replace(TINY, out=str(tmp_path), resume=str(tmp_path / "checkpoint.pt")),
                              engine.VirtualRanks(4))
    assert again["resumed_from_step"] == k
    assert again["simulate_mode_trial"]["resumed"] is True
    assert again["simulate_mode_used"] == again["simulate_mode_trial"]["chosen"] == cut["simulate_mode_used"]
    if cut["simulate_mode_used"] == auto["simulate_mode_used"]:  # the same mode: the same bits as the whole run
        assert same(engine.virtual_state(model), state) == 0.0
    monkeypatch.setattr(modepick, "MIN_STEPS", 200)
    short, _ = engine.fit(TINY, engine.VirtualRanks(4))
    assert short["simulate_mode_used"] == "fast"
    assert short["simulate_mode_trial"] == {"chosen": "fast", "no_trial": f"{2 * auto['steps_per_epoch']} steps < 200: "
                                                                          "not worth timing"}
    named, _ = engine.fit(replace(TINY, simulate_mode="exact", max_steps=1), engine.VirtualRanks(4))
    assert "simulate_mode_trial" not in named
