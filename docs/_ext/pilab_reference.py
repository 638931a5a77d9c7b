"""The manual's reference lists, made from the code each time the manual is built.

A page of docs/reference/ says what its list is for and marks where the list goes::

    ```{pilab-reference} commands
    ```

and this extension puts the list there as the page is read (Sphinx's ``source-read``), from:

* ``commands``: the real argparse parsers (``pilab.cli.build_parser()``): every command and sub-command,
  each option with its value, default, choices and help as ``--help`` prints them;
* ``config``: every ``Config`` setting from its declaration (``pilab.config.describe()``): type, default,
  allowed values, what it does -- the same words as the CLI's help and the errors;
* ``environment``: the registry of environment variables (``pilab.envvars.VARS``), with the files that
  read each one found in the source (``envscan``);
* ``exit-codes``: ``pilab.cli.common.EXIT_CODES``.

Why ours and not sphinx-argparse: pilab's Config flags default to None (so that a command knows which
were given) and each command has its own defaults (``train``'s out is runs/train, ``scale``'s the demo's);
sphinx-argparse would print "None" for each of sixty flags on six commands, and no types. This is the
same walk over argparse's actions, with the command's real defaults (``pilab_default``), and the Config
flags listed once on their own page instead of six times.
The pages holding a list are rebuilt on every build (``env-get-outdated``): the code may have changed
while the page did not.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
from dataclasses import fields

PLACEHOLDER = re.compile(r"^```\{pilab-reference\}[ \t]+([\w-]+)[ \t]*\n```[ \t]*$", re.M)
DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------
# Markdown helpers
# ----------------------------------------------------------------------------------------------
def _cell(text) -> str:
    """Text for a Markdown table cell: one line, ``|`` escaped, and outside `code` the characters that
    Markdown would take for HTML or emphasis (``<out>``, ``np*/``)."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):  # even pieces are outside code spans
        pieces = re.split(r"((?<![\w-])--[a-z][\w-]*(?:=[^\s;,)]+)?|\$[A-Z][A-Z0-9_]+)", parts[i])
        # options and variables as code (else typography makes "--np" a dash); the rest escaped
        parts[i] = "".join(f"`{p}`" if j % 2 else re.sub(r"([\\<>*_\[\]])", r"\\\1", p)
                           for j, p in enumerate(pieces))
    return "`".join(parts).replace("|", "\\|")


def _code(value) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return f"`{text}`" if "`" not in text else text


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------
def _value(action: argparse.Action) -> str:
    """What an option takes, in words: a flag, a number, one of the choices, one or more of them."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "flag (`--no-…` turns it off)"
    if action.nargs == 0:
        return "flag"
    t = action.type
    words = getattr(action, "words", None)  # an action of pilab's that says what it takes (IntList)
    kind = words or {int: "integer", float: "number", None: "text", str: "text"}.get(t, getattr(t, "__name__", "text"))
    if action.choices is not None:
        kind = "one of " + ", ".join(f"`{c}`" for c in action.choices)
    if action.nargs in ("+", "*") and not words:
        kind += ", one or more"
    if isinstance(action, argparse._AppendAction):
        kind += ", repeatable"
    return _cell(kind) if action.choices is None else kind


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS or value is False or (isinstance(value, (list, tuple))
                                                                        and not value):
        return ""
    if isinstance(value, (list, tuple)):
        return "`" + ",".join(str(v) for v in value) + "`"  # the manual's one form of a list
    return _code(value)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as ``--help`` prints it (``%(default)s`` filled in)."""
    if not action.help:
        return ""
    return _cell(parser._get_formatter()._expand_help(action))


def _names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    return " / ".join(f"`{o}`" for o in action.option_strings)


