"""Benchmark the predictors: held-out recall per predictor, tiny recall per layer group, latency, training time.

One command prints every figure the predictor issues ask for::

    python bench/bench_predictors.py --checkpoint runs/llapor_ds.safetensors \
        --tiny-traces traces/tiny-sg --tiny-checkpoint runs/llapor_tiny.safetensors
    python bench/bench_predictors.py --quick      # minutes: small training runs, fewer requests

1. DeepSeek-V2-Lite (``--traces``, default ``traces/ds-puffin``), held-out 10% of prompts
   (the test side of ``TraceSet.splits()``, the default split training uses): recall@k, recall@4, F1 per
   predictor: the count baselines (global / per-request frequency, MoE-Infinity activation
   matrices, built on the training split) and LLaPor. With ``--checkpoint`` LLaPor is read
   from that file (no training; its recorded training time is shown); without it LLaPor is
   trained with ``--config`` into ``--out-dir`` and the wall time is measured.
2. tiny traces with gate inputs (``--tiny-traces``): the same table plus the gate-reuse
   baseline (router weights from ``--tiny-model``), per layer group. Skipped with a note when
   the traces are absent (make them with ``moecast collect --model tiny --workloads sharegpt
   --max-requests 64 --max-new-tokens 32 --gate-inputs --out traces/tiny-sg``).
3. LLaPor inference on CPU, batch 1, one thread, µs per layer, median over every layer and
   many repeats: ``score_at`` (the runtime's per-layer call: the layer's features from the
   request so far, then its network, the gate inputs' PCA folded into the first matrices),
   the same unfolded (``features_at`` + ``score_layer``), ``score_layer`` alone on a ready
   feature row with int8 (the default) and float32 weights, and the batched torch network over
   all layers divided by L. One more row times a gate-input LLaPor at a real model's width
   (``wide_llapor``: random weights, ``--wide-hidden`` 2048 = DeepSeek-V2-Lite), which no
   trace here has. The 1-minute load average is printed beside it: on a shared machine timings
   scale with it.

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
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moecast import home

DS_BASELINES = ("frequency", "frequency-request", "cooccurrence", "moe-infinity")


def _load(path: str, ts: Any) -> Any:
    from moecast.predictors.registry import load

    return load(path, fingerprint=ts.meta.model.fingerprint, against=f"TraceSet {ts.path}")


def _train(config: str, traces: str, out: Path, overrides: list[str]) -> tuple[str, float]:
    """Train LLaPor with ``moecast train``; returns (checkpoint path, wall seconds)."""
    from moecast.cli import run

    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["train", "llapor", "--config", config, "--traces", traces, "--out", str(out), "--resume", "never"]
    t = time.perf_counter()
    run(argv + overrides)
    return str(out), time.perf_counter() - t


def latency_us(pred: Any, trace: Any, repeats: int, torch_too: bool = True) -> dict[str, float]:
    """Batch-1 CPU latency of one token, one thread, µs per layer: ``score_at`` (the runtime's
    per-layer call: that layer's features from the request so far, then its network; int8
    weights, the runtime's default), ``score_layer`` alone on a ready feature row (int8 and
    float32 weights), the unfolded ``features_at`` + ``score_layer``, and torch over all layers / L."""
    row = min(5, len(trace.topk_ids) - 1)
    window = trace.prefix(row + 1)
    L = pred.num_layers
    rows = {layer: pred.features_at(window, layer) for layer in range(L)}
    per: dict[str, list[float]] = {"at": [], "unfolded": [], "int8": [], "float32": []}
    calls = {
        "at": lambda layer: pred.score_at(window, layer),
        "unfolded": lambda layer: pred.score_layer(layer, pred.features_at(window, layer)),
        "int8": lambda layer: pred.score_layer(layer, rows[layer]),
    }
    _warm_up(pred, window, rows)
    for _ in range(repeats):  # the variants alternate, so load changes hit all alike
        for name in per:
            pred.int8_kernel = name != "float32"
            fn = calls.get(name, calls["int8"])
            t = time.perf_counter()
            for layer in range(L):
                fn(layer)
            per[name].append((time.perf_counter() - t) / L * 1e6)
    pred.int8_kernel = True
    out = _latency_summary(per)
    if torch_too:
        out["torch_all_layers_us_per_layer"] = _torch_us_per_layer(pred, window, row, repeats)
    return out


def _warm_up(pred: Any, window: Any, rows: dict[int, Any]) -> None:
    """One untimed call of each variant on every layer, int8 and float32 weights."""
    for int8 in (True, False):
        pred.int8_kernel = int8
        for layer in range(pred.num_layers):
            pred.score_layer(layer, rows[layer])  # warm-up (and per-layer weight cache)
    for layer in range(pred.num_layers):
        pred.score_at(window, layer)


def _latency_summary(per: dict[str, list[float]]) -> dict[str, float]:
    """Median (and p90) µs per layer of each variant, with the 1-minute load average now."""
    return {
        "score_at_us_median": statistics.median(per["at"]),
        "score_at_us_p90": float(np.percentile(per["at"], 90)),
        "unfolded_us_median": statistics.median(per["unfolded"]),
        "score_layer_us_median": statistics.median(per["int8"]),
        "score_layer_us_p90": float(np.percentile(per["int8"], 90)),
        "score_layer_float32_us_median": statistics.median(per["float32"]),
        "loadavg_1min": os.getloadavg()[0],
    }


def _torch_us_per_layer(pred: Any, window: Any, row: int, repeats: int) -> float:
    """The batched torch network over all layers on token ``row``, µs per layer."""
    L = pred.num_layers
    one = {k: torch.as_tensor(v) for k, v in pred.features(window).items()}
    one = {k: v[row : row + 1] for k, v in one.items()}
    with torch.no_grad():
        pred.net(**one)
        t = time.perf_counter()
        for _ in range(repeats):
            pred.net(**one)
        return (time.perf_counter() - t) / repeats / L * 1e6


def wide_llapor(gate_hidden: int = 2048, seed: int = 0) -> tuple[Any, Any]:
    """A LLaPor with gate inputs at a real model's width, random weights, and a 17-token window.

    No model that runs here has DeepSeek-V2-Lite's width (hidden 2048, 26 MoE layers, 64
    experts, top-6), and its real traces carry no gate inputs, so the latency of a gate-input
    LLaPor at that size is timed on random weights: the cost depends on the shapes alone.
    Shapes as ``configs/llapor_tiny.yaml`` trains them (hidden 128, PCA 256 for the input and
    output groups and 512 for the middle, the previous token's gate input, a skip path).
    """
    from moecast.collect.traceset import RequestTrace
    from moecast.predictors.llapor import LLaPor
    from moecast.predictors.llapor_features import FeatureSpec
    from moecast.predictors.llapor_net import LLaPorNet, NetConfig

    L, E, k, T = 26, 64, 6, 17
    torch.manual_seed(seed)
    spec = FeatureSpec(
        num_layers=L, num_experts=E, top_k=k, prev_layers=1, history_tokens=2, token_buckets=4096,
        token_dim=32, gate_pca=True, pca_dims=[256] * 3 + [512] * 20 + [256] * 3, gate_hidden=gate_hidden,
        weights=True, deep_history=True, context_tokens=2, dense_skip=True, context_gate=1,
    )  # fmt: skip
    groups = {"input": [0, 1, 2], "middle": list(range(3, 23)), "output": [23, 24, 25]}
    net = LLaPorNet(spec, groups, NetConfig(hidden=128, depth_io=1, depth_middle=2, dropout=0.0))
    with torch.no_grad():
        net.pca.components.normal_(std=gate_hidden**-0.5)
        net.dense_skip.weight.normal_(std=0.01)
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T * L)]).reshape(T, L, k).astype(np.int16)
    trace = RequestTrace(
        "wide", "random", "", "", rng.integers(0, 30000, T), [""] * T, np.ones(T, bool), ids,
        rng.random((T, L, k)).astype(np.float16), None, rng.standard_normal((T, L, gate_hidden)).astype(np.float32),
    )  # fmt: skip
    return LLaPor(net, list(range(1, L + 1))), trace


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


def _hook_layers(layers: Any) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], list[Any]]:
    """Hooks filling (each layer's gate input [T, H], each layer's expert output, the hook handles)."""
    gin: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: gin.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))
        )
        for i, layer in enumerate(layers)
    ]
    mout: dict[int, torch.Tensor] = {}
    hooks += [
        layer.mlp.register_forward_hook(lambda m, a, o, i=i: mout.__setitem__(i, o[0]))
        for i, layer in enumerate(layers)
    ]
    return gin, mout, hooks


def _top(layer: Any, x: torch.Tensor, k: int) -> np.ndarray:
    """[T, k] the experts ``layer``'s router picks for the states ``x``."""
    return torch.topk(x @ layer.mlp.gate.weight.T, k, dim=-1).indices.numpy()


def _recall(a: np.ndarray, b: np.ndarray) -> float:
    """Share of the experts in ``b`` that ``a`` picks too, token by token."""
    return float((a[:, :, None] == b[:, None, :]).any(-1).mean())


def _add_text_recalls(
    model: Any,
    ids: torch.Tensor,
    gin: dict[int, torch.Tensor],
    mout: dict[int, torch.Tensor],
    windows: tuple[int, ...],
    sums: dict[str, np.ndarray],
) -> int:
    """Run one text ``ids`` and add each reference's recall per layer, times its tokens, to ``sums``; its tokens."""
    layers = model.model.layers
    k = model.config.num_experts_per_tok
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states  # hs[l]: layer l's input
    t = ids.shape[1]
    pe = model.model.rotary_emb(hs[0], torch.arange(t)[None])
    q, kk = torch.arange(t)[:, None], torch.arange(t)[None]
    masks = {
        w: torch.zeros(t, t).masked_fill(~((kk <= q) & ((q - kk <= w) | (kk == 0))), -torch.inf)
        for w in windows
    }
    for li in range(1, len(layers)):
        layer = layers[li]
        truth = _top(layer, gin[li], k)
        sums["gate_reuse"][li] += _recall(_top(layer, gin[li - 1], k), truth) * t
        state = layer.post_attention_layernorm(hs[li][0])
        sums["input_state"][li] += _recall(_top(layer, state, k), truth) * t
        x = layer.input_layernorm(hs[li])
        for w, mask in masks.items():
            attn = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=mask[None, None])[
                0
            ]
            state = layer.post_attention_layernorm(hs[li][0] + attn[0])
            sums[f"window_{w}"][li] += _recall(_top(layer, state, k), truth) * t
        state = speculative_state(layer, hs[li][0], hs[li][0] - mout[li - 1], pe)
        sums["speculative"][li] += _recall(_top(layer, state, k), truth) * t
    return t


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
    gin, mout, hooks = _hook_layers(layers)
    keys = ["gate_reuse", "input_state", *(f"window_{w}" for w in windows), "speculative"]
    sums = {key: np.zeros(len(layers)) for key in keys}
    n = 0
    try:
        with torch.no_grad():
            for text in itertools.islice(
                sharegpt.training_texts(split="val", max_chars_per_text=2000), texts
            ):
                ids = tok(text, return_tensors="pt", truncation=True, max_length=256)["input_ids"]
                n += _add_text_recalls(model, ids, gin, mout, windows, sums)
    finally:
        for h in hooks:
            h.remove()
    return {key: [None] + [float(v / n) for v in arr[1:]] for key, arr in sums.items()}


