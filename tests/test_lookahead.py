"""Lookahead (``Config.lookahead_steps``, pilab/engine/lookahead.py) on real images: every k steps the weights
are the midpoint of where they stood k steps before and where the optimizer took them; real MPI ranks equal
the simulator bit for bit; a run resumed mid-cycle equals the whole run bit for bit.

The MPI part launches ``mpiexec -n 2 python tests/test_lookahead.py OUT.json`` (this file is its own worker)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import MPIEXEC, mpi_env

CFG = dict(width=0.25, train_subset=240, test_subset=100, batch_size=8, epochs=2, lr=0.2, threads=1, seed=3,
           lookahead_steps=4, simulate_mode="exact")  # 15 steps an epoch at np=2: cycles cross the epoch


def test_every_k_steps_the_weights_are_the_midpoint_and_a_resume_mid_cycle_is_bitwise(tmp_path):
    from pilab.config import Config
    from pilab.engine import simulate
    from pilab.engine.backend import base_model
    cfg = Config(**CFG)
    start = [p.detach().clone() for p in base_model(cfg, torch.device("cpu")).parameters()]
    _, plain = simulate.train(replace(cfg, lookahead_steps=0, max_steps=4), 2)
    _, la = simulate.train(replace(cfg, max_steps=4), 2)
    for s, f, w in zip(start, plain.parameters(), la.parameters()):  # slow + 0.5 (fast - slow)
        torch.testing.assert_close(w.detach(), 0.5 * (s + f.detach()), rtol=1e-6, atol=1e-7)
    _, three = simulate.train(replace(cfg, max_steps=3), 2)  # before the cycle ends: the optimizer's own
    _, plain3 = simulate.train(replace(cfg, lookahead_steps=0, max_steps=3), 2)
    assert all(torch.equal(a, b) for a, b in zip(three.parameters(), plain3.parameters()))

    whole, whole_model = simulate.train(cfg, 2)
    part = str(tmp_path / "part")
    simulate.train(replace(cfg, out=part, max_steps=10, checkpoint_every_steps=10), 2)  # 2 cycles + 2 steps
    rest, rest_model = simulate.train(replace(cfg, out=part, resume=os.path.join(part, "checkpoint.pt")), 2)
    assert rest["steps"]["loss"] == whole["steps"]["loss"][10:]
    assert all(torch.equal(a, b) for a, b in zip(rest_model.parameters(), whole_model.parameters()))
    unresumed, _ = simulate.train(replace(cfg, lookahead_steps=0), 2)
    assert unresumed["steps"]["loss"][4:] != whole["steps"]["loss"][4:]  # ... and it acted


@pytest.mark.mpi
def test_lookahead_over_mpi_ranks_equals_the_simulator(tmp_path):
    out = tmp_path / "lookahead.json"
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, __file__, str(out)], capture_output=True, text=True,
                       timeout=420, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mpi_loss"] == r["sim_loss"]  # every step's loss, bit for bit
    assert r["weights_equal"], r["max_weight_diff"]
    assert r["mpi_test_acc"] == r["sim_test_acc"]


def _worker(out: str) -> None:
    from mpi4py import MPI

    from pilab.config import Config
    from pilab.engine import simulate, train
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    cfg = Config(**CFG)
    ds = train.load_data(cfg, comm)
    result, model = train.train(cfg, comm, data=ds)
    if comm.Get_rank() == 0:
        sim, sim_model = simulate.train(cfg, comm.Get_size(), data=ds)
        diffs = [float((a - b).abs().max()) for a, b in zip(model.parameters(), sim_model.parameters())]
        Path(out).write_text(json.dumps({
            "mpi_loss": result["steps"]["loss"], "sim_loss": sim["steps"]["loss"],
            "weights_equal": max(diffs) == 0.0, "max_weight_diff": max(diffs),
            "mpi_test_acc": [e["test_acc"] for e in result["epochs"]],
            "sim_test_acc": [e["test_acc"] for e in sim["epochs"]]}))


if __name__ == "__main__":
    _worker(sys.argv[1])
