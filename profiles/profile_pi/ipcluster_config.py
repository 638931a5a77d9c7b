# ipyparallel profile: engines are the MPI ranks of one `mpiexec` spread over the Raspberry Pi cluster
# (24 Pi 4B nodes x 2 ranks), driven from JupyterLab on the head node.
#
#   cp profiles/profile_pi/hosts.template profiles/profile_pi/hosts     # edit names/slots once
#   ipcluster start --profile-dir profiles/profile_pi                   # from a shell, or:
#   from pilab.lab import cluster; lab = cluster.start(profile="pi")         # from a notebook
#
# Settings read from the environment (all optional):
#   PILAB_HOSTFILE=path        hostfile in MPICH's `host:slots` form (default: hosts beside this file)
#   PILAB_CONTROLLER_IP=addr   the head node's LAN address to bind and advertise
#                              (default: the address that routes to the first host in the hostfile,
#                              for both)
#   PILAB_MPIEXEC=path         mpiexec to use (default: the one beside this Python, then PATH)
#
# Every node needs the same venv at the same absolute path as the head node (engines are started as
# this Python's `-m ipyparallel.engine`) and this profile directory at the same path (shared home or
# identical clone). The data set does not need to be on the nodes: see pilab.lab.cluster.scatter_shards.
import os

from pilab.lab.cluster import hostfile_slots, lan_address
from pilab.launch import find_mpiexec

c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)

here = os.path.dirname(os.path.abspath(__file__))
hostfile = os.path.abspath(os.environ.get("PILAB_HOSTFILE") or os.path.join(here, "hosts"))
if not os.path.isfile(hostfile):
    raise FileNotFoundError(
        f"no hostfile at {hostfile}: copy {os.path.join(here, 'hosts.template')} there and edit it, "
        "or set PILAB_HOSTFILE")

c.Cluster.engine_launcher_class = "mpi"
# Absolute path resolved at start: a kernel's PATH may lack the venv's bin.
c.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
# Hydra (MPICH's mpiexec) reads `host:slots` lines and places ranks in order: node 1 gets ranks 0-1,
# node 2 gets 2-3, ... so neighbouring ranks share a board.
c.MPIEngineSetLauncher.mpi_args = ["-f", hostfile]
c.Cluster.n = hostfile_slots(hostfile)

# Engines on other hosts never register with a controller that listens on localhost: listen on the
# cluster's LAN -- the one address engines and clients are told to use, never every interface -- and
# encrypt what travels there (CurveZMQ, ipcontroller_config.py beside this file).
addr = os.environ.get("PILAB_CONTROLLER_IP", "") or lan_address(hostfile)
c.Cluster.controller_ip = addr
c.Cluster.controller_location = addr

# A Pi 4B takes 20-40 s to import torch from an SD card, and 48 of them start at once.
c.Cluster.engine_timeout = 300  # seconds the client waits for all engines to register
c.Cluster.delay = 2.0  # seconds between starting the controller and mpiexec
