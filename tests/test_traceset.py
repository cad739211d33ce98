from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import MissingFieldError, TraceSet, TraceSetError, merge


def test_roundtrip_arrays_and_order(synthetic_traces):
    ts = TraceSet(synthetic_traces)
    assert ts.num_requests == 6 and ts.num_tokens == 72
    ids = ts.array("topk_ids")
    assert ids.shape == (72, 3, 2) and ids.dtype == np.int16
    probs = ts.array("router_probs")
    assert probs.shape == (72, 3, 8)
    # the recorded top-k are the argmax of the recorded distribution
    top = np.sort(np.argsort(-probs.astype(np.float32), -1)[..., :2], -1)
    assert (np.sort(ids, -1) == top).mean() > 0.95
    r = ts.get("req-4")
    assert len(r) == 12 and r.topk_ids.shape == (12, 3, 2) and r.gate_inputs.shape == (12, 3, 16)
    assert list(r.is_decode) == [False] * 6 + [True] * 6
    np.testing.assert_array_equal(ts.array("topk_ids", ["req-4"]), r.topk_ids)
    assert [q.request_id for q in ts] == [f"req-{i}" for i in range(6)]
    # a decoder's view at token 4: the first five tokens of every per-token field
    head = r.prefix(5)
    assert len(head) == 5 and head.token_texts == r.token_texts[:5] and head.request_id == "req-4"
    for name in ("token_ids", "is_decode", "topk_ids", "topk_weights", "router_probs", "gate_inputs"):
        np.testing.assert_array_equal(getattr(head, name), getattr(r, name)[:5])


def test_split_is_deterministic_and_by_request(synthetic_traces):
    ts = TraceSet(synthetic_traces)
    a = ts.split(0.34, seed=3)
    b = ts.split(0.34, seed=3)
    assert a == b
    train, val = a
    assert set(train).isdisjoint(val) and len(train) + len(val) == 6 and len(val) == 2
    assert (
        ts.split(0.34, seed=4) != a or True
    )  # other seeds may coincide on 6 requests; determinism is the contract


def test_missing_field_is_named(tmp_path):
    path = make_synthetic_traceset(tmp_path / "ids_only", with_optional=False)
    ts = TraceSet(path)
    with pytest.raises(MissingFieldError, match="gate_inputs"):
        ts.array("gate_inputs")


def test_other_schema_version_refused(synthetic_traces):
    meta = json.loads((synthetic_traces / "meta.json").read_text())
    meta["schema_version"] = 99
    (synthetic_traces / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TraceSetError, match="schema version 99"):
        TraceSet(synthetic_traces)


def test_truncated_shard_is_a_clear_error(synthetic_traces):
    part = sorted((synthetic_traces / "tokens").glob("part-*.arrow"))[0]
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceSetError, match="corrupt or truncated"):
        TraceSet(synthetic_traces)


def test_uncommitted_chunk_is_invisible_and_resume_skips_done(tmp_path):
    from moecast.collect.traceset import TraceMeta, TraceWriter

    path = make_synthetic_traceset(tmp_path / "t")
    # a kill between the tokens part and its requests part leaves an orphan tokens part
    (path / "tokens" / "part-s000-00099.arrow").write_bytes(b"garbage")
    ts = TraceSet(path)
    assert ts.num_requests == 6
    w = TraceWriter(path, TraceMeta.from_json(json.loads((path / "meta.json").read_text())))
    assert w.done == {f"req-{i}" for i in range(6)}


def test_datasets_view(synthetic_traces):
    reqs, toks = TraceSet(synthetic_traces).datasets()
    assert len(reqs) == 6 and len(toks) == 72
    assert len(toks[0]["topk_ids"]) == 3 * 2


def test_merge_dedups(tmp_path):
    a = make_synthetic_traceset(tmp_path / "a", seed=0)
    out = merge([a, a], tmp_path / "m")
    assert out.num_requests == 6
    np.testing.assert_array_equal(out.array("topk_ids"), TraceSet(a).array("topk_ids"))


def test_rows_is_a_lazy_array(tmp_path):
    """TraceSet.rows reads the same rows as TraceSet.array, gathered across parts on indexing."""
    ts = TraceSet(make_synthetic_traceset(tmp_path / "t", num_requests=6, tokens=5))
    assert len(ts._parts) == 2  # the gather crosses parts
    ids = [ts.request_ids[i] for i in (4, 0, 5, 2)]  # both parts, out of order
    rng = np.random.default_rng(0)
    for name in ("topk_ids", "topk_weights", "router_probs", "gate_inputs"):
        full, lazy = ts.array(name, ids), ts.rows(name, ids)
        assert lazy.shape == full.shape and lazy.dtype == full.dtype and len(lazy) == len(full)
        idx = rng.permutation(len(full))[:11]
        assert np.array_equal(lazy[idx], full[idx])
        assert np.array_equal(lazy[3:17], full[3:17]) and np.array_equal(lazy[:], full)
    assert np.array_equal(ts.rows("topk_ids")[:], ts.array("topk_ids"))
    assert ts.rows("gate_inputs", []).shape == (0, *ts.array("gate_inputs").shape[1:])
    bare = TraceSet(make_synthetic_traceset(tmp_path / "bare", with_optional=False))
    with pytest.raises(MissingFieldError, match="gate_inputs"):
        bare.rows("gate_inputs")


def test_merge_into_an_existing_set_checks_it_first_and_never_overwrites_a_part(tmp_path):
    """An existing --out with other fields is refused before anything is written; new parts are
    numbered after the highest existing one, so a gap (a deleted part) cannot make one overwrite
    another; every source's workloads stay named."""
    import shutil

    a = make_synthetic_traceset(tmp_path / "a", num_requests=4, seed=0)
    ids_only = make_synthetic_traceset(tmp_path / "i", num_requests=4, seed=0, with_optional=False)
    before = (ids_only / "meta.json").read_bytes()
    with pytest.raises(TraceSetError, match="holds fields"):
        merge([a], ids_only)
    assert (ids_only / "meta.json").read_bytes() == before and TraceSet(ids_only).num_requests == 4
    out = tmp_path / "out"
    shutil.copytree(a, out)
    parts = sorted(p.name for p in (out / "requests").glob("part-*.arrow"))
    assert len(parts) >= 2, parts
    for d in ("requests", "tokens"):  # the advice for a damaged part: delete both files
        (out / d / parts[0]).unlink()
    kept = set(TraceSet(out).request_ids)
    other = make_synthetic_traceset(tmp_path / "b", num_requests=3, seed=1)
    meta = json.loads((other / "meta.json").read_text())
    meta["collection"] = {"workloads": ["boolq"]}
    (other / "meta.json").write_text(json.dumps(meta))
    # ids that do not collide with a's
    merged = merge([other], out)
    assert set(merged.request_ids) >= kept and merged.num_requests == len(
        kept | set(TraceSet(other).request_ids)
    )
    assert "boolq" in merged.meta.collection["workloads"]


def test_a_writer_leaves_other_shards_temporaries_alone(tmp_path):
    from moecast.collect.traceset import TraceMeta, TraceWriter

    path = make_synthetic_traceset(tmp_path / "t")
    mine, theirs = (
        path / "tokens" / ".part-s001-00000.arrow.tmp-1",
        path / "tokens" / ".part-s000-00007.arrow.tmp-2",
    )
    mine.write_bytes(b"x")
    theirs.write_bytes(b"y")
    TraceWriter(path, TraceMeta.from_json(json.loads((path / "meta.json").read_text())), shard=1)
    assert not mine.exists() and theirs.exists()  # shard 0 may be about to rename its file
