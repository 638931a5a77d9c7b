"""Shared pytest fixtures. Plain pytest runs in one process; MPI tests launch their own mpiexec."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background by a shell without job control (`cmd &`, `nohup`, some CI runners)
# inherits SIGINT ignored, and exec passes an ignored signal on to every process it starts: the tests
# that interrupt a run with SIGINT (a Ctrl-C, a kernel's interrupt) would see it never arrive. A handler
# of our own is reset to the default by exec, so the processes the tests start get SIGINT as usual.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def cifar_archive() -> Path:
    """The full CIFAR-10 JPEG archive: $PILAB_CIFAR_ARCHIVE, else <repo>/../shared/data/cifar10-jpeg.tar.gz.

    Absent: the test is skipped, except under CI=true, where a missing archive is a failure.
    """
    path = Path(os.environ.get("PILAB_CIFAR_ARCHIVE")
                or REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz").resolve()
    if not path.is_file():
        msg = (f"CIFAR-10 archive not found at {path}; set PILAB_CIFAR_ARCHIVE to cifar10-jpeg.tar.gz "
               "to run this test")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


# ---- MPI launch helpers (tests that run real ranks) --------------------------------------------
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

# The mpiexec of the MPI that mpi4py uses: pip's MPICH puts it next to this Python.
MPIEXEC = str(Path(sys.executable).parent / "mpiexec") \
    if (Path(sys.executable).parent / "mpiexec").exists() else shutil.which("mpiexec")

# One data cache for the whole session (and the ranks it launches), away from the user's.
_CACHE = tempfile.mkdtemp(prefix="pilab-test-cache-")
os.environ.setdefault("PILAB_CACHE", _CACHE)


def mpi_env(**extra) -> dict:
    """Environment for launched ranks: one thread each, the session's data cache."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_on_testbed(tb, cmd, *, timeout, **kw):
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)`` for a job on a
    testbed; a job that does not end in time fails the test with what every node still ran at that
    moment (state, wait channel, CPU time: ``pilab.testbed.ps``) and its output so far, instead of a
    bare timeout, then is killed."""
    import subprocess

    from pilab import testbed
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            left = testbed.ps(tb)  # before the kill: afterwards the nodes' pid namespaces are gone
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the job did not end within {timeout} s; on the nodes then:\n{left}\n"
                        f"-- stdout:\n{out[-2000:]}\n-- stderr:\n{err[-2000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)
