"""BENCHMARKS.md from a ``pilab.bench.suite.run`` result: one table per section, each ratio with its spread,
judged "met" / "NOT met" against the goals the run was given (``res["goals"]``: {key: [op, value]}, e.g.
benchmarks/goals.json; pilab has no goals of its own, and without them a figure is shown unjudged).

How BENCHMARKS.md writes a figure (a ratio with its spread, milliseconds) and judges it "met" / "NOT met"
against the goals the run was given (``res["goals"]``: {key: [op, value]})::

    _judged(1.04, {"goals": {"trace_overhead": ["<=", 1.02]}}, "trace_overhead")   # 'NOT met'

The machine a benchmark ran on, for its table's header: the processor's name (x86's model name, or an Arm
board and its core type) and the load::

    from pilab.bench.report import cpu_name, machine
    machine()["cpu"]     # 'Raspberry Pi 4 Model B Rev 1.4 (Cortex-A72)'

BENCHMARKS.md's memory sections: the default run's peak per rank, and the itemised peak per rank at
each setting beside its prediction (``pilab.bench.memory``).
"""
from __future__ import annotations

import datetime
import operator
import os
import platform

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


_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


def _r(s: dict | None, digits: int = 2) -> str:
    """'median (p10-p90, n)' of a summary."""
    if not s or s.get("median") is None:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['p10'])}–{f.format(s['p90'])}, n={s['n']})"


def _ms(s: dict | None) -> str:
    if not s or s.get("median") is None:
        return "n/a"
    return f"{1e3 * s['median']:.1f} ms ({1e3 * s['p10']:.1f}–{1e3 * s['p90']:.1f})"


def _goal(s: dict | None, res: dict, key: str) -> str:
    """"met (goal >= 0.98)" for a summary's median against the run's goal ``key``; "—" without one."""
    if not s or s.get("median") is None:
        return "not measured"
    return _judged(s["median"], res, key, with_goal=True)


def _goal_words(res: dict, key: str, what: str) -> str:
    """"the peak per rank in MB <= 900" for the run's goal ``key``; "none given" without one."""
    goal = (res.get("goals") or {}).get(key)
    return f"{what} {goal[0]} {goal[1]:g}" if goal else "none given"


def _judged(value: float, res: dict, key: str, *, with_goal: bool = False) -> str:
    """"met" / "NOT met" for ``value`` against the run's goal ``key`` (with the goal in words where asked);
    "—" where the run was given no such goal."""
    goal = (res.get("goals") or {}).get(key)
    if goal is None:
        return "—"
    op, target = goal
    ok = _OPS[op](value, target)
    return ("met" if ok else "NOT met") + (f" (goal {op} {target:g})" if with_goal else "")


# Each section's part of the report, in the report's order: (the bench.json key it reads, its writer).
def _parts() -> list:
    return [("one_rank", _one_rank), ("malloc", _malloc), ("models", _models), ("data", _data), ("cache", _cache),
            ("ranks", lambda r: _comm(r.get("ranks", {}), r)), ("sync", _sync), ("trace", _trace),
            ("ranks", lambda r: _e2e(r.get("ranks", {}), r)), ("ranks", lambda r: _memory(r.get("ranks", {}))),
            ("memory", memory_per_rank), ("simulator", _simulator), ("checkpoint", _checkpoint), ("cli", _cli),
            ("perfmodel", _perfmodel), ("network", _network), ("balance", _balance),
            ("balance_accuracy", _balance_accuracy)]


_RATIOS = ("Every figure is a ratio against a baseline measured in the same run: the contenders alternate round by "
           "round (order rotated), one ratio per round, shown as **median (p10–p90, n = rounds)**. Timings on a "
           "shared machine swing by tens of percent from one run to the next; only the ratios mean anything, and a "
           "wide p10–p90 says the load dominated.")


