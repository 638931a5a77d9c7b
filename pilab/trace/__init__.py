"""A run's per-rank timeline, in one home: recorded during a real run (``recorder``, the ``Trace`` component),
watched live for stragglers (``stragglers``), written and read in the Chrome Trace Event Format
(``format``), analysed (``read``), predicted by the performance model and a measured trace set beside its
prediction (``predict``). Importing it imports nothing; each name loads its module on first use::

    from pilab import trace
    report = trace.report(trace.analyse(trace.load("runs/t/trace.json")))
"""
from .. import lazy

__getattr__, __dir__, __all__ = lazy.face(__name__, {
    "predict": ["predicted_trace", "table", "validate"],
    "read": ["analyse", "load", "report"],
    "recorder": ["Trace"],
    "stragglers": ["StragglerWatch"],
})
