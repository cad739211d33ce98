"""Context memory (predictors/context_memory.py): keys, the index, LLaPor's blend, `predictors remember`."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import quiet_trainer, synthetic_record, synthetic_writer
from moecast.collect.traceset import TraceSet
from moecast.predictors import load
from moecast.predictors.commands import remember
from moecast.predictors.context_memory import MemoryConfig, build, context_keys, last_keys
from moecast.predictors.metrics import recall_at_k
from moecast.train.data import LLaPorDataModule
from moecast.train.llapor import LLaPorModule

torch.set_num_threads(1)

L, E, K = 3, 8, 2
TEMPLATES = [
    [11, 12, 13, 14, 15, 16, 17, 18],
    [21, 22, 23, 24, 25, 26, 27, 28],
    [31, 32, 33, 34, 35, 36, 37, 38],
]


def _route(tok: np.ndarray, t: int) -> np.ndarray:
    """[L, K] experts decided by the token and the two before it: a deterministic router."""
    ctx = tuple(int(x) for x in tok[max(0, t - 2) : t + 1])
    rng = np.random.default_rng(abs(hash(ctx)) % (2**32))
    return np.stack([rng.permutation(E)[:K] for _ in range(L)])


def _write(path: Path, num_requests: int = 24, seed: int = 0) -> Path:
    """Requests that open with one of three templates and go on with random tokens."""
    rng = np.random.default_rng(seed)
    writer = synthetic_writer(
        path, num_layers=L, num_experts=E, top_k=K, with_optional=False, name="memory-test"
    )
    records = []
    for r in range(num_requests):
        tok = np.array(TEMPLATES[r % 3] + list(rng.integers(40, 200, size=8)))
        ids = np.stack([_route(tok, t) for t in range(len(tok))])
        records.append(synthetic_record(r, tok, ids))
    writer.write(records)
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("memory") / "tr")


# ---------------------------------------------------------------------- keys
def test_keys_match_the_same_context_anywhere_and_prompt_starts_only_at_starts() -> None:
    a = np.array([5, 9, 1, 2, 3, 4, 5, 6, 7])
    b = np.array([8, 1, 2, 3, 4, 5, 6, 7, 0])
    ka, kb = context_keys(a, (3, 6)), context_keys(b, (3, 6))
    assert (ka[8] == kb[7]).all()  # ...5 6 7 and 2 3 4 5 6 7: same text at other positions
    assert ka[8, 0] != kb[8, 0]
    # shorter than n, a prompt's first tokens hash with the start marker: [5, 9, 1] opening a
    # prompt matches another prompt opening with it, not the same three tokens mid-text
    c = np.array([5, 9, 1])
    d = np.array([0, 5, 9, 1])
    assert context_keys(c, (6,))[2, 0] == ka[2, 1]
    assert context_keys(c, (4,))[2, 0] != context_keys(d, (4,))[3, 0]
    assert context_keys(d, (3,))[3, 0] == context_keys(np.array([7, 5, 9, 1]), (3,))[3, 0]


@pytest.mark.parametrize("T", [1, 5, 6, 7, 31, 32, 33, 90])
def test_last_keys_equal_the_vectorised_keys(T: int) -> None:
    rng = np.random.default_rng(T)
    tok = rng.integers(-3, 2**31, T)
    ngrams = (6, 8, 16, 32)
    window = tok[-32:] if T >= 32 else tok
    assert last_keys(window.tolist(), ngrams) == [int(x) for x in context_keys(tok, ngrams)[-1]]


# ---------------------------------------------------------------------- the index
def test_votes_are_the_latest_occurrences_shares_of_each_expert(traces: Path) -> None:
    ts = TraceSet(traces)
    sides = ts.splits(0.25, 0.1, 0)
    train, held = sides.train, sides.val + sides.test
    cfg = MemoryConfig(ngrams=(2, 4), max_postings=3)
    mem = build(ts, train, cfg)
    # brute force: for each context, its occurrences in request then token order, the last 3 kept
    seen: dict[tuple, list[np.ndarray]] = defaultdict(list)
    for r in ts.iter_requests(train):
        tok = list(np.asarray(r.token_ids))
        for t in range(len(tok)):
            for n in cfg.ngrams:
                ctx = ("start", *tok[: t + 1]) if t + 1 < n else tuple(tok[t + 1 - n : t + 1])
                seen[(n, ctx)].append(np.asarray(r.topk_ids[t]))
    matched = 0
    for r in ts.iter_requests(held):
        tok = list(np.asarray(r.token_ids))
        got = mem.votes(r.token_ids)
        for t in range(len(tok)):
            want = np.zeros((L, E))
            for n in cfg.ngrams:
                ctx = ("start", *tok[: t + 1]) if t + 1 < n else tuple(tok[t + 1 - n : t + 1])
                occ = seen.get((n, ctx), [])[-cfg.max_postings :]
                for ids in occ:
                    for layer in range(L):
                        want[layer, ids[layer]] += 1 / len(occ)
                matched += bool(occ)
            np.testing.assert_allclose(got[t], want, atol=1e-6)
            np.testing.assert_allclose(mem.votes_last(np.asarray(r.token_ids)[: t + 1]), want, atol=1e-6)
    assert matched > 0
    assert len(mem.routes) == ts.request_lengths(train).sum()


def test_bad_memory_settings_are_one_line_errors() -> None:
    for kw, word in (
        ({"ngrams": (0, 4)}, "ngrams"),
        ({"max_postings": 0}, "max_postings"),
        ({"weight": -1.0}, "weight"),
    ):
        with pytest.raises(ValueError, match=word) as info:
            MemoryConfig(**kw)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="memory_ngrams"):
        LLaPorModule(memory_ngrams=[4, 4])


# ---------------------------------------------------------------------- LLaPor with a memory
@pytest.fixture(scope="module")
def trained(traces: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LLaPor trained 2 epochs and exported with a memory (model.memory_ngrams)."""
    torch.manual_seed(0)
    data = LLaPorDataModule(str(traces), val_fraction=0.25, batch_size=64)
    module = LLaPorModule(hidden=16, warmup_epochs=0, loss="softmax", memory_ngrams=[2, 4], memory_postings=8)
    quiet_trainer(2).fit(module, datamodule=data)
    out = tmp_path_factory.mktemp("memory_ckpt") / "llapor.safetensors"
    module.export(out, data, {})
    return out


