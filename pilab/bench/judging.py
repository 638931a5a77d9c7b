"""How BENCHMARKS.md writes a figure (a ratio with its spread, milliseconds) and judges it "met" / "NOT met"
against the goals the run was given (``res["goals"]``: {key: [op, value]})::

    _judged(1.04, {"goals": {"trace_overhead": ["<=", 1.02]}}, "trace_overhead")   # 'NOT met'
"""
from __future__ import annotations

import operator

_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


def _r(s: dict | None, digits: int = 2) -> str:
    """'median (p10-p90, n)' of a summary."""
    if not s or s.get("median") is None:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['p10'])}–{f.format(s['p90'])}, n={s['n']})"


def _ms(s: dict | None) -> str:
    if not s or s.get("median") is None:
        return "n/a"
    return f"{1e3 * s['median']:.1f} ms ({1e3 * s['p10']:.1f}–{1e3 * s['p90']:.1f})"


def _goal(s: dict | None, res: dict, key: str) -> str:
    """"met (goal >= 0.98)" for a summary's median against the run's goal ``key``; "—" without one."""
    if not s or s.get("median") is None:
        return "not measured"
    return _judged(s["median"], res, key, with_goal=True)


def _goal_words(res: dict, key: str, what: str) -> str:
    """"the peak per rank in MB <= 900" for the run's goal ``key``; "none given" without one."""
    goal = (res.get("goals") or {}).get(key)
    return f"{what} {goal[0]} {goal[1]:g}" if goal else "none given"


def _judged(value: float, res: dict, key: str, *, with_goal: bool = False) -> str:
    """"met" / "NOT met" for ``value`` against the run's goal ``key`` (with the goal in words where asked);
    "—" where the run was given no such goal."""
    goal = (res.get("goals") or {}).get(key)
    if goal is None:
        return "—"
    op, target = goal
    ok = _OPS[op](value, target)
    return ("met" if ok else "NOT met") + (f" (goal {op} {target:g})" if with_goal else "")
