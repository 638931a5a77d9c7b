"""The study layer: runs of the engine at several process counts, judged and reported.

One module per concern (importing this package imports none of them)::

    scaling    the strong-scaling study: its points run, kept (--resume) or reused; load_study
    points     a point's result.json on disk: which can be kept or reused, study.json's references,
               the progress events of a point's training
    analysis   rows per np from the runs: speedup, efficiency, time and energy to target (the
               verdict itself is pilab.verdict's), times predicted by the performance model
    compare    several studies side by side; the three-model summary
    remedies   which settings keep accuracy at large np (simulated candidates, a Pareto front)
    ablation   which cause costs the accuracy at large np
    paper      a study beside the published Pi-cluster figures
    tables     what the CLI prints and a notebook shows (plots.Table, plots.Paragraph)
    report     the only writer of a study's files: JSON, CSV, markdown, HTML (plots' figures), PNG
    energy     power models, energy of a run (modelled or measured) and to target
    meters     measured energy: RAPL counters, a power meter's log
    verdict    the one logic that judges a study's rows (imports nothing from pilab: plots uses it)

    from pilab.study import scaling, tables
    study = scaling.study(cfg, nps=(1, 2), simulate_nps=(8,), out="runs/demo")
    tables.table(study)
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "scaling": ["Interrupted", "load_study", "partial_study", "study"],
    "remedies": ["candidate_labels", "slug"],
})
