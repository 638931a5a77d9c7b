"""The CNNs pilab trains, by registry name, plus parameter and FLOP counts for the performance model.

    from pilab.models.zoo import build_model, count_parameters, train_flops_per_image
    model = build_model("mobilenetv2_cifar", num_classes=10, width=0.5)
    logits = model(images.to(memory_format=torch.channels_last))   # (N, 3, 32, 32) -> (N, 10)
    count_parameters(build_model("mobilenetv2"))                     # 2_236_682
    train_flops_per_image("mobilenetv2_cifar")                       # FLOPs for one image, fwd + bwd
    activation_elements("mobilenetv2_cifar")                         # elements its layers write
    synaptic_ops(build_model("spiking_cnn"), images)                 # SynOps, firing rates (spiking)

Names (``MODEL_NAMES``):

* ``mobilenetv2`` -- torchvision's ``mobilenet_v2`` layout: same ``state_dict`` keys, shapes, channel
  rounding and initialisation, so checkpoints interchange with torchvision. Made for 224x224: a 32x32
  input ends at 1x1 before pooling.
* ``mobilenetv2_cifar`` -- the same module tree and keys (so the same parameters), with stride 1 in the
  stem and in the second stage, so a 32x32 input ends at 4x4 before pooling.
* ``squeezenet1_1`` -- torchvision's ``squeezenet1_1`` with a stride-1 stem so 32x32 inputs survive.
* ``spiking_cnn`` -- a small spiking CNN (leaky integrate-and-fire neurons, surrogate gradient, direct
  input encoding, ``timesteps`` steps per image, BatchNorm through time); needs snntorch, the optional
  extra ``pip install 'pilab[snn]'``, imported only when it is built. ``synaptic_ops(model, x)``
  measures its firing rates and spike-driven operations.

torchvision is not imported: the layouts are written out here and pinned by tests/test_models.py.
Initialisation draws from torch's global RNG; every rank gets rank 0's weights by broadcast anyway.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import custom
from .names import is_builder_spec
from .names import (MODEL_NAMES, SNN_INSTALL_HINT, SPIKING_MODELS, SPIKING_WIDTH_RANGE,  # noqa: F401
                          WIDTH_RANGE, check_width)

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

_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}
_TAKES_TIMESTEPS: set = set()  # spiking models: their builders also take ``timesteps``


def _register(name: str, timesteps: bool = False):
    def deco(fn):
        _REGISTRY[name] = fn
        if timesteps:
            _TAKES_TIMESTEPS.add(name)
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


# ----------------------------------------------------------------------------------------------
# Spiking CNN (leaky integrate-and-fire neurons from snntorch, the optional extra pilab[snn])
# ----------------------------------------------------------------------------------------------
DEFAULT_TIMESTEPS = 4  # time steps a spiking model runs per image unless told otherwise


def _snntorch():
    """snntorch and its surrogate module, imported only when a spiking model is built."""
    try:
        import snntorch
        from snntorch import surrogate
    except ImportError:
        raise ImportError(f"spiking_cnn needs snntorch, which is not installed: {SNN_INSTALL_HINT}") from None
    return snntorch, surrogate


def _fold_time_into_height(x: torch.Tensor, t: int) -> torch.Tensor:
    """(B*T, C, H, W), image-major -> (B, C, T*H, W): a BatchNorm2d on it normalises each channel over
    batch, time and space (tdBN) while dim 0 stays one row per image, so a rank's images stay its own.
    A view when ``x`` is channels_last (what the engine feeds), a copy otherwise."""
    bt, c, h, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(bt // t, t * h, w, c).permute(0, 3, 1, 2)


def _unfold_time(x: torch.Tensor, t: int) -> torch.Tensor:
    """(B, C, T*H, W) -> (B, T, C, H, W), the inverse of ``_fold_time_into_height``."""
    b, c, th, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(b, t, th // t, w, c).permute(0, 1, 4, 2, 3)


class LIFLayer(nn.Module):
    """One snntorch ``Leaky`` neuron layer run over ``T`` steps of input current (B, T, C, H, W).

    U[t] = beta * U[t-1] + I[t] - theta * S[t-1];  S[t] = H(U[t] - theta), with theta = 1 and an
    arctan surrogate gradient (snntorch's default, Fang et al. 2021) standing in for dH/dU in
    backprop through time. The membrane starts at zero on every call: state never carries from one
    batch to the next.
    """

    def __init__(self, beta: float):
        super().__init__()
        snn, surrogate = _snntorch()
        device = torch.empty(0).device  # where the model is being built (the default device's context)
        with torch.device("cpu"):  # Leaky's constructor reads a buffer back (.item()): not on meta
            self.neuron = snn.Leaky(beta=beta, threshold=1.0, spike_grad=surrogate.atan(),
                                    reset_mechanism="subtract")
        self.neuron.to(device)
        # snntorch lists every neuron ever built (for its init_hidden=True helpers, unused here: the
        # state is passed explicitly); leaving ours there would keep discarded models alive.
        instances = getattr(snn.SpikingNeuron, "instances", [])
        if self.neuron in instances:
            instances.remove(self.neuron)

    def forward(self, current: torch.Tensor) -> torch.Tensor:
        mem = torch.zeros_like(current[:, 0])  # reset per batch
        spikes = []
        for t in range(current.shape[1]):
            spk, mem = self.neuron(current[:, t], mem)
            spikes.append(spk)
        # Drop the state snntorch keeps on the module: it is not ours to carry, and a tensor with a
        # graph there would make the model impossible to deepcopy.
        self.neuron.mem = self.neuron.reset = current.new_zeros(0)
        # Stacked as (B, T, H, W, C) in memory, so the (B*T, C, H, W) the next conv sees is a
        # channels_last view: elementwise ops and convs on mixed layouts are 10-30x slower on a CPU.
        return torch.stack([s.permute(0, 2, 3, 1) for s in spikes], 1).permute(0, 1, 4, 2, 3)


class SpikingConv(nn.Module):
    """Conv 3x3 (no bias) -> BatchNorm through time (tdBN) -> LIF, on image-major (B*T, C, H, W)."""

    def __init__(self, inp: int, oup: int, timesteps: int, beta: float):
        super().__init__()
        self.timesteps = timesteps
        self.conv = nn.Conv2d(inp, oup, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(oup)
        self.lif = LIFLayer(beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.timesteps
        cur = _unfold_time(self.bn(_fold_time_into_height(self.conv(x), t)), t)
        return self.lif(cur).flatten(0, 1)  # spikes, (B*T, C, H, W)


class SpikingEncoder(SpikingConv):
    """Direct (analog) input encoding: the first conv + BN see the image once, and its current drives
    the first LIF layer at every step (the input is static, so T copies would normalise the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cur = self.bn(self.conv(x))
        return self.lif(cur.unsqueeze(1).expand(-1, self.timesteps, -1, -1, -1)).flatten(0, 1)


class SpikingCNN(nn.Module):
    """A small VGG-style spiking CNN for 32x32 images, trained with backprop through time.

    encoder conv(3->c) @32 -> maxpool -> conv(c->2c) @16 -> maxpool -> conv(2c->4c) @8 ->
    conv(4c->4c) @8 -> maxpool -> global average of the spikes over space and time -> linear.
    c = 32 x width (rounded to a multiple of 8). Every conv but the encoder sees binary spikes
    (max-pooling spikes keeps them binary), so its work is spike-driven accumulates (``synaptic_ops``).
    The logits are the time-averaged readout of the last layer's firing rates.

    BatchNorm is tdBN (Zheng et al., AAAI 2021): statistics per channel over batch, T and space,
    shared by all steps, one running-statistics update per batch. The time axis is folded into the
    height of a BatchNorm2d's input, so dim 0 is still one image per row: ghost/virtual-rank BN
    (``layers.GhostBatchNorm2d`` splits dim 0 by rank) and ``SyncBatchNorm`` work unchanged.
    """

    def __init__(self, num_classes: int = 10, width: float = 1.0, timesteps: int = DEFAULT_TIMESTEPS,
                 beta: float = 0.5):
        super().__init__()
        c = _make_divisible(32 * width)
        self.timesteps = timesteps
        self.encoder = SpikingEncoder(3, c, timesteps, beta)
        self.blocks = nn.Sequential(
            nn.MaxPool2d(2),
            SpikingConv(c, 2 * c, timesteps, beta),
            nn.MaxPool2d(2),
            SpikingConv(2 * c, 4 * c, timesteps, beta),
            SpikingConv(4 * c, 4 * c, timesteps, beta),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(4 * c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # channels_last throughout (the engine's layout): the time folds below are then views
        spikes = self.blocks(self.encoder(x.contiguous(memory_format=torch.channels_last)))
        rates = spikes.mean((2, 3)).unflatten(0, (x.shape[0], self.timesteps)).mean(1)
        return self.classifier(rates)


@_register("spiking_cnn", timesteps=True)
def _spiking_cnn(num_classes: int, width: float, timesteps: int = DEFAULT_TIMESTEPS) -> nn.Module:
    return SpikingCNN(num_classes, width, timesteps)


# The names and widths are declared in pilab.models.names (torch-free, so that Config validation and `--help`
# need no torch); the builders registered here must be exactly those.
assert tuple(_REGISTRY) == MODEL_NAMES and tuple(sorted(_TAKES_TIMESTEPS)) == tuple(sorted(SPIKING_MODELS)), \
    "pilab/models/zoo.py and pilab/models/names.py disagree on the models"


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def build_model(name: str, num_classes: int = 10, width: float = 1.0, *,
                timesteps: Optional[int] = None) -> nn.Module:
    """A freshly initialised model (train mode, CPU, contiguous weights).

        model = build_model("mobilenetv2_cifar", num_classes=10, width=0.5)
        model = build_model("squeezenet1_1").to(memory_format=torch.channels_last)
        model = build_model("spiking_cnn", width=0.5, timesteps=4)   # needs pilab[snn]
        logits = model(x)                  # x: float (N, 3, 32, 32), any memory format -> (N, 10)

    ``timesteps`` (default ``DEFAULT_TIMESTEPS``) is for spiking models; the others ignore it, so the
    engine can pass ``cfg.timesteps`` for every model. Seed torch (``torch.manual_seed``) first for
    reproducible weights.
    """
    check_width(name, width)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} must be a positive int")
    if is_builder_spec(name):  # your own model (pilab.models.custom)
        return custom.build(name, num_classes, float(width), timesteps=timesteps)
    if name not in _TAKES_TIMESTEPS:
        return _REGISTRY[name](num_classes, float(width))
    timesteps = DEFAULT_TIMESTEPS if timesteps is None else timesteps
    if isinstance(timesteps, bool) or not isinstance(timesteps, int) or timesteps < 1:
        raise ValueError(f"timesteps={timesteps!r} must be an int >= 1")
    return _REGISTRY[name](num_classes, float(width), timesteps)


@functools.lru_cache(maxsize=8)
def probe_model(name: str, num_classes: int = 10, width: float = 1.0, *,
                timesteps: Optional[int] = None) -> nn.Module:
    """A model built only to be measured -- its parameter count, its layers' output shapes -- shared by
    every caller (eval mode, parameters as built; do not train it or leave hooks on it)::

        count_parameters(probe_model("mobilenetv2_cifar", width=0.5))

    Built on the CPU under a forked RNG, so the global RNG is untouched: calling it on some ranks only
    cannot make their weights diverge. Not on the meta device: there, initialisation, BatchNorm and
    ReLU6 run through torch._refs, whose wrapper imports torch._dynamo -- 2 s of CPU and 50 MB in
    `train --np`'s launcher at every launch (it predicts memory), against 0.25 s for a real one-image
    forward here.
    """
    with torch.random.fork_rng(devices=[]):
        model = build_model(name, num_classes=num_classes, width=width, timesteps=timesteps)
    return model.eval()


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once; buffers not counted)."""
    return sum(p.numel() for p in model.parameters())


def _hooked_forward(model: nn.Module, hooks, image_size: int) -> None:
    """One eval-mode forward of a single zero image with ``hooks`` ((module, fn) pairs) attached;
    the hooks are removed and the model's train/eval mode restored afterwards."""
    param = next(model.parameters())
    x = torch.zeros(1, custom.input_channels(model), image_size, image_size, device=param.device, dtype=param.dtype)
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


def _numel(out) -> int:
    """Elements a layer wrote in ``_hooked_forward``'s one-image forward: all of its output (a spiking
    layer's batch holds that image's T steps), or the first tensor of a tuple (a neuron's spikes)."""
    return (out[0] if isinstance(out, (tuple, list)) else out).numel()


def forward_macs(model: nn.Module, image_size: int = 32) -> int:
    """Multiply-accumulates of the conv and linear layers for one image in a forward pass.

    Counts weights x output positions (grouped convs by their group width), every time step of a
    spiking model as dense work; ignores biases, BN, activations, pooling and the residual adds,
    which are a few percent for these networks. Spike-driven work: ``synaptic_ops``.
    """
    total = 0

    def conv_hook(m: nn.Conv2d, inp, out):
        nonlocal total
        k = m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
        total += _numel(out) * k  # the forward has one image

    def linear_hook(m: nn.Linear, inp, out):
        nonlocal total
        total += _numel(out) * m.in_features

    _hooked_forward(model, [(m, conv_hook if isinstance(m, nn.Conv2d) else linear_hook)
                            for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))],
                    image_size)
    return total


