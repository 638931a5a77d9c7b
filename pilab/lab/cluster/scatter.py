"""Data distribution for nodes without a copy of the data set: rank 0 sends each rank its shard::

    pilab.train(cfg, comm, data=cluster.load_scattered(cfg, comm))      # sharding="static" only
"""
from __future__ import annotations

import numpy as np

from ...config import ConfigError


def scatter_shards(ds, comm, *, seed: int = 0, root: int = 0):
    """Give every rank its static training shard and its test slice from ``root``'s copy of the data
    set, as raw uint8 buffers (``Scatterv``, no pickling), so the nodes need no copy on disk::

        ds = data.load("embedded") if comm.rank == 0 else None
        local = cluster.scatter_shards(ds, comm, seed=cfg.seed)
        pilab.train(cfg, comm, data=local)        # sharding="static" only

    The returned data set has the full shapes, but only this rank's rows are filled (the rest stay
    untouched zero pages, which cost no memory); ``data.ShardLoader`` and ``train.evaluate`` read just
    those rows. ``root`` returns ``ds`` itself. Labels (8 bytes an image) are broadcast to all.
    """
    # Imported here: mpi4py initialises MPI and pilab.data loads torch; the notebook client imports
    # pilab.lab.cluster without either.
    from ... import data as data_mod
    from ...launch import mpi
    MPI = mpi()

    rank, size = comm.Get_rank(), comm.Get_size()
    meta = None
    if rank == root:
        meta = {"n_train": len(ds.y_train), "n_test": len(ds.y_test), "classes": tuple(ds.classes),
                "source": ds.source, "checksum": ds.checksum}
    meta = comm.bcast(meta, root=root)
    n_train, n_test = meta["n_train"], meta["n_test"]
    pixel = 32 * 32 * 3

    y_train = ds.y_train if rank == root else np.empty(n_train, dtype=np.int64)
    y_test = ds.y_test if rank == root else np.empty(n_test, dtype=np.int64)
    comm.Bcast([np.ascontiguousarray(y_train, dtype=np.int64), MPI.INT64_T], root=root)
    comm.Bcast([np.ascontiguousarray(y_test, dtype=np.int64), MPI.INT64_T], root=root)

    # Every rank computes the same partition from the labels; only root reads pixels.
    shards = data_mod.static_shards(y_train, size, seed)
    test = [data_mod.test_shard(n_test, size, r) for r in range(size)]
    x_train = np.zeros((n_train, 32, 32, 3), np.uint8) if rank != root else None
    x_test = np.zeros((n_test, 32, 32, 3), np.uint8) if rank != root else None

    counts = [len(s) * pixel for s in shards]
    send = None
    if rank == root:
        send = [np.ascontiguousarray(ds.x_train[np.concatenate(shards)]), counts,
                np.cumsum([0] + counts[:-1]).tolist(), MPI.BYTE]
    recv = np.empty((len(shards[rank]), 32, 32, 3), np.uint8)
    comm.Scatterv(send, [recv, MPI.BYTE], root=root)
    if rank != root:
        x_train[shards[rank]] = recv

    tcounts = [(s.stop - s.start) * pixel for s in test]
    tsend = None
    if rank == root:
        tsend = [np.ascontiguousarray(ds.x_test), tcounts, [s.start * pixel for s in test], MPI.BYTE]
    trecv = np.empty((test[rank].stop - test[rank].start, 32, 32, 3), np.uint8)
    comm.Scatterv(tsend, [trecv, MPI.BYTE], root=root)
    if rank == root:
        return ds
    x_test[test[rank]] = trecv
    return data_mod.CIFAR10(x_train, y_train, x_test, y_test, classes=meta["classes"],
                            source=f"{meta['source']} [shard {rank}/{size} from rank {root}]",
                            checksum=meta["checksum"])


def load_scattered(cfg, comm, *, root: int = 0):
    """Rank ``root`` loads ``cfg``'s data set (with its subsets) and scatters the shards::

        pilab.train(cfg, comm, data=cluster.load_scattered(cfg, comm))
    """
    from ... import data as data_mod  # torch: see scatter_shards

    if cfg.sharding != "static":
        raise ConfigError("scattered data needs sharding='static'; 'reshuffle' reads the whole set on "
                          "every rank each epoch: put the data on every node (or a shared directory)")
    ds = None
    if comm.Get_rank() == root:
        ds = data_mod.load(cfg.data, train_subset=cfg.train_subset, test_subset=cfg.test_subset,
                           seed=cfg.seed)
    return scatter_shards(ds, comm, seed=cfg.seed, root=root)
