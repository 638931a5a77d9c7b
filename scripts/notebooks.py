"""Run the notebooks in small mode and commit what a reader should see: ``./lab.sh notebooks``.

Each ``notebooks/*.ipynb`` (or the ones named) is executed top to bottom with nbclient in a temporary
copy of ``notebooks/`` (the notebook and the files beside it) (what the notebook writes, e.g. ``runs/nb02/``, stays there), with
``PILAB_NB_SMALL=1`` as on Binder and in the suite, then written back with its outputs, less what varies
from run to run or cannot be shown outside a live kernel:

- the BokehJS loader (1.6 MB of JavaScript a live page needs; ``plots.setup_notebook``),
- widget views (the control panel, progress bars, Bokeh figures as jupyter_bokeh widgets): a static
  page cannot draw them, so each becomes one line saying so, and no widget state is stored,
- execution timestamps, absolute paths (the temporary copy's, the repository's, the home directory)
  and process ids.

A rerun without changes then differs only in numbers that depend on the machine's speed (the tables'
times). ``tests/test_notebooks.py`` runs the same notebooks under nbval against these outputs.

    python scripts/notebooks.py                 # all of notebooks/*.ipynb
    python scripts/notebooks.py 02_strong_scaling.ipynb
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(REPO, "notebooks")
CELL_TIMEOUT_S = 3600  # a hang guard only: a small-mode notebook takes minutes on a loaded box
BOKEH_LOAD = "application/vnd.bokehjs_load.v0+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FIGURE_NOTE = "(an interactive Bokeh figure: it is drawn when the notebook runs in Jupyter)"
WIDGET_NOTE = "(a widget: it is shown when the notebook runs in Jupyter)"


def scrub_text(text: str, roots: list[str]) -> str:
    """Absolute paths and process ids out of an output's text."""
    for root in roots:
        text = text.replace(root + os.sep, "").replace(root, ".")
    text = re.sub(r"\bpid \d+", "pid N", text)
    text = re.sub(r"\bpids \[\d[\d, ]*\]", "pids [N]", text)
    return re.sub(r"\bpid=\d+", "pid=N", text)


def _scrub_output(out: dict, roots: list[str]) -> dict | None:
    data = out.get("data", {})
    if BOKEH_LOAD in data or ("application/javascript" in data and "Bokeh" in data["application/javascript"]):
        return None
    if WIDGET_VIEW in data:
        plain = data.get("text/plain", "")
        note = FIGURE_NOTE if plain.startswith("BokehModel(") else WIDGET_NOTE
        return nbformat.v4.new_output("display_data", data={"text/plain": note})
    if out.get("output_type") == "stream":
        out["text"] = scrub_text(out["text"], roots)
    for mime in ("text/plain", "text/html", "text/markdown"):
        if mime in data:
            data[mime] = scrub_text(data[mime] if isinstance(data[mime], str) else "".join(data[mime]), roots)
    if out.get("output_type") in ("display_data", "execute_result"):  # %%px's: engine uuids, timestamps
        out["metadata"] = {}
    return out


def sanitize(nb, roots: list[str]):
    """The executed notebook as it is committed (see the module docstring)."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        outs = [_scrub_output(o, roots) for o in cell.outputs]
        cell.outputs = [o for o in outs if o is not None]
    return nb


def run(path: str) -> float:
    """Execute one notebook in a temporary copy of notebooks/ and write it back sanitised; seconds taken."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="pilab-nb-") as tmp:
        t0 = time.monotonic()
        for name in os.listdir(NOTEBOOKS):  # the files a notebook uses beside it (e.g. 06's mynet.py)
            if os.path.isfile(os.path.join(NOTEBOOKS, name)) and not name.endswith(".ipynb"):
                shutil.copy(os.path.join(NOTEBOOKS, name), tmp)
        env = dict(os.environ, PILAB_NB_SMALL="1")
        env.pop("PILAB_NB_LIVE_EPOCHS", None)
        os.environ.update(PILAB_NB_SMALL="1")  # the kernel inherits this process's environment
        client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": tmp}}, record_timing=False)
        client.execute()
        roots = [tmp, os.path.realpath(tmp), REPO, os.path.expanduser("~")]
        sanitize(nb, roots)
    nbformat.write(nb, path)
    return time.monotonic() - t0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--sanitize-only"]:  # re-apply the rules above to committed outputs, running nothing
        for path in argv[1:]:
            nbformat.write(sanitize(nbformat.read(path, as_version=4), [REPO, os.path.expanduser("~")]), path)
        return 0
    names = argv or sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))
    for name in names:
        path = name if os.path.sep in name else os.path.join(NOTEBOOKS, name)
        print(f"[pilab] running {os.path.relpath(path, REPO)} (small mode)", flush=True)
        s = run(path)
        print(f"[pilab] wrote {os.path.relpath(path, REPO)} with its outputs ({s:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
