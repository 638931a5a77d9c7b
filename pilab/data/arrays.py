"""Your own data from Python: numpy arrays or torch Datasets made into a pilab data set, and saved as a
file every rank (and every later run) can load by its path::

    from pilab import data
    ds = data.from_arrays(x_train, y_train, x_test, y_test)          # (N, H, W[, C]) images, int labels
    ds = data.from_dataset(train_set, test_set)                       # items (image, label): PIL, tensor, array
    path = data.save(ds)                                              # <cache>/cifar10-<checksum>.npz
    Config(data=path)  /  python -m pilab simulate --np 8 --data PATH --model mynets:net

Images are uint8 (N, H, W), (N, H, W, C) or (N, C, H, W) with C = 1 or 3, or floats in [0, 1] (scaled to
uint8). The classes are ``classes`` or "0".."K-1" for labels 0..K-1; the normalisation statistics are the
training images' own unless given. Bad input raises ``DataError``: one line naming the problem and the fix.
"""
from __future__ import annotations

import os

import numpy as np

from .cache import resolve_cache_dir, write_cache
from .dataset import CIFAR10, DataError


def _images(x, what: str) -> np.ndarray:
    """(N, H, W, C) uint8 from any of the accepted layouts."""
    try:
        x = np.asarray(x)
    except Exception as e:
        raise DataError(f"{what} cannot be read as an array ({e}); pass a numpy array of images") from None
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise DataError(f"{what} has shape {x.shape}; give images as (N, H, W), (N, H, W, C) or (N, C, H, W)")
    if x.shape[3] not in (1, 3) and x.shape[1] in (1, 3):
        x = x.transpose(0, 2, 3, 1)  # (N, C, H, W) -> NHWC
    if x.shape[3] not in (1, 3):
        raise DataError(f"{what} has shape {x.shape}: {x.shape[3]} channels; give 1 (grey) or 3 (RGB) channels")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.number):
            raise DataError(f"{what} holds {x.dtype}; give uint8 pixels or floats in [0, 1]")
        lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
        if np.issubdtype(x.dtype, np.integer) and 0 <= lo and hi <= 255:
            x = x.astype(np.uint8)
        elif lo >= 0 and hi <= 1:
            x = np.rint(x * 255.0).astype(np.uint8)
        else:
            raise DataError(f"{what} values span {lo:g}..{hi:g}; give uint8 pixels (0..255) or floats in [0, 1]")
    return np.ascontiguousarray(x)