def test_export_builds_the_memory_from_the_training_split_only(trained: Path, traces: Path) -> None:
    pred = load(trained)
    ts = TraceSet(traces)
    train = ts.splits(0.25, 0.1, 0).train
    assert pred.memory is not None and pred.metadata()["memory"]["ngrams"] == [2, 4]
    assert len(pred.memory.routes) == ts.request_lengths(train).sum()
    # none of the held-out requests' own routes are in it: every stored route is a training token's
    np.testing.assert_array_equal(pred.memory.routes, ts.array("topk_ids", train))


def test_scores_add_the_votes_to_the_softmax_and_raise_held_out_recall(trained: Path, traces: Path) -> None:
    pred = load(trained)
    ts = TraceSet(traces)
    sides = ts.splits(0.25, 0.1, 0)
    held = sides.val + sides.test
    memory = pred.memory
    with_mem, without, truth = [], [], []
    for r in ts.iter_requests(held):
        s = pred.score_request(r)
        pred.memory = None
        net = pred.score_request(r)
        pred.memory = memory
        # the blend: the network's softmax times k (from its sigmoids) plus the weighted votes
        odds = np.clip(net, 1e-7, 1 - 1e-7) / (1 - np.clip(net, 1e-7, 1 - 1e-7))
        want = odds * (K / odds.sum(-1, keepdims=True)) + memory.config.weight * memory.votes(r.token_ids)
        np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-6)
        with_mem.append(s), without.append(net), truth.append(np.asarray(r.topk_ids))
    y = np.concatenate(truth)
    # the templates' tokens repeat training contexts, whose routes the router decides alone
    assert recall_at_k(np.concatenate(with_mem), y) > recall_at_k(np.concatenate(without), y) + 0.1


def test_score_at_blends_like_score_request(trained: Path, traces: Path) -> None:
    pred = load(trained)
    pred.int8_kernel = False
    ts = TraceSet(traces)
    sides = ts.splits(0.25, 0.1, 0)
    held = sides.val + sides.test
    r = ts.get(held[0])
    full = pred.score_request(r)
    for t in range(len(r.token_ids)):
        sub = r.prefix(t + 1)
        for layer in range(L):
            np.testing.assert_allclose(pred.score_at(sub, layer), full[t, layer], rtol=1e-4, atol=1e-5)


