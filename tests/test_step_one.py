"""The compiled one-lane, one-token step (runtime/core/step_kernels.py) decides as the vectorised step.

Two :class:`LayerStep` run the same calls in the live runtime's order (the first layer's prefetch,
substitution, the layer with the next layer's predicted experts, the next layer's prefetch), one
compiled and one on the vectorised numpy path over a cache with ``scalar_path=False``; after every
call their outcomes, statistics, link clocks and caches must be equal, floats bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moecast.runtime.core import eviction
from moecast.runtime.core import step_kernels as sk
from moecast.runtime.core.cache import ExpertCache
from moecast.runtime.core.cost_model import CostModel
from moecast.runtime.core.mixed import Copies
from moecast.runtime.core.policy import POLICIES, Policy
from moecast.runtime.core.prefetch import top_predictions
from moecast.runtime.core.presched import schedule
from moecast.runtime.core.step import STATS, LayerStep, layer_time, rank_candidates, ranked_predictions

from moecast.errors import InputError

E, L = 24, 3
COSTS = {
    # one transfer 0.3 ms in a 0.4 ms attention: some prefetches land, some not
    "tight": CostModel(t_io=0.3, t_g=0.05, beta=0.05, c=0.3, t_attn=0.4, expert_bytes=1),
    # a fast link: loads win SMoE's and PreSched's splits
    "fast": CostModel(t_io=0.02, t_g=0.01, beta=0.2, c=0.7, t_attn=0.3, expert_bytes=1),
    # no link at all (transfer_gbps 0): nothing lands, loads take forever
    "no link": CostModel(t_io=np.inf, t_g=0.05, beta=0.01, c=0.02, t_attn=0.4, expert_bytes=1),
    # no accelerator and the experts on a disk: the CPU set is read over the link, compute times add
    "cpu + disk": CostModel(
        t_io=0.3,
        t_g=0.05,
        beta=0.05,
        c=0.3,
        t_attn=0.4,
        expert_bytes=1,
        shared_compute=True,
        cpu_reads_link=True,
    ),
}
# the same, each read taking compute time from the cores (prefetches' from the attention)
COSTS["cpu + disk, reads on the cores"] = dataclasses.replace(COSTS["cpu + disk"], t_rc=0.07)
# a device whose host takes time to issue each copy (load_host_ms)
COSTS["tight, copies issued by the host"] = dataclasses.replace(COSTS["tight"], t_rc=0.04)
CASES = {
    "lru": POLICIES["lru"],
    "lfu": POLICIES["lfu"],
    "score": POLICIES["score"],
    "static": POLICIES["static"],
    "lru + cpu": dataclasses.replace(POLICIES["lru"], balancer="cpu"),
    "prefetch": POLICIES["prefetch"],
    "prefetch-late": POLICIES["prefetch-late"],
    "lfu-prefetch": POLICIES["lfu-prefetch"],
    "presched": dataclasses.replace(POLICIES["presched"], preload="none"),
    "smoe": POLICIES["smoe"].with_alpha(0.5),
    # the gate's prefetches on the numpy path, the layers compiled, on the same cache and clock
    "prefetch-gated": POLICIES["prefetch-gated"],
}


def _step(policy, cost, k: int, compiled: bool, copies: Copies | None = None) -> LayerStep:
    cache = ExpertCache(E, k + 3, policy.eviction, lanes=L, score_window=3, scalar_path=compiled)
    if policy.eviction == "static":
        cache.preload(np.arange(L), np.tile(np.arange(k + 3), (L, 1)))
    return LayerStep(
        cache, policy, cost, E, L, stat_base=np.zeros(L, np.int64), n_stats=L, copies=copies,
        prefetching=policy.prefetches, predictor_ms=0.1 if policy.prefetches else 0.0, compiled=compiled,
    )  # fmt: skip


def _state(step: LayerStep) -> list:
    c = step.cache
    arrays = [c.resident, c.last, c.freq, c.prefetched, c.count, step.table, step.r_used, step.r_landed]
    arrays += [step.clock.free, step.clock.delay, step.clock.pf_n, step.clock.rc]
    if step.copies is not None:
        arrays += [step.low[:, :E] & c.resident, step._windowed]
    if c.policy == "score":
        arrays += [c.score_sum, c._ring, c._ring_pos]
    return [a.tolist() for a in arrays] + [vars(c.stats), c._clock]


def _outcome(o) -> list:
    return [a.tolist() for a in (o.ids, o.uniq, o.counts, o.hit, o.load_ids, o.cpu_ids, o.layer_t, o.link)]


def _prob(rng: np.random.Generator, pending: tuple) -> np.ndarray:
    """The ranked candidates' calibrated probabilities of use (the prefetch gate's), a fifth of them 0
    (a candidate the gate never lands, even in the window, under two copies)."""
    p = rng.random(pending[1].shape)
    return np.where(rng.random(p.shape) < 0.2, 0.0, p)


def _run(policy, cost, k: int, compiled: bool, seed: int, copies: Copies | None = None) -> list:
    """The live runtime's calls on random routing; every outcome and the state after each call (two
    copies: a layer no prefetch reaches upgrades as its window opens, as the live runtime's does)."""
    rng = np.random.default_rng(seed)
    step = _step(policy, cost, k, compiled, copies)
    seen: list = []
    for t in range(40):
        decode = np.array([t >= 2 or rng.random() < 0.5])  # a few one-token prefills first
        pending = None
        for pos in range(L):
            lane = np.array([pos])
            ids = rng.choice(E, k, replace=False)[None, None]
            if rng.random() < 0.1:
                ids[0, 0, -1] = -1  # an idle slot
            probs = rng.dirichlet(np.full(E, 0.3), size=(1, 1)).astype(np.float32)
            if pos == 0 and policy.prefetches and decode[0]:
                pending = ranked_predictions(rng.random(E).astype(np.float32), k)
            if pending is not None:
                seen.append(
                    step.prefetch(lane, lane, pending[1], np.array([t]), _prob(rng, pending)).tolist()
                )
                pending = None
            routed = step.route(lane, lane, ids, probs, decode)
            seen.append(routed.tolist())
            nxt = pos + 1
            pred = None
            if policy.prefetches and decode[0] and nxt < L:
                pending = ranked_predictions(rng.random(E).astype(np.float32), k)
                pred = pending[0]
            o = step.layer(
                lane, lane, routed, np.array([t]), probs,
                next_lanes=np.array([min(nxt, L - 1)]), has_next=np.array([nxt < L]),
                restart=np.array([pos == 0]), next_predicted=pred, decode=decode, routed=True,
            )  # fmt: skip
            seen += [_outcome(o), _state(step)]
            if copies is not None and pending is None and nxt < L and rng.random() < 0.5:
                step.upgrade_quiet(np.array([nxt]), np.array([nxt]))
            if pending is not None:
                seen.append(
                    step.prefetch(
                        np.array([nxt]), np.array([nxt]), pending[1], np.array([t]), _prob(rng, pending)
                    ).tolist()
                )
                pending = None
            seen.append(_state(step))
    return seen


