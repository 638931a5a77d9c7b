"""Your own model: a builder function found by a string, or given from Python, checked before training.

A builder is any function that takes ``num_classes`` (and, only if it names them, ``width`` and
``timesteps``) and returns a ``torch.nn.Module`` mapping (N, C, H, W) images to (N, num_classes) logits::

    # mynets.py, beside your notebook or in the directory you run pilab from
    def resnet8(num_classes):
        return torch.nn.Sequential(...)

    python -m pilab simulate --np 8 --model mynets:resnet8 --data ./my-images
    python -m pilab train --np 2 --model nets/mine.py:build        # a file path works too

    from pilab.models import custom
    custom.build("mynets:resnet8", num_classes=10)                 # the module, freshly initialised
    cfg = Config(model=custom.model_spec(resnet8))                 # a function from Python -> its string

A function defined in a script or notebook (``__main__``) runs in this process only (``simulate``, the
notebook's studies); MPI ranks import the builder by its string, so put it in a ``.py`` file for
``train --np``. Errors are ``ModelError`` (a ``ValueError``; the CLI exits 2): one line naming the problem and the fix.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from typing import Callable, Optional

import torch
from torch import nn

from .names import BUILDER_HINT, ModelError, check_builder_spec, check_named

# builders given as Python functions that no other process could import (defined in __main__, a
# notebook cell, a closure): this process only, by the string model_spec gave them
LOCAL_BUILDERS: dict[str, Callable[..., nn.Module]] = {}


def model_spec(fn: Callable[..., nn.Module]) -> str:
    """The string naming builder ``fn`` in ``Config.model``: ``module:qualname`` when that import finds
    ``fn`` itself; otherwise ``fn`` is kept for this process under that string::

        cfg = Config(model=model_spec(my_builder))
    """
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise ModelError(f"model_fn={fn!r} is not callable; pass a function taking num_classes and "
                         "returning a torch.nn.Module")
    spec = f"{getattr(fn, '__module__', None) or '__main__'}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    spec = spec.replace("<locals>.", "").replace("<", "").replace(">", "")
    try:
        found = _import_attr(*spec.split(":", 1)) is fn
    except ModelError:
        found = False
    if not found:
        LOCAL_BUILDERS[spec] = fn
    return spec


def is_local(spec: str) -> bool:
    """True when ``spec`` names a function only this process holds (MPI ranks could not import it)."""
    return spec in LOCAL_BUILDERS


def load_builder(spec: str) -> Callable[..., nn.Module]:
    """The builder function ``spec`` names ("package.module:function" or "path/to/file.py:function")."""
    if spec in LOCAL_BUILDERS:
        return LOCAL_BUILDERS[spec]
    try:
        check_builder_spec(spec)
    except ValueError as e:
        raise ModelError(str(e)) from None
    check_named(spec)  # a builder named in a file pilab reads is not imported (names.only_named)
    module, attr = spec.rsplit(":", 1)
    fn = _import_attr(module, attr)
    if not callable(fn):
        raise ModelError(f"model={spec!r} names a {type(fn).__name__}, not a function; point it at a "
                         "function taking num_classes and returning a torch.nn.Module")
    return fn


def source_file(spec: str) -> str | None:
    """The file that defines builder ``spec``, found without running it: the ``.py`` path itself, or
    where Python would import the module from (None where it cannot say: a package's module whose
    parent has to run first, a builder held only in this process)::

        source_file("nets/mine.py:build")   # "/home/me/nets/mine.py"
    """
    if spec in LOCAL_BUILDERS or ":" not in spec:
        return None
    module = spec.rsplit(":", 1)[0]
    if module.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(module))
        return path if os.path.isfile(path) else None
    if "." in module:
        return None  # finding a.b runs a/__init__.py: only an import says (source_digest imports)
    where = [os.getcwd(), *sys.path]
    found = importlib.machinery.PathFinder.find_spec(module, where)
    return found.origin if found is not None and found.origin and os.path.isfile(found.origin) else None


def source_digest(spec: str) -> dict | None:
    """``{"spec", "file", "sha256"}`` of the file your builder ``spec`` is defined in, as it is now (what a
    run records, so that a resume or a study's reuse notices an edited model; only that file: modules it
    imports are not covered); None for a registered model (pilab's own code, its version recorded) or one
    whose file cannot be found::

        source_digest("nets/mine.py:build")   # {"spec": ..., "file": "/home/me/nets/mine.py", "sha256": "9f2c..."}
    """
    if not isinstance(spec, str) or ":" not in spec:
        return None
    path = source_file(spec)
    if path is None and spec not in LOCAL_BUILDERS:
        try:  # a package's module: where its import found it
            path = getattr(sys.modules.get(spec.rsplit(":", 1)[0]) or inspect.getmodule(load_builder(spec)),
                           "__file__", None)
        except ModelError:
            path = None
    if path is None:
        fn = LOCAL_BUILDERS.get(spec)
        try:
            text = inspect.getsource(fn) if fn is not None else None
        except (OSError, TypeError):
            text = None
        return {"spec": spec, "file": None, "sha256": hashlib.sha256(text.encode()).hexdigest()} if text else None
    with open(path, "rb") as f:
        return {"spec": spec, "file": os.path.abspath(path), "sha256": hashlib.sha256(f.read()).hexdigest()}


def _import_attr(module: str, attr: str):
    """``module`` (a dotted name importable from here or the working directory, or a .py path) . ``attr``."""
    spec = f"{module}:{attr}"
    try:
        if module.endswith(".py"):
            path = os.path.abspath(os.path.expanduser(module))
            if not os.path.isfile(path):
                raise ModelError(f"model={spec!r}: {path} does not exist; give the path of your .py file")
            name = "pilab_user_" + os.path.splitext(os.path.basename(path))[0]
            mod = sys.modules.get(name)
            if mod is None or getattr(mod, "__file__", None) != path:
                loader = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(loader)
                sys.modules[name] = mod
                loader.loader.exec_module(mod)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:  # a module beside the user, as python finds it
                sys.path.append(os.getcwd())
            mod = importlib.import_module(module)
    except ModelError:
        raise
    except ModuleNotFoundError as e:
        raise ModelError(f"model={spec!r}: cannot import {module} ({e}); put {module.replace('.', '/')}.py "
                         "in the directory you run pilab from, install its package, or give a file path "
                         "(path/to/file.py:function)") from None
    except Exception as e:  # the user's module failed while importing
        raise ModelError(f"model={spec!r}: importing {module} failed ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); fix that module") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model={spec!r}: {module} has no {attr}; check the function's name")
        obj = getattr(obj, part)
    return obj


def build(spec: str, num_classes: int = 10, width: float = 1.0, *, timesteps: Optional[int] = None) -> nn.Module:
    """A fresh model from builder ``spec``: ``num_classes`` always, ``width`` and ``timesteps`` only to a
    builder that names them (the others ignore them, so a preset's width does not stop your model)::

        model = build("mynets:resnet8", num_classes=5)
    """
    fn = load_builder(spec)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {"num_classes": num_classes}
    if "width" in params or takes_any:  # a builder without it ignores --width, as one without timesteps does
        kwargs["width"] = width
    if timesteps is not None and ("timesteps" in params or takes_any):
        kwargs["timesteps"] = timesteps
    try:
        model = fn(**kwargs)
    except TypeError as e:
        raise ModelError(f"model={spec!r}: calling it with {', '.join(kwargs)} failed ({e}); the builder "
                         "must accept num_classes") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"model={spec!r} returned a {type(model).__name__}, not a torch.nn.Module; "
                         "return the network itself (e.g. return nn.Sequential(...))")
    return model


def input_channels(model: nn.Module, default: int = 3) -> int:
    """Channels the model's first convolution takes (its input images'), else ``default``: what a probe
    image needs when only the model is known (the performance model's counts)."""
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            return m.in_channels
    return default


def check_output(model: nn.Module, image_shape: tuple, num_classes: int, name: str) -> None:
    """Raise ModelError unless one (C, H, W) image gives (1, ``num_classes``) logits (eval mode, no gradient,
    the global RNG untouched)."""
    was = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            out = model(torch.zeros(2, *image_shape))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"model {name} fails on the data's {'x'.join(map(str, image_shape))} (CxHxW) images "
                         f"({msg}); make its first layer take {image_shape[0]} channel(s) and its layers "
                         f"fit {image_shape[1]}x{image_shape[2]} inputs") from None
    finally:
        model.train(was)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(f"model {name} gives output {got} for 2 images, but the data has {num_classes} "
                         f"classes; make its last layer output (N, {num_classes}) logits")


__all__ = ["ModelError", "model_spec", "is_local", "load_builder", "build", "input_channels", "check_output",
           "source_file", "source_digest", "BUILDER_HINT"]
