"""Two expert copies (runtime/core/mixed.py) and the prefetch gate (runtime/core/gate.py), pinned by hand.

Step-level cases use a cost model with round numbers: a high copy moves in t_hi = 1 ms, a low one in
t_lo = 0.25 ms, an expert computes in t_g = 0.25 ms, attention takes t_attn = 1.5 ms; 8 experts,
top-2, one lane (one layer's cache), every row a decode step. The window ``free`` a prefetch (or an
upgrade) may use is set on the lane's clock by hand. Replay cases use the hand profile of
tests/test_replay_hand.py (one model-dtype expert of 3072 bytes per ms) on the synthetic model, whose
int4-g128 copy is 1088 bytes (counted in test_the_low_copy_of_the_synthetic_expert).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import make_synthetic_traceset, synthetic_record, synthetic_writer
from moecast.collect.traceset import TraceSet
from moecast.predictors.base import Predictor
from moecast.runtime.core.cache import ExpertCache
from moecast.runtime.core.cost_model import CostModel, HardwareProfile
from moecast.runtime.core.gate import Calibration, candidate_probability, layer_probability
from moecast.runtime.core.mixed import HIGH, LOW, NONE, Copies, bytes_by_copy, parse_copies, plan_prefetch
from moecast.runtime.core.policy import POLICIES, Policy
from moecast.runtime.core.step import LayerStep, landing
from moecast.runtime.replay import engine
from moecast.runtime.replay.engine import ReplayConfig, replay

from moecast.errors import InputError

EXPERT_BYTES = 3 * 16 * 32 * 2  # the synthetic model's expert (conftest.synthetic_writer)
INT4_BYTES = 1088


def _cost(t_io: float, nbytes: int) -> CostModel:
    return CostModel(t_io=t_io, t_g=0.25, beta=0.0, c=100.0, t_attn=1.5, expert_bytes=nbytes)


HIGH_COST, LOW_COST = _cost(1.0, 4000), _cost(0.25, 1000)
COPIES = Copies("model", "int4-g128", LOW_COST)


def _step(policy: str | Policy = "lru", capacity: int = 3, copies: Copies | None = COPIES, **kw) -> LayerStep:
    pol = POLICIES[policy] if isinstance(policy, str) else policy
    cache = ExpertCache(8, capacity, pol.eviction, lanes=1)
    return LayerStep(
        cache, pol, HIGH_COST, 8, 1, stat_base=np.zeros(1, np.int64), n_stats=1,
        prefetching=pol.prefetches, copies=copies, **kw,
    )  # fmt: skip


ONE = np.zeros(1, np.int64)


def _layer(step: LayerStep, ids: list[int], t: int, free: float | None = None):
    if free is not None:
        step.clock.free[0] = free
    return step.layer(ONE, ONE, np.array([[ids]]), np.array([t]))


def _prefetch(step: LayerStep, ranked: list[int], t: int, free: float, prob: list[float] | None = None):
    step.clock.free[0] = free
    p = None if prob is None else np.array([prob], dtype=np.float64)
    return step.prefetch(ONE, ONE, np.array([ranked]), np.array([t]), p)


def _stat(step: LayerStep, name: str) -> float:
    return float(step.stats[name][0])


# ------------------------------------------------------------------------------------ the setting
def test_settings_name_a_high_and_a_low_copy():
    assert parse_copies("mixed", 128) == (("model", 128), ("int4", 128))
    assert parse_copies("int8+int4-g64", 128) == (("int8", 128), ("int4", 64))
    assert parse_copies("model+int8") == (("model", 128), ("int8", 128))
    for one in ("model", "int8", "int4"):
        assert parse_copies(one) is None
    for bad in ("int4+model", "int8+model", "fp8+int4", "model+int8+int4", "model+int4-gx"):
        with pytest.raises(InputError, match="expert dtype"):
            parse_copies(bad)


def test_the_low_copy_of_the_synthetic_expert(tmp_path):
    """int4-g128 of gate-up [64, 16] and down [16, 32] (bf16 scales): a group of 128 does not divide 16
    or 32, so each row is one group: gate-up 64 * 16 / 2 packed bytes + 64 rows * (scale, zero) * 2 bytes
    = 512 + 256; down 16 * 32 / 2 + 16 * 2 * 2 = 256 + 64; 1088 in all. A slot holds the high copy."""
    ts = TraceSet(make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2))
    assert engine.expert_link_bytes(ts, "int4", 128) == INT4_BYTES
    assert engine.expert_link_bytes(ts, "mixed", 128) == EXPERT_BYTES
    assert engine.expert_link_bytes(ts, "int8+int4", 128) == engine.expert_link_bytes(ts, "int8", 128)


# ------------------------------------------------------------------------------------ demand misses
def test_a_demand_miss_reads_the_low_copy():
    """Access {0, 1} on an empty cache: two demand loads of the low copy.
    link = 2 * 0.25 = 0.5; layer_t = 1.5 + max(2 * 0.25, 0.5 + 0.25) = 2.25 (at the high copy:
    1.5 + max(0.5, 2 * 1 + 0.25) = 3.75). Both are resident at the low copy; both uses low."""
    step = _step()
    out = _layer(step, [0, 1], 0, free=0.0)
    assert out.layer_t[0] == pytest.approx(2.25)
    assert out.link[0] == pytest.approx(0.5)
    assert step.low[0, :2].all() and not step.low[0, 2:].any()
    assert _stat(step, "low_uses") == 2 and _stat(step, "loads") == 2
    one = _step(copies=None)
    assert _layer(one, [0, 1], 0, free=0.0).layer_t[0] == pytest.approx(3.75)


# ------------------------------------------------------------------------------------ upgrades
def test_upgrades_only_in_idle_link_time_most_recent_first():
    """Capacity 3, no predictor (the whole window is idle):
    t0 free 0: {0, 1} load low; no upgrade (no link time).
    t1 free 0.9 < t_hi: no upgrade; {1, 2}: hit 1 (low), load 2 (low).
    t2 free 2.5: floor(2.5 / 1) = 2 upgrades of the low copies {0 (used t0), 1 (t1), 2 (t1)}, most
       recent first, ties to the lower id: 1 and 2. {0, 1}: 0 still low, 1 high.
    low uses: t0 2, t1 2 (a low hit, a miss), t2 1 -> 5; upgrades 2."""
    step = _step()
    _layer(step, [0, 1], 0, free=0.0)
    assert _stat(step, "upgrades") == 0
    _layer(step, [1, 2], 1, free=0.9)
    assert _stat(step, "upgrades") == 0 and step.low[0, [0, 1, 2]].all()
    out = _layer(step, [0, 1], 2, free=2.5)
    assert _stat(step, "upgrades") == 2
    assert step.low[0, [0, 1, 2]].tolist() == [True, False, False]
    assert out.hit[0].all() and _stat(step, "low_uses") == 5
    # the upgrades took only the window: the layer itself ran at its hits' time
    assert out.layer_t[0] == pytest.approx(1.5 + 2 * 0.25)


def test_an_upgrade_takes_its_read_s_share_of_the_cores():
    """As test_upgrades_only_in_idle_link_time_most_recent_first, with the CPU computing and reading
    (t_rc = 0.1 ms per high read): t2's two upgrades add 0.2 to the layer they run beside."""
    step = _step()
    step.cost = dataclasses.replace(HIGH_COST, t_rc=0.1)
    _layer(step, [0, 1], 0, free=0.0)
    _layer(step, [1, 2], 1, free=0.9)
    out = _layer(step, [0, 1], 2, free=2.5)
    assert _stat(step, "upgrades") == 2 and out.layer_t[0] == pytest.approx(1.5 + 2 * 0.25 + 2 * 0.1)


