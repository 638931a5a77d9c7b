"""The simulator's ``auto`` mode, measured: before a long run's first step, time a few steps of the
fast and the exact mode on this machine and run the faster one (both meet ``auto``'s need: the
mathematics of MPI's ranks, to float rounding or better). Which one wins depends on the model and the
per-rank batch (the simulator section of benchmarks/LOG.md: fast is 0.89x one process at
MobileNetV2-CIFAR 0.25 32 x 48 where exact is 1.16x, but 1.17x at MobileNetV2 1.0 32 x 8 where exact is
1.08x), so no rule written from one machine's table would pick right on the next one; a measurement costs
a few steps.
It is the loop component ``ModePick`` (``pilab.component``), wanted by ``simulate_mode=auto`` on
the simulator; result.json gets ``simulate_mode_trial`` (the times, or why there was no trial) beside
the backend's ``simulate_mode_used``::

    python -m pilab simulate --np 48 --epochs 10        # auto: "simulate_mode_trial": {"chosen": "fast", ...}

The trial steps run on the run's own first batch and model, and everything they change (weights,
BatchNorm rows, optimizer state, the RNG, dropout's per-rank streams, gradients) is put back bit for bit, so the run that follows is
the chosen mode's run exactly as if it had been asked for by name: ``result.json``'s
``simulate_mode_used`` is a setting a rerun can give (``--simulate-mode exact``) and get the same bits.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from ..component import Component, Stage

# A run shorter than this many steps keeps the fast mode untimed: the trial's steps (up to ~3x a fast
# step each where exact is slow: the small per-rank kernels of 4-image batches) would be > ~5% of it.
MIN_STEPS = 200
# Each mode's steps in the trial, alternated after one untimed warm-up step each (the first step of a
# mode allocates its buffers and picks its kernels): the median of these is the mode's step time.
ROUNDS = 2


def wanted_trial(cfg, device, np_: int, total_steps: int, given_chunk: int, mode: str) -> str:
    """Why this run does not time the modes ('' when it does): only ``auto``, on a CPU (on a GPU the
    exact mode's per-rank kernels leave the device idle: fast), with more than one rank, the fast mode
    allowed, each rank's BatchNorm its own (SyncBatchNorm runs all ranks in one forward in either mode)
    and no ranks_per_chunk given::

        wanted_trial(Config(), torch.device("cpu"), 48, 320, 0, "fast")       # ''
    """
    if cfg.simulate_mode != "auto":
        return "simulate_mode is set"
    if mode != "fast":
        return "the run needs the exact mode"
    if device.type != "cpu":
        return "on a GPU the fast mode"
    if np_ < 2 or cfg.bn == "sync" or given_chunk:
        return "one forward either way" if np_ >= 2 else "one rank"
    if total_steps < MIN_STEPS:
        return f"{total_steps} steps < {MIN_STEPS}: not worth timing"
    return ""


def pick(ranks, cfg, model, optimizer, epoch: int, step: int) -> tuple[str, dict]:
    """Time ``ROUNDS`` steps of each mode on (``epoch``, ``step``)'s batch, alternated, restore every
    state the steps touched, and return the faster mode by median wall time (what the user waits for;
    the process's CPU time is recorded beside it) and the measurements for result.json.
    ``ranks`` is the ``VirtualRanks`` about to run; its ``use(mode)`` switches it."""
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(optimizer.state_dict())
    saved_rng = torch.get_rng_state()
    saved_grads = [None if p.grad is None else p.grad.detach().clone() for p in ranks.params]
    # the components' in-step moments (clipping, a meter, your own gradient noise) stay out of the trial
    components, ranks.components = ranks.components, ()
    wall = {"fast": [], "exact": []}
    cpu = {"fast": [], "exact": []}
    t_start = time.perf_counter()
    try:
        for i in range(ROUNDS + 1):
            for mode in ("fast", "exact") if i % 2 == 0 else ("exact", "fast"):
                ranks.use(mode)
                w0, c0 = time.perf_counter(), time.process_time()
                ranks.step(cfg, model, optimizer, epoch, step)
                if i:  # the first round warms each mode up
                    wall[mode].append(time.perf_counter() - w0)
                    cpu[mode].append(time.process_time() - c0)
                # put back what the step changed, so every trial step (and the run) starts from the same state
                ranks.context.streams, ranks.context.streams_step = {}, None  # RankDropout's streams of the step
                model.load_state_dict(saved_model)
                optimizer.load_state_dict(copy.deepcopy(saved_opt))
    finally:
        ranks.components = components
        torch.set_rng_state(saved_rng)
        for p, g in zip(ranks.params, saved_grads):
            if g is None:
                p.grad = None
            else:
                p.grad.copy_(g)
    med = {m: statistics.median(v) for m, v in wall.items()}
    chosen = min(med, key=med.get)
    ranks.use(chosen)
    return chosen, {"chosen": chosen, "by": "median wall time of the trial steps",
                    "wall_s": {m: [round(t, 4) for t in v] for m, v in wall.items()},
                    "cpu_s": {m: [round(t, 4) for t in v] for m, v in cpu.items()},
                    "trial_s": round(time.perf_counter() - t_start, 2)}


class ModePick(Component):
    """``simulate_mode=auto`` on the simulator: before the first step, the trial (``pick``) where
    ``wanted_trial`` says so; the choice is kept in checkpoints, so a resumed run goes on in its mode."""

    name = "modepick"
    stage = Stage.MODE

    @classmethod
    def wanted(cls, cfg, ranks) -> bool:
        return bool(getattr(ranks, "simulated", False)) and cfg.simulate_mode == "auto"

    def __init__(self, cfg, ranks):
        super().__init__(cfg, ranks)
        self.trial: dict = {}
        self.due = False
        self.resume_in = ""  # the mode a resumed run's checkpoint says it ran in

    def start(self, session) -> None:
        ranks = session.ranks
        done = session.epoch_start[session.start_epoch] + session.start_step
        why = wanted_trial(session.cfg, session.device, ranks.np_, session.total_steps - done,
                           ranks.ranks_per_chunk, ranks.mode)
        self.due, self.trial = not why, ({"chosen": ranks.mode, "no_trial": why} if why else {})

    def load_state_dict(self, state) -> None:
        # the mode the run began in, whatever a trial now would say: one run, one arithmetic
        self.due, self.trial = False, dict(state, resumed=True)
        self.resume_in = state["chosen"]

    def before_step(self, session, epoch: int, step: int) -> None:
        if self.resume_in:
            session.ranks.use(self.resume_in)
            self.resume_in = ""
        if self.due:
            self.due = False
            _, self.trial = pick(session.ranks, session.cfg, session.model, session.optimizer, epoch, step)

    def state_dict(self):
        return self.trial or None

    def result(self) -> dict:
        return {"simulate_mode_trial": self.trial}
