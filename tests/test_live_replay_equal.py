"""The live runtime and the replay take the same per-layer step, so they report the same values.

A live run on ``tiny``'s architecture (configs/tiny.yaml, random weights) records the routing each
layer saw; the replay of that routing as a TraceSet, under the same policy, capacity and hardware
profile, must give the same hit rate, loads, CPU experts, prefetches, substitution rate and modeled
TPOT. Every forward feeds one token: the first is the prompt's prefill on both sides (no cache yet),
the others decode steps, and both start from empty caches. The profile makes prefetch windows tight
(one transfer is 0.3 ms, attention 0.35 ms, the predictor 0.2 ms), so some prefetches land and some do not.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import synthetic_record
from moecast.collect.models import find_moe_structure, kv_cache, model_info, with_cache
from moecast.collect.traceset import TraceMeta, TraceSet, TraceWriter
from moecast.predictors.base import LayerAhead
from moecast.runtime.core.cost_model import load_profile
from moecast.runtime.core.policy import POLICIES
from moecast.runtime.live.runtime import attach
from moecast.runtime.replay.engine import ReplayConfig, replay

STEPS = 24
CAPACITY = 8  # of tiny's 32 experts per layer
# teacher-forced tokens: the random model's greedy text soon repeats one token, whose routing every
# policy serves alike (a key that weighs recency otherwise than the replay's passed such a run)
TOKENS = torch.randint(1, 1000, (1, STEPS), generator=torch.Generator().manual_seed(0))


class RecordedOracle(LayerAhead):
    """A layer-ahead predictor that knows the routing of a recorded run: the live counterpart of the
    replay's oracle (the routing at alpha 0 does not depend on the policy)."""

    name = "oracle"
    needs = ("topk_ids",)

    def __init__(self, ids: np.ndarray, num_experts: int) -> None:
        self.ids, self.E, self.rt = ids, num_experts, None
        self.num_layers, self.num_experts, self.top_k = ids.shape[1], num_experts, ids.shape[2]

    def score_request(self, trace) -> np.ndarray:
        raise NotImplementedError("the oracle reads the live run's step: live only")

    def score_at(self, trace, layer: int) -> np.ndarray:
        out = np.zeros(self.E, np.float32)
        out[self.ids[self.rt._step, layer]] = 1.0
        return out


def live_run(model, policy, hw, predictor=None, prefetch="none", **tier):
    """Run STEPS one-token forwards under the live runtime; -> (stats, routing [T, L, k], probs or None).
    ``tier``: the slow tier's settings (offload, offload_dir, expert_dtype, group_size)."""
    rt = attach(
        model,
        policy=policy,
        capacity=CAPACITY,
        hardware=str(hw),
        warm=False,
        predictor=predictor,
        prefetch=prefetch,
        **tier,
    )
    if predictor is not None:
        predictor.rt = rt
    seen: dict[tuple[int, int], tuple] = {}
    route = rt.step.route

    def recording(lanes, layer, ids, probs, decode=None):
        seen[(rt._step, int(layer[0]))] = (ids[0, 0].copy(), None if probs is None else probs[0, 0].copy())
        return route(lanes, layer, ids, probs, decode)

    rt.step.route = recording
    try:
        with torch.no_grad():
            out = model(input_ids=TOKENS[:, :1], use_cache=True)
            for t in range(1, STEPS):
                out = model(
                    input_ids=TOKENS[:, t : t + 1], **with_cache(model, kv_cache(out)), use_cache=True
                )
        stats = rt.stats()
        stats["store_bytes_moved"] = [s.bytes_moved for s in rt.stores]  # each store's own count
        info = rt.info
    finally:
        rt.detach()
    L = len(info.moe_layers)
    ids = np.stack([np.stack([seen[(t, layer)][0] for layer in range(L)]) for t in range(STEPS)])
    has_probs = seen[(0, 0)][1] is not None
    probs = (
        np.stack([np.stack([seen[(t, layer)][1] for layer in range(L)]) for t in range(STEPS)])
        if has_probs
        else None
    )
    return stats, ids, probs, info


def as_traceset(path, info, ids, probs) -> TraceSet:
    fields = {"topk_weights": False, "router_probs": probs is not None, "gate_inputs": False}
    # tiny_random is float32: the replay derives the expert's shape from its bytes in that dtype
    collection = {"source": "live run", "dtype": "float32"}
    w = TraceWriter(path, TraceMeta(model=info, collection=collection, fields=fields))
    rec = synthetic_record(0, np.arange(STEPS), ids, np.arange(STEPS) >= 1, router_probs=probs)
    w.write([rec])
    return TraceSet(path)


