"""Each rank's share of the global batch set by its speed (``Config.balance``): the straggler's remedy.

In a synchronous step every rank waits for the slowest, so on a cluster of mixed or throttled boards the fast
ones idle. With ``balance`` on, rank r trains b_r images a step, Σ b_r = B (the global batch, unchanged), b_r
in proportion to its speed (``pilab.data.batch_shares``); its loss is weighted by b_r / B, so the average
gradient is Σ_r gradient-sum_r / B: the mathematics of one global batch of B images, whoever trains which::

    python -m pilab train --np 2 --balance static ...        # measured over the first WINDOW steps
    python -m pilab train --np 2 --balance dynamic ...       # ... and again every WINDOW steps
    python -m pilab simulate --np 3 --balance static:2,1,1   # given speeds (the simulator has none of its own)

``Shares`` is the policy, on every rank alike (the per-rank times it reads are the same numbers everywhere):

- ``static``: the first ``WINDOW`` steps run at equal shares and measure each rank's speed (images per
  second of its busy time: data, forward and backward up to its last gradient, the time a faster rank does
  not spend waiting); then the shares follow the median speeds, for the rest of the run -- unless every
  rank is within ``THRESHOLD`` of the mean: a uniform cluster keeps its equal shares.
- ``dynamic``: the same, and every ``WINDOW`` steps after: when some rank's median speed has moved by more
  than ``THRESHOLD`` from the speeds behind the current shares (a board heating up, a quota set or lifted),
  the shares follow. Why at a step boundary every ``WINDOW`` steps and not once an epoch: an epoch of CIFAR-10
  is hundreds to thousands of steps (minutes to an hour on a Pi) and a board throttles in seconds; changing
  the shares costs nothing (every rank holds the whole training set; the speeds ride with each step's
  metrics), and a median over ``WINDOW`` steps keeps one slow step (a page fault, a GC pause) from moving
  them. ``THRESHOLD`` is the doctor's 15%: below it a re-split would chase the machine's noise.
- ``static:S0,S1,...`` (or runs ``1x24,2.5x24``): the speeds given, one per rank, from the first step.
"""
from __future__ import annotations

import statistics

from ..config import ConfigError

__all__ = ["Shares", "parse", "WINDOW", "THRESHOLD", "MODES"]

MODES = ("off", "static", "dynamic")
WINDOW = 8  # steps each speed is the median of; dynamic: steps between looks at the speeds
THRESHOLD = 0.15  # dynamic: a rank's speed moved by this fraction from the one behind its share


def parse(value: str, np_: int | None = None) -> tuple[str, list[float] | None]:
    """``Config.balance`` as (mode, given speeds or None); ConfigError naming the fix::

        parse("static:1x2,0.5")       # ("static", [1.0, 1.0, 0.5])
    """
    mode, _, given = str(value).partition(":")
    if mode not in MODES or (given and mode != "static"):
        raise ConfigError(f"balance={value!r}: use off, static, dynamic or static:SPEED,... (one speed per rank, "
                          "e.g. static:2,1 or static:1x24,2.5x24)")
    if not given:
        return mode, None
    speeds: list[float] = []
    for part in given.split(","):
        speed, _, count = part.strip().partition("x")
        try:
            s, n = float(speed), int(count) if count else 1
        except ValueError:
            s, n = -1.0, 0
        if not (s > 0 and s != float("inf") and n >= 1):
            raise ConfigError(f"balance={value!r}: {part.strip()!r} is not SPEED or SPEEDxCOUNT with SPEED > 0 "
                              "(e.g. static:2,1 or static:1x24,2.5x24)")
        speeds += [s] * n
    if np_ is not None and len(speeds) != np_:
        raise ConfigError(f"balance={value!r} gives {len(speeds)} speeds for {np_} ranks; give one per rank")
    return mode, speeds


class Shares:
    """The shares of one run, step by step (see the module docstring)::

        sh = Shares("dynamic", np_=2, total=64)
        sh.shares                                   # [32, 32]
        for step in range(100):
            new = sh.observe(step, busy)            # busy: each rank's seconds of this step
            if new: ...                             # the shares from the next step on
    """

    def __init__(self, mode: str, np_: int, total: int, given: list[float] | None = None):
        from ..data import batch_shares
        self.mode, self.np_, self.total, self._split = mode, np_, total, batch_shares
        self.speeds = list(given) if given else None  # the speeds behind the current shares
        self.shares = batch_shares(total, given) if given else [total // np_ + (r < total % np_) for r in range(np_)]
        self._window: list[list[float]] = []
        self._settle = False  # the window after a re-split measures the speeds at the new shares: its reference
        self.changes: list[dict] = []  # every re-split: the step it took effect from, speeds, shares

    def observe(self, step: int, busy: list[float]) -> list[int] | None:
        """Record each rank's busy seconds of ``step`` (at the current shares); the new shares when they
        change from ``step + 1`` on, else None."""
        if self.mode == "off" or (self.mode == "static" and (self.speeds is not None)):
            return None
        self._window.append([b / max(t, 1e-9) for b, t in zip(self.shares, busy)])
        if len(self._window) < WINDOW:
            return None
        speeds = [statistics.median(w[r] for w in self._window) for r in range(self.np_)]
        self._window = []
        if self._settle:  # a rank's images per second move a little with its share (per-step work): take
            self.speeds, self._settle = speeds, False  # them at the new shares as the reference
            return None
        # against the speeds behind the current shares; at first, equal shares: the ranks' mean speed
        behind = self.speeds or [statistics.fmean(speeds)] * self.np_
        if max(abs(s / p - 1) for s, p in zip(speeds, behind)) <= THRESHOLD:
            self.speeds = self.speeds or speeds
            return None
        new = self._split(self.total, speeds)
        self.speeds = speeds
        if new == self.shares:
            return None
        self.shares, self._settle = new, self.mode == "dynamic"
        self.changes.append({"step": step + 1, "speeds": speeds, "shares": new})
        return new

    def state_dict(self) -> dict:
        return {"speeds": self.speeds, "shares": self.shares, "changes": self.changes, "np": self.np_,
                "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's shares, at the same np and global batch; at another they are measured again."""
        if state.get("np") == self.np_ and state.get("total") == self.total:
            self.speeds, self.shares, self.changes = state["speeds"], state["shares"], list(state["changes"])
