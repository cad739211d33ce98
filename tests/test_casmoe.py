"""CasMoE prompt-level planners: EP label (Eq. 3), EAM (Eqs. 4-5 + buffer), EAP (Eqs. 6-9), the cascade gate."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import make_synthetic_traceset
from moecast.collect.traceset import TraceSet
from moecast.predictors import CheckpointError, load
from moecast.predictors.bert_encoder import FastBertEncoder, checked_fast_encoder, fast_encoder_unsupported
from moecast.predictors.cascade import Cascade
from moecast.predictors.casmoe import ep_label, ep_labels, plan_recall, prompt_text
from moecast.predictors.checkpoint import load_raw, save
from moecast.predictors.eam import EAM, buffer_path, index_path
from moecast.predictors.onnx_encoder import OrtBertEncoder
from moecast.predictors.sentence_encoder import SentenceEmbedder, torch_threads
from moecast.train.planner_report import cascade_wins, compare_planners

TOPICS = [
    "Write a python function that sorts a list of integers",
    "Explain the causes of the French revolution",
    "Give me a recipe for a vegetarian lasagna",
    "How do I fix a segmentation fault in my C program",
    "Summarise the plot of Hamlet in three sentences",
    "What is the derivative of x squared times sine x",
    "Translate good morning into Spanish and German",
    "Plan a three day trip to Kyoto in spring",
    "Why is the sky blue during the day",
    "Draft a polite email declining a meeting",
    "Compare TCP and UDP for a game server",
    "List five exercises for lower back pain",
]


def _distinct_prompts(path: Path) -> None:
    """Give each synthetic request a real, distinct sentence as its prompt (make_synthetic_traceset writes 'prompt N')."""
    import pyarrow as pa
    from moecast.collect.traceset import _read_table, _write_table

    for part in sorted((path / "requests").glob("part-*.arrow")):
        table = _read_table(part)
        ids = table.column("request_id").to_pylist()
        prompts = [TOPICS[int(r.split("-")[1]) % len(TOPICS)] + f" (case {r})" for r in ids]
        table = table.set_column(table.column_names.index("prompt"), "prompt", pa.array(prompts, pa.string()))
        _write_table(part, table)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    path = make_synthetic_traceset(
        tmp_path_factory.mktemp("casmoe") / "ts", num_requests=12, num_layers=3, num_experts=8, top_k=2
    )
    _distinct_prompts(path)
    return path


@pytest.fixture(scope="module")
def eam_ckpt(traces, tmp_path_factory) -> Path:
    from moecast.predictors.eam import EAMConfig
    from moecast.train.casmoe import PlanData
    from moecast.train.eam import fit_eam

    out = tmp_path_factory.mktemp("eam") / "eam.safetensors"
    fit_eam(str(traces), str(out), EAMConfig(k_neighbours=1), PlanData(val_fraction=0.25), wandb=False)
    return out


@pytest.fixture(scope="module")
def eap_ckpt(traces, tiny_encoder, tmp_path_factory) -> Path:
    from moecast.cli import run

    out = tmp_path_factory.mktemp("eap") / "eap.safetensors"
    run(
        [
            "train",
            "eap",
            "--config",
            str(Path(__file__).parents[1] / "configs" / "eap_minilm.yaml"),
            "--traces",
            str(traces),
            "--out",
            str(out),
            "--model.encoder",
            str(tiny_encoder),
            "--model.max_length",
            "32",
            "--data.batch_size",
            "4",
            "--data.val_fraction",
            "0.25",
            "--train.max_epochs",
            "2",
            "--train.accelerator",
            "cpu",
            "--train.progress_bar",
            "false",
        ]
    )
    return out


# ----------------------------------------------------------------------------- EP label


def test_ep_label_is_router_weighted_and_normalised(traces):
    ts = TraceSet(traces)
    ep, weighted = ep_labels(ts)
    assert weighted and ep.shape == (12, 3, 8)
    np.testing.assert_allclose(ep.sum(-1), 1.0, rtol=1e-5)
    for i, rid in enumerate(ts.request_ids):
        tr = ts.get(rid)
        naive = np.zeros((3, 8))
        for t in np.flatnonzero(~tr.is_decode):
            for layer in range(3):
                for e, w in zip(tr.topk_ids[t, layer], tr.topk_weights[t, layer]):
                    naive[layer, e] += float(w)
        naive /= naive.sum(-1, keepdims=True)
        np.testing.assert_allclose(ep[i], naive, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(ep_label(tr, 8), ep[i], rtol=1e-5, atol=1e-7)
    with_decode, _ = ep_labels(ts, include_decode=True)
    assert not np.allclose(with_decode, ep)


def test_ep_label_counts_without_weights(tmp_path):
    path = make_synthetic_traceset(tmp_path / "nw", num_requests=3, with_optional=False)
    ts = TraceSet(path)
    ep, weighted = ep_labels(ts)
    assert not weighted
    tr = ts.get(ts.request_ids[0])
    prefill = tr.topk_ids[~tr.is_decode]
    counts = np.stack(
        [np.bincount(prefill[:, layer].ravel(), minlength=ts.num_experts) for layer in range(ts.num_layers)]
    )
    np.testing.assert_allclose(ep[0], counts / counts.sum(-1, keepdims=True), rtol=1e-6)


def test_plan_recall_matches_definition():
    true_ep = np.zeros((1, 2, 6), np.float32)
    true_ep[0, 0, [0, 1]] = 0.5
    true_ep[0, 1, [4, 5]] = 0.5
    plans = np.zeros_like(true_ep)
    plans[0, 0, [0, 2]] = 1.0  # one of two right
    plans[0, 1, [4, 5]] = 1.0  # both right
    r = plan_recall(plans, true_ep, 2)
    assert r["per_layer"]["recall_at_k"] == pytest.approx([0.5, 1.0])
    assert r["recall_at_k"] == pytest.approx(0.75)


def test_plan_truth_ties_go_to_the_lower_expert_id():
    """Pins plan_truth's tie rule (docstring: ties, lower id).

    By hand: EP [0.5, 0.25, 0.25, 0.0], k = 2: expert 0, then 1 and 2 tie at 0.25 -> 1 (lower id):
    [[0, 1]]. Catches CS4 (ascending sort reversed: the tie goes to 2, [[0, 2]])."""
    from moecast.predictors.casmoe import plan_truth

    assert plan_truth(np.array([[0.5, 0.25, 0.25, 0.0]]), k=2).tolist() == [[0, 1]]


def test_a_request_without_prompt_tokens_gets_a_uniform_ep(tmp_path):
    """Pins ep_labels' uniform row (1/E, module doc of ep_matrix) for a request whose tokens are all
    decode steps (nothing selected), rather than a zero row.

    By hand: E = 8, every token decode: every (layer, expert) entry 1/8 = 0.125, rows sum to 1.
    Catches CS5 (the fallback 0.0: a row summing to 0)."""
    path = make_synthetic_traceset(tmp_path / "dec", num_requests=2, num_layers=2, tokens=4, decode_from=0)
    ts = TraceSet(path)
    ep, _ = ep_labels(ts, [ts.request_ids[0]])
    assert ep.shape == (1, 2, 8)
    np.testing.assert_array_equal(ep[0], np.full((2, 8), 0.125, np.float32))


# ----------------------------------------------------------------------------- EAM


def test_eam_retrieves_indexed_prompt_exactly(traces, eam_ckpt):
    ts = TraceSet(traces)
    eam = load(eam_ckpt, fingerprint=ts.model.fingerprint)
    assert isinstance(eam, EAM) and eam.horizon == "prompt-ahead"
    sides = ts.splits(0.25, 0.1, 0)
    train_ids, val_ids = sides.train, sides.val
    assert eam.size == len(train_ids)
    ep, _ = ep_labels(ts, train_ids)
    plan, conf = eam.query(prompt_text(ts, train_ids[0]))
    assert conf == pytest.approx(1.0, abs=1e-4)
    np.testing.assert_allclose(plan, ep[0], atol=1e-6)  # k' = 1: its own EP comes back
    _, branch = eam.plan(prompt_text(ts, val_ids[0]))
    assert branch == "eam"
    tr = ts.get(val_ids[0])
    scores = eam.score_request(tr)
    assert scores.shape == (len(tr), 3, 8) and scores.dtype == np.float32
    np.testing.assert_allclose(scores[0], scores[-1])
    meta = load_raw(eam_ckpt)[1]
    assert (
        meta["files"]["index"] == index_path(eam_ckpt, 0).name and meta["ep_weighting"] == "router-weighted"
    )
    assert 0.0 <= meta["metrics"]["val_recall_at_k"] <= 1.0


def test_eam_buffer_folds_at_capacity_and_survives_reload(traces, eam_ckpt, tmp_path):
    import shutil

    for f in eam_ckpt.parent.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    ckpt = tmp_path / eam_ckpt.name
    eam = load(ckpt)
    eam.config.buffer_size = 3  # C = 3 here (paper: 30) to keep the test small
    save(ckpt, {"values": eam.values}, {**load_raw(ckpt)[1], "config": vars(eam.config)})
    eam = load(ckpt)
    n0 = eam.size
    new_ep = np.full((3, 8), 1 / 8, np.float32)
    new_ep[:, 7] += 1.0
    new_ep /= new_ep.sum(-1, keepdims=True)
    prompts = ["Tell me about volcanoes in Iceland", "How do rockets reach orbit", "Best way to learn chess"]
    assert not eam.observe(prompts[0], new_ep)
    assert not eam.observe(prompts[1], new_ep)
    lines = buffer_path(ckpt).read_text().splitlines()
    assert len(lines) == 2 and eam.size == n0
    # a crash now loses nothing: the reload holds both buffered pairs
    eam = load(ckpt)
    assert len(eam.buffer) == 2 and eam.size == n0
    assert eam.observe(prompts[2], new_ep)  # third pair fills C = 3: folded
    assert eam.size == n0 + 3 and not buffer_path(ckpt).exists()
    assert index_path(ckpt, 1).exists() and not index_path(ckpt, 0).exists()
    eam = load(ckpt)
    assert eam.size == n0 + 3 and eam.buffer == []
    plan, conf = eam.query(prompts[1])
    assert conf == pytest.approx(1.0, abs=1e-4)
    np.testing.assert_allclose(plan, new_ep, atol=1e-6)
    # a crash between checkpoint and buffer removal: stale entries are already folded, not re-added
    stale = [
        {"seq": s, "prompt": p, "embedding": [0.0] * 384, "ep": new_ep.tolist()}
        for s, p in enumerate(prompts)
    ]
    buffer_path(ckpt).write_text("".join(json.dumps(e) + "\n" for e in stale) + '{"seq": 3, "pro')
    eam = load(ckpt)
    assert eam.buffer == [] and eam.size == n0 + 3


def test_eam_bad_inputs(traces, eam_ckpt, tmp_path):
    import shutil

    eam = load(eam_ckpt)
    with pytest.raises(ValueError, match="empty"):
        eam.query("   ")
    with pytest.raises(ValueError, match="does not fit"):
        eam.observe("a prompt", np.ones((2, 8)))
    with pytest.raises(CheckpointError, match="fingerprint"):
        load(eam_ckpt, fingerprint="0000000000000000")
    # an index built with another embedding model
    ckpt = tmp_path / "eam.safetensors"
    for f in eam_ckpt.parent.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    tensors, meta = load_raw(ckpt)
    save(ckpt, tensors, {**meta, "embedder_id": "other-model:abc:256"})
    with pytest.raises(CheckpointError, match="embedding model"):
        load(ckpt)
    save(ckpt, tensors, meta)
    index_path(ckpt, 0).unlink()
    with pytest.raises(CheckpointError, match="index file"):
        load(ckpt)


def test_long_prompt_truncated_and_said_once():
    emb = SentenceEmbedder("minilm", max_length=16)
    long = "word " * 200
    with pytest.warns(UserWarning, match="truncated"):
        a = emb.embed([long])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = emb.embed([long + " more words at the end"])
    np.testing.assert_allclose(a, b, atol=1e-6)  # the tail past 16 tokens is cut off
    assert emb.dim == 384 and np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------- fast embedding path

FAST_PROMPTS = [
    "hi",
    "Write a python function that sorts a list of integers, then explain its time complexity.",
    "Explain the causes of the French revolution " * 30,  # past the token limit: truncated
    "Why is the sky blue during the day?",
]


@pytest.mark.parametrize("engine", ["torch", "onnx"])
@pytest.mark.parametrize("encoder", ["minilm", "tiny"])
def test_fast_embedding_equals_sentence_transformers(encoder, engine, tiny_encoder):
    """The batch-1 fast path (and its padded batch form), run by torch or by ONNX Runtime, gives
    sentence-transformers' own encode() embeddings (mean pooling + normalisation) to 1e-5,
    prompt by prompt and batched."""
    import torch

    spec = str(tiny_encoder) if encoder == "tiny" else encoder
    emb = SentenceEmbedder(spec, max_length=64, engine=engine)
    assert isinstance(emb.fast, OrtBertEncoder if engine == "onnx" else FastBertEncoder) and not emb.fast.int8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the truncation notice
        one_by_one = np.concatenate([emb.embed([p]) for p in FAST_PROMPTS])
        batched = emb.embed(FAST_PROMPTS)
    ref = emb.model.encode(FAST_PROMPTS, normalize_embeddings=True, convert_to_numpy=True)
    assert one_by_one.dtype == np.float32 and one_by_one.shape == (4, emb.dim)
    np.testing.assert_allclose(one_by_one, ref, atol=1e-5)
    np.testing.assert_allclose(batched, ref, atol=1e-5)
    # the module path it replaces gives the same, too
    feats = emb.tokenizer(FAST_PROMPTS, truncation=True, max_length=64, padding=True, return_tensors="pt")
    with torch.inference_mode():
        np.testing.assert_allclose(emb._st_forward(feats).numpy(), ref, atol=1e-5)


def test_fast_path_threads_and_fallbacks(tiny_encoder):
    import torch
    from transformers import BertConfig, BertModel

    emb = SentenceEmbedder(str(tiny_encoder))
    before = torch.get_num_threads()
    with torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        emb.embed(["a prompt"])  # runs on emb.threads = 1, then gives the setting back
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    # models it does not cover: another activation; a reference that disagrees
    relu = BertModel(
        BertConfig(
            vocab_size=100, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, hidden_act="relu"
        )
    )
    assert "relu" in fast_encoder_unsupported(relu)
    with pytest.raises(ValueError, match="relu"):
        FastBertEncoder(relu)
    model = emb.model[0].auto_model
    with pytest.warns(UserWarning, match="differs from the reference"):
        assert (
            checked_fast_encoder(model, lambda f: emb._st_forward(f) + 1, emb.tokenizer, False, "t") is None
        )


def test_int8_option_is_close_and_saved(traces, eam_ckpt, tmp_path):
    import shutil

    fp32 = SentenceEmbedder("minilm")
    for engine, cls, bound in (("torch", FastBertEncoder, 0.9), ("onnx", OrtBertEncoder, 0.98)):
        q = SentenceEmbedder("minilm", int8=True, engine=engine)
        assert isinstance(q.fast, cls) and q.fast.int8 and q.identity == fp32.identity  # an index serves both
        cos = (q.embed(FAST_PROMPTS[1:2]) * fp32.embed(FAST_PROMPTS[1:2])).sum()
        assert bound < cos < 1.0
    for f in eam_ckpt.parent.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    ckpt = tmp_path / eam_ckpt.name
    eam = load(ckpt)
    assert not eam.config.int8 and not eam.embedder.int8
    plan32, conf32 = eam.query(TOPICS[0])
    eam.set_encoder(int8=True)
    plan8, conf8 = eam.query(TOPICS[0])
    assert eam.embedder.int8 and abs(conf8 - conf32) < 0.1 and plan8.shape == plan32.shape
    eam.set_encoder(engine="torch")
    assert eam.embedder.int8 and isinstance(eam.embedder.fast, FastBertEncoder)
    with pytest.raises(ValueError, match="engine 'gpu' is not one of"):
        eam.set_encoder(engine="gpu")
    eam.save(ckpt)
    again = load(ckpt)  # the settings travel with the checkpoint
    assert again.embedder.int8 and again.config.engine == "torch"


def test_onnx_graph_is_cached_per_weights_and_rebuilt_when_damaged(tiny_encoder, tmp_path, monkeypatch):
    """The exported graph lands once in $MOECAST_HOME/onnx, named by a hash of the weights (so changed
    weights get their own file); a damaged file is exported again; without onnxruntime, torch runs."""
    import torch
    from moecast.predictors import onnx_encoder
    from transformers import AutoModel

    monkeypatch.setenv("MOECAST_HOME", str(tmp_path / "home"))
    model = AutoModel.from_pretrained(str(tiny_encoder)).eval()
    ids = torch.tensor([[2, 5, 7, 9, 3]])
    first = OrtBertEncoder(model, threads=1)
    stamp = first.path.stat().st_mtime_ns
    assert first.path.parent == tmp_path / "home" / "onnx" and not list(first.path.parent.glob("tmp*"))
    ref = first(ids)
    assert OrtBertEncoder(model).path.stat().st_mtime_ns == stamp  # read, not exported again
    first.path.write_bytes(b"not an onnx graph")
    monkeypatch.setattr(onnx_encoder, "_RUNNERS", {})  # a new process: nothing loaded yet
    with pytest.warns(UserWarning, match="unreadable"):
        again = OrtBertEncoder(model)
    np.testing.assert_allclose(again(ids).numpy(), ref.numpy(), atol=1e-6)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[5] += torch.linspace(-1, 1, model.config.hidden_size)
    changed = OrtBertEncoder(model)
    assert changed.path != first.path and not np.allclose(changed(ids).numpy(), ref.numpy(), atol=1e-3)
    assert len(list(first.path.parent.glob("*-fp32.onnx"))) == 2
    monkeypatch.setattr(onnx_encoder, "onnxruntime_available", lambda: False)
    with pytest.warns(UserWarning, match="needs onnxruntime"):
        emb = SentenceEmbedder(str(tiny_encoder), engine="onnx")
    assert isinstance(emb.fast, FastBertEncoder)
    with pytest.raises(ValueError, match="engine 'cuda' is not one of"):
        SentenceEmbedder(str(tiny_encoder), engine="cuda")


# ----------------------------------------------------------------------------- EAP and cascade


def test_eap_trains_exports_and_reloads(traces, eap_ckpt):
    ts = TraceSet(traces)
    eap = load(eap_ckpt, fingerprint=ts.model.fingerprint)
    assert eap.name == "eap" and eap.horizon == "prompt-ahead"
    meta = load_raw(eap_ckpt)[1]
    assert meta["encoder_weights"] == "embedded" and meta["hparams"]["hidden"] == 64
    assert len(meta["metrics"]["per_layer_recall"]) == 3
    p = prompt_text(ts, ts.request_ids[0])
    plan, branch = eap.plan(p)
    assert branch == "eap" and plan.shape == (3, 8)
    np.testing.assert_allclose(plan.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(load(eap_ckpt).plan(p)[0], plan, rtol=1e-5)  # reload is deterministic
    with pytest.raises(ValueError, match="empty"):
        eap.plan("")
    run_dir = eap_ckpt.with_name("eap.run")
    assert (run_dir / "checkpoints" / "last.ckpt").exists() and list(run_dir.rglob("metrics.csv"))


def test_eap_fast_path_equals_module_path(eap_ckpt):
    import torch

    eap = load(eap_ckpt)  # fine-tuned encoder: the fast path runs on its own (embedded) weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = np.stack([eap.plan(p)[0] for p in FAST_PROMPTS])
        batched = eap.plan_many(FAST_PROMPTS)
        with torch.inference_mode():
            ref = torch.softmax(eap.net(eap.tokenize(FAST_PROMPTS))[0], -1).numpy()
    assert eap._fast_encoder() is not None
    np.testing.assert_allclose(plans, ref, atol=1e-5)
    np.testing.assert_allclose(batched, ref, atol=1e-5)
    assert isinstance(eap._fast_encoder(), OrtBertEncoder)  # the default engine on the CPU
    eap.set_encoder(engine="torch")
    assert isinstance(eap._fast_encoder(), FastBertEncoder)
    np.testing.assert_allclose(np.stack([eap.plan(p)[0] for p in FAST_PROMPTS]), ref, atol=1e-5)
    eap.set_encoder(int8=True, engine="onnx")
    assert eap._fast_encoder().int8 and eap.plan(FAST_PROMPTS[1])[0].shape == plans.shape[1:]


def test_eap_frozen_encoder_trains_heads_only(traces, tiny_encoder, tmp_path):
    """The frozen encoder is the EAP's default recipe: no --config needed."""
    from moecast.train.config import TrainConfig
    from moecast.train.eap import EAPData, EAPModel, fit_eap

    out = tmp_path / "eap_frozen.safetensors"
    model = EAPModel(encoder=str(tiny_encoder), max_length=32)
    assert model.freeze_encoder and TrainConfig().max_epochs < 1000
    fit_eap(
        str(traces),
        str(out),
        model,
        EAPData(val_fraction=0.25),
        TrainConfig(max_epochs=3, progress_bar=False),
    )
    tensors, meta = load_raw(out)
    assert meta["encoder_weights"] == "reference" and not any(k.startswith("encoder.") for k in tensors)
    eap = load(out)
    assert eap.frozen and eap.plan("Why is the sky blue")[0].shape == (3, 8)


