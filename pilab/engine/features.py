"""The training loop's features, each a ``pilab.component.Component`` in a file of its own; the
loop calls them at fixed moments and never names one. A new feature is a file, a ``Config`` field and a
line here::

    chosen(cfg, ranks)     # the features cfg asks for, in this order
"""
from __future__ import annotations

from .clip import ClipGradNorm
from .compilebn import CompiledBN
from .ema import EMA
from .localsgd import LocalSGD
from .lookahead import Lookahead
from .modepick import ModePick
from .noise import NoiseRamp
from ..trace.stragglers import StragglerWatch
from ..trace.recorder import Trace

# CompiledBN first: it sets the fast mode's BatchNorm before ModePick's trial times that mode; ModePick's trial
# steps run before the other features see the first step; Lookahead before EMA, which averages the weights
# the step ends with
FEATURES = (CompiledBN, ModePick, ClipGradNorm, Lookahead, EMA, LocalSGD, NoiseRamp, StragglerWatch, Trace)


def chosen(cfg, ranks) -> list:
    return [f(cfg, ranks) for f in FEATURES if f.wanted(cfg, ranks)]
