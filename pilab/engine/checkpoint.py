"""Checkpoints you can trust: written atomically with a checksum of their payload, verified on load,
the last K kept.

A checkpoint is an ordinary ``torch.save`` dict (``torch.load(path, weights_only=True)`` reads it) with
``model``, ``optimizer``, ``epoch``, ``step``, ``np``, ``config`` and ``history``, plus ``sha256``: a
digest of all of those (tensor bytes, dtypes, shapes, the metadata), recomputed on load. Files::

    <out>/checkpoint-e0003.pt     one per checkpointed epoch; the last ``keep`` stay
    <out>/checkpoint-e0003-s00040.pt   mid-epoch: 3 epochs and 40 steps of the 4th done (the same
                                  ``keep`` counts both kinds, in training order)
    <out>/checkpoint.pt           the newest of them (a hard link, or a copy where links fail)

A mid-epoch checkpoint also holds ``step_in_epoch``, the epoch's partial sums, every rank's BatchNorm
buffers and torch RNG state (``ranks``), and ``order_np`` (the np whose data order the epoch follows).

    from pilab.engine import checkpoint
    checkpoint.save(out, payload, keep=2)                   # raises WriteError; old files untouched
    ck = checkpoint.load("runs/x/checkpoint.pt", cfg, np_=2)  # raises CheckpointError naming the fix

A failed write (disk full, read-only directory) leaves every earlier file as it was: the new file is
written beside them under a temporary name, flushed to disk, and only then renamed into place.

How the loop writes and resumes them (below): ``write_position`` (a collective: every rank's own state
gathered, rank 0 writes, every rank learns whether it failed), ``load_position`` (rank 0 reads and
verifies, every rank gets the position or the same error), the data order of an epoch resumed at another
np (``epoch_plan``), and what the run's checkpoints cost (``summary``). What goes into a checkpoint is
``Session.save_checkpoint``'s, every component's state under its name::

    failed = checkpoint.write_position(session, epoch, gstep, epochs_log)     # None, or why (every rank)
    position = checkpoint.load_position(cfg, ranks, model, optimizer)         # epoch, step_in_epoch, ...
"""
from __future__ import annotations

import glob
import hashlib
import io
import os
import re
import time

import numpy as np
import torch
from torch import nn

from .. import data as data_mod
from ..config import Config, ConfigError
from ..dist import bn_buffers, world
from ..files import atomic_write

__all__ = ["CheckpointError", "ReadError", "WriteError", "save", "load", "verify", "check_sources",
           "changed_sources", "digest", "latest", "FORMAT"]

# /2: every loop feature's state under its name in "components" (was "ema", "ema_pending", "gns" at the top)
FORMAT = "pilab.checkpoint/2"
NAME = "checkpoint.pt"
# Settings that may differ between a run and its resumption: they don't change what is computed.
RESUMABLE = ("out", "resume", "checkpoint_every", "keep", "max_steps", "eval_every", "eval_batch", "threads",
             "checkpoint_minutes", "checkpoint_every_steps", "straggler_threshold", "straggler_steps", "trace",
             "trace_window")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's (zip) format
_EPOCH_FILE = re.compile(r"checkpoint-e(\d+)(?:-s(\d+))?\.pt$")


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed from (missing, corrupt, truncated, another run's). One line, with
    the fix; a ConfigError, so the CLI reports it as bad input (exit 2)."""


class ReadError(CheckpointError):
    """A checkpoint that could not be read now for a reason other than damage (an I/O error, too little
    memory): the file may be fine, so nothing may delete or replace it; retry where it can be read."""


class WriteError(OSError):
    """A result or checkpoint could not be written (disk full, no permission). Earlier files are intact."""


# ----------------------------------------------------------------------------------------------
# the checksum
# ----------------------------------------------------------------------------------------------
def _feed(h, obj) -> None:
    """Feed ``obj`` (dicts, lists, tensors, plain values) into ``h`` in a fixed order."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode() + b":")
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(obj).encode() + b";")


