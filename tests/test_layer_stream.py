"""A layer-ahead predictor fed layer by layer (predictors/layer_stream.py) scores what its batch path scores."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from moecast.collect.traceset import RequestTrace
from moecast.predictors.base import (
    BatchScorer,
    LayerStream,
    LearningPlanner,
    OnlineStream,
    PromptPlanner,
    StreamingPredictor,
)
from moecast.predictors.baselines import CooccurrencePredictor, FrequencyPredictor, GateReusePredictor
from moecast.predictors.layer_stream import TraceWindow
from moecast.predictors.llapor import LLaPor
from moecast.predictors.llapor_features import FeatureSpec
from moecast.predictors.llapor_net import LLaPorNet, NetConfig

L, E, K, H, T = 4, 8, 2, 6, 9


def _request(seed: int = 0) -> RequestTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T * L)]).reshape(T, L, K).astype(np.int16)
    w = rng.random((T, L, K)).astype(np.float16)
    gate = rng.normal(size=(T, L, H)).astype(np.float32)
    tokens = rng.integers(0, 50, T)
    return RequestTrace("r", "w", "c", "p", tokens, ["x"] * T, np.zeros(T, bool), ids, w, None, gate)


def _llapor() -> LLaPor:
    torch.manual_seed(0)
    spec = FeatureSpec(
        num_layers=L,
        num_experts=E,
        top_k=K,
        history_tokens=2,
        token_buckets=50,
        context_tokens=1,
        gate_pca=True,
        pca_dims=[3, 3, 2, 2],
        gate_hidden=H,
        weights=True,
        context_gate=2,
    )
    net = LLaPorNet(spec, {"input": [0], "middle": [1, 2], "output": [3]}, NetConfig(hidden=16, dropout=0.0))
    with torch.no_grad():
        net.pca.components.normal_()
        net.pca.mean.normal_(std=0.3)
    return LLaPor(net, [1, 2, 3, 4], int8_kernel=False)


def _drive(stream: LayerStream, req: RequestTrace, prompt: int, learn_lr: float | None = None) -> dict:
    """Run ``req`` through ``stream``: its first ``prompt`` tokens as one prefill step, then one
    token per step; returns {(t, layer): scores} of every decode token and layer."""
    ids, w, g = req.topk_ids, req.topk_weights, req.gate_inputs
    stream.reset(req.token_ids[:prompt])
    for layer in range(L):
        stream.observe(layer, ids[:prompt, layer], w[:prompt, layer], g[:prompt, layer])
    got = {}
    for t in range(prompt, T):
        stream.end_token(int(req.token_ids[t]))
        for layer in range(L):
            got[t, layer] = stream.predict_next(layer)
            stream.observe(layer, ids[t : t + 1, layer], w[t : t + 1, layer], g[t : t + 1, layer])
        if learn_lr is not None:
            stream.learn(learn_lr)
    return got


@pytest.mark.parametrize("window", [16, 3])
def test_llapor_streamed_layer_by_layer_scores_as_its_batch_path(window):
    """Full window or a short one that shifts: each (token, layer) equals score_request's row, which
    is causal (tested in test_llapor.py) and reads no further back than the window (history 2,
    context_gate 2)."""
    pred, req = _llapor(), _request()
    full = pred.score_request(req)
    stream = pred.stream() if window == 16 else TraceWindow(pred, window, pred.gate_width, pred.gate_tokens)
    _drive(stream, _request(seed=1), prompt=2)  # an earlier request: reset forgets it
    got = _drive(stream, req, prompt=4)
    assert len(got) == (T - 4) * L
    for (t, layer), scores in got.items():
        assert np.allclose(scores, full[t, layer], atol=1e-5), (t, layer)


def test_the_window_holds_what_the_features_read():
    pred, req = _llapor(), _request()
    stream = TraceWindow(pred, 3, pred.gate_width, pred.gate_tokens)
    _drive(stream, req, prompt=4)  # ends after the last token's layers ran, before its end_token
    tr = stream.trace
    assert list(tr.token_ids) == list(req.token_ids[-4:])
    assert np.array_equal(tr.topk_ids, req.topk_ids[-4:])
    assert not tr.topk_weights[:-1].any() and np.array_equal(tr.topk_weights[-1], req.topk_weights[-1])
    assert not tr.gate_inputs[0].any()  # three finished tokens, two of them context_gate rows
    assert np.array_equal(tr.gate_inputs[1:], req.gate_inputs[-3:])


def test_online_learning_through_the_stream_is_the_update_on_that_token():
    a, req = _llapor(), _request()
    b = copy.deepcopy(a)
    stream = a.stream()
    assert isinstance(stream, OnlineStream)
    _drive(stream, req, prompt=T - 1, learn_lr=0.05)
    row = {k: v[-1:] for k, v in b.features(req).items()}
    b.update(row, req.topk_ids[-1:].astype(np.int64), lr=0.05)
    for (name, pa), pb in zip(a.net.named_parameters(), b.net.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), name
    assert not torch.allclose(a.net.w_in.weight, _llapor().net.w_in.weight)  # it did learn


def test_baselines_stream_through_score_request():
    req = _request()
    rng = np.random.default_rng(1)
    meta = {"moe_layers": [1, 2, 3, 4], "num_experts": E, "top_k": K, "fingerprint": "f"}
    gate_reuse = GateReusePredictor(rng.normal(size=(L, E, H)).astype(np.float32), meta)
    cooc = CooccurrencePredictor(rng.random((L, E, E)), rng.random((L, E)), meta)
    for pred, layers in ((gate_reuse, range(1, L)), (cooc, range(L))):
        full = pred.score_request(req)
        got = _drive(pred.stream(), req, prompt=3)
        for (t, layer), scores in got.items():
            if layer in layers:  # gate reuse's layer 0 reads the previous token's gate input: not kept
                assert np.allclose(scores, full[t, layer], atol=1e-5), (type(pred).__name__, t, layer)


def _bare(cls: type) -> object:
    """An instance without its heavy state (an encoder, an index): what the protocols look at."""
    obj = object.__new__(cls)
    obj.num_layers, obj.num_experts, obj.top_k, obj.fingerprint = L, E, K, "f"
    return obj


def test_predictors_declare_what_they_can_be_asked():
    from moecast.predictors.cascade import Cascade
    from moecast.predictors.eam import EAM
    from moecast.predictors.eap import EAP

    meta = {"moe_layers": [1, 2, 3, 4], "num_experts": E, "top_k": K, "fingerprint": "f"}
    llapor = _llapor()
    freq = FrequencyPredictor(np.ones((L, E), np.float32), {**meta, "mode": "global"})
    assert isinstance(llapor, StreamingPredictor) and llapor.learns_online
    assert isinstance(llapor.stream(), LayerStream)
    assert isinstance(freq, BatchScorer) and not isinstance(freq, (StreamingPredictor, PromptPlanner))
    assert all(isinstance(_bare(c), LearningPlanner) for c in (EAM, Cascade))
    assert isinstance(_bare(EAP), PromptPlanner) and not isinstance(_bare(EAP), LearningPlanner)
    assert not isinstance(_bare(EAP), StreamingPredictor)


class _Blank:
    """A stand-in LayerAhead: only the shape the window reads (its scores are never asked for)."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k

    def score_at(self, trace, layer):
        return np.zeros(4, np.float32)


