"""A package's face, loaded on first use (PEP 562; the ``lazy_loader`` pattern of scikit-image and SciPy,
in the few lines pilab needs rather than a dependency): ``import pilab.engine`` costs nothing, and
``pilab.engine.Session`` imports the module that defines it the first time it is asked for::

    # pilab/engine/__init__.py
    __getattr__, __dir__, __all__ = lazy.face(__name__, {"loop": ["Session", "fit"], "mpi": ["MPIRanks"]})
"""
from __future__ import annotations

import importlib


def face(package: str, names: dict[str, list[str]], defined=()) -> tuple:
    """``(__getattr__, __dir__, __all__)`` for ``package``: each name of ``names[module]`` is taken from
    ``package.module`` when first asked for. ``defined``: names the package's ``__init__`` defines itself
    (listed in ``__all__`` too)."""
    where = {name: module for module, those in names.items() for name in those}

    def __getattr__(name: str):
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    everything = sorted([*where, *defined])
    return __getattr__, lambda: everything, everything
