"""How a network starts (as ``torch.nn.init`` for pilab's settings); each function changes a built model
in place and says how many layers it changed.

Residual blocks started as the identity: the last BatchNorm scale of every block with a shortcut set to
0, so at the first step each block passes its input through and the network is as shallow as its stem and
head (Goyal et al. 2017, "Accurate, large minibatch SGD", section 5.1: it eases the first steps at a large
learning rate, which a large global batch needs). ``Config.zero_init_residual``::

    n = zero_residual_bn(build_model("mobilenetv2_cifar"))   # 10: MobileNetV2's blocks with a shortcut

The first convolution started as a whitening of the training images: its filters are the principal
directions of the image patches it sees, each scaled to unit variance, in +/- pairs so that the ReLU after
it keeps both signs. The fast CIFAR-10 training scripts (Keller Jordan's airbench, after Page's) start
their first layer this way: from the first step the net sees decorrelated inputs of even scale, which a
short run at a large learning rate needs most. ``Config.whiten_stem``::

    rows = sample_rows(len(ds.x_train), seed=0)              # 5,000 training images, drawn by the seed
    images = pilab.data.to_input(torch.from_numpy(ds.x_train[rows]), ds.mean, ds.std)  # as training sees them
    whiten_stem(build_model("mobilenetv2_cifar", width=0.25), images)   # 8: its 3x3 stem's 8 filters

Only the starting point changes: the filters train as any others. The sample is chosen by the seed, not
by the rank, and MPI ranks start from rank 0's weights anyway, so every rank (and the simulator) starts
from the same filters.

Convolutions started as the identity where their shapes allow (``Config.dirac_init``), as airbench's
CIFAR-10 scripts start theirs: a dense convolution with at least as many output as input channels gets
``torch.nn.init.dirac_`` on its first in-channels filters (output channel i passes input channel i
through, the kernel's centre 1), the other filters keep their random start; at the first step each
such layer passes its input on, however deep the network. Depthwise convolutions (a 3x3 identity filter
per channel would start every block without its spatial filter) and narrowing ones (no identity fits)
keep their random start::

    n = dirac_convs(build_model("mobilenetv2_cifar", width=0.25))   # MobileNetV2: the stem, every
                                                                    # expanding 1x1 and the last 1x1

BatchNorm scales fixed at 1 and not trained (``Config.freeze_bn_scale``), as airbench's CIFAR-10 scripts
keep theirs: each BatchNorm then normalises and shifts, and the next layer's weights carry the scale. With
few steps the shifts can then take a far larger learning rate than the weights (airbench: 64x,
``Config.bn_lr_scale``) without a scale to blow up::

    n = freeze_bn_scale(model)    # every affine BatchNorm's weight: 1, requires_grad False
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def residual_bns(model: nn.Module) -> list[_BatchNorm]:
    """The last BatchNorm of each residual block pilab knows: MobileNetV2's inverted residuals with a
    shortcut (``use_res_connect``), torchvision-style ResNet blocks (``bn3`` of a Bottleneck, ``bn2`` of a
    BasicBlock: any module with a ``downsample`` attribute and those names, so a copy of them counts too)."""
    out = []
    for m in model.modules():
        if getattr(m, "use_res_connect", False) and isinstance(getattr(m, "conv", None), nn.Sequential):
            last = m.conv[-1]
            if isinstance(last, _BatchNorm):
                out.append(last)
        elif hasattr(m, "downsample"):
            for name in ("bn3", "bn2"):
                bn = getattr(m, name, None)
                if isinstance(bn, _BatchNorm):
                    out.append(bn)
                    break
    return out


def zero_residual_bn(model: nn.Module, name: str = "") -> int:
    """Set the scale of each residual block's last BatchNorm to 0 (in place); the number of blocks.
    ValueError (one line, with the fix) where the model has none."""
    bns = [bn for bn in residual_bns(model) if bn.weight is not None]
    if not bns:
        raise ValueError(f"zero_init_residual: model {name or type(model).__name__} has no residual block pilab "
                         "knows (MobileNetV2's, torchvision's BasicBlock/Bottleneck); drop the setting, or zero "
                         "the last BatchNorm of your blocks in your builder")
    for bn in bns:
        nn.init.zeros_(bn.weight)
    return len(bns)


SAMPLE = 5000  # training images whose patches estimate the covariance (all of them if fewer)
EPS = 5e-4  # added to each eigenvalue before the scaling: a direction of almost no variance is not blown up
_CHUNK = 250  # images unfolded at once: 250 x 900 patches x 27 values stay a few tens of MB


def stem(model: nn.Module, channels: int = 3) -> nn.Conv2d:
    """The model's first convolution over the images (the first ``nn.Conv2d`` registered with ``channels``
    input channels and one group). ValueError (one line, with the fix) where there is none."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.in_channels == channels and m.groups == 1:
            return m
    raise ValueError(f"whiten_stem: {type(model).__name__} has no convolution over {channels}-channel images "
                     f"(an nn.Conv2d with in_channels={channels}, groups=1); drop the setting")


