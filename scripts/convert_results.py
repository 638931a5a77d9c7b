"""Convert results written before ``result.steps.npz`` (every per-step series inside result.json) to the
form pilab reads (:mod:`pilab.resultfile`), in place, and prove that no number changed.

    python scripts/convert_results.py experiments/paper-batch/cpu        # every old-form result.json under it
    python scripts/convert_results.py runs/x/result.json --data ../shared/data/cifar10-jpeg.tar.gz
    python scripts/convert_results.py --verify 65efd4b experiments       # each rewritten file against git

``convert`` rewrites each old-form ``result.json`` as result.json + result.steps.npz (a result already in
the new form is left as it is, but for ``--data``), then brings each ``study.json`` under the folders given up to date (its
references carry each point's SHA-256). ``--data SPELLING``: a config whose ``data`` names the same file
as SPELLING (an absolute path, ``/work/main/../shared/...``) records SPELLING instead, in result.json and
in a ``results.jsonl`` beside it, so that one archive reads as one data set (the data set's digest is in
each result's ``data.checksum``).

``--verify REV`` reads every result.json, study.json and results.jsonl under the folders as git has them at
REV and as they are now, and compares every number: equal bit for bit, but the per-step timings, which the
new form keeps to the microsecond (a step's ``time``, the sum of its parts, within 2 us); and every
string, but the data spellings and SHA-256 references the conversion changes. It prints the counts and the
largest differences; exit 1 on any other difference.

A one-off tool, kept while runs started before the new form still finish in the old one: pilab itself
does not read the old form.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pilab import resultfile  # noqa: E402
from pilab.files import save_json, sha256_file  # noqa: E402

TIMINGS = set(resultfile.SECONDS)


def _walk(paths: list[str], name: str) -> list[str]:
    out = []
    for p in paths:
        if os.path.isfile(p):
            out += [p] if os.path.basename(p) == name else []
            continue
        for root, _, names in os.walk(p):
            out += [os.path.join(root, n) for n in names if n == name]
    return sorted(out)


def _old_form(path: str) -> dict | None:
    with open(path) as f:
        r = json.load(f)
    steps = r.get("steps") if isinstance(r, dict) else None
    return r if isinstance(steps, dict) and not {"file", "sha256"} <= set(steps) else None


def _respell(config: dict, spelling: str | None) -> bool:
    """Put ``spelling`` in ``config["data"]`` where it names the same file; True if it changed."""
    d = config.get("data")
    if not spelling or not isinstance(d, str) or d == spelling or not os.path.isfile(d):
        return False
    if os.path.isfile(spelling) and os.path.samefile(d, spelling):
        config["data"] = spelling
        return True
    return False


def convert(paths: list[str], spelling: str | None) -> None:
    done = respelled = 0
    for path in _walk(paths, "result.json"):
        r = _old_form(path)
        if r is None:  # already in the new form: only its data spelling, if asked (lossless: see verify)
            try:
                r = resultfile.load(path)
            except resultfile.ResultFileError as e:
                sys.exit(f"convert_results: {e}")
            if _respell(r.get("config") or {}, spelling):
                resultfile.save(r, path)
                respelled += 1
            continue
        respelled += _respell(r.get("config") or {}, spelling)
        resultfile.save(r, path)
        done += 1
    for path in _walk(paths, "results.jsonl"):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        n = sum(_respell(row.get("config") or {}, spelling) for row in rows)
        if n:
            with open(path, "w") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows))
            print(f"{path}: data spelled {spelling} in {n} rows")
    studies = 0
    for path in _walk(paths, "study.json"):
        with open(path) as f:
            st = json.load(f)
        runs = st.get("runs") or {}
        changed = False
        for run in runs.values():
            if isinstance(run, dict) and "file" in run and "sha256" in run:
                target = os.path.join(os.path.dirname(path), run["file"])
                if os.path.exists(target) and sha256_file(target) != run["sha256"]:
                    run["sha256"] = sha256_file(target)
                    changed = True
        if changed:
            save_json(st, path)
            studies += 1
    print(f"converted {done} result.json ({respelled} with the data spelled {spelling}); "
          f"{studies} study.json brought up to date")


# ------------------------------------------------------------------------------------------------------
# the proof
# ------------------------------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.numbers = self.exact = self.strings = 0
        self.timing = {"values": 0, "max_us": 0.0, "time_values": 0, "time_max_us": 0.0}
        self.allowed: dict[str, int] = {}
        self.wrong: list[str] = []

    def allow(self, what: str) -> None:
        self.allowed[what] = self.allowed.get(what, 0) + 1


def _same_number(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or type(a) is not type(b):
        return a == b and type(a) is type(b)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _compare(old, new, where: str, t: Tally, allow) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        if set(old) != set(new):
            t.wrong.append(f"{where}: keys {sorted(set(old) ^ set(new))} differ")
        for k in old.keys() & new.keys():
            _compare(old[k], new[k], f"{where}/{k}", t, allow)
    elif isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            t.wrong.append(f"{where}: {len(old)} values, now {len(new)}")
        for i, (a, b) in enumerate(zip(old, new)):
            _compare(a, b, f"{where}[{i}]", t, allow)
    elif isinstance(old, (int, float)) and not isinstance(old, bool):
        t.numbers += 1
        if _same_number(old, new):
            t.exact += 1
        else:
            t.wrong.append(f"{where}: {old!r} -> {new!r}")
    else:
        t.strings += 1
        if old != new:
            what = allow(where, old, new)
            if what:
                t.allow(what)
            else:
                t.wrong.append(f"{where}: {old!r} -> {new!r}")


def _steps(old: dict, new: dict, where: str, t: Tally) -> None:
    if list(old) != list(new):
        t.wrong.append(f"{where}/steps: series {list(old)} -> {list(new)}")
    for k in old:
        a, b = old[k], new.get(k, [])
        if len(a) != len(b):
            t.wrong.append(f"{where}/steps/{k}: {len(a)} values, now {len(b)}")
            continue
        if k not in TIMINGS:
            for i, (x, y) in enumerate(zip(a, b)):
                t.numbers += 1
                if _same_number(float(x), y):
                    t.exact += 1
                else:
                    t.wrong.append(f"{where}/steps/{k}[{i}]: {x!r} -> {y!r}")
            continue
        worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0) * 1e6
        key = "time" if k == "time" else ""
        t.timing[key + ("_" if key else "") + "values"] += len(a)
        t.timing[key + ("_" if key else "") + "max_us"] = max(t.timing[key + ("_" if key else "") + "max_us"], worst)
        if worst > (2.0 if k == "time" else 0.5) + 1e-6:
            t.wrong.append(f"{where}/steps/{k}: differs by {worst:.3f} us")


def _git(rev: str, path: str) -> str | None:
    p = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else None


def verify(rev: str, paths: list[str]) -> int:
    t = Tally()
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()

    def rel(p):
        return os.path.relpath(os.path.abspath(p), repo)

    def data_spelling(where, old, new):
        return "config.data respelled" if where.endswith("/config/data") else None

    files = {"result.json": 0, "study.json": 0, "results.jsonl": 0}
    for path in _walk(paths, "result.json"):
        text = _git(rev, rel(path))
        if text is None:
            t.wrong.append(f"{path}: not in {rev}")
            continue
        old, new = json.loads(text), resultfile.load(path)
        files["result.json"] += 1
        _steps(old.pop("steps"), new.pop("steps"), path, t)
        _compare(old, new, path, t, data_spelling)
    for path in _walk(paths, "study.json"):
        text = _git(rev, rel(path))
        files["study.json"] += 1
        _compare(json.loads(text), json.load(open(path)), path, t,
                 lambda where, o, n: "study.json run sha256 updated" if where.endswith("/sha256") else None)
    for path in _walk(paths, "results.jsonl"):
        text = _git(rev, rel(path))
        old = [json.loads(x) for x in text.splitlines() if x.strip()]
        new = [json.loads(x) for x in open(path) if x.strip()]
        files["results.jsonl"] += 1
        _compare(old, new, path, t, data_spelling)
    print(f"verify against {rev}: {files['result.json']} result.json, {files['study.json']} study.json, "
          f"{files['results.jsonl']} results.jsonl")
    print(f"  numbers: {t.numbers} compared, {t.exact} equal bit for bit (loss and lr of every step included)")
    print(f"  per-step timings: {t.timing['values']} values, largest difference {t.timing['max_us']:.3f} us "
          f"(kept to the microsecond); step time: {t.timing['time_values']} values, largest difference "
          f"{t.timing['time_max_us']:.3f} us (the sum of its parts)")
    print(f"  strings: {t.strings} compared; changed as intended: "
          + (", ".join(f"{k} x{v}" for k, v in sorted(t.allowed.items())) or "none"))
    for w in t.wrong[:20]:
        print(f"  DIFFERENT: {w}")
    print(f"  {len(t.wrong)} other differences")
    return 1 if t.wrong else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="result.json files, or folders searched for them")
    p.add_argument("--data", help="record this spelling of the data path where a config names the same file")
    p.add_argument("--verify", metavar="REV", help="compare the files with git's at REV instead of converting")
    a = p.parse_args(argv)
    if a.verify:
        return verify(a.verify, a.paths)
    convert(a.paths, a.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
