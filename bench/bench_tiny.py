"""Build (or load) the embedded model `tiny` and print what it is worth.

    python bench/bench_tiny.py [--preset default] [--val-tokens 32768] [--rebuild]

Prints build time and training throughput (from build_info.json), then re-measures on
held-out ShareGPT text (conversations never trained on): perplexity, per-layer router
entropy against the uniform ln(E), busiest-expert load against the even share, the
previous-layer co-occurrence recall@k against chance k/E, and forward throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--val-tokens", type=int, default=32768)
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if a built model exists")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from moecast.collect import tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = (
        tiny.build_tiny(preset=args.preset, force=True, threads=args.threads)
        if args.rebuild
        else tiny.ensure_tiny(args.preset)
    )
    info = json.loads((path / "build_info.json").read_text())
    cfg = tiny.TinyConfig(**info["config"])
    print(f"\nmodel: {path}")
    print(
        f"  build: {info['build_seconds']:.0f} s total, training {info['train_seconds']:.0f} s, "
        f"{info['train_tokens']:,} tokens at {info['train_tokens_per_s']:.0f} tok/s, {info['threads']} thread(s)"
        + ("  [stopped early by max_train_seconds]" if info.get("stopped_early") else "")
    )
    print(f"  parameters {info['parameters']:,}, active per token {info['active_parameters']:,}")

    model = AutoModelForCausalLM.from_pretrained(path)
    model.set_experts_implementation("eager")
    tok = AutoTokenizer.from_pretrained(path)
    texts = tiny._collect_texts(cfg, "val", args.val_tokens)
    rows = tiny._pack(tok, texts, cfg.seq_len)[: max(2, args.val_tokens // cfg.seq_len)]
    start = time.perf_counter()
    loss, probs, topk = tiny.route(model, rows)
    seconds = time.perf_counter() - start
    ent = tiny.router_entropy(probs)
    loads = tiny.expert_loads(topk, cfg.num_experts)
    bal = loads.max(1)
    dead = tiny.dead_experts(topk, cfg.num_experts)
    rec = tiny.cooccurrence_recall(topk, cfg.num_experts)
    chance = cfg.top_k / cfg.num_experts

    print(f"\nheld-out: {rows.size:,} tokens of ShareGPT conversations not trained on")
    print(f"  perplexity {math.exp(loss):.2f} (loss {loss:.3f}); forward {rows.size / seconds:,.0f} tok/s")
    print(
        f"  {'layer':>5}  {'entropy':>8}  {'uniform':>7}  {'max load/even':>13}  {'min load/even':>13}"
        f"  {'dead':>4}  {'co-occ recall@k':>15}  {'x chance':>8}"
    )
    for layer in range(cfg.num_layers):
        r = f"{rec[layer - 1]:.3f}" if layer else "-"
        x = f"{rec[layer - 1] / chance:.2f}" if layer else "-"
        print(
            f"  {layer:>5}  {ent[layer]:>8.3f}  {math.log(cfg.num_experts):>7.3f}  {bal[layer]:>13.2f}"
            f"  {loads[layer].min():>13.3f}  {dead[layer]:>4}  {r:>15}  {x:>8}"
        )
    print(
        f"  dead experts (under {tiny.DEAD_LOAD:.0%} of the even share): {int(dead.sum())} of {dead.size} "
        f"({dead.sum() / dead.size:.1%})"
    )
    print(
        f"  mean co-occurrence recall@{cfg.top_k} {rec.mean():.3f} vs chance {chance:.3f} ({rec.mean() / chance:.2f}x)"
    )


if __name__ == "__main__":
    main()
