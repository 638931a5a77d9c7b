"""BatchNorm scales fixed at 1 and not trained (``Config.freeze_bn_scale``), as airbench's CIFAR-10 scripts
keep theirs: each BatchNorm then normalises and shifts, and the next layer's weights carry the scale. With
few steps the shifts can then take a far larger learning rate than the weights (airbench: 64x,
``Config.bn_lr_scale``) without a scale to blow up::

    n = freeze_bn_scale(model)    # every affine BatchNorm's weight: 1, requires_grad False
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


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
