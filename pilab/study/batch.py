"""A study's runs as Slurm batch jobs: one ``sbatch`` job per point (a scaling study's measured np points,
a remedies search's reference and candidates), the queue watched until each ends, the study's state on
disk so that ``--resume`` picks up after the shell is closed::

    python -m pilab scale --launcher slurm --partition pi --time 00:20:00 --nps 2,4,8 --out runs/s
    python -m pilab scale ... --dry-run        # prints each point's job.sbatch, submits nothing
    python -m pilab scale ... --resume         # waits for running jobs, keeps finished points,
                                               # submits failed ones again (a TIMEOUT one from its checkpoint)

    from pilab.study import batch
    opts = batch.Options(partition="pi", time="20")
    batch.check(opts, cfg, [2, 4, 8])                      # SlurmError on bad input, before anything is written
    points = batch.scale_points(cfg, [2, 4, 8], "runs/s", opts, rpn=2)
    runs, failed = batch.run_points(points, "runs/s", opts, resume=False, log=print)   # by point id "2" ...

One job per point rather than a job array: the points ask for different numbers of nodes and tasks, and
an array's tasks all share one request. Each point's script is ``<out>/np<p>/job.sbatch`` (kept, plain,
editable: ``sbatch`` it by hand and the study's ``--resume`` takes its result), its log
``<out>/np<p>/slurm-<job>.log``; ``<out>/slurm.json`` records which job each point has. A remedies
search's points are ``<out>/reference`` and ``<out>/<candidate slug>`` (:func:`remedies_points`).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

from ..config import Config
from ..files import save_json
from ..launch import slurm

# .points and ..engine.checkpoint load torch (seconds): imported where a point is read, so that
# check() refuses bad input at once

__all__ = ["Options", "Stopped", "Point", "check", "check_out", "job_config", "scale_points", "point_script",
           "pilab_argv", "dry_run", "run_points", "STATE_FILE"]

STATE_FILE = "slurm.json"
# A job that ended for one of these reasons was healthy: continued from its last checkpoint on --resume.
CONTINUABLE = ("TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE")
POLL_S = 1.0  # between two looks at the queue at first; slower as the wait grows (_poll_s), up to
POLL_MAX_S = 10.0  # so that a long study does not ask a shared cluster's controller every second
LOG_LINES = 8  # of a failed job's log, in its report


@dataclass(frozen=True)
class Options:
    partition: str
    time: str  # as sbatch --time takes it
    ranks_per_node: int = 0  # 0: as many as the partition's smallest node has CPUs (/ threads per rank)
    options: tuple = ()  # further #SBATCH lines, e.g. ("--account=myproject",)


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while waiting: the study's active jobs were cancelled (``cancelled``: [(name, job)])."""

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
    """SlurmError where ``out`` cannot go into a batch script (``slurm.check_path``), or holds a batch
    study whose jobs still run and ``resume`` is not asked: a new study there would write into the same
    point directories as they do."""
    slurm.check_path(os.path.abspath(out or "."), "--out")
    slurm.check_path(os.getcwd(), "the working directory")
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


def pilab_argv(command: str, cfg: Config, np_: int, out: str, resume: str = "") -> list[str]:
    """``python -m pilab COMMAND --np P --quiet --out OUT`` (train or simulate) with every setting that
    differs from the command's defaults, so the script shows what the point runs (and the command's
    own checks run in the job)."""
    base, mine = Config().to_dict(), replace(cfg, out=out, resume=resume).to_dict()
    argv = [sys.executable, "-m", "pilab", command, "--np", str(np_), "--quiet"]
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


@dataclass(frozen=True)
class Point:
    """One job of a batch study: ``id`` its key in slurm.json, ``name`` what the lines call it, ``dir``
    where its job writes (absolute), ``script(resume)`` its job.sbatch (continued from checkpoint
    ``resume``, "" from the start), ``finished()`` its result where it ran to the end, else None."""
    id: str
    name: str
    dir: str
    script: Callable[[str], str]
    finished: Callable[[], Optional[dict]]


def point_dir(out: str, p: int) -> str:
    return os.path.abspath(os.path.join(out, f"np{p}"))


