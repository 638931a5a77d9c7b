"""Where the images come from: :func:`load` resolves a source name or path, decodes it once (see
:mod:`pilab.data.sources`), caches the arrays (see :mod:`pilab.data.cache`) and takes subsets; :func:`fetch`
downloads the official set::

    from pilab import data
    ds = data.load("embedded")                                   # the subset shipped in pilab/embedded/
    ds = data.load("cifar10", train_subset=10_000, seed=0)       # after `python -m pilab data fetch`

Decoding CIFAR-10 from each layout :func:`pilab.data.load` accepts, into a :class:`CIFAR10`.

    from pilab.data import sources
    ds = sources.decode_source("folder", "/data/cifar10-jpeg")     # kind as pilab.data.sources resolves it
    rgb = sources.decode_image(jpeg_bytes, "train/cat/0001.jpg")   # uint8 (H, W, 3), or (H, W, 1) if grey

Layouts: the official python batches (a ``cifar-10-batches-py`` directory or the ``.tar.gz``), an ImageFolder
directory or ``.tar.gz`` (``train/<class>/*.jpg|png``, ``test/<class>/*``), and the embedded subset (original
JPEG bytes concatenated with offsets, see ``scripts/make_embedded.py``). Images are ordered by class, then
file name, so the result never depends on directory listing or archive member order.

Your own data from Python: numpy arrays or torch Datasets made into a pilab data set, and saved as a
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

import io
import os
import pickle
import re
import tarfile
import zlib
from importlib.resources import files
from typing import Sequence

import numpy as np

from .cache import cache_path, cached_meta, cached_sizes, read_cache, resolve_cache_dir, write_cache
from .dataset import CIFAR10, CLASSES, DataError
from .shards import stratified_subset

OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
BATCHES_DIR = "cifar-10-batches-py"
_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
_BATCH_FILES = _TRAIN_BATCHES + ("test_batch", "batches.meta")
_IMAGE_EXT = (".jpg", ".jpeg", ".png")
LAYOUTS = ("the official cifar-10-batches-py directory (data_batch_1..5, test_batch), an ImageFolder "
           "directory / .tar.gz with train/<class>/*.jpg and test/<class>/*.jpg, or a .npz of pilab.data.save")


def decode_source(kind: str, path: str, *, image_size: int = 0) -> CIFAR10:
    """Decode ``path`` of ``kind`` (embedded | batches | folder | archive); DataError names what is wrong.
    ``image_size`` > 0: an ImageFolder's images resized to that many pixels square."""
    if image_size and kind in ("embedded", "batches") and image_size != 32:
        raise DataError(f"image_size={image_size} resizes ImageFolder images only; {path} is CIFAR-10 at 32x32: "
                        "drop --image-size, or give an ImageFolder")
    if kind == "embedded":
        return _decode_embedded(path)
    if kind == "batches":
        return _decode_batches_dir(path)
    if kind == "folder":
        return _decode_folder(path, image_size)
    return _decode_archive(path, image_size)


def decode_image(data: bytes, where: str, image_size: int = 0) -> np.ndarray:
    """One encoded image -> uint8 (H, W, C): C = 1 for a grey image, 3 otherwise (converted to RGB);
    resized to ``image_size`` square (bilinear) when that is > 0. Raises DataError for a bad file."""
    # Imported here: ranks that find the decoded arrays in the cache never load PIL.
    from PIL import Image

    try:
        # formats=: skip probing every PIL plugin; per-image overhead dominates for 32x32 images.
        with Image.open(io.BytesIO(data), formats=("JPEG", "PNG", "BMP", "WEBP")) as im:
            im.load()
            grey = im.mode in ("1", "L", "LA", "I", "I;16", "F")
            im2 = im if im.mode == ("L" if grey else "RGB") else im.convert("L" if grey else "RGB")
            if image_size and im2.size != (image_size, image_size):
                im2 = im2.resize((image_size, image_size), Image.BILINEAR)
            w, h = im2.size
            pixels = np.frombuffer(im2.tobytes(), dtype=np.uint8).reshape(h, w, 1 if grey else 3)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError... for bad files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"image {where} is corrupt or not an image ({msg}); replace or delete it") from None
    return pixels


def _stack(pixels: Sequence[np.ndarray], where: str = "") -> np.ndarray:
    """One uint8 (N, H, W, C) array; grey images become RGB when the set mixes both. Images of several
    sizes are refused (DataError: resize them with image_size)."""
    if not pixels:
        return np.zeros((0, 32, 32, 3), np.uint8)
    sizes = {p.shape[:2] for p in pixels}
    if len(sizes) > 1:
        a, b = sorted(sizes)[:2]
        raise DataError(f"images in {where or 'the data'} have different sizes ({a[0]}x{a[1]}, {b[0]}x{b[1]}, ...); "
                        "pass --image-size N (image_size=N) to resize them all to NxN")
    if len({p.shape[2] for p in pixels}) > 1:
        pixels = [np.repeat(p, 3, axis=2) if p.shape[2] == 1 else p for p in pixels]
    return np.ascontiguousarray(np.stack(pixels))


