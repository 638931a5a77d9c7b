"""One training over real MPI ranks and in the simulator, compared bit for bit: a test file that is its own
worker launches itself under ``mpiexec`` (``launch``); the worker trains the Config both ways (``worker``) and
rank 0 writes both runs' numbers; ``assert_same`` checks them::

    r = launch(__file__, tmp_path / "out.json")          # in the test
    assert_same(r)
    if __name__ == "__main__":
        worker(Config(**CFG), sys.argv[1])                # the file run by mpiexec
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import MPIEXEC, mpi_env
from pilab import engine


def launch(test_file: str, out: Path, np_: int = 2, timeout: int = 420) -> dict:
    p = subprocess.run([MPIEXEC, "-n", str(np_), sys.executable, test_file, str(out)], capture_output=True,
                       text=True, timeout=timeout, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(Path(out).read_text())


def worker(cfg, out: str, extra=None, components=tuple) -> None:
    """Train ``cfg`` on this MPI world and (rank 0) in the simulator at the same np; ``extra(cfg, comm, ds)``
    may add its own numbers (a run without the feature, to show that it acted); ``components()``: fresh
    components of your own for each run."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    ds = engine.load_data(cfg, comm)
    result, model = engine.fit(cfg, engine.MPIRanks(comm), data=ds, components=components())
    more = extra(cfg, comm, ds) if extra else {}
    if comm.Get_rank() == 0:
        sim, sim_model = engine.fit(cfg, engine.VirtualRanks(comm.Get_size()), data=ds, components=components())
        diffs = [float((a - b).abs().max()) for a, b in zip(model.parameters(), sim_model.parameters())]
        Path(out).write_text(json.dumps({
            "mpi_loss": result["steps"]["loss"], "sim_loss": sim["steps"]["loss"],
            "weights_equal": max(diffs) == 0.0, "max_weight_diff": max(diffs),
            "mpi_test_acc": [e["test_acc"] for e in result["epochs"]],
            "sim_test_acc": [e["test_acc"] for e in sim["epochs"]],
            "mpi_result": {k: result[k] for k in result if k not in ("steps", "epochs", "env")},
            "sim_result": {k: sim[k] for k in sim if k not in ("steps", "epochs", "env")}, **more}, default=str))


def assert_same(r: dict) -> None:
    assert r["mpi_loss"] == r["sim_loss"]  # every step's loss, bit for bit
    assert r["weights_equal"], r["max_weight_diff"]
    assert r["mpi_test_acc"] == r["sim_test_acc"]
