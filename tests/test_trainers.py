"""The trainers' small parts by hand: splits, sequence batches and loss, schedules, settings, runs, Table 3."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_synthetic_traceset, quiet_trainer
from moecast.collect.traceset import TraceSet
from moecast.train.config import SplitConfig
from moecast.train.data import split_requests

# tiny tensors: threads only add spin-wait overhead on a shared CPU
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_traceset(
        tmp_path_factory.mktemp("trainers") / "tr",
        num_requests=12,
        num_layers=3,
        num_experts=8,
        hidden=16,
        tokens=12,
    )


# ---------------------------------------------------------------------- request split
def test_max_requests_keeps_at_least_one_validation_request_and_caps_the_total(traces: Path) -> None:
    ts = TraceSet(traces)
    sides = ts.splits(0.2, 0.1, 0)
    assert len(sides.train) > 4 and len(sides.val) >= 1
    # 2 requests at val_fraction 0.2: round(0.4) = 0 held out would leave nothing to select
    # the best epoch by, so one is held out and one trains: 2 in all
    train, val, _ = split_requests(ts, SplitConfig(val_fraction=0.2, max_requests=2))
    assert (train, val) == (sides.train[:1], sides.val[:1])
    # 4 requests at 0.25: round(1.0) = 1 held out, 3 train
    sides10 = ts.splits(0.25, 0.1, 0)
    train, val, _ = split_requests(ts, SplitConfig(val_fraction=0.25, max_requests=4))
    assert (train, val) == (sides10.train[:3], sides10.val[:1])
    assert len(train) + len(val) == 4


# ---------------------------------------------------------------------- sequence model (MoE-Beyond §3.2)
@pytest.fixture(scope="module")
def seq_dm(traces: Path):
    from moecast.train.sequence import SequenceDataModule

    dm = SequenceDataModule(str(traces), val_fraction=0.25, batch_size=4, token_buckets=64, max_len=5)
    dm.setup("fit")
    return dm


def test_sequence_batch_is_cut_to_max_len_and_feeds_each_token_the_previous_tokens_routing(
    seq_dm, traces: Path
) -> None:
    ts = TraceSet(traces)
    E = ts.num_experts
    batch = seq_dm.batch(np.array([0, 1]))
    assert batch["tokens"].shape == (2, 5)  # 12 tokens per request, cut to max_len 5
    for i, rid in enumerate(seq_dm.train_ids[:2]):
        ids = ts.array("topk_ids", [rid])[:5]  # [5, L, k]
        hot = np.zeros((5, ts.num_layers, E), np.float32)
        for t, li, c in np.ndindex(ids.shape):
            hot[t, li, ids[t, li, c]] = 1.0
        assert np.array_equal(batch["target"][i].numpy(), hot)
        prev = batch["prev"][i].numpy().reshape(5, ts.num_layers, E)
        assert not prev[0].any()  # the first token has no earlier routing
        assert np.array_equal(prev[1:], hot[:-1])  # token t reads token t-1's experts, never its own
        assert np.array_equal(batch["tokens"][i].numpy(), ts.column("token_id", [rid])[:5] % 64)
    assert not batch["pad"].any()


def test_sequence_validation_batches_are_the_validation_requests(seq_dm, traces: Path) -> None:
    ts = TraceSet(traces)
    assert len(seq_dm.val_req) == len(seq_dm.val_ids) > 0
    batch = seq_dm.batch(seq_dm.val_req)
    for i, rid in enumerate(seq_dm.val_ids):
        ids = ts.array("topk_ids", [rid])[:5]  # [5, L, k]
        chosen = [set(np.flatnonzero(row)) for row in batch["target"][i].numpy().reshape(-1, ts.num_experts)]
        assert chosen == [set(c) for c in ids.reshape(-1, ids.shape[-1])]


def test_sequence_loss_averages_bce_over_real_tokens_only(seq_dm) -> None:
    from moecast.train.sequence import SequenceModule

    torch.manual_seed(0)
    module = SequenceModule(d_model=16, n_heads=2, n_blocks=1, ffn=16, head_hidden=16, dropout=0.0)
    module.trainer = SimpleNamespace(datamodule=seq_dm)
    module.setup("fit")
    module.trainer = None
    batch = seq_dm.batch(np.array([0, 1]))
    batch["pad"][1, 3:] = True  # request 1 is 3 tokens long: its last two positions are padding
    module.eval()
    with torch.no_grad():
        loss, logits = module._loss(batch)
    # by hand: mean over (real token, layer, expert) of -[y log p + (1 - y) log(1 - p)]
    p = torch.sigmoid(logits.double())
    y = batch["target"].double()
    bce = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))
    real = [bce[0, t] for t in range(5)] + [bce[1, t] for t in range(3)]
    want = torch.stack(real).mean()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


def test_sequence_warm_up_is_cut_to_leave_one_cosine_epoch() -> None:
    from moecast.train.sequence import SequenceModule

    module = SequenceModule(warmup_epochs=5, lr=1e-2)
    module.net = torch.nn.Linear(2, 2)
    module.trainer = quiet_trainer(3)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # 3 epochs: warm-up over min(5, 3 - 1) = 2 epochs (1/3, 2/3 of the lr), then the cosine's start (1)
    assert np.allclose(seen, [1e-2 / 3, 2e-2 / 3, 1e-2])


# ---------------------------------------------------------------------- CasMoE Table 3 and the EAP's loss
def _dist(top: int, E: int = 4) -> np.ndarray:
    """An EP-like row over E experts whose largest mass is on ``top``."""
    row = np.full(E, 0.1, np.float32)
    row[top] = 0.7
    return row


def test_table3_cascade_rows_gate_inclusively_and_pay_the_fallback_only_when_it_falls_back() -> None:
    from moecast.train.planner_report import PlannerRun, table3

    true_ep = np.stack([_dist(0), _dist(1), _dist(2)])[:, None]  # 3 prompts, 1 layer, 4 experts
    eam = PlannerRun(
        np.stack([_dist(0), _dist(3), _dist(3)])[:, None],
        np.array([1.0, 1.0, 1.0]),
        np.array([0.5, 0.9, 0.2]),
    )
    eap = PlannerRun(np.stack([_dist(1), _dist(1), _dist(2)])[:, None], np.array([10.0, 20.0, 60.0]))
    rows = {r["planner"]: r for r in table3(eam, eap, true_ep, 1, [0.5])}
    assert rows["EAM"]["recall_at_k"] == pytest.approx(1 / 3)
    assert rows["EAP"]["recall_at_k"] == pytest.approx(2 / 3)
    casc = rows["cascade eps=0.5"]
    # confidence 0.5 >= 0.5: prompt 0 keeps the EAM's plan (right), prompt 1 too (wrong), prompt 2
    # (0.2) falls back to the EAP's (right)
    assert casc["eam_share"] == pytest.approx(2 / 3)
    assert casc["recall_at_k"] == pytest.approx(2 / 3)
    # latency: the EAM's for every prompt, plus the EAP's where it falls back: 1, 1, 1 + 60
    assert casc["mean_latency_ms"] == pytest.approx(21.0)
    assert casc["p50_latency_ms"] == pytest.approx(1.0)
    # paired differences to the EAP alone: -9, -19, +1: mean -9, sample std 10, se 10 / sqrt(3)
    assert casc["latency_vs_eap_ms"] == pytest.approx(-9.0)
    assert casc["latency_vs_eap_se_ms"] == pytest.approx(10 / math.sqrt(3))


def test_eap_huber_loss_compares_the_softmax_plan_and_the_ep_scaled_by_the_expert_count() -> None:
    from moecast.train.eap import EAPModule

    module = EAPModule(huber_delta=1.0)
    logits = torch.zeros(1, 1, 4)  # a uniform plan: E * 1/4 = 1 per expert
    ep = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])  # E * EP = 4, 0, 0, 0
    # differences -3, 1, 1, 1; Huber at delta 1: |d| - 1/2 past delta, d^2 / 2 within: 2.5, .5, .5, .5
    assert float(module._huber(logits, ep)) == pytest.approx(1.0)


def test_eap_training_loss_weighs_the_contrastive_term_by_alpha() -> None:
    from moecast.train.eap import EAPModule

    module = EAPModule(alpha=0.05, huber_delta=1.0)
    module.log = lambda *a, **k: None
    logits = torch.zeros(1, 1, 4)
    module._logits = lambda prompts: (logits, torch.tensor(2.0))
    loss = module.training_step({"prompts": ["p"], "ep": torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])}, 0)
    assert float(loss) == pytest.approx(0.05 * 2.0 + 1.0)  # Eq. 9: alpha * InfoNCE + Huber


# ---------------------------------------------------------------------- settings
def test_split_fractions_that_leave_no_training_request_are_refused() -> None:
    from moecast.errors import InputError

    with pytest.raises(InputError, match="leaves no training requests"):
        SplitConfig(val_fraction=0.5, test_fraction=0.5)
    assert SplitConfig(val_fraction=0.5, test_fraction=0.4).test_fraction == 0.4


def test_patience_below_one_epoch_is_refused() -> None:
    from moecast.train.config import TrainConfig

    from moecast.errors import InputError

    with pytest.raises(InputError, match=r"train\.patience must be an integer in \[1, inf\], got 0"):
        TrainConfig(patience=0)


def test_a_config_section_keeps_the_fit_functions_own_defaults_for_the_fields_it_omits(
    tmp_path: Path,
) -> None:
    from moecast.train.config import config_args
    from moecast.train.llapor import fit_llapor

    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  patience: 3\nmodel:\n  hidden: 8\n")
    args = config_args(fit_llapor, cfg)
    # fit_llapor's recipe is 30 epochs (TrainConfig's own default is 10): the section only sets patience
    assert (args["train"].max_epochs, args["train"].patience) == (30, 3)
    assert args["model"].hidden == 8 and args["model"].lr_io == pytest.approx(2e-3)


# ---------------------------------------------------------------------- runs
def test_fit_seeds_the_generators_with_the_runs_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl
    from moecast.train.config import TrainConfig
    from moecast.train.runner import fit

    seeds: list[int] = []

    class Stop(Exception):
        """Stops ``fit`` before it builds the trainer: only the seed is checked."""

    def spy(seed: int, **kw: object) -> int:
        seeds.append(seed)
        raise Stop

    monkeypatch.setattr(pl, "seed_everything", spy)
    with pytest.raises(Stop):
        fit(None, None, tmp_path / "p.safetensors", TrainConfig(seed=7, logger=False))
    assert seeds == [7]


def test_a_failed_run_removes_only_a_run_directory_it_created(tmp_path: Path) -> None:
    from moecast.train.runner import _discard_failed_run

    earlier = tmp_path / "earlier.run"  # an earlier run's logs, no checkpoint: not this call's to remove
    (earlier / "csv").mkdir(parents=True)
    (earlier / "config.yaml").write_text("x: 1\n")
    _discard_failed_run(False, earlier)
    assert (earlier / "config.yaml").is_file()
    fresh = tmp_path / "fresh.run"
    (fresh / "csv").mkdir(parents=True)
    _discard_failed_run(True, fresh)
    assert not fresh.exists()


def test_the_export_gets_the_best_epochs_weights_and_metrics(tmp_path: Path) -> None:
    from moecast.train.runner import _load_best

    torch.manual_seed(0)
    best = torch.nn.Linear(2, 2)  # the best epoch's weights, as its checkpoint holds them
    ckpt = tmp_path / "best.ckpt"
    torch.save({"state_dict": best.state_dict(), "moecast_val": {"recall_at_k": 0.75}}, ckpt)
    module = torch.nn.Linear(2, 2)  # the last epoch's
    module.last_val = {"recall_at_k": 0.5}
    trainer = SimpleNamespace(checkpoint_callback=SimpleNamespace(best_model_path=str(ckpt)))
    assert _load_best(trainer, module) == str(ckpt)
    assert torch.equal(module.weight, best.weight) and torch.equal(module.bias, best.bias)
    assert module.last_val == {"recall_at_k": 0.75}


def test_table3_static_baseline_is_the_training_splits_mean_ep(traces: Path, monkeypatch) -> None:
    """The static row's plan is the mean EP of the training requests (the planners are built on
    train), never of the held-out requests it is scored on."""
    from moecast.predictors.base import Predictor
    from moecast.predictors.casmoe import ep_labels
    from moecast.predictors.eam import EAM
    from moecast.train import planner_report
    from moecast.train.planner_report import PlannerRun

    class Stub:
        def __init__(self) -> None:
            self.extra_meta: dict = {}

        def set_encoder(self, *args: object) -> None:
            pass

    class StubEAM(Stub, EAM):
        pass

    class StubEAP(Stub, Predictor):
        name, horizon = "eap", "prompt-ahead"

        def score_request(self, trace: object) -> np.ndarray:
            raise AssertionError

    ts = TraceSet(traces)
    sides = ts.splits(0.25, 0.1, 0)
    n, L, E = len(sides.val), ts.num_layers, ts.num_experts
    run = PlannerRun(np.full((n, L, E), 1 / E, np.float32), np.ones(n), np.ones(n))
    monkeypatch.setattr(planner_report, "time_planners", lambda *a: (run, run, None))
    seen = {}

    def spy(eam_run, eap_run, true_ep, k, epsilons, fallback, baseline):
        seen.update(true_ep=true_ep, baseline=baseline)
        return []

    monkeypatch.setattr(planner_report, "table3", spy)
    planner_report.compare_planners(StubEAM(), StubEAP(), traces, val_fraction=0.25, progress=False)
    train_ep = np.stack([ep_labels(ts, [r], False)[0][0] for r in sides.train])
    assert np.allclose(seen["baseline"], train_ep.mean(0), atol=1e-6)
    assert seen["true_ep"].shape == (n, L, E)
