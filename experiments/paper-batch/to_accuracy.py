"""The time to np=1's accuracy (issue 54): np=48 at 32 images per rank trains until its test accuracy
reaches the target (np=1's committed 0.785, or the same recipe's np=1 if higher), on each seed, as one run
that is extended epoch by epoch (10, 12, 15, 20 ...) without starting again; beside every accuracy the
optimizer steps and images it took and the predicted Pi wall-clock against np=1's 10 epochs on one node.

How a run is extended without restarting: the recipe's schedule is warmup-stable-decay (``schedule="wsd"``,
``decay_epochs=D``). Up to its decay, such a run's learning rates, data order and state do not depend on how
long it will be, so one *trunk* per seed trains the stable phase and is checkpointed at every epoch; the
run of E epochs is its checkpoint after E - D epochs followed by a D-epoch *branch* that decays the lr to 0
(``pilab.engine.checkpoint.stable_phase`` lets it resume with ``epochs=E``). The branch is the very run a
plan of E epochs from the start makes, bit for bit (tests/test_fewstep.py): extending from E to E' costs the
E' - E new stable epochs and one more D-epoch decay, not a new run. A cosine or linear schedule cannot do
this: its lr at every step depends on the run's length, so a longer run is another run from step 0.

Folders (all resumable: run the same command again after an interruption)::

    OUT/<candidate>/np48-seed<S>/trunk/          the stable phase (checkpoint.pt, result.json so far)
    OUT/<candidate>/np48-seed<S>/e012/fork.pt    the trunk's checkpoint after 12 - D epochs
    OUT/<candidate>/np48-seed<S>/e012/result.json  the 12-epoch run (the trunk's epochs, then the decay)
    OUT/<candidate>/np1-seed<S>/result.json      the recipe's np=1, 10 epochs (the target if higher)
    OUT/table.md, OUT/to_accuracy.png            python experiments/paper-batch/to_accuracy.py --table OUT
    the fixed-budget points (np=1, 10 epochs at the large np) into the screen's table:
                                                 python experiments/paper-batch/to_accuracy.py --export OUT DEST

A tiny run of the code path (seconds)::

    python experiments/paper-batch/to_accuracy.py --data embedded --train-subset 192 --test-subset 100 \\
        --nps 4 --candidate "muon 0.004 wsd 3" --ladder 4,5 --seeds 0 --np1-seeds 0 --epochs-np1 4 --out runs/tta
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import screen  # noqa: E402 -- the candidates, the protocol, the point folders, the lock

TARGET = 0.785  # np=1's committed 10-epoch accuracy (experiments/paper-size/naive/np1)
HORIZON = 200  # the trunk's nominal epochs: it stops (max_steps) long before its own decay would begin
_DS = None  # the decoded data, loaded before the workers fork


def base_config(a, name: str, seed: int, epochs: int) -> dict:
    return {**screen.PROTOCOL, **screen.CANDIDATES[name], "epochs": epochs, "seed": seed, "data": a.data,
            "train_subset": a.train_subset, "test_subset": a.test_subset, "device": "cpu",
            "simulate_mode": a.simulate_mode, "threads": a.threads, "checkpoint_every": 1, "keep": 1,
            "checkpoint_minutes": a.checkpoint_minutes}


def _train(cfg_dict: dict, np_: int, out: str, resume: str, where: str, max_steps: int = 0) -> dict:
    from pilab.config import Config
    from pilab import engine
    cfg = Config(**{**cfg_dict, "out": out, "resume": resume, "max_steps": max_steps})
    cpu0 = time.process_time()

    def log(e: dict) -> None:
        if e["kind"] == "epoch":
            print(f"to_accuracy: {where}: epoch {e['epoch']} test acc {e['test_acc']:.4f} ({e['time']:.0f} s; "
                  f"{time.process_time() - cpu0:.0f} CPU s)", flush=True)
    print(f"to_accuracy: {where}: {'resumes from ' + resume if resume else 'starts'}", flush=True)
    r, _ = engine.fit(cfg, engine.VirtualRanks(np_), data=_DS, callbacks=[log])
    if r.get("stopped_early"):
        raise RuntimeError(f"{where} stopped early: {r.get('stop_reason')}")
    return r


def ladder_job(job: dict) -> dict:
    """One seed's ladder at the large np, in a worker: for each E the trunk extended to E - D epochs (its
    checkpoint kept as the branch's fork.pt), then the branch to E; it stops at the first E whose accuracy
    reaches the target. Returns {E: final test accuracy} (or the error)."""
    import torch

    from pilab import data as data_mod
    from pilab.engine import checkpoint
    torch.set_num_threads(max(1, job["threads"]))
    seed, np_, d = job["seed"], job["np"], job["decay"]
    home = os.path.join(job["out"], screen.slug(job["candidate"]), f"np{np_}-seed{seed}")
    trunk = os.path.join(home, "trunk")
    spe = data_mod.epoch_accounting(_DS.y_train, np_, job["config"]["batch_size"], job["config"].get(
        "sharding", "static"), seed=seed)["steps"]
    done: dict = {}
    try:
        for e in job["ladder"]:
            branch = os.path.join(home, f"e{e:03d}")
            r = screen.finished(os.path.join(branch, "result.json"))
            if r is None:
                fork = os.path.join(branch, "fork.pt") if e > d else ""  # a run all decay starts from scratch
                if fork and not os.path.exists(fork):
                    ck = checkpoint.read(checkpoint.latest(trunk)) if checkpoint.latest(trunk) else {"epoch": 0}
                    have = (int(ck["epoch"]), int(ck.get("step_in_epoch") or 0))
                    if have > (e - d, 0):
                        raise RuntimeError(f"{trunk} is past epoch {e - d} and {fork} is missing; start that seed again")
                    if have < (e - d, 0):
                        _train({**job["config"], "epochs": HORIZON}, np_, trunk, checkpoint.latest(trunk) or "",
                               f"np={np_} seed {seed} trunk to epoch {e - d}", max_steps=(e - d) * spe)
                    os.makedirs(branch, exist_ok=True)
                    shutil.copyfile(checkpoint.latest(trunk), fork + ".tmp")
                    os.replace(fork + ".tmp", fork)
                r = _train({**job["config"], "epochs": e}, np_, branch, checkpoint.latest(branch) or fork,
                           f"np={np_} seed {seed} {e} epochs")
            done[e] = r["epochs"][-1]["test_acc"]
            # the recipe's np=1, where it has finished (another worker runs it) and is higher, is the target
            target = max(job["target"], target_for(job["out"], job["candidate"], job["target"]))
            print(f"to_accuracy: np={np_} seed {seed}: {e} epochs -> {done[e]:.4f} (target {target:.4f})", flush=True)
            if done[e] >= target:
                break
        return {**job, "reached": done, "error": None}
    except Exception as ex:  # noqa: BLE001 -- report and go on with the other seeds
        return {**job, "reached": done, "error": repr(ex)[:500]}


def np1_job(job: dict) -> dict:
    """The recipe's np=1 for ``--epochs-np1`` epochs (a screen-style point, resumed from its checkpoint)."""
    import torch

    from pilab.engine import checkpoint
    torch.set_num_threads(max(1, job["threads"]))
    d = os.path.join(job["out"], screen.slug(job["candidate"]), f"np1-seed{job['seed']}")
    try:
        r = screen.finished(os.path.join(d, "result.json")) or _train(
            job["config"], 1, d, checkpoint.latest(d) or "", f"np=1 seed {job['seed']}")
        return {**job, "reached": {job["config"]["epochs"]: r["epochs"][-1]["test_acc"]}, "error": None}
    except Exception as ex:  # noqa: BLE001
        return {**job, "reached": {}, "error": repr(ex)[:500]}


