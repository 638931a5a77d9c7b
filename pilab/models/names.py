"""The models pilab can build, by name, and the widths each takes -- without importing torch.

``Config`` validation and the command line's ``--help`` need these facts; importing ``pilab.models.zoo``
(torch, ~2.5 s) for them would make every bad-argument error and every ``--help`` wait for torch::

    from pilab.models.names import MODEL_NAMES, check_width
    check_width("mobilenetv2_cifar", 0.5)        # None, or ValueError naming the fix

``pilab/models/zoo.py`` registers one builder per name here and checks at import that the two lists agree.
"""
from __future__ import annotations

import contextlib

import importlib.util
import re

MODEL_NAMES = ("mobilenetv2_cifar", "mobilenetv2", "squeezenet1_1", "spiking_cnn")
SPIKING_MODELS = ("spiking_cnn",)  # their builders also take ``timesteps``
WIDTH_RANGE = (0.25, 1.4)  # MobileNetV2 width multipliers accepted (inclusive)
SPIKING_WIDTH_RANGE = (0.25, 2.0)  # spiking_cnn width multipliers accepted (inclusive)
SNN_INSTALL_HINT = "pip install 'pilab[snn]'"
# your own model: "package.module:builder" or "path/to/file.py:builder" (see pilab.models.custom)
_BUILDER_SPEC = re.compile(r"^[^:\s]+:[A-Za-z_][\w.]*$")
BUILDER_HINT = "give a registered name or your builder as package.module:function (or path/to/file.py:function)"


class ModelError(ValueError):
    """A model cannot be built or trained as asked. The message is one line naming the problem and the fix."""


# Your own builders this process may import: None (training, notebooks, the library) -- any the caller
# names; a set -- only those. pilab's command line sets it to the --model you typed (only_named), so a
# builder string found in a file it reads (a result, a trace, a study) is never imported: that would run
# whatever code the file's author put in the builder's module (docs/security.md).
_NAMED: frozenset | None = None


@contextlib.contextmanager
def only_named(specs):
    """Within the ``with`` block, build your own model (a builder string, ``is_builder_spec``) only if it is
    among ``specs``, the builders named on the command line; pilab's registered models are always built;
    after it, what was allowed before::

        with only_named([args.model]):      # pilab.cli.main, around every command
            args.func(args, argv)
    """
    global _NAMED
    before = _NAMED
    _NAMED = frozenset(s for s in specs if isinstance(s, str) and is_builder_spec(s))
    try:
        yield
    finally:
        _NAMED = before


def check_named(spec: str) -> None:
    """ModelError unless builder ``spec`` may be imported here (:func:`only_named`)."""
    if _NAMED is None or not is_builder_spec(spec) or spec in _NAMED:
        return
    raise ModelError(f"model={spec!r} comes from a file pilab is reading (a result, a trace, a study), not from "
                     f"your command line, and building it would run that module's code; if you trust it, name it: "
                     f"--model {spec}")


def is_builder_spec(name: str) -> bool:
    """True for a user's model builder string ("mynets:resnet8", "nets/mine.py:build"), not a registered name."""
    return isinstance(name, str) and ":" in name


def check_builder_spec(name: str) -> None:
    """Raise ValueError (one line) unless ``name`` is written as ``module:function`` -- checked without
    importing it (that is ``pilab.models.custom.load_builder``'s, which needs torch)."""
    if not _BUILDER_SPEC.match(name):
        raise ValueError(f"model={name!r} is not a builder string; write it as package.module:function "
                         "(e.g. mynets:resnet8) or path/to/file.py:function")


def check_width(name: str, width: float) -> None:
    """Raise ValueError (one line: the problem and the fix) unless model ``name`` can be built here at
    ``width``: a known name, a width it takes, and for a spiking model snntorch installed (looked up,
    not imported). A builder string (``is_builder_spec``) is checked for its form only: its builder says
    what widths it takes."""
    if is_builder_spec(name):
        check_builder_spec(name)
        return
    if name not in MODEL_NAMES:
        raise ValueError(f"model={name!r} is unknown; choose one of {', '.join(MODEL_NAMES)}, or {BUILDER_HINT}")
    if isinstance(width, bool) or not isinstance(width, (int, float)):
        raise ValueError(f"width={width!r} is not a number; give a float such as 1.0")
    if name.startswith("mobilenetv2") or name in SPIKING_MODELS:
        lo, hi = WIDTH_RANGE if name.startswith("mobilenetv2") else SPIKING_WIDTH_RANGE
        if not (lo <= width <= hi):  # also refuses NaN
            kind = "MobileNetV2" if name.startswith("mobilenetv2") else name
            raise ValueError(f"width={width} is out of range; {kind} takes {lo}..{hi}")
    elif width != 1.0:
        raise ValueError(f"{name} has no width multiplier; use width=1.0")
    if name in SPIKING_MODELS and importlib.util.find_spec("snntorch") is None:
        raise ValueError(f"model={name} needs snntorch, which is not installed: {SNN_INSTALL_HINT}")
