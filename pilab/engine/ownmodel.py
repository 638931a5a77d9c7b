"""Your own model against your data, checked before any rank starts (the CLI, the notebook panel, a study)::

    from pilab.engine import ownmodel as preflight
    cfg = preflight.with_model(cfg, my_builder)     # a Python function -> Config.model's string
    preflight.check_model(cfg, np_=4, mpi=True)     # ModelError / DataError: one line, problem and fix

A model string ``package.module:function`` is imported, built for the data's classes and image shape,
and run on two probe images (its output must be (2, classes)); its layers are checked for anything that
mixes a batch's images other than BatchNorm (``engine.layers.check_rank_exact``). A built-in model is
checked the same way when the data is not CIFAR-10's 3x32x32 images in ten classes.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import data as data_mod
from ..config import Config
from ..models.names import ModelError, is_builder_spec
from .exactness import check_custom_model


def with_model(cfg: Config, model_fn=None) -> Config:
    """``cfg`` with ``model_fn`` (a builder function, or a model string) as its model; ``cfg`` when None."""
    if model_fn is None:
        return cfg
    from ..models.custom import model_spec

    return dataclasses.replace(cfg, model=model_spec(model_fn))


def check_model(cfg: Config, *, mpi: bool = False) -> None:
    """Raise ModelError unless ``cfg.model`` builds and runs on ``cfg.data``'s images and classes (see the
    module docstring); ``mpi``: its builder must also be importable by other processes."""
    from ..models.custom import is_local
    from ..models.zoo import build_model

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
