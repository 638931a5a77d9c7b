"""Gradient clipping by global norm (``Config.clip_grad_norm``, pilab/engine/clip.py) over real MPI ranks
equals the simulator's, bit for bit: every rank clips the same averaged gradient by the same factor.

The pytest side launches ``mpiexec -n 2 python tests/test_clip.py OUT.json`` (this file is its own worker);
rank 0 trains the simulator too and writes both runs' numbers."""
import sys
from dataclasses import replace

import pytest

from mpi_vs_sim import assert_same, launch, worker
from pilab import engine

CFG = dict(width=0.25, train_subset=240, test_subset=100, batch_size=8, epochs=2, lr=0.2, threads=1, seed=3,
           bucket_mb=0.25, clip_grad_norm=0.5, simulate_mode="exact")  # bit for bit: exact


@pytest.mark.mpi
def test_clipping_by_global_norm_over_mpi_ranks_equals_the_simulator(tmp_path):
    r = launch(__file__, tmp_path / "clip.json")
    assert_same(r)
    assert r["unclipped_loss"][1:] != r["mpi_loss"][1:]  # ... and the clipping did act


def _unclipped(cfg, comm, ds) -> dict:
    plain, _ = engine.fit(replace(cfg, clip_grad_norm=0.0), engine.MPIRanks(comm), data=ds)
    return {"unclipped_loss": plain["steps"]["loss"]}


if __name__ == "__main__":
    from pilab.config import Config
    worker(Config(**CFG), sys.argv[1], extra=_unclipped)
