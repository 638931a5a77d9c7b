"""SyncBatchNorm over MPI ranks on CPU (``bn="sync"``): batch statistics over all ranks, or over groups of
consecutive ranks (``bn_group``). torch's and Horovod's SyncBatchNorm need CUDA/NCCL; this one needs only
mpi4py::

    model = convert_sync_batchnorm(build_model("mobilenetv2_cifar"), comm)        # MPI ranks
    convert_sync_batchnorm(build_model("mobilenetv2_cifar"), comm, group=2)       # ... per pair of ranks
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .comm import allreduce_

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast over an (N, C, ...) input of ``ndim`` dimensions."""
    return t.view(1, -1, *([1] * (ndim - 2)))


class _SyncBNFunction(torch.autograd.Function):
    """Batch statistics over all ranks: one Allreduce of [sum, sum of squares, count] forward and one
    of [sum dy, sum dy*xhat] backward, so the result equals BatchNorm on the concatenated batch. Any
    BatchNorm's input, (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W); ``weight``/``bias`` None
    without affine parameters."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, eps):
        c, nd = x.shape[1], x.ndim
        dims = [0, *range(2, nd)]
        local = torch.cat([x.sum(dims), (x * x).sum(dims),
                           torch.tensor([x.numel() / c], dtype=x.dtype)]).double()
        allreduce_(local, comm)
        count = local[-1]
        mean = (local[:c] / count)
        var = (local[c:2 * c] / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        mean_f, invstd_f = mean.to(x.dtype), invstd.to(x.dtype)
        xhat = (x - per_channel(mean_f, nd)) * per_channel(invstd_f, nd)
        y = xhat if weight is None else xhat * per_channel(weight, nd) + per_channel(bias, nd)
        ctx.save_for_backward(xhat, invstd_f if weight is None else weight, invstd_f)
        ctx.affine = weight is not None
        ctx.comm = comm
        ctx.count = float(count)
        return y, mean.to(x.dtype), var.to(x.dtype), count

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dcount):
        xhat, weight, invstd = ctx.saved_tensors
        nd = xhat.ndim
        dims = [0, *range(2, nd)]
        c = xhat.shape[1]
        sums = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)]).double()
        dbias_local, dweight_local = sums[:c].to(dy.dtype).clone(), sums[c:].to(dy.dtype).clone()
        allreduce_(sums, ctx.comm)
        n = ctx.count
        sum_dy, sum_dy_xhat = sums[:c].to(dy.dtype), sums[c:].to(dy.dtype)
        scale = weight * invstd if ctx.affine else invstd
        dx = per_channel(scale, nd) * (
            dy - per_channel(sum_dy, nd) / n - xhat * per_channel(sum_dy_xhat / n, nd))
        if not ctx.affine:
            return dx, None, None, None, None
        # Parameter gradients stay local: GradSync averages them like any other gradient.
        return dx, dweight_local, dbias_local, None, None


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm (any of 1d/2d/3d) whose batch statistics span all ranks of ``comm`` — on CPU, over MPI.

    torch's and Horovod's SyncBatchNorm need CUDA/NCCL; this one needs only mpi4py.
    Build it with ``convert_sync_batchnorm(model, comm)``.
    """

    def __init__(self, num_features, comm=None, **kwargs):
        super().__init__(num_features, **kwargs)
        self.comm = comm  # convert_sync_batchnorm passes a Dup: apart from the gradient Iallreduces

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        if not self.training or self.comm is None or self.comm.Get_size() == 1:
            return super().forward(x)
        y, mean, var, count = _SyncBNFunction.apply(x, self.weight, self.bias, self.comm, self.eps)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (count / max(count - 1, 1))
                self.running_mean.mul_(1 - m).add_(mean * m)
                self.running_var.mul_(1 - m).add_(unbiased.to(var.dtype) * m)
        return y


def convert_sync_batchnorm(model: nn.Module, comm, group: int = 0) -> nn.Module:
    """Replace every BatchNorm (1d, 2d, 3d) with a SyncBatchNorm on a duplicate of ``comm`` (in place); ``group`` > 0:
    statistics over groups of that many consecutive ranks (``comm.Split``; it must divide the size)."""
    bn_comm = None
    if comm is not None:
        size, rank = comm.Get_size(), comm.Get_rank()
        # consecutive ranks share a node under mpiexec's block placement, so a group of the ranks per
        # node exchanges through shared memory only
        bn_comm = comm.Split(rank // group, rank) if 0 < group < size else comm.Dup()

    def convert(module):
        for name, child in module.named_children():
            if isinstance(child, _BatchNorm) and not isinstance(child, SyncBatchNorm):
                sync = SyncBatchNorm(child.num_features, bn_comm, eps=child.eps,
                                     momentum=child.momentum, affine=child.affine,
                                     track_running_stats=child.track_running_stats)
                sync.load_state_dict(child.state_dict())
                setattr(module, name, sync)
            else:
                convert(child)

    convert(model)
    return model
