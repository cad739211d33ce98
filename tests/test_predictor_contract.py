"""Every registered predictor kind keeps the contract of predictors/base.py and docs/adding-a-predictor.md.

As ``test_every_registered_tier_implements_the_protocol`` does for tiers, these run for every kind in
``registry.kinds()`` (moecast's and installed packages'): each names itself by its kind, and each kind fitted from traces (a ``fit(ts,
train_ids)`` classmethod: what `predictors eval NAME` builds) is fitted on a small TraceSet and must give
[T, L, E] float32 scores, the same scores after a checkpoint round trip, rows that read nothing their
horizon may not know, and (layer-ahead) a stream that scores as its batch path. A kind registered by a
contributor is checked without a line here. Two planted predictors that read what they may not show
that the causality check catches it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import RequestTrace, TraceSet
from moecast.predictors.base import HORIZONS, LayerAhead, Predictor, PromptPlanner, StreamingPredictor
from moecast.predictors.commands import VARIANTS, build_baseline, buildable
from moecast.predictors.metrics import multi_hot
from moecast.predictors.registry import kind_class, kinds, load
from test_layer_stream import _drive

# the shape of test_layer_stream's _drive (its module's L and T): 4 MoE layers, 9 tokens
LAYERS, EXPERTS, TOP_K, TOKENS = 4, 8, 2, 9


@pytest.fixture(scope="module")
def ts(tmp_path_factory) -> TraceSet:
    path = tmp_path_factory.mktemp("contract") / "traces"
    return TraceSet(
        make_synthetic_traceset(
            path, num_requests=8, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, hidden=6, tokens=TOKENS
        )
    )


def _perturbed(trace: RequestTrace, t: int, layer: int) -> RequestTrace:
    """A copy of ``trace`` whose token t's routing at layers >= ``layer`` (ids, weights, router
    probabilities, gate inputs) and every later token (its id too) are changed."""
    out = replace(trace, token_ids=np.array(trace.token_ids))
    out.token_ids[t + 1 :] += 1
    for name in ("topk_ids", "topk_weights", "router_probs", "gate_inputs"):
        value = getattr(trace, name)
        if value is None:
            continue
        value = np.array(value)
        if name == "topk_ids":  # other experts, still k distinct ones
            value[t, layer:] = (value[t, layer:] + 1) % EXPERTS
            value[t + 1 :] = (value[t + 1 :] + 3) % EXPERTS
        else:
            value[t, layer:] = value[t, layer:] * 0.5 + 0.25
            value[t + 1 :] = value[t + 1 :] * 0.5 + 0.25
        setattr(out, name, value)
    return out


def first_leak(pred: Predictor, trace: RequestTrace) -> tuple[int, int] | None:
    """The first (t, l) whose row changes when something it may not read changes, else None.

    Row (t, l) of a layer-ahead predictor may read tokens < t and token t's layers < l: token t's
    layers >= l and every later token are changed, and rows (t' < t, all layers) and (t, l' <= l)
    must stay. Every other horizon reads tokens < t at most (the prompt, counts of the prefix): token
    t's routing at every layer and every later token are changed, and rows t' <= t must stay."""
    base = pred.score_request(trace)
    T, L, _ = base.shape
    layer_ahead = pred.horizon == "layer-ahead"
    for t in range(T):
        for layer in range(L) if layer_ahead else (0,):
            got = pred.score_request(_perturbed(trace, t, layer))
            if not np.array_equal(got[:t], base[:t]):
                return t, layer
            kept = slice(0, layer + 1) if layer_ahead else slice(None)
            if not np.array_equal(got[t, kept], base[t, kept]):
                return t, layer
    return None


def _kind_of(name: str) -> str:
    return VARIANTS.get(name, (name, {}))[0]


@pytest.mark.parametrize("kind", list(kinds()))  # moecast's and installed packages'
def test_every_registered_kind_is_named_by_its_kind(kind):
    """``name`` is the checkpoint's ``kind``: a class named otherwise would save checkpoints that load
    as another kind (or none)."""
    cls = kind_class(kind)
    assert cls.name == kind and cls.horizon in HORIZONS
    assert callable(getattr(cls, "from_checkpoint", None))


# every name `predictors eval NAME --save` fits (registered kinds with fit, and their variants)
@pytest.mark.parametrize("name", list(buildable()))
def test_every_kind_fitted_from_traces_keeps_the_contract(name, ts, tmp_path):
    train = ts.splits().train
    pred = build_baseline(name, ts, train)
    assert type(pred).name == _kind_of(name) and pred.label == name
    traces = [ts.get(r) for r in ts.request_ids]
    scores = [pred.score_request(t) for t in traces]
    for trace, s in zip(traces, scores):
        assert s.shape == (len(trace), LAYERS, EXPERTS) and s.dtype == np.float32
    # its checkpoint: loaded by its kind, the model checked, the same scores
    back = load(pred.save(tmp_path / f"{name}.safetensors"), fingerprint=ts.meta.model.fingerprint)
    assert type(back) is type(pred) and back.label == name
    for trace, s in zip(traces, scores):
        np.testing.assert_array_equal(back.score_request(trace), s)
    # causal for its horizon
    for trace in traces[:3]:
        assert first_leak(pred, trace) is None, (name, trace.request_id)
    if pred.horizon == "layer-ahead":  # the live runtime's stream scores what the replay scores
        assert isinstance(pred, StreamingPredictor)
        for trace, s in zip(traces[:3], scores):
            got = _drive(pred.stream(), trace, prompt=3)
            assert len(got) == (TOKENS - 3) * LAYERS
            for (t, layer), row in got.items():
                np.testing.assert_allclose(row, s[t, layer], rtol=1e-6, err_msg=f"{name} {t} {layer}")
    if isinstance(pred, PromptPlanner):  # replay reads row 0 as the plan the live runtime preloads
        np.testing.assert_array_equal(pred.plan(traces[0].prompt)[0], scores[0][0])


class _Leaky(LayerAhead):
    """Planted: row (t, l) is the experts layer l chose for token t itself (the oracle, non-causal)."""

    name, horizon = "leaky", "layer-ahead"
    num_layers, num_experts, top_k = LAYERS, EXPERTS, TOP_K

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        return multi_hot(np.asarray(trace.topk_ids), EXPERTS, np.float32)


class _LeakyCounts(Predictor):
    """Planted: per-request counts that include token t (an off-by-one of frequency-request's prefix)."""

    name, horizon = "leaky-counts", "statistical"
    num_layers, num_experts, top_k = LAYERS, EXPERTS, TOP_K

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        return np.cumsum(multi_hot(np.asarray(trace.topk_ids), EXPERTS, np.float32), 0)


def test_the_causality_check_catches_a_predictor_that_reads_what_it_may_not(ts):
    trace = ts.get(ts.request_ids[0])
    # the oracle's row (0, 0) reads token 0's layer 0, changed in the first perturbation
    assert first_leak(_Leaky(), trace) == (0, 0)
    assert first_leak(_LeakyCounts(), trace) == (0, 0)
