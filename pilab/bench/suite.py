"""The benchmark run itself (``python -m pilab bench``; :mod:`pilab.bench` says what each section measures)::

    from pilab.bench import suite
    suite.run(quick=True, sections=("sync",), out="runs/bench", markdown="runs/bench/BENCHMARKS.md")
"""
from __future__ import annotations

import json
import os
import time

from ..config import Config
from ..files import atomic_write_text, save_json
from .report import machine


SECTIONS = ("one_rank", "malloc", "models", "data", "cache", "simulator", "checkpoint", "cli", "ranks", "sync",
            "trace", "memory")
# not in the default run: the fast mode's 100-step deviation (~7 min here), the performance model
# against real runs (~4 min), its network half on a testbed (~15 min, root), uneven shares against a
# throttled node on a testbed (~15 min, root), and the final accuracy of uneven against equal shares (the
# simulator, 3 seeds: ~40 min on 2 busy cores; apart from balance, whose timed runs want a quiet machine)
EXTRA_SECTIONS = ("deviation", "perfmodel", "network", "balance", "balance_accuracy")


def run(*, quick: bool = False, sections=SECTIONS, out: str = "runs/bench", markdown: str | None = "BENCHMARKS.md",
        mpiexec: str | None = None, command: str = "python -m pilab bench", log=print, before=(),
        goals: dict | None = None, simulator_models=None, simulator_rounds: int | None = None) -> dict:
    """Run ``sections``; writes ``<out>/bench.json`` and (unless None) ``markdown``; returns the dict.
    ``before``: paths of earlier ``pilab.bench.memory`` JSONs, shown beside this run's peaks. ``goals``:
    {key: [op, value]} the report judges figures against (e.g. benchmarks/goals.json; pilab has none).
    ``simulator_models``: [(model, width)] of the simulator section's grid (default: its three);
    ``simulator_rounds``: its alternated rounds (default 5, quick 3)."""
    import torch

    torch.set_num_threads(1)
    res = {"quick": quick, "command": command, "machine": machine(), "sections": list(sections),
           "goals": dict(goals or {})}
    t_all = time.perf_counter()
    sim = (simulator_models, simulator_rounds)
    plan = _plan(quick, mpiexec, log, before, out, command, sim)
    for name in [s for s in plan if s in sections]:
        fn = plan[name]()
        if isinstance(fn, str):  # a section that cannot run here says why
            log(f"bench: {name} skipped: {fn}")
            res["sections"].remove(name)
            continue
        log(f"bench: {name} ...")
        t = time.perf_counter()
        res[name] = fn()
        res[name]["wall_s"] = time.perf_counter() - t
        log(f"bench: {name} done in {res[name]['wall_s']:.0f} s")
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_all
    if out:
        save_json(res, os.path.join(out, "bench.json"))
    if markdown:
        _write_markdown(res, sections, markdown)
    return res


def _write_markdown(res: dict, sections, markdown: str) -> None:
    from .report import markdown_report
    text = markdown_report(res)
    if not set(SECTIONS) <= set(sections) and os.path.isfile(markdown):
        # some sections only: replace theirs in the existing report, keep the others' figures
        with open(markdown) as f:
            text = splice_sections(f.read(), text)
    atomic_write_text(markdown, text)


def splice_sections(old: str, new: str) -> str:
    """``old`` with every ``## `` section that ``new`` has replaced by ``new``'s (new ones go before
    ``## GPU``, or at the end); the header and the other sections of ``old`` stay."""
    def split(text):
        head, parts, cur = [], {}, None
        order = []
        for line in text.splitlines():
            if line.startswith("## "):
                cur = line
                order.append(cur)
                parts[cur] = [line]
            elif cur is None:
                head.append(line)
            else:
                parts[cur].append(line)
        return head, order, parts
    head, order, parts = split(old)
    _, new_order, new_parts = split(new)
    for title in new_order:
        if title == "## GPU" and title in parts:
            continue
        if title not in parts:
            order.insert(order.index("## GPU") if "## GPU" in order else len(order), title)
        parts[title] = new_parts[title]
    return "\n".join(head + [line for t in order for line in parts[t]]) + "\n"


