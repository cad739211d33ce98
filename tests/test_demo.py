"""`moecast demo` end to end on the seconds-to-build `tiny:test` preset and a 2-layer encoder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REQUIRED = [
    "LRU, on demand",
    "LFU, on demand",
    "SMoE score eviction (Eq. 3)",
    "SMoE substitution + llapor prefetch",
    "LRU + llapor prefetch",
    "LRU, on demand + cascade preload",
    "LRU, on demand + hot preload",  # the trivial plan beside every planner
    "Belady (offline bound)",
]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, tiny_encoder):
    out = tmp_path_factory.mktemp("demo") / "run"
    args = [
        sys.executable,
        "-m",
        "moecast.cli",
        "demo",
        "--out",
        str(out),
        "--preset",
        "test",
        "--requests",
        "10",
        "--fixture-requests",
        "3",
        "--max-new-tokens",
        "8",
        "--llapor-epochs",
        "2",
        "--eap-epochs",
        "2",
        "--encoder",
        str(tiny_encoder),
        "--json",
    ]
    first = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    return out, args, json.loads(first.stdout.strip().splitlines()[-1])


def test_demo_compares_every_policy_and_writes_table_plot_and_wandb(demo_run):
    out, _, result = demo_run
    rows = {r["configuration"]: r for r in result["summary"]}
    for name in REQUIRED:
        assert name in rows, f"{name} missing from {sorted(rows)}"
    caps = sorted(float(c) for c in rows["Belady (offline bound)"]["hit_rate"])
    assert caps == [0.125, 0.25, 0.5]
    for r in rows.values():
        for h in (*r["hit_rate"].values(), *r["decode_hit_rate"].values()):
            assert 0.0 <= h <= 1.0
    # the table's hit columns are the decode steps' (the TPOT's), the JSON keeps every token's beside
    table = (out / "compare" / "table.csv").read_text()
    assert "decode_hit_rate" in table
    # demand-only policies are bounded by Belady at every capacity (same accesses, no substitution)
    for name in ("LRU, on demand", "LFU, on demand", "SMoE score eviction (Eq. 3)"):
        for c, h in rows[name]["hit_rate"].items():
            assert h <= rows["Belady (offline bound)"]["hit_rate"][c] + 1e-9
    for key in ("table", "plot"):
        assert (out / "compare" / ("table.md" if key == "table" else "plot.png")).is_file()
    assert (out / "compare" / "plot.png").stat().st_size > 1000
    assert result["wandb_dirs"], "no offline wandb runs were written"
    assert result["mode"].startswith("cold")


def test_demo_rerun_reuses_finished_stages(demo_run):
    out, args, _ = demo_run
    ckpts = sorted((out / "ckpt").glob("*.safetensors"))
    assert {p.name for p in ckpts} == {
        "llapor.safetensors",
        "eam.safetensors",
        "eap.safetensors",
        "cascade.safetensors",
    }
    table = out / "compare" / "table.csv"
    before = {p: p.stat().st_mtime_ns for p in (*ckpts, table)}
    runs = sorted(out.rglob("offline-run-*"))
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in (*ckpts, table)} == before
    assert f"reusing {table}" in again.stdout
    assert sorted(out.rglob("offline-run-*")) == runs  # no second set of the same wandb runs
    assert json.loads(again.stdout.strip().splitlines()[-1])["summary"]  # the table, from the reused one


def test_demo_rerun_with_other_settings_trains_what_they_change(demo_run):
    """Another LLaPor epoch count retrains LLaPor (from scratch) and reuses the CasMoE checkpoints;
    the stamps beside the checkpoints say what each was trained with; the comparison runs again."""
    out, args, _ = demo_run
    eam = out / "ckpt" / "eam.safetensors"
    table = out / "compare" / "table.csv"
    before, compared = eam.stat().st_mtime_ns, table.stat().st_mtime_ns
    changed = list(args)
    changed[changed.index("--llapor-epochs") + 1] = "1"
    changed += ["--wandb", "false"]  # a setting of the comparison alone (the first run logs to wandb)
    again = subprocess.run(changed, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    text = again.stdout + again.stderr
    assert "llapor.safetensors: trained with other settings" in text and f"reusing {eam}" in text
    assert eam.stat().st_mtime_ns == before
    # the retrained LLaPor is compared again
    assert "table.csv: compared with other settings" in text and table.stat().st_mtime_ns != compared
    stamp = json.loads((out / "ckpt" / "llapor.safetensors.settings.json").read_text())
    assert stamp["llapor_epochs"] == 1
    from moecast.predictors import load

    assert load(out / "ckpt" / "llapor.safetensors").metadata()["training"]["epochs"] == 1


def test_a_stage_made_with_other_settings_loses_its_stamp_until_made_again(tmp_path, capsys):
    """An interrupted remake leaves no stamp of the old settings beside the new output, so a later run
    with the old settings makes it again instead of taking the new output for the old one."""
    from moecast.demo import _reuse, _stamp

    out = tmp_path / "table.csv"
    out.write_text("a")
    _stamp(out, {"epochs": 1})
    assert _reuse(out, {"epochs": 1}) and "reusing" in capsys.readouterr().out
    assert not _reuse(out, {"epochs": 2}, "compared", "comparing")
    assert (
        "table.csv: compared with other settings than this run's; comparing again" in capsys.readouterr().out
    )
    out.write_text("b")  # the remake is interrupted before its stamp
    assert not _reuse(out, {"epochs": 1})
    _stamp(out, {"epochs": 2})
    assert _reuse(out, {"epochs": 2})


def test_summary_table_counts_bytes_moved_in_mib_like_run(tmp_path):
    """The demo's table says MiB moved, 2**20 bytes each, as `moecast run` and a capacity in MB count
    them (it once divided by 10**6 under a header saying MB)."""
    from moecast.demo import summarise

    csv = tmp_path / "table.csv"
    head = "policy,predictor,planner,capacity_fraction,decode_hit_rate,hit_rate,bytes_moved,substitution_rate,modeled_tpot_ms"
    csv.write_text(
        f"{head}\nlru,none,none,0.25,0.5,0.4,{3 * 2**20},0.0,12.5\nlru,none,none,0.5,0.75,0.7,0,0.0,10\n"
    )
    text, summary = summarise(csv)
    header, _, row = text.splitlines()
    assert "MiB moved @ 25.0%" in header
    assert row.split(" | ")[3] == "3.0"  # 3 MiB, not 3.1 (10**6-byte MB)
    assert summary[0]["mib_moved"] == 3.0 and summary[0]["decode_hit_rate"] == {0.25: 0.5, 0.5: 0.75}
