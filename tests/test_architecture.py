"""The package's shape (docs/architecture.md): imports point down, one training loop."""
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_imports_point_down_and_nothing_below_the_cli_imports_it():
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "check_imports.py")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ok: imports point down, no circles" in p.stdout


def _check_fake(tmp_path, monkeypatch, files: dict[str, str]) -> list[str]:
    """Run the checker on a fake package made of ``files`` (path under pilab/ -> source)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import check_imports
    finally:
        sys.path.pop(0)
    fake = tmp_path / "pilab"
    for rel, text in {"__init__.py": "", **files}.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    monkeypatch.setattr(check_imports, "ROOT", fake)
    return check_imports.check()[0]


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    # The check must be able to fail: a library module importing the CLI is reported.
    problems = _check_fake(tmp_path, monkeypatch, {"engine.py": "from .cli import main\n",
                                                   "cli.py": "from . import engine\n"})
    assert any("imports the CLI" in p for p in problems), problems
    assert any("import circle" in p for p in problems), problems


def test_the_checker_catches_a_circle_inside_one_part(tmp_path, monkeypatch):
    # Two modules of one part (one layer) importing each other, one of them inside a function: the
    # part-level graph cannot see it, the module-level one does.
    problems = _check_fake(tmp_path, monkeypatch, {
        "lab/cluster/__init__.py": "",
        "lab/cluster/client.py": "def stop():\n    from . import profiles\n",
        "lab/cluster/profiles.py": "from .client import stop\n"})
    assert any("circle between modules" in p and "pilab.lab.cluster.client" in p for p in problems), problems


def test_the_checker_fences_mpi4py_and_bokeh(tmp_path, monkeypatch):
    # mpi4py only through pilab.launch.mpi() (or in dist/); Bokeh at module level only in the view and
    # the study's report: inside a function elsewhere is fine.
    problems = _check_fake(tmp_path, monkeypatch, {
        "engine.py": "import bokeh.plotting\nfrom mpi4py import MPI\n",
        "study/energy.py": "def draw():\n    import bokeh.plotting\n",
        "study/report.py": "import bokeh.plotting\n",
        "dist/comm.py": "from mpi4py import MPI\n"})
    assert any(p.startswith("pilab.engine:2 imports mpi4py") for p in problems), problems
    assert any(p.startswith("pilab.engine:1 imports bokeh at module level") for p in problems), problems
    assert not any(p.startswith(("pilab.study.energy", "pilab.study.report", "pilab.dist.comm"))
                   for p in problems), problems


# Files other than the engine that may call backward(), each with its reason: the contenders the
# benchmarks measure pilab against (a bare PyTorch loop, DDP, bare mpi4py), which are not a way to train.
BACKWARD_ALLOWED = {
    "pilab/bench/local.py": "bare-loop and model-only contenders of the one-rank benchmarks",
    "pilab/bench/mpijobs.py": "DDP-gloo and bare-mpi4py contenders of the rank benchmarks; per-tensor and fused "
                              "blocking-Allreduce contenders of the sync section",
    "pilab/perfmodel/check.py": "compute-only step timing that the performance model is checked against",
    "pilab/bench/wire.py": "the no-exchange ceiling and DDP-gloo contenders of one step on the wire (issue 23)",
    "pilab/engine/memory.py": "a few steps of your own model in a child process, its memory measured (issue 37)",
    "pilab/doctor/probe.py": "a few steps of the run's model on each host, timed: the doctor's speed check",
    "scripts/grouped_bn_forms.py": "one BatchNorm layer's forms timed alone, no training (issue 42)",
    "pilab/engine/compilebn.py": "its probe: one small BatchNorm layer compiled forward and backward, no training",
}


def test_one_training_loop():
    # Every backward pass of training runs in the engine; train and simulate only choose a backend. The
    # package, scripts/ and benchmarks/ are all read: a named file outside the engine is allowed only
    # with its reason above (tests/ may call backward to check layers against plain PyTorch).
    callers = set()
    for folder in ("pilab", "scripts", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "backward":
                    callers.add(path.relative_to(REPO).as_posix())
    # the engine's rank backends (their steps: MPI ranks, the simulator's virtual ranks), and GradSync.backward
    # (the loss scaled to this rank's share of the mean)
    assert callers - set(BACKWARD_ALLOWED) == {"pilab/engine/mpi.py", "pilab/engine/virtual.py",
                                               "pilab/dist/gradsync.py"}, callers
    assert set(BACKWARD_ALLOWED) <= callers, "an allowed file no longer calls backward: drop it from the list"


def test_the_library_never_launches_its_own_cli():
    # Library code starts ranks through launch.run_job over a rank-side entry module; only the CLI
    # may start `python -m pilab ...` (train --np re-launching itself under mpiexec).
    callers = set()
    for path in sorted((REPO / "pilab").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and "pilab_command" in (getattr(node.func, "attr", None),
                                                                   getattr(node.func, "id", None)):
                callers.add(rel)
    assert {c for c in callers if not c.startswith("pilab/cli/")} == set(), callers


HEAVY = ("torch", "bokeh", "numpy", "mpi4py")


def test_help_and_a_bad_argument_load_no_heavy_library():
    # `python -m pilab --help` and a one-line usage error must not wait for torch (~2.5 s here),
    # Bokeh or MPI: the parser is built from torch-free modules, errors are looked up, not imported.
    probe = ("import sys, contextlib, io\n"
             "from pilab.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:\n"
             "    for argv in (['--help'], ['train', '--help'], ['scale', '--help'], ['train', '--width', '7'],\n"
             "                 ['simulate', '--model', 'nope']):\n"
             "        try:\n"
             "            code = main(argv)\n"
             "        except SystemExit as e:\n"
             "            code = e.code\n"
             "        assert code in (0, 2), (argv, code)\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
             "print(err.getvalue().count('pilab: error:'))\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    loaded, errors = p.stdout.split("\n")[:2]
    assert loaded == "[]", f"--help / a usage error imported {loaded}"
    assert errors == "2", p.stdout  # both bad arguments got their one-line error


def test_both_rank_backends_implement_the_declared_protocol():
    # MPIRanks and VirtualRanks against pilab.engine.backend.RankBackend: every method, with the
    # protocol's parameters in its order (a backend may add keyword-only ones of its own)
    import inspect

    from pilab.engine.backend import RankBackend
    from pilab.engine import MPIRanks, VirtualRanks
    methods = [n for n, v in vars(RankBackend).items() if callable(v) and not n.startswith("_")]
    assert len(methods) >= 10, methods
    for backend in (MPIRanks(None), VirtualRanks(2)):
        assert isinstance(backend, RankBackend), type(backend)
        for name in methods:
            want = list(inspect.signature(getattr(RankBackend, name)).parameters)[1:]
            have = list(inspect.signature(getattr(backend, name)).parameters)
            assert have[:len(want)] == want, (type(backend).__name__, name, have, want)


def test_the_loop_names_no_feature_and_stays_short():
    # Features are components (pilab.engine.features); the loop and its Session call their moments only
    import ast

    from pilab.engine import features
    src = (REPO / "pilab" / "engine" / "loop.py").read_text()
    tree = ast.parse(src)
    # the code, not its prose: every name and attribute the loop uses, and every module it imports
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    for f in features.FEATURES:
        module = f.__module__.rpartition(".")[2]
        assert not {f.__name__, module, f.name} & used, (f.__name__, {f.__name__, module, f.name} & used)
    assert "ema_epochs" not in used and "straggler_threshold" not in used
    sizes = {f"{getattr(p, 'name', '')}.{n.name}": n.end_lineno - n.lineno + 1
             for p in ast.walk(tree) if isinstance(getattr(p, "body", None), list) for n in p.body
             if isinstance(n, ast.FunctionDef)}
    assert sizes[".fit"] <= 70 and sizes["Session.__init__"] <= 35, sizes
    assert all(v <= 60 for k, v in sizes.items() if k != ".fit"), sizes


def test_local_sgd_schedule_is_its_components_alone():
    # When a step is local and when the ranks average is LocalSGD's to say (before_step sets session.phase);
    # the backends, the loop and the EMA follow the Phase they are given and never read the schedule
    from pilab.config import Config
    from pilab.engine import features
    from pilab.engine.localsgd import LocalSGD
    from pilab.engine import VirtualRanks
    for name in ("mpi.py", "virtual.py", "loop.py", "ema.py"):
        tree = ast.parse((REPO / "pilab" / "engine" / name).read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "phase"
                 and isinstance(n.value, ast.Name) and n.value.id == "localsgd"]
        assert not reads, (name, reads)
    assert [type(c) for c in features.chosen(Config(local_steps=4), VirtualRanks(2))
            if isinstance(c, LocalSGD)] == [LocalSGD]
    assert not any(isinstance(c, LocalSGD) for c in features.chosen(Config(), VirtualRanks(2)))


FLAT_API = ["Component", "Config", "ConfigError", "GradSync", "Stage", "compare", "remedies", "scale", "simulate",
            "train"]


def test_the_flat_api_is_the_documented_surface_and_import_pilab_loads_nothing_heavy():
    # pilab.__all__ is what a user imports (README, docs/api.md); each name resolves to the library's own
    # function or class, and `import pilab` (and reading pilab.Config) loads no torch, Bokeh, numpy or MPI
    import pilab
    assert pilab.__all__ == FLAT_API
    from pilab.study import compare, remedies, scaling
    assert (pilab.scale, pilab.remedies, pilab.compare) == (scaling.study, remedies.search, compare.compare)
    probe = ("import sys, pilab\n"
             "pilab.Config(); pilab.Component; pilab.Stage\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_the_backends_name_no_feature_and_a_step_result_is_the_loops_own():
    # trace, the noise-driven ramp and local SGD reach the step through the components' in-step moments
    # (pilab.component.RankStep): neither GradSync nor a backend's step reads their settings or names them
    import dataclasses

    from pilab.engine import StepResult
    assert len(dataclasses.fields(StepResult)) <= 11
    for path in ("pilab/dist/gradsync.py", "pilab/engine/mpi.py", "pilab/engine/virtual.py"):
        tree = ast.parse((REPO / path).read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
            {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not used & {"trace", "gns_max", "batch_ramp", "local_steps", "norms", "Timeline", "localsgd",
                           "noise", "straggler_threshold"}, (path, used & {"trace", "gns_max", "local_steps"})


def test_a_codec_is_named_only_where_it_is_defined():
    # How gradients travel is a pilab.dist.codec.Codec: GradSync sends through it, the memory check, the
    # simulator's refusal and the performance model read its attributes, so a new codec is a class in
    # codec.py and a choice of Config.compression (two files of pilab/) -- none of them names one
    import pytest

    from pilab.config import CHOICES, ConfigError
    from pilab.dist import CODECS, codec_for
    paths = ("pilab/dist/gradsync.py", "pilab/engine/mpi.py", "pilab/engine/virtual.py", "pilab/engine/memory.py",
             "pilab/perfmodel/predict.py")
    for path in paths:
        tree = ast.parse((REPO / path).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
            {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not strings & set(CODECS) - {"none"} and not names & {"fp16", "float16", "half_type"}, path
    assert CHOICES["compression"] == tuple(CODECS)
    with pytest.raises(ConfigError, match="use one of: none, fp16"):
        codec_for("int8")


def test_every_face_gives_what_its_modules_define_whatever_was_imported_first():
    # A package's face (its __init__) names what the package offers; importing one of its modules must not
    # shadow a name of the face (Python sets pilab.perfmodel.predict to the module on its first import:
    # where a name is also a module's, the face is eager, as perfmodel's is)
    import importlib
    import pkgutil
    from types import ModuleType
    for init in sorted((REPO / "pilab").rglob("__init__.py")):
        package = ".".join(init.relative_to(REPO).parent.parts)
        face = importlib.import_module(package)
        for sub in pkgutil.iter_modules([str(init.parent)]):
            if not sub.ispkg and sub.name != "__main__":
                importlib.import_module(f"{package}.{sub.name}")
        shadowed = [n for n in getattr(face, "__all__", ())
                    if isinstance(getattr(face, n), ModuleType) and getattr(face, n).__name__ == f"{package}.{n}"]
        assert not shadowed, (package, shadowed)


def test_a_module_run_with_dash_m_defines_everything_before_its_main_guard():
    """``python -m pilab.engine.harness`` runs the module top to bottom: a function defined after the
    ``if __name__ == "__main__"`` block does not exist yet when ``main()`` runs (a merge once left half of
    harness.py below it, and every MPI study run failed with a NameError)."""
    late = []
    for path in sorted((REPO / "pilab").rglob("*.py")):
        body = ast.parse(path.read_text()).body
        guards = [i for i, n in enumerate(body) if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if guards and guards[-1] != len(body) - 1:
            late.append(str(path.relative_to(REPO)))
    assert not late, late
