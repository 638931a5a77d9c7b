"""From uint8 images to the network's input: normalisation and batched augmentation (tensor ops over the
whole batch, no per-image Python loop)::

    from pilab import data
    x = data.to_input(images)                                        # evaluation: normalise only
    x = data.augment(images, seed=0, epoch=3, step=17, rank=comm.rank)   # training: crop + flip too
"""
from __future__ import annotations

import numpy as np
import torch

from .dataset import DataError
from .shards import _TAG_AUG

# Per-channel statistics of the 50,000 official CIFAR-10 training images (pixel values in [0, 1]).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4  # random-crop padding, pixels on each side (reflect)

_SCALE = torch.tensor([1.0 / (255.0 * s) for s in STD], dtype=torch.float32)
_SHIFT = torch.tensor([-m / s for m, s in zip(MEAN, STD)], dtype=torch.float32)


def _check_images(x: torch.Tensor) -> None:
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.ndim != 4
            or tuple(x.shape[1:]) != (32, 32, 3)):
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise DataError(f"expected a uint8 tensor (B, 32, 32, 3), got {got}; pass rows of CIFAR10.x_train")


_ON_DEVICE: dict = {}  # device -> (scale, shift) there: moved once, not on every batch


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cpu":
        return _SCALE, _SHIFT
    if device not in _ON_DEVICE:
        _ON_DEVICE[device] = (_SCALE.to(device), _SHIFT.to(device))
    return _ON_DEVICE[device]


def _normalise(x_nhwc: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW view in channels_last memory (no copy beyond the float conversion)."""
    scale, shift = _constants(x_nhwc.device)
    y = x_nhwc.to(torch.float32).mul_(scale).add_(shift)
    return y.permute(0, 3, 1, 2)


def to_input(x: torch.Tensor) -> torch.Tensor:
    """uint8 (B,32,32,3) -> normalised float32 (B,3,32,32) in channels_last memory; no augmentation."""
    _check_images(x)
    return _normalise(x.contiguous())


def _aug_generator(seed: int, epoch: int, step: int, rank: int) -> torch.Generator:
    state = np.random.SeedSequence([int(seed), _TAG_AUG, int(epoch), int(step), int(rank)]).generate_state(2)
    g = torch.Generator()
    g.manual_seed(((int(state[0]) << 32) | int(state[1])) & ((1 << 63) - 1))
    return g


def _reflect(i: torch.Tensor, n: int = 32) -> torch.Tensor:
    """Index of reflect padding (edge not repeated, as F.pad(mode='reflect')) for |shift| < n."""
    i = torch.where(i < 0, -i, i)
    return torch.where(i > n - 1, 2 * (n - 1) - i, i)


def augment(x: torch.Tensor, *, seed: int, epoch: int, step: int, rank: int) -> torch.Tensor:
    """Random crop (4-pixel reflect padding) and horizontal flip, then normalisation, for a whole batch.

    ``x`` uint8 (B,32,32,3) -> float32 (B,3,32,32) channels_last. The randomness comes only from
    (seed, epoch, step, rank), so a step can be replayed exactly::

        xb = augment(shard_x[idx], seed=0, epoch=3, step=17, rank=comm.rank)
    """
    _check_images(x)
    shift, flip = augment_draws(x.shape[0], seed=seed, epoch=epoch, step=step, rank=rank)
    return augment_with(x, shift, flip)


def augment_draws(b: int, *, seed: int, epoch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers ``augment`` uses for a batch of ``b``: shifts (b, 2) and flips (b, 1), drawn
    on the CPU from (seed, epoch, step, rank). A device-resident loader draws a whole epoch of them at
    once and moves them in one copy, so the device never waits for the host per step."""
    g = _aug_generator(seed, epoch, step, rank)
    shift = torch.randint(-PAD, PAD + 1, (b, 2), generator=g)
    flip = torch.randint(0, 2, (b, 1), generator=g).bool()
    return shift, flip


def augment_with(x: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """``augment`` with given draws, on whatever device ``x`` and the draws are (all on the same one)."""
    x = x.contiguous()
    b = x.shape[0]
    ar = torch.arange(32, device=x.device)
    # Crop of the padded image at offset (PAD+dy, PAD+dx) = reflected source rows/cols; the flip reverses
    # the columns of the crop. One gather of 3-byte pixels does crop and flip for the whole batch.
    rows = _reflect(ar + shift[:, :1])                                      # (b, 32)
    cols = _reflect(torch.where(flip, 31 - ar, ar) + shift[:, 1:])          # (b, 32)
    flat = (torch.arange(b, device=x.device)[:, None, None] * 32 + rows[:, :, None]) * 32 + cols[:, None, :]
    crops = x.view(-1, 3).index_select(0, flat.reshape(-1)).view(b, 32, 32, 3)
    return _normalise(crops)
