"""What the training loop records: an epoch's sums (``EpochSums``), the epoch's record (``end_epoch``:
evaluation when due, buffers settled, times per rank) and the run's result (``result``: config,
environment, per-epoch metrics, per-step timings, peak memory). Components add their own keys to both
(``pilab.component``)::

    acc = EpochSums(); acc.add(st, images)
    record, checkpoint_now = records.end_epoch(session, epoch, acc, seconds, steps_log, stopped, gstep)

What a run that cannot finish still says: ``Keeper`` (rank 0 writes what was done, once, from any
thread), ``failure_reason`` (one line naming the rank, host and exception) and
``result_from_checkpoint`` (what a launcher can say when every rank died). Re-exported by
``pilab.engine.loop``::

    keeper = engine.Keeper()
    with Watchdog(comm, hang_s, on_end=keeper) as wd:
        pilab.train(cfg, comm, stop=wd.polled(), keeper=keeper)
"""
from __future__ import annotations

import os
import socket
import time

from .. import __version__, resultfile
from ..config import Config
from ..files import temp_name
from . import checkpoint
from .backend import EVAL_BATCH, StepResult, peak_mem_mb
from .checkpoint import CheckpointError

# Every file a run writes in its --out (and its numbered checkpoints, checkpoint-e*.pt: run_files): what
# --overwrite, and a study point run again, remove first, so that nothing of an old run (a trace.json
# of a run with --trace) is taken for the new run's. A result is two files (``pilab.resultfile``).
RUN_FILES = (*resultfile.files("result.json"), "trace.json", "checkpoint.pt")


def run_files(out: str) -> list[str]:
    """The paths of the run files in ``out`` that exist (``RUN_FILES``, then the numbered checkpoints)."""
    return [p for p in (os.path.join(out, n) for n in RUN_FILES) if os.path.exists(p)] + \
        [p for _, p in checkpoint.epoch_files(out)]

# comm_wait is the part of comm_exposed spent waiting for a slower rank to reach the gradient Allreduce
# (a straggler); comm_exposed - comm_wait is what the network itself cost (see MPIRanks.step).
STEP_KEYS = ("loss", "lr", "time", "compute", "comm", "comm_exposed", "data", "comm_wait")
TIME_KEYS = ("compute", "comm", "comm_exposed", "data", "comm_wait")
# A run stopped early evaluates only if that is cheap: at most one evaluation batch per rank.
EVAL_ON_STOP_MAX = EVAL_BATCH


class EpochSums:
    """Sums over one epoch's steps (global loss/correct/images, this rank's times)."""

    def __init__(self):
        self.loss = self.correct = self.images = 0.0
        self.times = dict.fromkeys(TIME_KEYS, 0.0)
        self.steps = 0

    def state(self) -> dict:
        """The sums so far (a mid-epoch checkpoint keeps them for the epoch's record)."""
        return {"loss": self.loss, "correct": self.correct, "images": self.images, "steps": self.steps,
                "times": dict(self.times)}

    def restore(self, d: dict) -> None:
        self.loss, self.correct, self.images, self.steps = d["loss"], d["correct"], d["images"], d["steps"]
        self.times.update(d["times"])

    def add(self, st: StepResult, images: int) -> None:
        self.loss += st.loss_sum
        self.correct += st.correct
        self.images += images
        self.steps += 1
        for k in TIME_KEYS:
            self.times[k] += getattr(st, k)


