"""A package's face, loaded on first use (PEP 562; the ``lazy_loader`` pattern of scikit-image and SciPy,
in the few lines pilab needs rather than a dependency): ``import pilab.engine`` costs nothing, and
``pilab.engine.Session`` imports the module that defines it the first time it is asked for::

    # pilab/engine/__init__.py
    __getattr__, __dir__, __all__ = lazy.face(__name__, {"loop": ["Session", "fit"], "mpi": ["MPIRanks"]})
"""
from __future__ import annotations

import importlib
import importlib.util
import sys


def face(package: str, names: dict[str, list[str]], defined=()) -> tuple:
    """``(__getattr__, __dir__, __all__)`` for ``package``: each name of ``names[module]`` is taken from
    ``package.module`` when first asked for (``"attr as name"`` renames it), and kept; each of the package's
    modules is an attribute too. ``defined``: names the package's ``__init__`` defines itself."""
    where = {}
    for module, those in names.items():
        for entry in those:
            attr, _, name = entry.partition(" as ")
            where[name or attr] = (module, attr)

    def __getattr__(name: str):
        if name in where:
            module, attr = where[name]
            value = getattr(importlib.import_module(f"{package}.{module}"), attr)
        elif importlib.util.find_spec(f"{package}.{name}") is not None:  # one of the package's modules
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # the next use is a plain attribute
        return value

    everything = sorted([*where, *defined])
    return __getattr__, lambda: everything, everything