def test_upgrades_after_the_prefetches_the_predicted_first():
    """Policy prefetch, capacity 4. t0: {0, 1} load low (free 0). t1: {2, 3} load low (free 0).
    t2: prediction [4, 0] with free 2.5: 4 is not resident and lands at the high copy (1 ms); the
    window leaves 1.5 idle: one upgrade, and the predicted 0 goes first though 2 and 3 were used
    later; 4 evicts the least recent of {1, 2, 3} (0 is predicted: shielded), i.e. 1."""
    step = _step("prefetch", capacity=4)
    _layer(step, [0, 1], 0, free=0.0)
    _layer(step, [2, 3], 1, free=0.0)
    ins = _prefetch(step, [4, 0], 2, free=2.5)
    assert ins[0].tolist() == [4, -1]
    assert step.cache.resident[0].nonzero()[0].tolist() == [0, 2, 3, 4]
    assert _stat(step, "upgrades") == 1
    assert step.low[0, [0, 2, 3, 4]].tolist() == [False, True, True, False]
    # the lane's window is spent: the layer that follows upgrades nothing more
    _layer(step, [0, 4], 2)
    assert _stat(step, "upgrades") == 1


@pytest.mark.parametrize("compiled", [False, True])
def test_the_predicted_upgrade_in_rank_order_not_by_id_or_recency(compiled):
    """Policy prefetch, capacity 4. t0: {1, 2} load low; t1: {3, 1} load 3 low (1 a low hit, now the
    most recent with 3). t2: prediction [2, 1], both resident: nothing lands and the window's 1.2
    idle reads floor(1.2 / 1) = 1 upgrade, the first predicted, 2, though 1 has the lower id and the
    later use. The compiled one-lane step decides the same."""
    step = _step("prefetch", capacity=4, compiled=compiled)
    _layer(step, [1, 2], 0, free=0.0)
    _layer(step, [3, 1], 1, free=0.0)
    _prefetch(step, [2, 1], 2, free=1.2)
    assert _stat(step, "upgrades") == 1 and _stat(step, "pf_landed") == 0
    assert step.low[0, [1, 2, 3]].tolist() == [True, False, True]


