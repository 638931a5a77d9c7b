"""The ways pilab gets installed agree: pyproject.toml, binder/requirements.txt (Binder, pip) and
environment.yml (conda) name the same packages with the same pins, and Binder's install path works.

The slow test repeats what Binder does (pip install -r binder/requirements.txt, then binder/postBuild) in
a clean venv, then starts two MPI engines under binder/start. It takes about 2 minutes, so it runs in CI
(CI=true) or with PILAB_SLOW=1, and is skipped otherwise.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# conda-forge names that differ from the PyPI distribution names.
CONDA_TO_PYPI = {"pytorch": "torch"}


def _norm(name: str) -> str:
    name = re.sub(r"[-_.]+", "-", name).lower()
    return CONDA_TO_PYPI.get(name, name)


def _parse(lines) -> dict[str, str]:
    """{normalised name: specifier} from requirement strings (pip options and comments dropped)."""
    from packaging.requirements import Requirement

    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        # conda uses "name=1.2" for an exact pin where pip writes "name==1.2"
        line = re.sub(r"(?<![=<>!~])=(?!=)", "==", line)
        req = Requirement(line)
        out[_norm(req.name)] = str(req.specifier)
    return out


def _project() -> dict:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _pyproject() -> dict[str, str]:
    project = _project()
    extras = project["optional-dependencies"]
    return _parse(project["dependencies"] + extras["mpich"] + extras["snn"])


def test_binder_requirements_match_pyproject():
    with open(os.path.join(REPO, "binder", "requirements.txt")) as f:
        lines = f.read().splitlines()
    assert _parse(lines) == _pyproject()
    # CPU-only torch wheels for Binder's x86-64 nodes.
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines


def test_conda_environment_matches_pyproject():
    import yaml

    with open(os.path.join(REPO, "environment.yml")) as f:
        env = yaml.safe_load(f)
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    names = _parse(c for c in conda if _norm(re.split(r"[<>=!~ ]", c)[0]) not in ("python", "pip"))
    names.update(_parse(p for p in pip if p != "-e ."))  # what conda-forge lacks, from PyPI
    assert names == _pyproject()
    assert "-e ." in pip  # pilab itself, editable so the notebooks find profiles/


def test_binder_scripts_are_executable_and_start_passes_the_command_on():
    for name in ("postBuild", "start"):
        path = os.path.join(REPO, "binder", name)
        assert os.access(path, os.X_OK), f"binder/{name} must be executable"
    with open(os.path.join(REPO, "binder", "start")) as f:
        assert f.read().rstrip().endswith('exec "$@"')


# ---- the Python floor ---------------------------------------------------------------------------------
def _floor() -> tuple[int, int]:
    m = re.fullmatch(r">=(\d+)\.(\d+)", _project()["requires-python"])
    assert m, _project()["requires-python"]
    return int(m[1]), int(m[2])


def _vermin(target: str, *paths) -> subprocess.CompletedProcess:
    """vermin (PyPI; the test extra) run over ``paths``: which Python the code needs, from its syntax and
    the standard library's functions, modules and keyword arguments it uses (statically: only one Python
    runs here)."""
    try:
        import vermin  # noqa: F401
    except ImportError:
        from conftest import skip_or_fail
        skip_or_fail("vermin is not installed; install the test extra: pip install -e '.[test]'",
                     "the Python floor must be checked")
    return subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())",
                           "--no-tips", "--violations", "--eval-annotations", f"-t={target}", *paths],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_code_runs_on_the_python_floor(tmp_path):
    """Nothing in pilab, its scripts, tests or docs needs a newer Python than pyproject's requires-python
    (3.11: subprocess.Popen(process_group=) in cli/train.py, tomllib here); and the check catches what
    would: a file using a 3.12 function is refused at that floor."""
    major, minor = _floor()
    floor = f"{major}.{minor}-"
    r = _vermin(floor, "pilab", "scripts", "tests", "docs/conf.py", "docs/_ext", "experiments", "notebooks")
    assert r.returncode == 0, f"code that needs more than Python {major}.{minor}:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"
    planted = tmp_path / "newer.py"
    planted.write_text("import itertools\nprint(list(itertools.batched(range(4), 2)))\n")
    r = _vermin(floor, str(planted))
    assert r.returncode != 0 and "itertools.batched" in r.stdout, r.stdout


def test_every_install_path_states_the_same_floor():
    major, minor = _floor()
    v = f"{major}.{minor}"
    with open(os.path.join(REPO, "environment.yml")) as f:
        assert f"  - python>={v}\n" in f.read()
    with open(os.path.join(REPO, "binder", "runtime.txt")) as f:
        assert f.read().strip() == f"python-{v}"  # repo2docker's Python
    with open(os.path.join(REPO, "lab.sh")) as f:
        assert f"sys.version_info < ({major}, {minor})" in f.read()
    for page in ("README.md", os.path.join("docs", "getting-started.md")):
        with open(os.path.join(REPO, page)) as f:
            text = f.read()
        said = set(re.findall(r"Python (3\.\d+)\+", text))
        assert said == {v}, (page, said)


@pytest.mark.slow
@pytest.mark.mpi  # postBuild runs mpiexec -n 2, then two MPI engines start
@pytest.mark.timeout(900)
def test_binder_install_path_in_a_clean_venv(tmp_path):
    """pip install -r binder/requirements.txt + binder/postBuild in a fresh venv, then 2 MPI engines."""
    if os.environ.get("CI") != "true" and os.environ.get("PILAB_SLOW") != "1":
        pytest.skip("installs the Binder stack into a clean venv (~2 min): runs under CI=true or PILAB_SLOW=1")
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bindir = venv / "bin"
    py = str(bindir / "python")
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
               VIRTUAL_ENV=str(venv), PILAB_CACHE=str(tmp_path / "cache"))
    # Offline, PyTorch's index fails to resolve: no retries, so pip moves on at once (it only warns).
    env.setdefault("PIP_RETRIES", "0")
    env.pop("PYTHONPATH", None)
    env.pop("PILAB_MPIEXEC", None)
    # Pin torch to the build this machine already has (as ./lab.sh pins it): what is checked is the
    # rest of Binder's path, not a multi-GB download. PyTorch's CPU index is unreachable offline:
    # pip must only warn about it.
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    t = time.monotonic()
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "-r", "binder/requirements.txt",
                          "-c", str(constraints)], cwd=REPO, env=env, capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    post = subprocess.run(["bash", "binder/postBuild"], cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert post.returncode == 0, post.stdout[-3000:] + post.stderr[-3000:]
    assert "CIFAR10(" in post.stdout
    install_s = time.monotonic() - t
    # What a Binder kernel does first: start 2 MPI engines from the installed stack, under start.
    check = ("import os\n"
             "from pilab.lab import cluster\n"
             "assert os.environ['PILAB_NB_SMALL'] == '1'\n"
             "lab = cluster.start(n=2)\n"
             "print('ranks', [r['rank'] for r in lab.ranks])\n"
             "lab.stop()\n")
    run = subprocess.run(["binder/start", py, "-c", check], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ranks [0, 1]" in run.stdout
    print(f"binder install {install_s:.0f} s, engines {time.monotonic() - t - install_s:.0f} s")
