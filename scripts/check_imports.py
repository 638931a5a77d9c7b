"""Check pilab's import structure: layers point down, nothing below the CLI imports it, no circles
between parts nor between modules, and the heavy third-party libraries stay behind their fences.

    python scripts/check_imports.py            # prints the module graph; exit 1 on a violation
    python scripts/check_imports.py --stats    # also lines per module and the longest functions
    python scripts/check_imports.py --numbers  # also the architecture's numbers (docs/architecture.md)

Reads the source with ``ast`` (imports inside functions count too), so it needs nothing installed.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pilab"

# Each part of the package and its layer: a module may import only lower layers (docs/architecture.md:
# front-ends -> study -> engine -> {dist, data, models}). A part is a folder of pilab (every module in it
# takes its layer, so a new module needs no entry here) or a module at the top of pilab/. The modules at
# the top that are not listed are the base (files, verdict, resultfile, envvars, component, lazy: atomic
# writes, the verdict's logic, a result on disk, the environment's registry, what a loop feature is, lazy
# package faces): they import no part above them, only one another (the circle check keeps that a tree),
# so a new small leaf module needs no entry either.
BASE = 0
LAYERS = {
    "launch": 1,  # finding mpiexec, starting a job, hostfiles, Slurm, where the ranks land (no torch)
    "models": 1,  # the networks, by name (torch only)
    "plots": 1, "testbed": 1,  # the view (Bokeh, matplotlib); network namespaces playing a cluster
    "config": 2,  # the frozen Config (checks model names against models/)
    "data": 3, "dist": 3,  # images, shards, loaders; MPI primitives, GradSync, SyncBatchNorm
    "perfmodel": 4,  # time per step at any np, and its checks against measurements
    "trace": 5,  # a run's per-rank timeline: recorded, written, read, predicted, validated; stragglers
    "engine": 6,  # the training loop, its rank backends, its features, one guarded run on the ranks
    "study": 7,  # scaling studies, remedies, comparisons, reports
    "bench": 8, "lab": 8,  # the benchmarks (`pilab bench`); the notebook front-ends
    "doctor": 9,  # preflight of a cluster (uses the lab's profile address)
    "cli": 10,
    "__main__": 11, "__init__": 11,
}


def is_base(name: str) -> bool:
    """A module at the top of pilab/ that the table does not list (``files``, ``verdict``, ...)."""
    return name not in LAYERS and (ROOT / f"{name}.py").is_file()


def layer(name: str) -> float | None:
    """A part's layer: the table's, ``BASE`` for a base module, None for an unknown part."""
    return LAYERS.get(name, BASE if is_base(name) else None)


# Third-party modules only these parts may import (anywhere in them): ipywidgets is the notebook
# panel's; mpi4py is loaded through pilab.launch.mpi() (importing it initialises MPI, which a process
# that only plots, predicts or launches must not do) and used directly only by the communication layer.
ONLY_IN = {"ipywidgets": {"lab"}, "mpi4py": {"dist", "launch"}}
# Third-party modules that only these modules may import at module level: Bokeh costs ~1 s to import,
# and a rank, the engine or a benchmark never draws. The view draws the figures; the study's report is
# the one place that puts them into a page. Elsewhere Bokeh is imported inside the function that draws.
MODULE_LEVEL_FROM = {"bokeh": ("pilab.plots", "pilab.study.report")}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _allowed_at_module_level(top: str, me: str) -> bool:
    return any(me == m or me.startswith(m + ".") for m in MODULE_LEVEL_FROM[top])


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function?) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            func = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                # "from . import a, b" or "from .engine import loop": a name is a submodule, or an
                # attribute of the module or package (each module imported counts once)
                targets = []
                for a in child.names:
                    sub = ROOT.parent.joinpath(*target.split("."), a.name)
                    is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                    name = f"{target}.{a.name}" if is_module else target
                    if name not in targets:
                        targets.append(name)
                out.extend((t, child.lineno, in_func) for t in targets)
            visit(child, func)
    visit(tree, False)
    return out


def part(module: str) -> str | None:
    """The part of pilab a module belongs to: the longest name in LAYERS that is the module or a package
    above it ("pilab.cli.train" -> "cli", "pilab.study.run" -> "study"); a module in no part is its
    top-level name ("pilab.nowhere.x" -> "nowhere", which the check reports)."""
    bits = module.split(".")
    if bits[0] != "pilab":
        return None
    if len(bits) == 1:
        return "__init__"
    for n in range(len(bits) - 1, 0, -1):
        name = ".".join(bits[1:n + 1])
        if name in LAYERS:
            return name
    return bits[1]


def check() -> tuple[list[str], dict, int]:
    problems, graph, modules, local_imports = [], {}, {}, 0
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        mine = part(me) if me != "pilab" else "__init__"
        if path.name == "__main__.py":
            mine = "__main__"
        if layer(mine) is None:
            problems.append(f"{me}: not in the layer table of scripts/check_imports.py; add its folder")
            continue
        for target, line, in_func in imports_of(path):
            local_imports += in_func and target.startswith("pilab")
            top = target.split(".")[0]
            if top in ONLY_IN and mine not in ONLY_IN[top]:
                problems.append(f"{me}:{line} imports {top}, which only {sorted(ONLY_IN[top])} may"
                                + (" (use pilab.launch.mpi())" if top == "mpi4py" else ""))
            if top in MODULE_LEVEL_FROM and not in_func and not _allowed_at_module_level(top, me):
                problems.append(f"{me}:{line} imports {top} at module level; only "
                                f"{', '.join(MODULE_LEVEL_FROM[top])} may: import it inside the function "
                                "that draws")
            target_module = _module_of(target)
            if target_module and target_module != me:
                modules.setdefault(me, set()).add(target_module)
            theirs = part(target)
            if theirs is None or theirs == mine or theirs == "__init__":
                continue
            if layer(theirs) is None:
                problems.append(f"{me}:{line} imports unknown part {target}")
                continue
            graph.setdefault(mine, set()).add(theirs)
            if theirs == "cli" and mine != "__main__":
                problems.append(f"{me}:{line} imports the CLI ({target}); only the CLI itself may")
            elif is_base(mine) and is_base(theirs):
                continue  # base modules may import one another; the circle check below keeps it a tree
            elif layer(theirs) >= layer(mine):
                problems.append(f"{me}:{line} imports {target}: layer {layer(theirs)} from layer "
                                f"{layer(mine)} (imports must point down)")
    problems += [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    # module by module too: two modules of one part importing each other pass the part-level check
    problems += [f"import circle between modules: {' -> '.join(c)}" for c in cycles(modules)
                 if len({part(m) for m in c}) == 1]
    return problems, graph, local_imports


def _module_of(target: str) -> str | None:
    """The pilab module (a file or a package's __init__) that ``import target`` loads, or None."""
    if not target.startswith("pilab"):
        return None
    bits = target.split(".")
    while bits:
        path = ROOT.parent.joinpath(*bits)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(bits)
        bits = bits[:-1]  # "pilab.lab.cluster.client.Engines" -> the module pilab.lab.cluster.client
    return None


def cycles(graph: dict) -> list[list[str]]:
    """Every elementary circle found by depth-first search (the graph is small)."""
    found, seen = [], set()

    def dfs(node, stack):
        for nxt in sorted(graph.get(node, ())):
            if nxt in stack:
                c = stack[stack.index(nxt):] + [nxt]
                key = frozenset(c)
                if key not in seen:
                    seen.add(key)
                    found.append(c)
            elif len(stack) < 20:
                dfs(nxt, stack + [nxt])
    for n in sorted(graph):
        dfs(n, [n])
    return found


def stats(top: int = 10) -> None:
    rows, funcs = [], []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        rows.append((len(text.splitlines()), str(path.relative_to(ROOT.parent))))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT.parent)}:"
                              f"{node.lineno} {node.name}"))
    for n, name in rows:
        print(f"{n:6d}  {name}")
    print(f"\nthe {top} longest functions:")
    for n, name in sorted(funcs, reverse=True)[:top]:
        print(f"{n:6d}  {name}")