def sample_rows(n: int, seed: int = 0, sample: int = SAMPLE) -> np.ndarray:
    """Which of ``n`` training images the whitening is estimated on: ``sample`` of them (all if fewer),
    drawn by ``seed`` alone, so every rank and the simulator draw the same, in index order."""
    return np.sort(np.random.default_rng([int(seed), 0x57]).choice(n, min(n, sample), replace=False))


@torch.no_grad()
def patch_covariance(conv: nn.Conv2d, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, covariance) in float64 of the patches ``conv`` sees (its kernel, stride and dilation, no
    padding) in ``images`` (float, N x C x H x W, normalised as training does)."""
    total, sums, outer = 0, None, None
    for i in range(0, len(images), _CHUNK):
        p = F.unfold(images[i:i + _CHUNK].contiguous(), conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
        p = p.transpose(1, 2).reshape(-1, p.shape[1]).to(torch.float64)  # (patches, C*kh*kw)
        sums = p.sum(0) if sums is None else sums + p.sum(0)
        outer = p.T @ p if outer is None else outer + p.T @ p
        total += len(p)
    mean = sums / total
    return mean, outer / total - torch.outer(mean, mean)


@torch.no_grad()
def whiten_stem(model: nn.Module, images: torch.Tensor) -> int:
    """Set the stem's filters (in place) to the whitening of the patches of ``images`` (a sample of the
    training images, normalised as training does: :func:`sample_rows`): filter 2i is the
    i-th principal direction divided by the square root of its variance, filter 2i+1 its negative, largest
    variance first; a stem with more filters than twice the patch's size keeps the rest as initialised. Its
    bias, if any, makes each filter's output zero-mean. Returns the number of filters set."""
    conv = stem(model, images.shape[1])
    mean, cov = patch_covariance(conv, images)
    values, vectors = torch.linalg.eigh(cov)  # ascending
    order = torch.argsort(values, descending=True)
    w = (vectors[:, order] / torch.sqrt(values[order].clamp(min=0) + EPS)).T  # (D, D), one filter a row
    w = torch.stack([w, -w], 1).reshape(-1, w.shape[1])  # +/- pairs
    k = min(conv.out_channels, len(w))
    conv.weight[:k] = w[:k].reshape(k, *conv.weight.shape[1:]).to(conv.weight.dtype)
    if conv.bias is not None:
        conv.bias[:k] = (-(w[:k] @ mean)).to(conv.bias.dtype)
    return k


def dirac_convs(model: nn.Module) -> int:
    """Start each dense, non-narrowing convolution of ``model`` (odd kernel) as the identity on its first
    in-channels filters, in place; how many it changed."""
    n = 0
    with torch.no_grad():
        for m in model.modules():
            if (isinstance(m, nn.Conv2d) and m.groups == 1 and m.out_channels >= m.in_channels
                    and all(k % 2 for k in m.kernel_size)):
                nn.init.dirac_(m.weight[:m.in_channels])
                n += 1
    return n


def freeze_bn_scale(model: nn.Module) -> int:
    """Set every affine BatchNorm's scale to 1 and leave it out of training (``requires_grad`` False: no
    gradient, no exchange, no optimizer state), in place; how many. Per-rank copies of the layer that the
    simulator makes keep the flag (``pilab.engine.layers``)."""
    n = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.weight is not None:
                m.weight.fill_(1.0)
                m.weight.requires_grad_(False)
                n += 1
    return n
