"""The virtual-rank simulator: ``VirtualRanks(np_)`` emulates np data-parallel ranks in this process, the
loop's other rank backend beside ``pilab.engine.mpi.MPIRanks``.

What an MPI run at np ranks computes, step by step, is reproduced here: the global batch is the
concatenation of the per-rank batches (same shards, same sharding policy, same per-rank augmentation
randomness), BatchNorm statistics are taken per rank sub-batch (or per ghost batch), running statistics
are kept per virtual rank and settled by the same buffer policy, dropout masks are drawn per rank from the
same seeds, and gradients are averaged over ranks. Weights after N steps match a real ``mpiexec`` run
(bit for bit in the exact mode), so accuracy at np=48 can be studied on a laptop (or a GPU) without 48
processes::

    import pilab
    result = pilab.simulate(pilab.Config(width=0.5, epochs=3), 48)     # same schema as pilab.train's
    result, model = pilab.engine.fit(cfg, pilab.engine.VirtualRanks(48))  # virtual_state(model, r): rank r's

    python -m pilab simulate --np 48 --width 0.5 --epochs 3

Modes (``Config.simulate_mode``, ``mode_used``): ``exact`` runs each virtual rank's sub-batch through its
own forward and sums the ranks' gradients in rank order as MPI does (bitwise an MPI run's arithmetic);
``fast`` runs the global batch in one forward with every BatchNorm's statistics per virtual rank (the same
mathematics to float rounding, at about one process's cost); ``auto`` runs exact where the run needs
each rank's own weights or gradient, else times both on a long run's first batch and runs the faster
(``pilab.engine.modepick``), else fast. A local step (``Phase(local=True)``, local SGD's) runs each rank on
its own weights and optimizer state (``VirtualReplicas``).
"""
from __future__ import annotations

import copy
import socket
import time

import numpy as np
import torch
from torch import nn

from .. import data as data_mod
from ..component import SYNC, Phase, RankStep, has
from ..config import Config, ConfigError
from ..dist import codec_for, share_of_mean
from .backend import StepResult, base_model, environment, evaluate, forward_loss, slot_sizes, usable_cores
from .layers import RankContext, step_seed, sync_virtual_buffers_

# simulate_mode=fast runs the global batch in one forward (the memory of one process training it, the
# physical bound); on a GPU the exact mode's chunks are about this many images
EXACT_CUDA_CHUNK_IMAGES = 256

def mode_used(cfg: Config, per_rank: bool = False) -> str:
    """The simulator's mode for ``cfg`` as it is built: ``simulate_mode`` itself, or for ``auto`` the fast
    mode (the same mathematics to float rounding, at about one process's cost) unless the run needs each
    rank's own weights or gradient (``per_rank``: a component that does, such as local SGD or the
    noise-driven batch ramp), which only the exact mode runs. A long ``auto`` run then times both and may
    switch to exact before its first step (``pilab.engine.modepick``)::

        mode_used(Config())                  # "fast"
        mode_used(Config(), per_rank=True)   # "exact"
    """
    if cfg.simulate_mode != "auto":
        return cfg.simulate_mode
    return "exact" if per_rank else "fast"


def needs_per_rank(components) -> list:
    """The components that need each rank's own gradient (``on_rank_grads``) or weights (``per_rank``)."""
    return [c for c in components if c.per_rank or callable(getattr(c, "on_rank_grads", None))]


# Of the memory free at the start, the share the simulator's predicted peak may take: the prediction is
# within ~15% of a measured rank (tests/test_memory.py), and fewer ranks per forward cost only speed.
MEMORY_SHARE = 0.75


