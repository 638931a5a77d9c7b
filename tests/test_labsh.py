"""lab.sh's refusals that need no install: each says what is wrong and how to fix it, installs nothing."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_system_mpi_refuses_a_venv_that_cannot_see_the_system_mpi4py(tmp_path):
    # A venv made without --system-site-packages would get pip's mpi4py wheel instead of the system's.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = subprocess.run(["bash", str(ROOT / "lab.sh"), "setup"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PILAB_SYSTEM_MPI": "1", "PILAB_VENV": str(venv)})
    assert r.returncode == 1
    assert "PILAB_SYSTEM_MPI=1 needs a venv that sees the system's mpi4py" in r.stderr
    assert f"rm -rf {venv}" in r.stderr
    assert not (venv / ".pilab-stamp").exists()
    assert not list(venv.glob("lib/python*/site-packages/*torch*"))


def test_lab_sh_refuses_an_older_python(tmp_path):
    """A python3 under the floor: one line naming it and PILAB_PYTHON, exit 1, no venv made."""
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\ncase \"$1\" in -V) echo 'Python 3.10.12';; *) exit 1;; esac\n")
    old.chmod(0o755)
    venv = tmp_path / "venv"
    r = subprocess.run(["bash", str(ROOT / "lab.sh"), "setup"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PILAB_PYTHON": str(old), "PILAB_VENV": str(venv)})
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs Python 3.11+" in lines[0] and "Python 3.10.12" in lines[0] \
        and "PILAB_PYTHON" in lines[0], lines
    assert not venv.exists()
