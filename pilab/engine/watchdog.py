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
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Watchdog", "DEFAULT_HANG_S", "EXIT_HANG", "hang_s_from_env", "diagnose"]

DEFAULT_HANG_S = 120.0
EXIT_HANG = 3  # exit status of a rank the watchdog ended
# What the watchdog can find once a rank has been quiet for hang_s: a peer it cannot connect to (its
# node is off the network), a peer that accepts but does not answer (stopped, or hung in C code with
# the GIL held), or every peer answering (one of them is behind and the others wait for it).
VERDICTS = ("unreachable", "silent", "waiting")
PROBE_S = 3.0  # seconds a peer has to answer (a reachable peer answers from its own thread at once)
EXIT_GRACE_S = 1.0  # seconds a captured stderr (a notebook engine's) gets to send the report


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


def _local_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (in a testbed node: its one link's address)."""
    import psutil  # an ipyparallel dependency; only multi-host jobs need it

    out = []
    for addrs in psutil.net_if_addrs().values():
        out += [a.address for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
    return out


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
        self.peers: list[dict] = []
        if self.size < 2 or self.hang_s <= 0:
            return
        host = socket.gethostname()
        hosts = comm.allgather(host)
        # One host: loopback is enough. Several: every address of this host (in a testbed node that is
        # only its link's; on a cluster node its LAN addresses), since which one a peer can reach is
        # what the watchdog is about to find out.
        multi = len(set(hosts)) > 1
        addrs = _local_addresses() if multi else ["127.0.0.1"]
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("0.0.0.0" if multi else "127.0.0.1", 0))
        self._server.listen(64)
        self._server.settimeout(0.5)
        me = {"rank": self.rank, "host": host, "addrs": addrs, "port": self._server.getsockname()[1],
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
                conn, _ = self._server.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                msg = {"rank": self.rank, "steps": self.steps,
                       "quiet_s": round(time.monotonic() - self.last, 1)}
                try:
                    conn.sendall((json.dumps(msg) + "\n").encode())
                    # a probe closes the connection now (EOF at once); a failing peer says why at
                    # once too: wait briefly, so that probes queued behind this one are answered
                    conn.settimeout(min(1.0, self.probe_s))
                    line = conn.makefile().readline()
                    if line.strip():
                        reason = json.loads(line).get("failed", "")
                        if self.on_peer_failure is not None and reason:
                            self.on_peer_failure(reason)
                        conn.sendall(b"ok\n")
                except (OSError, ValueError):
                    pass

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
                    f.readline()  # its status line
                    f.write(json.dumps({"failed": reason}) + "\n")
                    f.flush()
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
