"""Benchmark the predictors: held-out recall per predictor, tiny recall per layer group, latency, training time.

One command prints every figure the predictor issues ask for::

    python bench/bench_predictors.py --checkpoint /tmp/best/llapor_ds.safetensors \
        --tiny-traces /tmp/pp/tiny-sg --tiny-checkpoint /tmp/best/llapor_tiny.safetensors
    python bench/bench_predictors.py --quick      # minutes: small training runs, fewer requests

1. DeepSeek-V2-Lite (``--traces``, default ``traces/ds-puffin``), held-out 10% of prompts
   (``TraceSet.split(0.1, seed=0)``, the split training uses): recall@k, recall@4, F1 per
   predictor: the count baselines (global / per-request frequency, MoE-Infinity activation
   matrices, built on the training split) and LLaPor. With ``--checkpoint`` LLaPor is read
   from that file (no training; its recorded training time is shown); without it LLaPor is
   trained with ``--config`` into ``--out-dir`` and the wall time is measured.
2. tiny traces with gate inputs (``--tiny-traces``): the same table plus the gate-reuse
   baseline (router weights from ``--tiny-model``), per layer group. Skipped with a note when
   the traces are absent (make them with ``moecast collect --model tiny --workloads sharegpt
   --max-requests 64 --max-new-tokens 32 --gate-inputs --out /tmp/pp/tiny-sg``).
3. LLaPor inference on CPU, batch 1, one thread: ``score_layer`` (the runtime's per-layer call,
   numpy, fed the token's feature row as numpy arrays) in µs per layer, median over every layer and many repeats,
   with its int8 weights (the default) and with float32 weights; plus the batched torch
   network over all layers divided by L. The 1-minute load average is printed beside it: on a
   shared machine timings scale with it.

``--quick``: at most 60 held-out requests per trace set, LLaPor trained (only when no checkpoint
is given) on 300 requests for 1 epoch (tiny: 5 epochs), fewer timing repeats. ``--json`` prints
one JSON object per result line instead of the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

DS_BASELINES = ("frequency", "frequency-request", "cooccurrence", "moe-infinity")


def _load(path: str, ts: Any) -> Any:
    from moecast.predictors.registry import load

    return load(path, fingerprint=ts.meta.model.fingerprint, against=f"TraceSet {ts.path}")


def _train(config: str, traces: str, out: Path, overrides: list[str]) -> tuple[str, float]:
    """Train LLaPor with ``moecast train``; returns (checkpoint path, wall seconds)."""
    from moecast.train.cli import train

    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["llapor", "--config", config, "--traces", traces, "--out", str(out), "--resume", "never"]
    t = time.perf_counter()
    train(argv + overrides)
    return str(out), time.perf_counter() - t


def latency_us(pred: Any, trace: Any, repeats: int) -> dict[str, float]:
    """Batch-1 CPU latency of one token, one thread: score_layer µs per layer (its int8 weights,
    the runtime's default, and float32) and torch µs per layer."""
    feats = pred.features(trace)
    row = min(5, len(trace.topk_ids) - 1)
    one = {k: v[row : row + 1] for k, v in feats.items()}
    one_np = {k: v.numpy() for k, v in one.items()}  # the token's feature row, as numpy
    L = pred.num_layers
    per: dict[bool, list[float]] = {True: [], False: []}
    for int8 in (True, False):
        pred.int8_kernel = int8
        for layer in range(L):
            pred.score_layer(layer, one_np)  # warm-up (and per-layer weight cache)
    for _ in range(repeats):  # the two precisions alternate, so load changes hit both alike
        for int8 in (True, False):
            pred.int8_kernel = int8
            t = time.perf_counter()
            for layer in range(L):
                pred.score_layer(layer, one_np)
            per[int8].append((time.perf_counter() - t) / L * 1e6)
    pred.int8_kernel = True
    with torch.no_grad():
        pred.net(**one)
        t = time.perf_counter()
        for _ in range(repeats):
            pred.net(**one)
        torch_us = (time.perf_counter() - t) / repeats / L * 1e6
    return {
        "score_layer_us_median": statistics.median(per[True]),
        "score_layer_us_p90": float(np.percentile(per[True], 90)),
        "score_layer_float32_us_median": statistics.median(per[False]),
        "torch_all_layers_us_per_layer": torch_us,
        "loadavg_1min": os.getloadavg()[0],
    }


def speculative_state(layer: Any, exact: torch.Tensor, cur: torch.Tensor, pe: tuple) -> torch.Tensor:
    """[T, H] layer ``layer``'s post-attention-norm state when its attention runs on ``cur`` [T, H]
    (each token's early estimate of its input) against the exact inputs ``exact`` [T, H] of the
    tokens before it: token i's query, key and value come from ``cur[i]``, tokens j < i's keys and
    values from ``exact[j]``. One call of the layer's own attention module over [exact; cur] with a
    mask, so it holds for any attention the module implements (rotary ``pe`` [1, T, d] pairs).
    ``cur == exact`` gives back the model's own state."""
    t = exact.shape[0]
    x = torch.cat([layer.input_layernorm(exact), layer.input_layernorm(cur)])[None]
    pe2 = tuple(torch.cat([p, p], 1) for p in pe)
    q, kk = torch.arange(t)[:, None], torch.arange(t)[None]
    mask = torch.full((2 * t, 2 * t), -torch.inf)
    mask[:t, :t] = torch.zeros(t, t).masked_fill(kk > q, -torch.inf)  # the exact half: plain causal
    mask[t:, :t] = torch.zeros(t, t).masked_fill(kk >= q, -torch.inf)  # earlier tokens, exact
    mask[t:, t:] = torch.zeros(t, t).masked_fill(kk != q, -torch.inf)  # itself, early
    attn = layer.self_attn(hidden_states=x, position_embeddings=pe2, attention_mask=mask[None, None])[0]
    return layer.post_attention_layernorm(cur + attn[0, t:])


def state_reference(
    model_dir: str, texts: int = 60, windows: tuple[int, ...] = (2, 8, 32)
) -> dict[str, list[float | None]]:
    """How far layer l-1 can see in ``tiny``: per layer, recall@k of layer l's true router applied to

    - ``gate_reuse``: layer l-1's gate input (the gate-reuse baseline, on the model's own run);
    - ``input_state``: the token's whole state when layer l-1 ends, i.e. layer l's input hidden
      state through layer l's post-attention norm: everything but layer l's attention;
    - ``window_W`` (W in ``windows``): layer l's state with layer l's own attention (the model's
      weights) computed over only the token itself, the W tokens before it and the request's
      first token (the attention sink): how much of the earlier context layer l's routing reads.
    - ``speculative``: layer l's attention run early, when layer l-1's gate input is known (the
      point LLaPor predicts from): the earlier tokens' keys and values exact (a decode step's KV
      cache holds them), the token's own query, key and value from its residual before layer
      l-1's experts (:func:`speculative_state`). What the model's own weights give with the context
      but without layer l-1's expert output.

    Run on the first ``texts`` held-out ShareGPT texts of ``tiny``'s own split. A reference, not a
    ceiling: a predictor that also reads the context (as LLaPor does) can pass ``input_state``.
    """
    import itertools

    from moecast.collect import sharegpt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # eager attention: the windowed rows pass their own additive mask
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    layers = model.model.layers
    k = model.config.num_experts_per_tok
    gin: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: gin.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))
        )
        for i, layer in enumerate(layers)
    ]

    def top(li: int, x: torch.Tensor) -> np.ndarray:
        return torch.topk(x @ layers[li].mlp.gate.weight.T, k, dim=-1).indices.numpy()

    def recall(a: np.ndarray, b: np.ndarray) -> float:
        return float((a[:, :, None] == b[:, None, :]).any(-1).mean())

    mout: dict[int, torch.Tensor] = {}
    hooks += [
        layer.mlp.register_forward_hook(lambda m, a, o, i=i: mout.__setitem__(i, o[0]))
        for i, layer in enumerate(layers)
    ]

    keys = ["gate_reuse", "input_state", *(f"window_{w}" for w in windows), "speculative"]
    sums = {key: np.zeros(len(layers)) for key in keys}
    n = 0
    try:
        with torch.no_grad():
            for text in itertools.islice(
                sharegpt.training_texts(split="val", max_chars_per_text=2000), texts
            ):
                ids = tok(text, return_tensors="pt", truncation=True, max_length=256)["input_ids"]
                hs = model(input_ids=ids, output_hidden_states=True).hidden_states  # hs[l]: layer l's input
                t = ids.shape[1]
                pe = model.model.rotary_emb(hs[0], torch.arange(t)[None])
                q, kk = torch.arange(t)[:, None], torch.arange(t)[None]
                masks = {
                    w: torch.zeros(t, t).masked_fill(~((kk <= q) & ((q - kk <= w) | (kk == 0))), -torch.inf)
                    for w in windows
                }
                for li in range(1, len(layers)):
                    truth = top(li, gin[li])
                    sums["gate_reuse"][li] += recall(top(li, gin[li - 1]), truth) * t
                    state = layers[li].post_attention_layernorm(hs[li][0])
                    sums["input_state"][li] += recall(top(li, state), truth) * t
                    x = layers[li].input_layernorm(hs[li])
                    for w, mask in masks.items():
                        attn = layers[li].self_attn(
                            hidden_states=x, position_embeddings=pe, attention_mask=mask[None, None]
                        )[0]
                        state = layers[li].post_attention_layernorm(hs[li][0] + attn[0])
                        sums[f"window_{w}"][li] += recall(top(li, state), truth) * t
                    state = speculative_state(layers[li], hs[li][0], hs[li][0] - mout[li - 1], pe)
                    sums["speculative"][li] += recall(top(li, state), truth) * t
                n += t
    finally:
        for h in hooks:
            h.remove()
    return {key: [None] + [float(v / n) for v in arr[1:]] for key, arr in sums.items()}


