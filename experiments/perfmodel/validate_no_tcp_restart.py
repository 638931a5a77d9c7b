"""An experiment beside validate_testbed.py (issue 39's 1 Gbit tail): the same driver, with Linux's
restart of TCP's congestion window after an idle link (``net.ipv4.tcp_slow_start_after_idle``) set in
both testbed namespaces as they come up; every argument goes to validate_testbed.py::

    sudo flock /run/pilab-testbed.lock python experiments/perfmodel/validate_no_tcp_restart.py 0 \
        --out runs/validate-ssai0 --width 1.0 --bucket-mb 1 --bucket-tail-mb 0 --rates 1gbit

The first argument is the value (0: off; 1: Linux's default, for the alternated twin run). Why: the
step's last message follows 0.06-0.4 s of silence on the link (experiments/perfmodel/LOG.md).
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pilab import testbed  # noqa: E402

import validate_testbed  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("0", "1"):
        print("give the value first: 0 (restart off) or 1 (Linux's default), then validate_testbed.py's "
              "arguments", file=sys.stderr)
        return 2
    value, up = argv[0], testbed.up

    def up_and_set(tb, *a, **k):
        tb = up(tb, *a, **k)
        for h in tb.hosts:
            subprocess.run(["ip", "netns", "exec", tb.netns(h), "sysctl", "-w",
                            f"net.ipv4.tcp_slow_start_after_idle={value}"], check=True)
        return tb

    testbed.up = up_and_set
    sys.argv = [sys.argv[0], *argv[1:]]
    return validate_testbed.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