def collected_report(folder: str, *, command: str, sections=()) -> tuple[str, list[str]]:
    """BENCHMARKS.md put together from the saved runs under ``folder`` (every ``*.json`` written by
    :func:`pilab.bench.suite.run`, at any depth): each section from the newest run that has it (by its
    machine's date), each naming the file it comes from; dates and loads stay in those files. Returns the
    text and the files used (relative to the working directory). ``sections``: the ones a full run makes
    (``pilab.bench.suite.SECTIONS``); those no saved run has are named at the end, with the command that
    measures them::

        text, used = collected_report("benchmarks/results", command="python -m pilab bench --from benchmarks/results --out .",
                                      sections=suite.SECTIONS)
    """
    import glob
    import json
    import os
    runs = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "**", "*.json"), recursive=True)):
        try:
            with open(path) as f:
                res = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(res, dict) and isinstance(res.get("machine"), dict) and "sections" in res and "command" in res:
            runs.append((res["machine"].get("date", ""), path, res))
    newest = {}
    for date, path, res in sorted(runs, key=lambda r: (r[0], r[1])):
        for key in {k for k, _ in _parts()} | {"deviation"}:
            if key in res:
                newest[key] = (path, res)
    used = sorted({path for path, _ in newest.values()})
    machines = sorted({f"{r['machine']['cpu']}, {r['machine']['cpu_count']} cores; python {r['machine']['python']}, "
                       f"torch {r['machine']['torch']}" for _, r in newest.values()})
    out = ["# pilab benchmarks", "",
           f"Made by `{command}` from the runs saved there (`python -m pilab bench --out DIR` writes one as "
           "`DIR/bench.json`); do not edit by hand. Each section names the run it comes from; its date, machine "
           "and load are in that file. " + _RATIOS, "",
           *[f"- machine: {m}" for m in machines], ""]
    for key, part in _parts():
        if key in newest:
            path, res = newest[key]
            lines = part({**res, "_from": os.path.relpath(path)})
            if lines and not any(os.path.relpath(path) in line for line in lines):  # a part that does not say where
                lines[2:2] = [f"From `{os.path.relpath(path)}` (`{res['command']}`).", ""]
            out += lines
    if "deviation" in newest and "simulator" not in newest:
        path, res = newest["deviation"]
        out += _simulator({**res, "_from": os.path.relpath(path)})
    missing = [s for s in sections if s not in newest and not (s == "simulator" and "deviation" in newest)]
    if missing:  # say what is not there, rather than let a reader take the report for the whole suite
        out += ["## Not in these runs", "",
                f"No run saved under `{folder}` has the section(s) {', '.join(f'`{s}`' for s in missing)}: "
                f"`python -m pilab bench --sections {','.join(missing)} --out DIR` measures them, and its "
                f"`DIR/bench.json` saved under `{folder}` puts them here.", ""]
    out += _gpu({})
    return "\n".join(out), used


def markdown_report(res: dict) -> str:
    m = res["machine"]
    ranks = res.get("ranks", {})
    out = [
        "# pilab benchmarks",
        "",
        "Written by `python -m pilab bench` (`pilab/bench/`); do not edit by hand — rerun it. " + _RATIOS,
        "",
        f"- machine: {m['cpu']}, {m['cpu_count']} cores ({m['usable_cores']} usable); {m['platform']}",
        f"- software: python {m['python']}, torch {m['torch']}"
        + (f", mpi4py {ranks['mpi4py']}, {ranks['mpi_library']}" if ranks else ""),
        f"- date: {m['date']}; load average (1/5/15 min) at start {', '.join(f'{x:.1f}' for x in m['loadavg_start'])}, "
        f"at end {', '.join(f'{x:.1f}' for x in m.get('loadavg_end', []))}",
        f"- command: `{res['command']}`{' (quick mode: tiny settings, not the recorded figures)' if res['quick'] else ''};"
        f" wall time {res.get('wall_s', 0):.0f} s"
        + (f"; the rank job: `{ranks['command']}`" if ranks.get("command") else ""),
        "",
    ]
    for part in (_one_rank(res), _malloc(res), _models(res), _data(res), _cache(res), _comm(ranks, res), _sync(res), _trace(res),
                 _e2e(ranks, res), _memory(ranks), memory_per_rank(res), _simulator(res), _checkpoint(res), _cli(res), _perfmodel(res),
                 _network(res), _balance(res), _balance_accuracy(res), _gpu(res)):
        out += part
    return "\n".join(out)


