"""Tracing overhead and collection throughput on the embedded model ``tiny``.

Runs the same ShareGPT requests through the same batched greedy generation loop
twice per repeat, untraced (no recorder attached) and traced (``moecast_record``
experts implementation + router hooks + host copies), alternating so load drift
hits both alike, and reports the best of the repeats. Then a full collection
(traced generation + TraceWriter parts on disk) gives tokens/s end to end.
Goal: overhead <= 10 %.

    python bench/bench_collect.py [--model tiny|tiny:test|PATH] [--requests 16] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, tiny:PRESET or a local MoE model directory")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--gate-inputs", action="store_true", help="also record gate inputs (more host copies)"
    )
    args = parser.parse_args()

    import torch
    from moecast.collect.models import find_moe_structure, load_model, model_info
    from moecast.collect.recorder import RoutingRecorder
    from moecast.collect.runner import Collector, GenerationSettings
    from moecast.collect.traceset import TraceMeta, TraceWriter
    from moecast.collect.workloads import get_spec, load_requests

    torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(args.model)
    structure = find_moe_structure(model)
    info = model_info(model, structure, name)
    requests = load_requests(get_spec("sharegpt"), None, limit=args.requests)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    recorder = RoutingRecorder(structure, info.top_k, router_probs=True, gate_inputs=args.gate_inputs)

    def timed(traced: bool) -> tuple[float, int]:
        if traced:
            recorder.attach(model)
        try:
            col = Collector(model, tokenizer, recorder if traced else None, settings)
            start = time.perf_counter()
            col.run(requests, None, progress=False)
            return time.perf_counter() - start, col.tokens_done
        finally:
            if traced:
                recorder.detach()

    timed(False)  # warm-up: first calls allocate and pick kernels
    plain, traced = [], []
    tokens = 0
    for _ in range(args.repeats):
        t, _n = timed(False)
        plain.append(t)
        t, tokens = timed(True)
        traced.append(t)
    best_plain, best_traced = min(plain), min(traced)
    overhead = best_traced / best_plain - 1

    with tempfile.TemporaryDirectory() as tmp:
        fields = {"topk_weights": True, "router_probs": True, "gate_inputs": args.gate_inputs}
        writer = TraceWriter(f"{tmp}/traces", TraceMeta(model=info, collection={}, fields=fields))
        recorder.attach(model)
        try:
            col = Collector(model, tokenizer, recorder, settings)
            _, stats = col.run(requests, writer, progress=False)
        finally:
            recorder.detach()

    print(
        f"model {name}: {info.family}, {info.num_layers} MoE layers x {info.num_experts} experts, top-{info.top_k}; "
        f"{len(requests)} ShareGPT requests, batch {args.batch_size}, {args.max_new_tokens} new tokens, "
        f"{args.threads} thread(s), best of {args.repeats}"
    )
    print(f"  tokens per pass                 {tokens:,}")
    print(f"  untraced generation             {best_plain:.3f} s  ({tokens / best_plain:,.0f} tok/s)")
    print(f"  traced generation               {best_traced:.3f} s  ({tokens / best_traced:,.0f} tok/s)")
    print(
        f"  tracing overhead                {overhead * 100:+.1f} %  (goal <= 10 %)  "
        f"[all repeats: untraced {', '.join(f'{t:.2f}' for t in plain)}; traced {', '.join(f'{t:.2f}' for t in traced)}]"
    )
    print(
        f"  collection to disk (end to end) {stats['tokens_per_s']:,.0f} tok/s  ({int(stats['tokens']):,} tokens in {stats['seconds']:.2f} s)"
    )


if __name__ == "__main__":
    main()
