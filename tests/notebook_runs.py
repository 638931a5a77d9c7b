"""The notebooks' nbval runs, started in the background when the session's collection ends (conftest), so
that they use the CPU the rest of the suite leaves idle (its testbed, Slurm and install tests mostly wait)
instead of running alone when ``tests/test_notebooks.py`` is reached. ``test_notebook_runs_under_nbval``
then only reads each run's result::

    runs = notebook_runs.start(["01_quickstart.ipynb"], at_once=1)   # in pytest_collection_finish
    result = runs["01_quickstart.ipynb"].result()                     # in the test: code, output, cpu, ref
    notebook_runs.stop()                                              # in pytest_sessionfinish

Each run is judged by its own process tree's CPU time (``os.wait4``), scaled by a reference step measured
before and after it (``conftest.reference_step_cpu``), so what runs beside it moves its wall time, not
its verdict.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from conftest import reference_step_cpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELL_TIMEOUT_S = 2400  # a hang guard only: a loaded shared box runs a small-mode notebook for minutes
RUN_TIMEOUT_S = 3500
# longest first, so that the queues end together (their CPU seconds in small mode, test-artifacts/nbval-*)
LONGEST_FIRST = ["03_fast_but_wrong.ipynb", "02_strong_scaling.ipynb", "04_models.ipynb", "05_spiking.ipynb",
                 "01_quickstart.ipynb", "06_your_model.ipynb"]

_state: dict = {}


def _nbval(name: str, tmp: str, running: dict) -> dict:
    """One notebook under nbval in a temporary copy: its exit code, its output, its wall seconds and its process
    tree's CPU seconds (os.wait4: the run and every process it waited for, whatever ran beside it)."""
    work = os.path.join(tmp, "notebooks")
    os.mkdir(work)
    for f in os.listdir(os.path.join(REPO, "notebooks")):  # the notebook and the files beside it (06's mynet.py)
        if f == name or (os.path.isfile(os.path.join(REPO, "notebooks", f)) and not f.endswith(".ipynb")):
            shutil.copy(os.path.join(REPO, "notebooks", f), os.path.join(work, f))
    env = dict(os.environ, PILAB_NB_SMALL="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PILAB_NB_LIVE_EPOCHS", None)
    log = os.path.join(tmp, "nbval.log")
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--nbval-lax",
             f"--nbval-cell-timeout={CELL_TIMEOUT_S}", "--rootdir", tmp, os.path.join(work, name)],
            cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    running[name] = proc

    def kill():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    timer = threading.Timer(RUN_TIMEOUT_S, kill)  # a hang guard, as subprocess.run's timeout was
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    running.pop(name)
    with open(log) as f:
        output = f.read()
    return {"code": proc.returncode, "output": output, "cpu": usage.ru_utime + usage.ru_stime,
            "wall": time.monotonic() - t0}


def start(names, *, at_once: int) -> dict:
    """Start the named notebooks' runs, ``at_once`` queues in LONGEST_FIRST order: name -> a future of
    ``_nbval``'s dict plus ``ref``, the reference step measured before and after the run (averaged). A
    queue measures it once between two of its runs: the step after one run is the step before the next.
    Idempotent: a second call returns the first call's futures."""
    if "futures" in _state:
        return _state["futures"]
    names = set(names)
    todo = queue.SimpleQueue()
    for name in [n for n in LONGEST_FIRST if n in names] + sorted(names - set(LONGEST_FIRST)):
        todo.put(name)
    futures = {name: concurrent.futures.Future() for name in names}
    running: dict = {}
    stopping = threading.Event()
    tmp = tempfile.mkdtemp(prefix="pilab-nbval-")

    def worker():
        ref = None
        while not stopping.is_set():
            try:
                name = todo.get_nowait()
            except queue.Empty:
                return
            try:
                ref = reference_step_cpu() if ref is None else ref
                where = tempfile.mkdtemp(prefix=f"nbval-{name[:2]}-", dir=tmp)
                run = _nbval(name, where, running)
                after = reference_step_cpu()
                futures[name].set_result({**run, "ref": (ref + after) / 2})
                ref = after
            except BaseException as e:  # the test of this notebook reports it
                futures[name].set_exception(e)
    workers = [threading.Thread(target=worker, daemon=True) for _ in range(min(at_once, len(names)))]
    for w in workers:
        w.start()
    _state.update(futures=futures, running=running, stopping=stopping, workers=workers, tmp=tmp)
    return futures


def stop() -> None:
    """The session ends (also early: -x, Ctrl-C): what has not started will not, what runs is ended, the
    temporary copies go."""
    if "futures" not in _state:
        return
    _state["stopping"].set()
    for proc in list(_state["running"].values()):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for w in _state["workers"]:
        w.join()
    shutil.rmtree(_state["tmp"], ignore_errors=True)
    _state.clear()
