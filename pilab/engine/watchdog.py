"""A watchdog in every rank: a job whose network or a peer fails ends with an error that names the
unreachable rank and host, instead of waiting for TCP's timeouts (minutes to hours).

MPI over TCP has no notion of a peer gone silent: a rank whose node lost its link just never answers,
and every other rank waits in the next collective. The watchdog notices that this rank has made no
step for ``hang_s`` seconds, asks every other rank -- over a side channel of its own (one small TCP
listener per rank, addresses exchanged at the start) -- whether it is reachable and how far it got,
prints one line naming the ranks and hosts that did not answer (or the rank the others wait for), and
ends this process. Every rank does the same, on every node, so no process is left behind even on a
node nobody can reach any more::

    from pilab.engine.watchdog import Watchdog
    with Watchdog(comm, hang_s=120) as wd:             # a collective: call it on every rank
        pilab.train(cfg, comm, stop=wd.polled(stop))     # each poll of `stop` is one step of progress

``hang_s`` must exceed the longest quiet stretch of a healthy run: one step, one evaluation, one
checkpoint (on the Pi cluster at most ~20 s at the study's settings). Default: ``DEFAULT_HANG_S``
(120 s, as the notebook's ``Engines.train(hang_s=...)``); the CLI takes ``--hang-s`` or
``$PILAB_HANG_S``, 0 switches the watchdog off.

The side channel is the job's own: each listener binds the one address it advertises (the host's
address on the network its peers share; loopback when every rank is on one host), and answers only a
line that carries the job's secret -- 16 random bytes rank 0 draws and broadcasts over MPI at start,
compared with ``hmac.compare_digest``. A connection without it (another user on the cluster network, a
port scanner) gets nothing; the first is logged (``FOREIGN``), later ones are not (docs/security.md).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Watchdog", "DEFAULT_HANG_S", "EXIT_HANG", "hang_s_from_env", "diagnose", "cluster_address", "FOREIGN",
           "BACKLOG"]

DEFAULT_HANG_S = 120.0
EXIT_HANG = 3  # exit status of a rank the watchdog ended
# What the watchdog can find once a rank has been quiet for hang_s: a peer it cannot connect to (its
# node is off the network), a peer that accepts but does not answer (stopped, or hung in C code with
# the GIL held), or every peer answering (one of them is behind and the others wait for it).
VERDICTS = ("unreachable", "silent", "waiting")
PROBE_S = 3.0  # seconds a peer has to answer (a reachable peer answers from its own thread at once)
EXIT_GRACE_S = 1.0  # seconds a captured stderr (a notebook engine's) gets to send the report
# The one line a connection without the job's secret earns (once per rank). Not MARK: the launcher ends
# mpiexec when a rank prints MARK (watch_launcher), and a stranger's message must not end the job.
FOREIGN = "pilab: side channel:"
BACKLOG = 64  # connections a listener queues (its mark in `ss -tln`: MPI's own listeners queue 4096)


def hang_s_from_env(default: float = DEFAULT_HANG_S) -> float:
    """``$PILAB_HANG_S`` as seconds (``default`` when unset)."""
    text = os.environ.get("PILAB_HANG_S", "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"PILAB_HANG_S={text!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"PILAB_HANG_S={text!r} must be >= 0 (0: no watchdog)")
    return value


def _local_networks() -> list[str]:
    """This host's IPv4 interfaces other than loopback, as ``address/prefix`` (in a testbed node: its
    one link's)."""
    import psutil  # an ipyparallel dependency; only multi-host jobs need it

    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                out.append(str(ipaddress.ip_interface(f"{a.address}/{a.netmask or '255.255.255.255'}")))
    return out