def target_for(out: str, name: str, target: float = TARGET) -> float:
    """``target``, or the recipe's np=1 mean over its finished seeds where that is higher."""
    ones = [r["epochs"][-1]["test_acc"] for r in _np1_points(out, name)]
    return max([target] + ([sum(ones) / len(ones)] if ones else []))


def _np1_points(out: str, name: str) -> list[dict]:
    d = os.path.join(out, screen.slug(name))
    found = [screen.finished(os.path.join(d, p, "result.json")) for p in sorted(os.listdir(d))
             if p.startswith("np1-seed")] if os.path.isdir(d) else []
    return [r for r in found if r is not None]


def branches(out: str) -> dict:
    """{candidate slug: {np: {seed: {epochs: result.json}}}} of the finished branches under ``out``."""
    found: dict = {}
    for cand in sorted(os.listdir(out)):
        cdir = os.path.join(out, cand)
        for point in sorted(os.listdir(cdir)) if os.path.isdir(cdir) else ():
            if not point.startswith("np") or point.startswith("np1-"):
                continue
            np_, seed = (int(x) for x in point[2:].split("-seed"))
            for b in sorted(os.listdir(os.path.join(cdir, point))):
                r = screen.finished(os.path.join(cdir, point, b, "result.json")) if b.startswith("e") else None
                if r is not None:
                    found.setdefault(cand, {}).setdefault(np_, {}).setdefault(seed, {})[len(r["epochs"])] = r
    return found


