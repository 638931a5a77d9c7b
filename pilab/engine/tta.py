"""Test-time augmentation: a test image's logits averaged over views of it (``Config.tta``,
``Config.tta_translate``), as airbench's evaluation does::

    logits = tta_logits(model, x, flip=True)                   # (f(x) + f(mirror x)) / 2
    logits = tta_logits(model, x, flip=True, translate=True)   # six views, airbench's weights

With ``translate`` the image is also moved one pixel up-left and one down-right (reflect padding, as the
training crops pad), each with its mirror: half the weight on the plain pair, a quarter on each moved
pair. In eval mode a view's logits do not depend on the other images of the batch, so the views of a
rank's share of the test set are the same on every backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _pair(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) + model(x.flip(3))) / 2


def tta_logits(model: nn.Module, x: torch.Tensor, *, flip: bool = False, translate: bool = False) -> torch.Tensor:
    """``model``'s logits for the normalised batch ``x`` (B, C, H, W), averaged over its views."""
    if not flip:
        return model(x)
    if not translate:
        return _pair(model, x)
    h, w = x.shape[2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    moved = [padded[:, :, :h, :w], padded[:, :, 2:, 2:]]  # content moved down-right, up-left by a pixel
    moved = [m.contiguous(memory_format=torch.channels_last) for m in moved]
    return 0.5 * _pair(model, x) + 0.25 * (_pair(model, moved[0]) + _pair(model, moved[1]))
