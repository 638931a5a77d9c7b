"""The CNNs pilab trains, by registry name, plus parameter and FLOP counts for the performance model.

    from pilab.models import build_model, count_parameters, train_flops_per_image
    model = build_model("mobilenetv2_cifar", num_classes=10, width=0.5)
    logits = model(images.to(memory_format=torch.channels_last))   # (N, 3, 32, 32) -> (N, 10)
    count_parameters(build_model("mobilenetv2"))                     # 2_236_682
    train_flops_per_image("mobilenetv2_cifar")                       # FLOPs for one image, fwd + bwd
    activation_elements("mobilenetv2_cifar")                         # elements its layers write

Names (``MODEL_NAMES``):

* ``mobilenetv2`` -- torchvision's ``mobilenet_v2`` layout: same ``state_dict`` keys, shapes, channel
  rounding and initialisation, so checkpoints interchange with torchvision. Made for 224x224: a 32x32
  input ends at 1x1 before pooling.
* ``mobilenetv2_cifar`` -- the same module tree and keys (so the same parameters), with stride 1 in the
  stem and in the second stage, so a 32x32 input ends at 4x4 before pooling.
* ``squeezenet1_1`` -- torchvision's ``squeezenet1_1`` with a stride-1 stem so 32x32 inputs survive.

torchvision is not imported: the layouts are written out here and pinned by tests/test_models.py.
Initialisation draws from torch's global RNG; every rank gets rank 0's weights by broadcast anyway.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

# t (expansion), c (output channels), n (blocks), s (stride of the first block), as in the paper.
_MOBILENETV2_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
WIDTH_RANGE = (0.25, 1.4)  # MobileNetV2 width multipliers accepted (inclusive)

_REGISTRY: Dict[str, Callable[[int, float], nn.Module]] = {}


def _register(name: str):
    def deco(fn):
        _REGISTRY[name] = fn
        return fn
    return deco


# ----------------------------------------------------------------------------------------------
# MobileNetV2
# ----------------------------------------------------------------------------------------------
def _make_divisible(v: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    """Round a channel count to a multiple of ``divisor`` without losing more than 10% (torchvision's rule)."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNReLU6(nn.Sequential):
    """Conv (no bias) + BatchNorm + ReLU6; children 0, 1, 2 give torchvision's key names."""

    def __init__(self, inp: int, oup: int, kernel_size: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(inp, oup, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(oup),
            nn.ReLU6(inplace=True),
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
                 dropout: float = 0.2):
        super().__init__()
        input_channel = _make_divisible(32 * width)
        self.last_channel = _make_divisible(1280 * max(1.0, width))
        self.cifar = cifar
        features: List[nn.Module] = [ConvBNReLU6(3, input_channel, stride=1 if cifar else 2)]
        for stage, (t, c, n, s) in enumerate(_MOBILENETV2_SETTING):
            if cifar and stage == 1:
                s = 1
            output_channel = _make_divisible(c * width)
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


@_register("mobilenetv2_cifar")
def _mobilenetv2_cifar(num_classes: int, width: float) -> nn.Module:
    return MobileNetV2(num_classes, width, cifar=True)


@_register("mobilenetv2")
def _mobilenetv2(num_classes: int, width: float) -> nn.Module:
    return MobileNetV2(num_classes, width, cifar=False)


# ----------------------------------------------------------------------------------------------
# SqueezeNet 1.1
# ----------------------------------------------------------------------------------------------
class Fire(nn.Module):
    """Squeeze 1x1, then expand with 1x1 and 3x3 in parallel, concatenated on channels."""

    def __init__(self, inplanes: int, squeeze: int, expand1x1: int, expand3x3: int):
        super().__init__()
        self.squeeze = nn.Conv2d(inplanes, squeeze, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)


class SqueezeNet11(nn.Module):
    """SqueezeNet 1.1 as in torchvision, adapted to 32x32 inputs.

    The one difference from torchvision's ``squeezenet1_1``: the stem conv ``features.0`` is 3x3
    **stride 1, padding 1** (torchvision: stride 2, padding 0). Its weight shape is unchanged
    (64, 3, 3, 3), so keys, shapes and parameter count (1,235,496 at 1000 classes) match torchvision.
    The three 3x3/2 ceil-mode max-pools are kept, so a 32x32 input goes 32 -> 16 -> 8 -> 4 before
    the classifier (Dropout 0.5, 1x1 conv to classes, ReLU, global average pool), as torchvision has
    it -- including the ReLU on the logits. Initialisation as torchvision: kaiming_uniform for convs,
    normal(0, 0.01) for the final conv, zero biases.
    """

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1),  # torchvision: stride 2, no padding
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(64, 16, 64, 64),
            Fire(128, 16, 64, 64),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(128, 32, 128, 128),
            Fire(256, 32, 128, 128),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(256, 48, 192, 192),
            Fire(384, 48, 192, 192),
            Fire(384, 64, 256, 256),
            Fire(512, 64, 256, 256),
        )
        final_conv = nn.Conv2d(512, num_classes, kernel_size=1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), final_conv, nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1)))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if m is final_conv:
                    nn.init.normal_(m.weight, mean=0.0, std=0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.classifier(self.features(x)), 1)