def _one_node(r: dict) -> float:
    """Seconds ``r``'s whole run takes on one Pi node (2 ranks: the study's baseline), evaluation included."""
    tr, ev = _pi_times(r, 2)
    return len(r["epochs"]) * (tr + ev)


def _pi_times(r: dict, np_: int) -> tuple[float, float]:
    """(training, evaluation) seconds of one epoch of ``r``'s Config on the Pi cluster at ``np_`` ranks."""
    from dataclasses import replace

    from pilab import perfmodel
    from pilab.config import Config
    from pilab.study.analysis import sized_for_model
    cfg = replace(sized_for_model(Config.from_dict(r["config"]), {np_: r}), threads=0, out="", resume="", max_steps=0)
    p = perfmodel.predict(cfg, np_, screen.CLUSTER)
    return p["time"], p["eval_time"]


def table(out: str, target: float = TARGET) -> str:
    """``OUT/table.md`` (and ``OUT/to_accuracy.png``): per candidate, each extended length E at the large np
    -- steps, images, every seed's test accuracy, their mean, how many reach the target, the predicted Pi
    wall-clock of the run and its speedup over np=1's run on one node (np=1's 10 epochs at one node's
    predicted epoch time: 2 ranks, the study's baseline) -- and the recipe's np=1 itself."""
    import torch
    torch.set_num_threads(1)  # the performance model's probe forward: no OpenMP pool a later fork inherits
    lines = []
    ref = screen.finished(screen.REFERENCE_NP1)
    for cand, by_np in branches(out).items():
        name = next((n for n in screen.CANDIDATES if screen.slug(n) == cand), cand)
        ones = _np1_points(out, name)
        tgt = max([target] + ([sum(r["epochs"][-1]["test_acc"] for r in ones) / len(ones)] if ones else []))
        lines += [f"### {name}", "", f"Target {tgt:.4f} (np=1's committed {target:.3f}, or this recipe's np=1 mean if "
                  "higher). Pi times: the performance model's prediction for `pi4b_cluster` (24 Pi 4B, 2 ranks a "
                  "node), evaluation after every epoch included.", ""]
        # "How much sooner do I get np=1's accuracy": against the np=1 run that sets the target -- the committed
        # one (its recipe, its evaluation) unless this recipe's own np=1 is higher; the recipe's np=1 beside it
        own_node = None
        if ones:
            own_node = _one_node(ones[0])
            acc = [r["epochs"][-1]["test_acc"] for r in ones]
            n1 = len(ones[0]["epochs"])
            lines += [f"This recipe's np=1, {n1} epochs ({ones[0]['total_steps']:,} steps, "
                      f"{ones[0]['total_steps'] * ones[0]['global_batch']:,} images): {' '.join(f'{x:.4f}' for x in acc)} "
                      f"(mean {sum(acc) / len(acc):.4f}, {len(acc)} seeds); on one node (np=2's epoch time) "
                      f"{own_node / 60:.0f} min.", ""]
        own_sets_target = bool(ones) and tgt > target
        by_target = own_node if own_sets_target else (_one_node(ref) if ref else None)
        if ref and not own_sets_target:
            lines += [f"The committed np=1 that sets the target ({os.path.relpath(screen.REFERENCE_NP1, screen.REPO)}, "
                      f"{ref['epochs'][-1]['test_acc']:.4f}, {len(ref['epochs'])} epochs): on one node "
                      f"{by_target / 60:.0f} min.", ""]
        lines += ["| np | epochs | steps | images | test acc per seed | mean | seeds at target | Pi wall-clock | "
                  "× one node's np=1 (the target's run) | × one node's np=1 (this recipe's) |",
                  "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for np_, by_seed in sorted(by_np.items()):
            lengths = sorted({e for s in by_seed.values() for e in s})
            for e in lengths:
                rs = {s: by_seed[s][e] for s in sorted(by_seed) if e in by_seed[s]}
                r0 = next(iter(rs.values()))
                acc = [r["epochs"][-1]["test_acc"] for r in rs.values()]
                tr, ev = _pi_times(r0, np_)
                wall = e * (tr + ev)
                lines.append(f"| {np_} | {e} | {r0['total_steps']:,} | {r0['total_steps'] * r0['global_batch']:,} | "
                             + " ".join(f"{s}: {a:.4f}" for s, a in zip(rs, acc))
                             + f" | {sum(acc) / len(acc):.4f} | {sum(a >= tgt for a in acc)} of {len(acc)} | "
                             f"{wall / 60:.1f} min | " + " | ".join(f"{t / wall:.1f}×" if t else "—"
                                                                  for t in (by_target, own_node)) + " |")
        lines.append("")
    text = ("## Time to np=1's accuracy\n\nEach row: np=48's run of that many epochs on each seed (the trunk's stable "
            "phase, then its decay branch), with the optimizer steps and training images it took; a seed stops "
            "once it reaches the target.\n\n" + "\n".join(lines))
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    figure(out, target)
    return text


def figure(out: str, target: float = TARGET) -> str | None:
    """``OUT/to_accuracy.png``: test accuracy after each epoch against training images seen, for each
    extended run (mean over its seeds), the recipe's np=1 and the committed np=1 that sets the target; None
    without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (cand, by_np) in enumerate(branches(out).items()):
        name = next((n for n in screen.CANDIDATES if screen.slug(n) == cand), cand)
        for np_, by_seed in sorted(by_np.items()):
            for j, e in enumerate(sorted({e for s in by_seed.values() for e in s})):
                rs = [s[e] for s in by_seed.values() if e in s]
                mean = screen._mean_curve(rs)
                imgs = [(k + 1) * rs[0]["steps_per_epoch"] * rs[0]["global_batch"] / 1e3 for k in range(len(mean))]
                ax.plot(imgs, mean, "-", marker="o", ms=2.5, color=f"C{j}",
                        label=f"{name}, np={np_}, {e} epochs ({rs[0]['total_steps']} steps, {len(rs)} seed(s))")
        ones = _np1_points(out, name)
        if ones:
            mean = screen._mean_curve(ones)
            imgs = [(k + 1) * ones[0]["steps_per_epoch"] * ones[0]["global_batch"] / 1e3 for k in range(len(mean))]
            ax.plot(imgs, mean, "--", color="k", label=f"{name}, np=1 ({ones[0]['total_steps']:,} steps)")
    ref = screen.finished(screen.REFERENCE_NP1)
    if ref:  # the run that sets the target
        acc = [e["test_acc"] for e in ref["epochs"]]
        imgs = [(k + 1) * ref["steps_per_epoch"] * ref["global_batch"] / 1e3 for k in range(len(acc))]
        ax.plot(imgs, acc, ":", color="k", label=f"the committed np=1, SGD ({ref['total_steps']:,} steps): the target's run")
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("training images seen (thousands)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="lower right")
    ax.set_title("Extended runs: the stable phase shared, each length its own decay", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out, "to_accuracy.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def export(out: str, dest: str, epochs: int = 10) -> list[str]:
    """The fixed-budget points among ``out``'s (each seed's np=1 and its ``epochs``-epoch branch at the large
    np) copied into the screen's table folder ``dest`` as ``dest/<candidate>/np<N>-seed<S>/result.json``, each
    also a line of ``dest/results.jsonl`` (unless there), so that ``screen.py --table dest`` shows them beside
    the other recipes; the paths written::

        python experiments/paper-batch/to_accuracy.py --export ../paper-runs/tta experiments/paper-batch/cpu
    """
    found = [(cand, np_, seed, by[epochs]) for cand, by_np in branches(out).items() for np_, by_seed in by_np.items()
             for seed, by in by_seed.items() if epochs in by]
    for cand in sorted(os.listdir(out)):
        name = next((n for n in screen.CANDIDATES if screen.slug(n) == cand), None)
        found += [(cand, 1, r["config"]["seed"], r) for r in (_np1_points(out, name) if name else [])
                  if len(r["epochs"]) == epochs]
    path = os.path.join(dest, "results.jsonl")
    have = {(r["candidate"], r["np"], r["seed"]) for r in map(json.loads, open(path)) if r} if os.path.exists(path) else set()
    written = []
    with open(path, "a") as rows:
        for cand, np_, seed, r in found:
            name = next(n for n in screen.CANDIDATES if screen.slug(n) == cand)
            target = screen.point_dir(dest, name, np_, seed)
            os.makedirs(target, exist_ok=True)
            src = os.path.join(out, cand, f"np{np_}-seed{seed}", *(["e%03d" % epochs] if np_ != 1 else []))
            for f in os.listdir(src):  # result.json and its sidecars, never a checkpoint
                if f.startswith("result."):
                    shutil.copyfile(os.path.join(src, f), os.path.join(target, f))
            if (name, np_, seed) not in have:
                rows.write(json.dumps(screen._row({"candidate": name, "np": np_, "seed": seed}, r,
                                                  r.get("wall_time", 0.0), skipped=False)) + "\n")
            written.append(target)
    return written


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None)
    p.add_argument("--train-subset", type=int, default=0)
    p.add_argument("--test-subset", type=int, default=0)
    p.add_argument("--nps", type=int, default=48, help="the large np")
    p.add_argument("--candidate", required=True, help="a screen.py candidate with schedule=wsd")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--np1-seeds", default="0,1,2", help="the recipe's np=1 on these seeds ('' = none)")
    p.add_argument("--epochs-np1", type=int, default=10)
    p.add_argument("--ladder", default="10,12,15,20,25,30", help="the run lengths tried, in epochs")
    p.add_argument("--target", type=float, default=TARGET)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--simulate-mode", default="exact", choices=("fast", "exact"))
    p.add_argument("--checkpoint-minutes", type=float, default=10.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    a.data = a.data or screen.default_data()
    if a.candidate not in screen.CANDIDATES or screen.CANDIDATES[a.candidate].get("schedule") != "wsd":
        p.error(f"--candidate {a.candidate!r}: give a screen.py candidate whose schedule is wsd "
                f"({[n for n, c in screen.CANDIDATES.items() if c.get('schedule') == 'wsd']})")
    a.ladder_epochs = sorted(int(x) for x in a.ladder.split(","))
    d = screen.CANDIDATES[a.candidate]["decay_epochs"]
    if d != int(d):
        p.error(f"--candidate {a.candidate!r}: its decay_epochs={d} must be whole epochs (the trunk forks at epoch ends)")
    if a.ladder_epochs[0] < d:
        p.error(f"--ladder {a.ladder}: every length must be at least the decay's {d} epochs")
    return a


def main(argv=None) -> list[dict]:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--table"]:
        print(table(args[1]), end="")
        return []
    if args[:1] == ["--export"]:
        print("\n".join(export(args[1], args[2])))
        return []
    a = parse(argv)
    global _DS
    from pilab import data as data_mod
    os.makedirs(a.out, exist_ok=True)
    lock = screen.claim(a.out)  # noqa: F841 -- held until this process and its workers end
    _DS = data_mod.load(a.data, train_subset=a.train_subset, test_subset=a.test_subset)
    d = screen.CANDIDATES[a.candidate]["decay_epochs"]
    ones = [{"candidate": a.candidate, "np": 1, "seed": s, "threads": a.threads, "out": a.out,
             "config": base_config(a, a.candidate, s, a.epochs_np1)} for s in screen.seeds(a.np1_seeds)]
    big = [{"candidate": a.candidate, "np": a.nps, "seed": s, "threads": a.threads, "out": a.out, "decay": int(d),
            "ladder": a.ladder_epochs, "target": a.target, "config": base_config(a, a.candidate, s, HORIZON)}
           for s in screen.seeds(a.seeds)]
    # by what each says: a seed's ladder, then the recipe's np=1 on that seed (it sets the target where it is
    # higher than 0.785: a ladder that stopped under it goes on when the command runs again)
    order = [j for pair in zip(big + [None] * len(ones), ones + [None] * len(big)) for j in pair if j is not None]
    rows = []
    with cf.ProcessPoolExecutor(a.workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(ladder_job if j["np"] != 1 else np1_job, j) for j in order]
        for f in cf.as_completed(futures):
            rows.append(f.result())
            print(f"to_accuracy: np={rows[-1]['np']} seed {rows[-1]['seed']}: {rows[-1]['reached']} "
                  f"{rows[-1]['error'] or ''}", flush=True)
    table(a.out, a.target)
    return rows


if __name__ == "__main__":
    main()
