"""CasMoE Table-3-style comparison on held-out requests: EAP alone, EAM alone, the cascade at several epsilon.

    python bench/bench_casmoe.py --eam EAM.safetensors --eap EAP.safetensors --traces traces/ds-puffin \
        [--epsilons 0.3,0.5,0.6,0.7,0.8,0.9] [--k 6] [--max-requests 200] [--threads 1] [--int8] [--engine auto] \
        [--lengths] [--json]

Prints plan recall@k (against each held-out request's top-k of its true EP label per
layer), F1, and mean / median planner latency per prompt (EAM: embedding + HNSW
query; EAP: encoder + heads; cascade: EAM always, plus the EAP for prompts whose
confidence is below epsilon). Also a static plan (the training requests' mean EP)
for reference. Targets (CasMoE, on a GPU in the paper): EAM <= 5 ms, EAP <= 10 ms,
cascade recall >= EAP at lower mean latency. Builds both checkpoints first when
``--build`` is given (frozen-MiniLM EAP, the quick CPU recipe).

``--lengths`` adds the latency per prompt length: the held-out prompts nearest to 16
tokens and to their median length, and one cut at the encoder's limit (256), each
planned ``--repeats`` times (min / p50 / mean; JSON rows with ``"bench": "casmoe-length"``).
The 1-minute load average is printed with every figure: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def build(traces: str, eam: str, eap: str) -> None:
    """Build the EAM and train the frozen-MiniLM EAP (the quick CPU recipe) with ``moecast train``."""
    cfg = Path(__file__).resolve().parents[1] / "configs"
    for kind, config, out in (("eam", "eam_minilm.yaml", eam), ("eap", "eap_minilm_frozen.yaml", eap)):
        cmd = ["train", kind, "--config", str(cfg / config), "--traces", traces, "--out", out]
        subprocess.run([sys.executable, "-m", "moecast", *cmd], check=True)


def measure(
    traces: str,
    eam: str,
    eap: str,
    epsilons: list[float],
    k: int | None = None,
    val_fraction: float = 0.1,
    max_requests: int | None = None,
    threads: int = 1,
    int8: bool = False,
    engine: str = "auto",
    lengths: bool = False,
    repeats: int = 30,
) -> list[dict]:
    """The Table-3 rows (``"planner"``: EAM, EAP, static, cascade eps=...), then with ``lengths``
    the rows per prompt length (``"bench": "casmoe-length"``)."""
    import torch
    from moecast.predictors import load
    from moecast.train.planner_report import compare_planners

    torch.set_num_threads(threads)
    eam_p, eap_p = load(eam), load(eap)
    load0 = os.getloadavg()[0]
    rows = compare_planners(
        eam_p,
        eap_p,
        traces,
        epsilons,
        k,
        val_fraction,
        0,
        max_requests,
        int8=int8,
        engine=engine,
        threads=threads,
    )
    _annotate(rows, eam_p, load0, threads, int8)
    if lengths:
        rows += length_latencies(eam_p, eap_p, traces, val_fraction, repeats)
    return rows


def _annotate(rows: list[dict], eam_p: Any, load0: float, threads: int, int8: bool) -> None:
    """Stamp each Table-3 row with the load before and after, the threads, int8 and the EAM's engine."""
    engine_name = (
        type(eam_p.embedder.fast).__name__ if eam_p.embedder.fast is not None else "sentence-transformers"
    )
    for r in rows:
        r.update(loadavg_1min=[load0, os.getloadavg()[0]], threads=threads, int8=int8, engine=engine_name)


def rows(quick: bool, ds_traces: Path, eam: Path, eap: Path, train: bool = False) -> list[dict]:
    """At the checkpoints' default (fp32, 1 thread) and the fastest setting measured on a 2-core CPU
    (int8, 2 threads, with the latency per prompt length: how far the encoder alone is from 5 ms).
    Without checkpoints, ``train`` builds them. ``quick``: 50 held-out requests, 5 plans per length."""
    from bench.figures import missing

    if not (Path(eam).is_file() and Path(eap).is_file()):
        if not train:
            return [
                missing(
                    "casmoe",
                    "no checkpoints (runs/casmoe/{eam,eap}.safetensors; --train or bench_casmoe.py --build)",
                    "EAM / EAP / cascade",
                )
            ]
        build(str(ds_traces), str(eam), str(eap))
    eps = [0.3, 0.5, 0.6, 0.7, 0.8, 0.9]
    common = {"max_requests": 50 if quick else None}
    fast = {"int8": True, "threads": 2, "lengths": True, "repeats": 5 if quick else 20}
    out: list[dict] = []
    for setting, extra in (("fp32 1 thread", {}), ("int8 2 threads", fast)):
        got = measure(str(ds_traces), str(eam), str(eap), eps, **common, **extra)
        out += setting_rows(setting, got, quick, extra.get("repeats", 0))
    return out


