"""A Pi cluster on one Linux machine: N network namespaces ("nodes") on a bridge, real TCP between them.

Each node is a network namespace with one veth link to a bridge in the root namespace, an address from
one private range the testbed owns, rate shaping on its link in both directions (default 1 GbE, as on
the Raspberry Pi 4B), and -- for every process started on it -- its own hostname (UTS namespace), its
own ``/dev/shm`` (mount namespace) and its own pid namespace, as on a separate board. The pid namespace
is what makes the shim as tidy as ssh: when mpiexec ends (normally, after a failed launch, or killed)
the proxy it started dies, and with the proxy every process of that job on the node (see ``SHIM``).
Hydra reaches the nodes the way it reaches real hosts: ``mpiexec -launcher ssh -launcher-exec SHIM``
calls ``SHIM -x HOST command…``, and the shim runs the command in that host's namespaces instead of
over ssh::

    sudo python -m pilab testbed up --nodes 4 --slots 2 --rate 1gbit
    eval "$(sudo python -m pilab testbed env)"          # HYDRA_* and UCX_* for mpiexec
    python -m pilab scale --nps 2,4,8 --hostfile /run/pilab-testbed/hosts
    sudo python -m pilab testbed down                    # also after a crash

    from pilab import testbed
    tb = testbed.up(testbed.Testbed(nodes=2, slots=2))   # idempotent; needs root, ip and tc
    cmd = launch.pilab_command(4, ["train"], hostfile=tb.hostfile, extra=tb.mpiexec_args())
    subprocess.run(cmd, env=tb.env())
    testbed.down(tb.name)

Where the bytes go (verified with the veths' byte counters, see ``traffic`` and docs/perfmodel.md):
MPICH's ch4 device moves messages between ranks of one node through its own POSIX shared memory
(ranks are on one node when one Hydra proxy, i.e. one host of the hostfile, started them), and
between nodes through its network module. pip's MPICH uses UCX there, and UCX would itself pick a
shared-memory transport (``posix``/``cma``: one kernel, one pid namespace) between namespaces of one
machine, so nothing would cross the shaped link. ``env()`` therefore sets ``UCX_TLS=tcp,self`` and
``UCX_NET_DEVICES=eth0``: shared memory inside a node (MPICH's), TCP over the node's link between nodes.

Slurm on the testbed (``up --slurm``: munged, slurmctld on a head namespace, a slurmd per node) is
:mod:`pilab.testbed.slurmd`.

The package by concern: ``nodes`` (what a testbed is, its namespaces, veths and bridge), ``make`` (up,
down, status), ``shim`` (the files Hydra uses; cgroup file systems and overlays inside a node),
``cgroups`` (a node's processes, CPU quota and memory limit; its link: down, shaped, its traffic),
``slurmd``, ``lock`` (one job that makes testbeds at a time on the machine: ``exclusive``).

Everything the testbed makes carries its name as a prefix (namespaces ``<name>-node01…``, links
``<name>-br`` and ``<name>-n01…``, the state directory ``/run/<name>-testbed``), so ``down`` finds and
removes all of it even when the process that made it crashed. Traffic never leaves this machine: the
namespaces have no default route and no NAT, and ``up`` refuses a range that overlaps any route or
address already configured here.
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "cgroups": ["link", "shape", "throttle", "quota", "cpu_quota", "limit_memory", "traffic", "traffic_delta",
               "processes", "ps"],
    "lock": ["exclusive", "holder", "LOCK_PATH"],
    "make": ["up", "down", "status"],
    "nodes": ["Testbed", "TestbedError", "load", "available", "parse_rate", "burst_bytes", "check_range", "state_dir",
             "state_problem", "check_state_dir", "FIRST_HOST", "NODE_IFACE", "DEFAULT_SUBNET", "DEFAULT_RATE",
             "DEFAULT_NAME", "link_names", "netns_list", "routes_and_addresses"],
    "shim": ["overlay", "clear_overlays", "job_access"],
})
