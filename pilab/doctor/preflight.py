"""``doctor.run``: every host probed through the launcher, the job across them, the checks."""
from __future__ import annotations

import os
import tempfile

from ..launch import LaunchError, find_mpiexec, mpiexec_command
from .checks import _checks, _skip
from .common import DoctorError
from .jobs import (SECRET_ENV, _Job, _Listener, _hostfile, _launcher_words, _needs_snn, _net_job, _probe_cmd, speed_spec,
                   controller_address, data_path, predicted_peak)
from ..launch.library import _family, mpiexec_library
from ..launch.placement import placement_checks, ranks_on


def run(hosts: list[tuple[str, int]], *, cfg=None, ranks_per_node: int = 2, mpiexec: str | None = None,
        env: dict | None = None, answer_s: float = 30.0, timeout_s: float = 300.0,
        hostfile: str | None = None, links: bool = True, speed: bool = True) -> dict:
    """Check every host; returns the report (``format_table`` prints it, ``report["ok"]``).

    ``hosts``: [(host, slots)] in hostfile order; ``cfg``: the run's Config (data, model, threads,
    batch: what memory and data are checked against); ``answer_s``: how long a host may take to
    start the probe through the launcher; ``timeout_s``: how long a whole probe may take; ``speed``: time
    the run's training step on every host (the ``speed`` check)."""
    from ..config import Config
    cfg = cfg or Config()
    mpx, launcher = _launcher(hosts, ranks_per_node, mpiexec)
    env = dict(os.environ if env is None else env)
    data = data_path(cfg.data) if cfg.data else ""
    # the run: ranks_per_node ranks on every host (each rank's shard of the training set)
    peak = predicted_peak(cfg, np_=ranks_per_node * len(hosts))
    tmp_dir = tempfile.TemporaryDirectory(prefix="pilab-doctor-")
    tmp = tmp_dir.name
    hostfile = hostfile or _hostfile(tmp, "all", hosts)
    from ..lab.cluster.profiles import lan_address
    # the head's own address on the hosts' network (the route MPI takes): the one the controller is told
    # to use, else the one that routes to the hosts (node names of an allocation may not resolve here)
    toward = env.get("PILAB_CONTROLLER_IP") or lan_address(hostfile)
    bind, advertised = controller_address(hostfile, env)
    try:
        listener = _Listener(bind)
    except OSError as e:
        tmp_dir.cleanup()
        raise DoctorError(f"the controller's address {bind} cannot be bound here ({e.strerror}); set "
                          "PILAB_CONTROLLER_IP to an address of this machine on the hosts' network") from None
    head_arg = f"{advertised}:{listener.port}"
    env[SECRET_ENV] = listener.secret  # the probes' first line to the listener (mpiexec passes env on)
    opts = ["--data", data, "--head", head_arg, "--toward", toward] + (["--snn"] if _needs_snn(cfg) else [])
    report = {"hosts": list(dict.fromkeys(h for h, _ in hosts)), "mpiexec": mpx, "mpiexec_library": launcher,
              "config": cfg.to_dict(), "ranks_per_node": ranks_per_node, "data_path": data,
              "predicted_peak_bytes": peak, "controller": head_arg, "launcher": _launcher_words(env),
              "ucx_net_devices": env.get("UCX_NET_DEVICES", "")}
    try:
        spec = speed_spec(cfg, ranks_per_node, ranks_per_node * len(hosts)) if speed else ""
        probes, jobs, why, answered, net = _probe(report, hosts, opts, tmp, mpx, env, answer_s, timeout_s, links,
                                                  spec)
    finally:
        listener.close()
        tmp_dir.cleanup()
    report["probes"] = probes
    report["net"] = net
    if net and net.get("bench"):
        report["runs"] = [net["bench"]]  # what `perfmodel calibrate --inter-bench` reads
        report["fit"] = _fit(report["runs"])
    # the ranks each machine really gets, however often (and under whatever names) the list names it:
    # what its memory and CPU checks count (pilab.launch.placement)
    report["ranks_here"] = ranks_on(hosts, ranks_per_node, probes)
    report["checks"] = {h: _checks(h, jobs[h], why[h], probes[h], report, answered, peak, report["ranks_here"][h])
                        for h in dict.fromkeys(h for h, _ in hosts)}
    for h, check in placement_checks(hosts, ranks_per_node, env=env, probes=probes).items():
        # "as checked" needs the memory and CPU checks it refers to: a host that did not answer had none
        # (a wrong slot count or a drained node is still said: neither needs the host to answer)
        ok = check["ok"] and report["checks"][h]["answers"]["ok"]
        report["checks"][h]["placement"] = check if ok or check["ok"] is False else _skip()
    report["ok"] = all(c["ok"] for per in report["checks"].values() for c in per.values())
    return report