def cluster_address(mine: list[str], others: list[list[str]]) -> str:
    """The address of this host (``mine``: ``address/prefix`` strings) on the network the other hosts
    share with it: the one whose network holds an address of the most other hosts (``others``: each
    host's list), the first on a tie; where none shares a network, the address the kernel sends from
    toward the first other host. What the side channel binds and advertises -- never every interface::

        cluster_address(["192.168.1.5/24", "10.0.0.5/24"], [["10.0.0.6/24", "172.16.0.6/16"]])  # "10.0.0.5"
    """
    ifaces = [ipaddress.ip_interface(a) for a in mine]
    if not ifaces:
        raise OSError("this host has no IPv4 address other than loopback; the other hosts cannot reach it")

    def reached(i):
        return sum(any(ipaddress.ip_interface(a).ip in i.network for a in host) for host in others)
    best = max(ifaces, key=reached)  # max keeps the first of equals
    if reached(best) or not others or not others[0]:
        return str(best.ip)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((str(ipaddress.ip_interface(others[0][0]).ip), 9))  # UDP connect: nothing is sent
            src = s.getsockname()[0]
        return src if any(str(i.ip) == src for i in ifaces) else str(best.ip)
    except OSError:
        return str(best.ip)


class Watchdog:
    """See the module docstring. ``exit`` is what ends the process (``os._exit``; tests pass their
    own), ``out`` where the one-line report goes (stderr)."""

    def __init__(self, comm, hang_s: float = DEFAULT_HANG_S, *, probe_s: float = PROBE_S,
                 fatal=VERDICTS, exit=os._exit, out=None, on_end=None, on_peer_failure=None):
        self.comm, self.hang_s, self.probe_s = comm, float(hang_s), probe_s
        self.fatal = frozenset(fatal)
        unknown = self.fatal - set(VERDICTS)
        if unknown:
            raise ValueError(f"fatal={sorted(unknown)}: choose from {', '.join(VERDICTS)}")
        self._exit, self._out = exit, out
        # on_end(report): runs before the watchdog ends this rank (rank 0 keeps the run's result);
        # on_peer_failure(reason): another rank reported its exception over the side channel
        self.on_end, self.on_peer_failure = on_end, on_peer_failure
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.steps = 0
        self.last = time.monotonic()
        self.report: str | None = None
        self._stop = threading.Event()
        self._server = None
        self._secret = b""
        self.foreign = 0  # connections refused for want of the job's secret
        self.peers: list[dict] = []
        if self.size < 2 or self.hang_s <= 0:
            return
        host = socket.gethostname()
        # the job's secret: drawn by rank 0, sent to the others over MPI (never on the side channel)
        self._secret = comm.bcast(secrets.token_hex(16) if self.rank == 0 else None, root=0).encode()
        nets = _local_networks()
        seen = comm.allgather((host, nets))
        # One host: loopback is enough. Several: this host's address on the network the other hosts
        # share (in a testbed node its one link's; on a cluster node its cluster LAN address).
        multi = len({h for h, _ in seen}) > 1
        others = [n for h, n in dict(seen).items() if h != host]
        addr = cluster_address(nets, others) if multi else "127.0.0.1"
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((addr, 0))
        self._server.listen(BACKLOG)
        self._server.settimeout(0.5)
        me = {"rank": self.rank, "host": host, "addrs": [addr], "port": self._server.getsockname()[1],
              "pid": os.getpid()}
        self.peers = comm.allgather(me)
        self._threads = [threading.Thread(target=self._serve, name="pilab-watchdog-serve", daemon=True),
                         threading.Thread(target=self._watch, name="pilab-watchdog", daemon=True)]
        for t in self._threads:
            t.start()

    # -- progress ------------------------------------------------------------------------------
    def beat(self) -> None:
        """One unit of progress (a step)."""
        self.steps += 1
        self.last = time.monotonic()

    def polled(self, stop=None):
        """A ``stop`` callable for ``pilab.train`` that counts each poll (once per step) as progress."""
        def poll() -> bool:
            self.beat()
            return bool(stop()) if stop is not None else False
        return poll

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the two threads -----------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._server.accept()
            except (socket.timeout, OSError):
                continue
            try:  # the makefile closed with the socket: an open one would keep the connection up
                with conn, conn.makefile("rwb") as f:
                    conn.settimeout(min(1.0, self.probe_s))
                    self._answer(f, peer)
            except (OSError, ValueError):
                pass

    def _answer(self, f, peer) -> None:
        # the caller speaks first, with the job's secret; a line without it gets nothing
        ask = self._authentic(f.readline(4096), peer)
        if ask is None:
            return
        msg = {"rank": self.rank, "steps": self.steps, "quiet_s": round(time.monotonic() - self.last, 1)}
        f.write((json.dumps(msg) + "\n").encode())
        f.flush()
        reason = ask.get("failed", "")
        if reason and isinstance(reason, str):
            if self.on_peer_failure is not None:
                self.on_peer_failure(reason)
            f.write(b"ok\n")
            f.flush()

    def _authentic(self, line: bytes, peer) -> dict | None:
        """The message in ``line`` if it carries the job's secret, else None (the first such one logged)."""
        try:
            msg = json.loads(line)
            token = msg.get("secret", "") if isinstance(msg, dict) else ""
            ok = isinstance(token, str) and hmac.compare_digest(token.encode(), self._secret)
        except (ValueError, UnicodeError):
            ok = False
        if ok:
            return msg
        self.foreign += 1
        if self.foreign == 1:
            print(f"{FOREIGN} rank {self.rank} ignored a connection from {peer[0]} without this job's secret "
                  "(further ones are not logged)", file=self._out or sys.stderr, flush=True)
        return None

    def _line(self, **msg) -> str:
        return json.dumps({"secret": self._secret.decode(), **msg}) + "\n"

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            quiet = time.monotonic() - self.last
            if quiet < self.hang_s:
                continue
            answers = self.probe()
            if self._stop.is_set() or time.monotonic() - self.last < self.hang_s:
                continue  # the run ended, or moved on, while we asked
            verdict, self.report = diagnose(self.rank, self.peers, answers, steps=self.steps,
                                            quiet_s=quiet, hang_s=self.hang_s)
            if verdict not in self.fatal:
                # not ours to end (e.g. a notebook's stuck rank: its client reports it); look again
                # after another hang_s of no progress
                self.last = time.monotonic()
                continue
            out = self._out or sys.stderr
            print(f"{self.report}; ending this rank (exit {EXIT_HANG})", file=out, flush=True)
            # Keep the run's result before ending: rank 0 itself (on_end), or, when another rank's
            # watchdog fires first (its launcher then ends rank 0 too), that rank tells rank 0 why.
            reason = self.report[len(MARK):].strip()
            try:
                if self.on_end is not None:
                    self.on_end(reason)
                if self.rank != 0:
                    self.tell(reason, root=0, timeout=2 * self.probe_s)
            except Exception as e:  # ending the rank is what matters here
                print(f"pilab: watchdog: could not keep the result: {e}", file=out, flush=True)
            if out is not sys.__stderr__ and self._exit is os._exit:
                # A notebook engine's stderr is a stream that its kernel sends over zmq from another
                # thread: flush() hands the line to zmq, and os._exit would end the process before
                # zmq's own thread has sent it -- the notebook would never see which node was lost.
                time.sleep(EXIT_GRACE_S)
            self._exit(EXIT_HANG)
            return

    def tell(self, reason: str, root: int = 0, timeout: float = 10.0) -> bool:
        """Tell rank ``root`` that this rank failed (``reason``) and wait until it has acted on it
        (rank 0 keeps the run's result before the job is aborted); False if it could not be told."""
        peer = next((p for p in self.peers if p["rank"] == root), None)
        if peer is None or root == self.rank:
            return False
        for addr in peer["addrs"]:
            try:
                with socket.create_connection((addr, peer["port"]), timeout=self.probe_s) as s:
                    s.settimeout(timeout)
                    f = s.makefile("rw")
                    f.write(self._line(failed=reason))
                    f.flush()
                    f.readline()  # its status line
                    return f.readline().strip() == "ok"
            except OSError:
                continue
        return False

    def probe(self) -> dict[int, dict | str]:
        """Ask every other rank how far it got: rank -> its answer, or why there was none."""
        others = [p for p in self.peers if p["rank"] != self.rank]
        with ThreadPoolExecutor(max_workers=min(32, len(others) or 1)) as pool:
            return dict(zip((p["rank"] for p in others), pool.map(self._ask, others)))

    def _ask(self, peer: dict):
        why = "no address"
        for addr in peer["addrs"]:
            try:
                s = socket.create_connection((addr, peer["port"]), timeout=self.probe_s)
            except socket.timeout:
                why = f"no connection to {addr} within {self.probe_s:g} s"
                continue
            except OSError as e:
                why = f"{addr}: {e.strerror or e}"
                continue
            with s:
                try:
                    s.settimeout(self.probe_s)
                    s.sendall(self._line().encode())
                    line = s.makefile().readline()
                except OSError:
                    line = ""
            # connected: the host is there; a process that does not answer is stopped or wedged
            return json.loads(line) if line else f"SILENT: {addr} accepted but no answer within " \
                                                  f"{self.probe_s:g} s"
        return why


