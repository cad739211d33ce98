"""SMoE Algorithm 1 substitution and Algorithm 2 balancing: properties and the alpha = 0 identity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moecast.runtime.core.balancer import two_pointer, two_pointer_split
from moecast.runtime.core.substitution import _substitute_rows, substitute

E, K = 12, 3


@st.composite
def batches(draw):
    n = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, E)) * draw(st.floats(0.1, 3.0))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    resident = rng.random((1, E)) < draw(st.floats(0.0, 1.0))
    alpha = draw(st.floats(0.0, 0.9))
    return probs.astype(np.float32), np.repeat(resident, n, 0), alpha


@settings(max_examples=150, deadline=None)
@given(batches())
def test_substitution_stays_in_alpha_band(case):
    probs, resident, alpha = case
    topk = np.argsort(-probs, axis=1)[:, :K]
    out, nsub = substitute(probs, topk, resident, alpha, group=np.zeros(len(probs), dtype=np.int64))
    top_sets = [set(r.tolist()) for r in topk]
    beta = np.array([np.delete(p, t).max() for p, t in zip(probs, topk)])
    cset = set()
    for p, t, b in zip(probs, topk, beta):
        cset |= {int(e) for e in t if p[e] > (1 + alpha) * b}
    for row, p, b, orig in zip(out, probs, beta, top_sets):
        assert len(set(row.tolist())) == K  # still k distinct experts
        for e in row.tolist():
            if e in orig:
                continue
            # a substitute: inactive, score in ((1 - alpha) beta, beta], resident or a batch top-score expert
            assert (1 - alpha) * b < p[e] <= b + 1e-9
            assert resident[0, e] or e in cset
        for e in orig - set(row.tolist()):
            # only low-score, non-resident experts outside C are replaced
            assert p[e] <= (1 + alpha) * b and not resident[0, e] and e not in cset
    assert (nsub == [len(set(r.tolist()) - o) for r, o in zip(out, top_sets)]).all()


@settings(max_examples=50, deadline=None)
@given(batches())
def test_alpha_zero_changes_nothing(case):
    probs, resident, _ = case
    topk = np.argsort(-probs, axis=1)[:, :K]
    out, nsub = substitute(probs, topk, resident, 0.0)
    assert (out == topk).all() and nsub.sum() == 0


def test_substitution_prefers_resident_alternative():
    p = np.array([[0.40, 0.175, 0.105, 0.10, 0.02, 0.20]], dtype=np.float32)
    # top-3 = {0, 5, 1}; beta = 0.105 (expert 2). alpha 0.7: T = 0.1785, so 0 and 5 are top-score and
    # expert 1 (0.175) is low-score and not resident; expert 2 (resident, 0.105 > 0.3 * beta) replaces it.
    topk = np.array([[0, 5, 1]])
    ids, nsub = substitute(p, topk, np.array([[True, False, True, False, False, False]]), 0.7)
    assert set(ids[0].tolist()) == {0, 2, 5} and nsub.tolist() == [1]
    assert set(substitute(p, topk, np.zeros((1, 6), bool), 0.0)[0][0].tolist()) == {0, 1, 5}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=0, max_size=10), st.floats(0.01, 5.0), st.floats(0.01, 5.0))
def test_vectorised_two_pointer_matches_algorithm_2(sizes, t_load, t_cpu):
    load, cpu = two_pointer(np.array(sizes), t_load, t_cpu)
    assert len(load) + len(cpu) == len(sizes)
    desc = np.sort(np.array(sizes, dtype=float))[::-1]
    M = max(len(sizes), 1)
    row = np.zeros((1, M))
    row[0, : len(sizes)] = desc
    j = two_pointer_split(row, np.array([len(sizes)]), t_load, t_cpu)[0]
    assert j == len(load)
    if len(load) and len(cpu):
        assert min(np.array(sizes)[load]) >= max(np.array(sizes)[cpu])  # larger batches go to the device


@settings(max_examples=300, deadline=None)
@given(
    batches(),
    st.integers(1, E),
    st.sampled_from(["top", "reversed", "any"]),
    st.sampled_from(["f32", "f64", "ties"]),
)
def test_single_token_route_equals_algorithm_1(case, k, which, dtype):
    """The one-token path (substitute() with one row) gives exactly the
    vectorised Algorithm 1's ids (order included) and counts: float32 or float64 scores, exact ties,
    the router's top-k in any order or any k experts."""
    probs, resident, alpha = case
    p = probs[:1]
    if dtype == "f64":
        p = p.astype(np.float64) * (1 + 1e-9)  # values between float32 neighbours
    elif dtype == "ties":
        p = np.round(p * 16) / 16
    topk = np.argsort(-p, axis=1, kind="stable")[:, :k]
    if which == "reversed":
        topk = topk[:, ::-1].copy()
    elif which == "any":
        topk = np.random.default_rng(int(p.sum() * 1e6)).permutation(E)[None, :k]
    ref, ref_n = _substitute_rows(p, topk, resident[:1], alpha)
    one, one_n = substitute(p, topk, resident[:1], alpha)
    assert np.array_equal(one, ref) and np.array_equal(one_n, ref_n)
    assert ref.dtype == one.dtype


