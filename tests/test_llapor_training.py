"""LLaPor training (PreScope §4.2.2): AdamW groups, warm-up + cosine, bodies, 1/f_i, noise, CLI, online, export."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import make_synthetic_traceset, quiet_trainer
from moecast.collect.traceset import TraceSet
from moecast.predictors import load
from moecast.predictors.llapor import LLaPor
from moecast.predictors.llapor_net import balanced_focal_loss, group_lambda, llapor_loss
from moecast.predictors.metrics import multi_hot, recall_at_k
from moecast.train.data import LLaPorDataModule
from moecast.train.llapor import LLaPorModule

# tiny tensors: threads only add spin-wait overhead on a shared CPU
torch.set_num_threads(1)

GROUPS = {"input": [0], "middle": [1, 2], "output": [3]}
FLOOR = 0.05  # the schedules' floor, a fraction of each group's base learning rate


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_traceset(
        tmp_path_factory.mktemp("llapor_training") / "tr",
        num_requests=12,
        num_layers=4,
        num_experts=8,
        hidden=16,
        tokens=12,
    )


@pytest.fixture(scope="module")
def dm(traces: Path) -> LLaPorDataModule:
    data = LLaPorDataModule(str(traces), val_fraction=0.25, batch_size=64, groups=GROUPS)
    data.setup("fit")
    return data


def _built(dm: LLaPorDataModule, **hp: Any) -> LLaPorModule:
    """A module whose network is built from ``dm`` (its ``setup`` reads only ``trainer.datamodule``)."""
    torch.manual_seed(0)
    module = LLaPorModule(hidden=16, **hp)
    module.trainer = SimpleNamespace(datamodule=dm)
    module.setup("fit")
    module.trainer = None
    return module


def _group_names(module: LLaPorModule, opt: torch.optim.Optimizer) -> list[str]:
    """The layer group of each optimizer parameter group ("shared" = outside the bodies)."""
    owner = {id(p): g for g, body in module.net.bodies.items() for p in body.parameters()}
    names = []
    for pg in opt.param_groups:
        found = {owner.get(id(p), "shared") for p in pg["params"]}
        assert len(found) == 1, f"a parameter group mixes layer groups: {found}"
        names.append(found.pop())
    return names


def _fit(path: Path, epochs: int, **model: Any) -> tuple[LLaPorModule, LLaPorDataModule]:
    torch.manual_seed(0)
    data = LLaPorDataModule(str(path), val_fraction=0.25, batch_size=64)
    hp = {"hidden": 32, "warmup_epochs": 1, "lr_io": 5e-3, "lr_middle": 5e-3, "lr_shared": 5e-3}
    module = LLaPorModule(mask_prob=0.0, **{**hp, **model})
    quiet_trainer(epochs, gradient_clip_val=1.0).fit(module, datamodule=data)
    return module, data


# ---------------------------------------------------------------------- 1. AdamW parameter groups
HP_OPT = {
    "lr_shared": 7e-3,
    "lr_io": 1e-3,
    "lr_middle": 4e-3,
    "weight_decay_io": 2e-4,
    "weight_decay_middle": 3e-2,
    "warmup_epochs": 2,
}


def test_adamw_groups_take_lr_and_weight_decay_by_layer_group(dm: LLaPorDataModule) -> None:
    module = _built(dm, **HP_OPT)
    module.trainer = quiet_trainer(8)
    conf = module.configure_optimizers()
    opt = conf["optimizer"]
    assert isinstance(opt, torch.optim.AdamW)
    names = _group_names(module, opt)
    assert sorted(names) == ["input", "middle", "output", "shared"]  # one group each
    # every trainable parameter is optimised, in exactly one group
    grouped = [id(p) for pg in opt.param_groups for p in pg["params"]]
    assert len(grouped) == len(set(grouped)) and set(grouped) == {id(p) for p in module.parameters()}
    hp = module.hparams
    want = {
        "shared": (hp.lr_shared, hp.weight_decay_io),
        "input": (hp.lr_io, hp.weight_decay_io),
        "output": (hp.lr_io, hp.weight_decay_io),
        "middle": (hp.lr_middle, hp.weight_decay_middle),
    }
    for name, pg in zip(names, opt.param_groups):
        lr, wd = want[name]
        assert pg["initial_lr"] == pytest.approx(lr), name  # the base the schedule scales
        assert pg["weight_decay"] == pytest.approx(wd), name
    assert conf["lr_scheduler"]["interval"] == "epoch"


# ---------------------------------------------------------------------- 2. warm-up + cosine schedule
def _expected_factor(epoch: int, total: int, warmup: int, warm: bool) -> float:
    """Linear warm-up to 1 over ``warmup`` epochs (warm groups), then cosine from 1 to FLOOR at ``total``."""
    if warm and epoch < warmup:
        return (epoch + 1) / (warmup + 1)
    start = warmup if warm else 0
    t = min((epoch - start) / (total - start), 1.0)
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * t))


def test_schedule_warms_up_io_and_shared_groups_and_anneals_the_middle_one(
    dm: LLaPorDataModule, tmp_path: Path
) -> None:
    total, warmup = 8, HP_OPT["warmup_epochs"]
    module = _built(dm, **HP_OPT)
    module.trainer = quiet_trainer(total)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    names = _group_names(module, opt)
    seen: list[list[float]] = []
    for _ in range(total + 3):  # past the planned epochs: the floor holds
        seen.append([pg["lr"] / pg["initial_lr"] for pg in opt.param_groups])
        opt.step()  # (no gradients: a no-op) keeps the scheduler's order check quiet
        sched.step()
    got = np.array(seen)  # [epoch, group]
    for j, name in enumerate(names):
        warm = name != "middle"
        want = [_expected_factor(e, total, warmup, warm) for e in range(total + 3)]
        assert np.allclose(got[:, j], want), (name, got[:, j])
        col = got[:, j]
        if warm:  # linear warm-up: equal steps up to the base lr, reached at epoch `warmup`
            assert np.allclose(np.diff(col[: warmup + 1]), 1 / (warmup + 1))
            assert col[warmup] == pytest.approx(1)
            assert (np.diff(col[warmup:]) <= 1e-12).all()
        else:  # no warm-up: the base lr from the first epoch, then down
            assert col[0] == pytest.approx(1) and (np.diff(col) <= 1e-12).all()
        assert col.min() >= FLOOR - 1e-12 and np.allclose(col[total:], FLOOR)
    # the middle group's cosine is halfway at total / 2; a warm group is still higher there
    mid = names.index("middle")
    assert got[total // 2, mid] == pytest.approx(FLOOR + (1 - FLOOR) / 2)
    assert got[total // 2, names.index("input")] > got[total // 2, mid]

    # a run with no epoch count cannot lay the schedule out
    module.trainer = quiet_trainer(-1, max_time={"minutes": 1})
    with pytest.raises(ValueError, match="max_epochs"):
        module.configure_optimizers()

    # in a real fit Lightning steps it once per epoch: each epoch trains at the factors above
    class LrLog(pl.Callback):
        def __init__(self) -> None:
            self.lrs: list[list[float]] = []

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.lrs.append([pg["lr"] for pg in trainer.optimizers[0].param_groups])

    log = LrLog()
    epochs = 4
    fitted = LLaPorModule(hidden=16, **HP_OPT)
    data = LLaPorDataModule(str(dm.traces), val_fraction=0.25, batch_size=64, groups=GROUPS)
    quiet_trainer(epochs, callbacks=[log], limit_train_batches=1, limit_val_batches=0).fit(
        fitted, datamodule=data
    )
    bases = {"shared": HP_OPT["lr_shared"], "input": HP_OPT["lr_io"], "output": HP_OPT["lr_io"]}
    bases["middle"] = HP_OPT["lr_middle"]
    fit_names = _group_names(fitted, fitted.trainer.optimizers[0])
    want_lrs = [
        [bases[n] * _expected_factor(e, epochs, warmup, n != "middle") for n in fit_names]
        for e in range(epochs)
    ]
    assert len(log.lrs) == epochs and np.allclose(log.lrs, want_lrs)


# ---------------------------------------------------------------------- 3. group bodies
def test_middle_body_is_deeper_with_a_gated_residual_and_io_bodies_are_plain(dm: LLaPorDataModule) -> None:
    assert LLaPorModule().hparams.depth_middle > LLaPorModule().hparams.depth_io  # the paper's shape
    module = _built(dm, depth_io=2, depth_middle=3, dropout=0.0)
    bodies = module.net.bodies
    assert set(bodies) == {"input", "middle", "output"}
    torch.manual_seed(1)
    for name, body in bodies.items():
        body.eval()
        layers = len(GROUPS[name])
        x = torch.randn(5, layers, 16)
        h = x
        for lin in body.hidden:
            h = F.gelu(lin(h))
        with torch.no_grad():
            out = body(x)
            if name != "middle":
                assert len(body.hidden) == 2 and not body.residual
                assert not hasattr(body, "gate") and not hasattr(body, "res1")
                assert torch.allclose(out, body.head(h), atol=1e-6)  # no residual path
                continue
            assert len(body.hidden) == 3 and body.residual
            r = body.res2(F.gelu(body.res1(h)))
            g = torch.sigmoid(body.gate(h))
            assert torch.allclose(out, body.head(h + g * r), atol=1e-6)
            assert not torch.allclose(out, body.head(h), atol=1e-4)  # the residual contributes
            # the sigmoid gating unit decides how much: shut, the block is the plain stack; open, h + r
            body.gate.weight.zero_()
            body.gate.bias.fill_(-60.0)
            assert torch.allclose(body(x), body.head(h), atol=1e-5)
            body.gate.bias.fill_(60.0)
            assert torch.allclose(body(x), body.head(h + r), atol=1e-5)


# ---------------------------------------------------------------------- 4. expert balancing 1/f_i
def test_balancing_weights_are_inverse_training_frequencies(dm: LLaPorDataModule, traces: Path) -> None:
    ts = TraceSet(traces)
    sides = ts.splits(0.25, 0.1, 0)
    train_ids, val_ids = sides.train, sides.val
    assert sorted(train_ids) == sorted(dm.train_ids) and val_ids
    L, E = ts.num_layers, ts.num_experts

    def inv_freq(ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        topk = ts.array("topk_ids", ids)  # [N, L, k]
        counts = np.stack([np.bincount(topk[:, li].ravel(), minlength=E) for li in range(L)]).astype(float)
        # add-one smoothed, so that an expert the split never chose gets a finite weight
        f = (counts + 1) / (counts + 1).sum(1, keepdims=True)
        inv = 1 / f
        return counts, inv / inv.mean(1, keepdims=True)  # mean 1 per layer

    counts, want = inv_freq(train_ids)
    assert dm.inv_freq.shape == (L, E)
    assert np.allclose(dm.inv_freq, want, rtol=1e-5)
    assert np.allclose(dm.inv_freq.mean(1), 1.0, atol=1e-5)
    # 1/f_i: the weight ratio of two experts is the inverse ratio of their (smoothed) counts
    assert np.allclose(dm.inv_freq[:, 0:1] / dm.inv_freq, (counts + 1) / (counts[:, 0:1] + 1), rtol=1e-5)
    assert (dm.inv_freq.argmin(1) == counts.argmax(1)).all()  # the hottest expert weighs least
    assert not np.allclose(dm.inv_freq, inv_freq(ts.request_ids)[1], rtol=1e-3)  # training split only
    # the module takes them as the focal loss's balancing term
    module = _built(dm, loss="focal", lam_io=0.5, lam_middle=0.0)
    assert torch.allclose(module.inv_freq, torch.from_numpy(want).float())
    batch = dm.batch(dm.train_rows[:32])
    with torch.no_grad():
        logits = module.eval()(batch)
        lam = group_lambda(L, dm.groups, 0.5, 0.0)
        expect = balanced_focal_loss(logits, batch["target"], torch.from_numpy(want).float(), lam, 2.0)
        flat = balanced_focal_loss(logits, batch["target"], torch.ones(L, E), lam, 2.0)
        got = module._loss(logits, batch["target"])
    assert torch.isclose(got, expect) and not torch.isclose(got, flat)


# ---------------------------------------------------------------------- 5. Gaussian noise, training only
@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_gaussian_noise_is_added_in_training_steps_only(dm: LLaPorDataModule) -> None:
    noise = 0.3
    module = _built(dm, noise_std=noise, mask_prob=0.0, mask_dense=0.0, dropout=0.0)
    batch = dm.batch(dm.train_rows[:64])
    dense = batch["dense"]
    torch.manual_seed(0)
    aug = module._augment(batch)
    assert torch.equal(aug["bags"], batch["bags"])  # only the dense features get noise
    diff = aug["dense"] - dense
    assert (diff != 0).float().mean() > 0.99
    # zero-mean, scaled by noise_std times the batch's feature spread
    assert diff.std().item() == pytest.approx(noise * dense.std().item(), rel=0.1)
    assert abs(diff.mean().item()) < 0.1 * noise * dense.std().item()

    seen: list[torch.Tensor] = []
    forward = module.net.forward

    def spy(*args: Any) -> torch.Tensor:
        seen.append(args[2])  # bags, tokens, dense, route
        return forward(*args)

    module.net.forward = spy
    module.training_step(batch, 0)
    assert not torch.allclose(seen[-1], dense)  # training sees noisy features
    module.eval()
    module.on_validation_epoch_start()
    module.validation_step(batch, 0)
    assert torch.equal(seen[-1], dense)  # validation sees them as they are
    # noise_std 0: no noise at all
    quiet = _built(dm, noise_std=0.0, mask_prob=0.0, mask_dense=0.0)
    assert torch.equal(quiet._augment(batch)["dense"], dense)


# ---------------------------------------------------------------------- 6. CLI: early stopping, clipping
def test_cli_wires_early_stopping_on_val_recall_and_gradient_clipping(
    traces: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.callbacks import EarlyStopping

    from moecast import configs_dir
    from moecast.cli import run

    monkeypatch.chdir(tmp_path)
    # the tiny config without its patience: what is checked is the CLI's own wiring
    cfg = yaml.safe_load((configs_dir() / "llapor_tiny.yaml").read_text())
    del cfg["train"]["patience"]
    clip_cfg = cfg["train"]["gradient_clip_val"] = 0.375  # not Lightning's default (None)
    cfg_path = tmp_path / "llapor.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    seen: dict[str, Any] = {"clips": []}
    export, clip = LLaPorModule.export, LLaPorModule.clip_gradients

    def export_spy(self: LLaPorModule, out: Path, data: Any, info: dict) -> Path:
        seen["trainer"] = self.trainer
        return export(self, out, data, info)

    def clip_spy(self: LLaPorModule, optimizer: Any, gradient_clip_val: Any = None, **kw: Any) -> None:
        seen["clips"].append(gradient_clip_val)
        return clip(self, optimizer, gradient_clip_val, **kw)

    monkeypatch.setattr(LLaPorModule, "export", export_spy)
    monkeypatch.setattr(LLaPorModule, "clip_gradients", clip_spy)
    out = tmp_path / "es.safetensors"
    # learning rates too small to move a weight: val/recall never improves after the first epoch
    tiny_lr = [f"--model.{k}=1e-12" for k in ("lr_io", "lr_middle", "lr_shared")]
    run(
        [
            "train",
            "llapor",
            "--config",
            str(cfg_path),
            "--traces",
            str(traces),
            "--out",
            str(out),
            "--train.progress_bar=false",
            "--train.max_epochs=6",
            "--train.patience=1",
            "--model.hidden=16",
            "--data.val_fraction=0.25",
            *tiny_lr,
        ]
    )
    trainer = seen["trainer"]
    stops = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert len(stops) == 1
    es = stops[0]
    assert es.monitor == "val/recall" and es.mode == "max" and es.patience == 1
    assert trainer.max_epochs == 6 and es.stopped_epoch == 1 and trainer.current_epoch == 2  # stopped early
    assert load(out).metadata()["training"]["epochs"] == 2
    assert trainer.gradient_clip_val == clip_cfg
    assert seen["clips"] and all(c == clip_cfg for c in seen["clips"])  # applied at every step


# ---------------------------------------------------------------------- 7. online update, held out
def test_online_update_generalises_to_held_out_requests_of_the_shifted_workload(tmp_path: Path) -> None:
    a = make_synthetic_traceset(tmp_path / "a", num_requests=16, num_layers=3, seed=0, tokens=16)
    # the shifted workload: other routers
    b = make_synthetic_traceset(tmp_path / "b", num_requests=12, num_layers=3, seed=5, tokens=16)
    module, data = _fit(a, epochs=2, dropout=0.0)
    pred = load(module.export(tmp_path / "p.safetensors", data, {}))
    shifted = TraceSet(b)
    traces = [shifted.get(r) for r in shifted.request_ids]
    seen, held_out = traces[:8], traces[8:]  # update on some requests, score others

    def stacked(ts: list) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        feats = [pred.features(t) for t in ts]
        truth = np.concatenate([t.topk_ids for t in ts])
        return {k: torch.cat([f[k] for f in feats]) for k in feats[0]}, truth

    def held_out_score() -> tuple[float, float]:
        """The checkpoint's own loss (what ``update`` minimises) and recall@k on the held-out requests."""
        feats, truth = stacked(held_out)
        with torch.no_grad():
            logits = pred.net.eval()(**feats)
        target = torch.from_numpy(multi_hot(truth, pred.num_experts, np.float32))
        lam = group_lambda(pred.num_layers, pred.groups, hp["lam_io"], hp["lam_middle"])
        ones = torch.ones(pred.num_layers, pred.num_experts)  # update's balancing weights
        loss = float(llapor_loss(hp["loss"], logits, target, ones, lam, hp["gamma"]))
        scores = np.concatenate([pred.score_request(t) for t in held_out])  # the serving path
        return loss, recall_at_k(scores, truth)

    hp = pred.metadata()["hyper_parameters"]
    loss0, recall0 = held_out_score()
    feats, truth = stacked(seen)
    for _ in range(40):
        pred.update(feats, truth, lr=1e-3)
    loss1, recall1 = held_out_score()
    # (measured: loss 0.683 -> 0.628, recall@2 0.26 -> 0.37; the updated requests alone would say nothing)
    assert loss1 < loss0 - 0.03
    assert recall1 > recall0 + 0.05


