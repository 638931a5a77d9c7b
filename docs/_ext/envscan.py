"""Which environment variables the code reads, and where: found in the source, so that the manual's
environment reference (pilab_reference.py) names the files that read each variable of the registry
(pilab/envvars.py), and tests/test_reference.py fails on a variable read but not registered.

    code_env_reads()          # {"PILAB_CACHE": ["pilab/data/cache.py"], ...}

Python is read with ``ast`` (see ``env_reads`` for the forms found); shell scripts by ``$PILAB_X``.
Stdlib only: the docs build and the tests import it without pilab.
"""
from __future__ import annotations

import ast
import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _is_environ(node) -> bool:
    """``os.environ``, ``environ``, or a mapping the code calls ``env`` (an environment passed in)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id in ("environ", "env"))


def _strings(node, consts: dict) -> set:
    """The upper-case string constants ``node`` lists (a tuple/list/set literal, or a module-level name
    assigned one)."""
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                and ENV_NAME.match(e.value)}
    return set()


def env_reads(source: str) -> set:
    """Environment variables a Python source reads: ``os.environ.get("X")``, ``os.environ["X"]``,
    ``os.getenv("X")``, ``"X" in os.environ``, ``env.get("X")`` on an environment passed in, a loop or
    comprehension over a tuple of names reading ``os.environ[name]``, and ``{"X", ...} & set(os.environ)``.
    A write (``os.environ["X"] = ...``, ``dict(os.environ, X=...)``) is not a read."""
    tree = ast.parse(source)
    consts = {t.id: _strings(n.value, {}) for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    reads, loops = set(), {}
    for node in ast.walk(tree):  # loop variables bound to a list of names
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            loops.setdefault(node.target.id, set()).update(_strings(node.iter, consts))

    def key(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return {arg.value}
        return loops.get(arg.id, set()) if isinstance(arg, ast.Name) else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault") and _is_environ(f.value):
                reads |= key(node.args[0])
            elif isinstance(f, ast.Attribute) and f.attr == "getenv":
                reads |= key(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            reads |= key(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In) for op in node.ops) and \
                any(_is_environ(c) for c in node.comparators):
            reads |= key(node.left)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd) and \
                any(_is_environ(n) for side in (node.left, node.right) for n in ast.walk(side)):
            reads |= _strings(node.left, consts) | _strings(node.right, consts)
    return {r for r in reads if ENV_NAME.match(r)}


def _code_files():
    for pattern in ("pilab/**/*.py", "profiles/**/*.py", "scripts/**/*.py"):
        yield from glob.glob(os.path.join(REPO, pattern), recursive=True)


def code_env_reads() -> dict:
    """{variable: [files reading it]} over pilab/, profiles/, scripts/ and the shell scripts (lab.sh,
    scripts/*.sh, and the shell text of the profiles' batch scripts: ``$PILAB_X`` / ``${PILAB_X``)."""
    found: dict = {}
    for path in _code_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        names = env_reads(text) | set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*_[A-Z0-9_]+)", text)
                                      if path.startswith(os.path.join(REPO, "profiles")) else ())
        for name in names:
            found.setdefault(name, []).append(os.path.relpath(path, REPO))
    for path in [os.path.join(REPO, "lab.sh"), *glob.glob(os.path.join(REPO, "scripts", "*.sh"))]:
        with open(path, encoding="utf-8") as f:
            for name in set(re.findall(r"\$\{?(PILAB_[A-Z0-9_]+)", f.read())):
                found.setdefault(name, []).append(os.path.relpath(path, REPO))
    return found