def digest(payload: dict) -> str:
    """SHA-256 over everything in ``payload`` but its own ``sha256`` entry."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in payload.items() if k != "sha256"})
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def _write(data: bytes):
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
    return write


def _link_or_copy(src: str):
    """``dst`` (a temporary path) becomes the same file as ``src``: a hard link, a copy where links fail."""
    def write(tmp: str) -> None:
        try:
            os.link(src, tmp)
        except OSError:
            with open(src, "rb") as f:
                _write(f.read())(tmp)
    return write


def epoch_files(out: str) -> list[tuple[int, str]]:
    """(epochs done, path) of the numbered checkpoints in ``out`` (per epoch and mid-epoch), oldest
    first in training order."""
    found = []
    for p in glob.glob(os.path.join(glob.escape(out), "checkpoint-e*.pt")):
        m = _EPOCH_FILE.search(os.path.basename(p))
        if m:
            found.append(((int(m.group(1)), int(m.group(2) or 0)), p))
    return [(key[0], p) for key, p in sorted(found)]


def file_name(epoch: int, step_in_epoch: int = 0) -> str:
    """``checkpoint-e0003.pt`` after 3 full epochs; ``checkpoint-e0003-s00040.pt`` 40 steps later."""
    return f"checkpoint-e{int(epoch):04d}" + (f"-s{int(step_in_epoch):05d}" if step_in_epoch else "") + ".pt"


def save(out: str, payload: dict, *, keep: int = 1) -> str:
    """Write ``payload`` (model/optimizer state dicts, epoch, step, np, config, history) as
    ``<out>/checkpoint-eNNNN.pt``, point ``<out>/checkpoint.pt`` at it, keep the last ``keep``.

    Raises ``WriteError`` if it cannot be written; the files already there are then untouched."""
    ck = {"format": FORMAT, **payload}
    ck["sha256"] = digest(ck)
    buf = io.BytesIO()
    torch.save(ck, buf)
    mid = int(ck.get("step_in_epoch") or 0)
    path = os.path.join(out, file_name(ck["epoch"], mid))
    what = f"step {ck['step']} (mid-epoch {int(ck['epoch']) + 1})" if mid else f"epoch {ck['epoch']}"
    try:  # the numbered file, then checkpoint.pt pointed at it: each atomic, on the disk before it counts
        atomic_write(path, _write(buf.getvalue()), durable=True)
        atomic_write(os.path.join(out, NAME), _link_or_copy(path), durable=True)
    except OSError as e:
        err = WriteError(f"cannot write the checkpoint of {what} to {out}: "
                         f"{e.strerror or e}")
        err.errno = e.errno
        raise err from None
    for _, old in epoch_files(out)[:-max(1, keep)]:
        try:
            os.remove(old)
        except OSError:
            pass  # one more old checkpoint than asked for is no reason to stop a run
    return path


def latest(out: str) -> str | None:
    """``<out>/checkpoint.pt`` if it exists (what ``--resume`` is given), else None."""
    p = os.path.join(out, NAME)
    return p if os.path.exists(p) else None


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
def _others(path: str) -> str:
    d = os.path.dirname(os.path.abspath(path))
    names = [os.path.basename(p) for _, p in epoch_files(d) if os.path.abspath(p) != os.path.abspath(path)]
    return f"; other checkpoints there: {', '.join(names)}" if names else ""


def read(path: str) -> dict:
    """The checkpoint at ``path``, its checksum verified; CheckpointError if it is not one."""
    if not os.path.exists(path):
        raise CheckpointError(f"resume={path!r} does not exist; give the path of a checkpoint.pt "
                              "(written with --checkpoint-every K)")
    if os.path.isdir(path):
        raise CheckpointError(f"resume={path!r} is a directory; give {os.path.join(path, NAME)}")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        if head != _ZIP_MAGIC:
            raise CheckpointError(f"{path} is not a pilab checkpoint (not a torch.save file){_others(path)}")
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except (OSError, MemoryError) as e:  # the disk or the memory, not the file: it stays as it is
        why = (f"[Errno {e.errno}] {e.strerror}" if isinstance(e, OSError) and e.strerror
               else f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        raise ReadError(f"{path} could not be read ({why[:160]}); it is not known to be damaged and was left "
                        "as it is: resume again once the disk (or the memory) lets it be read") from None
    except Exception as e:  # a damaged zip, an unpicklable record: say so, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is truncated or corrupt ({first[:120]}); resume from an "
                              f"earlier checkpoint{_others(path) or ' or start again'}") from None
    if not isinstance(ck, dict) or not {"model", "optimizer", "epoch", "config"} <= set(ck):
        raise CheckpointError(f"{path} is a torch file but not a pilab checkpoint "
                              "(no model/optimizer/epoch/config)")
    if ck.get("format") != FORMAT:
        raise CheckpointError(f"{path} was written by another pilab (format {ck.get('format')!r}, this one reads "
                              f"{FORMAT!r}); resume it with the pilab that wrote it, or start again")
    if digest(ck) != ck.get("sha256"):
        raise CheckpointError(f"{path} is corrupt: its checksum does not match its contents; resume "
                              f"from an earlier checkpoint{_others(path) or ' or start again'}")
    return ck


def _flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    return f"{flag} {value}"


def stable_phase(ck: dict, saved: Config, cfg: Config) -> bool:
    """Whether ``ck`` (made under ``saved``) lies in the stable phase of a warmup-stable-decay schedule
    that ``cfg`` shares but for its length: then ``cfg`` may have other ``epochs``. Up to the decay, such a
    run's learning rates, data order and every feature's state do not depend on its length (warmup and EMA
    are counted in epochs of steps from the start), so the run with more epochs goes on from the checkpoint
    exactly as if it had been started with them -- how a run is extended (12, 15, 20 epochs ...) from the
    trunk of its stable phase::

        stable_phase(read("trunk/checkpoint-e0008.pt"), saved, replace(saved, epochs=15))   # True (decay 3)
    """
    if saved.schedule != "wsd" or cfg.schedule != "wsd" or saved.decay_epochs != cfg.decay_epochs:
        return False
    done = int(ck["epoch"]) + (1 if ck.get("step_in_epoch") else 0)  # epochs begun
    return done <= min(saved.epochs, cfg.epochs) - cfg.decay_epochs


def verify(ck: dict, cfg: Config, np_: int, path: str = "checkpoint") -> Config:
    """Refuse (CheckpointError) a checkpoint made with other settings or another process count;
    the message names each difference and the flags that resume it correctly."""
    try:
        saved = Config.from_dict({k: v for k, v in ck["config"].items()})
    except ConfigError as e:
        raise CheckpointError(f"{path} holds a configuration this pilab cannot read ({e})") from None
    mine, theirs = cfg.to_dict(), saved.to_dict()
    ck_np = ck.get("np")
    # each rank's share (balance) is set per rank: at another np the shares are set again, given speeds
    # one per new rank (Config.check_world checks their count) and measured ones measured again
    per_rank = ("balance",) if ck_np is not None and ck_np != np_ else ()
    diff = sorted(k for k in mine if k not in RESUMABLE + per_rank and mine[k] != theirs[k]
                  and not (k == "epochs" and stable_phase(ck, saved, cfg)))
    problems = [f"{k}={theirs[k]!r} (this run: {mine[k]!r})" for k in diff]
    fix = [_flag(k, theirs[k]) for k in diff]
    # A fixed global batch (batch_mode=global) resumes at another np: the same global batch, schedule
    # and data order (engine.Session regroups it); per-rank batches would change the run itself.
    if ck_np is not None and ck_np != np_ and cfg.batch_mode != "global":
        problems.append(f"np={ck_np} (this run: {np_})")
        fix.append(f"--np {ck_np} (or mpiexec -n {ck_np})")
    if problems:
        names = diff + (["np"] if len(problems) > len(diff) else [])
        raise CheckpointError(f"{path} was made with different {', '.join(names)}: {', '.join(problems)}; "
                              f"resume with the same settings ({' '.join(fix)})")
    return saved


def changed_sources(then: dict, now: dict, data: str) -> str | None:
    """What differs between the sources a run recorded (``then``: ``{"data_checksum", "model_source"}``, a
    checkpoint's or a result's) and those of now (``checkpoint.sources``), as the end of "was made ...":
    "on other data: the contents of 'x' changed since (...)" or "with another version of your model: ...";
    None when neither differs, or a record predates them::

        changed_sources(ck, checkpoint.sources(cfg, ds), cfg.data)
    """
    a, b = then.get("data_checksum"), now.get("data_checksum")
    if a and b and a != b:
        return f"on other data: the contents of {data!r} changed since (data checksum {a[:12]} then, {b[:12]} now)"
    a, b = then.get("model_source") or {}, now.get("model_source") or {}
    if a.get("sha256") and b.get("sha256") and a["sha256"] != b["sha256"]:
        return (f"with another version of your model: {b.get('file') or b.get('spec')} changed since "
                f"(sha256 {a['sha256'][:12]} then, {b['sha256'][:12]} now)")
    return None


def check_sources(ck: dict, path: str = "checkpoint", *, data_checksum: str | None = None,
                  model_source: dict | None = None) -> None:
    """Refuse (CheckpointError) to resume a checkpoint whose run read other data (``data_checksum``: the
    data set's as loaded now) or built its model from another source (``model_source``: your builder's
    file as it is now, ``models.custom.source_digest``); a checkpoint that predates these records passes.
    The same settings on changed data or code would carry on a run that mixes two."""
    why = changed_sources(ck, {"data_checksum": data_checksum, "model_source": model_source},
                          ck["config"].get("data"))
    if why:
        raise CheckpointError(f"{path} was made {why}; resume with the data and code it was made with, or start "
                              "the run again (--overwrite; another --out keeps this one)")


def load(path: str, cfg: Config, np_: int, *, data_checksum: str | None = None,
         model_source: dict | None = None) -> dict:
    """``read`` + ``verify`` (+ ``check_sources`` where the data's checksum or the model's source is
    given): the checkpoint, fit to resume ``cfg`` at ``np_`` ranks."""
    ck = read(path)
    verify(ck, cfg, np_, path)
    check_sources(ck, path, data_checksum=data_checksum, model_source=model_source)
    return ck


def apply(ck: dict, model, optimizer, path: str = "checkpoint") -> None:
    """Load the model and optimizer state; a state that does not fit the model is a CheckpointError."""
    try:
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path} does not fit this model ({first[:160]}); resume with the "
                              "settings it was made with") from None


def summary(s: Session) -> dict:
    """What the run's checkpoints cost (rank 0's seconds, bytes per file) and the newest one's path."""
    secs = [x["seconds"] for x in s.saves]
    return {"count": len(s.saves), "every_steps": s.cfg.checkpoint_every_steps,
            "every_minutes": s.checkpoint_minutes, "seconds": secs,
            "mean_s": sum(secs) / len(secs) if secs else None,
            "bytes": s.saves[-1]["bytes"] if s.saves else None,
            "last": s.saves[-1]["path"] if s.saves else (latest(s.cfg.out) if s.cfg.out else None)}