@pytest.mark.parametrize("compiled", [False, True])
def test_one_copy_upgrades_nothing(compiled):
    """A step of one precision asked for a window's upgrades (a caller that does not check) changes
    nothing: the compiled kernels must not index the two-copy flags it does not have."""
    step = _step(capacity=3, copies=None, compiled=compiled)
    _layer(step, [0, 1], 0, free=0.0)
    before = (step.table.copy(), step.clock.rc.copy(), step.cache.resident.copy())
    step.clock.free[0] = 5.0
    step.upgrade_quiet(ONE, ONE)
    assert np.array_equal(step.table, before[0]) and np.array_equal(step.clock.rc, before[1])
    assert np.array_equal(step.cache.resident, before[2])


@pytest.mark.parametrize(
    "free, low, delay",
    [(2.5, [False, False, True], 0.0), (1.2, [True, True, True], 0.0), (0.6, [True, True, True], 0.15)],
)
def test_without_the_gate_the_window_lands_what_fits_the_first_at_the_high_copy(free, low, delay):
    """prefetch-late at mixed precision (t_hi 1, t_lo 0.25), candidates [5, 6, 7].
    free 2.5: all three fit at the low copy (0.75); the 1.75 left turns floor(1.75 / 0.75) = 2 of them,
    5 and 6, into high copies (2.25 in all); the 0.25 left is short of an upgrade (t_hi).
    free 1.2: all three land low (0.75); 0.45 < 0.75 turns none high.
    free 0.6: floor(0.6 / 0.25) = 2 land low (5, 6); 7 is started past the window at the low copy,
    ending at 0.75: 0.15 past it (its high copy would end at 1.5: 0.9)."""
    step = _step("prefetch-late", capacity=4)
    _prefetch(step, [5, 6, 7], 0, free=free)
    assert (_stat(step, "pf_started"), _stat(step, "pf_landed")) == (3, 3)
    assert _stat(step, "pf_low") == sum(low)
    assert step.clock.delay[0] == pytest.approx(delay)
    assert step.low[0, [5, 6, 7]].tolist() == low and _stat(step, "upgrades") == 0


def test_the_window_s_high_copies_cost_no_candidate_its_low_ones_would_land():
    """The rule against its alternative: free 2.0, candidates [3, 4, 5, 6] (t_hi 1, t_lo 0.25). High
    copies first would land 3 and 4 (2.0) and leave 5 and 6 to demand reads. Here all four land low
    (1.0) and the 1.0 left turns floor(1.0 / 0.75) = 1, the first, high: 1.75 of the window."""
    step = _step("prefetch", capacity=5)
    _prefetch(step, [3, 4, 5, 6], 0, free=2.0)
    assert _stat(step, "pf_landed") == 4 and _stat(step, "pf_low") == 3
    assert step.low[0, [3, 4, 5, 6]].tolist() == [False, True, True, True]


def test_a_window_that_transfers_fill_exactly_lands_all_of_them():
    """Seven transfers of 0.1 ms in a 0.7 ms window: 0.7 / 0.1 is 6.999999999999999 in floating point,
    and floor would land six. The one-copy rule (step.landing) and the two-copy plan both land seven."""
    ask, free = np.array([10]), np.array([0.7])
    plan = plan_prefetch(ask, np.array([-1]), free, 0.1, 0.1, "none", False, False, None)
    assert plan.n_high.tolist() == [7] and plan.n_low.tolist() == [0]
    mixed = plan_prefetch(ask, np.array([-1]), free, 0.2, 0.1, "none", False, False, None)
    assert (mixed.n_high + mixed.n_low).tolist() == [7]


def test_a_late_prefetch_leaves_the_link_no_idle_time_for_upgrades():
    """t_hi 0.4, t_lo 0.3, five candidates, free 1.05: three land low (0.9), the 0.15 left turns one
    high (0.1 more): 1.0 used. The fourth is started past the window (late, the low copy), so the
    link is busy past the window's end: the 0.05 left is no idle time for an upgrade."""
    plan = plan_prefetch(np.array([5]), np.array([-1]), np.array([1.05]), 0.4, 0.3, "none", True, False, None)
    assert (plan.n_high.tolist(), plan.n_low.tolist(), plan.late.tolist()) == ([1], [2], [LOW])
    assert plan.idle.tolist() == [0.0]
    calm = plan_prefetch(np.array([3]), np.array([-1]), np.array([1.05]), 0.4, 0.3, "none", True, False, None)
    assert calm.late.tolist() == [NONE] and calm.idle[0] == pytest.approx(0.05)


# ------------------------------------------------------------------------------------ the gate
@pytest.mark.parametrize("p, taken", [(0.4, False), (0.6, True)])
def test_the_gate_starts_a_late_prefetch_above_break_even(p, taken):
    """One precision (t_io = 1), policy prefetch-gated, free 1.5, candidates [3, 4]: 3 lands in the
    window (1 ms), 4 would end at 2.0, d = 0.5 past it. A used 4 spares a demand read, S = 1: it pays
    when p * 1 > 0.5. Below: started 1, no delay, one refusal; above: started 2, landed 2, delay 0.5."""
    step = _step("prefetch-gated", copies=None)
    _prefetch(step, [3, 4], 0, free=1.5, prob=[0.9, p])
    assert _stat(step, "pf_started") == (2 if taken else 1)
    assert _stat(step, "pf_landed") == (2 if taken else 1)
    assert _stat(step, "pf_refused") == (0 if taken else 1)
    assert step.clock.delay[0] == pytest.approx(0.5 if taken else 0.0)
    assert bool(step.cache.resident[0, 4]) == taken


