"""What runs inside each engine (= MPI rank): called from ``%%px`` cells and by :meth:`Engines.train`::

    %%px
    from mpi4py import MPI
    from pilab import engine
    from pilab.lab import cluster
    with cluster.stop_flag() as stop:              # a kernel interrupt stops every rank after a step
        result, model = engine.fit(cfg, engine.MPIRanks(MPI.COMM_WORLD), stop=stop)
    cluster.rank_state(MPI.COMM_WORLD, model, result)    # a table of what each rank holds, on rank 0

mpi4py, torch and the engine's loop are imported inside the functions that need them: importing mpi4py
initialises MPI, and the notebook client imports this module (to send :func:`engine_train` to the
engines) without becoming an MPI process or loading torch.

Data distribution for nodes without a copy of the data set: rank 0 sends each rank its shard::

    pilab.train(cfg, comm, data=cluster.load_scattered(cfg, comm))      # sharding="static" only
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

import numpy as np

from ...config import ConfigError
from ...engine import handled
from .events import begin_stream, publish


class ClusterError(RuntimeError):
    """Engines are missing, a rank died or stopped making progress; raised by every part of
    :mod:`pilab.lab.cluster`, its message naming the ranks, the profile or the hostfile, and what to do::

        try:
            lab = cluster.start(n=4)
        except cluster.ClusterError as e:
            print(e)
    """


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


def whoami() -> dict:
    """This engine's MPI rank, world size, host and pid."""
    from ...launch import mpi
    MPI = mpi()  # on the engines only (see the module docstring)

    return {"rank": MPI.COMM_WORLD.Get_rank(), "size": MPI.COMM_WORLD.Get_size(),
            "host": socket.gethostname(), "pid": os.getpid()}


class StopFlag:
    """A callable that says whether a stop was requested (``pilab.train(..., stop=flag)``)."""

    def __init__(self):
        self.requested_at: float | None = None

    def set(self) -> None:
        if self.requested_at is None:
            self.requested_at = time.time()

    def __call__(self) -> bool:
        return self.requested_at is not None


@contextlib.contextmanager
def stop_flag(signals=(signal.SIGINT,)):
    """Turn SIGINT into a stop request for the duration of the block::

        %%px
        with cluster.stop_flag() as stop:
            result = pilab.train(cfg, MPI.COMM_WORLD, stop=stop)

    Interrupting the notebook kernel during that cell makes ipyparallel send SIGINT to the engines;
    here it sets the flag instead of raising KeyboardInterrupt in the middle of a collective (which
    would leave the other ranks waiting forever). ``pilab.train`` polls the flag every step and stops
    all ranks together when any rank has it set. Outside the main thread it yields a plain flag.
    """
    flag = StopFlag()
    with handled(signals, lambda signum, frame: flag.set()):
        yield flag


# The last run on this engine: %%px cells can look at the trained model (see rank_state). Only ever
# mutated, never rebound, so `cluster.last` (the package's re-export) is the same dict.
last: dict = {}


def engine_train(cfg, np_: int | None = None, *, stream: bool = True, scatter: bool = False,
                 hang_s: float = 0.0, components=()) -> dict:
    """Train on ranks ``0..np_-1`` of COMM_WORLD; call it on every engine (it splits the world).

    Ranks ``>= np_`` get no communicator and return ``{"rank": r, "idle": True}`` at once. Rank 0 of
    the run publishes events (``stream``) and returns the result; the others return a short summary.
    The model stays in ``cluster.last["model"]`` on each rank of the run::

        lab.view.apply_async(cluster.engine_train, cfg, 2)     # what Engines.train does
    """
    from ...engine import guarded_run  # these two on the engines only (see the module docstring)
    from ...launch import mpi
    MPI = mpi()

    world = MPI.COMM_WORLD
    np_ = world.Get_size() if np_ is None else int(np_)
    if not 1 <= np_ <= world.Get_size():
        raise ClusterError(f"np_={np_} must be between 1 and the world size {world.Get_size()}")
    rank = world.Get_rank()
    begin_stream()
    with stop_flag() as stop:
        comm = world.Split(0 if rank < np_ else MPI.UNDEFINED, rank)
        if comm == MPI.COMM_NULL:
            return {"rank": rank, "idle": True}
        try:
            callbacks = [publish] if stream and comm.Get_rank() == 0 else []
            data = load_scattered(cfg, comm) if scatter else None
            # A node off the network can never rejoin this run: after hang_s without a step every rank
            # ends itself, naming the unreachable ranks (the client reports them as died). A stuck but
            # reachable rank is left to the client's own hang report.
            out = guarded_run(cfg, comm, data=data, callbacks=callbacks, hang_s=hang_s, where="engine",
                              stop=stop, components=components)
            result = out.result
            last.clear()
            last.update(model=out.model, cfg=cfg, np=np_, rank=comm.Get_rank(), result=result)
        finally:
            comm.Free()
    if rank == 0:
        return result
    return {"rank": rank, "np": result["np"], "stopped_early": result["stopped_early"]}


class RankTable(list):
    """A list of per-rank dicts (index = rank) that prints as a table."""

    def __repr__(self) -> str:
        if not self:
            return "(no ranks)"
        keys = list(self[0])
        cells = [[_fmt(r.get(k)) for k in keys] for r in self]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
        line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
        return "\n".join([line(keys)] + [line(c) for c in cells])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(_fmt(x) for x in v) + "]"
    return str(v)


def rank_state(comm, model=None, result: dict | None = None, *, values: int = 3,
               root: int = 0) -> RankTable | None:
    """Gather, in rank order on ``root``, what each rank holds: host, pid, its training shard size
    and the first ``values`` running means of the model's first BatchNorm layer (None elsewhere)::

        %%px
        cluster.rank_state(MPI.COMM_WORLD, model, result)    # shows the table on rank 0 only

    ``model``/``result`` default to this engine's last :func:`engine_train` run.
    """
    import torch  # only where a model is (see the module docstring)

    model = model if model is not None else last.get("model")
    result = result if result is not None else last.get("result")
    rank = comm.Get_rank()
    row = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
    sizes = (result or {}).get("data", {}).get("shard_sizes")
    row["shard_size"] = sizes[rank] if sizes and rank < len(sizes) else None
    bn = next((m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
              if model is not None else None, None)
    row["bn_running_mean"] = bn.running_mean[:values].tolist() if bn is not None else None
    rows = comm.gather(row, root=root)
    return RankTable(rows) if rank == root else None
