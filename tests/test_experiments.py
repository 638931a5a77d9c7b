"""Experiment drivers kept beside their results (experiments/<name>/): their code paths run, tiny, on a CPU."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _driver(experiment: str, script: str):
    """An experiment's script as a module (registered, so its worker functions pickle by name)."""
    name = f"{experiment.replace('-', '_')}_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / experiment / script)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_paper_batch_screen_runs_a_candidate_and_tables_it(tmp_path):
    rows = _driver("paper-batch", "screen.py").main(["--device", "cpu", "--data", "embedded", "--epochs", "1", "--train-subset", "96",
                           "--test-subset", "40", "--nps", "3", "--candidates", "naive", "--reference-seeds", "",
                           "--top", "0", "--workers", "1", "--threads", "1", "--out", str(tmp_path)])
    assert [(r["candidate"], r["np"], r["error"]) for r in rows] == [("naive", 3, None)]
    assert rows[0]["global_batch"] == 96 and 0 <= rows[0]["final_test_acc"] <= 1
    saved = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert saved[0]["config"]["simulate_mode"] == "fast" and saved[0]["config"]["lr"] == 0.025
    assert "| naive | 3 | 0 |" in (tmp_path / "table.md").read_text()
