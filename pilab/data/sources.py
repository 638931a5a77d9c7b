"""Where the images come from: :func:`load` resolves a source name or path, decodes it once (see
:mod:`pilab.data.decode`), caches the arrays (see :mod:`pilab.data.cache`) and takes subsets; :func:`fetch`
downloads the official set::

    from pilab import data
    ds = data.load("embedded")                                   # the subset shipped in pilab/embedded/
    ds = data.load("cifar10", train_subset=10_000, seed=0)       # after `python -m pilab data fetch`
"""
from __future__ import annotations

import os
import tarfile
from importlib.resources import files

import numpy as np

from .cache import cache_path, cached_meta, cached_sizes, read_cache, resolve_cache_dir, write_cache
from .dataset import CIFAR10, DataError
from .decode import BATCHES_DIR, LAYOUTS, OFFICIAL_URL, decode_source
from .shards import stratified_subset

_EMBEDDED_FILE = "cifar10_subset.npz"  # in the pilab.embedded package data (see pyproject.toml)


def load(source: str = "embedded", *, cache_dir: str | None = None,
         train_subset: int = 0, test_subset: int = 0, seed: int = 0, image_size: int = 0) -> CIFAR10:
    """Load an image classification set from ``source``, decoding once and caching the arrays.

    ``train_subset`` / ``test_subset`` (0 = all) take a class-stratified subset chosen by ``seed``, after
    the cache. ``image_size`` > 0 resizes every image of an ImageFolder to that many pixels square when
    decoding (needed when its images differ in size). Several ranks may load at once (each cache write is
    atomic: temp file + ``os.replace``), but each then decodes; under MPI let one rank per node load
    first, barrier, then the rest hit the cache::

        ds = load("embedded")
        ds = load("/data/cifar10-jpeg.tar.gz", train_subset=10_000)
        ds = load("cifar10")          # after `python -m pilab data fetch`
        ds = load("/data/flowers", image_size=64)   # an ImageFolder of any classes, resized to 64x64
        ds = load(data.save(my_arrays))             # arrays from Python (pilab.data.arrays), as a file
    """
    _check_counts(train_subset, test_subset, seed)
    _check_size(image_size)
    cache = resolve_cache_dir(cache_dir)
    kind, path = _resolve(source, cache)
    if kind == "arrays":  # a data set saved by pilab.data.save: it is its own cache file
        ds = read_cache(path)
        if ds is None:
            raise DataError(f"{path} is not a data set saved by pilab.data.save (or it is corrupt); save it again")
    else:
        cache_file = cache_path(cache, kind, path, _variant(image_size))
        ds = read_cache(cache_file)
        if ds is None:
            ds = decode_source(kind, path, image_size=image_size)
            write_cache(cache_file, ds)
    return _subset(ds, train_subset, test_subset, seed)


def _variant(image_size: int) -> str:
    return f"{image_size}x{image_size}" if image_size else ""


def _check_size(image_size) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < 0:
        raise DataError(f"image_size={image_size!r} must be an integer >= 0 (0: keep the images' size)")


def _cache_file(source, cache: str, image_size: int) -> str:
    kind, path = _resolve(source, cache)
    return path if kind == "arrays" else cache_path(cache, kind, path, _variant(image_size))


def train_size(source: str = "embedded", *, cache_dir: str | None = None,
               train_subset: int = 0, test_subset: int = 0, seed: int = 0, image_size: int = 0) -> int:
    """How many training images ``load`` with the same arguments gives, reading only the labels of an
    already cached source: a launcher checks ``--np`` against it without holding the images::

        train_size("/data/cifar10-jpeg.tar.gz", train_subset=10_000)   # 10000

    A source not cached yet, or a subset larger than the source, goes through ``load`` itself: it is
    decoded and cached (the ranks then read the cache), and ``load``'s errors are raised."""
    _check_counts(train_subset, test_subset, seed)
    _check_size(image_size)
    cache = resolve_cache_dir(cache_dir)
    sizes = cached_sizes(_cache_file(source, cache, image_size))
    if sizes is None or train_subset > sizes[0] or test_subset > sizes[1]:
        return len(load(source, cache_dir=cache_dir, train_subset=train_subset, test_subset=test_subset,
                        seed=seed, image_size=image_size).y_train)
    return train_subset or sizes[0]


def describe(source: str = "embedded", *, cache_dir: str | None = None, image_size: int = 0) -> dict:
    """Classes, image shape (C, H, W) and training images of ``source``, from the cache's labels and one
    array header once it is cached (decoding it first otherwise): what ``train --np`` checks your model
    against before any rank starts::

        describe("/data/flowers", image_size=64)   # {"classes": (...), "image_shape": (3, 64, 64), ...}
    """
    _check_size(image_size)
    cache = resolve_cache_dir(cache_dir)
    meta = cached_meta(_cache_file(source, cache, image_size))
    if meta is None:
        ds = load(source, cache_dir=cache_dir, image_size=image_size)
        meta = {"classes": ds.classes, "image_shape": ds.image_shape, "n_train": len(ds.y_train)}
    return meta


