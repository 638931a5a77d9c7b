"""Layers whose behaviour depends on the ranks: every BatchNorm variant and the per-rank dropout.

Any model's layers are converted, not only pilab's: every ``nn.BatchNorm1d/2d/3d`` (with or without
affine parameters or running statistics) and every dropout layer. A layer that mixes the images of a
batch some other way cannot be made per-rank; ``engine.ownmodel.check_rank_exact`` finds it before training (per-image
layers such as GroupNorm and LayerNorm need nothing).

* ``SyncBatchNorm`` (``pilab.dist.syncbn``) — batch statistics over all MPI ranks, or over groups of
  consecutive ranks (``bn_group``), on CPU (``bn="sync"``);
* ``GhostBatchNorm2d`` — statistics per group of ``ghost_batch`` images, and per *virtual* rank in the
  simulator (or per group of virtual ranks: ``bn="sync"`` with ``bn_group``), with running statistics kept
  per virtual rank (``RankContext`` says which ranks a forward covers);
* ``RankDropout`` — each virtual rank's dropout mask from that rank's step seed;
* ``sync_virtual_buffers_`` — the BN buffer policy across virtual ranks, as ``dist.sync_buffers_`` is
  across MPI ranks.

The training engine picks them; the loops never build layers themselves::

    model = pilab.dist.convert_sync_batchnorm(build_model("mobilenetv2_cifar"), comm)   # MPI ranks
    ctx = RankContext(seed=0)
    use_ghost_batchnorm(model, ranks=48, ghost_batch=0, context=ctx)             # 48 virtual ranks
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ..dist import per_channel

__all__ = ["step_seed", "RankContext", "GhostBatchNorm2d",
           "RankDropout", "use_ghost_batchnorm", "use_rank_dropout", "sync_virtual_buffers_",
           "virtual_state"]


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """Seed of the global torch RNG for one step on one rank (dropout draws from it)."""
    return int(np.random.SeedSequence([seed, epoch, step, rank, 0x5EED]).generate_state(1)[0])


# ----------------------------------------------------------------------------------------------
# virtual ranks (the simulator) and ghost batches
# ----------------------------------------------------------------------------------------------
class RankContext:
    """Which virtual ranks the current forward covers, and the step (for dropout seeds)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.ranks = (0, 1)
        self.epoch = 0
        self.step = 0
        # True in the simulator's fast mode: GhostBatchNorm2d takes every group's statistics in one
        # vectorised reduction instead of one native batch_norm call per group (not bit-exact)
        self.vectorised = False
        # ... and that reduction compiled for layers of at least this many activations (None: never;
        # pilab.engine.compilebn sets it)
        self.compiled_from = None
        # RankDropout's per-rank RNG streams within one step (several ranks per forward), and that step
        self.streams: dict = {}
        self.streams_step = None


