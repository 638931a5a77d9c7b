"""Preflight for a cluster: reach every host the way ``mpiexec`` will and check what breaks a first run.

    python -m pilab doctor --hostfile profiles/profile_pi/hosts --ranks-per-node 2 --data ~/cifar10-jpeg.tar.gz

    from pilab import doctor
    report = doctor.run(doctor.read_hostfile("hosts"), cfg=Config(data=...), ranks_per_node=2)
    print(doctor.format_table(report)); report["ok"]

Every host gets one job of its own (``mpiexec -f <that host> -n 1 python -m pilab.doctor.probe host``,
through the same launcher, hostfile and interface settings -- ``HYDRA_*`` in the environment -- a run
uses), so one host that does not answer cannot hide what the others say. Then one job with one rank
per answering host runs an Allreduce, measures each host's link to rank 0 both ways and the Allreduce
micro-benchmark: the report holds it as ``runs``/``fit``, the format ``perfmodel calibrate
--inter-bench`` reads. Each check is ✔ or ✗ per host, with a one-line fix for each ✗ (``CHECKS``).
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ..hosts import HostsError, parse_hosts, read_hostfile
from ..launch import LaunchError, find_mpiexec, mpiexec_command
from .placement import placement_checks

MARK = "PILAB-DOCTOR"  # the probe's result lines on the job's stdout start with this
HELLO = MARK + "-HELLO"  # its first line, printed before any import: the host answered

__all__ = ["DoctorError", "HostsError", "CHECKS", "run", "read_hostfile", "parse_hosts", "format_table",
           "mpiexec_library", "same_family"]

# the columns of the table, in order
CHECKS = ("answers", "software", "mpi", "allreduce", "link", "iface", "data", "memory", "cpu",
          "clock", "controller", "placement")
CLOCK_LIMIT_S = 0.5  # event timestamps of different hosts are compared; NTP keeps boards within ms
HOT_C = 80.0  # the Pi 4B's firmware starts throttling at 80-85 °C
DETAILS = ("answers", "iface", "link", "memory", "cpu", "clock")  # the figures printed per host
SLOW_LINK = 0.5  # a link under half the median host's bandwidth (a 100 Mbit/s port, a bad cable)


class DoctorError(ValueError):
    """Bad input to the doctor (no hosts, a data path missing on the head…); the message names the fix."""


# ----------------------------------------------------------------------------------------------
# hosts
# ----------------------------------------------------------------------------------------------
# one parser for every host list in pilab (pilab.hosts): doctor.read_hostfile / doctor.parse_hosts stay
# importable here


# ----------------------------------------------------------------------------------------------
# the MPI behind mpiexec
# ----------------------------------------------------------------------------------------------
def mpiexec_library(mpiexec: str) -> str:
    """What ``mpiexec --version`` says it belongs to: "MPICH 4.1.2 (Hydra)", "Open MPI 4.1.4", …"""
    try:
        p = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = p.stdout + p.stderr
    if "HYDRA" in text:
        ver = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                    if ln.strip().startswith("Version:")), "?")
        return f"MPICH {ver} (Hydra)"
    first = text.strip().splitlines()[0] if text.strip() else "unknown"
    if "Open MPI" in text or "OpenRTE" in text:
        return "Open MPI " + first.split()[-1]
    return first


def _family(text: str) -> str:
    t = text.lower()
    if "open mpi" in t:
        return "openmpi"
    for name in ("mvapich", "intel", "mpich"):  # MVAPICH and Intel MPI say MPICH too
        if name in t:
            return name
    return t.split()[0] if t.split() else "?"


def same_family(library: str, launcher: str) -> bool:
    """True when mpi4py's library and mpiexec come from the same MPI (MPICH/Hydra, Open MPI, …)."""
    return _family(library) == _family(launcher)


# ----------------------------------------------------------------------------------------------
# the head's listener: the controller's address, reachable? and the clock
# ----------------------------------------------------------------------------------------------
class _Listener:
    """Answers every line with the head's clock, on the address the Pi profile's controller binds."""

    def __init__(self, bind: str):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.peers: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            self.peers.append(addr[0])
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn):
        with conn, conn.makefile("rw") as f:
            for _ in f:
                f.write(f"{time.time()!r}\n")
                f.flush()

    def close(self):
        self.sock.close()


