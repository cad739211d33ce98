"""Training of the MoE-Beyond-style sequence predictor (MoE-Beyond §3.2): multi-label BCE over every layer.

Batches are whole requests (padded to the longest in the batch, truncated to
``max_len``); the loss is binary cross-entropy over (token, layer, expert), with
padding masked out. AdamW with linear warm-up then cosine annealing per epoch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from moecast.predictors.metrics import MetricAccumulator, multi_hot
from moecast.predictors.sequence import SequenceConfig, SequenceNet, SequencePredictor
from moecast.train.config import SplitConfig, TrainConfig, check_range
from moecast.train.data import TracesDataModule, batch_loader
from moecast.train.module import RecallModule, planned_epochs, warm_cosine
from moecast.train.runner import fit
from torch.utils.data import DataLoader

from moecast.errors import InputError


@dataclass(frozen=True)
class SequenceData(SplitConfig):
    """Requests of a TraceSet as padded token sequences (request-level split via TraceSet.split).

    Args:
        val_fraction: share of requests held out for validation: selects the best epoch
        test_fraction: share of requests held out for testing, never trained or selected on
        seed: split seed
        max_requests: train on at most this many requests (all when null)
        batch_size: requests per batch
        token_buckets: rows of the token embedding (ids hashed into them)
        max_len: tokens per request seen in training (longer ones are cut); the predictor's window
        num_workers: DataLoader worker processes
    """

    batch_size: int = 16
    token_buckets: int = 32768
    max_len: int = 256
    num_workers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        d = "data"
        check_range(d, "batch_size", self.batch_size, int, 1)
        check_range(d, "token_buckets", self.token_buckets, int, 1)
        # requests are truncated to max_len: with 1 only each request's first token is trained on,
        # and its previous-token routing input is always empty
        check_range(d, "max_len", self.max_len, int, 2)
        check_range(d, "num_workers", self.num_workers, int, 0)


class SequenceDataModule(TracesDataModule):
    """The sequence model's training data, as :class:`SequenceData` says (or its settings as keywords)."""

    config_class = SequenceData
    config: SequenceData

    def setup(self, stage: str | None = None) -> None:
        if self._built:
            return
        hp = self.hparams
        ts = self._open()
        m = ts.meta.model
        order = self.train_ids + self.val_ids
        self.topk = np.ascontiguousarray(ts.array("topk_ids", order))
        self.tokens = ts.column("token_id", order).astype(np.int64) % hp.token_buckets
        lengths = ts.request_lengths(order)
        self.starts = np.cumsum(lengths) - lengths
        self.lengths = np.minimum(lengths, hp.max_len)
        self.cfg = SequenceConfig(
            m.num_layers, m.num_experts, m.top_k, token_buckets=hp.token_buckets, max_len=hp.max_len
        )
        n = len(self.train_ids)
        self.train_req = np.arange(n)
        self.val_req = np.arange(n, len(order))
        self._built = True

    def batch(self, reqs: np.ndarray) -> dict[str, torch.Tensor]:
        L, E = self.cfg.num_layers, self.cfg.num_experts
        T = int(self.lengths[reqs].max())
        B = len(reqs)
        tokens = np.zeros((B, T), np.int64)
        prev = np.zeros((B, T, L * E), np.float32)
        target = np.zeros((B, T, L, E), np.float32)
        pad = np.ones((B, T), bool)
        for i, r in enumerate(reqs):
            s, n = int(self.starts[r]), int(self.lengths[r])
            hot = multi_hot(self.topk[s : s + n], E, np.float32)
            tokens[i, :n] = self.tokens[s : s + n]
            prev[i, 1:n] = hot[:-1].reshape(n - 1, L * E)
            target[i, :n] = hot
            pad[i, :n] = False
        return {
            "tokens": torch.from_numpy(tokens),
            "prev": torch.from_numpy(prev),
            "target": torch.from_numpy(target),
            "pad": torch.from_numpy(pad),
        }

    def _loader(self, reqs: np.ndarray, train: bool) -> DataLoader:
        hp = self.hparams
        return batch_loader(self.batch, reqs, hp.batch_size, train, hp.num_workers, str(self.traces))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_req, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_req, False)


