"""Benchmark every predictor on a TraceSet's held-out split: recall@k, latency per layer, training time.

    python bench/bench_predictors.py --traces traces/ds-puffin \
        --checkpoints runs/llapor_ds.safetensors,runs/seq_ds.safetensors [--max-requests 200]

Baselines (global / per-request frequency, MoE-Infinity activation matrices) are built on
the training split of the same ``TraceSet.split(val_fraction, seed)``; trained checkpoints
report the training time recorded in their metadata. Latency: batch-1 CPU time of one
token, per MoE layer: ``score_layer`` (numpy, one layer) and the batched torch network over
all layers divided by L, on one thread.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def _latency_per_layer(pred, trace, repeats: int = 200) -> tuple[float, float] | None:
    """(ms of ``score_layer`` for one token, ms of one batched torch forward over all layers / L) or None."""
    if not hasattr(pred, "features"):
        return None
    feats = pred.features(trace)
    one = {k: v[5:6] for k, v in feats.items()}
    pred.score_layer(1, one)  # warm-up
    t = time.perf_counter()
    for i in range(repeats):
        pred.score_layer(1 + i % (pred.num_layers - 1), one)
    per_layer = (time.perf_counter() - t) / repeats * 1e3
    with torch.no_grad():
        pred.net(**one)
        t = time.perf_counter()
        for _ in range(repeats):
            pred.net(**one)  # all layers of one token in one torch call
    return per_layer, (time.perf_counter() - t) / repeats * 1e3 / pred.num_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument("--checkpoints", default="", help="comma-separated predictor .safetensors files")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-requests", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from moecast.collect.traceset import open_traces
    from moecast.predictors.commands import build_baseline, evaluate_predictor
    from moecast.predictors.registry import load

    ts = open_traces(args.traces)
    train_ids, val_ids = ts.split(args.val_fraction, args.seed)
    if args.max_requests:
        val_ids = val_ids[: args.max_requests]
    k = ts.meta.model.top_k
    print(
        f"{ts.path}: {ts.meta.model.name_or_path}, {ts.num_layers} MoE layers, {ts.num_experts} experts, top-{k}; "
        f"held-out {len(val_ids)} of {ts.num_requests} requests (split {args.val_fraction}, seed {args.seed})"
    )
    preds = []
    for spec in ("frequency", "frequency-request", "moe-infinity"):
        t = time.perf_counter()
        preds.append((spec, build_baseline(spec, ts, train_ids), time.perf_counter() - t))
    for path in filter(None, args.checkpoints.split(",")):
        pred = load(path, fingerprint=ts.meta.model.fingerprint, against=str(ts.path))
        preds.append((path, pred, (pred.meta.get("training") or {}).get("train_seconds")))
    print(
        f"{'predictor':<44}{'horizon':<14}{'recall@' + str(k):>10}{'recall@4':>10}{'f1_macro':>10}"
        f"{'ms/layer':>10}{'ms/L torch':>11}{'train s':>9}"
    )
    trace = ts.get(val_ids[0])
    for name, pred, secs in preds:
        res = evaluate_predictor(pred, ts, val_ids, extra_k=(4,), progress=False)
        lat = _latency_per_layer(pred, trace)
        lat_s = f"{lat[0]:>10.3f}{lat[1]:>11.4f}" if lat else f"{'-':>10}{'-':>11}"
        secs_s = f"{secs:>9.1f}" if isinstance(secs, (int, float)) else f"{'-':>9}"
        print(
            f"{name[-44:]:<44}{pred.horizon:<14}{res['recall_at_k']:>10.4f}{res.get('recall_at_4', np.nan):>10.4f}"
            f"{res['f1_macro']:>10.4f}{lat_s}{secs_s}"
        )
        for g, r in (res.get("per_group") or {}).items():
            print(f"{'  group ' + g:<58}{r['recall_at_k']:>10.4f}")


if __name__ == "__main__":
    main()
