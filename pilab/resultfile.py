"""A run's result on disk: ``result.json``, small and readable (config, summary, per-epoch records,
environment), and its per-step series in ``result.steps.npz`` beside it. This module alone writes and
reads the pair::

    from pilab import resultfile
    resultfile.save(result, "runs/x/result.json")  # runs/x/result.steps.npz, then runs/x/result.json
    r = resultfile.load("runs/x/result.json")      # the dict again: r["steps"]["loss"] is a list
    resultfile.files("runs/x/result.json")         # both paths: what a run leaves, copies, removes

In ``result.json`` the key ``steps`` names the other file, its SHA-256 (a pair copied apart, or one half
replaced, is refused rather than mixed), the number of steps and the series in their order. The per-step
file opens in numpy alone (``numpy.load``); its layout is below.

Why this form. A 10-epoch run at np=1 logs 8 series of 15,620 steps; as JSON text each value takes ~19
characters, 1.9 MB a run, and every committed run made every clone heavier. What the numbers are decides
how they are kept:

- ``loss`` and ``lr`` stay float64, bit for bit: resumed and re-run runs are compared with them exactly.
- The timings (``compute``, ``comm``, ``comm_exposed``, ``data``, ``comm_wait``) are whole microseconds
  (int64, series ``<name>_us``): a step's clock readings on a shared CPU, around Python code, mean nothing
  below that, and the trace file (Chrome's format) counts in microseconds too. The per-epoch sums in
  ``result.json`` keep their full precision.
- ``time`` is not stored: a step's time is its data + compute + exposed communication by construction
  (both backends read one clock at the three boundaries), so the reader adds them up (within 2 us of
  the measured sum). A run where that does not hold keeps its own ``time_us``.
- Each series is stored byte-stream-split (the k-th byte of every value side by side: HDF5's shuffle
  filter, Parquet's BYTE_STREAM_SPLIT), then LZMA-compressed as a zip member: a float's sign, exponent
  and leading mantissa bytes barely change from step to step and compress to almost nothing. A smooth
  series (the learning rate's schedule) is kept as the second difference of its values' bits read as
  int64 where that compresses smaller (member ``<name>.d2``; two cumulative sums give it back exactly).
  A member is a ``.npy`` of uint8 shaped (8, steps); ``np.ascontiguousarray(z["loss"].T).view("<f8")
  .ravel()`` is the series (``"<i8"`` for a ``_us`` one; for ``.d2``, ``np.cumsum`` twice over the
  ``"<i8"`` view, then ``.view("<f8")``).

A 10-epoch np=1 run (15,620 steps) is 118-137 KB so, result.json ~8 KB of it (as JSON: 1.9 MB); the lr's
second difference takes the largest from 181 KB to 137 KB. Not chosen: Parquet (pyarrow, ~100 MB
installed, for 10 lines of numpy), HDF5 (h5py's gzip + shuffle: ~160 KB), ``numpy.savez_compressed``
(deflate, no byte split: ~250 KB), float32 timings (~40 KB more per series than microseconds). Without
Python's lzma module the members are deflated instead; ``numpy.load`` reads either.

Results written before this form (the series inline in result.json) are refused with the command that
converts them once (``scripts/convert_results.py``); this module does not read them.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile

from .files import atomic_write, save_json

__all__ = ["save", "load", "files", "sidecar", "ResultFileError", "OldFormError", "SECONDS"]

# The per-step series that are seconds (kept as whole microseconds); any other series is kept as float64.
SECONDS = ("time", "compute", "comm", "comm_exposed", "data", "comm_wait")
# a step's time, as the backends measure it: the sum of these
_TIME_PARTS = ("compute", "comm_exposed", "data")
_US = "_us"
_D2 = ".d2"
CONVERT = "python scripts/convert_results.py"

try:
    import lzma  # noqa: F401 -- CPython built without liblzma lacks it
    _COMPRESSION = zipfile.ZIP_LZMA
except ImportError:  # pragma: no cover
    _COMPRESSION = zipfile.ZIP_DEFLATED


class ResultFileError(ValueError):
    """A result file pilab cannot read (the message is one line: the problem and the fix)."""


class OldFormError(ResultFileError):
    """A result written before result.steps.npz: its owner converts it once (the message says how); a
    study does not take it for a missing point and run it again."""


def sidecar(path: str) -> str:
    """The per-step file of the result at ``path``: ``x/result.json`` -> ``x/result.steps.npz``."""
    stem = path[:-5] if path.endswith(".json") else path
    return stem + ".steps.npz"


def files(path: str) -> list[str]:
    """The files of the result at ``path``: result.json and its per-step file (a run's own, kept,
    copied and removed together)."""
    return [path, sidecar(path)]


def save(result: dict, path: str) -> None:
    """Write ``result`` (a run's result as the engine returns it, ``steps`` a dict of per-step lists) as
    ``path`` and its per-step file beside it, each atomically; the per-step file first, so a
    ``result.json`` never names one that is not there. A result without ``steps`` is ``path`` alone."""
    steps = result.get("steps")
    if steps is None:
        save_json(result, path)
        return
    if not isinstance(steps, dict) or _is_ref(steps):
        raise ResultFileError(f"{path}: the result to save has no per-step series (read it with "
                              "pilab.resultfile.load, which brings them back, before saving it)")
    blob = _encode(steps)
    npz = sidecar(path)
    atomic_write(npz, lambda tmp: _write_bytes(tmp, blob), durable=True)  # on the disk before result.json names it
    count = len(next(iter(steps.values()), []))
    ref = {"file": os.path.basename(npz), "sha256": hashlib.sha256(blob).hexdigest(), "count": count,
           "series": list(steps)}
    save_json({**result, "steps": ref}, path)


def load(path: str) -> dict:
    """The result at ``path`` with its per-step series read back (lists of floats, as the engine returned
    them; timings to the microsecond). ``ResultFileError`` for a result written before this form, a
    per-step file that is missing or not this result's, and a file that is not a result; ``OSError``
    where ``path`` cannot be read."""
    with open(path) as f:
        try:
            result = json.load(f)
        except json.JSONDecodeError as e:
            raise ResultFileError(f"{path} is not JSON ({e}); it is not a pilab result") from None
    if not isinstance(result, dict):
        raise ResultFileError(f"{path} is not a pilab result (a JSON object)")
    steps = result.get("steps")
    if steps is None:
        return result
    if not _is_ref(steps):
        raise OldFormError(f"{path} keeps its per-step series inside (the result form before "
                              f"result.steps.npz); convert it once with `{CONVERT} {path}`")
    npz = os.path.join(os.path.dirname(path), steps["file"])
    try:
        with open(npz, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise ResultFileError(f"{npz} is missing: {path} keeps its per-step series there; copy it beside "
                              "result.json (a result is both files)") from None
    if hashlib.sha256(blob).hexdigest() != steps["sha256"]:
        raise ResultFileError(f"{npz} is not the per-step file {path} was written with (its SHA-256 "
                              "differs); copy the two files of one run together")
    return {**result, "steps": _decode(blob, steps["series"])}


def _is_ref(steps) -> bool:
    return isinstance(steps, dict) and {"file", "sha256", "series"} <= set(steps)


def _write_bytes(path: str, blob: bytes) -> None:
    with open(path, "wb") as f:
        f.write(blob)


def _series(steps: dict) -> dict:
    """{name: typed array}: float64 series as they are, timings in whole microseconds (``<key>_us``),
    ``time`` left out where it is the sum of its parts."""
    import numpy as np
    out = {}
    for k, v in steps.items():
        a = np.asarray(v, dtype=np.float64)
        if k in SECONDS and np.isfinite(a).all() and (a.size == 0 or np.abs(a).max() < 2.0 ** 52 / 1e6):
            out[k + _US] = np.rint(a * 1e6).astype("<i8")
        else:
            out[k] = a.astype("<f8")
    if "time" + _US in out and all(k + _US in out for k in _TIME_PARTS):
        t = np.asarray(steps["time"], dtype=np.float64)
        if np.all(np.abs(t - np.sum([steps[k] for k in _TIME_PARTS], axis=0)) < 1e-6):
            del out["time" + _US]
    return out


def _planes(a):
    """The byte-stream split of ``a``: uint8 (itemsize, n), the k-th byte of every value in row k."""
    import numpy as np
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T)


def _smallest(name: str, a):
    """(member name, uint8 planes): the series itself, or its second difference (``<name>.d2``, over
    the values' bits as int64: exact, and a smooth curve such as the learning rate's becomes small
    integers), whichever compresses smaller."""
    import lzma
    import numpy as np
    bits = a.view("<i8")
    d2 = np.diff(np.diff(bits, prepend=np.int64(0)), prepend=np.int64(0))  # int64 wraps: exact both ways
    plain, delta = _planes(a), _planes(d2)
    if len(lzma.compress(delta.tobytes())) < len(lzma.compress(plain.tobytes())):
        return name + _D2, delta
    return name, plain


def _encode(steps: dict) -> bytes:
    """The per-step file's bytes: each series byte-stream-split, a ``.npy`` member of an LZMA zip; the
    same series make the same bytes (fixed member dates)."""
    import numpy as np
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, a in _series(steps).items():
            name, planes = _smallest(name, a) if _COMPRESSION == zipfile.ZIP_LZMA else (name, _planes(a))
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = _COMPRESSION
            with z.open(info, "w") as f:
                np.lib.format.write_array(f, planes, allow_pickle=False)
    return buf.getvalue()


def _unpack(name: str, planes):
    """(series name, values as float64 or int64 microseconds) of one member."""
    import numpy as np
    v = np.ascontiguousarray(planes.T).view("<i8").ravel()
    if name.endswith(_D2):
        name, v = name[:-len(_D2)], np.cumsum(np.cumsum(v))
    return name, (v if name.endswith(_US) else v.view("<f8"))


def _decode(blob: bytes, series: list) -> dict:
    import numpy as np
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        arrays = dict(_unpack(name, z[name]) for name in z.files)
    out = {}
    for k in series:
        if k in arrays:
            out[k] = arrays[k].tolist()
        elif k + _US in arrays:
            out[k] = (arrays[k + _US] / 1e6).tolist()
        elif k == "time":  # the sum of its parts (see the module docstring)
            out[k] = (sum(arrays[p + _US] for p in _TIME_PARTS) / 1e6).tolist()
        else:
            raise ResultFileError(f"the per-step file has no series {k!r}; it is damaged: run again")
    return out
