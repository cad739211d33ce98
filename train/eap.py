"""Training CasMoE's Expert Activation Predictor (casmoe-eam-eap-cascade.md, "End-to-End EAP Training", Eqs. 6-9).

``EAPModule`` + ``EAPDataModule``: ``moecast train eap --config configs/eap_minilm.yaml
--traces T --out eap.safetensors``. Loss Eq. 9: alpha * InfoNCE (Eqs. 6-7, SimCSE: the
same prompts encoded twice with dropout as the positives, temperature tau) + Huber
(Eq. 8, delta) between the per-layer softmax plan and the EP label (Eq. 3). With
``freeze_encoder`` the encoder is not trained, its embeddings are computed once and only
the heads learn (the contrastive term then has nothing to train and is skipped).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from moecast.collect.traceset import open_traces
from moecast.predictors.casmoe import ep_labels, plan_recall, plan_truth, prompt_texts
from moecast.predictors.eap import EAP, EAPNet, load_encoder, tokenizer_limit
from moecast.predictors.metrics import MetricAccumulator
from moecast.predictors.sentence_encoder import encoder_identity, encoder_spec
from moecast.train.casmoe import PlanData, data_info, per_layer_table
from moecast.train.config import TrainConfig, check_range
from moecast.train.data import eval_sampler
from moecast.train.module import log_validation
from moecast.train.runner import fit
from torch.utils.data import DataLoader
from tqdm import tqdm

from moecast.errors import InputError


@dataclass(frozen=True)
class EAPData(PlanData):
    """(prompt, EP) pairs of a TraceSet, split by request (CasMoE "Data Calibration", dataset D).

    Args:
        val_fraction: share of requests in val, which selects the best epoch (``TraceSet.splits``).
        test_fraction: share of requests in test, never trained or selected on.
        seed: split seed.
        max_requests: use only the first N training requests (quick runs).
        include_decode: count decoded tokens in the EP label too (Eq. 3 sums the prompt's).
        batch_size: prompts per step (also the InfoNCE negatives).
    """

    batch_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("data", "batch_size", self.batch_size, int, 1)


class EAPDataModule(L.LightningDataModule):
    """The EAP's training pairs, as :class:`EAPData` says (or its settings as keywords)."""

    def __init__(self, traces: str, config: EAPData | None = None, **settings: Any) -> None:
        super().__init__()
        config = config if config is not None else EAPData(**settings)
        self.traces = traces
        self.batch_size = config.batch_size
        self.val_fraction = config.val_fraction
        self.test_fraction = config.test_fraction
        self.seed = config.seed
        self.include_decode = config.include_decode
        self.max_requests = config.max_requests
        self.info: dict[str, Any] = {}
        self._ready = False

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        ts = open_traces(self.traces)
        splits = ts.splits(self.val_fraction, self.test_fraction, self.seed)
        train_ids, val_ids = splits.train, splits.val
        if self.max_requests:
            train_ids = train_ids[: self.max_requests]
        if not train_ids or not val_ids:
            raise InputError(
                f"{self.traces}: {len(train_ids)} training and {len(val_ids)} held-out requests; "
                "EAP training needs both (more requests or another --data.val_fraction)"
            )
        ep_train, weighted = ep_labels(ts, train_ids, self.include_decode)
        ep_val, _ = ep_labels(ts, val_ids, self.include_decode)
        self.train_pairs = list(zip(prompt_texts(ts, train_ids), ep_train))
        self.val_pairs = list(zip(prompt_texts(ts, val_ids), ep_val))
        self.info = data_info(ts, self.traces, weighted, self.include_decode)
        self.info.update(train_requests=len(train_ids), val_requests=len(val_ids))
        self.info["split"] = {**splits.metadata(), "train_requests": len(train_ids)}
        self._ready = True

    @staticmethod
    def collate(batch: list[tuple[str, np.ndarray]]) -> dict[str, Any]:
        return {"prompts": [p for p, _ in batch], "ep": torch.from_numpy(np.stack([e for _, e in batch]))}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_pairs, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_pairs,
            batch_size=max(self.batch_size, 64),
            collate_fn=self.collate,
            sampler=eval_sampler(len(self.val_pairs)),
        )


