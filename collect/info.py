"""``moecast traces info``: what a TraceSet holds and how its routing behaves, per layer.

Routing statistics (vectorised over all tokens):
- frequency entropy: entropy (nats) of each layer's expert-use distribution, against
  ln(E) for perfectly balanced use;
- router entropy: mean per-token entropy of the post-softmax router distribution
  (only when ``router_probs`` were recorded), against ln(E) for a uniform router;
- skew: the most used expert's share over the mean share (1.0 = balanced), and the
  share of uses taken by the top 10% of experts.

Duplicate prompts: requests whose normalised prompt text (token ids where there is none) equals
another request's; :meth:`TraceSet.splits` keeps each such group on one side.
"""

from __future__ import annotations

import json as _json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from moecast.collect.traceset import TraceSet, open_traces


@dataclass
class LayerStats:
    layer: int
    freq_entropy: float
    router_entropy: float | None
    max_over_mean: float
    top10pct_share: float


def layer_stats(ts: TraceSet, max_tokens: int = 500_000) -> list[LayerStats]:
    ids = ts.array("topk_ids")
    if len(ids) > max_tokens:  # an evenly spaced sample keeps `info` fast on huge sets
        ids = ids[np.linspace(0, len(ids) - 1, max_tokens).astype(np.int64)]
    L, E = ts.num_layers, ts.num_experts
    counts = np.zeros((L, E), dtype=np.int64)
    layer_idx = np.broadcast_to(np.arange(L)[None, :, None], ids.shape)
    np.add.at(counts, (layer_idx.reshape(-1), ids.reshape(-1).astype(np.int64)), 1)
    freq = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        freq_entropy = -(np.where(freq > 0, freq * np.log(freq), 0.0)).sum(1)
    router_entropy: np.ndarray | None = None
    if ts.has("router_probs"):
        probs = ts.array("router_probs")
        if len(probs) > max_tokens:
            probs = probs[np.linspace(0, len(probs) - 1, max_tokens).astype(np.int64)]
        p = probs.astype(np.float32)
        router_entropy = -(p * np.log(np.clip(p, 1e-12, None))).sum(-1).mean(0)
    n_top = max(1, round(E * 0.1))
    top_share = np.sort(freq, 1)[:, ::-1][:, :n_top].sum(1)
    return [
        LayerStats(
            layer=int(ts.meta.model.moe_layers[i]),
            freq_entropy=float(freq_entropy[i]),
            router_entropy=None if router_entropy is None else float(router_entropy[i]),
            max_over_mean=float(freq[i].max() * E),
            top10pct_share=float(top_share[i]),
        )
        for i in range(L)
    ]


def traces_info(path: Path, json: bool = False) -> None:
    """Print a TraceSet's model, requests, tokens, fields present and per-layer routing statistics.

    Args:
        path: TraceSet directory.
        json: print one JSON object instead of tables.
    """
    ts = open_traces(path, require_nonempty=False)
    summary, stats = _traces_summary(path, ts)
    if json:
        print(_json.dumps(summary))
        return
    _print_overview(path, ts, summary)
    if not stats:
        return
    _print_layers(stats, summary["uniform_entropy"])


def _traces_summary(path: Path, ts: TraceSet) -> tuple[dict[str, Any], list[LayerStats]]:
    """(the JSON summary of ``ts``, its per-layer routing statistics; none when it holds no tokens)."""
    m = ts.meta.model
    decode = int((ts.column("phase") == "decode").sum()) if ts.num_tokens else 0
    workloads: dict[str, int] = {}
    for rid in ts.request_ids:
        w = ts.request_info(rid)["workload"]
        workloads[w] = workloads.get(w, 0) + 1
    stats = layer_stats(ts) if ts.num_tokens else []
    summary = {
        "path": str(path),
        "model": m.name_or_path,
        "family": m.family,
        "fingerprint": m.fingerprint,
        "moe_layers": list(m.moe_layers),  # as meta.json has them: the model's layer indices
        "num_moe_layers": len(m.moe_layers),
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "num_shared_experts": m.num_shared_experts,
        "hidden_size": m.hidden_size,
        "expert_bytes": m.expert_bytes,
        "requests": ts.num_requests,
        "tokens": ts.num_tokens,
        "prefill_tokens": ts.num_tokens - decode,
        "decode_tokens": decode,
        "workloads": workloads,
        "traceset_id": ts.traceset_id,
        **ts.duplicate_prompts(),
        "fields": ts.fields_present(),
        "absent": [f for f in ("topk_weights", "router_probs", "gate_inputs") if not ts.has(f)],
        "source": ts.meta.collection.get("source", "moecast collect"),
        "uniform_entropy": float(np.log(m.num_experts)),
        "layers": [asdict(s) for s in stats],
    }
    return summary, stats


def _print_overview(path: Path, ts: TraceSet, summary: dict[str, Any]) -> None:
    """Prints the model, requests, prompts, tokens and fields of the TraceSet as a table."""
    m = ts.meta.model
    workloads, decode = summary["workloads"], summary["decode_tokens"]
    print(f"TraceSet {path}  ({summary['source']})")
    print(f"  model      {m.name_or_path}  family={m.family}  fingerprint={m.fingerprint}")
    print(
        f"  routing    {len(m.moe_layers)} MoE layers (model layers {m.moe_layers[0]}..{m.moe_layers[-1]}), "
        f"{m.num_experts} experts, top-{m.top_k}, {m.num_shared_experts} shared, hidden {m.hidden_size}, "
        f"{m.expert_bytes / 2**20:.2f} MiB/expert"
    )
    print(
        f"  requests   {ts.num_requests}  ({', '.join(f'{k}: {v}' for k, v in workloads.items()) or 'none'})"
    )
    print(
        f"  prompts    {summary['distinct_prompts']} distinct; {summary['duplicate_requests']} requests share "
        f"their prompt with another ({summary['duplicate_groups']} prompts, up to {summary['largest_group']} "
        "copies); splits keep copies on one side"
    )
    print(f"  tokens     {ts.num_tokens}  (prefill {ts.num_tokens - decode}, decode {decode})")
    print(
        f"  fields     {', '.join(summary['fields'])}"
        + (f"  (absent: {', '.join(summary['absent'])})" if summary["absent"] else "")
    )


def _print_layers(stats: list[LayerStats], uniform_entropy: float) -> None:
    """Prints the per-layer routing statistics table."""
    print(f"\n  per-layer routing (uniform entropy ln E = {uniform_entropy:.3f} nats)")
    print("  layer  freq-entropy  router-entropy  max/mean  top-10% share")
    for s in stats:
        re_ = "-" if s.router_entropy is None else f"{s.router_entropy:.3f}"
        print(
            f"  {s.layer:>5}  {s.freq_entropy:>12.3f}  {re_:>14}  {s.max_over_mean:>8.2f}  {s.top10pct_share:>13.3f}"
        )
