"""Live straggler warnings: which rank holds the others back, while the run goes, and why.

Every synchronous step ends when the slowest rank's gradients are in, so one slow rank slows all of
them. ``MPIRanks.step`` already carries every rank's compute time of the step (its gradients' ready
time) and its network time of the step before (exposed communication minus waiting for a slower
rank) to every rank with the last gradient bucket; rank 0 feeds them here, step by step::

    mon = Monitor(hosts=["node01", "node01", "node02", "node02"])
    for line in mon.add(step, compute=[...], network=[...], nbytes=1_048_576):  # per-rank seconds
        print(line)                                              # rate-limited: rarely, never per step
    mon.summary()          # result.json's "stragglers": rank, host, steps, slowdown, kind

Over a sliding window of ``window`` steps each rank's median compute is compared with the median over
ranks. A rank ``threshold`` (20%) slower than that for ``steps`` consecutive steps is a *compute*
straggler: its node is hot or busy (on a Raspberry Pi: ``vcgencmd get_throttled``). A rank whose
median time in the exchange itself (not waiting for a slower rank) exceeds ``threshold`` of the median
compute is a *network* straggler: its link is slow (a 100 Mbit/s negotiation, a bad cable, a busy
switch port) -- where the step's payload is known (``nbytes``), only if the exchange also moved it at less
than ``min_rate`` (20 MB/s): small per-rank batches (the fast-and-right recipes: 4 images per rank on a
Pi) make a healthy gigabit exchange 20% of a step and more, but it still moves an Allreduce's payload at
45 MB/s or faster, while a 100 Mbit/s link cannot pass 12.5 MB/s. Medians keep one slow step (a page
fault, a GC pause) from counting. An Allreduce makes every rank wait for the slowest link, so with a
slow link all ranks whose exchange crosses it show network time: the line names them all, with their
hosts. While a rank is a compute straggler no network straggler is named: the slow node's exchange runs
on its slow core too, and its peers' exchange stalls on it.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..component import Component, Stage

__all__ = ["Monitor", "THRESHOLD", "MIN_RATE", "WINDOW", "STEPS", "EVERY_S"]

THRESHOLD = 0.2  # slower than the median rank by this fraction (compute), or this share in the network
# bytes/s of Allreduce payload below which an exchange counts as slow: above a 100 Mbit/s link's 12.5 MB/s,
# below gigabit's ~45 MB/s for a 1 MB gradient over 48 ranks (the ring's latency included)
MIN_RATE = 20e6
WINDOW = 20  # steps in the sliding window
STEPS = 10  # consecutive steps a rank must stay beyond the threshold before a warning
EVERY_S = 60.0  # at most one line per kind of straggler in this many seconds
HINT = {"compute": "its node is hot or busy (on a Raspberry Pi: `vcgencmd get_throttled`; "
                   "another job on it: `top`)",
        "network": "its link is slow (`ethtool eth0`: a 100 Mb/s link? a bad cable, a busy switch port)"}


def _ranks(rs: list[int], hosts: list[str]) -> str:
    by: dict[str, list[int]] = {}
    for r in rs:
        by.setdefault(hosts[r] if r < len(hosts) else "?", []).append(r)
    return "; ".join(f"{'rank' if len(v) == 1 else 'ranks'} {', '.join(map(str, v))} ({h})" for h, v in by.items())


class Monitor:
    """See the module docstring. ``clock`` is ``time.monotonic`` (tests may pass their own)."""

    def __init__(self, hosts: list[str], *, threshold: float = THRESHOLD, window: int = WINDOW,
                 steps: int = STEPS, every_s: float = EVERY_S, min_rate: float = MIN_RATE, clock=time.monotonic):
        self.hosts, self.n = list(hosts), len(hosts)
        self.threshold, self.window, self.steps, self.every_s = threshold, window, steps, every_s
        self.min_rate = min_rate
        self._bytes: deque = deque(maxlen=window)
        self._rate = None  # each rank's payload rate over the window (bytes/s), when nbytes is given
        self.clock = clock
        self._compute: deque = deque(maxlen=window)
        self._network: deque = deque(maxlen=window)
        self._run = {k: np.zeros(self.n, dtype=int) for k in HINT}  # consecutive steps beyond it
        self._last_line = {k: -np.inf for k in HINT}
        self.found: dict[tuple[int, str], dict] = {}  # (rank, kind) -> record
        self.lines: list[str] = []

    def add(self, step: int, compute, network, nbytes: int | None = None) -> list[str]:
        """One step's per-rank compute and network seconds, and ``nbytes``: the payload each rank handed
        to the exchange those network seconds timed (bytes); returns the warning lines due now."""
        if self.threshold <= 0 or self.n < 2:
            return []
        self._compute.append(np.asarray(compute, dtype=float)[:self.n])
        self._network.append(np.asarray(network, dtype=float)[:self.n])
        self._bytes.append(nbytes)
        if len(self._compute) < min(self.window, self.steps):
            return []
        c = np.median(np.stack(self._compute), axis=0)  # each rank's median over the window
        net = np.median(np.stack(self._network), axis=0)
        ref = float(np.median(c))
        if ref <= 0:
            return []
        excess = {"compute": c / ref - 1.0, "network": net / ref}
        self._rate = None
        if None not in self._bytes:  # payload over time in the exchange, summed over the window (local SGD's
            # steps send a few bytes, its averaging steps the weights: sums weigh them as the wire did)
            seconds = np.sum(np.stack(self._network), axis=0)
            self._rate = np.where(seconds > 0, sum(self._bytes) / np.maximum(seconds, 1e-12), np.inf)
        out = []
        for kind, x in excess.items():
            beyond = x >= self.threshold
            if kind == "network":
                # while any rank is a compute straggler, nobody's exchange is judged: a throttled node's
                # MPI progress runs on its throttled core, so every peer's exchange stalls on it and would
                # read as their own slow link (the compute line names the cause; a slow link behind it
                # shows once the node recovers)
                beyond &= ~(excess["compute"] >= self.threshold).any()
                if self._rate is not None:  # a large share at a healthy link's rate is the batch's doing
                    beyond &= self._rate < self.min_rate
            run = self._run[kind]
            run[:] = np.where(beyond, run + 1, 0)
            due = [r for r in range(self.n) if run[r] >= self.steps]
            for r in due:
                rec = self.found.setdefault((r, kind), {"rank": r, "host": self.hosts[r], "kind": kind,
                                                        "first_step": step, "steps": 0, "slowdown": 0.0})
                rec["steps"] += 1
                rec["last_step"] = step
                rec["slowdown"] = round(max(rec["slowdown"], float(x[r])), 3)
                if kind == "network" and self._rate is not None:  # the slowest it moved the payload
                    rec["mb_per_s"] = round(min(rec.get("mb_per_s", np.inf), float(self._rate[r]) / 1e6), 2)
            now = self.clock()
            if due and now - self._last_line[kind] >= self.every_s:
                self._last_line[kind] = now
                out.append(self._line(kind, due, x, step))
        self.lines += out
        return out

    def _line(self, kind: str, due: list[int], x: np.ndarray, step: int) -> str:
        pct = ", ".join(f"{100 * x[r]:.0f}%" for r in due)
        if kind == "compute":
            what = f"computes {pct} slower than the median rank"
        else:
            what = f"spends {pct} of the median rank's compute time in the exchange itself (not waiting " \
                   "for a slower rank)"
            if self._rate is not None:
                what += f", moving its payload at {', '.join(f'{self._rate[r] / 1e6:.1f}' for r in due)} MB/s"
        return (f"pilab: straggler ({kind}): {_ranks(due, self.hosts)} {what} over the last "
                f"{len(self._compute)} steps (step {step}): {HINT[kind]}")

    def summary(self) -> list[dict]:
        """The stragglers found: rank, host, kind, steps (counted beyond the threshold), slowdown (the
        largest windowed excess: compute over the median rank - 1, or network share), first/last step;
        a network straggler's ``mb_per_s``: the lowest payload rate of its windows beyond the threshold."""
        return [dict(v) for _, v in sorted(self.found.items())]


