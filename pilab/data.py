"""CIFAR-10 for data-parallel training: loading, caching, sharding across ranks, batched augmentation.

One process per rank calls the same functions; only the rank changes what it gets::

    from pilab import data
    ds = data.load("embedded")                    # shipped 5,000/1,000 subset; or "cifar10", or a path
    loader = data.ShardLoader(ds, np_=comm.size, rank=comm.rank, batch=32, seed=0, policy="static")
    for epoch in range(epochs):
        for step, x, y in loader.epoch(epoch):    # x float32 (B,3,32,32) channels_last, y int64 (B,)
            ...
    sl = data.test_shard(len(ds.y_test), comm.size, comm.rank)   # evaluate x_test[sl], reduce sums

Under ``mpiexec -n 4 python -m pilab train`` every rank sees the same shards and step counts, because all
randomness derives from (seed, epoch, step, rank) and never from global RNG state.

Sources for :func:`load` (decoded once, then cached as an ``.npz`` in :func:`default_cache_dir`):

- ``"embedded"``: the class-balanced subset shipped in ``pilab/embedded/`` (see its README);
- ``"cifar10"``: the official python batches placed in the cache by ``python -m pilab data fetch``;
- a path to the official ``cifar-10-batches-py`` directory (or its ``.tar.gz``), or to an ImageFolder
  directory / ``.tar.gz`` with ``train/<class>/*.jpg|png`` and ``test/<class>/*``.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import tarfile
import tempfile
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

CLASSES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer",
                            "dog", "frog", "horse", "ship", "truck")
POLICIES = ("static", "reshuffle")

# Per-channel statistics of the 50,000 official CIFAR-10 training images (pixel values in [0, 1]).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4  # random-crop padding, pixels on each side (reflect)

OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
BATCHES_DIR = "cifar-10-batches-py"
_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
_BATCH_FILES = _TRAIN_BATCHES + ("test_batch", "batches.meta")
_IMAGE_EXT = (".jpg", ".jpeg", ".png")
_LAYOUTS = ("the official cifar-10-batches-py directory (data_batch_1..5, test_batch), or an ImageFolder "
            "directory / .tar.gz with train/<class>/*.jpg and test/<class>/*.jpg")
_CACHE_VERSION = 1  # bump when decoding changes, so old caches are not reused

# Domain tags keep the random streams for different purposes independent under the same seed.
_TAG_SUBSET, _TAG_SHARDS, _TAG_STATIC, _TAG_RESHUFFLE, _TAG_AUG = 1, 2, 3, 4, 5


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

    def __repr__(self) -> str:
        return (f"CIFAR10({len(self.y_train)} train / {len(self.y_test)} test, "
                f"source={self.source!r}, checksum={self.checksum[:12]}…)")


# ----------------------------------------------------------------------------------------------------
# Loading and caching
# ----------------------------------------------------------------------------------------------------
def default_cache_dir() -> str:
    """``$PILAB_CACHE`` if set, else ``~/.cache/pilab``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("PILAB_CACHE") or "~/.cache/pilab"))


