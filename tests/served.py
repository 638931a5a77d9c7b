"""Which training images each (virtual) rank was served, however the loop asked for them.

A rank's batch comes from ``ShardLoader.batch`` (an MPI rank, the bitwise simulator) or, for several ranks at
once, from ``data.ranks_batch`` (the fast simulator's global batch, which may itself ask each loader). Tests
that check the data order must see both, or a whole run goes unrecorded (it happened twice)::

    with served_batches(lambda loader, epoch, step, y: rows.append((epoch, loader.rank, y))):
        engine.train(cfg, engine.VirtualRanks(48))
"""
from __future__ import annotations

from pilab import data


class served_batches:
    """Call ``on_batch(loader, epoch, step, y)`` once per rank and step served, ``y`` that rank's labels."""

    def __init__(self, on_batch):
        self.on_batch = on_batch

    def __enter__(self):
        self.orig, self.orig_ranks = data.ShardLoader.batch, data.ranks_batch
        orig, orig_ranks, on_batch, inside = self.orig, self.orig_ranks, self.on_batch, []

        def batch(loader, epoch, step, share=None):  # share: a balanced rank's part of the global batch
            x, y = orig(loader, epoch, step, share=share)
            if not inside:  # asked by ranks_batch: reported there
                on_batch(loader, epoch, step, y)
            return x, y

        def ranks_batch(loaders, epoch, step):
            inside.append(1)
            try:
                x, y = orig_ranks(loaders, epoch, step)
            finally:
                inside.pop()
            b = len(y) // len(loaders)  # rank order, the same batch size each
            for i, loader in enumerate(loaders):
                on_batch(loader, epoch, step, y[i * b:(i + 1) * b])
            return x, y
        data.ShardLoader.batch, data.ranks_batch = batch, ranks_batch
        return self

    def __exit__(self, *exc):
        data.ShardLoader.batch, data.ranks_batch = self.orig, self.orig_ranks
