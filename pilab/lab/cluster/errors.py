"""The cluster helper's error type, raised by every part of :mod:`pilab.lab.cluster`::

    try:
        lab = cluster.start(n=4)
    except cluster.ClusterError as e:
        print(e)          # names the ranks, the profile or the hostfile, and what to do
"""
from __future__ import annotations


class ClusterError(RuntimeError):
    """Engines are missing, a rank died or stopped making progress. The message names the ranks."""