def test_eap_training_under_ddp(traces, tiny_encoder, tmp_path):
    """Two CPU ranks fine-tune the encoder and heads (gradients synchronised by DDP); each validates a
    shard, the logged plan recall is the whole held-out split's, and rank 0 alone exports."""
    import subprocess
    import sys

    out = tmp_path / "eap_ddp.safetensors"
    cmd = [sys.executable, "-m", "moecast", "train", "eap"]
    cmd += ["--config", str(Path(__file__).parents[1] / "configs" / "eap_minilm.yaml")]
    cmd += ["--traces", str(traces), "--out", str(out), "--model.encoder", str(tiny_encoder)]
    cmd += ["--model.max_length", "32", "--data.batch_size", "4", "--data.val_fraction", "0.25"]
    cmd += ["--train.max_epochs", "1", "--train.progress_bar", "false"]
    cmd += ["--train.strategy", "ddp", "--train.devices", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1
    metrics = load_raw(out)[1]["metrics"]
    # 5 val prompts split 3 / 2 over the ranks; the export re-plans all 5 on one process
    assert metrics["val_requests"] == len(TraceSet(traces).splits(0.25, 0.1, 0).val) == 5
    assert metrics["best_score"] == pytest.approx(metrics["val_recall_at_k"], abs=1e-6)


def test_cascade_gate_and_table3(traces, eam_ckpt, eap_ckpt, tmp_path):
    from moecast.train.cascade import fit_cascade
    from moecast.train.config import SplitConfig

    ts = TraceSet(traces)
    out = tmp_path / "cascade.safetensors"
    fit_cascade(str(eam_ckpt), str(eap_ckpt), str(out), epsilon=0.5)
    cascade = load(out, fingerprint=ts.model.fingerprint)
    assert isinstance(cascade, Cascade) and cascade.epsilon == 0.5
    sides = ts.splits(0.25, 0.1, 0)
    train_ids, val_ids = sides.train, sides.val
    seen = prompt_text(ts, train_ids[0])
    plan, branch = cascade.plan(seen)  # an indexed prompt: cosine 1 >= 0.5
    assert branch == "eam"
    cascade.epsilon = 1.0 + 1e-6  # nothing is confident enough: EAP answers
    plan, branch = cascade.plan(seen)
    assert branch == "eap"
    np.testing.assert_allclose(plan, cascade.eap.plan(seen)[0], rtol=1e-5)
    assert cascade.score_request(ts.get(val_ids[0])).shape == (len(ts.get(val_ids[0])), 3, 8)
    # CasMoE's buffer is the EAM's: a served prompt observed through the cascade lands there
    cascade.eam.path = None  # in memory: the shared fixture's files stay as they are
    ep = ep_label(ts.get(val_ids[0]), 8)
    assert not cascade.observe("a prompt the cascade served", ep)
    assert [e["prompt"] for e in cascade.eam.buffer] == ["a prompt the cascade served"]
    np.testing.assert_allclose(cascade.eam.buffer[0]["ep"], ep)

    rows = compare_planners(
        eam_ckpt, eap_ckpt, traces, epsilons=[0.0, 1.0], val_fraction=0.25, progress=False
    )
    by = {r["planner"]: r for r in rows}
    assert {"EAP", "EAM", "cascade eps=0", "cascade eps=1"} <= set(by)
    assert by["cascade eps=0"]["recall_at_k"] == pytest.approx(by["EAM"]["recall_at_k"])
    assert by["cascade eps=1"]["recall_at_k"] == pytest.approx(by["EAP"]["recall_at_k"])
    assert by["cascade eps=0"]["eam_share"] == 1.0
    assert all(0 <= r["recall_at_k"] <= 1 and r["mean_latency_ms"] >= 0 for r in rows)
    assert all(r["latency_vs_eap_se_ms"] >= 0 for n, r in by.items() if n.startswith("cascade"))

    # `moecast train cascade --traces`: the comparison with chosen encoder settings, kept and logged
    out2 = tmp_path / "cascade2.safetensors"
    fit_cascade(
        str(eam_ckpt), str(eap_ckpt), str(out2), 0.5, str(traces), [0.0, 1.0], SplitConfig(val_fraction=0.25),
        engine="torch", int8=True,
    )  # fmt: skip
    saved = json.loads((tmp_path / "cascade2.run" / "table3.json").read_text())
    assert {r["planner"] for r in saved["rows"]} >= {"EAP", "EAM", "cascade eps=0.5"}
    assert list((tmp_path / "cascade2.run" / "wandb").glob("offline-run-*"))


def test_cascade_win_needs_recall_and_a_latency_gain_beyond_noise():
    eap = {"planner": "EAP", "recall_at_k": 0.50, "mean_latency_ms": 10.0}

    def casc(name, recall, d, se):
        return {"planner": name, "recall_at_k": recall, "latency_vs_eap_ms": d, "latency_vs_eap_se_ms": se}

    rows = [
        eap,
        casc("cascade eps=0.5", 0.51, -2.0, 0.5),  # a win
        casc("cascade eps=0.6", 0.51, -0.3, 0.25),  # faster on average, within two standard errors
        casc("cascade eps=0.7", 0.49, -5.0, 0.1),  # faster, less recall
    ]
    assert [r["planner"] for r in cascade_wins(rows)] == ["cascade eps=0.5"]


def test_cascade_refuses_planners_of_different_models(traces, eam_ckpt, eap_ckpt, tmp_path):
    import shutil

    other = tmp_path / "eap_other.safetensors"
    shutil.copy(eap_ckpt, other)
    tensors, meta = load_raw(other)
    save(other, tensors, {**meta, "fingerprint": "ffffffffffffffff"})
    with pytest.raises(CheckpointError, match="same MoE model"):
        Cascade(load(eam_ckpt), load(other), 0.5)


def test_train_eam_cli_with_yaml_config(traces, tmp_path, capsys):
    from moecast.cli import main

    out = tmp_path / "eam_cli.safetensors"
    main(
        [
            "train",
            "eam",
            "--config",
            str(Path(__file__).parents[1] / "configs" / "eam_minilm.yaml"),
            "--traces",
            str(traces),
            "--out",
            str(out),
            "--data.val_fraction",
            "0.25",
            "--eam.k-neighbours",
            "2",
            "--wandb",
            "false",
        ]
    )
    assert "plan recall@2" in capsys.readouterr().out
    assert load(out).config.k_neighbours == 2
    # --json: one object with what was indexed and the val metrics the text printed
    main(["train", "eam", "--traces", str(traces), "--out", str(out), "--data.val_fraction", "0.25",
          "--wandb", "false", "--json"])  # fmt: skip
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    eam = load(out)
    assert said["checkpoint"] == str(out) and said["prompts"] == eam.size > 0
    assert (out.parent / said["index"]).is_file() and 0 <= said["metrics"]["val_recall_at_k"] <= 1


def test_train_cascade_json_is_json_on_every_line(traces, eam_ckpt, eap_ckpt, tmp_path, capsys):
    """With --json and --traces the checkpoint's line was text before the comparison's JSON rows."""
    from moecast.train.cascade import fit_cascade
    from moecast.train.config import SplitConfig

    out = tmp_path / "c.safetensors"
    fit_cascade(str(eam_ckpt), str(eap_ckpt), str(out), 0.5, str(traces), [0.0, 1.0], SplitConfig(val_fraction=0.25),
                wandb=False, json=True)  # fmt: skip
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0] == {
        "checkpoint": str(out),
        "epsilon": 0.5,
        "shared_embedding": lines[0]["shared_embedding"],
    }
    assert {r["planner"] for r in lines[1:]} >= {"EAP", "EAM", "cascade eps=0.5"}