def _ranks(rs) -> str:
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def diagnose(rank: int, peers: list[dict], answers: dict, *, steps: int, quiet_s: float,
             hang_s: float) -> tuple[str, str]:
    """(verdict, one line): which ranks (on which hosts) could not be reached or did not answer, or,
    when all answered, which rank the others are waiting for (``VERDICTS``)."""
    by = {p["rank"]: p for p in peers}
    head = (f"pilab: watchdog: rank {rank} ({by[rank]['host']}) made no progress for {quiet_s:.0f} s "
            f"(hang_s={hang_s:g}) after {steps} step(s);")

    def where(rs):
        hosts: dict = {}
        for r in rs:
            hosts.setdefault(by[r]["host"], []).append(r)
        return "; ".join(f"{_ranks(v)} on {h} ({', '.join(by[v[0]]['addrs'])})" for h, v in hosts.items())
    failed = {r: a for r, a in answers.items() if not isinstance(a, dict)}
    gone = sorted(r for r, a in failed.items() if not a.startswith("SILENT"))
    silent = sorted(r for r, a in failed.items() if a.startswith("SILENT"))
    if gone:
        return "unreachable", f"{head} unreachable: {where(gone)} [{failed[gone[0]]}]"
    if silent:
        return "silent", (f"{head} not answering (stopped or wedged): {where(silent)} "
                          f"[{failed[silent[0]][len('SILENT: '):]}]")
    behind = min(answers, key=lambda r: answers[r]["steps"]) if answers else rank
    lag = answers[behind]["steps"] if answers else steps
    return "waiting", (f"{head} every rank answers; {_ranks([behind])} on {by[behind]['host']} is "
                       f"furthest behind (step {lag}; this rank: {steps}) and the others wait for it")


