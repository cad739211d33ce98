"""The prefetch gate's calibration kept in the predictor's checkpoint, and the gate in the live runtime.

``moecast predictors calibrate`` fits the calibration the replay would fit on the val side of the
checkpoint's split and writes it into the checkpoint; the replay then uses it, and the live runtime
prices each layer's prefetch candidates with it exactly as the replay does (test_live_replay_equal's
recorded run and tight-window profile: one transfer 0.3 ms, a 0.15 ms window after the predictor, so
every prefetch that starts is late, and the gate starts it only where p * 0.3 > its lateness).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import make_synthetic_traceset
from moecast.collect.models import find_moe_structure, model_info
from moecast.collect.traceset import TraceSet
from moecast.predictors import calibration as C
from moecast.predictors.base import LayerAhead
from moecast.predictors.checkpoint import load_raw
from moecast.predictors.registry import load
from moecast.runtime.core.cost_model import HardwareProfile
from moecast.runtime.core.policy import POLICIES
from moecast.runtime.live.runtime import attach
from moecast.runtime.replay.engine import ReplayConfig, replay
from test_live_replay_equal import CAPACITY, as_traceset, live_run

from moecast.errors import InputError

GATED = POLICIES["prefetch-gated"]


class RecordedNoisy(LayerAhead):
    """A layer-ahead predictor whose scores are a fixed table over a recorded run's steps: the true
    experts score higher on average, not always, so its calibrated probabilities spread over (0, 1).
    The replay reads the table by token, the live runtime by step: the same scores on both sides."""

    name = "noisy"
    needs = ("topk_ids",)

    def __init__(self, routing: np.ndarray, num_experts: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        T, L, k = routing.shape
        self.table = rng.uniform(0, 1, (T, L, num_experts)).astype(np.float32)
        lift = rng.uniform(0, 0.8, routing.shape).astype(np.float32)
        np.put_along_axis(self.table, routing, np.take_along_axis(self.table, routing, 2) + lift, 2)
        self.num_layers, self.num_experts, self.top_k, self.rt = L, num_experts, k, None

    def score_request(self, trace) -> np.ndarray:
        return self.table[: len(trace.topk_ids)]

    def score_at(self, trace, layer: int) -> np.ndarray:
        return self.table[self.rt._step, layer]


def _gated_equal(tiny, profile, tmp_path, tier):
    """A gated live run and the replay of its routing with the same calibrated predictor; -> (stats, result)."""
    _, routing, _, info = live_run(tiny, "lru", profile, **tier)
    pred = RecordedNoisy(routing, info.num_experts)
    ts = as_traceset(tmp_path / "ts", info, routing, None)
    pred.calibration = C.fit(pred, ts, list(ts.request_ids))  # in-sample: one recorded request
    stats, ids, probs, info = live_run(tiny, GATED, profile, pred, "auto", **tier)
    assert np.array_equal(ids, routing)
    cfg = ReplayConfig(
        policy=GATED, capacity=CAPACITY, cold=True, hardware=str(profile), predictor=pred,
        expert_dtype=tier.get("expert_dtype", "model"), group_size=tier.get("group_size", 128),
    )  # fmt: skip
    r = replay(as_traceset(tmp_path / "ts2", info, ids, probs), cfg)
    assert r.extra["gate_calibrated_on"].startswith("the checkpoint's calibration")
    assert stats["hit_rate"] == r.hit_rate
    assert (stats["loads"], stats["cpu_experts"]) == (r.loads, r.cpu_experts)
    assert (stats["prefetches_issued"], stats["prefetches_landed"]) == (
        r.prefetches_issued,
        r.prefetches_landed,
    )
    assert stats["gate_refused"] == r.gate_refused
    assert stats["prefetch_accuracy"] == pytest.approx(r.prefetch_accuracy, rel=1e-12)  # used / inserted
    assert stats["modeled_tpot_ms"] == pytest.approx(r.modeled_tpot_ms, rel=1e-12)
    # the bytes prefetched and never used: what moved, at its copy; the refused late ones moved nothing
    assert stats["wasted_bytes"] == pytest.approx(r.wasted_mb_per_token * r.tokens * 2**20, rel=1e-12)
    issued_unused = (stats["prefetches_issued"] - stats["prefetch_used"]) * stats["expert_bytes"]
    assert 0 < stats["wasted_bytes"] < issued_unused
    return stats, r


@pytest.mark.parametrize("dtype", ["int8", "mixed"])
def test_live_and_replay_gate_the_same_prefetches(tiny, profile, tmp_path, dtype):
    """The disk tier at int8 and at mixed (model + int4-g64): the live step prices each candidate as the
    replay does, so the same late prefetches start (gate_refused equal and non-zero) and the figures agree."""
    tier = dict(offload="disk", offload_dir=str(tmp_path / "off"), expert_dtype=dtype, group_size=64)
    stats, r = _gated_equal(tiny, profile, tmp_path, tier)
    assert r.gate_refused > 0 and r.prefetches_landed > 0
    if dtype == "mixed":
        assert stats["upgrades"] == r.upgrades and stats["low_share"] == pytest.approx(r.low_share, abs=1e-12)
    # the gate changed what ran: prefetch-late starts every late prefetch the gate refused
    late, _, _, _ = live_run(tiny, "prefetch-late", profile, RecordedNoisy(*_routing(tiny, profile, tier)), "auto",
                             **tier)  # fmt: skip
    assert late["gate_refused"] == 0 and late["prefetches_landed"] > stats["prefetches_landed"]


def _routing(tiny, profile, tier):
    _, routing, _, info = live_run(tiny, "lru", profile, **tier)
    return routing, info.num_experts


def test_a_gated_policy_without_a_calibration_is_refused_at_attach(tiny):
    """One line naming the command that writes the calibration; the online prefetcher has none either."""
    info = model_info(tiny, find_moe_structure(tiny), "tiny")
    L, k = len(info.moe_layers), info.top_k
    pred = RecordedNoisy(
        np.zeros((1, L, k), np.int64), info.num_experts
    )  # the model's shape: attach checks it
    with pytest.raises(
        InputError, match=r"noisy's checkpoint has none: run `moecast predictors calibrate CKPT "
    ):
        attach(tiny, policy="prefetch-gated", capacity=CAPACITY, predictor=pred)
    with pytest.raises(InputError, match="the online prefetcher has none: run `moecast predictors calibrate"):
        attach(tiny, policy="prefetch-gated", capacity=CAPACITY)
    pred.calibration = C.Calibration(np.zeros((L + 1, 1)), np.zeros((L + 1, 2)))
    with pytest.raises(InputError, match=f"covers {L + 1} layers, the predictor {L}"):
        attach(tiny, policy="prefetch-gated", capacity=CAPACITY, predictor=pred)


# ------------------------------------------------------------------------------------ the checkpoint
@pytest.fixture
def two_tracesets(tmp_path):
    """Two TraceSets of one synthetic model and a co-occurrence checkpoint built on the first's split."""
    from moecast.cli import run

    a = make_synthetic_traceset(tmp_path / "a", num_requests=20, seed=0)
    b = make_synthetic_traceset(tmp_path / "b", num_requests=20, seed=1)
    ckpt = tmp_path / "cooc.safetensors"
    run(["predictors", "eval", "cooccurrence", "--traces", str(a), "--save", str(ckpt), "--json"])
    return a, b, ckpt


