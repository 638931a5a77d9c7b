"""One testbed user at a time: ``exclusive()`` holds an flock on a root-owned lock file for as long as its
block runs, so that two processes that make testbeds (two test runs, a test run and ``pilab bench``'s
network section, an experiment's driver) never take down each other's namespaces, bridge and Slurm/munge
daemons, nor time their runs on a CPU the other is loading::

    from pilab import testbed
    with testbed.exclusive("my experiment"):        # waits, saying who holds it, while another has it
        tb = testbed.up(testbed.Testbed(nodes=2, name="plx", subnet="10.90.0.0/24"))
        ...
        testbed.down("plx")

    sudo flock /run/pilab-testbed.lock python experiments/perfmodel/validate_testbed.py ...   # from a shell

The lock is the machine's, not a testbed name's: namespaces, links and cgroups are global to the kernel,
whatever directory the state files go to. It covers a job that makes its testbed and takes it down
again; a testbed left up by ``pilab testbed up`` is its user's, under its own name, and is not locked.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from typing import Callable, Iterator

# /run is writable by root only, so nobody else can plant the file (or a link in its place) there.
LOCK_PATH = "/run/pilab-testbed.lock" if os.path.isdir("/run") else "/run/pilab-testbed.lock"
SAY_EVERY_S = 60.0  # how often a waiting process says again that it is still waiting

_depth: dict[str, int] = {}  # path -> how many nested exclusive() blocks of this process hold it


def holder(path: str = LOCK_PATH) -> str | None:
    """Who holds the lock at ``path`` now: ``"pid N (purpose)"``, the pid from /proc/locks and the purpose
    ``exclusive`` wrote (else the command line: a shell's ``flock`` writes none), or None when nobody
    does (or the kernel does not say)."""
    try:
        ino = os.stat(path).st_ino
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
        with open(path) as f:
            record = f.read().strip()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter's line reads "1: -> FLOCK ...")
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(ino):
            pid = parts[4]
            if record.startswith(f"{pid} "):
                return f"pid {pid} ({record[len(pid) + 1:]})"
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            return f"pid {pid} ({cmd[:300]})"
    return None


@contextlib.contextmanager
def exclusive(purpose: str, *, path: str = LOCK_PATH,
              say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> Iterator[None]:
    """Hold the machine's testbed lock for the block; ``purpose`` names this user in the lock file.
    While another process holds it, wait, and ``say`` (one line) who holds it, then every minute that
    we still wait. Nested blocks of one process share the lock (only the outermost takes and frees it)."""
    if _depth.get(path):
        _depth[path] += 1
        try:
            yield
        finally:
            _depth[path] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        t0 = said = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                t0 = now if t0 is None else t0
                if said is None or now - said >= SAY_EVERY_S:
                    who = holder(path) or "another process"
                    say(f"testbed: {purpose}: waiting for {path}, held by {who}"
                        + (f" (waited {now - t0:.0f} s)" if said is not None else "")
                        + ": one testbed user at a time on this machine")
                    said = now
                time.sleep(0.5)
        if t0 is not None:
            say(f"testbed: {purpose}: got {path} after {time.monotonic() - t0:.0f} s")
        # who holds it and why: what holder() tells the next one who waits
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {purpose}\n".encode())
        _depth[path] = 1
        try:
            yield
        finally:
            _depth.pop(path, None)
    finally:
        os.close(fd)  # closing the only descriptor frees the flock
