"""What a run that cannot finish still says: ``Keeper`` (rank 0 writes what was done, once, from any
thread), ``failure_reason`` (one line naming the rank, host and exception) and
``result_from_checkpoint`` (what a launcher can say when every rank died). Re-exported by
``pilab.engine.loop``::

    keeper = engine.Keeper()
    with Watchdog(comm, hang_s, on_end=keeper) as wd:
        train.run(cfg, comm, stop=wd.polled(), keeper=keeper)
"""
from __future__ import annotations

import os
import socket
import time

from .. import __version__
from . import checkpoint
from .checkpoint import CheckpointError
from ..config import Config
from .. import resultfile
from ..files import temp_name


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
            train.run(cfg, comm, stop=wd.polled(), keeper=keeper)
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


