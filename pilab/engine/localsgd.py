"""Local SGD and post-local SGD (Stich 2019; Lin et al., ICLR 2020): each rank takes ``local_steps``
(H) steps on its own copy of the model, then the ranks average their parameters (and BatchNorm
running statistics). Communication falls by H: one Allreduce of the parameters every H steps instead of
one of the gradients every step. ``local_after`` epochs of ordinary synchronous steps come first
(post-local SGD: the early, large-gradient phase synchronous, the later one local)::

    cfg = Config(local_steps=8, local_after=2)      # 2 synchronous epochs, then average every 8 steps
    phase(cfg, steps_per_epoch=39, epoch=3, step=7)  # Phase(local=True, average=True)

The loop's feature is ``LocalSGD``, a component: before every step it sets ``session.phase`` (this
schedule's ``Phase``), which the rank backend's ``step(..., phase=)`` follows (a local step, an average
after it) and the weights' EMA reads; the backends know how to take a local step and average (MPI ranks:
``GradSync.average_parameters_``; the simulator: ``pilab.engine.virtual.VirtualReplicas``), not when.

Every epoch ends with an average, whatever H: evaluation, an epoch's checkpoint and the result then see
one model on every rank, and the plan does not depend on when a run is evaluated or resumed.

Momentum buffers stay each rank's own (Lin et al.'s local SGD); a checkpoint keeps every rank's
parameters and optimizer state (the backends' ``rank_states`` after a local step), so a resume at the same
np continues the run exactly. The simulator (``VirtualReplicas``) keeps np copies of the parameters and
optimizer state in one process and averages them as MPI does (each rank's copy divided by np, summed
in rank order, the gradient buckets' layout): tests/test_mpi.py checks it against ``mpiexec`` at np 2, 3.
"""
from __future__ import annotations

from ..component import SYNC, Component, Phase, Stage
from ..config import ConfigError
from .checkpoint import CheckpointError


def phase(cfg, steps_per_epoch: int, epoch: int, step: int) -> Phase:
    """What step ``step`` (0-based) of ``epoch`` does under ``cfg.local_steps`` / ``cfg.local_after``."""
    if cfg.local_steps <= 1:
        return SYNC
    if epoch * steps_per_epoch + step < round(cfg.local_after * steps_per_epoch):
        return SYNC
    return Phase(local=True, average=(step + 1) % cfg.local_steps == 0 or step + 1 == steps_per_epoch)


class LocalSGD(Component):
    """The loop's feature (``Config.local_steps`` > 1): each step's ``Phase`` (``session.phase``, before
    the step), and the refusal to resume at another np between two parameter averages."""

    name = "local_sgd"
    stage = Stage.PLAN
    per_rank = True  # each rank's own weights: the simulator runs one rank per forward

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return cfg.local_steps > 1

    def setup(self, cfg, ranks) -> None:
        super().setup(cfg, ranks)
        if ranks.simulated and cfg.simulate_mode == "fast":
            raise ConfigError("simulate_mode=fast runs several ranks per forward, but local SGD (local_steps > 1) "
                              "gives each rank its own weights; use simulate_mode=exact")

    def start(self, session) -> None:
        s = session
        if s.start_step and s.resumed_np != s.np_ and \
                phase(self.cfg, s.steps_per_epoch, s.start_epoch, s.start_step - 1).local:
            raise CheckpointError(f"{self.cfg.resume} was taken between two parameter averages of local SGD, where "
                                  f"each of its {s.resumed_np} ranks holds its own weights; resume it at "
                                  f"np={s.resumed_np}, or from an epoch's checkpoint (checkpoint-eNNNN.pt)")

    def before_step(self, session, epoch: int, step: int) -> None:
        # the steps of the epoch as the backend cuts them (a batch ramp's epoch: its own)
        session.phase = phase(self.cfg, session.ranks.steps_per_epoch, epoch, step)


def averages_per_epoch(local_steps: int, steps_per_epoch: int) -> int:
    """Parameter averages in one local epoch: every H steps and at the epoch's end."""
    return -(-steps_per_epoch // local_steps)
