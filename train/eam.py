"""Building CasMoE's Expert Activation Matcher (casmoe-eam-eap-cascade.md, "Expert Activation Matcher", Eqs. 4-5).

``moecast train eam --traces T --out eam.safetensors`` embeds the training prompts,
builds the hnswlib index over their EP labels (Eq. 3) and evaluates plan recall on the
held-out requests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from moecast.collect.traceset import atomic_write_json, open_traces
from moecast.predictors.casmoe import ep_labels, plan_recall, prompt_texts
from moecast.predictors.eam import EAM, EAMConfig, index_path
from moecast.predictors.sentence_encoder import SentenceEmbedder
from moecast.train.casmoe import PlanData, data_info, per_layer_table, wandb_run
from moecast.train.planner_report import run_planner
from moecast.train.runner import run_dir_for
from tqdm import tqdm

from moecast.errors import InputError


def _embed(embedder: SentenceEmbedder, prompts: list[str], batch_size: int) -> np.ndarray:
    """[N, D] keys of ``prompts``, embedded in length order so each batch pads to similar lengths."""
    order = np.argsort([len(p) for p in prompts], kind="stable")
    keys = np.empty((len(prompts), embedder.dim), np.float32)
    for i in tqdm(range(0, len(prompts), batch_size), desc="EAM: embedding prompts", unit="batch"):
        idx = order[i : i + batch_size]
        keys[idx] = embedder.embed([prompts[j] for j in idx])
    return keys


def _evaluate(eam: EAM, ts: Any, val_ids: list[str], include_decode: bool, k: int) -> dict[str, Any]:
    """Plan recall@k and query latency of ``eam`` on the held-out requests (printed, and returned)."""
    run = run_planner(eam, prompt_texts(ts, val_ids), "EAM: held-out queries")
    r = plan_recall(run.plans, ep_labels(ts, val_ids, include_decode)[0], k)
    metrics = {
        "val_recall_at_k": r["recall_at_k"],
        "k": r["k"],
        "per_layer_recall": r["per_layer"]["recall_at_k"],
        "val_requests": len(val_ids),
        "mean_query_ms": float(run.latency_ms.mean()),
        "mean_confidence": float(run.confidence.mean()),
    }
    print(per_layer_table("EAM", r, eam.moe_layers))
    print(
        f"  mean query {metrics['mean_query_ms']:.2f} ms (embedding included), mean confidence {metrics['mean_confidence']:.3f}"
    )
    return metrics


# fit_eam's defaults (EAMConfig is not frozen: fit_eam gives the EAM a copy)
_EAM, _DATA = EAMConfig(), PlanData()


def fit_eam(
    traces: str,
    out: str,
    eam: EAMConfig = _EAM,
    data: PlanData = _DATA,
    eval_k: int | None = None,
    batch_size: int = 64,
    run_dir: str | None = None,
    wandb: bool = True,
    json: bool = False,
) -> Path:
    """Build CasMoE's EAM (Eqs. 4-5): embed the training prompts, index them, evaluate on val.

    Args:
        traces: TraceSet directory.
        out: the EAM checkpoint (.safetensors); its hnswlib index is written beside it.
        eam: the embedder and the index (saved with the EAM, which queries that way too).
        data: the split and the EP labels.
        eval_k: k of the plan recall@k (default: the model's top-k).
        batch_size: prompts embedded per batch while building.
        run_dir: where the metrics and the offline wandb run go (default ``<out>.run``).
        wandb: log the evaluation to an offline wandb run.
        json: print one JSON object (checkpoint, index, prompts indexed, val metrics) instead of the line.
    """
    out_p = Path(out)
    if not str(out_p).endswith(".safetensors"):
        raise InputError(f"out {out}: name the EAM checkpoint *.safetensors")
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    ts = open_traces(traces)
    splits = ts.splits(data.val_fraction, data.test_fraction, data.seed)
    train_ids, val_ids = splits.train, splits.val
    train_ids = train_ids[: data.max_requests] if data.max_requests else train_ids
    if not train_ids:
        raise InputError(f"{traces}: no training requests to index")
    index, moe_layers = _build(ts, traces, train_ids, splits.metadata(), eam, data, batch_size)
    metrics: dict[str, Any] = {"indexed_requests": len(train_ids)}
    if val_ids:
        metrics.update(_evaluate(index, ts, val_ids, data.include_decode, eval_k or ts.top_k))
    index.extra_meta["metrics"] = metrics
    path = index.save(out_p)
    _record_run(out_p, run_dir, metrics, bool(wandb and val_ids), moe_layers)
    beside = index_path(path, index.generation).name
    if json:
        from moecast.jsonout import dumps

        print(dumps(dict(checkpoint=str(path), index=beside, prompts=index.size, metrics=metrics)))
    else:
        print(f"wrote {path} ({index.size} prompts indexed; index {beside} beside it)")
    return path


def _build(
    ts: Any,
    traces: str,
    train_ids: list[str],
    split_meta: dict[str, Any],
    eam: EAMConfig,
    data: PlanData,
    batch_size: int,
) -> tuple[EAM, list[int]]:
    """The EAM over the training requests' prompt keys and EP labels, and the model's MoE layers."""
    ep_train, weighted = ep_labels(ts, train_ids, data.include_decode)
    embedder = SentenceEmbedder(eam.embedder, max_length=eam.max_length, int8=eam.int8, engine=eam.engine)
    keys = _embed(embedder, prompt_texts(ts, train_ids), batch_size)
    cfg = dataclasses.replace(eam, max_length=embedder.max_length, int8=embedder.int8)
    info = data_info(ts, traces, weighted, data.include_decode)
    info["split"] = split_meta
    index = EAM(
        embedder,
        ep_train,
        keys,
        fingerprint=info["fingerprint"],
        moe_layers=info["moe_layers"],
        top_k=info["top_k"],
        config=cfg,
        extra_meta={
            k: info[k] for k in ("trained_on", "ep_weighting", "include_decode", "model_name", "split")
        },
    )
    return index, info["moe_layers"]


def _record_run(
    out_p: Path, run_dir: str | None, metrics: dict[str, Any], log_wandb: bool, moe_layers: list[int]
) -> None:
    """Write the build's metrics.json into its run directory and, when asked, its wandb run."""
    rd = run_dir_for(out_p, run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    atomic_write_json(rd / "metrics.json", metrics)
    if log_wandb:
        scalars = {k: v for k, v in metrics.items() if not isinstance(v, list)}
        _log_wandb(rd, out_p.stem, scalars, metrics.get("per_layer_recall"), moe_layers)


def _log_wandb(
    run_dir: Path,
    name: str,
    scalars: dict[str, Any],
    per_layer: list[float] | None,
    moe_layers: list[int],
) -> None:
    """The build's held-out metrics as one wandb run under ``run_dir``."""
    with wandb_run(run_dir, name, "eam") as run:
        data = {f"val/{k}": v for k, v in scalars.items() if isinstance(v, (int, float))}
        if per_layer:
            data.update({f"val/recall_layer/{m}": v for m, v in zip(moe_layers, per_layer)})
        run.log(data)
