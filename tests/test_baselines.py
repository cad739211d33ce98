"""Baselines: frequency tables, gate reuse, MoE-Infinity activation matrices; CLI eval and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import ModelInfo, RequestRecord, TraceMeta, TraceSet, TraceWriter
from moecast.predictors import load
from moecast.predictors.baselines import (
    ActivationMatrixPredictor,
    FrequencyPredictor,
    GateReusePredictor,
    _Base,
    fitted_meta,
)
from moecast.predictors.checkpoint import CheckpointError
from moecast.predictors.commands import evaluate, evaluate_predictor
from moecast.predictors.metrics import recall_at_k
from moecast.predictors.registry import KINDS


def _router_traces(
    path: Path, L: int = 3, E: int = 8, k: int = 2, H: int = 12, requests: int = 6, T: int = 10
):
    """Traces whose layer-l routing is top-k of W_l @ x with x shared by all layers, and the model folder."""
    rng = np.random.default_rng(7)
    W = rng.normal(size=(L, E, H)).astype(np.float32)
    info = ModelInfo("router-test", "synthetic", list(range(1, L + 1)), E, k, 0, H, 100, True)
    writer = TraceWriter(
        path / "traces",
        TraceMeta(info, fields={"topk_weights": False, "router_probs": False, "gate_inputs": True}),
    )
    recs = []
    for r in range(requests):
        x = rng.normal(size=(T, H)).astype(np.float32)
        ids = np.argsort(-np.einsum("th,leh->tle", x, W), -1)[..., :k]
        recs.append(
            RequestRecord(
                f"r{r}",
                "w",
                "c",
                "p",
                np.arange(T),
                ["t"] * T,
                np.zeros(T, bool),
                ids.astype(np.int16),
                gate_inputs=np.repeat(x[:, None], L, 1).astype(np.float16),
            )
        )
    writer.write(recs)
    from safetensors.numpy import save_file

    model = path / "model"
    model.mkdir()
    save_file(
        {f"model.layers.{i + 1}.mlp.gate.weight": W[i] for i in range(L)}
        | {"model.layers.1.mlp.gate_proj.weight": np.zeros((4, H), np.float32)},
        str(model / "model.safetensors"),
    )
    return TraceSet(path / "traces"), model, W


def test_global_frequency_is_the_training_hot_table(synthetic_traces):
    ts = TraceSet(synthetic_traces)
    train, val = ts.split(0.3, 0)
    pred = FrequencyPredictor.fit(ts, train)
    ids = ts.array("topk_ids", train)
    for li in range(ts.num_layers):
        counts = np.bincount(ids[:, li].ravel(), minlength=ts.num_experts)
        assert np.allclose(pred.table[li], counts / counts.sum())
    scores = pred.score_request(ts.get(val[0]))
    assert scores.shape == (len(ts.get(val[0])), ts.num_layers, ts.num_experts)
    assert np.allclose(scores[0], scores[-1])  # statistical: the same for every token


def test_request_frequency_uses_only_the_prefix(synthetic_traces):
    ts = TraceSet(synthetic_traces)
    pred = FrequencyPredictor.fit(ts, ts.request_ids, "request")
    trace = ts.get(ts.request_ids[0])
    scores = pred.score_request(trace)
    assert np.allclose(scores[0], pred.table)  # nothing seen yet: the prior alone
    changed = trace.topk_ids.copy()
    changed[5:] = (changed[5:] + 1) % ts.num_experts  # the future must not matter
    trace.topk_ids = changed
    assert np.allclose(pred.score_request(trace)[:6], scores[:6])


def test_cooccurrence_is_layer_ahead_and_beats_the_hot_table(synthetic_traces):
    from moecast.predictors.baselines import CooccurrencePredictor

    ts = TraceSet(synthetic_traces)
    pred = CooccurrencePredictor.fit(ts, ts.request_ids)
    trace = ts.get(ts.request_ids[0])
    base = pred.score_request(trace)
    changed = trace.topk_ids.copy()
    changed[:, 1:] = (changed[:, 1:] + 1) % ts.num_experts  # layers >= 1 do not feed layer 1
    trace.topk_ids = changed
    assert np.allclose(pred.score_request(trace)[:, :2], base[:, :2])
    co = evaluate("cooccurrence", str(synthetic_traces), split="all")
    hot = evaluate("frequency", str(synthetic_traces), split="all")
    assert co["recall_at_k"] > hot["recall_at_k"]


def test_gate_reuse_refuses_router_weights_of_another_model(synthetic_traces, tmp_path):
    model_dir = tmp_path / "other-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "hidden_size": 16}))
    with pytest.raises(ValueError, match="is not the model"):
        GateReusePredictor.from_model_dir(model_dir, TraceSet(synthetic_traces))


def test_activation_matrix_matching_and_roundtrip(synthetic_traces, tmp_path):
    ts = TraceSet(synthetic_traces)
    pred = ActivationMatrixPredictor.fit(ts, ts.request_ids, capacity=4)
    assert pred.matrices.shape == (4, ts.num_layers, ts.num_experts)
    assert np.allclose(pred.matrices.sum(-1), 1.0)
    trace = ts.get(ts.request_ids[0])
    scores = pred.score_request(trace)
    assert np.allclose(scores[0], pred.matrices.mean(0))  # before any token: the collection mean
    pred.save(tmp_path / "mi.safetensors")
    again = load(tmp_path / "mi.safetensors", fingerprint=ts.meta.model.fingerprint)
    assert np.allclose(again.score_request(trace), scores)


def test_gate_reuse_with_the_true_router_predicts_well(tmp_path):
    ts, model, W = _router_traces(tmp_path)
    pred = GateReusePredictor.from_model_dir(model, ts)
    assert np.allclose(pred.router, W)
    res = evaluate_predictor(pred, ts, ts.request_ids, progress=False)
    # gate inputs are equal across layers here, so layer l-1's input gives layer l's routing exactly;
    # only layer 0 (previous token's input) is a guess
    assert res["per_layer"]["recall_at_k"][1] == 1.0 and res["per_layer"]["recall_at_k"][2] == 1.0
    assert res["per_layer"]["recall_at_k"][0] < 1.0
    pred.save(tmp_path / "gr.safetensors")
    assert isinstance(load(tmp_path / "gr.safetensors"), GateReusePredictor)


def test_gate_reuse_without_gate_inputs_says_so(tmp_path):
    path = make_synthetic_traceset(tmp_path / "ids", with_optional=False)
    with pytest.raises(Exception, match="gate_inputs"):
        evaluate("gate-reuse:" + str(tmp_path), str(path))


def test_eval_cli_json_and_baseline_save(synthetic_traces, tmp_path, capsys):
    out = evaluate(
        "frequency", str(synthetic_traces), split="all", json=True, save=str(tmp_path / "f.safetensors")
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("recall_at_k", "precision", "f1_micro", "f1_macro"):
        assert key in line and 0.0 <= line[key] <= 1.0
    assert line["recall_at_k"] == pytest.approx(out["recall_at_k"])
    ts = TraceSet(synthetic_traces)
    pred = load(tmp_path / "f.safetensors")
    direct = np.mean(
        [recall_at_k(pred.score_request(t), t.topk_ids) for t in ts]
    )  # equal lengths: mean of means
    assert out["recall_at_k"] == pytest.approx(direct)


def test_checkpoint_of_another_model_is_refused(synthetic_traces, tmp_path):
    other = make_synthetic_traceset(tmp_path / "other", num_experts=16)
    ts = TraceSet(other)
    FrequencyPredictor.fit(ts, ts.request_ids).save(tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="fingerprint"):
        evaluate(str(tmp_path / "other.safetensors"), str(synthetic_traces))


def test_cli_reports_bad_input_in_one_line(synthetic_traces, tmp_path):
    from moecast.cli import main

    other = make_synthetic_traceset(tmp_path / "other", num_experts=16)
    ts = TraceSet(other)
    FrequencyPredictor.fit(ts, ts.request_ids).save(tmp_path / "other.safetensors")
    ids_only = make_synthetic_traceset(tmp_path / "ids", with_optional=False)
    cases = [
        (
            ["predictors", "eval", str(tmp_path / "other.safetensors"), "--traces", str(synthetic_traces)],
            "fingerprint",
        ),
        (["predictors", "eval", "gate-reuse:" + str(tmp_path), "--traces", str(ids_only)], "gate_inputs"),
        (
            [
                "predictors",
                "eval",
                "frequency",
                "--traces",
                str(synthetic_traces),
                "--split",
                "val",
                "--val-fraction",
                "0",
            ],
            "split",
        ),
        (["predictors", "eval", "frequency", "--traces", str(tmp_path / "missing")], "missing"),
    ]
    for argv, word in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        msg = str(exc.value.code)
        assert msg.startswith("moecast: error:") and word in msg and "\n" not in msg, msg


def test_baselines_get_llapor_layer_groups_in_eval(synthetic_traces, capsys):
    out = evaluate("frequency", str(synthetic_traces), split="all", json=True)
    assert set(out["per_group"]) <= {"input", "middle", "output"} and out["per_group"]


def test_empty_split_and_unknown_baseline(synthetic_traces):
    with pytest.raises(ValueError, match="baseline"):
        evaluate("no-such-thing", str(synthetic_traces))
    with pytest.raises(ValueError, match="split"):
        evaluate("frequency", str(synthetic_traces), split="val", val_fraction=0.0)


def test_cli_reaches_eval(synthetic_traces, capsys):
    from moecast.cli import main

    main(["predictors", "eval", "moe-infinity", "--traces", str(synthetic_traces), "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["predictor"] == "moe-infinity"


def _activation_traces(path: Path, routes: dict[str, list[tuple[int, int]]]) -> TraceSet:
    """Traces with L = 2 layers, E = 4 experts, top-1: request -> each token's (layer 0, layer 1) expert."""
    info = ModelInfo("activation-test", "synthetic", [1, 2], 4, 1, 0, 8, 100, True)
    fields = {"topk_weights": False, "router_probs": False, "gate_inputs": False}
    writer = TraceWriter(path, TraceMeta(info, fields=fields))
    recs = []
    for rid, tokens in routes.items():
        T = len(tokens)
        ids = np.array(tokens, np.int16).reshape(T, 2, 1)
        recs.append(RequestRecord(rid, "w", "c", "p", np.arange(T), ["t"] * T, np.zeros(T, bool), ids))
    writer.write(recs)
    return TraceSet(path)


