#!/usr/bin/env bash
# pilab set-up and entry points. Each command below does the whole set-up first (idempotent):
#
#   ./lab.sh demo    # strong-scaling demo on the embedded CIFAR-10 subset -> runs/demo/report.html
#   ./lab.sh test    # the whole test suite (what .ci/run runs)
#   ./lab.sh docs    # the manual (Sphinx + MyST-NB, warnings as errors) -> docs/_build/html/index.html
#   ./lab.sh notebooks [NAME.ipynb ...]  # run the notebooks in small mode and keep their outputs in them
#   ./lab.sh setup   # only the set-up
#
# Environment knobs:
#   PILAB_VENV=path       where the virtual environment lives (default: .venv beside this file)
#   PILAB_PYTHON=python   the Python 3.11+ that makes it (default: python3)
#   PILAB_SYSTEM_MPI=1    use the system's mpi4py and its MPI instead of pip's MPICH (on Debian and
#                         Raspberry Pi OS python3-mpi4py is built against Open MPI: one node only, see docs)
#   PILAB_TORCH=spec      torch requirement (default: torch==2.13.0, CPU build)
set -euo pipefail
cd "$(dirname "$0")"
here=$(pwd)
venv=${PILAB_VENV:-$here/.venv}
py=$venv/bin/python
torch_spec=${PILAB_TORCH:-torch==2.13.0}
python=${PILAB_PYTHON:-python3}

say() { printf '[pilab] %s\n' "$*" >&2; }

setup() {
    sysmpi=${PILAB_SYSTEM_MPI:-0}
    if [ ! -x "$py" ]; then
        command -v "$python" >/dev/null || { say "$python not found; install Python 3.11+ (e.g. apt-get install python3-venv) or set PILAB_PYTHON"; exit 1; }
        # pilab's floor (pyproject.toml's requires-python; tests/test_packaging.py checks the code against it)
        "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
            say "pilab needs Python 3.11+, and $python is $("$python" -V 2>&1); point PILAB_PYTHON at a newer one (e.g. PILAB_PYTHON=python3.12)"; exit 1; }
        say "creating virtual environment $venv"
        # The system MPI's mpi4py is a system package (Debian's python3-mpi4py, built against that MPI):
        # the venv must see it, or pip installs its own mpi4py wheel, which may load another MPI library.
        venv_opts=()
        [ "$sysmpi" = 1 ] && venv_opts=(--system-site-packages)
        "$python" -m venv ${venv_opts[@]+"${venv_opts[@]}"} "$venv" || { say "$python -m venv failed; on Debian install python3-venv"; exit 1; }
    fi
    if [ "$sysmpi" = 1 ] && ! grep -Eqi '^include-system-site-packages *= *true' "$venv/pyvenv.cfg"; then
        say "PILAB_SYSTEM_MPI=1 needs a venv that sees the system's mpi4py, but $venv was made without it; remove it (rm -rf $venv) and rerun"
        exit 1
    fi
    extras=test,docs,snn
    [ "$sysmpi" = 1 ] || extras=test,docs,mpich,snn
    # Re-install only when what we install changed.
    want=$(cat pyproject.toml lab.sh | sha256sum | cut -c1-16)-$extras-$torch_spec
    stamp=$venv/.pilab-stamp
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        jupyter_config
        return 0
    fi
    say "installing the stack into $venv (torch CPU, MPI, Jupyter, Bokeh, test tools)"
    "$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # Plain PyPI torch on Linux is a multi-GB CUDA build, on x86-64 and (since torch 2.9) on aarch64
    # too: torch 2.13.0 for a Pi pulls cuDNN, cuBLAS, NCCL... (seen in scripts/arm64_node.sh's run).
    # Take PyTorch's CPU-only index where it answers; elsewhere (offline mirrors, local wheels) use
    # pip's configured sources as they are. On aarch64 the CPU index is the only one asked: its wheels
    # carry no "+cpu" tag, so next to PyPI the CUDA build of the same version could win.
    torch_index=()
    cpu_index=https://download.pytorch.org/whl/cpu
    case "$(uname -s)/$(uname -m)" in
        Linux/x86_64|Linux/aarch64)
            if "$py" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" >/dev/null 2>&1; then
                torch_index=(--extra-index-url "$cpu_index")
                [ "$(uname -m)" = x86_64 ] || torch_index=(--index-url "$cpu_index")
            else
                say "PyTorch's CPU-only index ($cpu_index) did not answer; torch comes from pip's configured sources (where that is PyPI, Linux gets a CUDA build: GBs of unused libraries, on a Pi too)"
            fi ;;
    esac
    "$py" -m pip install -q ${torch_index[@]+"${torch_index[@]}"} "$torch_spec"
    "$py" -m pip install -q -e ".[$extras]"
    [ "$sysmpi" = 1 ] && check_system_mpi
    jupyter_config
    echo "$want" >"$stamp"
}