@dataclass(frozen=True)
class SequenceModel:
    """MoE-Beyond sequence predictor training (§3.2; the defaults are the paper's sizes).

    Args:
        d_model: encoder width (paper: 512).
        n_heads: attention heads (paper: 8).
        n_blocks: encoder layers (paper: 4).
        ffn: feed-forward width (paper: 2048).
        dropout: dropout in the encoder.
        head_hidden: width of the 2-layer GELU head; null = d_model, 0 = a single Linear.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay (paper: 0.01).
        warmup_epochs: linear warm-up before cosine decay.
    """

    d_model: int = 512
    n_heads: int = 8
    n_blocks: int = 4
    ffn: int = 2048
    dropout: float = 0.1
    head_hidden: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_epochs: int = 1

    def __post_init__(self) -> None:
        m = "model"
        for name in ("d_model", "n_heads", "n_blocks", "ffn"):
            check_range(m, name, getattr(self, name), int, 1)
        if self.d_model % self.n_heads:
            # torch's multi-head attention splits d_model evenly over the heads and only asserts it
            raise InputError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}); change one of them"
            )
        check_range(m, "dropout", self.dropout, float, 0, 1, open_hi=True)
        check_range(m, "head_hidden", self.head_hidden, int, 0, optional=True)
        check_range(m, "lr", self.lr, float, 0, open_lo=True)
        check_range(m, "weight_decay", self.weight_decay, float, 0)
        check_range(m, "warmup_epochs", self.warmup_epochs, int, 0)


class SequenceModule(RecallModule):
    """The sequence model's training, as :class:`SequenceModel` says (or its settings as keywords)."""

    def __init__(self, config: SequenceModel | None = None, **settings: Any) -> None:
        super().__init__()
        config = config if config is not None else SequenceModel(**settings)
        self.save_hyperparameters(dataclasses.asdict(config))
        self.net: SequenceNet | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.net is not None:
            return
        dm = self.trainer.datamodule
        hp = self.hparams
        c = dm.cfg
        self.cfg = SequenceConfig(
            c.num_layers,
            c.num_experts,
            c.top_k,
            c.token_buckets,
            hp.d_model,
            hp.n_heads,
            hp.n_blocks,
            hp.ffn,
            hp.dropout,
            c.max_len,
            hp.head_hidden,
        )
        self.net = SequenceNet(self.cfg)
        self.moe_layers = list(dm.ts.meta.model.moe_layers)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(batch["tokens"], batch["prev"], batch["pad"])
        keep = (~batch["pad"]).float()[..., None, None]
        bce = F.binary_cross_entropy_with_logits(logits, batch["target"], reduction="none")
        return (bce * keep).sum() / (keep.sum() * logits.shape[2] * logits.shape[3]).clamp_min(1), logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["tokens"]))
        return loss

    def on_validation_epoch_start(self) -> None:
        self._acc = MetricAccumulator(self.cfg.num_layers, self.cfg.num_experts, self.cfg.top_k)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        valid = ~batch["pad"]  # [B, T]: the real tokens
        truth = batch["target"][valid].topk(self.cfg.top_k, dim=-1).indices  # [N, L, k]
        self._acc.update(logits[valid].detach().float().cpu().numpy(), truth.cpu().numpy())
        self.log("val/loss", loss, batch_size=len(batch["tokens"]))

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        total = planned_epochs(self.trainer, "the learning-rate warm-up and cosine")
        opt = torch.optim.AdamW(self.net.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        schedule = warm_cosine(min(hp.warmup_epochs, max(total - 1, 0)), total)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule),
                "interval": "epoch",
            },
        }

    def export(self, out: Path, dm: SequenceDataModule, info: dict[str, Any]) -> Path:
        m = dm.ts.meta.model
        pred = SequencePredictor(self.net.cpu().eval(), m.moe_layers, m.fingerprint)
        extra = {**self.run_metadata(dm, info), "net": dataclasses.asdict(self.cfg)}
        return pred.save(out, extra)


# fit_sequence's defaults (frozen: one instance serves every call); the epochs are bounded
_MODEL, _DATA, _TRAIN = SequenceModel(), SequenceData(), TrainConfig(max_epochs=10, patience=5)


def fit_sequence(
    traces: str,
    out: str,
    model: SequenceModel = _MODEL,
    data: SequenceData = _DATA,
    train: TrainConfig = _TRAIN,
    run_dir: str | None = None,
    resume: str = "auto",
    json: bool = False,
) -> Path:
    """Train the MoE-Beyond sequence predictor (§3.2) on a TraceSet and write its checkpoint.

    Args:
        traces: TraceSet directory to train on.
        out: the predictor checkpoint to write (.safetensors).
        model: the encoder, its head and optimiser.
        data: the split and the sequences.
        train: epochs, early stopping, devices, logging.
        run_dir: Lightning and wandb run directory (default ``<out>.run`` beside ``out``).
        resume: auto (from the run directory's last.ckpt when present), never, or a .ckpt path.
        json: print the closing line as one JSON object (checkpoint, best score, run dir, epochs).
    """
    settings = {"traces": traces, "out": out, "model": model, "data": data, "train": train}
    return fit(
        SequenceModule(model),
        SequenceDataModule(traces, data),
        out,
        train,
        run_dir,
        resume,
        settings,
        json=json,
    )
