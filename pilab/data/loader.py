"""The per-rank batch iterator that ``pilab.train`` and the simulator use::

    from pilab import data
    loader = data.ShardLoader(ds, np_=comm.size, rank=comm.rank, batch=32, seed=cfg.seed)
    for step, x, y in loader.epoch(epoch): ...

From uint8 images to the network's input: normalisation and batched augmentation (tensor ops over the
whole batch, no per-image Python loop)::

    from pilab import data
    x = data.to_input(images)                                        # evaluation: normalise only
    x = data.augment(images, seed=0, epoch=3, step=17, rank=comm.rank)   # training: crop + flip too
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .dataset import CIFAR10, CIFAR10_MEAN as MEAN, CIFAR10_STD as STD, DataError  # noqa: E402  (CIFAR-10's; a data set has its own)
from .shards import (TAG_AUG, check_np, epoch_accounting, epoch_permutation, reshuffle_global, static_local,
                     static_shards)


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
    state = np.random.SeedSequence([int(seed), TAG_AUG, int(epoch), int(step), int(rank)]).generate_state(2)
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
    # drawn on the CPU whatever the device (the same numbers everywhere), applied where the images are
    return augment_with(x, shift.to(x.device), flip.to(x.device), mean, std)


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


class ShardLoader:
    """Batches for one rank, under the ``static`` or ``reshuffle`` policy.

    ``static`` keeps only this rank's shard in memory (a uint8 tensor); ``reshuffle`` holds the whole
    training set and takes its slice of a shared per-epoch permutation. Every rank gets the same
    ``steps_per_epoch``; ``leftover`` images per epoch (over all ranks) are skipped, not padded::

        loader = ShardLoader(ds, np_=comm.size, rank=comm.rank, batch=32, seed=cfg.seed)
        for step, x, y in loader.epoch(epoch): ...
        x, y = loader.batch(epoch, step)        # the same batch again (replay / resume)

    ``device=`` keeps the images (uint8) on that device and augments there: an epoch's batch positions
    and augmentation draws are made on the CPU at the epoch's first batch and moved in one copy each, so
    a step issues no host-to-device transfer and no host synchronisation. The batches are the same as
    without ``device`` (``device="cpu"`` runs that path on the CPU, for tests).

    ``copies`` (batch augmentation, ``Config.batch_aug``): each image of the batch comes ``copies`` times,
    each copy augmented with its own draws, the copies of an image next to each other (so that several
    ranks' batches side by side still hold each image's copies together); the labels come once per image
    (``pilab.engine.backend.forward_loss`` repeats them).
    """

    def __init__(self, ds: CIFAR10, np_: int, rank: int, batch: int, *, seed: int = 0,
                 policy: str = "static", augment: bool = True, device=None, copies: int = 1):
        n = len(ds.y_train)
        check_np(n, np_, rank, batch, policy)
        acc = epoch_accounting(n, np_, batch, policy, seed)
        if acc["steps"] < 1:
            raise DataError(f"each of {np_} ranks holds at most {max(acc['shard_sizes'])} images, fewer than "
                            f"its batch of {batch}; use fewer processes or a smaller batch")
        self.np_, self.rank, self.batch_size, self.seed = np_, rank, batch, seed
        self.policy, self.augment, self._n, self.copies = policy, augment, n, copies
        self.mean, self.std = ds.mean, ds.std  # the data set's normalisation
        self.pad = pad_for(*ds.x_train.shape[1:3])  # crop padding scaled to the image size
        self.steps_per_epoch: int = acc["steps"]
        self.leftover: int = acc["leftover"]
        self.shard_size: int = acc["shard_sizes"][rank]
        if policy == "static":
            self.indices = static_shards(ds.y_train, np_, seed)[rank]  # global indices of the shard
            self._x = torch.from_numpy(np.ascontiguousarray(ds.x_train[self.indices]))
            self._y = torch.from_numpy(np.ascontiguousarray(ds.y_train[self.indices]))
        else:
            self.indices = None
            self._x = torch.from_numpy(ds.x_train)  # shares memory with ds
            self._y = torch.from_numpy(ds.y_train)
        self._cached_epoch, self._cached_rows = None, None
        self._perm = None  # (epoch, the epoch's shared permutation): uneven shares (batch(share=))
        self._carried = None  # (epoch, (steps, batch) global indices, x, y): see carry()
        self.device = torch.device(device) if device is not None else None
        if self.device is not None:
            self._x, self._y = _to_device(self._x, self.device), _to_device(self._y, self.device)
            self._draws_epoch, self._draws = None, None

    def set_batch(self, batch: int) -> None:
        """Cut the same shard into batches of ``batch`` from now on (a batch-size ramp): the epoch's
        order is the same permutation, taken ``batch`` at a time."""
        if batch == self.batch_size:
            return
        steps = epoch_accounting(self._n, self.np_, batch, self.policy, self.seed)["steps"]  # as every rank counts
        if steps < 1:
            raise DataError(f"rank {self.rank} holds {self.shard_size} images, fewer than a batch of {batch}; "
                            "use a smaller batch or fewer processes")
        self.batch_size, self.steps_per_epoch = batch, steps
        self.leftover = self._n - steps * batch * self.np_
        self._cached_epoch = self._cached_rows = None
        if self.device is not None:
            self._draws_epoch = self._draws = None

    def _rows(self, epoch: int) -> torch.Tensor:
        """(steps, batch) positions into self._x for ``epoch`` (computed once per epoch)."""
        if self._cached_epoch != epoch:
            if self.policy == "static":
                rows = static_local(len(self._y), self.steps_per_epoch, self.batch_size, epoch,
                                     self.seed, self.rank)
            else:
                rows = reshuffle_global(len(self._y), self.np_, self.rank, self.steps_per_epoch,
                                         self.batch_size, epoch, self.seed)
            self._cached_epoch, self._cached_rows = epoch, torch.from_numpy(rows)
        return self._cached_rows

    def carry(self, epoch: int, indices: np.ndarray, ds: CIFAR10) -> None:
        """Take ``epoch``'s batches from ``indices`` ((steps, batch) indices into ``ds``'s whole
        training set) instead of this rank's own order: a run resumed at another np finishes the
        epoch it was stopped in with the images it had not seen yet (the other epochs are unchanged)::

            loader.carry(3, plan[:, r * b:(r + 1) * b], ds)
        """
        indices = np.asarray(indices, dtype=np.int64)
        if indices.shape != (self.steps_per_epoch, self.batch_size):
            raise DataError(f"carried batches of shape {indices.shape}; this loader takes "
                            f"({self.steps_per_epoch}, {self.batch_size})")
        self._carried = (epoch, torch.from_numpy(indices), torch.from_numpy(ds.x_train),
                         torch.from_numpy(ds.y_train))

    def global_indices(self, epoch: int) -> np.ndarray:
        """Training-set indices per step for ``epoch``; equals ``epoch_batches(...)``."""
        if self._carried is not None and self._carried[0] == epoch:
            return self._carried[1].numpy().copy()
        rows = self._rows(epoch).numpy()
        return self.indices[rows] if self.indices is not None else rows.copy()

    def batch(self, epoch: int, step: int, share: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of ``epoch``: x float32 (B,C,H,W) channels_last, y int64 (B,).

        ``share=(start, count)``: ranks of different speeds training different shares of one global batch
        (``pilab.data.batch_shares``): this rank's ``count`` images are the step's global-batch positions
        ``start..start+count-1`` in the epoch's shared permutation (the ``reshuffle`` policy's, whose
        ranks hold the whole set). Every step takes the next global batch of it whatever the shares, so
        each image is used once an epoch even when the shares change between steps::

            x, y = loader.batch(epoch, step, share=(43, 21))   # rank 1 of shares [43, 21]
        """
        if not 0 <= step < self.steps_per_epoch:
            raise DataError(f"step={step} is outside 0..{self.steps_per_epoch - 1} of an epoch")
        if share is not None:
            xb, yb = self._shared(epoch, step, *share)
        elif self._carried is not None and self._carried[0] == epoch:
            _, idx, x_all, y_all = self._carried
            xb, yb = x_all.index_select(0, idx[step]), y_all.index_select(0, idx[step])
            if self.device is not None:
                xb, yb = xb.to(self.device), yb.to(self.device)
        elif self.device is not None:
            return self._device_batch(epoch, step)
        else:
            rows = self._rows(epoch)[step]
            xb, yb = self._x.index_select(0, rows), self._y.index_select(0, rows)
        if self.copies > 1:
            xb = xb.repeat_interleave(self.copies, dim=0)
        if self.augment:
            return augment(xb, seed=self.seed, epoch=epoch, step=step, rank=self.rank, mean=self.mean,
                           std=self.std), yb
        return to_input(xb, self.mean, self.std), yb

    def share_indices(self, epoch: int, step: int, start: int, count: int) -> np.ndarray:
        """The training-set indices of ``batch(epoch, step, share=(start, count))``."""
        total = self.batch_size * self.np_
        if self.policy != "reshuffle":
            raise DataError("shares of a global batch need the reshuffle policy (sharding=reshuffle: every "
                            f"rank holds the whole set); this loader is {self.policy}: use --sharding reshuffle")
        if not (0 <= start and 1 <= count and start + count <= total):
            raise DataError(f"share ({start}, {count}) is outside the global batch of {total}")
        if self._perm is None or self._perm[0] != epoch:  # once an epoch
            self._perm = (epoch, epoch_permutation(self._n, epoch, self.seed).astype(np.int64))
        first = step * total + start
        return self._perm[1][first:first + count].copy()

    def _shared(self, epoch: int, step: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(self.share_indices(epoch, step, start, count))
        if self.device is not None:  # a device-resident set (the simulator on a GPU): a share's rows moved
            rows = rows.to(self.device)  # per step, a few hundred bytes; its draws as augment() makes them
        return self._x.index_select(0, rows), self._y.index_select(0, rows)

    def _device_batch(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._draws_epoch != epoch:  # once per epoch: positions and draws for every step, one copy each
            rows = self._rows(epoch)
            draws = [augment_draws(self.batch_size * self.copies, seed=self.seed, epoch=epoch, step=s, rank=self.rank,
                                   pad=self.pad)
                     for s in range(self.steps_per_epoch)] if self.augment else []
            self._draws = (rows.to(self.device),
                           torch.stack([d[0] for d in draws]).to(self.device) if draws else None,
                           torch.stack([d[1] for d in draws]).to(self.device) if draws else None)
            self._draws_epoch = epoch
        rows, shifts, flips = self._draws
        r = rows[step]
        xb, yb = self._x.index_select(0, r), self._y.index_select(0, r)
        if self.copies > 1:
            xb = xb.repeat_interleave(self.copies, dim=0)
        if self.augment:
            return augment_with(xb, shifts[step], flips[step], self.mean, self.std), yb
        return to_input(xb, self.mean, self.std), yb

    def epoch(self, epoch: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for step in range(self.steps_per_epoch):
            x, y = self.batch(epoch, step)
            yield step, x, y


_SHARED: list = []  # [(cpu tensor, device, device tensor)]: the last whole-set copy, shared by loaders


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; the reshuffle policy's whole training set is moved once, not once per
    (virtual) rank: loaders of the same arrays share the last copy made."""
    for src, dev, copy in _SHARED:
        if src.data_ptr() == t.data_ptr() and src.shape == t.shape and dev == device:
            return copy
    copy = t.to(device)
    if copy.data_ptr() != t.data_ptr():
        _SHARED[:] = [(t, device, copy)] + _SHARED[:1]
    return copy


def ranks_batch(loaders: list, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Several ranks' batches of (``epoch``, ``step``) as one batch, in rank order: the same values as
    ``torch.cat`` of each loader's ``batch`` (the augmentation is per image, so one pass over the whole
    uint8 batch with every rank's own draws gives each image the same bits), at one augmentation's cost.
    The simulator's fast mode takes its global batch this way::

        x, y = ranks_batch(loaders[0:48], epoch, step)     # == cat of loaders[r].batch(epoch, step)

    Why not cat: per rank it cost an index_select, a float conversion and a normalisation of a few
    images, then a copy of the float batch, ~5-10% of a step at np=48 (the simulator's profile)."""
    first = loaders[0]
    if len(loaders) == 1:
        return first.batch(epoch, step)
    if first.copies > 1 or any(ld.device is not None or (ld._carried is not None and ld._carried[0] == epoch)
                               for ld in loaders):
        # a device-resident or carried epoch: as each has it; batch augmentation's copies: each rank's own
        parts = [ld.batch(epoch, step) for ld in loaders]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    b = first.batch_size
    if not 0 <= step < first.steps_per_epoch:
        raise DataError(f"step={step} is outside 0..{first.steps_per_epoch - 1} of an epoch")
    xs = torch.empty((b * len(loaders), *first._x.shape[1:]), dtype=first._x.dtype)
    ys = torch.empty(b * len(loaders), dtype=first._y.dtype)
    for i, ld in enumerate(loaders):
        rows = ld._rows(epoch)[step]
        torch.index_select(ld._x, 0, rows, out=xs[i * b:(i + 1) * b])
        torch.index_select(ld._y, 0, rows, out=ys[i * b:(i + 1) * b])
    if not first.augment:
        return to_input(xs, first.mean, first.std), ys
    draws = [augment_draws(b, seed=ld.seed, epoch=epoch, step=step, rank=ld.rank, pad=ld.pad) for ld in loaders]
    return augment_with(xs, torch.cat([d[0] for d in draws]), torch.cat([d[1] for d in draws]),
                        first.mean, first.std), ys
