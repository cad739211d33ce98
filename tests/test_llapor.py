"""LLaPor (PreScope §4.2): causality, groups, loss, training beats the hot table, online updates, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_synthetic_traceset, quiet_trainer
from moecast.collect.traceset import MissingFieldError, TraceSet
from moecast.predictors import load
from moecast.predictors.baselines import FrequencyPredictor
from moecast.predictors.commands import evaluate, evaluate_predictor
from moecast.predictors.llapor import LLaPor
from moecast.predictors.llapor_features import FeatureSpec
from moecast.predictors.llapor_groups import detect_groups, routing_correlation
from moecast.predictors.llapor_net import LLaPorNet, NetConfig, balanced_focal_loss, group_lambda
from moecast.train.data import LLaPorDataModule
from moecast.train.llapor import LLaPorModule

# tiny tensors: threads only add spin-wait overhead on a shared CPU
torch.set_num_threads(1)


def assert_kernel_matches(pred: LLaPor, feats: dict, expected: np.ndarray, layers: range) -> None:
    """score_layer (the runtime's compiled per-layer path) against the torch network's scores
    ``expected`` [B, L, E]: float32 weights to rounding; int8 weights within their error."""
    pred.int8_kernel = False
    for layer in layers:
        assert np.allclose(pred.score_layer(layer, feats), expected[:, layer], atol=1e-5)
    pred.int8_kernel = True
    for layer in layers:
        got = pred.score_layer(layer, feats)
        assert np.abs(got - expected[:, layer]).max() < 0.02
        assert not np.allclose(got, expected[:, layer], atol=1e-7)  # really the int8 weights


def _fit(path, epochs=8, loss="focal", model=None, **data):
    torch.manual_seed(0)
    dm = LLaPorDataModule(str(path), val_fraction=0.25, batch_size=64, **data)
    module = LLaPorModule(
        hidden=32,
        warmup_epochs=1,
        lr_io=5e-3,
        lr_middle=5e-3,
        lr_shared=5e-3,
        mask_prob=0.0,
        loss=loss,
        **(model or {}),
    )
    quiet_trainer(epochs, gradient_clip_val=1.0).fit(module, datamodule=dm)
    return module, dm


def test_scores_are_causal_for_the_layer_ahead_horizon():
    torch.manual_seed(0)
    spec = FeatureSpec(
        num_layers=4,
        num_experts=8,
        top_k=2,
        prev_layers=2,
        history_tokens=2,
        history_layers=2,
        token_buckets=50,
        context_tokens=2,
        deep_history=True,
    )
    net = LLaPorNet(spec, {"input": [0], "middle": [1, 2], "output": [3]}, NetConfig(hidden=16, dropout=0.0))
    pred = LLaPor(net, [1, 2, 3, 4])
    rng = np.random.default_rng(0)
    from moecast.collect.traceset import RequestTrace

    ids = np.stack([rng.permutation(8)[:2] for _ in range(6 * 4)]).reshape(6, 4, 2)
    trace = RequestTrace(
        "r", "w", "c", "p", rng.integers(0, 50, 6), ["x"] * 6, np.zeros(6, bool), ids, None, None, None
    )
    base = pred.score_request(trace)
    t, li = 3, 2
    changed = ids.copy()
    changed[t, li:] = (
        changed[t, li:] + 3
    ) % 8  # this token's layer l and later: unknown when predicting (t, li)
    changed[t + 1 :] = (changed[t + 1 :] + 5) % 8  # later tokens
    trace.topk_ids = changed
    trace.token_ids = trace.token_ids.copy()
    trace.token_ids[t + 1 :] = (trace.token_ids[t + 1 :] + 7) % 50  # later tokens' text
    after = pred.score_request(trace)
    assert np.allclose(after[t, : li + 1], base[t, : li + 1])
    assert np.allclose(after[:t], base[:t])
    assert not np.allclose(after[t, li + 1], base[t, li + 1])  # it does use the previous layer
    # the runtime's per-layer numpy path gives the same scores as the batched network
    feats = pred.features(trace)
    assert_kernel_matches(pred, feats, after, range(4))


def test_group_detection_covers_layers_in_order():
    rng = np.random.default_rng(0)
    topk = np.stack([rng.permutation(16)[:2] for _ in range(300 * 6)]).reshape(300, 6, 2)
    corr = routing_correlation(topk, 16)
    groups, _ = detect_groups(None, corr, 6)
    flat = groups["input"] + groups["middle"] + groups["output"]
    assert flat == list(range(6))
    assert groups["input"][0] == 0 and groups["input"] and groups["middle"] and groups["output"]
    cos = np.array([0, 0.2, 0.9, 0.95, 0.9, 0.3])
    groups, _ = detect_groups(cos, np.full(6, 0.5), 6)
    assert groups == {"input": [0, 1], "middle": [2, 3, 4], "output": [5]}
    # from gate inputs: layers 1-4 share a direction (slowly changing residual stream), 0 and 5 do not
    from moecast.predictors.llapor_groups import gate_cosine

    base = rng.standard_normal((400, 1, 32))
    gin = np.concatenate(
        [rng.standard_normal((400, 1, 32)), base + 0.1 * rng.standard_normal((400, 4, 32)), rng.standard_normal((400, 1, 32))],
        axis=1,
    )  # fmt: skip
    cos = gate_cosine(gin)
    assert cos[0] == 0 and np.allclose(cos[2:5], 0.99, atol=0.01) and abs(cos[1]) < 0.1 and abs(cos[5]) < 0.1
    groups, _ = detect_groups(cos, np.full(6, 0.5), 6)
    assert groups == {"input": [0, 1], "middle": [2, 3, 4], "output": [5]}


def test_balanced_focal_loss_matches_the_paper_formula():
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 8)
    target = (torch.rand(5, 3, 8) > 0.7).float()
    inv = torch.rand(3, 8) + 0.5
    lam = torch.tensor([0.5, 0.0, 0.5])
    got = balanced_focal_loss(logits, target, inv, lam, gamma=2.0)
    p = torch.sigmoid(logits)
    bce = -(target * torch.log(p) + (1 - target) * torch.log(1 - p))
    pt = torch.where(target > 0, p, 1 - p)
    want = ((bce * inv).mean(-1) + lam * ((1 - pt) ** 2 * bce).mean(-1)).mean()
    assert torch.allclose(got, want, atol=1e-6)


def test_sparse_and_dense_masking_are_separate_knobs():
    """mask_prob masks sparse ids only; dense features (gate-input PCA) are masked by mask_dense, off by
    default: zeroing single leading components cost tiny LLaPor 0.011 val recall."""
    from moecast.train.llapor import LLaPorModule

    torch.manual_seed(0)
    spec = FeatureSpec(num_layers=3, num_experts=8, top_k=2)
    net = LLaPorNet(spec, {"input": [0], "middle": [1], "output": [2]}, NetConfig(hidden=8, dropout=0.0))
    batch = {"bags": torch.zeros(64, 3, 4, dtype=torch.long), "dense": torch.ones(64, 3, 16)}
    sparse_only = LLaPorModule(noise_std=0.0, mask_prob=0.5)
    sparse_only.net = net  # what setup() builds from the data
    out = sparse_only._augment(batch)
    assert 0.4 < (out["bags"] == spec.vocab).float().mean() < 0.6  # ids masked to the padding id
    assert torch.equal(out["dense"], batch["dense"])  # dense untouched by default
    masked = LLaPorModule(noise_std=0.0, mask_prob=0.0, mask_dense=0.5)._augment(batch)
    assert torch.equal(masked["bags"], batch["bags"])
    assert 0.4 < (masked["dense"] == 0).float().mean() < 0.6
    # at 0.2 (not 0.5, where keeping and masking are alike) a fifth of the entries is masked
    light = LLaPorModule(noise_std=0.0, mask_prob=0.2, mask_dense=0.2)
    light.net = net
    out = light._augment(batch)
    assert 0.14 < (out["bags"] == spec.vocab).float().mean() < 0.26
    assert 0.14 < (out["dense"] == 0).float().mean() < 0.26
    with pytest.raises(ValueError, match="mask_dense"):
        LLaPorModule(mask_dense=1.0)


def test_training_beats_the_hot_table_and_roundtrips(tmp_path):
    path = make_synthetic_traceset(
        tmp_path / "tr", num_requests=24, num_layers=4, num_experts=8, hidden=16, tokens=16
    )
    module, dm = _fit(path, epochs=12, test_fraction=0.0)  # 24 requests: all but val train
    assert dm.spec.gate_pca and dm.spec.weights  # chosen from the fields present
    out = module.export(tmp_path / "llapor.safetensors", dm, {"best_score": None})
    ts = TraceSet(path)
    pred = load(out, fingerprint=ts.meta.model.fingerprint)
    assert isinstance(pred, LLaPor) and pred.metadata()["features"]["gate_pca"]
    res = evaluate_predictor(pred, ts, dm.val_ids, progress=False)
    hot = evaluate_predictor(FrequencyPredictor.fit(ts, dm.train_ids), ts, dm.val_ids, progress=False)
    assert res["recall_at_k"] > hot["recall_at_k"] + 0.15
    assert set(res["per_group"]) == {g for g, v in pred.groups.items() if v}
    trace = ts.get(dm.val_ids[0])
    module.net.eval()
    full = pred.score_request(trace)
    assert np.allclose(full, torch.sigmoid(module.net(**pred.features(trace))).detach().numpy())
    one = {k: v[3:4] for k, v in pred.features(trace).items()}  # batch 1, dense features included
    assert_kernel_matches(pred, one, full[3:4], range(4))
    # what training saw is what the runtime builds: the data module reads gate inputs from the
    # TraceSet per batch (no per-token dense table) and gives the same rows, in a shuffled batch too
    from moecast.collect.traceset import FieldRows

    assert isinstance(dm.gate, FieldRows) and not hasattr(dm, "dense")
    rows = dm.val_rows[: len(trace.token_ids)]
    served = pred.features(trace)
    for order in (np.arange(len(rows)), np.random.default_rng(0).permutation(len(rows))):
        batch = dm.batch(rows[order])
        # plus the training targets: the top-k set and the router's probabilities (data.soft_targets auto)
        assert set(batch) == set(served) | {"target", "probs"} and batch["dense"].dtype == torch.float32
        for key, value in served.items():
            assert torch.allclose(batch[key].to(value.dtype), value[order], atol=1e-5), key


def test_softmax_loss_ranks_experts_and_trains(tmp_path):
    from moecast.predictors.llapor_net import topk_softmax_loss

    target = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    good = topk_softmax_loss(torch.tensor([[5.0, 5.0, -5.0, -5.0]]), target)
    bad = topk_softmax_loss(torch.tensor([[-5.0, -5.0, 5.0, 5.0]]), target)
    assert good < 0.71 < bad  # ln 2 is the floor with two true experts
    # by hand: softmax [1, 2, 1, 1] / 5 against 1/2 on experts 1 and 2, summed over the experts
    two_to_one = torch.tensor([[0.0, float(np.log(2.0)), 0.0, 0.0]])
    want = -(np.log(2 / 5) + np.log(1 / 5)) / 2
    assert float(topk_softmax_loss(two_to_one, torch.tensor([[0.0, 1.0, 1.0, 0.0]]))) == pytest.approx(want)
    with pytest.raises(ValueError, match=r"model\.loss"):
        LLaPorModule(loss="nope")
    path = make_synthetic_traceset(
        tmp_path / "tr", num_requests=24, num_layers=4, num_experts=8, hidden=16, tokens=16
    )
    module, dm = _fit(path, loss="softmax", dense_skip=True)
    assert dm.spec.dense_skip and module.distill_weights is None  # the top-k loss: distillation off
    pred = load(module.export(tmp_path / "s.safetensors", dm, {}))
    ts = TraceSet(path)
    res = evaluate_predictor(pred, ts, dm.val_ids, progress=False)
    hot = evaluate_predictor(FrequencyPredictor.fit(ts, dm.train_ids), ts, dm.val_ids, progress=False)
    assert res["recall_at_k"] > hot["recall_at_k"] + 0.15
    trace = ts.get(dm.val_ids[0])
    one = {k: v[3:4] for k, v in pred.features(trace).items()}
    full = pred.score_request(trace)
    assert_kernel_matches(pred, one, full[3:4], range(4))  # the dense skip included


def test_distill_loss_targets_the_routers_softened_ranking():
    from moecast.predictors.llapor_net import distill_softmax_loss, topk_softmax_loss

    target = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = torch.tensor([[1.0, 0.0, 3.0, -1.0]])
    assert torch.isclose(
        distill_softmax_loss(logits, target, probs, 0.0, 2.0), topk_softmax_loss(logits, target)
    )
    for weight, temp in ((1.0, 1.0), (1.0, 2.0), (0.5, 2.0)):
        soft = torch.softmax(probs.log() / temp, -1)
        q = (1 - weight) * target / 2 + weight * soft
        best = q.log().requires_grad_()  # the softmax cross-entropy's minimiser is log q
        distill_softmax_loss(best, target, probs, weight, temp).backward()
        assert best.grad.abs().max() < 1e-6
    # one weight per layer ([L, 1]): layer 0 on the top-k set alone, layer 1 on the router alone
    two = torch.stack([logits, logits.flip(-1)], 1)  # [B, L=2, E]
    per_layer = distill_softmax_loss(
        two,
        target[:, None].expand(-1, 2, -1),
        probs[:, None].expand(-1, 2, -1),
        torch.tensor([[0.0], [1.0]]),
        2.0,
    )
    parts = (
        distill_softmax_loss(logits, target, probs, 0.0, 2.0),
        distill_softmax_loss(logits.flip(-1), target, probs, 1.0, 2.0),
    )
    assert torch.isclose(per_layer, (parts[0] + parts[1]) / 2)


def test_distillation_trains_on_router_probs_and_refuses_what_it_cannot_use(tmp_path):
    path = make_synthetic_traceset(
        tmp_path / "tr", num_requests=24, num_layers=4, num_experts=8, hidden=16, tokens=16
    )
    module, dm = _fit(
        path, loss="softmax", model={"distill": 1.0, "distill_temperature": 2.0, "distill_first": 0.5}
    )
    assert module.distill_weights.flatten().tolist() == [0.5, 1.0, 1.0, 1.0]  # the first MoE layer apart
    batch = dm.batch(dm.train_rows[:5])
    assert batch["probs"].shape == (5, 4, 8) and torch.allclose(
        batch["probs"].sum(-1), torch.ones(5, 4), atol=1e-2
    )
    pred = load(module.export(tmp_path / "d.safetensors", dm, {}))
    assert pred.metadata()["hyper_parameters"]["distill"] == 1.0
    ts = TraceSet(path)
    res = evaluate_predictor(pred, ts, dm.val_ids, progress=False)
    hot = evaluate_predictor(FrequencyPredictor.fit(ts, dm.train_ids), ts, dm.val_ids, progress=False)
    assert res["recall_at_k"] > hot["recall_at_k"] + 0.15
    with pytest.raises(ValueError, match=r"model\.loss: softmax"):
        LLaPorModule(loss="focal", distill=0.5)
    with pytest.raises(ValueError, match=r"model\.distill"):
        LLaPorModule(loss="softmax", distill=1.5)
    ids_only = make_synthetic_traceset(tmp_path / "ids", num_requests=8, num_layers=3, with_optional=False)
    with pytest.raises(ValueError, match="no router_probs"):
        _fit(ids_only, epochs=1, loss="softmax", model={"distill": 1.0})
    with pytest.raises(MissingFieldError, match="router_probs"):
        LLaPorDataModule(str(ids_only), soft_targets=True).setup()
    no_probs = LLaPorDataModule(str(path), soft_targets=False)
    no_probs.setup()
    assert "probs" not in no_probs.batch(no_probs.train_rows[:2])


def test_id_only_traces_use_id_features(tmp_path):
    path = make_synthetic_traceset(tmp_path / "ids", num_requests=12, num_layers=3, with_optional=False)
    module, dm = _fit(
        path, epochs=2, prev_layers=2, history_tokens=2, token_buckets=64, context_tokens=1,
        deep_history=True, repeat_token=True,
    )  # fmt: skip
    assert not dm.spec.gate_pca and not dm.spec.weights and dm.spec.fields() == ["topk_ids", "token_id"]
    pred = load(module.export(tmp_path / "ids.safetensors", dm, {}))
    trace = TraceSet(path).get(dm.val_ids[0])
    full = pred.score_request(trace)
    assert full.shape == (12, 3, 8)
    # the runtime's per-layer call (one compiled call, llapor_kernel.score_row) on each prefix
    pred.int8_kernel = False
    for t in range(len(trace)):
        for layer in range(3):
            assert np.allclose(pred.score_at(trace.prefix(t + 1), layer), full[t, layer], atol=1e-5)


def test_online_update_reduces_loss_on_a_shifted_workload(tmp_path):
    a = make_synthetic_traceset(tmp_path / "a", num_requests=16, num_layers=3, seed=0, tokens=16)
    b = make_synthetic_traceset(
        tmp_path / "b", num_requests=4, num_layers=3, seed=5, tokens=16
    )  # other routers
    module, dm = _fit(a, epochs=2)
    pred = load(module.export(tmp_path / "p.safetensors", dm, {}))
    shifted = TraceSet(b)
    traces = [shifted.get(r) for r in shifted.request_ids]
    feats = [pred.features(t) for t in traces]
    batch = {k: torch.cat([f[k] for f in feats]) for k in feats[0]}
    truth = np.concatenate([t.topk_ids for t in traces])
    before = pred.update(batch, truth, lr=0.0)  # lr 0: measures without changing
    for _ in range(30):
        pred.update(batch, truth, lr=3e-3)
    after = pred.update(batch, truth, lr=0.0)
    assert after < before * 0.8


def test_online_update_uses_the_loss_the_checkpoint_was_trained_with(tmp_path):
    from moecast.predictors.llapor_net import topk_softmax_loss
    from moecast.predictors.metrics import multi_hot

    path = make_synthetic_traceset(tmp_path / "s", num_requests=8, num_layers=3, tokens=12)
    module, dm = _fit(path, epochs=1, loss="softmax")
    pred = load(module.export(tmp_path / "s.safetensors", dm, {}))
    assert pred.meta["hyper_parameters"]["loss"] == "softmax"
    trace = TraceSet(path).get(dm.val_ids[0])
    feats = pred.features(trace)
    for m in pred.net.modules():  # update runs in train mode: no dropout noise in the comparison
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    with torch.no_grad():
        want = float(
            topk_softmax_loss(pred.net(**feats), torch.from_numpy(multi_hot(trace.topk_ids, 8, np.float32)))
        )
    assert pred.update(feats, trace.topk_ids, lr=0.0) == pytest.approx(want, rel=1e-5)
    # a checkpoint that records no loss gets the paper's focal loss (lambda 0.5 / 0 by group, gamma 2)
    pred.meta.pop("hyper_parameters")
    with torch.no_grad():
        focal = float(
            balanced_focal_loss(
                pred.net(**feats),
                torch.from_numpy(multi_hot(trace.topk_ids, 8, np.float32)),
                torch.ones(3, 8),
                group_lambda(3, pred.groups, 0.5, 0.0),
                2.0,
            )
        )
    assert pred.update(feats, trace.topk_ids, lr=0.0) == pytest.approx(focal, rel=1e-5)


def test_eval_with_online_updates_keeps_the_checkpoint(tmp_path):
    path = make_synthetic_traceset(tmp_path / "o", num_requests=8, num_layers=3, tokens=12)
    module, dm = _fit(path, epochs=1)
    ckpt = module.export(tmp_path / "o.safetensors", dm, {})
    before = ckpt.read_bytes()
    plain = evaluate(str(ckpt), str(path), split="all", json=True)
    online = evaluate(str(ckpt), str(path), split="all", json=True, online_lr=1e-2)
    assert plain["online_lr"] == 0.0 and online["online_lr"] == 1e-2
    # the first request is scored before any update; later ones by an updated model
    assert online["recall_at_k"] != plain["recall_at_k"]
    assert ckpt.read_bytes() == before
    with pytest.raises(ValueError, match="online_lr"):
        evaluate(str(ckpt), str(path), online_lr=-1.0)
    with pytest.raises(ValueError, match="no online update"):
        evaluate("frequency", str(path), online_lr=1e-3)


def test_bad_inputs_fail_with_one_clear_error(tmp_path):
    path = make_synthetic_traceset(tmp_path / "g", num_requests=8, num_layers=3, hidden=16)
    module, dm = _fit(path, epochs=1)
    pred = load(module.export(tmp_path / "g.safetensors", dm, {}))
    ts = TraceSet(path)
    trace = ts.get(ts.request_ids[0])
    trace.gate_inputs = trace.gate_inputs.astype(np.float32)
    trace.gate_inputs[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pred.score_request(trace)
    ids_only = make_synthetic_traceset(tmp_path / "ids", num_requests=4, num_layers=3, with_optional=False)
    with pytest.raises(MissingFieldError, match="gate_inputs"):
        evaluate_predictor(pred, TraceSet(ids_only), TraceSet(ids_only).request_ids, progress=False)
    with pytest.raises(MissingFieldError, match="gate_inputs"):
        LLaPorDataModule(str(ids_only), gate_pca=True).setup()
    with pytest.raises(ValueError, match="empty"):
        LLaPorDataModule(str(ids_only), val_fraction=0.5, max_requests=1).setup()


@pytest.mark.parametrize("field", ["gate_inputs", "router_probs"])
def test_nan_or_inf_in_wide_training_fields_is_refused(field, tmp_path, monkeypatch):
    path = make_synthetic_traceset(tmp_path / "n", num_requests=6, num_layers=3, hidden=16)
    real = TraceSet._part_array  # what both TraceSet.array and TraceSet.rows read

    def poisoned(self, p, name):
        out = real(self, p, name)
        if name == field:
            out = out.astype(np.float32)
            out[2, 1, 3] = np.inf
        return out

    monkeypatch.setattr(TraceSet, "_part_array", poisoned)
    with pytest.raises(ValueError, match=f"{field} contain NaN or inf"):  # the message names the field
        LLaPorDataModule(str(path)).setup()


def test_token_context_and_history_layers_are_causal_features():
    from moecast.predictors.llapor_features import sparse_bags, token_context

    spec = FeatureSpec(
        num_layers=3,
        num_experts=4,
        top_k=1,
        history_tokens=2,
        history_layers=2,
        token_buckets=10,
        context_tokens=2,
    )
    topk = np.arange(4 * 3).reshape(4, 3, 1) % 4
    pos = np.array([0, 1, 2, 3])
    rows = np.arange(4)
    tok = token_context(spec, np.array([11, 12, 13, 14]), rows, pos)
    assert tok.tolist() == [[1, 10, 10], [2, 1, 10], [3, 2, 1], [4, 3, 2]]  # 10 = pad bucket
    bags = sparse_bags(spec, topk, rows, pos)
    assert bags.shape == (4, 3, 1 + 2 * 2) and spec.vocab == (1 + 4) * 4
    # token 2, layer 2: prev layer id, then (t-1, layer 2), (t-1, layer 1), (t-2, layer 2), (t-2, layer 1)
    assert bags[2, 2].tolist() == [
        topk[2, 1, 0],
        4 + topk[1, 2, 0],
        8 + topk[1, 1, 0],
        12 + topk[0, 2, 0],
        16 + topk[0, 1, 0],
    ]
    assert (bags[0, :, 1:] == spec.vocab).all()  # the first token has no history


def test_real_deepseek_slice_id_only(puffin_dir, tmp_path):
    from moecast.collect.moe_beyond import import_moe_beyond

    out = tmp_path / "ds"
    import_moe_beyond(puffin_dir, out=out, max_files=8, workers=1)
    ts = TraceSet(out)
    assert not ts.has("gate_inputs")
    module, dm = _fit(out, epochs=2, prev_layers=1, deep_history=True, history_tokens=2, token_buckets=512)
    assert dm.spec.fields() == ["topk_ids", "token_id"] and dm.spec.deep_history
    pred = load(module.export(tmp_path / "ds.safetensors", dm, {}), fingerprint=ts.meta.model.fingerprint)
    res = evaluate_predictor(pred, ts, dm.val_ids, progress=False)
    assert res["k"] == 6 and 0.0 < res["recall_at_k"] <= 1.0
    assert len(res["per_layer"]["recall_at_k"]) == 26


def test_groups_from_config_are_used_and_checked(tmp_path):
    path = make_synthetic_traceset(tmp_path / "g", num_requests=6, num_layers=4)
    dm = LLaPorDataModule(str(path), groups={"input": [0], "middle": [1, 2], "output": [3]})
    dm.setup()
    assert dm.groups == {"input": [0], "middle": [1, 2], "output": [3]}
    # the middle group's PCA is milder (pca_middle) than the input/output groups' (pca_io), capped by H
    small = LLaPorDataModule(str(path), groups=dm.groups, pca_io=4, pca_middle=8)
    small.setup()
    assert small.spec.pca_dims[:3] == [8, 8, 4]  # layer l's components feed layer l+1's predictor
    # the last layer's gate input feeds no later layer (and without context_gate not its own): no PCA
    assert small.spec.pca_dims[3] == 0 and not small.pca_components[3].any()
    with pytest.raises(ValueError, match="cover layer positions"):
        LLaPorDataModule(str(path), groups={"input": [0], "middle": [1], "output": [3]}).setup()


def test_repeat_token_and_exact_vocab_are_causal():
    from moecast.collect.traceset import RequestTrace
    from moecast.predictors.llapor_features import previous_occurrence, token_buckets_of

    # previous occurrence: same token earlier in the same request only (pos restarts at 0)
    pos = np.array([0, 1, 2, 3, 0, 1])
    assert previous_occurrence(np.array([5, 6, 5, 5, 5, 6]), pos).tolist() == [-1, -1, 0, 2, -1, -1]
    vocab = np.array([3, 7, 11])
    spec = FeatureSpec(num_layers=2, num_experts=4, top_k=1, token_buckets=4, token_exact=True)
    assert token_buckets_of(spec, np.array([7, 3, 11, 5, 100]), vocab).tolist() == [1, 0, 2, 3, 3]

    torch.manual_seed(0)
    spec = FeatureSpec(
        num_layers=4,
        num_experts=8,
        top_k=2,
        prev_layers=1,
        history_tokens=1,
        token_buckets=4,  # 3 known ids + 1 unseen row
        token_exact=True,
        repeat_token=True,
        deep_history=True,
        context_vote=2,
    )
    net = LLaPorNet(spec, {"input": [0], "middle": [1, 2], "output": [3]}, NetConfig(hidden=16, dropout=0.0))
    net.tok_vocab.copy_(torch.tensor([10, 20, 30]))
    pred = LLaPor(net, [1, 2, 3, 4])
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(7 * 4)]).reshape(7, 4, 2)
    toks = np.array([10, 20, 10, 99, 20, 10, 30])
    trace = RequestTrace("r", "w", "c", "p", toks, ["x"] * 7, np.zeros(7, bool), ids, None, None, None)
    assert pred.needs == ("topk_ids",) and "token_id" in spec.fields()
    base = pred.score_request(trace)
    t, li = 5, 2  # token 10 again: its earlier occurrences are rows 0 and 2
    changed = ids.copy()
    changed[t, li:] = (changed[t, li:] + 3) % 8  # this token's layer l and later
    changed[t + 1 :] = (changed[t + 1 :] + 5) % 8  # later tokens
    trace.topk_ids = changed
    trace.token_ids = toks.copy()
    trace.token_ids[t + 1 :] = 20  # later tokens' text
    after = pred.score_request(trace)
    assert np.allclose(after[t, : li + 1], base[t, : li + 1])
    assert np.allclose(after[:t], base[:t])
    # the latest earlier occurrence (row 2, not row 0 and not row 4) feeds the repeat block
    again = changed.copy()
    again[2, li] = (again[2, li] + 1) % 8
    trace.topk_ids = again
    moved = pred.score_request(trace)
    assert not np.allclose(moved[t, li], after[t, li])
    trace.topk_ids = changed
    # the runtime's per-layer numpy path gives the same scores as the batched network
    feats = pred.features(trace)
    assert_kernel_matches(pred, feats, after, range(4))


def test_context_votes_pool_earlier_tokens_by_path_overlap():
    from moecast.predictors.llapor_features import context_votes

    spec = FeatureSpec(num_layers=2, num_experts=4, top_k=1, context_vote=1, vote_power=1.0)
    # request A: 3 tokens, request B: 1 token; ids[t, l, 0]
    ids = np.array([[[0], [1]], [[2], [3]], [[0], [2]], [[1], [1]]])
    v = context_votes(spec, ids, np.array([0, 1, 2, 0]))
    assert (v[0] == 0).all() and (v[3] == 0).all()  # no earlier token in the request
    assert v[1, 1].tolist() == [0, 1, 0, 0]  # the only earlier token's layer-1 id
    # token 2, layer 1: its layer-0 id 0 matches token 0 (weight 2), not token 1 (weight 1)
    assert np.allclose(v[2, 1], [0, 2 / 3, 0, 1 / 3])
    assert np.allclose(v[2, 0], [0.5, 0, 0.5, 0])  # layer 0: no earlier layer, uniform over tokens 0, 1


def test_token_exact_and_repeat_token_train_and_roundtrip(tmp_path):
    path = make_synthetic_traceset(tmp_path / "ex", num_requests=12, num_layers=3, with_optional=False)
    module, dm = _fit(path, epochs=1, token_buckets=64, token_exact=True, repeat_token=True, context_vote=2)
    ts = TraceSet(path)
    seen = np.unique(ts.column("token_id", dm.train_ids))
    assert dm.spec.token_exact and dm.spec.repeat_token and dm.spec.token_buckets == len(seen) + 1
    pred = load(module.export(tmp_path / "ex.safetensors", dm, {}))
    assert pred.spec.token_exact and pred.net.tok_vocab.tolist() == seen.tolist()
    assert pred.spec.context_vote == 2 and pred.spec.dense_dim == 8
    trace = ts.get(dm.val_ids[0])
    full = pred.score_request(trace)
    feats = pred.features(trace)
    assert_kernel_matches(pred, feats, full, range(3))


def test_kernel_quantize_keeps_each_column_within_half_a_step():
    from moecast.predictors.llapor_kernel import quantize

    rng = np.random.default_rng(0)
    W = rng.standard_normal((2, 48, 24)).astype(np.float32) * np.linspace(0.01, 3, 24, dtype=np.float32)
    W[1, :, 5] = 0  # an all-zero column keeps a usable scale
    Q, s = quantize(W, int8=True)
    assert Q.dtype == np.int8 and Q.shape == W.shape and s.shape == (2, 24)
    assert np.abs(Q).max() == 127 and s[1, 5] == 1.0 and (Q[1, :, 5] == 0).all()
    err = np.abs(Q * s[:, None, :] - W)
    assert (err <= s[:, None, :] / 2 + 1e-7).all()
    F, ones = quantize(W, int8=False)
    assert F.dtype == np.float32 and np.array_equal(F, W) and (ones == 1).all()
    Z, z = quantize(np.zeros((0, 8), np.float32), int8=True)  # an absent part
    assert Z.shape == (0, 8) and Z.dtype == np.int8 and z.shape == (8,)


def test_context_gate_feeds_the_previous_tokens_same_layer_gate_input():
    from moecast.predictors.llapor_features import dense_features

    spec = FeatureSpec(
        num_layers=3, num_experts=4, top_k=1, gate_pca=True, pca_dims=[2, 2, 2], context_gate=2
    )
    assert spec.dense_dim == 2 * 3
    pca_in = np.arange(5 * 3 * 2, dtype=np.float32).reshape(5, 3, 2) + 1  # [T, L, P]
    ids = np.zeros((5, 3, 1), np.int64)
    pos = np.array([0, 1, 2, 0, 1])  # two requests: rows 0-2 and 3-4
    out = dense_features(spec, pca_in, None, ids, pos)
    assert (out[:, 0, :2] == 0).all() and np.array_equal(out[:, 1:, :2], pca_in[:, :-1])  # layer-ahead
    assert np.array_equal(out[2, :, 2:4], pca_in[1]) and np.array_equal(out[2, :, 4:6], pca_in[0])
    assert (out[0, :, 2:] == 0).all() and (out[3, :, 2:] == 0).all()  # a request's first token
    assert np.array_equal(out[4, :, 2:4], pca_in[3]) and (out[4, :, 4:6] == 0).all()  # not across requests


@pytest.mark.parametrize("context_vote", [0, 1])
def test_score_at_folds_the_pca_into_the_first_matrices(tmp_path, context_vote):
    """score_at, the runtime's per-layer call, is score_layer(features_at) with each gate input's
    PCA folded into the matrices that read it: equal in float32, within int8 error by default.
    Without context votes it runs as one compiled call (llapor_kernel.score_row); with them,
    which are built in numpy, as the two calls."""
    import dataclasses

    path = make_synthetic_traceset(tmp_path / "sa", num_requests=12, num_layers=4, num_experts=8, hidden=16)
    module, dm = _fit(
        path,
        epochs=1,
        deep_history=True,
        history_tokens=1,
        token_buckets=64,
        context_tokens=1,
        context_vote=context_vote,
        context_gate=2,
        dense_skip=True,
        pca_io=6,
        pca_middle=10,
        groups={"input": [0], "middle": [1, 2], "output": [3]},
    )
    pred = load(module.export(tmp_path / "sa.safetensors", dm, {}))
    spec = pred.spec
    assert spec.pca_dims == [10, 10, 6, 6] and spec.gate_hidden == 16  # fewer components than the width
    torch.manual_seed(1)
    with torch.no_grad():  # weights of every size, so a misplaced block or mean would show
        for w in (pred.net.dense_proj.weight, pred.net.dense_skip.weight, pred.net.pca.mean):
            w.normal_(std=0.5)
    full = TraceSet(path).get(dm.val_ids[0])
    for t in (0, 1, 2, len(full) - 1):  # the first tokens lack some or all context_gate rows
        trace = full.prefix(t + 1)
        for layer in range(4):
            pred.int8_kernel = False
            ref = pred.score_layer(layer, pred.features_at(trace, layer))[0]
            assert np.allclose(pred.score_at(trace, layer), ref, atol=1e-5)
            pred.int8_kernel = True
            assert np.abs(pred.score_at(trace, layer) - ref).max() < 0.02
    # float32 gate inputs (the live runtime's window) are read in place, float16 (a TraceSet's) converted
    wide = dataclasses.replace(trace, gate_inputs=trace.gate_inputs.astype(np.float32))
    assert trace.gate_inputs.dtype == np.float16
    assert all(np.array_equal(pred.score_at(wide, la), pred.score_at(trace, la)) for la in range(4))
    moved = dataclasses.replace(trace, gate_inputs=trace.gate_inputs * 3)
    assert np.abs(pred.score_at(moved, 2) - pred.score_at(trace, 2)).max() > 1e-3  # the gate inputs count
    for row, layer in ((-1, 1), (-2, 2)):  # this token's layer-1 gate input, then a context token's
        bad = dataclasses.replace(trace, gate_inputs=trace.gate_inputs.copy())
        bad.gate_inputs[row, layer, 3] = np.inf
        with pytest.raises(ValueError, match="gate_inputs contain NaN or inf"):
            pred.score_at(bad, 2)
    bad = dataclasses.replace(trace, topk_weights=trace.topk_weights.copy())
    bad.topk_weights[-1, 1, 0] = np.nan
    with pytest.raises(ValueError, match="topk_weights contain NaN or inf"):
        pred.score_at(bad, 2)


def test_features_at_builds_the_runtime_row_as_features_does(tmp_path):
    import dataclasses

    path = make_synthetic_traceset(tmp_path / "fa", num_requests=12, num_layers=4, num_experts=8, hidden=16)
    module, dm = _fit(
        path,
        epochs=1,
        prev_layers=2,
        deep_history=True,
        history_tokens=2,
        token_buckets=64,
        context_tokens=1,
        repeat_token=True,
        context_vote=1,
        context_gate=2,
        dense_skip=True,
    )
    pred = load(module.export(tmp_path / "fa.safetensors", dm, {}))
    spec = pred.spec
    assert spec.gate_pca and spec.weights and spec.context_gate == 2 and spec.context_vote == 1
    full = TraceSet(path).get(dm.val_ids[0])
    for t in (0, 1, 2, len(full) - 1):  # the first tokens have no (or not every) earlier token
        trace = full.prefix(t + 1)
        ref = {k: v[-1:].numpy() for k, v in pred.features(trace).items()}
        for layer in range(4):
            row = pred.features_at(trace, layer)
            assert set(row) == set(ref) == {"bags", "route", "tokens", "dense"}
            assert np.array_equal(row["route"], ref["route"])
            assert np.array_equal(row["bags"][:, layer], ref["bags"][:, layer])
            assert np.array_equal(row["tokens"], ref["tokens"])
            assert np.allclose(row["dense"][:, layer], ref["dense"][:, layer], atol=1e-5)
            assert np.allclose(pred.score_layer(layer, row), pred.score_layer(layer, ref), atol=1e-6)
    # without context tokens the token input is the current token's bucket alone
    pred.spec = dataclasses.replace(spec, context_tokens=0)
    ref = pred.features(trace)["tokens"][-1:].numpy()
    assert np.array_equal(pred.features_at(trace, 2)["tokens"], ref) and ref.shape == (1,)
    seen = np.unique(np.asarray(trace.token_ids[::2], np.int64))  # half the ids: some unseen
    pred.net.register_buffer("tok_vocab", torch.from_numpy(seen))
    for ctx in (0, 1):  # token ids looked up in the training vocabulary instead of hashed
        pred.spec = dataclasses.replace(spec, context_tokens=ctx, token_exact=True)
        ref = pred.features(trace)["tokens"][-1:].numpy()
        assert np.array_equal(pred.features_at(trace, 2)["tokens"], ref)
    pred.spec = spec
    # a non-finite gate input or router weight: one clear line, whichever feature reads it
    bad = dataclasses.replace(trace, gate_inputs=trace.gate_inputs.copy())
    bad.gate_inputs[-1, 1, 3] = np.nan
    with pytest.raises(ValueError, match="gate_inputs contain NaN or inf"):
        pred.features_at(bad, 2)
    bad = dataclasses.replace(trace, topk_weights=trace.topk_weights.copy())
    bad.topk_weights[-1, 1, 0] = np.inf
    with pytest.raises(ValueError, match="topk_weights contain NaN or inf"):
        pred.features_at(bad, 2)


def test_cli_exports_the_best_epochs_metrics_and_honours_logger(tmp_path, monkeypatch, capsys):
    """The exported weights are the best epoch's (best.ckpt), and so must the recorded metrics be:
    here validation falls after the first epoch, so the last epoch's figures would be wrong.
    ``--train.logger false`` is the user's to set."""
    from moecast.train.llapor import LLaPorModule

    from moecast import configs_dir
    from moecast.cli import run

    path = make_synthetic_traceset(tmp_path / "b", num_requests=8, num_layers=3, num_experts=8, hidden=16)
    scores = iter([0.9, 0.5, 0.4])

    def falling(self):  # one value per epoch, logged as log_validation logs it
        if self.trainer.sanity_checking:
            return
        r = next(scores)
        self.log("val/recall", r)
        self.last_val = {"recall_at_k": r, "per_layer": [r, r, r]}

    monkeypatch.setattr(LLaPorModule, "on_validation_epoch_end", falling)
    out = tmp_path / "b.safetensors"
    run(
        [
            "train", "llapor", "--config", str(configs_dir() / "llapor_tiny.yaml"), "--traces", str(path),
            "--out", str(out), "--train.max_epochs", "3", "--train.progress-bar", "false",
            "--model.hidden", "16", "--train.patience", "5", "--train.logger", "false", "--json",
        ]
    )  # fmt: skip
    training = load(out).metadata()["training"]
    assert training["best_score"] == pytest.approx(0.9) and training["epochs"] == 3
    # --json: the closing line is one JSON object with what the checkpoint records
    import json

    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert said == dict(checkpoint=str(out), monitor="val/recall", best=pytest.approx(0.9),
                        run_dir=str(tmp_path / "b.run"), epochs=3, resumed_from=None)  # fmt: skip
    assert training["recall_at_k"] == pytest.approx(0.9) and training["per_layer"] == pytest.approx([0.9] * 3)
    run_dir = tmp_path / "b.run"
    assert not (run_dir / "wandb").exists() and not (run_dir / "csv").exists()  # no loggers
    assert (run_dir / "checkpoints" / "best.ckpt").is_file()  # checkpoints stay in the run directory


def test_eval_uses_the_checkpoints_split_and_checks_k(tmp_path, capsys):
    """A checkpoint trained on another split than the default is scored on its own held-out
    requests; --k outside 1..E is one clear error; the per-request hot table reports its name."""
    import json

    path = make_synthetic_traceset(tmp_path / "s", num_requests=12, num_layers=3)
    module, dm = _fit(path, epochs=1)  # val_fraction 0.25
    out = module.export(tmp_path / "s.safetensors", dm, {})
    res = evaluate(str(out), str(path), json=True)
    sides = TraceSet(path).splits(0.25, 0.1, 0)
    assert res["split"] == "test" and res["split_spec"]["val_fraction"] == 0.25
    assert res["requests"] == len(sides.test) > 0
    val = evaluate(str(out), str(path), split="val", json=True)
    assert val["requests"] == len(dm.val_ids) == len(sides.val)
    with pytest.raises(
        ValueError, match="disagrees with the split"
    ):  # another split would score training requests
        evaluate(str(out), str(path), val_fraction=0.5, json=True)
    capsys.readouterr()
    for k in (-1, 0, 9):
        with pytest.raises(
            ValueError, match=r"--k must be an integer from 1 to the model's 8 experts"
        ) as exc:
            evaluate(str(out), str(path), k=k)
        assert "\n" not in str(exc.value)
    res = evaluate(str(out), str(path), k=8, json=True)
    assert res["k"] == 8 and res["recall_at_k"] == pytest.approx(1.0)  # all 8 experts: every true one
    evaluate("frequency-request", str(path), json=True)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["predictor"] == "frequency-request"
    with pytest.raises(ValueError, match="no such checkpoint file, and not a baseline name"):
        evaluate(str(tmp_path / "missing.safetensors"), str(path))


def test_configured_group_names_are_checked(tmp_path):
    path = make_synthetic_traceset(tmp_path / "g", num_requests=4, num_layers=3)
    with pytest.raises(
        ValueError, match=r"data\.groups: unknown group inp, mid; the groups are input, middle and output"
    ):
        LLaPorDataModule(str(path), groups={"inp": [0], "mid": [1], "output": [2]})


def test_default_features_follow_the_traces_fields(tmp_path):
    """Unset, token_buckets and history_tokens give the paper's inputs on traces with gate inputs
    and, on ID-only traces, the features that exist: the token's embedding and layer l's ids of
    the previous token. Set, they are what the user said."""
    full = make_synthetic_traceset(tmp_path / "full", num_requests=4, num_layers=3)
    ids = make_synthetic_traceset(tmp_path / "ids", num_requests=4, num_layers=3, with_optional=False)
    for path, kwargs, want in (
        (full, {}, (0, 0)),
        (ids, {}, (4096, 1)),
        (ids, {"token_buckets": 0, "history_tokens": 0}, (0, 0)),
        (full, {"token_buckets": 64, "history_tokens": 2}, (64, 2)),
    ):
        dm = LLaPorDataModule(str(path), val_fraction=0.25, **kwargs)
        dm.setup("fit")
        assert (dm.spec.token_buckets, dm.spec.history_tokens) == want, (path.name, kwargs)


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_run_behind(tmp_path, monkeypatch):
    """A setting the traces cannot serve fails in setup with one line; the run directory (and the
    wandb run in it) that this call created is removed, while a run directory that already
    held a checkpoint is kept."""
    import sys

    from moecast import configs_dir
    from moecast.cli import run

    def train(argv: list[str]) -> None:
        run(["train", *argv])

    monkeypatch.setenv("WANDB_MODE", "offline")
    ids = make_synthetic_traceset(tmp_path / "ids", num_requests=6, num_layers=3, with_optional=False)
    out = tmp_path / "x.safetensors"
    args = [
        "llapor",
        "--config",
        str(configs_dir() / "llapor_tiny.yaml"),
        "--traces",
        str(ids),
        "--out",
        str(out),
    ]
    with pytest.raises(Exception, match="gate_inputs"):
        train([*args, "--data.gate_pca", "true", "--train.progress_bar", "false"])
    assert not (tmp_path / "x.run").exists() and not out.exists()
    assert "wandb" not in sys.modules or sys.modules["wandb"].run is None
    kept = tmp_path / "x.run" / "checkpoints"
    kept.mkdir(parents=True)
    (kept / "last.ckpt").write_bytes(b"")  # an earlier run's: not this call's to remove
    with pytest.raises(Exception, match="gate_inputs"):
        train([*args, "--data.gate_pca", "true", "--resume", "never", "--train.progress_bar", "false"])
    assert (kept / "last.ckpt").is_file()


def test_warm_compiles_what_the_live_stream_calls_and_changes_nothing(tmp_path):
    """LLaPor.warm (the live runtime calls it at attach) builds each layer's folded matrices and loads
    the kernels score_at calls: a stream then run as the live runtime feeds it, past its window,
    compiles no new specialization, and the predictor's scores are those of a predictor never warmed."""
    from moecast.predictors import llapor_kernel

    path = make_synthetic_traceset(tmp_path / "w", num_requests=8, num_layers=3, num_experts=8, hidden=16)
    module, dm = _fit(path, epochs=1, context_gate=2, pca_io=6, pca_middle=6)
    ckpt = module.export(tmp_path / "w.safetensors", dm, {})
    cold, pred = load(ckpt), load(ckpt)
    pred.warm()
    # every predicted layer's folded matrices are built (score_at builds them at a layer's first call)
    assert all(pred._layer_weights(layer).get("row_args") is not None for layer in (1, 2))
    kernels = [f for f in vars(llapor_kernel).values() if hasattr(f, "signatures")]
    after_warm = {f: set(f.signatures) for f in kernels}
    assert any(after_warm.values())
    trace = TraceSet(path).get(dm.val_ids[0])
    streams = [p.stream() for p in (cold, pred)]
    rng = np.random.default_rng(0)
    for s in streams:
        s.reset(trace.token_ids[:3])
    for step in range(pred.window + 4):
        n = 3 if step == 0 else 1
        ids = rng.integers(0, 8, (n, pred.top_k))
        w = rng.random((n, pred.top_k)).astype(np.float32)
        gate = rng.standard_normal((min(n, streams[0].gate_rows), 16)).astype(np.float32)
        for layer in range(3):
            got = []
            for s in streams:
                s.observe(layer, ids, w, gate)
                if layer < 2:
                    got.append(s.predict_next(layer + 1))
            assert not got or np.array_equal(got[0], got[1])
        for s in streams:
            s.end_token(int(step))
    assert {f: set(f.signatures) for f in kernels} == after_warm


def test_group_signal_is_the_mean_of_routing_correlation_and_gate_cosine_by_hand():
    """PreScope §3.1: with gate inputs the signal is 0.5 * routing correlation + 0.5 * cosine, so
    routing correlation breaks the cosine's ties. Cosine flat at 0.5 (a tie everywhere), routing
    correlation [., 0.1, 0.9, 0.9, 0.1]: signal [., 0.3, 0.7, 0.7, 0.3], mean 0.5, so layers 2-3
    are the middle group. The cosine alone would be all at the mean: middle 1-3."""
    cos = np.array([0.0, 0.5, 0.5, 0.5, 0.5])
    corr = np.array([0.0, 0.1, 0.9, 0.9, 0.1])
    groups, sig = detect_groups(cos, corr, 5)
    assert groups == {"input": [0, 1], "middle": [2, 3], "output": [4]}
    assert np.allclose(sig, [0.0, 0.3, 0.7, 0.7, 0.3])


def test_a_layer_at_the_mean_signal_is_a_middle_layer():
    """The middle group is the layers whose signal is >= the mean: with every signal equal (the
    mean itself) all of layers 1..L-2 are middle, and detection does not fail on an empty set."""
    groups, _ = detect_groups(None, np.full(4, 0.5), 4)
    assert groups == {"input": [0], "middle": [1, 2], "output": [3]}
    # layer 2 sits exactly at the mean of [0.25, 0.5, 0.75, 0.5] (0.5): it is a middle layer
    groups, _ = detect_groups(None, np.array([0.0, 0.25, 0.5, 0.75, 0.5]), 5)
    assert groups == {"input": [0, 1], "middle": [2, 3], "output": [4]}


def test_routing_correlation_is_the_recall_of_the_best_co_occurring_expert_by_hand():
    """routing_correlation[l]: predict layer l's expert as the one that co-occurred most with the
    token's layer l-1 expert. Three tokens route 0 -> 1, 0 -> 1, 0 -> 2: co-occurrence from expert 0
    is [0, 2, 1, 0], so every token is predicted expert 1 and two of three are right."""
    topk = np.array([[[0], [1]], [[0], [1]], [[0], [2]]])
    assert np.allclose(routing_correlation(topk, 4), [0.0, 2 / 3])


def test_context_votes_weigh_earlier_tokens_by_overlap_to_the_vote_power():
    """context_votes with vote_power 2: an earlier token's weight is (1 + overlap) ** 2. Token 2's
    layer-0 expert matches token 0's (weight 4), not token 1's (weight 1): its layer-1 vote is
    [0, 4/5, 0, 1/5]. A two-token request (rows 3-4) votes too: token 1 gets token 0's ids."""
    from moecast.predictors.llapor_features import context_votes

    spec = FeatureSpec(num_layers=2, num_experts=4, top_k=1, context_vote=1, vote_power=2.0)
    ids = np.array([[[0], [1]], [[2], [3]], [[0], [2]], [[1], [2]], [[3], [0]]])
    v = context_votes(spec, ids, np.array([0, 1, 2, 0, 1]))
    assert np.allclose(v[2, 1], [0, 4 / 5, 0, 1 / 5])
    assert v[4].tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]] and (v[3] == 0).all()