# ---------------------------------------------------------------------- 8. export loads without Lightning
BLOCKED = ("lightning", "lightning_fabric", "pytorch_lightning", "sklearn", "wandb", "jsonargparse")

_NO_TRAINING_STACK = """
import importlib.abc, json, sys
import numpy as np

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked}:
            raise ImportError("blocked in this test: " + name)
        return None

sys.meta_path.insert(0, Block())
from moecast.collect.traceset import TraceSet
from moecast.predictors import load

pred = load(sys.argv[1])
ts = TraceSet(sys.argv[2])
scores = pred.score_request(ts.get(sys.argv[3]))
np.save(sys.argv[4], scores)
try:  # the blocker itself works
    import lightning
except ImportError:
    pass
else:
    raise SystemExit("lightning was importable")
print(json.dumps({{"name": pred.name, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {blocked})}}))
"""


def test_llapor_checkpoint_loads_and_scores_without_the_training_stack(traces: Path, tmp_path: Path) -> None:
    module, data = _fit(traces, epochs=1, hidden=16)
    out = module.export(tmp_path / "llapor.safetensors", data, {})
    rid = data.val_ids[0]
    want = load(out).score_request(TraceSet(traces).get(rid))
    code = _NO_TRAINING_STACK.format(blocked=repr(set(BLOCKED)))
    npy = tmp_path / "scores.npy"
    done = subprocess.run(
        [sys.executable, "-c", code, str(out), str(traces), rid, str(npy)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res == {"name": "llapor", "loaded": []}
    got = np.load(npy)
    assert got.shape == want.shape == (len(TraceSet(traces).get(rid)), 4, 8)
    assert np.allclose(got, want, atol=1e-6)
    assert isinstance(load(out), LLaPor)


# ---------------------------------------------------------------------- 9. what the data module fits on
def test_gate_input_pca_is_fitted_on_the_training_split_only(dm: LLaPorDataModule, traces: Path) -> None:
    ts = TraceSet(traces)
    train_gate = ts.array("gate_inputs", dm.train_ids).astype(np.float64)  # [N, L, H]
    all_gate = ts.array("gate_inputs", dm.train_ids + dm.val_ids).astype(np.float64)
    fitted = [li for li, d in enumerate(dm.spec.pca_dims) if d]
    assert fitted
    for li in fitted:  # a PCA's mean is its sample's mean: here every training row's
        assert np.allclose(dm.pca_mean[li], train_gate[:, li].mean(0), atol=1e-4)
        assert not np.allclose(dm.pca_mean[li], all_gate[:, li].mean(0), atol=1e-4)


def test_exact_token_vocabulary_is_the_training_splits_ids_seen_min_count_times(traces: Path) -> None:
    ts = TraceSet(traces)
    data = LLaPorDataModule(
        str(traces), val_fraction=0.25, groups=GROUPS, token_buckets=16, token_exact=True, token_min_count=2
    )
    data.setup("fit")
    train_tokens = ts.column("token_id", data.train_ids)
    ids, counts = np.unique(train_tokens, return_counts=True)
    assert (counts == 2).any()  # ids seen exactly min_count times are in
    val_only = set(ts.column("token_id", data.val_ids)) - set(train_tokens)
    assert val_only  # ids seen only in validation are not
    assert data.token_vocab.tolist() == ids[counts >= 2].tolist()
    assert data.spec.token_buckets == len(data.token_vocab) + 1  # one more row for every other id


def test_expert_ids_at_or_past_the_expert_count_are_refused(traces: Path) -> None:
    from moecast.errors import InputError

    fresh = LLaPorDataModule(str(traces), groups=GROUPS)  # not the shared fixture: the check stores the ids
    bad = SimpleNamespace(path="t", array=lambda name, ids: np.full((2, 4, 2), 8, np.int64))
    with pytest.raises(InputError, match=r"topk_ids outside \[0, 8\)"):
        fresh._read_routing(bad, [], 8)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_validation_loss_keeps_the_hard_top_k_target_when_distilling(dm: LLaPorDataModule) -> None:
    assert dm.probs is not None
    module = _built(dm, loss="softmax", distill=1.0, dropout=0.0)
    assert module.distill_weights is not None
    batch = dm.batch(dm.val_rows[:16])
    logged: dict[str, float] = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    module.eval()
    module.on_validation_epoch_start()
    with torch.no_grad():
        module.validation_step(batch, 0)
        logits = module(batch)
    # cross-entropy against 1/k on each true expert, whatever the router's probabilities say
    q = batch["target"] / batch["target"].sum(-1, keepdim=True)
    want = float(-(F.log_softmax(logits, -1) * q).sum(-1).mean())
    assert logged["val/loss"] == pytest.approx(want, rel=1e-5)


def test_pca_width_is_capped_by_the_training_rows_it_is_fitted_on(tmp_path: Path) -> None:
    # 4 requests of 4 tokens, gate inputs 32 wide: fewer training rows than the width, and than pca_io
    path = make_synthetic_traceset(tmp_path / "few", num_requests=4, num_layers=3, hidden=32, tokens=4)
    data = LLaPorDataModule(str(path), val_fraction=0.25, test_fraction=0.0, groups={"input": [0, 1, 2]})
    data.setup("fit")
    rows = 4 * len(data.train_ids)
    assert rows < 32
    assert data.spec.pca_dims == [rows, rows, 0]


def test_context_gate_block_is_the_previous_tokens_own_layer_gate_input(traces: Path) -> None:
    ts = TraceSet(traces)
    data = LLaPorDataModule(str(traces), val_fraction=0.25, groups=GROUPS, context_gate=1)
    data.setup("fit")
    spec = data.spec
    assert spec.context_gate == 1 and spec.weights
    gate = ts.array("gate_inputs", data.train_ids[:1]).astype(np.float64)  # [T, L, H], request 0
    dense = data.batch(np.arange(3))["dense"].numpy()  # its tokens 0, 1, 2
    off = spec.pca_max + spec.num_experts  # after the own PCA block and the router weights
    for li in range(spec.num_layers):
        d = spec.pca_dims[li]
        comps = data.pca_components[li, :d].astype(np.float64)
        assert not dense[0, li, off : off + spec.pca_max].any()  # the first token has no predecessor
        for t in (1, 2):  # token t's block: token t-1's layer-l gate input, projected
            want = (gate[t - 1, li] - data.pca_mean[li]) @ comps.T
            assert np.allclose(dense[t, li, off : off + d], want, atol=1e-3)
