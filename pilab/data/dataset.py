"""The decoded data set and its error type: what every other part of ``pilab.data`` produces or raises.

CIFAR-10 is the default, but a data set is any image classification set: uint8 (N, H, W, C) images with
C = 1 (grey) or 3 (RGB), any size, its own class names and normalisation statistics::

    from pilab.data import CIFAR10, DataError
    ds = CIFAR10.from_arrays(x_train, y_train, x_test, y_test, source="my arrays")
    ds.image_shape, ds.classes, ds.mean, ds.std     # (3, 32, 32), CIFAR-10's ten, its official statistics
    ds = ds.with_test_rows(data.test_shard(len(ds.y_test), comm.size, comm.rank))   # one rank's test images
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

CLASSES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer",
                            "dog", "frog", "horse", "ship", "truck")
# Per-channel statistics of the 50,000 official CIFAR-10 training images (pixel values in [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (population) of uint8 NHWC images, pixels scaled to [0, 1]::

        mean, std = channel_stats(ds.x_train)
    """
    flat = x.reshape(-1, x.shape[-1])
    mean = flat.mean(0, dtype=np.float64) / 255.0
    # E[x^2] - mean^2 in float64 over uint8 values: exact enough and one pass without a float copy
    sq = np.einsum("ij,ij->j", flat, flat, dtype=np.float64) / len(flat) / 255.0 ** 2
    std = np.sqrt(np.maximum(sq - mean * mean, 0.0))
    std = np.where(std > 0, std, 1.0)  # a constant channel: leave its scale alone
    return tuple(float(round(v, 6)) for v in mean), tuple(float(round(v, 6)) for v in std)


class DataError(ValueError):
    """Data cannot be loaded or sharded. The message is one line naming the problem and the fix."""


@dataclass(frozen=True, eq=False)
class CIFAR10:
    """A decoded image classification set (CIFAR-10 or another): uint8 NHWC images and int64 labels, the
    class names, the per-channel normalisation statistics, and where they came from."""

    x_train: np.ndarray = field(repr=False)  # uint8 (N, H, W, C), C = 1 or 3, C-contiguous
    y_train: np.ndarray = field(repr=False)  # int64 (N,), index into classes
    x_test: np.ndarray = field(repr=False)
    y_test: np.ndarray = field(repr=False)
    classes: tuple[str, ...]
    source: str  # human description of where it came from
    checksum: str  # sha256 hex over the four arrays (see arrays_checksum)
    # the rows of x_test held in memory (None: all); the others are zero pages (see with_test_rows)
    test_rows: slice | None = field(default=None, repr=False)
    # per-channel mean and std of the pixels in [0, 1]: CIFAR-10's official ones, or the training set's
    mean: tuple[float, ...] = CIFAR10_MEAN
    std: tuple[float, ...] = CIFAR10_STD

    @classmethod
    def from_arrays(cls, x_train, y_train, x_test, y_test, source: str, classes: tuple[str, ...] = CLASSES,
                    mean=None, std=None) -> "CIFAR10":
        """Contiguous uint8 images / int64 labels, their classes and checksum. ``mean``/``std`` (per channel,
        pixels in [0, 1]) default to CIFAR-10's for CIFAR-10 itself (its ten classes at 32x32 RGB), else to
        the training images' own."""
        arrays = [np.ascontiguousarray(x_train, dtype=np.uint8), np.ascontiguousarray(y_train, dtype=np.int64),
                  np.ascontiguousarray(x_test, dtype=np.uint8), np.ascontiguousarray(y_test, dtype=np.int64)]
        classes = tuple(classes)
        if mean is None or std is None:
            cifar = classes == CLASSES and arrays[0].shape[1:] == (32, 32, 3)
            mean, std = (CIFAR10_MEAN, CIFAR10_STD) if cifar else channel_stats(arrays[0])
        return cls(*arrays, classes=classes, source=source, checksum=arrays_checksum(arrays),
                   mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image as the model sees it."""
        h, w, c = self.x_train.shape[1:]
        return c, h, w

    def with_test_rows(self, rows: slice) -> "CIFAR10":
        """This data set holding only ``rows`` of the test images, a rank's ``test_shard``: ``x_test``
        keeps its shape, so ``x_test[rows]``, ``len(y_test)`` and the checksum mean what they did, but
        the other rows are zero pages never written, which take no memory::

            ds = ds.with_test_rows(data.test_shard(len(ds.y_test), comm.size, comm.rank))
            ds.x_test[ds.test_rows]        # the rows it holds; evaluation reads no others
        """
        start, stop, step = rows.indices(len(self.y_test))
        if step != 1:
            raise DataError(f"test rows {rows} are not contiguous; pass a test_shard slice")
        rows = slice(start, stop)
        # np.zeros is calloc: fresh pages that stay unmapped until written (np.zeros_like writes them)
        x = np.zeros(self.x_test.shape, self.x_test.dtype)
        x[rows] = self.x_test[rows]
        return dataclasses.replace(self, x_test=x, test_rows=rows)

    def __repr__(self) -> str:
        return (f"CIFAR10({len(self.y_train)} train / {len(self.y_test)} test, "
                f"{'x'.join(map(str, self.image_shape))}, {len(self.classes)} classes, "
                f"source={self.source!r}, checksum={self.checksum[:12]}…)")


def arrays_checksum(arrays: Sequence[np.ndarray]) -> str:
    """sha256 over dtype, shape and bytes of each array, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()