def _one_rank(res: dict) -> list[str]:
    out: list[str] = []
    if "one_rank" in res:
        o = res["one_rank"]
        out += ["## One rank: pilab's step vs a bare PyTorch loop", "",
                f"{o['model']} width {o['width']}, batch {o['batch']}, {o['threads']} thread; the bare loop is "
                "zero_grad / forward / loss / backward / SGD step / loss.item() on the same model, optimizer and batches.",
                "", "| figure | value |", "|---|---|",
                f"| bare step | {_ms(o['step_s']['bare'])} |", f"| pilab step | {_ms(o['step_s']['pilab'])} |",
                f"| speed ratio bare time / pilab time | {_r(o['ratio_bare_over_pilab'], 3)} — "
                f"{_goal(o['ratio_bare_over_pilab'], res, 'one_rank_bare_over_pilab')} |", ""]
    return out


def _malloc(res: dict) -> list[str]:
    m = res.get("malloc")
    if not m:
        return []
    rows = [f"| {mode} | {_ms(m[mode]['step'])} | {_r(m[mode]['faults'], 0)} | {_r(m[mode]['kernel'])} |"
            for mode in ("fast", "lean")]
    return ["## malloc: freed memory kept for the next step vs returned at once", "",
            f"{m['model']} width {m['width']}, batch {m['batch']}, {m['threads']} thread; pilab's one-rank step, "
            f"each contender a fresh process per round (malloc is per process), {m['steps']} timed steps after 2. "
            "*fast*: glibc keeps freed blocks (mmap threshold 1 GiB, no trimming) — what a rank uses where it "
            "fits; *lean*: blocks from 1 MiB up mapped on their own and returned at once — the lowest peak, "
            "for a node where fast would not fit (`pilab.engine.memory.choose_allocator`). " + _when(res), "",
            "| malloc | step | minor page faults per step | kernel share of CPU time |", "|---|---|---|---|",
            *rows, "", f"Step time lean / fast: {_r(m['ratio_lean_over_fast'])}.", ""]


def _models(res: dict) -> list[str]:
    out: list[str] = []
    if "models" in res:
        mo = res["models"]
        out += ["## Training images/s per model and memory layout", "",
                f"Batch {mo['batch']}, one thread, forward + backward + SGD step. Ratios: channels_last speed-up "
                f"(NCHW time / channels_last time) and each row's images/s relative to {mo['base']}.", "",
                f"| model | width | layout | images/s | vs {mo['base']} | channels_last speed-up |",
                "|---|---|---|---|---|---|"]
        for row in mo["rows"]:
            out.append(f"| {row['model']} | {row['width']} | {'channels_last' if row['channels_last'] else 'NCHW'} | "
                       f"{_r(row['images_per_s'], 0)} | {_r(row['vs_base'])} | "
                       f"{_r(row.get('cl_speedup')) if row['channels_last'] else ''} |")
        out.append("")
    return out


def _data(res: dict) -> list[str]:
    out: list[str] = []
    if "data" in res:
        d = res["data"]
        s = d["speedup_pilab_over_dataloader"]
        out += ["## Data: batched augmentation vs a per-sample Dataset + DataLoader", "",
                f"Batches of {d['batch']}: crop (4-px reflect pad) + flip + normalise. DataLoader with num_workers=0.",
                "", "| figure | value |", "|---|---|",
                f"| pilab ShardLoader images/s | {_r(d['images_per_s']['pilab'], 0)} |",
                f"| Dataset + DataLoader images/s | {_r(d['images_per_s']['dataloader'], 0)} |",
                f"| speed-up | {_r(s, 1)} — {_goal(s, res, 'data_speedup')} |", ""]
    return out


def _when(res: dict) -> str:
    """When and under what load a section was measured; in a report put together from saved runs
    (:func:`collected_report`), the file that says it."""
    m = res["machine"]
    if res.get("_from"):
        return f"From `{res['_from']}` (`{res['command']}`, on {m['cpu']})."
    return (f"Measured {m['date']} on {m['cpu']}, load average {m['loadavg_start'][0]:.1f} at the start "
            f"(`{res['command']}`).")


