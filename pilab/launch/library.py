"""The MPI behind ``mpiexec``: which library it belongs to, and whether mpi4py's is of the same family."""
from __future__ import annotations

import subprocess


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


def _family(text: str) -> str:
    t = text.lower()
    if "open mpi" in t:
        return "openmpi"
    for name in ("mvapich", "intel", "mpich"):  # MVAPICH and Intel MPI say MPICH too
        if name in t:
            return name
    return t.split()[0] if t.split() else "?"


def same_family(library: str, launcher: str) -> bool:
    """True when mpi4py's library and mpiexec come from the same MPI (MPICH/Hydra, Open MPI, …)."""
    return _family(library) == _family(launcher)