@pytest.mark.parametrize("p, taken", [(0.5, False), (0.7, True)])
def test_the_gate_moves_the_low_copy_where_it_pays(p, taken):
    """Two copies, prefetch-gated, free 1.35, candidates [2, 3, 4, 5, 6, 7] (p 0.9 but 7's):
    floor(1.35 / 0.25) = 5 land low in the window (free: any p > 0), 1.25; the 0.1 left turns none
    high. 7 would end past the window: low d = 6 * 0.25 - 1.35 = 0.15, high d = 1.25 + 1.0 - 1.35 = 0.9.
    It spares a low read, S = 0.25: low pays when p * 0.25 > 0.15 (p > 0.6); high never (0.9 > 0.25)."""
    step = _step("prefetch-gated", capacity=6)
    _prefetch(step, [2, 3, 4, 5, 6, 7], 0, free=1.35, prob=[0.9] * 5 + [p])
    assert step.low[0, [2, 3, 4, 5, 6]].tolist() == [True] * 5
    assert _stat(step, "pf_low") == (6 if taken else 5)
    assert _stat(step, "pf_started") == (6 if taken else 5)
    assert step.clock.delay[0] == pytest.approx(0.15 if taken else 0.0)
    assert bool(step.cache.resident[0, 7]) == taken and (not taken or step.low[0, 7])
    # reads' compute share: none here (t_rc = 0)
    assert step.clock.rc[0] == 0.0


def test_the_gate_takes_no_free_low_copy_it_expects_unused():
    """p = 0 for 4: the window lands no copy of it, and as the late candidate it is refused
    (0 * S > d never); 3 lands, at the high copy (1.6 - 0.25 leaves room for its 0.75 more)."""
    step = _step("prefetch-gated")
    _prefetch(step, [3, 4], 0, free=1.6, prob=[0.9, 0.0])
    assert _stat(step, "pf_started") == 1 and _stat(step, "pf_refused") == 1
    assert _stat(step, "pf_low") == 0 and not step.low[0, 3] and not step.cache.resident[0, 4]


def test_the_gate_never_starts_presched_s_extra_transfer():
    """PreSched's one more transfer does not land for this layer (Premise 3): S = 0, so even at p = 1
    the gate refuses it; without the gate it is started (as step.landing does)."""
    gated = plan_prefetch(np.array([3]), np.array([3]), np.array([1.5]), 1.0, 1.0, "presched", False, True,
                          np.array([[1.0, 1.0, 1.0]]))  # fmt: skip
    plain = plan_prefetch(
        np.array([3]), np.array([3]), np.array([1.5]), 1.0, 1.0, "presched", False, False, None
    )
    assert (gated.started[0], gated.landed[0], gated.refused[0], gated.delay[0]) == (1, 1, True, 0.0)
    assert (plain.started[0], plain.landed[0], plain.late[0]) == (2, 1, HIGH)
    assert plain.delay[0] == pytest.approx(0.5)


def test_calibration_is_the_bin_frequencies():
    """Layer 0: scores 0.1 0.2 0.3 0.4, used 0 1 1 1, two bins: the median 0.25 splits them,
    P = 1/2 below and 2/2 above. Layer 1: scores 0.5 1 1 1, used 0 1 1 0 (and one non-prediction):
    the median is 1.0, so 0.5 alone is below (P = 0) and the three 1.0s above (P = 2/3). With four
    bins layer 1's edges are the quantiles 0.875, 1.0, 1.0 -> 0.875 and 1.0: a score in [0.875, 1.0)
    falls in a bin no val prediction did and takes the layer's rate, 2/4."""
    scores = np.array([[[0.1], [0.5]], [[0.2], [1.0]], [[0.3], [1.0]], [[0.4], [1.0]], [[0.9], [0.9]]])
    used = np.array([[[0], [0]], [[1], [1]], [[1], [1]], [[1], [0]], [[1], [1]]], dtype=bool)
    valid = np.ones(used.shape, bool)
    valid[4] = False
    cal = Calibration.fit(scores, used, valid, bins=2)
    assert cal.edges.tolist() == [[0.25], [1.0]]
    assert cal.prob == pytest.approx(np.array([[0.5, 1.0], [0.0, 2 / 3]]))
    q = cal.probability(np.array([[[0.05], [0.7]], [[0.25], [1.0]]]))
    assert q[:, :, 0] == pytest.approx(np.array([[0.5, 0.0], [1.0, 2 / 3]]))
    four = Calibration.fit(scores, used, valid, bins=4)
    assert four.probability(np.array([[[0.0], [0.9]]]))[0, 1, 0] == pytest.approx(0.5)
    # a batch's candidate predicted by two tokens at 0.5 each: used unless both miss, 1 - 0.5^2
    both = candidate_probability(np.array([[7, 3, -1]]), np.array([[7, 7, 3]]), np.array([[0.5, 0.5, 0.2]]))
    assert both == pytest.approx(np.array([[0.75, 0.2, 0.0]]))