def _cache(res: dict) -> list[str]:
    c = res.get("cache")
    if not c:
        return []
    return ["## Data: decoding the data set vs the cached reload", "",
            f"{c['source']} ({c['images']:,} images): each round decodes it into an empty cache directory, then "
            "loads it again from there (uint8 arrays, checksum verified). " + _when(res), "",
            "| figure | value |", "|---|---|",
            f"| decode | {_r(c['decode_s'])} s, {_r(c['decode_images_per_s'], 0)} images/s |",
            f"| cached reload | {_ms(c['reload_s'])} |",
            f"| speed-up of the reload (decode time / reload time) | {_r(c['reload_speedup'], 0)} |", ""]


def _sync(res: dict) -> list[str]:
    s = res.get("sync")
    if not s:
        return []
    d, a = s["default"], s["async_progress"]
    out = ["## Averaging the gradients of a step (np=2, shared memory)", "",
           f"{d['model']} width {d['width']}, {d['per_rank_batch']} images per rank, one thread, buckets of "
           f"{d['bucket_mb']:g} MiB (the bucket sizes: the bucket sweep above); forward + backward + averaging, "
           f"no optimizer step; {d['rounds']} rounds x {d['steps_per_round']} steps per contender, the slower "
           "rank's step. Ratios against (a) per-tensor blocking Allreduce measured in the same job; the async "
           f"progress rows are a second job (`MPIR_CVAR_ASYNC_PROGRESS=1`, thread level {a['thread_level']}) "
           f"with its own (a). " + _when(res), "",
           "| variant | messages | MiB/step | step | exposed | step / a | exposed / a |",
           "|---|---|---|---|---|---|---|"]
    for job in (d, a):
        for r in job["rows"]:
            if job is a and r["variant"] == "a":
                continue
            out.append(f"| {r['variant']}: {r['label']} | {r['messages']} | {r['bytes_per_step'] / 2 ** 20:.2f} | "
                       f"{_ms(r['step_s'])} | {_ms(r['exposed_s'])} | {_r(r['step_vs_a'], 3)} | "
                       f"{_r(r['exposed_vs_a'])} |")
    return out + ["", f"- `{s['command']}`", ""]


def _trace(res: dict) -> list[str]:
    t = res.get("trace")
    if not t:
        return []
    st = t["step_s"]
    return ["## Recording a trace: a step with `--trace` vs without (np=2, shared memory)", "",
            f"{t['model']} width {t['width']}, {t['per_rank_batch']} images per rank, {t['threads']} thread, buckets "
            f"of {t['bucket_mb']:g} MiB: one training step (`Session.step`: data, forward, backward, averaging, "
            "optimizer, the loop's features) of two sessions in one job, one with `Config.trace` (every phase "
            "stamped, each message tested on its own to note when it completes: `pilab.trace.recorder`), "
            f"{t['rounds']} rounds x {t['steps_per_round']} steps each, alternated; the slower rank's median step "
            "per round. " + _when(res), "",
            "| figure | value |", "|---|---|",
            f"| step without trace | {_ms(st['plain'])} |",
            f"| step with trace | {_ms(st['traced'])} |",
            f"| ratio traced / plain | {_r(t['traced_over_plain'], 3)} — "
            f"{_goal(t['traced_over_plain'], res, 'trace_overhead')} |",
            "", f"- `{t['command']}`", ""]


def _cli(res: dict) -> list[str]:
    c = res.get("cli")
    if not c:
        return []
    sec, ratio = c["seconds"], c["help_over_python"]
    help_s = sec["help"]
    return ["## Command line: `python -m pilab --help`", "",
            "Each call a fresh process, alternated with `python -c pass` (the interpreter's own start-up); "
            "`--help` imports neither torch nor Bokeh nor MPI. " + _when(res), "",
            "| figure | value |", "|---|---|",
            f"| `python -c pass` | {_ms(sec['python'])} |",
            f"| `python -m pilab --help` | {_ms(help_s)} — {_goal(help_s, res, 'cli_help_s')} |",
            f"| ratio `--help` / `python -c pass` | {_r(ratio)} |", ""]


