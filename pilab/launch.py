"""Finding ``mpiexec`` and building the command lines that start pilab's ranks.

One place for the launcher, used by the CLI (``train --np``), the study (measured points), the
performance model's micro-benchmark, the cluster helper and the benchmarks::

    from pilab import launch
    cmd = launch.pilab_command(2, ["train", "--epochs", "1"])   # [.../mpiexec, -n, 2, python, -m, pilab, ...]
    subprocess.run(cmd, check=True)
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Sequence

__all__ = ["LaunchError", "find_mpiexec", "mpiexec_command", "pilab_command", "launcher_size",
           "launcher_rank", "under_mpi", "mpi", "mpi_library", "mpi_versions"]

MPI_HINT = "`pip install 'pilab[mpich]'` (or the system's MPICH: apt-get install mpich)"


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
    """``mpiexec [-f hostfile] [extra…] -n np program…`` with the launcher resolved."""
    if np_ < 1:
        raise LaunchError(f"np={np_} must be >= 1")
    cmd = [find_mpiexec(mpiexec)]
    if hostfile:
        cmd += ["-f", hostfile]
    return [*cmd, *extra, "-n", str(np_), *program]


def pilab_command(np_: int, args: Sequence[str], **kwargs) -> list[str]:
    """``mpiexec … -n np <this python> -m pilab args…`` (keywords as for ``mpiexec_command``)."""
    return mpiexec_command(np_, [sys.executable, "-m", "pilab", *args], **kwargs)


# MPICH/Hydra, PMIx, Open MPI, Slurm's srun
_SIZE_VARS = ("PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS")
_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_size() -> int:
    """World size announced by a launcher's environment (0 when not started by mpiexec).

    Read from the environment so that asking does not load an MPI library."""
    for var in _SIZE_VARS:
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
    """The ``mpi4py.MPI`` module: the one place pilab imports mpi4py (``pilab.dist`` aside, which
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

