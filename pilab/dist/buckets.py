"""Gradient buckets: which tensors travel together in one Allreduce.

Its own module, free of torch and MPI, because two sides need the same rule: ``dist.GradSync`` fills its
buckets with it, and the performance model predicts them with it (without starting MPI in a notebook).
"""
from __future__ import annotations

__all__ = ["bucket_assignment"]


def bucket_assignment(numels, bucket_mb: float, tail_mb: float = 0.0) -> list[list[int]]:
    """Indices of ``numels`` (fp32 tensors, in the order they are filled) per bucket: consecutive
    tensors until adding the next would pass ``bucket_mb`` MiB; a larger tensor gets a bucket alone.

    The one rule ``GradSync`` and the performance model share (as DDP's reducer and its tests share
    ``_compute_bucket_assignment_by_size``)::

        bucket_assignment([10, 10, 300_000], bucket_mb=1.0)   # [[0, 1], [2]]  (1 MiB = 262,144 floats)
        bucket_assignment([300_000, 10, 10], 1.0, tail_mb=4e-5)   # [[0], [1], [2]]

    ``tail_mb`` (0 < tail_mb < bucket_mb): the last bucket of several is cut again into buckets of ``tail_mb``. Its gradients are the
    first layers', which come last in backward, one by one; a 1 MiB last bucket waits for all of them
    and then its whole Allreduce is exposed, while small ones go as their layers finish and leave only
    the last of them after backward (see ``Config.bucket_tail_mb``).
    """
    out = _fill(numels, bucket_mb)
    if 0 < tail_mb < bucket_mb and len(out) > 1:  # one bucket stays one (posted when backward ends)
        last = out.pop()
        out.extend([[last[0] + i for i in b] for b in _fill([numels[i] for i in last], tail_mb)])
    return out


def _fill(numels, bucket_mb: float) -> list[list[int]]:
    limit = max(1, int(bucket_mb * 2 ** 20 / 4))
    out: list[list[int]] = []
    current, n = [], 0
    for i, numel in enumerate(numels):
        if current and n + numel > limit:
            out.append(current)
            current, n = [], 0
        current.append(i)
        n += numel
    if current:
        out.append(current)
    return out
