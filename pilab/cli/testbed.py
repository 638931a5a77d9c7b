"""``pilab testbed {up,down,status,env,exec,link,shape,throttle,traffic}``: a Pi cluster on one machine.

    sudo python -m pilab testbed up --nodes 4 --slots 2 --rate 1gbit    # idempotent
    sudo python -m pilab testbed up --nodes 4 --slurm                    # ... run by Slurm (pilab.launch.slurm)
    eval "$(python -m pilab testbed env)"                                # HYDRA_*, UCX_*, PILAB_*
    python -m pilab scale --nps 2,4,8 --hostfile /run/pilab-testbed/hosts
    python -m pilab testbed exec node02 -- hostname                      # a shell "on" a node
    sudo python -m pilab testbed link node02 down                        # pull its cable
    sudo python -m pilab testbed throttle node02 0.5                     # half a core: a hot board
    sudo python -m pilab testbed down                                    # also after a crash

See ``pilab.testbed`` for what it builds and how traffic between nodes is kept on TCP.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess

from .common import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "testbed", help="a Pi cluster on one machine: network namespaces on a bridge, real TCP",
        description="N network namespaces (node01..) on a bridge with shaped links, a hostfile, an ssh "
                    "shim for Hydra and the ipyparallel Pi profile's settings: real multi-node mpiexec "
                    "jobs on one Linux machine (needs root, ip and tc).")
    ps = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    from ..testbed import DEFAULT_NAME, DEFAULT_RATE, DEFAULT_SUBNET  # light: no torch, no MPI

    def named(q):
        q.add_argument("--name", default=DEFAULT_NAME,
                       help=f"testbed name, the prefix of everything it makes (default: {DEFAULT_NAME})")
        return q

    u = named(ps.add_parser("up", help="make the testbed (idempotent)"))
    u.add_argument("--nodes", type=int, default=4, help="nodes (namespaces) (default: 4)")
    u.add_argument("--slots", type=int, default=2, help="MPI slots per node in the hostfile (default: 2)")
    u.add_argument("--rate", default=DEFAULT_RATE,
                   help=f"link rate per node and direction, a tc rate or 'none' (default: {DEFAULT_RATE})")
    u.add_argument("--subnet", default=DEFAULT_SUBNET,
                   help=f"private range the testbed owns; must not overlap a route here "
                        f"(default: {DEFAULT_SUBNET})")
    u.add_argument("--user", default=None,
                   help="the account every job, engine and shell on the nodes runs as (default: the user who ran "
                        "`sudo`, $SUDO_USER; root only when root itself ran it); that user starts jobs with "
                        "their own mpiexec (a sudo rule for the shim alone)")
    u.add_argument("--slurm", action="store_true",
                   help="also start a Slurm cluster on it: munged, slurmctld on a head node, a slurmd per "
                        "node, one partition 'pi' (needs Debian's slurmctld, slurmd and munge)")
    named(ps.add_parser("down", help="remove everything the testbed made (also after a crash)"))
    named(ps.add_parser("status", help="what is up, as JSON"))
    named(ps.add_parser("env", help="shell exports for mpiexec / ipcluster on the testbed"))
    e = named(ps.add_parser("exec", help="run a command on a node, as ssh would"))
    e.add_argument("host", help="node01, node02, ...")
    e.add_argument("cmd", nargs="+", help="the command (put -- before it)")
    k = named(ps.add_parser("link", help="take a node's link down or up"))
    k.add_argument("host")
    k.add_argument("state", choices=("up", "down"))
    s = named(ps.add_parser("shape", help="set one node's link rate (e.g. a slow node)"))
    s.add_argument("host")
    s.add_argument("rate", help="a tc rate, e.g. 100mbit, or 'none'")
    t = named(ps.add_parser("throttle", help="set one node's speed: a CPU quota (a hot or slower board)",
                            description="Give the node at most CPUS cores in total (a cgroup CPU quota), "
                                        "also what already runs there: a job running on it slows down at "
                                        "once. 0 or 'none' lifts the quota."))
    t.add_argument("host")
    t.add_argument("cpus", type=_cpus, help="cores, e.g. 0.5 (half a core), or 'none'")
    named(ps.add_parser("traffic", help="bytes sent/received per node on its link and loopback"))
    p.set_defaults(func=run)


def _cpus(text: str) -> float:
    """A throttle's cores: a number > 0, or 0 / none (no quota)."""
    import argparse
    if text.strip().lower() in ("none", "off"):
        return 0.0
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give cores as a number, e.g. 0.5, or 'none'")
    return v


def run(args, argv) -> int:
    from .. import testbed as tbm
    try:
        return _run(tbm, args)
    except tbm.TestbedError as e:
        raise UsageError(str(e)) from None


def _run(tbm, args) -> int:
    if args.action == "up":
        user = args.user if args.user is not None else os.environ.get("SUDO_USER", "")
        tb = tbm.up(tbm.Testbed(nodes=args.nodes, slots=args.slots, rate=args.rate,
                                subnet=args.subnet, name=args.name, user="" if user == "root" else user))
        print(f"testbed {tb.name}: {tb.nodes} nodes x {tb.slots} slots, {tb.rate} links, head node "
              f"{tb.bridge_address} on {tb.bridge}")
        print(tbm.job_access(tb))
        for h in tb.hosts:
            print(f"  {h}  {tb.address(h)}  (netns {tb.netns(h)}, link {tb.veth(h)})")
        if args.slurm:
            from ..testbed import slurmd as slurm
            conf = slurm.start(tb)
            print(f"slurm: slurmctld on head ({slurm.head_address(tb)}), slurmd on {', '.join(tb.hosts)}, "
                  f"partition {slurm.PARTITION}; SLURM_CONF={conf}")
        print(f"hostfile: {tb.hostfile}\nnext: eval \"$(python -m pilab testbed env"
              f"{'' if tb.name == tbm.DEFAULT_NAME else ' --name ' + tb.name})\"; then mpiexec -n "
              f"{tb.nodes * tb.slots} ..., `pilab scale --hostfile {tb.hostfile}` or "
              "cluster.start(profile='pi')")
        return 0
    if args.action == "down":
        removed = tbm.down(args.name)
        print(f"testbed {args.name}: removed {len(removed)} thing(s)" +
              "".join(f"\n  {r}" for r in removed))
        return 0
    if args.action == "status":
        print(json.dumps(tbm.status(args.name), indent=1))
        return 0
    tb = tbm.load(args.name)
    if args.action == "env":
        for k, v in tb.env_vars().items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    if args.action == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        tb.index(args.host)  # a clear error for an unknown host
        return subprocess.call([tb.shim, "-x", args.host, *map(shlex.quote, cmd)], env=tb.env())
    if args.action == "link":
        tbm.link(tb, args.host, args.state)
        print(f"{args.host}: link {args.state}")
        return 0
    if args.action == "shape":
        tbm.shape(tb, args.host, args.rate)
        print(f"{args.host}: {args.rate} both ways")
        return 0
    if args.action == "throttle":
        tbm.throttle(tb, args.host, args.cpus)
        print(f"{args.host}: {f'{args.cpus:g} core(s) (CPU quota)' if args.cpus else 'no CPU quota'}")
        return 0
    if args.action == "traffic":
        print(json.dumps(tbm.traffic(tb), indent=1))
        return 0
    raise UsageError(f"unknown action {args.action}")  # pragma: no cover - argparse's choices
