"""Measured energy: the CPU packages' RAPL counters (Linux powercap) and an external power meter's log
(an INA219 per board, a smart plug), read and integrated over a run's epochs. ``pilab.study.energy``
prices runs with them (and re-exports them)::

    from pilab.study import meters
    with meters.RaplWindow() as w:            # this machine's CPU package counters around some work
        ...
    w.energy_j                                # None where the counters are not readable
    s = meters.read_meter_csv("power.csv")    # {node: [(unix time, watts), ...]}
    meters.meter_energy(s, t0, t1)            # joules between two wall-clock times, summed over nodes
"""
from __future__ import annotations

import csv
import glob
import os
import time
from datetime import datetime
from typing import Optional, Sequence

RAPL_ROOT = "/sys/class/powercap"


# ----------------------------------------------------------------------------------------------
# measured: RAPL (Linux powercap) counters
# ----------------------------------------------------------------------------------------------
def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # absent, or root-only (energy_uj is 0400 since Linux 5.10)
        return None


def read_rapl(root: str = RAPL_ROOT, *, include_dram: bool = False) -> Optional[dict]:
    """One reading of the CPU packages' RAPL energy counters, or None where none is readable.

        read_rapl()   # {"time": 1.7e9, "zones": {"intel-rapl:0": {"name": "package-0",
                      #   "energy_uj": 123456789, "max_energy_range_uj": 262143328850}}}

    Reads ``<root>/intel-rapl:N/energy_uj`` (and ``max_energy_range_uj``, where the counter wraps) for
    each package zone; ``psys`` (the whole platform, which contains the packages) is left out so nothing
    counts twice, and so are the sub-zones (core, uncore: inside their package), except ``dram`` ones
    with ``include_dram=True`` (DRAM is outside the package). AMD's RAPL appears under the same names.
    """
    zones = {}
    for path in sorted(glob.glob(os.path.join(root, "intel-rapl:*"))):
        zone = os.path.basename(path)
        try:
            with open(os.path.join(path, "name")) as f:
                name = f.read().strip()
        except OSError:
            name = zone
        sub = zone.count(":") > 1
        if name == "psys" or (sub and not (include_dram and name == "dram")):
            continue
        energy = _read_int(os.path.join(path, "energy_uj"))
        top = _read_int(os.path.join(path, "max_energy_range_uj"))
        if energy is None or top is None:
            continue
        zones[zone] = {"name": name, "energy_uj": energy, "max_energy_range_uj": top}
    return {"time": time.time(), "zones": zones} if zones else None


def rapl_joules(start: dict, end: dict) -> float:
    """Joules between two ``read_rapl`` readings, summed over the zones in both; a counter that wrapped
    (end < start) went through ``max_energy_range_uj`` once (readings minutes apart: it wraps every
    ~hours at most)."""
    total = 0
    for zone, a in start["zones"].items():
        b = end["zones"].get(zone)
        if b is None:
            continue
        d = b["energy_uj"] - a["energy_uj"]
        if d < 0:
            d += a["max_energy_range_uj"] + 1  # the counter runs 0..max_energy_range_uj
        total += d
    return total / 1e6


class RaplWindow:
    """RAPL energy over a ``with`` block (``energy_j`` None where the counters are not readable).

        with RaplWindow() as w:
            result = scaling.run_measured(cfg, 2, "runs/x")         # pilab.study.scaling: ranks on this machine
        w.energy_j, w.to_dict()                                 # -> energy_of_run(result, rapl=w)
    """

    def __init__(self, root: str = RAPL_ROOT, *, include_dram: bool = False):
        self.root, self.include_dram = root, include_dram
        self.start = self.end = None
        self.started_at = self.ended_at = None
        self.energy_j: Optional[float] = None

    def __enter__(self) -> "RaplWindow":
        self.started_at = time.time()
        self.start = read_rapl(self.root, include_dram=self.include_dram)
        return self

    def __exit__(self, *exc) -> None:
        self.end = read_rapl(self.root, include_dram=self.include_dram)
        self.ended_at = time.time()
        if self.start is not None and self.end is not None:
            self.energy_j = rapl_joules(self.start, self.end)

    @property
    def available(self) -> bool:
        return self.start is not None

    def to_dict(self) -> dict:
        return {"source": "rapl", "energy_j": self.energy_j, "started_at": self.started_at,
                "ended_at": self.ended_at, "zones": sorted(self.start["zones"]) if self.start else []}


# ----------------------------------------------------------------------------------------------
# measured: an external power meter's log
# ----------------------------------------------------------------------------------------------
_TIME_COLUMNS = ("timestamp", "time", "datetime", "date_time", "ts")
_NODE_COLUMNS = ("node", "host", "hostname", "device", "channel")
_POWER_COLUMNS = {"watts": 1.0, "power_w": 1.0, "power": 1.0, "w": 1.0, "apower": 1.0,
                  "milliwatts": 1e-3, "power_mw": 1e-3, "mw": 1e-3}