@dataclass(frozen=True)
class EAPModel:
    """EAP training (CasMoE Eqs. 6-9): encoder + per-layer heads, alpha*InfoNCE + Huber.

    The defaults are the recipe measured on a CPU: a frozen encoder (its embeddings computed once,
    the heads trained on them); configs/eap_minilm.yaml fine-tunes the encoder instead.

    Args:
        encoder: 'minilm' (the packaged all-MiniLM-L6-v2) or a local Hugging Face encoder folder.
        max_length: token limit for prompts (longer ones are truncated, said once).
        freeze_encoder: train only the heads on fixed embeddings (fast on a CPU).
        hidden: shared projection width (paper: 64).
        intermediate: per-layer head width (paper: 128).
        dropout: head dropout; the encoder's own dropout makes the SimCSE positives.
        alpha: weight of the contrastive loss in Eq. 9 (paper: 0.05).
        tau: InfoNCE temperature of Eq. 6 (SimCSE: 0.05).
        huber_delta: delta of Eq. 8, on EP scaled by E (a uniform expert's share is 1).
        lr: learning rate of the heads (Adam).
        encoder_lr: learning rate of the encoder (the paper's 6e-7 barely moves it in a few epochs).
        weight_decay: AdamW weight decay.
        eval_k: k of the plan recall@k (default: the model's top-k).
    """

    encoder: str = "minilm"
    max_length: int = 256
    freeze_encoder: bool = True
    hidden: int = 64
    intermediate: int = 128
    dropout: float = 0.1
    alpha: float = 0.05
    tau: float = 0.05
    huber_delta: float = 1.0
    lr: float = 3e-3
    encoder_lr: float = 2e-5
    weight_decay: float = 0.0
    eval_k: int | None = None

    def __post_init__(self) -> None:
        m = "model"
        for name in ("max_length", "hidden", "intermediate"):
            check_range(m, name, getattr(self, name), int, 1)
        check_range(m, "dropout", self.dropout, float, 0, 1, open_hi=True)
        for name in ("tau", "huber_delta", "lr", "encoder_lr"):
            check_range(m, name, getattr(self, name), float, 0, open_lo=True)
        for name in ("alpha", "weight_decay"):
            check_range(m, name, getattr(self, name), float, 0)
        check_range(m, "eval_k", self.eval_k, int, 1, optional=True)


