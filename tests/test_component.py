"""Your own component (``pilab.Component``) in the loop, as pilab's own features are: a gradient-noise
injection written here, with its own seeded generator, gives the same run bit for bit under real
``mpiexec`` ranks and in the simulator, at np 2 and 3 (this file is its own worker: the pytest side launches
``mpiexec -n NP python tests/test_component.py OUT.json``); and it reaches a run through ``pilab.simulate``,
``pilab.scale`` and a checkpoint's resume."""
import sys
from dataclasses import replace

import pytest
import torch

import pilab
from mpi_vs_sim import assert_same, launch, worker
from pilab import engine

CFG = dict(width=0.25, train_subset=240, test_subset=100, batch_size=8, epochs=2, lr=0.2, threads=1, seed=3,
           bucket_mb=0.25, simulate_mode="exact")  # bit for bit: exact


class GradientNoise(pilab.Component):
    """Gaussian noise on the averaged gradient, the same on every rank: each rank's generator is seeded
    alike and draws once per step, in the parameters' order."""

    name, stage = "gradient_noise", pilab.Stage.GRADIENTS

    def __init__(self, sigma: float = 0.02, seed: int = 7):
        self.sigma, self.gen, self.draws = sigma, torch.Generator().manual_seed(seed), 0

    def on_grads(self, grads):
        for g in grads:
            g.add_(torch.randn(g.shape, generator=self.gen) * self.sigma)
        self.draws += 1

    def state_dict(self):
        return {"gen": self.gen.get_state(), "draws": self.draws}

    def load_state_dict(self, state):
        self.gen.set_state(state["gen"])
        self.draws = state["draws"]

    def result(self) -> dict:
        return {"gradient_noise_draws": self.draws}


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_your_component_is_exact_under_mpiexec_and_in_the_simulator(tmp_path, np_):
    r = launch(__file__, tmp_path / "noise.json", np_=np_)
    assert_same(r)
    assert r["plain_loss"][1:] != r["mpi_loss"][1:]  # ... and the noise did act
    steps = len(r["mpi_loss"])
    for side in ("mpi_result", "sim_result"):
        assert r[side]["components"] == ["gradient_noise"], r[side]
        assert r[side]["gradient_noise_draws"] == steps


def test_your_component_rides_in_checkpoints_and_runs_in_a_study(tmp_path):
    cfg = pilab.Config(**dict(CFG, train_subset=128, test_subset=40, epochs=1))
    whole = pilab.simulate(cfg, 2, components=[GradientNoise()])
    k = whole["steps_done"] // 2
    part = replace(cfg, out=str(tmp_path / "part"), checkpoint_every_steps=k, max_steps=k)
    pilab.simulate(part, 2, components=[GradientNoise()])
    rest = pilab.simulate(replace(part, max_steps=0, resume=str(tmp_path / "part" / "checkpoint.pt")), 2,
                          components=[GradientNoise()])  # its generator's state comes from the checkpoint
    assert whole["steps"]["loss"][k:] == rest["steps"]["loss"]
    study = pilab.scale(cfg, nps=(), simulate_nps=(2,), components=[GradientNoise()], out=str(tmp_path / "s"))
    assert study["runs"]["2"]["steps"]["loss"] == whole["steps"]["loss"]  # a fresh copy per point
    assert study["runs"]["2"]["components"] == ["gradient_noise"]


def test_components_run_in_stage_order_yours_after_pilabs_within_a_stage():
    cfg = pilab.Config(clip_grad_norm=1.0, ema_epochs=1.0, local_steps=4)
    mine = GradientNoise()
    order = engine.chosen(cfg, engine.VirtualRanks(2), [mine])
    assert [c.stage for c in order] == sorted(c.stage for c in order)
    names = [c.name for c in order]
    assert names.index("clip_grad_norm") < names.index("gradient_noise") < names.index("ema")
    with pytest.raises(ValueError, match="share a name"):
        engine.chosen(cfg, engine.VirtualRanks(2), [GradientNoise(), GradientNoise()])


def _plain(cfg, comm, ds) -> dict:
    plain, _ = engine.fit(cfg, engine.MPIRanks(comm), data=ds)
    return {"plain_loss": plain["steps"]["loss"]}


if __name__ == "__main__":
    worker(pilab.Config(**CFG), sys.argv[1], extra=_plain, components=lambda: [GradientNoise()])