def write_position(s: Session, epoch: int, gstep: int, epochs_log: list, *, step_in_epoch: int = 0,
                acc=None) -> str | None:
    """Rank 0 writes the checkpoint (``epoch`` full epochs and ``step_in_epoch`` steps done); every
    rank learns whether it failed (the reason) or not (None). A collective: every rank's own state
    (BatchNorm buffers, RNG) is gathered into it."""
    failed = None
    t = time.perf_counter()
    states = s.ranks.rank_states(s.model)
    if s.rank == 0:
        try:
            path = s.save_checkpoint(epoch, gstep, epochs_log, step_in_epoch=step_in_epoch,
                                     partial=acc.state() if step_in_epoch and acc is not None else None,
                                     states=states)
            s.saves.append({"at": t, "seconds": time.perf_counter() - t, "bytes": os.path.getsize(path),
                            "path": os.path.join(s.cfg.out, NAME), "step": gstep})
            s.last_save = time.monotonic()
        except WriteError as e:
            prev = epoch_files(s.cfg.out)
            failed = f"{e}; " + (f"the previous checkpoint ({os.path.basename(prev[-1][1])}) is intact"
                                 if prev else "there is no earlier checkpoint")
    if s.ranks.comm is not None and s.np_ > 1:
        failed = s.ranks.comm.bcast(failed, root=0)
    return failed


