"""The manual: the Sphinx site builds from docs/ with warnings as errors (a broken reference, a missing page,
a stale API name fails), offline, into HTML that needs no CDN; its results tables are the committed JSON's
numbers; its tutorial pages show the notebooks' committed outputs. And the README stays a short manual.

Also the static figures (pilab.plots.static): PNG and SVG with matplotlib, no browser; without matplotlib,
one line saying what to install and no file.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import skip_or_fail

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        import furo  # noqa: F401
        import myst_nb  # noqa: F401
        import sphinx  # noqa: F401
    except ImportError as e:
        skip_or_fail(f"{e.name} is not installed; install the docs extra: pip install -e '.[docs]' "
                     "(./lab.sh setup does)", "the manual must build")
    out = tmp_path_factory.mktemp("site")
    # offline: no proxy reachable, so a page or extension that fetched anything would fail here
    env = dict(os.environ, http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9",
               no_proxy="", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-W", "--keep-going", "-b", "html",
                           "-d", str(out / "doctrees"), "docs", str(out / "html")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the manual does not build with -W:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out / "html"


def _text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_every_page_is_built_and_linked(site):
    pages = {os.path.relpath(p, site) for p in glob.glob(str(site / "**" / "*.html"), recursive=True)}
    for want in ["index.html", "getting-started.html", "architecture.html", "api.html", "failures.html",
                 "cluster.html", "jupyter.html", "results/paper-size.html", "results/fast-but-wrong.html",
                 "results/fast-and-right.html", "tutorials/index.html"]:
        assert want in pages, (want, sorted(pages))
    for cmd in ["train", "simulate", "scale", "remedies", "compare", "perfmodel", "doctor", "testbed", "bench"]:
        assert f"guide/{cmd}.html" in pages, cmd
    # every guide page and notebook has its page (the glob toctrees pick up pages other work adds)
    for md in glob.glob(os.path.join(REPO, "docs", "guide", "*.md")):
        assert f"guide/{os.path.basename(md)[:-3]}.html" in pages, md
    for nb in glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")):
        assert f"tutorials/{os.path.basename(nb)[:-6]}.html" in pages, nb


def test_html_needs_no_network(site):
    """Works from file:// offline: no script, stylesheet or image from another host."""
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.I)
    for page in glob.glob(str(site / "**" / "*.html"), recursive=True):
        m = remote.search(_text(page))
        assert not m, f"{page}: {m.group(0)}"


def _cells(html: str, caption_source: str) -> list[list[str]]:
    """The rows of the generated table whose caption names ``caption_source``."""
    i = html.index(caption_source)
    start = html.rindex("<table", 0, i)
    table = html[start:html.index("</table>", start)]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r, re.S)]
            for r in rows]


def test_results_tables_are_the_committed_json(site):
    with open(os.path.join(REPO, "experiments", "paper-size", "compare.json")) as f:
        side = json.load(f)["paper"]
    rows = _cells(_text(site / "results" / "paper-size.html"), "experiments/paper-size/compare.json")
    head, body = rows[0], rows[1:]
    assert head[4:] == side["labels"]
    assert [int(r[0]) for r in body] == [r["np"] for r in side["rows"]]
    for cells, r in zip(body, side["rows"]):
        for label, cell in zip(side["labels"], cells[4:]):
            acc = r["studies"].get(label, {}).get("final_test_acc")
            assert cell == ("" if acc is None else f"{acc:.3f}"), (r["np"], label, cell, acc)

    with open(os.path.join(REPO, "experiments", "fast-but-wrong", "remedies", "full-test", "table.json")) as f:
        tab = json.load(f)
    rows = _cells(_text(site / "results" / "fast-and-right.html"), "full-test/table.json")
    shown = {(r[0], int(r[1])): r[2] for r in rows[1:]}
    assert len(shown) == len(tab["rows"])
    for r in tab["rows"]:
        assert shown[(r["label"], r["np"])].startswith(f"{r['acc_mean']:.3f}"), r["label"]

    rows = _cells(_text(site / "results" / "fast-but-wrong.html"), "experiments/fast-but-wrong/compare.json")
    assert [r[0] for r in rows[1:]] == ["naive", "linear", "linear+warmup", "sqrt+warmup"]