def _perfmodel(res: dict) -> list[str]:
    p = res.get("perfmodel")
    if not p:
        return []
    sp, b = p["split"], p["base"]
    out = ["## Performance model against real runs", "",
           f"Calibrated here from an np=1 run (mobilenetv2_cifar width "
           f"{b['width']}, {b['batch_size']} per rank, {b['train_subset']} images, one thread) and the Allreduce "
           f"micro-benchmark at np {', '.join(map(str, p['bench_nps']))}; each held-out run predicted (training "
           "time of the first epoch; err = (predicted - measured) / measured). *as calibrated*: all cores free; "
           "*share-aware*: the cores each job got (CPU s / wall s). " + _when(res), "",
           "| run | cores got | measured s | as calibrated s | err | share-aware s | err | eval measured s | "
           "predicted s | err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        out.append(f"| {r['run']} | {r['cores_got']:.2f} | {r['measured_time']:.2f} | {r['predicted_time_idle']:.2f} | "
                   f"{r['err_idle_pct']:+.0f}% | {r['predicted_time_share_aware']:.2f} | "
                   f"{r['err_share_aware_pct']:+.0f}% | {r['measured_eval']:.2f} | "
                   f"{r['predicted_eval_share_aware']:.2f} | {r['err_eval_pct']:+.0f}% |")
    sm = p["summary"]
    within = (res.get("goals") or {}).get("perfmodel_error_pct")  # [op, percent]

    def errs(key):
        n = sum(_OPS[within[0]](abs(r[key]), within[1]) for r in p["rows"]) if within else None
        return f"{sm[key]['median_abs']:.0f}%" + (f" ({n}/{sm[key]['n']} within {within[1]:g}%)" if within else "")
    out += ["", f"Median |err|: as calibrated {errs('err_idle_pct')}, share-aware {errs('err_share_aware_pct')}. "
            + f"Compute split over {len(sp['rows'])} (width, batch) points: {sp['flops_per_activation']:.0f} FLOPs "
            f"per activation (model: {sp['model_constants']['flops_per_activation']:.0f}), step work per tensor "
            f"{sp['step_work_per_tensor']:.3g} (model: {sp['model_constants']['step_work_per_tensor']:.3g}).", ""]
    return out


def _network(res: dict) -> list[str]:
    n = res.get("network")
    if not n:
        return []
    from ..perfmodel.check import markdown
    return markdown(n, _when(res))


def _balance(res: dict) -> list[str]:
    b = res.get("balance")
    if not b:
        return []
    from .balance import markdown
    return markdown(b, _when(res))


def _balance_accuracy(res: dict) -> list[str]:
    a = res.get("balance_accuracy")
    if not a:
        return []
    from .balance import accuracy_markdown
    return accuracy_markdown(a, _when(res))


def _comm(ranks: dict, res: dict) -> list[str]:
    out: list[str] = []
    if ranks.get("comm"):
        c = ranks["comm"]
        bw = c["bandwidth"]
        out += ["## Communication (np=2, shared memory)", "",
                f"Gradients of the e2e model: {bw['bytes'] / 2 ** 20:.1f} MiB in {bw['buckets']} bucket(s) of 1 MiB "
                "(GradSync sends buckets that are ready together as one message). " + _when(res),
                "", "| figure | value |", "|---|---|",
                f"| raw Allreduce GB/s | {_r(bw['raw_gb_per_s'])} |",
                f"| GradSync exchange GB/s (all buckets, no overlap) | {_r(bw['gradsync_gb_per_s'])} |",
                f"| effective bandwidth ratio GradSync / raw | {_r(bw['effective_bw_ratio'])} — "
                f"{_goal(bw['effective_bw_ratio'], res, 'comm_effective_bw_ratio')} |"]
        if "bare_iallreduce_vs_raw" in bw:  # where the gap is: MPI's non-blocking path, or GradSync
            out += [f"| bare mpi4py Iallreduce of the same buckets + Waitall GB/s | {_r(bw['iallreduce_gb_per_s'])} |",
                    f"| bandwidth ratio bare Iallreduce / raw (MPI's non-blocking path) | "
                    f"{_r(bw['bare_iallreduce_vs_raw'])} |",
                    f"| bandwidth ratio GradSync / bare Iallreduce (GradSync's own cost) | "
                    f"{_r(bw['gradsync_vs_bare_iallreduce'])} |"]
        out += ["",
                "Bucket sweep (forward + backward + exchange, no optimizer):", "",
                "| bucket MiB | buckets | step | step vs 1 MiB | exposed | share hidden behind backward |",
                "|---|---|---|---|---|---|"]
        for mb, row in c["bucket_sweep"].items():
            ref = next(k for k in row if k.startswith("step_vs_"))
            out.append(f"| {mb} | {row['buckets']} | {_ms(row['step_s'])} | {_r(row[ref])} | "
                       f"{_ms(row['exposed_s'])} | {_r(row['hidden_share'])} |")
        mi = c["micro"]
        out += ["", f"Small costs of one step: copying all gradients into buckets and back "
                f"{1e3 * mi['copy_in_and_out_s']:.2f} ms (what gradient views remove); one Testall "
                f"{1e6 * mi['testall_call_s']:.1f} µs (× {mi['testall_calls_per_step_before']} per step before, "
                f"~1 per 8 gradients now); loss.item() on CPU {1e6 * mi['item_s']:.1f} µs; a blocking 6-value "
                f"Allreduce {1e6 * mi['tiny_allreduce_s']:.0f} µs.", ""]
    return out


