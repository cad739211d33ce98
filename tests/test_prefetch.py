"""Prefetcher.choose: the one-token path equals the batch path; Eqs. 6-7 sizing agrees with the vectorised form."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moecast.runtime.prefetch import Prefetcher, gap_prefetch_count


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(2, 40),
    st.sampled_from(["f64", "f32", "ties", "signed"]),
    st.one_of(st.none(), st.floats(0.0, 4.0)),
    st.sampled_from([0.3, 0.7, 2.0, 0.0, math.inf]),
)
def test_one_token_choice_equals_batch_path(seed, E, kind, t_gap, t_io):
    """[E], [1, E] and the batch path (a second row of zeros adds no candidate) give the same ids in
    the same order, including exact ties and non-positive scores (never candidates)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, E + 1))
    s = rng.random(E)
    if kind == "f32":
        s = s.astype(np.float32)
    elif kind == "ties":
        s = np.round(s * 4) / 4
    elif kind == "signed":
        s = s - 0.5
    resident = rng.random(E) < rng.random()
    pf = Prefetcher(E, k, t_io=t_io, t_attn=0.08)
    a = pf.choose(s, resident, t_gap=t_gap)
    b = pf.choose(s[None, :], resident, t_gap=t_gap)
    c = pf.choose(np.stack([s, np.zeros_like(s)]), resident, t_gap=t_gap)
    assert np.array_equal(a, b) and np.array_equal(a, c) and a.dtype == c.dtype
    assert not resident[a].any() and (s[a] > 0).all()
    if len(a) > 1:
        assert (np.diff(s[a]) <= 0).all()  # best first


@pytest.mark.parametrize("t_io", [0.7, 0.25, math.inf, 0.0])
def test_gap_count_matches_eqs_6_7(t_io):
    pf = Prefetcher(64, 6, t_io=t_io, t_attn=0.08)
    pf.record(3, 7)
    for gap in np.linspace(0.0, 3.0, 31):
        ref = gap_prefetch_count(np.array([gap]), 0.08, t_io, np.array([pf.r_hit]))[0]
        assert pf._gap_count(float(gap)) == (64 if t_io == 0.0 else ref)