def _tight(ts_path, root) -> str:
    """test_live_replay_equal's tight window for the TraceSet's expert: a transfer 0.3 ms, attention
    0.35 ms, the predictor 0.2 ms (every prefetch that starts is late)."""
    eb = TraceSet(ts_path).meta.model.expert_bytes
    prof = HardwareProfile(name="tight", transfer_gbps=eb / 0.3e6, ref_expert_bytes=eb, gpu_expert_ms=0.05,
                           cpu_beta_ms=0.05, cpu_c_ms=0.3, attn_ms=0.35, predictor_ms=0.2)  # fmt: skip
    path = Path(root) / "tight.yaml"
    path.write_text(prof.to_yaml())
    return str(path)


def test_the_checkpoint_s_calibration_is_the_replay_s_val_fit(two_tracesets, monkeypatch):
    """The replay of a checkpoint without a calibration fits one on the val side; `predictors calibrate`
    writes the same edges and probabilities, and the replay with it reports the same figures."""
    from moecast.cli import run

    a, _, ckpt = two_tracesets
    fitted = []
    fit = C.Calibration.fit.__func__
    monkeypatch.setattr(
        C.Calibration, "fit", classmethod(lambda cls, *a, **k: fitted.append(fit(cls, *a, **k)) or fitted[-1])
    )
    cfg = ReplayConfig(policy="prefetch-gated", capacity=4, predictor=str(ckpt), hardware=_tight(a, a.parent))
    before = replay(a, cfg)
    assert len(fitted) == 1 and before.extra["gate_calibrated_on"].startswith("the 2 val requests")
    out = run(["predictors", "calibrate", str(ckpt), "--traces", str(a)])
    assert (out["side"], out["requests"], out["samples"]) == ("val", 2, fitted[0].samples)
    saved = load(ckpt).calibration
    assert np.array_equal(saved.edges, fitted[0].edges) and np.array_equal(saved.prob, fitted[0].prob)
    assert saved.samples == fitted[0].samples
    after = replay(a, cfg)
    assert len(fitted) == 2  # calibrate fitted once; this replay used the checkpoint's
    assert (
        after.extra["gate_calibrated_on"]
        == f"the checkpoint's calibration ({saved.samples} predictions: 2 val requests of {a})"
    )
    same = ("hit_rate", "loads", "prefetches_issued", "prefetches_landed", "gate_refused", "modeled_tpot_ms")
    assert [getattr(after, f) for f in same] == [getattr(before, f) for f in same]
    assert before.gate_refused > 0


