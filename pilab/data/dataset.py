"""The decoded data set and its error type: what every other part of ``pilab.data`` produces or raises.

    from pilab.data import CIFAR10, DataError
    ds = CIFAR10.from_arrays(x_train, y_train, x_test, y_test, source="my arrays")
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

CLASSES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer",
                            "dog", "frog", "horse", "ship", "truck")


class DataError(ValueError):
    """Data cannot be loaded or sharded. The message is one line naming the problem and the fix."""


@dataclass(frozen=True, eq=False)
class CIFAR10:
    """Decoded CIFAR-10 (or a subset): uint8 NHWC images and int64 labels, plus where they came from."""

    x_train: np.ndarray = field(repr=False)  # uint8 (N, 32, 32, 3), C-contiguous
    y_train: np.ndarray = field(repr=False)  # int64 (N,), index into classes
    x_test: np.ndarray = field(repr=False)
    y_test: np.ndarray = field(repr=False)
    classes: tuple[str, ...]
    source: str  # human description of where it came from
    checksum: str  # sha256 hex over the four arrays (see _checksum)

    @classmethod
    def from_arrays(cls, x_train, y_train, x_test, y_test, source: str) -> "CIFAR10":
        """Contiguous uint8 images / int64 labels, the ten CIFAR-10 classes, and their checksum."""
        arrays = [np.ascontiguousarray(x_train, dtype=np.uint8), np.ascontiguousarray(y_train, dtype=np.int64),
                  np.ascontiguousarray(x_test, dtype=np.uint8), np.ascontiguousarray(y_test, dtype=np.int64)]
        return cls(*arrays, classes=CLASSES, source=source, checksum=_checksum(arrays))

    def __repr__(self) -> str:
        return (f"CIFAR10({len(self.y_train)} train / {len(self.y_test)} test, "
                f"source={self.source!r}, checksum={self.checksum[:12]}…)")


def _checksum(arrays: Sequence[np.ndarray]) -> str:
    """sha256 over dtype, shape and bytes of each array, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()
