"""bench/bench_gpu.py's dry run on the CPU (so it cannot rot before a GPU runs it) and bench/ds_model.py's parts."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from moecast.collect.models import kv_cache, with_cache

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import ds_model  # noqa: E402

SMALL = dict(
    hidden_size=32,
    moe_intermediate_size=16,
    n_routed_experts=64,
    num_experts_per_tok=6,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    vocab_size=128,
    intermediate_size=64,
)


def _request(T: int, L: int, seed: int = 0) -> ds_model.RoutedRequest:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(64, 6, replace=False) for _ in range(L)] for _ in range(T)])
    return ds_model.RoutedRequest("r", np.arange(T) % 128, np.arange(T) + 1000, ids)


def test_routing_override_makes_the_model_use_the_recorded_ids():
    from moecast.collect.models import find_moe_structure
    from moecast.collect.recorder import RoutingRecorder

    model = ds_model.build_ds_model(ds_model.ds_config(2, **SMALL), torch.float32)
    req = _request(5, 2)
    routing = ds_model.Routing([req], "test")
    st = find_moe_structure(model)
    seen = []
    with torch.no_grad(), ds_model.routed(model, routing) as ov, RoutingRecorder(st, 6).attach(model) as rec:
        ov.start(req)
        toks = torch.as_tensor(req.tokens)[None]
        out = model(input_ids=toks[:, :3], use_cache=True)  # prefill of 3, then 2 decode steps
        seen.append(rec.take())
        for t in (3, 4):
            out = model(input_ids=toks[:, t : t + 1], **with_cache(model, kv_cache(out)), use_cache=True)
            seen.append(rec.take())
    got = torch.cat([s.topk_ids for s in seen]).numpy()
    assert np.array_equal(np.sort(got, -1), np.sort(req.topk_ids, -1))
    probs = torch.cat([s.router_probs for s in seen]).numpy()
    top = np.argsort(-probs, -1)[..., :6]  # the lifted logits' top-6 are the recording
    assert np.array_equal(np.sort(top, -1), np.sort(req.topk_ids, -1))
    assert "forward" not in st.layers[0].router.__dict__  # removed on exit


def test_recorded_ids_reach_the_device_once_per_request(monkeypatch):
    """decode_all hands each request's ids to the override with the run's device, and the router's
    forward slices them there: no host-to-device copy (a stream sync) inside any layer."""
    model = ds_model.build_ds_model(ds_model.ds_config(2, **SMALL), torch.float32)
    reqs = [_request(4, 2, seed) for seed in (0, 1)]
    routing = ds_model.Routing(reqs, "test")
    starts = []
    real_start = ds_model.RoutingOverride.start

    def start(self, request, device="cpu"):
        starts.append((request.request_id, torch.device(device)))
        real_start(self, request, device)

    monkeypatch.setattr(ds_model.RoutingOverride, "start", start)
    moved = []
    real_to = torch.Tensor.to

    def to(self, *a, **kw):
        if self.dtype == torch.int64 and self.dim() == 2 and self.shape[-1] == 6:  # a layer's [rows, k] ids
            moved.append(self.shape)
        return real_to(self, *a, **kw)

    with ds_model.routed(model, routing) as ov:
        monkeypatch.setattr(torch.Tensor, "to", to)
        ds_model.decode_all(model, [r.tokens for r in reqs], 1, torch.device("cpu"), routing, ov)
        monkeypatch.setattr(torch.Tensor, "to", real_to)
        assert ov.ids.device == torch.device("cpu")
    assert starts == [("r", torch.device("cpu"))] * 2
    assert moved == []  # a per-layer `.to(logits.device)` of the ids would show here


def test_held_out_requests_no_checkpoint_trained_on(puffin_dir, tmp_path):
    from moecast.collect.moe_beyond import import_moe_beyond
    from moecast.collect.traceset import split_request_ids

    rows = ds_model.held_out_requests(puffin_dir, 2, 16, 3)
    names = [f"puffin-{p.name.split('_')[1]}" for p in puffin_dir.glob("prompt_*_data.csv")]
    _, held = split_request_ids(sorted(names), 0.1, 0)
    assert all(r in held for r, _, _ in rows)  # the earlier ungrouped split's validation side
    assert all(ids.shape[1:] == (3, 6) and len(t) == len(ids) >= 16 for _, t, ids in rows)
    # and the test side of the prompt-grouped split, as TraceSet.splits() decides it on an import
    wanted = [int(r.split("-")[1]) for r, _, _ in rows]
    src = tmp_path / "src"
    src.mkdir()
    for p in puffin_dir.glob("prompt_*_data.csv"):
        if int(p.name.split("_")[1]) in wanted or int(p.name.split("_")[1]) < 20:
            (src / p.name).symlink_to(p)
    ts = import_moe_beyond(src, out=tmp_path / "ts", workers=1)
    assert {r for r, _, _ in rows} <= set(ts.splits().test)


def test_accelerate_disk_offload_keeps_the_logits(tmp_path):
    from accelerate import dispatch_model

    model = ds_model.build_ds_model(ds_model.ds_config(4, **SMALL), torch.float32)
    ids = torch.arange(6)[None]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    dm, keep = ds_model.accelerate_map(model, 0.25, main="cpu", offload="disk")
    assert keep == 1  # one layer of four keeps its experts: 25 % of the experts' bytes
    assert [k for k, v in dm.items() if v == "disk"] == [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)]
    dispatch_model(model, device_map=dm, main_device="cpu", offload_dir=str(tmp_path))
    assert model.model.layers[2].mlp.experts.down_proj.device.type == "meta"  # really offloaded
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


def test_dry_run_runs_every_cpu_row(tmp_path, monkeypatch):
    import bench_gpu

    monkeypatch.setattr(sys, "argv", ["bench_gpu.py"])
    args = ["--device", "cpu", "--quick", "--ds-shape", "test", "--tiny-preset", "test", "--out", str(tmp_path),
            "--requests", "1", "--prefill", "8", "--tokens", "7", "--train-requests", "8", "--train-epochs", "1",
            "--repeats", "2", "--precisions", "model,int4", "--group-size", "32"]  # fmt: skip
    rows = bench_gpu.run(args)
    by = {(r["model"], r["config"]): r for r in rows}
    assert not [r for r in rows if r["status"] == "FAILED"]
    for model in ("tiny", "deepseek-shaped"):  # the rows are modeled on the profile calibrated all-resident
        cal = by[(model, "calibrate (all resident)")]
        assert cal["calibrated_on_steps"] > 0 and Path(cal["profile"]).is_file()
    for model in ("tiny", "deepseek-shaped"):
        exact = by[(model, "exactness (alpha 0)")]
        # one token per forward: bit-identical; after the prefill too, whose waves combine their pairs
        assert exact["equal"] is True and exact["prefill_equal"] is True
        assert by[(model, "accelerate offload (device_map)")]["status"] == "skipped"
        for cfg in ("full residency", "on-demand LRU", "PreSched + CPU experts"):
            r = by[(model, cfg)]
            assert r["measured_tpot_ms"] > 0 and r["modeled_tpot_ms"] > 0
        assert (
            by[(model, "full residency")]["hit_rate"]
            == by[(model, "full residency")]["modeled_hit_rate"]
            == 1.0
        )
        # the same caches, live and replayed: empty at the start, one prompt token
        lru = by[(model, "on-demand LRU")]
        assert lru["hit_rate"] == pytest.approx(lru["modeled_hit_rate"], abs=1e-12)
        assert by[(model, "on-demand LRU")]["cpu_experts"] == 0  # on demand: every miss is loaded
        resident = by[(model, "runtime, all resident")]
        assert resident["hit_rate"] == resident["modeled_hit_rate"] == 1.0 and resident["loads"] == 0
        # full residency runs no runtime: modeled on the profile as probed, below the calibrated one, which
        # holds the runtime's host work (on the H200 that work made full residency's modeled 1.32x measured);
        # on a loaded host the probe's rest of a layer can come out above the calibration's, and then not
        cal = by[(model, "calibrate (all resident)")]
        if cal["attn_ms_probe"] < cal["attn_ms"]:
            assert by[(model, "full residency")]["modeled_tpot_ms"] < resident["modeled_tpot_ms"]
        for cfg in ("full residency", "runtime, all resident", "on-demand LRU"):
            r = by[(model, cfg)]
            # of two runs the faster, whose split and counters the row gives too
            assert len(r["measured_runs_ms"]) == 2 and r["measured_tpot_ms"] == min(r["measured_runs_ms"])
            assert r["spread"] == pytest.approx(
                (max(r["measured_runs_ms"]) - min(r["measured_runs_ms"])) / r["measured_tpot_ms"]
            )
        # the disk tier at each precision: the same caches as the host tier's LRU, its own replay
        for tag in ("model", "int4-g32"):
            disk = by[(model, f"disk LRU ({tag})")]
            assert disk["status"] == "ok" and disk["loads"] == lru["loads"] > 0
            assert disk["hit_rate"] == pytest.approx(disk["modeled_hit_rate"], abs=1e-12) == lru["hit_rate"]
            floor = by[(model, f"all resident ({tag})")]
            assert floor["loads"] == 0 and floor["hit_rate"] == 1.0
        # the host tier at int4 (dequantized into the slots on the simulated device): the LRU row's
        # caches, its own replay at int4
        host4 = by[(model, "on-demand LRU (int4-g32)")]
        assert host4["status"] == "ok" and host4["loads"] == lru["loads"] > 0
        assert host4["hit_rate"] == pytest.approx(host4["modeled_hit_rate"], abs=1e-12) == lru["hit_rate"]
        # int4 moves fewer bytes per load: its replay charges less link time than the model dtype's
        assert (
            by[(model, "disk LRU (int4-g32)")]["modeled_tpot_ms"]
            < by[(model, "disk LRU (model)")]["modeled_tpot_ms"]
        )
        # the split covers the TPOT's steps: its parts add up to the runtime's clock of them, which runs
        # inside the harness's clock of the same run's same steps (the warm-up in one but not the other, or
        # another run's split, would break it: a mean of two runs beside the faster one's split did)
        for cfg in ("runtime, all resident", "on-demand LRU", "PreSched + CPU experts"):
            r = by[(model, cfg)]
            assert r["split_sum_ms"] == pytest.approx(r["runtime_tpot_ms"])
            assert 0.5 * r["measured_tpot_ms"] < r["split_sum_ms"] <= r["measured_tpot_ms"]
        # the dry run walks the CUDA path on the simulated device: copies on its link, timed, each
        # issued by the host (its issue time the runtime's host work, reported per copy)
        assert lru["device_ops"] == "simulated" and lru["link_gbps_observed"] > 0
        assert lru["transfer_wait_ms"] > 0 and lru["stream_wait_ms"] >= 0 and lru["copy_issue_ms"] > 0
        # the copies' pinned source, and no layer over the pinning budget (no staging fallback)
        assert lru["pinned_bytes"] > 0 and lru["staged_layers"] == 0
        # the all-resident pair: decode calls replayed as graphs, and the same uncaptured
        assert by[(model, "runtime, all resident")]["graph_replays"] > 0
        assert by[(model, "all resident, no graphs")]["graph_replays"] is None
    assert by[("tiny", "LLaPor prefetch")]["prefetches_issued"] > 0
    assert by[("tiny", "LLaPor prefetch (int4-g32)")]["prefetches_issued"] > 0
    assert by[("deepseek-shaped", "LLaPor prefetch (int4-g32)")]["status"] == "skipped"
    assert by[("tiny", "SMoE (alpha 0.3)")]["status"] == "ok"
    assert by[("deepseek-shaped", "LLaPor prefetch")]["status"] == "skipped"  # no DeepSeek checkpoint given
    md = (tmp_path / "gpu-cpu.md").read_text()
    assert "## tiny" in md and "## deepseek-shaped" in md and "command:" in md and "machine:" in md
    assert ("BENCHMARK MODE" if ds_model.find_puffin() is not None else "own random router") in md
    assert json.loads((tmp_path / "gpu-cpu.json").read_text()) == json.loads(json.dumps(rows, default=str))
    assert (tmp_path / "bench-cpu-tiny.yaml").is_file()
    figs = bench_gpu.figures(rows)
    assert {f["verdict"] for f in figs if "alpha-0" in f["name"]} == {"ok"}
    lru = by[("tiny", "on-demand LRU")]
    err = next(f for f in figs if f["name"] == "tiny: on-demand LRU |modeled / measured - 1|")
    assert err["number"] == pytest.approx(abs(lru["modeled_tpot_ms"] / lru["measured_tpot_ms"] - 1))
    assert err["tpot_basis"] and err["tpot_basis"] == lru["tpot_basis"]  # the replay's, carried
    best = min(by[("tiny", c)]["measured_tpot_ms"] for c in bench_gpu.MOECAST_ROWS[1:])
    ratio = next(f for f in figs if f["name"] == "tiny: best moecast TPOT / on-demand LRU")
    assert ratio["number"] == pytest.approx(best / lru["measured_tpot_ms"]) and ratio["goal"] == "<= 0.667"


def test_a_failing_row_is_recorded_and_the_rest_go_on(tmp_path):
    import bench_gpu

    report = bench_gpu.Report("cpu")
    assert report.guard(None, "boom", lambda: 1 / 0) is None
    row = report.guard(None, "fine", lambda: {"x": 1})
    assert row is report.rows[1] and (row["config"], row["status"], row["x"]) == ("fine", "ok", 1)
    assert [r["status"] for r in report.rows] == ["FAILED", "ok"] and report.rows[0]["config"] == "boom"
    assert "ZeroDivisionError" in report.failures[0]


def test_extracted_routing_equals_the_csv_routing(puffin_dir, tmp_path, monkeypatch):
    out = tmp_path / "routing.npz"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "ds_model.py",
            "--extract",
            str(out),
            "--traces",
            str(puffin_dir),
            "--requests",
            "2",
            "--min-tokens",
            "64",
        ],
    )
    ds_model.main()
    a = ds_model.load_routing(str(puffin_dir), 2, 64, 3, 1000)
    b = ds_model.load_routing(str(out), 2, 64, 3, 1000)
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]
    for x, y in zip(a.requests, b.requests):
        assert np.array_equal(x.topk_ids, y.topk_ids) and np.array_equal(x.tokens, y.tokens)
        assert np.array_equal(x.token_hashes, y.token_hashes) and x.topk_ids.shape[1:] == (3, 6)


def test_runner_entry_without_cuda_is_one_skipped_row(monkeypatch):
    import bench_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (row,) = bench_gpu.rows(True)
    assert row["verdict"] == "SKIPPED" and "tests/test_bench_gpu.py" in row["value"]


def test_ds_predictor_adapter_pads_the_layers_and_maps_the_tokens_back():
    from moecast.collect.traceset import RequestTrace
    from moecast.runtime.profile.measure import llapor_standin

    inner = llapor_standin(num_layers=6, num_experts=64, top_k=6)  # the "26-layer" checkpoint
    ad = ds_model.LayerSubsetPredictor(inner, {5: 12345, 7: 999}, layers=3)
    ids = np.stack([_request(4, 3, seed=s).topk_ids[0] for s in range(4)]).astype(np.int16)

    def trace(L, toks, routes):
        return RequestTrace("r", "w", "", "", np.array(toks), [""] * 4, np.ones(4, bool), routes,
                            np.full((4, L, 6), 1 / 6, np.float16), None, None)  # fmt: skip

    padded = np.zeros((4, 6, 6), np.int16)
    padded[:, :3] = ids  # the layers the bench model lacks are zero, as before they are known
    ours, theirs = trace(3, [5, 7, 5, 7], ids), trace(6, [12345, 999, 12345, 999], padded)
    got = ad.score_request(ours)
    assert got.shape == (4, 3, 64)  # [tokens, the bench model's layers, experts]
    assert np.array_equal(got, inner.score_request(theirs)[:, :3])
    assert np.array_equal(ad.score_at(ours, 2), inner.score_at(theirs, 2))
    # score_at reuses its padded window: another request's tokens (8: unknown, so 0), then a shorter one
    other, want = trace(3, [7, 8, 5, 5], ids[::-1]), trace(6, [999, 0, 12345, 12345], padded[::-1])
    assert np.array_equal(ad.score_at(other, 1), inner.score_at(want, 1))
    short = dataclasses.replace(
        ours, token_ids=ours.token_ids[:2], topk_ids=ids[:2], topk_weights=ours.topk_weights[:2]
    )
    assert np.array_equal(ad.score_at(short, 2), inner.score_at(theirs.prefix(2), 2))
    # a replayed trace without router weights (recorded ids only) pads to one without them too
    bare = dataclasses.replace(ours, topk_weights=None)
    assert np.array_equal(
        ad.score_request(bare), inner.score_request(dataclasses.replace(theirs, topk_weights=None))[:, :3]
    )
    assert np.array_equal(
        ad.score_at(bare, 2), inner.score_at(dataclasses.replace(theirs, topk_weights=None), 2)
    )
    # the live runtime drives it through its stream: the window it keeps, padded and mapped the same way
    stream = ad.stream()
    stream.reset([5, 7, 5, 7])
    for layer in range(3):
        stream.observe(layer, ids[:, layer], ours.topk_weights[:, layer], None)
    stream.end_token(5)
    for layer in range(2):
        stream.observe(layer, ids[:1, layer], ours.topk_weights[:1, layer], None)
    ids5, w5 = np.zeros((5, 6, 6), np.int16), np.zeros((5, 6, 6), np.float16)
    ids5[:4], ids5[4, :2], w5[4, :2] = padded, ids[0, :2], 1 / 6
    running = RequestTrace("r", "w", "", "", np.array([12345, 999, 12345, 999, 12345]), [""] * 5,
                           np.ones(5, bool), ids5, w5, None, None)  # fmt: skip
    assert np.array_equal(stream.predict_next(2), inner.score_at(running, 2))
    # every layer of the checkpoint (nothing to pad): the window's own arrays, read as they change
    whole = ds_model.LayerSubsetPredictor(inner, {5: 12345, 7: 999}, layers=6)
    live = trace(6, [5, 7, 5, 7], padded.copy())
    assert np.array_equal(whole.score_at(live, 4), inner.score_at(theirs, 4))
    live.topk_ids[3, :4] = ids[0, :1]  # the runtime's stream fills the running token's row in place
    changed = dataclasses.replace(theirs, topk_ids=live.topk_ids.copy())
    assert np.array_equal(whole.score_at(live, 4), inner.score_at(changed, 4))
    assert not np.array_equal(inner.score_at(changed, 4), inner.score_at(theirs, 4))  # the change matters
    assert np.array_equal(whole.score_at(other := trace(6, [7, 8, 5, 5], padded[::-1].copy()), 3),
                          inner.score_at(trace(6, [999, 0, 12345, 12345], padded[::-1].copy()), 3))  # fmt: skip
    assert other.token_ids.tolist() == [7, 8, 5, 5]  # the runtime's window keeps its own token ids
    # the live runtime warms the adapter at attach: the checkpoint warms itself
    warmed = []
    inner.warm = lambda: warmed.append(True)
    ad.warm()
    assert warmed == [True]


def test_window_takes_the_steps_after_the_warm_up():
    import bench_gpu

    # 2 warm-up steps of 10 and 6 ms (mean 8), then 3 steps of 4, 5 and 6 ms: mean over all 5 is 6.2
    first, last = {"decode_steps": 2, "x_ms": 8.0}, {"decode_steps": 5, "x_ms": 6.2}
    assert bench_gpu.window(first, last, "x_ms") == pytest.approx(5.0)
    assert bench_gpu.window({}, last, "x_ms") == 6.2  # fewer steps than the warm-up: the whole run


def test_repeated_reports_the_median_run_and_the_spread():
    import bench_gpu

    runs = iter(
        [
            {"measured_tpot_ms": 12.0, "k": "a"},
            {"measured_tpot_ms": 10.0, "k": "b"},
            {"measured_tpot_ms": 11.0, "k": "c"},
        ]
    )
    s = bench_gpu.Setup("m", None, torch.device("cpu"), [], 1, 1, ds_model.Routing(), repeats=3)
    row = bench_gpu.repeated(s, lambda: next(runs))
    assert row["measured_tpot_ms"] == 11.0 and row["k"] == "c"  # the median run's other figures
    assert row["measured_runs_ms"] == [10.0, 11.0, 12.0] and row["spread"] == pytest.approx(2 / 11)
    # an even count: the faster middle run, its TPOT with its figures (not the mean of two runs)
    runs = iter([{"measured_tpot_ms": 12.0, "k": "a"}, {"measured_tpot_ms": 10.0, "k": "b"}])
    row = bench_gpu.repeated(dataclasses.replace(s, repeats=2), lambda: next(runs))
    assert (row["measured_tpot_ms"], row["k"]) == (10.0, "b") and row["spread"] == pytest.approx(2 / 10)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--device", "gpu"], "--device gpu: name cuda"),
        (["--models", "tiny,foo"], "unknown model foo"),
        (["--precisions", "model,int3"], "--precisions: unknown expert dtype 'int3'"),
        (["--layers", "0"], "--layers must be at least 1"),
        (["--requests", "2", "--tokens", "1"], "leave none past the 2 warm-up steps"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_before_anything_runs(argv, says, capsys):
    import bench_gpu

    with pytest.raises(SystemExit) as exc:
        bench_gpu.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "Traceback" not in err


def test_a_prefill_mismatch_is_a_miss_and_a_staged_row_says_so():
    import bench_gpu

    ex = {"model": "m", "config": "exactness (alpha 0)", "kind": "exactness", "status": "ok", "equal": True,
          "max_abs_diff": 0.0, "prefill_equal": False, "prefill_max_abs_diff": 2.86e-6}  # fmt: skip
    figs = {f["name"]: f for f in bench_gpu.figures([ex]) if "alpha-0" in f["name"]}
    assert figs["m: alpha-0 logits vs the model's, one token a forward"]["verdict"] == "ok"
    after = figs["m: alpha-0 logits vs the model's, after the prefill"]
    assert after["verdict"] == "MISS" and "2.86e-06" in after["value"]
    assert "prefill_equal=NO" in bench_gpu._brief(ex)
    row = {"model": "m", "config": "on-demand LRU", "kind": "tpot", "status": "ok", "staged_layers": 3}
    s = bench_gpu.Setup("m", None, torch.device("cpu"), [], 1, 1, ds_model.Routing(), repeats=3)
    lines = bench_gpu._tpot_lines(bench_gpu.Report("cpu", rows=[row]), s)
    assert "| on-demand LRU | ok: 3 layers' copies staged (over the pinning budget) |" in "\n".join(lines)
    assert any(line.startswith("Dry run:") for line in lines)  # the modeled column is another machine's


def test_the_calibration_line_compares_a_tokens_totals():
    """By hand: 4 layers of 2.0 ms and nothing after them probed (the probe spreads the LM head over
    the layers) is 8.0 ms; 4 x 1.5 + 3.0 after the last layer with the runtime attached is 9.0 ms."""
    import bench_gpu

    cal = {"layers": 4, "attn_ms_probe": 2.0, "step_ms_probe": 0.0, "attn_ms": 1.5, "step_ms": 3.0,
           "calibrated_on_steps": 30}  # fmt: skip
    line = bench_gpu._calibration_line(cal)
    assert "8.000 ms probed (4 x 2.000 a layer + 0.000 after the last)" in line
    assert "9.000 ms with the runtime's host work (4 x 1.500 + 3.000)" in line


def test_released_collects_a_rows_reference_cycles():
    import gc
    import weakref

    import bench_gpu

    class Held:
        pass

    gc.disable()
    try:
        a, b = Held(), Held()
        a.other, b.other = b, a  # a runtime's leftovers in a cycle: refcounts alone never free them
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None
        row = bench_gpu._released()
        assert gone() is None and row["peak_rss_gb"] > 0
    finally:
        gc.enable()


def test_ds_predictor_adapter_carries_the_gate_calibration_of_its_layers():
    """The checkpoint's gate calibration, cut to the bench model's first layers: bench_tiers runs its
    prefetch-gated rows only where there is one."""
    import bench_tiers
    from moecast.predictors.calibration import Calibration
    from moecast.runtime.profile.measure import llapor_standin

    inner = llapor_standin(num_layers=6, num_experts=64, top_k=6)
    assert ds_model.LayerSubsetPredictor(inner, {}, layers=3).calibration is None
    edges = np.arange(6 * 2, dtype=float).reshape(6, 2)
    inner.calibration = Calibration(edges, np.linspace(0, 1, 18).reshape(6, 3), samples=7)
    ad = ds_model.LayerSubsetPredictor(inner, {}, layers=3)
    assert np.array_equal(ad.calibration.edges, edges[:3]) and ad.calibration.prob.shape == (3, 3)
    assert ad.calibration.samples == 7
    assert bench_tiers.gated(SimpleNamespace(predictor=ad))
    assert not bench_tiers.gated(SimpleNamespace(predictor=None))


def test_rows_runs_only_the_rows_named(tmp_path, monkeypatch):
    """--rows: the measured rows whose name contains one of its parts run, the others are listed as
    skipped, and the profile and calibration still run (the rows are modeled on them). Catches a filter
    that drops the set-up or runs everything."""
    import bench_gpu

    monkeypatch.setattr(sys, "argv", ["bench_gpu.py"])
    args = ["--device", "cpu", "--quick", "--ds-shape", "test", "--models", "deepseek", "--out", str(tmp_path),
            "--requests", "1", "--tokens", "5", "--repeats", "1", "--precisions", "model,int4",
            "--group-size", "32", "--tiers", "host", "--rows", "on-demand lru",
            "--host-profile", "on-demand LRU (int4"]  # fmt: skip
    by = {r["config"]: r for r in bench_gpu.run(args)}
    ran = {c for c, r in by.items() if r["status"] == "ok" and r["kind"] in ("tpot", "exactness")}
    assert ran == {"on-demand LRU", "on-demand LRU (int4-g32)"}
    for c in ("full residency", "exactness (alpha 0)", "runtime, all resident", "PreSched + CPU experts"):
        assert by[c]["status"] == "skipped" and by[c]["note"] == "not in --rows"
    assert by["profile"]["status"] == by["calibrate (all resident)"]["status"] == "ok"
    assert by["on-demand LRU"]["modeled_tpot_ms"] > 0
    # --host-profile: the int4 row's profile, by owner and function; the other row has none
    assert "host_profile" not in by["on-demand LRU"]
    text = Path(by["on-demand LRU (int4-g32)"]["host_profile"]).read_text()
    assert text.startswith("# host profile: on-demand LRU (int4-g32)") and "forward_layer" in text
    owners = dict(ln[2:].split(": ") for ln in text.splitlines() if ln.startswith("- "))
    assert {"moecast", "transformers", "torch", "bench harness"} <= set(owners)
    assert all(float(v) >= 0 for v in owners.values()) and "self_cpu_time_total" in text


def test_profile_owners():
    """A profiled function's owner from its file: catches the device's venv under /opt/torch counting
    every package there as torch, and built-ins left unowned."""
    import bench_gpu

    site = "/opt/torch/.venv/lib/python3.12/site-packages"
    assert bench_gpu._owner(f"{site}/numpy/_core/fromnumeric.py", "sum") == "numpy"
    assert bench_gpu._owner(f"{site}/safetensors/torch.py", "load") == "other"
    assert bench_gpu._owner(f"{site}/moecast/runtime/live/runtime.py", "forward_layer") == "moecast"
    assert bench_gpu._owner("~", "<built-in method torch._grouped_mm>") == "torch"
    assert bench_gpu._owner(str(bench_gpu.RESULTS.parent / "ds_model.py"), "forward") == "bench harness"
    assert (
        bench_gpu._owner(str(bench_gpu.RESULTS.parents[1] / "runtime" / "core" / "step.py"), "layer")
        == "moecast"
    )


def test_device_busy_counts_the_device_side_events_once():
    """Kernels and copies from the device-side events only: catches counting the host operator that
    launched a kernel as well (its device time is the same kernel's), and copies counted as kernels."""
    import bench_gpu
    from torch.autograd import DeviceType

    ev = [SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU, device_time_total=40.0),
          SimpleNamespace(key="sm90_xmma_gemm_bf16", device_type=DeviceType.CUDA, device_time_total=40.0),
          SimpleNamespace(key="Memcpy HtoD (Pinned -> Device)", device_type=DeviceType.CUDA, device_time_total=350.0),
          SimpleNamespace(key="void at::native::silu", device_type=DeviceType.CUDA, device_time_total=2.5)]  # fmt: skip
    assert bench_gpu.device_busy(ev) == {"kernels": 42.5, "copies": 350.0}