def test_calibrate_rewrites_the_checkpoint_atomically_and_replaces_its_calibration(
    two_tracesets, monkeypatch
):
    """The predictor's tensors are copied unchanged; a write that fails leaves the old file whole; another
    TraceSet's val side gives other edges, which replace the first (one calibration per checkpoint)."""
    from moecast.cli import run

    a, b, ckpt = two_tracesets
    own, _ = load_raw(ckpt)
    run(["predictors", "calibrate", str(ckpt), "--traces", str(a)])
    first = load(ckpt)
    tensors, meta = load_raw(ckpt)
    assert set(tensors) == set(own) | {C.EDGES, C.PROB}
    assert all(np.array_equal(tensors[k].numpy(), v.numpy()) for k, v in own.items())
    assert meta["gate_calibration"]["traces"] == str(a) and meta["gate_calibration"]["side"] == "val"
    # a write that dies half-way (its bytes written, not yet synced or renamed) leaves the checkpoint as it was
    import os

    def dying(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", dying)
    with pytest.raises(OSError):
        run(["predictors", "calibrate", str(ckpt), "--traces", str(b)])
    monkeypatch.undo()
    assert np.array_equal(load(ckpt).calibration.edges, first.calibration.edges)
    assert [p.name for p in ckpt.parent.iterdir() if "cooc" in p.name] == [ckpt.name]  # no temporary left
    run(["predictors", "calibrate", str(ckpt), "--traces", str(b)])
    second = load(ckpt)
    assert not np.array_equal(second.calibration.edges, first.calibration.edges)
    assert second.checkpoint_meta["gate_calibration"]["traces"] == str(b)
    assert set(load_raw(ckpt)[0]) == set(own) | {C.EDGES, C.PROB}


def test_calibrate_refuses_a_traceset_without_a_val_side(tmp_path):
    from moecast.cli import run

    few = make_synthetic_traceset(tmp_path / "few", num_requests=2)
    ckpt = tmp_path / "cooc.safetensors"
    run(
        [
            "predictors",
            "eval",
            "cooccurrence",
            "--traces",
            str(few),
            "--save",
            str(ckpt),
            "--split",
            "all",
            "--json",
        ]
    )
    with pytest.raises(
        InputError, match=r"holds no val request of .*'s split; calibrate on a TraceSet whose split"
    ):
        run(["predictors", "calibrate", str(ckpt), "--traces", str(few)])
    with pytest.raises(InputError, match="needs --traces DIR"):
        run(["predictors", "calibrate", str(ckpt)])
