"""Scaling metrics: plain functions of measured or predicted times (the published figures are
checked with them, and ``pilab.study`` reports with them).

    from pilab.perfmodel import speedup, efficiency, karp_flatt
    S = speedup(t_base=200.0, t=40.0)           # 5.0
    efficiency(S, p=16, p0=2), karp_flatt(S, 16, 2)
"""
from __future__ import annotations


def speedup(t_base: float, t: float) -> float:
    """S = t_base / t: how many times faster than the baseline run."""
    return t_base / t


def efficiency(S: float, p: int, p0: int = 1) -> float:
    """E = S * p0 / p: speedup per added process, against a baseline of ``p0`` processes."""
    return S * p0 / p


def karp_flatt(S: float, p: int, p0: int = 1) -> float:
    """Experimentally determined serial fraction e = (1/S - 1/n) / (1 - 1/n), n = p / p0.

    A serial fraction that grows with p points at overhead (communication, duplicated work);
    a constant one at a genuinely serial part. NaN at p == p0.
    """
    n = p / p0
    if n == 1:
        return float("nan")
    return (1 / S - 1 / n) / (1 - 1 / n)
