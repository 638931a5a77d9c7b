"""Energy of a training run: modelled from a board's power figures, or measured (RAPL counters, an
external meter's log), and energy to a target accuracy; for a spiking net, an estimate on neuromorphic
hardware from its synaptic operations.

    from pilab.study import energy
    e = energy.energy_of_run(result)                            # model:pi4b over the nodes the run used
    e = energy.energy_of_run(result, count="cluster")           # ... with the whole 24-board cluster on
    e = energy.energy_of_run(result, epoch_times=predicted)     # priced over the Pi's predicted epochs
    e = energy.energy_of_run(result, meter="power.csv")         # an INA219 / smart-plug log, by time
    with energy.RaplWindow() as w:                              # this machine's CPU package counters
        result = scaling.run_measured(cfg, 2, "runs/x")             # pilab.study.scaling
    e = energy.energy_of_run(result, rapl=w)
    e["energy_j"], e["energy_per_epoch_j"], e["source"]         # source: model:pi4b | rapl | meter:power.csv
    energy.energy_to_target(result, 0.40, e["energy_per_epoch_j"])   # J until test acc >= 0.40; None: never
    energy.neuromorphic_energy(models.synaptic_ops(model, images))    # J per image, cited per-op figures

Like time per epoch, an epoch's energy covers its training time; evaluation is left out unless asked
(``include_eval=True``). Every figure says where it came from, and the modelled ones carry the
assumptions they rest on.

Measured energy: the CPU packages' RAPL counters (Linux powercap) and an external power meter's log
(an INA219 per board, a smart plug), read and integrated over a run's epochs, which prices runs with them::

    from pilab.study import energy
    with energy.RaplWindow() as w:            # this machine's CPU package counters around some work
        ...
    w.energy_j                                # None where the counters are not readable
    s = energy.read_meter_csv("power.csv")    # {node: [(unix time, watts), ...]}
    energy.meter_energy(s, t0, t1)            # joules between two wall-clock times, summed over nodes
"""
from __future__ import annotations

import csv
import glob
import os
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Mapping, Optional, Sequence, Union

from ..files import load_json
from ..perfmodel import PI_CORES_PER_NODE, PI_NODES, PI_RANKS_PER_NODE

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


__all__ = ["PowerModel", "POWER_MODELS", "resolve_power", "energy_of_run", "energy_to_target",
           "read_rapl", "rapl_joules", "RaplWindow", "read_meter_csv", "meter_energy",
           "neuromorphic_energy", "OP_ENERGY", "RAPL_ROOT"]

COUNTS = ("used", "cluster")


