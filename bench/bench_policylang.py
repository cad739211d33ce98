"""Side-by-side cache replay against the peer MoE-PolicyLang (``pip install moe-policylang``).

    python bench/bench_policylang.py [--traces traces/ds-puffin] [--requests 200] [--capacities 0.1,0.25,0.5]
        [--json]

Both simulators replay the same requests of one TraceSet with per-layer caches that start
cold for every request (MoE-PolicyLang groups its replay by (layer, prompt), i.e. cold per
request; ours runs with ``cold=True``, batch 1), at the same capacities (a fraction of the
experts per layer, rounded: 10/25/50 % of 64 = 6/16/32 experts), and both count every routed
(token, layer, expert) use, the first ones included, in the hit-rate denominator.

Ours: ``moecast.runtime.replay.engine.replay_capacities`` (what ``moecast replay`` runs), policies
``lru`` and ``belady``, demand loads only. Theirs: ``moe_policylang.benchmark.replay.replay_policies``
with ``topk_lru`` and ``belady`` on a ``TraceRecording`` built from the TraceSet (one entry per
(token, layer), ``prompt_id`` = request index, ``token_idx`` = position).

The DeepSeek-V2-Lite Puffin traces (imported from MoE-Beyond) record expert ids only. MoE-PolicyLang
reads a router softmax per entry and takes its top-k, so this bench synthesises one, peaked on the
recorded top-6: ``0.9 / k`` on each recorded expert (slightly decreasing in the recorded order so the
ranking is strict) and the remaining 0.1 spread evenly over the others. Its top-k is then exactly the
recorded set; nothing else of the distribution is used by the two policies compared here.

The two simulators differ in semantics (docs/design.md, Metrics): ours treats a token's top-k at a layer as
one access (hits = |top-k ∩ resident| are counted first, then the misses are loaded, and the current
token's experts are never evicted); MoE-PolicyLang touches the ids one at a time, so a miss of one of
the token's experts can evict another of the same token's experts before it is looked up, and its
Belady may evict an expert the current token has just used (the k experts need not be resident together).
At small capacity its LRU hit rates therefore come out lower, while its Belady, relieved of co-residency,
can come out higher than ours at capacity = top-k. Both figures are printed; neither is copied into the other.

MoE-PolicyLang's replay is pure Python over per-entry objects (about 26 x tokens entries), so the default
replays a documented subset (the first ``--requests`` requests by request id order); ``--requests 0``
replays the whole TraceSet (minutes and a few GB of memory).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

OURS = {"lru": "topk_lru", "belady": "belady"}  # our policy -> theirs


def synthetic_softmax(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, E] float32 distribution peaked on each row's recorded top-k ids (strict ranking, sums to 1)."""
    n, k = topk.shape
    rest = 0.1 / max(num_experts - k, 1)
    probs = np.full((n, num_experts), rest, dtype=np.float32)
    peak = (0.9 / k) * (1.0 + 1e-3 * np.arange(k - 1, -1, -1, dtype=np.float32))[None, :]
    probs[np.arange(n)[:, None], topk] = np.broadcast_to(peak, (n, k))
    probs /= probs.sum(1, keepdims=True)
    return probs


def build_recording(ts, rids: list[str]):
    """A MoE-PolicyLang ``TraceRecording`` of ``rids``: one entry per (token, layer), softmax synthesised."""
    from moe_policylang.integrations.trace_recorder import TraceEntry, TraceRecording

    m = ts.meta.model
    topk = np.asarray(ts.array("topk_ids", rids), dtype=np.int64)  # [T, L, k]
    lengths = ts.request_lengths(rids)
    T, L, k = topk.shape
    probs = synthetic_softmax(topk.reshape(T * L, k), m.num_experts).reshape(T, L, m.num_experts)
    prompt = np.repeat(np.arange(len(rids)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths]) if len(lengths) else np.zeros(0, int)
    entries = [
        # router_softmax rows are float32 numpy views (replay_policies stacks them with np.array,
        # exactly as it stacks lists); lists of Python floats would need ~30x the memory
        TraceEntry(
            prompt_id=int(prompt[t]),
            token_idx=int(pos[t]),
            layer_idx=int(layer),
            selected_experts=topk[t, layer].tolist(),
            router_softmax=probs[t, layer],
        )
        for t in range(T)
        for layer in range(L)
    ]
    return TraceRecording(
        model_name=m.name_or_path,
        num_layers=L,
        num_experts=m.num_experts,
        top_k=k,
        entries=entries,
        records_full_softmax=True,
    )