class GhostBatchNorm2d(nn.Module):
    """A BatchNorm (1d, 2d or 3d; with or without affine parameters or running statistics) with
    statistics per group of ``ghost_batch`` images and running statistics per virtual rank (``ranks``
    rows; one row is stored with the BatchNorm's shapes, so state_dicts match).

    In training, a batch of R ranks × k groups × g images is normalised group by group, and each group
    updates its rank's running mean/var in turn, as k small batches would (k=1 is exactly the BatchNorm
    on the rank's sub-batch). In eval, row 0 is used: the buffer policy makes all rows equal before
    any evaluation, as MPI ranks are made equal (without running statistics, eval uses the batch's, as
    the BatchNorm would).
    """

    def __init__(self, bn: _BatchNorm, ranks: int, ghost_batch: int = 0, context=None, rank_group: int = 1):
        super().__init__()
        self.renorm = None  # (start, full) steps: Batch Renormalization (use_batch_renorm)
        c = bn.num_features
        self.num_features, self.eps = c, bn.eps
        # None: a cumulative average (1 / batches seen), as BatchNorm with momentum=None keeps it
        self.cumulative = bn.momentum is None
        self.momentum = bn.momentum if bn.momentum is not None else 0.1
        self.ranks, self.ghost_batch = ranks, ghost_batch
        # SyncBatchNorm over groups of rank_group consecutive ranks (bn="sync" with bn_group): one group of
        # images spans that many ranks, and every rank of it keeps the same running statistics
        self.rank_group = rank_group
        self.context = context
        if bn.affine:
            # a scale kept out of training (Config.freeze_bn_scale) stays out
            self.weight = nn.Parameter(bn.weight.detach().clone(), requires_grad=bn.weight.requires_grad)
            self.bias = nn.Parameter(bn.bias.detach().clone(), requires_grad=bn.bias.requires_grad)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if bn.track_running_stats:
            shape = (c,) if ranks == 1 else (ranks, c)
            self.register_buffer("running_mean", bn.running_mean.detach().clone().expand(shape).contiguous())
            self.register_buffer("running_var", bn.running_var.detach().clone().expand(shape).contiguous())
            self.register_buffer("num_batches_tracked", bn.num_batches_tracked.detach().clone())
        else:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(name, None)

    def _rows(self):
        if self.running_mean is None:
            return None, None
        return self.running_mean.view(-1, self.num_features), self.running_var.view(-1, self.num_features)

    def _factor(self, r0: int) -> float:
        """The running statistics' update factor this step: the momentum, or 1 / batches seen counting
        this one (the rank-0 chunk counts the step after its groups; later chunks see it counted)."""
        if not self.cumulative or self.num_batches_tracked is None:
            return self.momentum
        return 1.0 / (int(self.num_batches_tracked) + (1 if r0 == 0 else 0))

    def forward(self, x):
        rm, rv = self._rows()
        if not self.training:
            if rm is None:  # no running statistics: the batch's, as BatchNorm evaluates then
                return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
            return F.batch_norm(x, rm[0], rv[0], self.weight, self.bias, False, 0.0, self.eps)
        r0, r1 = self.context.ranks if self.context is not None else (0, 1)
        per_rank = x.shape[0] // (r1 - r0)
        g = self.ghost_batch or per_rank * self.rank_group
        if x.shape[0] > g and self.context is not None and self.context.vectorised and self.renorm is None \
                and self.rank_group == 1 and rm is not None and not self.cumulative:
            return self._vectorised(x, rm, rv, r0, per_rank, g)
        # One native batch_norm call per group, not a vectorised re-derivation: the native kernel's
        # sums are what an MPI rank computes, so the simulator stays bit-close to real ranks
        # (a hand-written (x - mean) * rsqrt(var) differs by ~1e-3 in gradients after a few layers).
        if self.renorm is not None:
            # the step this forward belongs to: the rank-0 chunk counts it after its groups, so later
            # chunks of the same step (the simulator's) see it counted already
            t = int(self.num_batches_tracked) - (1 if r0 > 0 else 0)

            def group(part, m, v):
                return self._renormalised(part, m, v, t)
        else:
            momentum = self._factor(r0)

            def group(part, m, v):
                return F.batch_norm(part, m, v, self.weight, self.bias, True, momentum, self.eps)
        if rm is None:  # batch statistics only: nothing per rank to keep
            outs = [group(part, None, None) for part in x.split(g)]
        elif self.rank_group > 1:
            # a group of ranks: its statistics go into every one of its ranks' rows. batch_norm updates a
            # copy (autograd holds the tensor it was given, so that one may not change afterwards)
            outs = []
            for i, part in enumerate(x.split(g)):
                rows = slice(r0 + i * self.rank_group, r0 + (i + 1) * self.rank_group)
                m, v = rm[rows.start].clone(), rv[rows.start].clone()
                outs.append(group(part, m, v))
                with torch.no_grad():
                    rm[rows], rv[rows] = m, v
        else:  # group i belongs to rank r0 + i * g // per_rank and updates that rank's running-statistics row
            outs = [group(part, rm[r0 + i * g // per_rank], rv[r0 + i * g // per_rank])
                    for i, part in enumerate(x.split(g))]
        if r0 == 0 and self.num_batches_tracked is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def renorm_limits(self, t: int) -> tuple[float, float]:
        """Batch Renormalization's (r_max, d_max) at step ``t``: plain BatchNorm (1, 0) until the start,
        then linearly to (3, 5) -- Ioffe 2017's limits -- at the full step."""
        start, full = self.renorm
        f = min(1.0, max(0.0, (t - start) / max(1, full - start)))
        return 1.0 + 2.0 * f, 5.0 * f

    def _renormalised(self, x, rm, rv, t: int):
        """Batch Renormalization (Ioffe 2017) of one group: normalised by the group's statistics, then
        corrected by r = sigma_B / sigma and d = (mu_B - mu) / sigma towards the running ones, both clipped
        and held constant in backward. The output is then close to what the running statistics give,
        whatever the group's size, while the gradient still flows through the group's mean and variance.
        Shared by MPI ranks and the simulator's virtual ranks: the same arithmetic on the same group."""
        nd = x.ndim
        var, mean = torch.var_mean(x, dim=(0, *range(2, nd)), correction=0)
        invstd = torch.rsqrt(var + self.eps)
        with torch.no_grad():
            r_max, d_max = self.renorm_limits(t)
            run_invstd = torch.rsqrt(rv + self.eps)
            r = ((var + self.eps) * run_invstd * run_invstd).sqrt().clamp(1.0 / r_max, r_max)
            d = ((mean - rm) * run_invstd).clamp(-d_max, d_max)
        weight = self.weight if self.weight is not None else torch.ones_like(invstd)
        scale = weight * invstd * r
        shift = (self.bias if self.bias is not None else 0.0) + weight * d - mean * scale
        y = x * per_channel(scale, nd) + per_channel(shift, nd)
        with torch.no_grad():
            n = x.numel() // x.shape[1]
            rm.mul_(1 - self.momentum).add_(mean.detach(), alpha=self.momentum)
            rv.mul_(1 - self.momentum).add_(var.detach() * (n / max(n - 1, 1)), alpha=self.momentum)
        return y

    def _vectorised(self, x, rm, rv, r0: int, per_rank: int, g: int):
        """All groups at once: one var_mean over (group, image, H, W) -- a view of x, any memory layout
        -- then one fused scale-and-shift. Mathematically BatchNorm per group; numerically its sums run
        in another order than the native kernel's (the deviation docs/simulator.md states)."""
        groups, k = x.shape[0] // g, per_rank // g  # k groups per rank
        if x.ndim == 4 and x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last):
            # the simulator's layout (channels-last float32): each group is one (images*H*W, C) block
            least = self.context.compiled_from
            if least is not None and x.numel() >= least:
                # views, not the Parameters: torch.compile would guard on each Parameter's identity
                y, mean, var = compiled_grouped_bn()(x, None if self.weight is None else self.weight.view(-1),
                                                     None if self.bias is None else self.bias.view(-1),
                                                     groups, self.eps)
            else:
                y, mean, var = GroupedBN.apply(x, self.weight, self.bias, groups, self.eps)
            mean, var = mean.detach(), var.detach()
        else:
            xg = x.unflatten(0, (groups, g))
            xs = xg if xg.dtype == torch.float32 else xg.float()  # bf16 activations: statistics in fp32
            var, mean = torch.var_mean(xs, dim=(1, *range(3, xg.ndim)), correction=0)  # (groups, C)
            scale = torch.rsqrt(var + self.eps) if self.weight is None else self.weight * torch.rsqrt(var + self.eps)
            shift = -mean * scale if self.bias is None else self.bias - mean * scale
            spread = (slice(None), None, slice(None), *([None] * (x.ndim - 2)))  # (groups, 1, C, 1...)
            y = torch.addcmul(shift[spread].to(x.dtype), xg, scale[spread].to(x.dtype)).flatten(0, 1)
        with torch.no_grad():
            # Each rank's k groups update its running statistics in turn, as k small batches would:
            # r <- (1-m)^k r + sum_j m (1-m)^(k-1-j) stat_j. Variance unbiased, as BatchNorm2d keeps it.
            m, ranks = self.momentum, groups // k
            n = x[:g].numel() // x.shape[1]
            w = m * (1 - m) ** torch.arange(k - 1, -1, -1, dtype=torch.float64)
            w = w.to(device=x.device, dtype=mean.dtype)[None, :, None]
            rows = slice(r0, r0 + ranks)
            rm[rows].mul_((1 - m) ** k).add_((w * mean.detach().view(ranks, k, -1)).sum(1))
            unbiased = var.detach() * (n / max(n - 1, 1))
            rv[rows].mul_((1 - m) ** k).add_((w * unbiased.view(ranks, k, -1)).sum(1))
            if r0 == 0:
                self.num_batches_tracked += 1
        return y


class GroupedBN(torch.autograd.Function):
    """BatchNorm per group of consecutive images of a channels-last (N, C, H, W) float32 batch, every group
    at once: each group is a contiguous (images*H*W, C) block, so its sums are a batched matrix product
    (mean) and a batched dot product over the centred values (variance: two passes, no cancellation), and
    its backward is two such reductions and two fused multiply-adds -- about native BatchNorm's cost on the
    whole batch (one native call per group costs a call per rank). The same mathematics as ``F.batch_norm``
    per group, summed in another order (~1e-6 relative)::

        y, mean, var = GroupedBN.apply(x, weight, bias, groups, eps)   # mean, var: (groups, C), biased
    """

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, eps: float):
        n, c, h, w = x.shape
        xv = x.permute(0, 2, 3, 1).reshape(groups, -1, c)  # a view: channels-last is (N, H, W, C) in memory
        m = xv.shape[1]
        ones = x.new_ones(groups, 1, m)
        mean = torch.bmm(ones, xv).div_(m)  # (groups, 1, C)
        xc = xv - mean
        var = torch.linalg.vecdot(xc, xc, dim=1).div_(m)  # (groups, C)
        invstd = torch.rsqrt(var + eps)
        scale = (invstd if weight is None else invstd * weight)[:, None]
        # written straight into a channels-last tensor: an output that is a view may not be changed in
        # place (the in-place ReLU that follows)
        y = torch.empty_like(x, memory_format=torch.channels_last)
        yv = y.permute(0, 2, 3, 1).view(groups, m, c)
        torch.addcmul(bias, xc, scale, out=yv) if bias is not None else torch.mul(xc, scale, out=yv)
        ctx.save_for_backward(xc, invstd, scale, ones)
        ctx.affine = (weight is not None, bias is not None)
        mean = mean.view(groups, c).clone()
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        xc, invstd, scale, ones = ctx.saved_tensors
        groups, m, c = xc.shape
        n, _, h, w = dy.shape
        dyv = dy.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(groups, m, c)
        sdy = torch.bmm(ones, dyv)[:, 0]  # (groups, C)
        sdxc = torch.linalg.vecdot(dyv, xc, dim=1)
        s = scale[:, 0]
        # dx = scale * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = xc * invstd
        k_xc = (s * invstd * invstd * sdxc).div_(-m)[:, None]
        k_0 = (s * sdy).div_(-m)[:, None]
        dx = torch.empty_like(dy, memory_format=torch.channels_last)
        torch.addcmul(k_0, xc, k_xc, out=dx.permute(0, 2, 3, 1).view(groups, m, c)).addcmul_(dyv, scale)
        dweight = (sdxc * invstd).sum(0) if ctx.affine[0] else None
        dbias = sdy.sum(0) if ctx.affine[1] else None
        return dx, dweight, dbias, None, None


