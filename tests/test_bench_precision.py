"""bench/bench_precision.py at test sizes: every precision's row, its bytes by hand, and the file it writes."""

from __future__ import annotations

import sys
from pathlib import Path

from moecast.runtime.precision import Precision

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
