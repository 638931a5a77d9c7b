"""The machine a benchmark ran on, for its table's header: the processor's name (x86's model name, or an Arm
board and its core type) and the load::

    from pilab.bench.machine import cpu_name, machine
    machine()["cpu"]     # 'Raspberry Pi 4 Model B Rev 1.4 (Cortex-A72)'
"""
from __future__ import annotations

import datetime
import os
import platform


# Arm's part numbers (/proc/cpuinfo "CPU part") of the cores in Raspberry Pi boards and their kin.
ARM_PARTS = {"0xd03": "Cortex-A53", "0xd04": "Cortex-A35", "0xd05": "Cortex-A55", "0xd08": "Cortex-A72",
             "0xd0b": "Cortex-A76", "0xd0c": "Neoverse-N1"}


def cpu_name(cpuinfo: str, fallback: str = "") -> str:
    """The processor's name from the text of /proc/cpuinfo: x86's "model name"; on Arm, which has
    none, the board ("Model", e.g. a Raspberry Pi) and the core type from its "CPU part"::

        cpu_name(open("/proc/cpuinfo").read(), platform.machine())   # 'Raspberry Pi 4 Model B Rev 1.4 (Cortex-A72)'
    """
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    if fields.get("model name"):
        return fields["model name"]
    core = ARM_PARTS.get(fields.get("cpu part", "").lower(), "")
    board = fields.get("model", "")
    if board and core:
        return f"{board} ({core})"
    return board or core or fallback


def machine() -> dict:
    """Facts about this machine and its load, for the table's header."""
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_name(f.read(), cpu)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cores": cores, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "loadavg_start": list(os.getloadavg())}
