"""Optimizers and the per-step learning-rate schedule.

    opt = build_optimizer(model, cfg, peak_lr=cfg.peak_lr(np_))
    for step in range(total):
        set_lr(opt, lr_at(step, peak_lr=peak_lr, total_steps=total, warmup_steps=warm,
                          schedule=cfg.schedule))
"""
from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float, on: str = "weights") -> list[dict]:
    """Weight decay on conv/linear weights only (``on="weights"``: BatchNorm scales and biases are
    left alone, as large-batch recipes do) or on every parameter (``on="all"``, plain SGD's)."""
    if on == "all":
        return [{"params": [p for p in model.parameters() if p.requires_grad],
                 "weight_decay": weight_decay, "lars": True}]
    decay, no_decay = [], []
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if name == "weight" and isinstance(m, (nn.Conv2d, nn.Linear)):
                decay.append(p)
            else:
                no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay, "lars": True},
            {"params": no_decay, "weight_decay": 0.0, "lars": False}]


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio (You et al., 2017).

    For each tensor in a group with ``lars=True`` the step is scaled by
    ``eta * ||w|| / (||g|| + wd * ||w||)``; BatchNorm and bias tensors (``lars=False``) take plain SGD.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, nesterov: bool = False):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                        nesterov=nesterov, lars=True)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                wd = g["weight_decay"]
                if g["lars"]:
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d)
                    trust = torch.where((w_norm > 0) & (g_norm > 0),
                                        g["eta"] * w_norm / (g_norm + wd * w_norm),
                                        torch.ones_like(w_norm))
                    d = (d + wd * p) * trust
                elif wd:
                    d = d + wd * p
                state = self.state[p]
                if g["momentum"]:
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d.clone()
                    else:
                        buf.mul_(g["momentum"]).add_(d)
                    d = d.add(buf, alpha=g["momentum"]) if g["nesterov"] else buf
                p.add_(d, alpha=-g["lr"])
        return loss


def build_optimizer(model: nn.Module, cfg, peak_lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.weight_decay_on)
    if cfg.optimizer == "lars":
        return LARS(groups, lr=peak_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    eta=cfg.lars_eta, nesterov=cfg.nesterov)
    for g in groups:
        g.pop("lars")
    return torch.optim.SGD(groups, lr=peak_lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                           weight_decay=cfg.weight_decay)


def lr_at(step: int, *, peak_lr: float, total_steps: int, warmup_steps: int,
          schedule: str) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup from peak/warmup_steps to
    the peak over ``warmup_steps``, then cosine to 0, step decay (x0.1 at 50% and 75%), or constant."""
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    rest = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / rest)
    if schedule == "cosine":
        return peak_lr * 0.5 * (1 + math.cos(math.pi * t))
    if schedule == "step":
        return peak_lr * (0.1 ** ((t >= 0.5) + (t >= 0.75)))
    return peak_lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
