"""A real Slurm on the testbed: Debian's ``munge``, ``slurmctld`` on a head node and one ``slurmd`` on
each node namespace, as on a Pi cluster run by Slurm::

    sudo python -m pilab testbed up --nodes 4 --slots 2 --slurm
    eval "$(python -m pilab testbed env)"               # SLURM_CONF among the rest
    sinfo                                               # pi*  up  infinite  4  idle node[01-04]
    srun -N 2 hostname                                  # node01, node02
    salloc -N 2 --ntasks-per-node 2 python -m pilab train --np 4 ...   # ranks started by srun
    sudo python -m pilab testbed down                   # stops the daemons too (also after a crash)

    from pilab import testbed
    from pilab.testbed import slurmd
    tb = testbed.up(testbed.Testbed(nodes=2, slots=2))
    slurmd.start(tb)                                     # waits until every node is idle
    slurmd.stop(tb.name)

How it is laid out, and what is configured around because the nodes share one kernel:

- The controller runs in a namespace of its own, ``<name>-head`` (hostname ``head``, the range's
  ``.2`` on the bridge): slurmctld listens on every address of its host, and in a namespace of its own
  those are the head's only. Clients (``sinfo``, ``sbatch``, ``srun``) reach it from anywhere on this
  machine over the bridge.
- Each ``slurmd`` runs in its node's network namespace with the node's hostname (UTS namespace), a
  ``/dev/shm`` of its own and the cgroup file systems mounted again (mount namespace), exactly where the
  shim starts Hydra's proxies: what a job step starts there is on that board.
- Process tracking by ``/proc`` (``proctrack/linuxproc``) and no task binding (``task/none``), as a
  small cluster without cgroup delegation runs: slurmd's cgroup plugins want to own a cgroup tree,
  which several slurmds on one kernel cannot each do. ``SlurmdParameters=config_overrides``: every node
  reports the machine's cores and memory; slurm.conf's ``CPUs`` (the testbed's slots) and
  ``RealMemory`` (the node's memory cgroup limit, else the machine's memory) are what Slurm schedules.
- One ``munged`` for the whole testbed with a key of its own, its socket in the state directory
  (``AuthInfo=socket=...``): the machine's own munge (if any) is left alone.
- Every file is under ``/run/<name>-testbed/slurm``; ``SLURM_CONF`` points the client commands at it (a
  Slurm client without it asks DNS for an SRV record: ``env()`` always sets it).

MPI under Slurm: ``srun --mpi=pmi2`` starts the ranks; MPICH's PMI client speaks PMI-2 to slurmstepd
(pilab.launch does this inside an allocation).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

from ..files import atomic_write_text
from .nodes import (NODE_IFACE, Testbed, TestbedError, check_state_dir, link_names, netns_list, run_cmd, slurm_conf,
                    state_dir, state_problem)
from .shim import write_files

__all__ = ["available", "start", "stop", "is_up", "conf_path", "head_address", "write_conf", "wait_idle",
           "PARTITION", "COMMANDS"]

PARTITION = "pi"  # the testbed's one partition, the default
COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel")
HEAD = "head"


def available() -> str | None:
    """None when Slurm can run on a testbed here, else why not (one line naming the fix)."""
    missing = [c for c in COMMANDS if shutil.which(c) is None and not os.path.exists(f"/usr/sbin/{c}")]
    if missing:
        return (f"Slurm/munge commands not found ({', '.join(missing)}): apt-get install slurmctld slurmd "
                "munge slurm-client")
    return None


def _dir(name: str) -> str:
    return os.path.join(state_dir(name), "slurm")


def conf_path(name: str) -> str:
    return slurm_conf(name)


def is_up(name: str) -> bool:
    return os.path.isfile(conf_path(name))


def head_address(tb: Testbed) -> str:
    import ipaddress
    return str(ipaddress.ip_network(tb.subnet).network_address + 2)


def head_netns(name: str) -> str:
    return f"{name}-{HEAD}"


def _sbin(cmd: str) -> str:
    return shutil.which(cmd) or f"/usr/sbin/{cmd}"


def _node_memory_mib(tb: Testbed, host: str) -> int:
    """The node's memory cgroup limit (testbed.limit_memory), else this machine's memory, in MiB."""
    from .cgroups import memory_cgroup
    found = memory_cgroup(tb.name, host)
    if found:
        for knob in ("memory.max", "memory.limit_in_bytes"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(found[0], knob)) as f:
                limit = int(f.read())
                if limit < 1 << 50:
                    return limit >> 20
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 20


def write_conf(tb: Testbed) -> str:
    """slurm.conf for ``tb``: one line per node (its address, ``CPUs`` = slots, ``RealMemory``), one
    partition ``pi`` with every node. Returns its path."""
    d = _dir(tb.name)
    lines = [
        f"# pilab testbed {tb.name}: a Slurm cluster of {tb.nodes} node namespaces (pilab/testbed/slurmd.py)",
        f"ClusterName={tb.name}", f"SlurmctldHost={HEAD}({head_address(tb)})",
        "SlurmctldPort=6817", "SlurmdPort=6818", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d}/munge/munge.socket",
        f"StateSaveLocation={d}/ctld", f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "# no cgroup plugins: several slurmds share one kernel (see pilab/testbed/slurmd.py)",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SlurmdParameters=config_overrides",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill",
        "MpiDefault=pmi2", "ReturnToService=2", "PropagateResourceLimits=NONE",
        "KillWait=5", "InactiveLimit=0", "MinJobAge=600", "SlurmctldTimeout=30", "SlurmdTimeout=30",
        *(f"NodeName={h} NodeAddr={tb.address(h)} NodeHostname={h} CPUs={tb.slots} "
          f"RealMemory={_node_memory_mib(tb, h)} State=UNKNOWN" for h in tb.hosts),
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    for sub in ("munge", "ctld", "log", *(f"spool/{h}" for h in tb.hosts)):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    atomic_write_text(conf_path(tb.name), "\n".join(lines) + "\n")
    return conf_path(tb.name)


def _start_munge(tb: Testbed) -> None:
    d = _dir(tb.name)
    key = os.path.join(d, "munge.key")
    if not os.path.exists(key):
        run_cmd(_sbin("mungekey"), "--create", f"--keyfile={key}", "--bits=1024")
        os.chmod(key, 0o600)
    os.chmod(os.path.join(d, "munge"), 0o755)  # munged wants its socket's directory readable by all
    # --origin: the head's address, so that munged never looks up this machine's name
    # no --force: munged's own checks of its key, socket and directories (owner, mode) stand
    run_cmd(_sbin("munged"), f"--socket={d}/munge/munge.socket", f"--key-file={key}",
         f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/log/munged.log",
         f"--seed-file={d}/munge/munged.seed", f"--origin={tb.bridge_address}")


def _head_up(tb: Testbed) -> None:
    """The head node: a namespace of its own on the bridge at the range's .2."""
    ns, veth = head_netns(tb.name), f"{tb.name}-nh"
    if ns not in netns_list():
        run_cmd("ip", "netns", "add", ns)
    if veth not in link_names():
        run_cmd("ip", "link", "add", veth, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
    run_cmd("ip", "link", "set", veth, "master", tb.bridge)
    run_cmd("ip", "link", "set", veth, "up")
    run_cmd("ip", "addr", "replace", f"{head_address(tb)}/{tb.prefixlen}", "dev", NODE_IFACE, ns=ns)
    run_cmd("ip", "link", "set", NODE_IFACE, "up", ns=ns)
    run_cmd("ip", "link", "set", "lo", "up", ns=ns)


def start(tb: Testbed, *, wait_s: float = 60.0) -> str:
    """Start munged, slurmctld (head) and a slurmd per node for testbed ``tb`` (which must be up);
    wait until every node is idle. Returns the path of slurm.conf. Idempotent: daemons already
    running are stopped and started again with the new configuration."""
    why = available()
    if why:
        raise TestbedError(why)
    check_state_dir(tb.name)  # root starts daemons with files from it
    stop(tb.name)
    conf = write_conf(tb)
    d = _dir(tb.name)
    _start_munge(tb)
    _head_up(tb)
    run_cmd("unshare", "--uts", "sh", "-c", f"hostname {HEAD} && exec {_sbin('slurmctld')} -f {conf}",
         ns=head_netns(tb.name))
    mounts = os.path.join(tb.state_dir, "mounts.sh")
    for h in tb.hosts:
        # as the shim does for a job: the node's hostname, /dev/shm and cgroup file systems
        run_cmd("unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
             f"hostname {h} && mount -t tmpfs -o mode=1777,size=50% tmpfs /dev/shm && . {mounts} {h} "
             f"&& exec {_sbin('slurmd')} -f {conf}", ns=tb.netns(h))
    wait_idle(tb, wait_s, log=os.path.join(d, "log", "slurmctld.log"))
    write_files(tb)  # env.sh again, now with SLURM_CONF
    return conf


def wait_idle(tb: Testbed, wait_s: float, *, log: str = "") -> None:
    """Wait until ``sinfo`` shows every node of ``tb`` idle."""
    env = dict(os.environ, SLURM_CONF=conf_path(tb.name))
    deadline, states = time.monotonic() + wait_s, ""
    while time.monotonic() < deadline:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=env)
        states = p.stdout.strip() or p.stderr.strip()
        got = dict(line.split()[:2] for line in p.stdout.splitlines() if len(line.split()) >= 2)
        if sorted(got) == tb.hosts and all(s == "idle" for s in got.values()):
            return
        time.sleep(0.5)
    raise TestbedError(f"Slurm on testbed {tb.name}: nodes not idle after {wait_s:.0f} s ({states}); "
                       f"see {log or _dir(tb.name) + '/log'}")