def test_activation_matrix_matching_picks_the_most_cosine_similar_request(tmp_path):
    spread = [(e, e) for e in (0, 1, 2, 3)] * 2
    query_head = [(e, e) for e in (0, 0, 0, 1, 1, 2, 2, 3, 3)]  # counts [3, 2, 2, 2] at both layers
    ts = _activation_traces(
        tmp_path / "t",
        {
            "hot0": [(0, 0)] * 8,  # stored [L, E] rows: [1, 0, 0, 0] at both layers
            "spread": spread,  # [.25, .25, .25, .25] at both layers
            "split": [(3, 2)] * 8,  # expert 3 at layer 0, expert 2 at layer 1
            "query": query_head + [(0, 0)] * 21,
            "query2": [(3, 2)] * 5 + [(0, 1)],
        },
    )
    pred = ActivationMatrixPredictor.fit(ts, ["hot0", "spread", "split"])
    hot0, spread_m, split = pred.matrices
    assert np.allclose(hot0, [[1, 0, 0, 0]] * 2) and np.allclose(spread_m, 0.25)
    assert np.allclose(split, [[0, 0, 0, 1], [0, 0, 1, 0]])

    scores = pred.score_request(ts.get("query"))
    assert np.allclose(scores[0], pred.matrices.mean(0))  # nothing seen yet
    # after the 9 head tokens (counts [3, 2, 2, 2]): cosine 0.98 with "spread", 0.65 with "hot0".
    # An unnormalised match (dot product 4.5 vs 6) would pick "hot0": the matching is by cosine
    assert np.allclose(scores[9], spread_m)
    assert np.allclose(scores[1], hot0)  # one token on expert 0: "hot0" is the exact direction
    assert np.allclose(scores[-1], hot0)  # 21 more tokens on expert 0 outweigh the head
    # token t sees tokens < t only; every row is the stored matrix nearest by cosine to that prefix
    hot = np.zeros((30, 2, 4))
    np.put_along_axis(hot, ts.get("query").topk_ids.astype(np.int64), 1.0, -1)
    prefix = (np.cumsum(hot, 0) - hot).reshape(30, -1)
    stored = pred.matrices.reshape(3, -1)
    cos = prefix @ stored.T / np.maximum(np.linalg.norm(prefix, axis=1, keepdims=True), 1e-12)
    cos /= np.linalg.norm(stored, axis=1)
    best = cos[1:].argmax(1)
    assert set(best.tolist()) == {0, 1}  # the match moves from "hot0" to "spread" and back
    assert np.allclose(scores[1:], pred.matrices[best])
    # a request routed like "split" is matched to it, from its second token on
    assert np.allclose(pred.score_request(ts.get("query2"))[1:], split)