# ----------------------------------------------------------------------------- real DeepSeek traces


def test_real_puffin_prompts_and_eam(puffin_dir, tmp_path):
    from moecast.collect.moe_beyond import import_moe_beyond
    from moecast.train.casmoe import PlanData
    from moecast.train.eam import fit_eam

    ts = import_moe_beyond(puffin_dir, out=tmp_path / "ds", max_files=10)
    prompts = [prompt_text(ts, r) for r in ts.request_ids]
    assert all(p.strip() for p in prompts) and "Ġ" not in "".join(prompts)
    ep, weighted = ep_labels(ts)
    assert not weighted and ep.shape == (10, 26, 64)
    out = tmp_path / "eam.safetensors"
    fit_eam(str(tmp_path / "ds"), str(out), data=PlanData(val_fraction=0.2), wandb=False)
    meta = load_raw(out)[1]
    assert meta["ep_weighting"].startswith("count") and meta["fingerprint"] == ts.model.fingerprint
    eam = load(out, fingerprint=ts.model.fingerprint)
    plan, conf = eam.query(prompts[0])
    assert plan.shape == (26, 64) and -1.0 <= conf <= 1.0 + 1e-5


def test_eap_fine_tuning_runs_the_encoder_with_dropout(tiny_encoder):
    """SimCSE (Eq. 6) takes the positive from another dropout mask: while training, the encoder
    (loaded in eval mode by Hugging Face, and kept so by Lightning) must run in train mode, so the
    two views differ; in validation it runs in eval mode."""
    import torch
    from moecast.predictors.eap import EAPNet, load_encoder
    from moecast.train.eap import EAPModule

    enc, tok, _ = load_encoder(str(tiny_encoder))
    assert not enc.training  # as from_pretrained leaves it
    m = EAPModule(encoder=str(tiny_encoder), freeze_encoder=False)
    m.net, m.tokenizer, m.max_len = EAPNet(enc, 3, 8), tok, 16
    m.train()
    enc.eval()  # Lightning restores the submodules' own modes around validation
    torch.manual_seed(0)
    prompts = ["one two three", "four five", "six seven eight nine"]
    _, cont = m._logits(prompts)
    assert m.net.encoder.training and cont is not None
    feats = m._tokenize(prompts)
    assert not torch.allclose(m.net.embed(feats), m.net.embed(feats))  # two dropout views
    m.eval()
    _, cont = m._logits(prompts)
    assert not m.net.encoder.training and cont is None


