"""bench/run_all.py runs bench modules by name and stores their rows; bench/figures.py formats them."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import figures as F  # noqa: E402
from bench import run_all  # noqa: E402


def test_judge_reads_the_goal_bound():
    assert F.judge(9.9, "<= 10 %") == "ok"
    assert F.judge(10.1, "<= 10 %") == "MISS"
    assert F.judge(60.0, "< 60 s") == "MISS"
    assert F.judge(4.43, ">= 3 x") == "ok"
    assert F.judge(None, "<= 10 %") == ""
    assert F.judge(1.0, "< uniform") == ""  # not a number: the bench judges it
    # a figure on its bound meets an inclusive goal and misses a strict one
    assert (F.judge(10.0, "<= 10 %"), F.judge(3.0, ">= 3 x")) == ("ok", "ok")
    assert (F.judge(10.0, "< 10"), F.judge(3.0, "> 3")) == ("MISS", "MISS")


def test_fig_formats_and_judges():
    f = F.fig("replay", "hit", 0.26249, "{:.3f}", "> 0.25", "note")
    assert (f["value"], f["verdict"], f["number"], f["note"]) == ("0.262", "ok", 0.26249, "note")
    assert F.fig("b", "n", 17.0, "{:.1f} s", "< 60 s", judged=False)["verdict"] == ""
    assert F.fig("b", "n", None)["value"] == "see its log"


def test_format_table_pads_columns():
    table = F.format_table([F.row("tiny", "build", "440 s", "<= 600 s", "ok", "n")]).splitlines()
    assert table[0].startswith("bench" + " " * 8 + "figure")
    # widths 11, 56, 46, 24, 8, two spaces between
    assert table[2] == "tiny".ljust(11) + "  " + "build".ljust(56) + "  " + "440 s".ljust(46) + "  " + (
        "<= 600 s".ljust(24) + "  " + "ok".ljust(8) + "  n"
    )


def test_markdown_table_escapes_a_pipe_inside_a_cell():
    """A note such as "hit | miss" must stay in its cell: an unescaped | starts a new markdown column."""
    f = F.row("tiers", "25 %: lru", "1.0", note="hit | miss", tpot_basis="decode steps")
    lines = F.markdown_table([f]).splitlines()
    assert lines[2] == "| tiers | 25 %: lru | 1.0 |  |  | decode steps | hit \\| miss |"


def _entry(value: str, date: str = "2026-01-02") -> dict:
    machine = {"cpu": "X", "cores": 2, "cuda": None, "torch": "2", "python": "3"}
    return {
        "date": date,
        "command": "python bench/run_all.py",
        "mode": "full",
        "machine": machine,
        "seconds": 3.0,
        "load_before": "1",
        "load_after": "1",
        "inputs": [],
        "figures": [F.row("x", "fig", value)],
    }


def test_store_merges_by_bench_in_table_order(tmp_path):
    run_all.store(tmp_path, {"replay": _entry("a")})
    run_all.store(tmp_path, {"collect": _entry("b")})
    run_all.store(tmp_path, {"replay": _entry("c", "2026-01-03")})
    data = json.loads((tmp_path / "run_all.json").read_text())["benches"]
    assert list(data) == ["collect", "replay"]  # BENCHES order, whatever order they ran in
    assert data["replay"]["figures"][0]["value"] == "c" and data["collect"]["figures"][0]["value"] == "b"
    md = (tmp_path / "run_all.md").read_text()
    assert (
        "| replay | 2026-01-03 | `python bench/run_all.py` | X, 2 cores, no GPU; torch 2, python 3 | 3 |"
        in md
    )
    assert "| x | fig | c |  |  |  |  |" in md and "| x | fig | a |" not in md


def test_a_tpot_basis_is_shown_where_a_figure_has_one():
    basis = "every token as a step (prefill-only trace, no decode steps)"
    with_basis = F.fig("prefetch", "tpot", 7.04, "{:.1f} ms", note="cold", tpot_basis=basis)
    stored_before = {k: v for k, v in F.row("live", "overhead", "+3.6 %").items() if k != "tpot_basis"}
    md = F.markdown_table([with_basis, stored_before]).splitlines()
    assert md[0] == "| bench | figure | value | goal | verdict | TPOT over | note |"
    assert md[2] == f"| prefetch | tpot | 7.0 ms |  |  | {basis} | cold |"
    assert md[3] == "| live | overhead | +3.6 % |  |  |  |  |"
    printed = F.format_table([with_basis]).splitlines()[2]
    assert printed.endswith(f"  cold; TPOT over {basis}")


def test_prefetch_rows_pick_the_best_online_policy_and_carry_the_basis():
    from types import SimpleNamespace

    from bench.bench_prefetch import capacity_rows

    def res(hit, tpot):
        return [SimpleNamespace(hit_rate=hit, modeled_tpot_ms=tpot, tpot_basis="decode steps", requests=3)]

    m = {
        "lru": res(0.30, 9.0),
        "lfu": res(0.35, 8.5),
        "static": res(0.20, 9.9),
        "belady": res(0.50, 7.0),  # a bound: never the best non-learned row
        "LLaPor prefetch": res(0.34, 8.0),
        "PreSched, no predictor": res(0.25, 6.0),
        "LLaPor + PreSched": res(0.36, 5.5),
        "oracle + PreSched (bound)": res(0.60, 5.0),
    }
    got = capacity_rows(m, 0, "hw")
    assert [(r["name"], r["value"], r["goal"], r["verdict"]) for r in got] == [
        ("10 %, hw: hit rate, modeled TPOT, best non-learned (lfu)", "0.350, 8.5 ms", "", ""),
        ("10 %, hw: hit rate, modeled TPOT, LLaPor prefetch", "0.340, 8.0 ms", "> lfu", "MISS"),
        ("10 %, hw: hit rate, modeled TPOT, LLaPor + PreSched", "0.360, 5.5 ms", "> lfu", "ok"),
        ("10 %, hw: hit rate, modeled TPOT, PreSched without a predictor", "0.250, 6.0 ms", "", ""),
        ("10 %, hw: hit rate, modeled TPOT, oracle + PreSched (bound)", "0.600, 5.0 ms", "", ""),
        ("10 %, hw: hit rate, modeled TPOT, Belady (bound)", "0.500, 7.0 ms", "", ""),
    ]
    assert {r["tpot_basis"] for r in got} == {"decode steps"} and got[0]["number"] == 0.35


@pytest.fixture
def fake_benches(tmp_path, monkeypatch):
    (tmp_path / "fakebench.py").write_text(
        textwrap.dedent(
            """
            def rows(quick, work, ds_traces):
                print("a line for the log")
                return [{"bench": "fake", "name": "quick", "value": str(quick), "goal": "",
                         "verdict": "", "number": None, "note": ds_traces.name}]

            def crash(quick):
                raise ValueError("boom")

            def by_argv(argv):
                return []
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(run_all.BENCHES, "fake", ("fakebench", "rows"))
    monkeypatch.setitem(run_all.BENCHES, "crash", ("fakebench", "crash"))
    monkeypatch.setitem(run_all.BENCHES, "absent", ("bench.no_such_bench", "rows"))
    monkeypatch.setitem(run_all.BENCHES, "argv", ("fakebench", "by_argv"))
    return tmp_path


