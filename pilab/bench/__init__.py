"""``python -m pilab bench``: how fast pilab is against what a user would pick instead, on this machine.

    python -m pilab bench                       # the default set (<= 20 min here), JSON + BENCHMARKS.md
    python -m pilab bench --quick               # CI-sized: tiny models, 5 alternations, ~3 min
    python -m pilab bench --sections one_rank,data --out runs/bench
    sudo python -m pilab bench --sections network --quick   # the testbed section (root)

The one home of pilab's benchmarks: a library package, so that the command works from an installed
pilab and its pieces are importable (tests call them on tiny settings). The run is
:mod:`pilab.bench.suite` (``suite.run``, ``suite.SECTIONS``); the machine's facts :mod:`pilab.bench.report`.
This file holds no code. Every figure is a ratio against
a baseline measured in the same run: contenders alternate round by round (the order rotated), one ratio
per round, reported as median and p10-p90 / min-max. Sections that need ranks run as MPI jobs
(``pilab.launch.run_job`` over ``pilab.bench.mpijobs`` / ``pilab.bench.memory`` / ``pilab.engine.harness``; a
failed job raises ``launch.JobError``).

* ``one_rank``: pilab's one-rank step vs a bare PyTorch loop; ``malloc``: that step with malloc "fast"
  (freed memory kept) vs "lean" (returned at once), a fresh process each; ``models``: images/s per model and layout;
* ``data``: ShardLoader vs a per-sample Dataset + DataLoader; ``cache``: decoding the data set vs the
  cached reload; ``simulator``: exact vs fast, np 1/8/48;
* ``checkpoint``: one mid-epoch checkpoint (ms, bytes) and its share of the 10-minute multi-node interval;
  ``cli``: ``python -m pilab --help`` against ``python -c pass``;
* ``ranks``: memory, communication (bandwidth, bucket sweep, hidden share) and the np=2 step
  (pilab vs DDP-gloo vs the sync-only floor vs the no-exchange ceiling, strong scaling);
* ``sync``: the ways to average a step's gradients at np=2 (per-tensor and fused blocking Allreduce,
  GradSync, fp16, MPICH's async progress thread);
* ``memory``: peak RSS per rank itemised at the study's setting (``pilab.bench.memory``, real ranks),
  and ``pilab.engine.memory``'s prediction against it over 3 widths x 2 batch sizes.

Only when named (minutes each): ``deviation``, the fast mode's deviation after 100 steps at np=48;
``perfmodel``, the performance model calibrated here and checked against held-out real runs
(``pilab.perfmodel.check``); ``network``, its network half on a testbed of shaped links that the
section brings up and removes (root; ``pilab.bench.network``; skipped with one line otherwise);
``balance``, uneven shares (``--balance``) against a throttled node on a testbed (root;
``pilab.bench.balance``), and ``balance_accuracy``, their final test accuracy against equal shares.

Running some sections only (``--sections memory``) replaces those sections in an existing BENCHMARKS.md
and keeps the others. Figures are judged "met" / "NOT met" against the goals the run is given (``--goals``;
benchmarks/goals.json in pilab's source repository): pilab itself holds none.
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "suite": ["EXTRA_SECTIONS", "SECTIONS"],
    "report": ["collected_report"],
})