def test_a_prefill_steps_running_row_holds_its_last_tokens_routing():
    """Pins the running row (the window's last) holding the *last* token of a multi-token step.

    By hand: L = 2, k = 2, prefill of tokens [7, 8, 9], layer 0 routed [1, 2], [3, 4], [5, 6]: the
    running row's layer 0 is the last token's [5, 6] and its token id 9. Catches LS1 (the first
    token's [1, 2])."""
    w = TraceWindow(_Blank(2, 2), window=4)
    w.reset([7, 8, 9])
    w.observe(0, np.array([[1, 2], [3, 4], [5, 6]]), None, None)
    assert w.trace.topk_ids[-1, 0].tolist() == [5, 6]
    assert w.trace.token_ids[-1] == 9


def test_after_a_full_window_shifts_the_running_row_starts_empty():
    """Pins the running token's row being zero after the in-place shift of a full window (``trace``
    docstring: its later layers still zero).

    By hand: window 2, L = 2, k = 2; reset([5]), then three times: layer 0 [1, 2], layer 1 [3, 4],
    end_token(6 + i). The first two end_tokens rebuild the window (1, then 2 finished tokens); the third
    finds 2 finished + the running row = window + 1 and shifts: finished tokens 6, 7, running token 8
    with routing [[0, 0], [0, 0]]. Catches LS2 (the shift leaves the last token's [[1, 2], [3, 4]])."""
    w = TraceWindow(_Blank(2, 2), window=2)
    w.reset([5])
    for i in range(3):
        w.observe(0, np.array([[1, 2]]), None, None)
        w.observe(1, np.array([[3, 4]]), None, None)
        w.end_token(6 + i)
    tr = w.trace
    assert tr.token_ids.tolist() == [6, 7, 8]
    assert tr.topk_ids[-1].tolist() == [[0, 0], [0, 0]]
    assert tr.topk_ids[:-1].tolist() == [[[1, 2], [3, 4]]] * 2


def test_gate_tokens_equal_to_the_window_keep_every_finished_tokens_gate_input():
    """Pins gate_tokens being capped at the window (not window - 1).

    By hand: window 2, gate width 3, gate_tokens 2, L = 1, k = 1; two one-token steps observe gate
    inputs g1 = [1, 1, 1] then g2 = [2, 2, 2] at layer 0, each followed by end_token: both finished
    tokens keep theirs, gate_inputs[:-1, 0] = [g1, g2]. Catches LS4 (a cap of window - 1 = 1 keeps only
    g2: [[0, 0, 0], [2, 2, 2]])."""
    w = TraceWindow(_Blank(1, 1), window=2, gate_width=3, gate_tokens=2)
    w.reset([5])
    for t, g in ((6, 1.0), (7, 2.0)):
        w.observe(0, np.array([[0]]), None, np.full((1, 3), g, np.float32))
        w.end_token(t)
    assert w.gate_tokens == 2
    assert w.trace.gate_inputs[:-1, 0].tolist() == [[1, 1, 1], [2, 2, 2]]
