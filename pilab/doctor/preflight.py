"""``doctor.run``: every host probed through the launcher, the job across them, the checks.

Running the probes: the head's listener (the controller's address, reachable? the clock), one probe job per
host through the launcher, and the one job across the hosts (Allreduce, links).

The doctor's report as text: one row of marks per host, the figures, then each ✗ with its fix.
"""
from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..launch import (LaunchError, find_mpiexec, mpi_family, mpiexec_command, mpiexec_library, placement_checks,
                     ranks_on)
from .checks import CHECKS, DETAILS, MARK, DoctorError, host_checks, skipped


SECRET_ENV = "PILAB_DOCTOR_SECRET"  # how the probes learn the listener's secret (mpiexec passes it on)


def format_table(report: dict) -> str:
    """The host x check table (✔ / ✗ / · not checked), each host's figures, one fix per ✗."""
    mark = {True: "✔", False: "✗", None: "·"}
    hosts = report["hosts"]
    w = max(8, *(len(h) for h in hosts))
    head = f"{'host':<{w}}  " + "  ".join(CHECKS)
    lines = [head]
    for h in hosts:
        row = report["checks"][h]
        lines.append(f"{h:<{w}}  " + "  ".join(f"{mark[row[k]['ok']]:<{len(k)}}" for k in CHECKS).rstrip())
    lines.append("")
    for h in hosts:
        row = report["checks"][h]
        if row["answers"]["ok"]:
            lines.append(f"{h}: " + "; ".join(f"{k} {row[k]['detail']}" for k in
                                                DETAILS if row[k]["ok"]))
    fails = [(h, k, report["checks"][h][k]) for h in hosts for k in CHECKS
             if report["checks"][h][k]["ok"] is False]
    lines.append("")
    for h, k, c in fails:
        lines.append(f"✗ {h} {k}: {c['detail']}\n    fix: {c['fix']}")
    n = len(hosts)
    lines.append(f"all {len(CHECKS)} checks pass on {n} host(s)" if report["ok"] else
                 f"{len(fails)} check(s) fail on {len({h for h, _, _ in fails})} of {n} host(s)")
    return "\n".join(lines)


class ClockListener:
    """Answers every line with the head's clock, on the address the Pi profile's controller binds, to a
    connection whose first line is this doctor run's secret (``secret``, in ``$PILAB_DOCTOR_SECRET`` of
    the probe jobs); any other connection is closed unanswered, the first one logged."""

    def __init__(self, bind: str, *, out=None):
        self.secret = secrets.token_hex(16)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.peers: list[str] = []
        self.foreign: list[str] = []  # addresses of connections without the secret
        self._out = out
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn, addr[0]), daemon=True).start()

    def _answer(self, conn, peer: str):
        with conn, conn.makefile("rw") as f:
            conn.settimeout(10)
            try:
                first = f.readline(256).strip()
            except (OSError, UnicodeError):
                first = ""
            if not hmac.compare_digest(first.encode(), self.secret.encode()):
                self.foreign.append(peer)
                if len(self.foreign) == 1:
                    print(f"pilab doctor: ignored a connection from {peer} to the head's listener without this "
                          "run's secret (further ones are not logged)", file=self._out or sys.stderr, flush=True)
                return
            self.peers.append(peer)
            conn.settimeout(None)
            for _ in f:
                f.write(f"{time.time()!r}\n")
                f.flush()

    def close(self):
        self.sock.close()


def controller_address(hostfile: str | None, env: dict | None = None) -> tuple[str, str]:
    """(bind, advertised) address of the Pi profile's controller: ``$PILAB_CONTROLLER_IP`` for both,
    else the address that routes to the first host, for both (profiles/profile_pi): never every
    interface."""
    from ..lab.cluster import lan_address
    addr = (os.environ if env is None else env).get("PILAB_CONTROLLER_IP", "") or lan_address(hostfile)
    return addr, addr


def _hostfile(tmp: str, name: str, hosts: list[tuple[str, int]]) -> str:
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write("".join(f"{h}:{s}\n" for h, s in hosts))
    return path


class _Job:
    """One launched probe: notes when its first line arrived and collects its JSON lines."""

    def __init__(self, cmd: list[str], env: dict):
        self.t0 = time.monotonic()
        self.hello_s = None
        self.hello: dict | None = None
        self.results: list[dict] = []
        self.err: list[str] = []
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self._threads = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._threads:
            t.start()

    def _read_out(self):
        dec = json.JSONDecoder()
        for line in self.proc.stdout:
            # the launcher forwards each rank's output as it comes: lines of two ranks may run together
            for kind, _, rest in (m.partition(" ") for m in line.split(MARK)[1:]):
                try:
                    obj = dec.raw_decode(rest.strip())[0]
                except ValueError:
                    continue
                if kind == "-HELLO" and self.hello_s is None:
                    self.hello_s, self.hello = time.monotonic() - self.t0, obj
                elif kind == "":
                    self.results.append(obj)

    def _read_err(self):
        for line in self.proc.stderr:
            if line.strip():
                self.err.append(line.rstrip())

    def wait(self, answer_s: float, total_s: float) -> str | None:
        """None when the job ended by itself in time, else why it was stopped."""
        why = None
        while self.proc.poll() is None:
            el = time.monotonic() - self.t0
            if self.hello_s is None and el > answer_s:
                why = f"no answer within {answer_s:g} s"
                break
            if el > total_s:
                why = f"not done within {total_s:g} s"
                break
            time.sleep(0.05)
        if why:
            self.kill()
        for t in self._threads:
            t.join(timeout=5)
        return why

    def kill(self):
        import signal
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def last_error(self) -> str:
        lines = [ln for ln in self.err if "PILAB" not in ln and "Warning" not in ln
                 and not ln.startswith((" ", "Traceback"))]
        return lines[0][:200] if lines else ""


