"""`moecast train` end to end: typed fit functions + YAML, wandb/CSV logs in the run dir, export, resume, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import make_synthetic_traceset, quiet_trainer
from moecast.collect.traceset import TraceSet
from moecast.predictors import load
from moecast.predictors.commands import evaluate
from moecast.train.runner import run_dir_for

from moecast.cli import COMMANDS, main, run

torch.set_num_threads(1)


@pytest.fixture
def traces(tmp_path):
    return make_synthetic_traceset(
        tmp_path / "tr", num_requests=12, num_layers=3, num_experts=8, hidden=16, tokens=12
    )


def _args(cfg, traces, out, *extra):
    from moecast import configs_dir

    return [
        "--config",
        str(configs_dir() / cfg),
        "--traces",
        str(traces),
        "--out",
        str(out),
        "--train.progress_bar",
        "false",
        *extra,
    ]


def train(argv: list[str]) -> object:
    """``moecast train NAME ...`` as the command line runs it, errors raised rather than printed."""
    return run(["train", *argv])


def test_llapor_cli_trains_exports_and_resumes(traces, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ckpt" / "llapor.safetensors"
    train(
        [
            "llapor",
            *_args("llapor_tiny.yaml", traces, out, "--train.max_epochs", "2", "--model.hidden", "32"),
        ]
    )
    printed = capsys.readouterr().out
    assert "layer groups" in printed and out.is_file()
    run = run_dir_for(out)
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "checkpoints" / "best.ckpt").is_file()
    assert list((run / "wandb").glob("offline-run-*")), "wandb run must live in the run dir"
    metrics = next((run / "csv").glob("version_*/metrics.csv")).read_text()
    header = metrics.splitlines()[0].split(",")
    for name in ("recall", "precision", "f1_micro", "f1_macro"):  # overall, per layer, per group
        assert f"val/{name}" in header
        assert {f"val/{name}_layer/{layer}" for layer in (1, 2, 3)} <= set(header)
        assert any(h.startswith(f"val/{name}_group/") for h in header)
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "wandb").exists()
    # hyper-parameter override from the command line reached the model and the checkpoint
    pred = load(out, fingerprint=TraceSet(traces).meta.model.fingerprint)
    assert pred.metadata()["net"]["hidden"] == 32
    assert pred.metadata()["training"]["best_score"] is not None
    # re-run with more epochs: resumes from last.ckpt instead of starting over
    train(
        [
            "llapor",
            *_args("llapor_tiny.yaml", traces, out, "--train.max_epochs", "3", "--model.hidden", "32"),
        ]
    )
    assert "resuming from" in capsys.readouterr().out
    assert load(out).metadata()["training"]["epochs"] == 3
    res = evaluate(str(out), str(traces), json=True)
    assert 0.0 <= res["recall_at_k"] <= 1.0


def test_training_under_ddp(traces, tmp_path):
    """Two CPU ranks (Lightning's DDP relaunches `moecast train` once per rank): each builds the same
    split from the files, validates its shard, and the logged recall is the whole split's. The
    sequence model shards requests, the uneven case (5 over 2 ranks); LLaPor's loader takes the same
    sampler (test_llapor_validation_shards_over_ranks_without_repeats) and the same summed counts."""
    name = "sequence"
    out = tmp_path / "ddp.safetensors"
    cmd = [sys.executable, "-m", "moecast", "train", name]
    cmd += _args(f"{name}_tiny.yaml", traces, out, "--train.max_epochs", "1")
    cmd += ["--train.strategy", "ddp", "--train.devices", "2", "--data.val_fraction", "0.4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 exports
    logged = load(out).metadata()["training"]["best_score"]
    # the exported weights on one process over the whole val split: 5 requests, which the
    # sequence model's ranks split 3 / 2 (no request repeated to even the shards)
    assert len(TraceSet(traces).splits(0.4, 0.1, 0).val) == 5
    res = evaluate(str(out), str(traces), split="val", json=True)
    assert res["tokens"] == 5 * 12
    assert logged == pytest.approx(res["recall_at_k"], abs=1e-6)


@pytest.mark.parametrize("world", [1, 2, 7])
def test_llapor_validation_shards_over_ranks_without_repeats(world, traces, monkeypatch):
    """Under DDP each rank validates every world-th token row, unpadded: the shards together are the
    split, each row once (Lightning's default sampler would repeat rows to even them, and the summed
    counts would count those twice); on one process the loader keeps every row."""
    import torch.distributed as dist
    from moecast.train.data import LLaPorDataModule

    data = LLaPorDataModule(str(traces), val_fraction=0.4, batch_size=7)
    data.setup()
    n = len(data.val_rows)
    monkeypatch.setattr(dist, "is_initialized", lambda: world > 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: world)
    seen = []
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda *a, rank=rank, **k: rank)
        loader = data.val_dataloader()
        idx = list(loader.sampler)
        assert idx == list(range(rank, n, world))  # every world-th row, from the rank's own
        assert sum(len(b["target"]) for b in loader) == len(idx)  # the batches are the shard's rows
        seen += idx
    assert sorted(seen) == list(range(n))
    if world == 7:
        assert n % world  # uneven shards: a padding sampler would repeat rows to even them


def test_checkpoint_loads_without_lightning(traces, tmp_path):
    out = tmp_path / "seq.safetensors"
    train(["sequence", *_args("sequence_tiny.yaml", traces, out, "--train.max_epochs", "1")])
    code = (
        "import sys; from moecast.predictors import load; p = load(sys.argv[1]); "
        "assert p.horizon == 'token-ahead'; assert 'lightning' not in sys.modules; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
    res = evaluate(str(out), str(traces), split="all", json=True)
    assert res["predictor"] == "sequence" and res["tokens"] == 12 * 12


def test_sequence_scores_are_causal(traces):
    from moecast.predictors.sequence import SequenceConfig, SequenceNet, SequencePredictor

    torch.manual_seed(0)
    cfg = SequenceConfig(
        3, 8, 2, token_buckets=100, d_model=16, n_heads=2, n_blocks=1, ffn=16, dropout=0.0, max_len=8
    )
    pred = SequencePredictor(SequenceNet(cfg), [1, 2, 3])
    trace = TraceSet(traces).get(TraceSet(traces).request_ids[0])  # 12 tokens > max_len: windows too
    base = pred.score_request(trace)
    trace.token_ids = trace.token_ids.copy()
    trace.token_ids[7:] += 1
    ids = trace.topk_ids.copy()
    ids[6:] = (ids[6:] + 1) % 8  # routing of token 6 is first seen by token 7
    trace.topk_ids = ids
    after = pred.score_request(trace)
    assert base.shape == (12, 3, 8)
    assert (after[:7] == base[:7]).all()
    assert not (after[7:] == base[7:]).all()


def test_sequence_head_is_the_papers_two_layer_mlp_and_old_checkpoints_load(tmp_path):
    """MoE-Beyond's 2-layer GELU head by default; a checkpoint saved before head_hidden existed (one
    Linear head, no key in its config) still loads and scores the same."""
    from dataclasses import asdict

    from moecast.predictors.registry import load
    from moecast.predictors.sequence import SequenceConfig, SequenceNet, SequencePredictor

    small = dict(token_buckets=50, d_model=16, n_heads=2, n_blocks=1, ffn=16, max_len=8)
    assert isinstance(SequenceNet(SequenceConfig(2, 8, 2, **small)).head, torch.nn.Sequential)
    old = SequencePredictor(
        SequenceNet(SequenceConfig(2, 8, 2, head_hidden=0, **small)).eval(), [0, 1], "f" * 16
    )
    assert isinstance(old.net.head, torch.nn.Linear)
    cfg = asdict(old.cfg)
    del cfg["head_hidden"]
    path = old.save(tmp_path / "old.safetensors", {"config": cfg})
    back = load(path)
    x = (torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 16))
    with torch.no_grad():
        assert torch.equal(back.net(*x), old.net(*x))


def test_sequence_window_of_one_token_finishes(traces):
    """max_len 1 made the sliding window's stride max_len // 2 = 0: scoring never finished. Each
    token is now scored in a window of its own; a config with no window at all is refused."""
    import signal

    from moecast.predictors.sequence import SequenceConfig, SequenceNet, SequencePredictor, sequence_inputs

    torch.manual_seed(0)
    small = dict(token_buckets=100, d_model=16, n_heads=2, n_blocks=1, ffn=16, dropout=0.0)
    pred = SequencePredictor(SequenceNet(SequenceConfig(3, 8, 2, max_len=1, **small)), [1, 2, 3])
    trace = TraceSet(traces).get(TraceSet(traces).request_ids[0])

    def hung(*_: object) -> None:
        raise TimeoutError("score_request with max_len 1 did not finish")

    # a hang fails the test instead of blocking the run
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        out = pred.score_request(trace)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    tok, prev = sequence_inputs(trace.token_ids, trace.topk_ids, pred.cfg)
    with torch.no_grad():
        alone = [
            torch.sigmoid(
                pred.net(torch.from_numpy(tok[t : t + 1])[None], torch.from_numpy(prev[t : t + 1])[None])
            )
            for t in range(len(tok))
        ]
    assert out.shape == (12, 3, 8)
    assert torch.allclose(torch.from_numpy(out), torch.cat([a[0] for a in alone]))
    with pytest.raises(ValueError, match="max_len must be a positive integer, got 0"):
        SequenceConfig(3, 8, 2, max_len=0)


@pytest.mark.parametrize(
    ("section", "kwargs", "message"),
    [
        ("data", {"max_len": 1}, r"data\.max_len must be an integer in \[2, inf\], got 1"),
        ("data", {"max_len": 0}, r"data\.max_len"),
        ("data", {"token_buckets": 0}, r"data\.token_buckets must be an integer in \[1, inf\], got 0"),
        ("data", {"batch_size": 0}, r"data\.batch_size"),
        ("data", {"val_fraction": 0.0}, r"data\.val_fraction"),
        ("data", {"val_fraction": 1.0}, r"data\.val_fraction"),
        ("data", {"seed": 0.5}, r"data\.seed"),
        ("data", {"max_requests": 0}, r"data\.max_requests"),
        ("data", {"num_workers": -1}, r"data\.num_workers"),
        (
            "model",
            {"d_model": 30, "n_heads": 4},
            r"model\.d_model \(30\) must be divisible by model\.n_heads \(4\)",
        ),
        ("model", {"n_heads": 0}, r"model\.n_heads"),
        ("model", {"d_model": 0}, r"model\.d_model"),
        ("model", {"n_blocks": 0}, r"model\.n_blocks"),
        ("model", {"ffn": 0}, r"model\.ffn"),
        ("model", {"dropout": 1.0}, r"model\.dropout"),
        ("model", {"head_hidden": -1}, r"model\.head_hidden"),
        ("model", {"lr": 0.0}, r"model\.lr"),
        ("model", {"weight_decay": -0.1}, r"model\.weight_decay"),
        ("model", {"warmup_epochs": -1}, r"model\.warmup_epochs"),
        ("model", {"warmup_epochs": 1.5}, r"model\.warmup_epochs"),
    ],
)
def test_sequence_hyper_parameters_are_checked_up_front(section, kwargs, message):
    """Bad values are one-line ValueErrors when the modules are built, not torch tracebacks later."""
    from moecast.train.sequence import SequenceDataModule, SequenceModule

    with pytest.raises(ValueError, match=message) as exc:
        if section == "data":
            SequenceDataModule("never-read", **kwargs)
        else:
            SequenceModule(**kwargs)
    assert "\n" not in str(exc.value)


def test_sequence_schedule_needs_an_epoch_count():
    """max_epochs -1 (bounded by time or steps only) used to squeeze warm-up and cosine into one epoch."""
    from moecast.train.sequence import SequenceModule

    module = SequenceModule()
    module.net = torch.nn.Linear(2, 2)
    trainer = quiet_trainer(-1, max_steps=1)
    module.trainer = trainer
    with pytest.raises(ValueError, match=r"train\.max_epochs must be a positive number of epochs, got -1"):
        module.configure_optimizers()
    trainer.fit_loop.max_epochs = 3  # a planned run still gets its schedule
    assert module.configure_optimizers()["lr_scheduler"]["interval"] == "epoch"


def test_sequence_checkpoint_carries_its_epochs_metrics(traces, tmp_path):
    """best.ckpt holds the validation metrics of the epoch its weights are from, for the export."""
    import lightning.pytorch as pl
    from moecast.train.sequence import SequenceDataModule, SequenceModule

    pl.seed_everything(0)
    dm = SequenceDataModule(str(traces), val_fraction=0.25, batch_size=4, token_buckets=64, max_len=16)
    module = SequenceModule(d_model=16, n_heads=2, n_blocks=1, ffn=16, head_hidden=16)
    trainer = quiet_trainer(1, devices=1, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "epoch.ckpt")
    saved = torch.load(tmp_path / "epoch.ckpt", map_location="cpu", weights_only=False)["moecast_val"]
    assert saved["recall_at_k"] == pytest.approx(float(trainer.callback_metrics["val/recall"]))
    assert saved == module.last_val and len(saved["per_layer"]) == 3


def test_cli_errors_are_one_line(traces, tmp_path):
    from moecast.errors import InputError

    with pytest.raises(InputError, match="required: out"):
        train(["llapor", "--traces", str(traces)])
    with pytest.raises(InputError, match=r"train\.max_epochs must be an integer in \[1, inf\], got 0"):
        train(
            [
                "llapor",
                *_args("llapor_tiny.yaml", traces, tmp_path / "x.safetensors", "--train.max_epochs", "0"),
            ]
        )
    with pytest.raises(FileNotFoundError, match="resume"):
        train(
            [
                "llapor",
                *_args(
                    "llapor_tiny.yaml",
                    traces,
                    tmp_path / "x.safetensors",
                    "--resume",
                    str(tmp_path / "none.ckpt"),
                ),
            ]
        )
    assert set(COMMANDS["train"]) >= {"llapor", "sequence", "eap", "eam", "cascade"}
    for argv in (["train", "nope"], ["train", "llapor", "--traces", str(traces)]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        msg = str(exc.value.code)
        assert msg.startswith("moecast") and "\n" not in msg, msg
    assert "required: out" in msg and "moecast train llapor --help" in msg


def test_empty_training_split_is_reported(tmp_path):
    one = make_synthetic_traceset(tmp_path / "one", num_requests=1)
    with pytest.raises(ValueError, match="empty"):
        train(["llapor", *_args("llapor_tiny.yaml", one, tmp_path / "o.safetensors")])