def test_tutorial_pages_show_the_committed_outputs(site):
    quick = _text(site / "tutorials" / "01_quickstart.html")
    assert "pilab-summary" in quick and "so it learned" in quick  # the closing paragraph, as committed
    assert "2 MPI engines" in quick                                # the engines' table
    study = _text(site / "tutorials" / "02_strong_scaling.html")
    assert "pilab-table" in study and "FAST-BUT-WRONG" in study
    assert re.search(r'<img[^>]+src="[^"]+\.png"', study), "the committed figure is not on the page"


def test_readme_is_a_short_manual():
    text = _text(os.path.join(REPO, "README.md"))
    assert len(text.splitlines()) <= 250
    dated = re.findall(r"\b20\d\d-\d\d-\d\d\b|\bcommit [0-9a-f]{7}\b|\bload (?:average )?~?\d", text)
    assert not dated, f"dated prose in the README (it belongs in an experiment's LOG.md): {dated}"
    assert text.index("./lab.sh demo") < text.index("## ", text.index("## ") + 1), "the two commands come first"
    assert "docs/demo-report.png" in text


# ---- figures without a browser -------------------------------------------------------------------
def _committed_study():
    from pilab.plots.static import study_with_runs

    return study_with_runs(os.path.join(REPO, "experiments", "testbed-scale", "study.json"))


