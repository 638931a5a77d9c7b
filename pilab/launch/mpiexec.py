"""Finding ``mpiexec``, building the command lines that start pilab's ranks, and running a job.

One place for the launcher, used by the CLI (``train --np``), the study (measured points), the
performance model's micro-benchmark, the cluster helper and the benchmarks::

    from pilab import launch
    cmd = launch.pilab_command(2, ["train", "--epochs", "1"])   # [.../mpiexec, -n, 2, python, -m, pilab, ...]
    res = launch.run_job(2, "pilab.bench.mpijobs", {"quick": True})   # rank 0's answer, a dict

Library code launches rank-side entry modules through :func:`run_job`, never the CLI. Loads neither
torch nor MPI (the CLI's ``--help`` imports it).

The MPI behind ``mpiexec``: which library it belongs to, and whether mpi4py's is of the same family.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Mapping, Sequence

__all__ = ["LaunchError", "find_mpiexec", "mpiexec_command", "pilab_command", "launcher_size",
           "launcher_rank", "under_mpi", "mpi", "mpi_library", "mpi_versions", "run_job", "job_argv", "JobError"]

# pilab is not on PyPI, so `pip install 'pilab[mpich]'` would find nothing: name what installs
MPI_HINT = "`pip install mpich` (pip's MPICH, the `mpich` extra of a pilab clone) or the system's MPICH (apt-get install mpich)"


class LaunchError(ValueError):
    """No usable launcher, or a launcher that cannot start these ranks. The message names the fix."""


def find_mpiexec(explicit: str | None = None) -> str:
    """Absolute path of the ``mpiexec`` that belongs to this Python's mpi4py.

    ``explicit`` (e.g. ``--mpiexec``) if given, else ``$PILAB_MPIEXEC``, else the one beside
    ``sys.executable`` (a venv with pip's MPICH), else the first on ``PATH``. A notebook kernel's PATH
    often lacks the venv's ``bin``, hence beside-Python before PATH.
    """
    chosen = explicit or os.environ.get("PILAB_MPIEXEC")
    if chosen:
        where = "--mpiexec" if explicit else "PILAB_MPIEXEC"
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise LaunchError(f"{where}={chosen} is not an executable file; give the path of mpiexec")
        return os.path.abspath(chosen)
    for name in ("mpiexec", "mpiexec.hydra", "mpirun"):
        beside = os.path.join(os.path.dirname(sys.executable), name)
        if os.access(beside, os.X_OK):
            return beside
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return os.path.abspath(found)
    raise LaunchError(f"no mpiexec found beside this Python or on PATH; install one with {MPI_HINT}, "
                      "or pass --mpiexec PATH / set PILAB_MPIEXEC")


def mpiexec_command(np_: int, program: Sequence[str], *, mpiexec: str | None = None,
                    hostfile: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``mpiexec [-f hostfile] [extra…] -n np program…`` with the launcher resolved; inside a Slurm
    allocation (and no hostfile, ``mpiexec`` or ``extra`` given) :func:`srun_command` instead."""
    if np_ < 1:
        raise LaunchError(f"np={np_} must be >= 1")
    if use_srun(mpiexec=mpiexec, hostfile=hostfile, extra=extra):
        return srun_command(np_, program, mpiexec=mpiexec)
    cmd = [find_mpiexec(mpiexec)]
    if hostfile:
        from .hosts import HostsError, read_hostfile
        try:  # every host a plain name or address before Hydra hands it to ssh (pilab.launch.hosts.check_host)
            read_hostfile(hostfile)
        except HostsError as e:
            raise LaunchError(str(e)) from None
        cmd += ["-f", hostfile]
    return [*cmd, *extra, "-n", str(np_), *program]


def use_srun(*, mpiexec: str | None = None, hostfile: str | None = None, extra: Sequence[str] = ()) -> bool:
    """Inside a Slurm allocation the ranks go through Slurm (:func:`srun_command`) unless a hostfile or
    launcher flags were asked for, or ``PILAB_LAUNCHER=hostfile``."""
    from .hosts import in_allocation
    return (in_allocation() and not (hostfile or extra)
            and os.environ.get("PILAB_LAUNCHER", "slurm") != "hostfile")


def srun_command(np_: int, program: Sequence[str], *, mpiexec: str | None = None) -> list[str]:
    """Inside an allocation: ``env -u HYDRA_HOST_FILE mpiexec -launcher slurm -launcher-exec SRUN -n np
    program…``. Hydra asks Slurm for the nodes and tasks per node (``SLURM_JOB_NODELIST``,
    ``SLURM_TASKS_PER_NODE``) and starts one proxy per node with ``srun``: nodes filled in order, each up to
    its tasks, as with the allocation written out as a hostfile (:func:`pilab.launch.hosts.place`). A
    ``HYDRA_HOST_FILE`` left in the environment (the testbed's ``env``) would take precedence, hence
    ``env -u``; so does a ``HYDRA_IFACE`` this host lacks (an sbatch script gets the submitter's). (``srun --mpi=pmi2`` alone starts small MPICH programs, but Slurm 22.05's PMI-2 server
    rejects the address exchange of pilab's ranks under MPICH 5: "value not properly terminated".)"""
    from .hosts import HostsError, allocation, place
    srun = shutil.which("srun")
    if srun is None:
        raise LaunchError("inside a Slurm allocation but no srun on PATH; load Slurm's module (or add "
                          "its bin directory to PATH), or set PILAB_LAUNCHER=hostfile and give a hostfile")
    try:  # enough tasks in the allocation, else a clear error before anything starts
        place(allocation(), np_)
    except HostsError as e:
        raise LaunchError(str(e)) from None
    unset = ["-u", "HYDRA_HOST_FILE"]
    iface = os.environ.get("HYDRA_IFACE")
    if iface and not os.path.exists(f"/sys/class/net/{iface}"):
        unset += ["-u", "HYDRA_IFACE"]  # the head's interface, seen from a batch script on a node
    return ["env", *unset, find_mpiexec(mpiexec), "-launcher", "slurm", "-launcher-exec", srun,
            "-n", str(np_), *program]


def pilab_command(np_: int, args: Sequence[str], **kwargs) -> list[str]:
    """``mpiexec … -n np <this python> -m pilab args…`` (keywords as for ``mpiexec_command``)."""
    return mpiexec_command(np_, [sys.executable, "-m", "pilab", *args], **kwargs)


# MPICH/Hydra, PMIx, Open MPI, Slurm's srun (a job step's: an salloc shell or an sbatch script also has
# SLURM_NTASKS and SLURM_PROCID, but is no rank -- only a step has SLURM_STEP_ID)
_SIZE_VARS = ("PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS")
_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def launcher_size() -> int:
    """World size announced by a launcher's environment (0 when not started by mpiexec).

    Read from the environment so that asking does not load an MPI library."""
    for var in _SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def launcher_local_size() -> int:
    """The ranks on this node as the launcher's environment says (0 when not under mpiexec)."""
    for var in _LOCAL_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def launcher_rank() -> int:
    """This process's rank as the launcher's environment says (0 when not under mpiexec)."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def under_mpi() -> bool:
    """True in a rank started by mpiexec (any size, also ``mpiexec -n 1``)."""
    return launcher_size() > 0


def mpi():
    """The ``mpi4py.MPI`` module: the one place pilab imports mpi4py (``pilab.dist.helpers`` aside, which
    holds the communication itself). Only ranks call it -- importing mpi4py initialises MPI, which a
    process that only predicts, plots or launches must not do::

        MPI = launch.mpi()
        comm = MPI.COMM_WORLD

    Raises ``LaunchError`` naming the fix when mpi4py or the MPI library it needs is missing."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:  # RuntimeError: mpi4py cannot load its MPI library
        raise LaunchError(f"mpi4py cannot load an MPI library ({str(e).splitlines()[0]}); install one "
                          f"with {MPI_HINT}") from None
    return MPI


def mpi_library(MPI=None) -> str:
    """The MPI library mpi4py loaded, as one line: "MPICH Version:      5.0.2", "Open MPI v4.1.4, package:
    Debian OpenMPI, …" (the first line of ``MPI.Get_library_version()``).

    ``MPI``: the ``mpi4py.MPI`` module (default: :func:`mpi`, which loads the library). Debian bookworm's
    mpi4py 3.1.4 (python3-mpi4py, Open MPI) ends the string with a NUL byte, which reached result.json
    as "\\u0000" on the emulated Pi (docs/arm64.md); it is dropped here."""
    MPI = MPI if MPI is not None else mpi()
    lines = MPI.Get_library_version().replace("\x00", "").strip().splitlines()
    return lines[0].strip() if lines else ""


def mpi_versions() -> dict:
    """``{"mpi4py": version, "mpi_library": mpi_library()}``: what a result's environment records
    (loads MPI like :func:`mpi`)."""
    MPI = mpi()
    return {"mpi4py": sys.modules["mpi4py"].__version__, "mpi_library": mpi_library(MPI)}


# ----------------------------------------------------------------------------------------------
# jobs: mpiexec, the exit code, rank 0's answer -- written once for every launcher in pilab
# ----------------------------------------------------------------------------------------------
class JobError(RuntimeError):
    """A launched job failed: the message names the job, its exit code and the end of its stderr."""

    def __init__(self, name: str, code: int | None, stderr: str, command: Sequence[str] = ()):
        self.name, self.code, self.stderr, self.command = name, code, stderr, list(command)
        tail = "\n".join((stderr or "").strip().splitlines()[-15:])
        how = "did not finish within its time limit" if code is None else f"failed (exit {code})"
        super().__init__(f"{name} {how}" + (f":\n{tail}" if tail else ""))


def job_argv(payload: Mapping[str, Any] | None) -> list[str]:
    """``{"quick": True, "sizes": [4, 64], "config": {...}}`` -> ``--quick --sizes 4 64 --config '{...}'``:
    True is a bare flag, False and None are left out, a list gives several values, a dict is one JSON
    argument; underscores in names become dashes (what an ``argparse`` entry module reads)."""
    argv: list[str] = []
    for key, value in (payload or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, Mapping):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def run_job(np_: int, module: str, payload: Mapping[str, Any] | None = None, *, name: str | None = None,
            mpiexec: str | None = None, hostfile: str | None = None, extra: Sequence[str] = (),
            env: Mapping[str, str] | None = None, timeout: float | None = None, cwd: str | None = None,
            answer_dir: str | None = None) -> dict:
    """Run ``mpiexec -n np python -m module ANSWER.json <payload as flags>`` and return the JSON its
    rank 0 wrote to ANSWER.json; every rank-side entry module (``pilab.engine.harness``, ``pilab.bench.mpijobs``,
    ``pilab.perfmodel.calibrate`` …) takes that path first and its payload as flags (:func:`job_argv`)::

        res = launch.run_job(2, "pilab.bench.mpijobs", {"quick": True}, env={"OMP_NUM_THREADS": "1"})

    ``env``: the job's whole environment (default: this process's). ``extra``: mpiexec arguments before
    ``-n`` (``-hosts``, ``-ppn`` …). ``answer_dir``: where ANSWER.json goes (a temporary folder is made
    and removed there; default: the system's), a folder rank 0 can write when it runs on another host.
    Raises :class:`JobError` (naming the job, its exit code and its stderr's end) when the job exits
    non-zero, runs past ``timeout`` seconds or leaves no answer; ``LaunchError`` without a launcher.
    Ctrl-C here ends the job (``subprocess.run`` kills mpiexec) and raises KeyboardInterrupt.
    """
    name = name or f"the {module} job (np={np_})"
    if answer_dir:
        os.makedirs(answer_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pilab-job-", dir=answer_dir) as tmp:
        answer = os.path.join(tmp, "answer.json")
        cmd = mpiexec_command(np_, [sys.executable, "-m", module, answer, *job_argv(payload)],
                              mpiexec=mpiexec, hostfile=hostfile, extra=extra)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                               env=dict(env) if env is not None else None)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise JobError(name, None, err, cmd) from None
        if p.returncode != 0:
            raise JobError(name, p.returncode, p.stderr or p.stdout, cmd)
        if not os.path.exists(answer):
            raise JobError(name, 0, (p.stderr or "") + "\n(exit 0, but rank 0 wrote no answer)", cmd)
        with open(answer) as f:
            return json.load(f)


def mpiexec_library(mpiexec: str) -> str:
    """What ``mpiexec --version`` says it belongs to: "MPICH 4.1.2 (Hydra)", "Open MPI 4.1.4", …"""
    try:
        p = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = p.stdout + p.stderr
    if "HYDRA" in text:
        ver = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                    if ln.strip().startswith("Version:")), "?")
        return f"MPICH {ver} (Hydra)"
    first = text.strip().splitlines()[0] if text.strip() else "unknown"
    if "Open MPI" in text or "OpenRTE" in text:
        return "Open MPI " + first.split()[-1]
    return first


def mpi_family(text: str) -> str:
    t = text.lower()
    if "open mpi" in t:
        return "openmpi"
    for name in ("mvapich", "intel", "mpich"):  # MVAPICH and Intel MPI say MPICH too
        if name in t:
            return name
    return t.split()[0] if t.split() else "?"


def same_family(library: str, launcher: str) -> bool:
    """True when mpi4py's library and mpiexec come from the same MPI (MPICH/Hydra, Open MPI, …)."""
    return mpi_family(library) == mpi_family(launcher)
