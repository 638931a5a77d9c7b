# ipyparallel profile: N engines that are the MPI ranks of one `mpiexec` on this machine.
#
#   ipcluster start -n 4 --profile-dir profiles/profile_mpi        # from a shell, or from Python:
#   from pilab.lab import cluster; lab = cluster.start(n=4)             # uses this profile
#
# Each engine is one MPI rank (mpi4py's COMM_WORLD spans the engines), so `%%px` cells can call
# collectives. Engine ids are registration order, not ranks: pilab.lab.cluster maps them to ranks.
c = get_config()  # noqa: F821  (provided by traitlets when it loads this file)

from pilab.launch import find_mpiexec  # noqa: E402

c.Cluster.engine_launcher_class = "mpi"
c.Cluster.n = 2  # engines (= MPI ranks) when none are asked for; `ipcluster start -n N` / start(n=N)
# The absolute path, found now (at start): a notebook kernel's PATH often lacks the venv's bin, and
# the mpiexec that belongs to this Python's mpi4py is the one next to sys.executable.
c.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
# Localhost only: nothing outside this machine needs to reach the controller.
c.Cluster.controller_ip = "127.0.0.1"
# Torch on a busy laptop can take a while to import; do not give up on engines too early.
c.Cluster.engine_timeout = 120
c.IPEngine.timeout = 30  # seconds an engine waits for the controller to answer its registration
