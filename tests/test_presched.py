"""PreSched's Eq. 5 load/CPU split (PreScope Sec. 4.3.3) and Eq. 6's gap, worked by hand.

The split takes the i' minimising max(T_G(i'), T_C(i')), ties to the smaller i', not the paper's
literal "smallest i' with T_G < T_C" (one past the balance point; see runtime/core/presched.py). Each
case below says what the literal rule gave, so a regression to it fails here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from moecast.runtime.core.cost_model import CostModel
from moecast.runtime.core.presched import PreSched, PreSchedDecision, schedule, schedule_unit

SIZES = [1.0, 1.0, 2.0]  # pending tokens of the 3 missing experts, ascending


def _cost(t_io: float = 0.4, c: float = 1.25, t_g: float = 0.05, beta: float = 0.1) -> CostModel:
    return CostModel(t_io=t_io, t_g=t_g, beta=beta, c=c, t_attn=0.5, expert_bytes=1)


def _split(
    sizes: list[float], cost: CostModel, delay: float = 0.0, nxt: list[float] = ()
) -> PreSchedDecision:
    """schedule on the row alone (the compiled one-row path) and beside a copy (the vectorised
    rows): both must give the same decision, which is returned."""
    cur, nx = np.array([sizes]), np.array([list(nxt)]).reshape(1, -1)
    args = (np.array([len(sizes)]), nx, np.array([len(nxt)]), np.array([delay]), np.array([0.5]))
    one = schedule(cur, args[0], nx, *args[2:], cost)
    two = schedule(np.repeat(cur, 2, 0), *(np.repeat(a, 2, 0) for a in args), cost)
    for f in ("n_load", "n_cpu", "t_cpu", "n_prefetch"):
        assert getattr(one, f)[0] == getattr(two, f)[0] == getattr(two, f)[1], f
    return one


def test_hand_case_loads_every_expert_the_literal_rule_sent_one_to_the_cpu():
    """t_io 0.4, t_g 0.05, beta 0.1, C 1.25 (a CPU expert 1.35 ms at 1 token, 1.45 at 2), alpha 0:
    i'   T_G = (3 - i') 0.4 + 0.05   T_C = t_c(first i')   max
    0    1.25                        0                     1.25  <- min-max
    1    0.85                        1.35                  1.35  <- literal rule: 0.85 < 1.35
    2    0.45                        2.70                  2.70
    3    0.05                        4.15                  4.15
    The literal rule ran one expert on the CPU (the layer 1.35 ms); the min-max loads all three."""
    d = _split(SIZES, _cost())
    assert (d.n_cpu[0], d.n_load[0], d.t_cpu[0]) == (0, 3, 0.0)


def test_balance_inside_the_range_is_one_before_the_literal_rule():
    """t_io 1.0: T_G = 3.05, 2.05, 1.05, 0.05; T_C = 0, 1.35, 2.70, 4.15; max = 3.05, 2.05, 2.70,
    4.15 -> i' = 1 (the 1-token expert on the CPU, 1.35 ms). The literal rule took i' = 2
    (1.05 < 2.70): two CPU experts and a 2.70 ms layer."""
    d = _split(SIZES, _cost(t_io=1.0))
    assert (d.n_cpu[0], d.n_load[0]) == (1, 2)
    assert d.t_cpu[0] == pytest.approx(1.35)


def test_the_literal_rule_is_kept_where_it_sits_at_the_balance():
    """t_io 1.5: T_G = 4.55, 3.05, 1.55, 0.05; max = 4.55, 3.05, 2.70, 4.15 -> i' = 2, as the
    literal rule (T_G(1) = 3.05 > T_C(2) = 2.70, so the first passing i' is already the best)."""
    d = _split(SIZES, _cost(t_io=1.5))
    assert (d.n_cpu[0], d.n_load[0]) == (2, 1)
    assert d.t_cpu[0] == pytest.approx(2.70)


def test_link_delay_moves_the_balance_towards_the_cpu():
    """The hand case with alpha 1.0 (an earlier prefetch holds the link): T_G = 2.25, 1.85, 1.45,
    1.05; max = 2.25, 1.85, 2.70, 4.15 -> i' = 1 (the literal rule: i' = 2, 1.45 < 2.70)."""
    d = _split(SIZES, _cost(), delay=1.0)
    assert (d.n_cpu[0], d.n_load[0]) == (1, 2)
    assert d.t_cpu[0] == pytest.approx(1.35)


@pytest.mark.parametrize("t_io", [100.0, math.inf])
def test_everything_on_the_cpu_when_loads_are_slow(t_io):
    """T_G = (3 - i') t_io + 0.05 dwarfs T_C <= 4.15 until i' = 3: all three on the CPU, 4.15 ms
    (the literal rule agrees here)."""
    d = _split(SIZES, _cost(t_io=t_io))
    assert (d.n_cpu[0], d.n_load[0]) == (3, 0)
    assert d.t_cpu[0] == pytest.approx(4.15)


def test_everything_loads_when_the_cpu_is_slow():
    """C 100: T_C = 0, 100.1, 200.2, 300.4 against T_G <= 1.25 -> i' = 0. The literal rule can never
    pick i' = 0 (T_C(0) = 0 < T_G), so it ran one expert on the CPU: a 100.1 ms layer."""
    d = _split(SIZES, _cost(c=100.0))
    assert (d.n_cpu[0], d.n_load[0], d.t_cpu[0]) == (0, 3, 0.0)


def test_a_tie_keeps_the_smaller_i():
    """Two 1-token misses, t_io 1, t_g 0.25, beta 0, C 2.25 (exact in binary): T_G = 2.25, 1.25,
    0.25; T_C = 0, 2.25, 4.5; max = 2.25, 2.25, 4.5: i' = 0 and 1 tie -> i' = 0, both load (fewer
    CPU experts). The literal rule took i' = 1."""
    d = _split([1.0, 1.0], _cost(t_io=1.0, t_g=0.25, beta=0.0, c=2.25))
    assert (d.n_cpu[0], d.n_load[0], d.t_cpu[0]) == (0, 2, 0.0)


def test_eq6_gap_is_clamped_at_zero_when_the_layer_is_gpu_bound():
    """The hand case (i' = 0, 3 loads) with one predicted next-layer expert of 3 tokens.
    Eq. 4: E_all = [1, 1, 2, 3]; T_all^G(k) = (4 - k) 0.4 + 0.05 = 1.65, 1.25, ...; T_all^C(k) =
    t_c(E_all[0..k-1]) + t_attn 0.5 = 0.5, 1.85, ... -> the queue starts at k = 1 and holds the
    next-layer expert. Eq. 6: T_gap = T_C - alpha - 3 t_io = 0 - 0 - 1.2 < 0, clamped to 0 (the
    link idles from the last load through the next attention): f = (0 + 0.5) / 0.4 = 1.25,
    |f| = 1, xi = 0.5 * 1.25 - 0.5 * (1 - 1.25) > 0 -> 1 prefetch. Unclamped: f = -1.75 -> none."""
    d = _split(SIZES, _cost(), nxt=[3.0])
    assert (d.n_load[0], d.n_prefetch[0]) == (3, 1)


def test_the_online_wrapper_sends_the_smallest_to_the_cpu():
    """PreSched.decide sorts the tokens (stably): [2, 1, 1] with t_io 1.0 -> i' = 1 as above: the
    first 1-token expert (index 1) on the CPU, index 2 and the 2-token one loaded."""
    load, cpu, _ = PreSched(_cost(t_io=1.0)).decide(np.array([2.0, 1.0, 1.0]), np.array([]))
    assert cpu.tolist() == [1] and sorted(load.tolist()) == [0, 2]


def test_split_minimises_the_layer_span_on_random_rows():
    """Against a brute force over every i': the chosen i' is the first minimiser of
    max(T_G, T_C), in schedule and (one-token rows) schedule_unit."""
    rng = np.random.default_rng(1)
    rows, M = 400, 6
    cost = _cost(t_io=0.37, c=0.9)
    n = rng.integers(0, M + 1, rows)
    sizes = np.sort(np.where(np.arange(M) < n[:, None], rng.integers(1, 5, (rows, M)), 99), 1).astype(float)
    delay = np.where(rng.random(rows) < 0.5, 0.0, rng.random(rows) * 2)
    none = (np.zeros((rows, 0)), np.zeros(rows, int), delay, np.full(rows, 0.5), cost)
    d = schedule(sizes, n, *none)
    ones = (np.arange(M) < n[:, None]).astype(float)
    u, ref = schedule_unit(n, M, none[1], 0, *none[2:]), schedule(ones, n, *none)
    for r in range(rows):
        for sz, got in ((sizes[r], d.n_cpu[r]), (ones[r], u.n_cpu[r])):
            tc = np.concatenate([[0.0], np.cumsum(cost.beta * sz[: n[r]] + cost.c)])
            span = [max(delay[r] + (n[r] - i) * cost.t_io + cost.t_g, tc[i]) for i in range(n[r] + 1)]
            assert got == int(np.argmin(span)), (r, span)
    assert (u.n_cpu == ref.n_cpu).all() and (u.t_cpu == ref.t_cpu).all()


def test_the_gap_stays_negative_when_nothing_loads_and_sizes_the_prefetch():
    """t_io 1, t_g 0.25, C 0.5, t_attn 4.5; one miss of one token, five next-layer candidates, a late
    prefetch's delay 2, r_hit 0.5. Loading it spans 2 + 1 + 0.25 = 3.25, the CPU 0.5: nothing loads
    (n_cpu 1, t_cpu 0.5). The gap is T_C - delay = 0.5 - 2 = -1.5, so the prefetch count is PreSched's
    f for a negative gap: 3 (a split that dropped the gap when nothing loads would give 4)."""
    cost = CostModel(t_io=1.0, t_g=0.25, beta=0.0, c=0.5, t_attn=4.5, expert_bytes=1)
    for rows in (1, 2):
        d = schedule(np.ones((rows, 1)), np.full(rows, 1), np.ones((rows, 5)), np.full(rows, 5),
                     np.full(rows, 2.0), np.full(rows, 0.5), cost)  # fmt: skip
        assert (d.n_load[0], d.n_cpu[0], d.t_cpu[0], d.n_prefetch[0]) == (0, 1, 0.5, 3)


def test_plan_prior_maps_probabilities_with_zeros_to_logits_by_hand():
    """plan_prior (CasMoE Sec. 4): probabilities (non-negative, <= 1) become logits before the plan's
    log prior is added, zeros included (clipped to 1e-6). Scores [0.5, 0] with a flat plan [1, 1] at
    weight 1: logit(0.5) + log(0.5) = -0.6931 and logit(1e-6) + log(0.5) = -13.8155 - 0.6931."""
    from moecast.runtime.core.prefetch import plan_prior

    got = plan_prior(np.array([[[0.5, 0.0]]]), np.array([[1.0, 1.0]]), 1.0)
    assert got[0, 0] == pytest.approx([math.log(0.5), math.log(1e-6 / (1 - 1e-6)) + math.log(0.5)], rel=1e-5)


def test_plan_prior_takes_probabilities_as_they_are_and_counts_as_shares():
    """Scores in [0, 1] are probabilities, mapped to logits as they are: [0.5, 0.25] -> [0, log(1/3)]
    (weight 0: the predictor alone). Counts (max > 1) are shares of their row first: [2, 1] ->
    [2/3, 1/3] -> [log 2, -log 2]."""
    from moecast.runtime.core.prefetch import plan_prior

    flat = np.array([[1.0, 1.0]])
    got = plan_prior(np.array([[[0.5, 0.25]]]), flat, 0.0)
    assert got[0, 0] == pytest.approx([0.0, math.log(1 / 3)], abs=1e-6)
    got = plan_prior(np.array([[[2.0, 1.0]]]), flat, 0.0)
    assert got[0, 0] == pytest.approx([math.log(2), -math.log(2)], abs=1e-6)
