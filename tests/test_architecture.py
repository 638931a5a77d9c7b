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


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    # The check must be able to fail: a library module importing the CLI is reported.
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import check_imports
    finally:
        sys.path.pop(0)
    fake = tmp_path / "pilab"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "engine.py").write_text("from .cli import main\n")
    (fake / "cli.py").write_text("from . import engine\n")
    monkeypatch.setattr(check_imports, "ROOT", fake)
    problems, _, _ = check_imports.check()
    assert any("imports the CLI" in p for p in problems), problems
    assert any("import circle" in p for p in problems), problems


def test_one_training_loop():
    # Every backward pass of training runs in the engine; train and simulate only choose a backend.
    callers = []
    for path in sorted((REPO / "pilab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "backward":
                callers.append(path.relative_to(REPO).as_posix())
    # pilab/bench/ holds the contenders the benchmarks measure pilab against (a bare PyTorch loop, DDP);
    # they are not a way to train.
    assert {c for c in callers if not c.startswith("pilab/bench/")} == {"pilab/engine.py"}, callers


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