def _defined(tree: ast.Module) -> set:
    """The names a module defines at its top (functions, classes, assignments, in if/try blocks too)."""
    out = set()
    for node in tree.body:
        for n in ([node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    return out


def numbers() -> dict:
    """The architecture's numbers: modules and lines of pilab/, names imported across modules that are
    private there (``_name``) or that the module they come from only re-exports (a package's face may),
    the layer table's entries, circles between folders, file names used in more than one folder, and
    ``StepResult``'s fields."""
    paths = sorted(ROOT.rglob("*.py"))
    trees = {module_name(p): (p, ast.parse(p.read_text())) for p in paths}
    private = hops = 0
    for me, (path, tree) in trees.items():
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for n in ast.walk(tree):
            if not isinstance(n, ast.ImportFrom):
                continue
            base = package.split(".")[:len(package.split(".")) - (n.level - 1)] if n.level else []
            target = ".".join(base + ([n.module] if n.module else [])) if n.level else (n.module or "")
            if target not in trees or target == me:
                continue
            for a in n.names:
                if f"{target}.{a.name}" in trees:
                    continue  # a module, not a name
                private += a.name.startswith("_") and not a.name.startswith("__")
                face = trees[target][0].name == "__init__.py"
                hops += not face and a.name not in _defined(trees[target][1])
    folders: dict = {}  # folder (or top-level module) -> the folders it imports
    for p in paths:
        me = module_name(p).split(".")
        for target, _, _ in imports_of(p):
            there = (_module_of(target) or "").split(".")
            if len(me) > 1 and len(there) > 1 and there[0] == "pilab" and there[1] != me[1]:
                folders.setdefault(me[1], set()).add(there[1])
    names = [p.name for p in paths if p.name != "__init__.py"]
    step = trees["pilab.engine.backend"][1]
    fields = next(len([b for b in n.body if isinstance(b, ast.AnnAssign)]) for n in step.body
                  if isinstance(n, ast.ClassDef) and n.name == "StepResult")
    return {"modules": len(paths), "lines": sum(len(p.read_text().splitlines()) for p in paths),
            "private names imported across modules": private, "re-export hops": hops,
            "layer-table entries": len(LAYERS), "folder loops": len(cycles(folders)),
            "repeated file names": len({n for n in names if names.count(n) > 1}),
            "StepResult fields": fields}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stats", action="store_true", help="also lines per module, longest functions")
    ap.add_argument("--numbers", action="store_true", help="also the architecture's numbers")
    args = ap.parse_args()
    problems, graph, local = check()
    for mod in sorted(graph, key=layer):
        print(f"{mod:<10} -> {', '.join(sorted(graph[mod], key=lambda m: -layer(m)))}")
    print(f"function-local imports of pilab modules: {local}")
    if args.stats:
        stats()
    if args.numbers:
        for k, v in numbers().items():
            print(f"{k}: {v}")
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    print("ok: imports point down, no circles" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
