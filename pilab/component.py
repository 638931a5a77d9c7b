"""What a feature of the training loop is: a ``Component``, called by the loop and by the rank backends at
fixed moments, never by name. pilab's own features are components (``pilab.engine.features``), and so is
yours, given to ``pilab.train(cfg, components=[...])``, ``pilab.simulate``, ``pilab.scale`` or the
notebook panel::

    import numpy as np, torch, pilab

    class GradientNoise(pilab.Component):
        '''Gaussian noise added to the averaged gradient, the same on every rank (one seeded generator).'''
        name, stage = "gradient_noise", pilab.Stage.GRADIENTS

        def __init__(self, sigma=1e-3, seed=0):
            self.sigma, self.gen = sigma, torch.Generator().manual_seed(seed)

        def on_grads(self, grads):
            for g in grads:
                g.add_(torch.randn(g.shape, generator=self.gen) * self.sigma)

        def state_dict(self):                    # rides in every checkpoint under its name
            return {"gen": self.gen.get_state()}

        def load_state_dict(self, state):
            self.gen.set_state(state["gen"])

    result = pilab.simulate(pilab.Config(epochs=1), 4, components=[GradientNoise(1e-3)])

The moments, on every rank, in the order they come::

    c.setup(cfg, ranks)                  # before the data and the model exist (may refuse: ConfigError)
    c.start(session)                     # the session set up (model, optimizer, plan); after a resume's
    c.load_state_dict(state)             #   position, its own state from the checkpoint (if it saved one)
    c.begin_epoch(session, epoch)        # before each step (the epoch's plan is known)
    c.before_step(session, epoch, step)  # may set session.phase: what the step exchanges (a Phase)
      inside the step (the rank backend calls these; MPI ranks and the simulator's virtual ranks alike):
      c.on_rank_grads(rank, grads)       # this rank's gradient as it is sent, its share of the average,
                                         #   in pieces (GradSync's buckets; the simulator: all at once);
                                         #   write rank.send[name] (your slots) for the sum over ranks
      c.on_grads(grads)                  # the averaged gradient, before the optimizer step (a local step:
                                         #   this rank's own); change it in place
      c.on_step(rank)                    # the step done: rank.sums (every slot summed over the ranks),
                                         #   rank.spans (what this process did when), rank.flights
    events = c.after_step(session, epoch, step, st)   # st: the StepResult every rank agrees on;
                                                      # events: dicts rank 0 emits to the callbacks
    with c.evaluating(session): ...      # around an evaluation
    c.end_epoch(session, epoch, record)  # may add its own keys to the epoch's record
    c.state_dict()                       # into every checkpoint, under c.name (None: nothing to save)
    c.result()                           # its own keys of result.json

The order among components is a rule, ``Stage`` (below): the loop sorts them by ``stage``; within a stage
pilab's own come first (in ``FEATURES``' order), then yours in the order given. A component keeps its
state on itself and reads the loop's through ``session`` (``session.cfg``, ``session.params``,
``session.epoch_steps``, ...). Values summed over the ranks with the gradients get named slots
(``slots``), never offsets. A component that needs each rank's own gradient (``on_rank_grads``) or
weights (``per_rank = True``) makes the simulator run one rank per forward, as MPI computes it.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from enum import IntEnum


@dataclass(frozen=True)
class Phase:
    """What one step exchanges, as a backend's ``step(..., phase=)`` follows it; a component chooses it
    before the step (``session.phase``: local SGD's, ``pilab.engine.localsgd.LocalSGD``)::

        Phase()                              # SYNC: the gradients averaged over the ranks
        Phase(local=True, average=True)      # each rank steps on its own gradient, then the ranks
                                             # average their parameters and BatchNorm statistics
        Phase(shares=(43, 21))               # rank r trains shares[r] images of the global batch of
                                             # sum(shares), its loss weighted by shares[r] / sum(shares)
                                             # (``pilab.engine.balance.Balance``'s uneven shares)
    """
    local: bool = False  # the step's gradients stay on the rank: no gradient Allreduce
    average: bool = False  # after the step the ranks average their parameters and BatchNorm statistics
    shares: tuple | None = None  # each rank's images of the step's global batch; None: equal, as cut at build

    def share_of(self, rank: int) -> tuple[int, int] | None:
        """Rank ``rank``'s (first position, images) in the step's global batch; None with equal shares::

            Phase(shares=(43, 21)).share_of(1)     # (43, 21)
        """
        return None if self.shares is None else (sum(self.shares[:rank]), self.shares[rank])

    def weight_of(self, rank: int) -> float | None:
        """Rank ``rank``'s weight in the average, b_r / B (None: equal shares, 1/np as ever)."""
        return None if self.shares is None else self.shares[rank] / sum(self.shares)


SYNC = Phase()


class Stage(IntEnum):
    """Where a component stands among the others, at every moment: the loop calls them in this order."""
    COMPILE = 0  # how the step's arithmetic is built (the fast simulator's compiled BatchNorm)
    MODE = 1  # which mode the simulator runs, timed on trial steps before any other component sees one
    MEASURE = 2  # reads the gradients as they are (the noise scale), before anything changes them
    GRADIENTS = 3  # changes the averaged gradient before the optimizer step (clipping; your gradient noise)
    WEIGHTS = 4  # changes the weights the step ends with (Lookahead's slow weights)
    AVERAGE = 5  # averages the weights as changed (the EMA evaluated instead of the weights)
    PLAN = 6  # chooses what the next steps exchange (local SGD's phase)
    OBSERVE = 7  # only watches and writes (stragglers, the trace)


class Component:
    """Every moment a no-op: a component overrides the ones it needs. ``on_rank_grads`` and ``on_grads``
    are left undefined here, so that a backend calls only those that have them (and the simulator runs
    per rank only for a component that needs it)."""

    name = ""  # its key in checkpoints (state_dict) and in events
    stage = Stage.OBSERVE
    per_rank = False  # needs each rank's own weights (the simulator then runs one rank per forward)
    watch_messages = False  # wants each gradient message's flight (MPI ranks: rank.flights)

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        """Whether ``cfg`` asks for this feature on ``ranks`` (pilab's own components; yours are given)."""
        return False

    def __init__(self, cfg=None, ranks=None):
        self.cfg = cfg

    def setup(self, cfg, ranks) -> None:
        """Before the data and the model exist, on every rank: refuse what it cannot run (ConfigError)."""
        self.cfg = cfg

    def slots(self, np_: int) -> dict:
        """Named float64 values this component sends with each step's metrics, summed over the ranks:
        ``{"name": count}`` (a count of ``np_``: one per rank, rank r writing entry r, sums exactly)."""
        return {}

    def start(self, session) -> None:
        pass

    def begin_epoch(self, session, epoch: int) -> None:
        pass

    def before_step(self, session, epoch: int, step: int) -> None:
        pass

    def on_step(self, rank) -> None:
        pass

    def after_step(self, session, epoch: int, step: int, st) -> list:
        return []

    def evaluating(self, session):
        return nullcontext()

    def end_epoch(self, session, epoch: int, record: dict) -> None:
        pass

    def state_dict(self):
        return None

    def load_state_dict(self, state) -> None:
        pass

    def result(self) -> dict:
        return {}


class RankStep:
    """One rank's step as its backend runs it.

    The record the components' in-step moments share::

        rank.rank, rank.np_        # which rank (a virtual rank in the simulator), of how many
        rank.send["name"]          # before the exchange: this rank's values of a slot (zeroed each step)
        rank.sums["name"]          # after it: the slot summed over the ranks (also the backend's own:
                                   #   MPI ranks' "ready" and "network": every rank's compute and network s)
        rank.spans                 # (track, phase, begin, end) on this process's perf_counter clock
        rank.flights               # (track, first bucket, bytes, posted, first seen complete): MPI ranks,
                                   #   when a component sets watch_messages
    """

    __slots__ = ("rank", "np_", "send", "sums", "spans", "flights")

    def __init__(self, rank: int, np_: int, send=None):
        self.rank, self.np_ = rank, np_
        self.send, self.sums = send if send is not None else {}, {}
        self.spans, self.flights = None, ()


def in_order(components) -> list:
    """``components`` sorted by stage, keeping their given order within a stage (the loop's rule)."""
    return sorted(components, key=lambda c: c.stage)


def has(components, moment: str) -> list:
    """The components that define ``moment`` (``on_rank_grads``, ``on_grads``), in order."""
    return [c for c in components if callable(getattr(c, moment, None))]