def test_run_bench_passes_only_the_inputs_a_bench_names(fake_benches):
    logs = fake_benches / "logs"
    logs.mkdir()
    kwargs = {"work": fake_benches, "ds_traces": Path("/x/ds-puffin"), "train": True}
    got = run_all.run_bench("fake", True, kwargs, logs, timeout=120)
    assert got["rows"][0]["value"] == "True" and got["rows"][0]["note"] == "ds-puffin"
    assert set(got["inputs"]) == {"work", "ds_traces"}  # not train: rows does not take it
    assert "a line for the log" in (logs / "fake.log").read_text()


def test_run_bench_marks_a_crash_and_skips_an_absent_module(fake_benches):
    logs = fake_benches / "logs"
    logs.mkdir()
    got = run_all.run_bench("crash", False, {}, logs, timeout=120)
    (row,) = got["rows"]
    assert row["verdict"] == "FAILED" and row["value"] == "exit 1: ValueError: boom"
    assert run_all.run_bench("absent", False, {}, logs, timeout=120) is None
    (row,) = run_all.run_bench("argv", False, {}, logs, timeout=120)["rows"]
    assert row["value"] == "exit 1: TypeError: fakebench.by_argv must be rows(quick: bool, ...) to run here"


def test_replay_rows_read_the_hit_table_in_mode_then_policy_order():
    from bench.bench_replay import hit_table

    def res(h):  # (policy, cold, rows of (hit, tpot, prefetch acc, cpu rate), err, wall, cpu, jobs)
        return (
            "p",
            True,
            [(h, 1.0, 0.0, 0.0), (h + 0.1, 1.0, 0, 0), (h + 0.2, 1, 0, 0), (0.9, 1, 0, 0)],
            None,
            0,
            0,
            1,
        )

    m = {
        "runnable": ["lru", "static"],
        "sweeps": {
            "cold": ({"lru": res(0.1), "static": res(0.05)}, 1.0),
            "stream": ({"lru": res(0.2), "static": res(0.0)}, 1.0),
        },
    }
    table = hit_table(m)
    assert list(table) == [("lru", "cold"), ("static", "cold"), ("lru", "stream"), ("static", "stream")]
    assert table[("lru", "cold")] == [0.1, pytest.approx(0.2), pytest.approx(0.3)]


