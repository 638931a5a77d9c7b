"""What the manual's reference is made from, checked against the code it describes: every Config setting
declared once (its help, allowed values and default are the CLI's help, the reference's row and the
error's words), every environment variable pilab reads in one registry, the exit codes in one table."""
from __future__ import annotations

import ast
import glob
import math
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from pilab.config import CHOICES, Config, ConfigError, allowed, describe


def _outside(meta) -> list:
    """Values just outside each bound a setting declares (and NaN/inf where it must be finite)."""
    bad = []
    if meta["at_least"] is not None:
        bad.append(meta["at_least"] - 1)
    if meta["above"] is not None:
        bad.append(meta["above"])
    if meta["below"] is not None:
        bad.append(meta["below"])
    if meta["finite"]:
        bad += [math.inf, math.nan]
    return bad


def test_every_setting_is_declared_with_its_help_and_refused_outside_its_bounds():
    """Each bound a field declares is what Config enforces, with the one-line error naming the field, the
    value and the bound; each choice list is what Config accepts."""
    checked = 0
    for f in fields(Config):
        meta = f.metadata
        assert meta.get("help"), f"{f.name}: declare it with setting(default, help, ...)"
        for value in _outside(meta):
            value = {"int": int, "float": float}[f.type](value)  # bounds are declared on numbers only
            with pytest.raises(ConfigError) as e:
                Config(**{f.name: value})
            line = str(e.value)
            assert line.startswith(f"{f.name}=") and "\n" not in line, line
            checked += 1
        for choice in meta["choices"]:
            assert getattr(Config(**{f.name: choice}), f.name) == choice
    assert checked >= 30  # the bounds are really declared (not one per field forgotten)
    with pytest.raises(ConfigError, match="choose one of local, sync, renorm"):
        Config(bn="global")


def test_describe_is_the_reference_row_of_every_setting():
    rows = describe()
    assert [r["name"] for r in rows] == [f.name for f in fields(Config)]
    by = {r["name"]: r for r in rows}
    assert by["epochs"] == {**by["epochs"], "type": "int", "default": 10, "allowed": "> 0", "flag": "--epochs",
                            "section": "batch and schedule"}
    assert by["momentum"]["allowed"] == ">= 0 and < 1"
    assert by["bn"]["allowed"] == "local | sync | renorm" and CHOICES["bn"] == ("local", "sync", "renorm")
    assert by["checkpoint_minutes"]["allowed"] == "-1, or >= 0"
    assert by["trace_window"]["section"] == "a per-rank trace"
    assert all(r["section"] for r in rows)


def test_the_cli_help_says_what_the_setting_declares(tmp_path):
    """`train --help` carries each setting's help, its allowed values and train's default; the flag's
    error for a value out of bounds is the Config's line."""
    p = subprocess.run([sys.executable, "-m", "pilab", "train", "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())  # argparse wraps lines
    for f in fields(Config):
        words = " ".join(Config.help(f.name).split())
        assert words[:60] in text, f.name
    assert "(>= 0 and < 1; default: 0.9)" in text  # momentum's bounds and default
    assert "(> 0; default: 10)" in text  # epochs
    p = subprocess.run([sys.executable, "-m", "pilab", "train", "--momentum", "1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "pilab: error: momentum=1.0 must be < 1", p.stderr
    assert allowed("momentum") == ">= 0 and < 1"


# ---- environment variables -----------------------------------------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "docs", "_ext"))
from envscan import code_env_reads, env_reads  # noqa: E402  (the scanner the manual's page uses too)


def test_the_reader_finds_each_form_of_reading():
    """The checker itself, on a planted source: each form of reading is found, a write is not."""
    src = ('import os\nNAMES = ("A_ONE", "A_TWO")\n'
           'x = os.environ.get("R_GET"); y = os.environ["R_SUB"]; z = os.getenv("R_GETENV")\n'
           'if "R_IN" in os.environ: pass\n'
           'def f(env): return env.get("R_ENV")\n'
           'for v in NAMES:\n    os.environ.get(v)\n'
           'w = {k: os.environ[k] for k in ("R_COMP",) if k in os.environ}\n'
           'if {"R_SET"} & set(os.environ): pass\n'
           'os.environ["W_SET"] = "1"; d = dict(os.environ, W_KW="1"); os.environ.update(W_UP="1")\n')
    assert env_reads(src) == {"R_GET", "R_SUB", "R_GETENV", "R_IN", "R_ENV", "A_ONE", "A_TWO", "R_COMP", "R_SET"}


def test_every_environment_variable_read_is_in_the_registry_and_none_else():
    from pilab.envvars import GROUPS, VARS
    found = code_env_reads()
    registered = {v.name for v in VARS}
    missing = {k: v for k, v in found.items() if k not in registered}
    assert not missing, f"read but not in pilab/envvars.py's VARS (add a Var for each): {missing}"
    stale = registered - set(found)
    assert not stale, f"in pilab/envvars.py but read nowhere (remove them): {sorted(stale)}"
    assert len(registered) == len(VARS), "a variable registered twice"
    assert all(v.group in GROUPS and v.what and v.default for v in VARS)


# ---- exit codes ----------------------------------------------------------------------------------
def test_every_exit_status_constant_is_in_the_table():
    """Each ``EXIT_* = N`` of pilab's code (and the signals' 128 + N) is a row of EXIT_CODES, the table the
    manual's exit-code page is made from."""
    from pilab.cli.common import EXIT_CODES
    from pilab.engine.harness import exit_code_for
    codes = {c for c, _ in EXIT_CODES}
    found = {}
    for path in glob.glob(os.path.join(REPO, "pilab", "**", "*.py"), recursive=True):
        if os.sep + "bench" + os.sep in path:  # the benchmarks' own result states, not a command's status
            continue
        with open(path, encoding="utf-8") as f:
            for name, value in re.findall(r"^(EXIT_[A-Z_]+) = (\d+)[ \t]*(?:#|$)", f.read(), re.M):
                found[name] = int(value)
    assert {"EXIT_USAGE", "EXIT_WRITE", "EXIT_HANG"} <= set(found)
    missing = {k: v for k, v in found.items() if v not in codes}
    assert not missing, f"exit statuses not in pilab.cli.common.EXIT_CODES: {missing}"
    assert exit_code_for(2) in codes and exit_code_for(15) in codes
