"""Preflight for a cluster: reach every host the way ``mpiexec`` will and check what breaks a first run.

    python -m pilab doctor --hostfile profiles/profile_pi/hosts --ranks-per-node 2 --data ~/cifar10-jpeg.tar.gz

    from pilab import doctor, launch
    report = doctor.run(launch.read_hostfile("hosts"), cfg=Config(data=...), ranks_per_node=2)
    print(doctor.format_table(report)); report["ok"]

Every host gets one job of its own (``mpiexec -f <that host> -n 1 python -m pilab.doctor.probe host``,
through the same launcher, hostfile and interface settings -- ``HYDRA_*`` in the environment -- a run
uses), so one host that does not answer cannot hide what the others say. Then one job with one rank
per answering host runs an Allreduce, measures each host's link to rank 0 both ways and the Allreduce
micro-benchmark: the report holds it as ``runs``/``fit``, the format ``perfmodel calibrate
--inter-bench`` reads. Each check is ✔ or ✗ per host, with a one-line fix for each ✗ (``CHECKS``).
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "checks": ["DoctorError", "CHECKS"],
    "preflight": ["run", "format_table", "controller_address", "data_path", "predicted_peak"],
})