def _launcher(hosts, ranks_per_node, mpiexec) -> tuple[str, str]:
    """The mpiexec and its library, after the input checks; DoctorError naming the fix."""
    if ranks_per_node < 1:
        raise DoctorError(f"--ranks-per-node {ranks_per_node} must be >= 1")
    if not hosts:
        raise DoctorError("no hosts: give --hostfile FILE or --hosts a,b")
    try:
        mpx = find_mpiexec(mpiexec)
    except LaunchError as e:
        raise DoctorError(str(e)) from None
    launcher = mpiexec_library(mpx)
    if _family(launcher) == "openmpi":
        # Raspberry Pi OS's `apt-get install mpich python3-mpi4py` makes Open MPI's the mpiexec (Debian's
        # mpi4py is built against Open MPI); it answers every probe with 'unknown option "-f"'.
        raise DoctorError(
            f"{mpx} is {launcher}'s, but pilab starts ranks on the hosts with MPICH's (Hydra's) command "
            "line (mpiexec -f HOSTFILE, host:slots lines); use MPICH's: pip's (./lab.sh setup without "
            "PILAB_SYSTEM_MPI=1), or Debian's (--mpiexec /usr/bin/mpiexec.mpich, with mpi4py built against "
            "it: apt-get install libmpich-dev; pip install --no-binary mpi4py mpi4py)")
    return mpx, launcher


def _probe(report, hosts, opts, tmp, mpx, env, answer_s, timeout_s, links, spec=""):
    """The head's probe (the reference), one probe job per host, then the job across the answering hosts."""
    head = _Job(_probe_cmd("host", *opts), env)  # the head itself, without a launcher
    jobs = {h: _Job(mpiexec_command(1, _probe_cmd("host", *opts), mpiexec=mpx,
                                    hostfile=_hostfile(tmp, f"h{i}", [(h, 1)])), env)
            for i, h in enumerate(dict.fromkeys(h for h, _ in hosts))}  # a name listed twice: probed once
    head_why = head.wait(timeout_s, timeout_s)
    if head_why or not head.results:
        for j in jobs.values():
            j.kill()
        raise DoctorError(f"the probe does not run on the head itself ({head_why or 'no result'}): "
                          f"{head.last_error() or 'see python -m pilab.doctor.probe host'}")
    report["head"] = head.results[0]
    why = {h: j.wait(answer_s, timeout_s) for h, j in jobs.items()}
    probes = {h: (j.results[0] if j.results else None) for h, j in jobs.items()}
    answered = [h for h in jobs if probes[h] is not None]
    net = _net_job(tmp, answered, mpx, env, answer_s, timeout_s, links, spec) if answered else None
    return probes, jobs, why, answered, net


def _fit(runs) -> dict:
    from ..perfmodel.fit import fit_alpha_beta
    try:
        return fit_alpha_beta(runs)
    except Exception as e:  # noqa: BLE001 - a fit that fails is not a failed check
        return {"error": str(e)}
