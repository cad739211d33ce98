from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
from moecast.collect.moe_beyond import detokenize, import_moe_beyond, parse_file
from moecast.collect.traceset import TraceSet


def _simple_parse(path):
    """Independent reading of one CSV: {layer: [(token, set(ids)), ...]}."""
    out: dict[int, list] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            ids = [int(x) for x in row["Activated Expert IDs"].strip("[]").split(",")]
            out.setdefault(int(row["Layer ID"]), []).append((row["Token"], ids))
    return out


def test_import_matches_csv(puffin_dir, tmp_path):
    ts = import_moe_beyond(puffin_dir, out=tmp_path / "ds", max_files=6)
    assert ts.num_requests == 6 and ts.num_layers == 26 and ts.top_k == 6 and ts.num_experts == 64
    assert not ts.has("router_probs") and not ts.has("gate_inputs") and not ts.has("topk_weights")
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert set(meta["collection"]["absent"]) == {"topk_weights", "router_probs", "gate_inputs"}
    files = sorted(puffin_dir.glob("prompt_*_data.csv"), key=lambda p: int(p.stem.split("_")[1]))[:6]
    for f in files:
        rid = f"puffin-{int(f.stem.split('_')[1])}"
        ref = _simple_parse(f)
        r = ts.get(rid)
        assert r.token_texts == [t for t, _ in ref[1]]
        assert not r.is_decode.any()
        for li, layer in enumerate(sorted(ref)):
            for pos, (_, ids) in enumerate(ref[layer]):
                assert sorted(r.topk_ids[pos, li].tolist()) == sorted(ids)
    # prompt text rebuilt from byte-level BPE tokens
    assert ts.get(f"puffin-{int(files[0].stem.split('_')[1])}").prompt.strip()


def test_import_resumes_without_duplicates(puffin_dir, tmp_path):
    import_moe_beyond(puffin_dir, out=tmp_path / "ds", max_files=3, chunk=2)
    ts = import_moe_beyond(puffin_dir, out=tmp_path / "ds", max_files=5, chunk=2)
    assert ts.num_requests == 5 and len(set(ts.request_ids)) == 5


def test_detokenize_bytes():
    assert detokenize(["<｜begin▁of▁sentence｜>", "How", "Ġdo", "ĠI", "Ċ", "Ã©"]) == "How do I\né"


def _write(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["Layer ID", "Batch Number", "Token", "Activated Expert IDs"])
        w.writerows(rows)


def test_bad_csvs_are_clear_errors(tmp_path):
    good = [[1, 0, "a", "[1, 2]"], [1, 0, "b", "[3, 4]"], [2, 0, "a", "[5, 6]"], [2, 0, "b", "[7, 0]"]]
    _write(tmp_path / "ok.csv", good)
    layers, tokens, ids = parse_file(tmp_path / "ok.csv", num_experts=8)
    assert layers == [1, 2] and tokens == ["a", "b"] and ids.shape == (2, 2, 2)
    np.testing.assert_array_equal(ids[1, 1], [7, 0])
    _write(tmp_path / "ragged.csv", good[:-1])
    with pytest.raises(ValueError, match="ragged"):
        parse_file(tmp_path / "ragged.csv", num_experts=8)
    _write(tmp_path / "range.csv", [*good[:-1], [2, 0, "b", "[7, 99]"]])
    with pytest.raises(ValueError, match="outside"):
        parse_file(tmp_path / "range.csv", num_experts=8)
    (tmp_path / "trunc.csv").write_text((tmp_path / "ok.csv").read_text()[:-9])
    with pytest.raises(ValueError):
        parse_file(tmp_path / "trunc.csv", num_experts=8)


def test_cli_import_and_info(puffin_dir, tmp_path):
    out = tmp_path / "ds"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "moecast",
            "import",
            "moe-beyond",
            str(puffin_dir),
            "--out",
            str(out),
            "--max-files",
            "3",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "imported 3 prompts" in run.stdout
    info = subprocess.run(
        [sys.executable, "-m", "moecast", "traces", "info", str(out), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(info.stdout)
    assert summary["requests"] == 3 and summary["top_k"] == 6 and len(summary["layers"]) == 26
    assert summary["num_moe_layers"] == 26 and summary["moe_layers"] == list(range(1, 27))  # as in meta.json
    assert "router_probs" in summary["absent"]
    assert all(0 < layer["freq_entropy"] <= np.log(64) + 1e-9 for layer in summary["layers"])
    bad = subprocess.run(
        [sys.executable, "-m", "moecast", "traces", "info", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "no such TraceSet" in bad.stderr
    assert TraceSet(out).num_tokens == summary["tokens"]
