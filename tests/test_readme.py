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


def _run_all(path: Path, figures: dict[str, list[dict]], date: str = "2026-01-02") -> Path:
    machine = {"cpu": "X", "cores": 2, "cuda": None, "torch": "2", "python": "3"}
    benches = {b: {"date": date, "machine": machine, "figures": fs} for b, fs in figures.items()}
    path.write_text(json.dumps({"benches": benches}))
    return path


def test_results_rows_come_from_run_all(tmp_path, monkeypatch):
    figure = {"bench": "live", "name": "alpha=0.3 perplexity change", "value": "+0.01 %", "goal": "<= 2 %",
              "verdict": "ok", "number": 0.01, "note": ""}  # fmt: skip
    agree = {**figure, "name": "alpha=0.3 greedy agreement", "value": "99.5 %"}
    path = _run_all(tmp_path / "run_all.json", {"live": [figure, agree]})
    rows = (("alpha", (("live", "alpha=0.3 perplexity"), ("live", "alpha=0.3 greedy"))),)
    monkeypatch.setattr(readme_table, "RUN_ALL_ROWS", rows)
    lines, notes = readme_table.run_all_rows(path)
    # no goal, no verdict: the value and the file it comes from
    assert lines == ["| alpha | +0.01 %; 99.5 % | [run_all.md](bench/results/run_all.md) |"]
    assert notes == ["The run_all.md rows: measured 2026-01-02 on X, 2 cores, no GPU; torch 2, python 3."]
    basis = "every token as a step (prefill-only trace, no decode steps)"
    best = {**figure, "bench": "prefetch", "name": "10 %: best (lfu)", "value": "0.5", "tpot_basis": basis}
    _run_all(path, {"prefetch": [best]}, "2026-01-03")
    monkeypatch.setattr(readme_table, "RUN_ALL_ROWS", (("best{0}", (("prefetch", "10 %: best"),)),))
    lines, notes = readme_table.run_all_rows(path)
    assert lines == ["| best (lfu) | 0.5 | [run_all.md](bench/results/run_all.md) |"]
    assert f"Modeled TPOT there: the mean over {basis}." in notes
    monkeypatch.setattr(readme_table, "RUN_ALL_ROWS", (("agreement", (("live", "alpha=0.3"),)),))
    with pytest.raises(SystemExit, match=re.escape("no live figure starting 'alpha=0.3'")):
        readme_table.run_all_rows(path)


def test_every_headline_row_names_its_results_file():
    table = readme_table.results_table().split("\n\n")[0].splitlines()
    assert table[:2] == ["| measured | value | results file |", "|---|---|---|"]
    assert 3 <= len(table) - 2 <= 8  # headline figures, not a dashboard
    for row in table[2:]:
        link = re.fullmatch(r"\| .+ \| .+ \| \[([^]]+)\]\(bench/results/([^)]+)\) \|", row)
        assert link and link.group(1) == link.group(2), row
        assert (readme_table.RESULTS / link.group(2)).is_file(), row
        assert "MISS" not in row


def test_gpu_row_from_the_gpu_runs_json(tmp_path):
    rows = [
        {"model": "deepseek-shaped", "config": "profile", "kind": "profile", "status": "ok"},
        {"model": "deepseek-shaped", "config": "full residency", "kind": "tpot", "status": "ok",
         "capacity": 0.25, "measured_tpot_ms": 47.529},
        {"model": "deepseek-shaped", "config": "SMoE", "kind": "tpot", "status": "skipped"},
        {"model": "deepseek-shaped", "config": "accelerate offload (device_map)", "kind": "tpot",
         "status": "ok", "capacity": 0.25, "measured_tpot_ms": 499.183, "resident_layers": "6 of 26"},
        {"model": "tiny", "config": "full residency", "kind": "tpot", "status": "ok", "capacity": 0.25,
         "measured_tpot_ms": 3.9},
    ]  # fmt: skip
    (tmp_path / "gpu-NVIDIA-H100-80GB-HBM3.json").write_text(json.dumps(rows))
    assert readme_table.gpu_row(tmp_path, "gpu-NVIDIA-H100-80GB-HBM3") == (
        "| TPOT on an NVIDIA H100 80GB HBM3, 25 % of experts resident (DeepSeek-V2-Lite shape, 26 MoE layers) "
        "| full residency 47.5 ms; accelerate offload (device_map) 499.2 ms "
        "| [gpu-NVIDIA-H100-80GB-HBM3.md](bench/results/gpu-NVIDIA-H100-80GB-HBM3.md) |"
    )


def test_tiers_row_picks_the_best_llapor_policy(tmp_path):
    rows = [
        {"config": "noise floor (lru x4)", "capacity": 0.25, "status": "ok", "measured_tpot_ms": 250.0,
         "runs_tpot_ms": [240.0, 260.0]},
        {"config": "lru", "capacity": 0.25, "status": "ok", "measured_tpot_ms": 280.9},
        {"config": "llapor prefetch", "capacity": 0.25, "status": "ok", "measured_tpot_ms": 214.6},
        {"config": "llapor prefetch-late", "capacity": 0.25, "status": "ok", "measured_tpot_ms": 220.1},
        {"config": "page cache", "capacity": 0.25, "status": "ok", "measured_tpot_ms": 449.4},
        {"config": "accelerate", "capacity": 0.25, "status": "FAILED"},
        {"config": "llapor prefetch", "capacity": 0.5, "status": "ok", "measured_tpot_ms": 100.0},
    ]  # fmt: skip
    (tmp_path / "tiers-box.json").write_text(json.dumps(rows))
    (tmp_path / "tiers-box.md").write_text("- random weights, DeepSeek-V2-Lite shape, 4 MoE layers, bf16\n")
    spec = ("tiers-box", 0.25, "llapor", ("lru", "page cache"))
    assert readme_table.tiers_row(tmp_path, spec) == (
        "| TPOT with the experts on disk, CPU only, 25 % of them resident in RAM (DeepSeek-V2-Lite shape, "
        "4 MoE layers): the best LLaPor policy, lru, page cache "
        "| llapor prefetch 215 ms; lru 281 ms; page cache 449 ms | [tiers-box.md](bench/results/tiers-box.md) |"
    )
    with pytest.raises(SystemExit, match="lacks"):
        readme_table.tiers_row(tmp_path, ("tiers-box", 0.25, "llapor", ("lfu",)))


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


def test_user_docs_name_no_development_paths():
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        assert "../shared" not in path.read_text(), f"{path.name} names a development path"
