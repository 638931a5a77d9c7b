"""``python -m pilab ...``: see pilab.cli."""
import faulthandler
import sys

# A rank killed by a fatal signal (an abort in MPI or a C extension, a segfault) prints every thread's
# Python stack to stderr -- in a batch job, its log -- instead of dying with nothing but mpiexec's banner.
# First, so that a signal while the CLI imports torch is covered too.
faulthandler.enable()

from .cli import main  # noqa: E402

sys.exit(main())