def _kill_pidfile(path: str, must_contain: str) -> bool:
    """SIGTERM (then SIGKILL) the process of a pid file if its command line names ``must_contain``."""
    try:
        with open(path) as f:
            pid = int(f.read().split()[0])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if must_contain.encode() not in f.read():
                return False
    except (OSError, ValueError, IndexError):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        for _ in range(20):
            if not os.path.exists(f"/proc/{pid}"):
                return True
            time.sleep(0.1)
    return True


def stop(name: str) -> list[str]:
    """Stop testbed ``name``'s Slurm daemons and munged and remove the head namespace (works after a
    crash: found by the state directory and the name's prefix). Returns what it stopped/removed."""
    d, removed = _dir(name), []
    ns = head_netns(name)
    # pid files are trusted only in a state directory no other account can write (testbed.state_problem)
    mine = os.path.isdir(d) and not state_problem(name)
    for pidfile in sorted(os.listdir(d)) if mine else []:
        if pidfile.startswith("slurm") and pidfile.endswith(".pid") and \
                _kill_pidfile(os.path.join(d, pidfile), conf_path(name)):
            removed.append(f"daemon {pidfile[:-4]}")
    if ns in netns_list():
        for pid in run_cmd("ip", "netns", "pids", ns, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        run_cmd("ip", "netns", "del", ns, check=False)
        removed.append(f"netns {ns}")
    if f"{name}-nh" in link_names():
        run_cmd("ip", "link", "del", f"{name}-nh", check=False)
        removed.append(f"link {name}-nh")
    if mine and _kill_pidfile(os.path.join(d, "munge", "munged.pid"), os.path.join(d, "munge")):
        removed.append("daemon munged")
    if mine:
        shutil.rmtree(d, ignore_errors=True)
        removed.append(f"dir {d}")
    return removed
