"""Replay benchmark: full-TraceSet replay time, per-layer decision cost, hit-rate table.

    python bench/bench_replay.py [--traces traces/ds-puffin] [--requests N] [--stream-requests N]

Prints (1) the per-layer online decision cost (cache lookup + substitution + prefetch choice) at
64 experts top-6, (2) the wall time of replaying the TraceSet for every policy at 5 capacities, cold
per request (all capacities of a policy run as lanes of one vectorised pass), and (3) hit rates at
10/25/50 % capacity for every policy, cold per request and stream (stream over the first
--stream-requests requests: the stream is one sequential chain of steps).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def decision_cost(E: int = 64, k: int = 6, cap: int = 16, iters: int = 5000) -> dict[str, float]:
    from moecast.runtime.cache import ExpertCache
    from moecast.runtime.prefetch import Prefetcher
    from moecast.runtime.substitution import SubstitutingRouter

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(iters, E)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    topk = np.argsort(-probs, axis=1)[:, :k]
    nxt = np.roll(probs, 1, axis=0)
    cache = ExpertCache(E, cap, "lru")
    router = SubstitutingRouter(k, 0.2)
    pf = Prefetcher(E, k, t_io=0.7, t_attn=0.08)
    parts = {"cache": 0.0, "substitution": 0.0, "prefetch": 0.0}
    for i in range(iters):
        t0 = time.perf_counter()
        ids = router.route(probs[i : i + 1], cache.resident[0], topk[i : i + 1])
        t1 = time.perf_counter()
        cache.access(ids[0], t=i)
        t2 = time.perf_counter()
        pf.choose(nxt[i], cache.resident[0], t_gap=1.5)
        t3 = time.perf_counter()
        parts["substitution"] += t1 - t0
        parts["cache"] += t2 - t1
        parts["prefetch"] += t3 - t2
    out = {k_: v / iters * 1e6 for k_, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument("--requests", type=int, default=0, help="replay only the first N requests (0 = all)")
    ap.add_argument("--stream-requests", type=int, default=200, help="requests in the stream-mode table")
    ap.add_argument("--hardware", default="prescope-a100-pcie4")
    ap.add_argument("--skip-full", action="store_true", help="only the decision cost and the stream table")
    args = ap.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.replay import POLICIES, ReplayConfig, replay_capacities

    # numpy's per-call overhead sets the floor of a per-layer decision made of numpy calls
    a = np.zeros(64)
    t0 = time.perf_counter()
    for _ in range(20000):
        a.sum()
    call_us = (time.perf_counter() - t0) / 20000 * 1e6
    print(f"numpy call overhead on this machine now: {call_us:.2f} us per tiny call")
    d = decision_cost()
    print(
        "per-layer decision cost, 64 experts top-6, batch 1 (us): "
        + ", ".join(f"{k} {v:.1f}" for k, v in d.items())
        + "  (goal <= 10 us total)"
    )

    ts = TraceSet(args.traces)
    rids = ts.request_ids[: args.requests] if args.requests else list(ts.request_ids)
    policies = [p for p, spec in POLICIES.items() if spec.eviction != "score" or ts.has("router_probs")]
    skipped = [p for p in POLICIES if p not in policies]
    caps5 = [0.1, 0.25, 0.5, 0.75, 0.9]
    table: dict[tuple[str, str], list[float]] = {}
    print(
        f"TraceSet {ts.path}: {len(rids)} requests, {int(ts.request_lengths(rids).sum())} tokens, "
        f"{ts.num_layers} layers, {ts.num_experts} experts, top-{ts.top_k}; policies {', '.join(policies)}"
        + (f" (skipped, no router_probs: {', '.join(skipped)})" if skipped else "")
    )
    if not args.skip_full:
        total = 0.0
        for p in policies:
            t0 = time.perf_counter()
            res = replay_capacities(
                ts, ReplayConfig(policy=p, cold=True, requests=rids, hardware=args.hardware), caps5
            )
            dt = time.perf_counter() - t0
            total += dt
            table[(p, "cold")] = [r.hit_rate for r in res[:3]]
            print(
                f"  cold replay {p:<9} 5 capacities: {dt:6.1f} s  hit rates {' '.join(f'{r.hit_rate:.3f}' for r in res)}"
                f"  TPOT ms {' '.join(f'{r.modeled_tpot_ms:.2f}' for r in res)}"
            )
        print(
            f"full replay, {len(policies)} policies x 5 capacities, cold per request: {total:.1f} s (goal < 60 s)"
        )
    srids = rids[: args.stream_requests]
    for p in policies:
        res = replay_capacities(
            ts, ReplayConfig(policy=p, cold=False, requests=srids, hardware=args.hardware), caps5[:3]
        )
        table[(p, "stream")] = [r.hit_rate for r in res]
    print(
        f"\nhit rate at 10/25/50 % capacity (per-layer caches, demand + policy; stream = first {len(srids)} requests)"
    )
    print(f"{'policy':<10} {'mode':<7} {'10%':>7} {'25%':>7} {'50%':>7}")
    for (p, mode), hr in sorted(table.items(), key=lambda kv: (kv[0][1], policies.index(kv[0][0]))):
        print(f"{p:<10} {mode:<7} " + " ".join(f"{h:7.3f}" for h in hr))


if __name__ == "__main__":
    main()
