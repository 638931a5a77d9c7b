"""What the doctor's parts share: its error, the probe's output markers, the checks and their limits."""
from __future__ import annotations


MARK = "PILAB-DOCTOR"  # the probe's result lines on the job's stdout start with this


HELLO = MARK + "-HELLO"  # its first line, printed before any import: the host answered


CHECKS = ("answers", "software", "mpi", "allreduce", "link", "iface", "data", "memory", "cpu", "speed",
          "clock", "controller", "placement")


CLOCK_LIMIT_S = 0.5  # event timestamps of different hosts are compared; NTP keeps boards within ms


HOT_C = 80.0  # the Pi 4B's firmware starts throttling at 80-85 °C


DETAILS = ("answers", "iface", "link", "memory", "cpu", "speed", "clock")  # the figures printed per host


SLOW_HOST = 0.85  # a host under 85% of the fastest host's training speed: every step waits for it


SLOW_LINK = 0.5  # a link under half the median host's bandwidth (a 100 Mbit/s port, a bad cable)


class DoctorError(ValueError):
    """Bad input to the doctor (no hosts, a data path missing on the head…); the message names the fix."""
