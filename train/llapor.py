"""LLaPor training (PreScope §4.2.2): per-group loss, AdamW by layer group, warm-up + cosine, augmentation.

- Loss (``loss: focal``, the paper's): input/output groups L = L_expert (BCE weighted
  by 1/f_i) + lambda * L_focal; the paper gives no middle-group loss, so the middle
  group uses the balancing term plus ``lam_middle`` * focal (default 0: balancing BCE
  alone). ``loss: softmax`` instead ranks the experts of each (token, layer) with a
  softmax cross-entropy against the true top-k set (aligned with recall@k);
  ``loss: bce`` is plain per-expert BCE. ``distill`` > 0 (softmax loss only) mixes the
  router's recorded probabilities, softened by ``distill_temperature``, into the softmax
  target (``distill_softmax_loss``; needs ``router_probs`` in the TraceSet). Validation
  loss and online updates keep the hard top-k target.
- Optimiser: AdamW with one parameter group per layer group (lr and weight decay
  from config; the middle group gets higher ones, as in the paper) plus one for
  the shared parts (input tables, token embedding). Input/output groups and the
  shared parts: linear warm-up for ``warmup_epochs`` then cosine annealing; middle
  group: cosine annealing without warm-up.
- Augmentation, training only: Gaussian noise on the dense features and random masking of
  sparse feature ids (``mask_prob``) and of dense features (``mask_dense``, default 0). Masking
  single PCA components of the gate input cost tiny LLaPor 0.011 val recall@4 (1024 requests,
  8 epochs, best val 0.9011 with ``mask_dense`` 0.1, 0.9118 with 0): the leading components carry most of
  the signal, so zeroing one at random removes much of a row's information rather than adding
  robustness (``configs/llapor_tiny.yaml`` records the runs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from moecast.predictors.context_memory import MemoryConfig, build
from moecast.predictors.llapor import LLaPor
from moecast.predictors.llapor_net import (
    LOSSES,
    LLaPorNet,
    NetConfig,
    distill_softmax_loss,
    group_lambda,
    llapor_loss,
)
from moecast.predictors.metrics import MetricAccumulator
from moecast.train.config import TrainConfig, check_range
from moecast.train.data import LLaPorData, LLaPorDataModule
from moecast.train.module import RecallModule, planned_epochs, warm_cosine
from moecast.train.runner import fit

from moecast.errors import InputError


@dataclass(frozen=True)
class LLaPorModel:
    """LLaPor's network, loss and optimiser (PreScope §4.2.1-2): one network per layer, grouped.

    Args:
        hidden: width of each layer's network
        depth_io: hidden Linear-GELU-Dropout layers of the input and output groups
        depth_middle: hidden layers of the middle group, which also has the gated residual block
        dropout: dropout after each hidden layer
        lr_io: AdamW learning rate of the input and output groups (warm-up, then cosine)
        lr_middle: AdamW learning rate of the middle group (cosine, no warm-up)
        lr_shared: AdamW learning rate of the shared parts (embeddings, input tables)
        weight_decay_io: AdamW weight decay of the input/output groups and the shared parts
        weight_decay_middle: AdamW weight decay of the middle group
        warmup_epochs: linear warm-up epochs of the input/output groups (PreScope: 5)
        lam_io: lambda of the focal term, input and output groups (the paper leaves it open)
        lam_middle: lambda of the focal term, middle group (0: expert-balancing BCE alone)
        gamma: focal-loss focusing parameter
        noise_std: Gaussian noise on the dense features while training
        mask_prob: share of sparse feature ids masked while training
        mask_dense: share of dense features zeroed while training
        loss: focal (the paper's: balancing BCE weighted by 1/f_i plus lambda * focal) | softmax
            (a softmax over each row's experts against the true top-k: ranks them as recall@k scores)
        distill: weight of the router's probabilities in the softmax target (needs router_probs)
        distill_temperature: temperature that softens those probabilities
        distill_first: the first MoE layer's distill weight (null: distill)
        memory_ngrams: context lengths of the context memory built from the training split at
            export (predictors/context_memory.py; not PreScope's); empty: no memory
        memory_postings: occurrences the memory keeps per context (the latest)
        memory_weight: the memory's votes against the network's softmax (both sum to k)
    """

    hidden: int = 256
    depth_io: int = 1
    depth_middle: int = 2
    dropout: float = 0.1
    lr_io: float = 2e-3
    lr_middle: float = 3e-3
    lr_shared: float = 2e-3
    weight_decay_io: float = 1e-4
    weight_decay_middle: float = 1e-3
    warmup_epochs: int = 5
    lam_io: float = 0.5
    lam_middle: float = 0.0
    gamma: float = 2.0
    noise_std: float = 0.05
    mask_prob: float = 0.1
    mask_dense: float = 0.0
    loss: str = "focal"
    distill: float = 0.0
    distill_temperature: float = 2.0
    distill_first: float | None = None
    memory_ngrams: list[int] | None = None
    memory_postings: int = 32
    memory_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise InputError(f"model.loss must be one of {', '.join(LOSSES)}, not {self.loss!r}")
        m = "model"
        check_range(m, "distill", self.distill, float, 0, 1)
        check_range(m, "distill_temperature", self.distill_temperature, float, 0, open_lo=True)
        check_range(m, "distill_first", self.distill_first, float, 0, 1, optional=True)
        if max(self.distill, self.distill_first or 0.0) > 0 and self.loss != "softmax":
            raise InputError(
                f"model.distill mixes the router's probabilities into the softmax loss; set model.loss: softmax (not {self.loss!r}) or model.distill: 0"
            )
        for name in ("hidden", "depth_io", "depth_middle"):
            check_range(m, name, getattr(self, name), int, 1)
        check_range(m, "warmup_epochs", self.warmup_epochs, int, 0)
        for name in ("dropout", "mask_prob", "mask_dense"):
            check_range(m, name, getattr(self, name), float, 0, 1, open_hi=True)
        for name in ("lr_io", "lr_middle", "lr_shared"):
            check_range(m, name, getattr(self, name), float, 0, open_lo=True)
        for name in ("weight_decay_io", "weight_decay_middle", "lam_io", "lam_middle", "gamma", "noise_std"):
            check_range(m, name, getattr(self, name), float, 0)
        self.memory()  # checked now, not after hours of training at export

    def memory(self) -> MemoryConfig | None:
        """The context memory built at export, or None."""
        if not self.memory_ngrams:
            return None
        return MemoryConfig(tuple(self.memory_ngrams), self.memory_postings, self.memory_weight)


class LLaPorModule(RecallModule):
    """Trains all of a model's LLaPor predictors together, as :class:`LLaPorModel` says.

    ``LLaPorModule(config)``, or the settings as keywords (``hidden=32``).
    """

    def __init__(self, config: LLaPorModel | None = None, **settings: Any) -> None:
        super().__init__()
        config = config if config is not None else LLaPorModel(**settings)
        self.memory_config = config.memory()
        self.save_hyperparameters(dataclasses.asdict(config))
        self.net: LLaPorNet | None = None

    # ------------------------------------------------------------------ build from the data
    def setup(self, stage: str | None = None) -> None:
        if self.net is not None:
            return
        dm = self.trainer.datamodule
        hp = self.hparams
        weights = torch.full((dm.spec.num_layers, 1), float(hp.get("distill", 0.0)))
        if hp.get("distill_first") is not None:
            weights[0] = float(hp.distill_first)  # the first MoE layer: token and context features only
        # decided once here, not per step: None when the loss is the top-k one
        self.register_buffer(
            "distill_weights", weights if bool(weights.max() > 0) else None, persistent=False
        )
        if self.distill_weights is not None and dm.probs is None:
            raise InputError(
                f"model.distill > 0 needs the router's probabilities, and {dm.ts.path} has no router_probs "
                "(or data.soft_targets is false); collect with router probabilities or set model.distill: 0"
            )
        self.net = LLaPorNet(
            dm.spec, dm.groups, NetConfig(hp.hidden, hp.depth_io, hp.depth_middle, hp.dropout)
        )
        if dm.spec.gate_pca:
            self.net.pca.components.copy_(torch.from_numpy(dm.pca_components))
            self.net.pca.mean.copy_(torch.from_numpy(dm.pca_mean))
        if dm.spec.token_exact:
            self.net.tok_vocab.copy_(torch.from_numpy(dm.token_vocab))
        self.register_buffer("inv_freq", torch.from_numpy(dm.inv_freq))
        lam = group_lambda(dm.spec.num_layers, dm.groups, hp.lam_io, hp.lam_middle)
        self.register_buffer("lam", lam)
        self.moe_layers = list(dm.ts.meta.model.moe_layers)
        self.layer_groups = self.net.groups

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch["bags"], batch.get("tokens"), batch.get("dense"), batch.get("route"))

    def _augment(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hp = self.hparams
        out = dict(batch)
        if hp.mask_prob > 0:
            drop = torch.rand(batch["bags"].shape, device=self.device) < hp.mask_prob
            out["bags"] = torch.where(drop, self.net.spec.vocab, batch["bags"])
        if "dense" in batch:
            d = batch["dense"]
            if hp.noise_std > 0:
                d = d + hp.noise_std * d.std().clamp_min(1e-6) * torch.randn_like(d)
            if hp.mask_dense > 0:
                d = d * (torch.rand_like(d) >= hp.mask_dense)
            out["dense"] = d
        return out

    def _loss(
        self, logits: torch.Tensor, target: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        kind = self.hparams.get("loss", "focal")
        weights = getattr(self, "distill_weights", None)
        if probs is not None and weights is not None:
            temp = float(self.hparams.get("distill_temperature", 2.0))
            return distill_softmax_loss(logits, target, probs, weights, temp)
        return llapor_loss(kind, logits, target, self.inv_freq, self.lam, self.hparams.gamma)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(self._augment(batch))
        loss = self._loss(logits, batch["target"], batch.get("probs"))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(logits))
        return loss

    # ------------------------------------------------------------------ validation metrics
    def on_validation_epoch_start(self) -> None:
        spec = self.net.spec
        self._acc = MetricAccumulator(spec.num_layers, spec.num_experts, spec.top_k)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch)
        loss = self._loss(logits, batch["target"])
        truth = batch["target"].topk(self.net.spec.top_k, dim=-1).indices  # the k true experts
        self._acc.update(logits.detach().float().cpu().numpy(), truth.cpu().numpy())
        self.log("val/loss", loss, batch_size=len(logits))

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        groups: list[dict[str, Any]] = []
        shared = [p for n, p in self.net.named_parameters() if not n.startswith("bodies.")]
        groups.append(
            {"params": shared, "lr": hp.lr_shared, "weight_decay": hp.weight_decay_io, "warm": True}
        )
        for g, body in self.net.bodies.items():
            mid = g == "middle"
            groups.append(
                {
                    "params": list(body.parameters()),
                    "lr": hp.lr_middle if mid else hp.lr_io,
                    "weight_decay": hp.weight_decay_middle if mid else hp.weight_decay_io,
                    "warm": not mid,
                }
            )
        warms = [pg.pop("warm") for pg in groups]
        opt = torch.optim.AdamW(groups)
        total = planned_epochs(self.trainer, "the learning-rate warm-up and cosine")
        warm = warm_cosine(min(hp.warmup_epochs, max(total - 1, 0)), total)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [warm if w else warm_cosine(0, total) for w in warms])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    # ------------------------------------------------------------------ export
    def export(self, out: Path, dm: LLaPorDataModule, info: dict[str, Any]) -> Path:
        """Write the trained predictor as one .safetensors loadable by ``moecast.predictors.load``."""
        m = dm.ts.meta.model
        memory = None
        if self.memory_config is not None:
            memory = build(dm.ts, dm.train_ids, self.memory_config, progress=True)
            print(f"context memory: {len(memory.keys)} contexts of {len(memory.routes)} training tokens")
        pred = LLaPor(self.net.cpu().eval(), m.moe_layers, m.fingerprint, memory=memory)
        return pred.save(out, {**self.run_metadata(dm, info), "net": dataclasses.asdict(self.net.net)})


# fit_llapor's defaults (frozen: one instance serves every call); the epochs are bounded, as measured
# with configs/llapor_tiny.yaml
_MODEL, _DATA, _TRAIN = LLaPorModel(), LLaPorData(), TrainConfig(max_epochs=30, patience=8)


def fit_llapor(
    traces: str,
    out: str,
    model: LLaPorModel = _MODEL,
    data: LLaPorData = _DATA,
    train: TrainConfig = _TRAIN,
    run_dir: str | None = None,
    resume: str = "auto",
    json: bool = False,
) -> Path:
    """Train LLaPor (PreScope §4.2) on a TraceSet and write its checkpoint.

    Args:
        traces: TraceSet directory to train on.
        out: the predictor checkpoint to write (.safetensors).
        model: the network, loss and optimiser.
        data: the split and the features.
        train: epochs, early stopping, devices, logging.
        run_dir: Lightning and wandb run directory (default ``<out>.run`` beside ``out``).
        resume: auto (from the run directory's last.ckpt when present), never, or a .ckpt path.
        json: print the closing line as one JSON object (checkpoint, best score, run dir, epochs).
    """
    settings = {"traces": traces, "out": out, "model": model, "data": data, "train": train}
    return fit(
        LLaPorModule(model), LLaPorDataModule(traces, data), out, train, run_dir, resume, settings, json=json
    )
