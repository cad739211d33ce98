"""The README: its generated tables are current, and its test command is the one CI runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import readme_table  # noqa: E402


def test_generated_tables_are_current():
    text = (ROOT / "README.md").read_text()
    assert readme_table.render(text) == text, "run python bench/readme_table.py"


def test_every_cli_command_has_a_row():
    from moecast.cli import COMMANDS

    table = readme_table.commands_table()
    for name, target in COMMANDS.items():
        for sub in target if isinstance(target, dict) else [""]:
            assert f"| `moecast {(name + ' ' + sub).strip()}` |" in table


def test_results_rows_come_from_run_all(tmp_path, monkeypatch):
    figure = {"bench": "live", "name": "live runtime overhead at full residency", "value": "+3.6 %",
              "goal": "<= 15 %", "verdict": "ok", "number": 3.6, "note": ""}  # fmt: skip
    machine = {"cpu": "X", "cores": 2, "cuda": None, "torch": "2", "python": "3"}
    path = tmp_path / "run_all.json"
    path.write_text(
        json.dumps({"benches": {"live": {"date": "2026-01-02", "machine": machine, "figures": [figure]}}})
    )
    monkeypatch.setattr(readme_table, "RESULTS", (("live", "live runtime overhead", "overhead"),))
    table = readme_table.results_table(path)
    assert "| overhead | +3.6 % | <= 15 % (ok) | live |" in table
    assert "Measured 2026-01-02 on X, 2 cores, no GPU; torch 2, python 3" in table
    basis = "every token as a step (prefill-only trace, no decode steps)"
    best = {**figure, "bench": "prefetch", "name": "10 %: best (lfu)", "value": "0.5", "tpot_basis": basis}
    benches = {"prefetch": {"date": "2026-01-03", "machine": machine, "figures": [best]}}
    path.write_text(json.dumps({"benches": benches}))
    monkeypatch.setattr(readme_table, "RESULTS", (("prefetch", "10 %: best", "best{rest}"),))
    table = readme_table.results_table(path)
    assert "| best (lfu) | 0.5 | <= 15 % (ok) | prefetch |" in table
    assert f"Modeled TPOT of the prefetch rows: the mean over {basis}." in table
    monkeypatch.setattr(readme_table, "RESULTS", (("live", "alpha=0.3", "agreement"),))
    with pytest.raises(SystemExit, match=re.escape("no live figure starting 'alpha=0.3'")):
        readme_table.results_table(path)


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    (command,) = [ln for ln in ci.splitlines() if ln.startswith("pip install")]
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert blocks[1] == command
    # the set-up command installs the same way and runs the demo
    assert (
        blocks[0]
        == command.split(' && pip install -q -e ".[dev]"')[0] + " && pip install -q -e . && moecast demo"
    )
