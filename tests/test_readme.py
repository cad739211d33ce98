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
    figure = {"bench": "live", "name": "live runtime overhead at full residency", "value": "+3.6 %",
              "goal": "<= 15 %", "verdict": "ok", "number": 3.6, "note": ""}  # fmt: skip
    path = _run_all(tmp_path / "run_all.json", {"live": [figure]})
    none = tmp_path / "absent.json"
    monkeypatch.setattr(readme_table, "RESULTS", (("live", "live runtime overhead", "overhead"),))
    table = readme_table.results_table(path, none)
    assert "| overhead | +3.6 % |  | <= 15 % (ok) | live |" in table
    assert "Measured 2026-01-02 on X, 2 cores, no GPU; torch 2, python 3" in table
    basis = "every token as a step (prefill-only trace, no decode steps)"
    best = {**figure, "bench": "prefetch", "name": "10 %: best (lfu)", "value": "0.5", "tpot_basis": basis}
    _run_all(path, {"prefetch": [best]}, "2026-01-03")
    monkeypatch.setattr(readme_table, "RESULTS", (("prefetch", "10 %: best", "best{rest}"),))
    table = readme_table.results_table(path, none)
    assert "| best (lfu) | 0.5 |  | <= 15 % (ok) | prefetch |" in table
    assert f"Modeled TPOT of the prefetch rows: the mean over {basis}." in table
    monkeypatch.setattr(readme_table, "RESULTS", (("live", "alpha=0.3", "agreement"),))
    with pytest.raises(SystemExit, match=re.escape("no live figure starting 'alpha=0.3'")):
        readme_table.results_table(path, none)


def test_the_before_column_reads_the_ungrouped_split_file(tmp_path, monkeypatch):
    new = {"bench": "splits", "name": "LLaPor recall@6, grouped test", "value": "0.6947", "goal": "",
           "verdict": "", "number": 0.6947, "note": ""}  # fmt: skip
    old = {**new, "bench": "predictors", "name": "LLaPor DeepSeek held-out recall@6", "value": "0.7732"}
    path = _run_all(tmp_path / "run_all.json", {"splits": [new]}, "2026-01-03")
    before = _run_all(tmp_path / "ungrouped-split.json", {"predictors": [old]})
    monkeypatch.setattr(readme_table, "RESULTS", (("splits", "LLaPor recall@6, grouped test", "recall"),))
    table = readme_table.results_table(path, before).splitlines()
    assert table[0] == "| measured | value | before: ungrouped split (2026-01-02) | goal | bench |"
    assert table[2] == "| recall | 0.6947 | 0.7732 |  | splits |"
    assert any("`bench/results/ungrouped-split.json`" in line for line in table)


def test_gpu_line_from_the_gpu_runs_json(tmp_path):
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
    assert readme_table.gpu_lines(tmp_path) == [
        "On a GPU (NVIDIA H100 80GB HBM3, `bench/results/gpu-NVIDIA-H100-80GB-HBM3.md`): the "
        "DeepSeek-V2-Lite-shaped model, 26 MoE layers, 25 % of experts resident, measured TPOT in ms: "
        "full residency 47.5, accelerate offload (device_map) 499.2."
    ]


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


def test_the_before_column_takes_the_same_hardware_profile():
    # the ungrouped file holds each prefetch figure once per profile, the A100 ones first; the README's
    # GH200 rows must read the GH200 ones (LLaPor prefetch 0.432, not the A100's 0.260)
    before = json.loads(readme_table.UNGROUPED.read_text())["benches"]
    gh200 = {f["name"]: f["value"] for f in before["prefetch"]["figures"] if "gh200-nvlink-c2c" in f["name"]}
    table = readme_table.results_table(readme_table.RUN_ALL, readme_table.UNGROUPED)
    row = next(line for line in table.splitlines() if line.startswith("| ... LLaPor prefetch |"))
    assert row.split(" | ")[2] == gh200["10 % hit, LLaPor prefetch, gh200-nvlink-c2c"]


def test_tiers_line_from_the_tiers_runs_json(tmp_path):
    rows = [
        {"config": "lru", "capacity": 0.25, "status": "ok", "measured_tpot_ms": 280.9},
        {"config": "llapor prefetch", "capacity": 0.25, "status": "ok", "measured_tpot_ms": 214.6},
        {"config": "accelerate", "capacity": 0.25, "status": "FAILED"},
        {"config": "lru", "capacity": 0.5, "status": "ok", "measured_tpot_ms": 140.4},
    ]
    (tmp_path / "tiers-box.json").write_text(json.dumps(rows))
    (tmp_path / "tiers-box.md").write_text("- random weights, DeepSeek-V2-Lite shape, 4 MoE layers, bf16\n")
    assert readme_table.tiers_lines(tmp_path) == [
        "Experts on disk, CPU only (`bench/results/tiers-box.md`): the DeepSeek-V2-Lite-shaped model, "
        "4 MoE layers, 25 % of experts resident in RAM, measured TPOT in ms: lru 281, llapor prefetch 215."
    ]
