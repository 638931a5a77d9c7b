"""Reading a trace: per rank, where each step's time went, which steps were slow and who made them slow,
and the critical path of a typical step. Works on a measured run's ``trace.json`` and on the performance
model's predicted one alike (the conventions of ``pilab.trace.format``)::

    from pilab.trace.read import load, analyse, report
    a = analyse(load("runs/x"), top=5)        # a run directory or a trace file
    print(report(a))                          # the table `python -m pilab trace runs/x` prints
    a["slow"][0]["who"]                       # "rank 3 (node02)" or "link node01-node02"
    a["critical"]["path"]                     # the median step on its critical rank: compute, network, ...
    a["balance"]                              # uneven shares: each rank's, the step against equal shares'

The figures, per rank and step (seconds; the ranks' clocks aligned by the recorder):

    compute  = forward + backward + optimizer
    peer     = the wait at the end of backward spent on a slower peer: the slowest rank's backward end
               minus this rank's, clipped to [0, wait] (a predicted trace, whose ranks are alike, states
               it: the wait span's ``peer_s``, the model's straggler term)
    network  = wait - peer: the exposed network (buckets still on the wire after backward)
    data     = the batch's loading and augmentation

A step's time is its slowest rank's (data's start to optimizer's end). A slow step is blamed on the
part whose worst rank stood out most, against the step's other ranks or the run's typical step
(medians): compute or data (that rank), or the network (the ranks whose buckets finished last, named
as the link between their two hosts, their host, or themselves).
"""
from __future__ import annotations

import os
import statistics

from . import format as tf

STEP_SPANS = ("data", "forward", "backward", "wait", "optimizer")
COMPUTE = ("forward", "backward", "optimizer")
EVEN = 0.02  # a part standing out by less than this share of the step blames no rank
EVEN_NETWORK = 0.10  # ... and an even step's exposed network from this share on is named (the link)


def load(path: str) -> dict:
    """The checked trace at ``path``: a run directory (its ``trace.json``) or a trace file. Raises
    ``FileNotFoundError`` (naming the path) or ``tracefile.TraceError`` (naming the problem)."""
    if os.path.isdir(path):
        path = os.path.join(path, "trace.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such trace (record one with `python -m pilab train --trace`)")
    return tf.read(path)


def steps(doc: dict) -> tuple[dict, dict]:
    """({(rank, step): record}, {rank: host name}) from a trace: each record holds the rank's spans of
    that step ({name: [start, end]} in seconds, a name seen twice spans both), its ``busy`` seconds per
    span name, its buckets ({K: [posted, done]}) and, where the recorder noted it, ``images``: its share
    of the step's global batch."""
    hosts, rank_host, recs = {}, {}, {}

    def rec(r, s):
        return recs.setdefault((r, s), {"spans": {}, "busy": {}, "buckets": {}})
    begins = {}
    for ev in doc["traceEvents"]:
        ph, args = ev["ph"], ev.get("args") or {}
        if ph == "M":
            if ev["name"] == "process_name":
                hosts[ev["pid"]] = args.get("name", f"host {ev['pid']}")
            continue
        r = ev["tid"]
        rank_host.setdefault(r, ev["pid"])
        if ph == "X" and ev["name"] in STEP_SPANS and "step" in args:
            x = rec(r, args["step"])
            a, b = ev["ts"] / 1e6, (ev["ts"] + ev["dur"]) / 1e6
            old = x["spans"].get(ev["name"], [a, b])
            x["spans"][ev["name"]] = [min(old[0], a), max(old[1], b)]
            x["busy"][ev["name"]] = x["busy"].get(ev["name"], 0.0) + ev["dur"] / 1e6
            if "images" in args:  # the rank's share of the step's global batch (b_r)
                x["images"] = int(args["images"])
            if ev["name"] == "wait" and "peer_s" in args:  # a predicted trace states its straggler wait
                x["peer_s"] = x.get("peer_s", 0.0) + args["peer_s"]
        elif ph == "b" and ev.get("cat") == tf.ASYNC_CAT and "bucket" in args:
            begins[(ev["cat"], ev["id"])] = (r, args.get("step"), args["bucket"], ev["ts"] / 1e6)
        elif ph == "e" and (ev.get("cat"), ev["id"]) in begins:
            r0, s, k, t0 = begins.pop((ev["cat"], ev["id"]))
            if s is not None:
                rec(r0, s)["buckets"][k] = [t0, ev["ts"] / 1e6]
    names = {r: hosts.get(pid, f"host {pid}") for r, pid in rank_host.items()}
    return {k: v for k, v in recs.items() if v["spans"]}, names