def epoch_plan(cfg: Config, ds, order_np: int, epoch: int, steps: int) -> np.ndarray:
    """(steps, global batch) training indices of ``epoch`` as a run at ``order_np`` ranks draws them:
    step s's global batch is rank 0's batch, then rank 1's, ... (what every rank computes alone)."""
    b = cfg.global_batch(order_np) // order_np
    plan = np.concatenate([data_mod.epoch_batches(ds.y_train, order_np, r, b, epoch, cfg.seed, cfg.sharding)
                           for r in range(order_np)], axis=1)
    if len(plan) != steps:
        raise CheckpointError(f"{cfg.resume} was made at np={order_np}, whose epochs have {len(plan)} steps; "
                              f"at this np they have {steps}, so the schedule would change; resume at "
                              f"np={order_np}, or at an np whose shards give the same steps")
    return plan


def _regroup_(state: dict, model: nn.Module, policy: str) -> None:
    """Resume at another np in the simulator: per-virtual-rank BatchNorm rows (np_old, C) are settled
    by ``policy`` (row 0 or the mean) and spread to this run's rows -- per-rank statistics regroup."""
    mine = model.state_dict()
    for k, v in state.items():
        if k in mine and v.shape != mine[k].shape and v.dim() == 2 and v.shape[1:] == mine[k].shape[-1:]:
            row = v[0] if policy == "broadcast" else v.mean(0)
            state[k] = row.expand_as(mine[k]).contiguous().clone()