def _timestamp(text: str) -> float:
    """Unix seconds from a number (s, or ms when it looks like ms) or an ISO 8601 date-time (a trailing
    Z is UTC; without a zone, local time, as the logger's clock and ``time.time()`` agree on)."""
    text = text.strip()
    try:
        t = float(text)
        return t / 1000.0 if t > 1e11 else t  # ms since the epoch (smart-plug APIs log these)
    except ValueError:
        pass
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    return datetime.fromisoformat(text).timestamp()


def read_meter_csv(path: str) -> dict[str, list[tuple[float, float]]]:
    """A power log as {node: [(unix seconds, watts), ...]} sorted by time. Two layouts, with a header:

        timestamp,node,watts              # long: one row per sample and node (INA219 / plug loggers)
        2026-03-02T10:00:00.0,pi01,3.1
        2026-03-02T10:00:00.0,pi02,3.0

        timestamp,pi01,pi02               # wide: one column of watts per node
        1772445600.0,3.1,3.0

    Times: unix seconds (or ms), or ISO 8601. Power columns ``watts``/``power_w``/``power`` (W) or
    ``power_mw``/``milliwatts`` (mW, what the INA219 reports); in the wide layout a node column whose
    name ends in ``_mw`` is in mW. A log without a node column is one node, named after the file.
    """
    with open(path, newline="") as f:
        rows = list(csv.reader(row for row in f if row.strip() and not row.lstrip().startswith("#")))
    if len(rows) < 2:
        raise ValueError(f"{path}: no samples (need a header and at least one row)")
    header = [h.strip().lower() for h in rows[0]]
    t_col = next((i for i, h in enumerate(header) if h in _TIME_COLUMNS), None)
    if t_col is None:
        raise ValueError(f"{path}: no time column (one of {', '.join(_TIME_COLUMNS)}) in {rows[0]}")
    n_col = next((i for i, h in enumerate(header) if h in _NODE_COLUMNS), None)
    p_col = next((i for i, h in enumerate(header) if h in _POWER_COLUMNS), None)
    out: dict[str, list[tuple[float, float]]] = {}
    try:
        if p_col is not None:  # long (or one node without a node column)
            scale = _POWER_COLUMNS[header[p_col]]
            default = os.path.splitext(os.path.basename(path))[0]
            for row in rows[1:]:
                node = row[n_col].strip() if n_col is not None else default
                out.setdefault(node, []).append((_timestamp(row[t_col]), float(row[p_col]) * scale))
        else:  # wide: every other column is a node
            for j, h in enumerate(header):
                if j == t_col:
                    continue
                scale = 1e-3 if h.endswith("_mw") else 1.0
                name = rows[0][j].strip()
                out[name] = [(_timestamp(row[t_col]), float(row[j]) * scale) for row in rows[1:] if row[j].strip()]
    except (IndexError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a sample ({e})") from None
    return {k: sorted(v) for k, v in out.items()}


def _integrate(samples: list[tuple[float, float]], a: float, b: float) -> float:
    """∫ watts dt over [a, b], linear between samples (trapezoids), clipped at a and b."""
    def at(t):  # linear interpolation; samples cover t (checked by the caller)
        for (t0, w0), (t1, w1) in zip(samples, samples[1:]):
            if t0 <= t <= t1:
                return w0 if t1 == t0 else w0 + (w1 - w0) * (t - t0) / (t1 - t0)
        return samples[0][1] if t < samples[0][0] else samples[-1][1]

    pts = [(a, at(a))] + [(t, w) for t, w in samples if a < t < b] + [(b, at(b))]
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(pts, pts[1:]))


def meter_energy(samples: dict, start: float, end: float, *, nodes: Optional[Sequence[str]] = None,
                 max_gap_s: float = 10.0) -> float:
    """Joules the logged nodes drew between two wall-clock times (unix seconds), summed over nodes.

        meter_energy(read_meter_csv("power.csv"), result["started_at"], result["ended_at"])

    Raises ValueError where a node's samples do not cover [start, end] or leave a gap longer than
    ``max_gap_s`` inside it (the edges may be up to ``max_gap_s`` from the nearest sample, held flat).
    """
    if end < start:
        raise ValueError(f"window ends ({end}) before it starts ({start})")
    total = 0.0
    for node in (nodes if nodes is not None else sorted(samples)):
        s = samples[node]
        if not s or s[0][0] > start + max_gap_s or s[-1][0] < end - max_gap_s:
            span = f"{s[0][0]:.1f}..{s[-1][0]:.1f}" if s else "nothing"
            raise ValueError(f"meter log for {node} covers {span}, not the window {start:.1f}..{end:.1f}")
        gaps = [t1 - t0 for (t0, _), (t1, _) in zip(s, s[1:]) if t1 > start and t0 < end]
        if gaps and max(gaps) > max_gap_s:
            raise ValueError(f"meter log for {node} has a {max(gaps):.1f} s gap inside "
                             f"{start:.1f}..{end:.1f} (max_gap_s={max_gap_s})")
        total += _integrate(s, start, end)
    return total