def figures(recs: dict) -> dict:
    """Per (rank, step): time, compute, data, wait, peer, network, work (data + forward + backward: what
    grows with the rank's images) in seconds, and images (its share; None in a trace without them)."""
    by_step: dict = {}
    for (r, s), x in recs.items():
        by_step.setdefault(s, {})[r] = x
    out = {}
    for s, ranks in by_step.items():
        bwd_ends = [x["spans"]["backward"][1] for x in ranks.values() if "backward" in x["spans"]]
        slowest = max(bwd_ends) if bwd_ends else None
        for r, x in ranks.items():
            sp, busy = x["spans"], x["busy"]
            wait = busy.get("wait", 0.0)
            peer = 0.0
            if "peer_s" in x:
                peer = min(wait, x["peer_s"])
            elif slowest is not None and "backward" in sp:
                peer = min(wait, max(0.0, slowest - sp["backward"][1]))
            out[(r, s)] = {"time": max(b for _, b in sp.values()) - min(a for a, _ in sp.values()),
                           "compute": sum(busy.get(n, 0.0) for n in COMPUTE), "data": busy.get("data", 0.0),
                           "wait": wait, "peer": peer, "network": wait - peer,
                           "buckets": x["buckets"], "pace": sp["backward"][1] if "backward" in sp else 0.0,
                           "images": x.get("images"),
                           "work": sum(busy.get(n, 0.0) for n in ("data", "forward", "backward"))}
    return out


