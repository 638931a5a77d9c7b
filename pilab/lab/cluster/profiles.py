"""Finding an ipyparallel profile and its hostfile, and starting or attaching to its engines::

    lab = cluster.start(n=4)                   # profiles/profile_mpi: 4 ranks of one mpiexec here
    lab = cluster.start(profile="pi")          # profiles/profile_pi: the hostfile's slots over the LAN
    lab = cluster.connect(profile="pi")        # engines started by `ipcluster start --profile-dir ...`

The profile files (``profiles/profile_*/ipcluster_config.py``) call :func:`hostfile_slots` and
:func:`lan_address` when ipyparallel loads them. ipyparallel itself is imported inside :func:`start` and
:func:`connect`: ranks started by plain ``mpiexec`` import ``pilab.lab.cluster`` (for ``scatter_shards``,
``rank_state``) without its client stack.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import socket
import sys
import time

import psutil  # an ipyparallel dependency

from ...launch import HostsError, read_hostfile
from .client import Engines
from .rank import ClusterError

# The repository root: pilab/lab/cluster/profiles.py is three levels below it.
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def profile_dir(profile: str = "mpi") -> str:
    """Directory of an ipyparallel profile: a name (``"mpi"``, ``"pi"`` -> ``profiles/profile_<name>``
    in this repository, or under ``$PILAB_PROFILES``) or a path to a profile directory."""
    if os.sep in profile or os.path.isdir(profile):
        return os.path.abspath(profile)
    name = f"profile_{profile}"
    roots = [os.environ.get("PILAB_PROFILES", ""), os.path.join(_REPO, "profiles")]
    # A non-editable install has no repository beside the package: look up from the working
    # directory (a notebook runs in notebooks/, next to profiles/).
    here = os.getcwd()
    while True:
        roots.append(os.path.join(here, "profiles"))
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for root in roots:
        if root and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    raise ClusterError(f"no ipyparallel profile {name} (looked in $PILAB_PROFILES, {_REPO}/profiles and "
                       "above the working directory); use profile='mpi' or 'pi', or pass the path of a "
                       "profile directory")


def _hostfile_lines(path: str) -> list[tuple[str, int]]:
    try:
        return read_hostfile(path)
    except HostsError as e:
        raise ClusterError(str(e)) from None


def hostfile_slots(path: str) -> int:
    """Total MPI slots in an MPICH hostfile (``host:slots`` lines, ``#`` comments)::

        hostfile_slots("profiles/profile_pi/hosts.template")   # 48
    """
    return sum(slots for _, slots in _hostfile_lines(path))


def lan_address(hostfile: str | None = None) -> str:
    """This machine's address on the network the cluster nodes are on.

    The address the kernel would send from to reach the first remote host of ``hostfile`` (a UDP
    ``connect`` sends nothing), else the first non-loopback address of this host; ``127.0.0.1`` if
    there is none (then only engines on this machine can register).
    """
    targets = [h for h, _ in _hostfile_lines(hostfile)] if hostfile and os.path.isfile(hostfile) else []
    for host in targets:
        if host in ("localhost", "127.0.0.1", socket.gethostname()):
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                addr = s.getsockname()[0]
            if not addr.startswith("127."):
                return addr
        except OSError:
            continue
    for addr in non_loopback_addresses():
        return addr
    return "127.0.0.1"


def non_loopback_addresses() -> list[str]:
    """IPv4 addresses of this host other than 127.x (from its name, then from its interfaces)."""
    found = []
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.append(info[4][0])
    except OSError:
        pass
    for addrs in psutil.net_if_addrs().values():
        found += [a.address for a in addrs if a.family == socket.AF_INET]
    return list(dict.fromkeys(a for a in found if not a.startswith("127.")))


def start(n: int | None = None, profile: str = "mpi", *, timeout: float | None = None,
          log_level: int | str = "WARNING") -> Engines:
    """Start a controller and ``n`` MPI engines (one ``mpiexec -n n``), wait until all registered,
    and map engine ids to MPI ranks. ``n=None`` takes the profile's count (``mpi``: 2; ``pi``: the
    hostfile's slots). Nothing else in pilab starts engines::

        lab = cluster.start(n=4)                   # this machine
        lab = cluster.start(profile="pi")          # 48 ranks from profiles/profile_pi/hosts
    """
    import ipyparallel as ipp  # see the module docstring

    pdir = profile_dir(profile)
    if isinstance(log_level, str):
        log_level = logging.getLevelName(log_level.upper())
    log = _file_log(pdir, log_level)
    kwargs = dict(engines="mpi", profile_dir=pdir, log_level=log_level, log=log)
    if n is not None:
        if n < 1:
            raise ClusterError(f"n={n} must be >= 1 engines")
        kwargs["n"] = int(n)
    _check_profile(pdir)
    _warn_running(pdir, profile)
    ipc = ipp.Cluster(**kwargs)
    if timeout is not None:
        ipc.engine_timeout = int(timeout)
    try:
        client = ipc.start_and_connect_sync()
    except Exception as e:
        output = _launcher_output(ipc)
        with contextlib.suppress(Exception):
            ipc.stop_cluster_sync()
        raise ClusterError(f"the engines did not all register within {ipc.engine_timeout} s "
                           f"({type(e).__name__}: {e}); mpiexec said:\n{output}\n"
                           f"(the whole log: {log.handlers[0].baseFilename})") from None
    try:
        lab = Engines(client, ipc, owned=True, on_stop=_STARTED_HERE.discard)
        lab.log_file = log.handlers[0].baseFilename
        _STARTED_HERE.add(ipc.cluster_id)
        return lab
    except Exception:
        with contextlib.suppress(Exception):
            ipc.stop_cluster_sync()
        raise


def _file_log(pdir: str, level: int) -> logging.Logger:
    """A logger writing to ``<profile>/log/pilab-cluster-<time>-<pid>.log``: ipyparallel logs to a
    notebook's stdout, and on stopping prints every engine's whole output (60 lines ending in an exit
    code mpiexec gives engines it shuts down) -- which reads as a crash. The engines' output goes there,
    and a failure to start quotes it."""
    d = os.path.join(pdir, "log")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"pilab-cluster-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    log = logging.getLogger(f"pilab.cluster.{os.path.basename(path)}")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers, log.propagate = [handler], False
    # INFO, not DEBUG: at DEBUG ipyparallel streams every process's output live (into the notebook)
    log.setLevel(min(level, logging.INFO))
    return log


def connect(profile: str = "mpi", *, cluster_id: str = "", timeout: float = 30) -> Engines:
    """Attach to engines started elsewhere (``ipcluster start --profile-dir ...``); ``stop()`` on the
    result then only disconnects::

        lab = cluster.connect(profile="pi")
    """
    import ipyparallel as ipp  # see the module docstring

    pdir = profile_dir(profile)
    if cluster_id:
        client = ipp.Client(profile_dir=pdir, cluster_id=cluster_id, timeout=timeout)
    else:
        client = ipp.Client(profile_dir=pdir, timeout=timeout)
    deadline = time.monotonic() + timeout
    while not client.ids and time.monotonic() < deadline:
        time.sleep(0.2)
    if not client.ids:
        client.close()
        raise ClusterError(f"no engines registered with the controller of {pdir} within {timeout} s")
    return Engines(client, None, owned=False)


def running_clusters(profile: str = "mpi") -> list[dict]:
    """Clusters of ``profile`` whose controller or engines still run: ``{"cluster_id", "file", "pids",
    "mine"}`` (``mine``: started by this process and not stopped). A cluster file whose processes are
    all gone (a crash) is removed on the way."""
    pdir = profile_dir(profile)
    found = []
    for path in sorted(glob.glob(os.path.join(glob.escape(pdir), "security", "cluster-*.json"))):
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        pids = [p for p in _pids(info) if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        cid = info.get("cluster", {}).get("cluster_id", "")
        if not pids:
            with contextlib.suppress(OSError):
                os.remove(path)
            continue
        found.append({"cluster_id": cid, "file": path, "pids": pids, "mine": cid in _STARTED_HERE})
    return found


def stop_stale(profile: str = "mpi") -> list[str]:
    """Stop the clusters of ``profile`` left running by a kernel that is gone (restarted, crashed, killed)::

        cluster.stop_stale("mpi")        # what cluster.start tells you to run after a kernel restart

    Returns their cluster ids. Clusters this process started and still uses are left alone."""
    import ipyparallel as ipp  # see the module docstring

    stopped = []
    for c in running_clusters(profile):
        if c["mine"]:
            continue
        with contextlib.suppress(Exception):
            ipp.Cluster.from_file(c["file"]).stop_cluster_sync()
        for pid in c["pids"]:  # whatever ipyparallel could not reach (e.g. an engine set's mpiexec)
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                for p in [*proc.children(recursive=True), proc]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
        with contextlib.suppress(OSError):
            os.remove(c["file"])
        stopped.append(c["cluster_id"])
    return stopped


def _pids(obj) -> list[int]:
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "pid" and isinstance(v, int) and v > 0] + \
            [p for k, v in obj.items() if k != "pid" for p in _pids(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in _pids(v)]
    return []


# Cluster ids started by this process (start) and not yet stopped (Engines.stop removes them).
_STARTED_HERE: set[str] = set()


def _warn_running(pdir: str, profile: str) -> list[dict]:
    """Say what to do about other clusters of this profile (ipyparallel runs each on its own ports, so
    starting one more works, but engines left by a dead kernel hold cores and memory). Returns them."""
    others = running_clusters(pdir)
    for c in others:
        if c["mine"]:
            msg = (f"note: a cluster of profile {profile!r} is already running in this kernel (cluster id "
                   f"{c['cluster_id']}); starting a second, separate one: %px now goes to the new engines. "
                   "Use the Engines you have instead, or lab.stop() the old one")
        else:
            msg = (f"warning: profile {profile!r} has a cluster this kernel did not start still running "
                   f"(cluster id {c['cluster_id']}, pids {c['pids']}), e.g. left by a kernel restart or "
                   f"crash: stop it with cluster.stop_stale({profile!r}) (or `ipcluster stop --profile-dir "
                   f"{pdir} --cluster-id {c['cluster_id']}`), or attach to it with "
                   f"cluster.connect({profile!r}, cluster_id={c['cluster_id']!r})")
        print(msg, file=sys.stderr, flush=True)
    return others


def _check_profile(pdir: str) -> None:
    """Load the profile's ipcluster_config.py once here: ipyparallel logs an error in it and goes on
    with defaults (engines on localhost), which would hide e.g. a missing hostfile."""
    from traitlets.config.loader import PyFileConfigLoader  # with ipyparallel: see the module docstring

    if os.path.isfile(os.path.join(pdir, "ipcluster_config.py")):
        try:
            PyFileConfigLoader("ipcluster_config.py", path=pdir).load_config()
        except Exception as e:
            raise ClusterError(f"profile {pdir} cannot be used: {e}") from None


def _launcher_output(ipc) -> str:
    lines = []
    for es in (ipc.engines or {}).values():
        with contextlib.suppress(Exception):
            lines.append(es.get_output(remove=False))
    text = "\n".join(x for x in lines if x).strip()
    return text[-3000:] if text else "(nothing)"
