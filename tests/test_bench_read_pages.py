"""bench/bench_read_pages.py: both page kinds measured in each round, its files, its failure line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moecast.runtime.profile.measure import ReadProbe
from moecast.runtime.tiers import offload

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))


def test_each_round_measures_small_then_huge_pages_and_restores_the_allocator(tmp_path, monkeypatch):
    import bench_read_pages

    seen = []

    def probe(directory, expert_bytes, budget_s):
        # which page kind the runtime's buffers get during this measurement
        seen.append(offload._huge_pages is real)
        return ReadProbe(0.5, 10, 2.0, "huge") if seen[-1] else ReadProbe(2.0, 5, 2.5, "small")

    real = offload._huge_pages
    monkeypatch.setattr("moecast.runtime.profile.measure.read_cpu_probe", probe)
    got = bench_read_pages.measure(str(tmp_path), 1 << 20, 2, 1.0)
    assert seen == [False, True, False, True] and offload._huge_pages is real
    assert [r["read_cpu_ms"] for r in got["small pages"]] == [2.0, 2.0]
    assert [r["read_cpu_ms"] for r in got["huge pages"]] == [0.5, 0.5]
    # reads per second: the probe's reads over the time they took
    assert [r["reads_per_s"] for r in got["small pages"]] == [2.0, 2.0]
    assert [r["reads_per_s"] for r in got["huge pages"]] == [5.0, 5.0]


def test_the_command_writes_its_table_and_fails_in_one_line(tmp_path, monkeypatch, capsys):
    import bench_read_pages

    monkeypatch.setattr(
        "moecast.runtime.profile.measure.read_cpu_probe", lambda d, b, budget_s: ReadProbe(1.0, 4, 1.0, "x")
    )
    assert (
        bench_read_pages.main(["--dir", str(tmp_path), "--rounds", "1", "--out", str(tmp_path / "out")]) == 0
    )
    md = next((tmp_path / "out").glob("read-pages-*.md")).read_text()
    assert "| small pages | 1.000 |" in md and "| huge pages | 1.000 |" in md
    assert json.loads(next((tmp_path / "out").glob("read-pages-*.json")).read_text())["medians"]

    def broken(*a, **k):
        raise OSError("no such disk")

    monkeypatch.setattr("moecast.runtime.profile.measure.read_cpu_probe", broken)
    assert bench_read_pages.main(["--dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "bench_read_pages: FAILED: OSError: no such disk" in capsys.readouterr().err
