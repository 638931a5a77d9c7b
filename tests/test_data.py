"""pilab.data: loading, caching, sharding, augmentation. Plain pytest, one process.

    python -m pytest -q tests/test_data.py

The full archive (fixture ``cifar_archive``) is decoded at most once per session; most tests use small
archives built from the embedded subset's original JPEG bytes, so they run without it.
"""
from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import sys
import tarfile
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pilab import data
from pilab.data import CLASSES, DataError

torch.set_num_threads(1)

ARCHIVE_SHA256 = "2d48e559d664d8b236a8ad09f080c869123da584b64964ea6760f3224f1bc2c9"
NPS = (1, 2, 3, 7)
FIX_WORDS = re.compile(r"\b(pass|use|run|rename|remove|replace|delete|convert|re-download|re-pack|"
                       r"reinstall|install|download|set|pick|check|add|choose)\b")


# ---------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def full(cifar_archive, tmp_path_factory):
    """The whole archive, decoded once for the session into its own cache dir."""
    cache = str(tmp_path_factory.mktemp("full-cache"))
    return data.load(str(cifar_archive), cache_dir=cache), cache


@pytest.fixture(scope="session")
def embedded_raw():
    """The shipped .npz as stored: names, labels and the original JPEG bytes per member."""
    with np.load(data.sources.embedded_path(), allow_pickle=False) as z:
        raw = {k: z[k] for k in z.files}
    blob, off = raw["data"], raw["offsets"]
    raw["jpegs"] = [blob[off[i]:off[i + 1]].tobytes() for i in range(len(raw["labels"]))]
    return raw


@pytest.fixture(scope="session")
def embedded(tmp_path_factory, embedded_raw):
    cache = str(tmp_path_factory.mktemp("emb-cache"))
    ds = data.load("embedded", cache_dir=cache)
    (name,) = _files(cache)
    embedded_raw["cache_file"] = os.path.join(cache, name)
    return ds


def _tar_add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def _make_archive(path, members) -> str:
    """Write an ImageFolder .tar.gz from [(member name, bytes)]."""
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members:
            _tar_add(tar, name, payload)
    return str(path)


@pytest.fixture(scope="session")
def small(embedded_raw, embedded, tmp_path_factory):
    """A real 200/50 ImageFolder archive (20 train + 5 test per class, original JPEG bytes), its
    members, and the pixels they must decode to (from the embedded subset)."""
    names, labels = embedded_raw["names"], embedded_raw["labels"]
    n_train = int(embedded_raw["n_train"])
    x_all = np.concatenate([embedded.x_train, embedded.x_test])
    pick, count = {"train": [], "test": []}, {}
    for i in range(len(names)):
        split = "train" if i < n_train else "test"
        key = (split, int(labels[i]))
        count[key] = count.get(key, 0) + 1
        if count[key] <= (20 if split == "train" else 5):
            pick[split].append(i)
    members = [(str(names[i]), embedded_raw["jpegs"][i]) for s in ("train", "test") for i in pick[s]]
    # Members in reverse order: the loader must order by class and name itself.
    path = _make_archive(tmp_path_factory.mktemp("small") / "small.tar.gz", members[::-1])
    tr, te = pick["train"], pick["test"]
    return {"path": path, "members": members,
            "x_train": x_all[tr], "y_train": labels[tr], "x_test": x_all[te], "y_test": labels[te]}


def _files(d) -> list[str]:
    """The cache's files, less the content-hash memos (.content-*: one small text file per source version)."""
    return sorted(f for f in os.listdir(d) if not f.startswith(".content-")) if os.path.isdir(d) else []


def _assert_same(ds, x_train, y_train, x_test, y_test):
    np.testing.assert_array_equal(ds.x_train, x_train)
    np.testing.assert_array_equal(ds.y_train, y_train)
    np.testing.assert_array_equal(ds.x_test, x_test)
    np.testing.assert_array_equal(ds.y_test, y_test)


def _well_formed(ds):
    for x, y in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
        assert x.dtype == np.uint8 and x.shape[1:] == (32, 32, 3) and x.flags["C_CONTIGUOUS"]
        assert y.dtype == np.int64 and y.shape == (len(x),)
    assert ds.classes == CLASSES
    assert ds.checksum == data.dataset.arrays_checksum([ds.x_train, ds.y_train, ds.x_test, ds.y_test])


# ---------------------------------------------------------------------------------------------------
# Import from archives, directories and python batches
# ---------------------------------------------------------------------------------------------------
def test_classes_are_alphabetical():
    assert CLASSES == tuple(sorted(CLASSES)) and len(CLASSES) == 10