def _labels(y, n: int, what: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != n:
        raise DataError(f"{what} has shape {y.shape} for {n} images; give one integer label per image")
    if not np.issubdtype(y.dtype, np.integer):
        if not (np.issubdtype(y.dtype, np.floating) and np.all(y == np.round(y))):
            raise DataError(f"{what} holds {y.dtype}; give integer class labels 0..K-1")
    return y.astype(np.int64)


def from_arrays(x_train, y_train, x_test, y_test, *, classes=None, mean=None, std=None,
                source: str = "arrays") -> CIFAR10:
    """A data set from arrays (see the module docstring); labels must lie in 0..len(classes)-1::

        from sklearn.datasets import load_digits
        d = load_digits()                                   # 1,797 8x8 grey images, 10 classes
        x = (d.images * 16).clip(0, 255).astype("uint8")
        ds = data.from_arrays(x[:1500], d.target[:1500], x[1500:], d.target[1500:])
    """
    xt, xv = _images(x_train, "x_train"), _images(x_test, "x_test")
    yt, yv = _labels(y_train, len(xt), "y_train"), _labels(y_test, len(xv), "y_test")
    if len(yt) == 0 or len(yv) == 0:
        raise DataError("the training and test sets need at least one image each; pass non-empty arrays")
    if xt.shape[1:] != xv.shape[1:]:
        raise DataError(f"x_train images are {xt.shape[1:]} (HxWxC), x_test {xv.shape[1:]}; give both the same "
                        "size and channels (resize one of them)")
    k = len(classes) if classes is not None else int(max(yt.max(), yv.max())) + 1
    for name, y in (("y_train", yt), ("y_test", yv)):
        if y.min() < 0 or y.max() >= k:
            raise DataError(f"{name} holds labels {int(y.min())}..{int(y.max())} outside 0..{k - 1} of the "
                            f"{k} classes; number the classes 0..{k - 1}" +
                            (" or give every class a name in classes=" if classes is not None else ""))
    if len(np.unique(yt)) < 2:
        raise DataError(f"y_train holds one class ({int(yt[0])}); a classifier needs at least 2: add images "
                        "of the other classes")
    names = tuple(str(c) for c in classes) if classes is not None else tuple(str(i) for i in range(k))
    return CIFAR10.from_arrays(xt, yt, xv, yv, source=f"{source} ({len(yt)} train / {len(yv)} test, "
                               f"{xt.shape[1]}x{xt.shape[2]}x{xt.shape[3]})", classes=names, mean=mean, std=std)


def _item_image(img) -> np.ndarray:
    """One Dataset item's image as (H, W, C) uint8 or float: PIL image, tensor (C, H, W), or array."""
    if hasattr(img, "mode") and hasattr(img, "size"):  # a PIL image
        return np.asarray(img.convert("L" if img.mode in ("1", "L", "LA", "I", "F") else "RGB"))
    if hasattr(img, "numpy"):  # a torch tensor, (C, H, W) as torchvision's ToTensor gives
        a = img.detach().cpu().numpy()
        return a.transpose(1, 2, 0) if a.ndim == 3 and a.shape[0] in (1, 3) else a
    return np.asarray(img)


def from_dataset(train, test, *, classes=None, mean=None, std=None) -> CIFAR10:
    """A data set from two map-style torch Datasets whose items are (image, label)::

        ds = data.from_dataset(torchvision.datasets.MNIST(root, train=True),
                               torchvision.datasets.MNIST(root, train=False))
    """
    parts = []
    for name, d in (("train", train), ("test", test)):
        try:
            items = [d[i] for i in range(len(d))]
        except Exception as e:
            raise DataError(f"reading the {name} Dataset failed ({type(e).__name__}: {e}); give a map-style "
                            "Dataset (len and [i]) of (image, label) items") from None
        if items and not (isinstance(items[0], (tuple, list)) and len(items[0]) >= 2):
            raise DataError(f"the {name} Dataset's items are {type(items[0]).__name__}; give (image, label) items")
        imgs = [_item_image(it[0]) for it in items]
        if len({i.shape for i in imgs}) > 1:
            raise DataError(f"the {name} Dataset's images have different shapes; resize them (e.g. a Resize "
                            "transform) to one size")
        parts += [np.stack(imgs) if imgs else np.zeros((0, 1, 1, 1)), [int(it[1]) for it in items]]
    classes = classes if classes is not None else getattr(train, "classes", None)
    return from_arrays(*parts, classes=classes, mean=mean, std=std, source=f"Dataset {type(train).__name__}")


def save(ds: CIFAR10, path: str | None = None) -> str:
    """Write ``ds`` where every rank can load it (default: the cache, named by its checksum) and return the
    path: ``Config(data=path)`` or ``--data PATH`` then loads it like any other source::

        cfg = Config(data=data.save(ds), model="mynets:net")
    """
    if path is None:
        path = os.path.join(resolve_cache_dir(None), f"cifar10-{ds.checksum[:16]}.npz")
    path = os.path.abspath(os.path.expanduser(path))
    if not path.endswith(".npz"):
        raise DataError(f"{path} does not end in .npz; name the file *.npz")
    write_cache(path, ds)
    if not os.path.isfile(path):
        raise DataError(f"could not write {path}; pass a writable path")
    return path