def _summary(ts: Any, rids: list[str], subset: bool, capacities: list[float]) -> dict:
    """What is replayed: the TraceSet, its model, the requests and capacities; ``rows`` still empty."""
    m = ts.meta.model
    return {
        "traces": str(ts.path),
        "model": m.name_or_path,
        "requests": len(rids),
        "of_requests": ts.num_requests,
        "subset": f"first {len(rids)} requests of {ts.num_requests}" if subset else "all requests",
        "tokens": int(ts.request_lengths(rids).sum()),
        "layers": m.num_layers,
        "experts": m.num_experts,
        "top_k": m.top_k,
        "capacities": capacities,
        "softmax": "recorded" if ts.has("router_probs") else "synthesised, peaked on the recorded top-k",
        "rows": [],
    }


def _replay_ours(
    ts: Any, rids: list[str], capacities: list[float]
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(our hit rate per policy and capacity, our wall seconds per policy)."""
    from moecast.runtime.replay.engine import ReplayConfig, replay_capacities

    ours: dict[str, list[float]] = {}
    t_ours = {}
    for pol in OURS:
        t0 = time.perf_counter()
        res = replay_capacities(ts, ReplayConfig(policy=pol, cold=True, requests=rids), capacities)
        t_ours[pol] = time.perf_counter() - t0
        ours[pol] = [r.hit_rate for r in res]
    return ours, t_ours


def _replay_theirs(
    ts: Any, rids: list[str], capacities: list[float], out: dict
) -> tuple[dict[str, list[float]] | None, dict[str, float]]:
    """(MoE-PolicyLang's hit rate per our policy and capacity, or None when it is not installed; its
    wall seconds per policy); notes the error or its recording time and budgets in ``out``."""
    try:
        from moe_policylang.benchmark.replay import replay_policies
    except ImportError as exc:
        out["error"] = f"moe-policylang is not installed ({exc}); pip install 'moecast[bench]'"
        return None, {}
    t0 = time.perf_counter()
    if ts.has("router_probs"):
        rec = build_recording_probs(ts, rids)
    else:
        rec = build_recording(ts, rids)
    out["build_recording_s"] = round(time.perf_counter() - t0, 2)
    theirs = {}
    t_theirs = {}
    for pol, their in OURS.items():
        t0 = time.perf_counter()
        res = replay_policies(rec, ts.meta.model.top_k, policies=(their,), budget_fractions=capacities)
        t_theirs[pol] = time.perf_counter() - t0
        theirs[pol] = [r.hit_rate for r in res]
        out.setdefault("their_budgets", [r.budget for r in res])
        out.setdefault("their_accesses", res[0].accesses)
    return theirs, t_theirs


def _table_rows(
    ours: dict[str, list[float]],
    theirs: dict[str, list[float]] | None,
    budgets: list[int],
    capacities: list[float],
) -> list[dict]:
    """One row per (policy, capacity): our hit rate beside theirs (None without MoE-PolicyLang)."""
    out = []
    for pol, their in OURS.items():
        for i, cap in enumerate(capacities):
            row = {
                "policy": pol,
                "their_policy": their,
                "capacity": cap,
                "experts": budgets[i],
                "moecast": round(ours[pol][i], 4),
                "policylang": round(theirs[pol][i], 4) if theirs else None,
            }
            out.append(row)
    return out


def run(traces: str, requests: int, capacities: list[float]) -> dict:
    from moecast.collect.traceset import TraceSet

    ts = TraceSet(traces)
    rids = list(ts.request_ids)
    subset = bool(requests) and requests < len(rids)
    if subset:
        rids = rids[:requests]
    m = ts.meta.model
    out = _summary(ts, rids, subset, capacities)
    ours, t_ours = _replay_ours(ts, rids, capacities)
    theirs, t_theirs = _replay_theirs(ts, rids, capacities, out)
    from moecast.runtime.core.cache import resolve_capacity

    out["our_budgets"] = [resolve_capacity(c, m.num_experts, m.top_k) for c in capacities]
    out["rows"] += _table_rows(ours, theirs, out["our_budgets"], capacities)
    out["seconds"] = {
        "moecast": {p: round(t, 2) for p, t in t_ours.items()},
        "policylang": {p: round(t, 2) for p, t in t_theirs.items()} if theirs else None,
    }
    return out


def build_recording_probs(ts, rids: list[str]):
    """As :func:`build_recording`, with the TraceSet's own router_probs as the softmax."""
    rec = build_recording(ts, rids)
    probs = np.asarray(ts.array("router_probs", rids), dtype=np.float32)
    L = probs.shape[1]
    for i, e in enumerate(rec.entries):
        e.router_softmax = probs[i // L, i % L]
    return rec


SEMANTICS = (
    "Semantics: moecast treats a token's top-k at a layer as one access (hits = |top-k ∩ resident| "
    "counted first, then misses loaded; the token's own experts are never evicted, so all k are resident "
    "together while the layer runs). MoE-PolicyLang touches the ids one by one: under LRU a miss can evict "
    "another expert of the same token before it is looked up, so its LRU hit rates come out lower, most at "
    "small capacity; its Belady may evict an expert the token has just used (no co-residency of the k "
    "experts), which frees a slot for the next token, so at capacity = top-k its Belady can come out higher "
    "than ours. Figures are shown side by side, not reconciled."
)


def rows(quick: bool, ds_traces: Path) -> list[dict]:
    """Hit rates at 10/25/50 %, ours beside MoE-PolicyLang's. ``quick``: 50 requests, else 200."""
    from bench.figures import missing, row, shown

    if not Path(ds_traces).is_dir():
        return [missing("policylang", f"{shown(ds_traces)} absent")]
    res = run(str(ds_traces), 50 if quick else 200, [0.1, 0.25, 0.5])
    if res.get("error"):
        return [missing("policylang", res["error"], "MoE-PolicyLang")]
    by: dict[str, list] = {}
    for r in res["rows"]:
        by.setdefault(r["policy"], []).append(r)
    return [
        row(
            "policylang",
            f"hit rate 10/25/50 % {pol}: moecast | PolicyLang {rs[0]['their_policy']}",
            " / ".join(f"{r['moecast']:.3f}" for r in rs)
            + "  |  "
            + " / ".join(f"{r['policylang']:.3f}" for r in rs),
            note=f"{res['subset']}, cold per request; softmax {res['softmax']}",
        )
        for pol, rs in by.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=str(Path(__file__).resolve().parents[1] / "traces" / "ds-puffin"))
    ap.add_argument(
        "--requests", type=int, default=200, help="replay the first N requests (0 = all; theirs is slow)"
    )
    ap.add_argument("--capacities", default="0.1,0.25,0.5")
    ap.add_argument("--json", action="store_true", help="print one JSON object (last line)")
    args = ap.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    caps = [float(c) for c in args.capacities.split(",") if c.strip()]
    res = run(args.traces, args.requests, caps)
    if args.json:
        print(json.dumps({"bench": "policylang", **res, "semantics": SEMANTICS}))
        return
    _print_header(res)
    _print_rows(res)
    _print_wall(res)
    print(SEMANTICS)


def _print_header(res: dict) -> None:
    """What was replayed, the router softmax MoE-PolicyLang got, and its error if it could not run."""
    print(
        f"{res['traces']}: {res['model']}, {res['subset']} ({res['tokens']:,} tokens x {res['layers']} layers), "
        f"{res['experts']} experts, top-{res['top_k']}; per-layer caches, cold per request, demand loads"
    )
    print(f"router softmax for MoE-PolicyLang: {res['softmax']}")
    if "error" in res:
        print(f"MoE-PolicyLang: {res['error']}")


def _print_rows(res: dict) -> None:
    """The hit rates per policy and capacity, ours beside MoE-PolicyLang's and their difference."""
    print(
        f"\n{'policy (ours / theirs)':<24}{'capacity':>9}{'experts':>8}{'moecast':>9}{'PolicyLang':>11}{'diff':>8}"
    )
    for r in res["rows"]:
        theirs = r["policylang"]
        t = f"{theirs:>11.4f}{r['moecast'] - theirs:>+8.4f}" if theirs is not None else f"{'-':>11}{'-':>8}"
        print(
            f"{r['policy'] + ' / ' + r['their_policy']:<24}{r['capacity']:>9.0%}{r['experts']:>8}{r['moecast']:>9.4f}{t}"
        )


def _print_wall(res: dict) -> None:
    """Each side's wall time per policy (MoE-PolicyLang's with its TraceRecording build)."""
    s = res["seconds"]
    print(
        f"\nwall time: moecast {', '.join(f'{p} {t:.1f} s' for p, t in s['moecast'].items())}"
        + (
            f"; MoE-PolicyLang {', '.join(f'{p} {t:.1f} s' for p, t in s['policylang'].items())}"
            f" (+{res['build_recording_s']:.1f} s building its TraceRecording)"
            if s["policylang"]
            else ""
        )
    )


if __name__ == "__main__":
    main()
