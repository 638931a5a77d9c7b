"""MobileNetV2 with torchvision's module tree (``mobilenetv2``), and its CIFAR variant with two strides of 1
(``mobilenetv2_cifar``): registered in ``pilab.models.zoo``; the layouts are pinned by tests/test_models.py.

    from pilab.models.mobilenet import MobileNetV2
    model = MobileNetV2(num_classes=10, width=0.5, cifar=True)
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

# t (expansion), c (output channels), n (blocks), s (stride of the first block), as in the paper.
MOBILENETV2_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)

def make_divisible(v: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    """Round a channel count to a multiple of ``divisor`` without losing more than 10% (torchvision's rule)."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class _ReLU6Inplace(torch.autograd.Function):
    """ReLU6 in place whose backward reads its own output: autograd's in-place hardtanh_ keeps a copy
    of its input for the backward (one activation per ConvBNReLU6, ~30% of a step's saved tensors).
    The output is in (0, 6) exactly where the input is, so passing it to the same backward kernel
    gives bitwise the same gradients."""

    @staticmethod
    def forward(ctx, x):
        out = torch.nn.functional.hardtanh_(x, 0.0, 6.0)
        ctx.mark_dirty(out)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return torch.ops.aten.hardtanh_backward(grad, out, 0.0, 6.0)


class ReLU6(nn.ReLU6):
    """``nn.ReLU6(inplace=True)`` that saves no copy for the backward (see ``_ReLU6Inplace``); the
    same numbers forward and backward. Out of place where autograd is off or the input is a leaf."""

    def __init__(self):
        super().__init__(inplace=True)

    def forward(self, x):
        if torch.is_grad_enabled() and x.requires_grad and x.grad_fn is not None:
            return _ReLU6Inplace.apply(x)
        return super().forward(x)


class ConvBNReLU6(nn.Sequential):
    """Conv (no bias) + BatchNorm + ReLU6; children 0, 1, 2 give torchvision's key names."""

    def __init__(self, inp: int, oup: int, kernel_size: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(inp, oup, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(oup),
            ReLU6(),
        )


class InvertedResidual(nn.Module):
    """Expand 1x1 -> depthwise 3x3 -> linear project 1x1, with identity shortcut when shapes allow."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.stride = stride
        self.use_res_connect = stride == 1 and inp == oup
        layers: List[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(inp, hidden, kernel_size=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 with torchvision's module tree (``features.0`` .. ``features.18``, ``classifier.1``).

    ``cifar=True`` changes only two strides (stem and the first block of the 24-channel stage, 2 -> 1);
    keys, shapes and parameter count are unchanged. Overall stride is 8 instead of 32.
    """

    def __init__(self, num_classes: int = 1000, width: float = 1.0, cifar: bool = False,
                 dropout: float = 0.2, in_channels: int = 3):
        super().__init__()
        input_channel = make_divisible(32 * width)
        self.last_channel = make_divisible(1280 * max(1.0, width))
        self.cifar = cifar
        features: List[nn.Module] = [ConvBNReLU6(in_channels, input_channel, stride=1 if cifar else 2)]
        for stage, (t, c, n, s) in enumerate(MOBILENETV2_SETTING):
            if cifar and stage == 1:
                s = 1
            output_channel = make_divisible(c * width)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(ConvBNReLU6(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(self.last_channel, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        return self.classifier(torch.flatten(x, 1))