def _average_saved_buffers_(model: nn.Module, states: list) -> None:
    """Resume at another np under MPI with bn_buffers=average: start from the mean of every saved
    rank's statistics (rank 0's alone under broadcast, which the model already holds)."""
    with torch.no_grad():
        for i, b in enumerate(bn_buffers(model)):
            b.copy_(torch.stack([st["bn"][i] for st in states]).mean(0))


def sources(cfg: Config, ds) -> dict:
    """What a run reads and builds from, as a checkpoint records it: the data set's checksum (its contents
    as loaded, subset included) and your model builder's file digest (``models.source_digest``; None for a
    registered model)::

        checkpoint.sources(cfg, ds)   # {"data_checksum": "5e1f...", "model_source": None}
    """
    from ..models import source_digest
    return {"data_checksum": ds.checksum, "model_source": source_digest(cfg.model)}


def check_unchanged(cfg: Config, ds) -> None:
    """CheckpointError when ``cfg.resume`` was made on other data than ``ds`` or with another version of
    the model builder (``check_sources``); before any rank trains (``harness.prepare``)."""
    check_sources(read(cfg.resume), cfg.resume, **sources(cfg, ds))


def load_position(cfg: Config, ranks, model, optimizer, *, sources: dict | None = None) -> dict:
    """Rank 0 reads and verifies ``cfg.resume`` (checksum, settings, np; with ``sources``, the data and
    model source it was made with); every rank gets the position (epoch, step in epoch, history, partial
    sums, np, order np), rank 0 also the per-rank states (key ``ranks``), or every rank the same
    CheckpointError (never one rank failing while the others wait)."""
    comm, np_ = ranks.comm, ranks.np_
    rank, size = world(comm)
    meta = error = states = None
    if rank == 0:
        try:
            ck = load(cfg.resume, cfg, np_, **(sources or {}))
            other_np = int(ck["np"]) != np_
            if other_np and ranks.simulated:
                _regroup_(ck["model"], model, cfg.bn_buffers)
            apply(ck, model, optimizer, cfg.resume)
            states = ck["ranks"]
            if other_np and states and not ranks.simulated and cfg.bn_buffers == "average":
                _average_saved_buffers_(model, states)
            meta = {"epoch": int(ck["epoch"]), "history": list(ck["history"]),
                    "step_in_epoch": int(ck["step_in_epoch"]), "partial": ck["partial"], "np": int(ck["np"]),
                    "order_np": int(ck["order_np"]), "has_ranks": states is not None,
                    "components": ck["components"]}
        except CheckpointError as e:
            error = str(e)
    if size > 1:
        meta, error = comm.bcast((meta, error), root=0)
    if error:
        raise CheckpointError(error)
    meta["ranks"] = states if rank == 0 else None
    return meta
