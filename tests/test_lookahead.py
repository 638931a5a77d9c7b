"""Lookahead (``Config.lookahead_steps``, pilab/engine/lookahead.py) on real images: every k steps the weights
are the midpoint of where they stood k steps before and where the optimizer took them; real MPI ranks equal
the simulator bit for bit; a run resumed mid-cycle equals the whole run bit for bit.

The MPI part launches ``mpiexec -n 2 python tests/test_lookahead.py OUT.json`` (this file is its own worker)."""
import os
import sys
from dataclasses import replace

import pytest
import torch

from mpi_vs_sim import assert_same, launch, worker
from pilab import engine

CFG = dict(width=0.25, train_subset=240, test_subset=100, batch_size=8, epochs=2, lr=0.2, threads=1, seed=3,
           lookahead_steps=4, simulate_mode="exact")  # 15 steps an epoch at np=2: cycles cross the epoch


def test_every_k_steps_the_weights_are_the_midpoint_and_a_resume_mid_cycle_is_bitwise(tmp_path):
    from pilab.config import Config
    from pilab.engine.backend import base_model
    cfg = Config(**CFG)
    start = [p.detach().clone() for p in base_model(cfg, torch.device("cpu")).parameters()]
    _, plain = engine.fit(replace(cfg, lookahead_steps=0, max_steps=4), engine.VirtualRanks(2))
    _, la = engine.fit(replace(cfg, max_steps=4), engine.VirtualRanks(2))
    for s, f, w in zip(start, plain.parameters(), la.parameters()):  # slow + 0.5 (fast - slow)
        torch.testing.assert_close(w.detach(), 0.5 * (s + f.detach()), rtol=1e-6, atol=1e-7)
    _, three = engine.fit(replace(cfg, max_steps=3),
                          engine.VirtualRanks(2))  # before the cycle ends: the optimizer's own
    _, plain3 = engine.fit(replace(cfg, lookahead_steps=0, max_steps=3), engine.VirtualRanks(2))
    assert all(torch.equal(a, b) for a, b in zip(three.parameters(), plain3.parameters()))

    whole, whole_model = engine.fit(cfg, engine.VirtualRanks(2))
    part = str(tmp_path / "part")
    engine.fit(replace(cfg, out=part, max_steps=10, checkpoint_every_steps=10),
               engine.VirtualRanks(2))  # 2 cycles + 2 steps
    rest, rest_model = engine.fit(replace(cfg, out=part, resume=os.path.join(part, "checkpoint.pt")),
                                  engine.VirtualRanks(2))
    assert rest["steps"]["loss"] == whole["steps"]["loss"][10:]
    assert all(torch.equal(a, b) for a, b in zip(rest_model.parameters(), whole_model.parameters()))
    unresumed, _ = engine.fit(replace(cfg, lookahead_steps=0), engine.VirtualRanks(2))
    assert unresumed["steps"]["loss"][4:] != whole["steps"]["loss"][4:]  # ... and it acted


@pytest.mark.mpi
def test_lookahead_over_mpi_ranks_equals_the_simulator(tmp_path):
    assert_same(launch(__file__, tmp_path / "lookahead.json"))


if __name__ == "__main__":
    from pilab.config import Config
    worker(Config(**CFG), sys.argv[1])