def fitting_ranks(cfg: Config, np_: int, batch: int, free: int | None = None) -> int:
    """The most virtual ranks (1..np_) whose images one forward of the fast mode can hold: the predicted
    peak of one process training ``k * batch`` images (``engine.memory``) within ``MEMORY_SHARE`` of
    ``free`` bytes (None: what this machine or its memory cgroup has free now; 0: unknown, no limit)::

        fitting_ranks(Config(width=1.0), 48, 64, free=24 * 2**30)     # 17 ranks per forward, not 48
    """
    from dataclasses import replace

    from . import memory

    free = memory.free_bytes() if free is None else free
    if not free:
        return np_

    def peak(k: int) -> int:
        return memory.predict_peak_bytes(replace(cfg, batch_mode="per_rank", batch_size=k * batch))

    budget = MEMORY_SHARE * free
    whole = peak(np_)
    if whole <= budget:
        return np_
    one = peak(1)  # the peak grows linearly in the images (activations per image): solve for k
    per_rank = (whole - one) / (np_ - 1)
    return max(1, min(np_ - 1, int((budget - one) // per_rank) + 1 if budget > one else 1))


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


class VirtualRanks:
    """``np_`` ranks emulated in this process: bit for bit an MPI run in the ``exact`` mode, the same mathematics
    to float rounding in the ``fast`` one (the module docstring says which ``auto`` picks)."""

    simulated = True
    rank = 0
    comm = None

    def __init__(self, np_: int, ranks_per_chunk: int = 0, *, defer_metrics: bool = False):
        if np_ < 1:
            raise ConfigError(f"np={np_} must be >= 1")
        self.np_, self.ranks_per_chunk = np_, ranks_per_chunk
        # defer_metrics: step() returns loss_sum and correct as 0-d device tensors and never waits for
        # the device (no .item(), no synchronize), so a GPU runs ahead of the host; the caller reads
        # them at the epoch's end (scripts/gpu_check.py). engine.train() needs floats: leave it False.
        self.defer_metrics = defer_metrics

    def threads(self, cfg: Config) -> int:
        return cfg.threads or usable_cores()

    def check(self, cfg: Config, components=()) -> None:
        """Refuse settings the simulator does not emulate exactly, and a component that needs each rank's
        own gradient or weights where it runs several ranks per forward (pilab's own components refuse
        first, in their own words, when they are set up)."""
        if cfg.bn == "sync" and self.ranks_per_chunk not in (0, self.np_):
            raise ConfigError(f"bn=sync runs all {self.np_} virtual ranks in one forward (BatchNorm over the "
                              f"global batch), but ranks_per_chunk={self.ranks_per_chunk}; leave it 0")
        if not codec_for(cfg.compression).simulated:
            raise ConfigError(f"the simulator does not emulate compression={cfg.compression}; use compression=none")
        for c in needs_per_rank(components):
            name = c.name or type(c).__name__
            if cfg.simulate_mode == "fast":
                raise ConfigError(f"simulate_mode=fast runs several ranks per forward, but {name} needs each "
                                  "rank's own gradient or weights; use simulate_mode=exact")
            if cfg.bn == "sync" and self.np_ > 1 and c in has(components, "on_rank_grads"):
                raise ConfigError(f"bn=sync runs all ranks in one forward, but {name} needs each rank's own "
                                  "gradient; use bn=local, or run it under mpiexec")

    def build(self, cfg: Config, device, ds, batch: int, components=()) -> nn.Module:
        np_ = self.np_
        per_rank = bool(needs_per_rank(components))
        # On a GPU the images live and are augmented there (no per-step host-to-device copy).
        self.loaders = [data_mod.ShardLoader(ds, np_, r, batch, seed=cfg.seed, policy=cfg.sharding,
                                             augment=cfg.augment, copies=cfg.batch_aug,
                                             device=device if device.type == "cuda" else None)
                        for r in range(np_)]
        self.steps_per_epoch = self.loaders[0].steps_per_epoch
        self.batch, self.device, self.eval_batch, self.tta = batch, device, cfg.eval_batch, cfg.tta
        self.tta_translate = cfg.tta_translate
        # One rank per forward on CPU reproduces an MPI rank's arithmetic exactly (same conv kernels on
        # the same batch). Several ranks per forward are faster on a GPU but sum weight gradients in
        # another order, and BatchNorm's shift invariance amplifies that float noise (~1e-3 after a step).
        # simulate_mode=fast: the global batch in one forward (the memory of one process training it), ghost
        # BN vectorised over the ranks' groups (layers.GroupedBN); docs/simulator.md gives its deviation.
        self.mode = mode_used(cfg, per_rank)
        fast = self.mode == "fast"
        # the exact mode's ranks per forward: one on CPU (MPI's arithmetic), ~256 images on a GPU
        exact_chunk = max(1, min(np_, EXACT_CUDA_CHUNK_IMAGES // batch)) if device.type == "cuda" else 1
        self.chunk = self.ranks_per_chunk or (np_ if fast else exact_chunk)
        self.chunk_why = "ranks_per_chunk" if self.ranks_per_chunk else "mode"
        if fast and not self.ranks_per_chunk and device.type == "cpu" and np_ > 1 and cfg.bn != "sync":
            # the global batch in one forward holds its activations at once (50 GiB predicted for
            # MobileNetV2 1.0 at 64 x 48): where that does not fit, the most ranks per forward that do
            fit = fitting_ranks(cfg, np_, batch)
            if fit < np_:
                self.chunk, self.chunk_why = fit, "memory"
        if per_rank:  # every rank's own weights, or its own gradient (a component's need)
            self.chunk = 1
        if cfg.bn == "sync":
            # SyncBatchNorm's statistics are the global batch's: one forward over every rank's images is
            # that BatchNorm, and its mean loss's gradient is the ranks' average. The same mathematics as
            # MPI's SyncBatchNorm, not its arithmetic (MPI sums the statistics in float64, per rank), so
            # this is the one rule the simulator reproduces only to float rounding (docs/simulator.md).
            self.chunk = np_
        self.context = RankContext(cfg.seed)
        self.context.vectorised = fast
        self._chunks = {self.mode: (self.chunk, self.chunk_why)}  # each mode's ranks per forward, for use()
        if fast:  # the exact mode's too, for auto's trial of both (pilab.engine.modepick)
            self._chunks["exact"] = (np_ if cfg.bn == "sync" else self.ranks_per_chunk or exact_chunk,
                                     "ranks_per_chunk" if self.ranks_per_chunk else "mode")
        return base_model(cfg, device, ranks=np_, context=self.context, steps_per_epoch=self.steps_per_epoch,
                          data=ds)

    def use(self, mode: str) -> None:
        """Run the next steps in ``mode`` (``exact`` or ``fast``), the mode chosen at build or the other
        one: the ``auto`` mode's trial switches between them (``pilab.engine.modepick``)."""
        if mode not in self._chunks:
            raise ConfigError(f"simulate_mode={mode!r} cannot run here (this run has {sorted(self._chunks)})")
        self.mode, (self.chunk, self.chunk_why) = mode, self._chunks[mode]
        self.context.vectorised = mode == "fast"

    def start(self, cfg: Config, model: nn.Module, optimizer, components=()) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.components = list(components)  # their in-step moments, as MPIRanks' (pilab.component)
        self.slot_sizes = slot_sizes(components, self.np_)
        # Averaged gradient, built as MPI builds it: each rank's loss scaled by 1/np before backward (so
        # its gradient comes out divided, as GradSync.backward does), the ranks' gradients summed in rank order.
        self.avg = [torch.zeros_like(p) for p in self.params]
        self.optimizer = optimizer
        self.replicas = None  # a local step: every rank's weights and momentum, made at the first one
        self._replica_state = None  # ... or from a checkpoint (restore_rank_states)

    def _rank(self, r: int) -> RankStep:
        """Virtual rank r's record of this step, its slots zeroed."""
        return RankStep(r, self.np_, {name: np.zeros(n) for name, n in self.slot_sizes.items()})

    def _sums(self, recs: list) -> dict:
        """Every slot summed over the virtual ranks, in rank order."""
        out = {name: np.zeros(n) for name, n in self.slot_sizes.items()}
        for rec in recs:
            for name, v in rec.send.items():
                out[name] += v
        return out

    def step(self, cfg: Config, model, optimizer, epoch: int, step: int, stop=None, save=None,
             phase: Phase = SYNC) -> StepResult:
        if phase.local:  # each rank on its own weights (local SGD's component chooses it, and the average)
            return self._local_step(cfg, model, optimizer, epoch, step, phase, stop, save)
        np_, device = self.np_, self.device
        if phase.shares is not None and (self.chunk != 1 or np_ == 1):
            raise ConfigError(f"uneven shares (Phase.shares) need one virtual rank per forward, but this run has "
                              f"{self.chunk}; a component that sets them must say per_rank = True")
        t0 = time.perf_counter()
        t_data = 0.0
        loss_sum = correct = 0  # python numbers, or 0-d device tensors with defer_metrics
        one_chunk = self.chunk >= np_  # the chunk's mean gradient is the average: nothing to accumulate
        per_rank = self.chunk == 1  # MPI's arithmetic: each rank's gradient, summed in rank order
        sends = has(self.components, "on_rank_grads") if per_rank and not one_chunk else []
        recs = []
        if per_rank and not one_chunk:
            torch._foreach_zero_(self.avg)
        if not per_rank:  # several ranks per forward: their shares of the mean loss accumulate in .grad
            optimizer.zero_grad(set_to_none=False)
        self.context.epoch, self.context.step = epoch, step
        spans = []  # each chunk's phases, on its first rank's track
        for r0 in range(0, np_, self.chunk):
            r1 = min(np_, r0 + self.chunk)
            td = time.perf_counter()
            x, y = self._images(r0, r1, epoch, step, phase.share_of(r0))
            t_data += (tx := time.perf_counter()) - td
            self.context.ranks = (r0, r1)
            # Without dropout nothing else draws from the global RNG; seed it as rank r0 would.
            torch.manual_seed(step_seed(cfg.seed, epoch, step, r0))
            out, loss = forward_loss(model, x, y, cfg, device)
            tb = time.perf_counter()
            if one_chunk:
                if per_rank:
                    optimizer.zero_grad(set_to_none=False)
                loss.backward()  # the mean loss over every rank's images: the average itself
            elif per_rank:
                optimizer.zero_grad(set_to_none=False)
                # as MPI forms it (GradSync.backward): each rank's loss scaled by 1/np, so its gradient
                # comes out divided, and the ranks' gradients added in rank order
                # (uneven shares: by b_r / B, as GradSync.backward(loss, weight) does)
                (share_of_mean(loss, np_) if phase.shares is None else loss * phase.weight_of(r0)).backward()
                if sends:  # as GradSync's on_send: this rank's share, as it would be sent
                    recs.append(rec := self._rank(r0))
                    for c in sends:
                        c.on_rank_grads(rec, [p.grad for p in self.params])
                torch._foreach_add_(self.avg, [p.grad for p in self.params])
            else:  # several ranks per forward (the mean over their images): weighted by their share
                (loss * ((r1 - r0) / np_)).backward()
            spans += [(r0, "data", td, tx), (r0, "forward", tx, tb), (r0, "backward", tb, time.perf_counter())]
            loss_sum, correct = self._add_metrics(loss_sum, correct, loss, out, y, r1 - r0,
                                                  None if phase.shares is None else phase.shares[r0])
        if per_rank and not one_chunk:
            torch._foreach_copy_([p.grad for p in self.params], self.avg)
        to = time.perf_counter()
        for c in has(self.components, "on_grads"):
            c.on_grads([p.grad for p in self.params])
        optimizer.step()
        if device.type == "cuda" and not self.defer_metrics:
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        want_stop = bool(stop()) if stop is not None else False
        want_save = bool(save()) if save is not None else False
        self._stepped(recs, spans + [(0, "optimizer", to, t0 + total)])
        return StepResult(loss_sum, correct, float(want_stop), time=total, compute=total - t_data,
                          comm=0.0, comm_exposed=0.0, data=t_data, save_votes=float(want_save))

    def _stepped(self, recs: list, spans) -> None:
        """The components' ``on_step``: rank 0's record with every slot summed over the ranks."""
        rec = RankStep(0, self.np_)
        rec.sums, rec.spans = self._sums(recs), spans
        for c in self.components:
            c.on_step(rec)

    def _add_metrics(self, loss_sum, correct, loss, out, y, ranks: int, images: int | None = None):
        """The sums so far plus a chunk of ``ranks`` ranks' loss and correct images: python numbers, or with
        defer_metrics 0-d device tensors (nothing waits for the device). ``images``: one rank's uneven share
        (its loss counted as MPIRanks counts it: loss x b_r)."""
        with torch.no_grad():
            if images is not None:
                if self.defer_metrics:
                    return loss_sum + loss.detach() * images, correct + (out.argmax(1) == y).sum()
                return loss_sum + loss.item() * images, correct + (out.argmax(1) == y).sum().item()
            if self.defer_metrics:
                return loss_sum + loss.detach() * (self.batch * ranks), correct + (out.argmax(1) == y).sum()
            return loss_sum + loss.item() * self.batch * ranks, correct + (out.argmax(1) == y).sum().item()

    def _images(self, r0: int, r1: int, epoch: int, step: int, share=None):
        """Virtual ranks r0..r1-1's images and labels of this step, as one batch on the device (``share``:
        rank r0's uneven share, ``Phase.share_of``)."""
        if share is not None:
            x, y = self.loaders[r0].batch(epoch, step, share=share)
        else:
            x, y = data_mod.ranks_batch(self.loaders[r0:r1], epoch, step)  # one augmentation pass, no cat
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last), y

    def _local_step(self, cfg: Config, model, optimizer, epoch: int, step: int, ph, stop, save) -> StepResult:
        """A local-SGD step: each rank's own forward, backward and optimizer step on its own weights
        (``VirtualReplicas``), then, if due, the average MPI forms."""
        np_, device = self.np_, self.device
        t0 = time.perf_counter()
        t_data, loss_sum, correct = 0.0, 0.0, 0.0
        if self.replicas is None:
            self.replicas = VirtualReplicas(self.params, optimizer, np_, state=self._replica_state)
            self._replica_state = None
        self.context.epoch, self.context.step = epoch, step
        for r in range(np_):
            self.replicas.enter(r)
            td = time.perf_counter()
            x, y = self.loaders[r].batch(epoch, step)
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            t_data += time.perf_counter() - td
            self.context.ranks = (r, r + 1)
            torch.manual_seed(step_seed(cfg.seed, epoch, step, r))
            out, loss = forward_loss(model, x, y, cfg, device)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            for c in has(self.components, "on_grads"):
                c.on_grads([p.grad for p in self.params])
            optimizer.step()
            loss_sum += loss.item() * self.batch
            correct += (out.argmax(1) == y).sum().item()
        if ph.average:
            self.replicas.average_()
            sync_virtual_buffers_(model, "average")
        self.replicas.enter(0)  # the model is rank 0's, as an MPI job's rank 0 holds it
        total = time.perf_counter() - t0
        want_stop = bool(stop()) if stop is not None else False
        want_save = bool(save()) if save is not None else False
        self._stepped([], None)
        return StepResult(loss_sum, correct, float(want_stop), time=total, compute=total - t_data,
                          comm=0.0, comm_exposed=0.0, data=t_data, save_votes=float(want_save))

    def set_batch(self, batch: int) -> None:
        self.batch = batch
        for loader in self.loaders:
            loader.set_batch(batch)
        self.steps_per_epoch = self.loaders[0].steps_per_epoch

    def settle(self, model, policy: str) -> None:
        sync_virtual_buffers_(model, policy)

    def rank_states(self, model) -> list:
        """The virtual ranks' BatchNorm rows are in the model's state_dict; the RNG is the process's;
        under local SGD every rank's weights and optimizer state."""
        st = {"rng": torch.get_rng_state()}
        if self.replicas is not None:
            st["replicas"] = self.replicas.state()
        return [st]

    def restore_rank_states(self, model, states: list) -> None:
        self._replica_state = states[0].get("replicas")
        torch.set_rng_state(states[0]["rng"])

    def hosts(self) -> list[str]:
        return [socket.gethostname()]

    def carry(self, epoch: int, plan, ds) -> None:
        b = self.batch
        for r, loader in enumerate(self.loaders):
            loader.carry(epoch, plan[:, r * b:(r + 1) * b], ds)

    def evaluate(self, model, ds) -> tuple[float, float]:
        return evaluate(model, ds, None, self.device, self.eval_batch, tta=self.tta,
                        translate=self.tta_translate)

    def per_rank(self, values: list[float]):
        return None  # one process: there is no per-rank timeline to show

    def environment(self, threads: int) -> dict:
        return environment(None, threads, self.device)

    def close(self) -> None:
        pass

    def extras(self) -> dict:
        # ranks_per_chunk_why: "mode" (the mode's own), "ranks_per_chunk" (given), "memory" (fitting_ranks)
        return {"simulated": True, "ranks_per_chunk": self.chunk, "ranks_per_chunk_why": self.chunk_why,
                "simulate_mode_used": self.mode}
