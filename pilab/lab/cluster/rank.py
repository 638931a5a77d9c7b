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
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

from ...engine.signals import handled
from .errors import ClusterError
from .events import begin_stream, publish
from .scatter import load_scattered


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
    from ...engine.harness import guarded_run  # these two on the engines only (see the module docstring)
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
