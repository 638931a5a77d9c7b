"""Sphinx configuration of pilab's manual: ``./lab.sh docs`` builds it into docs/_build/html.

Sphinx with MyST (Markdown pages) and MyST-NB (the notebooks as tutorial pages, with the outputs committed
in them: nothing is executed here) -- the scientific-Python ecosystem's documentation tool, whose autodoc
reads pilab's docstrings. The build is offline and its HTML works from file:// (no CDN: no MathJax, no
widget manager). The results pages' tables are made here, at build time, from the committed JSON under
experiments/ (docs/_ext/pilab_results.py), and the reference's lists -- every command's options, every
Config setting, every environment variable, the exit codes -- from the code (docs/_ext/pilab_reference.py,
which says why it is ours and not sphinx-argparse).
"""
import os
import shutil
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(DOCS, "_ext"))

project = "pilab"
author = "pilab contributors"
copyright = "pilab contributors, MIT licence"

extensions = ["myst_nb", "sphinx.ext.autodoc", "pilab_results", "pilab_reference"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"          # the committed outputs are the ones shown (./lab.sh notebooks makes them)
nb_ipywidgets_js = {}              # no widget manager from a CDN: the committed notebooks store no widget state
nb_merge_streams = True
# mystnb.unknown_mime_type: a notebook's application/vnd.* outputs with no static form.
# myst.xref_missing: MyST cannot link a page to a file of the repository outside docs/ (an experiment's
# README or LOG.md, a notebook), which pages do on purpose; such a link shows as its text. Links are checked
# instead by tests/test_docs.py, which fails on one whose file or heading does not exist.
suppress_warnings = ["mystnb.unknown_mime_type", "myst.xref_missing"]

html_theme = "furo"
html_title = "pilab"
html_static_path = []
html_copy_source = False
# no MathJax (it comes from a CDN); the pages use no LaTeX math
mathjax_path = "NO-MATHJAX.js"

autodoc_member_order = "bysource"
autodoc_typehints = "none"         # signatures as written; the docstrings say the types that matter
autodoc_default_options = {"members": False}

exclude_patterns = ["_build", "**/.ipynb_checkpoints", "notebooks/*.png"]


def _copy_notebooks(app):
    """notebooks/*.ipynb into docs/tutorials/ (ignored by git): MyST-NB reads sources inside docs/ only.
    Every notebook there becomes a tutorial page (docs/tutorials/index.md lists them by a glob)."""
    src = os.path.join(REPO, "notebooks")
    dst = os.path.join(DOCS, "tutorials")
    wanted = sorted(n for n in os.listdir(src) if n.endswith(".ipynb"))
    for name in os.listdir(dst):
        if name.endswith(".ipynb") and name not in wanted:
            os.remove(os.path.join(dst, name))
    for name in wanted:
        a, b = os.path.join(src, name), os.path.join(dst, name)
        if not os.path.exists(b) or open(a, "rb").read() != open(b, "rb").read():
            shutil.copyfile(a, b)


def setup(app):
    app.connect("builder-inited", _copy_notebooks)

