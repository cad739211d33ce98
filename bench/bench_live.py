"""Live runtime figures on ``tiny`` (CPU): attach overhead at full residency, and SMoE's alpha sweep.

    python bench/bench_live.py [--tokens 32] [--repeats 5] [--texts 6] [--text-tokens 64] [--capacity 0.25]

Prints (goals from the live-runtime issue):
- overhead of the attached runtime vs plain ``generate`` at full residency (goal <= 15 %);
- alpha = 0.3: perplexity change on held-out ShareGPT text (goal <= 2 %) and greedy
  next-token agreement with alpha = 0 (goal >= 95 %);
- the whole alpha sweep (SMoE Table IV-style), with modeled TPOT on the default profile;
- with a LLaPor checkpoint for ``tiny`` (``--predictor``, default runs/llapor_tiny.safetensors when
  present): ms/token attached with layer-ahead prediction, and the per-layer prediction call
  inside the decode loop (window, features of that layer, score_layer), median and p90 in µs,
  and the same calls out of the loop with warm caches.

Uses the built ``tiny`` default model when it exists ($MOECAST_HOME/tiny/default),
otherwise the quick ``test`` preset (said in the output).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from moecast.errors import MoecastError

DEFAULT_PREDICTOR = str(Path(__file__).resolve().parents[1] / "runs" / "llapor_tiny.safetensors")


def _model():
    from moecast.collect.tiny import _default_out, _is_built, ensure_tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    preset = "default" if _is_built(_default_out("default")) else "test"
    path = ensure_tiny(preset)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path), preset


@torch.no_grad()
def _generate_ms(model, ids, tokens: int) -> float:
    t0 = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return (time.perf_counter() - t0) * 1e3 / tokens


def _predictor_timing(model, ids, predictor: str, capacity: float, tokens: int, repeats: int) -> dict:
    """At ``capacity``: ms/token attached with lru alone and with LLaPor's layer-ahead prefetch,
    and the per-layer prediction call inside the decode loop (µs), or ``{"skipped": why}``."""
    import numpy as np
    from moecast.predictors.registry import load
    from moecast.runtime.live.runtime import attach

    try:
        pred = load(predictor)
        attach(model, policy="lru", capacity=capacity, predictor=pred).detach()
    except (ValueError, MoecastError) as exc:
        return {"skipped": str(exc)}
    calls: list[float] = []
    ms: dict[str, list[float]] = {"lru": [], "lru + LLaPor": []}
    for _ in range(repeats):  # interleaved, as above
        for name in ms:
            rt = attach(model, policy="lru", capacity=capacity, predictor=pred if "LLaPor" in name else None)
            if "LLaPor" in name:
                inner = rt.prefetcher.predict_layer_ahead

                def timed(nxt: int, inner=inner):
                    t0 = time.perf_counter()
                    out = inner(nxt)
                    calls.append(time.perf_counter() - t0)
                    return out

                rt.prefetcher.predict_layer_ahead = timed
            try:
                mark = len(calls)
                _generate_ms(model, ids, 4)  # warm-up (kernels, packed weights): not counted
                del calls[mark:]
                ms[name].append(_generate_ms(model, ids, tokens))
            finally:
                rt.detach()
    us = np.array(calls) * 1e6
    return {
        "ms_per_token": ms,
        "calls": len(us),
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "warm_us": _warm_prediction_us(model, ids, pred, capacity),
    }


def _warm_prediction_us(model, ids, pred, capacity: float) -> float:
    """Median µs of score_at on snapshots of the live windows, each repeated
    back to back: the predictor's own cost once its weights and code are in the caches."""
    import copy

    import numpy as np
    from moecast.runtime.live.runtime import attach

    snaps: list[tuple[object, int]] = []
    rt = attach(model, policy="lru", capacity=capacity, predictor=pred)
    inner = rt.prefetcher.predict_layer_ahead

    def grab(nxt: int):
        snaps.append((copy.deepcopy(rt.prefetcher.stream.trace), nxt))  # the window score_at reads
        return inner(nxt)

    rt.prefetcher.predict_layer_ahead = grab
    try:
        _generate_ms(model, ids, 4)
    finally:
        rt.detach()
    med = []
    for trace, layer in snaps:
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            pred.score_at(trace, layer)
            ts.append(time.perf_counter() - t0)
        med.append(np.median(ts[5:]))
    return float(np.median(med)) * 1e6


