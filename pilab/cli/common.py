"""What every subcommand shares: the one-line usage error, Config <-> flags, the progress display.

Only the CLI imports this module; library code raises its own errors (``ConfigError``, ``DataError``,
``LaunchError`` …) and ``pilab.cli.main`` turns them into one line and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from ..config import CHOICES, Config

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before its error; we want one line naming the fix.
    def error(self, message):
        words = self.prog.split()
        hint = "python -m pilab" + ("" if len(words) < 2 else " " + " ".join(words[1:]))
        raise UsageError(f"{message} (see `{hint} --help`)")


def ints(text: str, what: str = "process counts") -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; anything else is a one-line error."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{text!r} is not a comma-separated list of {what}, e.g. 1,2,4") from None


# ----------------------------------------------------------------------------------------------
# Config <-> argparse, one source of truth: the dataclass and its comments
# ----------------------------------------------------------------------------------------------
def add_config_arguments(p: argparse.ArgumentParser, defaults: Config | None = None,
                         skip: tuple = ()) -> None:
    """One ``--flag`` per Config field, typed and with the field's comment as help."""
    defaults = defaults or Config()
    g = p.add_argument_group("training configuration (pilab.config.Config)")
    for f in fields(Config):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = f"{Config.help(f.name)} (default: {default!r})".replace("%", "%%")
        if f.type == "bool":
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=text)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type]
            g.add_argument(flag, dest=f.name, type=typ, default=None,
                           choices=CHOICES.get(f.name), metavar=f.name.upper(), help=text)


def config_from_args(args: argparse.Namespace, defaults: Config | None = None) -> Config:
    """The Config the flags describe (flags not given keep ``defaults``); validated by Config."""
    values = (defaults or Config()).to_dict()
    for f in fields(Config):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return Config(**values)


def strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without ``--flag VALUE`` / ``--flag=VALUE`` for each flag (for re-launching ranks)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(fl + "=") for fl in flags):
            continue
        out.append(a)
    return out


def progress_callbacks(quiet: bool):
    """A tqdm bar over all steps and one line per epoch (rank 0 only: callbacks run there)."""
    if quiet:
        return []
    from tqdm.auto import tqdm  # only when a bar is wanted: tqdm.auto probes for a notebook
    state = {}

    def cb(ev):
        kind = ev["kind"]
        if kind == "start":
            done = ev["start_epoch"] * ev["steps_per_epoch"]
            state["bar"] = tqdm(total=ev["total_steps"], initial=done, unit="step",
                                desc=f"np={ev['np']}", dynamic_ncols=True, file=sys.stderr)
        elif kind == "step":
            bar = state["bar"]
            bar.update(1)
            bar.set_postfix(loss=f"{ev['loss']:.3f}", img_s=f"{ev['images_per_s']:.0f}", refresh=False)
        elif kind == "epoch":
            test = "" if ev["test_acc"] is None else \
                f"  test loss {ev['test_loss']:.3f} acc {ev['test_acc']:.3f}"
            state["bar"].write(f"epoch {ev['epoch']}: train loss {ev['train_loss']:.3f} "
                               f"acc {ev['train_acc']:.3f}{test}  {ev['time']:.1f}s "
                               f"(comm {ev['comm']:.1f}s, exposed {ev['comm_exposed']:.1f}s)")
        elif kind == "end":
            state["bar"].close()
    return [cb]