jupyter_config() {
    # JupyterLab (4.4+) opens a kernel subshell for widget comms on the control channel, and the kernel's
    # busy/idle status for that request is taken for the kernel's own: a long cell right after a widget
    # cell showed "Idle" while it ran. jupyter-config/ lists those requests as untracked (merged into the
    # venv's jupyter_server_config.json, which every `jupyter lab` from this venv reads).
    "$py" - <<'PY'
import json, os, sys
d = os.path.join(sys.prefix, "etc", "jupyter")
os.makedirs(d, exist_ok=True)
path = os.path.join(d, "jupyter_server_config.json")
cfg = json.load(open(path)) if os.path.exists(path) else {}
for cls, values in json.load(open("jupyter-config/jupyter_server_config.json")).items():
    cfg.setdefault(cls, {}).update(values)
with open(path, "w") as f:
    json.dump(cfg, f, indent=1)
PY
}

check_system_mpi() {
    # mpi4py built against one MPI and started by another's mpiexec runs every rank as "0 of 1". With
    # Debian's packages that is easy: python3-mpi4py is built against Open MPI, while `apt-get install
    # mpich` adds MPICH's mpiexec beside it and update-alternatives picks one. Two ranks must see 2.
    local mpiexec lib out
    mpiexec=$(PATH="$venv/bin:$PATH" command -v mpiexec || true)
    # (without the NUL byte Debian's mpi4py 3.1.4 ends Open MPI's version string with; see pilab.launch)
    lib=$("$py" -c 'from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), "").strip().splitlines()[0])' 2>&1) || {
        say "PILAB_SYSTEM_MPI=1 but mpi4py does not load: $lib; install it with: apt-get install python3-mpi4py"; exit 1; }
    [ -n "$mpiexec" ] || { say "PILAB_SYSTEM_MPI=1 but no mpiexec on PATH (mpi4py uses $lib); install that MPI's launcher (apt-get install openmpi-bin for Debian's python3-mpi4py)"; exit 1; }
    out=$(timeout 300 "$mpiexec" -n 2 "$py" -c 'from mpi4py import MPI; print("size", MPI.COMM_WORLD.Get_size())' 2>&1 || true)
    if [ "$(printf '%s\n' "$out" | grep -c '^size 2$')" != 2 ]; then
        say "the system MPI does not start mpi4py's ranks: $(readlink -f "$mpiexec") -n 2 gave '$(printf '%s' "$out" | head -2 | tr '\n' ' ')'"
        say "mpi4py is built against: $lib; use that MPI's mpiexec (e.g. update-alternatives --config mpirun) or PILAB_MPIEXEC=path, or rebuild mpi4py against the other (pip install --no-binary mpi4py mpi4py)"
        exit 1
    fi
    say "system MPI: $(readlink -f "$mpiexec") starts mpi4py's ranks ($lib)"
}


browser() {
    # The browser test drives Debian's Chromium (never a downloaded browser). Install it where we can.
    if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing Debian's chromium for the browser test"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
            || say "could not install chromium; the browser test will say so"
    fi
}

slurm() {
    # The Slurm tests (tests/test_slurm.py) run Debian's munge, slurmctld and slurmd on the testbed.
    if ! command -v slurmd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing Debian's slurmctld, slurmd and munge for the Slurm tests"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd munge \
            slurm-client >/dev/null) || say "could not install Slurm; the Slurm tests will say so"
    fi
}

sudo_for_tests() {
    # The unprivileged testbed test (tests/test_testbed.py) has a user start jobs through the testbed's
    # sudo rule for its shim, as `sudo pilab testbed up` sets it up for the user who ran it.
    if ! command -v sudo >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing Debian's sudo for the unprivileged testbed test"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sudo >/dev/null) \
            || say "could not install sudo; the unprivileged testbed test will say so"
    fi
}

case "${1:-}" in
    setup)
        setup
        ;;
    demo)
        setup
        shift
        export PATH="$venv/bin:$PATH"
        exec "$py" -m pilab scale --out runs/demo "$@"
        ;;
    test)
        setup
        browser
        slurm
        sudo_for_tests
        shift
        export PATH="$venv/bin:$PATH"
        export PILAB_NB_SMALL=1   # the notebooks' small mode (one core, as on Binder)
        # One pytest run: unit tests in-process, MPI tests spawn real mpiexec ranks, every notebook runs once
        # under nbval against its committed outputs (tests/test_notebooks.py), the manual is built with -W
        # (tests/test_docs.py), and the browser test drives only what needs a browser (tests/test_browser.py);
        # --durations lists the 15 slowest tests, so a suite drifting past ~15 minutes shows its cause.
        exec "$py" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
        ;;
    docs)
        setup
        export PATH="$venv/bin:$PATH"
        # -W: a broken reference, a missing page or a stale API name is an error, as in the suite
        "$py" -m sphinx -q -W --keep-going -b html docs docs/_build/html
        say "the manual: $here/docs/_build/html/index.html (works from file://, offline)"
        ;;
    notebooks)
        setup
        shift
        export PATH="$venv/bin:$PATH"
        exec "$py" scripts/notebooks.py "$@"
        ;;
    *)
        echo "usage: ./lab.sh demo | test | docs | notebooks | setup" >&2
        exit 2
        ;;
esac