def controller_address(hostfile: str | None, env: dict | None = None) -> tuple[str, str]:
    """(bind, advertised) address of the Pi profile's controller: ``$PILAB_CONTROLLER_IP`` for both,
    else all interfaces and the address that routes to the first host (profiles/profile_pi)."""
    from ..lab.cluster.profiles import lan_address
    addr = (os.environ if env is None else env).get("PILAB_CONTROLLER_IP", "")
    return (addr or "0.0.0.0"), (addr or lan_address(hostfile))


# ----------------------------------------------------------------------------------------------
# running the probes
# ----------------------------------------------------------------------------------------------
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
    """Predicted peak RSS of one of ``np_`` ranks training ``cfg``, in bytes (``pilab.models.memory``): with
    malloc "lean", what a rank needs (it keeps more, "fast", only where the node has room for it)."""
    from ..models.memory import predict_peak_bytes
    return int(predict_peak_bytes(cfg, np_=np_, allocator="lean"))


def data_path(source: str) -> str:
    """The file or directory a run with ``Config.data = source`` reads, as the head resolves it."""
    from ..data import DataError
    from ..data.cache import resolve_cache_dir
    from ..data.sources import _resolve
    try:
        return _resolve(source, resolve_cache_dir(None))[1]
    except DataError as e:
        raise DoctorError(f"--data {source}: {e}") from None


def run(hosts: list[tuple[str, int]], *, cfg=None, ranks_per_node: int = 2, mpiexec: str | None = None,
        env: dict | None = None, answer_s: float = 30.0, timeout_s: float = 300.0,
        hostfile: str | None = None, links: bool = True) -> dict:
    """Check every host; returns the report (``format_table`` prints it, ``report["ok"]``).

    ``hosts``: [(host, slots)] in hostfile order; ``cfg``: the run's Config (data, model, threads,
    batch: what memory and data are checked against); ``answer_s``: how long a host may take to
    start the probe through the launcher; ``timeout_s``: how long a whole probe may take."""
    from ..config import Config
    cfg = cfg or Config()
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
    opts = ["--data", data, "--head", head_arg, "--toward", toward] + (["--snn"] if _needs_snn(cfg) else [])
    report = {"hosts": [h for h, _ in hosts], "mpiexec": mpx, "mpiexec_library": launcher,
              "config": cfg.to_dict(), "ranks_per_node": ranks_per_node, "data_path": data,
              "predicted_peak_bytes": peak, "controller": head_arg, "launcher": _launcher_words(env),
              "ucx_net_devices": env.get("UCX_NET_DEVICES", "")}
    try:
        # the head itself, without a launcher: the reference every host is compared with
        head = _Job(_probe_cmd("host", *opts), env)
        jobs = {h: _Job(mpiexec_command(1, _probe_cmd("host", *opts), mpiexec=mpx,
                                        hostfile=_hostfile(tmp, f"h{i}", [(h, 1)])), env)
                for i, (h, _) in enumerate(hosts)}
        head_why = head.wait(timeout_s, timeout_s)
        if head_why or not head.results:
            for j in jobs.values():
                j.kill()
            raise DoctorError(f"the probe does not run on the head itself ({head_why or 'no result'}): "
                              f"{head.last_error() or 'see python -m pilab.doctor.probe host'}")
        report["head"] = head.results[0]
        why = {h: j.wait(answer_s, timeout_s) for h, j in jobs.items()}
        probes = {h: (j.results[0] if j.results else None) for h, j in jobs.items()}
        answered = [h for h, _ in hosts if probes[h] is not None]
        net = _net_job(tmp, answered, mpx, env, answer_s, timeout_s, links) if answered else None
    finally:
        listener.close()
        tmp_dir.cleanup()
    report["probes"] = probes
    report["net"] = net
    if net and net.get("bench"):
        report["runs"] = [net["bench"]]  # what `perfmodel calibrate --inter-bench` reads
        from ..perfmodel.fit import fit_alpha_beta
        try:
            report["fit"] = fit_alpha_beta(report["runs"])
        except Exception as e:  # noqa: BLE001 - a fit that fails is not a failed check
            report["fit"] = {"error": str(e)}
    report["checks"] = {h: _checks(h, jobs[h], why[h], probes[h], report, answered, peak)
                        for h, _ in hosts}
    for h, check in placement_checks(hosts, ranks_per_node, env=env).items():
        report["checks"][h]["placement"] = check
    report["ok"] = all(c["ok"] for per in report["checks"].values() for c in per.values())
    return report