def test_full_archive_import(full, cifar_archive):
    ds, cache = full
    assert (len(ds.y_train), len(ds.y_test)) == (50_000, 10_000)
    np.testing.assert_array_equal(ds.y_train, np.repeat(np.arange(10), 5000))  # class, then file number
    np.testing.assert_array_equal(ds.y_test, np.repeat(np.arange(10), 1000))
    assert str(cifar_archive) in ds.source
    # Cached reload (load verifies the stored checksum against the arrays): the same data set,
    # exactly one cache file and no temp file. The small-archive tests compare arrays element-wise.
    again = data.load(str(cifar_archive), cache_dir=cache)
    _well_formed(again)
    assert again.checksum == ds.checksum and again.source == ds.source
    assert len(_files(cache)) == 1 and _files(cache)[0].endswith(".npz")


def test_small_archive_import(small, tmp_path):
    ds = data.load(small["path"], cache_dir=str(tmp_path))
    _well_formed(ds)
    assert (len(ds.y_train), len(ds.y_test)) == (200, 50)
    assert np.all(np.diff(ds.y_train) >= 0) and np.bincount(ds.y_train).tolist() == [20] * 10
    _assert_same(ds, small["x_train"], small["y_train"], small["x_test"], small["y_test"])


def test_archive_with_top_folder_and_imagefolder_directory(small, tmp_path):
    wrapped = _make_archive(tmp_path / "wrapped.tar.gz", [("cifar10/" + n, b) for n, b in small["members"]])
    a = data.load(wrapped, cache_dir=str(tmp_path / "c1"))
    root = tmp_path / "folder"
    for name, payload in small["members"]:
        (root / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(payload)
    (root / "train" / "cat" / ".DS_Store").write_bytes(b"junk")  # hidden files are ignored
    b = data.load(str(root), cache_dir=str(tmp_path / "c2"))
    for ds in (a, b):
        _assert_same(ds, small["x_train"], small["y_train"], small["x_test"], small["y_test"])


def test_cache_roundtrip_and_corruption(small, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = data.load(small["path"], cache_dir=str(cache))
    (name,) = _files(cache)
    cache_file = cache / name

    def no_decode(*a, **k):
        raise AssertionError("decoded although a valid cache exists")

    with monkeypatch.context() as m:
        m.setattr(data.sources, "decode_source", no_decode)
        again = data.load(small["path"], cache_dir=str(cache))
    assert again.checksum == first.checksum and again.source == first.source
    _assert_same(again, first.x_train, first.y_train, first.x_test, first.y_test)

    # A valid .npz whose pixels no longer match its checksum: detected, rebuilt.
    with np.load(cache_file) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["x_train"][0, 0, 0, 0] ^= 1
    np.savez(cache_file, **arrays)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        rebuilt = data.load(small["path"], cache_dir=str(cache))
    _assert_same(rebuilt, first.x_train, first.y_train, first.x_test, first.y_test)
    assert _files(cache) == [name]

    # A truncated file (an old crash, a full disk): detected, rebuilt.
    cache_file.write_bytes(cache_file.read_bytes()[: cache_file.stat().st_size // 2])
    with pytest.warns(RuntimeWarning, match="corrupt"):
        data.load(small["path"], cache_dir=str(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert data.load(small["path"], cache_dir=str(cache)).checksum == first.checksum
    assert _files(cache) == [name]

    # The cache is keyed by content: a touched source (new mtime, same bytes) keeps its entry, and so
    # does a copy at another path; changed bytes get a new entry.
    os.utime(small["path"], ns=(1, 1))
    copy = tmp_path / "copy.tar.gz"
    shutil.copyfile(small["path"], copy)
    assert data.load(str(copy), cache_dir=str(cache)).checksum == first.checksum
    data.load(small["path"], cache_dir=str(cache))
    assert _files(cache) == [name]
    _make_archive(copy, small["members"][:-1])
    assert data.load(str(copy), cache_dir=str(cache)).checksum != first.checksum
    assert len(_files(cache)) == 2


def test_cache_listing_and_clearing(small, tmp_path):
    import subprocess
    import sys
    cache = tmp_path / "cache"
    ds = data.load(small["path"], cache_dir=str(cache))
    (cache / "cifar-10-batches-py").mkdir()  # where `data fetch` puts a download: never touched
    (cache / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"x")
    (cache / ".tmp-cifar10-0123456789abcdef.npz-abc.npz").write_bytes(b"half")  # an interrupted write
    entries = data.cache_entries(str(cache))
    assert len(entries) == 2
    good = [e for e in entries if e["source"] == ds.source]
    assert len(good) == 1 and good[0]["bytes"] > ds.x_train.nbytes
    env = dict(os.environ, PILAB_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-m", "pilab", "data", "cache"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0 and "2 data set(s)" in p.stdout and ds.source in p.stdout
    p = subprocess.run([sys.executable, "-m", "pilab", "data", "cache", "--clear"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0 and "removed 2" in p.stdout
    assert data.cache_entries(str(cache)) == []
    assert (cache / "cifar-10-batches-py" / "data_batch_1").exists()
    assert data.load(small["path"], cache_dir=str(cache)).checksum == ds.checksum  # decoded again
    p = subprocess.run([sys.executable, "-m", "pilab", "data", "info", "--clear"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2 and "--clear goes with" in p.stderr


def test_interrupted_cache_write_leaves_nothing(small, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def dies_half_way(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(data.cache.np, "savez", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        data.load(small["path"], cache_dir=str(cache))
    assert _files(cache) == []


def test_unwritable_cache_only_warns(small, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="could not write"):
        ds = data.load(small["path"], cache_dir=str(blocker / "cache"))
    assert len(ds.y_train) == 200


def _write_batches(root, x_train, y_train, x_test, y_test):
    """A tiny cifar-10-batches-py in the official format (pickled dicts, rows of CHW bytes)."""
    root.mkdir(parents=True)

    def dump(name, obj):
        with open(root / name, "wb") as f:
            pickle.dump(obj, f, protocol=2)

    def rows(x):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2)).reshape(len(x), 3072)

    for i, part in enumerate(np.array_split(np.arange(len(y_train)), 5)):
        dump(f"data_batch_{i + 1}", {b"batch_label": b"training batch", b"labels": y_train[part].tolist(),
                                     b"data": rows(x_train[part]), b"filenames": [b"x.png"] * len(part)})
    dump("test_batch", {b"batch_label": b"testing batch", b"labels": y_test.tolist(), b"data": rows(x_test)})
    dump("batches.meta", {b"label_names": [c.encode() for c in CLASSES], b"num_vis": 3072})
    return str(root)


def test_official_python_batches(small, tmp_path):
    parts = (small["x_train"][:40], small["y_train"][:40], small["x_test"][:10], small["y_test"][:10])
    batches = _write_batches(tmp_path / "fetched" / data.BATCHES_DIR, *parts)
    a = data.load(batches, cache_dir=str(tmp_path / "c1"))
    _well_formed(a)
    _assert_same(a, *parts)
    # The fetch root, the "cifar10" name, and the official .tar.gz packing are read the same way.
    b = data.load(str(tmp_path / "fetched"), cache_dir=str(tmp_path / "c2"))
    c = data.load("cifar10", cache_dir=str(tmp_path / "fetched"))
    tgz = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(batches, arcname=data.BATCHES_DIR)
    d = data.load(str(tgz), cache_dir=str(tmp_path / "c3"))
    assert a.checksum == b.checksum == c.checksum == d.checksum


def test_subsets_after_cache(small, tmp_path):
    cache = str(tmp_path)
    ds = data.load(small["path"], cache_dir=cache, train_subset=50, test_subset=20, seed=3)
    _well_formed(ds)
    assert len(ds.y_train) == 50 and len(ds.y_test) == 20
    assert np.ptp(np.bincount(ds.y_train, minlength=10)) <= 1
    assert np.bincount(ds.y_test, minlength=10).tolist() == [2] * 10
    assert "train_subset=50" in ds.source and len(_files(cache)) == 1  # the cache holds the full set
    again = data.load(small["path"], cache_dir=cache, train_subset=50, test_subset=20, seed=3)
    assert again.checksum == ds.checksum
    other = data.load(small["path"], cache_dir=cache, train_subset=50, test_subset=20, seed=4)
    assert other.checksum != ds.checksum


def test_train_size_reads_the_labels_of_a_cache_and_agrees_with_load(small, tmp_path):
    cache = str(tmp_path / "c")
    # not cached yet: it goes through load, which decodes and writes the cache
    n = data.train_size(small["path"], cache_dir=cache)
    assert n == len(data.load(small["path"], cache_dir=cache).y_train)
    [entry] = data.cache_entries(cache)
    for sub in (0, 50):
        assert data.train_size(small["path"], cache_dir=cache, train_subset=sub, test_subset=20) == \
            len(data.load(small["path"], cache_dir=cache, train_subset=sub, test_subset=20).y_train)
    # a subset larger than the source raises load's own error, as before
    for kw in ({"train_subset": 10 ** 6}, {"test_subset": 10 ** 6}):
        with pytest.raises(data.DataError, match="exceeds the"):
            data.train_size(small["path"], cache_dir=cache, **kw)
    with pytest.raises(data.DataError, match="must be an integer >= 0"):
        data.train_size(small["path"], cache_dir=cache, train_subset=-1)
    # cached: only the labels are read -- with the training images made unreadable the count still
    # comes from the file, which stays as it was (load would warn and decode again)
    import zipfile
    with zipfile.ZipFile(entry["path"]) as z:
        members = {name: z.read(name) for name in z.namelist()}
    members["x_train.npy"] = members["x_train.npy"][:100]
    with zipfile.ZipFile(entry["path"], "w") as z:
        for name, payload in members.items():
            z.writestr(name, payload)
    damaged = open(entry["path"], "rb").read()
    assert data.train_size(small["path"], cache_dir=cache, train_subset=50) == 50
    assert data.train_size(small["path"], cache_dir=cache) == n
    assert open(entry["path"], "rb").read() == damaged


def test_stratified_subset():
    labels = np.repeat(np.arange(10), [7, 50, 50, 50, 50, 50, 50, 50, 50, 50])
    idx = data.stratified_subset(labels, 95, seed=1)
    assert idx.dtype == np.int64 and len(np.unique(idx)) == 95 and np.all(np.diff(idx) > 0)
    counts = np.bincount(labels[idx])
    assert counts[0] == 7 and np.ptp(counts[1:]) <= 1  # a short class gives what it has
    np.testing.assert_array_equal(idx, data.stratified_subset(labels, 95, seed=1))
    assert not np.array_equal(idx, data.stratified_subset(labels, 95, seed=2))


# ---------------------------------------------------------------------------------------------------
# The embedded subset
# ---------------------------------------------------------------------------------------------------
def test_embedded_subset(embedded, embedded_raw, tmp_path, monkeypatch):
    _well_formed(embedded)
    assert (len(embedded.y_train), len(embedded.y_test)) == (5000, 1000)
    assert np.bincount(embedded.y_train).tolist() == [500] * 10
    assert np.bincount(embedded.y_test).tolist() == [100] * 10
    assert str(embedded_raw["archive_sha256"]) == ARCHIVE_SHA256
    assert tuple(embedded_raw["classes"]) == CLASSES
    for blob in embedded_raw["jpegs"][:50]:
        assert blob[:2] == b"\xff\xd8"  # stored as original JPEG bytes
    assert os.path.getsize(data.sources.embedded_path()) < 4_000_000
    # From another working directory: the package file is found (and its cache entry, keyed by it).
    assert os.path.isabs(data.sources.embedded_path())
    monkeypatch.chdir(tmp_path)
    cache = os.path.dirname(embedded_raw["cache_file"])
    other = data.load("embedded", cache_dir=os.path.relpath(cache))
    assert other.checksum == embedded.checksum
    assert _files(cache) == [os.path.basename(embedded_raw["cache_file"])]


def test_embedded_matches_archive(embedded, embedded_raw, full):
    ds, _ = full
    n_train = int(embedded_raw["n_train"])
    for i, name in enumerate(embedded_raw["names"]):
        split, cls, file = str(name).split("/")
        per_class = 5000 if split == "train" else 1000
        j = CLASSES.index(cls) * per_class + int(file.split(".")[0])  # the archive is sorted by class, number
        if split == "train":
            assert ds.y_train[j] == embedded.y_train[i]
            np.testing.assert_array_equal(ds.x_train[j], embedded.x_train[i])
        else:
            assert ds.y_test[j] == embedded.y_test[i - n_train]
            np.testing.assert_array_equal(ds.x_test[j], embedded.x_test[i - n_train])


# ---------------------------------------------------------------------------------------------------
# Sharding (index level: every rank computed in this one process)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def labels(full):
    return full[0].y_train


@pytest.mark.parametrize("np_", NPS)
def test_static_policy(labels, np_):
    batch, n = 64, len(labels)
    shards = data.static_shards(labels, np_, seed=5)
    assert [len(s) for s in shards] == data.epoch_accounting(n, np_, batch, "static")["shard_sizes"]
    allidx = np.concatenate(shards)
    assert len(allidx) == n and len(np.unique(allidx)) == n  # a partition
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    per_class = np.stack([np.bincount(labels[s], minlength=10) for s in shards])
    assert np.all(np.ptp(per_class, axis=0) <= 1)  # class-stratified
    acc = data.epoch_accounting(labels, np_, batch, "static", seed=5)
    assert acc["steps"] == min(map(len, shards)) // batch
    assert acc["used"] == acc["steps"] * batch * np_ and acc["leftover"] == n - acc["used"]
    orders = {}
    for epoch in (0, 1):
        used = []
        for rank in range(np_):
            idx = data.epoch_batches(labels, np_, rank, batch, epoch, seed=5, policy="static")
            assert idx.dtype == np.int64 and idx.shape == (acc["steps"], batch)
            assert np.isin(idx, shards[rank]).all()  # fixed shard
            orders[epoch, rank] = idx
            used.append(idx.ravel())
        used = np.concatenate(used)
        assert len(np.unique(used)) == len(used) == acc["used"]  # no index twice in an epoch
    for rank in range(np_):
        assert not np.array_equal(orders[0, rank], orders[1, rank])  # reshuffled inside the shard
    # Every rank computes the same partition from the seed alone.
    assert all(np.array_equal(a, b) for a, b in zip(shards, data.static_shards(labels, np_, seed=5)))


@pytest.mark.parametrize("np_", NPS)
def test_reshuffle_policy(labels, np_):
    batch, n = 64, len(labels)
    acc = data.epoch_accounting(n, np_, batch, "reshuffle")
    assert acc["steps"] == n // (np_ * batch)
    assert acc["leftover"] == n - acc["steps"] * batch * np_ and 0 <= acc["leftover"] < np_ * batch
    sets = []
    for epoch in (0, 1):
        per_rank = [data.epoch_batches(labels, np_, r, batch, epoch, seed=5, policy="reshuffle")
                    for r in range(np_)]
        assert all(p.shape == (acc["steps"], batch) for p in per_rank)
        used = np.concatenate([p.ravel() for p in per_rank])
        assert len(np.unique(used)) == len(used) == acc["used"]
        # Rank r holds positions r, r+np, ... of one permutation: interleaving the ranks rebuilds it.
        perm = np.stack([p.ravel() for p in per_rank], axis=-1).ravel()
        shared = data.shards.stream(5, data.shards.TAG_RESHUFFLE, epoch).permutation(n)
        np.testing.assert_array_equal(perm, shared[:acc["used"]])
        sets.append(per_rank)
    for r in range(np_):
        assert not np.array_equal(sets[0][r], sets[1][r])  # a new permutation each epoch
    if np_ > 1:
        assert set(sets[0][0].ravel()) != set(sets[1][0].ravel())  # ranks see different images each epoch


def test_leftover_is_counted_not_padded():
    for n, np_, batch in ((100, 3, 8), (50_000, 7, 32), (5000, 24, 32), (61, 2, 30)):
        for policy in data.POLICIES:
            acc = data.epoch_accounting(n, np_, batch, policy)
            assert acc["used"] + acc["leftover"] == n and acc["leftover"] < np_ * batch
            assert sum(acc["shard_sizes"]) == n
    assert data.epoch_accounting(50_000, 7, 32, "static")["leftover"] == 48


def test_loader_matches_index_level(embedded):
    for policy in data.POLICIES:
        loaders = [data.ShardLoader(embedded, 3, r, 50, seed=2, policy=policy, augment=False)
                   for r in range(3)]
        assert len({ld.steps_per_epoch for ld in loaders}) == 1
        for r, ld in enumerate(loaders):
            idx = data.epoch_batches(embedded.y_train, 3, r, 50, 4, seed=2, policy=policy)
            np.testing.assert_array_equal(ld.global_indices(4), idx)
            assert ld.steps_per_epoch == len(idx)
        steps = list(loaders[2].epoch(4))
        assert [s[0] for s in steps] == list(range(len(idx)))
        _, x, y = steps[7]
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.is_contiguous(memory_format=torch.channels_last)
        np.testing.assert_array_equal(y.numpy(), embedded.y_train[idx[7]])
        torch.testing.assert_close(x, data.to_input(torch.from_numpy(embedded.x_train[idx[7]])))
        if policy == "static":  # only the shard is held
            shard = data.static_shards(embedded.y_train, 3, 2)[1]
            assert loaders[1]._x.shape[0] == loaders[1].shard_size == len(shard)


def test_ranks_batch_is_the_ranks_batches_concatenated_bit_for_bit(embedded):
    """The simulator's fast mode takes its global batch in one augmentation pass (ranks_batch): every
    image must carry the same bits as each rank's own batch() gives it, augmented or not, either policy."""
    for policy in data.POLICIES:
        for aug in (True, False):
            loaders = [data.ShardLoader(embedded, 5, r, 8, seed=3, policy=policy, augment=aug) for r in range(5)]
            for epoch, step in ((0, 0), (2, 3)):
                x, y = data.ranks_batch(loaders[1:4], epoch, step)
                parts = [ld.batch(epoch, step) for ld in loaders[1:4]]
                assert torch.equal(y, torch.cat([p[1] for p in parts]))
                assert torch.equal(x, torch.cat([p[0] for p in parts])), (policy, aug, epoch, step)
                assert x.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(DataError, match="outside"):
        data.ranks_batch(loaders[:2], 0, loaders[0].steps_per_epoch)


def test_loader_replay(embedded):
    ld = data.ShardLoader(embedded, 2, 1, 32, seed=9)
    _, x5, y5 = list(ld.epoch(3))[5]
    ld.batch(0, 0)  # another epoch in between
    x, y = ld.batch(3, 5)
    assert torch.equal(x, x5) and torch.equal(y, y5)


@pytest.mark.parametrize("total, speeds", [(64, [1.0, 0.5]), (64, [2.0, 2.0]), (7, [1, 1, 1]), (3, [100, 1, 1]),
                                           (1536, [1.0] * 24 + [2.5] * 24), (100, [0.3, 1e-3, 5.0, 2.2, 2.2])])
def test_batch_shares_sum_to_the_global_batch_in_proportion_to_speed(total, speeds):
    shares = data.batch_shares(total, speeds)
    assert sum(shares) == total and min(shares) >= 1 and len(shares) == len(speeds)
    ideal = [total * s / sum(speeds) for s in speeds]
    # each share within one image of its ideal, unless raised to the least share of 1
    assert all(abs(b - i) < 1 or b == 1 for b, i in zip(shares, ideal)), (shares, ideal)
    assert shares == data.batch_shares(total, list(speeds))  # the same on every rank
    assert data.batch_shares(total, [3.0] * len(speeds)) == data.batch_shares(total, [1.0] * len(speeds))


def test_batch_shares_refuses_what_cannot_be_split():
    with pytest.raises(data.DataError, match="at least 3"):
        data.batch_shares(2, [1, 1, 1])
    for bad in ([1, 0], [1, -1], [1, float("nan")], []):
        with pytest.raises(data.DataError, match="positive, finite"):
            data.batch_shares(10, bad)


def test_uneven_shares_use_every_image_once_an_epoch_however_they_change(embedded):
    # two ranks of different speeds: each step the next global batch of the epoch's shared permutation,
    # rank r its b_r images after the ranks before it; the shares change between steps (dynamic balance)
    np_, total = 3, 48
    loaders = [data.ShardLoader(embedded, np_, r, total // np_, policy="reshuffle", seed=5) for r in range(np_)]
    steps = loaders[0].steps_per_epoch
    assert steps == len(embedded.y_train) // total
    plans = [[16, 16, 16], [30, 12, 6], [1, 1, 46], [20, 20, 8]]
    for epoch in (0, 1):
        seen = []
        for step in range(steps):
            shares = plans[step % len(plans)]
            start = 0
            for r, ld in enumerate(loaders):
                x, y = ld.batch(epoch, step, share=(start, shares[r]))
                idx = ld.share_indices(epoch, step, start, shares[r])
                assert x.shape[0] == shares[r] and torch.equal(y, torch.from_numpy(embedded.y_train[idx]).long())
                seen += list(idx)
                start += shares[r]
            # the step's images are the reshuffle policy's step, whoever trains which
            equal = np.concatenate([data.epoch_batches(embedded.y_train, np_, r, total // np_, epoch, seed=5,
                                                       policy="reshuffle")[step] for r in range(np_)])
            assert sorted(seen[-total:]) == sorted(equal)
        assert len(seen) == len(set(seen)) == steps * total  # every image once, none twice
        assert list(data.epoch_permutation(len(embedded.y_train), epoch, 5)[:steps * total]) == seen
    # the same share again is the same batch (a replay, the simulator's virtual rank)
    a, b = loaders[1].batch(1, 2, share=(7, 9)), loaders[1].batch(1, 2, share=(7, 9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # and the same from a device-resident set (the simulator's on a GPU; device="cpu" runs that path here)
    on_device = data.ShardLoader(embedded, np_, 1, total // np_, policy="reshuffle", seed=5, device="cpu")
    for epoch, step, share in ((1, 2, (7, 9)), (0, 0, (0, 48)), (1, 3, (47, 1))):
        c, d = loaders[1].batch(epoch, step, share=share), on_device.batch(epoch, step, share=share)
        assert torch.equal(c[0], d[0]) and torch.equal(c[1], d[1])


def test_shares_need_the_reshuffle_policy_and_fit_the_global_batch(embedded):
    static = data.ShardLoader(embedded, 2, 0, 16)
    with pytest.raises(DataError, match="reshuffle policy"):
        static.batch(0, 0, share=(0, 8))
    ld = data.ShardLoader(embedded, 2, 0, 16, policy="reshuffle")
    for share in ((20, 13), (-1, 4), (0, 0)):
        with pytest.raises(DataError, match="outside the global batch of 32"):
            ld.batch(0, 0, share=share)


def test_test_shard_coverage():
    for n in (0, 5, 1000, 10_001):
        for np_ in (1, 2, 3, 7, 24):
            slices = [data.test_shard(n, np_, r) for r in range(np_)]
            covered = np.concatenate([np.arange(n)[s] for s in slices])
            np.testing.assert_array_equal(covered, np.arange(n))  # contiguous, disjoint, all
            sizes = [s.stop - s.start for s in slices]
            assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------------------------------------
# Augmentation
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def images(embedded):
    return torch.from_numpy(embedded.x_train[:64].copy())


def test_augment_replay_and_rank(images):
    a = data.augment(images, seed=1, epoch=2, step=3, rank=0)
    torch.manual_seed(123)  # global RNG state must not matter
    torch.rand(10)
    b = data.augment(images, seed=1, epoch=2, step=3, rank=0)
    assert torch.equal(a, b)
    for other in ({"rank": 1}, {"step": 4}, {"epoch": 3}, {"seed": 2}):
        kw = {"seed": 1, "epoch": 2, "step": 3, "rank": 0, **other}
        assert not torch.equal(a, data.augment(images, **kw))


def test_augment_format_and_normalisation(images, embedded):
    out = data.augment(images, seed=0, epoch=0, step=0, rank=0)
    assert out.shape == (64, 3, 32, 32) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    plain = data.to_input(images)
    assert plain.is_contiguous(memory_format=torch.channels_last)
    mean, std = torch.tensor(data.MEAN).view(1, 3, 1, 1), torch.tensor(data.STD).view(1, 3, 1, 1)
    manual = (images.permute(0, 3, 1, 2).float() / 255 - mean) / std
    torch.testing.assert_close(plain, manual, atol=1e-5, rtol=1e-5)
    # Normalised with CIFAR-10 statistics: roughly zero mean, unit spread per channel.
    x = data.to_input(torch.from_numpy(embedded.x_train))
    assert x.mean((0, 2, 3)).abs().max() < 0.15 and (x.std((0, 2, 3)) - 1).abs().max() < 0.1


def test_augment_is_a_crop_of_the_padded_image(images):
    out = data.augment(images, seed=4, epoch=1, step=2, rank=3)
    mean, std = torch.tensor(data.MEAN).view(3, 1, 1), torch.tensor(data.STD).view(3, 1, 1)
    seen = set()
    for i in range(len(images)):
        img = images[i].permute(2, 0, 1).float()[None] / 255
        padded = F.pad(img, (4, 4, 4, 4), mode="reflect")[0]
        crops = padded.unfold(1, 32, 1).unfold(2, 32, 1).permute(1, 2, 0, 3, 4)  # (dy, dx, 3, 32, 32)
        matches = []
        for flip in (False, True):
            c = (crops.flip(-1) if flip else crops) - mean
            err = (c / std - out[i]).abs().amax(dim=(2, 3, 4))
            matches += [(int(dy), int(dx), flip) for dy, dx in (err < 1e-5).nonzero()]
        assert matches, f"image {i} is not a (flipped) crop of its reflect-padded original"
        seen.update(matches)
    assert {m[2] for m in seen} == {False, True} and len({m[:2] for m in seen}) > 10


def test_augment_rejects_wrong_input():
    with pytest.raises(DataError, match="uint8"):
        data.augment(torch.zeros(2, 3, 32, 32), seed=0, epoch=0, step=0, rank=0)


# ---------------------------------------------------------------------------------------------------
# Bad input: one-line DataError naming the fix, nothing written to the cache
# ---------------------------------------------------------------------------------------------------
def _png(size=(32, 32), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def _bad_sources(tmp_path, small):
    members = small["members"]
    good = list(members)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "junk").mkdir()
    (tmp_path / "noise.tar.gz").write_bytes(os.urandom(2000))
    with open(small["path"], "rb") as f:
        blob = f.read()
    (tmp_path / "truncated.tar.gz").write_bytes(blob[: len(blob) // 2])
    return {
        "missing path": (str(tmp_path / "nope"), "does not exist"),
        "not a tar.gz": (str(tmp_path / "noise.tar.gz"), "not a readable tar.gz"),
        "truncated tar.gz": (str(tmp_path / "truncated.tar.gz"), "not a readable tar.gz"),
        "neither layout": (str(tmp_path / "empty"),
                           "neither known layout.*cifar-10-batches-py.*train/<class>"),
        "no train/": (_make_archive(tmp_path / "a1.tar.gz", [m for m in good if m[0].startswith("test/")]),
                      "no images under train/"),
        "no test/": (_make_archive(tmp_path / "a2.tar.gz", [m for m in good if m[0].startswith("train/")]),
                     "no images under test/"),
        "extra class": (_make_archive(tmp_path / "a3.tar.gz", good + [("train/dragon/0.jpg", good[0][1])]),
                        "lacks class folder.*test/dragon"),
        "missing class": (_make_archive(tmp_path / "a4.tar.gz", [m for m in good if "test/truck/" not in m[0]]),
                          "lacks class folder.*test/truck"),
        "corrupt image": (_make_archive(tmp_path / "a5.tar.gz",
                                        good + [("train/cat/bad.jpg", good[0][1][:100])]), "corrupt"),
        "mixed sizes": (_make_archive(tmp_path / "a6.tar.gz", good + [("test/cat/big.png", _png((64, 64)))]),
                        "different sizes .*32x32, 64x64.*--image-size N"),
        "one class": (_make_archive(tmp_path / "a7.tar.gz", [m for m in good if "/cat/" in m[0]]),
                      "1 class folder under train/; a classifier needs at least 2"),
    }


def _check_message(err: DataError, pattern: str) -> None:
    msg = str(err)
    assert "\n" not in msg, msg
    assert re.search(pattern, msg), msg
    assert FIX_WORDS.search(msg.split(";")[-1]), f"no fix named after ';' in: {msg}"


def test_bad_sources(small, tmp_path):
    cache = tmp_path / "cache"
    for case, (source, pattern) in _bad_sources(tmp_path, small).items():
        with pytest.raises(DataError) as e:
            data.load(source, cache_dir=str(cache))
        _check_message(e.value, pattern)
        assert _files(cache) == [], f"{case}: cache written"


def test_bad_directory_layout(small, tmp_path):
    root = tmp_path / "folder"
    for name, payload in small["members"]:
        (root / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(payload)
    (root / "test" / "unicorn").mkdir()
    with pytest.raises(DataError) as e:
        data.load(str(root), cache_dir=str(tmp_path / "cache"))
    _check_message(e.value, "lacks class folder.*train/unicorn")
    assert _files(tmp_path / "cache") == []


def test_bad_python_batches(small, tmp_path):
    parts = (small["x_train"][:10], small["y_train"][:10], small["x_test"][:5], small["y_test"][:5])
    root = _write_batches(tmp_path / data.BATCHES_DIR, *parts)
    os.remove(os.path.join(root, "data_batch_3"))
    with pytest.raises(DataError) as e:
        data.load(root, cache_dir=str(tmp_path / "cache"))
    _check_message(e.value, "lacks data_batch_3")
    with open(os.path.join(root, "data_batch_3"), "wb") as f:
        f.write(b"\x80\x02cos\nsystem\n")  # a pickle that would run code: refused
    with pytest.raises(DataError) as e:
        data.load(root, cache_dir=str(tmp_path / "cache"))
    _check_message(e.value, "not a readable CIFAR-10 batch")
    assert _files(tmp_path / "cache") == []


def test_bad_arguments(small, tmp_path, embedded):
    cases = [
        (lambda: data.load(small["path"], cache_dir=str(tmp_path), train_subset=201), "exceeds the 200"),
        (lambda: data.load(small["path"], cache_dir=str(tmp_path), test_subset=51), "exceeds the 50"),
        (lambda: data.load("cifar10", cache_dir=str(tmp_path / "empty")), r"python -m pilab data fetch"),
        (lambda: data.ShardLoader(embedded, 200, 0, 32), "fewer than its batch"),
        (lambda: data.ShardLoader(embedded, 2, 2, 32), "rank=2 is outside"),
        (lambda: data.epoch_batches(embedded.y_train, 2, 0, 32, 0, policy="random"), "unknown"),
        (lambda: data.load(small["path"], cache_dir=str(tmp_path), seed=-1), "seed=-1"),
    ]
    for call, pattern in cases:
        with pytest.raises(DataError) as e:
            call()
        _check_message(e.value, pattern)


def test_fetch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed
    with pytest.raises(DataError) as e:
        data.fetch(str(tmp_path))
    _check_message(e.value, r"`pip install torchvision`.*pip install -e '\.\[vision\]'.*cifar-10-python\.tar\.gz.*cifar-10-batches-py")

    calls = []

    def fake_cifar10(root, train, download):
        calls.append((root, train, download))
        os.makedirs(os.path.join(root, data.BATCHES_DIR), exist_ok=True)

    fake = types.SimpleNamespace(datasets=types.SimpleNamespace(CIFAR10=fake_cifar10))
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setenv("PILAB_CACHE", str(tmp_path / "pc"))
    assert data.default_cache_dir() == str(tmp_path / "pc")
    assert data.fetch() == str(tmp_path / "pc" / data.BATCHES_DIR)
    assert calls == [(str(tmp_path / "pc"), True, True)]
