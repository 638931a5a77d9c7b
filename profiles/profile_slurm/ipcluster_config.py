# ipyparallel profile: engines are the MPI ranks of one job in a Slurm allocation, registering with a
# controller on the login/head node (where JupyterLab runs).
#
#   from pilab.lab import cluster; lab = cluster.start(profile="slurm", n=8)     # from a notebook
#   ipcluster start --profile-dir profiles/profile_slurm -n 8                     # from a shell
#
# ipyparallel's Slurm launcher submits the batch script below (sbatch); inside its allocation MPICH's
# mpiexec starts the engines through Slurm (`-launcher slurm`: one srun step, one proxy per node), so
# the engines are ranks 0..n-1 of one MPI job, nodes filled in order (pilab.launch.hosts.place), and
# cluster.start returns them in rank order as with the other profiles.
#
# Settings read from the environment (all optional):
#   PILAB_CONTROLLER_IP=addr     the head's address on the compute nodes' network, bound and advertised
#                                (default: this host's LAN address, for both). Never 127.0.0.1: engines on
#                                other nodes could not reach it, and would not say so.
#   PILAB_SLURM_PARTITION=name   the partition (default: Slurm's default partition)
#   PILAB_SLURM_TIME=HH:MM:SS    the job's time limit (default: the partition's)
#   PILAB_SLURM_PER_NODE=k       engines per node (default: 2, the Pi 4B's)
#   PILAB_SLURM_OPTIONS="..."    more #SBATCH options, e.g. "--account=myproject"
import os
import shlex
import shutil

from pilab.lab.cluster import lan_address
from pilab.launch import find_mpiexec

c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)

per_node = int(os.environ.get("PILAB_SLURM_PER_NODE", "2"))
srun = shutil.which("srun") or "srun"
extra = "\n".join(f"#SBATCH {o}" for o in os.environ.get("PILAB_SLURM_OPTIONS", "").split() if o)


def _word(path: str) -> str:
    """``path`` as one shell word in the template below (quoted; braces doubled, since ipyparallel fills the
    template with str.format)."""
    return shlex.quote(path).replace("{", "{{").replace("}", "}}")

c.Cluster.engine_launcher_class = "slurm"
# A plain script the user can read in the profile's log directory; {n}, {cluster_id} and
# {program_and_args} are filled in by ipyparallel. A HYDRA_IFACE of the submitting host (the testbed's
# bridge) does not exist on a compute node: dropped there. HYDRA_HOST_FILE would replace the allocation.
c.SlurmEngineSetLauncher.batch_template = f"""#!/bin/sh
#SBATCH --job-name=pilab-engines-{{cluster_id}}
#SBATCH --ntasks={{n}}
#SBATCH --ntasks-per-node={per_node}
#SBATCH --export=ALL
{extra}
unset HYDRA_HOST_FILE
[ -z "$HYDRA_IFACE" ] || [ -e "/sys/class/net/$HYDRA_IFACE" ] || unset HYDRA_IFACE
exec {_word(find_mpiexec())} -launcher slurm -launcher-exec {_word(srun)} -n {{n}} {{program_and_args}}
"""
if os.environ.get("PILAB_SLURM_PARTITION"):
    c.SlurmEngineSetLauncher.queue = os.environ["PILAB_SLURM_PARTITION"]
if os.environ.get("PILAB_SLURM_TIME"):
    c.SlurmEngineSetLauncher.timelimit = os.environ["PILAB_SLURM_TIME"]

# The controller listens on the address it advertises, the head's on the compute nodes' network, and
# nowhere else; its traffic is encrypted (CurveZMQ, ipcontroller_config.py beside this file).
addr = os.environ.get("PILAB_CONTROLLER_IP", "") or lan_address()
c.Cluster.controller_ip = addr
c.Cluster.controller_location = addr

c.Cluster.engine_timeout = 300  # a queued job: the client waits this long for all engines to register
c.Cluster.delay = 2.0