def test_a_layer_without_val_predictions_takes_the_rate_of_the_valid_ones():
    """Pins Calibration.fit's fallback for a layer with no predictions: the overall used-rate of the
    *valid* predictions (padding excluded).

    By hand: T = 2, L = 2, kp = 2; layer 0 all valid with used 1 0 / 1 1 -> 3 of 4 = 0.75; layer 1 all
    invalid (its labels, all 0, are padding). prob[1] = [0.75, 0.75] with two bins. Catches CA6 (the
    mean over all 8 labels: 3 / 8 = 0.375)."""
    scores = np.array([[[0.1, 0.2], [0.5, 0.6]], [[0.3, 0.4], [0.7, 0.8]]])
    used = np.array([[[1, 0], [0, 0]], [[1, 1], [0, 0]]], dtype=bool)
    valid = np.zeros(used.shape, bool)
    valid[:, 0] = True
    cal = Calibration.fit(scores, used, valid, bins=2)
    assert cal.prob[1].tolist() == [0.75, 0.75]


# ------------------------------------------------------------------------------------ cross-checks
def test_equal_copies_are_the_landing_rule():
    """plan_prefetch with the copies equal and no gate is step.landing, over random rows."""
    rng = np.random.default_rng(0)
    n = 400
    n_cand = rng.integers(0, 6, n)
    pf_n = np.where(rng.random(n) < 0.5, -1, rng.integers(0, 6, n))
    free = rng.uniform(-0.5, 5.0, n)
    for t in (1.0, 0.7, 0.0, np.inf):
        for bal, late in (("none", False), ("none", True), ("presched", False)):
            want, landed, started, delay = landing(n_cand, pf_n, free, t, bal, late)
            pl = plan_prefetch(n_cand, pf_n, free, t, t, bal, late, False, None)
            assert (pl.issued == want).all() and (pl.landed == landed).all() and (pl.started == started).all()
            assert (pl.delay == delay).all()
            assert (pl.late != LOW).all() and (pl.n_low == 0).all()
            assert ((pl.late != NONE) == (started > np.minimum(landed, pl.n_high + pl.n_low))).all() or t == 0


def _profile(attn_ms: float = 1.5) -> HardwareProfile:
    return HardwareProfile(
        name="hand", transfer_gbps=EXPERT_BYTES / 1e6, ref_expert_bytes=EXPERT_BYTES, gpu_expert_ms=0.25,
        cpu_beta_ms=0.0, cpu_c_ms=100.0, attn_ms=attn_ms,
    )  # fmt: skip


def _same(a, b, exact: bool = True) -> None:
    skip = {"wall_s", "expert_dtype", "low_share", "mb_per_token_by_copy", "capacities_in_pass"}
    ja, jb = ({k: v for k, v in r.to_json().items() if k not in skip} for r in (a, b))
    if exact:
        assert ja == jb
    else:  # the fast engines sum the step times in another order
        assert ja.keys() == jb.keys()
        for k, v in ja.items():
            assert jb[k] == (pytest.approx(v, rel=1e-12) if isinstance(v, (float, list)) else v), k


@pytest.mark.parametrize(
    "policy, kw",
    [("lru", {}), ("prefetch", {}), ("prefetch-late", {}), ("prefetch-gated", {}), ("smoe", {}),
     ("prefetch", {"batch_size": 2}), ("prefetch-late", {"shared": True}), ("lfu-prefetch", {"cold": True})],
)  # fmt: skip
def test_equal_copies_reproduce_one_precision(tmp_path, policy, kw):
    """model+model runs every mixed rule (demand reads and prefetches by copy, the flags, the gate's
    choice of copy) with both copies the same bytes: each figure is the single-precision replay's,
    of the general engine and of the fast ones where they serve."""
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    # a disk under a CPU (reads' compute share; a transfer longer than the attention: late prefetches)
    hw = str(Path(__file__).parents[1] / "bench" / "results" / "bench-tiers-26layers-calibrated-25.yaml")
    base = dict(policy=policy, capacity=4, hardware=hw, **kw)
    if POLICIES[policy].gate != "none":
        base["calibrate_on"] = list(TraceSet(path).request_ids)[:2]
    one = replay(path, ReplayConfig(**base, expert_dtype="model", fast=False))
    two = replay(path, ReplayConfig(**base, expert_dtype="model+model", fast=False))
    _same(one, two)
    assert two.upgrades == 0
    _same(replay(path, ReplayConfig(**base, expert_dtype="model")), one, exact=False)


