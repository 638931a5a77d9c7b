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

from contextlib import contextmanager

import torch


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
