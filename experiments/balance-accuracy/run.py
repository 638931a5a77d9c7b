"""Issue 53's accuracy goal: uneven shares (given speeds 2:1) against equal shares, final test accuracy over
3 seeds, in the simulator at np=2 (exact mode: bit-identical to ``mpiexec`` with these shares,
tests/test_balance.py) on the embedded data (5,000 training images, 1,000 test), 4 epochs::

    python experiments/balance-accuracy/run.py          # writes experiments/balance-accuracy/accuracy.json

It is the bench section's own measurement (``pilab.bench.balance.accuracy``, full form), run apart from the
section's timed testbed runs: it times nothing, so it needs no quiet machine.
"""
import json
import os
import sys
import time

from pilab.bench.balance import accuracy

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    t = time.time()
    out = accuracy(quick=False, log=lambda line: print(line, flush=True))
    doc = {"command": "python experiments/balance-accuracy/run.py", "wall_s": round(time.time() - t, 1),
           "settings": out["settings"] + ", sharding reshuffle, 1,000 test images", "accuracy": out["modes"]}
    with open(os.path.join(HERE, "accuracy.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    sys.exit(0)