def test_repeat_token_features_read_the_token_ids():
    """repeat_token finds a token's earlier occurrence by its id: the features read token_id even
    without a token embedding, and the checkpoint's "needs" says so."""
    spec = FeatureSpec(num_layers=2, num_experts=4, top_k=1, repeat_token=True)
    assert spec.fields() == ["topk_ids", "token_id"]
    assert FeatureSpec(num_layers=2, num_experts=4, top_k=1).fields() == ["topk_ids"]


def test_the_group_threshold_is_the_mean_signal_not_the_median():
    """Routing correlation [., 0.1, 0.2, 0.9, 0.2]: its mean 0.35 leaves layer 3 alone above it
    (middle [3]); the median 0.2 would take layers 2-3 as the middle group."""
    groups, _ = detect_groups(None, np.array([0.0, 0.1, 0.2, 0.9, 0.2]), 5)
    assert groups == {"input": [0, 1, 2], "middle": [3], "output": [4]}


def _small_llapor(num_layers=3, num_experts=4, top_k=1, tokens=5, seed=0):
    """An untrained two-group LLaPor without dropout and one request of ``tokens`` tokens."""
    from moecast.collect.traceset import RequestTrace

    torch.manual_seed(seed)
    spec = FeatureSpec(num_layers=num_layers, num_experts=num_experts, top_k=top_k)
    groups = {"input": [0], "output": list(range(1, num_layers))}
    pred = LLaPor(LLaPorNet(spec, groups, NetConfig(hidden=8, dropout=0.0)), list(range(num_layers)))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num_experts, (tokens, num_layers, top_k))
    trace = RequestTrace(
        "r", "w", "c", "p", np.arange(tokens), ["x"] * tokens, np.zeros(tokens, bool), ids, None, None, None
    )
    return pred, trace