class EAPModule(L.LightningModule):
    """The EAP's training, as :class:`EAPModel` says (or its settings as keywords)."""

    def __init__(self, config: EAPModel | None = None, **settings: Any) -> None:
        config = config if config is not None else EAPModel(**settings)
        super().__init__()
        self.save_hyperparameters(dataclasses.asdict(config))
        self.net: EAPNet | None = None
        self.tokenizer: Any = None
        self._cache: dict[str, torch.Tensor] = {}
        self.info: dict[str, Any] = {}

    # ------------------------------------------------------------------ build
    def setup(self, stage: str | None = None) -> None:
        if self.net is not None:
            return
        dm = self.trainer.datamodule
        dm.setup(stage)
        self.info = dict(dm.info)
        hp = self.hparams
        enc, self.tokenizer, self.encoder_path = load_encoder(hp.encoder)
        self.max_len = tokenizer_limit(self.tokenizer, enc, hp.max_length)
        self.net = EAPNet(
            enc, self.info["num_layers"], self.info["num_experts"], hp.hidden, hp.intermediate, hp.dropout
        )
        pooler = getattr(enc, "pooler", None)
        if isinstance(pooler, torch.nn.Module):
            # EAPNet.embed mean-pools the last hidden state: the pooler head never reaches the loss,
            # and DDP refuses a trainable parameter without a gradient
            pooler.requires_grad_(False)
        if hp.freeze_encoder:
            enc.requires_grad_(False)
            self._embed_all([p for p, _ in dm.train_pairs + dm.val_pairs])

    def _tokenize(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        feats = self.tokenizer(
            prompts, truncation=True, max_length=self.max_len, padding=True, return_tensors="pt"
        )
        return {k: v.to(self.device) for k, v in feats.items()}

    @torch.no_grad()
    def _embed_all(self, prompts: list[str], batch: int = 64) -> None:
        # a frozen encoder gives the same embedding every epoch: compute it once
        # sorted by length so each batch pads to similar lengths (MiniLM cost grows with padding)
        todo = sorted(set(prompts) - set(self._cache), key=len)
        self.net.encoder.eval()
        for i in tqdm(
            range(0, len(todo), batch), desc="EAP: embedding prompts (frozen encoder)", unit="batch"
        ):
            chunk = todo[i : i + batch]
            emb = self.net.embed(self._tokenize(chunk)).cpu()
            self._cache.update(zip(chunk, emb))

    def _logits(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [B, L, E], InfoNCE loss or None)."""
        if self.hparams.freeze_encoder:
            emb = torch.stack([self._cache[p] for p in prompts]).to(self.device)
            return self.net.heads(emb), None
        feats = self._tokenize(prompts)
        # Hugging Face loads encoders in eval mode and Lightning keeps a submodule's own mode, so
        # set it here: SimCSE's positive is the same prompt through another dropout mask (Eq. 6),
        # which an eval-mode encoder would make identical (InfoNCE ~ 0, nothing learned)
        self.net.encoder.train(self.training)
        logits, h = self.net(feats)
        if not self.training or len(prompts) < 2:
            return logits, None
        # SimCSE (Eq. 6): the positive of X_i is X_i itself through another dropout mask
        h_pos = self.net.embed(feats)
        sim = h @ h_pos.T / self.hparams.tau
        return logits, torch.nn.functional.cross_entropy(sim, torch.arange(len(prompts), device=sim.device))

    def _huber(self, logits: torch.Tensor, ep: torch.Tensor) -> torch.Tensor:
        # Eq. 8 on EP scaled by E so delta is relative to a uniform expert's share (1)
        E = logits.shape[-1]
        pred = torch.softmax(logits, -1)
        return torch.nn.functional.huber_loss(pred * E, ep.to(pred.dtype) * E, delta=self.hparams.huber_delta)

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        logits, cont = self._logits(batch["prompts"])
        huber = self._huber(logits, batch["ep"])
        loss = huber if cont is None else self.hparams.alpha * cont + huber  # Eq. 9
        bs = len(batch["prompts"])
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        self.log("train/huber", huber, batch_size=bs)
        if cont is not None:
            self.log("train/infonce", cont, batch_size=bs)
        return loss

    def on_validation_epoch_start(self) -> None:
        k = self.hparams.eval_k or self.info["top_k"]
        self._acc = MetricAccumulator(self.info["num_layers"], self.info["num_experts"], k)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        logits, _ = self._logits(batch["prompts"])
        self.log("val/huber", self._huber(logits, batch["ep"]), batch_size=len(batch["prompts"]))
        # plan recall (plan_recall's definition): the plan against the top-k of the true EP
        plans = torch.softmax(logits.float(), -1).cpu().numpy()
        self._acc.update(plans, plan_truth(batch["ep"].numpy(), self._acc.k))

    def on_validation_epoch_end(self) -> None:
        log_validation(self, self._acc, self.info["moe_layers"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        heads = [p for n, p in self.net.named_parameters() if not n.startswith("encoder.")]
        groups = [{"params": heads, "lr": hp.lr}]
        if not hp.freeze_encoder:
            groups.append({"params": list(self.net.encoder.parameters()), "lr": hp.encoder_lr})
        return torch.optim.AdamW(groups, weight_decay=hp.weight_decay)

    # ------------------------------------------------------------------ export
    def to_predictor(self) -> EAP:
        hp = self.hparams
        frozen = bool(hp.freeze_encoder)
        spec = encoder_spec(hp.encoder)
        ident = f"{self.encoder_path.name}:{encoder_identity(self.encoder_path)}:{self.max_len}"
        self.net.cpu().eval()
        return EAP(
            self.net,
            self.tokenizer,
            max_length=self.max_len,
            fingerprint=self.info["fingerprint"],
            moe_layers=self.info["moe_layers"],
            top_k=self.info["top_k"],
            encoder=spec,
            encoder_id=ident if frozen else f"finetuned:{ident}",
            frozen=frozen,
            hparams={
                k: hp[k]
                for k in (
                    "hidden",
                    "intermediate",
                    "dropout",
                    "alpha",
                    "tau",
                    "huber_delta",
                    "lr",
                    "encoder_lr",
                )
            },
            extra_meta={
                k: self.info[k]
                for k in ("trained_on", "ep_weighting", "include_decode", "model_name", "split")
            },
        )

    def export(self, out: Path, datamodule: EAPDataModule, info: dict[str, Any]) -> Path:
        """Evaluate the exported EAP on the held-out prompts, then write it (predictors.checkpoint.save)."""
        eap = self.to_predictor()
        prompts = [p for p, _ in datamodule.val_pairs]
        eps = np.stack([e for _, e in datamodule.val_pairs])
        plans = np.concatenate([eap.plan_many(prompts[i : i + 64]) for i in range(0, len(prompts), 64)])
        k = self.hparams.eval_k or self.info["top_k"]
        r = plan_recall(plans, eps, k)
        eap.extra_meta["metrics"] = {
            "val_recall_at_k": r["recall_at_k"],
            "k": k,
            "per_layer_recall": r["per_layer"]["recall_at_k"],
            "val_requests": len(prompts),
            **{key: info[key] for key in ("best_score", "epochs") if key in info},
        }
        print(per_layer_table("EAP", r, self.info["moe_layers"]))
        return eap.save(out)


# fit_eap's defaults (frozen: one instance serves every call): the frozen-encoder recipe, bounded
_MODEL, _DATA, _TRAIN = EAPModel(), EAPData(), TrainConfig(max_epochs=60, patience=10)


def fit_eap(
    traces: str,
    out: str,
    model: EAPModel = _MODEL,
    data: EAPData = _DATA,
    train: TrainConfig = _TRAIN,
    run_dir: str | None = None,
    resume: str = "auto",
    json: bool = False,
) -> Path:
    """Train CasMoE's EAP (Eqs. 6-9) on a TraceSet's prompts and write its checkpoint.

    Args:
        traces: TraceSet directory to train on.
        out: the predictor checkpoint to write (.safetensors).
        model: the encoder, heads, loss and optimiser.
        data: the split and the EP labels.
        train: epochs, early stopping, devices, logging.
        run_dir: Lightning and wandb run directory (default ``<out>.run`` beside ``out``).
        resume: auto (from the run directory's last.ckpt when present), never, or a .ckpt path.
        json: print the closing line as one JSON object (checkpoint, best score, run dir, epochs).
    """
    settings = {"traces": traces, "out": out, "model": model, "data": data, "train": train}
    return fit(
        EAPModule(model), EAPDataModule(traces, data), out, train, run_dir, resume, settings, json=json
    )