def end_epoch(s: Session, epoch: int, acc: EpochSums, train_time: float, steps_log: dict,
               stopped: bool, gstep: int, *, force: bool = False) -> tuple[dict, bool]:
    """Evaluate if due, settle buffers for evaluation or checkpoint, and build the epoch record."""
    cfg = s.cfg
    last = stopped or gstep >= s.total_steps or epoch + 1 == cfg.epochs
    evaluate_now = last or (epoch + 1) % cfg.eval_every == 0
    # Stopped early (Ctrl-C, a batch system's SIGTERM, run.stop()): evaluate only if cheap, so the
    # ranks leave promptly. Decided from sizes alone, so every rank decides the same.
    per_rank_test = -(-len(s.ds.y_test) // (1 if s.ranks.simulated else s.np_))
    skip_test = stopped and per_rank_test > EVAL_ON_STOP_MAX
    evaluate_now = evaluate_now and not skip_test
    full_epoch = acc.steps == s.epoch_steps[epoch]
    checkpoint_now = full_epoch and (force or (bool(cfg.checkpoint_every) and (
        epoch + 1) % cfg.checkpoint_every == 0 and not stopped))
    t_eval = time.perf_counter()
    test_loss = test_acc = None
    if evaluate_now or checkpoint_now or last:  # the last model is the same on every rank
        s.ranks.settle(s.model, cfg.bn_buffers)
    if evaluate_now:
        test_loss, test_acc = s.evaluate()
    eval_time = time.perf_counter() - t_eval
    per_rank = s.ranks.per_rank([acc.times[k] for k in TIME_KEYS])
    images = max(acc.images, 1)
    record = {
        "epoch": epoch + 1, "steps": acc.steps,
        "train_loss": acc.loss / images, "train_acc": acc.correct / images,
        "test_loss": test_loss, "test_acc": test_acc,
        "lr": steps_log["lr"][-1] if steps_log["lr"] else None,
        "time": train_time, "eval_time": eval_time, "images": int(acc.images),
        "images_per_s": acc.images / train_time if train_time > 0 else None,
        **acc.times,
    }
    if skip_test:
        record["test_skipped"] = (f"stopped early; evaluating {per_rank_test} test images per rank "
                                  f"is more than the {EVAL_ON_STOP_MAX} done on a stop")
    if per_rank is not None and s.rank == 0:
        record["per_rank"] = {k: per_rank[:, i].tolist() for i, k in enumerate(TIME_KEYS)}
    return record, checkpoint_now


def result(s: Session, epochs_log: list, steps_log: dict, bytes_per_step: int, stopped: bool,
            wall: float, *, collective: bool = True) -> dict:
    """The run's result: the config, environment, per-epoch metrics, per-step timings, peak memory."""
    cfg, ds = s.cfg, s.ds
    mem = s.ranks.per_rank([peak_mem_mb()]) if collective else None
    env = s.env
    new = epochs_log[len(s.history):]
    train_total = sum(e["time"] for e in new)
    images_total = sum(e["images"] for e in new)
    return {
        "pilab_version": __version__, **s.ranks.extras(), "config": cfg.to_dict(), "allocator": s.allocator,
        "np": s.np_, "threads": s.threads,
        "per_rank_batch": cfg.per_rank_batch(s.np_), "global_batch": cfg.global_batch(s.np_), "peak_lr": s.peak_lr,
        "warmup_steps": s.warmup_steps, "steps_per_epoch": s.steps_per_epoch,
        "total_steps": s.total_steps, "schedule_steps": s.schedule_steps,
        "data": {"source": ds.source, "checksum": ds.checksum, "n_train": int(len(ds.y_train)),
                 "n_test": int(len(ds.y_test)), "sharding": cfg.sharding, **s.accounting},
        **({"model_source": s.sources["model_source"]} if s.sources.get("model_source") else {}),
        **({"model_profile": s.model_profile} if s.model_profile else {}),
        "env": env, "epochs": epochs_log, "steps": steps_log, "bytes_per_step": bytes_per_step,
        "wall_time": wall, "train_time": train_total,
        "images_per_s": images_total / train_total if train_total else None,
        "peak_mem_mb": (mem[:, 0].tolist() if mem is not None else [peak_mem_mb()]) if s.rank == 0 else None,
        "stopped_early": stopped, "resumed_from_epoch": s.start_epoch,
        "resumed_from_step": s.epoch_start[s.start_epoch] + s.start_step, "resumed_from_np": s.resumed_np,
        "steps_done": len(steps_log["loss"]) + s.epoch_start[s.start_epoch] + s.start_step,
        "epochs_done": sum(1 for e in epochs_log if e["steps"] == s.epoch_steps[e["epoch"] - 1]),
        **({"batch_plan": [{"epoch": e + 1, "per_rank_batch": s.bcfg.per_rank_batch(s.np_, e), "steps": n}
                           for e, n in enumerate(s.epoch_steps)]} if cfg.batch_ramp else {}),
        **({"components": s.yours} if s.yours else {}),
    }


def failure_reason(rank: int, e: BaseException) -> str:
    """One line naming the rank, its host and the exception (a result's ``stop_reason``)."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"rank {rank} ({socket.gethostname()}) failed: {type(e).__name__}" + (f": {text}" if text else "")


class Keeper:
    """Keeps what a run did when it cannot finish: ``keeper(reason)`` writes ``<out>/result.json`` with
    ``stopped_early``, ``aborted``, ``stop_reason`` (naming the rank and host), the steps and epochs
    done and the last checkpoint, once; a no-op on ranks other than 0 and before the run started.
    Thread-safe, and no collective: it runs while the other ranks are gone::

        keeper = engine.Keeper()
        with Watchdog(comm, hang_s, on_end=keeper) as wd:
            pilab.train(cfg, comm, stop=wd.polled(), keeper=keeper)
    """

    SETTLE_S, SETTLE_MAX_S = 0.5, 3.0

    def __init__(self):
        import threading
        self._lock = threading.RLock()  # a signal handler may call it on the thread that holds it
        self._write = None
        self._progress = None
        self.written: str | None = None  # the path written

    def attach(self, write, path: str = "", progress=None) -> None:
        """``write(reason)`` writes the result; ``progress()`` counts the steps the run has recorded."""
        self._write, self._path, self._progress = write, path, progress

    def _settle(self) -> None:
        # Called from another thread (a peer said it failed, the watchdog fired), the training thread
        # may be between a step's finished exchange and its record: a failed peer lets it finish at most
        # that one step, so wait until the count stops moving (briefly: the peer waits for our "ok").
        import threading
        if self._progress is None or threading.current_thread() is threading.main_thread():
            return
        end, last, since = time.monotonic() + self.SETTLE_MAX_S, self._progress(), time.monotonic()
        while time.monotonic() < end and time.monotonic() - since < self.SETTLE_S:
            time.sleep(0.05)
            now = self._progress()
            if now != last:
                last, since = now, time.monotonic()

    def cleanup(self) -> None:
        """Remove the temporary files a write cut short left (a process about to ``os._exit``): the
        result's and its per-step file's (``pilab.resultfile``)."""
        path = getattr(self, "_path", "")
        for tmp in [temp_name(p) for p in resultfile.files(path)] if path else []:
            if os.path.exists(tmp):
                try:
                    os.remove(tmp)
                except OSError:
                    pass

    def __call__(self, reason: str) -> str | None:
        if self._write is not None and self.written is None:
            self._settle()
        with self._lock:
            if self._write is None or self.written is not None:
                return self.written
            try:
                self.written = self._write(reason)
            except OSError:
                pass  # a disk that fails now is no reason to hide the run's own failure
            return self.written


def result_from_checkpoint(cfg: Config, np_: int, reason: str) -> dict:
    """A result for a run whose ranks all died without writing one (what a launcher can still say):
    ``stopped_early``, ``aborted``, the reason, and the steps and epochs its newest checkpoint in
    ``cfg.out`` holds (0 without one; every step after it is lost)."""
    latest = checkpoint.latest(cfg.out) if cfg.out else None
    ck = None
    if latest:
        try:
            ck = checkpoint.read(latest)
        except CheckpointError:
            ck = None
    history = list(ck["history"]) if ck else []
    return {"pilab_version": __version__, "config": cfg.to_dict(), "np": np_, "epochs": history,
            "stopped_early": True, "aborted": True, "stop_reason": reason, "steps_done": int(ck["step"]) if ck else 0,
            "epochs_done": int(ck["epoch"]) if ck else 0, "last_checkpoint": latest if ck else None,
            "steps_done_is": "the newest checkpoint's step (steps after it are lost)", "ended_at": time.time()}