def test_online_update_takes_the_gamma_it_is_given():
    """gamma 0 makes the focal term the plain BCE: the loss is (1 + lambda_l) x mean BCE per layer,
    lambda 0.5 on both groups of a checkpoint that records no loss (the paper's focal loss)."""
    pred, trace = _small_llapor()
    feats = pred.features(trace)
    with torch.no_grad():
        p = torch.sigmoid(pred.net(**feats)).double().numpy()  # [T, L, E]
    y = np.zeros_like(p)
    for t, li, c in np.ndindex(trace.topk_ids.shape):
        y[t, li, trace.topk_ids[t, li, c]] = 1.0
    bce = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    want = ((1 + 0.5) * bce.mean(-1)).mean()
    assert pred.update(feats, trace.topk_ids, lr=0.0, gamma=0.0) == pytest.approx(want, rel=1e-5)


def test_learn_last_steps_on_the_last_tokens_row_and_routing():
    pred, trace = _small_llapor(tokens=5)
    seen = {}

    def spy(row, truth, lr):
        seen.update(row=row, truth=truth, lr=lr)
        return 0.0

    pred.update = spy
    pred.learn_last(trace, lr=0.25)
    assert np.array_equal(seen["truth"], trace.topk_ids[4:5]) and seen["lr"] == 0.25
    assert torch.equal(seen["row"]["bags"], pred.features(trace)["bags"][4:5])


