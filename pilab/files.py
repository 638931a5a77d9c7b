"""Writing results so that a reader never sees half a file: temporary file + rename, JSON helpers.

    from pilab.files import save_json, load_json
    save_json({"np": 2}, "runs/x/study.json")      # creates runs/x/, replaces the file atomically

JSON is written compactly: one key per line, but a list of plain values on one line. A run's result is
two files, written and read by ``pilab.resultfile`` (its per-step series are not JSON).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable


__all__ = ["atomic_write", "atomic_write_text", "temp_name", "save_json", "load_json", "dumps", "sha256_file", "sha256_tree"]


def temp_name(path: str) -> str:
    """Where ``atomic_write`` writes ``path`` first: a hidden name beside it, this process's, with the same
    extension (a writer that picks the format from it, such as matplotlib's, writes the right one);
    a process that must leave at once removes it (``pilab.engine.records``), and the data cache
    recognises its own leftovers by the ``.tmp-`` prefix (``pilab.data.cache``)."""
    d, base = os.path.split(path)
    return os.path.join(d, f".tmp-{base}-{os.getpid()}{os.path.splitext(base)[1]}")


def atomic_write(path: str, write: Callable[[str], Any], *, durable: bool = False) -> None:
    """Call ``write(tmp)`` on a temporary path in the same directory, then rename it over ``path``.

    The rename is atomic on POSIX: ``path`` holds the old content or the new, never a mix; a failed
    write (disk full, an exception) leaves the old file untouched and no temporary behind. ``durable``:
    the file's bytes reach the disk before the rename, and the rename itself after it (a checkpoint
    survives a power cut), at the price of two fsyncs::

        atomic_write("out/x.bin", lambda tmp: open(tmp, "wb").write(data), durable=True)
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = temp_name(path)
    try:
        write(tmp)
        if durable:
            _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
        if durable:
            _fsync(os.path.dirname(os.path.abspath(path)), os.O_RDONLY, quiet=True)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _fsync(path: str, flags: int, *, quiet: bool = False) -> None:
    """fsync a file or directory by path; ``quiet``: where a directory cannot be synced, go on."""
    try:
        fd = os.open(path, flags)
    except OSError:
        if quiet:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not quiet:
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str, *, mode: int | None = None) -> None:
    """``text`` into ``path`` atomically; ``mode``: its permission bits (e.g. 0o755 for a script)."""
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
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


def _scalar(o) -> bool:
    return o is None or isinstance(o, (str, int, float, bool))


def dumps(obj, *, indent: int | None = 1) -> str:
    """``obj`` as JSON text: objects and lists of objects indented by ``indent``, a list of plain values
    (numbers, strings, booleans, None) on one line; ``json.loads`` reads back the same value::

        dumps({"np": 2, "loss": [2.3, 2.1]})     # '{\n "np": 2,\n "loss": [2.3, 2.1]\n}'
    """
    if indent is None:
        return json.dumps(obj, default=_plain)
    enc = json.JSONEncoder(default=_plain)

    def walk(o, level: int) -> str:
        o = _plain(o) if not _scalar(o) and not isinstance(o, (dict, list, tuple)) else o
        if isinstance(o, dict) and o:
            pad = "\n" + " " * (indent * (level + 1))
            items = ",".join(f"{pad}{json.dumps({k: 0})[1:-4]}: {walk(v, level + 1)}"  # json's key rules
                             for k, v in o.items())
            return "{" + items + "\n" + " " * (indent * level) + "}"
        if isinstance(o, (list, tuple)) and o and not all(map(_scalar, o)):
            pad = "\n" + " " * (indent * (level + 1))
            return "[" + ",".join(pad + walk(v, level + 1) for v in o) + "\n" + " " * (indent * level) + "]"
        return enc.encode(o)
    return walk(obj, 0)


def save_json(obj, path: str, *, indent: int | None = 1, durable: bool = True) -> None:
    """``obj`` as JSON at ``path`` (atomically; compactly, see :func:`dumps`; numpy values become plain
    numbers and lists). ``durable`` (the default): on the disk before it replaces the old file, so a
    result.json survives a power cut as a checkpoint does (two fsyncs, milliseconds)."""
    text = dumps(obj, indent=indent)

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write, durable=durable)


def sha256_file(path: str) -> str:
    """The SHA-256 of the file's bytes, in hex (what a study records beside each point's result.json)."""
    return sha256_tree(path)[0]


def sha256_tree(path: str) -> tuple[str, int]:
    """(SHA-256 in hex, bytes read) of a file's bytes, or of a directory's files: each one's path relative
    to the directory, a NUL and its bytes, in sorted order. The data cache keys on it and the doctor
    compares it between hosts; an unreadable file raises ``OSError``::

        sha256_tree("data/my-imagefolder")   # ('9f2c...', 1843200)
    """
    import hashlib
    h, size = hashlib.sha256(), 0
    files = [path] if not os.path.isdir(path) else sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
    for f in files:
        if f != path:
            h.update(os.path.relpath(f, path).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
                size += len(block)
    return h.hexdigest(), size


def load_json(path: str):
    with open(path) as f:
        return json.load(f)