# presched from empty caches: the live runtime has no hot-expert table of its own
PRESCHED = dataclasses.replace(POLICIES["presched"], preload="none")
CASES = {
    "lru": (POLICIES["lru"], False),
    "lfu": (POLICIES["lfu"], False),
    "oracle prefetch": (POLICIES["prefetch"], True),
    "oracle prefetch-late": (POLICIES["prefetch-late"], True),
    "oracle lfu-prefetch": (POLICIES["lfu-prefetch"], True),
    "presched": (PRESCHED, True),
    "smoe": (dataclasses.replace(POLICIES["smoe"], prefetch="none"), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_live_and_replay_report_equal_values(tiny, profile, cheap_cpu_profile, tmp_path, case):
    _equal_values(tiny, cheap_cpu_profile if case == "presched" else profile, tmp_path, case)


@pytest.mark.parametrize("case", ["lru", "oracle prefetch", "oracle prefetch-late", "smoe"])
def test_live_and_replay_equal_where_reads_take_compute_time(tiny, cpu_disk_profile, tmp_path, case):
    r, ts, cfg, _ = _equal_values(tiny, cpu_disk_profile, tmp_path, case)
    if CASES[case][1]:  # the prefetches' reads were charged: without their compute time it is less
        free = dataclasses.replace(load_profile(cpu_disk_profile), read_cpu_ms=0.0)
        assert replay(ts, dataclasses.replace(cfg, hardware=free)).modeled_tpot_ms < r.modeled_tpot_ms


@pytest.mark.parametrize("case", ["lru", "oracle prefetch"])
def test_live_and_replay_equal_where_the_host_issues_each_copy(tiny, issuing_profile, tmp_path, case):
    """Each copy's issue time on the host (a device's t_rc) is charged alike by the live runtime's
    step and the replay: a demand load's in its layer, a prefetch's in the layer it prefetches for;
    without it the same run models less, by exactly the issue time of every load and prefetch
    that moved when neither changes what lands (LRU)."""
    r, ts, cfg, _ = _equal_values(tiny, issuing_profile, tmp_path, case, dict(device_ops="simulated"))
    free = dataclasses.replace(load_profile(issuing_profile), load_host_ms=0.0)
    free = replay(ts, dataclasses.replace(cfg, hardware=free))
    assert free.modeled_tpot_ms < r.modeled_tpot_ms
    if case == "lru":
        # the cold prefill token (not in the TPOT) loads its top-k in every layer; the rest are decode's
        info = model_info(tiny, find_moe_structure(tiny), "tiny")
        decode_loads = r.loads - info.num_layers * info.top_k
        assert r.modeled_tpot_ms - free.modeled_tpot_ms == pytest.approx(0.08 * decode_loads / (STEPS - 1))


@pytest.mark.parametrize("case", ["lru", "oracle prefetch"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_live_and_replay_equal_at_a_quantized_precision(tiny, profile, tmp_path, case, dtype):
    """The disk tier at int8 / int4 moves the precision's bytes; the replay at that precision models
    the same (one expert's bytes, transfers, and so the windows and the TPOT)."""
    tier = dict(offload="disk", offload_dir=str(tmp_path / "off"), expert_dtype=dtype, group_size=64)
    r, _, _, stats = _equal_values(tiny, profile, tmp_path, case, tier)
    assert stats["expert_dtype"] == r.config["expert_dtype"] == {"int8": "int8", "int4": "int4-g64"}[dtype]
    assert (
        stats["expert_bytes"]
        == r.config["expert_bytes"]
        < model_info(tiny, find_moe_structure(tiny), "t").expert_bytes
    )
    assert stats["bytes_read"] == stats["disk_reads"] * (-(-r.config["expert_bytes"] // 4096) * 4096)


@pytest.mark.parametrize("case", ["oracle prefetch", "presched", "smoe"])
def test_live_and_replay_equal_on_the_simulated_device(tiny, profile, cheap_cpu_profile, tmp_path, case):
    """device_ops='simulated' walks the accelerator's path (packed slots, one link stream, events, the
    CPU experts on a worker thread): the same decisions, so the same figures as the replay."""
    hw = cheap_cpu_profile if case == "presched" else profile
    _, _, _, stats = _equal_values(tiny, hw, tmp_path, case, dict(device_ops="simulated"))
    assert stats["simulated_device"] and stats["device_ops"] == "simulated" and stats["link_bytes"] > 0


def test_the_runs_routing_tells_the_policies_apart(tiny, profile, tmp_path):
    """Live equals replay only says something where the policies decide differently: on this run's
    routing LRU and LFU evict otherwise (the greedy text's routing, one token repeated, served every
    policy alike)."""
    stats, ids, probs, info = live_run(tiny, "lru", profile)
    ts = as_traceset(tmp_path / "ts", info, ids, probs)
    cfg = ReplayConfig(policy="lru", capacity=CAPACITY, cold=True, hardware=str(profile))
    lru, lfu = (replay(ts, dataclasses.replace(cfg, policy=p)).loads for p in ("lru", "lfu"))
    assert stats["loads"] == lru != lfu


class PinnedTable:
    """A statistical predictor whose [L, E] ``table`` static pins (a frequency checkpoint's shape)."""

    name, horizon, fingerprint, needs = "freq", "statistical", None, ("topk_ids",)

    def __init__(self, table: np.ndarray, top_k: int) -> None:
        self.table = table
        (self.num_layers, self.num_experts), self.top_k = table.shape, top_k

    def score_request(self, trace) -> np.ndarray:
        return np.repeat(self.table[None].astype(np.float32), len(trace.topk_ids), 0)

    def metadata(self) -> dict:
        return {"kind": self.name}


def test_static_pins_a_checkpoints_table_live_and_in_the_replay(tiny, profile, tmp_path):
    """Under static the predictor is the table it pins, live (`run --policy static --predictor freq`)
    and now in the replay too, which refused it: the same experts pinned, so the same hits, CPU
    experts and modeled TPOT. The table ranks the experts the run uses least first, so the replay's own
    table (counted on the routing) would give other figures. Catches the replay counting its own."""
    _, routing, _, info = live_run(tiny, "lru", profile)
    L, E = routing.shape[1], info.num_experts
    counts = np.stack([np.bincount(routing[:, layer].ravel(), minlength=E) for layer in range(L)])
    pred = PinnedTable(-counts.astype(np.float64) + np.arange(E) * 1e-3, info.top_k)
    stats, ids, probs, info = live_run(tiny, POLICIES["static"], profile, pred, "auto")
    ts = as_traceset(tmp_path / "ts", info, ids, probs)
    cfg = ReplayConfig(policy="static", capacity=CAPACITY, cold=True, hardware=str(profile), predictor=pred)
    r = replay(ts, cfg)
    assert stats["hit_rate"] == r.hit_rate and (stats["loads"], stats["cpu_experts"]) == (
        r.loads,
        r.cpu_experts,
    )
    assert stats["modeled_tpot_ms"] == pytest.approx(r.modeled_tpot_ms, rel=1e-12)
    assert r.extra["hot_table_from"] == "the table of freq" and r.prefetches_issued == 0
    counted = replay(ts, dataclasses.replace(cfg, predictor=None))
    assert counted.hit_rate > r.hit_rate  # the counted table pins the used experts: this one pins others
    with pytest.raises(
        ValueError, match=r"its predictor is the hot-expert table it pins, which oracle is not"
    ):
        replay(ts, dataclasses.replace(cfg, predictor="oracle"))


def _equal_values(tiny, profile, tmp_path, case, tier=None):
    tier = tier or {}
    policy, oracle = CASES[case]
    predictor = None
    if oracle:  # the routing at alpha 0, from a first run at the same precision, is what the oracle knows
        _, routing, _, info = live_run(tiny, "lru", profile, **tier)
        predictor = RecordedOracle(routing, info.num_experts)
    stats, ids, probs, info = live_run(tiny, policy, profile, predictor, "auto" if oracle else "none", **tier)
    if oracle:
        assert np.array_equal(ids, predictor.ids)
    ts = as_traceset(tmp_path / "ts", info, ids, probs)
    cfg = ReplayConfig(
        policy=policy,
        capacity=CAPACITY,
        cold=True,
        hardware=str(profile),
        predictor="oracle" if oracle else "none",
        expert_dtype=tier.get("expert_dtype", "model"),
        group_size=tier.get("group_size", 128),
    )
    r = replay(ts, cfg)
    assert (stats["prefill_steps"], stats["decode_steps"]) == (1, STEPS - 1)
    assert stats["hit_rate"] == r.hit_rate
    assert (stats["loads"], stats["cpu_experts"]) == (r.loads, r.cpu_experts)
    assert (stats["prefetches_issued"], stats["prefetches_landed"]) == (
        r.prefetches_issued,
        r.prefetches_landed,
    )
    assert stats["substitution_rate"] == pytest.approx(r.substitution_rate, abs=1e-12)
    assert stats["modeled_tpot_ms"] == pytest.approx(r.modeled_tpot_ms, rel=1e-12)
    assert stats["modeled_predictor_ms"] == r.predictor_ms
    # each case exercises what it is about
    if oracle:
        assert r.prefetches_landed > 0
    if case == "presched":
        assert r.cpu_experts > 0 and r.prefetches_landed < r.prefetches_issued  # a late one delays loads
    if case == "smoe":
        assert r.substitution_rate > 0 and r.cpu_experts > 0
    return r, ts, cfg, stats


def test_the_accelerator_path_predicts_on_its_own_thread(tiny, profile, monkeypatch):
    """On an accelerator a layer's prediction is made on the prediction thread while the host launches
    the layer's experts (issue 43: the predictor off the host's critical path); on the CPU on the host's
    thread, before them. The token's first layer is predicted at its start, on the host's thread. The
    thread ends at detach. Catches the prediction left on the host's thread, and a thread left running."""
    import threading

    from moecast.runtime.live import prefetch

    seen: list[tuple[int, str]] = []
    scores, close = prefetch.Prefetcher.scores, prefetch.Prefetcher.close
    closed: list[bool] = []

    def recording(self, nxt, online):
        seen.append((nxt, threading.current_thread().name))
        return scores(self, nxt, online)

    def closing(self):
        close(self)
        closed.append(self._thread is None)

    monkeypatch.setattr(prefetch.Prefetcher, "scores", recording)
    monkeypatch.setattr(prefetch.Prefetcher, "close", closing)
    _, routing, _, info = live_run(tiny, "lru", profile)
    main = threading.current_thread().name
    for tier, want in ((dict(device_ops="simulated"), "moecast-predictor"), ({}, main)):
        seen.clear()
        oracle = RecordedOracle(routing, info.num_experts)
        stats, *_ = live_run(tiny, POLICIES["prefetch"], profile, oracle, "auto", **tier)
        later = {name for nxt, name in seen if nxt > 0}
        assert later and all(n.startswith(want) for n in later), (tier, later)
        assert {name for nxt, name in seen if nxt == 0} == {main}
        assert closed[-1] and stats["prefetches_issued"] > 0


def test_a_forward_cut_short_leaves_no_prediction_reading_the_stream(tiny, profile, monkeypatch):
    """A forward that fails between a layer's prediction start and its join (here its experts call
    raises) leaves that prediction running on its thread; the next forward waits for it before it feeds
    or resets the predictor's stream. Catches a stream reset by the host while the thread reads it."""
    import threading
    import time

    from moecast.runtime.live import prefetch
    from moecast.runtime.live.executor import Executor

    _, routing, _, info = live_run(tiny, "lru", profile)
    done = threading.Event()
    scores = prefetch.Prefetcher.scores

    def slow(self, nxt, online):
        if nxt == 0:  # the token's first layer: predicted on the host's thread at the token's start
            return scores(self, nxt, online)
        time.sleep(0.3)
        out = scores(self, nxt, online)
        done.set()
        return out

    def broken(self, *a, **kw):
        raise RuntimeError("planted")

    monkeypatch.setattr(prefetch.Prefetcher, "scores", slow)
    oracle = RecordedOracle(routing, info.num_experts)
    rt = attach(tiny, policy=POLICIES["prefetch"], capacity=CAPACITY, hardware=str(profile), warm=False,
                predictor=oracle, prefetch="auto", device_ops="simulated")  # fmt: skip
    oracle.rt = rt
    try:
        with torch.no_grad():
            out = tiny(input_ids=torch.tensor([[1]]), use_cache=True)  # the prefill: no prediction
            monkeypatch.setattr(Executor, "run", broken)
            with pytest.raises(RuntimeError, match="planted"):
                tiny(input_ids=torch.tensor([[2]]), **with_cache(tiny, kv_cache(out)), use_cache=True)
        assert not done.is_set()  # the first layer's prediction of layer 1 is still running
        rt.prefetcher.begin(True, torch.tensor([[3]]))
        assert done.is_set()
    finally:
        rt.detach()
