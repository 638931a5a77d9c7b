"""Gradient clipping by global norm (``Config.clip_grad_norm``): before every optimizer step the
averaged gradient is scaled down to that L2 norm if it is longer (Pascanu et al. 2013; what
``torch.nn.utils.clip_grad_norm_`` does on one process).

Exact in the simulator: the norm is ``pilab.dist.helpers.squared_norm``'s (float64, the same bits wherever
the same values are), taken of the averaged gradient every rank holds alike, so every MPI rank and every
virtual rank scale by the same factor. A local-SGD step clips each rank's own gradient::

    cfg = Config(clip_grad_norm=1.0)
"""
from __future__ import annotations

import math

import torch

from ..component import Component, Stage
from ..dist import squared_norm


class ClipGradNorm(Component):
    name = "clip_grad_norm"
    stage = Stage.GRADIENTS

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return cfg.clip_grad_norm > 0

    def on_grads(self, grads: list) -> None:
        norm = math.sqrt(squared_norm(grads))
        if norm > self.cfg.clip_grad_norm:
            torch._foreach_mul_(grads, self.cfg.clip_grad_norm / (norm + 1e-6))
