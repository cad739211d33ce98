"""ExpertCache: capacity parsing, eviction order per policy, shield, static table, online access."""

from __future__ import annotations

import numpy as np
import pytest
from moecast.runtime.core.cache import CapacityWarning, ExpertCache, StaticTable, resolve_capacity


def test_a_fractional_capacity_rounds_to_the_nearest_expert():
    """Pins resolve_capacity rounding a fraction to the nearest whole expert, not down.

    By hand: 0.15 of 64 experts = 9.6 -> 10 (0.3 of 64 = 19.2 -> 19; no .5 case, round is banker's).
    Catches C1 (int() truncates 9.6 to 9)."""
    assert resolve_capacity(0.15, 64, 8) == 10
    assert resolve_capacity(0.3, 64, 8) == 19


def test_capacity_forms_and_below_topk_error():
    assert resolve_capacity(0.25, 64, 6) == 16
    assert resolve_capacity("6", 64, 6) == 6
    assert resolve_capacity("0.5", 16, 2) == 8
    assert resolve_capacity("40MB", 64, 6, expert_bytes=4 << 20) == 10
    with pytest.raises(ValueError, match="below top-k"):
        resolve_capacity(0.05, 64, 6)
    with pytest.raises(ValueError, match="below top-k"):
        resolve_capacity(3, 64, 6)
    with pytest.raises(ValueError):
        resolve_capacity("lots", 64, 6)
    # a count from bytes names the slot it divided by: a device's and the CPU's slots differ at one precision
    with pytest.raises(
        ValueError, match=r"capacity '8MB' at 4096.0 KiB a slot holds 2 experts .* below top-k"
    ):
        resolve_capacity("8MB", 64, 6, expert_bytes=4 << 20)


def test_a_capacity_above_the_experts_clamps_with_one_warning():
    with pytest.warns(CapacityWarning, match=r"capacity 100 holds 100 experts .* model's 64: .*capacity 64"):
        assert resolve_capacity(100, 64, 6) == 64
    with pytest.warns(CapacityWarning, match="holds 81 experts"):
        assert resolve_capacity("2GB", 64, 6, expert_bytes=25 << 20) == 64
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exactly all experts is no clamp: nothing said
        assert resolve_capacity(64, 64, 6) == 64


def test_lru_evicts_least_recent_and_shields_current():
    c = ExpertCache(8, 3, "lru")
    c.access([0, 1], t=0)
    c.access([2], t=1)
    hits = c.access([3, 0], t=2)  # 0 hits; 3 evicts 1 (least recent); 0 is shielded
    assert hits.tolist() == [False, True]
    assert set(c.resident_ids().tolist()) == {0, 2, 3}


def test_lfu_keeps_frequent():
    c = ExpertCache(8, 2, "lfu")
    for t in range(3):
        c.access([5], t=t)
    c.access([1], t=3)
    c.access([2], t=4)  # evicts 1 (count 1) not 5 (count 3)
    assert set(c.resident_ids().tolist()) == {5, 2}


@pytest.mark.parametrize("scalar_path", [True, False])
def test_score_eviction_ties_go_to_the_lower_id(scalar_path):
    """Pins SMoE Eq. 3's eviction tie rule (the lower id, a stable ascending sort) on the compiled
    single-lane kernel (scalar_path True) as on the numpy path.

    By hand: 4 experts, capacity 2, no scores observed (every window sum 0: a tie). access [0, 1] fills
    the cache; access [2] must evict one of {0, 1}: the lower id, 0 -> resident {1, 2}. Catches K8
    (`a <= b` in the kernel's comparison keeps the last of a tie: evicts 1, resident {0, 2})."""
    c = ExpertCache(4, 2, "score", scalar_path=scalar_path)
    c.access(np.array([0, 1]), t=0)
    c.access(np.array([2]), t=1)
    assert sorted(c.resident_ids().tolist()) == [1, 2]


