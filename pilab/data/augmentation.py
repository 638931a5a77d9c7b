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

from .dataset import CIFAR10_MEAN as MEAN, CIFAR10_STD as STD  # noqa: E402  (CIFAR-10's; a data set has its own)

PAD = 4  # random-crop padding at 32x32, pixels on each side (reflect); other sizes: pad_for(size)

_SCALE = torch.tensor([1.0 / (255.0 * s) for s in STD], dtype=torch.float32)
_SHIFT = torch.tensor([-m / s for m, s in zip(MEAN, STD)], dtype=torch.float32)


def pad_for(h: int, w: int | None = None) -> int:
    """Crop padding for an image of ``h`` x ``w`` pixels: an eighth of its shorter side (4 at 32, 8 at 64,
    1 at 8), so the crop moves the image by the same share at any size."""
    return max(1, round(min(h, w or h) / 8))


def _check_images(x: torch.Tensor) -> None:
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.ndim != 4
            or x.shape[3] not in (1, 3)):
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise DataError(f"expected a uint8 tensor (B, H, W, 1 or 3), got {got}; pass rows of CIFAR10.x_train")


_ON_DEVICE: dict = {}  # (device, mean, std) -> (scale, shift) there: made once, not on every batch


def _constants(device: torch.device, mean=None, std=None) -> tuple[torch.Tensor, torch.Tensor]:
    if mean is None or (tuple(mean) == MEAN and tuple(std) == STD):
        if device.type == "cpu":
            return _SCALE, _SHIFT
        key = (device, None, None)
    else:
        key = (device, tuple(mean), tuple(std))
    if key not in _ON_DEVICE:
        if key[1] is None:
            scale, shift = _SCALE, _SHIFT
        else:
            scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32)
            shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=torch.float32)
        _ON_DEVICE[key] = (scale.to(device), shift.to(device))
    return _ON_DEVICE[key]


def _normalise(x_nhwc: torch.Tensor, mean=None, std=None) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW view in channels_last memory (no copy beyond the float conversion);
    ``mean``/``std`` per channel (pixels in [0, 1]), CIFAR-10's when None."""
    if mean is not None and len(mean) != x_nhwc.shape[3]:
        raise DataError(f"normalisation statistics for {len(mean)} channels, images with {x_nhwc.shape[3]}; "
                        "give one mean and std per channel")
    scale, shift = _constants(x_nhwc.device, mean, std)
    y = x_nhwc.to(torch.float32).mul_(scale).add_(shift)
    return y.permute(0, 3, 1, 2)


def to_input(x: torch.Tensor, mean=None, std=None) -> torch.Tensor:
    """uint8 (B,H,W,C) -> normalised float32 (B,C,H,W) in channels_last memory; no augmentation.
    ``mean``/``std``: the data set's (``ds.mean``, ``ds.std``); CIFAR-10's when None."""
    _check_images(x)
    return _normalise(x.contiguous(), mean, std)


def _aug_generator(seed: int, epoch: int, step: int, rank: int) -> torch.Generator:
    state = np.random.SeedSequence([int(seed), _TAG_AUG, int(epoch), int(step), int(rank)]).generate_state(2)
    g = torch.Generator()
    g.manual_seed(((int(state[0]) << 32) | int(state[1])) & ((1 << 63) - 1))
    return g


def _reflect(i: torch.Tensor, n: int = 32) -> torch.Tensor:
    """Index of reflect padding (edge not repeated, as F.pad(mode='reflect')) for |shift| < n."""
    i = torch.where(i < 0, -i, i)
    return torch.where(i > n - 1, 2 * (n - 1) - i, i)


def augment(x: torch.Tensor, *, seed: int, epoch: int, step: int, rank: int, mean=None, std=None) -> torch.Tensor:
    """Random crop (reflect padding of ``pad_for`` the size: 4 px at 32x32) and horizontal flip, then
    normalisation, for a whole batch.

    ``x`` uint8 (B,H,W,C) -> float32 (B,C,H,W) channels_last. The randomness comes only from
    (seed, epoch, step, rank), so a step can be replayed exactly::

        xb = augment(shard_x[idx], seed=0, epoch=3, step=17, rank=comm.rank)
    """
    _check_images(x)
    shift, flip = augment_draws(x.shape[0], seed=seed, epoch=epoch, step=step, rank=rank,
                                pad=pad_for(x.shape[1], x.shape[2]))
    return augment_with(x, shift, flip, mean, std)


def augment_draws(b: int, *, seed: int, epoch: int, step: int, rank: int,
                  pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers ``augment`` uses for a batch of ``b``: shifts (b, 2) within +-``pad`` and flips
    (b, 1), drawn on the CPU from (seed, epoch, step, rank). A device-resident loader draws a whole epoch
    of them at once and moves them in one copy, so the device never waits for the host per step."""
    g = _aug_generator(seed, epoch, step, rank)
    shift = torch.randint(-pad, pad + 1, (b, 2), generator=g)
    flip = torch.randint(0, 2, (b, 1), generator=g).bool()
    return shift, flip


def augment_with(x: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor, mean=None, std=None) -> torch.Tensor:
    """``augment`` with given draws, on whatever device ``x`` and the draws are (all on the same one)."""
    x = x.contiguous()
    b, h, w, c = x.shape
    dev = x.device
    # Crop of the padded image at offset (PAD+dy, PAD+dx) = reflected source rows/cols; the flip reverses
    # the columns of the crop. One gather of C-byte pixels does crop and flip for the whole batch.
    ar_h, ar_w = torch.arange(h, device=dev), torch.arange(w, device=dev)
    rows = _reflect(ar_h + shift[:, :1], h)                                    # (b, h)
    cols = _reflect(torch.where(flip, w - 1 - ar_w, ar_w) + shift[:, 1:], w)   # (b, w)
    flat = (torch.arange(b, device=dev)[:, None, None] * h + rows[:, :, None]) * w + cols[:, None, :]
    crops = x.view(-1, c).index_select(0, flat.reshape(-1)).view(b, h, w, c)
    return _normalise(crops, mean, std)