def test_mixed_and_gated_runs_refuse_the_fast_engines_and_compile_as_the_numpy_step(tmp_path, monkeypatch):
    """The batch-1 engines know one copy and no gate: a mixed or gated run must not reach what would
    drop the copies or the gate silently. The compiled one-lane kernels take both (two copies, the
    gate), with the numpy path's figures."""
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)

    def boom(*a, **k):
        raise AssertionError("a fast engine ran a mixed or gated replay")

    with monkeypatch.context() as m:
        m.setattr(engine, "_fast_demand", boom)
        m.setattr(engine.fast, "Wavefront", boom)
        for policy, dtype in (("lru", "mixed"), ("prefetch", "mixed"), ("prefetch-late", "int8+int4"),
                              ("prefetch-gated", "model"), ("prefetch-gated", "mixed")):  # fmt: skip
            replay(path, ReplayConfig(policy=policy, capacity=4, expert_dtype=dtype))
    for pol, copies in (("prefetch-late", COPIES), ("prefetch-gated", None), ("prefetch-gated", COPIES)):
        steps = [_step(pol, compiled=c, copies=copies) for c in (True, False)]
        assert steps[0]._one.takes(ONE, np.zeros((1, 1, 2), np.int64), None, None)
        for s in steps:
            for t, (ids, pred) in enumerate(([[0, 1], [2, 3]], [[2, 4], [4, 5]], [[4, 5], [6, 0]])):
                _prefetch(s, pred, t, free=1.6, prob=[0.9, 0.7])
                _layer(s, ids, t)
        assert steps[0].table.tolist() == steps[1].table.tolist()
        assert (steps[0].cache.resident == steps[1].cache.resident).all()
        if copies is not None:
            assert ((steps[0].low & steps[0].cache._res) == (steps[1].low & steps[1].cache._res)).all()


def test_live_style_callers_without_probabilities_are_told():
    step = _step("prefetch-gated", copies=None)
    with pytest.raises(InputError, match="calibrated probabilities"):
        _prefetch(step, [3], 0, free=1.5)


def test_presched_refuses_two_copies():
    with pytest.raises(InputError, match="one expert precision"):
        _step("presched")


# ------------------------------------------------------------------------------------ replay figures
class _Fixed(Predictor):
    """Predicts the same experts at every (token, layer): ``scores`` [E]."""

    name = "fixed"
    horizon = "layer-ahead"

    def __init__(self, scores: list[float], L: int) -> None:
        self.scores, self.num_layers, self.num_experts, self.top_k = (
            np.array(scores, np.float32),
            L,
            len(scores),
            2,
        )

    def score_request(self, trace) -> np.ndarray:
        T, L, _k = trace.topk_ids.shape
        return np.broadcast_to(self.scores, (T, L, len(self.scores))).copy()


def _trace(path: Path, routes: list[list[list[int]]]) -> TraceSet:
    ids = np.array(routes)
    w = synthetic_writer(path, num_layers=ids.shape[1], num_experts=8, top_k=2, with_optional=False)
    w.write([synthetic_record(0, np.arange(len(ids)), ids, np.ones(len(ids), bool))])
    return TraceSet(path)


def test_mixed_replay_bytes_by_hand(tmp_path):
    """LRU at mixed precision, trace A of tests/test_replay_hand.py (2 layers, capacity 2, cold), no
    predictor: each layer upgrades in its whole window (t_attn 1.5 for layer 0; layer_t - link for
    layer 1). t_lo = 1088 / 3072 ms.
    t0: L0 {0,1} and L1 {2,3}: two low loads each (layer_t 1.5 + 2 t_lo + 0.25).
    t1: L0 window 1.5 -> one upgrade, {0, 1} tie -> 0; {0,4}: hit 0 (high), load 4 (low, evicts 1).
        L1 window 2.0 - t_lo > 1 -> one upgrade: 2; {2,5}: hit 2 (high), load 5 (evicts 3).
    t2: L0 upgrades 4 (0 is high); {4,6}: hit 4, load 6 (evicts 0). L1 upgrades 5; {3,5}: hit 5, load 3.
    Loads 8 (low), upgrades 4 (high): 8 * 1088 + 4 * 3072 bytes over 3 tokens; every hit was on a high
    copy, every miss low: low_share 8 / 12; nothing prefetched, nothing wasted."""
    ts = _trace(tmp_path / "a", [[[0, 1], [2, 3]], [[0, 4], [2, 5]], [[4, 6], [3, 5]]])
    r = replay(
        ts, ReplayConfig(policy="lru", capacity=2, cold=True, hardware=_profile(), expert_dtype="mixed")
    )
    t_lo = INT4_BYTES / EXPERT_BYTES
    assert r.loads == 8 and r.upgrades == 4 and r.hit_rate == pytest.approx(4 / 12)
    assert r.bytes_moved == 8 * INT4_BYTES + 4 * EXPERT_BYTES
    assert r.mb_per_token == pytest.approx((8 * INT4_BYTES + 4 * EXPERT_BYTES) / 3 / 2**20)
    assert r.mb_per_token_by_copy == pytest.approx(
        {"model": 4 * EXPERT_BYTES / 3 / 2**20, "int4-g128": 8 * INT4_BYTES / 3 / 2**20}
    )
    assert r.low_share == pytest.approx(8 / 12) and r.wasted_mb_per_token == 0.0
    step0 = 2 * (1.5 + 2 * t_lo + 0.25)
    later = 2 * (1.5 + max(0.5, t_lo + 0.25))
    assert r.modeled_tpot_ms == pytest.approx((step0 + 2 * later) / 3)
    assert r.to_json()["expert_dtype"] == "model+int4-g128"


