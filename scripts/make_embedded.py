"""Derive the shipped CIFAR-10 subset, pilab/embedded/cifar10_subset.npz, from the full JPEG archive.

    python scripts/make_embedded.py                       # archive: ../shared/data/cifar10-jpeg.tar.gz
    python scripts/make_embedded.py --archive PATH --train 5000 --test 1000 --seed 0

Deterministic: the subset is ``pilab.data.stratified_subset`` (class-balanced, fixed seed) over the archive's
members in name order, and the .npz is written with fixed zip timestamps, so the same archive gives the same
bytes. The original JPEG bytes are stored unchanged (no re-encoding): one uint8 array of concatenated
files, their offsets, labels, member names, and the archive's sha256.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import zipfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pilab.data import CLASSES, stratified_subset  # noqa: E402
from pilab.data.sources import decode_image  # noqa: E402
from pilab.files import sha256_file  # noqa: E402

DEFAULT_ARCHIVE = os.path.join(REPO, "..", "shared", "data", "cifar10-jpeg.tar.gz")
DEFAULT_OUT = os.path.join(REPO, "pilab", "embedded", "cifar10_subset.npz")


def read_members(archive: str) -> dict:
    """{split: sorted list of (name, label, jpeg bytes)} for train/<class>/* and test/<class>/*."""
    out = {"train": [], "test": []}
    with tarfile.open(archive, "r|gz") as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and len(parts) == 3 and parts[0] in out and parts[1] in CLASSES:
                out[parts[0]].append((m.name, CLASSES.index(parts[1]), tar.extractfile(m).read()))
    for split in out:
        out[split].sort(key=lambda t: t[0])
    return out


def write_npz(path: str, arrays: dict) -> None:
    """Like np.savez_compressed, but with fixed timestamps (byte-reproducible) and an atomic replace."""
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(value), allow_pickle=False)
            z.writestr(info, buf.getvalue(), compresslevel=9)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archive", default=DEFAULT_ARCHIVE,
                   help="cifar10-jpeg.tar.gz (train/<class>/*.jpg, test/<class>/*.jpg)")
    p.add_argument("--out", default=DEFAULT_OUT, help="output .npz")
    p.add_argument("--train", type=int, default=5000, help="training images (class-balanced)")
    p.add_argument("--test", type=int, default=1000, help="test images (class-balanced)")
    p.add_argument("--seed", type=int, default=0, help="seed of the stratified choice")
    a = p.parse_args(argv)

    members = read_members(a.archive)
    chosen = []
    for split, n in (("train", a.train), ("test", a.test)):
        labels = np.array([t[1] for t in members[split]], dtype=np.int64)
        chosen += [members[split][i] for i in stratified_subset(labels, n, a.seed)]
    for name, _, data in chosen:  # refuse to ship anything load() would reject
        decode_image(data, name)
    sizes = np.array([len(t[2]) for t in chosen], dtype=np.int64)
    arrays = {
        "data": np.frombuffer(b"".join(t[2] for t in chosen), dtype=np.uint8),
        "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        "labels": np.array([t[1] for t in chosen], dtype=np.int64),
        "names": np.array([t[0] for t in chosen]),
        "n_train": np.array(a.train, dtype=np.int64),
        "classes": np.array(CLASSES),
        "archive_sha256": np.array(sha256_file(a.archive)),
        "seed": np.array(a.seed, dtype=np.int64),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    write_npz(a.out, arrays)
    print(f"wrote {a.out}: {a.train} train + {a.test} test JPEGs, {sizes.sum():,} JPEG bytes, "
          f"{os.path.getsize(a.out):,} bytes on disk; sha256 {sha256_file(a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
