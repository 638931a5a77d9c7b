"""Performance model: time per epoch at any np, from an np=1 run and an Allreduce micro-benchmark.

Calibrate on your machine, then predict (everything returns dicts / lists of dicts)::

    python -m pilab train --width 0.25 --train-subset 960 --test-subset 200 --epochs 1 --threads 1 \\
        --out runs/np1                                                   # the np=1 run
    python -m pilab perfmodel bench --np 2,3          # launches mpiexec; runs/perfmodel/comm_bench.json
    python -m pilab perfmodel calibrate --result runs/np1/result.json \\
        --bench runs/perfmodel/comm_bench.json        # -> runs/perfmodel/calibration.json
    python -m pilab perfmodel table --calibration runs/perfmodel/calibration.json --nps 1,2,3 --width 0.25 ...
    python -m pilab perfmodel table --published       # the Pi table beside the published figures

    from pilab import perfmodel
    from pilab import resultfile
    from pilab.files import load_json
    cal = perfmodel.calibrate(resultfile.load("runs/np1/result.json"), load_json("runs/perfmodel/comm_bench.json"))
    perfmodel.predict(Config(width=0.25), 2, cal)                      # one dict
    perfmodel.predict_table(Config(), [2, 4, 8, 48], "pi4b_cluster", "naive", baseline_np=2)
    perfmodel.pi_table()                                                # both profiles + published figures
    perfmodel.predict(pi_config(), 48, "pi4b:12,pi5:12", baseline_np=2)["balancing"]   # a mixed cluster

The model, per optimizer step on every rank (synchronous, so the slowest rank sets the pace):

    step = data + compute + straggler + exposed comm + overhead
    compute   = (per-step work + per-rank batch x work per image) / rate (at the rank's threads,
                slowed by oversubscription); work = FLOPs + a memory-bound term per activation element,
                rate from the np=1 run
    straggler = E[max of np normal draws] x compute x cv  (per-step jitter measured at np=1)
    comm      = alpha-beta cost of each Allreduce, simulated round by round over the real schedule
                (ring | recursive doubling | Rabenseifner | MPICH's choice by message size), with
                block placement of ranks on nodes: a round that crosses nodes pays the inter-node link,
                and flows that leave one node in the same round share its NIC.
    exposed   = pilab: fused buckets posted during backward, queued on the network; what does not fit
                behind the rest of backward (the last bucket plus any backlog) is exposed.
                naive: one blocking Allreduce per parameter tensor after backward: all exposed.
                bn="sync" adds two blocking Allreduces per BatchNorm layer (forward and backward), all exposed,
                over bn_group consecutive ranks (all of them when 0).
    epoch     = steps x step + evaluation (pilab: test set sharded over ranks; naive: every rank
                evaluates the whole test set)

One module per concern, each depending only on those above it in this list: ``metrics`` (speedup,
efficiency, Karp-Flatt), ``machine`` (the stated constants; Link, Cluster), ``allreduce`` (schedules and
their cost), ``layout`` (gradient tensors and buckets of a model), ``calibrate`` (the MPI micro-benchmark
and its launcher, the alpha-beta fit, Calibration, this_box), ``presets`` (the Pi facts, pi4b_cluster, the
published figures), ``predict`` (and its tables in Markdown), ``check`` (the model against measured runs
and the testbed's network). A predicted step as a Chrome trace is ``pilab.trace.predict``'s. Importing
the package loads neither torch nor MPI; the command line lives in ``pilab.cli.perfmodel``. See
docs/perfmodel.md for the assumptions and the Raspberry Pi table. This face imports its modules at once
(they are light), not on first use as the other packages' do: two of its names, ``predict`` and
``calibrate``, are also its modules' names, which a first import of the module would otherwise shadow.
"""
from __future__ import annotations

from .allreduce import allreduce_phases, allreduce_rounds, allreduce_time
from .calibrate import (DEFAULT_SIZES, Calibration, calibrate, cluster_from_calibration, comm_bench, fit_alpha_beta,
                        run_comm_bench, this_box)
from .layout import bn_bytes, bn_channels, buckets_for, gradient_layout, model_profile, remember, work_per_image
from .machine import (ALGORITHMS, BACKWARD_FRACTION, ELEMENT_BYTES, FLOPS_PER_ACTIVATION_CPU, METRIC_BYTES,
                      STEP_WORK_PER_TENSOR_CPU, THREAD_EXPONENT, Cluster, Link)
from .metrics import efficiency, karp_flatt, speedup
from .predict import (BALANCE, BALANCE_COLUMNS, PI_TABLE_COLUMNS, PROFILES, TABLE_COLUMNS, as_config, balance_rows,
                      bucket_schedule, exchange, markdown_table, pi_table, pi_table_markdown, predict, predict_table,
                      step_schedule)
from .presets import (BOARDS, PI_BASELINE_NP, PI_CORES_PER_NODE, PI_GBE_GOODPUT, PI_NODES, PI_RANKS_PER_NODE,
                      PI_STUDY_NPS, PI_TABLE_NPS, PI_THREADS_PER_RANK, PRESETS, PUBLISHED, is_board_spec,
                      is_pi_cluster, mixed_cluster, pi4b_cluster, pi_config, published_table, relinked,
                      resolve_cluster)

__all__ = ["speedup", "efficiency", "karp_flatt", "PUBLISHED", "published_table", "Link", "Cluster", "Calibration",
    "allreduce_rounds", "allreduce_time", "allreduce_phases", "ALGORITHMS", "comm_bench", "run_comm_bench",
    "DEFAULT_SIZES", "fit_alpha_beta", "calibrate", "this_box", "pi4b_cluster", "cluster_from_calibration", "PRESETS",
    "resolve_cluster", "relinked", "BOARDS", "mixed_cluster", "is_board_spec", "is_pi_cluster", "BALANCE",
    "balance_rows", "BALANCE_COLUMNS", "gradient_layout", "model_profile", "remember", "buckets_for", "work_per_image", "bn_bytes", "bn_channels",
    "PROFILES", "predict", "predict_table", "exchange", "bucket_schedule", "step_schedule", "pi_config", "pi_table",
    "markdown_table", "pi_table_markdown", "TABLE_COLUMNS", "PI_TABLE_COLUMNS", "FLOPS_PER_ACTIVATION_CPU",
    "STEP_WORK_PER_TENSOR_CPU", "BACKWARD_FRACTION", "THREAD_EXPONENT", "ELEMENT_BYTES", "METRIC_BYTES", "PI_NODES",
    "PI_RANKS_PER_NODE", "PI_CORES_PER_NODE", "PI_THREADS_PER_RANK", "PI_GBE_GOODPUT", "PI_BASELINE_NP",
    "PI_STUDY_NPS", "PI_TABLE_NPS", "as_config"]