def test_wasted_bytes_by_hand(tmp_path):
    """Policy prefetch at mixed precision, one layer, capacity 3, t_attn 2.5, every token routed to
    {0, 1}; the predictor always ranks 6 then 7, which are never used.
    t0: window 2.5: 6 and 7 land high (2 ms), 0.5 idle; {0,1} load low, one slot: evicts 6 (ties to
        the lower id).
    t1: 6 lands high (evicts 0); 1.5 idle: one upgrade, 1; {0,1}: hit 1, load 0, evicts 7 (older than 6).
    t2: 7 lands high (evicts 0); no low copy left to upgrade; {0,1}: hit 1, load 0, evicts 6.
    Prefetched 4 (all high), used 0: wasted 4 * 3072 bytes, 7 among them though still resident at the
    end (never used). Loads 4 low, upgrades 1: 4 * 1088 + 5 * 3072 bytes."""
    ts = _trace(tmp_path / "w", [[[0, 1]]] * 3)
    pred = _Fixed([0, 0, 0, 0, 0, 0, 1.0, 0.5], 1)
    cfg = ReplayConfig(policy="prefetch", capacity=3, cold=True, hardware=_profile(2.5), expert_dtype="mixed",
                       predictor=pred)  # fmt: skip
    r = replay(ts, cfg)
    assert (r.loads, r.prefetches_landed, r.upgrades) == (4, 4, 1)
    assert r.prefetch_accuracy == 0.0
    assert r.wasted_mb_per_token == pytest.approx(4 * EXPERT_BYTES / 3 / 2**20)
    assert r.bytes_moved == 4 * INT4_BYTES + 5 * EXPERT_BYTES
    assert r.low_share == pytest.approx(4 / 6)
    # one precision: the same four prefetches wasted, at its bytes
    one = replay(ts, dataclasses.replace(cfg, expert_dtype="int4"))
    assert one.wasted_mb_per_token == pytest.approx(one.prefetches_landed * INT4_BYTES / 3 / 2**20)
    assert one.low_share is None


def test_bytes_by_copy_with_low_prefetches_by_hand():
    """5 prefetches started, 2 of them at the low copy; 2 used, 1 of those low; 3 demand loads (low),
    1 upgrade, no plan. High reads: 3 prefetches + 1 upgrade = 4 x 3072 = 12288; low reads: 3 loads + 2
    prefetches = 5 x 1088 = 5440; wasted: 2 high prefetches unused (3072 each) + 1 low one (1088) = 7232.
    One copy: all 9 reads (the upgrade among them) at its bytes, the same 3 prefetches wasted."""
    t = {k: np.array([v]) for k, v in dict(pf_started=5, pf_low=2, pf_used=2, pf_used_low=1, plan_loads=0,
                                           loads=3, upgrades=1).items()}  # fmt: skip
    assert bytes_by_copy(t, 3072, 1088) == {"high": 12288.0, "low": 5440.0, "wasted": 7232.0}
    one = bytes_by_copy(t, 3072, None)
    assert one == {"high": 9 * 3072.0, "low": 0.0, "wasted": 3 * 3072.0}


def test_cli_replays_mixed_and_gated(tmp_path, capsys):
    from moecast.cli import main

    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    main(["replay", "--traces", str(path), "--policy", "prefetch-gated", "--capacity", "4",
          "--expert-dtype", "mixed", "--json", "true"])  # fmt: skip
    import json

    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["expert_dtype"] == "model+int4-g128" and row["policy"] == "prefetch-gated"
    assert 0 <= row["low_share"] <= 1 and row["wasted_mb_per_token"] >= 0 and "gate_calibrated_on" in row
    main(["compare", "--traces", str(path), "--policies", "lru", "prefetch-gated", "--predictors", "oracle",
          "--capacities", "4", "--expert-dtypes", "int4", "mixed", "--out", str(tmp_path / "c"), "--wandb", "false"])  # fmt: skip
    table = (tmp_path / "c" / "table.md").read_text()
    assert "low_share" in table and "wasted_mb_per_token" in table and "model+int4-g128" in table


def test_remembered_predictions_carry_no_gate_into_the_next_run(tmp_path):
    """compare keeps a checkpoint's predictions (and the gate's calibration) between cells: a gated
    cell must leave the next ungated one as it would be alone."""
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    hw = str(Path(__file__).parents[1] / "bench" / "results" / "bench-tiers-26layers-calibrated-25.yaml")
    base = dict(capacity=4, hardware=hw, expert_dtype="mixed", predictor="oracle")
    engine._PRED_MEMO.clear()
    alone = replay(path, ReplayConfig(policy="prefetch-late", **base))
    gated = replay(path, ReplayConfig(policy="prefetch-gated", **base))
    again = replay(path, ReplayConfig(policy="prefetch-late", **base))
    _same(alone, again)
    assert "gate_calibrated_on" in gated.extra and "gate_calibrated_on" not in again.extra


