"""Lookahead (Zhang, Lucas, Hinton, Ba 2019, "Lookahead optimizer: k steps forward, 1 step back") as a loop
feature (``Config.lookahead_steps``): a slow copy of the weights; every k optimizer steps the slow weights
move halfway (alpha 0.5, the paper's default) towards where the optimizer took the fast ones, and the fast
weights start again from there. It damps the oscillation a large learning rate brings, which is what a
large global batch's linear rule asks for::

    cfg = Config(lookahead_steps=5)        # k = 5

Exact in the simulator: every rank (MPI or virtual) holds the same averaged weights after a synchronous
step, so each applies the same interpolation to the same values. The optimizer's state (momentum) is kept
across the interpolation, as the paper's default does; BatchNorm's running statistics are not weights and
are left alone. The slow weights and the position in the cycle are saved in every checkpoint, so a run
resumed mid-cycle goes on bit for bit.
"""
from __future__ import annotations

import torch

from ..component import Component, Stage

ALPHA = 0.5  # the slow weights' step towards the fast ones (Zhang et al.'s default; 0.5 and 0.8 both work)


class Lookahead(Component):
    name = "lookahead"
    stage = Stage.WEIGHTS

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return cfg.lookahead_steps > 0

    def start(self, session) -> None:
        self.params = session.params
        self.slow = [p.detach().clone() for p in self.params]
        self.count = 0  # optimizer steps since the last interpolation

    @torch.no_grad()
    def after_step(self, session, epoch: int, step: int, st) -> list:
        self.count += 1
        if self.count == self.cfg.lookahead_steps:
            fast = [p.detach() for p in self.params]
            torch._foreach_lerp_(self.slow, fast, ALPHA)  # slow += alpha (fast - slow)
            torch._foreach_copy_(fast, self.slow)
            self.count = 0
        return []

    def state_dict(self) -> dict:
        return {"slow": [s.clone() for s in self.slow], "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for s, v in zip(self.slow, state["slow"]):
                s.copy_(v)
        self.count = int(state["count"])