def test_score_eviction_lowest_window_mean():
    c = ExpertCache(4, 2, "score", score_window=2)
    lanes = np.array([0])
    c.insert(lanes, np.array([[0, 1]]))
    c.observe_scores(lanes, np.array([[0.1, 0.9, 0.5, 0.0]]))
    c.insert(lanes, np.array([[2]]), shield=np.array([[2]]))
    assert set(c.resident_ids().tolist()) == {1, 2}  # 0 had the lowest mean score


def test_belady_uses_next_use():
    c = ExpertCache(6, 2, "belady")
    lanes = np.array([0])
    c.insert(lanes, np.array([[0, 1]]))
    c.next_use[0, 0] = 10
    c.next_use[0, 1] = 3
    c.insert(lanes, np.array([[2]]))
    assert set(c.resident_ids().tolist()) == {1, 2}


def test_batch_larger_than_capacity_inserts_only_what_fits():
    c = ExpertCache(16, 4, "lru")
    ids = np.arange(6)[None, :]
    ins = c.insert(np.array([0]), ids, shield=ids)
    assert ins.sum() == 4 and c.count[0] == 4


def test_static_table_hottest_per_layer_and_shared():
    topk = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]], [[0, 1], [2, 3]]])  # [T=3, L=2, k=2]
    t = StaticTable.from_topk(topk, 4)
    assert t.per_layer(1)[:, 0].tolist() == [0, 2]
    assert set(t.shared(2).tolist()) == {0, 4 + 2}
    c = ExpertCache(4, 2, "static")
    c.preload(np.array([0]), t.per_layer(2)[:1])
    assert c.access([3])[0] == False  # noqa: E712
    assert 3 not in c.resident_ids()  # static never inserts


def test_lanes_are_independent():
    c = ExpertCache(8, 2, "lru", lanes=3)
    c.insert(np.array([0, 2]), np.array([[1, 2], [3, 4]]))
    assert c.lookup(np.array([0, 1, 2]), np.array([[1], [1], [3]]))[:, 0].tolist() == [True, False, True]


def test_shared_cache_non_power_of_two_items_and_short_rows():
    # 3 layers x 7 experts = 21 items (not a power of two); rows with fewer evictable items than needed
    c = ExpertCache(21, 4, "lru", lanes=2)
    lanes = np.array([0, 1])
    c.insert(lanes, np.array([[0, 8, 15, 20], [1, 2, 3, -1]]))
    ins = c.insert(
        lanes, np.array([[5, 6, 7, 9], [4, 11, 12, 13]]), shield=np.array([[0, 8, 15, -1], [-1, -1, -1, -1]])
    )
    assert ins[0].sum() == 1 and c.count.tolist() == [4, 4]  # lane 0: only 20 was evictable
    assert set(c.resident_ids(0).tolist()) == {0, 8, 15, 5}
    assert set(c.resident_ids(1).tolist()) == {4, 11, 12, 13}


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady", "score"])
def test_online_access_equals_batch_insert_touch(policy):
    """The single-lane online path (access) decides exactly as the vectorised batch path (insert + touch)."""
    rng = np.random.default_rng(0)
    E, k, cap = 16, 3, 6
    a = ExpertCache(E, cap, policy, score_window=3)
    b = ExpertCache(E, cap, policy, score_window=3, scalar_path=False)
    lanes = np.array([0])
    for t in range(300):
        ids = rng.choice(E, k, replace=False)
        if policy == "belady":
            nu = rng.integers(t + 1, t + 40, size=E)
            a.next_use[0] = nu
            b.next_use[0] = nu
        if policy == "score":
            sc = rng.random((1, E)).astype(np.float32)
            a.observe_scores(lanes, sc)
            b.observe_scores(lanes, sc)
        hit_a = a.access(ids, t=t)
        hit_b = b.lookup(lanes, ids[None, :])[0]
        miss = np.where(hit_b, -1, ids)
        b.insert(lanes, miss[None, :], shield=ids[None, :])
        b.touch(lanes, ids[None, :], t)
        assert (hit_a == hit_b).all() and (a.resident == b.resident).all(), t


