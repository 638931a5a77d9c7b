"""Every command line the manual shows is parsed by pilab's own parser, as doctest runs a docstring's
examples: a renamed option, a bad choice or a value of the wrong form fails here, naming the page and
the line -- not in a reader's terminal.

What counts as a command: a ``python -m pilab …`` or ``pilab …`` line in a code block of README.md,
docs/**/*.md or the notebooks' markdown cells (the block's language none, bash, sh, shell or console), and
an inline code span that starts such a command. Continuation lines (``\\``) are joined; a shell's
``sudo``, ``VAR=value``, ``mpiexec -n N``, pipes, ``&&``, redirections and comments are left to the shell.

How it is parsed: ``pilab.cli.build_parser()``, as ``pilab.cli.main`` does (an unknown option, a bad
choice, an int that is not one), then an option written as a prefix of its name is refused (argparse
accepts ``--np`` for ``--nps``; the manual writes options whole), a list written ``--nps 1 2 4`` (the
manual writes ``1,2,4``: one form), and the command's settings built into its ``Config`` (a value out of
bounds). A placeholder in capitals or <angle brackets> (``--np N``, ``--out DIR``) stands for a value of
the option's type.

Marks, an HTML comment on the line before a code block (invisible on GitHub and in the built manual):
``<!-- check: run -->`` runs the block's commands as written, in small mode (``PILAB_NB_SMALL=1``) and in
a scratch copy of the working directory, and each must exit 0; ``<!-- check: fails -->`` is a block of
commands the manual shows failing, each of which must be refused.
"""
from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "shell-session"}
START = re.compile(r"(?:^|(?<=[\s;&|(`]))(?:(?:\S*/)?python3?\s+-m\s+pilab|pilab)(?=\s|$)")
MARK = re.compile(r"<!--\s*check:\s*(run|fails)\s*-->")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|<[^<>]+>|\$\{?[A-Za-z_]\w*\}?)$")
ELLIPSIS = {"...", "…", "[...]", "[…]", "[options]", "[OPTIONS]"}


@dataclass
class Command:
    page: str  # the file, relative to the repository
    line: int  # its first line there (for a notebook: the line in the cell's source)
    text: str  # the command line from `pilab` / `python -m pilab` on
    mark: str = ""  # "run" or "fails" for a marked code block
    where: str = ""  # "page:line" or "notebook cell N line M"
    inline: bool = False  # a code span in the text: may name a command without all it needs

    def __str__(self):
        return f"{self.where}: {self.text}"


# ----------------------------------------------------------------------------------------------
# collecting
# ----------------------------------------------------------------------------------------------
def _command_text(line: str, block: bool) -> str | None:
    """The ``pilab …`` part of a shell line (None where there is none): from ``pilab`` or
    ``python -m pilab`` to the end -- or to the quote that closes a ``sh -c "…"`` it is in -- the shell's
    own operators and comments cut off later."""
    for m in START.finditer(line):
        rest = line[m.end():]
        before = line[:m.start()]
        for q in "\"'":
            if before.count(q) % 2:  # inside a quoted string: the command ends where it closes
                rest = rest.split(q, 1)[0]
        words = rest.split()
        # a bare `pilab` is a command when a sub-command or an option follows it (not "cd pilab")
        if m.group(0) == "pilab" and not (words and (words[0] in _commands() or words[0].startswith("-"))):
            continue
        if not block and m.start() > 0:
            continue  # inline: only a span that starts with the command
        return "pilab" + rest
    return None


def _commands() -> set:
    from pilab.cli import COMMANDS
    return {c.__name__.rsplit(".", 1)[-1] for c in COMMANDS}