class _AxisEmbedder:
    """A stub embedder: prompt "e<i>" -> the unit vector along axis i of R^3 (no model)."""

    dim = 3

    def embed(self, prompts):
        out = np.zeros((len(prompts), 3), np.float32)
        for r, p in enumerate(prompts):
            out[r, int(p[1:])] = 1.0
        return out


def _axis_eam(keys, k_neighbours):
    """An EAM over unit keys along the given axes, key i's EP (L = 1, E = 4) one-hot on expert i."""
    from moecast.predictors.eam import EAMConfig

    values = np.zeros((len(keys), 1, 4), np.float32)
    for i in range(len(keys)):
        values[i, 0, i] = 1.0
    emb = _AxisEmbedder()
    return EAM(
        emb,
        values,
        emb.embed([f"e{a}" for a in keys]),
        fingerprint="hand",
        moe_layers=[0],
        top_k=1,
        config=EAMConfig(k_neighbours=k_neighbours),
    )


def test_eam_plan_is_the_mean_ep_of_the_k_neighbours_and_confidence_the_best_cosine():
    """Pins CasMoE Eq. 5 (plan = mean EP of the k' nearest keys) and Eq. 4 (confidence = cosine of
    the nearest).

    By hand: keys e0, e1, e2 (orthogonal unit vectors) with EPs one-hot on experts 0, 1, 2; k' = 3;
    query e0: all three are neighbours, plan = ([1,0,0,0] + [0,1,0,0] + [0,0,1,0]) / 3 =
    [1/3, 1/3, 1/3, 0] (row sum 1); confidence = cos(e0, e0) = 1.0 (the others have cosine 0).
    Catches EA1 (the nearest key's EP only: [1, 0, 0, 0]), EA6 (a sum: [1, 1, 1, 0]) and EA2 (the
    farthest neighbour's cosine: 0.0)."""
    eam = _axis_eam([0, 1, 2], k_neighbours=3)
    plans, conf = eam.query_embedding(np.array([[1.0, 0.0, 0.0]], np.float32))
    np.testing.assert_allclose(plans[0, 0], [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
    assert plans[0, 0].sum() == pytest.approx(1.0)
    assert conf[0] == pytest.approx(1.0, abs=1e-6)


def test_cascade_gate_is_inclusive_at_epsilon():
    """Pins the gate 'EAM if confidence >= epsilon' at equality.

    By hand: EAM keys e0, e1; the prompt embeds to e2, orthogonal to both: cosine 0, confidence exactly
    0.0 (hnswlib's cosine distance 1 - 0 = 1); epsilon 0.0: 0.0 >= 0.0 -> 'eam'. Catches CC1 (`>`:
    falls back to 'eap')."""

    class _StubEAP:
        fingerprint, num_layers, num_experts = "hand", 1, 4

        def shares_embedder(self, _emb):
            return False

        def plan(self, _prompt):
            return np.full((1, 1, 4), 0.25, np.float32), None

    cascade = Cascade(_axis_eam([0, 1], k_neighbours=1), _StubEAP(), 0.0)
    _plan, branch = cascade.plan("e2")
    assert cascade.last_confidence == 0.0
    assert branch == "eam"
