"""The gradient noise scale, measured from what data-parallel training already has, and the batch a
noise-driven ramp (``batch_ramp="gns:MAX"``) chooses from it.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A): with the squared norm
of a gradient over a small batch (each rank's own, ``b`` images) and over a big one (the average over the
ranks, ``B = np * b`` images), unbiased estimates of the true gradient's squared norm and of the
per-image gradient variance's trace are

    |G|^2 = (B |g_B|^2 - b |g_b|^2) / (B - b)         S = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

and the noise scale ``B_noise = S / |G|^2`` (in images) is the batch beyond which a larger batch buys
little: the critical batch. Each step gives one pair of estimates, far too noisy alone; as the paper
does, their means over many steps (here: an epoch's) are divided, not the per-step ratios::

    ns = NoiseScale()
    ns.add(rank_sq, avg_sq, per_rank_batch=8, np_=48)    # every synchronous step
    ns.value()                                           # images; then ns.reset() for the next epoch
    next_batch(8, [8, 16, 32], 48, ns.value())           # the ramp's choice for the next epoch

``rank_sq`` are each rank's squared gradient norms *as sent*, i.e. of its share ``g_r / np`` of the
average (``pilab.dist.squared_norm``, taken in the component's ``on_rank_grads`` moment; a slot of one
value per rank carries them with the step's metrics, exactly, so every rank and the simulator hold the
same numbers and choose the same batch).
"""
from __future__ import annotations

import dataclasses
import math

from ..component import Component, Stage
from ..config import ConfigError
from ..dist import squared_norm


class NoiseScale:
    """Sums of the per-step estimates of ``|G|^2`` and ``S`` since the last ``reset``."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.g2 = self.s = 0.0
        self.steps = 0

    def add(self, rank_sq, avg_sq: float, per_rank_batch: int, np_: int) -> None:
        """One synchronous step: ``rank_sq`` (per rank, of ``g_r / np``) and the average's ``avg_sq``."""
        small = math.fsum(rank_sq) / len(rank_sq) * np_ ** 2  # the ranks' mean |g_r|^2
        b, big_b = per_rank_batch, per_rank_batch * np_
        self.g2 += (big_b * avg_sq - b * small) / (big_b - b)
        self.s += (small - avg_sq) / (1 / b - 1 / big_b)
        self.steps += 1

    def value(self) -> float | None:
        """The noise scale in images (the epoch's mean ``S`` over its mean ``|G|^2``); None before any
        step, infinity where the gradient's estimated norm is not positive (noise dominates)."""
        if not self.steps:
            return None
        return self.s / self.g2 if self.g2 > 0 else math.inf

    def state(self) -> dict:
        return {"g2": self.g2, "s": self.s, "steps": self.steps}

    def restore(self, d: dict | None) -> None:
        self.reset()
        if d:
            self.g2, self.s, self.steps = float(d["g2"]), float(d["s"]), int(d["steps"])


def record(noise_scale: float | None) -> dict:
    """The epoch record's entry: ``noise_scale`` in images, or None and a note where it is unbounded
    (JSON has no infinity)::

        record(1823.2)          # {"noise_scale": 1823.2}
        record(math.inf)        # {"noise_scale": None, "noise_scale_note": "..."}
    """
    if noise_scale is None or math.isfinite(noise_scale):
        return {"noise_scale": noise_scale}
    return {"noise_scale": None, "noise_scale_note": "the gradient's estimated squared norm was not positive "
                                                     "over this epoch: noise dominates (an unbounded noise scale)"}


def next_batch(current: int, ladder: list[int], np_: int, noise_scale: float | None) -> int:
    """The per-rank batch for the next epoch: the largest of ``ladder`` (per-rank batches, rising) whose
    global batch stays within ``noise_scale``, never smaller than ``current`` (the ramp only grows: a
    noisier late estimate is no reason to give back the cheap large steps)."""
    if noise_scale is None:
        return current
    fits = [b for b in ladder if b * np_ <= noise_scale]
    return max([current] + fits)


