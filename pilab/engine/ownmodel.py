"""Your own model against your data, checked before any rank starts (the CLI, the notebook panel, a study)::

    from pilab.engine import ownmodel
    cfg = ownmodel.with_model(cfg, my_builder)     # a Python function -> Config.model's string
    ownmodel.check_model(cfg, mpi=True)            # ModelError / DataError: one line, problem and fix
    ownmodel.check_rank_exact(my_model, (3, 32, 32))                     # ValueError naming the layer
    ownmodel.check_custom_model(my_model, "mynets:net", (1, 8, 8), 10)   # its output too; ModelError

A model string ``package.module:function`` is imported, built for the data's classes and image shape,
and run on two probe images (its output must be (2, classes)); its layers are checked for anything that
mixes a batch's images other than BatchNorm (``check_rank_exact``). A built-in model is checked the same
way when the data is not CIFAR-10's 3x32x32 images in ten classes. ``engine.layers`` makes every BatchNorm
and dropout layer per virtual rank; a layer that mixes a batch's images some other way (batch statistics
by hand, randomness outside a dropout layer) cannot be, and is refused with one line naming it.

Your own model: what the simulator cannot make per-rank, found before training.

``engine.layers`` makes every BatchNorm and dropout layer per virtual rank; a layer that mixes a batch's
images some other way (batch statistics by hand, randomness outside a dropout layer) cannot be, and is
refused here with one line naming it::

    from pilab.engine.ownmodel import check_custom_model, check_rank_exact
    check_rank_exact(my_model, (3, 32, 32))                       # ValueError naming the layer
    check_custom_model(my_model, "mynets:net", (1, 8, 8), 10)     # its output too; ModelError
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from .. import data as data_mod
from ..config import Config
from ..models import ModelError, is_builder_spec
from .layers import GhostBatchNorm2d, RankDropout, replace_modules


def with_model(cfg: Config, model_fn=None) -> Config:
    """``cfg`` with ``model_fn`` (a builder function, or a model string) as its model; ``cfg`` when None."""
    if model_fn is None:
        return cfg
    from ..models import model_spec

    return dataclasses.replace(cfg, model=model_spec(model_fn))


def check_model(cfg: Config, *, mpi: bool = False) -> None:
    """Raise ModelError unless ``cfg.model`` builds and runs on ``cfg.data``'s images and classes (see the
    module docstring); ``mpi``: its builder must also be importable by other processes."""
    from ..models import is_local
    from ..models import build_model

    if mpi and is_builder_spec(cfg.model) and is_local(cfg.model):
        raise ModelError(f"model {cfg.model} is a function of this process only, which MPI ranks cannot import; "
                         "put it in a .py file and pass module:function (or run it with simulate)")
    meta = data_mod.describe(cfg.data, image_size=cfg.image_size)
    classes, shape = len(meta["classes"]), tuple(meta["image_shape"])
    if not is_builder_spec(cfg.model) and shape == (3, 32, 32) and classes == 10:
        return  # a built-in model on CIFAR-10-shaped data: what it was made for
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg.model, num_classes=classes, width=cfg.width, timesteps=cfg.timesteps,
                            in_channels=shape[0])
    check_custom_model(model, cfg.model, shape, classes)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _rows_differ(full, half, rows: int) -> bool | None:
    """Whether the first ``rows`` rows of ``full`` differ from ``half`` (None: not comparable)."""
    if full is None or half is None or full.ndim == 0 or full.shape[0] != 2 * rows or half.shape[0] != rows \
            or full.shape[1:] != half.shape[1:] or not full.is_floating_point():
        return None
    a, b = full[:rows].double(), half.double()
    return not torch.allclose(a, b, rtol=1e-4, atol=1e-4 * (float(b.abs().max()) + 1e-6))


def check_rank_exact(model: nn.Module, image_shape: tuple, name: str = "the model") -> None:
    """Raise ValueError naming the first layer that mixes the images of a batch some way other than
    BatchNorm (which the simulator makes per-rank) -- e.g. batch statistics computed by hand, or
    randomness outside a dropout layer: a virtual rank's images would then see the others'::

        check_rank_exact(my_model, (3, 32, 32))

    A copy runs in train mode with every BatchNorm and dropout taken out, on 4 images and on their
    first 2: any layer whose output for those 2 changes with the batch around them is refused. Per-image
    layers (GroupNorm, LayerNorm, InstanceNorm, pooling) pass. The global RNG is left as it was."""
    import copy

    probe = copy.deepcopy(model).cpu().float().train()
    replace_modules(probe, lambda m: nn.Identity() if isinstance(m, (_BatchNorm, _DropoutNd, GhostBatchNorm2d,
                                                               RankDropout)) else None)
    names = {m: n for n, m in probe.named_modules()}
    seen: list[dict] = [{}, {}]

    def hook(m, inp, out):
        seen[run][m] = (_first_tensor(inp), _first_tensor(out))

    handles = [m.register_forward_hook(hook) for m in probe.modules()]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, *image_shape, generator=g)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for run, batch in enumerate((x, x[:2])):
                torch.manual_seed(run + 1)  # randomness outside a dropout layer shows as a difference too
                probe(batch)
    except Exception:
        return  # check_output reports what does not run
    finally:
        for h in handles:
            h.remove()
    culprits = [m for m in seen[0] if m in seen[1] and _rows_differ(seen[0][m][1], seen[1][m][1], 2)
                and not _rows_differ(seen[0][m][0], seen[1][m][0], 2)]
    # the innermost: a module none of whose submodules is also to blame
    def inside(c, m):  # c is a submodule of m
        return c is not m and (names[m] == "" or names[c].startswith(names[m] + "."))

    inner = [m for m in culprits if not any(inside(c, m) for c in culprits)]
    if inner:
        bad = inner[0]
        where = names[bad] or "the model's own forward"
        raise ValueError(f"{name}: layer {where} ({type(bad).__name__}) mixes the images of a batch (batch "
                         "statistics or randomness outside nn.BatchNorm*/nn.Dropout*), so a simulated rank would "
                         "see the others' images; use nn.BatchNorm1d/2d/3d, nn.Dropout, or a per-image norm "
                         "(nn.GroupNorm, nn.LayerNorm)")


def check_custom_model(model: nn.Module, name: str, image_shape: tuple, num_classes: int) -> None:
    """Your own model before training: its output for the data's images (``models.custom.check_output``)
    and its layers (``check_rank_exact``); ``models.custom.ModelError`` names the problem and the fix."""
    from ..models import check_output
    from ..models import ModelError

    check_output(model, tuple(image_shape), num_classes, name)
    try:
        check_rank_exact(model, tuple(image_shape), name)
    except ValueError as e:
        raise ModelError(str(e)) from None