def cached_counts(source: str, *, cache_dir: str | None = None) -> tuple[int, int] | None:
    """(training, test) images of the whole source if it is cached already (its labels alone are read),
    else None: what the performance model needs for "all images" without decoding anything::

        cached_counts("/data/cifar10-jpeg.tar.gz")   # (50000, 10000) once pilab has loaded it
    """
    try:
        cache = resolve_cache_dir(cache_dir)
        return cached_sizes(_cache_file(source, cache, 0))
    except (DataError, OSError):
        return None


def _check_counts(train_subset, test_subset, seed) -> None:
    for name, value in (("train_subset", train_subset), ("test_subset", test_subset), ("seed", seed)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            fix = "pass 0 for all images" if name.endswith("subset") else "pass a non-negative integer"
            raise DataError(f"{name}={value!r} must be an integer >= 0; {fix}")


def _resolve(source: str, cache: str) -> tuple[str, str]:
    """Map a source name or path to (kind, absolute path); kind: embedded | batches | folder | archive."""
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(f"data source {source!r} is not a string; pass 'embedded', 'cifar10' or a path")
    source = os.fspath(source)
    if source == "embedded":
        path = _embedded_path()
        if not os.path.isfile(path):
            raise DataError(f"the embedded subset {path} is missing; reinstall pilab or run "
                            "scripts/make_embedded.py")
        return "embedded", path
    if source == "cifar10":
        path = os.path.join(cache, BATCHES_DIR)
        if not os.path.isdir(path):
            raise DataError(f"CIFAR-10 has not been fetched into {cache}; run `python -m pilab data fetch` "
                            f"(or pass the path of a {BATCHES_DIR} directory)")
        return "batches", path
    path = os.path.abspath(os.path.expanduser(source))
    if not os.path.exists(path):
        raise DataError(f"data path {path} does not exist; pass 'embedded', 'cifar10' or an existing "
                        "directory or .tar.gz")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "data_batch_1")):
            return "batches", path
        if os.path.isfile(os.path.join(path, BATCHES_DIR, "data_batch_1")):
            return "batches", os.path.join(path, BATCHES_DIR)
        if os.path.isdir(os.path.join(path, "train")) or os.path.isdir(os.path.join(path, "test")):
            return "folder", path
        raise DataError(f"directory {path} is neither known layout; pass one of: {LAYOUTS}")
    if path.endswith(".npz"):
        return "arrays", path
    if not tarfile.is_tarfile(path):
        raise DataError(f"{path} is not a readable tar.gz archive; pass one of: {LAYOUTS}")
    return "archive", path


def _embedded_path() -> str:
    """The shipped subset's file: package data of ``pilab`` (found from any working directory)."""
    try:
        return str(files("pilab") / "embedded" / _EMBEDDED_FILE)
    except TypeError:  # unusual loaders: fall back to the package's own directory
        pilab_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return os.path.join(pilab_dir, "embedded", _EMBEDDED_FILE)


def _subset(ds: CIFAR10, n_train: int, n_test: int, seed: int) -> CIFAR10:
    if not n_train and not n_test:
        return ds
    parts, notes = [ds.x_train, ds.y_train, ds.x_test, ds.y_test], []
    for i, (name, n) in enumerate((("train_subset", n_train), ("test_subset", n_test))):
        if not n:
            continue
        y = parts[2 * i + 1]
        if n > len(y):
            raise DataError(f"{name}={n} exceeds the {len(y)} images available in {ds.source}; "
                            f"use at most {len(y)}, or 0 for all")
        idx = stratified_subset(y, n, seed)
        parts[2 * i], parts[2 * i + 1] = parts[2 * i][idx], y[idx]
        notes.append(f"{name}={n}")
    return CIFAR10.from_arrays(*parts, source=f"{ds.source} [{', '.join(notes)}, seed={seed}]")


def fetch(root: str | None = None) -> str:
    """Download the official CIFAR-10 python version into ``root`` (default: the cache dir) with
    torchvision and return its ``cifar-10-batches-py`` path; ``load("cifar10")`` then finds it::

        python -m pilab data fetch
    """
    root = resolve_cache_dir(root)
    manual = (f"download {OFFICIAL_URL} by hand, unpack it, and pass the {BATCHES_DIR} directory as the "
              "data path")
    try:
        import torchvision  # the optional `vision` extra: only this download needs it
    except ImportError:
        # pilab is not on PyPI, so `pip install 'pilab[vision]'` finds nothing: name what does install
        raise DataError("torchvision is not installed, so pilab cannot download CIFAR-10; run "
                        "`pip install torchvision` (beside a CPU-only torch: add --index-url "
                        "https://download.pytorch.org/whl/cpu; from a clone: pip install -e '.[vision]') "
                        f"and retry, or {manual}") from None
    try:
        os.makedirs(root, exist_ok=True)
        torchvision.datasets.CIFAR10(root, train=True, download=True)
    except (OSError, RuntimeError) as e:  # URLError is an OSError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"downloading CIFAR-10 into {root} failed ({msg}); check the network, "
                        f"or {manual}") from None
    return os.path.join(root, BATCHES_DIR)