def grouped_bn(x, weight, bias, groups: int, eps: float):
    """``GroupedBN``'s mathematics as plain tensor operations, for ``torch.compile`` to fuse into a pass
    or two over the activations each way (the eager form takes four): a channels-last (N, C, H, W) float32
    batch normalised per group of consecutive images::

        y, mean, var = grouped_bn(x, weight, bias, groups, eps)   # mean, var: (groups, C), biased, detached
    """
    n, c, h, w = x.shape
    xv = x.permute(0, 2, 3, 1).reshape(groups, -1, c)
    var, mean = torch.var_mean(xv, dim=1, correction=0, keepdim=True)
    scale = torch.rsqrt(var + eps) if weight is None else torch.rsqrt(var + eps) * weight
    y = (xv - mean) * scale if bias is None else torch.addcmul(bias, xv - mean, scale)
    return y.reshape(n, h, w, c).permute(0, 3, 1, 2), mean.view(groups, c).detach(), var.view(groups, c).detach()


_COMPILED: list = []


def compiled_grouped_bn():
    """``grouped_bn`` compiled, once per process: static shapes, one kernel per layer shape (a
    dynamic-shape build ran slower end to end), with room for every layer's (dynamo's default stops at 8)."""
    if not _COMPILED:
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config
        # compile in this process: no pool of compiler workers outliving a notebook's kernel or an engine
        # (each layer's kernels are few and small; they are compiled one shape at a time as layers meet them)
        inductor_config.compile_threads = 1
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 1024)
        _COMPILED.append(torch.compile(grouped_bn, dynamic=False))
    return _COMPILED[0]


