"""pilab's own features of the training loop, each a ``pilab.component.Component`` in a file of its own;
the loop calls them at fixed moments and never names one. A new feature is a file, a ``Config`` field and
a line here::

    chosen(cfg, ranks)                    # the features cfg asks for, with yours, in the loop's order
    chosen(cfg, ranks, [MyComponent()])
"""
from __future__ import annotations

from ..component import in_order
from ..trace import StragglerWatch, Trace
from .balance import Balance
from .clip import ClipGradNorm
from .compilebn import CompiledBN
from .ema import EMA
from .localsgd import LocalSGD
from .lookahead import Lookahead
from .modepick import ModePick
from .noise import NoiseRamp

FEATURES = (CompiledBN, ModePick, NoiseRamp, ClipGradNorm, Lookahead, EMA, LocalSGD, Balance, StragglerWatch, Trace)


def chosen(cfg, ranks, components=()) -> list:
    """The features ``cfg`` asks for on ``ranks`` and ``components`` (yours), each set up, in the loop's
    order: by ``stage``, pilab's own before yours within a stage (``pilab.component.in_order``)."""
    out = in_order([f(cfg, ranks) for f in FEATURES if f.wanted(cfg, ranks)] + list(components))
    names = [c.name for c in out if c.name]
    if len(names) != len(set(names)):
        raise ValueError(f"two components share a name ({', '.join(sorted(n for n in set(names) if names.count(n) > 1))})"
                         "; give each its own: it is its key in checkpoints")
    for c in out:
        c.setup(cfg, ranks)
    return out
