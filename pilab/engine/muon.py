"""Muon (Keller Jordan, 2024): SGD's Nesterov momentum, orthogonalised by a few Newton-Schulz iterations
before it is applied, for the weights of convolutions (and optionally the classifier), as airbench's
CIFAR-10 record scripts step them; SGD for BatchNorm, biases and the weights Muon is not given
(``Config.optimizer="muon"``, ``muon_lr``, ``muon_momentum``, ``muon_on``)::

    opt = build_optimizer(model, cfg, peak_lr=cfg.peak_lr(np_))   # pilab.engine.optim's: a Muon
    set_lr(opt, lr)                                          # Muon's group follows at muon_lr / lr

Per Muon weight W with ``c_out`` output channels and averaged gradient G (airbench94_muon's rule):
``buf = mu buf + G``; ``U = G + mu buf`` (Nesterov); W is rescaled to Frobenius norm sqrt(c_out) (every
convolution here feeds a BatchNorm, so its scale is free; this holds the step's relative size at lr);
then ``W -= lr NS(U)``, where NS maps U (as a c_out x rest matrix) to roughly its orthogonal polar factor
(its singular values pushed to ~[0.7, 1.2]) by 3 quintic iterations. The classifier (``conv+head``),
whose scale no BatchNorm undoes, is not rescaled; its step is ``lr sqrt(max(1, rows/cols)) NS(U)``, as
Keller Jordan's general Muon scales it, and its weight decays as SGD's would.

It acts on the averaged gradient, the same on every rank, so MPI ranks and the simulator take the same
step bit for bit (tests/test_fewstep.py). The iterations run in float32 (airbench: bfloat16 on a GPU;
a CPU has no fast bfloat16 matmul, and float32 keeps the step reproducible).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim import sgd as torch_sgd

from ..models.weights import muon_weights
from .eager import Eager, eager_method

_sgd_step = eager_method(torch_sgd.sgd)  # torch's SGD arithmetic, without its torch._dynamo guard
NS_STEPS = 3  # airbench's (Keller Jordan's general Muon: 5)
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic's, chosen for the steepest slope at 0 (Jordan 2024)


def orthogonalise(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """~U V^T of ``g``'s SVD (a 2-D matrix), by ``steps`` quintic Newton-Schulz iterations::

        orthogonalise(torch.randn(16, 96))   # its singular values all between ~0.7 and ~1.2
    """
    a, b, c = NS_COEFFS
    x = g / (torch.linalg.matrix_norm(g) + eps)  # every singular value <= 1
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the short side's Gram matrix
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_groups(model: nn.Module, cfg, groups: list[dict]) -> list[dict]:
    """``groups`` (``pilab.engine.optim.param_groups``': weight decay on the weights, ``bn_lr_scale`` on
    BatchNorm and biases) with the weights of ``muon_weights`` taken out into Muon's own group(s): ``muon=True``, ``lr_scale`` muon_lr /
    lr (so ``set_lr`` moves both along the schedule), ``rescale`` where a BatchNorm follows (convolutions)."""
    chosen = muon_weights(model, cfg.muon_on)
    ids = {id(p) for p in chosen}
    convs = {id(m.weight) for m in model.modules() if isinstance(m, nn.Conv2d)}
    out = []
    for g in groups:
        rest = [p for p in g["params"] if id(p) not in ids]
        out.append({**{k: v for k, v in g.items() if k != "lars"}, "params": rest, "muon": False})
    scale = cfg.muon_lr / cfg.lr
    for rescale in (True, False):
        params = [p for p in chosen if (id(p) in convs) == rescale]
        if params:
            out.append({"params": params, "muon": True, "rescale": rescale, "lr_scale": scale,
                        "weight_decay": 0.0 if rescale else cfg.weight_decay})
    return [g for g in out if g["params"]]


class Muon(Eager, torch.optim.Optimizer):
    """Muon for the groups marked ``muon=True`` (momentum ``muon_momentum``, always Nesterov), torch's SGD
    arithmetic for the others (``momentum``, ``nesterov``, coupled weight decay)::

        opt = Muon(muon_groups(model, cfg), lr=0.1, momentum=0.9, muon_momentum=0.6)
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0, muon_momentum: float = 0.6, ns_steps: int = NS_STEPS):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      muon=False, rescale=False, muon_momentum=muon_momentum,
                                      ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if g["muon"]:
                for p in params:
                    self._muon(p, g)
            elif params:
                self._sgd(params, g)
        return loss

    def _sgd(self, params: list, g: dict) -> None:
        """torch.optim.SGD's update of these tensors, by torch's own function (one tensor at a time, as
        torch.optim.SGD on a CPU), its momentum buffers kept in this optimizer's state as SGD keeps them."""
        bufs = [self.state[p].get("momentum_buffer") for p in params]
        _sgd_step(params, [p.grad for p in params], bufs, foreach=False, weight_decay=g["weight_decay"],
                  momentum=g["momentum"], lr=g["lr"], dampening=0.0, nesterov=g["nesterov"], maximize=False)
        if g["momentum"]:
            for p, buf in zip(params, bufs):
                self.state[p]["momentum_buffer"] = buf

    def _muon(self, p: torch.Tensor, g: dict) -> None:
        mu, state = g["muon_momentum"], self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(p)
        buf.mul_(mu).add_(p.grad)
        u = p.grad.add(buf, alpha=mu)
        rows = p.shape[0]
        update = orthogonalise(u.reshape(rows, -1), g["ns_steps"]).view_as(p)
        if g["rescale"]:
            norm = torch.linalg.vector_norm(p)
            if norm > 0:
                p.mul_(math.sqrt(rows) / norm)
            p.add_(update, alpha=-g["lr"])
        else:
            if g["weight_decay"]:
                p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(update, alpha=-g["lr"] * math.sqrt(max(1.0, rows / update[0].numel())))


def build_muon(model: nn.Module, cfg, peak_lr: float, groups: list[dict]) -> Muon:
    """``Config.optimizer="muon"`` over ``groups`` (``param_groups``'): Muon's weights at ``peak_lr * muon_lr /
    lr``, the rest SGD's at ``peak_lr`` (times ``bn_lr_scale`` for BatchNorm and biases)."""
    groups = muon_groups(model, cfg, groups)
    for g in groups:
        g["lr"] = peak_lr * g.get("lr_scale", 1.0)
    return Muon(groups, lr=peak_lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
                muon_momentum=cfg.muon_momentum)