class _Collector:
    """Gathers (split, class, name, image) from an ImageFolder walk or archive stream, then orders them.
    Classes are the train/ folder names, sorted (CIFAR-10's ten sort into its label order)."""

    def __init__(self, where: str, image_size: int = 0):
        self.where, self.image_size = where, image_size
        self.items: dict[str, list] = {"train": [], "test": []}
        self.seen: dict[str, set] = {"train": set(), "test": set()}

    def add_dir(self, split: str, cls: str) -> None:
        self.seen[split].add(cls)

    def add(self, split: str, cls: str, name: str, data: bytes) -> None:
        self.add_dir(split, cls)
        img = decode_image(data, f"{split}/{cls}/{name} in {self.where}", self.image_size)
        self.items[split].append((cls, name, img))

    def finish(self, what: str) -> CIFAR10:
        out = []
        for split in ("train", "test"):
            if not self.items[split]:
                raise DataError(f"{self.where} has no images under {split}/; add them as "
                                f"{split}/<class>/*.jpg|png for each class")
        classes = tuple(sorted(self.seen["train"]))
        if len(classes) < 2:
            raise DataError(f"{self.where} has {len(classes)} class folder under train/; a classifier needs "
                            "at least 2: add train/<class>/ folders, one per class")
        for split in ("train", "test"):
            other = "test" if split == "train" else "train"
            missing = sorted(self.seen[other] - self.seen[split])
            if missing:
                folders = ", ".join(f"{split}/{c}" for c in missing)
                raise DataError(f"{self.where} lacks class folder(s) {folders}; add them (train/ and test/ "
                                f"need the same class folders: {' '.join(sorted(self.seen[other]))})")
            # Order by class, then file name: independent of archive member or directory listing order.
            items = sorted(self.items[split], key=lambda t: (classes.index(t[0]), _natural(t[1])))
            out.append(_stack([t[2] for t in items], f"{self.where}"))
            out.append(np.array([classes.index(t[0]) for t in items], dtype=np.int64))
        if out[0].shape[1:] != out[2].shape[1:]:
            raise DataError(f"train images in {self.where} are {out[0].shape[1:]} (HxWxC), test images "
                            f"{out[2].shape[1:]}; pass --image-size N to resize them all to NxN")
        return CIFAR10.from_arrays(*out, source=f"{what} {self.where} ({len(out[1])} train / {len(out[3])} test)",
                                   classes=classes)


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(_IMAGE_EXT)


def _decode_folder(path: str, image_size: int = 0) -> CIFAR10:
    col = _Collector(path, image_size)
    for split in ("train", "test"):
        top = os.path.join(path, split)
        if not os.path.isdir(top):
            raise DataError(f"{path} has no {split}/ folder; expected {LAYOUTS}")
        for cls in sorted(os.listdir(top)):
            full = os.path.join(top, cls)
            if cls.startswith(".") or not os.path.isdir(full):
                continue
            col.add_dir(split, cls)
            for name in sorted(os.listdir(full)):
                if _is_image(name):
                    with open(os.path.join(full, name), "rb") as f:
                        col.add(split, cls, name, f.read())
    return col.finish("ImageFolder directory")


def _decode_archive(path: str, image_size: int = 0) -> CIFAR10:
    """Stream a .tar.gz once: ImageFolder members are decoded as they pass, python batches collected."""
    col, batches, prefix = _Collector(path, image_size), {}, None
    try:
        with tarfile.open(path, "r|*") as tar:
            for m in tar:
                parts = [p for p in m.name.split("/") if p not in ("", ".")]
                if not parts or any(p.startswith(".") for p in parts):
                    continue
                if m.isfile() and parts[-1] in _BATCH_FILES:
                    batches[parts[-1]] = tar.extractfile(m).read()
                    continue
                # train/<class>/<file>, optionally below one top-level folder (e.g. cifar10/train/...).
                i = 0 if parts[0] in ("train", "test") else 1
                if len(parts) <= i or parts[i] not in ("train", "test"):
                    continue
                if prefix is None:
                    prefix = parts[:i]
                if parts[:i] != prefix:
                    raise DataError(f"{path} holds train/ or test/ under several top folders; "
                                    "pack one ImageFolder tree per archive")
                rest = parts[i:]
                if m.isdir():
                    if len(rest) == 2:
                        col.add_dir(rest[0], rest[1])
                    continue
                if not m.isfile() or not _is_image(rest[-1]):
                    continue
                if len(rest) != 3:
                    raise DataError(f"image {m.name} in {path} is not directly inside a class folder; "
                                    "use train/<class>/<image> and test/<class>/<image>")
                col.add(rest[0], rest[1], rest[2], tar.extractfile(m).read())
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{path} is not a readable tar.gz archive ({e}); re-download or re-pack it") from None
    if batches and not (col.items["train"] or col.items["test"]):
        return _decode_batches(lambda name: batches.get(name), f"CIFAR-10 python archive {path}")
    return col.finish("ImageFolder archive")


