"""bench/bench_precision.py at test sizes: every precision's row, its bytes by hand, and the file it writes."""

from __future__ import annotations

import sys
from pathlib import Path

from moecast.runtime.tiers.precision import Precision, relative_error

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))


def test_each_precisions_bytes_by_hand_and_errors_in_order():
    import bench_precision

    w = bench_precision.expert(64, 32)
    rows = {
        p.tag: bench_precision.row(p, w, 2) for p in (Precision(), Precision("int8"), Precision("int4", 32))
    }
    # model: (2 x 32 x 64 + 64 x 32) bf16 = 12288 bytes; int8: 6144 + bf16 scales (64 + 64) x 2 = 6400;
    # int4-g32: 3072 + bf16 (scale, zero) per row and group: (64 x 2 + 64 x 1) x 2 x 2 = 3840
    assert {k: r["bytes"] for k, r in rows.items()} == {"model": 12288, "int8": 6400, "int4-g32": 3840}
    assert (
        rows["model"]["output_error"] == 0 < rows["int8"]["output_error"] < rows["int4-g32"]["output_error"]
    )
    assert all(r["packed_ms"] > 0 and r["dequant_ms"] > 0 for r in rows.values())
    # the worst matrix's relative error (pinned by hand in test_precision::test_relative_error_by_hand)
    for p in (Precision(), Precision("int8"), Precision("int4", 32)):
        assert rows[p.tag]["weight_error"] == max(relative_error(t.float(), p) for t in w.values())
    assert (
        rows["model"]["weight_error"] == 0 < rows["int8"]["weight_error"] < rows["int4-g32"]["weight_error"]
    )


def test_the_command_prints_the_table_and_writes_its_file(tmp_path, capsys):
    import bench_precision

    argv = [
        "--hidden",
        "64",
        "--intermediate",
        "32",
        "--reps",
        "2",
        "--group-size",
        "32",
        "--out",
        str(tmp_path),
    ]
    assert bench_precision.main(argv) == 0
    printed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[2:5]]
    assert printed == ["model", "int8", "int4-g32"]
    text = next(tmp_path.glob("precision-*.md")).read_text()
    assert "- command: `python bench/bench_precision.py --hidden 64" in text and "- machine:" in text


def test_the_frontier_takes_each_precisions_fastest_runnable_row_and_its_accuracy(tmp_path, capsys):
    """int4: LLaPor 300 beats LRU 350; the oracle bound (200) and all in RAM (100) are not rows a user
    runs, another capacity's row (90) is not this one, and a failed row is skipped."""
    import json

    import precision_frontier

    def r(config, ms, prec, cap=0.25, status="ok"):
        return {"config": config, "measured_tpot_ms": ms, "expert_dtype": prec, "capacity": cap,
                "status": status, "read_mb_per_token": ms / 10}  # fmt: skip

    tiers = tmp_path / "tiers.json"
    tiers.write_text(json.dumps([
        r("lru", 800, "model"), r("llapor prefetch-late", 700, "model"), r("lru int4-g128", 350, "int4-g128"),
        r("llapor prefetch-late int4-g128", 300, "int4-g128"), r("oracle (bound) int4-g128", 200, "int4-g128"),
        r("all in RAM int4-g128", 100, "int4-g128"), r("lru int4-g128", 90, "int4-g128", cap=0.5),
        r("lru int4-g128", 50, "int4-g128", status="FAILED"), r("page cache", 900, None),
    ]))  # fmt: skip
    acc = tmp_path / "acc.md"
    acc.write_text("    experts  alpha  ppl  d ppl  agree\n      model   0.00   277.3   +0.00%  100.0%  0.0%\n"
                   "      model   0.10   277.3   +0.01%   99.9%  1.7%\n  int4-g128   0.00   277.4   +0.06%   99.1%  0.0%\n")  # fmt: skip
    assert precision_frontier.main(["--tiers", str(tiers), "--accuracy", str(acc)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| model | 700 (llapor prefetch-late) | 70 | +0.00 % | 100.0 % |"
    assert lines[3] == "| int4-g128 | 300 (llapor prefetch-late int4-g128) | 30 | +0.06 % | 99.1 % |"
    assert (tmp_path / "precision-frontier.png").stat().st_size > 0
    acc.write_text(acc.read_text().replace("int4-g128", "int8"))  # int8 without TPOT, int4 without accuracy
    assert precision_frontier.main(["--tiers", str(tiers), "--accuracy", str(acc)]) == 1
    assert "int8 is in only one of" in capsys.readouterr().err
