"""Each rank's share of the global batch set by its speed (``Config.balance``): the straggler's remedy.

In a synchronous step every rank waits for the slowest, so on a cluster of mixed or throttled boards the fast
ones idle. With ``balance`` on, rank r trains b_r images a step, Σ b_r = B (the global batch, unchanged), b_r
in proportion to its speed (``pilab.data.batch_shares``); its loss is weighted by b_r / B, so the average
gradient is Σ_r gradient-sum_r / B: the mathematics of one global batch of B images, whoever trains which::

    python -m pilab train --np 2 --sharding reshuffle --balance static       # measured over the first WINDOW steps
    python -m pilab train --np 2 --sharding reshuffle --balance dynamic      # ... and again every WINDOW steps
    python -m pilab simulate --np 3 --sharding reshuffle --balance static:2,1,1   # given speeds

Uneven shares need ``sharding=reshuffle`` (every rank holds the whole training set; each step takes the next
B images of the epoch's one permutation, rank r the b_r after the ranks before it, so every image is used
once an epoch however the shares change). BatchNorm stays per rank, on its own b_r images: a rank with a
smaller share normalises with noisier statistics (``bn=local``'s usual trade, now per rank).

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

import dataclasses
import statistics

from ..component import Component, Stage
from ..data import batch_shares

__all__ = ["Balance", "Shares", "WINDOW", "THRESHOLD"]

WINDOW = 8  # steps each speed is the median of; dynamic: steps between looks at the speeds
THRESHOLD = 0.15  # a rank's speed this fraction away from the one behind its share: re-split


class Shares:
    """The shares of one run, step by step (see the module docstring)::

        sh = Shares("dynamic", np_=2, total=64)
        sh.shares                                   # [32, 32]
        for step in range(100):
            new = sh.observe(step, busy)            # busy: each rank's seconds of this step
            if new: ...                             # the shares from the next step on
    """

    def __init__(self, mode: str, np_: int, total: int, given: list[float] | None = None):
        self.mode, self.np_, self.total = mode, np_, total
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
            self._settle = False  # them at the new shares as the reference ...
            if max(abs(s / p - 1) for s, p in zip(speeds, self.speeds)) <= THRESHOLD:
                self.speeds = speeds
                return None
            # ... unless they are far from the speeds the split was made from: that window straddled the
            # change (a throttle half-way through it gives a median between the two speeds), so the
            # split was short of the new speeds; the settled window has them (the testbed's bench)
            return self._split(step, speeds)
        # against the speeds behind the current shares; at first, equal shares: the ranks' mean speed
        behind = self.speeds or [statistics.fmean(speeds)] * self.np_
        if max(abs(s / p - 1) for s, p in zip(speeds, behind)) <= THRESHOLD:
            self.speeds = self.speeds or speeds
            return None
        return self._split(step, speeds)

    def _split(self, step: int, speeds: list[float]) -> list[int] | None:
        """The shares by ``speeds`` from ``step + 1`` on (None if they stay as they are)."""
        new = batch_shares(self.total, speeds)
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


def busy_seconds(rank) -> list[float] | None:
    """Every rank's busy seconds of the step just taken (data, forward, backward up to its last gradient),
    from a ``pilab.component.RankStep``: MPI ranks' ``ready`` slot (each rank's, summed over the ranks with
    the gradients, so every rank reads the same numbers); None in the simulator, whose virtual ranks share
    one process and have no speed of their own."""
    ready = rank.sums.get("ready")
    return None if ready is None else [float(t) for t in ready]


class Balance(Component):
    """The loop's feature (``Config.balance`` other than ``off``, np >= 2): before each step it sets the
    step's shares (``session.phase``'s ``Phase.shares``), which both rank backends follow (the data:
    ``ShardLoader.batch(share=)``; the loss weight b_r / B: ``GradSync.backward(weight=)``); after each
    it hands every rank's busy time to ``Shares``. result.json's ``balance``: mode, the shares at the
    end, the speeds behind them and every change (the step it took effect from); each epoch's record its
    ``shares`` at the epoch's end; rank 0's callbacks a ``shares`` event (``global_step``, ``shares``: from
    the next step on) at the first step and at every change, which the live panel's bars show::

        pilab.train(pilab.Config(sharding="reshuffle", balance="static"), comm)
        pilab.simulate(pilab.Config(sharding="reshuffle", balance="static:2,1", simulate_mode="exact"), 2)

    In the simulator the measured modes keep equal shares (its virtual ranks have no speed of their own);
    given speeds (``static:2,1``) run there as under ``mpiexec``, bit for bit.
    """

    name = "balance"
    stage = Stage.PLAN
    per_rank = True  # one rank per forward in the simulator: each rank's BatchNorm on its own b_r images

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return cfg.balance_plan()[0] != "off" and ranks.np_ > 1

    def setup(self, cfg, ranks) -> None:
        super().setup(cfg, ranks)
        self.mode, self.given = cfg.balance_plan(ranks.np_)
        self.measure = not ranks.simulated
        self.policy = None

    def start(self, session) -> None:
        self.policy = Shares(self.mode, session.np_, session.batch * session.np_, self.given)
        self.first = list(self.policy.shares)
        self._busy = None
        self._shown = None  # the shares the last ``shares`` event told the callbacks

    def before_step(self, session, epoch: int, step: int) -> None:
        session.phase = dataclasses.replace(session.phase, shares=tuple(self.policy.shares))

    def on_step(self, rank) -> None:
        self._busy = busy_seconds(rank) if self.measure else None

    def after_step(self, session, epoch: int, step: int, st) -> list:
        if self._busy is not None:
            self.policy.observe(session.epoch_start[epoch] + step, self._busy)
        if session.rank != 0 or self.policy.shares == self._shown:
            return []
        # the live panel's per-rank bars show each rank's share (``plots.LivePlot``): told at the first
        # step and whenever they change, not every step
        self._shown = list(self.policy.shares)
        return [{"kind": "shares", "global_step": session.epoch_start[epoch] + step + 1, "mode": self.mode,
                 "shares": list(self._shown)}]

    def end_epoch(self, session, epoch: int, record: dict) -> None:
        record["shares"] = list(self.policy.shares)  # each rank's images a step as the epoch ended

    def state_dict(self):
        return {**self.policy.state_dict(), "first": self.first}

    def load_state_dict(self, state) -> None:
        self.policy.load_state_dict(state)
        if state.get("np") == self.policy.np_ and state.get("total") == self.policy.total:
            self.first = state.get("first", self.first)

    def result(self) -> dict:
        p = self.policy
        return {"balance": {"mode": self.mode, "given": self.given, "first": self.first, "shares": p.shares,
                            "speeds": p.speeds, "changes": p.changes, "window": WINDOW, "threshold": THRESHOLD}}
