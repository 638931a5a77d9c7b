"""Which images each rank trains on: subsets, static shards, per-epoch batches, test slices.

Index arithmetic only (numpy, no pixels): every rank computes the same answer from (labels, np, seed,
epoch) without communicating, because all randomness derives from those and never from global RNG state::

    from pilab import data
    data.epoch_accounting(50_000, 7, 32, "static")["steps"]        # 223 steps per epoch on every rank
    idx = data.epoch_batches(ds.y_train, np_=4, rank=1, batch=32, epoch=0)   # (steps, 32) indices
    sl = data.test_shard(len(ds.y_test), comm.size, comm.rank)     # evaluate x_test[sl], reduce sums
"""
from __future__ import annotations

import numpy as np

from .dataset import DataError

POLICIES = ("static", "reshuffle")

# Domain tags keep the random streams for different purposes independent under the same seed
# (all of them here, augmentation's included, so that no two can collide).
_TAG_SUBSET, _TAG_SHARDS, _TAG_STATIC, TAG_RESHUFFLE, TAG_AUG = 1, 2, 3, 4, 5


def stream(*key: int) -> np.random.Generator:
    """The random stream of ``key`` (seed, a domain tag above, epoch, ...): the same numbers on every rank."""
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
    rng = stream(seed, _TAG_SUBSET)
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
    check_np(len(labels), np_)
    order, _ = _class_order(labels, stream(seed, _TAG_SHARDS))
    # Deal the class-grouped sequence round robin: each class is spread evenly over the shards.
    return [np.sort(order[r::np_]).astype(np.int64) for r in range(np_)]


def check_np(n: int, np_: int, rank: int = 0, batch: int = 1, policy: str = "static") -> None:
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
    check_np(n, np_, 0, batch, policy)
    sizes = _shard_sizes(n, np_)  # static_shards deals round robin, so sizes depend on n only
    steps = min(sizes) // batch if policy == "static" else n // (np_ * batch)
    used = steps * batch * np_
    return {"steps": steps, "used": used, "leftover": n - used, "shard_sizes": sizes}


def static_local(shard_size: int, steps: int, batch: int, epoch: int, seed: int, rank: int) -> np.ndarray:
    """(steps, batch) positions inside this rank's shard: a fresh shuffle each epoch."""
    perm = stream(seed, _TAG_STATIC, epoch, rank).permutation(shard_size)
    return perm[:steps * batch].reshape(steps, batch).astype(np.int64)


def epoch_permutation(n: int, epoch: int, seed: int = 0) -> np.ndarray:
    """The ``reshuffle`` policy's order of all ``n`` training images in ``epoch``, the same on every rank:
    its ranks take positions r, r+np, ... of it; ranks with uneven shares take each step's next global
    batch of it (``ShardLoader.batch(..., share=)``)."""
    return stream(seed, TAG_RESHUFFLE, epoch).permutation(n)


def reshuffle_global(n: int, np_: int, rank: int, steps: int, batch: int, epoch: int,
                     seed: int) -> np.ndarray:
    """One permutation of all n per epoch (same on every rank); rank r takes positions r, r+np, ..."""
    perm = epoch_permutation(n, epoch, seed)
    return perm[:steps * batch * np_][rank::np_].reshape(steps, batch).astype(np.int64)


def epoch_batches(labels: np.ndarray, np_: int, rank: int, batch: int, epoch: int,
                  seed: int = 0, policy: str = "static") -> np.ndarray:
    """(steps, batch) int64 global training-set indices that ``rank`` uses in ``epoch``::

        idx = epoch_batches(ds.y_train, np_=4, rank=1, batch=32, epoch=0)   # idx[step] -> one batch
    """
    labels = np.asarray(labels)
    check_np(len(labels), np_, rank, batch, policy)
    steps = epoch_accounting(len(labels), np_, batch, policy, seed)["steps"]
    if policy == "static":
        shard = static_shards(labels, np_, seed)[rank]
        return shard[static_local(len(shard), steps, batch, epoch, seed, rank)]
    return reshuffle_global(len(labels), np_, rank, steps, batch, epoch, seed)


def batch_shares(total: int, speeds) -> list[int]:
    """Split a global batch of ``total`` images over ranks in proportion to their ``speeds`` (images per
    second, or any positive measure of it): integers >= 1 that sum to ``total``, the largest remainders
    rounded up (ties to the lower rank). Every rank computes the same shares from the same speeds; the
    performance model prices a mixed cluster with the same rule::

        batch_shares(64, [1.0, 0.5])       # [43, 21]
        batch_shares(64, [2.0, 2.0])       # [32, 32]
    """
    s = np.asarray(speeds, dtype=float)
    if s.ndim != 1 or not len(s) or not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise DataError(f"speeds={list(speeds)!r}: give one positive, finite speed per rank")
    if not isinstance(total, (int, np.integer)) or total < len(s):
        raise DataError(f"a global batch of {total!r} cannot give each of {len(s)} ranks an image; use at "
                        f"least {len(s)}")
    ideal = total * s / s.sum()
    shares = np.maximum(1, np.floor(ideal)).astype(np.int64)
    while shares.sum() > total:  # ranks raised to 1 took images: the most over its ideal gives one back
        over = np.where(shares > 1, shares - ideal, -np.inf)
        shares[int(np.argmax(over))] -= 1
    rest = int(total - shares.sum())
    order = sorted(range(len(s)), key=lambda r: (-(ideal[r] - shares[r]), r))
    for r in order[:rest]:
        shares[r] += 1
    return [int(x) for x in shares]


def test_shard(n_test: int, np_: int, rank: int) -> slice:
    """Contiguous slice of the test set for ``rank``: sizes differ by <= 1, every image once overall,
    so per-rank metrics (correct counts, loss sums) are combined with a sum-allreduce."""
    if np_ < 1 or not 0 <= rank < np_:
        raise DataError(f"rank={rank} is outside 0..{np_ - 1}; pass the MPI rank and size")
    q, r = divmod(int(n_test), np_)
    start = rank * q + min(rank, r)
    return slice(start, start + q + (rank < r))