def table(
    name: str, ts: Any, preds: list[tuple[str, Any, float | None]], requests: list[str]
) -> Iterator[tuple[str, dict | None]]:
    """(text line, JSON object) per predictor; returns each predictor's evaluation by label."""
    from moecast.predictors.commands import detected_groups, evaluate_predictor

    k = ts.meta.model.top_k
    train_ids = ts.splits().train
    hint = detected_groups(ts, train_ids)
    results = {}
    w = max([34] + [len(label) + 1 for label, _, _ in preds])  # a long checkpoint name widens the column
    for line in _table_header(name, ts, k, len(requests), w):
        yield line, None
    for label, pred, secs in preds:
        res = evaluate_predictor(pred, ts, requests, extra_k=(4,), progress=False, groups_hint=hint)
        groups = res.get("per_group") or {}
        r4 = res.get("recall_at_4", res["recall_at_k"] if k == 4 else float("nan"))
        yield (
            _result_line(label, pred, secs, res, r4, groups, w),
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


def _table_header(name: str, ts: Any, k: int, n_requests: int, w: int) -> list[str]:
    """The table's title line (the traces and the held-out requests) and its column heads."""
    return [
        f"\n[{name}] {ts.path}: {ts.meta.model.name_or_path}, {ts.num_layers} MoE layers, {ts.num_experts} "
        f"experts, top-{k}; held-out {n_requests} requests",
        f"{'predictor':<{w}}{'horizon':<14}{'recall@' + str(k):>10}{'recall@4':>10}{'f1_micro':>10}"
        f"{'f1_macro':>10}{'train s':>9}   per group recall@{k}",
    ]


def _result_line(
    label: str, pred: Any, secs: float | None, res: dict, r4: float, groups: dict, w: int
) -> str:
    """One predictor's row of the table: recalls, F1, training seconds and recall per layer group."""
    gtxt = "  ".join(f"{g} {r['recall_at_k']:.4f}" for g, r in groups.items())
    secs_s = f"{secs:>9.1f}" if isinstance(secs, (int, float)) else f"{'-':>9}"
    return (
        f"{label:<{w}}{pred.horizon:<14}{res['recall_at_k']:>10.4f}{r4:>10.4f}"
        f"{res['f1_micro']:>10.4f}{res['f1_macro']:>10.4f}{secs_s}   {gtxt}"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="traces/ds-puffin", help="DeepSeek TraceSet (ids only)")
    ap.add_argument("--checkpoint", default=None, help="LLaPor checkpoint for --traces (else: train one)")
    ap.add_argument("--config", default="configs/llapor_deepseek.yaml")
    ap.add_argument(
        "--sequence-checkpoint",
        default=None,
        help="MoE-Beyond-style sequence checkpoint for --traces (token-ahead)",
    )
    ap.add_argument("--tiny-traces", default="traces/tiny-sg", help="tiny TraceSet with gate inputs")
    ap.add_argument("--tiny-checkpoint", default=None, help="LLaPor checkpoint for --tiny-traces")
    ap.add_argument("--tiny-config", default="configs/llapor_tiny.yaml")
    ap.add_argument("--tiny-model", default=str(home() / "tiny" / "default"))
    ap.add_argument(
        "--out-dir", default=str(home() / "bench" / "predictors"), help="where trained checkpoints go"
    )
    ap.add_argument("--max-requests", type=int, default=None, help="held-out requests per trace set")
    ap.add_argument("--repeats", type=int, default=None, help="timing repeats (all layers each)")
    ap.add_argument("--quick", action="store_true", help="small training runs, 60 requests, fewer repeats")
    ap.add_argument("--skip-ds", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object per result line")
    ap.add_argument("--skip-wide", action="store_true", help="no latency row at a real model's width")
    ap.add_argument(
        "--wide-hidden", type=int, default=2048, help="gate width of that row (DeepSeek-V2-Lite: 2048)"
    )
    return ap.parse_args(argv)


def _held_out(ts: Any, max_req: int | None) -> tuple[list[str], list[str]]:
    """(the training request ids, the held-out requests to evaluate: at most ``max_req``)."""
    sides = ts.splits()  # the default split training uses; test is reported
    train_ids, test_ids = sides.train, sides.test
    return train_ids, test_ids[:max_req] if max_req else test_ids


def _llapor(
    checkpoint: str | None, config: str, traces: str, out: Path, overrides: list[str], ts: Any
) -> tuple[Any, float | None]:
    """(LLaPor, its training seconds): read from ``checkpoint`` (its recorded time), else trained here."""
    if checkpoint:
        pred = _load(checkpoint, ts)
        return pred, (pred.meta.get("training") or {}).get("train_seconds")
    path, secs = _train(config, traces, out, overrides)
    return _load(path, ts), secs


def _ds_results(
    args: argparse.Namespace, max_req: int | None, out_dir: Path
) -> Generator[tuple[str, dict | None], None, tuple[str, Any, Any]]:
    """DeepSeek held-out: the count baselines, LLaPor and the sequence checkpoint; returns LLaPor's timing entry."""
    from moecast.collect.traceset import open_traces
    from moecast.predictors.commands import build_baseline

    ts = open_traces(args.traces)
    train_ids, requests = _held_out(ts, max_req)
    preds = [(b, build_baseline(b, ts, train_ids), None) for b in DS_BASELINES]
    over = ["--data.max_requests", "300", "--train.max_epochs", "1"] if args.quick else []
    out = out_dir / "llapor_ds.safetensors"
    pred, secs = _llapor(args.checkpoint, args.config, args.traces, out, over, ts)
    preds.append((f"llapor ({Path(args.checkpoint or 'trained').name})", pred, secs))
    if args.sequence_checkpoint:
        seq = _load(args.sequence_checkpoint, ts)
        seq_secs = (seq.meta.get("training") or {}).get("train_seconds")
        preds.append((f"sequence ({Path(args.sequence_checkpoint).name})", seq, seq_secs))
    yield from table("deepseek held-out", ts, preds, requests)
    return ("deepseek", pred, ts.get(requests[0]))


def _reference_result(model_dir: str, texts: int, per: list) -> tuple[str, dict]:
    """How far layer l-1 can see (:func:`state_reference`) beside LLaPor's recall per layer ``per``."""
    ref = state_reference(model_dir, texts)

    def row(v: list) -> str:
        return " ".join("   -  " if x is None else f"{x:.3f}" for x in v)

    return (
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


def _tiny_results(
    args: argparse.Namespace, max_req: int | None, out_dir: Path
) -> Generator[tuple[str, dict | None], None, tuple[str, Any, Any] | None]:
    """tiny held-out: the baselines, gate reuse, LLaPor and the reference; returns LLaPor's timing entry."""
    from moecast.collect.traceset import open_traces
    from moecast.predictors.commands import build_baseline

    if not Path(args.tiny_traces, "meta.json").is_file():
        yield (
            f"\n[tiny] skipped: no TraceSet at {args.tiny_traces} (moecast collect --model tiny --workloads "
            "sharegpt --max-requests 64 --max-new-tokens 32 --gate-inputs --out PATH)",
            {"bench": "tiny", "skipped": f"no TraceSet at {args.tiny_traces}"},
        )
        return None
    ts = open_traces(args.tiny_traces)
    train_ids, requests = _held_out(ts, max_req)
    preds = [
        (b, build_baseline(b, ts, train_ids), None) for b in ("frequency", "cooccurrence", "moe-infinity")
    ]
    if ts.has("gate_inputs") and Path(args.tiny_model).is_dir():
        preds.append(("gate-reuse", build_baseline(f"gate-reuse:{args.tiny_model}", ts, train_ids), None))
    over = ["--train.max_epochs", "5"] if args.quick else []
    out = out_dir / "llapor_tiny.safetensors"
    pred, secs = _llapor(args.tiny_checkpoint, args.tiny_config, args.tiny_traces, out, over, ts)
    label = f"llapor ({Path(args.tiny_checkpoint or 'trained').name})"
    preds.append((label, pred, secs))
    evaluated = yield from table("tiny held-out", ts, preds, requests)
    entry = ("tiny", pred, ts.get(requests[0]))
    if Path(args.tiny_model).is_dir():
        per = evaluated[label]["per_layer"]["recall_at_k"]
        yield _reference_result(args.tiny_model, 20 if args.quick else 60, per)
    return entry


def _latency_results(timing: list[tuple[str, Any, Any]], repeats: int) -> Iterator[tuple[str, dict | None]]:
    """The latency header, then one line per (name, LLaPor, trace) in ``timing``."""
    yield (
        "\n[latency] LLaPor on CPU, batch 1, 1 thread, us/layer (score_at = the runtime's per-layer call: "
        "features + network)",
        None,
    )
    for name, pred, trace in timing:
        lat = latency_us(pred, trace, repeats, torch_too=not name.startswith("wide"))
        torch_part = (
            f"; torch all-layers {lat['torch_all_layers_us_per_layer']:.1f}"
            if "torch_all_layers_us_per_layer" in lat
            else ""
        )
        yield (
            f"{name:<10} score_at {lat['score_at_us_median']:7.1f} median (p90 {lat['score_at_us_p90']:.1f}); "
            f"unfolded features_at + score_layer {lat['unfolded_us_median']:.1f}; score_layer alone "
            f"{lat['score_layer_us_median']:.1f} (float32 weights {lat['score_layer_float32_us_median']:.1f}){torch_part}; "
            f"load average {lat['loadavg_1min']:.2f} on {os.cpu_count()} CPUs",
            {"bench": "latency", "traces": name, **lat, "cpus": os.cpu_count()},
        )


def results(args: argparse.Namespace) -> Iterator[tuple[str, dict | None]]:
    """Every result as (text line, JSON object or None): main prints one or the other, rows reads the objects."""
    torch.set_num_threads(1)  # batch-1 inference; tiny tensors only pay for thread hand-offs
    max_req = args.max_requests or (60 if args.quick else None)
    repeats = args.repeats or (50 if args.quick else 300)
    out_dir = Path(args.out_dir)

    timing: list[tuple[str, Any, Any]] = []
    if not args.skip_ds:
        timing.append((yield from _ds_results(args, max_req, out_dir)))
    if not args.skip_tiny:
        tiny = yield from _tiny_results(args, max_req, out_dir)
        if tiny is not None:
            timing.append(tiny)
    if not args.skip_wide:
        timing.append((f"wide-{args.wide_hidden}", *wide_llapor(args.wide_hidden)))
    if timing:
        yield from _latency_results(timing, repeats)


def tiny_pair(checkpoint: Path | None, traces: Path | None) -> tuple[Path | None, Path | None]:
    """(tiny TraceSet with gate inputs, a LLaPor checkpoint trained on it): the checkpoint's own
    ``trained_on`` when that TraceSet is here, else ``traces`` without a checkpoint."""
    from bench.figures import checkpoint_meta

    if checkpoint is not None and Path(checkpoint).is_file():
        try:
            on = checkpoint_meta(Path(checkpoint)).get("trained_on")
        except (OSError, ValueError):
            on = None
        if on and (Path(on) / "meta.json").is_file():
            return Path(on), Path(checkpoint)
    if traces is not None and (Path(traces) / "meta.json").is_file():
        return Path(traces), None
    return None, None


def _ds_args(ds: Path | None, seq_checkpoint: Path | None, quick: bool, train: bool) -> tuple[list[str], str]:
    """(bench arguments for the DeepSeek checkpoint ``ds``, the note its rows carry)."""
    from bench.figures import first_file, shown

    if ds is not None:
        argv = ["--checkpoint", str(ds)]
        if first_file(seq_checkpoint):
            argv += ["--sequence-checkpoint", str(seq_checkpoint)]
        return argv, f"checkpoint {shown(ds)}"
    if quick:
        return [], "no checkpoint: quick-trained here (1 epoch, 300 requests), not the goal run"
    if train:
        return [], "trained here with configs/llapor_deepseek.yaml"
    return [], ""


def _tiny_args(tiny_traces: Path | None, tiny_ck: Path | None, quick: bool) -> tuple[list[str], str]:
    """(bench arguments for the tiny traces and checkpoint, the note their rows carry)."""
    from bench.figures import shown

    if tiny_traces is None:
        return [], ""
    argv = ["--tiny-traces", str(tiny_traces)]
    if tiny_ck is not None:
        return [*argv, "--tiny-checkpoint", str(tiny_ck)], f"checkpoint {shown(tiny_ck)}"
    return argv, "no checkpoint: quick-trained here (5 epochs)" if quick else ""


def _missing_ds() -> dict:
    """The row saying the DeepSeek figures were not measured."""
    from bench.figures import missing

    return missing(
        "predictors",
        "no checkpoint (runs/llapor_ds.safetensors; --train)",
        "LLaPor DeepSeek held-out recall@6",
        ">= 0.85",
    )


def _missing_tiny() -> dict:
    """The row saying the tiny figures were not measured."""
    from bench.figures import missing

    return missing(
        "predictors",
        "no tiny traces with gate inputs / checkpoint (see bench_predictors.py)",
        "tiny LLaPor held-out recall@k",
        ">= 0.97",
    )


def rows(
    quick: bool,
    work: Path,
    ds_traces: Path,
    ds_checkpoint: Path | None = None,
    seq_checkpoint: Path | None = None,
    tiny_checkpoint: Path | None = None,
    tiny_traces: Path | None = None,
    train: bool = False,
) -> list[dict]:
    """LLaPor on DeepSeek and tiny against the baselines, and its latency. Without a checkpoint,
    ``quick`` trains a small one and ``train`` the full one; otherwise that trace set is skipped."""
    from bench.figures import first_file, missing

    ds = first_file(ds_checkpoint)
    tiny_traces, tiny_ck = tiny_pair(tiny_checkpoint, tiny_traces)
    ds_argv, ds_note = _ds_args(ds, seq_checkpoint, quick, train)
    tiny_argv, tiny_note = _tiny_args(tiny_traces, tiny_ck, quick)
    skip_ds = not Path(ds_traces).is_dir() or (ds is None and not quick and not train)
    skip_tiny = tiny_traces is None or (tiny_ck is None and not quick and not train)
    argv = ["--traces", str(ds_traces), "--out-dir", str(Path(work) / "predictors"), *ds_argv, *tiny_argv]
    argv += ["--skip-ds"] * skip_ds + ["--skip-tiny"] * skip_tiny + ["--quick"] * quick
    if skip_ds and skip_tiny:
        return [
            missing(
                "predictors",
                "no checkpoints (runs/llapor_ds.safetensors, runs/llapor_tiny.safetensors) "
                "and no tiny traces; --quick trains small ones, --train full ones",
                "LLaPor DeepSeek / tiny",
            )
        ]
    objs = [obj for _text, obj in results(parse(argv)) if obj is not None]
    q = "quick: 60 held-out requests; " if quick else ""
    judged = ds is not None or (train and not quick)
    out = [_missing_ds()] if skip_ds else _ds_rows(objs, q + ds_note, judged=judged)
    out += [_missing_tiny()] if skip_tiny else _tiny_rows(objs, q + tiny_note, judged=tiny_ck is not None)
    return out + _latency_rows(objs)


def _ds_rows(objs: list[dict], note: str, judged: bool) -> list[dict]:
    from bench.figures import fig

    ds = [r for r in objs if str(r.get("bench", "")).startswith("deepseek")]
    ll = next((r for r in ds if str(r.get("predictor", "")).startswith("llapor")), None)
    out = [
        fig(
            "predictors",
            "LLaPor DeepSeek held-out recall@6",
            ll and ll.get("recall_at_k"),
            "{:.4f}",
            ">= 0.85",
            note,
            judged=judged,
        )
    ]
    for r in ds:
        if r is not ll and r.get("recall_at_k") is not None:
            seq = str(r["predictor"]).startswith("sequence")
            out.append(
                fig(
                    "predictors",
                    f"{'' if seq else 'baseline '}{r['predictor']} recall@6 ({r.get('horizon')})",
                    r["recall_at_k"],
                    "{:.4f}",
                    note="MoE-Beyond-style, causal; the next token's experts, all layers" if seq else "",
                )
            )
    out.append(
        fig(
            "predictors",
            "LLaPor DeepSeek training time (s)",
            ll and ll.get("train_seconds"),
            "{:.0f} s",
            "<= 1800 s",
            note,
            judged=judged,
        )
    )
    return out


def _tiny_rows(objs: list[dict], note: str, judged: bool) -> list[dict]:
    from bench.figures import fig, row

    tiny = [r for r in objs if str(r.get("bench", "")).startswith("tiny")]
    ll = next((r for r in tiny if str(r.get("predictor", "")).startswith("llapor")), None)
    skipped = next((r.get("skipped") for r in tiny if r.get("skipped")), None)
    out = [
        fig(
            "predictors",
            "tiny LLaPor held-out recall@k",
            ll and ll.get("recall_at_k"),
            "{:.4f}",
            ">= 0.97",
            skipped or note,
            judged=judged,
        )
    ]
    ref = next((r for r in tiny if r.get("bench") == "tiny-reference"), None)
    if ref is None:
        return out

    def per_layer(v: list) -> str:
        return " ".join(f"{x:.3f}" for x in v if x is not None)

    out.append(
        row(
            "predictors",
            "tiny: true router of layer l on its input state, layers 1..L-1",
            per_layer(ref["input_state"]),
            note=f"all but layer l's attention; gate reuse {per_layer(ref['gate_reuse'])}; "
            f"LLaPor {per_layer(ref['llapor_per_layer'][1:])}",
        )
    )
    for key in (k for k in ref if k.startswith("window_")):
        v = [x for x in ref[key] if x is not None]
        out.append(
            row(
                "predictors",
                f"tiny: ... plus layer l's own attention over the last {key[7:]} tokens, layers 1..L-1",
                per_layer(v),
                note=f"mean {sum(v) / len(v):.3f}; the context layer l-1 cannot see, by the model's weights",
            )
        )
    return out


def _latency_rows(objs: list[dict]) -> list[dict]:
    from bench.figures import fig, row

    out = []
    for r in (r for r in objs if r.get("bench") == "latency"):
        name, us, torch_us = r["traces"], r["score_at_us_median"], r.get("torch_all_layers_us_per_layer")
        out.append(
            fig(
                "predictors",
                f"LLaPor inference ms/layer ({name}, batch 1, 1 thread)",
                us / 1e3,
                "{:.4f} ms",
                "<= 0.1 ms",
                ("random weights, gate inputs at a real model's width; " if name.startswith("wide") else "")
                + "score_at (features + network), int8 weights; "
                f"unfolded features_at + score_layer {r['unfolded_us_median']:.1f} us; "
                f"score_layer alone {r['score_layer_us_median']:.1f} us "
                f"(float32 {r['score_layer_float32_us_median']:.1f} us); "
                + (f"torch all layers {torch_us:.1f} us/layer; " if torch_us is not None else "")
                + f"load {r['loadavg_1min']:.2f}",
            )
        )
    return out or [row("predictors", "LLaPor inference ms/layer", "see its log", "<= 0.1 ms")]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    for text, obj in results(args):
        if not args.json:
            print(text, flush=True)
        elif obj is not None:
            print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    sys.exit(main())
