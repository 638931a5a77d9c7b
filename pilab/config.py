"""One frozen configuration for a training run, validated once, saved with every result.

Variants are made with ``dataclasses.replace`` (which re-validates)::

    from dataclasses import replace
    from pilab.config import Config
    cfg = Config(model="mobilenetv2_cifar", width=0.5, epochs=2)
    big = replace(cfg, lr_scaling="linear", warmup_epochs=2)

Every field is declared once, with ``setting(default, help, ...)``: its default, what it does, and the
values it allows (``choices``, or bounds). That one declaration is the CLI's ``--flag`` and help text
(``pilab.cli.common``), the panel's tooltips, the manual's Config reference (generated from
``describe()``) and the check that refuses a bad value (``ConfigError``, one line). Adding a setting is
one line here; the component that reads it is its own module.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping


class ConfigError(ValueError):
    """A setting is invalid. The message is one line naming the setting and the fix."""


# At most this many test images per forward pass in evaluation, whatever ``eval_batch``: an evaluation
# batch runs in equal pieces (500 -> 10 x 50, 167 -> 4 x 41-42), so its activations stay those of
# EVAL_CHUNK images (~1.5 MB each at width 1.0: 75 MB instead of 750 at the default eval_batch of 500).
# The numbers do not change: in eval mode an image's logits do not depend on the images beside it, as
# long as the batch is not so small that oneDNN takes another kernel (here: under 16 images on one
# thread, 1 image on more) -- equal pieces of a batch over EVAL_CHUNK are never under EVAL_CHUNK / 2.
# tests/test_memory.py checks it bitwise for every model.
EVAL_CHUNK = 50


def setting(default, help: str, *, choices: tuple = (), at_least: float | None = None, above: float | None = None,
            below: float | None = None, finite: bool = False, hint: str = "", allowed: str = ""):
    """A ``Config`` field, declared once with everything said about it::

        epochs: int = setting(10, "passes over the training set", above=0)
        bn: str = setting("local", "local: per-rank statistics | sync: across ranks", choices=("local", "sync"))

    ``help``: what it does (the CLI's help, the panel's tooltip, the reference). ``choices``: the values
    allowed. ``at_least`` / ``above`` / ``below``: bounds, checked by ``Config`` with the error
    "NAME=VALUE must be >= BOUND" (``hint`` appended in brackets); ``finite``: inf and NaN refused.
    ``allowed``: words for the reference where a rule of its own (in ``_validate_values``) checks it.
    """
    meta = {"help": help, "choices": tuple(choices), "at_least": at_least, "above": above, "below": below,
            "finite": finite, "hint": hint, "allowed": allowed}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    # --- model ---
    model: str = setting("mobilenetv2_cifar", "mobilenetv2_cifar | mobilenetv2 | squeezenet1_1 | spiking_cnn | your own: package.module:builder or path/to/file.py:builder (a function taking num_classes)")
    width: float = setting(1.0, "width multiplier, 0.25..1.4 (MobileNetV2), 0.25..2 (spiking_cnn); SqueezeNet 1.0")
    timesteps: int = setting(4, "spiking models: time steps each image is presented for; others ignore it", at_least=1)
    # --- data ---
    data: str = setting("embedded", '"embedded" (shipped subset) | "cifar10" (cached full set) | a path')
    image_size: int = setting(0, "resize an ImageFolder's images to this many pixels square when decoding (needed when their sizes differ); 0 = keep them as they are", at_least=0)
    train_subset: int = setting(0, "class-stratified training images to use; 0 = all", at_least=0)
    test_subset: int = setting(0, "class-stratified test images to use; 0 = all", at_least=0)
    sharding: str = setting("static", "static: one fixed shard per rank | reshuffle: shared permutation per epoch", choices=('static', 'reshuffle'))
    augment: bool = setting(True, "random crop (reflect pad of 1/8 the image size: 4 px at 32x32) + horizontal flip; --no-augment for data a flip changes the meaning of (digits, text)")
    # --- batch and schedule ---
    epochs: int = setting(10, "passes over the training set (the original study used 10)", above=0)
    batch_mode: str = setting("per_rank", "per_rank: batch_size per rank (global grows with np) | global: split", choices=('per_rank', 'global'))
    batch_size: int = setting(32, "images per rank (per_rank) or in the global batch (global)", above=0)
    batch_ramp: str = setting("", "batch-size ramp: 'EPOCH:BATCH,...' -- from each of those epochs (0-based) on, that batch (in batch_size's sense), e.g. batch_size=8 with '3:16,6:32'; or 'gns:MAX' -- at each epoch's end the batch becomes the largest of batch_size x 2^k (up to MAX, never smaller than before) whose global batch is within the gradient noise scale measured over that epoch (McCandlish et al. 2018; needs np >= 2); '' = batch_size throughout")
    max_steps: int = setting(0, "stop after this many optimizer steps in total; 0 = no limit", at_least=0)
    batch_aug: int = setting(1, "batch augmentation (Hoffer et al. 2019): each image of a rank's batch goes into the step this many times, each copy with its own crop and flip; the loss is the mean over the copies, so a step computes this many times the images (the speed counts it); 1 = off", at_least=1, hint="1: off")
    balance: str = setting("off", "each rank's share of the global batch set by its speed, the global batch unchanged (a slow or throttled node's remedy; needs sharding=reshuffle; docs/guide/mixed-cluster.md): off (equal shares) | static (measured over the first 8 steps, then kept) | dynamic (measured again every 8 steps, re-split when a rank's speed moved more than 15%) | static:SPEED,... (given, one per rank; SPEEDxCOUNT repeats one: static:1x24,2.5x24); result.json's balance has the shares and every change", allowed="off, static, dynamic, or static:SPEEDS (one per rank)")
    # --- optimizer ---
    optimizer: str = setting("sgd", "sgd | lars | lamb (Adam's moments with a layer-wise trust ratio, You et al. 2020: beta1 = momentum, beta2 0.999; its lr is Adam's scale, ~1e-3 per 256 images, not SGD's) | muon (the weights muon_on names step by Muon at muon_lr, every other parameter by SGD at lr)", choices=('sgd', 'lars', 'lamb', 'muon'))
    lr: float = setting(0.05, "learning rate per `lr_ref_batch` examples of the global batch", above=0, finite=True)
    lr_ref_batch: int = setting(64, "reference batch size the lr is quoted for", above=0)
    lr_scaling: str = setting("none", "rule from reference to global batch: none | linear | sqrt", choices=('none', 'linear', 'sqrt'))
    warmup_epochs: float = setting(0.0, "per-step linear warmup from ~0 to the peak lr, in epochs", at_least=0)
    schedule: str = setting("cosine", "after warmup, per step: cosine | step (x0.1 at 50%, 75%) | constant | linear (to 0: with warmup, the triangular schedule of few-step recipes; without, airbench's linear decay) | wsd (warmup-stable-decay: the peak until the last decay_epochs, then linear to 0; a checkpoint of the stable phase resumes with more epochs)", choices=('cosine', 'step', 'constant', 'linear', 'wsd'))
    decay_epochs: float = setting(2.0, "schedule=wsd: the last this many epochs decay linearly to 0 (the rest after warmup stays at the peak); other schedules ignore it", above=0, finite=True)
    momentum: float = setting(0.9, "SGD/LARS momentum coefficient (LAMB's beta1)", at_least=0, below=1)
    nesterov: bool = setting(False, "Nesterov momentum")
    label_smoothing: float = setting(0.0, "training loss: cross-entropy with this label smoothing (0 = none)", at_least=0, below=1)
    lookahead_steps: int = setting(0, "Lookahead (Zhang et al. 2019): every this many steps the weights are set halfway (alpha 0.5) from where they stood that many steps ago towards where the optimizer took them, and go on from there (5-10 is usual); 0 = off", at_least=0)
    ema_epochs: float = setting(0.0, "evaluate an exponential moving average of the weights whose time constant is this many epochs (e.g. 0.5: the same horizon at every np; 0 = the weights themselves)", at_least=0)
    clip_grad_norm: float = setting(0.0, "before each optimizer step, scale the averaged gradient down to this global L2 norm if it is longer (0 = never)", at_least=0)
    tta: bool = setting(False, "evaluation averages the logits of each test image and of its mirror image")
    tta_translate: bool = setting(False, "with tta: also the image moved one pixel up-left and one down-right (reflect padding), each with its mirror: six views, weighted as airbench's (half the plain pair, a quarter each moved pair); 3x tta's evaluation cost", allowed="only with tta")
    weight_decay: float = setting(5e-4, "L2 penalty coefficient", at_least=0)
    weight_decay_on: str = setting("weights", "weights: conv/linear weights only | all parameters", choices=('weights', 'all'))
    bn_lr_scale: float = setting(1.0, "learning rate of BatchNorm scales/shifts and of biases, as a multiple of the weights' (fast-CIFAR recipes raise it); 1 = the same", above=0, finite=True, hint="1: the weights' lr")
    lars_eta: float = setting(0.001, "LARS trust coefficient")
    muon_lr: float = setting(0.008, "optimizer=muon: the learning rate of the weights Muon steps, per `lr_ref_batch` examples, scaled by lr_scaling and the schedule like lr (0.008 per 64 images: airbench's 0.24 at a batch of 2,000 by the linear rule); each step moves a weight by muon_lr times its orthogonalised momentum, the weight held at norm sqrt(its output channels); other optimizers ignore it", above=0, finite=True)
    muon_momentum: float = setting(0.6, "optimizer=muon: Muon's Nesterov momentum (airbench: 0.6 at a batch of 2,000); `momentum` is the SGD parameters'", at_least=0, below=1)
    muon_on: str = setting("conv", "optimizer=muon: the weights Muon steps: conv (every convolution's filters but depthwise ones) | conv+depthwise | conv+head (and the classifier's weight) | conv+depthwise+head; the rest (BatchNorm, biases, the head unless named) steps by SGD", choices=("conv", "conv+depthwise", "conv+head", "conv+depthwise+head"))
    # --- BatchNorm ---
    bn_momentum: float = setting(0.1, "BatchNorm running statistics: the weight of each new batch's (torch's momentum; 0.1 = torch's default; airbench: 0.4, for weights that move fast in few steps, whose statistics would otherwise lag behind and spoil evaluation)", above=0, below=1)
    freeze_bn_scale: bool = setting(False, "every BatchNorm scale fixed at 1 and not trained (airbench's; pair it with a large bn_lr_scale for the shifts, airbench: 64)", allowed="not with zero_init_residual")
    dirac_init: bool = setting(False, "every dense convolution with at least as many output as input channels starts as the identity on its first input-many filters (torch.nn.init.dirac_; the others keep their random start), as airbench's convolutions; depthwise and narrowing convolutions keep theirs")
    zero_init_residual: bool = setting(False, "the last BatchNorm scale of every residual block starts at 0, so each block starts as the identity (Goyal et al. 2017); MobileNetV2's blocks with a shortcut, torchvision-style ResNet blocks")
    whiten_stem: bool = setting(False, "the first convolution over the images starts as a whitening of the training images' patches (their principal directions at unit variance, in +/- pairs; fast-CIFAR recipes), from 5,000 images drawn by the seed; it trains as any other layer")
    bn: str = setting("local", "local: per-rank statistics (the original study) | sync: across ranks over MPI | renorm: per-rank, Batch Renormalization (Ioffe 2017: corrected towards the running statistics, for small per-rank batches)", choices=('local', 'sync', 'renorm'))
    bn_buffers: str = setting("broadcast", "before eval/checkpoint: rank 0's running stats | rank average", choices=('broadcast', 'average'))
    ghost_batch: int = setting(0, "BN statistics over groups of this many images per rank; 0 = whole batch", at_least=0)
    bn_group: int = setting(0, "bn=sync: statistics over groups of this many consecutive ranks (2: one Pi node's two ranks, whose Allreduces never leave the node); 0 = all ranks", at_least=0)
    # --- communication ---
    local_steps: int = setting(1, "local SGD: steps each rank takes on its own copy of the model between parameter averages (1 = gradients averaged every step); every epoch ends with an average", at_least=1, hint="1: average gradients every step")
    local_after: float = setting(0.0, "post-local SGD: epochs of synchronous steps before local steps begin", at_least=0)
    bucket_mb: float = setting(1.0, "gradient fusion bucket size, MiB of fp32", above=0)
    bucket_tail_mb: float = setting(0.1, "the last bucket (the first layers' gradients, ready last in backward) cut again into buckets of this size, so less of it is left to send after backward; 0 (or >= bucket_mb) = not cut", at_least=0, hint="0: the last bucket is not cut")
    compression: str = setting("none", "none | fp16 (halves bytes sent)", choices=('none', 'fp16'))
    step_as_landed: bool = setting(False, "step each gradient bucket's parameters as its average lands, while the last buckets are still on the wire (SGD and LARS on CPU, bitwise the same step; off with gradient clipping or the noise scale, which need every gradient first)")
    # --- runtime ---
    seed: int = setting(0, "all randomness derives from (seed, epoch, step, rank)", at_least=0)
    threads: int = setting(0, "torch threads per rank; 0 = cores per node / ranks per node", at_least=0)
    device: str = setting("cpu", "cpu | cuda | auto", choices=('cpu', 'cuda', 'auto'))
    simulate_mode: str = setting("auto", "simulator only: exact (one forward per virtual rank, MPI's arithmetic bit for bit: to compare with mpiexec runs) | fast (one forward of the global batch, per-rank BatchNorm vectorised: the same mathematics to float rounding, ~the cost of one process training the global batch) | auto (exact where the run needs it; on a CPU run of 200+ steps the faster of the two, timed on its first batch; else fast; result.json says which: simulate_mode_used, simulate_mode_trial; see docs/simulator.md)", choices=('auto', 'exact', 'fast'))
    compile_bn: str = setting("auto", "simulator's fast mode only: its per-rank BatchNorm on large layers (1M+ activations) as torch.compile's fused C++ kernels, 11-15% off a step at MobileNetV2-CIFAR 1.0 (benchmarks/LOG.md); the same mathematics to float rounding; compiling takes 10-45 s and a C++ compiler (CXX, else g++) | auto (on for CPU runs of 200+ steps) | on | off; result.json: compile_bn_used (or why not)", choices=('auto', 'on', 'off'))
    eval_batch: int = setting(500, "test images per evaluation batch (its loss is summed in one piece; the forward runs EVAL_CHUNK images at a time, so memory does not grow with it); a stopped run's partial epoch is evaluated only when its test share fits one batch", above=0)
    eval_every: int = setting(1, "evaluate on the test set every N epochs (and always after the last)", above=0)
    checkpoint_every: int = setting(0, "write a checkpoint every K epochs; 0 = never", at_least=0)
    keep: int = setting(1, "checkpoints kept: the last K (checkpoint-eNNNN.pt; checkpoint.pt is the newest)", above=0)
    out: str = setting("", 'directory for result.json and checkpoints; "" = write nothing')
    resume: str = setting("", "checkpoint file to resume from")
    # --- long runs: mid-epoch checkpoints, stragglers ---
    checkpoint_minutes: float = setting(-1.0, "also checkpoint at a step boundary every M minutes (rank 0's clock); -1 = 10 on a multi-node run (ranks on >1 host) with --out, else never; 0 = never", allowed="-1, or >= 0")
    checkpoint_every_steps: int = setting(0, "also checkpoint every K optimizer steps, mid-epoch included; 0 = never", at_least=0)
    straggler_threshold: float = setting(0.2, "warn when a rank computes this fraction slower than the median rank (or spends this share of it in the exchange); 0 = never", at_least=0)
    straggler_steps: int = setting(10, "... for this many consecutive steps (medians over a window of 2x as many)", above=0)
    # --- a per-rank trace ---
    trace: bool = setting(False, "record every rank's step (data, forward, backward, each gradient message's Allreduce, wait, optimizer, evaluation, checkpoints) on clocks aligned over MPI into <out>/trace.json (Chrome Trace Event Format: open it in ui.perfetto.dev) and a per-rank table in result.json")
    trace_window: int = setting(50, "with trace: keep the first 5 steps, the last this many, and the steps a straggler warning named (a bounded file for a long run)", above=0)


    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------
    def _validate(self) -> None:
        for f in fields(self):
            value, options = getattr(self, f.name), f.metadata["choices"]
            if options and value not in options:
                raise ConfigError(
                    f"{f.name}={value!r} is not valid; choose one of {', '.join(options)}")
        for f in fields(self):
            value = getattr(self, f.name)
            want = _TYPES[f.name]
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                continue
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ConfigError(
                    f"{f.name}={value!r} has the wrong type; give a {want.__name__}")
        self._validate_values()
        self._validate_combinations()

    def _validate_values(self) -> None:
        """Each setting alone: the bounds its ``setting`` declares, a known model (or your own builder)
        and width, and the rules that bounds cannot say."""
        from .models import check_width

        for f in fields(self):
            _check_bounds(f.name, getattr(self, f.name), f.metadata)
        try:  # a registered name, or your own builder as "package.module:function"
            check_width(self.model, self.width)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not (self.checkpoint_minutes >= 0 or self.checkpoint_minutes == -1):
            raise ConfigError(f"checkpoint_minutes={self.checkpoint_minutes} must be >= 0 (0: never) or -1 "
                              "(10 on a multi-node run)")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("nesterov=True needs momentum > 0")
        if self.nesterov and self.optimizer == "lamb":
            raise ConfigError("nesterov=True is SGD's and LARS's momentum; LAMB has none: drop nesterov or use "
                              "optimizer=sgd or lars")

    def _validate_combinations(self) -> None:
        """Settings that cannot go together."""
        if self.ghost_batch and self.bn == "sync":
            raise ConfigError("ghost_batch needs bn='local' or 'renorm'; SyncBatchNorm already spans ranks")
        if self.bn_group and self.bn != "sync":
            raise ConfigError(f"bn_group={self.bn_group} groups SyncBatchNorm's ranks; use it with bn='sync'")
        self.ramp()  # raises ConfigError for a malformed ramp
        if self.gns_max and self.local_steps > 1:
            raise ConfigError(f"batch_ramp={self.batch_ramp!r} measures the gradient noise at every gradient "
                              "average, which local SGD (local_steps > 1) skips; use an explicit ramp with it")
        if self.local_after > self.epochs:
            raise ConfigError(f"local_after={self.local_after} must be between 0 and epochs={self.epochs}")
        if self.zero_init_residual and self.model in ("squeezenet1_1", "spiking_cnn"):
            raise ConfigError(f"zero_init_residual: {self.model} has no residual blocks; drop the setting or use "
                              "model=mobilenetv2_cifar")
        if self.lookahead_steps and self.local_steps > 1:
            raise ConfigError("lookahead_steps needs local_steps=1: local SGD's ranks hold different weights "
                              "between averages; use one or the other")
        if self.local_steps > 1 and self.bn == "sync":
            raise ConfigError("local_steps > 1 needs bn='local': SyncBatchNorm would exchange every step")
        if self.local_steps > 1 and self.compression != "none":
            raise ConfigError("local_steps > 1 averages parameters, which compression=fp16 would round; "
                              "use compression=none")
        self._validate_fewstep()
        self._validate_balance()
        if self.warmup_epochs > self.epochs:
            raise ConfigError(
                f"warmup_epochs={self.warmup_epochs} exceeds epochs={self.epochs}; shorten it")

    def _validate_fewstep(self) -> None:
        """Muon, the warmup-stable-decay schedule and the few-step tricks with the rest."""
        if self.schedule == "wsd":
            if self.warmup_epochs + self.decay_epochs > self.epochs:
                raise ConfigError(f"warmup_epochs={self.warmup_epochs} + decay_epochs={self.decay_epochs} exceed "
                                  f"epochs={self.epochs}; shorten them")
            if self.batch_ramp:
                raise ConfigError("schedule=wsd counts its decay in the first epoch's steps, which a batch_ramp "
                                  "changes; use one or the other")
        if self.freeze_bn_scale and self.zero_init_residual:
            raise ConfigError("freeze_bn_scale fixes every BatchNorm scale at 1, zero_init_residual starts some at 0; "
                              "use one or the other")
        if self.tta_translate and not self.tta:
            raise ConfigError("tta_translate adds moved views to tta's mirror pair; set tta too")
        if self.batch_aug > 1 and self.ghost_batch:
            raise ConfigError(f"batch_aug={self.batch_aug} puts each image's copies into the rank's batch, whose "
                              "ghost_batch groups would then split copies of one image; use one or the other")
        if self.batch_aug > 1 and not self.augment:
            raise ConfigError(f"batch_aug={self.batch_aug} makes differently augmented copies, and augment is off; "
                              "turn augment on, or use batch_aug=1")

    def _validate_balance(self) -> None:
        """Uneven shares (``balance``) with the rest: each rank must be able to take any images of a step."""
        if self.balance_plan()[0] == "off":
            return
        why = ("sharding=static keeps each rank to its own shard; use sharding=reshuffle" if self.sharding == "static"
               else "local SGD (local_steps > 1) gives each rank its own weights; use local_steps=1"
               if self.local_steps > 1 else "a batch_ramp changes the global batch the shares split; drop it"
               if self.batch_ramp else "bn=sync takes the statistics over all ranks; use bn=local or renorm"
               if self.bn == "sync" else "ghost_batch groups would not divide the shares; use ghost_batch=0"
               if self.ghost_batch else "")
        if why:
            raise ConfigError(f"balance={self.balance!r}: {why}")

    # ------------------------------------------------------------------
    def balance_plan(self, np_: int | None = None) -> tuple[str, list[float] | None]:
        """``balance`` as (mode, the given speeds or None), one speed per rank when ``np_`` is given::

            Config(balance="static:1x2,0.5").balance_plan()     # ("static", [1.0, 1.0, 0.5])
        """
        value = self.balance
        mode, _, given = str(value).partition(":")
        if mode not in ("off", "static", "dynamic") or (given and mode != "static"):
            raise ConfigError(f"balance={value!r}: use off, static, dynamic or static:SPEED,... (one speed per rank, "
                              "e.g. static:2,1 or static:1x24,2.5x24)")
        if not given:
            return mode, None
        speeds: list[float] = []
        for part in given.split(","):
            speed, _, count = part.strip().partition("x")
            try:
                s, n = float(speed), int(count) if count else 1
            except ValueError:
                s, n = -1.0, 0
            if not (s > 0 and math.isfinite(s) and n >= 1):
                raise ConfigError(f"balance={value!r}: {part.strip()!r} is not SPEED or SPEEDxCOUNT with SPEED > 0 "
                                  "(e.g. static:2,1 or static:1x24,2.5x24)")
            speeds += [s] * n
        if np_ is not None and len(speeds) != np_:
            # also where a checkpoint made at another np is resumed with its flags: its speeds were per rank
            want = ",".join(f"S{r}" for r in range(np_)) if np_ <= 3 else f"S0,...,S{np_ - 1}"
            raise ConfigError(f"balance={value!r} gives {len(speeds)} speeds for {np_} ranks; give one per rank "
                              f"(--balance static:{want}) or let them be measured (--balance static)")
        return mode, speeds

    def ramp(self) -> list[tuple[int, int]]:
        """The batch plan as (first epoch, batch) pairs, starting with (0, batch_size)::

            Config(batch_size=8, batch_ramp="3:16,6:32", epochs=10).ramp()   # [(0, 8), (3, 16), (6, 32)]
        """
        plan = [(0, self.batch_size)]
        if not self.batch_ramp.strip() or self.gns_max:  # a noise-driven ramp is chosen while training
            return plan
        for part in self.batch_ramp.split(","):
            try:
                e, b = (int(v) for v in part.split(":"))
            except ValueError:
                raise ConfigError(f"batch_ramp={self.batch_ramp!r}: {part.strip()!r} is not EPOCH:BATCH; write e.g. "
                                  "'3:16,6:32'") from None
            if not plan[-1][0] < e < self.epochs or b < 1:
                raise ConfigError(f"batch_ramp={self.batch_ramp!r}: epochs must rise between 1 and epochs-1="
                                  f"{self.epochs - 1} and batches be >= 1")
            plan.append((e, b))
        return plan

    @property
    def gns_max(self) -> int:
        """MAX of a noise-driven ramp (``batch_ramp="gns:MAX"``), in batch_size's sense; 0 for any other."""
        head, _, tail = self.batch_ramp.strip().partition(":")
        if head.strip().lower() != "gns":
            return 0
        try:
            top = int(tail)
        except ValueError:
            top = 0
        if top < 2 * self.batch_size:
            raise ConfigError(f"batch_ramp={self.batch_ramp!r}: write gns:MAX with MAX >= 2 x batch_size="
                              f"{2 * self.batch_size}, e.g. gns:{4 * self.batch_size}")
        return top

    def gns_ladder(self) -> list[int]:
        """The batches a noise-driven ramp may choose (batch_size doubled while <= MAX, in batch_size's
        sense)::

            Config(batch_size=8, batch_ramp="gns:32").gns_ladder()   # [8, 16, 32]
        """
        out = [self.batch_size]
        while self.gns_max and out[-1] * 2 <= self.gns_max:
            out.append(out[-1] * 2)
        return out

    def gns_ladder_per_rank(self, np_: int) -> list[int]:
        """``gns_ladder()`` as images per rank at ``np_`` ranks (raises ConfigError if not divisible)."""
        return [dataclasses.replace(self, batch_size=b, batch_ramp="").per_rank_batch(np_) for b in self.gns_ladder()]

    def batch_at(self, epoch: int) -> int:
        """``batch_size`` in effect at ``epoch`` (0-based) under the ramp (in batch_size's sense)."""
        return [b for e, b in self.ramp() if e <= epoch][-1]

    def per_rank_batch(self, np_: int, epoch: int = 0) -> int:
        """Images per rank per step at ``np_`` ranks in ``epoch`` (raises ConfigError if not divisible)."""
        batch = self.batch_at(epoch) if self.batch_ramp else self.batch_size
        if self.batch_mode == "per_rank":
            return batch
        if batch % np_:
            raise ConfigError(
                f"global batch_size={batch} is not divisible by np={np_}; "
                f"pick a multiple of {np_} or use batch_mode=per_rank")
        return batch // np_

    def sync_group(self, np_: int) -> int:
        """Ranks whose images one SyncBatchNorm statistic spans at ``np_`` ranks (1 unless bn="sync")::

            Config(bn="sync", bn_group=2).sync_group(48)   # 2: ranks 0-1, 2-3, ... each normalise together
        """
        if self.bn != "sync":
            return 1
        return min(self.bn_group, np_) if self.bn_group else np_

    def global_batch(self, np_: int, epoch: int = 0) -> int:
        return self.per_rank_batch(np_, epoch) * np_

    def peak_lr(self, np_: int, epoch: int = 0) -> float:
        """The lr after scaling from ``lr_ref_batch`` to the global batch at ``np_`` ranks (in ``epoch``:
        under a batch ramp the rule follows the batch)."""
        ratio = self.global_batch(np_, epoch) / self.lr_ref_batch
        factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]
        return self.lr * factor

    def check_world(self, np_: int, n_train: int) -> None:
        """Checks that need the process count and data size; raise ConfigError."""
        if np_ < 1:
            raise ConfigError(f"np={np_} must be >= 1")
        if np_ > n_train:
            raise ConfigError(
                f"np={np_} exceeds the {n_train} training images; use fewer processes")
        if self.gns_max and np_ < 2:
            raise ConfigError(f"batch_ramp={self.batch_ramp!r} measures the gradient noise from the ranks' own "
                              "gradients and needs np >= 2; use an explicit ramp (e.g. '3:16,6:32') at np=1")
        if np_ > 1:  # given speeds, one per rank (at np=1 there is nothing to share)
            self.balance_plan(np_)
        if np_ % self.sync_group(np_):
            raise ConfigError(f"bn_group={self.bn_group} does not divide np={np_}; pick a divisor of {np_} "
                              "(e.g. the ranks per node)")
        batches = self.gns_ladder_per_rank(np_) if self.gns_max else \
            [self.per_rank_batch(np_, epoch) for epoch, _ in self.ramp()]
        for b in batches:
            if self.ghost_batch and b % self.ghost_batch:
                raise ConfigError(
                    f"ghost_batch={self.ghost_batch} does not divide the per-rank batch {b}")
            if n_train // np_ < b:
                raise ConfigError(
                    f"each of {np_} ranks holds {n_train // np_} images, fewer than its batch of {b}; "
                    "use fewer processes or a smaller batch")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Config":
        """Build from a mapping, refusing unknown keys (e.g. a result's saved config)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; see `python -m pilab train --help`")
        return cls(**dict(d))

    @staticmethod
    def help(name: str) -> str:
        """What the setting ``name`` does: the CLI's help and the panel's tooltip ("" if no such setting)."""
        f = _FIELDS.get(name)
        return f.metadata["help"] if f else ""


_FIELDS = {f.name: f for f in fields(Config)}
_TYPES = {f.name: {"str": str, "int": int, "float": float, "bool": bool}[f.type] for f in fields(Config)}
# The settings with a fixed list of values: the CLI's choices, the panel's dropdowns.
CHOICES = {f.name: f.metadata["choices"] for f in fields(Config) if f.metadata["choices"]}
# The comment lines that head each group of fields in the class above, by the group's first field: the
# reference's sections (a field added inside a group needs no edit here).
SECTIONS = {"model": "model", "data": "data", "epochs": "batch and schedule", "optimizer": "optimizer",
            "zero_init_residual": "BatchNorm", "local_steps": "communication", "seed": "runtime",
            "checkpoint_minutes": "long runs: mid-epoch checkpoints, stragglers", "trace": "a per-rank trace"}


def _check_bounds(name: str, value, meta: Mapping) -> None:
    """ConfigError, one line, when ``value`` breaks a bound its ``setting`` declares."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    hint = f" ({meta['hint']})" if meta["hint"] else ""
    if meta["finite"] and not math.isfinite(value):
        raise ConfigError(f"{name}={value} must be a finite number{hint}")
    for key, op, ok in (("at_least", ">=", lambda v, b: v >= b), ("above", ">", lambda v, b: v > b),
                        ("below", "<", lambda v, b: v < b)):
        bound = meta[key]
        if bound is not None and not ok(value, bound):  # NaN fails every comparison: refused too
            raise ConfigError(f"{name}={value} must be {op} {bound:g}{hint}")


