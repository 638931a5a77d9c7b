"""Launching: finding ``mpiexec`` and starting a job of pilab's ranks (``mpiexec``), the hosts and slots a
cluster gives and where the ranks will land (``hosts``), Slurm's commands (``slurm``), which MPI library a
launcher belongs to (``mpiexec``). Nothing here imports torch or MPI::

    from pilab.launch import find_mpiexec, run_job
    res = run_job(2, "pilab.engine.harness", {"config": cfg.to_dict()})   # rank 0's answer
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "hosts": ["HostsError", "allocation", "check_host", "parse_hosts", "placement_checks", "ranks_on", "machines",
              "read_hostfile", "total_slots"],
    "mpiexec": ["MPI_HINT", "JobError", "LaunchError", "find_mpiexec", "job_argv", "launcher_local_size",
               "launcher_rank", "launcher_size", "mpi", "mpi_library", "mpi_versions", "mpiexec_command",
               "pilab_command", "run_job", "srun_command", "under_mpi", "use_srun", "mpi_family", "mpiexec_library",
               "same_family"],
})
