"""The CNNs pilab trains, by registry name, plus parameter and FLOP counts for the performance model.

    from pilab.models import build_model, count_parameters, train_flops_per_image
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
from typing import Callable, Dict, Optional

import torch
from torch import nn

from . import custom
from .counts import counted_train_flops, forward_macs, hooked_forward, output_numel
from .mobilenet import MobileNetV2
from .names import MODEL_NAMES, SPIKING_MODELS, check_width, is_builder_spec
from .spiking import DEFAULT_TIMESTEPS, SpikingCNN
from .squeezenet import SqueezeNet11

_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}
TAKES_TIMESTEPS: set = set()  # spiking models: their builders also take ``timesteps``


def _register(name: str, timesteps: bool = False):
    def deco(fn):
        _REGISTRY[name] = fn
        if timesteps:
            TAKES_TIMESTEPS.add(name)
        return fn
    return deco


@_register("mobilenetv2_cifar")
def _mobilenetv2_cifar(num_classes: int, width: float, in_channels: int = 3) -> nn.Module:
    return MobileNetV2(num_classes, width, cifar=True, in_channels=in_channels)


@_register("mobilenetv2")
def _mobilenetv2(num_classes: int, width: float, in_channels: int = 3) -> nn.Module:
    return MobileNetV2(num_classes, width, cifar=False, in_channels=in_channels)



@_register("squeezenet1_1")
def _squeezenet1_1(num_classes: int, width: float, in_channels: int = 3) -> nn.Module:
    return SqueezeNet11(num_classes, in_channels=in_channels)



@_register("spiking_cnn", timesteps=True)
def _spiking_cnn(num_classes: int, width: float, timesteps: int = DEFAULT_TIMESTEPS,
                 in_channels: int = 3) -> nn.Module:
    return SpikingCNN(num_classes, width, timesteps, in_channels=in_channels)


# The names and widths are declared in pilab.models.names (torch-free, so that Config validation and `--help`
# need no torch); the builders registered here must be exactly those.
assert tuple(_REGISTRY) == MODEL_NAMES and tuple(sorted(TAKES_TIMESTEPS)) == tuple(sorted(SPIKING_MODELS)), \
    "pilab/models/zoo.py and pilab/models/names.py disagree on the models"



# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def build_model(name: str, num_classes: int = 10, width: float = 1.0, *,
                timesteps: Optional[int] = None, in_channels: int = 3) -> nn.Module:
    """A freshly initialised model (train mode, CPU, contiguous weights).

        model = build_model("mobilenetv2_cifar", num_classes=10, width=0.5)
        model = build_model("squeezenet1_1").to(memory_format=torch.channels_last)
        model = build_model("spiking_cnn", width=0.5, timesteps=4)   # needs pilab[snn]
        logits = model(x)                  # x: float (N, 3, 32, 32), any memory format -> (N, 10)

    ``timesteps`` (default ``DEFAULT_TIMESTEPS``) is for spiking models; the others ignore it, so the
    engine can pass ``cfg.timesteps`` for every model. ``in_channels``: the images' channels (1 for grey
    images such as sklearn's digits), for the registered models' first layer; your own builder decides its
    own. Seed torch (``torch.manual_seed``) first for
    reproducible weights.
    """
    check_width(name, width)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} must be a positive int")
    if is_builder_spec(name):  # your own model (pilab.models.custom)
        return custom.build(name, num_classes, float(width), timesteps=timesteps)
    if name not in TAKES_TIMESTEPS:
        return _REGISTRY[name](num_classes, float(width), in_channels=in_channels)
    timesteps = DEFAULT_TIMESTEPS if timesteps is None else timesteps
    if isinstance(timesteps, bool) or not isinstance(timesteps, int) or timesteps < 1:
        raise ValueError(f"timesteps={timesteps!r} must be an int >= 1")
    return _REGISTRY[name](num_classes, float(width), timesteps, in_channels=in_channels)


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


@functools.lru_cache(maxsize=None)
def _leaf_outputs(name: str, width: float, num_classes: int, image_size: int,
                  timesteps: Optional[int]) -> tuple:
    """(elements all leaf layers write, elements of the largest leaf output) for one image: one
    hooked forward of ``probe_model`` serves both counts."""
    model = probe_model(name, num_classes=num_classes, width=width, timesteps=timesteps)
    total = largest = 0

    def hook(m, inp, out):
        nonlocal total, largest
        total += output_numel(out)
        largest = max(largest, output_numel(out))

    hooked_forward(model, [(m, hook) for m in model.modules() if next(m.children(), None) is None],
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
    (no autograd) holds at its peak is a few of these per image (``pilab.engine.memory``)::

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


