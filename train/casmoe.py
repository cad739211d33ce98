"""Training and building CasMoE's planners (casmoe-eam-eap-cascade.md, "Training and Inference").

- ``EAPModule`` + ``EAPDataModule``: ``moecast train eap --config configs/eap_minilm.yaml
  --traces T --out eap.safetensors`` (LightningCLI via ``moecast.train.cli``). Loss
  Eq. 9: alpha * InfoNCE (Eqs. 6-7, SimCSE: the same prompts encoded twice with
  dropout as the positives, temperature tau) + Huber (Eq. 8, delta) between the
  per-layer softmax plan and the EP label (Eq. 3). With ``freeze_encoder`` the
  encoder is not trained, its embeddings are computed once and only the heads learn
  (the contrastive term then has nothing to train and is skipped).
- ``build_eam``: ``moecast train eam --traces T --out eam.safetensors`` embeds the
  training prompts, builds the hnswlib index (Eqs. 4-5) and evaluates on held-out.
- ``build_cascade``: ``moecast train cascade --eam A --eap B --out C --epsilon e
  [--traces T]`` writes the gated cascade checkpoint and, with traces, prints the
  Table-3-style comparison.

Held-out requests are ``TraceSet.split(val_fraction, seed)`` (default 0.1, 0) everywhere.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from moecast.collect.traceset import TraceSet, atomic_write_json, open_traces
from moecast.predictors.casmoe import ep_labels, plan_recall, plan_truth, prompt_text
from moecast.predictors.eam import EAM, EAMConfig, index_path
from moecast.predictors.eap import EAP, EAPNet, load_encoder, tokenizer_limit
from moecast.predictors.metrics import MetricAccumulator
from moecast.predictors.sentence_encoder import SentenceEmbedder, encoder_identity, encoder_spec
from moecast.train.data import eval_sampler, log_validation
from moecast.train.planner_report import compare_planners, format_table, run_planner
from torch.utils.data import DataLoader
from tqdm import tqdm


def _prompts(ts: TraceSet, ids: list[str]) -> list[str]:
    return [prompt_text(ts, rid) for rid in ids]


def _data_info(ts: TraceSet, traces: str, weighted: bool, include_decode: bool) -> dict[str, Any]:
    m = ts.model
    return {
        "fingerprint": m.fingerprint,
        "model_name": m.name_or_path,
        "moe_layers": list(m.moe_layers),
        "num_layers": m.num_layers,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "trained_on": str(Path(traces).resolve()),
        # Eq. 3 weights each selection by its router weight; traces without weights
        # (imported DeepSeek) fall back to plain counts, said here
        "ep_weighting": "router-weighted" if weighted else "count (TraceSet has no topk_weights)",
        "include_decode": include_decode,
    }


# ----------------------------------------------------------------------------- EAP


class EAPDataModule(L.LightningDataModule):
    """(prompt, EP) pairs of a TraceSet, split by request (CasMoE "Data Calibration", dataset D)."""

    def __init__(
        self,
        traces: str,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        seed: int = 0,
        include_decode: bool = False,
        max_requests: int | None = None,
    ) -> None:
        """
        Args:
            traces: TraceSet directory (linked from ``--traces``).
            batch_size: prompts per step (also the InfoNCE negatives).
            val_fraction: share of requests held out (``TraceSet.split``).
            seed: split seed.
            include_decode: count decoded tokens in the EP label too (Eq. 3 sums the prompt's).
            max_requests: use only the first N training requests (quick runs).
        """
        super().__init__()
        self.traces = traces
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.include_decode = include_decode
        self.max_requests = max_requests
        self.info: dict[str, Any] = {}
        self._ready = False

    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        ts = open_traces(self.traces)
        train_ids, val_ids = ts.split(self.val_fraction, self.seed)
        if self.max_requests:
            train_ids = train_ids[: self.max_requests]
        if not train_ids or not val_ids:
            raise ValueError(
                f"{self.traces}: {len(train_ids)} training and {len(val_ids)} held-out requests; "
                "EAP training needs both (more requests or another --data.val_fraction)"
            )
        ep_train, weighted = ep_labels(ts, train_ids, self.include_decode)
        ep_val, _ = ep_labels(ts, val_ids, self.include_decode)
        self.train_pairs = list(zip(_prompts(ts, train_ids), ep_train))
        self.val_pairs = list(zip(_prompts(ts, val_ids), ep_val))
        self.info = _data_info(ts, self.traces, weighted, self.include_decode)
        self.info.update(train_requests=len(train_ids), val_requests=len(val_ids))
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


class EAPModule(L.LightningModule):
    """EAP training (CasMoE Eqs. 6-9): encoder + per-layer heads, alpha*InfoNCE + Huber."""

    datamodule_class = EAPDataModule

    def __init__(
        self,
        encoder: str = "minilm",
        max_length: int = 256,
        freeze_encoder: bool = False,
        hidden: int = 64,
        intermediate: int = 128,
        dropout: float = 0.1,
        alpha: float = 0.05,
        tau: float = 0.05,
        huber_delta: float = 1.0,
        lr: float = 1e-3,
        encoder_lr: float = 2e-5,
        weight_decay: float = 0.0,
        eval_k: int | None = None,
    ) -> None:
        """
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
        super().__init__()
        self.save_hyperparameters()
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
                k: self.info[k] for k in ("trained_on", "ep_weighting", "include_decode", "model_name")
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


def per_layer_table(name: str, r: dict[str, Any], moe_layers: list[int]) -> str:
    rec = r["per_layer"]["recall_at_k"]
    cells = "  ".join(f"L{m}:{v:.3f}" for m, v in zip(moe_layers, rec))
    return f"{name} plan recall@{r['k']} on {r['requests']} held-out requests: {r['recall_at_k']:.4f}\n  per layer: {cells}"


# ----------------------------------------------------------------------------- EAM


def build_eam_index(
    traces: str,
    out: str,
    embedder: str = "minilm",
    max_length: int = 256,
    k_neighbours: int = 3,
    buffer_size: int = 30,
    M: int = 16,
    ef_construction: int = 200,
    ef: int = 64,
    seed: int = 0,
    val_fraction: float = 0.1,
    include_decode: bool = False,
    eval_k: int | None = None,
    batch_size: int = 64,
    run_dir: str | None = None,
    wandb: bool = True,
    int8: bool = False,
    engine: str = "auto",
) -> Path:
    """Build CasMoE's EAM (Eqs. 4-5): embed the training prompts, index them, evaluate on held-out.

    Args:
        traces: TraceSet directory.
        out: the EAM checkpoint (.safetensors); its hnswlib index is written beside it.
        embedder: 'minilm' (the packaged all-MiniLM-L6-v2) or a local sentence-transformers folder.
        max_length: token limit of the embedder (longer prompts are truncated, said once).
        k_neighbours: k' of Eq. 5 (neighbours averaged).
        buffer_size: C, new pairs buffered before they are folded into the index (paper: 30).
        M: hnswlib graph degree.
        ef_construction: hnswlib build-time beam.
        ef: hnswlib query-time beam.
        seed: split seed and hnswlib seed.
        val_fraction: share of requests held out for evaluation (``TraceSet.split``).
        include_decode: count decoded tokens in the EP label too.
        eval_k: k of the plan recall@k (default: the model's top-k).
        batch_size: prompts embedded per batch while building.
        run_dir: where the metrics and the offline wandb run go (default ``<out>.run``).
        wandb: log the evaluation to an offline wandb run.
        int8: embed with dynamic int8 Linear layers (CPU; ~1.5x faster short queries, embeddings
            ~0.99 cosine to fp32's); saved with the EAM, which then queries that way too.
        engine: who runs the embedder: auto (ONNX Runtime on the CPU when installed), onnx or torch;
            saved with the EAM.
    """
    from moecast.train.cli import run_dir_for

    out_p = Path(out)
    if not str(out_p).endswith(".safetensors"):
        raise ValueError(f"--out {out}: name the EAM checkpoint *.safetensors")
    ts = open_traces(traces)
    train_ids, val_ids = ts.split(val_fraction, seed)
    if not train_ids:
        raise ValueError(f"{traces}: no training requests to index")
    ep_train, weighted = ep_labels(ts, train_ids, include_decode)
    prompts = _prompts(ts, train_ids)
    emb_model = SentenceEmbedder(embedder, max_length=max_length, int8=int8, engine=engine)
    # embed in length order so each batch pads to similar lengths, then restore the order
    order = np.argsort([len(p) for p in prompts], kind="stable")
    keys = np.empty((len(prompts), emb_model.dim), np.float32)
    for i in tqdm(range(0, len(prompts), batch_size), desc="EAM: embedding prompts", unit="batch"):
        idx = order[i : i + batch_size]
        keys[idx] = emb_model.embed([prompts[j] for j in idx])
    cfg = EAMConfig(
        embedder=embedder,
        max_length=emb_model.max_length,
        k_neighbours=k_neighbours,
        buffer_size=buffer_size,
        M=M,
        ef_construction=ef_construction,
        ef=ef,
        seed=seed,
        int8=emb_model.int8,
        engine=engine,
    )
    info = _data_info(ts, traces, weighted, include_decode)
    eam = EAM(
        emb_model,
        ep_train,
        keys,
        fingerprint=info["fingerprint"],
        moe_layers=info["moe_layers"],
        top_k=info["top_k"],
        config=cfg,
        extra_meta={k: info[k] for k in ("trained_on", "ep_weighting", "include_decode", "model_name")},
    )
    metrics: dict[str, Any] = {"indexed_requests": len(train_ids)}
    if val_ids:
        run = run_planner(eam, _prompts(ts, val_ids), "EAM: held-out queries")
        r = plan_recall(run.plans, ep_labels(ts, val_ids, include_decode)[0], eval_k or ts.top_k)
        metrics.update(
            val_recall_at_k=r["recall_at_k"],
            k=r["k"],
            per_layer_recall=r["per_layer"]["recall_at_k"],
            val_requests=len(val_ids),
            mean_query_ms=float(run.latency_ms.mean()),
            mean_confidence=float(run.confidence.mean()),
        )
        print(per_layer_table("EAM", r, info["moe_layers"]))
        print(
            f"  mean query {metrics['mean_query_ms']:.2f} ms (embedding included), mean confidence {metrics['mean_confidence']:.3f}"
        )
    eam.extra_meta["metrics"] = metrics
    path = eam.save(out_p)
    rd = run_dir_for(out_p, run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    atomic_write_json(rd / "metrics.json", metrics)
    if wandb and val_ids:
        _log_wandb(
            rd,
            out_p.stem,
            "eam",
            {k: v for k, v in metrics.items() if not isinstance(v, list)},
            metrics.get("per_layer_recall"),
            info["moe_layers"],
        )
    print(
        f"wrote {path} ({eam.size} prompts indexed; index {index_path(path, eam.generation).name} beside it)"
    )
    return path


def _log_wandb(
    run_dir: Path,
    name: str,
    kind: str,
    scalars: dict[str, Any],
    per_layer: list[float] | None,
    moe_layers: list[int],
) -> None:
    """One offline wandb run (project moecast) under ``run_dir``; sync later with `wandb sync`."""
    import wandb

    mode = "online" if os.environ.get("WANDB_MODE") == "online" else "offline"
    run = wandb.init(
        project="moecast", name=name, group=kind, dir=str(run_dir), mode=mode, reinit="finish_previous"
    )
    try:
        data = {f"val/{k}": v for k, v in scalars.items() if isinstance(v, (int, float))}
        if per_layer:
            data.update({f"val/recall_layer/{m}": v for m, v in zip(moe_layers, per_layer)})
        run.log(data)
    finally:
        run.finish()


def _log_table3(run_dir: Path, name: str, rows: list[dict[str, Any]]) -> None:
    """The Table-3 comparison as one offline wandb run: a table and ``<planner>/<metric>`` scalars."""
    import wandb

    mode = "online" if os.environ.get("WANDB_MODE") == "online" else "offline"
    run = wandb.init(
        project="moecast", name=name, group="cascade", dir=str(run_dir), mode=mode, reinit="finish_previous"
    )
    try:
        cols = ["planner", "recall_at_k", "f1_micro", "mean_latency_ms", "p50_latency_ms", "eam_share"]
        table = wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
        data: dict[str, Any] = {"table3": table}
        for r in rows:
            for c in cols[1:]:
                if isinstance(r.get(c), (int, float)):
                    data[f"{r['planner']}/{c}"] = r[c]
        run.log(data)
    finally:
        run.finish()


def build_eam(argv: list[str]) -> Path:
    """``moecast train eam --traces T --out CKPT [--config configs/eam_minilm.yaml] [options]``."""
    from jsonargparse import auto_cli

    return auto_cli(build_eam_index, args=argv, as_positional=False)


# ----------------------------------------------------------------------------- cascade


def build_cascade_checkpoint(
    eam: str,
    eap: str,
    out: str,
    epsilon: float = 0.5,
    traces: str | None = None,
    epsilons: list[float] | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    max_requests: int | None = None,
    json_out: bool = False,
    int8: bool | None = None,
    engine: str | None = None,
    threads: int | None = None,
    run_dir: str | None = None,
    wandb: bool = True,
) -> Path:
    """Write CasMoE's gated cascade (EAM if cosine confidence >= epsilon, else EAP); with traces, compare.

    Args:
        eam: EAM checkpoint (``moecast train eam``).
        eap: EAP checkpoint (``moecast train eap``).
        out: cascade checkpoint to write (.safetensors; it names the two beside it).
        epsilon: the gate threshold on the EAM's best cosine similarity.
        traces: a TraceSet; when given, print the Table-3-style comparison on its held-out requests.
        epsilons: thresholds to compare (default 0.3 0.5 0.6 0.7 0.8 0.9 plus epsilon).
        val_fraction: held-out share (``TraceSet.split``).
        seed: split seed.
        max_requests: compare on at most this many held-out requests.
        json_out: print one JSON object per comparison row instead of a table.
        int8: compare with int8 (true) or fp32 (false) encoders; default: as the checkpoints say.
        engine: compare with the encoders run by onnx, torch or auto; default: as the checkpoints say.
        threads: batch-1 encoder threads for the comparison (default: 1).
        run_dir: where the comparison's table3.json and offline wandb run go (default ``<out>.run``).
        wandb: log the comparison (one row per planner, scalars and a table) to an offline wandb run.
    """
    from moecast.predictors.cascade import Cascade
    from moecast.predictors.registry import load

    eam_p, eap_p = load(eam), load(eap)
    if eam_p.name != "eam" or eap_p.name != "eap":
        raise ValueError(f"--eam must be an EAM and --eap an EAP checkpoint (got {eam_p.name}, {eap_p.name})")
    cascade = Cascade(eam_p, eap_p, epsilon)
    path = cascade.save(out, eam, eap)
    print(f"wrote {path} (epsilon {epsilon}, EAP reuses the EAM embedding: {cascade.shared_embedding})")
    if traces:
        eps = sorted(set([*(epsilons or [0.3, 0.5, 0.6, 0.7, 0.8, 0.9]), epsilon]))
        t0 = time.perf_counter()
        rows = compare_planners(
            eam_p,
            eap_p,
            traces,
            eps,
            None,
            val_fraction,
            seed,
            max_requests,
            int8=int8,
            engine=engine,
            threads=threads,
        )
        from moecast.train.cli import run_dir_for

        rd = run_dir_for(Path(out), run_dir)
        rd.mkdir(parents=True, exist_ok=True)
        atomic_write_json(rd / "table3.json", {"traces": str(traces), "rows": rows})
        if wandb:
            _log_table3(rd, Path(out).stem, rows)
        if json_out:
            for r in rows:
                print(json.dumps(r))
        else:
            print(format_table(rows))
            print(f"({time.perf_counter() - t0:.1f} s)")
    return path


def build_cascade(argv: list[str]) -> Path:
    """``moecast train cascade --eam A --eap B --out C [--epsilon e] [--traces T]``."""
    from jsonargparse import auto_cli

    return auto_cli(build_cascade_checkpoint, args=argv, as_positional=False)