def _plan(q: bool, mpiexec, log, before, out, command, sim=(None, None)) -> dict:
    """{section: a function giving the section's runner (or a line saying why it cannot run)}, in order."""
    from . import local

    def cfg(**kw):
        return Config(threads=1, **kw)
    dcfg = cfg(width=0.25, batch_size=4, lr=0.05, lr_ref_batch=64)
    step = dict(width=0.25 if q else 1.0, batch_size=16 if q else 64, train_subset=512 if q else 0)
    models = [("mobilenetv2_cifar", 0.25), ("mobilenetv2", 0.25), ("squeezenet1_1", 1.0)] if q else local.MODELS
    archive = os.environ.get("PILAB_CIFAR_ARCHIVE") or MEMORY_DATA
    source = archive if not q and os.path.isfile(archive) else "embedded"
    return {
        "one_rank": lambda: lambda: local.one_rank(cfg(**step), 5 if q else 10, 2 if q else 3),
        "malloc": lambda: lambda: local.malloc(cfg(**step), 2 if q else 5, 2 if q else 4),
        "models": lambda: lambda: local.models(16 if q else 64, 5, 1 if q else 2, models),
        "data": lambda: lambda: local.data_path(64, 5 if q else 7, 4 if q else 10),
        "simulator": lambda: lambda: local.simulator(_simulator_cases(q, sim[0]), sim[1] or (3 if q else 5),
                                                     progress=_partial(out, "simulator")),
        "checkpoint": lambda: lambda: local.checkpoint_cost(
            cfg(width=0.25 if q else 1.0, batch_size=16, train_subset=512), 3 if q else 5),
        "deviation": lambda: lambda: local.fast_deviation(dcfg, 8 if q else 48, 10 if q else 100),
        "cli": lambda: lambda: local.cli_startup(5 if q else 10),
        "cache": lambda: lambda: local.cache(source, 3),
        "ranks": lambda: lambda: _ranks_job(q, mpiexec),
        "sync": lambda: lambda: sync_section(q, mpiexec),
        "trace": lambda: lambda: trace_section(q, mpiexec),
        "memory": lambda: lambda: memory_section(q, mpiexec, log=log, before=before),
        "perfmodel": lambda: _perfmodel_section(q, mpiexec, log),
        "network": lambda: _network_section(q, mpiexec, log, out, command),
        "balance": lambda: _balance_section(q, mpiexec, log),
        "balance_accuracy": lambda: _balance_accuracy_section(q, log),
    }


SIMULATOR_MODELS = (("mobilenetv2_cifar", 0.25), ("mobilenetv2_cifar", 1.0), ("squeezenet1_1", 1.0))


def _simulator_cases(quick: bool, models=None) -> list[tuple]:
    """(model, width, per-rank batch, np) of the simulator section (its grid; quick: its corners
    of the first model)."""
    models = list(models or SIMULATOR_MODELS)
    if quick:
        return [(*models[0], b, 48) for b in (4, 32)]
    return [(m, w, b, np_) for m, w in models for np_ in (8, 48) for b in (4, 8, 16, 32, 64)]


def _partial(out: str | None, name: str):
    """A section's ``progress`` callback: its rows so far in ``<out>/<name>.partial.json`` (a long
    section stopped part-way keeps what it measured)."""
    if not out:
        return None
    return lambda res: save_json(res, os.path.join(out, f"{name}.partial.json"))


def _perfmodel_section(q: bool, mpiexec, log):
    from ..perfmodel import check as perfmodel
    return lambda: perfmodel.section(q, mpiexec, log=log)


def _balance_section(q: bool, mpiexec, log):
    from . import balance
    why = balance.unavailable()
    if why:
        return why
    return lambda: balance.section(q, mpiexec=mpiexec, log=log)


def _balance_accuracy_section(q: bool, log):
    from . import balance
    return lambda: balance.accuracy(q, log=log)


def _network_section(q: bool, mpiexec, log, out, command):
    from . import network
    why = network.unavailable()
    if why:
        return why
    work = os.path.join(out, "network") if out else None

    def measured_and_analysed():
        from ..perfmodel.check import analyse
        data = network.section(q, work=work, mpiexec=mpiexec, log=log, command=command)
        data["analysis"] = analyse(data)  # the model's side, from the measurements alone
        return data
    return measured_and_analysed


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
    # The goal is what a rank needs: malloc "lean" (pilab.engine.memory); the first setting once more as a
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
    """The ``sync`` rank job (``pilab.bench.mpijobs --sections sync``) twice: as MPICH runs by default,
    and under ``MPIR_CVAR_ASYNC_PROGRESS=1`` (a progress thread per rank), each with its own baseline."""
    from ..launch import run_job
    env = dict(os.environ, OMP_NUM_THREADS="1")
    payload = {"sections": "sync", "quick": quick}
    out = {}
    for key, extra in (("default", {}), ("async_progress", {"MPIR_CVAR_ASYNC_PROGRESS": "1"})):
        job = run_job(2, "pilab.bench.mpijobs", payload, name=f"the sync job ({key})", mpiexec=mpiexec,
                      env=dict(env, **extra))
        out[key] = job["sync"]
    out["command"] = "OMP_NUM_THREADS=1 [MPIR_CVAR_ASYNC_PROGRESS=1] mpiexec -n 2 python -m pilab.bench.mpijobs " \
        "OUT.json --sections sync" + (" --quick" if quick else "")
    return out


def trace_section(quick: bool, mpiexec: str | None = None) -> dict:
    """The ``trace`` rank job (``pilab.bench.mpijobs --sections trace``): a step with ``--trace`` vs without."""
    from ..launch import run_job
    job = run_job(2, "pilab.bench.mpijobs", {"sections": "trace", "quick": quick}, name="the trace job",
                  mpiexec=mpiexec, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = job["trace"]
    out["command"] = "OMP_NUM_THREADS=1 mpiexec -n 2 python -m pilab.bench.mpijobs OUT.json --sections trace" + \
        (" --quick" if quick else "")
    return out


def _ranks_job(quick: bool, mpiexec: str | None) -> dict:
    from ..launch import run_job
    out = run_job(2, "pilab.bench.mpijobs", {"quick": quick}, name="the rank job", mpiexec=mpiexec,
                  env=dict(os.environ, OMP_NUM_THREADS="1"))
    out["command"] = "OMP_NUM_THREADS=1 mpiexec -n 2 python -m pilab.bench.mpijobs OUT.json" + \
        (" --quick" if quick else "")
    return out