# ----------------------------------------------------------------------------------------------
# the power model
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PowerModel:
    """Power of a cluster of identical nodes and its switch; every number an assumption to override.

        PowerModel()                                  # the Raspberry Pi 4B cluster of the study
        replace(POWER_MODELS["pi4b"], switch_w=5.0)   # one assumption changed
        PowerModel.from_dict({"name": "my_box", "idle_w": 40, "load_w": 120, "cores_per_node": 8,
                              "ranks_per_node": 2, "nodes": 1, "switch_w": 0})

    A node draws ``idle_w`` with its cores idle and ``load_w`` with all ``cores_per_node`` busy, linear
    in the busy cores between (dynamic power = (load_w - idle_w) x utilisation). Defaults, per board at
    the 5.1 V of the official Raspberry Pi 4 supply:

    * idle 0.6 A -> 3.06 W: the Raspberry Pi documentation's "typical bare-board active current
      consumption" of the Pi 4 Model B, 600 mA (Raspberry Pi documentation, "Power supply");
    * full CPU load 1.2 A -> 6.12 W: what independent measurements of all four cores under stress
      report (e.g. RasPi.TV's 2019 Pi 4B test: 1280 mA / 6.4 W with ``stress --cpu 4``; Jeff Geerling's
      sbc-reviews: 5.0 W at the wall with ``stress-ng --matrix 0``); the documentation gives no figure;
    * the switch: ``switch_w`` = 10 W, an assumption for one unmanaged 24-port gigabit desktop switch
      (not measured here; take your switch's datasheet figure);
    * while a rank waits for communication, ``wait_threads`` = 1 of its threads stays busy (MPICH's
      progress engine polls); while it computes, all of its threads are.

    The defaults leave out fans, SD-card and power-supply losses (a PSU's own loss is ~10-20% at the
    wall) and thermal throttling.
    """
    name: str = "pi4b"
    idle_w: float = 0.6 * 5.1  # per node, W, cores idle
    load_w: float = 1.2 * 5.1  # per node, W, all cores busy
    cores_per_node: int = PI_CORES_PER_NODE
    ranks_per_node: int = PI_RANKS_PER_NODE  # ranks are packed this many to a node
    nodes: int = PI_NODES  # nodes in the cluster (count="cluster" powers all of them)
    switch_w: float = 10.0  # W, the network switch (counted once more than one node takes part)
    wait_threads: float = 1.0  # busy threads of a rank waiting on communication
    notes: str = ("Raspberry Pi 4B: 0.6 A idle, 1.2 A all cores busy, at 5.1 V; 10 W unmanaged GbE "
                  "switch (assumed); no PSU losses or fans")

    def __post_init__(self):
        if not 0 <= self.idle_w <= self.load_w:
            raise ValueError(f"idle_w={self.idle_w} and load_w={self.load_w}: need 0 <= idle_w <= load_w")
        for name in ("cores_per_node", "ranks_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.switch_w < 0 or self.wait_threads < 0:
            raise ValueError("switch_w and wait_threads must be >= 0")

    def node_power(self, busy_cores: float) -> float:
        """Watts of one node with ``busy_cores`` cores busy (capped at all of them)."""
        u = min(1.0, max(0.0, busy_cores / self.cores_per_node))
        return self.idle_w + (self.load_w - self.idle_w) * u

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "PowerModel":
        """From a mapping (e.g. a saved study's assumptions); unknown keys are refused."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown PowerModel field(s) {', '.join(unknown)}")
        return cls(**dict(d))


POWER_MODELS = {"pi4b": PowerModel()}


def resolve_power(spec: Union[None, str, Mapping, PowerModel] = None) -> PowerModel:
    """A PowerModel from itself, a preset name (``POWER_MODELS``), a dict, or a JSON file's path."""
    if spec is None:
        return POWER_MODELS["pi4b"]
    if isinstance(spec, PowerModel):
        return spec
    if isinstance(spec, str):
        if spec in POWER_MODELS:
            return POWER_MODELS[spec]
        if not os.path.isfile(spec):
            raise ValueError(f"unknown power model {spec!r}; choose one of {', '.join(POWER_MODELS)} "
                             "or give a JSON file of PowerModel fields")
        spec = load_json(spec)
    if isinstance(spec, Mapping):
        return PowerModel.from_dict(spec)
    raise TypeError(f"cannot make a PowerModel from {type(spec).__name__}")


# ----------------------------------------------------------------------------------------------
# energy of a run
# ----------------------------------------------------------------------------------------------
def _ranks_on_nodes(np_: int, pm: PowerModel) -> list[int]:
    """Ranks on each node that takes part, packed ``ranks_per_node`` to a node (the last may have fewer)."""
    full, rest = divmod(np_, pm.ranks_per_node)
    return [pm.ranks_per_node] * full + ([rest] if rest else [])


def _epoch_windows(result: dict, include_eval: bool) -> list[tuple[float, float]]:
    """(start, end) wall-clock times of each epoch's training (plus evaluation if asked)."""
    out = []
    for e in result["epochs"]:
        if e.get("started_at") is None:
            raise ValueError("the result has no epoch start times (epochs[i]['started_at']); a meter log can "
                             "only be joined to runs of a pilab that records them: run it again")
        eval_t = (e.get("eval_time") or 0.0) if include_eval else 0.0
        out.append((e["started_at"], e["started_at"] + e["time"] + eval_t))
    return out


def energy_of_run(result: dict, power: Union[None, str, Mapping, PowerModel] = None, *,
                  count: str = "used", epoch_times: Optional[Sequence[float]] = None,
                  comm_exposed_share: Optional[float] = None, threads: Optional[int] = None,
                  include_eval: bool = False, meter=None, rapl=None) -> dict:
    """Energy of a run (a ``result.json`` dict, measured or simulated), per epoch and in total.

        energy_of_run(result)                                    # {"energy_j", "energy_per_epoch_j",
        energy_of_run(result, "pi4b", count="cluster")           #  "mean_power_w", "source", "assumptions"}
        energy_of_run(sim_result, epoch_times=[12.5] * 4, comm_exposed_share=0.3)   # a predicted row
        energy_of_run(result, meter="runs/power.csv")            # measured by an external meter
        energy_of_run(result, rapl=window)                       # measured by RAPL (a RaplWindow)

    Where the figure comes from, in this order:

    * ``rapl``: a finished ``RaplWindow`` (or its ``to_dict()``) around the run: this machine's CPU
      package energy over the window (the whole package: other processes count too), given to the
      epochs at the window's mean power. Unreadable counters (``energy_j`` None) fall through.
    * ``meter``: a CSV path (or ``read_meter_csv``'s samples): each epoch's energy integrated from the
      samples between the epoch's wall-clock start and end (``result["epochs"][i]["started_at"]``),
      summed over the nodes in the log. ``source`` is ``"meter:<file name>"``.
    * otherwise the power model (``power``: a PowerModel, a preset name, a dict or a JSON path; default
      ``"pi4b"``): per epoch, Σ over nodes (idle + (load - idle) x utilisation) x time, plus the switch
      when more than one node takes part (always with ``count="cluster"``). A node's utilisation is
      its busy threads over its cores: each rank's ``threads`` busy while computing and
      ``wait_threads`` while waiting on communication (the epoch's ``comm_exposed`` share, or
      ``comm_exposed_share`` for predicted times). ``count="used"`` counts the nodes the run used
      (ranks packed ``ranks_per_node`` to a node); ``count="cluster"`` also the cluster's unused nodes
      at idle, as when the whole cluster is powered for a small run. ``threads`` defaults to the
      target's own placement (its cores over the ranks on a node: 2 on the Pi study), as the
      performance model places ranks; pass ``result["threads"]`` to price the run as configured.

    The model prices the epochs' durations: a run measured on this machine gives what the target's
    nodes would draw over this machine's times; pass the target's times (``epoch_times``, e.g. the
    performance model's prediction for the cluster) for the target's energy. ``epoch_times`` replaces
    the result's epoch times for the model only.
    """
    if count not in COUNTS:
        raise ValueError(f"count={count!r}; choose one of {', '.join(COUNTS)}")
    if rapl is not None:
        w = rapl.to_dict() if hasattr(rapl, "to_dict") else dict(rapl)
        if w.get("energy_j") is not None:
            return _apportion(result, w["energy_j"], w["ended_at"] - w["started_at"], "rapl",
                              {"zones": w.get("zones"), "window_s": w["ended_at"] - w["started_at"],
                               "note": "CPU package counters over the whole window, all processes; "
                                       "epochs get the window's mean power"}, include_eval)
    if meter is not None:
        return _metered(result, meter, include_eval)
    return _modelled(result, resolve_power(power), count, epoch_times, comm_exposed_share, threads, include_eval)


def _metered(result: dict, meter, include_eval: bool) -> dict:
    """Each epoch's energy integrated from a meter's samples over its wall-clock window."""
    samples = read_meter_csv(meter) if isinstance(meter, (str, os.PathLike)) else meter
    label = os.path.basename(os.fspath(meter)) if isinstance(meter, (str, os.PathLike)) else "samples"
    per_epoch = [meter_energy(samples, a, b) for a, b in _epoch_windows(result, include_eval)]
    total_t = sum(b - a for a, b in _epoch_windows(result, include_eval))
    return {"energy_j": sum(per_epoch), "energy_per_epoch_j": per_epoch,
            "mean_power_w": sum(per_epoch) / total_t if total_t > 0 else None,
            "source": f"meter:{label}",
            "assumptions": {"nodes": sorted(samples), "includes_eval": include_eval,
                            "note": "samples integrated (trapezoids) over each epoch's wall-clock window"}}


def _modelled(result: dict, pm: PowerModel, count: str, epoch_times, comm_exposed_share, threads,
              include_eval: bool) -> dict:
    """The power model over the epochs' times (see ``energy_of_run``)."""
    epochs = result["epochs"]
    np_ = int(result["np"])
    if np_ > pm.nodes * pm.ranks_per_node:
        raise ValueError(f"np={np_} does not fit {pm.nodes} nodes x {pm.ranks_per_node} ranks of {pm.name}")
    if epoch_times is not None and len(epoch_times) != len(epochs):
        raise ValueError(f"{len(epoch_times)} epoch_times for {len(epochs)} epochs")
    placement = _ranks_on_nodes(np_, pm)
    t_rank = threads or max(1, pm.cores_per_node // min(np_, pm.ranks_per_node))
    used = len(placement)
    switch_on = count == "cluster" or used > 1
    per_epoch, utilisation, seconds = [], [], []
    for i, e in enumerate(epochs):
        t = float(epoch_times[i]) if epoch_times is not None else float(e["time"])
        if comm_exposed_share is not None:
            wait = comm_exposed_share
        else:
            wait = (e.get("comm_exposed") or 0.0) / e["time"] if e["time"] else 0.0
        wait = min(1.0, max(0.0, wait))
        busy_per_rank = t_rank * (1 - wait) + min(t_rank, pm.wait_threads) * wait
        watts = sum(pm.node_power(r * busy_per_rank) for r in placement)
        if count == "cluster":
            watts += (pm.nodes - used) * pm.idle_w
        watts += pm.switch_w if switch_on else 0.0
        energy = watts * t
        if include_eval and e.get("eval_time"):  # evaluation: every thread computes, no waiting
            eval_t = e["eval_time"]
            energy += eval_t * (sum(pm.node_power(r * t_rank) for r in placement)
                                + ((pm.nodes - used) * pm.idle_w if count == "cluster" else 0.0)
                                + (pm.switch_w if switch_on else 0.0))
            t += eval_t
        per_epoch.append(energy)
        seconds.append(t)
        utilisation.append(sum(min(1.0, r * busy_per_rank / pm.cores_per_node) for r in placement) / used)
    total_t = sum(seconds)
    return {
        "energy_j": sum(per_epoch), "energy_per_epoch_j": per_epoch,
        "mean_power_w": sum(per_epoch) / total_t if total_t > 0 else None,
        "source": f"model:{pm.name}",
        "assumptions": {"power_model": pm.to_dict(), "count": count, "nodes_used": used,
                        "nodes_counted": pm.nodes if count == "cluster" else used,
                        "ranks_on_nodes": placement, "threads_per_rank": t_rank, "switch": switch_on,
                        "node_utilisation": utilisation, "includes_eval": include_eval,
                        "times": "given (epoch_times)" if epoch_times is not None else "the result's"},
    }


def _apportion(result: dict, joules: float, window_s: float, source: str, assumptions: dict,
               include_eval: bool) -> dict:
    """A measured total over a window, given to each epoch at the window's mean power."""
    mean_w = joules / window_s if window_s > 0 else 0.0
    per_epoch = [mean_w * (e["time"] + ((e.get("eval_time") or 0.0) if include_eval else 0.0))
                 for e in result["epochs"]]
    return {"energy_j": joules, "energy_per_epoch_j": per_epoch, "mean_power_w": mean_w, "source": source,
            "assumptions": {**assumptions, "includes_eval": include_eval}}


def energy_to_target(result: dict, target: float, energy_per_epoch: Optional[Sequence[float]] = None,
                     **energy_kw) -> Optional[float]:
    """Joules until the first evaluated epoch with test accuracy >= ``target``; None if never reached
    (like ``pilab.study.analysis.time_to_target``, on energy instead of seconds).

        energy_to_target(result, 0.40, energy_of_run(result)["energy_per_epoch_j"])
        energy_to_target(result, 0.40, power="pi4b", count="cluster")   # energy_of_run's keywords
    """
    if energy_per_epoch is None:
        energy_per_epoch = energy_of_run(result, **energy_kw)["energy_per_epoch_j"]
    spent = 0.0
    for e, joules in zip(result["epochs"], energy_per_epoch):
        spent += joules
        if e.get("test_acc") is not None and e["test_acc"] >= target:
            return spent
    return None


# ----------------------------------------------------------------------------------------------
# a spiking net on neuromorphic hardware
# ----------------------------------------------------------------------------------------------
# Energy per operation, joules. "horowitz45nm": M. Horowitz, "Computing's energy problem (and what we
# can do about it)", ISSCC 2014: 45 nm, 0.9 V, 32-bit float add 0.9 pJ and multiply 3.7 pJ, so an
# accumulate (AC) 0.9 pJ and a multiply-accumulate (MAC) 4.6 pJ -- the pair most SNN papers use.
# "loihi": M. Davies et al., "Loihi: a neuromorphic manycore processor with on-chip learning",
# IEEE Micro 38(1), 2018, Table 1: 23.6 pJ per synaptic spike operation (its minimum); Loihi does
# no MACs, so the encoder's and readout's MACs are priced at Horowitz's 4.6 pJ (a host beside it).
OP_ENERGY = {
    "horowitz45nm": {"synop_j": 0.9e-12, "mac_j": 4.6e-12,
                     "citation": "Horowitz, ISSCC 2014: 45 nm fp32 add 0.9 pJ (AC), mult+add 4.6 pJ (MAC)"},
    "loihi": {"synop_j": 23.6e-12, "mac_j": 4.6e-12,
              "citation": "Davies et al., IEEE Micro 2018 (Loihi): 23.6 pJ per synaptic spike op; "
                          "MACs at Horowitz 2014's 4.6 pJ"},
}


def neuromorphic_energy(ops: Mapping, hardware: str = "horowitz45nm", *, images: int = 1,
                        synop_j: Optional[float] = None, mac_j: Optional[float] = None) -> dict:
    """Estimated inference energy of a spiking net from its measured operations (``models.synaptic_ops``).

        ops = models.synaptic_ops(model, images)           # SynOps and MACs per image, measured
        neuromorphic_energy(ops)["energy_per_image_j"]      # 0.9 pJ/SynOp + 4.6 pJ/MAC (Horowitz 2014)
        neuromorphic_energy(ops, "loihi", images=10_000)    # the test set on Loihi-class hardware

    Spike-driven accumulates cost ``synop_j`` each, the analog layers' MACs (encoder, readout)
    ``mac_j``; ``dense_energy_j`` prices the same network evaluated densely (every MAC, every step) at
    ``mac_j``, the non-spiking baseline on the same process. Neuron updates, memory traffic and
    routing are not counted: a lower bound per operation, as in the papers these figures come from.
    """
    if hardware not in OP_ENERGY:
        raise ValueError(f"hardware={hardware!r}; choose one of {', '.join(OP_ENERGY)}")
    ref = OP_ENERGY[hardware]
    e_syn = ref["synop_j"] if synop_j is None else synop_j
    e_mac = ref["mac_j"] if mac_j is None else mac_j
    per_image = ops["synops_per_image"] * e_syn + ops["macs_per_image"] * e_mac
    custom = synop_j is not None or mac_j is not None
    return {
        "energy_per_image_j": per_image, "energy_j": per_image * images, "images": images,
        "dense_energy_per_image_j": ops["dense_macs_per_image"] * e_mac,
        "synops_per_image": ops["synops_per_image"], "macs_per_image": ops["macs_per_image"],
        "synop_j": e_syn, "mac_j": e_mac,
        "source": f"estimate:{hardware}{'+custom' if custom else ''}",
        "citation": ref["citation"] + ("; per-op energy overridden" if custom else ""),
    }