def _without_comment(line: str) -> str:
    """A shell line without its comment: from the first ``#`` that starts a word outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _from_markdown(text: str, page: str, where=lambda n: None) -> list[Command]:
    out, lines = [], text.splitlines()
    fence, lang, mark, pending, i = None, "", "", "", 0
    while i < len(lines):
        line, n = lines[i], i + 1
        stripped = line.strip()
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*(\{[\w-]+\})?\s*([\w-]*)", line)
        if fence is None and m:
            fence, lang = m.group(2), (m.group(4) if not m.group(3) or m.group(3) == "{code-block}" else "?")
            mark, pending = pending, ""
            i += 1
            continue
        if fence is not None:
            if stripped.startswith(fence) and stripped.strip("`~") == "":
                fence, mark = None, ""
                i += 1
                continue
            prompt = re.match(r"^\s*\$\s+", line)
            if lang.lower() in SHELL_LANGS and (prompt or lang.lower() not in ("console", "shell-session")):
                first = n
                while line.rstrip().endswith("\\") and i + 1 < len(lines):  # a continued command
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                cmd = _command_text(_without_comment(re.sub(r"^\s*\$\s+", "", line)), block=True)
                if cmd:
                    out.append(Command(page, first, cmd, mark, where(first) or f"{page}:{first}"))
            i += 1
            continue
        mk = MARK.search(line)
        if mk:
            pending = mk.group(1)
        elif stripped:
            pending = ""
            for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", line):
                cmd = _command_text(span.strip(), block=False)
                if cmd and START.match(span.strip()):
                    out.append(Command(page, n, cmd, "", where(n) or f"{page}:{n}", inline=True))
        i += 1
    return out


def manual_pages() -> list[str]:
    pages = [os.path.join(REPO, "README.md")]
    pages += [p for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
              if os.sep + "_build" + os.sep not in p]
    pages += glob.glob(os.path.join(REPO, "notebooks", "*.ipynb"))
    return sorted(pages)


def collect(path: str) -> list[Command]:
    """The commands of one page (a Markdown file or a notebook's markdown cells)."""
    rel = os.path.relpath(path, REPO)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not path.endswith(".ipynb"):
        return _from_markdown(text, rel)
    out = []
    for k, cell in enumerate(json.loads(text)["cells"], 1):
        if cell["cell_type"] == "markdown":
            src = "".join(cell["source"])
            out += _from_markdown(src, rel, where=lambda n, k=k: f"{rel} cell {k} line {n}")
    return out


# ----------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------
def _shell_words(text: str) -> list[str]:
    """The command's words up to the shell's first operator (|, &&, ;, >, a comment, a closing ")");
    ``<out>``-style placeholders are words (OUT), not redirections."""
    text = re.sub(r"<([\w.-]+)>", lambda m: m.group(1).upper().replace(".", "_").replace("-", "_"), text)
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lex.whitespace_split = True
    lex.commenters = "#"
    words = []
    try:
        for w in lex:
            if w and set(w) <= set(";&|<>()"):
                break
            words.append(w)
    except ValueError:  # an unclosed quote: let the parser see what there is
        pass
    return words


def _actions_by_option(parser) -> dict:
    return dict(parser._option_string_actions)


def _sample(action) -> str:
    if action is None:
        return "x"
    if action.choices:
        return str(next(iter(action.choices)))
    return {int: "1", float: "1.0"}.get(action.type, "1" if getattr(action.type, "words", "").startswith(
        "integers") else "x")


def _subparser(parser, word):
    import argparse
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) and word in a.choices:
            return a.choices[word]
    return None


def prepare(words: list[str]):
    """(the words with placeholders filled in for their option's type, the innermost parser, problems):
    problems are the manual's own forms that parse but are not written so (a prefix of an option, a
    list with spaces)."""
    from pilab.cli import build_parser
    from pilab.cli.common import IntList

    parser = build_parser()
    out, problems, prev = [], [], None
    for w in words:
        if w in ELLIPSIS:
            continue
        if PLACEHOLDER.match(w) and prev is None and any(
                a.__class__.__name__ == "_SubParsersAction" for a in parser._actions):
            return None, parser, []  # `pilab COMMAND --help`: any command; nothing to check past it
        sub = _subparser(parser, w) if not w.startswith("-") else None
        if sub is not None and (prev is None or prev.nargs == 0 or prev.option_strings == []):
            parser, prev = sub, None
            out.append(w)
            continue
        opts = _actions_by_option(parser)
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            action = opts.get(name)
            if action is None and name not in ("--help",):
                full = [o for o in opts if o.startswith(name)]
                if len(full) == 1:
                    problems.append(f"{name} is written as a prefix of {full[0]}; write the option whole")
            if eq and action is not None and PLACEHOLDER.match(value):
                w = f"{name}={_sample(action)}"
            out.append(w)
            prev = action
            if isinstance(action, IntList):
                prev.count = 0
            continue
        if prev is not None and isinstance(prev, IntList) and not w.startswith("-"):
            prev.count = getattr(prev, "count", 0) + 1
            if prev.count == 2:
                problems.append(f"{prev.option_strings[0]} takes its numbers as 1,2,4 in the manual, not "
                                "separated by spaces")
        out.append(_sample(prev) if PLACEHOLDER.match(w) else w)
    return out, parser, problems


