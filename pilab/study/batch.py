"""A study's measured points as Slurm batch jobs: one ``sbatch`` job per point, the queue watched until
each ends, the study's state on disk so that ``--resume`` picks up after the shell is closed::

    python -m pilab scale --launcher slurm --partition pi --time 00:20:00 --nps 2,4,8 --out runs/s
    python -m pilab scale ... --dry-run        # prints each point's job.sbatch, submits nothing
    python -m pilab scale ... --resume         # waits for running jobs, keeps finished points,
                                               # submits failed ones again (a TIMEOUT one from its checkpoint)

    from pilab.study import batch
    opts = batch.Options(partition="pi", time="20")
    batch.check(opts, cfg, [2, 4, 8])                      # SlurmError on bad input, before anything is written
    runs, failed = batch.run_points(cfg, [2, 4, 8], "runs/s", opts, resume=False, log=print)

One job per point rather than a job array: the points ask for different numbers of nodes and tasks, and
an array's tasks all share one request. Each point's script is ``<out>/np<p>/job.sbatch`` (kept, plain,
editable: ``sbatch`` it by hand and the study's ``--resume`` takes its result), its log
``<out>/np<p>/slurm-<job>.log``; ``<out>/slurm.json`` records which job each point has.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, fields, replace

from .. import slurm
from ..config import Config
from ..files import save_json
# .points and ..engine.checkpoint load torch (seconds): imported where a point is read, so that
# check() refuses bad input at once

__all__ = ["Options", "Stopped", "check", "check_out", "job_config", "point_script", "dry_run", "run_points", "STATE_FILE"]

STATE_FILE = "slurm.json"
# A job that ended for one of these reasons was healthy: continued from its last checkpoint on --resume.
CONTINUABLE = ("TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE")
POLL_S = 1.0  # between two looks at the queue
LOG_LINES = 8  # of a failed job's log, in its report


@dataclass(frozen=True)
class Options:
    partition: str
    time: str  # as sbatch --time takes it
    ranks_per_node: int = 0  # 0: as many as the partition's smallest node has CPUs (/ threads per rank)
    options: tuple = ()  # further #SBATCH lines, e.g. ("--account=myproject",)


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while waiting: the study's active jobs were cancelled (``cancelled``: [(np, job)])."""

    def __init__(self, cancelled, cause: BaseException):
        super().__init__("interrupted")
        self.cancelled, self.cause = cancelled, cause


def _threads(cfg: Config) -> int:
    return cfg.threads or 1  # a job's rank gets the CPUs it asked for: one, unless --threads says more