def _subparsers(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            return [(name, sub, helps.get(name, "")) for name, sub in a.choices.items()]
    return []


def _command(parser, name: str, helpline: str, level: int, base) -> list[str]:
    out = [f"{'#' * level} `{name}`\n"]
    for text in dict.fromkeys(t for t in (helpline, parser.description) if t):  # each once, in that order
        out.append(_cell(text[0].upper() + text[1:] + ("" if text.rstrip()[-1] in ".:)" else ".")) + "\n")
    subs = _subparsers(parser)
    own = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
           and not hasattr(a, "pilab_default")]
    if own:
        rows = [[_names(a), _value(a), _default(a), _help(parser, a)] for a in own]
        out.append(_table(["Option", "Value", "Default", "What it does"], rows))
    settings = [a for a in parser._actions if hasattr(a, "pilab_default")]  # add_config_arguments' flags
    if settings:
        given = {a.dest for a in settings}
        left_out = [f"`--{f.name.replace('_', '-')}`" for f in fields(base) if f.name not in given]
        differ = [f"`--{a.dest.replace('_', '-')} {_plain(a.pilab_default)}`" for a in settings
                  if a.pilab_default != getattr(base(), a.dest)]
        out.append("Every setting of the [Config reference](config.md) as its `--flag`"
                   + (f", except {', '.join(left_out)}" if left_out else "") + ". "
                   + (f"This command's defaults that differ from `Config()`'s: {', '.join(differ)}."
                      if differ else "The defaults are `Config()`'s.") + "\n")
    if parser.epilog:
        out.append("```text\n" + parser.epilog.strip() + "\n```\n")
    for sub_name, sub, sub_help in subs:
        out += _command(sub, f"{name} {sub_name}", sub_help or "", min(level + 1, 4), base)
    return out


def _plain(value) -> str:
    return "''" if value == "" else str(value)


def commands() -> str:
    from pilab.cli import build_parser
    from pilab.config import Config
    parser = build_parser()
    for _, sub, _ in _subparsers(parser):
        sub.format_help()  # a command whose epilog is made when its help is printed (remedies' candidates)
    out = []
    for name, sub, helpline in _subparsers(parser):
        out += _command(sub, f"pilab {name}", helpline, 2, Config)
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Config, environment, exit codes
# ----------------------------------------------------------------------------------------------
def config() -> str:
    from pilab.config import describe
    out, section = [], None
    rows: list = []
    for d in describe() + [None]:
        if d is None or d["section"] != section:
            if rows:
                out.append(f"## {section[0].upper() + section[1:]}\n")
                out.append(_table(["Setting", "Type", "Default", "Allowed", "What it does"], rows))
            if d is None:
                break
            section, rows = d["section"], []
        flag = d["flag"] if d["type"] != "bool" else f"{d['flag']} / --no-{d['flag'][2:]}"
        rows.append([f"`{d['name']}` (`{flag}`)", d["type"], _code(d["default"]), _cell(d["allowed"]),
                     _cell(d["help"])])
    return "\n".join(out)


def environment() -> str:
    from envscan import code_env_reads
    from pilab.envvars import GROUPS, VARS
    reads = code_env_reads()
    out = []
    for group, title in GROUPS.items():
        rows = [[f"`{v.name}`", _cell(v.default), _cell(v.what),
                 ", ".join(f"`{p}`" for p in sorted(reads.get(v.name, [])))] for v in VARS if v.group == group]
        if rows:
            out.append(f"## {title}\n")
            out.append(_table(["Variable", "When unset", "What it does", "Read in"], rows))
    return "\n".join(out)


def exit_codes() -> str:
    from pilab.cli.common import EXIT_CODES
    return _table(["Exit status", "Meaning"], [[f"`{code}`", _cell(words)] for code, words in EXIT_CODES])


LISTS = {"commands": commands, "config": config, "environment": environment, "exit-codes": exit_codes}


# ----------------------------------------------------------------------------------------------
# Sphinx
# ----------------------------------------------------------------------------------------------
def fill(text: str) -> str:
    """``text`` with each ``{pilab-reference} NAME`` block replaced by its list (KeyError: no such list)."""
    return PLACEHOLDER.sub(lambda m: LISTS[m.group(1)](), text)


def _fill(app, docname, source):
    if PLACEHOLDER.search(source[0]):
        try:
            source[0] = fill(source[0])
        except KeyError as e:
            raise ValueError(f"{docname}: no reference list named {e}; choose one of {', '.join(LISTS)}") from None


def _pages_with_lists() -> list[str]:
    out = []
    for path in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True):
        if "_build" not in path:
            with open(path, encoding="utf-8") as f:
                if PLACEHOLDER.search(f.read()):
                    out.append(os.path.relpath(path, DOCS)[:-3].replace(os.sep, "/"))
    return out


def _outdated(app, env, added, changed, removed):
    return [d for d in _pages_with_lists() if d in env.found_docs]


def setup(app):
    app.connect("source-read", _fill)
    app.connect("env-get-outdated", _outdated)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
