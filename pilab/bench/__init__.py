"""``python -m pilab bench``: how fast pilab is against what a user would pick instead, on this machine.

    python -m pilab bench                       # the default set (<= 20 min here), JSON + BENCHMARKS.md
    python -m pilab bench --quick               # CI-sized: tiny models, 5 alternations, ~3 min
    python -m pilab bench --sections one_rank,data --out runs/bench
    sudo python -m pilab bench --sections network --quick   # the testbed section (root)

The one home of pilab's benchmarks: a library package, so that the command works from an installed
pilab and its pieces are importable (tests call them on tiny settings). Every figure is a ratio against
a baseline measured in the same run: contenders alternate round by round (the order rotated), one ratio
per round, reported as median and p10-p90 / min-max. Sections that need ranks run as MPI jobs
(``pilab.launch.run_job`` over ``pilab.bench.ranks`` / ``pilab.bench.memory`` / ``pilab.engine.harness``; a
failed job raises ``launch.JobError``).

* ``one_rank``: pilab's one-rank step vs a bare PyTorch loop; ``malloc``: that step with malloc "fast"
  (freed memory kept) vs "lean" (returned at once), a fresh process each; ``models``: images/s per model and layout;
* ``data``: ShardLoader vs a per-sample Dataset + DataLoader; ``cache``: decoding the data set vs the
  cached reload; ``simulator``: exact vs fast, np 1/8/48;
* ``checkpoint``: one mid-epoch checkpoint (ms, bytes) and its share of the 10-minute multi-node interval;
  ``cli``: ``python -m pilab --help`` against ``python -c pass`` (the goal: under 1 s);
* ``ranks``: memory, communication (bandwidth, bucket sweep, hidden share) and the np=2 step
  (pilab vs DDP-gloo vs the sync-only floor vs the no-exchange ceiling, strong scaling);
* ``sync``: the ways to average a step's gradients at np=2 (per-tensor and fused blocking Allreduce,
  GradSync with and without polling, fp16, MPICH's async progress thread);
* ``memory``: peak RSS per rank itemised at the study's setting (``pilab.bench.memory``, real ranks),
  and ``pilab.models.memory``'s prediction against it over 3 widths x 2 batch sizes.

Only when named (minutes each): ``deviation``, the fast mode's deviation after 100 steps at np=48;
``perfmodel``, the performance model calibrated here and checked against held-out real runs
(``pilab.bench.perfmodel``); ``network``, its network half on a testbed of shaped links that the
section brings up and removes (root; ``pilab.bench.network``; skipped with one line otherwise).

Running some sections only (``--sections memory``) replaces those sections in an existing BENCHMARKS.md
and keeps the others.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import time

SECTIONS = ("one_rank", "malloc", "models", "data", "cache", "simulator", "checkpoint", "cli", "ranks", "sync",
            "memory")
# not in the default run: the fast mode's 100-step deviation (~7 min here), the performance model
# against real runs (~4 min), its network half on a testbed (~15 min, root)
EXTRA_SECTIONS = ("deviation", "perfmodel", "network")


# Arm's part numbers (/proc/cpuinfo "CPU part") of the cores in Raspberry Pi boards and their kin.
ARM_PARTS = {"0xd03": "Cortex-A53", "0xd04": "Cortex-A35", "0xd05": "Cortex-A55", "0xd08": "Cortex-A72",
             "0xd0b": "Cortex-A76", "0xd0c": "Neoverse-N1"}


def cpu_name(cpuinfo: str, fallback: str = "") -> str:
    """The processor's name from the text of /proc/cpuinfo: x86's "model name"; on Arm, which has
    none, the board ("Model", e.g. a Raspberry Pi) and the core type from its "CPU part"::

        cpu_name(open("/proc/cpuinfo").read(), platform.machine())   # 'Raspberry Pi 4 Model B Rev 1.4 (Cortex-A72)'
    """
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    if fields.get("model name"):
        return fields["model name"]
    core = ARM_PARTS.get(fields.get("cpu part", "").lower(), "")
    board = fields.get("model", "")
    if board and core:
        return f"{board} ({core})"
    return board or core or fallback


def machine() -> dict:
    """Facts about this machine and its load, for the table's header."""
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_name(f.read(), cpu)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cores": cores, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "loadavg_start": list(os.getloadavg())}


