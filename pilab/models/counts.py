"""Counting what a model does for one image: parameters, multiply-accumulates (hooks on its conv and linear
layers), training FLOPs of any model (torch's FlopCounterMode). ``pilab.models.zoo`` measures the registered
models with these; the performance model and memory prediction use them.

    from pilab.models.counts import count_parameters, forward_macs, counted_train_flops
    forward_macs(model, image_size=32); counted_train_flops(model, image_size=64)

Which weights of a model are which kind, for a rule that treats them apart (Muon's: ``Config.muon_on``)::

    muon_weights(build_model("mobilenetv2_cifar", width=0.25), "conv")   # 35 dense convolutions' filters
"""
from __future__ import annotations

import torch
from torch import nn

from .custom import input_channels


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once; buffers not counted)."""
    return sum(p.numel() for p in model.parameters())


def hooked_forward(model: nn.Module, hooks, image_size: int) -> None:
    """One eval-mode forward of a single zero image with ``hooks`` ((module, fn) pairs) attached;
    the hooks are removed and the model's train/eval mode restored afterwards."""
    param = next(model.parameters())
    x = torch.zeros(1, input_channels(model), image_size, image_size, device=param.device, dtype=param.dtype)
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


def output_numel(out) -> int:
    """Elements a layer wrote in ``hooked_forward``'s one-image forward: all of its output (a spiking
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
        total += output_numel(out) * k  # the forward has one image

    def linear_hook(m: nn.Linear, inp, out):
        nonlocal total
        total += output_numel(out) * m.in_features

    hooked_forward(model, [(m, conv_hook if isinstance(m, nn.Conv2d) else linear_hook)
                            for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))],
                    image_size)
    return total


def counted_train_flops(model: nn.Module, image_size: int = 32) -> float:
    """Training FLOPs per image of any model: torch's ``FlopCounterMode`` over one probe image's forward
    (every convolution, matmul and attention it runs), times 3 for forward + backward -- the rule the
    built-in models' analytic count uses (``train_flops_per_image``). The forward is counted, not the
    backward: torch's counter takes a grouped (depthwise) convolution's backward as a dense one.

        counted_train_flops(my_model, image_size=64)
    """
    from torch.utils.flop_counter import FlopCounterMode

    param = next(model.parameters())
    x = torch.zeros(1, input_channels(model), image_size, image_size, device=param.device, dtype=param.dtype)
    counter = FlopCounterMode(display=False)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), counter:
            model(x)
    finally:
        model.train(was_training)
    return 3.0 * float(counter.get_total_flops())


def muon_weights(model: nn.Module, on: str = "conv") -> list[nn.Parameter]:
    """The trainable weights ``on`` names (``Config.muon_on``): dense convolutions' filters; with
    ``depthwise`` also depthwise filters (``groups`` = input channels: each output channel has its own k x k
    filter, so the matrix Muon would orthogonalise is a stack of unrelated filters); with ``head`` also
    every ``nn.Linear`` (the classifier)."""
    parts = set(on.split("+"))
    out = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.weight.requires_grad:
            depthwise = m.groups > 1 and m.groups == m.in_channels
            if not depthwise or "depthwise" in parts:
                out.append(m.weight)
        elif isinstance(m, nn.Linear) and "head" in parts and m.weight.requires_grad:
            out.append(m.weight)
    return out
