"""Residual blocks started as the identity: the last BatchNorm scale of every block with a shortcut set to
0, so at the first step each block passes its input through and the network is as shallow as its stem and
head (Goyal et al. 2017, "Accurate, large minibatch SGD", section 5.1: it eases the first steps at a large
learning rate, which a large global batch needs). ``Config.zero_init_residual``::

    n = zero_residual_bn(build_model("mobilenetv2_cifar"))   # 10: MobileNetV2's blocks with a shortcut
"""
from __future__ import annotations

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