def scale_points(cfg: Config, nps, out: str, opts: Options, rpn: int) -> list[Point]:
    """A scaling study's measured points: ``np<p>`` each, ``train --np p`` on ``ceil(p / rpn)`` nodes
    filled in order, as a hostfile of ``rpn`` slots per host would place the ranks (the same placement
    gives the same per-step losses)."""
    def point(p: int) -> Point:
        d = point_dir(out, p)

        def script(resume: str) -> str:
            per_node = min(p, rpn)
            why = f"pilab scale: the np={p} point of the study in {os.path.abspath(out)}" + \
                (f", continued from {os.path.basename(resume)}" if resume else "")
            return slurm.job_script(pilab_argv("train", cfg, p, d, resume), name=f"pilab-np{p}",
                                    partition=opts.partition, time=opts.time, nodes=math.ceil(p / per_node),
                                    ntasks=p, ntasks_per_node=per_node, cpus_per_task=_threads(cfg),
                                    log=os.path.join(slurm.literal(d), "slurm-%j.log"), chdir=os.getcwd(),
                                    options=list(opts.options), comment=why)

        def finished():
            from .points import finished_run
            return finished_run(os.path.join(d, "result.json"), p, replace(cfg, out=d), False)
        return Point(str(p), f"np={p}", d, script, finished)
    return [point(p) for p in nps]


def remedies_points(cfg: Config, np_: int, candidates, only, recipes_of, opts: Options, *,
                    reference: bool) -> list[Point]:
    """A remedies search's runs: each candidate ``simulate --np np_`` in ``<out>/<its slug>`` (where the
    search keeps it), and the np=1 reference in ``<out>/reference`` where ``reference``; one process a
    job (the simulator runs its np ranks in one process)."""
    from . import remedies
    defined_at = recipes_of or np_
    cands = remedies.chosen((candidates or remedies.default_candidates)(cfg, defined_at), only, defined_at)
    sim_cfg = replace(cfg, out="")

    def point(pid: str, name: str, c: Config, p: int) -> Point:
        d = os.path.abspath(os.path.join(cfg.out, pid))

        def script(resume: str) -> str:
            why = f"pilab remedies: {name} at np={p}, of the search in {os.path.abspath(cfg.out)}"
            return slurm.job_script(pilab_argv("simulate", c, p, d, resume), name=f"pilab-{pid}"[:40],
                                    partition=opts.partition, time=opts.time, nodes=1, ntasks=1,
                                    ntasks_per_node=1, cpus_per_task=_threads(cfg),
                                    log=os.path.join(slurm.literal(d), "slurm-%j.log"), chdir=os.getcwd(),
                                    options=list(opts.options), comment=why)

        def finished():
            from .points import finished_run
            return finished_run(os.path.join(d, "result.json"), p, replace(c, out=d), True)
        return Point(pid, name, d, script, finished)
    points = [point("reference", "reference np=1", sim_cfg, 1)] if reference else []
    return points + [point(remedies.slug(label), label, replace(sim_cfg, **changes), np_)
                     for label, changes in cands if _fits(replace(sim_cfg, **changes), np_)]


def _fits(c: Config, np_: int) -> bool:
    """Whether a candidate can run at ``np_`` (the search reports the others as skipped, with why)."""
    from ..config import ConfigError
    from .. import data
    try:
        c.check_world(np_, data.train_size(c.data, train_subset=c.train_subset, test_subset=c.test_subset,
                                           seed=c.seed, image_size=c.image_size))
    except ConfigError:
        return False
    return True


def point_script(cfg: Config, p: int, out: str, opts: Options, rpn: int, resume: str = "") -> str:
    """The batch script of the scaling study's np point ``p`` (:func:`scale_points`)."""
    return scale_points(cfg, [p], out, opts, rpn)[0].script(resume)


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


