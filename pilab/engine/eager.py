"""torch.optim's methods without the guards that import ``torch._dynamo`` (``Eager``): every pilab optimizer
(``pilab.engine.optim``, ``pilab.engine.muon``) takes them, so that a rank never loads the compiler stack::

    class SGD(Eager, torch.optim.SGD): ...
"""
from __future__ import annotations

import inspect

import torch


def eager_method(method):
    """``method`` without the wrappers torch puts around it (``functools.wraps`` chains)."""
    return inspect.unwrap(method)


class Eager:
    """Mixin for a ``torch.optim`` optimizer that never imports ``torch._dynamo``::

        class SGD(Eager, torch.optim.SGD): ...

    torch wraps ``add_param_group``, ``zero_grad``, ``state_dict``, ``load_state_dict`` and SGD's
    ``step`` in guards that import ``torch._dynamo`` on their first call, and with it sympy and
    torch._inductor: ~70 MB of resident modules per rank (BENCHMARKS.md, "Memory per rank"), 8% of
    the 900 MB a rank aims at on a Pi 4B 4 GB. The guards matter only under ``torch.compile``, which
    pilab never uses; the methods inside them are the same code, so the numbers are the same
    (tests/test_memory.py checks both). Where a torch has no such wrapper, the method is used as is."""

    add_param_group = eager_method(torch.optim.Optimizer.add_param_group)
    zero_grad = eager_method(torch.optim.Optimizer.zero_grad)
    state_dict = eager_method(torch.optim.Optimizer.state_dict)
    load_state_dict = eager_method(torch.optim.Optimizer.load_state_dict)