def test_each_copy_computes_at_its_own_precision_by_hand(tmp_path):
    """test_mixed_replay_bytes_by_hand's trace under a profile that times the model's expert at 0.6 ms
    and the int4 one at 0.1: a hit on a high copy computes in 0.6, a low hit or a demand load in 0.1.
    t0: two low loads per layer: 1.5 + 2 t_lo + 0.1 (the last load's tail at the low copy's time).
    t1, t2: per layer one hit on a high copy (the upgrade) and one low load: the device's work is
    0.6 + 0.1 = 0.7, past the load's end t_lo + 0.1 (t_lo = 1088 / 3072 ms = 0.354). The windows
    still hold one upgrade each (1.5, and 1.5 + 0.7 - 0.354 >= t_hi = 1), so the same loads and
    upgrades happen."""
    ts = _trace(tmp_path / "a", [[[0, 1], [2, 3]], [[0, 4], [2, 5]], [[4, 6], [3, 5]]])
    # a CPU fast tier: its kernels compute the packed copy (an accelerator's slots hold dequantized weights)
    hw = dataclasses.replace(_profile(), gpu_expert_ms=0.6, expert_ms={"int4-g128": 0.1}, fast_tier="cpu")
    r = replay(ts, ReplayConfig(policy="lru", capacity=2, cold=True, hardware=hw, expert_dtype="mixed"))
    t_lo = INT4_BYTES / EXPERT_BYTES
    assert r.loads == 8 and r.upgrades == 4
    step0 = 2 * (1.5 + 2 * t_lo + 0.1)
    later = 2 * (1.5 + max(0.6 + 0.1, t_lo + 0.1))
    assert r.modeled_tpot_ms == pytest.approx((step0 + 2 * later) / 3)
    # the int4 time only where the slot holds int4: one precision at int4 is charged 0.1 throughout
    one = replay(ts, ReplayConfig(policy="lru", capacity=2, cold=True, hardware=hw, expert_dtype="int4"))
    assert one.modeled_tpot_ms == pytest.approx((2 * (1.5 + 2 * t_lo + 0.1) + 4 * (1.5 + t_lo + 0.1)) / 3)


def test_a_high_hit_outlasting_the_link_is_charged_the_high_time():
    """layer_time's ``high``: 3 device experts, 2 of them high copies (0.25 each) and 1 low load (0.1),
    the link 0.2 long: the device's work 2 * 0.25 + 0.1 = 0.6 outlasts the load's end 0.2 + 0.1."""
    from moecast.runtime.core.cost_model import CostModel
    from moecast.runtime.core.step import layer_time

    low = CostModel(t_io=0.2, t_g=0.1, beta=0.0, c=1.0, t_attn=1.0, expert_bytes=1)
    t, link = layer_time(low, np.array([3]), np.array([1]), 0.0, 0.0, high=(np.array([2]), 0.25))
    assert link[0] == pytest.approx(0.2) and t[0] == pytest.approx(1.0 + 0.6)
    t, _ = layer_time(low, np.array([3]), np.array([1]), 0.0, 0.0)
    assert t[0] == pytest.approx(1.0 + 0.3)  # all at the low copy's time


def test_a_steps_candidates_take_their_predictions_calibrated_probability():
    """layer_probability by hand. Layer 1's bins: score < 0.5 -> 0.2, < 0.8 -> 0.6, else 0.9. One
    token's scores [4, -8, 2, 6] normalise (by 8) to [0.5, -1, 0.25, 0.75]; its top 2 (experts 3 and 0)
    are the candidates, at 0.6 and 0.6; a padded candidate (-1) gets 0. Two tokens: expert 3 predicted
    by both (0.75 -> 0.6, and 1.0 -> 0.9) is used unless both miss, 1 - 0.4 x 0.1 = 0.96."""
    cal = Calibration(
        edges=np.array([[0.1, 0.2], [0.5, 0.8]]), prob=np.array([[0.0, 0.0, 0.0], [0.2, 0.6, 0.9]])
    )
    one = np.array([[4.0, -8.0, 2.0, 6.0]], np.float32)
    got = layer_probability(cal, 1, one, np.array([[3, 0]]), np.array([[3, 0]]))
    assert got == pytest.approx(np.array([[0.6, 0.6]]))
    assert layer_probability(cal, 1, one, np.array([[3, -1]]), np.array([[3, -1]])) == pytest.approx(
        np.array([[0.6, 0.0]])
    )
    two = np.array([[4.0, -8.0, 2.0, 6.0], [1.0, 0.0, 0.3, 2.0]], np.float32)  # token 2: [0.5, 0, 0.15, 1]
    got = layer_probability(cal, 1, two, np.array([[3, 0, 3, 0]]), np.array([[3, 0]]))
    assert got == pytest.approx(np.array([[1 - 0.4 * 0.1, 1 - 0.4 * 0.4]]))
    # one token's answer is candidate_probability's, bit for bit (the replay's arithmetic)
    rng = np.random.default_rng(0)
    for _ in range(50):
        row = rng.normal(size=(1, 16)).astype(np.float32)
        ids = np.argsort(-row[0])[:4][None]
        s = row / np.abs(row).max()
        want = candidate_probability(ids, ids, cal.at(1, np.take_along_axis(s, ids, 1)))
        assert np.array_equal(layer_probability(cal, 1, row, ids, ids), want)