def test_static_study_figure_is_png_and_svg(tmp_path):
    from pilab.plots import static

    png = static.write_study(_committed_study(), str(tmp_path / "report.png"))
    assert png == str(tmp_path / "report.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    svg = _text(tmp_path / "report.svg")
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "speedup" in svg
    assert sorted(os.listdir(tmp_path)) == ["report.png", "report.svg"]  # no temporary files left


def test_without_matplotlib_one_line_and_no_file(tmp_path):
    """matplotlib made unimportable in a fresh interpreter: the figure is skipped with one line naming
    what to install; nothing is written."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from pilab.plots import static\n"
            "import json\n"
            f"study = static.study_with_runs({os.path.join(REPO, 'experiments', 'testbed-scale', 'study.json')!r})\n"
            f"print(static.write_study(study, {str(tmp_path / 'report.png')!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib" in lines[0] and "pip install matplotlib" in lines[0], lines
    assert os.listdir(tmp_path) == []


def test_every_figure_names_the_command_that_regenerates_it():
    """Under each picture in the manual, the line that says which command made it."""
    command = re.compile(r"`(?:\./lab\.sh|python |bash |PILAB_\w+=\S+ python)[^`]*`")
    for md in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True):
        if "_build" in md:
            continue
        lines = _text(md).splitlines()
        for i, line in enumerate(lines):
            if line.startswith("!["):
                after = " ".join(lines[i + 1:i + 5])
                assert command.search(after), f"{os.path.relpath(md, REPO)}:{i + 1}: no command under {line[:80]}"


def _slug(heading: str) -> str:
    """MyST's anchor for a heading (myst_heading_anchors): lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_every_link_in_the_manual_leads_somewhere():
    """Relative links in docs/ (to pages, to repository files outside docs/, to headings) name a file that
    exists and, with #anchor, a heading it has: what -W checks for pages, checked for the rest too."""
    link = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
    bad = []
    for md in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True):
        if "_build" in md:
            continue
        text = re.sub(r"```.*?```", "", _text(md), flags=re.S)
        for target in link.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            if not os.path.exists(dest):
                bad.append(f"{os.path.relpath(md, REPO)}: {target} (no such file)")
            elif anchor and dest.endswith(".md"):
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", _text(dest), re.M)}
                if anchor not in slugs:
                    bad.append(f"{os.path.relpath(md, REPO)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


# ---- the reference: generated from the code at build time (docs/_ext/pilab_reference.py) -----------
def _all_parsers():
    """(name, parser) for every command and sub-command of ``pilab``."""
    import argparse

    from pilab.cli import build_parser

    todo, out = [("pilab", build_parser())], []
    while todo:
        name, p = todo.pop(0)
        out.append((name, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {n}", sub) for n, sub in a.choices.items()]
    return out


def test_reference_pages_list_every_option_setting_variable_and_exit_code(site):
    """What the parsers, Config, the environment registry and the exit-code table hold is on the built
    pages -- made when the manual is built, so a new option cannot be missing from it."""
    from dataclasses import fields

    from pilab.cli.common import EXIT_CODES
    from pilab.config import Config, allowed
    from pilab.envvars import VARS

    commands = _text(site / "reference" / "commands.html")
    for name, p in _all_parsers()[1:]:
        assert f'id="{name.replace(" ", "-")}"' in commands, name  # its section
        for a in p._actions:
            if not hasattr(a, "pilab_default") and a.dest != "help":  # Config's flags: on the Config page
                for opt in a.option_strings:
                    assert f">{opt}<" in commands, (name, opt)
    config = _text(site / "reference" / "config.html")
    for f in fields(Config):
        assert f">{f.name}<" in config and f">--{f.name.replace('_', '-')}" in config, f.name
        # Sphinx's smartquotes typesets "..." as an ellipsis: the page shows the rule as a reader sees it
        rule = allowed(f.name).replace(">", "&gt;").replace("<", "&lt;").replace("...", "\u2026")
        assert rule in config, (f.name, rule)
    env = _text(site / "reference" / "environment.html")
    assert all(f">{v.name}<" in env for v in VARS)
    codes = _text(site / "reference" / "exit-codes.html")
    assert all(f">{c}<" in codes for c, _ in EXIT_CODES if isinstance(c, int))


# ---- a manual a newcomer can read (issue 51 §4) --------------------------------------------------
def _manual_pages() -> list[str]:
    """README.md and every page under docs/ (not the build, not the tutorial copies sphinx makes)."""
    pages = [os.path.join(REPO, "README.md")]
    pages += sorted(p for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
                    if f"{os.sep}_build{os.sep}" not in p)
    return pages


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph of prose: blank-line separated, outside fenced blocks; a table,
    a heading or a list item's marker ends one (each list item is a paragraph of its own)."""
    out, cur, start, fenced = [], [], 0, False
    item = re.compile(r"^([-*+]|\d+\.)\s")
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith(("```", ":::")):
            fenced = not fenced
            if cur:
                out.append((start, " ".join(cur)))
                cur = []
            continue
        if fenced:
            continue
        if not s or s.startswith(("|", "#")) or item.match(s):
            if cur:
                out.append((start, " ".join(cur)))
                cur = []
            if item.match(s):
                start, cur = i, [s]
            continue
        if not cur:
            start = i
        cur.append(s)
    if cur:
        out.append((start, " ".join(cur)))
    return out


PAGE_LINES, PARAGRAPH_WORDS = 300, 150


def test_no_page_over_300_lines_and_no_paragraph_over_150_words():
    long = []
    for page in _manual_pages() + [os.path.join(REPO, "BENCHMARKS.md")]:  # the generated report too
        text = _text(page)
        name = os.path.relpath(page, REPO)
        if len(text.splitlines()) > PAGE_LINES:
            long.append(f"{name}: {len(text.splitlines())} lines (split it by what the reader wants)")
        for line, p in _paragraphs(text):
            if len(p.split()) > PARAGRAPH_WORDS:
                long.append(f"{name}:{line}: a paragraph of {len(p.split())} words")
    assert not long, "\n".join(long)
    # and the check sees a long paragraph where there is one
    assert [w for _, w in _paragraphs("intro\n\n" + "word " * 151 + "\n\n- an item\n")][1].count("word") == 151


# A lab notebook's marks in a page: an ISO date (not inside a file's name), a clock time (not a Slurm time
# limit), UTC, an issue number, a "sitting", a load figure, "this machine/box/VM", a quiet or busy box,
# "this session", CPU accounting of a run. Where they belong is an experiment's LOG.md.
DATED = re.compile(r"""(?<![\w-])20\d\d-[01]\d-[0-3]\d\b(?![\w.-]*\.(?:json|md|log|png|csv))
 | (?<!--time\ )(?<!--time=)(?<!MaxTime=)(?<!-t\ )(?<![\d:])\b[0-2]\d:[0-5]\d(?::[0-5]\d)?\b
 | \bUTC\b
 | \bissues?\ \#?\d+\b | \(\#\d+\)
 | \bsittings?\b
 | \bload(?:\ average)?s?\ (?:of\ |at\ |was\ |about\ |~)?\d | \bload\ average\b
 | \bthis\ (?:session|bench\ machine)\b | \bon\ this\ (?:2-core|x86|shared)\b | \bnothing\ else\ running\b
 | \btoday\b
 | \bthis\ (?:machine|box|vm)\b | \bquiet(?:er)?\ machine\b | \b\d-core\ box\b
 | \bs\ of\ CPU\b""", re.I | re.X)
DATED_AT_MOST = 10


def _dated_marks() -> list[str]:
    texts = [(os.path.relpath(p, REPO), _text(p)) for p in _manual_pages() + [os.path.join(REPO, "BENCHMARKS.md")]]
    for nb in sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb"))):
        cells = json.loads(_text(nb))["cells"]
        texts.append((os.path.relpath(nb, REPO),
                      "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    return [f"{name}:{i}: {m.group(0)!r}" for name, text in texts for i, line in enumerate(text.splitlines(), 1)
            for m in DATED.finditer(line)]


def test_dated_lab_notebook_marks_stay_in_the_logs():
    """README, docs/, BENCHMARKS.md and the notebooks' markdown say what to type and what it means; the dates,
    loads and sittings of the runs are in the experiments' LOG.md (issue 51: 134 of them by this regex
    before, at most 10 now). The regex finds what it is for: a planted line is counted."""
    marks = _dated_marks()
    assert len(marks) <= DATED_AT_MOST, f"{len(marks)} dated marks (at most {DATED_AT_MOST}):\n" + "\n".join(marks)
    planted = "Measured 2026-12-05 at 08:16 UTC on this machine (load average 3.3), issue 39's sitting."
    assert len(DATED.findall(planted)) == 7
    assert not DATED.findall("--time 02:00:00, MaxTime=04:00:00, bench_network-2026-12-03.json, `--target this`")


def test_benchmarks_md_is_generated_from_the_committed_runs(tmp_path):
    """BENCHMARKS.md is made by one command from the runs committed under benchmarks/results/, never by
    hand: the committed file is what that command makes of them."""
    cmd = [sys.executable, "-m", "pilab", "bench", "--from", "benchmarks/results", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    made = (tmp_path / "BENCHMARKS.md").read_text(encoding="utf-8").replace(f"--out {tmp_path}", "--out .")
    assert "Made by `python -m pilab bench --from benchmarks/results --out .`" in made
    assert _text(os.path.join(REPO, "BENCHMARKS.md")) == made, "BENCHMARKS.md differs from what `python -m " \
        "pilab bench --from benchmarks/results --out .` makes: rerun that command (or record the run you meant to)"


def test_the_study_pilab_reproduces_is_cited_and_pilab_has_a_citation_file():
    import yaml
    cff = yaml.safe_load(_text(os.path.join(REPO, "CITATION.cff")))
    assert cff["cff-version"] == "1.2.0" and cff["title"].startswith("pilab") and cff["authors"]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        import tomllib
        assert cff["version"] == tomllib.load(f)["project"]["version"]
    study = cff["references"][0]
    assert study["doi"] == "10.5120/ijca2025925727" and study["year"] == 2025
    for page in ("README.md", os.path.join("docs", "index.md")):
        text = " ".join(_text(os.path.join(REPO, page)).split())  # as read, not as wrapped
        for fact in ("Papakyriakou", "Barbounakis", study["title"], "International Journal of Computer Applications",
                     "187(41)", "2025", study["doi"], "9.99", "41.6%", "90.9%", "52.3%"):
            assert fact in text, (page, fact)


def test_the_pages_show_one_demo_table_and_its_reuse_example_reuses():
    """README and getting-started show the same table for `./lab.sh demo`; the --reuse example in both reuses
    the first study's np=1 point (the same training: the sqrt rule leaves np=1's lr as it is)."""
    def table(page):
        text = _text(os.path.join(REPO, page))
        start = text.index("  np      kind")
        return text[start:text.index("```", start)]
    assert table("README.md") == table(os.path.join("docs", "getting-started.md"))
    from pilab.cli import build_parser
    from pilab.cli.common import config_from_args
    from pilab.cli.scale import defaults
    from pilab.study.points import same_training
    for page in ("README.md", os.path.join("docs", "getting-started.md")):
        text = _text(os.path.join(REPO, page)).replace("\\\n", " ")
        first, second = re.findall(r"python -m pilab (scale --nps 1,2 --simulate-nps 8,48 [^\n#]*)", text)[:2]
        assert "--reuse runs/s" in second, (page, second)
        a, b = (config_from_args(build_parser().parse_args(c.split()), defaults()) for c in (first, second))
        assert same_training(a.to_dict(), b, 1) and not same_training(a.to_dict(), b, 2), page