def test_cooccurrence_rows_are_conditional_distributions_over_every_pair(tmp_path):
    """Pins CooccurrencePredictor.fit counting every (layer l-1 expert, layer l expert) pair of a token
    (k x k pairs) and normalising each source row to P(e at l | j at l-1) before score_request sums
    the rows of a token's k experts.

    By hand (L = 2, E = 6, k = 2): training tokens 2 x (l0 {0,1}, l1 {2,3}), 2 x (l0 {0,1}, l1 {4,5}),
    1 x (l0 {2,3}, l1 {0,1}). Row 0 of layer 1: pairs 0->2, 0->3, 0->4, 0->5 twice each, 8 in all ->
    0.25 each; row 2: 2->0, 2->1 once each -> 0.5 each. Prior at layer 1: counts [1,1,2,2,2,2] / 10.
    A token with l0 {0, 2}: [0.5, 0.5, 0.25, 0.25, 0.25, 0.25] + 1e-3 * prior -> top-2 {0, 1}.
    Catches BA4 (rows unnormalised: [1, 1, 2, 2, 2, 2], top-2 inside {2..5}) and BA7 (aligned pairs
    only, 0->2 and 1->3 / 0->4 and 1->5: row 0 = [0, 0, 0.5, 0, 0.5, 0])."""
    from moecast.predictors.baselines import CooccurrencePredictor

    info = ModelInfo("cooc-test", "synthetic", [1, 2], 6, 2, 0, 8, 100, True)
    fields = {"topk_weights": False, "router_probs": False, "gate_inputs": False}
    writer = TraceWriter(tmp_path / "t", TraceMeta(info, fields=fields))
    routes = {
        "a": [((0, 1), (2, 3))] * 2,
        "b": [((0, 1), (4, 5))] * 2,
        "c": [((2, 3), (0, 1))],
        "q": [((0, 2), (4, 5))],
    }
    recs = []
    for rid, tokens in routes.items():
        T = len(tokens)
        ids = np.array(tokens, np.int16)  # [T, L, k]
        recs.append(RequestRecord(rid, "w", "c", "p", np.arange(T), ["t"] * T, np.zeros(T, bool), ids))
    writer.write(recs)
    ts = TraceSet(tmp_path / "t")
    pred = CooccurrencePredictor.fit(ts, ["a", "b", "c"])
    np.testing.assert_allclose(pred.table[1][0], [0, 0, 0.25, 0.25, 0.25, 0.25])
    np.testing.assert_allclose(pred.table[1][2], [0.5, 0.5, 0, 0, 0, 0])
    scores = pred.score_request(ts.get("q"))[0, 1]
    np.testing.assert_allclose(
        scores,
        np.array([0.5, 0.5, 0.25, 0.25, 0.25, 0.25]) + 1e-3 * np.array([1, 1, 2, 2, 2, 2]) / 10,
        rtol=1e-6,
    )
    assert set(np.argsort(-scores, kind="stable")[:2].tolist()) == {0, 1}


