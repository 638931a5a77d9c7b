"""The results pages' tables, made at build time from the committed JSON under experiments/ (never copied
by hand into the pages): a page says

    ```{pilab-table} experiments/paper-size/compare.json
    :kind: paper-size
    ```

and the build reads that file and writes the table. A file that is missing, or that lacks what a table
needs, fails the build (with -W, the suite's and ``./lab.sh docs``'s setting) naming the file.
"""
from __future__ import annotations

import json
import os

from docutils import nodes
from docutils.parsers.rst import Directive, directives

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _acc(v) -> str:
    return "" if v is None else f"{v:.3f}"


def _speed(s, e) -> str:
    return "" if s is None else f"{s:.2f} ({e * 100:.0f}%)" if e is not None else f"{s:.2f}"


def paper_size(d: dict, path: str) -> tuple[list[str], list[list[str]]]:
    """np, the published speedups, the performance model's for naive code and pilab's, every study's accuracy."""
    side = d["paper"]
    labels = side["labels"]
    head = ["np", "published speedup (eff.)", "predicted Pi: naive code", "predicted Pi: pilab"] + labels
    rows = []
    for r in side["rows"]:
        pub = "" if r.get("published_speedup") is None else \
            f"{r['published_speedup']:.2f} ({r['published_efficiency'] * 100:.1f}%)"
        accs = []
        for lab in labels:
            s = r["studies"].get(lab) or {}
            accs.append("" if s.get("not_run") or s.get("final_test_acc") is None else _acc(s["final_test_acc"]))
        rows.append([str(r["np"]), pub, _speed(r["naive_speedup"], r["naive_efficiency"]),
                     _speed(r["pilab_speedup"], r["pilab_efficiency"])] + accs)
    return head, rows


def by_rule(d: dict, path: str) -> tuple[list[str], list[list[str]]]:
    """One row per study (LR rule), one column per np: final test accuracy, fast-but-wrong marked."""
    nps = sorted({r["np"] for r in d["rows"]})
    head = ["rule"] + [f"np={p}" for p in nps]
    rows = []
    for lab in d["labels"]:
        cells = {r["np"]: r for r in d["rows"] if r["label"] == lab}
        row = [lab]
        for p in nps:
            r = cells.get(p)
            if r is None or r.get("final_test_acc") is None:
                row.append("")
                continue
            mark = " (fast but wrong)" if r.get("fast_but_wrong") else ""
            row.append(_acc(r["final_test_acc"]) + mark)
        rows.append(row)
    return head, rows


def seeds(d: dict, path: str) -> tuple[list[str], list[list[str]]]:
    """The fast-and-right table over seeds: mean ± sd (n), points against np=1, predicted Pi speedups, goal."""
    head = ["candidate", "np", "final test acc (mean ± sd, n)", "vs np=1 (points)", "predicted Pi speedup",
            "time-to-target speedup", "goal"]
    rows = []
    order = sorted(d["rows"], key=lambda r: (r["np"] != 1 or r["slug"] != "baseline", -(r["acc_mean"] or 0)))
    for r in order:
        sd = "" if r.get("acc_sd") is None else f" ± {r['acc_sd']:.3f}"
        delta = r.get("delta_vs_np1_baseline")
        ttt = r.get("time_to_target_speedup")
        goal = "met" if r.get("goal") else ("missed: " + ", ".join(r.get("misses") or []) if r["np"] != 1 else "")
        rows.append([r["label"], str(r["np"]), f"{r['acc_mean']:.3f}{sd} (n={r['n']})",
                     "" if delta is None else f"{delta * 100:+.1f}",
                     f"{r['predicted_pi_speedup']:.1f}x",
                     "not reached" if ttt is None else f"{ttt:.1f}x", goal])
    return head, rows


KINDS = {"paper-size": paper_size, "by-rule": by_rule, "seeds": seeds}


def table_node(head: list[str], rows: list[list[str]], source: str) -> nodes.Node:
    table = nodes.table(classes=["pilab-generated"])
    group = nodes.tgroup(cols=len(head))
    table += group
    for _ in head:
        group += nodes.colspec(colwidth=1)
    thead = nodes.thead()
    group += thead
    tbody = nodes.tbody()
    group += tbody
    for target, cells in ((thead, [head]), (tbody, rows)):
        for cells_ in cells:
            row = nodes.row()
            for c in cells_:
                entry = nodes.entry()
                entry += nodes.paragraph(text=c)
                row += entry
            target += row
    caption = nodes.paragraph()
    caption += nodes.emphasis(text="Generated when this page was built, from ")
    caption += nodes.literal(text=source)
    return [table, caption]


class PilabTable(Directive):
    required_arguments = 1
    option_spec = {"kind": lambda a: directives.choice(a, tuple(KINDS))}

    def run(self):
        rel = self.arguments[0]
        path = os.path.join(REPO, rel)
        env = self.state.document.settings.env
        if not os.path.exists(path):
            raise self.error(f"pilab-table: {rel} does not exist (a committed result the page shows)")
        env.note_dependency(path)
        try:
            with open(path) as f:
                head, rows = KINDS[self.options.get("kind", "by-rule")](json.load(f), rel)
        except (KeyError, TypeError, ValueError) as e:
            raise self.error(f"pilab-table: {rel} lacks what a {self.options.get('kind')} table needs: "
                             f"{type(e).__name__}: {e}")
        return table_node(head, rows, rel)


def setup(app):
    app.add_directive("pilab-table", PilabTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