def check(cmd: Command) -> str | None:
    """None when pilab's parser takes the command as written; else the one line it says."""
    from pilab.cli import build_parser
    from pilab.cli.common import UsageError, config_from_args
    from pilab.config import ConfigError

    words = _shell_words(cmd.text)[1:]  # after "pilab"
    words, _, problems = prepare(words)
    if problems:
        return problems[0]
    if words is None:
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, extra = build_parser().parse_known_args(words)
    except UsageError as e:
        if cmd.inline and re.match(r"the following arguments are required|argument \S+: expected one", str(e)):
            return None  # text naming a command or an option (`pilab trace`, `--out`), not a whole command
        return str(e)
    except SystemExit as e:  # --help
        return None if e.code == 0 else f"argparse exited {e.code}"
    if extra:
        return f"unrecognized arguments: {' '.join(extra)}"
    defaults = getattr(args, "config_defaults", None)
    try:
        if defaults is not None:
            config_from_args(args, defaults(args) if callable(defaults) else defaults)
        if getattr(args, "precheck", None):  # a command's own checks before running (remedies' --only)
            args.precheck(args)
    except (ConfigError, UsageError) as e:
        return str(e)
    return None


def all_commands() -> list[Command]:
    return [c for page in manual_pages() for c in collect(page)]


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------
def test_every_command_in_the_manual_parses():
    cmds = all_commands()
    bad = [f"{c}\n    -> {why}" for c in cmds if c.mark != "fails" and (why := check(c))]
    print(f"\n{len(cmds)} commands checked in {len(manual_pages())} pages; "
          f"{sum(c.mark == 'run' for c in cmds)} marked to run")
    assert len(cmds) > 100, "the collector lost the manual's commands"
    assert not bad, "commands in the manual that pilab refuses:\n" + "\n".join(bad)
    wrong = [str(c) for c in cmds if c.mark == "fails" and not check(c)]
    assert not wrong, "commands marked `check: fails` that pilab takes:\n" + "\n".join(wrong)


PLANTED = """# A page

Train on two ranks:

```bash
python -m pilab train --np 2 --epochs 1      # fine
python -m pilab train --np 2 --epoch-count 1
```

Then `pilab scale --nps 1,2 --bn global` and `pilab perfmodel table --nps 1 2 4`;
a placeholder is fine: `python -m pilab simulate --np N --out DIR`, a prefix is not:
`pilab scale --simulate-n 8` and a value out of bounds neither: `pilab simulate --np 8 --epochs 0`.
Nor a recipe that is not one: `pilab remedies --np 8 --only "sqrt lr + warmup,no such recipe"`.
"""


def test_the_checker_fails_on_a_planted_bad_flag_naming_page_and_line(tmp_path):
    """The checker itself, on a temporary page: each kind of mistake is found, with its page and line."""
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    cmds = collect(str(page))
    found = {c.line: check(c) for c in cmds}
    assert len(cmds) == 8, [str(c) for c in cmds]
    assert found[6] is None and found[11] is None
    assert "unrecognized arguments: --epoch-count 1" in found[7]
    assert "argument --bn: invalid choice: 'global'" in cmds[2].__str__() + str(check(cmds[2]))
    assert "takes its numbers as 1,2,4" in check(cmds[3])
    assert "--simulate-n is written as a prefix of --simulate-nps" in check(cmds[5])
    assert check(cmds[6]) == "epochs=0 must be > 0"
    assert check(cmds[7]).startswith("'no such recipe' is not a candidate at np=8; the candidates")
    assert str(cmds[1]).startswith(f"{os.path.relpath(str(page), REPO)}:7: pilab train --np 2 --epoch-count 1")


def test_list_options_take_both_forms_and_the_same_values():
    """`--nps 1,2,4` and `--nps 1 2 4` are one list on every command that takes process counts."""
    from pilab.cli import build_parser
    p = build_parser()
    for words in (["scale", "--nps"], ["perfmodel", "table", "--nps"], ["perfmodel", "bench", "--np"]):
        a = p.parse_args(words + ["2,4", "8"])
        b = p.parse_args(words + ["2", "4", "8"])
        dest = words[-1].lstrip("-")
        assert getattr(a, dest) == getattr(b, dest) == [2, 4, 8], words
    assert p.parse_args(["scale", "--simulate-nps", ""]).simulate_nps == []


def _scratch(tmp_path):
    """A working directory for the commands run: the repository's files linked in, its runs/ apart."""
    work = tmp_path / "work"
    work.mkdir()
    for name in os.listdir(REPO):
        if name not in ("runs", ".git", ".venv") and not name.startswith("."):
            os.symlink(os.path.join(REPO, name), work / name)
    return work


@pytest.mark.parametrize("cmd", [c for c in all_commands() if c.mark == "run"], ids=str)
def test_the_cheap_commands_run_as_written(cmd, tmp_path):
    words = _shell_words(cmd.text)
    env = dict(os.environ, PILAB_NB_SMALL="1", PILAB_CACHE=os.environ.get("PILAB_CACHE", ""))
    p = subprocess.run([sys.executable, "-m", "pilab", *words[1:]], cwd=_scratch(tmp_path), env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{cmd}\n{p.stderr[-3000:]}"
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
