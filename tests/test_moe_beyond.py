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


def test_import_resumes_without_duplicates(puffin_dir, tmp_path, capsys):
    import_moe_beyond(puffin_dir, out=tmp_path / "ds", max_files=3, chunk=2)
    assert capsys.readouterr().out.startswith("imported 3 prompts; ")
    ts = import_moe_beyond(puffin_dir, out=tmp_path / "ds", max_files=5, chunk=2)
    assert ts.num_requests == 5 and len(set(ts.request_ids)) == 5
    # what this run imported, apart from what the set held: it once said 5 prompts were imported
    assert capsys.readouterr().out.startswith(
        f"imported 2 prompts (3 already there); {tmp_path / 'ds'} holds 5 prompts"
    )
    import_moe_beyond(puffin_dir, out=tmp_path / "ds", max_files=6, chunk=2, json=True)
    got = json.loads(capsys.readouterr().out)
    want = dict(out=str(tmp_path / "ds"), imported=1, already=5, prompts=6, layers=26)
    assert {k: got[k] for k in want} == want
    assert got["tokens"] == TraceSet(tmp_path / "ds").num_tokens > 0


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


# ----------------------------------------------------------------------------- test set and predictions


def _write_formatted(path, tokens, routes):
    """MoE-Beyond's test-set layout: rows grouped by layer (1, 2), token order within; routes [T][L]."""
    _write(
        path,
        [[layer + 1, 0, tok, str(routes[t][layer])] for layer in range(2) for t, tok in enumerate(tokens)],
    )


