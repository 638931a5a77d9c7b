"""Convolutions started as the identity where their shapes allow (``Config.dirac_init``), as airbench's
CIFAR-10 scripts start theirs: a dense convolution with at least as many output as input channels gets
``torch.nn.init.dirac_`` on its first in-channels filters (output channel i passes input channel i
through, the kernel's centre 1), the other filters keep their random start; at the first step each
such layer passes its input on, however deep the network. Depthwise convolutions (a 3x3 identity filter
per channel would start every block without its spatial filter) and narrowing ones (no identity fits)
keep their random start::

    n = dirac_convs(build_model("mobilenetv2_cifar", width=0.25))   # MobileNetV2: the stem, every
                                                                    # expanding 1x1 and the last 1x1
"""
from __future__ import annotations

import torch
from torch import nn


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