class RankDropout(nn.Module):
    """A dropout layer (any of torch's: ``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``...) whose
    masks are each virtual rank's own, as an MPI rank draws them.

    One rank per forward (the exact simulator on CPU): the backend has seeded the global RNG with the
    rank's step seed, as an MPI rank does, so the layer runs as it is. Several ranks per forward (bn=sync,
    a GPU, the fast mode): each rank's part is drawn from that rank's own stream, seeded with its step
    seed at its first dropout layer of the step. Either way exact for any number of dropout layers."""

    def __init__(self, inner, context: RankContext):
        super().__init__()
        self.inner = nn.Dropout(inner) if isinstance(inner, float) else inner
        self.context = context

    @property
    def p(self) -> float:
        return self.inner.p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        ctx = self.context
        r0, r1 = ctx.ranks
        if r1 - r0 == 1:
            return self.inner(x)
        # each rank's stream goes on from where its previous dropout layer left it this step, as on an
        # MPI rank that seeded once: exact for any number of dropout layers
        streams = ctx.streams if ctx.streams_step == (ctx.epoch, ctx.step) else {}
        ctx.streams, ctx.streams_step = streams, (ctx.epoch, ctx.step)
        out = []
        for r, part in zip(range(r0, r1), x.chunk(r1 - r0)):
            if r in streams:
                _set_rng(streams[r], part.device)
            else:
                torch.manual_seed(step_seed(ctx.seed, ctx.epoch, ctx.step, r))
            out.append(self.inner(part))
            streams[r] = _get_rng(part.device)
        return torch.cat(out)