def _write_predicted(path, activated, predicted):
    """MoE-Beyond's predicted_csvs layout: Token is the position; activated and predicted [T][L]."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["Layer ID", "Token", "Activated Expert IDs", "Predicted Expert IDs"])
        for layer in range(2):
            for t in range(len(activated)):
                w.writerow([layer + 1, t, str(activated[t][layer]), str(predicted[t][layer])])


def test_the_test_set_layout_imports_in_prompt_number_order(tmp_path):
    src = tmp_path / "formatted_csvs"
    src.mkdir()
    routes = {n: [[[n % 60, 61], [62, 63]], [[1, 2], [3, n % 60 + 4]]] for n in (10, 2, 1)}
    for n in (10, 2, 1):
        _write_formatted(src / f"prompt_{n}_data_formatted.csv", ["Ġhi", f"Ġp{n}"], routes[n])
    (src / "notes.csv").write_text("a,b\n1,2\n")  # another header: not a trace, skipped
    ts = import_moe_beyond(src, out=tmp_path / "t", workers=1)
    assert ts.request_ids == ["moe-beyond-test-1", "moe-beyond-test-2", "moe-beyond-test-10"]
    assert ts.meta.collection["workloads"] == ["moe-beyond-test"]
    assert ts.traceset_id.startswith("mb-") and ts.get("moe-beyond-test-2").prompt == " hi p2"
    for n in (1, 2, 10):
        np.testing.assert_array_equal(ts.get(f"moe-beyond-test-{n}").topk_ids, routes[n])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "prompt_1_data.csv").write_text("a,b\n")
    with pytest.raises(FileNotFoundError, match="no CSV with MoE-Beyond's header"):
        import_moe_beyond(empty, out=tmp_path / "e")


def test_published_predictions_are_scored_as_published(tmp_path, capsys):
    from moecast.cli import main

    src = tmp_path / "predicted_csvs"
    src.mkdir()
    act = {3: [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], 7: [[[8, 9], [10, 11]]]}
    pred = {3: [[[0, 9], [2, 3]], [[40, 41], [6, 5]]], 7: [[[8, 1], [12, 13]]]}
    for n in (3, 7):
        _write_predicted(src / f"prompt_{n}_data_predicted.csv", act[n], pred[n])
    out = tmp_path / "t"
    main(["import", "moe-beyond", str(src), "--out", str(out), "--workers", "1"])
    ts = TraceSet(out)
    assert ts.request_ids == ["moe-beyond-test-3", "moe-beyond-test-7"]
    assert ts.get("moe-beyond-test-3").token_texts == ["", ""]
    capsys.readouterr()
    main(["predictors", "eval", f"moe-beyond:{src}", "--traces", str(out), "--json", "true"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # per (token, layer): |predicted ∩ activated| / 2 over the six rows: 1/2 1 0 1/2 | 1/2 0
    assert res["split"] == "all" and res["requests"] == 2 and res["tokens"] == 3
    assert res["recall_at_k"] == pytest.approx((0.5 + 1 + 0 + 0.5 + 0.5 + 0) / 6)
    # several predictors, each on the same requests: ours beside theirs
    main(
        [
            "predictors",
            "eval",
            "hot",
            f"moe-beyond:{src}",
            "--traces",
            str(out),
            "--split",
            "all",
            "--json",
            "true",
        ]
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["predictor"] for r in rows] == ["hot", "moe-beyond"] and {r["tokens"] for r in rows} == {3}
    # predictions whose activated experts are not the TraceSet's routing are refused
    _write_predicted(src / "prompt_7_data_predicted.csv", [[[8, 9], [10, 12]]], pred[7])
    with pytest.raises(SystemExit) as exc:
        main(["predictors", "eval", f"moe-beyond:{src}", "--traces", str(out)])
    assert "are not request moe-beyond-test-7's routing" in str(exc.value.code)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_predicted(mixed / "prompt_1_data_predicted.csv", act[7], pred[7])
    _write_formatted(mixed / "prompt_2_data_formatted.csv", ["a"], [[[1, 2], [3, 4]]])
    with pytest.raises(ValueError, match="mixes traces and prediction CSVs"):
        import_moe_beyond(mixed, out=tmp_path / "m")


def test_rows_of_a_lower_layer_after_a_higher_one_are_refused(tmp_path):
    """Rows come grouped by layer in ascending layer order (the i-th row of a layer is token i):
    layer 1's rows after layer 2's are refused, naming the line where layer 1 starts, instead of
    importing the layers in reverse order."""
    rows = [[2, 0, "a", "[5, 6]"], [2, 0, "b", "[7, 0]"], [1, 0, "a", "[1, 2]"], [1, 0, "b", "[3, 4]"]]
    _write(tmp_path / "desc.csv", rows)
    with pytest.raises(ValueError, match=r"desc\.csv:4: rows of layer 1 are not grouped together"):
        parse_file(tmp_path / "desc.csv", num_experts=8)


def test_rows_of_interleaved_layers_are_refused(tmp_path):
    """Layers 1, 2, 1, 2: every layer first appears in rising order, yet read as grouped rows token a
    would take token b's layer-1 route ([3, 4]) at layer 2. Refused at line 4, where layer 1 comes back."""
    rows = [[1, 0, "a", "[1, 2]"], [2, 0, "a", "[5, 6]"], [1, 0, "b", "[3, 4]"], [2, 0, "b", "[7, 0]"]]
    _write(tmp_path / "mixed.csv", rows)
    with pytest.raises(ValueError, match=r"mixed\.csv:4: rows of layer 1 are not grouped together"):
        parse_file(tmp_path / "mixed.csv", num_experts=8)


def test_a_row_that_lists_an_expert_twice_is_refused(tmp_path):
    """A top-k route names k distinct experts; "[3, 3]" is a corrupt row, refused, not imported as a
    route with one expert counted twice."""
    rows = [[1, 0, "a", "[1, 2]"], [1, 0, "b", "[3, 3]"], [2, 0, "a", "[5, 6]"], [2, 0, "b", "[7, 0]"]]
    _write(tmp_path / "dup.csv", rows)
    with pytest.raises(ValueError, match="lists the same expert twice"):
        parse_file(tmp_path / "dup.csv", num_experts=8)