def _launcher_words(env: dict) -> str:
    exec_ = env.get("HYDRA_LAUNCHER_EXEC")
    return f"{env.get('HYDRA_LAUNCHER', 'ssh')}{' via ' + exec_ if exec_ else ''}" + \
        (f", -iface {env['HYDRA_IFACE']}" if env.get("HYDRA_IFACE") else "")


def _net_job(tmp, answered, mpx, env, answer_s, timeout_s, links) -> dict:
    """One rank per answering host (two on the one host when there is only one: a size to check)."""
    hosts = [(h, 1) for h in answered] if len(answered) > 1 else [(answered[0], 2)]
    n = sum(s for _, s in hosts)
    cmd = mpiexec_command(n, _probe_cmd("net", *(["--links"] if links and len(answered) > 1 else [])),
                          mpiexec=mpx, hostfile=_hostfile(tmp, "net", hosts))
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


# ----------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------
def _ok(detail: str) -> dict:
    return {"ok": True, "detail": detail, "fix": ""}


def _bad(detail: str, fix: str) -> dict:
    return {"ok": False, "detail": detail, "fix": fix}


def _skip(detail: str = "not checked: the host did not answer") -> dict:
    return {"ok": None, "detail": detail, "fix": ""}


def _gb(n) -> str:
    return f"{n / 1e9:.2f} GB"


def _software(p: dict, head: dict) -> dict:
    mine, ref = p.get("versions", {}), head.get("versions", {})
    diff = []
    for k in ("python", "torch", "numpy", "mpi4py", "snntorch"):
        if k in ref and mine.get(k) != ref.get(k):
            diff.append(f"{k} {mine.get(k)} (head: {ref.get(k)})")
    pm, pr = mine.get("pilab", {}), ref.get("pilab", {})
    for k in ("version", "commit", "source_sha256"):
        if pm.get(k) != pr.get(k):
            diff.append(f"pilab {k} {pm.get(k)} (head: {pr.get(k)})")
    if mine.get("executable") != ref.get("executable"):
        diff.append(f"python at {mine.get('executable')} (head: {ref.get('executable')})")
    if diff:
        return _bad("; ".join(diff), f"install the head's versions on this host: the same commit at the "
                                     f"same path, then ./lab.sh setup (pip install {_pins(ref)})")
    commit = pr.get("commit") or pr.get("source_sha256")
    return _ok(f"python {ref.get('python')}, torch {ref.get('torch')}, mpi4py {ref.get('mpi4py')}, "
               f"pilab {pr.get('version')}@{commit}")


def _pins(ref: dict) -> str:
    return " ".join(f"{k}=={ref[k]}" for k in ("torch", "numpy", "mpi4py", "snntorch")
                    if ref.get(k) and "cannot" not in str(ref[k]))