def _get_rng(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def replace_modules(module: nn.Module, make) -> None:
    """Every submodule of ``module`` for which ``make(child)`` returns a module replaced by it, in place;
    the others searched further down::

        replace_modules(model, lambda m: GhostBatchNorm2d(...) if isinstance(m, nn.BatchNorm2d) else None)
    """
    for name, child in module.named_children():
        new = make(child)
        if new is not None:
            setattr(module, name, new)
        else:
            replace_modules(child, make)


def use_ghost_batchnorm(model: nn.Module, ranks: int, ghost_batch: int = 0, context=None,
                        rank_group: int = 1) -> nn.Module:
    """Replace every BatchNorm (1d, 2d, 3d; torch's SyncBatchNorm too) with a GhostBatchNorm2d (in place);
    returns the model. ``rank_group`` > 1: statistics over that many consecutive virtual ranks' images
    (SyncBatchNorm in groups)."""
    replace_modules(model, lambda m: GhostBatchNorm2d(m, ranks, ghost_batch, context, rank_group)
             if isinstance(m, _BatchNorm) else None)
    return model


def use_batch_renorm(model: nn.Module, start: int, full: int) -> nn.Module:
    """Batch Renormalization in every GhostBatchNorm2d (in place): plain BatchNorm for the first ``start``
    steps (its running statistics settle), the corrections' limits widened to Ioffe's (3, 5) by ``full``.
    Raises ValueError for a BatchNorm without running statistics (renormalisation corrects towards them)."""
    for name, m in model.named_modules():
        if isinstance(m, GhostBatchNorm2d):
            if m.running_mean is None:
                raise ValueError(f"bn=renorm corrects towards running statistics, but {name} keeps none "
                                 "(track_running_stats=False); use bn=local, or let it track them")
            m.renorm = (int(start), int(full))
    return model


def use_rank_dropout(model: nn.Module, context: RankContext) -> nn.Module:
    """Wrap every dropout layer in a RankDropout drawing per virtual rank (in place)."""
    replace_modules(model, lambda m: RankDropout(m, context) if isinstance(m, _DropoutNd) else None)
    return model


def sync_virtual_buffers_(model: nn.Module, policy: str) -> None:
    """The buffer policy across virtual ranks: rank 0's rows (broadcast) or their mean (average)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GhostBatchNorm2d) and m.ranks > 1 and m.running_mean is not None:
                for buf in m._rows():
                    src = buf[0].clone() if policy == "broadcast" else buf.sum(0) / m.ranks
                    buf.copy_(src.expand_as(buf))


def virtual_state(model: nn.Module, rank: int = 0) -> dict:
    """Parameters and buffers as virtual rank ``rank`` holds them, keyed like a plain model's."""
    out = {}
    for name, t in model.state_dict().items():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if isinstance(mod, GhostBatchNorm2d) and leaf in ("running_mean", "running_var") and mod.ranks > 1:
            t = t[rank]
        out[name] = t.detach().cpu().clone()
    return out