@functools.lru_cache(maxsize=None)
def _leaf_outputs(name: str, width: float, num_classes: int, image_size: int,
                  timesteps: Optional[int]) -> tuple:
    """(elements all leaf layers write, elements of the largest leaf output) for one image: one
    hooked forward of ``probe_model`` serves both counts."""
    model = probe_model(name, num_classes=num_classes, width=width, timesteps=timesteps)
    total = largest = 0

    def hook(m, inp, out):
        nonlocal total, largest
        total += _numel(out)
        largest = max(largest, _numel(out))

    _hooked_forward(model, [(m, hook) for m in model.modules() if next(m.children(), None) is None],
                    image_size)
    return total, largest


def activation_elements(name: str, width: float = 1.0, num_classes: int = 10,
                        image_size: int = 32, timesteps: Optional[int] = None) -> int:
    """Elements written by every leaf layer (conv, BN, ReLU6, pooling, linear) for one image.

        activation_elements("mobilenetv2_cifar", width=0.5)   # used by pilab.perfmodel

    On a CPU the training step of these small-image networks is bound by memory traffic more than
    by FLOPs: per-image time tracks this count (x1.75 from width 0.25 to 0.5) better than the FLOPs
    (x2.95). A spiking model's neurons count once per time step. Measured on ``probe_model``.
    """
    return _leaf_outputs(name, width, num_classes, image_size, timesteps)[0]


