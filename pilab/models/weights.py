"""Which weights of a model are which kind, for a rule that treats them apart (Muon's: ``Config.muon_on``)::

    muon_weights(build_model("mobilenetv2_cifar", width=0.25), "conv")   # 35 dense convolutions' filters
"""
from __future__ import annotations

from torch import nn


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
