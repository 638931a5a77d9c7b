"""Writing results so that a reader never sees half a file: temporary file + rename, JSON helpers.

    from pilab.files import save_json, load_json
    save_json({"np": 2}, "runs/x/result.json")     # creates runs/x/, replaces the file atomically
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable


__all__ = ["atomic_write", "atomic_write_text", "save_json", "load_json"]


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """Call ``write(tmp)`` on a temporary path in the same directory, then rename it over ``path``.

    The rename is atomic on POSIX: ``path`` holds the old content or the new, never a mix; a failed
    write (disk full, an exception) leaves the old file untouched and no temporary behind."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write)


def _plain(o):
    """JSON for numpy scalars and arrays (metrics reduced with MPI come back as numpy values)."""
    # Looked up, not imported (this module is loaded by `--help`): a numpy value exists only if numpy is.
    np = sys.modules.get("numpy")
    if np is not None and isinstance(o, np.generic):
        return o.item()
    if np is not None and isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def save_json(obj, path: str, *, indent: int | None = 1) -> None:
    """``obj`` as JSON at ``path`` (atomically; numpy values become plain numbers and lists)."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent, default=_plain)
    atomic_write(path, write)


def load_json(path: str):
    with open(path) as f:
        return json.load(f)