def setting_rows(setting: str, lines: list[dict], quick: bool, repeats: int) -> list[dict]:
    """The table's rows for one setting: EAM and EAP latency, the best cascade against EAP, lengths."""
    by = {r.get("planner"): r for r in lines if "planner" in r}
    note = "quick: 50 held-out requests; " if quick else ""
    out = _latency_figs(setting, by, note)
    out += _cascade_rows(setting, by)
    out += _length_figs(setting, lines, repeats)
    return out


def _latency_figs(setting: str, by: dict, note: str) -> list[dict]:
    """The EAM's and the EAP's mean latency per prompt against their targets."""
    from bench.figures import fig

    out = []
    for name, goal in (("EAM", "<= 5 ms"), ("EAP", "<= 10 ms")):
        r = by.get(name, {})
        out.append(
            fig(
                "casmoe",
                f"{name} latency per prompt, {setting} (ms)",
                r.get("mean_latency_ms"),
                "{:.2f} ms",
                goal,
                f"{note}{r.get('engine', '?')}; p50 {r.get('p50_latency_ms', float('nan')):.2f} ms; "
                f"recall {r.get('recall_at_k', float('nan')):.4f}",
            )
        )
    return out


def _cascade_rows(setting: str, by: dict) -> list[dict]:
    """The best cascade's recall and latency against the EAP's; none without both."""
    from moecast.train.planner_report import cascade_wins

    from bench.figures import row

    casc = [r for n, r in by.items() if n and n.startswith("cascade")]
    eap = by.get("EAP")
    if not (casc and eap):
        return []
    wins = cascade_wins(list(by.values()))
    best = (
        min(wins, key=lambda r: r["mean_latency_ms"])
        if wins
        else max(casc, key=lambda r: (r["recall_at_k"], -r["mean_latency_ms"]))
    )
    d = best["recall_at_k"] - eap["recall_at_k"]
    return [
        row(
            "casmoe",
            f"cascade recall vs EAP (best cascade), {setting}",
            f"{best['recall_at_k']:.4f} vs {eap['recall_at_k']:.4f} ({d:+.4f}); "
            f"{best['latency_vs_eap_ms']:+.2f} +- {best['latency_vs_eap_se_ms']:.2f} ms vs EAP",
            ">= EAP at lower latency",
            "ok" if wins else "MISS",
            f"{best['planner']}, EAM share {best.get('eam_share', float('nan')):.2f}; latency paired per prompt",
            best["recall_at_k"],
        )
    ]


def _length_figs(setting: str, lines: list[dict], repeats: int) -> list[dict]:
    """The EAM's p50 latency on each prompt length against its target."""
    from bench.figures import fig

    out = []
    for r in lines:
        if r.get("bench") == "casmoe-length" and r.get("timed") == "EAM":
            out.append(
                fig(
                    "casmoe",
                    f"EAM latency, one {r['prompt']} prompt ({r['tokens']} tokens), {setting} (ms)",
                    r["p50_ms"],
                    "{:.2f} ms",
                    "<= 5 ms",
                    f"p50 of {repeats} plans; min {r['min_ms']:.2f} ms",
                )
            )
    return out


def _parse_args() -> argparse.Namespace:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument("--eam", default="runs/casmoe/eam.safetensors")
    ap.add_argument("--eap", default="runs/casmoe/eap.safetensors")
    ap.add_argument("--build", action="store_true", help="build the EAM and train a frozen-MiniLM EAP first")
    ap.add_argument("--epsilons", default="0.3,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--k", type=int, default=None, help="recall@k (default: the model's top-k)")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of the timed planners' encoders")
    ap.add_argument("--int8", action="store_true", help="dynamic int8 encoders for both planners")
    ap.add_argument(
        "--engine",
        default="auto",
        choices=("auto", "onnx", "torch"),
        help="who runs the encoders (auto: ONNX Runtime)",
    )
    ap.add_argument("--lengths", action="store_true", help="also latency per prompt length")
    ap.add_argument("--repeats", type=int, default=30, help="timed plans per prompt with --lengths")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def _print_table(args: argparse.Namespace, got: list[dict]) -> None:
    """The Table-3 rows of ``got`` as a table, the latency targets and the cascade settings that win."""
    from moecast.train.planner_report import cascade_wins, format_table

    rows_ = [r for r in got if "planner" in r]
    load0, load1 = rows_[0]["loadavg_1min"]
    print(
        f"CasMoE planners on held-out requests of {args.traces} ({rows_[0]['engine']}, {args.threads} thread(s), "
        f"{'int8' if args.int8 else 'fp32'} encoders, this CPU; load {load0:.2f} -> {load1:.2f})"
    )
    print(format_table(rows_))
    best = {r["planner"]: r for r in rows_}
    wins = cascade_wins(rows_)
    print(
        f"EAM query incl. embedding: {best['EAM']['mean_latency_ms']:.2f} ms/prompt (target <= 5); "
        f"EAP: {best['EAP']['mean_latency_ms']:.2f} ms/prompt (target <= 10)"
    )
    print(
        "cascade settings with recall >= EAP at lower mean latency (paired, > 2 SE): "
        + (", ".join(r["planner"] for r in wins) if wins else "none")
    )


