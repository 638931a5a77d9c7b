"""Every environment variable pilab reads, in one registry: what it does, its default, what reads it.

The manual's environment reference is generated from ``VARS`` at build time, with the files that read
each variable found in the source (docs/_ext/envscan.py); tests/test_reference.py fails when the code
(pilab/, profiles/, scripts/, lab.sh) reads a variable that is not here, or when one here is read
nowhere. Reading a new variable is two edits: the code that reads it, and its ``Var`` below::

    from pilab.envvars import VARS, var
    var("PILAB_CACHE").default          # '~/.cache/pilab'
    [v.name for v in VARS if v.group == "yours"]
"""
from __future__ import annotations

from dataclasses import dataclass

GROUPS = {
    "yours": "Settings of pilab (all optional)",
    "setup": "Settings of ./lab.sh setup",
    "honoured": "Other tools' variables pilab honours",
    "launcher": "Set by mpiexec or Slurm: pilab reads them to know it is a rank, and where",
    "internal": "Set by pilab for its own processes",
    "developer": "Tests, benchmarks and developer scripts",
}


@dataclass(frozen=True)
class Var:
    name: str
    group: str  # a key of GROUPS
    default: str  # in words: what happens when it is unset
    what: str  # what it does


VARS = (
    # --- yours ---
    Var("PILAB_MPIEXEC", "yours", "the mpiexec beside this Python, then the first on PATH",
        "the mpiexec that starts ranks (`train --np`, `scale`, `doctor`, `perfmodel bench`, the ipyparallel "
        "profiles); `--mpiexec` overrides it"),
    Var("PILAB_HOSTFILE", "yours", "profiles/profile_pi/hosts",
        "the hostfile (`host:slots` lines) of the Pi profile, of `doctor` without `--hostfile`, and of the "
        "notebooks' studies: set on a cluster's head node, their process counts run on its hosts"),
    Var("PILAB_LAUNCHER", "yours", "slurm inside a Slurm allocation",
        "`hostfile`: inside a Slurm allocation, start ranks with mpiexec and a hostfile instead of "
        "through Slurm (srun)"),
    Var("PILAB_HANG_S", "yours", "120",
        "seconds without a step on any rank before the watchdog ends the job, naming the stuck rank "
        "(0: never); `train --hang-s` overrides it"),
    Var("PILAB_CACHE", "yours", "~/.cache/pilab",
        "where decoded data sets (and `pilab data fetch`'s download) are kept"),
    Var("PILAB_ALLOCATOR", "yours", "chosen per run: fast where the ranks fit the node's memory, else lean",
        "`fast` or `lean`: the glibc malloc setting of every rank (lean: the lowest peak memory)"),
    Var("PILAB_CONTROLLER_IP", "yours", "the address that routes to the first host (or this host's LAN "
        "address)", "the head node's address on the cluster's network, the one the ipyparallel controller "
        "and the doctor's listener bind and advertise"),
    Var("PILAB_PROFILES", "yours", "profiles/ of this repository, then of the working directory and above",
        "a directory searched first for the ipyparallel profiles (profile_<name>)"),
    Var("PILAB_SLURM_PARTITION", "yours", "Slurm's default partition",
        "the Slurm profile's partition for its engines' job"),
    Var("PILAB_SLURM_TIME", "yours", "the partition's limit", "the Slurm profile's job time limit (HH:MM:SS)"),
    Var("PILAB_SLURM_PER_NODE", "yours", "2 (a Pi 4B's ranks)", "the Slurm profile's engines per node"),
    Var("PILAB_SLURM_OPTIONS", "yours", "none", "more #SBATCH options for the Slurm profile's job, e.g. "
        "`--account=myproject`"),
    Var("PILAB_TESTBED_DIR", "yours", "/run", "the directory under which `pilab testbed` keeps its state "
        "(<dir>/<name>-testbed; root's alone, checked on every use)"),
    Var("PILAB_NB_SMALL", "yours", "small under CI (CI=true) and in kernels pytest started, else full size",
        "1: the notebooks and their studies use tiny settings (minutes on one core); 0: full size"),
    Var("PILAB_NB_LIVE_EPOCHS", "yours", "the notebook's own (4 small, 5 full)",
        "epochs of the notebooks' live training run"),
    # --- ./lab.sh setup ---
    Var("PILAB_PYTHON", "setup", "python3", "the Python 3.11+ that makes the virtual environment"),
    Var("PILAB_VENV", "setup", ".venv beside lab.sh", "where ./lab.sh makes and uses the virtual environment"),
    Var("PILAB_SYSTEM_MPI", "setup", "0: pip's MPICH", "1: use the system's MPI and its mpi4py instead of "
        "pip's MPICH"),
    Var("PILAB_TORCH", "setup", "torch==2.13.0 (CPU build)", "the torch requirement ./lab.sh installs"),
    # --- other tools' ---
    Var("HYDRA_HOST_FILE", "honoured", "none", "MPICH's hostfile: `doctor`'s hosts when no --hostfile is given "
        "(pilab drops it for a Slurm launch, where it would replace the allocation)"),
    Var("HYDRA_IFACE", "honoured", "none", "MPICH's network interface; dropped on a node that lacks it, "
        "reported by `doctor`"),
    Var("HYDRA_LAUNCHER", "honoured", "ssh", "MPICH's launcher, as `doctor` reports it"),
    Var("HYDRA_LAUNCHER_EXEC", "honoured", "none", "MPICH's launcher program, as `doctor` reports it"),
    Var("UCX_NET_DEVICES", "honoured", "none", "UCX's network devices, as `doctor` reports them"),
    Var("MALLOC_MMAP_THRESHOLD_", "honoured", "unset", "glibc's malloc setting: when set (or "
        "MALLOC_TRIM_THRESHOLD_), pilab leaves malloc as you set it"),
    Var("MALLOC_TRIM_THRESHOLD_", "honoured", "unset", "as MALLOC_MMAP_THRESHOLD_"),
    Var("LOADEDMODULES", "honoured", "none", "environment modules loaded now: a Slurm job's script loads "
        "the same"),
    Var("SUDO_USER", "honoured", "unset (root itself ran it)", "set by sudo: `sudo pilab testbed up` runs "
        "every job on the nodes as that user (`--user` overrides it)"),
    Var("CI", "honoured", "unset", "`true`: the notebooks' small mode unless PILAB_NB_SMALL says otherwise"),
    Var("PYTEST_CURRENT_TEST", "honoured", "unset", "set by pytest: the notebooks' small mode in kernels "
        "it started"),
    # --- set by the launcher ---
    *(Var(name, "launcher", "unset outside a rank", what) for name, what in (
        ("PMI_SIZE", "MPICH: the job's ranks"), ("PMI_RANK", "MPICH: this rank"),
        ("PMIX_SIZE", "PMIx: the job's ranks"), ("PMIX_RANK", "PMIx: this rank"),
        ("OMPI_COMM_WORLD_SIZE", "Open MPI: the job's ranks"), ("OMPI_COMM_WORLD_RANK", "Open MPI: this rank"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI: ranks on this node"),
        ("MPI_LOCALNRANKS", "MPICH: ranks on this node"),
        ("SLURM_STEP_NUM_TASKS", "Slurm: a job step's ranks"), ("SLURM_PROCID", "Slurm: this rank"))),
    *(Var(name, "launcher", "unset outside an allocation", what) for name, what in (
        ("SLURM_JOB_ID", "Slurm: inside an allocation (salloc, sbatch)"),
        ("SLURM_JOB_NODELIST", "Slurm: the allocation's nodes"),
        ("SLURM_TASKS_PER_NODE", "Slurm: the allocation's tasks per node"),
        ("SLURM_JOB_CPUS_PER_NODE", "Slurm: CPUs per node, where no task count was asked"))),
    # --- pilab's own ---
    Var("PILAB_MEMORY_CHECKED", "internal", "unset", "set by `train --np` for its ranks: the memory warning "
        "was given before launch"),
    Var("PILAB_DOCTOR_SECRET", "internal", "unset", "set by `doctor` for its probes: the secret the head's "
        "listener answers (docs/security.md)"),
    # --- developers ---
    Var("PILAB_CIFAR_ARCHIVE", "developer", "../shared/data/cifar10-jpeg.tar.gz beside the repository",
        "the real CIFAR-10 JPEG archive the benchmarks and developer scripts read"),
    Var("MPIR_CVAR_ASYNC_PROGRESS", "developer", "0", "MPICH's progress thread: the gradient-sync benchmark "
        "runs its second set of contenders under it"),
    Var("MALLOC_ARENA_MAX", "developer", "unset", "recorded in the memory benchmark's JSON"),
    Var("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "developer", "unset", "recorded in the memory benchmark's JSON"),
)

_BY_NAME = {v.name: v for v in VARS}


def var(name: str) -> Var:
    """The registry's entry for ``name`` (KeyError: pilab does not read it)."""
    return _BY_NAME[name]