def _checks(host, job, why, p, report, answered, peak) -> dict:
    c = {}
    launcher = report["launcher"]
    if p is None:
        rc = job.proc.returncode
        msg = job.last_error() or why or f"the probe exited {rc} without a result" + \
            (" (killed: out of memory?)" if rc in (-9, 137) else "")
        if why and job.hello_s is None and not job.last_error():
            msg = f"{why} through the launcher ({launcher})"
        fix = f"check that {host} is on and on the network, and that `ssh {host} true` works without " \
              "a password from the head (as mpiexec will run it)"
        if job.hello_s is not None:  # it started, then failed: its own output says why
            fix = f"run `{sys.executable} -m pilab.doctor.probe host` on {host} and read its error"
        c["answers"] = _bad(msg, fix)
        for k in CHECKS[1:]:
            c[k] = _skip()
        return c
    c["answers"] = _ok(f"{p.get('hostname')} in {job.hello_s:.1f} s")
    head = report["head"]
    c["software"] = _software(p, head)
    # --- MPI library: the one mpi4py loads on this host vs the mpiexec the run uses
    lib, mpx = p.get("mpi", {}).get("library") or p.get("mpi", {}).get("error", "?"), \
        report["mpiexec_library"]
    net = report.get("net") or {}
    mine = [r for r in net.get("ranks", []) if r.get("host") == p.get("hostname")]
    zero_of_one = any(r.get("size") == 1 and r.get("launcher_size", 0) > 1 for r in mine)
    if not same_family(lib, mpx) or zero_of_one:
        c["mpi"] = _bad(f"mpi4py uses {lib}, but mpiexec {report['mpiexec']} is {mpx}"
                        + (": every rank is 0 of 1" if zero_of_one else ""),
                        "use the mpiexec of mpi4py's MPI (--mpiexec / PILAB_MPIEXEC), or reinstall mpi4py "
                        "against this one (pip install --no-binary mpi4py --force-reinstall mpi4py)")
    else:
        c["mpi"] = _ok(f"{lib.split(',')[0]} = {mpx}")
    # --- the job across all hosts
    if not net.get("allreduce_ok"):
        c["allreduce"] = _bad(f"the {net.get('np')}-rank job over {len(answered)} host(s) failed: "
                              f"{net.get('stopped') or net.get('error') or 'no sum'}",
                              "run `mpiexec -f HOSTFILE -n N hostname`; open the hosts' TCP ports "
                              "to each other (firewall) and give every host the same interface name")
        c["link"] = _skip("not measured: no job across the hosts")
    else:
        c["allreduce"] = _ok(f"{net['np']} ranks, one per host, sum correct")
        c["link"] = _link(host, p, net, answered)
    # --- interface
    iface = p.get("iface", {})  # toward the head's address on the hosts' network
    names = {(report["probes"][h] or {}).get("iface", {}).get("name") for h in answered}
    ucx = report["ucx_net_devices"]
    name = iface.get("name")
    if not name:
        c["iface"] = _bad(iface.get("error", "no interface toward the head"),
                          "give this host an address on the head's network")
    elif ucx and ucx != "all" and name not in [d.split(":")[0] for d in ucx.split(",")]:
        c["iface"] = _bad(f"{name} ({iface.get('address')}), not in UCX_NET_DEVICES={ucx}",
                          f"export UCX_NET_DEVICES={','.join(sorted(n for n in names if n))}")
    elif len(names) > 1:
        c["iface"] = _bad(f"{name} here; the hosts use {', '.join(sorted(map(str, names)))}",
                          f"give all hosts one interface name, or export UCX_NET_DEVICES="
                          f"{','.join(sorted(n for n in names if n))} (Hydra: -iface on the head)")
    else:
        c["iface"] = _ok(f"{name} ({iface.get('address')})")
    # --- data
    c["data"] = _data(host, p.get("data", {}), head.get("data", {}), report["data_path"])
    # --- memory
    mem = p.get("memory", {})
    rpn = report["ranks_per_node"]
    free = mem.get("free")
    if free is None:
        c["memory"] = _bad("cannot read /proc/meminfo", "check the host's /proc")
    else:
        need = rpn * peak
        where = f" (cgroup limit {_gb(mem['cgroup']['limit'])})" if mem.get("cgroup") and \
            mem["cgroup"]["free"] <= (mem.get("available") or 1 << 62) else ""
        text = f"free {_gb(free)}{where}, {rpn} ranks x {_gb(peak)} predicted peak = {_gb(need)}"
        c["memory"] = _ok(text) if free >= need else _bad(
            text + " will not fit",
            f"fewer ranks per node (--ranks-per-node {max(1, int(free // peak))}), a smaller "
            "--batch-size or --width, or stop what else runs there")
    # --- cpu
    c["cpu"] = _cpu(p.get("cpu", {}), rpn, report["config"].get("threads", 0))
    # --- clock and controller: the round trips to the head's listener
    talk = p.get("head", {})
    if not talk.get("reachable"):
        c["controller"] = _bad(f"{report['controller']} not reachable from {host}: {talk.get('error')}",
                               "set PILAB_CONTROLLER_IP to the head's address on the nodes' network "
                               "(not 127.0.0.1) and open its ports in the head's firewall")
        c["clock"] = _skip("not measured: the head's address is not reachable")
    else:
        c["controller"] = _ok(f"{report['controller']} reachable")
        off = talk["offset_s"]
        text = f"{1e3 * off:+.2f} ms from the head (± {1e3 * talk['rtt_s'] / 2:.2f} ms)"
        c["clock"] = _ok(text) if abs(off) <= CLOCK_LIMIT_S else _bad(
            text, "synchronise the clocks: sudo timedatectl set-ntp true (or install chrony) on every host")
    return c