def run(*, quick: bool = False, sections=SECTIONS, out: str = "runs/bench", markdown: str | None = "BENCHMARKS.md",
        mpiexec: str | None = None, command: str = "python -m pilab bench", log=print, before=()) -> dict:
    """Run ``sections``; writes ``<out>/bench.json`` and (unless None) ``markdown``; returns the dict.
    ``before``: paths of earlier ``pilab.bench.memory`` JSONs, shown beside this run's peaks."""
    import torch

    from ..config import Config
    from ..files import save_json
    from . import local
    from .report import markdown_report

    torch.set_num_threads(1)
    res = {"quick": quick, "command": command, "machine": machine(), "sections": list(sections)}
    t_all = time.perf_counter()
    q = quick

    def timed(name, fn):
        log(f"bench: {name} ...")
        t = time.perf_counter()
        res[name] = fn()
        res[name]["wall_s"] = time.perf_counter() - t
        log(f"bench: {name} done in {res[name]['wall_s']:.0f} s")

    if "one_rank" in sections:
        cfg = Config(width=0.25 if q else 1.0, batch_size=16 if q else 64, threads=1,
                     train_subset=512 if q else 0)
        timed("one_rank", lambda: local.one_rank(cfg, 5 if q else 10, 2 if q else 3))
    if "malloc" in sections:
        mcfg = Config(width=0.25 if q else 1.0, batch_size=16 if q else 64, threads=1, train_subset=512 if q else 0)
        timed("malloc", lambda: local.malloc(mcfg, 2 if q else 5, 2 if q else 4))
    if "models" in sections:
        models = [("mobilenetv2_cifar", 0.25), ("mobilenetv2", 0.25), ("squeezenet1_1", 1.0)] if q else local.MODELS
        timed("models", lambda: local.models(16 if q else 64, 5, 1 if q else 2, models))
    if "data" in sections:
        timed("data", lambda: local.data_path(64, 5 if q else 7, 4 if q else 10))
    scfg = Config(width=0.25, batch_size=4 if q else 8, threads=1, train_subset=0)
    dcfg = Config(width=0.25, batch_size=4, threads=1, lr=0.05, lr_ref_batch=64)
    if "simulator" in sections:
        timed("simulator", lambda: local.simulator(scfg, (1, 8) if q else (1, 8, 48), 5))
    if "checkpoint" in sections:
        ccfg = Config(width=0.25 if q else 1.0, batch_size=16, threads=1, train_subset=512)
        timed("checkpoint", lambda: local.checkpoint_cost(ccfg, 3 if q else 5))
    if "deviation" in sections:
        timed("deviation", lambda: local.fast_deviation(dcfg, 8 if q else 48, 10 if q else 100))
    if "cli" in sections:
        timed("cli", lambda: local.cli_startup(5 if q else 10))
    if "cache" in sections:
        archive = os.environ.get("PILAB_CIFAR_ARCHIVE") or MEMORY_DATA
        source = archive if not q and os.path.isfile(archive) else "embedded"
        timed("cache", lambda: local.cache(source, 3))
    if "ranks" in sections:
        timed("ranks", lambda: _ranks_job(quick, mpiexec))
    if "sync" in sections:
        timed("sync", lambda: sync_section(quick, mpiexec))
    if "memory" in sections:
        timed("memory", lambda: memory_section(quick, mpiexec, log=log, before=before))
    if "perfmodel" in sections:
        from . import perfmodel
        timed("perfmodel", lambda: perfmodel.section(quick, mpiexec, log=log))
    if "network" in sections:
        from . import network
        why = network.unavailable()
        if why:
            log(f"bench: network skipped: {why}")
            res["sections"].remove("network")
        else:
            work = os.path.join(out, "network") if out else None
            timed("network", lambda: network.section(quick, work=work, mpiexec=mpiexec, log=log,
                                                     command=command))
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_all
    if out:
        save_json(res, os.path.join(out, "bench.json"))
    if markdown:
        from ..files import atomic_write_text
        from .report import splice_sections
        text = markdown_report(res)
        if not set(SECTIONS) <= set(sections) and os.path.isfile(markdown):
            # some sections only: replace theirs in the existing report, keep the others' figures
            with open(markdown) as f:
                text = splice_sections(f.read(), text)
        atomic_write_text(markdown, text)
    return res


# The memory section: the study's setting (full CIFAR-10, MobileNetV2-CIFAR 1.0, 32 per rank, 2 threads),
# then the prediction against the measured peak over 3 widths x 2 batch sizes.
MEMORY_DATA = os.path.join("..", "shared", "data", "cifar10-jpeg.tar.gz")
MEMORY_STUDY = {"width": 1.0, "batch_size": 32, "threads": 2, "steps": 3}
MEMORY_TABLE = [(w, b) for w in (0.25, 0.5, 1.0) for b in (16, 32)]
MEMORY_TABLE_EVAL_BATCH = 50