def _plan(points: list, out: str, resume: bool, log) -> dict:
    """point id -> ("kept", result) | ("wait", job) | ("submit", resume checkpoint or "" [, why again])."""
    from ..engine import checkpoint
    st = _load_state(out) if resume else {"points": {}}
    recorded = {pt.id: st["points"].get(pt.id) for pt in points}
    now = slurm.states([r["job"] for r in recorded.values() if r]) if resume else {}
    plan = {}
    for pt in points:
        done = pt.finished() if resume else None
        rec = recorded[pt.id]
        job = now.get(rec["job"]) if rec else None
        if done is not None:
            plan[pt.id] = ("kept", done)
        elif job is not None and job.active:
            plan[pt.id] = ("wait", rec["job"])
            log(f"  {pt.name:<6} job {rec['job']} is still {job.state}: waiting for it")
        else:
            ended = job.state if job is not None and job.state != "UNKNOWN" else (rec or {}).get("state", "")
            ck = checkpoint.latest(pt.dir)
            cont = ck if ended in CONTINUABLE and ck else ""
            plan[pt.id] = ("submit", cont)
            if rec:  # said as it is submitted again (run_points), or as it would be (dry_run)
                plan[pt.id] += (f"job {rec['job']} ended {ended or 'UNKNOWN'}: submitting it again"
                                + (f", continued from {os.path.relpath(ck)}" if cont else ""),)
    return plan


def dry_run(points: list, out: str, *, resume: bool, log) -> None:
    """Print the script of every point that would be submitted; submit and write nothing."""
    plan = _plan(points, out, resume, log)
    for pt in points:
        what, arg, *why = plan[pt.id]
        if what == "submit":
            for line in why:
                log(f"  {pt.name:<6} {line}")
            print(f"# ---- {os.path.join(pt.dir, 'job.sbatch')} (not submitted: --dry-run)")
            print(pt.script(arg), end="")
        else:
            log(f"  {pt.name:<6} {'kept: finished earlier' if what == 'kept' else f'job {arg} still queued'}")


def _describe(job: slurm.Job) -> str:
    if job.state == "PENDING":
        return f"PENDING ({job.reason})" if job.reason and job.reason != "None" else "PENDING"
    if job.state == "RUNNING":
        return f"RUNNING on {job.nodes}"
    return "done" if job.state == slurm.ENDED_OK else job.state


# Hydra's report of a rank that died: ten lines that would fill a short tail and hide the rank's own
# last words (a traceback, an MPI error) printed above them; folded into one line (_fold_hydra)
_HYDRA_BANNER = re.compile(r"^=+$|^=\s+(BAD TERMINATION|PID \d+ RUNNING AT|EXIT CODE:|CLEANING UP|YOU CAN IGNORE)"
                           r"|^This typically refers to a problem|^Please see the FAQ page")
_HYDRA_RANK = re.compile(r"^=\s+PID (\d+) RUNNING AT (\S+)")
_HYDRA_EXIT = re.compile(r"^YOUR APPLICATION TERMINATED WITH THE EXIT STRING: (.*)")


def _fold_hydra(lines: list[str]) -> list[str]:
    """``lines`` without Hydra's bad-termination banner, which becomes one line where it stood:
    ``mpiexec: a rank (pid 16467 on node02) ended: Aborted (signal 6)``."""
    out, where = [], ""
    for ln in lines:
        m = _HYDRA_RANK.match(ln)
        if m:
            where = f" (pid {m[1]} on {m[2]})"
        m = _HYDRA_EXIT.match(ln)
        if m:
            out.append(f"mpiexec: a rank{where} ended: {m[1]}")
            where = ""
        elif not _HYDRA_BANNER.match(ln):
            out.append(ln)
    return out


def _log_tail(pt: Point, job: str) -> str:
    path = os.path.join(pt.dir, f"slurm-{job}.log")
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return f"    (no log: {path} was not written)"
    lines = [ln for ln in _fold_hydra(lines) if not ln.startswith("Extension modules:")]  # faulthandler's
    tail = lines[-LOG_LINES:]
    # A traceback or a fatal signal's stack starts above its last lines: keep its first line, and of a
    # fatal signal's (faulthandler: innermost call first) the crashed thread's innermost calls too
    at = next((i for i, ln in enumerate(lines) if ln.startswith(("Fatal Python error", "Traceback ("))), None)
    if at is not None and lines[at] not in tail:
        cur = next((i for i, ln in enumerate(lines) if i > at and ln.startswith("Current thread ")), None)
        head = [lines[at]] + (lines[cur:cur + 4] if cur is not None and lines[at].startswith("Fatal") else [])
        tail = head + ["..."] + [ln for ln in tail if ln not in head]
    tail = "\n".join(f"    | {ln}" for ln in tail)
    return f"{tail}\n    (all of it: {path})" if tail else f"    ({path} is empty)"