def test_predictor_rows_from_the_bench_objects():
    from bench.bench_predictors import _ds_rows, _latency_rows

    objs = [
        {"bench": "deepseek held-out", "predictor": "frequency", "horizon": "statistical", "recall_at_k": 0.14339},
        {"bench": "deepseek held-out", "predictor": "llapor (x)", "recall_at_k": 0.7732, "train_seconds": 1107.4},
        {"bench": "latency", "traces": "tiny", "score_at_us_median": 23.2, "unfolded_us_median": 28.8,
         "score_layer_us_median": 14.9, "score_layer_float32_us_median": 18.6, "loadavg_1min": 0.85},
    ]  # fmt: skip
    rows = _ds_rows(objs, "checkpoint x", judged=True)
    assert [(r["name"], r["value"], r["verdict"]) for r in rows] == [
        ("LLaPor DeepSeek held-out recall@6", "0.7732", "MISS"),  # goal >= 0.85
        ("baseline frequency recall@6 (statistical)", "0.1434", ""),
        ("LLaPor DeepSeek training time (s)", "1107 s", "ok"),  # goal <= 1800 s
    ]
    (lat,) = _latency_rows(objs)
    assert lat["value"] == "0.0232 ms" and lat["verdict"] == "ok"  # 23.2 us = 0.0232 ms <= 0.1 ms
    assert lat["note"].endswith("score_layer alone 14.9 us (float32 18.6 us); load 0.85")


def test_split_rows_name_each_side_and_judge_only_llapor_on_test(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import moecast.predictors.provenance as provenance
    from conftest import make_synthetic_traceset

    from bench import bench_splits

    traces = tmp_path / "ts"
    make_synthetic_traceset(traces, top_k=2)
    ckpt = tmp_path / "llapor.safetensors"
    ckpt.write_bytes(b"")
    asked = []

    def measure(path, checkpoint):
        asked.append(checkpoint)

        def side(name, label, recall):
            return {"baseline": name, "requests": label, "n_requests": 3, "tokens": 30, "recall_at_k": recall}

        return [side("frequency", "ungrouped held-out", 0.25), side("frequency", "grouped test", 0.2)] + (
            [side(ckpt.name, "grouped test", 0.9)] if checkpoint else []
        )

    monkeypatch.setattr(bench_splits, "measure", measure)
    monkeypatch.setattr(provenance, "trained_on_file", lambda p: SimpleNamespace(spec="grouped"))
    got = bench_splits.rows(False, traces, ckpt)
    assert [(r["name"], r["value"], r["goal"], r["verdict"]) for r in got] == [
        ("baseline frequency recall@2, ungrouped held-out (earlier versions)", "0.2500", "", ""),
        ("baseline frequency recall@2, grouped test", "0.2000", "", ""),
        ("LLaPor recall@2, grouped test", "0.9000", ">= 0.85", "ok"),
    ]
    assert got[2]["note"].startswith("3 requests, 30 tokens; checkpoint ")
    # a checkpoint of the ungrouped split has no test side it never saw: not scored, and said so
    monkeypatch.setattr(provenance, "trained_on_file", lambda p: SimpleNamespace(spec=None))
    got = bench_splits.rows(False, traces, ckpt)
    assert asked == [ckpt, None] and got[-1]["verdict"] == "MISSING" and len(got) == 3


def test_a_failed_figure_fails_run_all_and_names_itself_on_stderr(capsys):
    ok = {"figures": [F.fig("tiny", "build", 1.0)]}
    assert run_all.failed_status({"tiny": ok}) == 0
    bad = {"figures": [F.fig("gpu", "x", 2.0), F.failed("tiers", "exit 1: no disk")]}
    assert run_all.failed_status({"tiny": ok, "tiers": bad}) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["run_all: tiers: (bench) FAILED: exit 1: no disk"]


def test_a_failed_row_fails_the_bench_command(capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_gpu

    rows = [
        {"model": "-", "config": "setup", "status": "FAILED"},
        {"model": "25 %", "config": "lru", "status": "ok"},
        {"model": "25 %", "config": "llapor prefetch", "status": "skipped"},
        {"model": "deepseek", "config": "LLaPor prefetch", "status": "FAILED"},
    ]
    assert bench_gpu.exit_status(rows[1:3], "bench_gpu") == 0
    assert capsys.readouterr().err == ""
    assert bench_gpu.exit_status(rows, "bench_tiers") == 1
    assert capsys.readouterr().err.splitlines() == [
        "bench_tiers: setup FAILED (traceback in the results file)",
        "bench_tiers: deepseek: LLaPor prefetch FAILED (traceback in the results file)",
    ]


def test_a_guarded_failure_goes_to_stderr_with_its_traceback(capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_gpu

    report = bench_gpu.Report("cpu")
    assert report.guard(None, "boom", lambda: 1 / 0) is None
    out, err = capsys.readouterr()
    assert "ZeroDivisionError" in err and "ZeroDivisionError" not in out
    assert report.rows[0]["status"] == "FAILED" and "ZeroDivisionError" in report.failures[0]