def _e2e(ranks: dict, res: dict) -> list[str]:
    out: list[str] = []
    if ranks.get("e2e"):
        e = ranks["e2e"]
        r, st = e["ratios"], e["step_s"]
        out += ["## End to end at np=2: one synchronous step", "",
                f"{e['model']} width {e['width']}, {e['per_rank_batch']} images per rank, {e['threads']} thread per "
                f"rank, channels_last, {e['rounds']} rounds × {e['steps_per_round']} steps per contender (median step of "
                "the slower rank). *ceiling*: no exchange; *floor*: plus one 8-byte Allreduce per step; *DDP-gloo*: "
                "torch DDP (defaults, broadcast_buffers=False) over gloo on 127.0.0.1; *np=1*: rank 0 alone "
                "(rank 1 asleep). " + _when(res), "",
                "| contender | step |", "|---|---|"]
        for k in ("ceiling", "floor", "pilab", "ddp_gloo", "np1"):
            out.append(f"| {k} | {_ms(st.get(k))} |")
        out += ["", "| ratio | median (p10–p90) | goal |", "|---|---|---|",
                f"| pilab / floor | {_r(r['pilab_over_floor'], 3)} | {_goal(r['pilab_over_floor'], res, 'e2e_pilab_over_floor')} |",
                f"| pilab / DDP-gloo | {_r(r['pilab_over_ddp'], 3)} | {_goal(r['pilab_over_ddp'], res, 'e2e_pilab_over_ddp')} |",
                f"| strong-scaling efficiency np=1→2 (t1 / t2) | {_r(r['scaling_efficiency'], 3)} | "
                f"{_goal(r['scaling_efficiency'], res, 'e2e_scaling_efficiency')} |",
                f"| pilab / ceiling | {_r(r['pilab_over_ceiling'], 3)} | |",
                f"| floor / ceiling (the cost of synchronising at all) | {_r(r['floor_over_ceiling'], 3)} | |",
                f"| DDP-gloo / ceiling | {_r(r['ddp_over_ceiling'], 3)} | |", ""]
        p = e["pilab_step_parts"]
        out += ["pilab's own step timings (StepResult, this run): "
                + ", ".join(f"{k} {_ms(p[k])}" for k in ("time", "compute", "comm_exposed", "comm_wait", "data"))
                + f". GC during the pilab steps: {e['gc']['collections']} collections, "
                f"{1e3 * e['gc']['total_s']:.1f} ms in {e['gc']['pilab_steps']} steps.", ""]
    return out


