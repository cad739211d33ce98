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


def measure(
    preset: str = "default", val_tokens: int = 32768, rebuild: bool = False, threads: int = 1
) -> dict:
    """Build (or load) ``tiny`` and measure it on held-out ShareGPT text."""
    torch.set_num_threads(threads)
    from moecast.collect import tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = (
        tiny.build_tiny(preset=preset, force=True, threads=threads) if rebuild else tiny.ensure_tiny(preset)
    )
    info = json.loads((path / "build_info.json").read_text())
    cfg = tiny.TinyConfig(**info["config"])
    model = AutoModelForCausalLM.from_pretrained(path)
    model.set_experts_implementation("eager")
    tok = AutoTokenizer.from_pretrained(path)
    texts = tiny._collect_texts(cfg, "val", val_tokens)
    rows = tiny._pack(tok, texts, cfg.seq_len)[: max(2, val_tokens // cfg.seq_len)]
    start = time.perf_counter()
    loss, probs, topk = tiny.route(model, rows)
    seconds = time.perf_counter() - start
    return {
        "path": path,
        "build": info,
        "config": cfg,
        "tokens": int(rows.size),
        "loss": float(loss),
        "forward_tok_s": rows.size / seconds,
        "entropy": tiny.router_entropy(probs),
        "uniform": math.log(cfg.num_experts),
        "loads": tiny.expert_loads(topk, cfg.num_experts),
        "dead": tiny.dead_experts(topk, cfg.num_experts),
        "cooccurrence": tiny.cooccurrence_recall(topk, cfg.num_experts),
        "chance": cfg.top_k / cfg.num_experts,
    }


def rows(quick: bool) -> list[dict]:
    """``quick``: 8,192 held-out tokens, and only when ``tiny`` is already built (a build is ~7 min)."""
    from bench.figures import fig, missing, row, tiny_built

    if quick and not tiny_built("default"):
        return [missing("tiny", "tiny default not built (moecast build-tiny, ~7 min)")]
    m = measure(val_tokens=8192) if quick else measure()
    note = "quick: 8,192 held-out tokens" if quick else ""
    ent, uniform = [float(x) for x in m["entropy"]], m["uniform"]
    rec, chance = m["cooccurrence"], m["chance"]
    mean = sum(ent) / len(ent)
    return [
        fig("tiny", "tiny build time (s)", m["build"]["build_seconds"], "{:.0f} s", "<= 600 s"),
        fig("tiny", "tiny held-out perplexity", math.exp(m["loss"]), "{:.1f}", note=note),
        row(
            "tiny",
            "tiny router entropy, mean over layers vs uniform ln E",
            f"{mean:.3f} vs {uniform:.3f} (min layer {min(ent):.3f})",
            "< uniform",
            "ok" if mean < uniform else "MISS",
            note,
            mean,
        ),
        fig(
            "tiny",
            "tiny co-occurrence recall vs chance (x)",
            rec.mean() / chance,
            "{:.2f}x",
            ">= 3 x",
            f"recall@{m['config'].top_k} {rec.mean():.3f} vs chance {chance:.3f}",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--val-tokens", type=int, default=32768)
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if a built model exists")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from moecast.collect.tiny import DEAD_LOAD

    m = measure(args.preset, args.val_tokens, args.rebuild, args.threads)
    info, cfg = m["build"], m["config"]
    print(f"\nmodel: {m['path']}")
    print(
        f"  build: {info['build_seconds']:.0f} s total, training {info['train_seconds']:.0f} s, "
        f"{info['train_tokens']:,} tokens at {info['train_tokens_per_s']:.0f} tok/s, {info['threads']} thread(s)"
        + ("  [stopped early by max_train_seconds]" if info.get("stopped_early") else "")
    )
    print(f"  parameters {info['parameters']:,}, active per token {info['active_parameters']:,}")
    ent, loads, dead, rec, chance = m["entropy"], m["loads"], m["dead"], m["cooccurrence"], m["chance"]
    bal = loads.max(1)
    print(f"\nheld-out: {m['tokens']:,} tokens of ShareGPT conversations not trained on")
    print(
        f"  perplexity {math.exp(m['loss']):.2f} (loss {m['loss']:.3f}); forward {m['forward_tok_s']:,.0f} tok/s"
    )
    print(
        f"  {'layer':>5}  {'entropy':>8}  {'uniform':>7}  {'max load/even':>13}  {'min load/even':>13}"
        f"  {'dead':>4}  {'co-occ recall@k':>15}  {'x chance':>8}"
    )
    for layer in range(cfg.num_layers):
        r = f"{rec[layer - 1]:.3f}" if layer else "-"
        x = f"{rec[layer - 1] / chance:.2f}" if layer else "-"
        print(
            f"  {layer:>5}  {ent[layer]:>8.3f}  {m['uniform']:>7.3f}  {bal[layer]:>13.2f}"
            f"  {loads[layer].min():>13.3f}  {dead[layer]:>4}  {r:>15}  {x:>8}"
        )
    print(
        f"  dead experts (under {DEAD_LOAD:.0%} of the even share): {int(dead.sum())} of {dead.size} "
        f"({dead.sum() / dead.size:.1%})"
    )
    print(
        f"  mean co-occurrence recall@{cfg.top_k} {rec.mean():.3f} vs chance {chance:.3f} ({rec.mean() / chance:.2f}x)"
    )


if __name__ == "__main__":
    main()