def _print_lengths(lengths: list[dict], repeats: int) -> None:
    """The latency per prompt length rows (``"bench": "casmoe-length"``), one line each."""
    print(f"\nlatency per prompt length, ms over {repeats} plans of one prompt (min / p50 / mean)")
    for r in lengths:
        print(
            f"  {r['prompt']:<7} {r['tokens']:>4} tokens  {r['timed']:<18} "
            f"{r['min_ms']:7.2f} {r['p50_ms']:7.2f} {r['mean_ms']:7.2f}   load {r['loadavg_1min']:.2f}"
        )


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    if args.build:
        build(args.traces, args.eam, args.eap)
    t0 = time.perf_counter()
    eps = [float(x) for x in args.epsilons.split(",") if x]
    got = measure(
        args.traces,
        args.eam,
        args.eap,
        eps,
        args.k,
        args.val_fraction,
        args.max_requests,
        args.threads,
        args.int8,
        args.engine,
        args.lengths,
        args.repeats,
    )
    if args.json:
        for r in got:
            print(json.dumps(r))
        return
    _print_table(args, got)
    lengths = [r for r in got if r.get("bench") == "casmoe-length"]
    if lengths:
        _print_lengths(lengths, args.repeats)
    print(f"({time.perf_counter() - t0:.1f} s)")


def length_latencies(eam, eap, traces: str, val_fraction: float, repeats: int) -> list[dict]:
    """Per-planner latency on three held-out prompts: ~16 tokens, the median length, one past the limit."""
    import numpy as np
    from moecast.collect.traceset import open_traces
    from moecast.predictors.cascade import Cascade
    from moecast.predictors.casmoe import prompt_texts

    ts = open_traces(traces)
    # the val side of the grouped split, as compare_planners scores (train/planner_report.py)
    prompts = prompt_texts(ts, ts.splits(val_fraction).val)
    tok = eam.embedder.tokenizer
    n = np.array([len(tok(p, truncation=False)["input_ids"]) for p in prompts])
    limit = eam.embedder.max_length
    picks = {
        "short": int(np.argmin(np.abs(n - 16))),
        "median": int(np.argmin(np.abs(n - np.median(n)))),
        "long": int(np.argmax(n)),
    }
    # epsilon 1: the cascade's slowest case, EAM query + EAP fallback (on the shared embedding
    # when the EAP's encoder is the EAM's frozen one)
    cascade = Cascade(eam, eap, 1.0)
    planners = {
        "EAM": lambda p: eam.query(p),
        "EAP": lambda p: eap.plan(p),
        "cascade (fallback)": lambda p: cascade.plan(p),
    }
    out = []
    for label, i in picks.items():
        p = prompts[i]
        for name, f in planners.items():
            out.append(_length_row(label, int(min(n[i], limit)), name, _plan_ms(f, p, repeats)))
    return out


def _plan_ms(f: Callable[[str], Any], p: str, repeats: int) -> list[float]:
    """One untimed plan of ``p`` by ``f``, then the ms of each of ``repeats`` timed ones."""
    f(p)
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(p)
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def _length_row(label: str, tokens: int, name: str, ms: list[float]) -> dict:
    """One ``"casmoe-length"`` row: min / p50 / mean of a planner's timed plans of one prompt."""
    import numpy as np

    return {
        "bench": "casmoe-length",
        "prompt": label,
        "tokens": tokens,
        "timed": name,  # not "planner": run_all keys the Table-3 rows by that
        "min_ms": float(np.min(ms)),
        "p50_ms": float(np.median(ms)),
        "mean_ms": float(np.mean(ms)),
        "loadavg_1min": os.getloadavg()[0],
    }


if __name__ == "__main__":
    main()
