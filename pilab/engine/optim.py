"""Optimizers and the per-step learning-rate schedule.

    opt = build_optimizer(model, cfg, peak_lr=cfg.peak_lr(np_))
    for step in range(total):
        set_lr(opt, lr_at(step, peak_lr=peak_lr, total_steps=total, warmup_steps=warm,
                          schedule=cfg.schedule))

The optimizers: ``SGD`` (``torch.optim.SGD``'s arithmetic and state_dict), ``LARS`` and ``LAMB`` (the
layer-wise trust ratios of large-batch training) and ``Muon`` (below), all run without the guards that
import ``torch._dynamo`` (``Eager``: torch.optim's methods unwrapped, so that a rank never loads the compiler
stack). ``param_groups`` keeps weight decay off BatchNorm and biases, and gives them their own
learning-rate scale where ``Config.bn_lr_scale`` asks.

Muon (Keller Jordan, 2024): SGD's Nesterov momentum, orthogonalised by a few Newton-Schulz iterations
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

import inspect
import math

import torch
from torch import nn
from torch.optim import sgd as torch_sgd

from ..models import muon_weights


def eager_method(method):
    """``method`` without the wrappers torch puts around it (``functools.wraps`` chains)."""
    return inspect.unwrap(method)


_sgd_step = eager_method(torch_sgd.sgd)  # torch's SGD arithmetic, without its torch._dynamo guard


class Eager:
    """Mixin for a ``torch.optim`` optimizer that never imports ``torch._dynamo``::

        class SGD(Eager, torch.optim.SGD): ...

    torch wraps ``add_param_group``, ``zero_grad``, ``state_dict``, ``load_state_dict`` and SGD's
    ``step`` in guards that import ``torch._dynamo`` on their first call, and with it sympy and
    torch._inductor: ~70 MB of resident modules per rank (BENCHMARKS.md, "Memory per rank"), 8% of
    the 900 MB a rank aims at on a Pi 4B 4 GB. The guards matter only under ``torch.compile``, which
    pilab never uses; the methods inside them are the same code, so the numbers are the same
    (tests/test_memory.py checks both). Where a torch has no such wrapper, the method is used as is."""

    add_param_group = eager_method(torch.optim.Optimizer.add_param_group)
    zero_grad = eager_method(torch.optim.Optimizer.zero_grad)
    state_dict = eager_method(torch.optim.Optimizer.state_dict)
    load_state_dict = eager_method(torch.optim.Optimizer.load_state_dict)


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
