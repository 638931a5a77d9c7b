"""Virtual-rank simulator: emulate np data-parallel ranks exactly, in one process.

What an MPI run at np ranks computes, step by step, is reproduced here: the global batch is the
concatenation of the per-rank batches (same shards, same sharding policy, same per-rank augmentation
randomness), BatchNorm statistics are taken per rank sub-batch (or per ghost batch), running statistics
are kept per virtual rank and settled by the same buffer policy, dropout masks are drawn per rank from the
same seeds, and gradients are averaged over ranks. Weights after N steps match a real ``mpiexec`` run to
~1e-6, so accuracy at np=48 can be studied on a laptop (or a GPU) without 48 processes::

    from pilab.config import Config
    from pilab.engine import simulate
    result = simulate.run(Config(width=0.5, epochs=3), np_=48)     # same schema as train.run

    python -m pilab simulate --np 48 --width 0.5 --epochs 3

``cfg.simulate_mode`` says how (docs/simulator.md): ``exact`` processes the virtual ranks one at a time on
CPU (``ranks_per_chunk=1``: bit-identical per-rank arithmetic) with gradient accumulation; ``fast`` runs the
global batch in one forward with per-rank BatchNorm vectorised (the same mathematics to float rounding, at
about the cost of one process training the global batch); ``auto``, the default, takes ``fast`` unless the
run needs each rank's own weights or gradient (``result["simulate_mode_used"]`` says which ran). The loop is ``pilab.engine.loop``'s, run on ``engine.VirtualRanks``; the
per-rank layers are in ``pilab.engine.layers``.
"""
from __future__ import annotations

from torch import nn

from . import loop as engine
from ..config import Config
from .ownmodel import with_model
from .layers import GhostBatchNorm2d, use_ghost_batchnorm, virtual_state  # noqa: F401  (re-exported)

__all__ = ["run", "train", "check_supported", "virtual_state", "GhostBatchNorm2d", "use_ghost_batchnorm"]


def check_supported(cfg: Config) -> None:
    """Refuse (ConfigError) settings the simulator does not emulate exactly."""
    engine.VirtualRanks(1).check(cfg)


def run(cfg: Config, np_: int, *, callbacks=(), stop=None, data=None, ranks_per_chunk: int = 0,
        model_fn=None) -> dict:
    """Emulate ``np_`` ranks training ``cfg``; returns a result shaped like ``train.run``'s. ``model_fn``:
    your own model's builder (a function taking num_classes), instead of ``cfg.model``."""
    return train(cfg, np_, callbacks=callbacks, stop=stop, data=data, ranks_per_chunk=ranks_per_chunk,
                 model_fn=model_fn)[0]


def train(cfg: Config, np_: int, *, callbacks=(), stop=None, data=None,
          ranks_per_chunk: int = 0, model_fn=None) -> tuple[dict, nn.Module]:
    """Like ``run`` but also returns the model (``virtual_state(model, r)`` is virtual rank r's state)."""
    cfg = with_model(cfg, model_fn)
    return engine.train(cfg, engine.VirtualRanks(np_, ranks_per_chunk), callbacks=callbacks, stop=stop,
                        data=data)