class StragglerWatch(Component):
    """The loop's feature (a ``pilab.component.Component``): rank 0 of an MPI job of 2+ ranks
    feeds every step's per-rank times to a ``Monitor`` (``Config.straggler_threshold`` > 0) and emits
    its warnings as events; result.json's ``stragglers`` and ``straggler_lines`` are its own (empty where
    it does not watch)."""

    name = "stragglers"
    stage = Stage.OBSERVE

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return ranks.rank == 0

    def __init__(self, cfg, ranks):
        self.cfg, self.monitor = cfg, None
        self.watch = not ranks.simulated and ranks.np_ > 1 and cfg.straggler_threshold > 0
        self.times = Times()

    def on_step(self, rank) -> None:
        self.times.take(rank)

    def after_step(self, session, epoch: int, step: int, st) -> list:
        every = self.times.every(st)
        # the hosts are known once train() has the run's environment (a Session stepped by hand has none)
        if self.watch and self.monitor is None and getattr(session, "env", None):
            n = self.cfg.straggler_steps
            self.monitor = Monitor(session.env["hostnames"], threshold=self.cfg.straggler_threshold, steps=n,
                                   window=2 * n)
        if self.monitor is None or every is None:
            return []
        gstep = session.epoch_start[epoch] + step + 1
        return [{"kind": "straggler", "line": line, "global_step": gstep, "stragglers": self.monitor.summary()}
                for line in self.monitor.add(gstep, *every)]

    def result(self) -> dict:
        m = self.monitor
        return {"stragglers": m.summary() if m is not None else [], "straggler_lines": m.lines if m is not None else []}


class Times:
    """Every rank's times of each step, as a ``Monitor`` takes them: its compute (the last gradient ready,
    s) and its network time of the step before, which MPI ranks send with the step's metrics (their slots
    ``ready`` and ``network``), and the payload that network time moved (the step before's bytes sent,
    which local SGD makes vary; the first step, with no network time yet, pairs with its own)::

        times.take(rank)             # a component's on_step
        times.every(st)              # its after_step: (compute, network, bytes), or None (the simulator)
    """

    def __init__(self):
        self.seen, self.sent = None, None

    def take(self, rank) -> None:
        sums = rank.sums
        self.seen = (sums["ready"].copy(), sums["network"].copy()) if "ready" in sums else None

    def every(self, st):
        sent, self.sent = (st.bytes_sent if self.sent is None else self.sent), st.bytes_sent
        return None if self.seen is None else (*self.seen, sent)