def largest_output_elements(name: str, width: float = 1.0, num_classes: int = 10,
                            image_size: int = 32, timesteps: Optional[int] = None) -> int:
    """Elements of the largest output any leaf layer writes for one image: what an evaluation batch
    (no autograd) holds at its peak is a few of these per image (``pilab.models.memory``)::

        largest_output_elements("mobilenetv2_cifar", width=1.0)   # 144 channels x 32 x 32
    """
    return _leaf_outputs(name, width, num_classes, image_size, timesteps)[1]


@functools.lru_cache(maxsize=None)
def train_flops_per_image(name: str, width: float = 1.0, num_classes: int = 10,
                          image_size: int = 32, timesteps: Optional[int] = None) -> float:
    """Training FLOPs per image: 2 FLOPs per MAC, and forward + backward ~= 3x the forward.

        train_flops_per_image("mobilenetv2_cifar", width=0.5)   # used by pilab.perfmodel
        train_flops_per_image("spiking_cnn", 1.0, timesteps=8)  # every step as dense work (BPTT)

    Measured on ``probe_model``: the global RNG is untouched, so calling this on some ranks only
    cannot make their weights diverge.
    """
    model = probe_model(name, num_classes=num_classes, width=width, timesteps=timesteps)
    if is_builder_spec(name):  # your own model: whatever its forward runs (matmuls, attention...), counted
        return counted_train_flops(model, image_size)
    return 3.0 * 2.0 * forward_macs(model, image_size)


