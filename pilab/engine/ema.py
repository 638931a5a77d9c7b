"""An exponential moving average of the weights, evaluated instead of the weights themselves (Polyak
averaging, as few-step CIFAR-10 recipes such as airbench use it)::

    ema = WeightAverage(params, decay=0.99)
    ...after each step whose parameters every rank shares:   ema.update(params, steps=1)
    with ema.applied(params):                               # evaluate the average
        evaluate(model, ...)

Updated only where every rank holds the same parameters (every synchronous step; a local-SGD run's
parameter averages, ``steps`` = the steps since the last one, so the decay per step is the same), so
the average is the same on every rank without any communication. BatchNorm running statistics are the
model's own (settled as usual before evaluation).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..component import Component, Stage


class WeightAverage:
    def __init__(self, params: list, decay: float):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, params: list, steps: int = 1) -> None:
        keep = self.decay ** steps
        torch._foreach_mul_(self.shadow, keep)
        torch._foreach_add_(self.shadow, [p.detach() for p in params], alpha=1 - keep)

    @contextmanager
    def applied(self, params: list):
        """The average in the parameters' place (no copy: the tensors are swapped), then back."""
        live = [p.data for p in params]
        for p, s in zip(params, self.shadow):
            p.data = s
        try:
            yield
        finally:
            for p, t in zip(params, live):
                p.data = t

    def state(self) -> list:
        return [s.clone() for s in self.shadow]

    @torch.no_grad()
    def load(self, state: list) -> None:
        for s, v in zip(self.shadow, state):
            s.copy_(v)


class EMA(Component):
    """The loop's feature (``Config.ema_epochs``): the average updated after every step whose parameters
    every rank shares (``steps`` since the last such step), its time constant kept in epochs under a
    batch ramp, evaluated instead of the weights, saved in every checkpoint."""

    name = "ema"
    stage = Stage.AVERAGE

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return cfg.ema_epochs > 0

    def start(self, session) -> None:
        self.params = session.params
        self.avg = WeightAverage(self.params, math.exp(-1 / (self.cfg.ema_epochs * session.steps_per_epoch)))
        self.pending = 0  # steps since its last update

    def begin_epoch(self, session, epoch: int) -> None:
        if self.cfg.batch_ramp and epoch < self.cfg.epochs:  # the same time constant in epochs, whatever the steps
            self.avg.decay = math.exp(-1 / (self.cfg.ema_epochs * session.epoch_steps[epoch]))

    def after_step(self, session, epoch: int, step: int, st) -> list:
        self.pending += 1
        ph = session.phase  # the step's (pilab.engine.localsgd.LocalSGD's; SYNC without local SGD)
        if not ph.local or ph.average:
            self.avg.update(self.params, steps=self.pending)
            self.pending = 0
        return []

    def evaluating(self, session):
        return self.avg.applied(self.params)

    def state_dict(self) -> dict:
        return {"shadow": self.avg.state(), "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.avg.load(state["shadow"])
        self.pending = int(state["pending"])