def load(source: str = "embedded", *, cache_dir: str | None = None,
         train_subset: int = 0, test_subset: int = 0, seed: int = 0) -> CIFAR10:
    """Load CIFAR-10 from ``source``, decoding once and caching the arrays.

    ``train_subset`` / ``test_subset`` (0 = all) take a class-stratified subset chosen by ``seed``, after
    the cache. Several ranks may load at once (each cache write is atomic: temp file + ``os.replace``),
    but each then decodes; under MPI let one rank per node load first, barrier, then the rest hit the cache::

        ds = load("embedded")
        ds = load("/data/cifar10-jpeg.tar.gz", train_subset=10_000)
        ds = load("cifar10")          # after `python -m pilab data fetch`
    """
    for name, value in (("train_subset", train_subset), ("test_subset", test_subset), ("seed", seed)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            fix = "pass 0 for all images" if name.endswith("subset") else "pass a non-negative integer"
            raise DataError(f"{name}={value!r} must be an integer >= 0; {fix}")
    cache = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    kind, path = _resolve(source, cache)
    cache_file = os.path.join(cache, f"cifar10-{_cache_key(kind, path)}.npz")
    ds = _read_cache(cache_file)
    if ds is None:
        ds = _decode_source(kind, path)
        _write_cache(cache_file, ds)
    return _subset(ds, train_subset, test_subset, seed)


# what load() writes into the cache directory: decoded arrays and, after a crash, their temp files;
# never anything else there (`data fetch` puts the downloaded batches in the same directory)
_CACHE_NAME = re.compile(r"^(?:\.tmp-)?cifar10-[0-9a-f]{16}\.npz(?:-[^/]*\.npz)?$")


def cache_entries(cache_dir: str | None = None) -> list[dict]:
    """The decoded data sets in the cache, newest first: path, bytes, modified (epoch s), source.

        for e in cache_entries():
            print(e["bytes"] >> 20, "MiB", e["source"])

    Each distinct source (and each new version of one: the key includes size and mtime) adds a file;
    a full CIFAR-10 is ~185 MB. ``clear_cache`` removes them; the next ``load`` decodes again.
    """
    cache = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    if not os.path.isdir(cache):
        return []
    out = []
    for name in os.listdir(cache):
        path = os.path.join(cache, name)
        if not (_CACHE_NAME.match(name) and os.path.isfile(path)):
            continue
        st = os.stat(path)
        try:
            with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
                source = str(z["source"])
        except Exception:  # a temp file of an interrupted write, or a corrupt entry
            source = "(incomplete or corrupt: load() rebuilds it)"
        out.append({"path": path, "bytes": st.st_size, "modified": st.st_mtime, "source": source})
    return sorted(out, key=lambda e: -e["modified"])


def clear_cache(cache_dir: str | None = None) -> list[str]:
    """Delete the cached arrays (only files ``load`` writes; downloads stay) and return their paths."""
    removed = []
    for e in cache_entries(cache_dir):
        try:
            os.unlink(e["path"])
            removed.append(e["path"])
        except FileNotFoundError:  # another process cleared it first
            pass
    return removed


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
        raise DataError(f"directory {path} is neither known layout; pass one of: {_LAYOUTS}")
    if not tarfile.is_tarfile(path):
        raise DataError(f"{path} is not a readable tar.gz archive; pass one of: {_LAYOUTS}")
    return "archive", path


def _embedded_path() -> str:
    try:
        from importlib.resources import files

        return str(files("pilab") / "embedded" / "cifar10_subset.npz")
    except (ImportError, TypeError):  # unusual loaders: fall back to the module's own directory
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), "embedded", "cifar10_subset.npz")


