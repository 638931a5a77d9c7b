"""The large-batch toolbox as remedies candidates, beyond pilab's default ones: local SGD, the few-step recipe's
pieces alone and together, small fixed global batches with BatchNorm over the global batch (SyncBatchNorm), over
a node's ranks or renormalised, and batch-size ramps, fixed or driven by the gradient noise scale -- the
candidates of the committed fast-and-right study (experiments/fast-but-wrong/remedies/), each defined from the
settings and np (the labels carry their batch sizes and epochs). :func:`pilab.study.remedies.toolbox_candidates`
puts them after the default ones::

    python -m pilab remedies --np 48 --candidates toolbox --only "fixed global batch 192 + few-step recipe + SyncBatchNorm"
    remedies.search(cfg, 48, candidates=remedies.toolbox_candidates, only=["local SGD H=8"])
"""
from __future__ import annotations

from ..config import Config


def fixed_per_rank(cfg: Config, np_: int) -> int:
    """Images per rank of "fixed global batch": the size a single rank used, rounded to a multiple of np
    (>= 2 per rank)."""
    return max(2, round(cfg.batch_size / np_))


def fast_and_right(cfg: Config, np_: int) -> list[tuple[str, dict | None]]:
    """The candidates that keep np=1's epochs: local SGD (Stich 2019; Lin et al. 2020: fewer
    averages, so small per-rank batches -- many steps -- stay cheap on the wire), the few-step recipe's
    pieces (as airbench trains CIFAR-10 at large batch), alone and together, and batch-size ramps."""
    warm = max(1.0, round(cfg.epochs / 5, 1))  # the warmup of remedies.default_candidates
    eight = {"batch_mode": "global", "batch_size": 8 * np_} if 8 < cfg.per_rank_batch(np_) else None
    # 4 per rank: the measured gradient noise scale (1,000-2,700 images over most of the committed
    # study's run) says a global batch B needs about 1 + B / B_noise times the examples of a tiny one to
    # get as far (McCandlish et al. 2018) -- ~2x at np=48's 1,536, ~1.25x at 384, ~1.1x at 192, where
    # the Pi's predicted whole-run speedup is still ~19x; fewer than 4 images leave BatchNorm nothing to
    # normalise with
    four = {"batch_mode": "global", "batch_size": 4 * np_, "lr_scaling": "sqrt", "warmup_epochs": warm} \
        if fixed_per_rank(cfg, np_) < 4 < cfg.per_rank_batch(np_) else None
    tri = {"schedule": "linear", "warmup_epochs": max(0.5, round(cfg.epochs / 20, 1))}
    recipe = {"label_smoothing": 0.2, "ema_epochs": 0.5, "nesterov": True, **tri, "tta": True}
    local8 = {**eight, "local_steps": 8} if eight else None
    # a batch ramp (Smith et al. 2018; AdaBatch): a quarter of the per-rank batch for the first 30% of the
    # epochs (4x the steps), half until 60%, then the whole; the lr rule follows each epoch's batch
    b, e1, e2 = cfg.batch_size, round(cfg.epochs * 0.3), round(cfg.epochs * 0.6)
    ramp = {"batch_size": b // 4, "batch_ramp": f"{e1}:{b // 2},{e2}:{b}"} \
        if cfg.batch_mode == "per_rank" and b >= 8 and 0 < e1 < e2 < cfg.epochs else None
    ramp_label = f"batch ramp {b // 4}-{b // 2}-{b}"
    gns = {"batch_size": b // 4, "batch_ramp": f"gns:{b}"} if ramp and np_ > 1 else None
    # the same ramp from an eighth (4 per rank at 32): the global batch kept near a tenth to a fifth of the
    # noise scale measured at each stage (~550-2,700 images in epochs 2-7, rising after), at constant lr
    small = {"batch_size": b // 8, "batch_ramp": f"{e1}:{b // 4},{e2}:{b // 2}", "schedule": "constant"} \
        if ramp and b // 8 >= 4 else None
    return [
        *[(f"local SGD H={h}", {"local_steps": h}) for h in (2, 4, 8, 16)],
        (f"post-local SGD H=8 after {warm:g} ep", {"local_steps": 8, "local_after": warm}),
        ("local SGD H=8 at 8 per rank", local8),
        ("local SGD H=8 at 8 per rank + sqrt lr", {**local8, "lr_scaling": "sqrt"} if local8 else None),
        (f"fixed global batch {4 * np_} + sqrt lr + warmup", four),
        # 4 per rank ends under-trained, not over-fitted (seed 0: train accuracy 0.49 against np=1's 0.60;
        # BatchNorm statistics recomputed over 3,072 training images move test accuracy by 0.6 points only):
        # the few-step recipe's pieces are what trains more per step; its warmup stays the 4-per-rank one
        # (0.5 epochs to the sqrt rule's 0.12 is the near-divergence seen at 8 per rank)
        (f"fixed global batch {4 * np_} + few-step recipe", {**four, **recipe, "warmup_epochs": warm}
         if four else None),
        # ... and what costs 4 per rank its accuracy is BatchNorm over 4 images: one process at the same
        # global batch, lr and schedule reaches 0.647 with BatchNorm over 192, 0.560 over groups of 4 (seed 0;
        # np=48: 0.560). Batch Renormalization (Ioffe 2017) corrects each group's statistics towards the
        # running ones, with no communication (SyncBatchNorm would cost the Pi ~0.06 s a step)
        (f"fixed global batch {4 * np_} + sqrt lr + warmup + batch renorm", {**four, "bn": "renorm"}
         if four else None),
        # ... or pay for it: SyncBatchNorm's statistics are the global batch's, as the one process's are
        # (two blocking Allreduces per BatchNorm layer: the performance model prices them, ~0.06 s of a
        # 0.25 s Pi step at np=48); the simulator runs it as one forward over all ranks' images
        (f"fixed global batch {4 * np_} + sqrt lr + warmup + SyncBatchNorm", {**four, "bn": "sync"}
         if four else None),
        (f"fixed global batch {4 * np_} + few-step recipe + SyncBatchNorm",
         {**four, **recipe, "warmup_epochs": warm, "bn": "sync"} if four else None),
        # flip TTA evaluates every test image twice: on the Pi that is what takes the recipe + SyncBatchNorm
        # below 15x (14.4x predicted, 0.636 +- 0.012 over 3 seeds); the rest of the recipe costs no time
        (f"fixed global batch {4 * np_} + few-step recipe without TTA + SyncBatchNorm",
         {**four, **recipe, "warmup_epochs": warm, "bn": "sync", "tta": False} if four else None),
        # ... or take the statistics over a few ranks only (bn_group): over the two ranks of a Pi node
        # (8 images; their Allreduces go through shared memory: 0.4 ms of a step predicted at np=48, against
        # 57 ms over all 48 ranks) or over 8 ranks on 4 nodes (32 images, as a 32-per-rank BatchNorm; 23 ms)
        *[(f"fixed global batch {4 * np_} + few-step recipe + SyncBatchNorm over {g} ranks",
           {**four, **recipe, "warmup_epochs": warm, "bn": "sync", "bn_group": g}
           if four and np_ % g == 0 and np_ > g else None) for g in (2, 8)],
        ("label smoothing 0.2", {"label_smoothing": 0.2}),
        ("weight EMA 0.5 ep", {"ema_epochs": 0.5}),
        ("nesterov", {"nesterov": True}),
        ("triangular lr", tri),
        ("flip TTA", {"tta": True}),
        ("few-step recipe", recipe),
        ("few-step recipe + sqrt lr", {**recipe, "lr_scaling": "sqrt"}),
        ("few-step recipe + local SGD H=8 at 8 per rank", {**recipe, **local8} if local8 else None),
        (ramp_label, ramp),
        (f"{ramp_label} + sqrt lr", {**ramp, "lr_scaling": "sqrt"} if ramp else None),
        (f"{ramp_label} at constant lr", {**ramp, "schedule": "constant"} if ramp else None),
        (f"{ramp_label} + local SGD H=8", {**ramp, "local_steps": 8} if ramp else None),
        (f"batch ramp {b // 8}-{b // 4}-{b // 2} at constant lr", small),
        # ... or one the gradient noise scale drives (McCandlish et al. 2018): from a quarter of the
        # per-rank batch, at an epoch's end the largest doubling whose global batch is within the noise scale
        # measured over that epoch (it needs np >= 2: the ranks' own gradients are the small batches)
        (f"noise-driven batch ramp {b // 4}-{b}", gns),
        (f"noise-driven batch ramp {b // 4}-{b} + sqrt lr", {**gns, "lr_scaling": "sqrt"} if gns else None),
    ]