def analyse(doc: dict, top: int = 5, step: int | None = None) -> dict:
    """Per-rank table, the ``top`` slowest steps with who made each slow, and the critical path of the
    median step (or of ``step``). Raises ``tracefile.TraceError`` for a trace with no step spans,
    ``ValueError`` for a ``step`` it does not hold."""
    recs, host = steps(doc)
    if not recs:
        raise tf.TraceError("the trace has no step spans (data/forward/backward/wait/optimizer with "
                            "args.step); record one with `python -m pilab train --trace`")
    fig = figures(recs)
    ranks = sorted({r for r, _ in fig})
    step_ids = sorted({s for _, s in fig})
    step_time = {s: max(fig[(r, s)]["time"] for r in ranks if (r, s) in fig) for s in step_ids}
    table = []
    for r in ranks:
        mine = [fig[(r, s)] for s in step_ids if (r, s) in fig]
        times = [m["time"] for m in mine]
        table.append({"rank": r, "host": host[r], "steps": len(mine), "step_min": min(times),
                      "step_median": statistics.median(times), "step_max": max(times),
                      **{k: statistics.median(m[k] for m in mine) for k in ("compute", "network", "peer", "data")}})
    typical = {k: statistics.median(f[k] for f in fig.values()) for k in ("compute", "network", "data")}
    slow = sorted(step_ids, key=lambda s: (-step_time[s], s))[:max(0, top)]
    median_step = sorted(step_ids, key=lambda s: (step_time[s], s))[(len(step_ids) - 1) // 2]
    if step is not None and step not in step_time:
        raise ValueError(f"step {step} is not in the trace (it holds steps {step_ids[0]}..{step_ids[-1]})")
    chosen = median_step if step is None else step
    meta = doc.get("otherData") or {}
    return {"kind": meta.get("kind", "measured"), "np": len(ranks), "steps": len(step_ids),
            "clock_error_us": (meta.get("clock") or {}).get("error_us"), "ranks": table,
            "slow": [{"step": s, "time": step_time[s], **_blame(s, step_time[s], ranks, fig, host, typical)}
                     for s in slow],
            "critical": _critical(chosen, step_time[chosen], ranks, fig, host, median_step == chosen),
            "balance": shares_bought(fig, step_time, meta)}


def shares_bought(fig: dict, step_time: dict, meta: dict) -> dict | None:
    """What uneven shares (``Config.balance``) bought, from the trace's own times; None when the trace holds
    no shares, or equal ones in a run without balance::

        shares_bought(figures(recs), {step: seconds}, doc["otherData"])
        # {"shares": [44, 20], "first": [32, 32], "first_step": 1, "step": 0.24, "equal": 0.33, ...}

    Rank r spent t_r seconds of a step on the work that grows with its b_r images (data, forward,
    backward); t_r / b_r is its time per image. With equal shares B / n each, the slowest rank per image
    would have set the step's work: max_r (t_r / b_r) B / n, where the step measured max_r t_r; the rest
    of the step (optimizer, the exposed exchange) stays. So, per step,

        equal ≈ step - max_r t_r + max_r (t_r / b_r) B / n

    and both figures are medians over the kept steps. An estimate: a rank's time per image grows a little
    as its share shrinks (the per-step work that does not shrink with it). In a simulated trace the
    virtual ranks run one after another in one process, so only the shares are reported."""
    cfg = meta.get("config") or {}
    steps = sorted(step_time)
    per = {s: {r: f for (r, q), f in fig.items() if q == s and f.get("images")} for s in steps}
    per = {s: v for s, v in per.items() if v}
    if not per:
        return None
    shares = {s: [v[r]["images"] for r in sorted(v)] for s, v in per.items()}
    uneven = any(len(set(b)) > 1 for b in shares.values())
    if str(cfg.get("balance", "off")) == "off" and not uneven:
        return None
    order = sorted(per)
    first, last = shares[order[0]], shares[order[-1]]
    # the kept steps have gaps (the first few, the last window, the named): where shares changed between
    # two of them is result.json's balance["changes"]; here, only what the first kept step had
    out = {"mode": cfg.get("balance"), "first": first, "first_step": order[0], "shares": last,
           "simulated": bool(meta.get("simulated"))}
    if out["simulated"]:
        return out
    est = []
    for s in order:
        v = per[s]
        if any(f["work"] <= 0 for f in v.values()):
            continue
        total, n = sum(f["images"] for f in v.values()), len(v)
        slowest = max(f["work"] for f in v.values())
        per_image = max(f["work"] / f["images"] for f in v.values())
        est.append((step_time[s], step_time[s] - slowest + per_image * total / n))
    if est:
        out["step"] = statistics.median(t for t, _ in est)
        out["equal"] = statistics.median(e for _, e in est)
        out["steps"] = len(est)
    return out


def _shares_lines(b: dict | None) -> list[str]:
    """``report``'s words for ``shares_bought``'s figures (one or two lines)."""
    if not b:
        return []
    total, ms = sum(b["shares"]), 1e3
    shares = "/".join(map(str, b["shares"]))
    moved = f" ({'/'.join(map(str, b['first']))} at step {b['first_step']})" if b["first"] != b["shares"] else ""
    head = f"balance {b['mode'] or 'off'}: each rank's share of the {total} images a step, {shares} at the end{moved}"
    if b["simulated"]:
        return ["", head + "; simulated ranks run one after another, so the trace cannot say what the shares bought"]
    if "equal" not in b:
        return ["", head]
    equal = "/".join(str(total // len(b['shares']) + (r < total % len(b['shares']))) for r in range(len(b['shares'])))
    return ["", head + ".",
            f"the median step took {b['step'] * ms:.1f} ms; at equal shares ({equal}) the same per-image times give "
            f"≈ {b['equal'] * ms:.1f} ms ({b['equal'] / b['step']:.2f}× the measured step)"]


def _blame(s: int, time: float, ranks: list, fig: dict, host: dict, typical: dict) -> dict:
    """What made step ``s`` slow and whose it was: the part (compute, network, data) whose worst rank
    stood out most, either against the step's other ranks (a throttled rank, a slow link's late buckets)
    or against the run's typical step (everyone slowed at once). In an even step (nothing stands out by
    ``EVEN`` of the step) the exposed network is named if it is ``EVEN_NETWORK`` of the step or more:
    a link slow on every step, e.g. the one link between two hosts."""
    here = {r: fig[(r, s)] for r in ranks if (r, s) in fig}
    score = {}
    for k in ("compute", "data"):
        worst = max(f[k] for f in here.values())
        score[k] = max(worst - statistics.median(f[k] for f in here.values()), worst - typical[k])
    late, who = _late(here, host)
    score["network"] = max(late, statistics.median(f["network"] for f in here.values()) - typical["network"])
    cause = max(score, key=lambda k: score[k])
    if score[cause] < EVEN * time:  # no rank stood out: an even step, slow (if at all) by its exposed network
        net = statistics.median(f["network"] for f in here.values())
        if net >= EVEN_NETWORK * time:
            return {"cause": "network", "who": who, "excess": net}
        return {"cause": "none", "who": "no one (an even step)", "excess": score[cause]}
    if cause == "network":
        return {"cause": cause, "who": who, "excess": score[cause]}
    r = max(here, key=lambda q: here[q][cause])
    return {"cause": cause, "who": f"rank {r} ({host[r]})", "excess": score[cause]}


def _late(here: dict, host: dict) -> tuple[float, str]:
    """(how late the latest rank's buckets finished against the earliest rank's same bucket, whose),
    counting the buckets each rank saw complete while it waited after backward:
    the ranks within a quarter of the latest, named as the link between their two hosts, their host,
    or the ranks; all ranks together on two hosts, or one rank on each of two: the link between them
    (every bucket crosses it)."""
    # only completions a rank saw while it waited after backward: during backward it sees a bucket at its
    # next gradient hook, later than the bucket finished (the recorder tests requests between layers)
    seen = {r: {k: end for k, (_, end) in f["buckets"].items() if end >= f["pace"]} for r, f in here.items()}
    first: dict = {}
    for ends in seen.values():
        for k, end in ends.items():
            first[k] = min(first.get(k, end), end)
    late = {r: max((end - first[k] for k, end in ends.items()), default=0.0) for r, ends in seen.items()}
    worst = max(late.values(), default=0.0)
    names = sorted(r for r, v in late.items() if worst > 0 and v >= 0.75 * worst)
    all_hosts = sorted({host[r] for r in here})
    # one rank on each of two hosts: every message crosses the one link between them, and which end
    # sees it complete later changes from step to step (a testbed link at 10 Mbit/s: either rank), so
    # a late rank there is the link's
    if not names or len(names) == len(here) or (len(all_hosts) == 2 and len(here) == 2):
        return worst, (f"link {all_hosts[0]}-{all_hosts[1]}" if len(all_hosts) == 2 else "all ranks")
    hosts = sorted({host[r] for r in names})
    if len(names) == 1:
        return worst, f"rank {names[0]} ({host[names[0]]})"
    if len(hosts) == 2:
        return worst, f"link {hosts[0]}-{hosts[1]}"
    if len(hosts) == 1 and len(all_hosts) > 1:
        return worst, f"host {hosts[0]}"
    return worst, "ranks " + ", ".join(map(str, names))


def _critical(s: int, time: float, ranks: list, fig: dict, host: dict, is_median: bool) -> dict:
    """Where step ``s``'s time went: on the critical path, the rank that ended backward last (its data,
    compute, exposed network; no wait for a peer: it was the one waited for), and averaged over all
    ranks (the others' wait for it shows as peer). Each with the rest (gaps between spans)."""
    here = {r: fig[(r, s)] for r in ranks if (r, s) in fig}
    keys = ("compute", "network", "peer", "data")

    def split(fs):
        parts = {k: statistics.fmean(f[k] for f in fs) for k in keys}
        parts["other"] = max(0.0, statistics.fmean(f["time"] for f in fs) - sum(parts.values()))
        return parts
    last = max(here, key=lambda r: here[r]["pace"])
    parts, path = split(here.values()), split([here[last]])
    return {"step": s, "median": is_median, "time": time, "parts": parts, "rank": last,
            "who": f"rank {last} ({host[last]})", "path": path,
            "shares": {k: v / time if time else 0.0 for k, v in parts.items()},
            "path_shares": {k: v / time if time else 0.0 for k, v in path.items()}}


def report(a: dict) -> str:
    """The text ``python -m pilab trace`` prints for ``analyse``'s result (times in milliseconds)."""
    ms = 1e3
    lines = [f"{a['kind']} trace: {a['np']} ranks, {a['steps']} steps"
             + (f", clocks aligned within {a['clock_error_us']:.0f} us" if a.get("clock_error_us") is not None else ""),
             "", "per rank (ms; step min/median/max, the rest medians per step)",
             f"{'rank':>4} {'host':<12} {'steps':>5} {'min':>9} {'median':>9} {'max':>9} {'compute':>9} "
             f"{'network':>9} {'peer':>9} {'data':>9}"]
    for t in a["ranks"]:
        lines.append(f"{t['rank']:>4} {t['host']:<12} {t['steps']:>5} {t['step_min'] * ms:>9.1f} "
                     f"{t['step_median'] * ms:>9.1f} {t['step_max'] * ms:>9.1f} {t['compute'] * ms:>9.1f} "
                     f"{t['network'] * ms:>9.1f} {t['peer'] * ms:>9.1f} {t['data'] * ms:>9.1f}")
    lines += ["", "slowest steps (ms; excess: how far the worst rank's part stood out)",
              f"{'step':>6} {'time':>9} {'cause':<8} {'excess':>9}  made slow by"]
    for x in a["slow"]:
        lines.append(f"{x['step']:>6} {x['time'] * ms:>9.1f} {x['cause']:<8} {x['excess'] * ms:>9.1f}  {x['who']}")
    c = a["critical"]
    lines += ["", f"critical path of {'the median ' if c['median'] else ''}step {c['step']} "
                  f"({c['time'] * ms:.1f} ms): {c['who']}, the last to end backward; beside it the mean "
                  f"over ranks", f"  {'':<20} {'critical rank':>19} {'mean over ranks':>19}"]
    label = {"compute": "compute", "network": "exposed network", "peer": "waiting for a peer",
             "data": "data", "other": "other (gaps)"}
    for k, v in c["parts"].items():
        lines.append(f"  {label[k]:<20} {c['path'][k]:>9.4f} s {100 * c['path_shares'][k]:>6.1f}% "
                     f"{v:>9.4f} s {100 * c['shares'][k]:>6.1f}%")
    lines += _shares_lines(a.get("balance"))
    return "\n".join(lines)
