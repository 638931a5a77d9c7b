"""What a loop feature is: a ``Component`` the training loop calls at fixed moments, never by name.

A feature (the weights' EMA, gradient clipping, the straggler monitor, ...) is one class in a file of its
own that implements the moments it needs; ``pilab.engine.features.FEATURES`` lists them and
``chosen(cfg, ranks)`` keeps those the ``Config`` asks for. The loop (``pilab.engine.loop``) calls, on
every rank, in this order::

    c = Feature(cfg, ranks)              # before the model exists
    ranks.start(..., on_grads=[c.on_grads])   # if it defines on_grads: the averaged gradients, before
                                              # every optimizer step, on every rank (exactly alike)
    c.start(session)                     # the session set up (model, optimizer, plan); after a resume's
    c.load_state_dict(state)             #   position, its own state from the checkpoint (if it saved one)
    c.begin_epoch(session, epoch)        # before each step (the epoch's plan is known)
    c.before_step(session, epoch, step)  # may set session.phase: what the step exchanges
                                         #   (a Phase, below; SYNC unless a component says)
    events = c.after_step(session, epoch, step, st)   # st: the StepResult every rank agrees on;
                                                      # events: dicts rank 0 emits to the callbacks
    with c.evaluating(session): ...      # around an evaluation
    c.end_epoch(session, epoch, record)  # may add its own keys to the epoch's record
    c.state_dict()                       # into every checkpoint, under c.name (None: nothing to save)
    c.result()                           # its own keys of result.json

A component keeps its state on itself and reads the loop's through ``session`` (``session.cfg``,
``session.params``, ``session.epoch_steps``, ...). Values a feature needs summed over the ranks with the
gradients get named slots (``pilab.dist.helpers.Slots``), not offsets.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """What one step exchanges, as a backend's ``step(..., phase=)`` follows it; a component chooses it
    before the step (``session.phase``: local SGD's, ``pilab.engine.localsgd.LocalSGD``)::

        Phase()                              # SYNC: the gradients averaged over the ranks
        Phase(local=True, average=True)      # each rank steps on its own gradient, then the ranks
                                             # average their parameters and BatchNorm statistics
    """
    local: bool = False  # the step's gradients stay on the rank: no gradient Allreduce
    average: bool = False  # after the step the ranks average their parameters and BatchNorm statistics


SYNC = Phase()


class Component:
    """Every moment a no-op: a feature overrides the ones it needs (and ``on_grads`` if it acts on the
    averaged gradients; leave it undefined otherwise, so the backends skip it)."""

    name = ""

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        """Whether ``cfg`` asks for this feature on ``ranks``."""
        return False

    def __init__(self, cfg, ranks):
        self.cfg = cfg

    def start(self, session) -> None:
        pass

    def begin_epoch(self, session, epoch: int) -> None:
        pass

    def before_step(self, session, epoch: int, step: int) -> None:
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