def _submit(pt: Point, resume_from: str, st: dict, out: str, log) -> str:
    """Write the point's job.sbatch and submit it; record the job in slurm.json."""
    if not resume_from:
        from .points import clear_point
        clear_point(pt.dir)
    os.makedirs(pt.dir, exist_ok=True)
    script = os.path.join(pt.dir, "job.sbatch")
    with open(script, "w") as f:
        f.write(pt.script(resume_from))
    job = slurm.submit(script)
    rec = st["points"].get(pt.id) or {"earlier": []}
    if rec.get("job"):
        rec["earlier"] = [*rec.get("earlier", []), rec["job"]]
    st["points"][pt.id] = {**rec, "job": job, "state": "SUBMITTED", "script": os.path.relpath(script, out),
                           "resumed_from": resume_from or None}
    _save_state(out, st)
    log(f"  {pt.name:<6} submitted {os.path.relpath(script)} as job {job}")
    return job


def run_points(points: list, out: str, opts: Options, *, resume: bool, log,
               poll_s: float = POLL_S) -> tuple[dict, list]:
    """Submit (or, with ``resume``, keep / wait for / submit again) every point and wait until each job
    ends, printing each point's queue state as it changes. Returns ``(runs, failed)``: point id ->
    result of the finished points, and ``[{"id", "name", "job", "state", "log"}]`` of the others. Ctrl-C
    or SIGTERM (as KeyboardInterrupt) cancels the study's active jobs and raises :class:`Stopped`."""
    os.makedirs(out, exist_ok=True)
    st = _load_state(out) if resume else {"points": {}}
    st.update(partition=opts.partition, time=opts.time, ranks_per_node=opts.ranks_per_node)
    by_id = {pt.id: pt for pt in points}
    runs, jobs = {}, {}
    try:
        plan = _plan(points, out, resume, log)
        for pt in points:
            what, arg, *why = plan[pt.id]
            for line in why:
                log(f"  {pt.name:<6} {line}")
            if what == "kept":
                runs[pt.id] = arg
                log(f"  {pt.name:<6} kept: finished earlier")
            elif what == "wait":
                jobs[pt.id] = arg
            else:
                jobs[pt.id] = _submit(pt, arg, st, out, log)
        ended = _wait(by_id, jobs, st, out, log, poll_s)
    except KeyboardInterrupt as e:
        now = slurm.states(jobs.values()) if jobs else {}
        live = [(i, j) for i, j in jobs.items() if now[j].active or now[j].state == "UNKNOWN"]
        slurm.cancel([j for _, j in live])
        for i, _ in live:
            st["points"][i]["state"] = "CANCELLED"
        _save_state(out, st)
        raise Stopped([(by_id[i].name, j) for i, j in live], e) from None
    failed = []
    for i, job in ended.items():
        res = by_id[i].finished()
        if job.state == slurm.ENDED_OK and res is not None:
            runs[i] = res
            continue
        state = job.state if job.state != slurm.ENDED_OK else "COMPLETED without a finished result.json"
        failed.append({"id": i, "name": by_id[i].name, "job": job.id, "state": state,
                       "log": _log_tail(by_id[i], job.id)})
    return runs, failed


def _wait(by_id: dict, jobs: dict, st: dict, out: str, log, poll_s: float) -> dict:
    """Poll until every job in ``jobs`` (point id -> job id) has ended; point id -> its final
    :class:`slurm.Job`. A job Slurm no longer knows (purged, no accounting) is judged by its own files:
    a finished result.json."""
    shown: dict = {}
    t0 = time.monotonic()
    while True:
        now = slurm.states(jobs.values()) if jobs else {}
        final = {}
        for i, j in jobs.items():
            job = now[j]
            if job.state == "UNKNOWN":
                job = slurm.Job(j, slurm.ENDED_OK if by_id[i].finished() else "UNKNOWN", source="files")
            line = _describe(job)
            if shown.get(i) != line:
                log(f"  {by_id[i].name:<6} job {j:<6} {line}")
                shown[i] = line
                st["points"][i]["state"] = job.state
                _save_state(out, st)
            if not job.active:
                final[i] = job
        if len(final) == len(jobs):
            return final
        time.sleep(min(POLL_MAX_S, poll_s + (time.monotonic() - t0) / 30))
