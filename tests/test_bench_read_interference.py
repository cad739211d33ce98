"""bench/bench_read_interference.py: the paired slowdown by hand, a tiny run's files, its failure line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))


def test_the_slowdown_is_the_median_of_each_rounds_own_ratio():
    import bench_read_interference as B

    # ratios 2, 1.5, 2: median 2 (the ratio of the medians, 3 / 2, would hide the pairing)
    assert B.paired_slowdown([2.0, 3.0, 6.0], [1.0, 2.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        B.paired_slowdown([1.0], [1.0, 2.0])


def test_the_report_pairs_each_condition_with_its_rounds_none_window():
    """none 1, 2, 4 ms and reads 1.5, 2, 6 in rounds 1-3: ratios 1.5, 1.0, 1.5, so 1.5x (the ratio of
    the medians would say 1.0x); medians 2.0 and 2.0 ms an expert."""
    import argparse

    import bench_read_interference as B

    ms = {
        "none": [1.0, 2.0, 4.0],
        "reads, this process": [1.5, 2.0, 6.0],
        "reads, another process": [1.0, 2.0, 4.0],
    }
    got = {"ms_per_expert": {"model": ms}, "read_gbps_this_process": [1.0, 3.0], "ring": {"model": 8},
           "block_bytes": 4_600_000}  # fmt: skip
    args = argparse.Namespace(inter=128, window=0.05, dir="d", threads=2, rounds=3)
    md, data = B.report(args, got, ["--rounds", "3"])
    by = data["summary"]["model"]
    assert by["reads, this process"] == {"ms_per_expert": 2.0, "slowdown": 1.5}
    assert by["none"]["slowdown"] == 1.0 and by["reads, another process"]["slowdown"] == 1.0
    assert data["read_gbps"] == 2.0 and "| model | reads, this process | 2.000 | 1.500x |" in md


def test_a_tiny_run_times_every_condition_and_writes_its_table(tmp_path):
    import bench_read_interference as B

    out = tmp_path / "out"
    argv = ["--dir", str(tmp_path / "disk"), "--inter", "128", "--precision", "model", "--read-mb", "0.1",
            "--rounds", "1", "--window", "0.05", "--out", str(out)]  # fmt: skip
    assert B.main(argv) == 0
    data = json.loads(next(out.glob("read-interference-*.json")).read_text())
    by = data["summary"]["model"]
    assert list(by) == list(B.CONDITIONS) and by["none"]["slowdown"] == 1.0
    assert all(v["ms_per_expert"] > 0 for v in by.values())
    assert data["read_gbps"] > 0  # the reads in this process ran during its window
    md = next(out.glob("read-interference-*.md")).read_text()
    assert "| model | reads, another process |" in md and "--rounds 1" in md
    assert not list((tmp_path / "disk").glob(".moecast-profile-reads-*"))  # the temporary file is removed


def test_a_failed_measurement_is_one_line_and_exit_1(tmp_path, capsys):
    import bench_read_interference as B

    (tmp_path / "a-file").write_text("")
    assert B.main(["--dir", str(tmp_path / "a-file" / "disk"), "--out", str(tmp_path / "out"), "--inter", "128",
                   "--precision", "model", "--rounds", "1", "--window", "0.05"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_read_interference: FAILED: ")
    assert not (tmp_path / "out").exists()