def _link(host, p, net, answered) -> dict:
    links = {int(k): v for k, v in (net.get("links") or {}).items()}
    idx = answered.index(host)
    if not links:
        return _ok("one host: no link to measure")
    if idx == 0:
        return _ok("rank 0's host: the others are measured against it")
    m = links.get(idx)
    if m is None:
        return _bad("not measured", "rerun the doctor")
    bw = [min(v["to_peer_Bps"], v["from_peer_Bps"]) for v in links.values()]
    median = sorted(bw)[len(bw) // 2]
    mine = min(m["to_peer_Bps"], m["from_peer_Bps"])
    text = (f"{1e6 * m['latency_s']:.0f} µs, {m['to_peer_Bps'] / 1e6:.0f} MB/s in, "
            f"{m['from_peer_Bps'] / 1e6:.0f} MB/s out")
    if len(bw) >= 2 and mine < SLOW_LINK * median:
        return _bad(text + f" (hosts' median {median / 1e6:.0f} MB/s)",
                    "check the cable, switch port and `ethtool eth0` speed/duplex on this host")
    return _ok(text)


def _data(host, mine, ref, path) -> dict:
    if not path:
        return _ok("no data file (--data)")
    copy = f"rsync -a {shlex.quote(path)}{'/' if os.path.isdir(path) else ''} " \
           f"{host}:{shlex.quote(path)}{'/' if os.path.isdir(path) else ''}"
    if mine.get("missing"):
        return _bad(f"{path} missing", f"copy it there: {copy}")
    if mine.get("error") or "sha256" not in mine:
        return _bad(f"{path}: {mine.get('error', 'not read')}", f"make it readable, or {copy}")
    if mine["sha256"] != ref.get("sha256"):
        return _bad(f"{path} differs (sha256 {mine['sha256'][:12]}…, head {ref.get('sha256', '?')[:12]}…)",
                    f"copy the head's: {copy}")
    return _ok(f"sha256 {mine['sha256'][:12]}… = head")


def _cpu(cpu: dict, rpn: int, threads: int) -> dict:
    cores = cpu.get("cores") or 0
    quota = cpu.get("quota_cores")
    if quota:
        cores = min(cores, quota)
    per = max(1, int(threads or 0))
    need = rpn * per
    freq = f"{cpu['freq_mhz']:.0f}/{cpu['max_mhz'] or 0:.0f} MHz" if cpu.get("freq_mhz") else "freq n/a"
    temp = f", {cpu['temp_c']:.0f} °C" if cpu.get("temp_c") is not None else ""
    text = f"{cores:g} cores{' (CPU quota)' if quota and quota <= cores else ''} for {rpn} ranks x " \
           f"{per} threads, {freq}{temp}"
    if cores < need:
        fix = f"--threads {int(cores // rpn)}" if cores >= rpn else \
            f"--ranks-per-node {max(1, int(cores))}{', or lift the CPU quota' if quota else ''}"
        return _bad(text, fix)
    thr = cpu.get("throttled")
    if thr:  # vcgencmd bits: 0 under-voltage, 1 arm frequency capped, 2 throttled, 3 soft temp limit (now)
        return _bad(text + f", vcgencmd get_throttled=0x{thr:x}",
                    "a 5.1 V / 3 A power supply (under-voltage) and a heatsink or fan (throttling)")
    if cpu.get("temp_c") is not None and cpu["temp_c"] >= HOT_C:
        return _bad(text, "cool the board (heatsink, fan): it throttles at 80-85 °C")
    return _ok(text)


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------
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
