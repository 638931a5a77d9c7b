"""BENCHMARKS.md's memory sections: the default run's peak per rank, and the itemised peak per rank at
each setting beside its prediction (``pilab.bench.memory``)."""
from __future__ import annotations

from .judging import _goal_words, _judged


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


def _memory_per_rank(res: dict) -> list[str]:
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
