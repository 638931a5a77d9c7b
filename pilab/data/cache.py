"""The cache of decoded data sets: one ``.npz`` per source version in :func:`default_cache_dir`.

    from pilab import data
    data.cache_entries()          # [{"path", "bytes", "modified", "source"}, ...] newest first
    data.clear_cache()            # remove them; the next data.load decodes again

:func:`pilab.data.load` names its entry with :func:`cache_key`, reads it with :func:`read_cache` (None when
absent or corrupt) and writes it with :func:`write_cache` (atomic, so several ranks may load at once).
"""
from __future__ import annotations

import hashlib
import os
import re
import warnings

import numpy as np

from ..files import atomic_write, atomic_write_text, sha256_tree
from .dataset import CIFAR10, CLASSES, arrays_checksum

_CACHE_VERSION = 2  # bump when decoding changes, so old caches are not reused (2: any classes and size)
_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def default_cache_dir() -> str:
    """``$PILAB_CACHE`` if set, else ``~/.cache/pilab``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("PILAB_CACHE") or "~/.cache/pilab"))


def resolve_cache_dir(cache_dir: str | None = None) -> str:
    """``cache_dir`` as an absolute path, or :func:`default_cache_dir` when None or empty."""
    return os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()


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
    cache = resolve_cache_dir(cache_dir)
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


def cache_path(cache: str, kind: str, path: str, variant: str = "") -> str:
    """Where ``load`` keeps the decoded arrays of source ``path`` (of ``kind``) inside ``cache``;
    ``variant`` (e.g. "64x64": the images resized) keys a differently decoded copy of the same source."""
    return os.path.join(cache, f"cifar10-{cache_key(kind, path, variant, cache)}.npz")  # matches _CACHE_NAME


def cache_key(kind: str, path: str, variant: str = "", cache: str | None = None) -> str:
    """Key from the source's content (its bytes; a directory's files and their relative paths), so two
    copies of the same data share an entry and a changed file makes a new one. Hashing is done once per
    version of the source: the content hash is remembered beside the cache under its path, size and
    mtime (summed / max over a directory's files)."""
    if os.path.isdir(path):
        size, mtime = 0, os.stat(path).st_mtime_ns
        for root, _, files in os.walk(path):
            for f in files:
                st = os.stat(os.path.join(root, f))
                size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
    else:
        st = os.stat(path)
        size, mtime = st.st_size, st.st_mtime_ns
    stamp = hashlib.sha256(f"{path}|{size}|{mtime}".encode()).hexdigest()[:16]
    memo = os.path.join(cache or default_cache_dir(), f".content-{stamp}")
    try:
        with open(memo) as f:
            content = f.read().strip()
    except OSError:
        content = ""
    if len(content) != 64:
        content = sha256_tree(path)[0]
        _write_small(memo, content)
    text = f"v{_CACHE_VERSION}|{kind}|{content}|{variant}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_small(path: str, text: str) -> None:
    """Best effort, atomic: a read-only cache only costs hashing again."""
    try:
        atomic_write_text(path, text)
    except OSError:
        pass


def read_cache(path: str) -> CIFAR10 | None:
    """The cached data set, or None when absent or corrupt (then the caller decodes again)."""
    if not os.path.isfile(path):
        return None
    try:
        # Our own file object: np.load leaks its handle when the zip is truncated.
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            arrays = [z[k] for k in _ARRAYS]
            checksum, source = str(z["checksum"]), str(z["source"])
            classes = tuple(str(c) for c in z["classes"]) if "classes" in z else CLASSES
            stats = (tuple(float(v) for v in z["mean"]), tuple(float(v) for v in z["std"])) if "mean" in z \
                else (None, None)
        ok = (arrays[0].dtype == np.uint8 and arrays[0].ndim == 4 and arrays[0].shape[3] in (1, 3)
              and arrays[2].dtype == np.uint8 and arrays[2].shape[1:] == arrays[0].shape[1:]
              and arrays_checksum(arrays) == checksum)
    except Exception:  # truncated zip, bad CRC, missing key: all mean "rebuild"
        ok = False
    if not ok:
        warnings.warn(f"cache {path} is corrupt; decoding the source again", RuntimeWarning, stacklevel=3)
        return None
    if stats[0] is None:
        return CIFAR10(*arrays, classes=classes, source=source, checksum=checksum)
    return CIFAR10(*arrays, classes=classes, source=source, checksum=checksum, mean=stats[0], std=stats[1])


def cached_meta(path: str) -> dict | None:
    """Classes and image shape (C, H, W) of a cache file, from its labels and one image -- what a launcher
    checks a model against before any rank starts (None when absent or unreadable)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            classes = tuple(str(c) for c in z["classes"]) if "classes" in z else CLASSES
            h, w, c = _x_shape(z)
            return {"classes": classes, "image_shape": (c, h, w), "n_train": len(z["y_train"])}
    except Exception:
        return None


def _x_shape(z) -> tuple[int, int, int]:
    """(H, W, C) of the training images of an open .npz, read from the array's header only."""
    with z.zip.open("x_train.npy") as member:
        version = np.lib.format.read_magic(member)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape = read(member)[0]
    return tuple(shape[1:])


def cached_sizes(path: str) -> tuple[int, int] | None:
    """(training, test) image counts of a cache file, from its two label arrays alone -- not the 185 MB
    of images (None when absent or unreadable). ``read_cache`` still verifies the whole file when the
    images are loaded."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            return len(z["y_train"]), len(z["y_test"])
    except Exception:  # a truncated or corrupt file: load() rebuilds it
        return None


def write_cache(path: str, ds: CIFAR10) -> None:
    """Write atomically (``pilab.files.atomic_write``: no half-written cache; an interrupted write leaves
    a ``.tmp-`` file that ``clear_cache`` recognises)."""
    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, x_train=ds.x_train, y_train=ds.y_train, x_test=ds.x_test, y_test=ds.y_test,
                     checksum=np.array(ds.checksum), source=np.array(ds.source), classes=np.array(ds.classes),
                     mean=np.array(ds.mean), std=np.array(ds.std))
    try:
        atomic_write(path, write, durable=True)
    except OSError as e:  # a read-only home should not stop training: only the cache is lost
        warnings.warn(f"could not write the data cache {path} ({e}); set PILAB_CACHE to a writable "
                      "directory to avoid decoding again", RuntimeWarning, stacklevel=3)