def test_one_token_path_refuses_a_resident_mask_of_another_size():
    """The compiled one-token kernel indexes the resident mask by expert id: a mask of the wrong
    length is a clear error, never a read past its end."""
    p = np.full((1, 8), 0.125, dtype=np.float32)
    with pytest.raises(ValueError, match="resident has 4 experts"):
        substitute(p, np.array([[0, 1]]), np.zeros((1, 4), bool), 0.2)


def test_algorithm_2_gives_a_tie_to_loading():
    """Three one-token misses, a load 1 ms, a token on the CPU 1 ms. Algorithm 2 loads the largest (load
    first: 0 <= 0), then computes the smallest on the CPU (1 > 0), then
    meets at load 1 against CPU 1: the tie loads. Experts 0 and 1 load, 2 computes on the CPU, in all
    three implementations (a strict comparison would load one)."""
    from moecast.runtime.core import step_kernels as sk

    load, cpu = two_pointer(np.array([1, 1, 1]), 1.0, 1.0)
    assert load.tolist() == [0, 1] and cpu.tolist() == [2]
    assert two_pointer_split(np.array([[1.0, 1.0, 1.0]]), np.array([3]), 1.0, 1.0).tolist() == [2]
    assert sk._smoe_loads(3, 1.0, 1.0) == 2


def test_the_lowest_scored_missing_expert_is_the_one_substituted():
    """p = [.30, .16, .15, .14, .13, .12], routed {0, 1, 2}, only expert 3 resident, alpha 0.5: beta =
    S_4 = .14. Expert 0 is top-score (.30 > 1.5 beta = .21); 1 and 2 are low-score (.14 < S <= .21) and
    missing; the one alternative ((1 - alpha) beta = .07 < S <= .14, resident) is 3. It replaces the
    lower-scored missing one, 2: ids [0, 1, 3], one substitution."""
    p = np.array([[0.30, 0.16, 0.15, 0.14, 0.13, 0.12]], np.float32)
    res = np.array([[False, False, False, True, False, False]])
    for f in (_substitute_rows, substitute):
        ids, n = f(p, np.array([[0, 1, 2]]), res, 0.5)
        assert ids[0].tolist() == [0, 1, 3] and n.tolist() == [1]


def test_a_score_exactly_at_the_top_band_edge_is_low_score():
    """Pins Algorithm 1's band beta < S <= (1 + alpha) beta at its upper edge: S == (1 + alpha) beta is
    a *low*-score expert (replaceable), on the vectorised rows and on the compiled one-token kernel.

    By hand (all exact in float32): p = [.375, .3, .25, .075], routed {0, 1}, resident {1, 2},
    alpha 0.5: beta = S_3 = .25, (1 + alpha) beta = .375, (1 - alpha) beta = .125. Expert 0 (.375 <=
    .375) is low-score and missing; the one alternative is 2 (.125 < .25 <= .25, resident). Ids
    [1, 2] (score order .3, .25), one substitution. The vectorised path runs with a second, padding
    row (topk -1), which keeps its ids and counts 0. Catches S1 (`s >= hi` on the rows makes expert 0
    top-score: ids [0, 1], 0) and K1 (`v < hi` in the kernel: no change)."""
    p = np.array([0.375, 0.3, 0.25, 0.075], np.float32)
    res = np.array([False, True, True, False])
    ids, n = substitute(np.stack([p, p]), np.array([[0, 1], [-1, -1]]), np.stack([res, res]), 0.5)
    assert ids.tolist() == [[1, 2], [-1, -1]] and n.tolist() == [1, 0]
    ids, n = substitute(p[None], np.array([[0, 1]]), res[None], 0.5)  # one token: the compiled kernel
    assert ids.tolist() == [[1, 2]] and n.tolist() == [1]