def _simulator(res: dict) -> list[str]:
    out: list[str] = []
    if "simulator" in res:
        s = res["simulator"]
        g = s["goals"]
        out += ["## Simulator against one process on the global batch", "",
                f"One step of `VirtualRanks(np)` in each `simulate_mode` against one process training the same global "
                f"batch (np × b images, `MPIRanks(None)`), {s['threads']} threads, {s['rounds']} alternated rounds: "
                f"the ratio per round, median (p10–p90), by the process's own CPU time (all its threads; other jobs "
                f"on a shared machine swing it far less) and by wall time. Goals: fast ≤ {g['fast']:.2f}, "
                f"exact ≤ {g['exact']:.2f}; judged on CPU time, wall beside it.", "",
                "| model | b × np | global step: wall, CPU | fast / global: CPU, wall | exact / global: CPU, wall "
                "| goals (CPU) | load |", "|---|---|---|---|---|---|---|"]
        for row in s["rows"]:
            out.append(_simulator_row(row))
        out.append("")
    d = res.get("deviation")
    if "simulator" in res and not d:
        out += ["The fast mode's deviation from the exact path after 100 steps at np=48 is measured by "
                "`python -m pilab bench --sections deviation` (~7 min here) and stated in docs/simulator.md.", ""]
    if d:
        out += [f"Deviation of fast from exact after {d['steps']} steps at np={d['np']} ({d['model']} width "
                    f"{d['width']}, {d['per_rank_batch']} per rank): max |Δw| {d['max_abs_param_diff']:.2e}, "
                    f"‖Δw‖ / ‖w_exact − w_0‖ {d['rel_param_diff']:.2e}, mean loss of the last 10 steps "
                    f"{d['loss_last10_exact']:.4f} (exact) vs {d['loss_last10_fast']:.4f} (fast), largest per-step "
                    f"loss difference {d['max_step_loss_diff']:.2e}."]
        out.append("")
    return out


def _simulator_row(row: dict) -> str:
    if "skipped" in row:
        return f"| {row['model']} {row['width']:g} | {row['per_rank_batch']} × {row['np']} | skipped: {row['skipped']} ||||| "
    cpu = row.get("ratio_cpu")  # absent in runs before the CPU clock
    met = ", ".join(f"{m} {'met' if ok else 'missed'}" for m, ok in row.get("met_cpu", row["met"]).items())
    load = row.get("loadavg")

    def both(m):
        return f"{_r(cpu[m]) if cpu else '—'}; {_r(row['ratio'][m])}"
    glob = _ms(row["step_s"]["global"]) + (f"; {_ms(row['cpu_s']['global'])}" if "cpu_s" in row else "")
    return (f"| {row['model']} {row['width']:g} | {row['per_rank_batch']} × {row['np']} | {glob} | {both('fast')} | "
            f"{both('exact')} | {met} | {f'{load[0]:.1f}–{load[1]:.1f}' if load else '—'} |")


def _checkpoint(res: dict) -> list[str]:
    c = res.get("checkpoint")
    if not c:
        return []
    return ["## One mid-epoch checkpoint", "",
            f"{c['model']} width {c['width']}: one save (every rank's state gathered, checksummed, written, "
            f"fsynced, renamed) takes {_ms(c['save_s'])} and {c['bytes'] / 2 ** 20:.1f} MiB; at the multi-node "
            f"default of one every {c['interval_min']:g} minutes that is {100 * c['share_of_interval']:.3f}% of "
            "the run (the issue's bound: 2%).", ""]


def _gpu(res: dict) -> list[str]:
    out: list[str] = []
    out += ["## GPU", "",
            "Not measured yet. `scripts/gpu_check.py` runs the full-size check on a machine with a GPU (10 epochs "
            "of mobilenetv2_cifar on the 50,000 images, np=1 at batch 64 and simulated np=48 at 64 per rank).", ""]
    return out


def _memory(ranks: dict) -> list[str]:
    out: list[str] = []
    if ranks.get("memory"):
        mem = ranks["memory"]
        sh = mem["shards"]
        out += ["## Memory", "",
                f"Peak RSS per rank of the default run ({mem['config']}, np=2): "
                + ", ".join(f"{x:.0f} MiB" for x in mem["peak_rss_mb_per_rank"]) + ". "
                + "Shards: " + "; ".join(f"rank {s['rank']} loader holds {s['loader_images']} of {s['train_images']} "
                                         f"images ({s['loader_mb']:.1f} of {s['full_train_set_mb']:.1f} MiB)" for s in sh)
                + (". The Session still references the whole training array (the data set object), so a rank "
                   "holds its shard *and* the full set." if any(s["session_keeps_full_train_array"] for s in sh) else
                   ". Nothing else in the rank keeps the other ranks' images (the Session drops the full set once "
                   "its loader has copied the shard; tests/test_mpi.py checks it)."),
                ""]
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:.0f}"


def _memory_setting(row: dict) -> tuple:
    """What makes two memory runs comparable: the settings on their command line."""
    c = row["config"]
    return tuple(c.get(k) for k in ("data", "model", "width", "batch_size", "threads", "eval_batch",
                                    "train_subset", "test_subset")) + (row.get("steps"), row.get("np"))