def measure(
    tokens: int = 32,
    repeats: int = 5,
    texts: int = 6,
    text_tokens: int = 64,
    capacity: str = "0.25",
    alphas: tuple[float, ...] = (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
    predictor: str = DEFAULT_PREDICTOR,
) -> dict:
    """Full-residency overhead (best of ``repeats``), the LLaPor timing, and the alpha sweep."""
    from moecast.runtime.live.commands import heldout_rows, sweep
    from moecast.runtime.live.runtime import attach

    torch.set_num_threads(1)
    model, tok, preset = _model()
    ids = torch.tensor([tok("Tell me about the history of the printing press.")["input_ids"]])
    _generate_ms(model, ids, 4)  # warm-up
    plain, live = [], []
    for _ in range(repeats):
        # interleaved so that load from other processes hits both alike
        plain.append(_generate_ms(model, ids, tokens))
        rt = attach(model, policy="smoe", capacity=None, alpha=0.0)
        _generate_ms(model, ids, 4)  # warm-up: the first attach loads the compiled decision kernels
        live.append(_generate_ms(model, ids, tokens))
        stats = rt.stats()
        rt.detach()
    out = {
        "preset": preset,
        "parameters": sum(p.numel() for p in model.parameters()),
        "plain": plain,
        "live": live,
        "hit_rate": stats["hit_rate"],
    }
    if Path(predictor).is_file() and preset == "default":
        out["llapor"] = _predictor_timing(model, ids, predictor, float(capacity), tokens, repeats)
    else:
        out["llapor"] = {"skipped": f"no checkpoint {predictor} for tiny default"}
    rows = heldout_rows(tok, "sharegpt", texts, text_tokens)
    t0 = time.perf_counter()
    out["sweep"] = sweep(model, rows, list(alphas), progress=False, policy="smoe", capacity=capacity)
    out["sweep_texts"], out["sweep_seconds"] = len(rows), time.perf_counter() - t0
    return out


def overhead(m: dict) -> float:
    """Attached over plain ms/token, best of the repeats: on a shared machine other processes only
    ever add time, so the minimum is the cleanest estimate of each."""
    return min(m["live"]) / min(m["plain"]) - 1


def rows(quick: bool, tiny_checkpoint: Path | None = None) -> list[dict]:
    """``quick``: 16 tokens x 2 repeats, 3 texts x 32 tokens, alphas 0 and 0.3."""
    from bench.figures import fig, shown

    kw = {"tokens": 16, "repeats": 2, "texts": 3, "text_tokens": 32, "alphas": (0, 0.3)} if quick else {}
    predictor = str(tiny_checkpoint or DEFAULT_PREDICTOR)
    m = measure(**kw, predictor=predictor)
    note = ", ".join(
        filter(None, [f"tiny {m['preset']}", "quick: 16 tokens x 2, 3 texts x 32 tokens" if quick else ""])
    )
    at = next((r for r in m["sweep"] if abs(r["alpha"] - 0.3) < 1e-9), {})
    change, agree = at.get("perplexity_change"), at.get("agreement")
    return [
        fig(
            "live", "live runtime overhead at full residency", 100 * overhead(m), "{:+.1f} %", "<= 15 %", note
        ),
        *_llapor_rows(m["llapor"], note, shown(predictor)),
        fig(
            "live",
            "alpha=0.3 perplexity change",
            None if change is None else 100 * change,
            "{:+.2f} %",
            "<= 2 %",
            note,
        ),
        fig(
            "live",
            "alpha=0.3 greedy agreement",
            None if agree is None else 100 * agree,
            "{:.1f} %",
            ">= 95 %",
            note,
        ),
    ]


def _llapor_rows(ll: dict, note: str, predictor: str) -> list[dict]:
    from bench.figures import fig, row

    names = {
        "median_us": (
            "LLaPor per-layer prediction in the decode loop (us)",
            f"; window + score_at (that layer's features and network), tiny, {predictor}",
        ),
        "warm_us": (
            "LLaPor per-layer prediction out of the loop, warm caches (us)",
            "; the same calls on snapshots of the live windows, back to back",
        ),
    }
    if "skipped" in ll:
        return [
            row("live", name, f"skipped: {ll['skipped']}", "<= 100 us", note=note)
            for name, _ in names.values()
        ]
    return [
        fig("live", name, ll[key], "{:.1f} us", "<= 100 us", note + more)
        for key, (name, more) in names.items()
    ]


def _parse_args() -> argparse.Namespace:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--texts", type=int, default=6)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--capacity", default="0.25")
    ap.add_argument("--alphas", default="0,0.1,0.2,0.3,0.4,0.5,0.6")
    ap.add_argument(
        "--predictor",
        default=DEFAULT_PREDICTOR,
        help="LLaPor checkpoint for tiny (skipped when absent or trained on another model)",
    )
    return ap.parse_args()