def test_remember_adds_rebuilds_and_removes_a_memory(
    trained: Path, traces: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "m.safetensors"
    res = remember(str(trained), traces=str(traces), out=str(out), ngrams=[3], max_postings=2, weight=0.5)
    assert capsys.readouterr().out.startswith(f"wrote {out} with a context memory of ")
    pred = load(out)
    assert res["memory"]["ngrams"] == [3] and pred.memory.config.max_postings == 2
    assert pred.memory.config.weight == 0.5
    ts = TraceSet(traces)
    # the network is the same: without the memory the scores equal the original's
    orig = load(trained)
    orig.memory = pred.memory = None
    r = ts.get(ts.request_ids[0])
    np.testing.assert_array_equal(pred.score_request(r), orig.score_request(r))
    everything = tmp_path / "all.safetensors"
    remember(str(trained), traces=str(traces), out=str(everything), requests="all")
    assert len(load(everything).memory.routes) == ts.num_tokens
    capsys.readouterr()
    remember(str(out), traces=str(traces), out=str(out), ngrams=[], json=True)
    assert load(out).memory is None and load(out).metadata()["memory"] is None
    assert json.loads(capsys.readouterr().out)["memory"] is None
    # from the command line, where an empty list cannot be typed: --forget, which needs no traces
    from moecast.cli import main

    forgot = tmp_path / "forgot.safetensors"
    main(["predictors", "remember", str(everything), "--forget", "--out", str(forgot), "--json"])
    assert json.loads(capsys.readouterr().out)["memory"] is None
    assert load(forgot).memory is None and load(everything).memory is not None
    orig.memory = None
    np.testing.assert_array_equal(load(forgot).score_request(r), orig.score_request(r))


def test_remember_refuses_other_predictors_and_bad_options(
    trained: Path, traces: Path, tmp_path: Path
) -> None:
    from moecast.predictors.commands import evaluate

    freq = tmp_path / "freq.safetensors"
    evaluate("frequency", traces=str(traces), json=True, save=str(freq))
    with pytest.raises(ValueError, match="LLaPor only"):
        remember(str(freq), traces=str(traces), out=str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="--requests"):
        remember(str(trained), traces=str(traces), out=str(tmp_path / "x.safetensors"), requests="some")
    with pytest.raises(ValueError, match="--traces"):
        remember(str(trained), out=str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="give one of them"):
        remember(str(trained), out=str(tmp_path / "x.safetensors"), forget=True, ngrams=[3])


def test_the_memorys_votes_blend_at_their_weight_by_hand():
    """p = [.2, .6], votes [1, 0], weight .5, k 1: p + .5 votes = [.7, .6]. With softmax the sigmoids'
    odds p / (1 - p) = [.25, 1.5] are scaled to sum k (over 1.75), then the votes added:
    [.25 / 1.75 + .5, 1.5 / 1.75] (votes at weight 1 would give 1.2 first); at k 2 the odds sum to 2
    (times 2 / 1.75)."""
    from moecast.predictors import llapor_kernel

    p = np.array([[0.2, 0.6]], np.float32)
    v = np.array([[1.0, 0.0]], np.float32)
    out = np.empty_like(p)
    llapor_kernel.blend_rows(p, v, 1.0, 0.5, False, out)
    assert out[0].tolist() == pytest.approx([0.7, 0.6])
    llapor_kernel.blend_rows(p, v, 1.0, 0.5, True, out)
    assert out[0].tolist() == pytest.approx([0.25 / 1.75 + 0.5, 1.5 / 1.75], rel=1e-5)
    llapor_kernel.blend_rows(p, v, 2.0, 0.5, True, out)
    assert out[0].tolist() == pytest.approx([0.5 / 1.75 + 0.5, 3.0 / 1.75], rel=1e-5)


def test_each_context_keeps_its_latest_postings_by_hand(tmp_path: Path) -> None:
    """Four requests open with the same tokens [5, 6] and send token 6 to expert r (request r; one
    layer, top-1). With max_postings 2 the bigram [5, 6] keeps its two latest occurrences,
    requests 2 and 3: the vote is 1/2 for expert 2 and 1/2 for expert 3. Token 5 (the prompt start,
    expert 0 in every request) votes 1 for expert 0."""
    writer = synthetic_writer(tmp_path / "t", num_layers=1, num_experts=4, top_k=1, with_optional=False)
    writer.write([synthetic_record(r, np.array([5, 6]), np.array([[[0]], [[r]]])) for r in range(4)])
    ts = TraceSet(tmp_path / "t")
    mem = build(ts, ts.request_ids, MemoryConfig(ngrams=(2,), max_postings=2))
    got = mem.votes(np.array([5, 6]))
    np.testing.assert_allclose(got[:, 0], [[1, 0, 0, 0], [0, 0, 0.5, 0.5]])
    np.testing.assert_allclose(mem.votes_last(np.array([5, 6]))[0], [0, 0, 0.5, 0.5])