@pytest.mark.parametrize("cost", list(COSTS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("k", [4, 10])
def test_compiled_one_lane_step_equals_the_vectorised_step(case, cost, k):
    """k = 10 sums ten CPU times: numpy's pairwise order, not a running sum."""
    policy, cm = CASES[case], COSTS[cost]
    want = _run(policy, cm, k, compiled=False, seed=k)
    got = _run(policy, cm, k, compiled=True, seed=k)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"call {i}"
    # each case exercises what it is about
    st = {name: v.sum() for name, v in zip(STATS, np.array(want[-1][5]))}
    assert st["uses"] > st["hits"] > 0
    # over the fast link PreSched's split loads every miss (Eq. 5's min-max, module presched)
    on_cpu = case in ("static", "lru + cpu", "smoe") or (case == "presched" and cost != "fast")
    assert (st["cpu"] > 0) == on_cpu
    assert (st["subs"] > 0) == (case == "smoe")
    assert (st["pf_landed"] > 0) == (policy.prefetches and cost != "no link")
    if case == "presched" and cost == "tight":
        assert st["pf_started"] > st["pf_landed"]  # a late one delays the next layer's loads
    if case == "prefetch-gated" and cost == "tight":  # the gate refuses late ones and starts others
        assert st["pf_refused"] > 0 and st["pf_started"] > st["pf_refused"]


def _low(cost: CostModel) -> Copies:
    """The low copy of an expert moving at ``cost``: a quarter of its bytes and reads, a slower compute."""
    low = dataclasses.replace(
        cost,
        t_io=cost.t_io / 4,
        t_rc=cost.t_rc / 4,
        t_g=cost.t_g * 1.5,
        beta=cost.beta * 1.5,
        expert_bytes=0.25,
    )
    return Copies("model", "int4-g128", low)


MIXED_CASES = ("lru", "score", "lru + cpu", "prefetch", "prefetch-late", "smoe", "prefetch-gated")


@pytest.mark.parametrize("cost", ["tight", "fast", "no link", "cpu + disk, reads on the cores"])
@pytest.mark.parametrize("case", MIXED_CASES)
@pytest.mark.parametrize("k", [4, 10])
def test_compiled_two_copy_step_equals_the_vectorised_step(case, cost, k):
    """Two copies (mixed.py's rules): the compiled one-lane step lands, marks, upgrades and times
    every copy as the vectorised step does, call by call, floats bit for bit."""
    policy, cm = CASES[case], COSTS[cost]
    want = _run(policy, cm, k, compiled=False, seed=k, copies=_low(cm))
    got = _run(policy, cm, k, compiled=True, seed=k, copies=_low(cm))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"call {i}"
    # each case exercises the copies: low uses always, upgrades where the link has idle time, low
    # and high prefetches where a predictor prefetches over a link
    st = {name: v.sum() for name, v in zip(STATS, np.array(want[-1][5]))}
    assert 0 < st["low_uses"] <= st["uses"] and (st["low_uses"] < st["uses"]) == (cost != "no link")
    if not policy.prefetches or cost == "fast":  # a window the prefetches leave idle: upgrades
        assert (st["upgrades"] > 0) == (cost != "no link")
    if policy.prefetches and cost != "no link":  # a tight window lands low copies, a fast one high ones
        assert st["pf_started"] > 0 and (st["pf_low"] > 0) == (st["pf_used_low"] > 0) == (cost != "fast")


def test_compiled_step_refuses_out_of_range_ids():
    step = _step(POLICIES["lru"], COSTS["tight"], 4, compiled=True)
    lane = np.array([0])
    with pytest.raises(IndexError, match="out of range"):
        step.layer(lane, lane, np.array([[[1, 2, 3, E]]]), np.array([0]), routed=True)
    with pytest.raises(IndexError, match="out of range"):
        step.prefetch(lane, lane, np.array([[E, 1]]), np.array([0]))
    assert step.table.sum() == 0 and not step.cache.resident.any()


def test_compiled_step_refuses_an_eviction_policy_without_a_kernel(monkeypatch):
    """A policy of the eviction table without a kernel code runs on the numpy paths; the compiled
    step refuses it in one line rather than pass the kernels a code that means another policy."""
    monkeypatch.setitem(eviction.TABLE, "fifo", eviction.Eviction(eviction.TABLE["lru"].key, None, False))
    policy = Policy("fifo", "fifo")
    step = _step(policy, COSTS["tight"], 2, compiled=False)
    lane = np.array([0])
    for t in range(6):
        step.layer(lane, lane, np.array([[[t, t + 1]]]), np.array([t]), routed=True)
    assert step.cache.count[0] == 5 and step.cache.stats.evictions == 2
    with pytest.raises(InputError, match=r"^eviction policy 'fifo' has no compiled kernel[^\n]*$"):
        _step(policy, COSTS["tight"], 2, compiled=True)


@pytest.mark.parametrize("quantum", [0.0, 0.25, 0.5])
def test_compiled_ranking_equals_numpy(quantum):
    """ranked_predictions of one token (compiled) against the vectorised ranking; scores rounded to
    ``quantum`` tie often, across the k-th score too (then the numpy path answers)."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        s = rng.random(E).astype(np.float32) * 4 - 1
        if quantum:
            s = (np.round(s / quantum) * quantum).astype(np.float32)
        k = int(rng.integers(1, 8))
        ids, ranked = ranked_predictions(s, k)
        n = s[None] / np.maximum(np.abs(s).max(-1, keepdims=True), 1e-12)
        want_ids, sc = top_predictions(n, k)
        want = rank_candidates(want_ids.reshape(1, -1), sc.reshape(1, -1), E)
        assert ranked.tolist() == want.tolist()
        assert sorted(ids[0].tolist()) == sorted(want_ids[0].tolist())


@pytest.mark.parametrize("cost", list(COSTS))
def test_compiled_presched_row_equals_the_vectorised_rows(cost):
    """presched.schedule of one row (compiled) against the same row scheduled beside another (the
    vectorised path): every field equal, on sizes with ties between the two layers."""
    cm = dataclasses.replace(COSTS[cost], t_attn=float(np.random.default_rng(0).random()))
    rng = np.random.default_rng(2)
    prefetched = 0
    for _ in range(400):
        M, Mn = int(rng.integers(0, 9)), int(rng.integers(0, 9))
        n, nn = int(rng.integers(0, M + 1)), int(rng.integers(0, Mn + 1))
        cur = np.sort(rng.integers(1, 4, (2, M)).astype(np.float64), axis=1)
        nxt = np.sort(rng.integers(1, 4, (2, Mn)).astype(np.float64), axis=1)
        ns, nns = np.array([n, M]), np.array([nn, Mn])
        delay, r_hit = rng.random(2) * rng.choice([0, 0.5, 3]), rng.random(2)
        got = schedule(cur[:1], ns[:1], nxt[:1], nns[:1], delay[:1], r_hit[:1], cm)
        want = schedule(cur, ns, nxt, nns, delay, r_hit, cm)
        for name in ("n_load", "n_cpu", "t_cpu", "n_prefetch"):
            g, w = getattr(got, name), getattr(want, name)[:1]
            assert g.dtype == w.dtype and g.tolist() == w.tolist(), name
        prefetched += int(got.n_prefetch[0] > 0)
    assert prefetched > 0 or cost == "no link"


_MS = st.floats(0.0, 50.0)
_ROWS = st.tuples(st.integers(0, 64), st.integers(0, 64), _MS, st.floats(0.0, 500.0), st.integers(0, 64))


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(_MS, st.just(np.inf)),
    _MS,
    _MS,
    st.one_of(st.just(0.0), _MS),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.lists(_ROWS, min_size=1, max_size=4),
)
def test_layer_time_compiled_equals_numpy(t_io, t_g, t_attn, t_rc, shared, reads, late, rows):
    """step.layer_time (vectorised over rows) and its compiled copy step_kernels.layer_time (one row)
    give the same (layer_t, link) bit for bit, for any cost model, counts and delays: the formula is
    written twice, so this pins the copies together."""
    cost = CostModel(t_io, t_g, 0.0, 0.0, t_attn, 1, shared_compute=shared, cpu_reads_link=reads, t_rc=t_rc)
    n_dev, n_load, delay, t_cpu, n_cpu = (np.array(c) for c in zip(*rows))
    want_t, want_link = layer_time(cost, n_dev, n_load, delay, t_cpu, n_cpu, delay if late else None)
    fcost = sk.fcost_of(cost, late=late)
    for i, (d, nl, dl, tc, nc) in enumerate(rows):
        got = sk.layer_time(fcost, d, nl, dl, tc, nc, dl if late else 0.0)
        assert np.array_equal(got, (want_t[i], want_link[i]), equal_nan=True), (i, got)


def test_warm_loads_the_kernels_of_the_path_a_step_takes(monkeypatch):
    """The live runtime warms its step at attach: the compiled path's entry points, or the cache's kernels
    where the step keeps to numpy (a gated prefetch), are loaded then, not in the first decode steps."""
    from moecast.runtime.core import kernels

    loaded, real_step, real_cache = [], sk.entry_points, kernels.cache_kernels
    monkeypatch.setattr(sk, "entry_points", lambda: loaded.append("step") or real_step())
    monkeypatch.setattr(kernels, "cache_kernels", lambda: loaded.append("cache") or real_cache())
    step = _step(POLICIES["lru"], COSTS["tight"], 2, compiled=True)
    assert step._one.ep is None
    step.warm()
    assert loaded == ["step"] and step._one.ep is not None
    step = _step(POLICIES["prefetch-gated"], COSTS["tight"], 2, compiled=True)  # the gate runs compiled
    loaded.clear()
    step.warm()
    assert loaded == ["step"]
    step = _step(POLICIES["lru"], COSTS["tight"], 2, compiled=False)  # the numpy path's kernels
    loaded.clear()
    step.warm()
    assert loaded == ["cache"] and step.cache._kc is not None


@pytest.mark.parametrize("base, n_stats", [(np.arange(L), L), (np.full(L, -1), L), (np.zeros(L), L - 1)])
def test_a_statistics_slot_past_the_table_is_refused(base, n_stats):
    """The compiled kernels write stat_base + layer unchecked, so the step refuses a layout whose slots
    leave the table (a lane per layer with each its own base: slot 2 L - 2 of L)."""
    cache = ExpertCache(E, 4, "lru", lanes=L)
    with pytest.raises(ValueError, match="stat_base"):
        LayerStep(
            cache, POLICIES["lru"], COSTS["tight"], E, L, stat_base=base.astype(np.int64), n_stats=n_stats
        )


def test_the_live_and_replay_layouts_fit_the_table():
    cache = ExpertCache(E, 4, "lru", lanes=3 * L)
    LayerStep(
        cache, POLICIES["lru"], COSTS["tight"], E, L, stat_base=np.repeat(np.arange(3) * L, L), n_stats=3 * L
    )
    LayerStep(ExpertCache(E, 4, "lru", lanes=L), POLICIES["lru"], COSTS["tight"], E, L, stat_base=np.zeros(L, np.int64),
              n_stats=L)  # fmt: skip