def memory_job(setting: dict, mpiexec: str | None = None, env=None) -> dict:
    """One ``mpiexec -n 2 python -m pilab.bench.memory`` job for ``setting`` (its flags); its JSON."""
    from ..launch import job_argv, run_job
    out = run_job(2, "pilab.bench.memory", setting, name="the memory job", mpiexec=mpiexec,
                  env=dict(os.environ, **(env or {})))
    out["command"] = " ".join(f"{k}={v}" for k, v in (env or {}).items()) + \
        (" " if env else "") + "mpiexec -n 2 python -m pilab.bench.memory OUT.json " + " ".join(job_argv(setting))
    return out


def memory_section(quick: bool, mpiexec: str | None = None, log=print, before=()) -> dict:
    """Itemised peak RSS per rank at the study's setting (default eval batch, and eval_batch 50), and
    the prediction vs the measurement over ``MEMORY_TABLE`` (quick: one tiny row on the embedded set).

    ``before``: earlier ``pilab.bench.memory`` JSONs (e.g. of the same command at an older commit,
    kept under benchmarks/results/memory/); the report shows each beside the row of the same setting."""
    data = "embedded" if quick or not os.path.isfile(MEMORY_DATA) else MEMORY_DATA
    out = {"data": data, "rows": [], "table": [], "before": []}
    for path in before:
        with open(path) as f:
            out["before"].append(dict(json.load(f), file=path))
    if quick:
        settings = [dict(data=data, width=0.25, batch_size=16, threads=1, steps=2, train_subset=512,
                         test_subset=200, eval_batch=MEMORY_TABLE_EVAL_BATCH)]
    else:
        settings = [dict(data=data, **MEMORY_STUDY, eval_batch=MEMORY_TABLE_EVAL_BATCH),
                    dict(data=data, **MEMORY_STUDY)]
    # The goal is what a rank needs: malloc "lean" (pilab.models.memory); the first setting once more as a
    # rank runs where it fits ("fast": freed memory kept for the next step), to show what that costs.
    lean, fast = {"PILAB_ALLOCATOR": "lean"}, {"PILAB_ALLOCATOR": "fast"}
    for st, env in [(st, lean) for st in settings] + [(settings[0], fast)]:
        log(f"bench: memory at {st}, {env}")
        out["rows"].append(memory_job(st, mpiexec, env=env))
    table = [] if quick else [dict(data=data, width=w, batch_size=b, threads=2, steps=2, test_subset=1000,
                                   eval_batch=MEMORY_TABLE_EVAL_BATCH) for w, b in MEMORY_TABLE]
    for st in table:
        log(f"bench: memory prediction at {st}")
        out["table"].append(memory_job(st, mpiexec, env=lean))
    return out


def sync_section(quick: bool, mpiexec: str | None = None) -> dict:
    """The ``sync`` rank job (``pilab.bench.ranks --sections sync``) twice: as MPICH runs by default,
    and under ``MPIR_CVAR_ASYNC_PROGRESS=1`` (a progress thread per rank), each with its own baseline."""
    from ..launch import run_job
    env = dict(os.environ, OMP_NUM_THREADS="1")
    payload = {"sections": "sync", "quick": quick}
    out = {}
    for key, extra in (("default", {}), ("async_progress", {"MPIR_CVAR_ASYNC_PROGRESS": "1"})):
        job = run_job(2, "pilab.bench.ranks", payload, name=f"the sync job ({key})", mpiexec=mpiexec,
                      env=dict(env, **extra))
        out[key] = job["sync"]
    out["command"] = "OMP_NUM_THREADS=1 [MPIR_CVAR_ASYNC_PROGRESS=1] mpiexec -n 2 python -m pilab.bench.ranks " \
        "OUT.json --sections sync" + (" --quick" if quick else "")
    return out


def _ranks_job(quick: bool, mpiexec: str | None) -> dict:
    from ..launch import run_job
    out = run_job(2, "pilab.bench.ranks", {"quick": quick}, name="the rank job", mpiexec=mpiexec,
                  env=dict(os.environ, OMP_NUM_THREADS="1"))
    out["command"] = "OMP_NUM_THREADS=1 mpiexec -n 2 python -m pilab.bench.ranks OUT.json" + \
        (" --quick" if quick else "")
    return out
