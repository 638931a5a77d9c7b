"""scripts/arm64_node.sh: only its argument handling (the emulated run itself takes an hour; it is run by
hand and its summary is in docs/arm64.md). Every refusal happens before anything is mounted or written."""
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "arm64_node.sh"


def run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_names_the_options():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--root DIR", "--log FILE", "--only STEPS", "--mirror URL", "--np-sim N", "--host-cpuinfo", "--torch SPEC", "--testbed NAME", "--subnet CIDR"):
        assert opt in r.stdout


@pytest.mark.parametrize("args, says", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--root"], "--root needs a directory"),
    (["--root", "relative/dir"], "--root must be an absolute path"),
    (["--only", "pip,conda"], "unknown step 'conda'"),
    (["--np-sim", "0"], "--np-sim must be a positive whole number"),
    # doctor is in pilab now: the option that ran it from another branch is gone
    (["--doctor-ref", "doctor"], "unknown argument '--doctor-ref'"),
    (["--torch"], "--torch needs a requirement"),
    # it becomes part of a shell command inside the root
    (["--torch", "torch==2.8.0; rm -rf ~"], "is not a requirement like torch==2.8.0"),
    (["--testbed", "plarm"], "--testbed needs --subnet CIDR"),
    (["--subnet", "10.77.0.0/24"], "--subnet and --head-python go with --testbed NAME"),
    (["--testbed", "Bad"], "is not a testbed name"),
    (["--testbed", "plarm", "--subnet", "10.77.0.0/24", "--head-python", "/nonexistent/python"],
     "--head-python /nonexistent/python is not an executable"),
    # A Debian root inside the repository would be thousands of untracked files.
    ([ "--root", str(SCRIPT.parent.parent / "arm64-root")], "is inside the git work tree"),
])
def test_bad_arguments_exit_2_with_one_line(args, says, tmp_path):
    r = run(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert not (SCRIPT.parent.parent / "arm64-root").exists()


# /proc/cpuinfo of a Raspberry Pi 4B under Raspberry Pi OS 64-bit (bookworm): Arm has no "model name".
PI4B_CPUINFO = "".join(
    f"processor\t: {i}\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\n"
    f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n" for i in range(4)
) + "Revision\t: c03114\nSerial\t\t: 100000002a5b3c4d\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n"


def test_bench_names_an_arm_board_and_core():
    from pilab.bench.report import cpu_name
    assert cpu_name(PI4B_CPUINFO, "aarch64") == "Raspberry Pi 4 Model B Rev 1.4 (Cortex-A72)"
    # an Arm server (no board line) and an unknown part
    assert cpu_name(PI4B_CPUINFO.split("Revision")[0], "aarch64") == "Cortex-A72"
    assert cpu_name("processor\t: 0\nCPU part\t: 0xfff\n", "aarch64") == "aarch64"
    # x86 as before
    assert cpu_name("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n", "x86_64") == \
        "Intel(R) Xeon(R) Processor"


def test_result_line_reads_a_real_result_json():
    # The script prints each train's result.json in one line; run 5 printed "threads/rank None machine
    # None" because it read r["environment"] (the file says "env"). Same snippet, a committed result.
    import re
    import sys
    text = SCRIPT.read_text()
    code = re.search(r"^result_py='(.*?)'$", text, re.S | re.M).group(1)
    assert "'" not in code  # it goes into in_pi's command line in single quotes
    result = SCRIPT.parent.parent / "experiments" / "testbed-scale" / "np2" / "result.json"
    r = subprocess.run([sys.executable, "-c", code, str(result)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("result: np 2 steps 32 ")
    assert "machine x86_64 hosts ['node01', 'node01'] threads/rank 1 torch 2.13.0+cpu | MPICH" in r.stdout


def test_mpi_library_drops_the_nul_of_debians_mpi4py():
    # Debian bookworm's python3-mpi4py 3.1.4 (Open MPI 4.1.4) on the emulated Pi: the version string
    # ends with a NUL byte, which reached result.json and the doctor's table.
    from types import SimpleNamespace

    from pilab.launch import mpi_library
    debian = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022\x00"
    assert mpi_library(SimpleNamespace(Get_library_version=lambda: debian)) == debian[:-1]
    mpich = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\n"
    assert mpi_library(SimpleNamespace(Get_library_version=lambda: mpich)) == "MPICH Version:      5.0.2"
    assert mpi_library(SimpleNamespace(Get_library_version=lambda: "\x00")) == ""


def test_a_root_location_another_account_could_change_is_refused(tmp_path):
    # Root chroots into the arm64 root and mounts inside it: a location another account owns, or a
    # directory above it that others can write (without the sticky bit), is refused in one line before
    # anything is made. (/var/tmp, /tmp: sticky, so only a tree of root's own below them passes.)
    import os
    if os.geteuid() != 0:
        pytest.skip("the location checks run as root (the script refuses any other user first)")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody's
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # writable by all, no sticky bit
    tmp_path.chmod(0o755)
    for root, says in ((theirs / "root", f"{theirs} belongs to nobody, not root"),
                       (theirs / "x" / "root", f"{theirs} belongs to nobody, not root"),
                       (open_dir / "x" / "root", f"{open_dir} is writable by others (mode 777)"),
                       (tmp_path / "a b" / "root", "use letters, digits and ./_- only")):
        r = run("--root", str(root))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
        assert not (theirs / "x").exists() and not (open_dir / "x").exists()
