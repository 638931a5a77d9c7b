"""Check pilab's import structure: layers point down, nothing below the CLI imports it, no circles
between parts nor between modules, and the heavy third-party libraries stay behind their fences.

    python scripts/check_imports.py            # prints the module graph; exit 1 on a violation
    python scripts/check_imports.py --stats    # also lines per module and the longest functions

Reads the source with ``ast`` (imports inside functions count too), so it needs nothing installed.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pilab"

# Each part of the package and its layer: a module may import only lower layers (the rule in
# docs/architecture.md: front-ends -> study -> engine -> {dist, data, models}). A part is a module or a
# package, named from pilab down ("study", "engine.dist"); a module belongs to the longest part that names it.
LAYERS = {
    "hosts": -1,  # host/slot lists from a hostfile, --hosts or a Slurm allocation (no pilab imports)
    "launch": 0, "files": 0, "embedded": 0,
    "slurm": 0,  # Slurm's commands for batch jobs: a script, sbatch, the queue, scancel (no pilab imports)
    "engine.eager": 0,  # torch.optim's methods without the torch._dynamo guards (every pilab optimizer's)
    "engine.muon": 0.02,  # Muon: orthogonalised momentum for the convolutions (torch, engine.eager)
    "engine.optim": 0.05, "engine.buckets": 0, "models.names": 0,
    "engine.component": 0,  # what a loop feature is: the moments the loop calls (no imports)
    "engine.noise": 0.2,  # the gradient noise scale, the batch it chooses, and the ramp as a loop feature
    "engine.signals": 0,  # installing signal handlers and putting the old ones back; no pilab imports
    "tracefile": 0.1,  # the Chrome Trace Event Format: build, write, read, check (files only)
    "verdict": 0,  # the one logic that judges a study's rows; no pilab imports (a leaf: plots and study use it)
    "plots": 0.5,  # draws what pilab.verdict judged
    "models.custom": 0.9,  # your own model's builder, found by its string (torch only)
    "models.counts": 0.92,  # parameters, MACs, FLOPs of one image (torch only)
    "models.mobilenet": 0.95, "models.squeezenet": 0.95, "models.spiking": 0.97,  # the registered networks (spiking uses mobilenet's channel rounding)
    "models.residual": 0.96,  # residual blocks started as the identity (torch only)
    "models.dirac": 0.96, "models.bnscale": 0.96,  # convolutions started as the identity; BatchNorm scales fixed at 1 (torch only)
    "models.zoo": 1, "config": 1, "testbed": 1,
    "models.memprobe": 1.4,  # your own model's training step measured in a child process (torch, engine.optim)
    "models.memory": 1.5,  # predicted memory per rank: config and the models only (the doctor and train use it)
    "engine.watchdog": 2, "engine.stragglers": 2,
    "engine.trace": 2.5,  # a per-rank trace of a real run (a loop feature): its timeline, clocks, trace.json
    "engine.comm": 1.8, "engine.gradsync": 1.9,  # MPI primitives and shared exact arithmetic; GradSync
    "engine.dist": 2, "data": 2, "engine.checkpoint": 2,
    "engine.syncbn": 2.9,  # SyncBatchNorm over MPI ranks (CPU)
    "engine.tta": 3,  # test-time augmentation: a test image's logits over its views (torch only)
    "engine.layers": 3, "engine.ema": 3.2,  # ema: the weights' moving average (and its loop feature)
    "engine.exactness": 3.2,  # your own model's layers checked for what the simulator cannot make per-rank
    "engine.lookahead": 3,  # the Lookahead optimizer's slow weights: a loop feature (torch and engine.component only)
    "engine.clip": 3,  # the loop feature clipping the averaged gradient's norm
    "engine.modepick": 3,  # the simulator's auto mode timed: a loop feature (torch and engine.component only)
    "engine.compilebn": 3.1,  # the fast simulator's BatchNorm compiled: a loop feature (engine.layers, engine.modepick)
    "engine.features": 3.4,  # the loop's features, each a component in a file of its own
    "engine.backend": 3.3,  # what the loop asks of a rank backend, and the pieces every backend uses
    "engine.records": 3.35,  # what the loop records: an epoch's sums and record, the run's result
    "engine.resume": 3.3, "engine.keeper": 3,  # checkpoints as the loop writes and resumes them; a failed run's result
    "engine.localsgd": 3,  # local SGD: its plan, the MPI ranks' parameter average, the simulator's per-rank weights
    "engine.virtual": 3.45,  # the simulator's rank backend (virtual ranks in one process)
    "engine.ranks": 3.5,  # the rank backends (MPI ranks, the simulator's virtual ranks) the loop drives
    "engine.loop": 4,
    "engine.preflight": 4.5,  # your own model against your data, before any rank starts
    "engine.train": 5, "engine.simulate": 5,
    "engine.harness": 5.2,  # one guarded run on the ranks (vote, signals, abort, watchdog): CLI, engines, the
                            # study's jobs
    "perfmodel": 6, "study.meters": 6.4, "study.energy": 6.5,  # meters: RAPL and power-meter logs (no pilab
    # imports); energy: uses the perfmodel's Pi facts and the meters; the study uses it
    "bench": 6.8,  # benchmarks: the engine, the launcher, the harness's jobs and the performance model they check
    "study": 7,  # the scaling study, its analysis, comparisons, remedies, ablations, the paper, reports
    "lab.cluster": 9,
    "doctor": 9.5,  # preflight: the launcher, the perfmodel's bench, the Pi profile's address
    "lab.widgets": 10,
    "cli": 11,
    "__main__": 12, "__init__": 12,
    # The packages engine/, models/ and lab/ hold modules of several layers; their __init__ imports nothing.
    # A module in them that is not named above takes the package's layer.
    "engine": 4, "models": 1, "lab": 10,
}
# Third-party modules only these parts may import (anywhere in them): ipywidgets is the notebook
# panel's; mpi4py is loaded through pilab.launch.mpi() (importing it initialises MPI, which a process
# that only plots, predicts or launches must not do) and used directly only by the communication layer.
ONLY_IN = {"ipywidgets": {"lab.widgets"}, "mpi4py": {"engine.comm", "launch"}}
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
        if mine not in LAYERS:
            problems.append(f"{me}: not in the layer table of scripts/check_imports.py; add it")
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
            if theirs not in LAYERS:
                problems.append(f"{me}:{line} imports unknown part {target}")
                continue
            graph.setdefault(mine, set()).add(theirs)
            if theirs == "cli" and mine != "__main__":
                problems.append(f"{me}:{line} imports the CLI ({target}); only the CLI itself may")
            elif LAYERS[theirs] >= LAYERS[mine]:
                problems.append(f"{me}:{line} imports {target}: layer {LAYERS[theirs]} from layer "
                                f"{LAYERS[mine]} (imports must point down)")
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stats", action="store_true", help="also lines per module, longest functions")
    args = ap.parse_args()
    problems, graph, local = check()
    for mod in sorted(graph, key=lambda m: LAYERS[m]):
        print(f"{mod:<10} -> {', '.join(sorted(graph[mod], key=lambda m: -LAYERS[m]))}")
    print(f"function-local imports of pilab modules: {local}")
    if args.stats:
        stats()
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    print("ok: imports point down, no circles" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
