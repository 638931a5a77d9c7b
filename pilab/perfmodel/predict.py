"""Prediction: time per epoch of a Config at any np on a Cluster.

    from pilab.config import Config
    from pilab.perfmodel import predict, predict_table, pi_table
    predict(Config(width=0.5), 8, "pi4b_cluster", "naive", baseline_np=2)["efficiency"]
    predict_table(Config(), [2, 4, 8, 48], "pi4b_cluster", "naive", baseline_np=2)   # one dict per np
    pi_table()                                   # both profiles beside the published figures

The model itself is described in the package docstring and docs/perfmodel.md.

Predictions over several np (``predict_table``, the Pi table) and as GitHub tables.

    from pilab.perfmodel import markdown_table, pi_table_markdown, predict_table
    print(markdown_table(predict_table(Config(), [2, 4, 8], "pi4b_cluster"), TABLE_COLUMNS))
    print(pi_table_markdown())          # the Pi table beside the published figures (docs/perfmodel.md)
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..config import Config, ConfigError
from ..dist import codec_for
from .allreduce import allreduce_phases, allreduce_time
from .layout import bn_bytes, bn_channels, buckets_for, gradient_layout, optimizer_work, work_per_image
from .machine import ELEMENT_BYTES, METRIC_BYTES, THREAD_EXPONENT, Cluster
from .metrics import efficiency, karp_flatt, speedup
from .presets import PI_TABLE_NPS, PUBLISHED, pi4b_cluster, pi_config, published_table, resolve_cluster

# image counts of the named sources, so that a Config without subsets needs no data on disk
_SOURCE_SIZES = {"embedded": (5000, 1000), "cifar10": (50000, 10000)}

# profile -> (gradient averaging, evaluation); the two halves of "naive" apart, to see what each costs
PROFILES = {
    "pilab": ("buckets", "sharded"),  # fused buckets posted during backward; test set split over ranks
    "naive": ("per_tensor", "full"),  # blocking Allreduce per tensor after backward; all ranks eval all
    "naive_comm": ("per_tensor", "sharded"),
    "naive_eval": ("buckets", "full"),
}


def _sizes(cfg: Config, n_train, n_test) -> tuple[int, int]:
    known = _SOURCE_SIZES.get(cfg.data)
    if known is None and not (cfg.train_subset and cfg.test_subset) and (n_train is None or n_test is None):
        from ..data import cached_counts  # a path: its cache's labels, if it was loaded once
        known = cached_counts(cfg.data)
    if n_train is None:
        n_train = cfg.train_subset or (known[0] if known else None)
    if n_test is None:
        n_test = cfg.test_subset or (known[1] if known else None)
    if n_train is None or n_test is None:
        raise ConfigError(f"data={cfg.data!r}: pass n_train= and n_test= (image counts)")
    return int(n_train), int(n_test)


def as_config(cfg) -> Config:
    if isinstance(cfg, Config):
        return cfg
    if cfg is None:
        return Config()
    d = dict(cfg)
    d = d.get("config", d)  # a result dict carries its config
    return Config.from_dict(d)


def _expected_max_normal(n: int) -> float:
    """E[max of n standard normals] (Blom's approximation; 0 for n = 1)."""
    if n <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def _placement(cfg: Config, p: int, cl: Cluster) -> dict:
    """Ranks per node, nodes, threads per rank, and how crowded a node is."""
    rpn = min(p, cl.ranks_per_node or p)
    threads = cfg.threads or max(1, cl.cores_per_node // rpn)
    # more threads than the cores this job gets on a node: they time-share them
    avail = cl.available_cores or cl.cores_per_node
    return {"ranks_per_node": rpn, "nodes": math.ceil(p / rpn), "threads": threads,
            "oversubscription": max(1.0, rpn * threads / avail),
            "crowded": rpn * threads > avail}  # a rank may wait for a peer that is not scheduled


def _rank_costs(cfg: Config, p: int, b: int, cl: Cluster, place: dict, n_tensors: int) -> dict:
    """Per rank: compute, data and straggler seconds per step; evaluation seconds per test image."""
    threads, oversub = place["threads"], place["oversubscription"]
    thread_factor = (cl.ref_threads / threads) ** THREAD_EXPONENT
    work = work_per_image(cfg.model, cfg.width, cl.flops_per_activation, timesteps=cfg.timesteps)
    views = b * cfg.batch_aug  # batch augmentation: every copy is trained on (and augmented)
    step_work = views * work + cl.step_work_per_tensor * n_tensors + optimizer_work(cfg)
    compute = step_work / (cl.train_gflops * 1e9) * thread_factor * oversub
    return {"compute": compute, "data": views * (cl.data_s_per_image * oversub),
            "straggler": compute * cl.compute_cv * _expected_max_normal(p),
            "eval_s_per_image": (work / 3) / (cl.eval_gflops * 1e9) * thread_factor * oversub}


def _gradient_comm(cfg: Config, layout, averaging: str, compute: float, cl: Cluster,
                   ar: Callable[[float], float], rate: float = 1.0) -> tuple[int, float, float]:
    """(messages, comm seconds, exposed seconds) per step for averaging the gradients (p > 1).
    ``rate``: the share of its speed a transfer keeps while backward runs (``Cluster.overlap_rate``
    where the job spans nodes)."""
    if averaging == "per_tensor":
        comm = sum(ar(n * ELEMENT_BYTES) for n, _ in layout)
        return len(layout), comm, comm
    sched = bucket_schedule(cfg, layout, compute, cl, ar, rate)
    comm = 0.0
    for b in sched["buckets"]:
        comm += b["cost"]
    end = sched["buckets"][-1]["end"] if sched["buckets"] else 0.0
    return len(sched["buckets"]), comm, max(0.0, end - sched["backward_end"])


def bucket_schedule(cfg: Config, layout, compute: float, cl: Cluster, ar: Callable[[float], float],
                    rate: float = 1.0) -> dict:
    """When each gradient bucket's Allreduce is posted, starts and ends in a step whose forward and
    backward take ``compute`` seconds (from the forward's start), and what it costs on an idle wire:
    ``{"forward_end", "backward_end", "buckets": [{numel, bytes, posted, start, end, cost}, ...]}`` in
    GradSync's order. The one rule ``predict`` prices the exposed tail with and
    ``pilab.trace.predict`` draws::

        bucket_schedule(Config(), gradient_layout("mobilenetv2_cifar", 1.0), 0.5, cl, ar)["buckets"][-1]
    """
    c = codec_for(cfg.compression)
    wire = c.itemsize
    t_fwd = compute * (1 - cl.backward_fraction)
    t_bwd = compute * cl.backward_fraction
    done = t_fwd + t_bwd
    end = 0.0
    out = []
    for numel, ready in buckets_for(layout, cfg.bucket_mb, cfg.bucket_tail_mb):  # posted in order as they fill; one at a time
        t = ar(numel * wire) + (numel * wire * cl.gamma_fp16 if c.software_sum else 0.0)
        # overlap < 1: only that share of the remaining backward can hide communication
        posted = t_fwd + t_bwd * (1 - cl.overlap * (1 - ready))
        start = max(end, posted)
        if rate < 1.0 and start < done:  # slowed until backward ends, then at full speed
            slow = (done - start) * rate  # the part of t moved before backward ends
            end = start + (t / rate if rate else 0.0) if slow >= t else done + t - slow
        else:
            end = start + t
        out.append({"numel": numel, "bytes": numel * wire, "posted": posted, "start": start, "end": end,
                    "cost": t})
    return {"forward_end": t_fwd, "backward_end": done, "buckets": out}


def exchange(cfg, np_: int, cluster, compute_s: float, *, forward_s: float | None = None,
             metrics: bool = True) -> dict:
    """The gradient exchange of one synchronous step of ``cfg`` at ``np_`` ranks on ``cluster``, beside
    a compute time given in seconds (a measured step without any exchange: forward, backward and the
    optimizer) instead of one the model derives -- the network half alone, as the wire benchmark
    (``pilab.bench.wire``) measures it::

        exchange(Config(model="mobilenetv2", bucket_mb=1.0), 2, cl, 0.183, forward_s=0.046)["step"]

    ``forward_s``: the forward's share of ``compute_s`` (default: the cluster's ``backward_fraction``);
    buckets are posted as backward fills them and go one at a time on the wire (as in ``predict``), the
    bytes halved for fp16. ``metrics``: pilab's per-step Allreduce of the metrics, after the gradients.
    Returns messages, comm (seconds on the wire), exposed (what the step waits after backward) and step
    (``compute_s`` + exposed)."""
    import dataclasses
    cfg = as_config(cfg)
    cl = resolve_cluster(cluster)
    p = int(np_)
    if forward_s is not None:
        if not 0 <= forward_s <= compute_s:
            raise ConfigError(f"forward_s={forward_s} must be within [0, compute_s={compute_s}]")
        cl = dataclasses.replace(cl, backward_fraction=1 - forward_s / compute_s if compute_s else 0.0)
    if p == 1:
        return {"messages": 0, "comm": 0.0, "exposed": 0.0, "step": compute_s}
    place = _placement(cfg, p, cl)
    ar = _allreduce_fn(p, cl, place)
    messages, comm, exposed = _gradient_comm(cfg, gradient_layout(cfg.model, cfg.width), "buckets",
                                             compute_s, cl, ar, _overlap_rate(cl, place))
    if metrics:
        metric = ar(METRIC_BYTES)
        comm += metric
        exposed += metric
    return {"messages": messages, "comm": comm, "exposed": exposed, "step": compute_s + exposed}


def _allreduce_fn(p: int, cl: Cluster, place: dict, phases: bool = False) -> Callable:
    """Seconds of one Allreduce of n bytes over the job's ranks (``phases``: as
    ``allreduce_phases``'s intra-/inter-node list)."""
    cost = allreduce_phases if phases else allreduce_time

    def ar(nbytes):
        return cost(nbytes, p, cl, None, place["crowded"])
    return ar


def step_schedule(cfg, np_: int, cluster, profile: str = "pilab", **sizes) -> dict:
    """One synchronous step of ``predict``'s, laid out in time for a predicted trace: ``predict``'s
    dict (its ``step_time`` and ``step`` parts) plus ``schedule``, the buckets from ``bucket_schedule``
    with the same compute, Allreduce cost and overlap ``predict`` priced them with, each with its
    ``phases`` (``allreduce_phases``). Only bucketed averaging has buckets to lay out::

        step_schedule(pi_config(), 48, "pi4b_cluster")["schedule"]["buckets"][-1]["phases"]
    """
    averaging, _ = _profile(profile)
    cfg = as_config(cfg)
    cl = resolve_cluster(cluster)
    if averaging != "buckets" or cfg.batch_ramp or _local_share(cfg, int(np_)):
        raise ConfigError(f"profile={profile!r}, batch_ramp={cfg.batch_ramp!r}, local_steps={cfg.local_steps}: "
                          "a predicted step is laid out for bucketed averaging at one batch size "
                          "(use profile pilab, no batch ramp, no local SGD)")
    out = predict(cfg, np_, cl, profile, **sizes)
    p = out["np"]
    place = _placement(cfg, p, cl)
    layout = gradient_layout(cfg.model, cfg.width)
    compute = out["step"]["compute"]
    if p > 1:
        sched = bucket_schedule(cfg, layout, compute, cl, _allreduce_fn(p, cl, place), _overlap_rate(cl, place))
    else:
        sched = {"forward_end": compute * (1 - cl.backward_fraction), "backward_end": compute, "buckets": []}
    phases = _allreduce_fn(p, cl, place, phases=True)
    for b in sched["buckets"]:
        b["phases"] = phases(b["bytes"])
    out["schedule"] = sched
    out["metric_s"] = _allreduce_fn(p, cl, place)(METRIC_BYTES) if p > 1 else 0.0
    return out


def _overlap_rate(cl: Cluster, place: dict) -> float:
    """``cl.overlap_rate`` where the job spans nodes (it is the inter-node transfer's), else 1."""
    return cl.overlap_rate if place["nodes"] > 1 else 1.0


def _local_share(cfg: Config, p: int) -> float:
    """The share of a run's steps that are local-SGD steps (``cfg.local_steps`` > 1 after
    ``cfg.local_after`` synchronous epochs; see ``pilab.engine.localsgd``)."""
    if cfg.local_steps <= 1 or p == 1:
        return 0.0
    return max(0.0, 1.0 - cfg.local_after / cfg.epochs)


def _eval_time(cfg: Config, p: int, n_test: int, per_image: float, evaluation: str,
               ar: Callable[[float], float], metric: float) -> float:
    """Seconds of one evaluation of the test set."""
    per_image *= (6 if cfg.tta_translate else 2) if cfg.tta else 1  # TTA: a forward per view (pilab.engine.backend)
    if evaluation == "full":
        return n_test * per_image
    t = math.ceil(n_test / p) * per_image
    if p > 1:  # settle BN statistics (one broadcast ~ one Allreduce) + reduce the sums
        t += ar(bn_bytes(cfg.model, cfg.width)) + metric
    return t


def predict(cfg, np_: int, cluster, profile: str = "pilab", *, baseline_np: int | None = None,
            n_train: int | None = None, n_test: int | None = None, balance: str | None = None) -> dict:
    """Predicted time per epoch of ``cfg`` at ``np_`` ranks on ``cluster``.

    ``cluster``: a Calibration, a Cluster, a preset name ("pi4b_cluster") or a JSON path.
    ``profile``: "pilab" (fused buckets overlapped with backward, sharded evaluation) or "naive"
    (one blocking Allreduce per parameter tensor after backward, every rank evaluates everything);
    "naive_comm" and "naive_eval" take only one half of naive (see ``PROFILES``).
    ``baseline_np`` adds speedup, efficiency (E = S * p0 / p) and Karp-Flatt against that np.

        predict(Config(width=0.5), 8, "pi4b_cluster", "naive", baseline_np=2)["efficiency"]

    On a cluster whose nodes differ in speed (``Cluster.node_speeds``: "pi4b:12,pi5:12", a throttled
    board) every step waits for the slowest rank. ``balance``: "off" (every rank trains the same share of
    the global batch), "static" or "dynamic" (each rank's share set by its speed, ``data.batch_shares``:
    the same rule the training uses; the model's speeds do not change during a run, so the two price
    alike); default: ``cfg.balance`` where the Config has it, else "off". Such a prediction also carries
    ``balancing``: the step and epoch off, balanced, and on the ideal cluster (every node at the mean
    speed: the same total speed, perfect sharing), with their speedups against ``baseline_np``::

        predict(pi_config(), 48, "pi4b:12,pi5:12", baseline_np=2)["balancing"]["balanced"]["speedup"]

    Times are seconds; "time" is the training part of an epoch (as in result.json's epochs[].time),
    "epoch_time" adds evaluation. Settings that cannot run (np < 1, more ranks than the cluster has)
    raise ``ConfigError``.
    """
    _profile(profile)
    cfg = as_config(cfg)
    cl = resolve_cluster(cluster)
    p = _checked_np(np_, baseline_np, cl)
    n_train, n_test = _sizes(cfg, n_train, n_test)
    balance = _balance(cfg, balance)
    out = _priced(cfg, p, cl, profile, baseline_np, n_train, n_test, balance)
    if len(set(cl.rank_speeds(p) or [1.0])) > 1:
        out["balancing"] = _balancing(out, cfg, p, cl, profile, baseline_np, n_train, n_test)
    return out


def _priced(cfg: Config, p: int, cl: Cluster, profile: str, baseline_np, n_train: int, n_test: int,
            balance: str) -> dict:
    """``predict`` without the comparison of a mixed cluster's sharings."""
    out = (_ramped if cfg.batch_ramp else _one_batch)(cfg, p, cl, profile, n_train, n_test, balance)
    return _with_speedup(out, cfg, p, cl, profile, baseline_np, n_train, n_test, balance)


BALANCE = ("off", "static", "dynamic")


def _balance(cfg: Config, balance: str | None) -> str:
    balance = balance or getattr(cfg, "balance", "off")
    if balance not in BALANCE:
        raise ConfigError(f"balance={balance!r}; use one of {', '.join(BALANCE)}")
    return balance


def _balancing(out: dict, cfg: Config, p: int, cl: Cluster, profile: str, baseline_np, n_train, n_test) -> dict:
    """A mixed cluster's step and epoch with and without balanced shares, and on the ideal cluster of the
    same total speed (every node at the mean speed of the ranks, equal shares)."""
    import dataclasses
    speeds = cl.rank_speeds(p)
    mean = sum(speeds) / len(speeds)
    ideal = dataclasses.replace(cl, node_speeds=(mean,) * len(cl.node_speeds))
    # one baseline for all three: this cluster's baseline_np ranks (equal shares there, as with off)
    base = None if baseline_np is None else _priced(cfg, baseline_np, cl, profile, None, n_train, n_test, "off")
    rows = {}
    for key, cluster, mode in (("off", cl, "off"), ("balanced", cl, "static"), ("ideal", ideal, "off")):
        q = out if cluster is cl and (mode == "off") == (out["balance"] == "off") else \
            _priced(cfg, p, cluster, profile, None, n_train, n_test, mode)
        rows[key] = {"step_time": q["step_time"], "time": q["time"], "epoch_time": q["epoch_time"],
                     "speedup": speedup(base["epoch_time"], q["epoch_time"]) if base else None,
                     "shares": q["shares"]}
    for key in ("off", "balanced"):
        rows[key]["of_ideal"] = rows[key]["step_time"] / rows["ideal"]["step_time"]
    rows["mean_speed"] = mean
    return rows


def _one_batch(cfg: Config, p: int, cl, profile: str, n_train: int, n_test: int, balance: str = "off") -> dict:
    """``predict``'s epoch at one batch size (a ramp's epochs are each one: ``_ramped``)."""
    averaging, evaluation = _profile(profile)
    b = cfg.per_rank_batch(p)
    steps = _steps(cfg, p, b, n_train)
    place = _placement(cfg, p, cl)
    layout = gradient_layout(cfg.model, cfg.width)
    rank = _rank_costs(cfg, p, b, cl, place, len(layout))
    overhead, shares = cl.step_overhead_s, None
    if cl.node_speeds:  # nodes of different speeds: the step is the slowest rank's
        rank, overhead, shares = _slowest_rank(cfg, p, b, cl, place, len(layout), balance)
    compute, data, straggler = rank["compute"], rank["data"], rank["straggler"]
    ar = _allreduce_fn(p, cl, place)
    metric = ar(METRIC_BYTES) if p > 1 else 0.0
    local = _local_share(cfg, p)
    messages, comm, exposed, sync_bn = _step_comm(cfg, p, cl, place, layout, averaging, compute, steps, ar,
                                                  metric, local)
    step = data + compute + straggler + exposed + overhead
    eval_time = _eval_time(cfg, p, n_test, rank["eval_s_per_image"], evaluation, ar, metric)
    # evaluation runs every eval_every epochs and after the last: its average share per epoch
    evals_per_epoch = len({e for e in range(1, cfg.epochs + 1) if e % cfg.eval_every == 0} | {cfg.epochs}) \
        / cfg.epochs
    time_ = steps * step
    images = steps * b * p
    n_params = sum(n for n, _ in layout)
    wire = codec_for(cfg.compression).itemsize
    return {
        "np": p, "profile": profile, "cluster": cl.name, "model": cfg.model, "width": cfg.width,
        "nodes": place["nodes"], "ranks_per_node": place["ranks_per_node"],
        "threads": place["threads"], "oversubscription": place["oversubscription"],
        "per_rank_batch": b, "global_batch": b * p, "steps_per_epoch": steps, "images": images,
        "n_train": n_train, "n_test": n_test,
        "params": n_params, "messages_per_step": messages,
        "bytes_per_step": n_params * wire * ((1 - local) + local * math.ceil(steps / cfg.local_steps) / steps
                                             if local else 1),
        "local_steps": cfg.local_steps, "local_share": local,
        "algorithm": cl.algorithm,
        "step_time": step,
        "step": {"compute": compute, "data": data, "straggler": straggler, "comm": comm,
                 "comm_exposed": exposed, "overhead": overhead},
        "sync_bn_per_step": sync_bn,
        "compute": steps * compute, "data": steps * data, "straggler": steps * straggler,
        "comm": steps * comm, "comm_exposed": steps * exposed, "overhead": steps * overhead,
        "time": time_, "eval_time": eval_time, "evals_per_epoch": evals_per_epoch,
        "epoch_time": time_ + evals_per_epoch * eval_time,
        "first_epoch_time": time_ + cl.warmup_s,
        "images_per_s": images / time_ if time_ > 0 else None,
        **({"balance": balance, "shares": shares} if shares is not None else {}),
    }


def _slowest_rank(cfg: Config, p: int, b: int, cl: Cluster, place: dict, n_tensors: int,
                  balance: str) -> tuple[dict, float, list[int]]:
    """On nodes of different speeds: the costs of the rank that finishes its part of a step last (each
    rank's compute, data and overhead divided by its node's speed), its overhead, and every rank's share
    of the global batch (equal with ``balance`` off, else ``data.batch_shares`` of the speeds). The
    test set is sharded equally whatever the shares: evaluation waits for the slowest rank."""
    from ..data import batch_shares  # pilab.data loads torch: not at `import pilab.perfmodel`

    speeds = cl.rank_speeds(p)
    shares = [b] * p if balance == "off" else batch_shares(b * p, speeds)
    costs = {q: _rank_costs(cfg, p, q, cl, place, n_tensors) for q in set(shares)}
    slowest = max(range(p), key=lambda r: (costs[shares[r]]["data"] + costs[shares[r]]["compute"]
                                           + cl.step_overhead_s) / speeds[r])
    s = speeds[slowest]
    rank = {k: v / s for k, v in costs[shares[slowest]].items()}
    rank["eval_s_per_image"] = costs[shares[slowest]]["eval_s_per_image"] / min(speeds)
    return rank, cl.step_overhead_s / s, shares


def _steps(cfg: Config, p: int, b: int, n_train: int) -> int:
    """Optimizer steps in an epoch at np=p; none is refused (a speedup would divide by zero)."""
    from ..data import epoch_accounting  # pilab.data loads torch: not at `import pilab.perfmodel`

    steps = epoch_accounting(n_train, p, b, cfg.sharding, seed=cfg.seed)["steps"]
    if steps < 1:
        raise ConfigError(f"np={p}: each rank holds at most {-(-n_train // p)} of the {n_train} training images, "
                          f"fewer than its batch of {b}; use at least {p * b} training images (or a smaller batch)")
    return steps


def _step_comm(cfg: Config, p: int, cl, place: dict, layout, averaging: str, compute: float, steps: int, ar,
               metric: float, local: float) -> tuple:
    """(messages, comm, exposed, sync_bn) per step: the gradients' Allreduces (hidden behind backward as far
    as the overlap allows), the metrics' one, local SGD's averages and SyncBatchNorm's Allreduces."""
    messages, comm, exposed = (0, 0.0, 0.0) if p == 1 else \
        _gradient_comm(cfg, layout, averaging, compute, cl, ar, _overlap_rate(cl, place))
    comm += metric
    exposed += metric
    if local:
        comm, exposed, messages = _mix_local_steps(cfg, local, steps, layout, ar, metric, comm, exposed, messages)
    sync_bn, sync_messages = _sync_bn_cost(cfg, p, cl, place)
    return messages + sync_messages, comm + sync_bn, exposed + sync_bn, sync_bn


def _profile(profile: str) -> tuple:
    if profile not in PROFILES:
        raise ConfigError(f"profile={profile!r}; use one of {', '.join(PROFILES)}")
    return PROFILES[profile]


def _checked_np(np_, baseline_np, cl) -> int:
    p = int(np_)
    if p < 1:
        raise ConfigError(f"np={p} must be >= 1")
    if baseline_np is not None and baseline_np < 1:
        raise ConfigError(f"baseline_np={baseline_np} must be >= 1")
    if cl.nodes and cl.ranks_per_node and p > cl.nodes * cl.ranks_per_node:
        raise ConfigError(f"np={p} exceeds {cl.name}: {cl.nodes} nodes x {cl.ranks_per_node} ranks")
    return p


def _mix_local_steps(cfg: Config, local: float, steps: int, layout, ar, metric: float, comm: float,
                     exposed: float, messages: float) -> tuple[float, float, float]:
    """(comm, exposed, messages) per step with local SGD: a local step sends only the metrics (a blocking
    Allreduce, so stragglers still wait each step); every local_steps steps and at each epoch's end the
    parameters and BatchNorm statistics are averaged, blocking, nothing to hide behind. Mixed by the share
    ``local`` of local steps in the run."""
    n_params = sum(n for n, _ in layout)
    average = ar(n_params * ELEMENT_BYTES) + ar(bn_bytes(cfg.model, cfg.width))
    per_step_average = average * math.ceil(steps / cfg.local_steps) / steps
    return ((1 - local) * comm + local * (metric + per_step_average),
            (1 - local) * exposed + local * (metric + per_step_average),
            (1 - local) * messages + local * (1 + len(buckets_for(layout, cfg.bucket_mb, cfg.bucket_tail_mb))
                                              * math.ceil(steps / cfg.local_steps) / steps))


def _sync_bn_cost(cfg: Config, p: int, cl, place: dict) -> tuple[float, int]:
    """(seconds, messages) per step of SyncBatchNorm (bn="sync"): every BatchNorm layer Allreduces [sum, sum
    of squares, count] forward and [sum dy, sum dy*xhat] backward, in float64 (pilab.engine.layers),
    blocking: the layer cannot go on until it has them, so each is on the critical path and none hides
    behind compute. Each is also a point where every rank waits for the slowest; the straggler term still
    counts one per step, so at large np this is a lower bound. With bn_group the Allreduces span a group of
    consecutive ranks only (2 per Pi node: shared memory)."""
    group = cfg.sync_group(p)
    if group <= 1:
        return 0.0, 0
    chans = bn_channels(cfg.model, cfg.width)

    def gar(nbytes):
        return allreduce_time(nbytes, group, cl, None, place["crowded"])
    return sum(gar((2 * c + 1) * 8) + gar(2 * c * 8) for c in chans), 2 * len(chans)


def _with_speedup(out: dict, cfg: Config, p: int, cl, profile: str, baseline_np, n_train, n_test,
                  balance: str = "off") -> dict:
    if baseline_np is not None:
        base = out if baseline_np == p else _priced(cfg, baseline_np, cl, profile, None, n_train, n_test, balance)
        S = speedup(base["epoch_time"], out["epoch_time"])
        out.update({"baseline_np": baseline_np, "speedup": S,
                    "efficiency": efficiency(S, p, baseline_np),
                    "karp_flatt": karp_flatt(S, p, baseline_np),
                    "train_speedup": speedup(base["time"], out["time"])})
    return out


# per-epoch figures a batch ramp averages over its epochs (the rest are the first epoch's)
_EPOCH_SUMS = ("compute", "data", "straggler", "comm", "comm_exposed", "overhead", "time", "epoch_time",
               "images", "steps_per_epoch")


def _ramped(cfg: Config, p: int, cl, profile: str, n_train: int, n_test: int, balance: str = "off") -> dict:
    """A batch ramp (``cfg.batch_ramp``): each epoch predicted at its own batch, averaged per epoch."""
    from dataclasses import replace

    by_batch = {b: _priced(replace(cfg, batch_size=b, batch_ramp=""), p, cl, profile, None, n_train, n_test,
                           balance) for _, b in cfg.ramp()}  # once per batch, not per epoch
    parts = [by_batch[cfg.batch_at(e)] for e in range(cfg.epochs)]
    out = dict(parts[0])
    for k in _EPOCH_SUMS:
        out[k] = sum(q[k] for q in parts) / cfg.epochs
    steps = sum(q["steps_per_epoch"] for q in parts)
    out["step_time"] = out["time"] / out["steps_per_epoch"]
    out["step"] = {k: sum(q["step"][k] * q["steps_per_epoch"] for q in parts) / steps for k in parts[0]["step"]}
    out["images_per_s"] = out["images"] / out["time"] if out["time"] > 0 else None
    out["first_epoch_time"] = parts[0]["first_epoch_time"]
    out["batch_plan"] = [{"epoch": e + 1, "per_rank_batch": q["per_rank_batch"], "steps": q["steps_per_epoch"]}
                         for e, q in enumerate(parts)]
    return out


def predict_table(cfg, nps: Iterable[int], cluster, profile: str = "pilab",
                  baseline_np: int | None = None, **kwargs) -> list[dict]:
    """``predict`` at each np, with speedup/efficiency against ``baseline_np`` (default: the first)."""
    nps = list(nps)
    if not nps:
        raise ConfigError("predict_table needs at least one np")
    base = nps[0] if baseline_np is None else baseline_np
    return [predict(cfg, p, cluster, profile, baseline_np=base, **kwargs) for p in nps]


def pi_table(cfg=None, nps: Iterable[int] = PI_TABLE_NPS, cluster=None) -> list[dict]:
    """Predicted Pi-cluster scaling for both profiles beside the published figures (p0 = 2)."""
    cfg = pi_config() if cfg is None else as_config(cfg)
    cl = pi4b_cluster() if cluster is None else resolve_cluster(cluster)
    p0 = PUBLISHED["baseline_np"]
    published = {r["np"]: r for r in published_table()}
    rows = []
    for p in nps:
        pil = predict(cfg, p, cl, "pilab", baseline_np=p0)
        nai = predict(cfg, p, cl, "naive", baseline_np=p0)
        pub = published.get(p, {})
        rows.append({
            "np": p, "nodes": pil["nodes"],
            "published_speedup": pub.get("speedup"), "published_efficiency": pub.get("efficiency"),
            "naive_speedup": nai["speedup"], "naive_efficiency": nai["efficiency"],
            "pilab_speedup": pil["speedup"], "pilab_efficiency": pil["efficiency"],
            "naive_epoch_s": nai["epoch_time"], "pilab_epoch_s": pil["epoch_time"],
            "naive_comm_exposed_s": nai["comm_exposed"], "pilab_comm_exposed_s": pil["comm_exposed"],
            "naive_eval_s": nai["eval_time"], "pilab_eval_s": pil["eval_time"],
        })
    return rows


def balance_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """``predict_table``'s rows on a mixed cluster as the comparison of its sharings: per np the step and
    speedup with equal shares and with shares by speed, each step as a multiple of the ideal one (np
    where every rank runs at one speed have no comparison: off = balanced)."""
    out = []
    for r in rows:
        b = r.get("balancing")
        row = {"np": r["np"], "nodes": r["nodes"]}
        if b is None:
            row.update(step_off=r["step_time"], step_balanced=r["step_time"], step_ideal=r["step_time"],
                       speedup_off=r.get("speedup"), speedup_balanced=r.get("speedup"), off_of_ideal=1.0,
                       balanced_of_ideal=1.0)
        else:
            row.update(step_off=b["off"]["step_time"], step_balanced=b["balanced"]["step_time"],
                       step_ideal=b["ideal"]["step_time"], speedup_off=b["off"]["speedup"],
                       speedup_balanced=b["balanced"]["speedup"], off_of_ideal=b["off"]["of_ideal"],
                       balanced_of_ideal=b["balanced"]["of_ideal"])
        out.append(row)
    return out


# `pilab perfmodel table`'s comparison on a mixed cluster (balance_rows)
BALANCE_COLUMNS = ["np", "nodes", "step_off", "step_balanced", "step_ideal", "off_of_ideal", "balanced_of_ideal",
                   "speedup_off", "speedup_balanced"]
# the columns `pilab perfmodel table` prints of each predict() row
TABLE_COLUMNS = ["np", "nodes", "threads", "per_rank_batch", "steps_per_epoch", "step_time",
                 "time", "comm", "comm_exposed", "eval_time", "epoch_time", "images_per_s",
                 "speedup", "efficiency"]
# the columns of the Pi table in docs/perfmodel.md
PI_TABLE_COLUMNS = ["np", "nodes", "published_speedup", "published_efficiency", "naive_speedup",
                    "naive_efficiency", "pilab_speedup", "pilab_efficiency", "naive_epoch_s",
                    "pilab_epoch_s"]


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                   digits: int = 3) -> str:
    """A GitHub Markdown table of ``rows`` (None shows as an em dash; fractions named *efficiency*
    as percentages)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())

    def fmt(k, v):
        if v is None:
            return "—"
        if isinstance(v, float):
            if math.isnan(v):
                return "—"
            if "efficiency" in k:
                return f"{100 * v:.1f}%"
            return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(k, r.get(k)) for k in columns) + " |" for r in rows]
    return "\n".join(lines)


def pi_table_markdown(cfg=None, **kwargs) -> str:
    """``pi_table(cfg, **kwargs)`` as Markdown: speedups, efficiencies and epoch times.

        pi_table_markdown(nps=(2, 4, 48))
    """
    return markdown_table(pi_table(cfg, **kwargs), PI_TABLE_COLUMNS)
