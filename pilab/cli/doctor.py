"""``pilab doctor``: check a cluster before a run, the way ``mpiexec`` will reach it.

    python -m pilab doctor --hostfile profiles/profile_pi/hosts --ranks-per-node 2 --data ~/cifar10-jpeg.tar.gz
    python -m pilab doctor --hosts pi01,pi02 --json runs/doctor.json   # also the inter-node calibration

Exit 0 when every check passes on every host, 1 when one fails, 2 on bad input. See ``pilab.doctor``.
"""
from __future__ import annotations

import os

from ..config import Config
from .common import UsageError, add_config_arguments, add_launch_arguments, config_from_args

DEFAULTS = Config()


def add_parser(sub) -> None:
    d = sub.add_parser(
        "doctor", help="check every host of a cluster before a run (exit 0 all pass, 1 a check fails)",
        description="Reach every host through the launcher mpiexec will use and check: it answers; "
                    "Python/torch/mpi4py/pilab versions as on the head; mpi4py's MPI vs mpiexec's; an "
                    "Allreduce across all hosts and each link's latency and bandwidth; the network "
                    "interface; the data file's SHA-256; memory for the ranks; CPU and throttling; "
                    "each host's speed on the run's own training step; the clock; the Pi profile's "
                    "controller address. One table, one fix per failure.")
    g = d.add_mutually_exclusive_group()
    add_launch_arguments(d, what="the probes, as the run will", hostfile_group=g,
                         hostfile_default="$HYDRA_HOST_FILE, $PILAB_HOSTFILE, then profiles/profile_pi/hosts")
    g.add_argument("--hosts", default=None, help="comma-separated hosts instead of a hostfile, e.g. pi01,pi02")
    d.add_argument("--ranks-per-node", dest="ranks_per_node", type=int, default=2,
                   help="MPI ranks the run will put on each host (default: 2, the Pi 4B's)")
    d.add_argument("--json", dest="json_out", default=None,
                   help="also write the report as JSON (it holds `runs`/`fit`: give it to `perfmodel "
                        "calibrate --inter-bench`)")
    d.add_argument("--answer-s", dest="answer_s", type=float, default=30.0,
                   help="seconds a host may take to start the probe through the launcher (default: 30)")
    d.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0,
                   help="seconds one host's whole probe may take (a Pi imports torch in 20-40 s) "
                        "(default: 300)")
    d.add_argument("--no-speed", dest="speed", action="store_false",
                   help="do not time the run's training step on every host (the speed check: a few "
                        "steps of the model on each, seconds on a Pi)")
    add_config_arguments(d, DEFAULTS, skip=("out", "resume"))
    d.set_defaults(func=run)


def _hosts(args):
    from .. import launch
    if args.hosts:
        return launch.parse_hosts(args.hosts, args.ranks_per_node), None
    if not args.hostfile and launch.allocation():  # inside salloc/sbatch: the allocation's nodes and tasks
        return launch.allocation(), None
    path = args.hostfile or os.environ.get("HYDRA_HOST_FILE") or os.environ.get("PILAB_HOSTFILE")
    if not path:
        from ..lab.cluster import profile_dir
        path = os.path.join(profile_dir("pi"), "hosts")
        if not os.path.isfile(path):
            raise UsageError(f"no hosts: give --hostfile FILE or --hosts a,b (or create {path} from "
                             "hosts.template beside it)")
    return launch.read_hostfile(path), path


def run(args, argv) -> int:
    from .. import doctor, launch
    from ..files import save_json
    for name in ("answer_s", "timeout_s"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    cfg = config_from_args(args, DEFAULTS)
    try:
        hosts, hostfile = _hosts(args)
        report = doctor.run(hosts, cfg=cfg, ranks_per_node=args.ranks_per_node, mpiexec=args.mpiexec,
                            answer_s=args.answer_s, timeout_s=args.timeout_s, hostfile=hostfile,
                            speed=args.speed)
    except (doctor.DoctorError, launch.HostsError) as e:
        raise UsageError(str(e)) from None
    print(doctor.format_table(report))
    if args.json_out:
        save_json(report, args.json_out)
        print(f"wrote {args.json_out}")
    return 0 if report["ok"] else 1
