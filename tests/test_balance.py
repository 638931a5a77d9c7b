"""Uneven per-rank shares set by speed (``Config.balance``, pilab.engine.balance): the policy on its own
(given, measured and re-measured speeds, the threshold, checkpoints)."""
import pytest

from pilab.config import ConfigError
from pilab.engine.balance import THRESHOLD, WINDOW, Shares, parse


def test_parse_modes_and_given_speeds():
    assert parse("off") == ("off", None) and parse("dynamic") == ("dynamic", None)
    assert parse("static:2,1") == ("static", [2.0, 1.0])
    assert parse("static:1x2,2.5x3", np_=5) == ("static", [1.0, 1.0, 2.5, 2.5, 2.5])
    for bad, words in [("fast", "use off, static"), ("dynamic:2,1", "use off, static"),
                       ("static:2,0", "not SPEED or SPEEDxCOUNT"), ("static:1x0", "not SPEED"),
                       ("static:a", "not SPEED")]:
        with pytest.raises(ConfigError, match=words):
            parse(bad)
    with pytest.raises(ConfigError, match="gives 2 speeds for 3 ranks"):
        parse("static:2,1", np_=3)


def _run(sh, speeds_by_step, steps, per_step=0.0):
    """Feed ``steps`` steps whose rank r trains share_r images at speeds_by_step(step)[r] images/s
    (plus ``per_step`` seconds each step whatever the share); returns the steps where the shares changed."""
    changed = []
    for step in range(steps):
        busy = [per_step + b / s for b, s in zip(sh.shares, speeds_by_step(step))]
        if sh.observe(step, busy) is not None:
            changed.append(step + 1)
    return changed


def test_given_speeds_set_the_shares_from_the_first_step_and_never_move():
    sh = Shares("static", 2, 64, given=[2.0, 1.0])
    assert sh.shares == [43, 21]
    assert _run(sh, lambda s: [1.0, 1.0], 5 * WINDOW) == [] and sh.shares == [43, 21]


def test_static_measures_once_then_keeps_the_shares():
    sh = Shares("static", 2, 64)
    assert sh.shares == [32, 32]
    # rank 1 at half speed: after one window the shares follow; later changes are not followed
    changed = _run(sh, lambda s: [100.0, 50.0] if s < 3 * WINDOW else [100.0, 100.0], 6 * WINDOW, per_step=0.01)
    assert changed == [WINDOW] and sh.shares in ([43, 21], [42, 22])  # 2:1, a little less for the per-step work
    assert sh.changes[0]["step"] == WINDOW and sh.changes[0]["speeds"][1] < 0.6 * sh.changes[0]["speeds"][0]


def test_dynamic_follows_a_node_throttled_mid_run_within_two_windows():
    sh = Shares("dynamic", 2, 64)
    at = 5 * WINDOW + 3  # node02 throttled to half speed here, mid-window
    changed = _run(sh, lambda s: [100.0, 100.0] if s < at else [100.0, 50.0], 10 * WINDOW, per_step=0.002)
    assert sh.shares == [43, 21]
    assert len(changed) == 1 and at < changed[0] <= at + 2 * WINDOW, changed


def test_a_uniform_cluster_keeps_equal_shares_and_noise_moves_nothing():
    sh = Shares("static", 3, 48)
    assert _run(sh, lambda s: [100.0, 95.0 if s % 2 else 105.0, 100.0], 3 * WINDOW) == [] and sh.shares == [16] * 3
    sh = Shares("dynamic", 3, 48)
    slow = 1 - THRESHOLD / 2  # a rank 7.5% slower, now and then: noise, not a new board
    assert _run(sh, lambda s: [100.0, 100.0 * (slow if s % 3 else 1), 100.0], 10 * WINDOW) == []
    assert sh.shares == [16, 16, 16]


def test_checkpoint_keeps_the_shares_at_the_same_np_and_batch_only():
    sh = Shares("static", 2, 64, given=[3.0, 1.0])
    state = sh.state_dict()
    again = Shares("static", 2, 64)
    again.load_state_dict(state)
    assert again.shares == [48, 16] and again.speeds == [3.0, 1.0]
    other = Shares("static", 3, 96)
    other.load_state_dict(state)  # another np: measured again
    assert other.shares == [32, 32, 32] and other.speeds is None
