"""The decoded data set and its error type: what every other part of ``pilab.data`` produces or raises.

    from pilab.data import CIFAR10, DataError
    ds = CIFAR10.from_arrays(x_train, y_train, x_test, y_test, source="my arrays")
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
    # the rows of x_test held in memory (None: all); the others are zero pages (see with_test_rows)
    test_rows: slice | None = field(default=None, repr=False)

    @classmethod
    def from_arrays(cls, x_train, y_train, x_test, y_test, source: str) -> "CIFAR10":
        """Contiguous uint8 images / int64 labels, the ten CIFAR-10 classes, and their checksum."""
        arrays = [np.ascontiguousarray(x_train, dtype=np.uint8), np.ascontiguousarray(y_train, dtype=np.int64),
                  np.ascontiguousarray(x_test, dtype=np.uint8), np.ascontiguousarray(y_test, dtype=np.int64)]
        return cls(*arrays, classes=CLASSES, source=source, checksum=_checksum(arrays))

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
                f"source={self.source!r}, checksum={self.checksum[:12]}…)")


def _checksum(arrays: Sequence[np.ndarray]) -> str:
    """sha256 over dtype, shape and bytes of each array, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()