def counted_train_flops(model: nn.Module, image_size: int = 32) -> float:
    """Training FLOPs per image of any model: torch's ``FlopCounterMode`` over one probe image's forward
    (every convolution, matmul and attention it runs), times 3 for forward + backward -- the rule the
    built-in models' analytic count uses (``train_flops_per_image``). The forward is counted, not the
    backward: torch's counter takes a grouped (depthwise) convolution's backward as a dense one.

        counted_train_flops(my_model, image_size=64)
    """
    from torch.utils.flop_counter import FlopCounterMode

    param = next(model.parameters())
    x = torch.zeros(1, custom.input_channels(model), image_size, image_size, device=param.device, dtype=param.dtype)
    counter = FlopCounterMode(display=False)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), counter:
            model(x)
    finally:
        model.train(was_training)
    return 3.0 * float(counter.get_total_flops())


def synaptic_ops(model: nn.Module, x: torch.Tensor, *, train: bool = False) -> dict:
    """Spike activity of a spiking model on a real batch ``x``, measured with hooks: firing rates
    per neuron layer and the synaptic operations (SynOps) the spikes drive, per image.

        model = build_model("spiking_cnn", width=0.5)            # or the trained model of a run
        ops = synaptic_ops(model, images)                         # images: (N, 3, 32, 32)
        ops["synops_per_image"], ops["firing_rates"]["blocks.1.lif"]
        energy.neuromorphic_energy(ops)                           # joules per image, cited figures

    A conv fed by spikes (every conv of a ``SpikingConv`` block; checked to be 0/1) does one
    accumulate per (input spike, synapse it reaches):
    counted exactly, borders included, as a convolution of the spike map with a kernel of ones, times
    the output channels. A layer with analog input (the encoder, which sees the image, and the
    readout on firing rates) does dense multiply-accumulates, counted as in ``forward_macs``.
    ``dense_macs_per_image`` is what the same network costs evaluated densely, every step.

    Runs without gradients in eval mode (BN running statistics), or with ``train=True`` on a copy in
    train mode (batch statistics; the model's buffers are left as they were).
    """
    was_training = model.training
    net = model
    if train:
        import copy

        net = copy.deepcopy(model).train()
    else:
        model.eval()
    names = {m: n for n, m in net.named_modules()}
    # the convs behind a neuron layer (not the encoder's, which sees the image)
    spike_driven = {blk.conv for blk in net.modules() if type(blk) is SpikingConv}
    layers, fired = [], {}

    def weights_hook(m, inp, out):
        a = inp[0]
        binary = m in spike_driven
        if binary and not bool(((a == 0) | (a == 1)).all()):
            raise ValueError(f"{names[m]} should see spikes (0/1) but its input is analog")
        if isinstance(m, nn.Conv2d):
            dense = out.numel() * m.kernel_size[0] * m.kernel_size[1] * (m.in_channels // m.groups)
            if binary:
                g = m.groups
                ones = a.new_ones(g, m.in_channels // g, *m.kernel_size)
                # per output position and group: the input spikes in its receptive field
                reach = F.conv2d((a != 0).to(a.dtype), ones, None, m.stride, m.padding, m.dilation, g)
                ops = float(reach.sum()) * (m.out_channels // g)
        else:
            dense = out.numel() * m.in_features
            if binary:
                ops = float((a != 0).sum()) * m.out_features
        layers.append({"name": names[m], "kind": "synops" if binary else "macs",
                       "ops": ops if binary else float(dense), "dense_macs": float(dense),
                       "input_rate": float((a != 0).float().mean()) if binary else None})

    def neuron_hook(m, inp, out):
        spikes, n = fired.get(names[m], (0.0, 0))
        fired[names[m]] = (spikes + float(out.sum()), n + out.numel())

    handles = [m.register_forward_hook(weights_hook) for m in net.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear))]
    handles += [m.register_forward_hook(neuron_hook) for m in net.modules() if isinstance(m, LIFLayer)]
    try:
        with torch.no_grad():
            net(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not fired:
        raise ValueError(f"{type(model).__name__} has no spiking neurons (LIFLayer); "
                         "synaptic_ops is for spiking models such as spiking_cnn")
    b = x.shape[0]
    for layer in layers:
        layer["ops_per_image"] = layer.pop("ops") / b
        layer["dense_macs_per_image"] = layer.pop("dense_macs") / b
    return {
        "images": b, "timesteps": getattr(model, "timesteps", None), "parameters": count_parameters(model),
        "synops_per_image": sum(layer["ops_per_image"] for layer in layers if layer["kind"] == "synops"),
        "macs_per_image": sum(layer["ops_per_image"] for layer in layers if layer["kind"] == "macs"),
        "dense_macs_per_image": sum(layer["dense_macs_per_image"] for layer in layers),
        "firing_rates": {name: s / n for name, (s, n) in fired.items()},
        "mean_firing_rate": sum(s for s, _ in fired.values()) / sum(n for _, n in fired.values()),
        "layers": layers,
    }
