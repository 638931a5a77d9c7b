"""What reading one training step means, counted: the pilab files and functions one ``MPIRanks`` step
runs on rank 0 (issue #36's "files and calls to read one training step"), traced with ``sys.setprofile``
over one ``Session.step`` (the step after a first, untraced one)::

    mpiexec -n 2 python scripts/step_reading.py                    # a plain synchronous step
    mpiexec -n 2 python scripts/step_reading.py --local-steps 2    # a local-SGD step (no average after it)

The model's own forward and the data's augmentation are on the path too; they are listed, as they run.
The built-in data set (``data="embedded"``) keeps it quick; nothing is written.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from pilab import engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local-steps", type=int, default=1)
    args = p.parse_args(argv)
    from mpi4py import MPI

    import pilab
    from pilab.config import Config
    root = os.path.dirname(pilab.__file__)
    cfg = Config(data="embedded", model="mobilenetv2_cifar", width=0.25, train_subset=256, test_subset=64,
                 batch_size=16, epochs=2, threads=1, local_steps=args.local_steps)
    s = engine.Session(cfg, engine.MPIRanks(MPI.COMM_WORLD))
    s.step(0, 0)  # the first step makes buffers; the one counted is the second after it (step 2)
    calls = []

    def seen(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            calls.append((os.path.relpath(frame.f_code.co_filename, root), frame.f_code.co_qualname))
    threading.setprofile(seen)
    sys.setprofile(seen)
    s.step(0, 2)  # local_steps=2: a local step with no average after it
    sys.setprofile(None)
    threading.setprofile(None)
    if MPI.COMM_WORLD.Get_rank() == 0:
        files, funcs = sorted({f for f, _ in calls}), sorted(set(calls))
        print(f"{root} local_steps={args.local_steps}: {len(files)} files, {len(funcs)} functions, "
              f"{len(calls)} calls")
        print("files:", ", ".join(files))
        print("functions:", ", ".join(f"{f.removesuffix('.py')}:{q}" for f, q in funcs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
