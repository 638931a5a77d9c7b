"""The doctor's report as text: one row of marks per host, the figures, then each ✗ with its fix."""
from __future__ import annotations

from .common import CHECKS, DETAILS


def format_table(report: dict) -> str:
    """The host x check table (✔ / ✗ / · not checked), each host's figures, one fix per ✗."""
    mark = {True: "✔", False: "✗", None: "·"}
    hosts = report["hosts"]
    w = max(8, *(len(h) for h in hosts))
    head = f"{'host':<{w}}  " + "  ".join(CHECKS)
    lines = [head]
    for h in hosts:
        row = report["checks"][h]
        lines.append(f"{h:<{w}}  " + "  ".join(f"{mark[row[k]['ok']]:<{len(k)}}" for k in CHECKS).rstrip())
    lines.append("")
    for h in hosts:
        row = report["checks"][h]
        if row["answers"]["ok"]:
            lines.append(f"{h}: " + "; ".join(f"{k} {row[k]['detail']}" for k in
                                                DETAILS if row[k]["ok"]))
    fails = [(h, k, report["checks"][h][k]) for h in hosts for k in CHECKS
             if report["checks"][h][k]["ok"] is False]
    lines.append("")
    for h, k, c in fails:
        lines.append(f"✗ {h} {k}: {c['detail']}\n    fix: {c['fix']}")
    n = len(hosts)
    lines.append(f"all {len(CHECKS)} checks pass on {n} host(s)" if report["ok"] else
                 f"{len(fails)} check(s) fail on {len({h for h, _, _ in fails})} of {n} host(s)")
    return "\n".join(lines)