def _probe_cmd(mode: str, *opts: str) -> list[str]:
    return [sys.executable, "-m", "pilab.doctor.probe", mode, *opts]


def _needs_snn(cfg) -> bool:
    return "spiking" in cfg.model


def predicted_peak(cfg, np_: int) -> int:
    """Predicted peak RSS of one of ``np_`` ranks training ``cfg``, in bytes (``pilab.engine.memory``): with
    malloc "lean", what a rank needs (it keeps more, "fast", only where the node has room for it)."""
    from ..engine import predict_peak_bytes
    return int(predict_peak_bytes(cfg, np_=np_, allocator="lean"))


def data_path(source: str) -> str:
    """The file or directory a run with ``Config.data = source`` reads, as the head resolves it."""
    from ..data import DataError
    from ..data import resolve_cache_dir
    from ..data import resolve_source
    try:
        return resolve_source(source, resolve_cache_dir(None))[1]
    except DataError as e:
        raise DoctorError(f"--data {source}: {e}") from None


def _launcher_words(env: dict) -> str:
    exec_ = env.get("HYDRA_LAUNCHER_EXEC")
    return f"{env.get('HYDRA_LAUNCHER', 'ssh')}{' via ' + exec_ if exec_ else ''}" + \
        (f", -iface {env['HYDRA_IFACE']}" if env.get("HYDRA_IFACE") else "")


def speed_spec(cfg, ranks_per_node: int, np_: int) -> str:
    """What the probe's ``step_speed`` times, for the run ``cfg`` at ``np_`` ranks: its model and per-rank
    batch, as one base64 word for the probe's command line."""
    import base64
    spec = {"model": cfg.model, "width": cfg.width, "timesteps": cfg.timesteps, "image_size": cfg.image_size,
            "batch": cfg.per_rank_batch(np_), "threads": cfg.threads, "ranks_per_node": ranks_per_node}
    return base64.b64encode(json.dumps(spec).encode()).decode()


def _net_job(tmp, answered, mpx, env, answer_s, timeout_s, links, speed: str = "") -> dict:
    """One rank per answering host (two on the one host when there is only one: a size to check)."""
    hosts = [(h, 1) for h in answered] if len(answered) > 1 else [(answered[0], 2)]
    n = sum(s for _, s in hosts)
    opts = (["--links"] if links and len(answered) > 1 else []) + (["--speed", speed] if speed else [])
    cmd = mpiexec_command(n, _probe_cmd("net", *opts), mpiexec=mpx, hostfile=_hostfile(tmp, "net", hosts))
    job = _Job(cmd, env)
    why = job.wait(answer_s, timeout_s)
    res = {"np": n, "hosts": answered, "exit": job.proc.returncode, "stopped": why,
           "error": job.last_error(), "outputs": len(job.results)}
    if len(job.results) == 1 and len(job.results[0].get("ranks", [])) == n:
        res.update(job.results[0])
    else:  # every rank its own world of 1 (or none answered): what each one saw
        res["ranks"] = [r for out in job.results for r in out.get("ranks", [])]
        res["allreduce_ok"] = False
    return res


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
    from ..lab.cluster import lan_address
    # the head's own address on the hosts' network (the route MPI takes): the one the controller is told
    # to use, else the one that routes to the hosts (node names of an allocation may not resolve here)
    toward = env.get("PILAB_CONTROLLER_IP") or lan_address(hostfile)
    bind, advertised = controller_address(hostfile, env)
    try:
        listener = ClockListener(bind)
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
    # what its memory and CPU checks count (pilab.launch.ranks_on)
    report["ranks_here"] = ranks_on(hosts, ranks_per_node, probes)
    report["checks"] = {h: host_checks(h, jobs[h], why[h], probes[h], report, answered, peak, report["ranks_here"][h])
                        for h in dict.fromkeys(h for h, _ in hosts)}
    for h, check in placement_checks(hosts, ranks_per_node, env=env, probes=probes).items():
        # "as checked" needs the memory and CPU checks it refers to: a host that did not answer had none
        # (a wrong slot count or a drained node is still said: neither needs the host to answer)
        ok = check["ok"] and report["checks"][h]["answers"]["ok"]
        report["checks"][h]["placement"] = check if ok or check["ok"] is False else skipped()
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
    if mpi_family(launcher) == "openmpi":
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
    from ..perfmodel import fit_alpha_beta
    try:
        return fit_alpha_beta(runs)
    except Exception as e:  # noqa: BLE001 - a fit that fails is not a failed check
        return {"error": str(e)}