@_register("squeezenet1_1")
def _squeezenet1_1(num_classes: int, width: float) -> nn.Module:
    return SqueezeNet11(num_classes)


MODEL_NAMES = tuple(_REGISTRY)  # ("mobilenetv2_cifar", "mobilenetv2", "squeezenet1_1")


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def check_width(name: str, width: float) -> None:
    """Raise ValueError (one line: the problem and the fix) unless ``width`` suits model ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"model={name!r} is unknown; choose one of {', '.join(MODEL_NAMES)}")
    if isinstance(width, bool) or not isinstance(width, (int, float)):
        raise ValueError(f"width={width!r} is not a number; give a float such as 1.0")
    if name.startswith("mobilenetv2"):
        lo, hi = WIDTH_RANGE
        if not (lo <= width <= hi):  # also refuses NaN
            raise ValueError(f"width={width} is out of range; MobileNetV2 takes {lo}..{hi}")
    elif width != 1.0:
        raise ValueError(f"{name} has no width multiplier; use width=1.0")


def build_model(name: str, num_classes: int = 10, width: float = 1.0) -> nn.Module:
    """A freshly initialised model (train mode, CPU, contiguous weights).

        model = build_model("mobilenetv2_cifar", num_classes=10, width=0.5)
        model = build_model("squeezenet1_1").to(memory_format=torch.channels_last)
        logits = model(x)                  # x: float (N, 3, 32, 32), any memory format -> (N, 10)

    Seed torch (``torch.manual_seed``) first for reproducible weights.
    """
    check_width(name, width)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} must be a positive int")
    return _REGISTRY[name](num_classes, float(width))


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once; buffers not counted)."""
    return sum(p.numel() for p in model.parameters())


def _hooked_forward(model: nn.Module, hooks, image_size: int) -> None:
    """One eval-mode forward of a single zero image with ``hooks`` ((module, fn) pairs) attached;
    the hooks are removed and the model's train/eval mode restored afterwards."""
    param = next(model.parameters())
    x = torch.zeros(1, 3, image_size, image_size, device=param.device, dtype=param.dtype)
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


def forward_macs(model: nn.Module, image_size: int = 32) -> int:
    """Multiply-accumulates of the conv and linear layers for one image in a forward pass.

    Counts weights x output positions (grouped convs by their group width); ignores biases, BN,
    activations, pooling and the residual adds, which are a few percent for these networks.
    """
    total = 0

    def conv_hook(m: nn.Conv2d, inp, out):
        nonlocal total
        k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
        total += out[0].numel() * k  # out[0]: one image of the batch

    def linear_hook(m: nn.Linear, inp, out):
        nonlocal total
        total += out[0].numel() * m.in_features

    _hooked_forward(model, [(m, conv_hook if isinstance(m, nn.Conv2d) else linear_hook)
                            for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))],
                    image_size)
    return total


@functools.lru_cache(maxsize=None)
def activation_elements(name: str, width: float = 1.0, num_classes: int = 10,
                        image_size: int = 32) -> int:
    """Elements written by every leaf layer (conv, BN, ReLU6, pooling, linear) for one image.

        activation_elements("mobilenetv2_cifar", width=0.5)   # used by pilab.perfmodel

    On a CPU the training step of these small-image networks is bound by memory traffic more than
    by FLOPs: per-image time tracks this count (x1.75 from width 0.25 to 0.5) better than the FLOPs
    (x2.95). Built on the meta device, like ``train_flops_per_image``.
    """
    with torch.device("meta"):
        model = build_model(name, num_classes=num_classes, width=width)
    total = 0

    def hook(m, inp, out):
        nonlocal total
        total += out[0].numel()

    _hooked_forward(model, [(m, hook) for m in model.modules() if next(m.children(), None) is None],
                    image_size)
    return total


@functools.lru_cache(maxsize=None)
def train_flops_per_image(name: str, width: float = 1.0, num_classes: int = 10,
                          image_size: int = 32) -> float:
    """Training FLOPs per image: 2 FLOPs per MAC, and forward + backward ~= 3x the forward.

        train_flops_per_image("mobilenetv2_cifar", width=0.5)   # used by pilab.perfmodel

    The model is built on the meta device: no memory, no compute, and the global RNG is untouched,
    so calling this on some ranks only cannot make their weights diverge.
    """
    with torch.device("meta"):
        model = build_model(name, num_classes=num_classes, width=width)
    return 3.0 * 2.0 * forward_macs(model, image_size)
