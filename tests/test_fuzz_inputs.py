"""Hypothesis-fuzzed inputs never crash with a traceback: they parse, or fail with one clear ValueError."""

from __future__ import annotations

import csv
import io

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moecast.collect.moe_beyond import parse_file

cell = st.one_of(st.integers(-5, 80).map(str), st.text(max_size=6))
ids = st.one_of(
    st.lists(st.integers(-3, 70), min_size=0, max_size=8).map(lambda xs: "[" + ", ".join(map(str, xs)) + "]"),
    st.text(max_size=12),
)
row = st.tuples(st.integers(0, 4).map(str), st.just("0"), st.text(max_size=5), ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.one_of(row, st.lists(cell, max_size=6)), max_size=12), cut=st.integers(0, 400))
def test_fuzzed_moe_beyond_csv(tmp_path, rows, cut):
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["Layer ID", "Batch Number", "Token", "Activated Expert IDs"])
    w.writerows(rows)
    text = buf.getvalue()
    path = tmp_path / "prompt_1_data.csv"
    path.write_text(text[: len(text) - cut] if cut < len(text) else text, encoding="utf-8")
    try:
        layers, tokens, out = parse_file(path, num_experts=64)
    except ValueError as exc:
        assert str(exc)  # a message, never an empty error
        return
    # what parses is consistent: [tokens, layers, k] with ids in range and distinct per row
    assert out.shape[:2] == (len(tokens), len(layers))
    assert out.size == 0 or (out.min() >= 0 and out.max() < 64)