def memory_per_rank(res: dict) -> list[str]:
    mem = res.get("memory")
    if not mem:
        return []
    before = {_memory_setting(b): b for b in mem.get("before", [])}
    m = res["machine"]
    out = ["## Memory per rank", "",
           f"Peak RSS of each rank (VmHWM, MB = 10^6 bytes), itemised, two real ranks (`mpiexec -n 2`) on "
           f"{mem['data']}; " + (f"from `{res['_from']}`" if res.get("_from") else f"measured {m['date']}") + f" on {m['cpu']}. Runtime: python + torch + mpi4py imported; data: "
           "the rank's shard (uint8) and its share of the test set; model: parameters, gradient buckets, momentum; "
           "activations: what autograd saved in a step's forward; allocator: the rest of the peak (the code "
           "pages of the kernels a step ran, oneDNN's caches, glibc's free lists, gradients in flight). Goal: "
           + _goal_words(res, "memory_peak_mb", "the peak per rank in MB")
           + " at the study's setting with malloc lean (what a rank needs; a rank keeps "
           "freed memory for its next step, malloc fast, where the node has room: "
           "`pilab.engine.memory.choose_allocator`).", "",
           "| setting | runtime | data | model | activations | allocator | peak (load / set-up / train / eval) | "
           "predicted | goal |" + (" before |" if before else ""), "|---|---|---|---|---|---|---|---|---|"
           + ("---|" if before else "")]
    shown = []
    for row in mem["rows"]:
        c = row["config"]
        r = max(row["ranks"], key=lambda x: x["peak"])
        ph = r["phases"]
        was = before.get(_memory_setting(row))
        if was is not None:
            shown.append(was)
        malloc = row.get("malloc", "lean")
        out.append(f"| width {c['width']}, {c['batch_size']} per rank, {c['threads']} threads, eval batch "
                   f"{c['eval_batch']}, malloc {malloc} | {_mb(r['runtime'])} | {_mb(r['data'])} | {_mb(r['model'])} | "
                   f"{_mb(r['activations'])} | {_mb(r['allocator'])} | **{_mb(r['peak'])}** ({_mb(ph['load'])} / "
                   f"{_mb(ph['setup'])} / {_mb(ph['train'])} / {_mb(ph['eval'])}) | {_mb(row['predicted']['peak'])} | "
                   f"{_judged(r['peak'] / 1e6, res, 'memory_peak_mb') if malloc == 'lean' else 'n/a'} |"
                   + (f" {_before_cell(was)} |" if before else ""))
    out += [""] + [f"- `{row['command']}`" for row in mem["rows"]] + [""]
    if shown:
        out += ["Before: the same command's figures in " + ", ".join(f"`{b['file']}`" for b in shown)
                + " (runtime / data / model / activations / allocator: peak).", ""]
    if mem["table"]:
        out += ["The prediction (`pilab.engine.memory.predict_peak_bytes`) against the measured peak, 3 widths x 2 "
                "batch sizes (full training set, 1,000 test images, eval batch 50, 2 threads, 2 steps; the "
                "larger rank's peak):", "", "| width | per rank | measured MB | predicted MB | error |",
                "|---|---|---|---|---|"]
        worst = 0.0
        for row in mem["table"]:
            c = row["config"]
            meas = max(r["peak"] for r in row["ranks"])
            err = row["predicted"]["peak"] / meas - 1
            worst = max(worst, abs(err))
            out.append(f"| {c['width']} | {c['batch_size']} | {_mb(meas)} | {_mb(row['predicted']['peak'])} | "
                       f"{100 * err:+.1f}% |")
        out += ["", f"Largest error {100 * worst:.1f}% — {_judged(worst, res, 'memory_prediction_error', with_goal=True)}. "
                f"Each row: `{mem['table'][0]['command']}` with its width and batch size.", ""]
    return out


def _before_cell(was: dict | None) -> str:
    if was is None:
        return "—"
    r = max(was["ranks"], key=lambda x: x["peak"])
    items = " / ".join(_mb(r[k]) for k in ("runtime", "data", "model", "activations", "allocator"))
    return f"{items}: **{_mb(r['peak'])}**"