def allowed(name: str) -> str:
    """The values ``name`` allows, in words: ``"local | sync | renorm"``, ``">= 0"``, ``">= 0 and < 1"``;
    "" where any value of its type goes (or only rules of their own say, e.g. the model's width)."""
    m = _FIELDS[name].metadata
    if m["choices"]:
        return " | ".join(m["choices"])
    parts = [f"{op} {m[key]:g}" for key, op in (("at_least", ">="), ("above", ">"), ("below", "<"))
             if m[key] is not None]
    if m["finite"]:
        parts.append("finite")
    return m["allowed"] or " and ".join(parts)


def describe() -> list[dict]:
    """Every setting as the reference lists it, in the class's order::

        describe()[0]   # {"name": "model", "type": "str", "default": "mobilenetv2_cifar", "allowed": "",
                        #  "help": "mobilenetv2_cifar | ...", "section": "model", "flag": "--model"}
    """
    out, section = [], ""
    for f in fields(Config):
        section = SECTIONS.get(f.name, section)
        out.append({"name": f.name, "type": f.type, "default": f.default, "allowed": allowed(f.name),
                    "help": f.metadata["help"], "section": section, "flag": "--" + f.name.replace("_", "-")})
    return out


def small_mode() -> bool:
    """True when notebooks and their studies should use tiny settings: PILAB_NB_SMALL=1, or unless it
    says otherwise, under CI (CI=true) and in kernels that pytest/nbval started."""
    flag = os.environ.get("PILAB_NB_SMALL")
    if flag is not None:
        return flag not in ("", "0")
    return os.environ.get("CI") == "true" or "PYTEST_CURRENT_TEST" in os.environ


# Defaults of the demo (`python -m pilab scale` with no options): small enough for ~6 minutes on a 2-core
# laptop, big enough to show the effect. Here, not in the study module, so that `--help` needs no torch.
DEMO = Config(width=0.25, train_subset=2000, test_subset=1000, epochs=4, batch_size=32, lr=0.05,
              lr_ref_batch=32)


def demo(data: str = "embedded") -> Config:
    """The demo's settings for ``data``, which ``scale`` and ``remedies`` start from: ``DEMO`` on the
    embedded data; on any other (your folder, your arrays, the full CIFAR-10) every image, since the
    subsets of 2,000 and 1,000 images are the embedded set's, not yours::

        demo("embedded").train_subset        # 2000
        demo("/data/mine").train_subset      # 0: all of them
    """
    if data == "embedded":
        return DEMO
    return dataclasses.replace(DEMO, data=data, train_subset=0, test_subset=0)
