"""Running the probes: the head's listener (the controller's address, reachable? the clock), one probe job per
host through the launcher, and the one job across the hosts (Allreduce, links)."""
from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

from ..launch import mpiexec_command
from .common import MARK, DoctorError


SECRET_ENV = "PILAB_DOCTOR_SECRET"  # how the probes learn the listener's secret (mpiexec passes it on)


class _Listener:
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
    from ..lab.cluster.profiles import lan_address
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
    from ..engine.memory import predict_peak_bytes
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
