"""An experiment, not pilab's behaviour (issue 39's tail on a loaded machine): with this folder first on
PYTHONPATH, every Python process (the ranks too: mpiexec passes PYTHONPATH on) loads
pilab.dist.gradsync with SPIN_S = 60 s, so GradSync's end-of-backward wait polls without napping::

    sudo env PYTHONPATH=experiments/perfmodel/spinning_wait:$PWD flock /run/pilab-testbed.lock \\
        python experiments/perfmodel/validate_testbed.py --out runs/validate-spin \\
        --width 1.0 --bucket-mb 1 --bucket-tail-mb 0 --rates 1gbit

Why: a nap gives the core away, and on a machine with more runnable processes than cores the rank
wakes late; the spinning wait shows how much of a measured tail that is (experiments/perfmodel/LOG.md).
"""
import importlib.abc
import importlib.util
import sys

SPIN_S = 60.0


class _SpinningWait(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pilab.dist.gradsync":
            return None
        sys.meta_path.remove(self)  # find the real module, then patch it once it has run
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.SPIN_S = SPIN_S

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SpinningWait())
