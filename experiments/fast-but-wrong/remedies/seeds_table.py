"""The table over seeds of a fast-and-right study: every candidate at np=48 and at np=1, final accuracy
as mean ± sd over the seeds it ran, beside the predicted Pi speedup and the MLPerf-style time-to-target
speedup over one node; the goal of issue 20 judged per row.

A study is a folder of finished points ``<root>/np<N>/seed<S>/<slug>/result.json`` (what
fast-and-right.sh beside this script writes, one ``pilab remedies --only`` per point); this study's code, kept
with its results (its goal is not pilab's)::

    python experiments/fast-but-wrong/remedies/seeds_table.py experiments/fast-but-wrong/remedies/full-test \
        --out experiments/fast-but-wrong/remedies/full-test/table          # table.md, table.json, table.png
    # re-priced on a measured latency (or a Cluster JSON, `pilab perfmodel calibrate --cluster-out`)
    python experiments/fast-but-wrong/remedies/seeds_table.py experiments/fast-but-wrong/remedies/full-test \
        --inter-alpha 150e-6
    tab = seeds_table.table(root)        # imported: seeds_table.markdown(tab)
    seeds_table.table(root, calibration=perfmodel.pi4b_cluster(inter=perfmodel.Link(150e-6, 1 / 117e6)))

The target (MLPerf / DAWNBench rules, ``analysis.time_to_target``): the np=1 baseline's mean accuracy
less ``GOAL_POINTS``. "One node" is the Pi cluster's speed baseline (2 ranks on one Pi 4B, its whole run
predicted by ``pilab.perfmodel``), and it reaches the target after the epochs the np=1 baseline needed
(mean over seeds): the accuracy curve of np=2 at 32 images a rank is taken to be np=1's. On another
machine (``calibration``: a preset name, a Cluster or Calibration, or a JSON path of either), one node is
that machine's ranks per node, and energy needs a power model for its name (the Pi's: ``pi4b_cluster``).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

from dataclasses import replace

from pilab import Config, ConfigError, perfmodel, resultfile
from pilab.study import analysis, remedies
from pilab.study.analysis import target_baseline, time_to_target
from pilab.study.points import trained_config

# the candidates this study ran (their labels name the points' folders), from the file beside this one
CANDIDATES = remedies.load_candidates(os.path.join(os.path.dirname(os.path.abspath(__file__)), "candidates.py"))

GOAL_POINTS = 0.01  # np=48 within 1 point of np=1 (mean of the seeds)
GOAL_SPEEDUP = 15.0  # predicted Pi whole-run speedup over one node, and time-to-target speedup
GOAL_SEEDS = 3  # ... as the mean of this many seeds: fewer is "met on n=1 of 3", not met
CALIBRATION = "pi4b_cluster"


def points(root: str) -> dict[tuple[int, str], dict[int, dict]]:
    """{(np, slug): {seed: result}} of every finished point under ``root`` (a point cut short is left out)."""
    out: dict[tuple[int, str], dict[int, dict]] = {}
    for np_dir in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not (np_dir.startswith("np") and np_dir[2:].isdigit()):
            continue
        for seed_dir in sorted(os.listdir(os.path.join(root, np_dir))):
            if not (seed_dir.startswith("seed") and seed_dir[4:].isdigit()):
                continue
            d = os.path.join(root, np_dir, seed_dir)
            for name in sorted(os.listdir(d)):
                path = os.path.join(d, name, "result.json")
                if not os.path.isfile(path):
                    continue
                r = resultfile.load(path)
                if r.get("stopped_early") or r.get("steps_done") != r.get("total_steps"):
                    continue
                out.setdefault((int(np_dir[2:]), name), {})[int(seed_dir[4:])] = r
    return out


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _epochs_to(res: dict, target: float) -> int | None:
    """The first epoch (1-based) whose test accuracy reaches ``target``; None if none does."""
    for i, e in enumerate(res["epochs"], 1):
        if (e.get("test_acc") or 0) >= target:
            return i
    return None


def _machine(calibration):
    """(the Cluster, whether the model places each rank's threads, the name its power model goes by) of
    a preset name, Cluster, Calibration or JSON path; ConfigError (a ValueError) for anything else."""
    cl = perfmodel.resolve_cluster(calibration)
    # a cluster places its own threads per rank; this box (a Calibration) runs at the config's threads
    return cl, cl.name != "this_box", cl.name


def table(root: str, *, calibration=CALIBRATION) -> dict:
    """The rows of the study under ``root`` (see the module docstring), priced on ``calibration``; raises
    ValueError without the np=1 baseline (every row is judged against it) or for an unknown machine."""
    cluster, place_threads, machine = _machine(calibration)
    one_node_np = target_baseline(machine) or cluster.ranks_per_node or 1
    pts = points(root)
    base_pts = pts.get((1, "baseline"))
    if not base_pts:
        raise ValueError(f"{root}: no finished np=1 baseline (np1/seed*/baseline/result.json); run it first")
    ref_acc, ref_sd = _mean_sd([r["epochs"][-1]["test_acc"] for r in base_pts.values()])
    target = ref_acc - GOAL_POINTS
    first_ref = next(iter(base_pts.values()))
    proto = Config.from_dict(first_ref["config"])
    # the image counts from the runs themselves: the data set need not be at hand to make the table
    at = {"cluster": cluster, "place_threads": place_threads, "machine": machine, "target": target,
          "counts": {"n_train": first_ref["data"]["n_train"], "n_test": first_ref["data"]["n_test"]}}
    one_node = _predicted(proto, one_node_np, at)["epoch_time"] * proto.epochs
    ref_epochs = [_epochs_to(r, target) for r in base_pts.values()]
    at["one_node"] = one_node
    at["node_ttt"] = one_node * statistics.fmean(ref_epochs) / proto.epochs if all(ref_epochs) else None
    # an np=1 point may run a larger np's recipe (pilab remedies --recipes-of): named as it is there
    top = _labels(proto, max(n for n, _ in pts))
    rows = [_row(np_, name, runs, pts.get((1, name)), {**top, **_labels(proto, np_)}, at)
            for (np_, name), runs in sorted(pts.items(), key=lambda kv: (kv[0][1] != "baseline", kv[0][1],
                                                                          -kv[0][0]))]
    for r in rows:
        r["delta_vs_np1_baseline"] = r["acc_mean"] - ref_acc
    # the Pareto front over every row (no np=48 row reaches the target yet, so not only the "right" ones):
    # no other row is faster on the Pi, more accurate and cheaper in energy at once
    have_energy = all(r["energy_j"] is not None for r in rows)
    for r, on in zip(rows, remedies.pareto(rows, time_key="predicted_pi_time_s", acc_key="acc_mean",
                                           energy_key="energy_j" if have_energy else None)):
        r["front"] = on
    return {"root": root, "calibration": machine, "one_node_np": one_node_np,
            "calibration_source": calibration if isinstance(calibration, str) else type(calibration).__name__,
            "reference_acc": ref_acc, "reference_sd": ref_sd,
            "reference_seeds": sorted(base_pts), "target": target, "one_node_time_s": one_node,
            "one_node_time_to_target_s": at["node_ttt"], "goal_points": GOAL_POINTS, "goal_speedup": GOAL_SPEEDUP,
            "goal_seeds": GOAL_SEEDS,
            "rows": rows}


def _labels(proto: Config, np_: int) -> dict[str, str]:
    """{folder name: label} of the candidates at ``np_``."""
    return {remedies.slug(label): label for label in remedies.candidate_labels(proto, np_, CANDIDATES)}


def _predicted(cfg: Config, np_: int, at: dict) -> dict:
    """The performance model's prediction of ``cfg`` at ``np_`` on the table's machine (``at``)."""
    placed = replace(cfg, threads=0) if at["place_threads"] else cfg
    return perfmodel.predict(placed, np_, at["cluster"], **at["counts"])


def _row(np_: int, name: str, runs: dict, same: dict | None, labels: dict, at: dict) -> dict:
    """One (np, candidate) row over its seeds' ``runs``; ``same``: the np=1 runs of the same folder."""
    target = at["target"]
    accs = [r["epochs"][-1]["test_acc"] for r in runs.values()]
    mean, sd = _mean_sd(accs)
    # each seed's run priced as it trained (a noise-driven ramp: at the batches that seed's run chose)
    preds = [_predicted(trained_config(r), np_, at) for r in runs.values()]
    whole = statistics.fmean(p["epoch_time"] * len(r["epochs"]) for p, r in zip(preds, runs.values()))
    energies = [analysis.run_energy(r, {"train": [p["time"]] * len(r["epochs"]),
                                        "eval": [p["eval_time"]] * len(r["epochs"]),
                                        "comm_exposed_share": p["comm_exposed"] / p["time"]},
                                    at["machine"], target)["energy_j"] for p, r in zip(preds, runs.values())]
    ttts = [time_to_target(r, target, [p["time"]] * len(r["epochs"]), [p["eval_time"]] * len(r["epochs"]))
            for p, r in zip(preds, runs.values())]
    vs = _mean_sd([r["epochs"][-1]["test_acc"] for r in same.values()])[0] if same and np_ != 1 else None
    reached = all(t is not None for t in ttts)
    ttt_speedup = at["node_ttt"] / statistics.fmean(ttts) if reached and at["node_ttt"] else None
    speedup = at["one_node"] / whole if whole else None
    misses = _misses(mean, target, speedup, ttt_speedup,
                     {s: r["epochs"][-1]["test_acc"] for (s, r), t in zip(runs.items(), ttts) if t is None})
    meets = np_ > 1 and not misses
    return {
        "np": np_, "slug": name, "label": labels.get(name, name), "seeds": sorted(runs), "n": len(runs),
        "acc_mean": mean, "acc_sd": sd, "accs": accs,
        "delta_vs_np1_baseline": None,
        "np1_same_recipe": vs, "delta_vs_np1_same_recipe": mean - vs if vs is not None else None,
        "predicted_pi_speedup": speedup, "predicted_pi_time_s": whole,
        "energy_j": statistics.fmean(energies) if None not in energies else None,
        "time_to_target_s": statistics.fmean(ttts) if reached else None,
        "time_to_target_speedup": ttt_speedup,
        "goal": meets and len(runs) >= GOAL_SEEDS, "goal_on_fewer_seeds": meets and len(runs) < GOAL_SEEDS,
        "misses": misses if np_ > 1 else []}


def _misses(mean: float, target: float, speedup: float | None, ttt_speedup: float | None,
            short: dict[int, float]) -> list[str]:
    """What of the goal a row misses, in words (empty: it meets all three criteria): its mean accuracy
    against the target (the np=1 baseline's less ``GOAL_POINTS``), its speedups. ``short``: {seed: its
    final accuracy} of the seeds that never reach the target; named only where the mean is close enough,
    as then they are what keeps the row from the goal."""
    out = []
    if mean < target:
        out.append("accuracy")
    if (speedup or 0) < GOAL_SPEEDUP:
        out.append(f"speedup {_x(speedup)}")
    if short and not out:
        out.append(", ".join(f"seed {s} ends at {a:.4f}" for s, a in sorted(short.items()))
                   + " below the target")
    elif ttt_speedup is not None and ttt_speedup < GOAL_SPEEDUP:
        out.append(f"time-to-target {_x(ttt_speedup)}")
    return out


def _acc(mean: float, sd: float | None, n: int) -> str:
    return f"{mean:.4f} ± {sd:.4f} (n={n})" if sd is not None else f"{mean:.4f} (n=1)"


def _x(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.1f}×"


def _pts(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:+.1f}"


HEAD = ("candidate", "np", "final accuracy (mean ± sd)", "vs np=1 baseline (points)", "vs np=1 same recipe (points)",
        "predicted Pi time (min)", "predicted Pi speedup", "energy (kJ)", "time-to-target speedup", "front", "goal")


def cells(tab: dict) -> list[list[str]]:
    """The table's rows as text, in ``HEAD``'s columns (the markdown and the HTML report share them)."""
    out = []
    for r in tab["rows"]:
        kj = "—" if r.get("energy_j") is None else f"{r['energy_j'] / 1e3:.0f}"
        out.append([r["label"], str(r["np"]), _acc(r["acc_mean"], r["acc_sd"], r["n"]),
                    _pts(r["delta_vs_np1_baseline"]), _pts(r["delta_vs_np1_same_recipe"]),
                    f"{r['predicted_pi_time_s'] / 60:.1f}", _x(r["predicted_pi_speedup"]), kj,
                    _x(r["time_to_target_speedup"]), "yes" if r.get("front") else "",
                    _goal(r)])
    return out


def _goal(r: dict) -> str:
    if r["np"] == 1:
        return "—"
    if r["goal"]:
        return "met"
    if r.get("goal_on_fewer_seeds"):
        return f"met on n={r['n']} of {GOAL_SEEDS} seeds"
    return f"not met ({'; '.join(r['misses'])})" if r.get("misses") else "not met"


def reference_line(tab: dict) -> str:
    return (f"Reference: np=1 baseline {_acc(tab['reference_acc'], tab['reference_sd'], len(tab['reference_seeds']))} "
            f"on all 10,000 test images; target {tab['target']:.4f} (1 point below); one node "
            f"({tab['calibration']}, {tab.get('one_node_np', 2)} ranks) "
            f"{tab['one_node_time_s'] / 60:.0f} min for the whole run, "
            + (f"{tab['one_node_time_to_target_s'] / 60:.0f} min to the target." if tab["one_node_time_to_target_s"]
               else "never at the target."))


def goal_line(tab: dict) -> str:
    met = [r for r in tab["rows"] if r["goal"]]
    fewer = [r for r in tab["rows"] if r.get("goal_on_fewer_seeds")]
    seeds = tab.get("goal_seeds", GOAL_SEEDS)
    # right on the mean of the seeds but short of the goal on speed or on a seed's run
    near = [r for r in tab["rows"] if r["np"] > 1 and r["n"] >= seeds and r.get("misses")
            and "accuracy" not in r["misses"]]
    return (f"Goal (np=48 within {100 * tab['goal_points']:.0f} point of np=1 in the same epochs, the mean of "
            f"{seeds} seeds, predicted Pi speedup and time-to-target speedup >= {tab['goal_speedup']:.0f}): "
            + (", ".join(r["label"] for r in met) if met else "no candidate meets it yet")
            + (f"; within {100 * tab['goal_points']:.0f} point on the mean of {seeds} seeds but short of it: "
               + ", ".join(f"{r['label']} ({'; '.join(r['misses'])})" for r in near) if near and not met else "")
            + (f"; met on fewer seeds so far: {', '.join(r['label'] for r in fewer)}" if fewer else "") + ".")


def markdown(tab: dict) -> str:
    """The table as markdown: one row per (candidate, np), the reference first."""
    lines = [reference_line(tab), "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c) + " |" for c in cells(tab)]
    return "\n".join(lines + ["", goal_line(tab)]) + "\n"


def _priced_on(preset: str, alpha: float | None, mbps: float | None):
    """The machine ``main``'s flags name: the preset (or JSON) with its inter-node link replaced where
    given; ConfigError for a latency < 0 or a bandwidth <= 0."""
    if alpha is None and mbps is None:
        return preset
    if alpha is not None and not (math.isfinite(alpha) and alpha >= 0):
        raise ConfigError(f"--inter-alpha {alpha} must be >= 0 seconds (e.g. 150e-6)")
    if mbps is not None and not (math.isfinite(mbps) and mbps > 0):
        raise ConfigError(f"--inter-mbps {mbps} must be > 0")
    return perfmodel.relinked(perfmodel.resolve_cluster(preset), alpha=alpha, mbps=mbps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/fast-but-wrong/remedies/seeds_table.py",
                                description="the table over seeds of a fast-and-right study (markdown + JSON + "
                                "figure)")
    p.add_argument("root", help="the study's folder (np<N>/seed<S>/<candidate>/result.json)")
    p.add_argument("--out", default="", help="write OUT.md, OUT.json, OUT.html and OUT.png (the figure, where a "
                   "browser is available; default: print the markdown)")
    p.add_argument("--preset", default=CALIBRATION,
                   help="the machine to price on: pi4b_cluster, or a Cluster/Calibration JSON (`pilab perfmodel "
                        "calibrate --cluster-out`) (default: %(default)s)")
    p.add_argument("--inter-alpha", dest="inter_alpha", type=float, default=None,
                   help="the machine's inter-node latency, seconds per message (e.g. 150e-6, measured with "
                        "`pilab perfmodel bench` across two nodes)")
    p.add_argument("--inter-mbps", dest="inter_mbps", type=float, default=None,
                   help="the machine's inter-node bandwidth in MB/s")
    a = p.parse_args(argv)
    try:
        tab = table(a.root, calibration=_priced_on(a.preset, a.inter_alpha, a.inter_mbps))
    except ValueError as e:
        print(f"pilab: {e}", file=sys.stderr)
        return 2
    text = markdown(tab)
    if not a.out:
        print(text, end="")
        return 0
    from pilab.files import save_json
    save_json(tab, a.out + ".json")
    tmp = a.out + ".md.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, a.out + ".md")
    from pilab.study.report import write_seeds  # Bokeh: only where a figure is made
    write_seeds(tab, a.out, columns=HEAD, cells=cells(tab), reference=reference_line(tab),
                goal=goal_line(tab))  # OUT.html, and OUT.png where a browser is available
    return 0


if __name__ == "__main__":
    sys.exit(main())