def _decode_batches_dir(path: str) -> CIFAR10:
    def read(name):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            return None
        with open(p, "rb") as f:
            return f.read()

    return _decode_batches(read, f"CIFAR-10 python batches {path}")


class _BatchUnpickler(pickle.Unpickler):
    """The official batches are pickles: allow only what they contain (no arbitrary code on load)."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")


def _decode_batches(read, where: str) -> CIFAR10:
    """Official layout: pickled dicts, b'data' (N, 3072) uint8 row-major CHW, b'labels' list of ints."""
    fix = f"re-download {OFFICIAL_URL} and unpack it"

    def batch(name):
        raw = read(name)
        if raw is None:
            raise DataError(f"{where} lacks {name}; {fix}")
        try:
            d = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
            x = np.asarray(d[b"data"], dtype=np.uint8)
            y = np.asarray(d[b"labels"], dtype=np.int64)
        except Exception as e:
            raise DataError(f"{name} in {where} is not a readable CIFAR-10 batch ({e}); {fix}") from None
        bad_labels = y.size and not 0 <= y.min() <= y.max() < 10
        if x.ndim != 2 or x.shape[1] != 3072 or len(y) != len(x) or bad_labels:
            raise DataError(f"{name} in {where} does not hold (N, 3072) images with labels 0..9; {fix}")
        return x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y

    meta = read("batches.meta")
    if meta is not None:
        try:
            names = _BatchUnpickler(io.BytesIO(meta), encoding="bytes").load()[b"label_names"]
            names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
        except Exception as e:
            raise DataError(f"batches.meta in {where} is not readable ({e}); {fix}") from None
        if names != CLASSES:
            raise DataError(f"batches.meta in {where} lists classes {names}, not CIFAR-10's; {fix}")
    train = [batch(n) for n in _TRAIN_BATCHES]
    x_test, y_test = batch("test_batch")
    x_train, y_train = np.concatenate([b[0] for b in train]), np.concatenate([b[1] for b in train])
    return CIFAR10.from_arrays(x_train, y_train, x_test, y_test,
                 source=f"{where} ({len(y_train)} train / {len(y_test)} test)")


def _decode_embedded(path: str) -> CIFAR10:
    """The shipped subset: original JPEG bytes, concatenated, with offsets (see scripts/make_embedded.py)."""
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            blob, offsets, labels = z["data"], z["offsets"], z["labels"]
            names, n_train, sha = z["names"], int(z["n_train"]), str(z["archive_sha256"])
    except Exception as e:
        raise DataError(f"the embedded subset {path} is unreadable ({e}); reinstall pilab or run "
                        "scripts/make_embedded.py") from None
    imgs = _stack([decode_image(blob[offsets[i]:offsets[i + 1]].tobytes(), f"{names[i]} in {path}")
                   for i in range(len(labels))], path)
    return CIFAR10.from_arrays(imgs[:n_train], labels[:n_train], imgs[n_train:], labels[n_train:],
                 source=f"pilab embedded CIFAR-10 subset ({n_train} train / {len(labels) - n_train} test "
                        f"JPEGs from cifar10-jpeg.tar.gz sha256 {sha[:12]}…)")


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
        ds = load(data.save(my_arrays))             # arrays from Python (pilab.data.sources), as a file
    """
    _check_counts(train_subset, test_subset, seed)
    _check_size(image_size)
    cache = resolve_cache_dir(cache_dir)
    kind, path = resolve_source(source, cache)
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
    kind, path = resolve_source(source, cache)
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


def resolve_source(source: str, cache: str) -> tuple[str, str]:
    """Map a source name or path to (kind, absolute path); kind: embedded | batches | folder | archive."""
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(f"data source {source!r} is not a string; pass 'embedded', 'cifar10' or a path")
    source = os.fspath(source)
    if source == "embedded":
        path = embedded_path()
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


def embedded_path() -> str:
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