# ----------------------------------------------------------------------------------------------
# the launcher's side
# ----------------------------------------------------------------------------------------------
MARK = "pilab: watchdog:"


def watch_launcher(proc, *, grace_s: float = 15.0, tail: list | None = None) -> int:
    """Wait for a launched ``mpiexec`` (a ``Popen`` with ``stdout=PIPE, stderr=PIPE``), passing its
    output through as it comes; once a rank's watchdog has reported, give mpiexec ``grace_s`` seconds
    to end, then end it and return ``EXIT_HANG``.

    Why: Hydra's mpiexec waits for every proxy's connection to close, and the proxy on a node that lost
    its link closes it with a FIN that never arrives: mpiexec would wait for ever although every rank
    (the watchdog's doing) and every proxy has ended::

        proc = subprocess.Popen(launch.pilab_command(4, ["train"]), stdout=PIPE, stderr=PIPE)
        sys.exit(watch_launcher(proc))

    ``tail``: a list whose first item becomes the last 4 KiB of mpiexec's stderr (what it said last).
    """
    import subprocess

    seen = threading.Event()
    keep = tail

    def pump(src, dst):
        # chunks, not lines: a progress bar's carriage returns pass through at once
        last = b""
        fd = src.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            dst.buffer.write(chunk) if hasattr(dst, "buffer") else dst.write(chunk.decode(errors="replace"))
            dst.flush()
            last = (last + chunk)[-4096:]
            if MARK.encode() in last:
                seen.set()
            if keep is not None and dst is sys.stderr:
                keep[:1] = [last.decode(errors="replace")]
    pumps = [threading.Thread(target=pump, args=(src, dst), daemon=True, name="pilab-launcher-output")
             for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)) if src is not None]
    for t in pumps:
        t.start()
    while proc.poll() is None:
        if seen.wait(0.5):
            try:
                proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                print(f"pilab: the ranks ended but mpiexec did not within {grace_s:g} s (it waits for a "
                      "proxy on a node it cannot reach); ending it", file=sys.stderr, flush=True)
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                for t in pumps:
                    t.join(timeout=2)
                return EXIT_HANG
    for t in pumps:
        t.join(timeout=5)
    return proc.returncode