def _print_overhead(m: dict, tokens: int, repeats: int) -> None:
    """Plain and attached ms/token at full residency and the overhead between them."""
    p, lv = min(m["plain"]), min(m["live"])
    pm, lm = statistics.median(m["plain"]), statistics.median(m["live"])
    print(f"\nfull residency, {tokens} new tokens, best of {repeats} (median in brackets):")
    print(f"  plain generate      {p:7.2f} ms/token  ({pm:.2f})")
    print(f"  attached (alpha 0)  {lv:7.2f} ms/token  ({lm:.2f})   hit rate {m['hit_rate']:.3f}")
    print(
        f"  overhead            {100 * overhead(m):+7.1f} %   (goal <= 15 %; medians {100 * (lm / pm - 1):+.1f} %)"
    )


def _print_llapor(ll: dict, predictor: str, capacity: str, repeats: int) -> None:
    """LLaPor's ms/token and per-layer prediction call in the decode loop, or why it was skipped."""
    if "skipped" in ll:
        print(f"\nLLaPor in the decode loop: skipped ({ll['skipped']})")
        return
    print(f"\nLLaPor in the decode loop ({Path(predictor).name}, capacity {capacity}, best of {repeats}):")
    for name, v in ll["ms_per_token"].items():
        print(f"  {name:<18} {min(v):7.2f} ms/token  ({statistics.median(v):.2f})")
    print(
        f"  per-layer prediction {ll['median_us']:6.1f} us median, p90 {ll['p90_us']:.1f} us "
        f"({ll['calls']} calls: window, then score_at: that layer's features and network)"
    )
    print(
        f"  the same calls out of the loop {ll['warm_us']:6.1f} us median (warm caches: the rest is the model's "
        "own work between layers evicting the predictor's data on this CPU)"
    )


def _print_sweep(m: dict, capacity: str) -> None:
    """The alpha sweep's table, then the alpha = 0.3 figures against their goals."""
    res = m["sweep"]
    print(
        f"\nalpha sweep: {m['sweep_texts']} held-out ShareGPT texts, {res[0]['tokens']} tokens scored one by one "
        f"(decode steps), capacity {capacity}, {m['sweep_seconds']:.0f} s"
    )
    print(
        f"  {'alpha':>5}  {'ppl':>8}  {'d ppl':>7}  {'agree':>6}  {'subst':>6}  {'hit':>6}  {'TPOT model':>10}  {'measured':>8}"
    )
    for r in res:
        print(
            f"  {r['alpha']:>5.2f}  {r['perplexity']:>8.3f}  {100 * r['perplexity_change']:>+6.2f}%  "
            f"{100 * r['agreement']:>5.1f}%  {100 * r['substitution_rate']:>5.1f}%  {100 * r['hit_rate']:>5.1f}%  "
            f"{r['modeled_tpot_ms']:>8.3f}ms  {r['measured_tpot_ms']:>6.2f}ms"
        )
    at = next((r for r in res if abs(r["alpha"] - 0.3) < 1e-9), None)
    if at is not None:
        print(
            f"\nalpha = 0.3: perplexity change {100 * at['perplexity_change']:+.2f} % (goal <= 2 %), "
            f"agreement with alpha = 0 {100 * at['agreement']:.1f} % (goal >= 95 %), "
            f"substitution rate {100 * at['substitution_rate']:.1f} %"
        )


def main() -> None:
    args = _parse_args()
    alphas = tuple(float(a) for a in args.alphas.split(","))
    m = measure(
        args.tokens, args.repeats, args.texts, args.text_tokens, args.capacity, alphas, args.predictor
    )
    print(f"tiny ({m['preset']} preset), {m['parameters']:,} parameters, 1 CPU thread")
    _print_overhead(m, args.tokens, args.repeats)
    _print_llapor(m["llapor"], args.predictor, args.capacity, args.repeats)
    _print_sweep(m, args.capacity)


if __name__ == "__main__":
    main()
