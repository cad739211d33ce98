"""Building CasMoE's Expert Activation Matcher (casmoe-eam-eap-cascade.md, "Expert Activation Matcher", Eqs. 4-5).

``moecast train eam --traces T --out eam.safetensors`` embeds the training prompts,
builds the hnswlib index over their EP labels (Eq. 3) and evaluates plan recall on the
held-out requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from moecast.collect.traceset import atomic_write_json, open_traces
from moecast.predictors.casmoe import ep_labels, plan_recall, prompt_texts
from moecast.predictors.eam import EAM, EAMConfig, index_path
from moecast.predictors.sentence_encoder import SentenceEmbedder
from moecast.train.casmoe import data_info, per_layer_table, wandb_run
from moecast.train.planner_report import run_planner
from tqdm import tqdm

from moecast.errors import InputError


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
    test_fraction: float = 0.1,
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
        val_fraction: share of requests in val, evaluated here (``TraceSet.splits``).
        test_fraction: share of requests in test, left for ``moecast predictors eval``.
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
        raise InputError(f"--out {out}: name the EAM checkpoint *.safetensors")
    ts = open_traces(traces)
    splits = ts.splits(val_fraction, test_fraction, seed)
    train_ids, val_ids = splits.train, splits.val
    if not train_ids:
        raise InputError(f"{traces}: no training requests to index")
    ep_train, weighted = ep_labels(ts, train_ids, include_decode)
    prompts = prompt_texts(ts, train_ids)
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
    info = data_info(ts, traces, weighted, include_decode)
    info["split"] = splits.metadata()
    eam = EAM(
        emb_model,
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
    metrics: dict[str, Any] = {"indexed_requests": len(train_ids)}
    if val_ids:
        run = run_planner(eam, prompt_texts(ts, val_ids), "EAM: held-out queries")
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


def build_eam(argv: list[str]) -> Path:
    """``moecast train eam --traces T --out CKPT [--config configs/eam_minilm.yaml] [options]``."""
    from jsonargparse import auto_cli

    return auto_cli(build_eam_index, args=argv, as_positional=False)
