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
from dataclasses import dataclass
from typing import Any


@dataclass
class _Generation:
    """The model, its recorder, the generation settings and the requests that every pass runs."""

    net: Any
    tokenizer: Any
    recorder: Any
    settings: Any
    reqs: list

    def timed(self, traced: bool) -> tuple[float, int]:
        """One untraced or traced generation of every request: (wall seconds, tokens)."""
        from moecast.collect.runner import Collector

        reqs = self.reqs
        if traced:
            self.recorder.attach(self.net)
        try:
            col = Collector(self.net, self.tokenizer, self.recorder if traced else None, self.settings)
            start = time.perf_counter()
            col.run(reqs, None, progress=False)
            return time.perf_counter() - start, col.tokens_done
        finally:
            if traced:
                self.recorder.detach()

    def best_of(self, repeats: int) -> tuple[list[float], list[float], int]:
        """Untraced and traced passes alternated ``repeats`` times: (untraced s, traced s, tokens)."""
        plain, traced = [], []
        tokens = 0
        for _ in range(repeats):
            t, _n = self.timed(False)
            plain.append(t)
            t, tokens = self.timed(True)
            traced.append(t)
        return plain, traced, tokens

    def collect(self, info: Any, gate_inputs: bool) -> dict:
        """A traced collection of every request to TraceWriter parts on disk; its stats."""
        from moecast.collect.runner import Collector
        from moecast.collect.traceset import TraceMeta, TraceWriter

        with tempfile.TemporaryDirectory() as tmp:
            fields = {"topk_weights": True, "router_probs": True, "gate_inputs": gate_inputs}
            writer = TraceWriter(f"{tmp}/traces", TraceMeta(model=info, collection={}, fields=fields))
            self.recorder.attach(self.net)
            try:
                _, stats = Collector(self.net, self.tokenizer, self.recorder, self.settings).run(
                    self.reqs, writer, progress=False
                )
            finally:
                self.recorder.detach()
        return stats


def measure(
    model: str = "tiny",
    requests: int = 16,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    max_prompt_tokens: int = 256,
    repeats: int = 3,
    threads: int = 1,
    gate_inputs: bool = False,
) -> dict:
    """Untraced and traced generation of the same requests (best of ``repeats``), then a collection to disk."""
    import torch
    from moecast.collect.models import find_moe_structure, load_model, model_info
    from moecast.collect.recorder import RoutingRecorder
    from moecast.collect.runner import GenerationSettings
    from moecast.collect.workloads import get_spec, load_requests

    torch.set_num_threads(threads)
    net, tokenizer, name = load_model(model)
    structure = find_moe_structure(net)
    info = model_info(net, structure, name)
    reqs = load_requests(get_spec("sharegpt"), None, limit=requests)
    settings = GenerationSettings(
        max_new_tokens=max_new_tokens, batch_size=batch_size, max_prompt_tokens=max_prompt_tokens
    )
    recorder = RoutingRecorder(structure, info.top_k, router_probs=True, gate_inputs=gate_inputs)
    gen = _Generation(net, tokenizer, recorder, settings, reqs)
    gen.timed(False)  # warm-up: first calls allocate and pick kernels
    plain, traced, tokens = gen.best_of(repeats)
    stats = gen.collect(info, gate_inputs)
    return {
        "model": name,
        "info": info,
        "requests": len(reqs),
        "tokens": tokens,
        "plain": plain,
        "traced": traced,
        "overhead": min(traced) / min(plain) - 1,
        "collection": stats,
    }


def rows(quick: bool) -> list[dict]:
    """Tracing overhead and collection throughput on ``tiny`` (the test preset when the default is not built)."""
    from bench.figures import fig, tiny_built

    model, note = "tiny", ""
    if not tiny_built("default"):
        model, note = "tiny:test", "tiny default not built; on the test preset"
    kw = {}
    if quick:
        kw = {"requests": 8, "max_new_tokens": 16, "repeats": 2}
        note = ", ".join(filter(None, [note, "quick: 8 requests x 16 tokens, best of 2"]))
    m = measure(model, **kw)
    return [
        fig("collect", f"tracing overhead on {model}", m["overhead"] * 100, "{:+.1f} %", "<= 10 %", note),
        fig(
            "collect",
            f"collection tokens/s on {model} (to disk)",
            m["collection"]["tokens_per_s"],
            "{:,.0f}",
            note=note,
        ),
    ]


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
    m = measure(**vars(args))
    info, plain, traced, tokens = m["info"], m["plain"], m["traced"], m["tokens"]
    stats = m["collection"]
    best_plain, best_traced = min(plain), min(traced)
    print(
        f"model {m['model']}: {info.family}, {info.num_layers} MoE layers x {info.num_experts} experts, top-{info.top_k}; "
        f"{m['requests']} ShareGPT requests, batch {args.batch_size}, {args.max_new_tokens} new tokens, "
        f"{args.threads} thread(s), best of {args.repeats}"
    )
    print(f"  tokens per pass                 {tokens:,}")
    print(f"  untraced generation             {best_plain:.3f} s  ({tokens / best_plain:,.0f} tok/s)")
    print(f"  traced generation               {best_traced:.3f} s  ({tokens / best_traced:,.0f} tok/s)")
    print(
        f"  tracing overhead                {m['overhead'] * 100:+.1f} %  (goal <= 10 %)  "
        f"[all repeats: untraced {', '.join(f'{t:.2f}' for t in plain)}; traced {', '.join(f'{t:.2f}' for t in traced)}]"
    )
    print(
        f"  collection to disk (end to end) {stats['tokens_per_s']:,.0f} tok/s  ({int(stats['tokens']):,} tokens in {stats['seconds']:.2f} s)"
    )


if __name__ == "__main__":
    main()
