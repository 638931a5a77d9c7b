"""Slurm's commands as a batch study uses them: a job script, ``sbatch``, the queue, ``scancel``::

    from pilab.launch import slurm
    slurm.require_commands()                              # SlurmError naming the fix if sbatch/squeue are missing
    slurm.partition("pi")                                 # {"nodes": 4, "cpus_per_node": 2, "cpus": 8}
    slurm.time_seconds("00:10:00")                        # 600 (every sbatch --time format)
    text = slurm.job_script(["python", "-m", "pilab", "train", "--np", "4"], name="pilab-np4",
                            partition="pi", time="10", nodes=2, ntasks=4, ntasks_per_node=2, log="np4/slurm-%j.log")
    job = slurm.submit("np4/job.sbatch")                  # "17"
    slurm.states(["17"])                                  # {"17": Job("17", "RUNNING", "node[01-02]", "None")}
    slurm.cancel(["17"])

Where a job's state comes from: ``squeue -u $USER --states=all`` (the controller's memory: pending, running, and
ended jobs for ``MinJobAge`` seconds), then ``scontrol show job``, then ``sacct`` where accounting is
configured (the testbed has none: ``AccountingStorageType=accounting_storage/none``). A job none of them
knows any more is "UNKNOWN"; the caller then reads the job's own files. Loads nothing of pilab's.
"""
from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["SlurmError", "Job", "require_commands", "partition", "time_seconds", "job_script", "check_path",
           "literal", "activation",
           "submit", "states", "cancel", "ACTIVE", "ENDED_OK"]

COMMANDS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol")
# states in which a job may still run (wait for it); every other state is final
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
          "SIGNALING", "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED")
ENDED_OK = "COMPLETED"


class SlurmError(ValueError):
    """Slurm missing, a partition it does not know, a time it cannot read, sbatch refusing a job: the
    message names the fix (the CLI: one line, exit 2)."""


@dataclass(frozen=True)
class Job:
    id: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ... or UNKNOWN
    nodes: str = ""  # Slurm's compressed node list, where it runs or ran
    reason: str = ""  # why it waits (Resources, Priority) or what ended it
    source: str = ""  # squeue, scontrol or sacct

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