def test_sequence_windows_score_each_position_with_half_a_window_of_context():
    """MoE-Beyond's sequence predictor on a request longer than max_len (W = 4, T = 8): windows
    start every W / 2 = 2 tokens and each keeps only the positions the one before could not see with
    as much context. By hand: positions 0-3 from the window at 0, 4-5 from the window at 2, 6-7 from
    the window at 4. The encoder is causal, so position t scored in the window at s is the last
    output of the network run on tokens s..t alone."""
    import torch
    from moecast.collect.traceset import RequestTrace
    from moecast.predictors.sequence import SequenceConfig, SequenceNet, SequencePredictor, sequence_inputs

    torch.manual_seed(0)
    cfg = SequenceConfig(
        2, 8, 2, token_buckets=50, d_model=16, n_heads=2, n_blocks=1, ffn=16, dropout=0.0, max_len=4
    )
    pred = SequencePredictor(SequenceNet(cfg), [1, 2])
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(8 * 2)]).reshape(8, 2, 2)
    toks = rng.integers(0, 50, 8)
    trace = RequestTrace("r", "w", "c", "p", toks, ["x"] * 8, np.zeros(8, bool), ids, None, None, None)
    got = pred.score_request(trace)
    tok, prev = sequence_inputs(toks, ids, cfg)
    for t, s in enumerate([0, 0, 0, 0, 2, 2, 4, 4]):
        with torch.no_grad():
            logits = pred.net(torch.from_numpy(tok[s : t + 1])[None], torch.from_numpy(prev[s : t + 1])[None])
        np.testing.assert_allclose(got[t], torch.sigmoid(logits[0, -1]).numpy(), atol=1e-5, err_msg=str(t))


def test_two_files_of_one_prompt_number_are_refused(tmp_path):
    """A folder holding prompt_1_data.csv and prompt_1_data_formatted.csv has two traces of prompt 1:
    refused (naming both) instead of one silently replacing the other."""
    from moecast.collect.moe_beyond import list_files

    good = [[1, 0, "a", "[1, 2]"], [2, 0, "a", "[5, 6]"]]
    _write(tmp_path / "prompt_1_data.csv", good)
    _write(tmp_path / "prompt_1_data_formatted.csv", good)
    _write(tmp_path / "prompt_2_data.csv", good)
    with pytest.raises(
        ValueError, match=r"prompt_1_data\.csv and prompt_1_data_formatted\.csv are both prompt 1"
    ):
        list_files(tmp_path)


def test_an_expert_id_equal_to_the_expert_count_is_refused(tmp_path):
    """Expert ids run 0..E-1: with 8 experts, id 8 is out of range and refused."""
    rows = [[1, 0, "a", "[1, 2]"], [1, 0, "b", "[3, 8]"], [2, 0, "a", "[5, 6]"], [2, 0, "b", "[7, 0]"]]
    _write(tmp_path / "edge.csv", rows)
    with pytest.raises(ValueError, match=r"expert id 8 outside 0\.\.7"):
        parse_file(tmp_path / "edge.csv", num_experts=8)


def test_detokenize_keeps_characters_outside_the_byte_map():
    """A token character that is no byte-level BPE byte (here CJK) is kept as its own UTF-8."""
    assert detokenize(["Ġ中文", "!"]) == " 中文!"


def test_a_folder_not_all_in_the_training_layout_imports_as_the_test_workload(tmp_path):
    """Only a folder whose every file is prompt_<N>_data.csv is the training set (workload puffin);
    one file named otherwise makes it the test workload (moe-beyond-test-<N>)."""
    good = [[1, 0, "a", "[1, 2]"], [2, 0, "a", "[5, 6]"]]
    _write(tmp_path / "prompt_1_data.csv", good)
    _write(tmp_path / "prompt_2_data_formatted.csv", good)
    ts = import_moe_beyond(tmp_path, out=tmp_path / "t", workers=1)
    assert ts.request_ids == ["moe-beyond-test-1", "moe-beyond-test-2"]