def test_activation_matrix_collection_holds_1000_requests_by_default(tmp_path):
    import inspect

    from moecast.predictors.commands import build_baseline

    assert inspect.signature(ActivationMatrixPredictor.fit).parameters["capacity"].default == 1000
    ts = _activation_traces(tmp_path / "t", {f"r{i}": [(i % 4, (i // 4) % 4)] for i in range(1003)})
    pred = build_baseline("moe-infinity", ts, ts.request_ids)  # what `predictors eval moe-infinity` builds
    assert isinstance(pred, ActivationMatrixPredictor)
    assert pred.matrices.shape == (1000, 2, 4) and pred.metadata()["capacity"] == 1000
    small = ActivationMatrixPredictor.fit(ts, ts.request_ids[:10])  # fewer requests: all of them, in order
    assert np.allclose(small.matrices[:, 0].argmax(-1), [i % 4 for i in range(10)])


class ToyPredictor(_Base):
    """A contributor's kind, registered by the tests below only: statistical, every score 1, ``n`` the
    number of requests it was fitted on; its ``update`` is no online learning step."""

    name = "toy"
    horizon = "statistical"

    def __init__(self, n: int, meta: dict) -> None:
        super().__init__(meta)
        self.n = int(n)

    @classmethod
    def fit(cls, ts: TraceSet, train_ids: list[str]) -> ToyPredictor:
        return cls(len(train_ids), fitted_meta(ts, train_ids))

    def score_request(self, trace) -> np.ndarray:
        return np.ones((len(trace), self.num_layers, self.num_experts), np.float32)

    def update(self, more: int) -> None:
        self.n += more

    def tensors(self) -> dict:
        return {"n": np.array([self.n], np.int64)}

    @classmethod
    def from_checkpoint(cls, tensors: dict, meta: dict, path: Path) -> ToyPredictor:
        return cls(int(tensors["n"][0]), meta)


def test_a_registered_kind_is_built_saved_and_listed_by_predictors_eval(
    synthetic_traces, tmp_path, monkeypatch, capsys
):
    """A kind's module and its registration are all `predictors eval KIND --save` needs: it is fitted on
    the training side (6 requests: the default split leaves 4 there), saved with that split, loads
    back, and `--help` lists it with its horizon. The names were a hand-kept list and if-chain."""
    from moecast.cli import main

    monkeypatch.setitem(KINDS, "toy", "test_baselines:ToyPredictor")
    out = tmp_path / "toy.safetensors"
    main(["predictors", "eval", "toy", "--traces", str(synthetic_traces), "--save", str(out), "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ts = TraceSet(synthetic_traces)
    sides = ts.splits()
    assert (len(sides.train), len(sides.val), len(sides.test)) == (4, 1, 1)
    assert res["predictor"] == "toy" and res["split"] == "test" and res["requests"] == 1
    back = load(out, fingerprint=ts.meta.model.fingerprint)
    assert isinstance(back, ToyPredictor) and back.n == 4
    assert back.checkpoint_meta["split"]["train_requests"] == 4
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help lines at hyphens too
    with pytest.raises(SystemExit) as exc:
        main(["predictors", "eval", "--help"])
    assert exc.value.code == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert "cooccurrence (layer-ahead), toy (statistical), gate-reuse:MODEL_DIR (router weights" in listed


def test_a_package_adds_its_kind_through_an_entry_point(synthetic_traces, tmp_path, monkeypatch, capsys):
    """A predictor in a package of its own reaches the `moecast` command by declaring its kind in the
    ``moecast.predictors`` entry points, with no edit to moecast: `predictors eval toy --save` builds
    it and its checkpoint loads. Without the package the checkpoint's kind is refused in one line that
    says how a kind of another package is found. Catches a registry that reads only its own table."""
    import importlib.metadata as md

    from moecast.predictors import registry

    from moecast.cli import main

    real = md.entry_points
    toy = md.EntryPoint(name="toy", value="test_baselines:ToyPredictor", group=registry.ENTRY_POINTS)
    installed = [toy]

    def entry_points(**kw):
        return list(installed) if kw.get("group") == registry.ENTRY_POINTS else real(**kw)

    monkeypatch.setattr(md, "entry_points", entry_points)
    assert "toy" not in KINDS
    out = tmp_path / "toy.safetensors"
    main(["predictors", "eval", "toy", "--traces", str(synthetic_traces), "--save", str(out), "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["predictor"] == "toy"
    assert isinstance(load(out), ToyPredictor)
    installed.clear()  # the package uninstalled
    with pytest.raises(
        CheckpointError, match=r"unknown predictor kind 'toy'; .*'moecast.predictors' entry points"
    ):
        load(out)
    # a package's kind never shadows one of moecast's own
    installed.append(
        md.EntryPoint(name="frequency", value="test_baselines:ToyPredictor", group=registry.ENTRY_POINTS)
    )
    assert registry.kind_class("frequency") is not ToyPredictor


def test_online_lr_asks_whether_the_predictor_learns_online(synthetic_traces, tmp_path, monkeypatch):
    """`--online-lr` asks the protocol the live runtime asks (``learns_online``), not for a method
    named ``update``: the toy kind has one (no learning step), and went on to a traceback on LLaPor's
    ``features``. The message names the option as typed."""
    from moecast.cli import main

    monkeypatch.setitem(KINDS, "toy", "test_baselines:ToyPredictor")
    ts = TraceSet(synthetic_traces)
    ckpt = ToyPredictor.fit(ts, ts.request_ids).save(tmp_path / "toy.safetensors")
    base = ["predictors", "eval", str(ckpt), "--traces", str(synthetic_traces)]
    for flag, said in (
        (
            "--online-lr=0.01",
            "--online-lr 0.01 asks for online updates, but the toy predictor has no online update",
        ),
        ("--online-lr=-1", "--online-lr -1.0 is negative; give a learning rate >= 0"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([*base, flag])
        msg = str(exc.value.code)
        assert msg.startswith(f"moecast: error: {said}") and "online_lr" not in msg, msg


def test_gate_reuse_records_that_it_was_fitted_on_no_request(tmp_path, capsys):
    """Router weights read from a model: ``split`` null, so every request of any TraceSet is held out
    (a replay of them warns of nothing), where a header with no split is possibly in-sample."""
    import warnings

    from moecast.predictors.provenance import warn_in_sample

    ts, model, _ = _router_traces(tmp_path)
    pred = GateReusePredictor.from_model_dir(model, ts)
    assert "split" in pred.meta and pred.meta["split"] is None
    ckpt = str(pred.save(tmp_path / "gr.safetensors"))
    res = evaluate(ckpt, str(ts.path))
    assert res["split"] == "all" and res["requests"] == 6
    assert "none of them was trained on" in capsys.readouterr().out
    with warnings.catch_warnings():  # a replay of any of its requests is held out: nothing to say
        warnings.simplefilter("error")
        warn_in_sample(ts, [ckpt], list(ts.request_ids))


def test_a_baseline_that_records_no_split_is_not_saved(tmp_path):
    """A contributor's fit that writes no ``split`` (the docs' first example did) is refused at save, in
    one line saying how to record it, and no file is left."""
    meta = {"fingerprint": "f", "moe_layers": [1, 2, 3], "num_experts": 8, "top_k": 2, "trained_on": "t"}
    with pytest.raises(CheckpointError) as exc:
        FrequencyPredictor(np.full((3, 8), 1 / 8), meta).save(tmp_path / "f.safetensors")
    msg = str(exc.value)
    assert "records no `split`" in msg and "fitted_meta(ts, train_ids)" in msg and "\n" not in msg
    assert list(tmp_path.iterdir()) == []


def test_a_missing_checkpoint_says_how_to_build_one_as_well_as_train_one(tmp_path):
    """Frequency, hot and a contributor's kind are built by `predictors eval KIND --save`, not trained."""
    from moecast.predictors.checkpoint import load_raw

    with pytest.raises(CheckpointError) as exc:
        load_raw(tmp_path / "nope.safetensors")
    msg = str(exc.value)
    assert "no such checkpoint" in msg and "\n" not in msg
    assert f"`moecast predictors eval KIND --traces T --save {tmp_path / 'nope.safetensors'}`" in msg
    assert "`moecast train KIND`" in msg