def require_commands() -> None:
    """SlurmError unless Slurm's client commands are on PATH."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise SlurmError(f"--launcher slurm needs Slurm's commands, and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not on PATH; load Slurm's module "
                         "(module load slurm) or install slurm-client, or use --launcher mpiexec")


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def partition(name: str) -> dict:
    """``{"nodes", "cpus_per_node" (the smallest node's), "cpus" (all of them)}`` of partition ``name``;
    SlurmError if ``sinfo -h -p NAME`` lists nothing."""
    p = _run(["sinfo", "-h", "-N", "-p", name, "-o", "%N %c"])
    cpus = {}
    for line in p.stdout.splitlines():
        node, _, c = line.strip().partition(" ")
        if c.strip().isdigit():
            cpus[node] = int(c)
    if not cpus:
        known = _run(["sinfo", "-h", "-o", "%R"]).stdout.split()
        raise SlurmError(f"--partition {name}: Slurm knows no such partition (sinfo -h -p {name} lists "
                         f"nothing); give one of {', '.join(sorted(set(known))) or 'the partitions sinfo lists'}")
    return {"nodes": len(cpus), "cpus_per_node": min(cpus.values()), "cpus": sum(cpus.values())}


def time_seconds(text: str) -> int:
    """An ``sbatch --time`` in seconds: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``."""
    t = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m or t in ("0",):
        raise SlurmError(f"--time {text!r} is not a Slurm time limit; give minutes (30), H:M:S (01:30:00) "
                         "or D-H:M:S")
    d, a, b, c = m.groups()
    if d is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return ((int(d) * 24 + h) * 60 + mi) * 60 + s
    if c is not None:
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:
        return int(a) * 60 + int(b)
    return int(a) * 60


def activation() -> list[str]:
    """The shell lines that give a job this process's software: the environment modules loaded now
    (``LOADEDMODULES``) and this Python's venv. The job runs ``sys.executable`` by its full path
    either way; the lines make the rest (mpiexec, srun's environment) the same as here."""
    lines = []
    mods = [m for m in os.environ.get("LOADEDMODULES", "").split(":") if m]
    if mods:
        lines.append("module load " + " ".join(shlex.quote(m) for m in mods))
    act = os.path.join(sys.prefix, "bin", "activate")
    if sys.prefix != sys.base_prefix and os.path.isfile(act):
        lines.append(f". {shlex.quote(act)}")
    return lines


def check_path(path: str, what: str) -> str:
    """``path`` if a batch script can carry it (sbatch reads ``#SBATCH`` values with quotes and backslash
    escapes of its own, a line break would end the line), else SlurmError naming ``what`` it is::

        check_path("runs/a b%c", "--out")      # fine: quoted, and % kept literal (:func:`literal`)
    """
    bad = next((c for c in path if c in "\\" or not c.isprintable()), None)
    if bad is not None:
        raise SlurmError(f"{what} {path!r} has a {'backslash' if bad == chr(92) else 'control character'}, "
                         "which a batch script cannot carry; use a path without it")
    return path


def literal(path: str) -> str:
    """``path`` in an ``#SBATCH --output`` file name pattern, standing for itself: ``%`` doubled (Slurm reads
    ``%j``, ``%x``, ... as the job id, name and so on)::

        os.path.join(literal("runs/50%"), "slurm-%j.log")   # "runs/50%%/slurm-%j.log"
    """
    return path.replace("%", "%%")


def _sbatch(option: str, value: str) -> str:
    """One ``#SBATCH --option=value`` line, the value quoted as sbatch reads it (quotes, no shell)."""
    return f"#SBATCH --{option}={shlex.quote(check_path(value, '--' + option))}"


def job_script(command: list[str], *, name: str, partition: str, time: str, nodes: int, ntasks: int,
               ntasks_per_node: int, log: str, chdir: str | None = None, cpus_per_task: int = 1,
               options: list[str] = (), comment: str = "") -> str:
    """A plain batch script: ``#SBATCH`` lines, the software (:func:`activation`), then ``command``.
    Every path is quoted (``log`` is a file name pattern: :func:`literal` for a path with ``%``); one a
    script cannot carry is a SlurmError."""
    for text, what in ((comment, "the comment"), (name, "--job-name"), *((c, "the command") for c in command),
                       *((o, "an #SBATCH option") for o in options)):
        check_path(text, what)
    lines = ["#!/bin/bash", *([f"# {comment}"] if comment else []),
             _sbatch("job-name", name), _sbatch("partition", partition), _sbatch("time", time),
             f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks={ntasks}",
             f"#SBATCH --ntasks-per-node={ntasks_per_node}",
             *([f"#SBATCH --cpus-per-task={cpus_per_task}"] if cpus_per_task > 1 else []),
             _sbatch("output", log), *([_sbatch("chdir", chdir)] if chdir else []),
             *(f"#SBATCH {o}" for o in options), *activation(),
             # exec: the job's exit code is the training's, and scancel's signal reaches it directly
             "exec " + shlex.join(command)]
    return "\n".join(lines) + "\n"


def submit(script: str) -> str:
    """``sbatch --parsable SCRIPT``; the job id. SlurmError with sbatch's own words if it refuses."""
    p = _run(["sbatch", "--parsable", script], timeout=60)
    job = p.stdout.strip().split(";")[0]
    if p.returncode != 0 or not job.isdigit():
        said = (p.stderr.strip() or p.stdout.strip()).splitlines()
        raise SlurmError(f"sbatch refused {script}: {said[-1] if said else f'exit {p.returncode}'}")
    return job


def states(ids) -> dict[str, Job]:
    """Each job id's :class:`Job`, from squeue, else scontrol, else sacct; "UNKNOWN" where none knows it."""
    ids = [str(i) for i in ids]
    found: dict[str, Job] = {}
    # this user's jobs only (a shared cluster's queue can be long); every state, ended ones included
    p = _run(["squeue", "-h", "-u", pwd.getpwuid(os.getuid()).pw_name, "--states=all", "-o", "%i|%T|%N|%r"])
    for line in p.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] in ids:
            found[parts[0]] = Job(parts[0], parts[1], parts[2], parts[3], "squeue")
    for j in (j for j in ids if j not in found):
        p = _run(["scontrol", "-o", "show", "job", j])
        fields = dict(kv.split("=", 1) for kv in p.stdout.split() if "=" in kv)
        if p.returncode == 0 and fields.get("JobState"):
            found[j] = Job(j, fields["JobState"], fields.get("NodeList", "").replace("(null)", ""),
                           fields.get("Reason", ""), "scontrol")
    rest = [j for j in ids if j not in found]
    if rest and shutil.which("sacct"):
        p = _run(["sacct", "-n", "-X", "-P", "-j", ",".join(rest), "-o", "JobID,State,NodeList"])
        for line in p.stdout.splitlines() if p.returncode == 0 else []:
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0] in rest:
                found[parts[0]] = Job(parts[0], parts[1].split()[0], parts[2], "", "sacct")
    return {j: found.get(j, Job(j, "UNKNOWN")) for j in ids}


def cancel(ids) -> None:
    """``scancel`` the jobs (ids Slurm no longer knows are fine)."""
    ids = [str(i) for i in ids]
    if ids:
        _run(["scancel", *ids])