def test_online_update_refreshes_the_runtimes_per_layer_weights():
    """score_layer packs each layer's weights once; an update changes them, so the next call must
    score with the new weights, as the torch network does."""
    pred, trace = _small_llapor()
    pred.int8_kernel = False
    feats = pred.features(trace)
    before = pred.score_layer(1, feats)  # packs layer 1's weights
    pred.update(feats, trace.topk_ids, lr=0.05, steps=3)
    want = pred.score_features(feats)[:, 1]
    assert not np.allclose(want, before, atol=1e-3)  # the update moved the scores
    assert np.allclose(pred.score_layer(1, feats), want, atol=1e-5)
    assert np.allclose(pred.score_at(trace, 1), want[-1], atol=1e-5)


def test_deep_history_never_reads_the_layers_own_route_whatever_the_learned_mix():
    """The layer mix is learned: with every entry of it 1 (as training may make it), layer l's
    logits still read only the earlier layers' ids of the token, never layer l's own."""
    torch.manual_seed(0)
    spec = FeatureSpec(num_layers=3, num_experts=4, top_k=1, deep_history=True)
    net = LLaPorNet(spec, {"input": [0], "output": [1, 2]}, NetConfig(hidden=8, dropout=0.0)).eval()
    with torch.no_grad():
        net.deep_mix.fill_(1.0)
    bags = torch.full((1, 3, 1), spec.vocab)
    route = torch.tensor([[[0], [1], [2]]])
    other = route.clone()
    other[0, 1, 0] = 3  # layer 1's id: known to layer 2's predictor, not yet to layer 1's
    with torch.no_grad():
        a, b = net(bags, route=route), net(bags, route=other)
    assert torch.equal(a[0, :2], b[0, :2])
    assert not torch.allclose(a[0, 2], b[0, 2])
