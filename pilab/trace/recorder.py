"""A per-rank trace of a real run (``Config.trace``): every rank's data, forward, backward, each gradient
message's Allreduce (posted, first seen complete), the wait at the end of backward, the optimizer,
evaluations and checkpoints, on the ranks' clocks aligned over MPI, written by rank 0 as
``<out>/trace.json`` in the Chrome Trace Event Format (``pilab.trace.format``; open it in ui.perfetto.dev).
Each step's spans carry the rank's images of that step (``args.images``: b_r, its share of the global batch,
uneven with ``Config.balance``), from which ``pilab trace`` says what the shares bought::

    mpiexec -n 2 python -m pilab train --trace --out runs/t     # runs/t/trace.json + result.json["trace"]
    python -m pilab train --np 2 --trace --trace-window 20 --out runs/t

How the times are taken, with the least wiring: every rank backend gives the components' ``on_step``
moment the step's spans (``pilab.component.RankStep.spans``: an MPI rank's phase boundaries on its
``perf_counter``), and with ``watch_messages`` set (this component's) ``GradSync`` notes when each
message is first seen complete (``RankStep.flights``: it tests each request in posting order instead of
one Testall). The simulator (``VirtualRanks``) gives one track per virtual rank (its data, forward and
backward; a chunk of several ranks per forward goes on its first rank's track) and the one optimizer step
on rank 0's track.

Bounded: each rank keeps the first ``FIRST`` steps, the last ``trace_window`` and up to ``trace_window``
steps a straggler warning named (every rank runs the same ``pilab.trace.stragglers.Monitor`` on the
per-rank times every rank already receives with the last bucket, so they agree without a message). At
every epoch's end the ranks' clocks are compared again and what each rank kept goes to rank 0 (one
gather per epoch, never per step); rank 0 merges, converts to its clock and prunes to the same bound.

Clock alignment: at the start and at every epoch's end rank 0 ping-pongs each rank ``ROUNDS`` times and
keeps the exchange with the smallest round trip: offset = t_remote - (t_send + rtt / 2), error at most
rtt / 2. A time on rank r's clock is converted to rank 0's by the offset interpolated linearly between
the two measurements around it. The trace's meta and result.json say the offsets, the drift between the
first and last measurement and the error bound.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from contextlib import contextmanager

import numpy as np

from . import format as tracefile
from ..component import Component, Stage
from .stragglers import Monitor, Times

__all__ = ["Trace", "clock_offsets", "FIRST", "ROUNDS"]

FIRST = 5  # the run's first steps, always kept (start-up: the first step allocates, later ones reuse)
ROUNDS = 8  # ping-pongs per rank per clock comparison: the smallest round trip of them is used
_TAG = 3939  # the comparisons' point-to-point tag


def clock_offsets(comm, rounds: int = ROUNDS):
    """Every rank's clock against rank 0's (a collective): on rank 0 a list, per rank, of (t on rank 0's
    ``perf_counter``, offset s = its clock minus rank 0's, error s = half the smallest round trip); None
    elsewhere. ``comm=None`` or one rank: rank 0 alone, exact."""
    if comm is None or comm.Get_size() == 1:
        return [(time.perf_counter(), 0.0, 0.0)]
    buf = np.zeros(1)
    if comm.Get_rank() != 0:
        for _ in range(rounds):
            comm.Recv(buf, source=0, tag=_TAG)
            buf[0] = time.perf_counter()
            comm.Send(buf, dest=0, tag=_TAG)
        return None
    out = [(time.perf_counter(), 0.0, 0.0)]
    for r in range(1, comm.Get_size()):
        best = (math.inf, 0.0, 0.0)
        for _ in range(rounds):
            ts = time.perf_counter()
            comm.Send(buf, dest=r, tag=_TAG)
            comm.Recv(buf, source=r, tag=_TAG)
            rtt = time.perf_counter() - ts
            if rtt < best[0]:
                best = (rtt, ts + rtt / 2, float(buf[0]) - (ts + rtt / 2))
        out.append((best[1], best[2], best[0] / 2))
    return out


class Trace(Component):
    """The loop's feature (``Config.trace``): see the module docstring. result.json's ``trace`` is its
    own (rank 0): the trace's path, the steps kept, per rank the median data, compute, network and wait
    seconds over them, and the clocks' alignment."""

    name = "trace"
    stage = Stage.OBSERVE
    watch_messages = True  # each gradient message's flight (GradSync tests each request on its own)

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return cfg.trace

    def __init__(self, cfg, ranks):
        self.cfg, self.ranks = cfg, ranks
        self.rank, self.np_ = ranks.rank, ranks.np_
        self.comm = ranks.comm if not ranks.simulated and ranks.np_ > 1 else None
        self.window = cfg.trace_window
        self.seen = 0  # steps recorded on this rank
        self.gstep = 0  # the last step's global number (1-based, as the loop's events)
        self.first: list = []  # this rank's records since the last flush: (step, epoch, comm_wait, spans, flights,
        # every rank's images of the step)
        self.last: deque = deque(maxlen=self.window)
        self.named: list = []
        self.n_named = 0
        self.evals: list = []  # (tid, "eval", begin, end, step)
        self.step_seen = None  # the last step's (spans, flights), from on_step
        self.times = Times()  # every rank's compute and network times, for the monitor and the lane
        self.monitor = None
        if self.comm is not None and cfg.straggler_threshold > 0:
            n = cfg.straggler_steps
            self.monitor = Monitor(["?"] * self.np_, threshold=cfg.straggler_threshold, steps=n, window=2 * n)
        # rank 0: the merged trace (step -> {rank: record}), the steps kept first / named, the clocks
        self.kept: dict = {}
        self.first_steps: set = set()
        self.named_steps: set = set()
        self.other: list = []  # evaluation spans, aligned
        self.syncs: list = []  # per comparison: clock_offsets' list

    def start(self, session) -> None:
        self.session = session
        self._compare()
        self.zero = time.perf_counter()  # rank 0's: the trace's time zero

    def _compare(self) -> None:
        got = clock_offsets(self.comm)
        if got is not None:
            self.syncs.append(got)

    def on_step(self, rank) -> None:
        self.step_seen = (rank.spans, rank.flights) if rank.spans is not None else None
        self.times.take(rank)

    def after_step(self, session, epoch: int, step: int, st) -> list:
        self.gstep = g = session.epoch_start[epoch] + step + 1
        every = self.times.every(st)
        if self.step_seen is None:  # a step the backend does not trace (the simulator's local-SGD steps)
            return []
        spans, flights = self.step_seen
        # each rank's images this step (b_r): uneven with ``balance`` (the step's Phase.shares), else the
        # per-rank batch; what `pilab trace` needs to say what the shares bought
        shares = session.phase.shares
        images = tuple(int(b) for b in shares) if shares is not None else (int(session.batch),) * self.np_
        rec = (g, epoch + 1, float(st.comm_wait), spans, flights, images)
        self.seen += 1
        if self.seen <= FIRST:
            self.first.append(rec)
        else:
            self.last.append(rec)
        if self.monitor is not None and every is not None:
            self.monitor.add(g, *every)
            if self.seen > FIRST and self.n_named < self.window and \
                    any(f.get("last_step") == g for f in self.monitor.found.values()):
                self.named.append(rec)
                self.n_named += 1
        return [self._lane(g, epoch + 1, spans, flights, every)] if self.rank == 0 else []

    def _lane(self, g: int, epoch: int, spans, flights, every) -> dict:
        """Rank 0's ``lane`` event of step ``g`` (the notebook's live swim-lane, ``pilab.plots.run``):
        seconds on rank 0's clock from the trace's zero. Rank 0's own spans and flights are measured
        (the simulator's: every virtual rank's); another MPI rank's are estimated from what rank 0 has
        each step without a message: the step started together on every rank, its data, forward and
        backward lasted until its last gradient went out (every rank's ``ready`` time), then it waited
        until rank 0 saw the last gradient averaged. The exact picture is trace.json (per epoch)."""
        z = self.zero
        spans = [[tid, n, round(b - z, 6), round(e - z, 6), 0] for tid, n, b, e in spans]
        flights = [[tid, k, nb, round(a - z, 6), round(max(a, b) - z, 6)] for tid, k, nb, a, b in flights]
        if self.comm is not None and every is not None:
            mine = {n: (b, e) for _, n, b, e, _ in spans}
            if "data" in mine and "wait" in mine:
                t0, done = mine["data"][0], mine["wait"][1]
                for r in range(1, self.np_):
                    ready = round(min(t0 + float(every[0][r]), done), 6)
                    spans += [[r, "data+forward+backward", t0, ready, 1], [r, "wait", ready, done, 1]]
        return {"kind": "lane", "global_step": g, "epoch": epoch, "np": self.np_, "spans": spans, "flights": flights}

    @contextmanager
    def evaluating(self, session):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.evals.append((self.rank, "eval", t, time.perf_counter(), self.gstep))

    def end_epoch(self, session, epoch: int, record: dict) -> None:
        """Flush: the clocks compared again, every rank's records gathered to rank 0 (a collective)."""
        mine = {"first": self.first, "last": list(self.last), "named": self.named, "evals": self.evals}
        self.first, self.named, self.evals = [], [], []
        self.last.clear()
        self._compare()
        every = self.comm.gather(mine, root=0) if self.comm is not None else [mine]
        if self.rank == 0:
            self._merge(every)

    # -- rank 0 ----------------------------------------------------------------------------------
    def _to_us(self, rank: int, t: float) -> float:
        """``t`` on ``rank``'s clock as microseconds on rank 0's from the trace's zero."""
        if rank and self.comm is not None:
            local = [s[rank][0] + s[rank][1] for s in self.syncs]
            t = t - float(np.interp(t, local, [s[rank][1] for s in self.syncs]))
        return max(0.0, (t - self.zero) * 1e6)

    def _merge(self, every: list) -> None:
        proc = (lambda tid: tid) if self.comm is not None else (lambda tid: 0)  # whose clock: the process's
        for r, part in enumerate(every):
            for kind in ("first", "last", "named"):
                for g, epoch, wait, spans, flights, images in part[kind]:
                    row = self.kept.setdefault(g, {})
                    row[r] = (epoch, wait, images,
                              [(tid, n, self._to_us(proc(tid), b), self._to_us(proc(tid), e)) for tid, n, b, e in spans],
                              [(tid, k, nb, self._to_us(proc(tid), a), self._to_us(proc(tid), b))
                               for tid, k, nb, a, b in flights])
                    if kind == "first":
                        self.first_steps.add(g)
                    elif kind == "named":
                        self.named_steps.add(g)
            self.other += [(tid, n, self._to_us(proc(tid), b), self._to_us(proc(tid), e), g)
                           for tid, n, b, e, g in part["evals"]]
        rest = sorted(g for g in self.kept if g not in self.first_steps and g not in self.named_steps)
        for g in rest[:-self.window]:
            del self.kept[g]

    def _events(self) -> list:
        hosts = (getattr(self.session, "env", None) or {}).get("hostnames") or [os.uname().nodename] * self.np_
        names = list(dict.fromkeys(hosts))
        pid = (lambda tid: names.index(hosts[tid])) if self.comm is not None else (lambda tid: 0)
        ev = [tracefile.process(i, h) for i, h in enumerate(names if self.comm is not None else names[:1])]
        ev += [tracefile.thread(pid(r), r, f"rank {r}") for r in range(self.np_)]
        for g, row in list(self.kept.items()):  # a copy: an aborted run's rank 0 may call this mid-merge
            for epoch, _, images, spans, flights in list(row.values()):
                ev += [tracefile.span(n, pid=pid(tid), tid=tid, ts=b, dur=max(0.0, e - b), step=g, epoch=epoch,
                                      images=images[tid]) for tid, n, b, e in spans]
                for tid, k, nb, a, b in flights:
                    ev += tracefile.flight(f"bucket {k}", pid=pid(tid), tid=tid, ts=a, end=max(a, b),
                                           id=f"{tid}-{g}-{k}", step=g, bucket=k, bytes=nb)
        ev += [tracefile.span(n, pid=pid(tid), tid=tid, ts=b, dur=max(0.0, e - b), step=g)
               for tid, n, b, e, g in self.other]
        for save in self.session.saves:  # rank 0 writes the checkpoints (the others wait in the collective)
            if "at" in save:
                b = self._to_us(0, save["at"])
                ev.append(tracefile.span("checkpoint", pid=0, tid=0, ts=b, dur=save["seconds"] * 1e6, step=save["step"]))
        return ev

    def _clock(self) -> dict:
        if not self.syncs:
            return {}
        first, last = self.syncs[0], self.syncs[-1]
        return {"offsets_us": [round(o * 1e6, 3) for _, o, _ in first],
                "drift_us": [round((b[1] - a[1]) * 1e6, 3) for a, b in zip(first, last)],
                "error_us": round(max(e for s in self.syncs for _, _, e in s) * 1e6, 3),
                "comparisons": len(self.syncs)}

    def _table(self) -> list:
        """Per rank (track), medians over the kept steps of its data, compute (forward + backward +
        optimizer), network (the wait span less the wait for a slower rank) and wait seconds."""
        per: dict = {}
        for row in list(self.kept.values()):
            for r, (_, wait, _, spans, _) in list(row.items()):
                for tid in {s[0] for s in spans}:
                    d = {n: (e - b) / 1e6 for t, n, b, e in spans if t == tid}
                    if "wait" in d:
                        d["network"] = max(0.0, d["wait"] - wait)
                        d["wait"] = wait
                    d["compute"] = d.get("forward", 0.0) + d.get("backward", 0.0) + d.get("optimizer", 0.0)
                    per.setdefault(tid, []).append(d)
        out = []
        for tid in sorted(per):
            rows = per[tid]
            med = {k: round(float(np.median([d.get(k, 0.0) for d in rows])), 6)
                   for k in ("data", "compute", "network", "wait")}
            out.append({"rank": tid, "steps": len(rows), **{f"{k}_s": v for k, v in med.items()}})
        return out

    def result(self) -> dict:
        """Rank 0: write ``<out>/trace.json`` (with ``out``) and return result.json's ``trace``; no
        collective (an aborted run's rank 0 calls it alone, with what the flushed epochs held)."""
        if self.rank != 0:
            return {}
        clock = self._clock()
        out = {"path": None, "steps": sorted(self.kept), "first": sorted(self.first_steps),
               "named": sorted(self.named_steps), "window": self.window, "ranks": self._table(), "clock": clock,
               "tracks": "one per virtual rank (data, forward, backward; the optimizer on rank 0's)"
               if self.ranks.simulated else "one per rank"}
        if self.cfg.out:
            path = os.path.join(self.cfg.out, "trace.json")
            # the model as analysis needs it (perfmodel validate reads it, never imports the builder): the
            # session's, measured once for result.json and the trace alike
            meta = {"kind": "measured", "config": self.cfg.to_dict(), "np": self.np_, "clock": clock,
                    "simulated": bool(self.ranks.simulated), "model_profile": self.session.model_profile}
            try:
                tracefile.write(path, self._events(), meta=meta)
                out["path"] = path
            except (OSError, tracefile.TraceError) as e:
                out["error"] = f"cannot write {path}: {e}"
        return {"trace": out}