def _cache_key(kind: str, path: str) -> str:
    """Key from the source's absolute path, size and mtime (summed / max over a directory's files)."""
    if os.path.isdir(path):
        size, mtime = 0, os.stat(path).st_mtime_ns
        for root, _, files in os.walk(path):
            for f in files:
                st = os.stat(os.path.join(root, f))
                size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
    else:
        st = os.stat(path)
        size, mtime = st.st_size, st.st_mtime_ns
    text = f"v{_CACHE_VERSION}|{kind}|{path}|{size}|{mtime}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def _checksum(arrays: Sequence[np.ndarray]) -> str:
    """sha256 over dtype, shape and bytes of each array, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def _make(x_train, y_train, x_test, y_test, source: str) -> CIFAR10:
    arrays = [np.ascontiguousarray(x_train, dtype=np.uint8), np.ascontiguousarray(y_train, dtype=np.int64),
              np.ascontiguousarray(x_test, dtype=np.uint8), np.ascontiguousarray(y_test, dtype=np.int64)]
    return CIFAR10(*arrays, classes=CLASSES, source=source, checksum=_checksum(arrays))


def _read_cache(path: str) -> CIFAR10 | None:
    """The cached data set, or None when absent or corrupt (then the caller decodes again)."""
    if not os.path.isfile(path):
        return None
    try:
        # Our own file object: np.load leaks its handle when the zip is truncated.
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            arrays = [z[k] for k in _ARRAYS]
            checksum, source = str(z["checksum"]), str(z["source"])
        ok = (arrays[0].dtype == np.uint8 and arrays[0].shape[1:] == (32, 32, 3)
              and arrays[2].dtype == np.uint8 and arrays[2].shape[1:] == (32, 32, 3)
              and _checksum(arrays) == checksum)
    except Exception:  # truncated zip, bad CRC, missing key: all mean "rebuild"
        ok = False
    if not ok:
        warnings.warn(f"cache {path} is corrupt; decoding the source again", RuntimeWarning, stacklevel=3)
        return None
    return CIFAR10(*arrays, classes=CLASSES, source=source, checksum=checksum)


def _write_cache(path: str, ds: CIFAR10) -> None:
    """Write atomically: a temp file in the same directory, then os.replace (no half-written cache)."""
    d = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", suffix=".npz", dir=d)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test,
                     checksum=np.array(ds.checksum), source=np.array(ds.source))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache holds public data
        os.replace(tmp, path)
        tmp = None
    except OSError as e:  # a read-only home should not stop training: only the cache is lost
        warnings.warn(f"could not write the data cache {path} ({e}); set PILAB_CACHE to a writable "
                      "directory to avoid decoding again", RuntimeWarning, stacklevel=3)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


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
    return _make(*parts, source=f"{ds.source} [{', '.join(notes)}, seed={seed}]")


# ---- decoding ---------------------------------------------------------------------------------------
def _decode_source(kind: str, path: str) -> CIFAR10:
    if kind == "embedded":
        return _decode_embedded(path)
    if kind == "batches":
        return _decode_batches_dir(path)
    if kind == "folder":
        return _decode_folder(path)
    return _decode_archive(path)


def _decode_image(data: bytes, where: str) -> bytes:
    """One encoded image -> its 32*32*3 RGB bytes (HWC). Raises DataError for anything else."""
    from PIL import Image

    try:
        # formats=: skip probing every PIL plugin; per-image overhead dominates for 32x32 images.
        with Image.open(io.BytesIO(data), formats=("JPEG", "PNG", "BMP", "WEBP")) as im:
            im.load()
            size, mode = im.size, im.mode
            pixels = im.tobytes() if (size == (32, 32) and mode == "RGB") else None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError... for bad files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"image {where} is corrupt or not an image ({msg}); replace or delete it") from None
    if pixels is None:
        raise DataError(f"image {where} is {size[0]}x{size[1]} {mode}, not 32x32 RGB; convert it "
                        "(e.g. PIL: im.convert('RGB').resize((32, 32))) or delete it")
    return pixels


def _stack(pixels: Sequence[bytes]) -> np.ndarray:
    # bytearray: the array owns writable memory (torch.from_numpy warns on read-only arrays).
    return np.frombuffer(bytearray().join(pixels), dtype=np.uint8).reshape(-1, 32, 32, 3)


class _Collector:
    """Gathers (split, class, name, image) from an ImageFolder walk or archive stream, then orders them."""

    def __init__(self, where: str):
        self.where = where
        self.items: dict[str, list] = {"train": [], "test": []}
        self.seen: dict[str, set] = {"train": set(), "test": set()}

    def add_dir(self, split: str, cls: str) -> None:
        self._check_class(split, cls)
        self.seen[split].add(cls)

    def add(self, split: str, cls: str, name: str, data: bytes) -> None:
        self.add_dir(split, cls)
        img = _decode_image(data, f"{split}/{cls}/{name} in {self.where}")
        self.items[split].append((CLASSES.index(cls), name, img))

    def _check_class(self, split: str, cls: str) -> None:
        if cls not in CLASSES:
            raise DataError(f"folder {split}/{cls} in {self.where} is not a CIFAR-10 class; rename or "
                            f"remove it (expected class folders: {' '.join(CLASSES)})")

    def finish(self, what: str) -> CIFAR10:
        out = []
        for split in ("train", "test"):
            if not self.items[split]:
                raise DataError(f"{self.where} has no images under {split}/; add them as "
                                f"{split}/<class>/*.jpg|png for the ten CIFAR-10 classes")
            missing = [c for c in CLASSES if c not in self.seen[split]]
            if missing:
                folders = ", ".join(f"{split}/{c}" for c in missing)
                raise DataError(f"{self.where} lacks class folder(s) {folders}; "
                                f"add them (all ten CIFAR-10 classes are needed: {' '.join(CLASSES)})")
            # Order by class, then file name: independent of archive member or directory listing order.
            items = sorted(self.items[split], key=lambda t: (t[0], _natural(t[1])))
            out.append(_stack([t[2] for t in items]))
            out.append(np.array([t[0] for t in items], dtype=np.int64))
        return _make(*out, source=f"{what} {self.where} ({len(out[1])} train / {len(out[3])} test)")


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(_IMAGE_EXT)


def _decode_folder(path: str) -> CIFAR10:
    col = _Collector(path)
    for split in ("train", "test"):
        top = os.path.join(path, split)
        if not os.path.isdir(top):
            raise DataError(f"{path} has no {split}/ folder; expected {_LAYOUTS}")
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


def _decode_archive(path: str) -> CIFAR10:
    """Stream a .tar.gz once: ImageFolder members are decoded as they pass, python batches collected."""
    col, batches, prefix = _Collector(path), {}, None
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
    return _make(x_train, y_train, x_test, y_test,
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
    imgs = _stack([_decode_image(blob[offsets[i]:offsets[i + 1]].tobytes(), f"{names[i]} in {path}")
                   for i in range(len(labels))])
    return _make(imgs[:n_train], labels[:n_train], imgs[n_train:], labels[n_train:],
                 source=f"pilab embedded CIFAR-10 subset ({n_train} train / {len(labels) - n_train} test "
                        f"JPEGs from cifar10-jpeg.tar.gz sha256 {sha[:12]}…)")


# ----------------------------------------------------------------------------------------------------
# Subsets and sharding (index level, identical on every rank)
# ----------------------------------------------------------------------------------------------------
def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def _class_order(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Indices grouped by class (ascending class), shuffled inside each class; and their class ids."""
    _, inv = np.unique(labels, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.lexsort((rng.random(len(inv)), inv))
    return order, inv[order]


def stratified_subset(labels: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of ``n`` samples, class-balanced (per-class counts differ by <= 1 where classes
    have enough samples), deterministic from ``seed``::

        idx = stratified_subset(ds.y_train, 5000)     # 500 per class
    """
    labels = np.asarray(labels)
    if not 0 <= n <= len(labels):
        raise DataError(f"subset of {n} is outside 0..{len(labels)} (the samples available); "
                        f"use at most {len(labels)}")
    rng = _rng(seed, _TAG_SUBSET)
    order, cls = _class_order(labels, rng)
    n_cls = int(cls.max()) + 1 if len(cls) else 0
    starts = np.searchsorted(cls, np.arange(n_cls))
    pos_in_class = np.arange(len(order)) - starts[cls]
    # Round robin over classes (class order shuffled, so the remainder lands on random classes).
    key = pos_in_class * n_cls + rng.permutation(n_cls)[cls]
    return np.sort(order[np.argsort(key, kind="stable")[:n]]).astype(np.int64)


def static_shards(labels: np.ndarray, np_: int, seed: int = 0) -> list[np.ndarray]:
    """Partition ``range(len(labels))`` into ``np_`` class-stratified shards (sorted index arrays).

    Shard sizes differ by <= 1, and so do each class's counts across shards; the result depends only on
    (labels, np_, seed), so every rank computes the same partition without communicating.
    """
    labels = np.asarray(labels)
    _check_np(len(labels), np_)
    order, _ = _class_order(labels, _rng(seed, _TAG_SHARDS))
    # Deal the class-grouped sequence round robin: each class is spread evenly over the shards.
    return [np.sort(order[r::np_]).astype(np.int64) for r in range(np_)]


def _check_np(n: int, np_: int, rank: int = 0, batch: int = 1, policy: str = "static") -> None:
    if policy not in POLICIES:
        raise DataError(f"sharding policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    if not isinstance(np_, (int, np.integer)) or np_ < 1:
        raise DataError(f"np={np_!r} must be an integer >= 1")
    if not 0 <= rank < np_:
        raise DataError(f"rank={rank} is outside 0..{np_ - 1}; pass the MPI rank of this process")
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise DataError(f"batch={batch!r} must be an integer >= 1")
    if np_ > n:
        raise DataError(f"np={np_} exceeds the {n} training images; use fewer processes")


def _shard_sizes(n: int, np_: int) -> list[int]:
    return [(n - r + np_ - 1) // np_ for r in range(np_)]


def epoch_accounting(n_or_labels, np_: int, batch: int, policy: str, seed: int = 0) -> dict:
    """Steps per epoch (the same on every rank), images used and left over, per-rank shard sizes.

    ``shard_sizes`` are the images each rank draws its batches from in an epoch: its static shard, or
    its slice ``r, r+np, ...`` of the shared permutation. Leftover images are skipped, never padded::

        epoch_accounting(50_000, 7, 32, "static")
        # {'steps': 223, 'used': 49952, 'leftover': 48, 'shard_sizes': [7143, 7143, ..., 7142]}
    """
    n = int(n_or_labels) if np.ndim(n_or_labels) == 0 else len(n_or_labels)
    _check_np(n, np_, 0, batch, policy)
    sizes = _shard_sizes(n, np_)  # static_shards deals round robin, so sizes depend on n only
    steps = min(sizes) // batch if policy == "static" else n // (np_ * batch)
    used = steps * batch * np_
    return {"steps": steps, "used": used, "leftover": n - used, "shard_sizes": sizes}


def _static_local(shard_size: int, steps: int, batch: int, epoch: int, seed: int, rank: int) -> np.ndarray:
    """(steps, batch) positions inside this rank's shard: a fresh shuffle each epoch."""
    perm = _rng(seed, _TAG_STATIC, epoch, rank).permutation(shard_size)
    return perm[:steps * batch].reshape(steps, batch).astype(np.int64)


def _reshuffle_global(n: int, np_: int, rank: int, steps: int, batch: int, epoch: int,
                      seed: int) -> np.ndarray:
    """One permutation of all n per epoch (same on every rank); rank r takes positions r, r+np, ..."""
    perm = _rng(seed, _TAG_RESHUFFLE, epoch).permutation(n)
    return perm[:steps * batch * np_][rank::np_].reshape(steps, batch).astype(np.int64)


def epoch_batches(labels: np.ndarray, np_: int, rank: int, batch: int, epoch: int,
                  seed: int = 0, policy: str = "static") -> np.ndarray:
    """(steps, batch) int64 global training-set indices that ``rank`` uses in ``epoch``::

        idx = epoch_batches(ds.y_train, np_=4, rank=1, batch=32, epoch=0)   # idx[step] -> one batch
    """
    labels = np.asarray(labels)
    _check_np(len(labels), np_, rank, batch, policy)
    steps = epoch_accounting(len(labels), np_, batch, policy, seed)["steps"]
    if policy == "static":
        shard = static_shards(labels, np_, seed)[rank]
        return shard[_static_local(len(shard), steps, batch, epoch, seed, rank)]
    return _reshuffle_global(len(labels), np_, rank, steps, batch, epoch, seed)


def test_shard(n_test: int, np_: int, rank: int) -> slice:
    """Contiguous slice of the test set for ``rank``: sizes differ by <= 1, every image once overall,
    so per-rank metrics (correct counts, loss sums) are combined with a sum-allreduce."""
    if np_ < 1 or not 0 <= rank < np_:
        raise DataError(f"rank={rank} is outside 0..{np_ - 1}; pass the MPI rank and size")
    q, r = divmod(int(n_test), np_)
    start = rank * q + min(rank, r)
    return slice(start, start + q + (rank < r))


# ----------------------------------------------------------------------------------------------------
# Augmentation and input conversion (batched tensor ops, no per-image Python loop)
# ----------------------------------------------------------------------------------------------------
_SCALE = torch.tensor([1.0 / (255.0 * s) for s in STD], dtype=torch.float32)
_SHIFT = torch.tensor([-m / s for m, s in zip(MEAN, STD)], dtype=torch.float32)


def _check_images(x: torch.Tensor) -> None:
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.ndim != 4
            or tuple(x.shape[1:]) != (32, 32, 3)):
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise DataError(f"expected a uint8 tensor (B, 32, 32, 3), got {got}; pass rows of CIFAR10.x_train")


def _normalise(x_nhwc: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW view in channels_last memory (no copy beyond the float conversion)."""
    y = x_nhwc.to(torch.float32).mul_(_SCALE).add_(_SHIFT)
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
    x = x.contiguous()
    b = x.shape[0]
    g = _aug_generator(seed, epoch, step, rank)
    shift = torch.randint(-PAD, PAD + 1, (b, 2), generator=g)
    flip = torch.randint(0, 2, (b, 1), generator=g).bool()
    ar = torch.arange(32)
    # Crop of the padded image at offset (PAD+dy, PAD+dx) = reflected source rows/cols; the flip reverses
    # the columns of the crop. One gather of 3-byte pixels does crop and flip for the whole batch.
    rows = _reflect(ar + shift[:, :1])                                      # (b, 32)
    cols = _reflect(torch.where(flip, 31 - ar, ar) + shift[:, 1:])          # (b, 32)
    flat = (torch.arange(b)[:, None, None] * 32 + rows[:, :, None]) * 32 + cols[:, None, :]
    crops = x.view(-1, 3).index_select(0, flat.reshape(-1)).view(b, 32, 32, 3)
    return _normalise(crops)


# ----------------------------------------------------------------------------------------------------
# Per-rank loader
# ----------------------------------------------------------------------------------------------------
class ShardLoader:
    """Batches for one rank, under the ``static`` or ``reshuffle`` policy.

    ``static`` keeps only this rank's shard in memory (a uint8 tensor); ``reshuffle`` holds the whole
    training set and takes its slice of a shared per-epoch permutation. Every rank gets the same
    ``steps_per_epoch``; ``leftover`` images per epoch (over all ranks) are skipped, not padded::

        loader = ShardLoader(ds, np_=comm.size, rank=comm.rank, batch=32, seed=cfg.seed)
        for step, x, y in loader.epoch(epoch): ...
        x, y = loader.batch(epoch, step)        # the same batch again (replay / resume)
    """

    def __init__(self, ds: CIFAR10, np_: int, rank: int, batch: int, *, seed: int = 0,
                 policy: str = "static", augment: bool = True):
        n = len(ds.y_train)
        _check_np(n, np_, rank, batch, policy)
        acc = epoch_accounting(n, np_, batch, policy, seed)
        if acc["steps"] < 1:
            raise DataError(f"each of {np_} ranks holds at most {max(acc['shard_sizes'])} images, fewer than "
                            f"its batch of {batch}; use fewer processes or a smaller batch")
        self.np_, self.rank, self.batch_size, self.seed = np_, rank, batch, seed
        self.policy, self.augment = policy, augment
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

    def _rows(self, epoch: int) -> torch.Tensor:
        """(steps, batch) positions into self._x for ``epoch`` (computed once per epoch)."""
        if self._cached_epoch != epoch:
            if self.policy == "static":
                rows = _static_local(len(self._y), self.steps_per_epoch, self.batch_size, epoch,
                                     self.seed, self.rank)
            else:
                rows = _reshuffle_global(len(self._y), self.np_, self.rank, self.steps_per_epoch,
                                         self.batch_size, epoch, self.seed)
            self._cached_epoch, self._cached_rows = epoch, torch.from_numpy(rows)
        return self._cached_rows

    def global_indices(self, epoch: int) -> np.ndarray:
        """Training-set indices per step for ``epoch``; equals ``epoch_batches(...)``."""
        rows = self._rows(epoch).numpy()
        return self.indices[rows] if self.indices is not None else rows.copy()

    def batch(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of ``epoch``: x float32 (B,3,32,32) channels_last, y int64 (B,)."""
        if not 0 <= step < self.steps_per_epoch:
            raise DataError(f"step={step} is outside 0..{self.steps_per_epoch - 1} of an epoch")
        rows = self._rows(epoch)[step]
        xb, yb = self._x.index_select(0, rows), self._y.index_select(0, rows)
        if self.augment:
            return augment(xb, seed=self.seed, epoch=epoch, step=step, rank=self.rank), yb
        return to_input(xb), yb

    def epoch(self, epoch: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for step in range(self.steps_per_epoch):
            x, y = self.batch(epoch, step)
            yield step, x, y


# ----------------------------------------------------------------------------------------------------
# Fetching the official data set
# ----------------------------------------------------------------------------------------------------
def fetch(root: str | None = None) -> str:
    """Download the official CIFAR-10 python version into ``root`` (default: the cache dir) with
    torchvision and return its ``cifar-10-batches-py`` path; ``load("cifar10")`` then finds it::

        python -m pilab data fetch
    """
    root = os.path.abspath(os.path.expanduser(root)) if root else default_cache_dir()
    manual = (f"download {OFFICIAL_URL} by hand, unpack it, and pass the {BATCHES_DIR} directory as the "
              "data path")
    try:
        import torchvision
    except ImportError:
        raise DataError("torchvision is not installed, so pilab cannot download CIFAR-10; run "
                        f"`pip install 'pilab[vision]'` and retry, or {manual}") from None
    try:
        os.makedirs(root, exist_ok=True)
        torchvision.datasets.CIFAR10(root, train=True, download=True)
    except (OSError, RuntimeError) as e:  # URLError is an OSError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"downloading CIFAR-10 into {root} failed ({msg}); check the network, "
                        f"or {manual}") from None
    return os.path.join(root, BATCHES_DIR)