def check(opts: Options, cfg: Config, nps) -> dict:
    """Everything Slurm can refuse, before anything is written or submitted (SlurmError naming the fix):
    Slurm's commands, the partition, ``--time``, np against the partition's CPUs and a time limit shorter
    than one checkpoint interval. Returns the partition's sizes with ``ranks_per_node`` used."""
    slurm.require_commands()
    part = slurm.partition(opts.partition)
    limit = slurm.time_seconds(opts.time)
    t = _threads(cfg)
    rpn = opts.ranks_per_node or max(1, part["cpus_per_node"] // t)
    if opts.ranks_per_node < 0 or rpn * t > part["cpus_per_node"]:
        raise slurm.SlurmError(f"--ranks-per-node {opts.ranks_per_node} x {t} thread(s) is more than the "
                               f"{part['cpus_per_node']} CPUs of partition {opts.partition}'s nodes; give at "
                               f"most {part['cpus_per_node'] // t}")
    big = max(nps)
    if big * t > part["cpus"] or math.ceil(big / rpn) > part["nodes"]:
        raise slurm.SlurmError(f"np={big} needs {big * t} CPUs on {math.ceil(big / rpn)} node(s), and partition "
                               f"{opts.partition} has {part['cpus']} CPUs on {part['nodes']} node(s); lower "
                               "--nps or give a larger --partition")
    if cfg.checkpoint_minutes > 0 and limit < cfg.checkpoint_minutes * 60:
        raise slurm.SlurmError(f"--time {opts.time} is shorter than one checkpoint interval (--checkpoint-minutes "
                               f"{cfg.checkpoint_minutes:g}): a job stopped at its limit would keep nothing; "
                               f"give a longer --time or --checkpoint-minutes under {limit / 60:g}")
    return {**part, "ranks_per_node": rpn}


def check_out(out: str, resume: bool) -> None:
    """SlurmError where ``out`` holds a batch study whose jobs still run and ``resume`` is not asked: a
    new study there would write into the same point directories as they do."""
    if resume or not out:
        return
    recorded = [r["job"] for r in _load_state(out)["points"].values() if r.get("job")]
    live = [j for j, job in slurm.states(recorded).items() if job.active] if recorded else []
    if live:
        raise slurm.SlurmError(f"--out {out} holds a batch study whose job(s) {', '.join(live)} still run; the "
                               f"same command with --resume waits for them, or `scancel {' '.join(live)}` first")


def job_config(cfg: Config, opts: Options) -> Config:
    """``cfg`` as a point's job trains it: train's default checkpoint interval (-1: 10 minutes on more
    than one node) becomes half the job's time limit where that is shorter, so a job stopped at its
    limit keeps a checkpoint to continue from (how often a run checkpoints is not what it trains)."""
    if cfg.checkpoint_minutes != -1:
        return cfg
    return replace(cfg, checkpoint_minutes=min(10.0, slurm.time_seconds(opts.time) / 120))


def _train_argv(cfg: Config, np_: int, out: str, resume: str = "") -> list[str]:
    """``python -m pilab train --np P --quiet --out OUT`` with every setting that differs from train's
    defaults, so the script shows what the point trains (and train's own checks run in the job)."""
    base, mine = Config().to_dict(), replace(cfg, out=out, resume=resume).to_dict()
    argv = [sys.executable, "-m", "pilab", "train", "--np", str(np_), "--quiet"]
    for f in fields(Config):
        v = mine[f.name]
        if v == base[f.name] and f.name != "out":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            argv.append(flag if v else "--no-" + flag[2:])
        else:
            argv += [flag, str(v)]
    return argv


def point_dir(out: str, p: int) -> str:
    return os.path.abspath(os.path.join(out, f"np{p}"))


def point_script(cfg: Config, p: int, out: str, opts: Options, rpn: int, resume: str = "") -> str:
    """The batch script of np point ``p``: ``ceil(p / rpn)`` nodes filled in order, as a hostfile of
    ``rpn`` slots per host would place the ranks (the same placement gives the same per-step losses)."""
    d = point_dir(out, p)
    per_node = min(p, rpn)
    why = f"pilab scale: the np={p} point of the study in {os.path.abspath(out)}" + \
        (f", continued from {os.path.basename(resume)}" if resume else "")
    return slurm.job_script(_train_argv(cfg, p, d, resume), name=f"pilab-np{p}", partition=opts.partition,
                            time=opts.time, nodes=math.ceil(p / per_node), ntasks=p, ntasks_per_node=per_node,
                            cpus_per_task=_threads(cfg), log=os.path.join(d, "slurm-%j.log"),
                            chdir=os.getcwd(), options=list(opts.options), comment=why)


# ----------------------------------------------------------------------------------------------
# the study's state on disk: <out>/slurm.json
# ----------------------------------------------------------------------------------------------
def _load_state(out: str) -> dict:
    try:
        with open(os.path.join(out, STATE_FILE)) as f:
            st = json.load(f)
        return st if isinstance(st, dict) and isinstance(st.get("points"), dict) else {"points": {}}
    except (OSError, ValueError):
        return {"points": {}}


def _save_state(out: str, st: dict) -> None:
    save_json(st, os.path.join(out, STATE_FILE))


def _finished(cfg: Config, out: str, p: int) -> dict | None:
    from .points import finished_run
    return finished_run(os.path.join(out, f"np{p}", "result.json"), p, replace(cfg, out=point_dir(out, p)),
                        False)


def _plan(cfg: Config, nps, out: str, resume: bool, log) -> dict:
    """np -> ("kept", result) | ("wait", job) | ("submit", resume checkpoint or "" [, why again])."""
    from ..engine import checkpoint
    st = _load_state(out) if resume else {"points": {}}
    recorded = {p: st["points"].get(str(p)) for p in nps}
    now = slurm.states([r["job"] for r in recorded.values() if r]) if resume else {}
    plan = {}
    for p in nps:
        done = _finished(cfg, out, p) if resume else None
        rec = recorded[p]
        job = now.get(rec["job"]) if rec else None
        if done is not None:
            plan[p] = ("kept", done)
        elif job is not None and job.active:
            plan[p] = ("wait", rec["job"])
            log(f"  np={p:<3} job {rec['job']} is still {job.state}: waiting for it")
        else:
            ended = job.state if job is not None and job.state != "UNKNOWN" else (rec or {}).get("state", "")
            ck = checkpoint.latest(point_dir(out, p))
            cont = ck if ended in CONTINUABLE and ck else ""
            plan[p] = ("submit", cont)
            if rec:  # said as it is submitted again (run_points), or as it would be (dry_run)
                plan[p] += (f"job {rec['job']} ended {ended or 'UNKNOWN'}: submitting it again"
                            + (f", continued from {os.path.relpath(ck)}" if cont else ""),)
    return plan


def dry_run(cfg: Config, nps, out: str, opts: Options, rpn: int, *, resume: bool, log) -> None:
    """Print the script of every point that would be submitted; submit and write nothing."""
    for p, (what, arg, *why) in _plan(cfg, nps, out, resume, log).items():
        if what == "submit":
            for line in why:
                log(f"  np={p:<3} {line}")
            print(f"# ---- {os.path.join(point_dir(out, p), 'job.sbatch')} (not submitted: --dry-run)")
            print(point_script(cfg, p, out, opts, rpn, arg), end="")
        else:
            log(f"  np={p:<3} {'kept: finished earlier' if what == 'kept' else f'job {arg} still queued'}")


def _describe(job: slurm.Job) -> str:
    if job.state == "PENDING":
        return f"PENDING ({job.reason})" if job.reason and job.reason != "None" else "PENDING"
    if job.state == "RUNNING":
        return f"RUNNING on {job.nodes}"
    return "done" if job.state == slurm.ENDED_OK else job.state


def _log_tail(out: str, p: int, job: str) -> str:
    path = os.path.join(point_dir(out, p), f"slurm-{job}.log")
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return f"    (no log: {path} was not written)"
    return "\n".join(f"    | {ln}" for ln in lines[-LOG_LINES:]) or f"    ({path} is empty)"


def run_points(cfg: Config, nps, out: str, opts: Options, rpn: int, *, resume: bool, log,
               poll_s: float = POLL_S) -> tuple[dict, list]:
    """Submit (or, with ``resume``, keep / wait for / submit again) every measured point and wait until
    each job ends, printing each point's queue state as it changes. Returns ``(runs, failed)``: np ->
    result of the finished points, and ``[{"np", "job", "state", "log"}]`` of the others. Ctrl-C or
    SIGTERM (as KeyboardInterrupt) cancels the study's active jobs and raises :class:`Stopped`."""
    os.makedirs(out, exist_ok=True)
    st = _load_state(out) if resume else {"points": {}}
    st.update(partition=opts.partition, time=opts.time, ranks_per_node=rpn)
    runs, jobs = {}, {}
    try:
        for p, (what, arg, *why) in _plan(cfg, nps, out, resume, log).items():
            for line in why:
                log(f"  np={p:<3} {line}")
            if what == "kept":
                runs[p] = arg
                log(f"  np={p:<3} kept: finished earlier")
                continue
            if what == "wait":
                jobs[p] = arg
                continue
            d = point_dir(out, p)
            if not arg:
                from .points import _clear_point
                _clear_point(d)
            os.makedirs(d, exist_ok=True)
            script = os.path.join(d, "job.sbatch")
            with open(script, "w") as f:
                f.write(point_script(cfg, p, out, opts, rpn, arg))
            jobs[p] = slurm.submit(script)
            rec = st["points"].get(str(p)) or {"earlier": []}
            if rec.get("job"):
                rec["earlier"] = [*rec.get("earlier", []), rec["job"]]
            st["points"][str(p)] = {**rec, "job": jobs[p], "state": "SUBMITTED",
                                    "script": os.path.relpath(script, out), "resumed_from": arg or None}
            _save_state(out, st)
            log(f"  np={p:<3} submitted {os.path.relpath(script)} as job {jobs[p]}")
        ended = _wait(cfg, jobs, st, out, log, poll_s)
    except KeyboardInterrupt as e:
        now = slurm.states(jobs.values()) if jobs else {}
        live = [(p, j) for p, j in jobs.items() if now[j].active or now[j].state == "UNKNOWN"]
        slurm.cancel([j for _, j in live])
        for p, j in live:
            st["points"][str(p)]["state"] = "CANCELLED"
        _save_state(out, st)
        raise Stopped(sorted(live), e) from None
    failed = []
    for p, job in ended.items():
        res = _finished(cfg, out, p)
        if job.state == slurm.ENDED_OK and res is not None:
            runs[p] = res
            continue
        state = job.state if job.state != slurm.ENDED_OK else "COMPLETED without a finished result.json"
        failed.append({"np": p, "job": job.id, "state": state, "log": _log_tail(out, p, job.id)})
    return dict(sorted(runs.items())), failed


def _wait(cfg: Config, jobs: dict, st: dict, out: str, log, poll_s: float) -> dict:
    """Poll until every job in ``jobs`` (np -> id) has ended; np -> its final :class:`slurm.Job`. A job
    Slurm no longer knows (purged, no accounting) is judged by its own files: a finished result.json."""
    shown: dict = {}
    while True:
        now = slurm.states(jobs.values()) if jobs else {}
        final = {}
        for p, j in jobs.items():
            job = now[j]
            if job.state == "UNKNOWN":
                job = slurm.Job(j, slurm.ENDED_OK if _finished(cfg, out, p) else "UNKNOWN", source="files")
            line = _describe(job)
            if shown.get(p) != line:
                log(f"  np={p:<3} job {j:<6} {line}")
                shown[p] = line
                st["points"][str(p)]["state"] = job.state
                _save_state(out, st)
            if not job.active:
                final[p] = job
        if len(final) == len(jobs):
            return final
        time.sleep(poll_s)