@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "belady", "score"])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_lane_equals_vectorised(policy, seed):
    """Single-lane calls on the compiled kernels (access, one-row insert / touch, prefetch inserts,
    repeated and missing times, a batch call in between) give the vectorised path's hits, resident
    sets, recency, frequency and statistics step by step."""
    E, k, cap = 24, 4, 7

    def run(scalar: bool) -> list:
        rng = np.random.default_rng(seed)
        c = ExpertCache(E, cap, policy, lanes=2, scalar_path=scalar)
        if policy == "static":
            c.preload(np.array([0, 1]), np.tile(np.arange(cap), (2, 1)))
        lanes = np.array([0])
        out = []
        for t in range(400):
            ids = rng.choice(E, k, replace=False)
            if policy == "belady":
                c.set_next_use(
                    np.array([0, 1]), np.tile(np.arange(E), (2, 1)), rng.integers(t, t + 50, (2, E))
                )
            if policy == "score":  # window means with ties (scores in tenths) among the resident
                c.observe_scores(np.array([0, 1]), rng.integers(0, 10, (2, E)).astype(np.float32) / 10)
            r = rng.random()
            if r < 0.25:  # a prefetch (sometimes with its time, sometimes without)
                pf = np.append(rng.choice(E, 3, replace=False), -1)
                ins = c.insert(
                    lanes,
                    pf[None, :],
                    shield=rng.choice(E, 2, replace=False)[None, :],
                    prefetch=True,
                    t=t if r < 0.12 else None,
                )
                out.append(ins.tolist())
            if r > 0.97:  # a vectorised two-lane call in between
                c.insert(np.array([0, 1]), np.stack([ids, ids]), t=t)
            tt = t if rng.random() < 0.8 else max(t - 1, 0)  # sometimes an earlier or equal time
            if rng.random() < 0.5:
                out.append(c.access(ids, t=tt if rng.random() < 0.9 else None).tolist())
            else:
                h = c.lookup(lanes, ids[None, :])[0]
                c.insert(
                    lanes,
                    np.where(h, -1, ids)[None, :],
                    shield=ids[None, :],
                    t=tt if rng.random() < 0.5 else None,
                )
                c.touch(lanes, ids[None, :], tt)
                out.append(h.tolist())
            out.append(c.resident[0].tolist() + c.prefetched[0].tolist())
        return [*out, c.last.tolist(), c.freq.tolist(), c.count.tolist(), vars(c.stats)]

    assert run(True) == run(False)


def test_single_lane_kernels_refuse_out_of_range_ids():
    """The compiled single-lane paths check ids and lanes (numba does not bound-check): a clear
    IndexError, the cache unchanged."""
    c = ExpertCache(8, 4, "lru", lanes=2)
    c.access(np.array([1, 2]), t=0)
    before = (c.resident.copy(), c.last.copy(), c.freq.copy())
    for call in (
        lambda: c.access(np.array([1, 8]), t=1),
        lambda: c.access(np.array([-1, 2]), t=1),
        lambda: c.access(np.array([1]), t=1, lane=2),
        lambda: c.insert(np.array([0]), np.array([[3, 9]])),
        lambda: c.touch(np.array([0]), np.array([[3, 9]]), 1),
    ):
        with pytest.raises(IndexError, match=r"out of range|does not exist"):
            call()
    assert all((a == b).all() for a, b in zip(before, (c.resident, c.last, c.freq)))


def test_the_score_window_forgets_what_left_it():
    """Window 2: expert 0 scored .9 then 0, 0; expert 1 .1, .3, .3. Over the last two steps 0 holds 0 and
    1 holds .6, so inserting 2 (shielded) evicts 0: {1, 2}. A window that never forgot would hold .9
    against .7 and evict 1."""
    c = ExpertCache(4, 2, "score", score_window=2)
    lanes = np.array([0])
    c.insert(lanes, np.array([[0, 1]]))
    for s in ([0.9, 0.1, 0, 0], [0, 0.3, 0, 0], [0, 0.3, 0, 0]):
        c.observe_scores(lanes, np.array([s]))
    c.insert(lanes, np.array([[2]]), shield=np.array([[2]]))
    assert set(c.resident_ids().tolist()) == {1, 2}
