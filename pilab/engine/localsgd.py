"""Local SGD and post-local SGD (Stich 2019; Lin et al., ICLR 2020): each rank takes ``local_steps``
(H) steps on its own copy of the model, then the ranks average their parameters (and BatchNorm
running statistics). Communication falls by H: one Allreduce of the parameters every H steps instead of
one of the gradients every step. ``local_after`` epochs of ordinary synchronous steps come first
(post-local SGD: the early, large-gradient phase synchronous, the later one local)::

    cfg = Config(local_steps=8, local_after=2)      # 2 synchronous epochs, then average every 8 steps
    ParameterAverage(gsync)()                        # an MPI rank's average (pilab.engine.mpi.MPIRanks)
    phase(cfg, steps_per_epoch=39, epoch=3, step=7)  # Phase(local=True, average=True)

The loop's feature is ``LocalSGD``, a component: before every step it sets ``session.phase`` (this
schedule's ``Phase``), which the rank backend's ``step(..., phase=)`` follows (a local step, an average
after it) and the weights' EMA reads; the backends know how to take a local step and average, not when.

Every epoch ends with an average, whatever H: evaluation, an epoch's checkpoint and the result then see
one model on every rank, and the plan does not depend on when a run is evaluated or resumed.

Momentum buffers stay each rank's own (Lin et al.'s local SGD); a checkpoint keeps every rank's
parameters and optimizer state (``rank_state`` / ``VirtualReplicas.state``), so a resume at the same np
continues the run exactly. The simulator (``VirtualReplicas``) keeps np copies of the parameters and
optimizer state in one process and averages them as MPI does (each rank's copy divided by np, summed
in rank order, the gradient buckets' layout): tests/test_mpi.py checks it against ``mpiexec`` at np 2, 3.
"""
from __future__ import annotations

import copy

import torch

from .checkpoint import CheckpointError
from ..dist.comm import MPI, _buf
from ..component import SYNC, Component, Phase


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

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return cfg.local_steps > 1

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


def rank_state(params: list, optimizer) -> dict:
    """This rank's own parameters and optimizer state (copies): what a local-SGD checkpoint keeps per rank."""
    return {"params": [p.detach().clone() for p in params],
            "opt": [copy.deepcopy(optimizer.state.get(p, {})) for p in params]}


@torch.no_grad()
def load_rank_state_(params: list, optimizer, state: dict) -> None:
    """The inverse of ``rank_state`` on this rank."""
    for p, v in zip(params, state["params"]):
        p.copy_(v)
    for p, st in zip(params, state["opt"]):
        optimizer.state[p] = copy.deepcopy(st)


class VirtualReplicas:
    """np ranks' own parameters and optimizer state in one process (the simulator's local SGD).

    ``enter(r)`` points the model's parameters and the optimizer's state at rank r's (no copy: the
    tensors are swapped in), so a forward, backward and ``optimizer.step()`` then are rank r's;
    ``average_()`` averages the parameters as MPI does; after a step the model holds rank 0's copy,
    as an MPI job's rank 0 does (its ``state_dict`` is what a checkpoint saves)::

        reps = VirtualReplicas(params, optimizer, np_)
        for r in range(np_):
            reps.enter(r); loss_r.backward(); optimizer.step()
        reps.average_(); reps.enter(0)
    """

    def __init__(self, params: list, optimizer, np_: int, state: list | None = None):
        self.params, self.optimizer, self.np_ = params, optimizer, np_
        if state is not None:  # from a checkpoint (``state()``)
            self.data = [[t.clone() for t in s["params"]] for s in state]
            self.opt = [[copy.deepcopy(st) for st in s["opt"]] for s in state]
        else:  # every rank starts from the model as it is (after synchronous steps: the same everywhere)
            self.data = [[p.detach().clone() for p in params] for _ in range(np_)]
            self.opt = [[copy.deepcopy(optimizer.state.get(p, {})) for p in params] for _ in range(np_)]
        self.enter(0)

    def enter(self, r: int) -> None:
        for i, p in enumerate(self.params):
            p.data = self.data[r][i]
            self.optimizer.state[p] = self.opt[r][i]

    @torch.no_grad()
    def average_(self) -> None:
        """Every rank's parameters become the mean: each copy divided by np, added in rank order."""
        acc = [torch.zeros_like(t) for t in self.data[0]]
        for r in range(self.np_):
            torch._foreach_add_(acc, torch._foreach_div(self.data[r], self.np_))
        for r in range(self.np_):
            torch._foreach_copy_(self.data[r], acc)

    def state(self) -> list:
        """Every rank's parameters and optimizer state, in rank order (for a checkpoint)."""
        return [{"params": [t.clone() for t in self.data[r]], "opt": copy.deepcopy(self.opt[r])}
                for r in range(self.np_)]


class ParameterAverage:
    """Local SGD's parameter average over MPI ranks (blocking), on ``sync``'s (a ``GradSync``) buckets::

        average = ParameterAverage(gsync)
        sent = average()       # every rank's parameters now the mean; the bytes this rank sent

    In the gradient buckets' layout and order, each bucket divided by the world size and summed by
    Allreduce: the sums are formed as the gradients' are, which the simulator reproduces
    (``VirtualReplicas.average_``)."""

    def __init__(self, sync):
        self.sync = sync
        self.flats: list | None = None  # one buffer per bucket, made on first use

    @torch.no_grad()
    def __call__(self) -> int:
        sync = self.sync
        if sync.size == 1:
            return 0
        if self.flats is None:
            self.flats = [torch.empty_like(b.flat) for b in sync.buckets]
        reqs, sent = [], 0
        for b, flat in zip(sync.buckets, self.flats):
            offset = 0
            for p in b.params:
                n = p.numel()
                flat[offset:offset + n].copy_(p.reshape(-1))
                offset += n
            flat.div_(sync.size)
            reqs.append(sync.comm.Iallreduce(MPI.IN_PLACE, _buf(flat), op=MPI.SUM))
            sent += flat.numel() * flat.element_size()
        MPI.Request.Waitall(reqs)
        for b, flat in zip(sync.buckets, self.flats):
            offset = 0
            for p in b.params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        return sent
