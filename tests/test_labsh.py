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