class NoiseRamp(Component):
    """The loop's feature for ``batch_ramp="gns:MAX"``: every synchronous step's norms into a
    ``NoiseScale``; after each whole epoch, the batch it chooses for the next one, which the session then
    follows as an explicit ramp (the choices so far: ``batch_ramp_chosen`` in result.json, and with the
    noise measured so far in every checkpoint). The same numbers on every rank (their norms travel
    exactly), so every rank chooses alike, with no collective. Its later epochs' steps are not known
    ahead, so the learning-rate schedule runs in epochs (``session.schedule_in_epochs``)."""

    name = "gns"
    stage = Stage.MEASURE  # the averaged gradient's norm as it is, before clipping changes it

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return bool(cfg.gns_max)

    def __init__(self, cfg, ranks):
        super().__init__(cfg, ranks)
        self.scale = NoiseScale()
        self.sq: dict = {}  # this step's per-tensor squared norms of each rank's share, as sent, by rank
        self.avg_sq = None
        self.last = None  # the last step's (every rank's squared norm, the average's), if it exchanged

    def setup(self, cfg, ranks) -> None:
        super().setup(cfg, ranks)
        if ranks.simulated and cfg.bn == "sync" and ranks.np_ > 1:
            raise ConfigError(f"bn=sync runs all ranks in one forward, but batch_ramp={cfg.batch_ramp!r} needs "
                              "each rank's own gradient; use bn=local, or run it under mpiexec")
        if ranks.simulated and cfg.simulate_mode == "fast":
            raise ConfigError(f"simulate_mode=fast runs several ranks per forward, but batch_ramp={cfg.batch_ramp!r} "
                              "needs each rank's own gradient; use simulate_mode=exact")

    def slots(self, np_: int) -> dict:
        return {"grad_sq": np_} if np_ > 1 else {}

    def on_rank_grads(self, rank, grads: list) -> None:
        # per tensor, added exactly (fsum) at the end: the same bits however the pieces come
        mine = self.sq.setdefault(rank.rank, [])  # one rank here; the simulator's each in turn
        mine += [squared_norm([g]) for g in grads]
        rank.send["grad_sq"][rank.rank] = math.fsum(mine)

    def on_grads(self, grads: list) -> None:
        if self.sq:  # a step whose gradients were averaged over 2+ ranks
            self.avg_sq = squared_norm(grads)

    def on_step(self, rank) -> None:
        self.last = (rank.sums["grad_sq"].copy(), self.avg_sq) if self.avg_sq is not None else None
        self.sq, self.avg_sq = {}, None

    def start(self, session) -> None:
        self.session = session
        session.schedule_in_epochs = True
        session.follow_plan(dataclasses.replace(self.cfg, batch_ramp=""))  # nothing chosen yet

    def after_step(self, session, epoch: int, step: int, st) -> list:
        if self.last is not None:
            self.scale.add(*self.last, session.batch, session.np_)
        return []

    def end_epoch(self, session, epoch: int, rec: dict) -> None:
        if rec["steps"] != session.epoch_steps[epoch]:  # a partial epoch chooses nothing
            return
        cfg, np_, value = self.cfg, session.np_, self.scale.value()
        cur = session.bcfg.per_rank_batch(np_, epoch)
        nxt = next_batch(cur, cfg.gns_ladder_per_rank(np_), np_, value)
        self.scale.reset()
        if nxt != cur and epoch + 1 < cfg.epochs:
            sense = nxt if cfg.batch_mode == "per_rank" else nxt * np_
            chosen = ",".join(filter(None, [session.bcfg.batch_ramp, f"{epoch + 1}:{sense}"]))
            session.follow_plan(dataclasses.replace(cfg, batch_ramp=chosen))
        rec.update({**record(value), "next_per_rank_batch": nxt if epoch + 1 < cfg.epochs else None})

    def state_dict(self) -> dict:
        return {"plan": self.session.bcfg.batch_ramp, "noise": self.scale.state()}

    def load_state_dict(self, state: dict) -> None:
        self.session.follow_plan(dataclasses.replace(self.cfg, batch_ramp=state["plan"]))
        self.scale.restore(state["noise"])

    def result(self) -> dict:
        return {"batch_ramp_chosen": self.session.bcfg.batch_ramp}