def table(
    name: str, ts: Any, preds: list[tuple[str, Any, float | None]], requests: list[str], emit: Any
) -> dict[str, dict]:
    from moecast.predictors.commands import detected_groups, evaluate_predictor

    k = ts.meta.model.top_k
    train_ids, _ = ts.split(0.1, 0)
    hint = detected_groups(ts, train_ids)
    results = {}
    emit(
        f"\n[{name}] {ts.path}: {ts.meta.model.name_or_path}, {ts.num_layers} MoE layers, {ts.num_experts} "
        f"experts, top-{k}; held-out {len(requests)} requests",
        None,
    )
    w = max([34] + [len(label) + 1 for label, _, _ in preds])  # a long checkpoint name widens the column
    emit(
        f"{'predictor':<{w}}{'horizon':<14}{'recall@' + str(k):>10}{'recall@4':>10}{'f1_micro':>10}"
        f"{'f1_macro':>10}{'train s':>9}   per group recall@{k}",
        None,
    )
    for label, pred, secs in preds:
        res = evaluate_predictor(pred, ts, requests, extra_k=(4,), progress=False, groups_hint=hint)
        groups = res.get("per_group") or {}
        gtxt = "  ".join(f"{g} {r['recall_at_k']:.4f}" for g, r in groups.items())
        secs_s = f"{secs:>9.1f}" if isinstance(secs, (int, float)) else f"{'-':>9}"
        r4 = res.get("recall_at_4", res["recall_at_k"] if k == 4 else float("nan"))
        emit(
            f"{label:<{w}}{pred.horizon:<14}{res['recall_at_k']:>10.4f}{r4:>10.4f}"
            f"{res['f1_micro']:>10.4f}{res['f1_macro']:>10.4f}{secs_s}   {gtxt}",
            {
                "bench": name,
                "predictor": label,
                "horizon": pred.horizon,
                "requests": len(requests),
                "tokens": res["tokens"],
                "recall_at_k": res["recall_at_k"],
                "recall_at_4": r4,
                "f1_micro": res["f1_micro"],
                "f1_macro": res["f1_macro"],
                "per_group_recall": {g: r["recall_at_k"] for g, r in groups.items()},
                "groups": hint if not getattr(pred, "groups", None) else pred.groups,
                "train_seconds": secs,
            },
        )
        results[label] = res
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="traces/ds-puffin", help="DeepSeek TraceSet (ids only)")
    ap.add_argument("--checkpoint", default=None, help="LLaPor checkpoint for --traces (else: train one)")
    ap.add_argument("--config", default="configs/llapor_deepseek.yaml")
    ap.add_argument(
        "--sequence-checkpoint",
        default=None,
        help="MoE-Beyond-style sequence checkpoint for --traces (token-ahead)",
    )
    ap.add_argument("--tiny-traces", default="/tmp/pp/tiny-sg", help="tiny TraceSet with gate inputs")
    ap.add_argument("--tiny-checkpoint", default=None, help="LLaPor checkpoint for --tiny-traces")
    ap.add_argument("--tiny-config", default="configs/llapor_tiny.yaml")
    ap.add_argument("--tiny-model", default=str(Path.home() / ".cache/moecast/tiny/default"))
    ap.add_argument("--out-dir", default="/tmp/bench_predictors", help="where trained checkpoints go")
    ap.add_argument("--max-requests", type=int, default=None, help="held-out requests per trace set")
    ap.add_argument("--repeats", type=int, default=None, help="timing repeats (all layers each)")
    ap.add_argument("--quick", action="store_true", help="small training runs, 60 requests, fewer repeats")
    ap.add_argument("--skip-ds", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object per result line")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # batch-1 inference; tiny tensors only pay for thread hand-offs
    max_req = args.max_requests or (60 if args.quick else None)
    repeats = args.repeats or (50 if args.quick else 300)
    out_dir = Path(args.out_dir)

    def emit(text: str, obj: dict | None) -> None:
        if args.json:
            if obj is not None:
                print(json.dumps(obj), flush=True)
        else:
            print(text, flush=True)

    from moecast.collect.traceset import open_traces
    from moecast.predictors.commands import build_baseline

    timing: list[tuple[str, Any, Any]] = []
    if not args.skip_ds:
        ts = open_traces(args.traces)
        train_ids, val_ids = ts.split(0.1, 0)
        requests = val_ids[:max_req] if max_req else val_ids
        preds = [(b, build_baseline(b, ts, train_ids), None) for b in DS_BASELINES]
        if args.checkpoint:
            pred = _load(args.checkpoint, ts)
            secs = (pred.meta.get("training") or {}).get("train_seconds")
        else:
            over = ["--data.max_requests", "300", "--trainer.max_epochs", "1"] if args.quick else []
            path, secs = _train(args.config, args.traces, out_dir / "llapor_ds.safetensors", over)
            pred = _load(path, ts)
        preds.append((f"llapor ({Path(args.checkpoint or 'trained').name})", pred, secs))
        if args.sequence_checkpoint:
            seq = _load(args.sequence_checkpoint, ts)
            seq_secs = (seq.meta.get("training") or {}).get("train_seconds")
            preds.append((f"sequence ({Path(args.sequence_checkpoint).name})", seq, seq_secs))
        table("deepseek held-out", ts, preds, requests, emit)
        timing.append(("deepseek", pred, ts.get(requests[0])))
    if not args.skip_tiny:
        if not Path(args.tiny_traces, "meta.json").is_file():
            emit(
                f"\n[tiny] skipped: no TraceSet at {args.tiny_traces} (moecast collect --model tiny --workloads "
                "sharegpt --max-requests 64 --max-new-tokens 32 --gate-inputs --out PATH)",
                {"bench": "tiny", "skipped": f"no TraceSet at {args.tiny_traces}"},
            )
        else:
            ts = open_traces(args.tiny_traces)
            train_ids, val_ids = ts.split(0.1, 0)
            requests = val_ids[:max_req] if max_req else val_ids
            preds = [
                (b, build_baseline(b, ts, train_ids), None)
                for b in ("frequency", "cooccurrence", "moe-infinity")
            ]
            if ts.has("gate_inputs") and Path(args.tiny_model).is_dir():
                preds.append(
                    ("gate-reuse", build_baseline(f"gate-reuse:{args.tiny_model}", ts, train_ids), None)
                )
            if args.tiny_checkpoint:
                pred = _load(args.tiny_checkpoint, ts)
                secs = (pred.meta.get("training") or {}).get("train_seconds")
            else:
                over = ["--trainer.max_epochs", "5"] if args.quick else []
                path, secs = _train(
                    args.tiny_config, args.tiny_traces, out_dir / "llapor_tiny.safetensors", over
                )
                pred = _load(path, ts)
            label = f"llapor ({Path(args.tiny_checkpoint or 'trained').name})"
            preds.append((label, pred, secs))
            results = table("tiny held-out", ts, preds, requests, emit)
            timing.append(("tiny", pred, ts.get(requests[0])))
            if Path(args.tiny_model).is_dir():
                ref = state_reference(args.tiny_model, 20 if args.quick else 60)
                per = results[label]["per_layer"]["recall_at_k"]

                def row(v: list) -> str:
                    return " ".join("   -  " if x is None else f"{x:.3f}" for x in v)

                emit(
                    "\n[tiny] how far layer l-1 can see: recall@k per layer of the true router of layer l on\n"
                    f"  layer l-1's gate input (gate reuse)        {row(ref['gate_reuse'])}\n"
                    f"  layer l's input state (all but attention)  {row(ref['input_state'])}\n"
                    + "".join(
                        f"  ... + layer l's attention, last {key[7:]:>2} tokens {row(v)}\n"
                        for key, v in ref.items()
                        if key.startswith("window_")
                    )
                    + f"  layer l's attention early, at l-1's input  {row(ref['speculative'])}\n"
                    + f"  LLaPor (held-out traces)                   {row(per)}",
                    {"bench": "tiny-reference", **ref, "llapor_per_layer": per},
                )
    if timing:
        emit(
            "\n[latency] LLaPor on CPU, batch 1, 1 thread (score_layer = the runtime's per-layer call)", None
        )
        for name, pred, trace in timing:
            lat = latency_us(pred, trace, repeats)
            emit(
                f"{name:<10} score_layer {lat['score_layer_us_median']:7.1f} µs/layer median "
                f"(p90 {lat['score_layer_us_p90']:.1f}; float32 weights {lat['score_layer_float32_us_median']:.1f}); torch all-layers {lat['torch_all_layers_us_per_layer']:.1f} "
                f"µs/layer; load average {lat['loadavg_1min']:.2f} on {os.cpu_count()} CPUs",
                {"bench": "latency", "traces": name, **lat, "cpus": os.cpu_count()},
            )


if __name__ == "__main__":
    sys.exit(main())
