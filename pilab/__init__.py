"""pilab: synchronous data-parallel CNN training over MPI, and a lab for seeing when it turns fast-but-wrong.

Everything a user needs is a name here, loaded on first use (``import pilab`` loads no torch)::

    import pilab
    cfg = pilab.Config(epochs=2, width=0.5)
    result = pilab.train(cfg)                          # one process; every rank of mpiexec: comm=MPI.COMM_WORLD
    result = pilab.simulate(cfg, 48)                   # np=48 in this process (fast or exact: simulate_mode)
    study = pilab.scale(cfg, nps=(1, 2), simulate_nps=(8, 48), out="runs/demo")   # strong scaling
    search = pilab.remedies(cfg, 48)                   # which settings stay accurate at np=48
    side_by_side = pilab.compare({"linear": study, "sqrt": other})
    result = pilab.simulate(cfg, 4, components=[MyComponent()])   # your own feature of the loop

``pilab.Component`` is what such a feature is (its moments, ``pilab.Stage`` its place among the others);
``pilab.GradSync`` averages gradients over MPI ranks in a training loop of your own, as
``hvd.DistributedOptimizer`` does for Horovod's users. The packages behind these names
(``pilab.engine``, ``pilab.study``, ...) are docs/architecture.md's.
"""
import importlib

__version__ = "0.1.0"

# name -> (module, its name there); the documented surface (tests/test_architecture.py pins it)
_NAMES = {
    "Config": ("pilab.config", "Config"),
    "ConfigError": ("pilab.config", "ConfigError"),
    "train": ("pilab.engine", "train"),
    "simulate": ("pilab.engine", "simulate"),
    "scale": ("pilab.study.scaling", "study"),
    "remedies": ("pilab.study.remedies", "search"),
    "compare": ("pilab.study.compare", "compare"),
    "Component": ("pilab.component", "Component"),
    "Stage": ("pilab.component", "Stage"),
    "GradSync": ("pilab.dist", "GradSync"),
}
_PACKAGES = ("cli", "config", "data", "dist", "engine", "lab", "launch", "models", "perfmodel", "plots", "study",
             "testbed", "trace")
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        module, attr = _NAMES[name]
        return getattr(importlib.import_module(module), attr)
    if name in _PACKAGES:
        return importlib.import_module(f"pilab.{name}")
    raise AttributeError(f"module 'pilab' has no attribute {name!r}")


def __dir__():
    return sorted([*__all__, "__version__", *_PACKAGES])
