"""Optimizers and the per-step learning-rate schedule.

    opt = build_optimizer(model, cfg, peak_lr=cfg.peak_lr(np_))
    for step in range(total):
        set_lr(opt, lr_at(step, peak_lr=peak_lr, total_steps=total, warmup_steps=warm,
                          schedule=cfg.schedule))

The optimizers: ``SGD`` (``torch.optim.SGD``'s arithmetic and state_dict), ``LARS`` and ``LAMB`` (the
layer-wise trust ratios of large-batch training), all run without the guards that import
``torch._dynamo`` (see ``Eager``). ``param_groups`` keeps weight decay off BatchNorm and biases, and gives
them their own learning-rate scale where ``Config.bn_lr_scale`` asks.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .eager import Eager, eager_method
from .muon import build_muon


def param_groups(model: nn.Module, weight_decay: float, on: str = "weights", *,
                 bn_lr_scale: float = 1.0) -> list[dict]:
    """Weight decay on conv/linear weights only (``on="weights"``: BatchNorm scales and biases are
    left alone, as large-batch recipes do) or on every parameter (``on="all"``, plain SGD's).
    ``bn_lr_scale``: BatchNorm scales/shifts and biases step with this multiple of the weights' learning
    rate (their group's ``lr_scale``, which ``set_lr`` follows); fast-CIFAR recipes raise it::

        param_groups(model, 5e-4)                    # [weights: decayed, the rest: not]
        param_groups(model, 5e-4, bn_lr_scale=4.0)   # ... and the rest at 4x the weights' lr
    """
    if on == "all" and bn_lr_scale == 1.0:
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
    rest = {"params": no_decay, "weight_decay": weight_decay if on == "all" else 0.0, "lars": on == "all"}
    if bn_lr_scale != 1.0:
        rest["lr_scale"] = bn_lr_scale
    return [{"params": decay, "weight_decay": weight_decay, "lars": True}, rest]


class SGD(Eager, torch.optim.SGD):
    """``torch.optim.SGD`` (the same update, state and state_dict) that never imports ``torch._dynamo``."""

    # torch's guard runs the step with autograd set to defaults["differentiable"], False unless asked
    # for; pilab never asks (a differentiable optimizer step is for meta-learning).
    _step = staticmethod(eager_method(torch.optim.SGD.step))

    @torch.no_grad()
    def step(self, closure=None):
        return self._step(self, closure)


class LARS(Eager, torch.optim.Optimizer):
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


class LAMB(Eager, torch.optim.Optimizer):
    """Adam's moments with a layer-wise trust ratio (You et al., ICLR 2020, "Large batch optimization for
    deep learning: training BERT in 76 minutes"), with bias correction.

    Per tensor: ``u = m_hat / (sqrt(v_hat) + eps) + wd * w``; in a group with ``lars=True`` (conv/linear
    weights) the step is ``lr * ||w|| / ||u|| * u`` (``lr * u`` where either norm is 0), in the others
    (BatchNorm, biases) Adam's ``lr * u``. Its lr is Adam's scale (~1e-3 per 256 images), not SGD's::

        opt = LAMB(param_groups(model, 0.01), lr=2e-3, betas=(0.9, 0.999))
    """

    def __init__(self, params, lr: float, betas: tuple = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, lars=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(g["eps"]))
                if g["weight_decay"]:
                    u.add_(p, alpha=g["weight_decay"])
                if g["lars"]:
                    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
                    trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                    u.mul_(trust)
                p.add_(u, alpha=-g["lr"])
        return loss


class SubsetStep:
    """``optimizer.step()`` a few parameters at a time: ``GradSync.finish(step=...)`` steps each bucket's
    parameters as its average lands, while later buckets are still on the wire, and ``rest()`` steps the
    others. For SGD and LARS only, whose update of a parameter reads that parameter's gradient, state
    and group settings alone, one tensor at a time on CPU (torch's SGD takes its per-tensor path there),
    so the result is bitwise the same as one ``step()`` (tests/test_mpi.py)::

        stepper = SubsetStep.of(optimizer)   # None: this optimizer is stepped whole
        sync.finish(step=stepper)
        stepper.rest()
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.done: set = set()

    @classmethod
    def of(cls, optimizer) -> "SubsetStep | None":
        ok = type(optimizer) in (SGD, LARS) and all(
            p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"])
        return cls(optimizer) if ok else None

    def __call__(self, params) -> None:
        ids = {id(p) for p in params}
        self._step(ids)
        self.done |= ids

    def rest(self) -> None:
        """Step every parameter not stepped since the last ``rest()``."""
        done, self.done = self.done, set()
        self._step({id(p) for g in self.optimizer.param_groups for p in g["params"]} - done)

    def _step(self, ids: set) -> None:
        opt = self.optimizer
        full = opt.param_groups
        # the same groups (settings, the learning rate of this step) holding only these parameters; the
        # state (momentum buffers) is the optimizer's, kept per parameter
        opt.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in ids]) for g in full]
        try:
            opt.step()
        finally:
            opt.param_groups = full


def build_optimizer(model: nn.Module, cfg, peak_lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.weight_decay_on, bn_lr_scale=cfg.bn_lr_scale)
    if cfg.optimizer == "muon":
        return build_muon(model, cfg, peak_lr, groups)
    for g in groups:
        g["lr"] = peak_lr * g.get("lr_scale", 1.0)
    if cfg.optimizer == "lars":
        return LARS(groups, lr=peak_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    eta=cfg.lars_eta, nesterov=cfg.nesterov)
    if cfg.optimizer == "lamb":  # beta1 is the momentum setting (0.9 by default), beta2 Adam's 0.999
        return LAMB(groups, lr=peak_lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)
    for g in groups:
        g.pop("lars")
    return SGD(groups, lr=peak_lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
               weight_decay=cfg.weight_decay)


def lr_at(step: int, *, peak_lr: float, total_steps: int, warmup_steps: int,
          schedule: str, decay_steps: int = 0) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup from peak/warmup_steps to
    the peak over ``warmup_steps``, then cosine to 0, step decay (x0.1 at 50% and 75%), constant, linear
    to 0 (with a short warmup: the triangular schedule of few-step recipes such as airbench's), or wsd:
    the peak until the last ``decay_steps``, then linear to 0 -- before its decay the lr does not depend on
    ``total_steps``, so a run of more steps may go on from a checkpoint of the stable phase::

        lr_at(90, peak_lr=1.0, total_steps=100, warmup_steps=0, schedule="wsd", decay_steps=20)   # 0.5
    """
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "wsd":
        start = total_steps - decay_steps
        return peak_lr if step < start else peak_lr * (1 - (step - start) / max(1, decay_steps))
    rest = max(1, total_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / rest)
    if schedule == "cosine":
        return peak_lr * 0.5 * (1 + math.cos(math.pi * t))
    if schedule == "step":
        return peak_lr * (0.1 ** ((t >= 0.5) + (t >= 0.75)))
    if schedule == "linear":
        return peak_lr * (1 - t)
    return peak_lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The step's learning rate: ``lr`` for the weights, times a group's ``lr_scale`` where it has one."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
