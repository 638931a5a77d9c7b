"""Gradient clipping by global norm (``Config.clip_grad_norm``, pilab/engine/clip.py) over real MPI ranks
equals the simulator's, bit for bit: every rank clips the same averaged gradient by the same factor.

The pytest side launches ``mpiexec -n 2 python tests/test_clip.py OUT.json`` (this file is its own worker);
rank 0 trains the simulator too and writes both runs' numbers."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import MPIEXEC, mpi_env

CFG = dict(width=0.25, train_subset=240, test_subset=100, batch_size=8, epochs=2, lr=0.2, threads=1, seed=3,
           bucket_mb=0.25, clip_grad_norm=0.5, simulate_mode="exact")  # bit for bit: exact


@pytest.mark.mpi
def test_clipping_by_global_norm_over_mpi_ranks_equals_the_simulator(tmp_path):
    out = tmp_path / "clip.json"
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, __file__, str(out)], capture_output=True, text=True,
                       timeout=420, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mpi_loss"] == r["sim_loss"]  # every step's loss, bit for bit
    assert r["weights_equal"], r["max_weight_diff"]
    assert r["mpi_test_acc"] == r["sim_test_acc"]
    assert r["unclipped_loss"][1:] != r["mpi_loss"][1:]  # ... and the clipping did act


def _worker(out: str) -> None:
    import torch
    from mpi4py import MPI

    from pilab.config import Config
    from pilab.engine import simulate, train
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    cfg = Config(**CFG)
    ds = train.load_data(cfg, comm)
    result, model = train.train(cfg, comm, data=ds)
    plain, _ = train.train(replace(cfg, clip_grad_norm=0.0), comm, data=ds)
    if comm.Get_rank() == 0:
        sim, sim_model = simulate.train(cfg, comm.Get_size(), data=ds)
        diffs = [float((a - b).abs().max()) for a, b in zip(model.parameters(), sim_model.parameters())]
        Path(out).write_text(json.dumps({
            "mpi_loss": result["steps"]["loss"], "sim_loss": sim["steps"]["loss"],
            "unclipped_loss": plain["steps"]["loss"], "weights_equal": max(diffs) == 0.0,
            "max_weight_diff": max(diffs), "mpi_test_acc": [e["test_acc"] for e in result["epochs"]],
            "sim_test_acc": [e["test_acc"] for e in sim["epochs"]]}))


if __name__ == "__main__":
    _worker(sys.argv[1])
