"""Issue 39's validation goal for the performance model, judged on a measured trace: the step time
within 10% and the exposed tail within 20% of the measurement (one rank per core on the testbed, at
1 Gbit and at 200 Mbit). The goals live here, not in pilab/ (issue 36); pilab prints the errors.

    python experiments/perfmodel/validate_trace.py runs/x/trace.json \
        --calibration runs/perfmodel/calibration.json [--out runs/x/validation.json]

Every other argument goes to `python -m pilab perfmodel validate` as it is.
"""
from __future__ import annotations

import sys

STEP_GOAL = 0.10  # |predicted - measured| / measured of the step time
TAIL_GOAL = 0.20  # ... of the exposed tail (the wait after backward less the wait for a slower peer)


def main(argv: list[str]) -> int:
    from pilab.cli import main as pilab
    return pilab(["perfmodel", "validate", *argv, "--step-goal", str(STEP_GOAL), "--tail-goal", str(TAIL_GOAL)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
