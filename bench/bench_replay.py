"""Replay benchmark: per-layer decision cost, whole-TraceSet replay time, hit-rate table.

    python bench/bench_replay.py [--traces traces/ds-puffin] [--quick] [--workers 2]

Prints (1) the per-layer online decision cost as the live runtime makes it (LayerStep's compiled
one-lane calls: substitution, the prediction ranking, the layer, the prefetch) at 64 experts, top-6,
batch 1; (2) the wall and CPU time of replaying the whole TraceSet for every
policy at 5 capacities (10/25/50/75/90 %), cold per request, the policies spread over ``--workers``
processes (all capacities of a policy run in one pass; the costliest, presched, as two passes of
capacities when there are several workers); (3) the same in stream mode (caches persist
across requests); (4) the hit rates at 10/25/50 % capacity for every policy, cold and stream.
Policies needing router_probs (score, smoe) are skipped with the replay's own one-line reason when
the TraceSet lacks them (the imported DeepSeek traces do). ``--quick`` replays the first 200
requests only. Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

CAPS5 = [0.1, 0.25, 0.5, 0.75, 0.9]


def _no_clock() -> float:
    return 0.0


def _routing(E: int, k: int, iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(router softmax [iters, E] of random logits, its top-``k`` ids, the next layer's predicted scores)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(iters, E)) * 2
    # float32, as the live runtime hands them over (router softmax and predictor scores from torch)
    probs = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    topk = np.argsort(-probs, axis=1)[:, :k]
    nxt = np.roll(probs, 1, axis=0)
    return probs, topk, nxt


def _best_passes(
    step: Callable[[], Any],
    layer: Callable[[Any, int, Callable[[], float]], tuple[float, ...]],
    iters: int,
    repeats: int,
) -> dict:
    """µs per layer, the best of ``repeats`` passes of ``iters`` layers: each part (wall), their total,
    the whole loop's CPU time, and the last pass's substituted share."""
    names = ("substitution", "ranking", "layer", "prefetch")
    best = dict.fromkeys((*names, "total_cpu"), math.inf)
    layer(step(), 0, _no_clock)  # loads the compiled kernels
    subs = 0.0
    for _ in range(repeats):
        st = step()  # the decisions alone, timed as a whole in CPU time (robust to other processes)
        c0 = time.process_time()
        for i in range(iters):
            layer(st, i, _no_clock)
        best["total_cpu"] = min(best["total_cpu"], (time.process_time() - c0) / iters * 1e6)
        st = step()  # the same loop with a clock read around each call
        parts = np.zeros(len(names))
        for i in range(iters):
            parts += layer(st, i, time.perf_counter)
        for name, v in zip(names, parts):
            best[name] = min(best[name], v / iters * 1e6)
        subs = st.stats["subs"].sum() / st.stats["uses"].sum()
    out = {n: best[n] for n in names}
    out["total"] = sum(out.values())
    out["total_cpu"] = best["total_cpu"]
    out["substituted_share"] = subs
    return out


def decision_cost(
    E: int = 64, k: int = 6, cap: int = 16, iters: int = 20000, policy: str = "lru", repeats: int = 3
) -> dict:
    """µs of one layer's online decision as the live runtime makes it: the compiled one-lane calls of
    :class:`moecast.runtime.core.step.LayerStep` (``compiled=True``), one token, 26 layers in turn.

    Per layer: substitution (SMoE Algorithm 1 at alpha 0.2 on the policy's eviction), the ranking
    of the next layer's predicted experts, the layer (access, the balancer's split, inserts,
    recency, layer time and window) and the next layer's prefetch (the landing rule and its
    inserts), in the runtime's order. ``total_cpu``: CPU time (``process_time``) of the whole loop;
    the parts: a clock read around each call in the same loop (wall time, so a part that another
    process interrupts reads high). Each the best of ``repeats`` passes.
    """
    import dataclasses

    from moecast.runtime.core.cache import ExpertCache
    from moecast.runtime.core.cost_model import CostModel
    from moecast.runtime.core.policy import POLICIES
    from moecast.runtime.core.step import LayerStep, ranked_predictions

    L = 26
    probs, topk, nxt = _routing(E, k, iters)
    pol = dataclasses.replace(POLICIES[policy], substitutes=True, alpha=0.2, prefetch="predictor")
    # one transfer 0.7 ms in a 1.5 ms attention: a prefetch or two lands per layer
    cost = CostModel(t_io=0.7, t_g=0.05, beta=0.01, c=0.1, t_attn=1.5, expert_bytes=1)
    dec = np.array([True])
    # each layer's arguments made once, as the live runtime makes them
    lanes = [np.array([i]) for i in range(L)]
    has_next = [np.array([i + 1 < L]) for i in range(L)]
    restart = [np.array([i == 0]) for i in range(L)]

    def step() -> LayerStep:
        return LayerStep(
            ExpertCache(E, cap, pol.eviction, lanes=L), pol, cost, E, L, stat_base=np.zeros(L, np.int64),
            n_stats=L, prefetching=True, predictor_ms=0.06, compiled=True,
        )  # fmt: skip

    def layer(st: LayerStep, i: int, clock) -> tuple[float, ...]:
        pos = i % L
        lane, t = lanes[pos], np.array([i // L])
        t0 = clock()
        ids = st.route(lane, lane, topk[i][None, None], probs[i][None, None], dec)
        t1 = clock()
        pred, ranked = ranked_predictions(nxt[i], k)
        t2 = clock()
        nl = lanes[min(pos + 1, L - 1)]
        st.layer(lane, lane, ids, t, probs[i][None, None], next_lanes=nl, has_next=has_next[pos],
                 restart=restart[pos], next_predicted=pred, decode=dec, routed=True)  # fmt: skip
        t3 = clock()
        if pos + 1 < L:
            st.prefetch(nl, nl, ranked, t)
        t4 = clock()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    return _best_passes(step, layer, iters, repeats)


def _run(args: tuple) -> tuple:
    """One policy at some of the capacities (a worker process)."""
    traces, policy, cold, rids, hardware, caps = args
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.replay.engine import ReplayConfig, replay_capacities

    ts = TraceSet(traces)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        res = replay_capacities(
            ts, ReplayConfig(policy=policy, cold=cold, requests=rids, hardware=hardware), caps
        )
    except ValueError as exc:  # a policy this TraceSet cannot run: its one-line reason
        return policy, cold, None, str(exc), 0.0, 0.0, 1
    rows = [(r.hit_rate, r.modeled_tpot_ms, r.prefetch_accuracy, r.cpu_expert_rate) for r in res]
    return policy, cold, rows, None, time.perf_counter() - t0, time.process_time() - c0, 1


# The costliest policy runs as two jobs of capacities when there are several workers, so the workers
# finish together; the capacities of a pass are independent lanes, so its rows are the same.
SPLIT = {"presched": (CAPS5[:2], CAPS5[2:])}


def _sweep(traces, policies, cold, rids, hardware, workers) -> tuple[dict, float]:
    jobs = []
    for p in policies:
        for caps in SPLIT.get(p, (CAPS5,)) if workers > 1 else (CAPS5,):
            jobs.append((traces, p, cold, rids, hardware, list(caps)))
    t0 = time.perf_counter()
    if workers > 1:
        import multiprocessing as mp

        from moecast.collect.traceset import TraceSet
        from moecast.runtime.replay.engine import _data

        # read the trace arrays once here: the forked workers inherit them (the replay keeps them)
        ts = TraceSet(traces)
        _data(ts, list(rids) if rids is not None else list(ts.request_ids), need_probs=False)

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as ex:
            out = list(ex.map(_run, jobs))
    else:
        out = [_run(j) for j in jobs]
    merged: dict[str, tuple] = {}
    for o in out:  # the jobs of a policy come in capacity order
        q = merged.get(o[0])
        if q is None:
            merged[o[0]] = o
        else:
            rows = q[2] + o[2] if q[2] is not None and o[2] is not None else None
            merged[o[0]] = (o[0], cold, rows, q[3] or o[3], max(q[4], o[4]), q[5] + o[5], q[6] + 1)
    return merged, time.perf_counter() - t0


def call_floor_us() -> float:
    """CPU µs of one tiny numpy call now: the floor the decision cost is read against."""
    a = np.zeros(64)
    call_us = math.inf
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(20000):
            a.sum()
        call_us = min(call_us, (time.process_time() - t0) / 20000 * 1e6)
    return call_us


def _skip_reason(ts, policy: str, rid: str) -> str:
    from moecast.runtime.replay.engine import ReplayConfig, replay

    try:
        replay(ts, ReplayConfig(policy=policy, capacity=0.25, requests=[rid]))
    except ValueError as exc:
        return str(exc)
    return ""


def measure(
    traces: str,
    requests: int = 0,
    workers: int = 2,
    hardware: str = "prescope-a100-pcie4",
    stream: bool = True,
    decision: bool = True,
) -> dict:
    """The decision microbenchmark (lru, lfu), then every policy's sweep over CAPS5, cold and stream."""
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.replay.engine import POLICIES

    out: dict = {"load_before": os.getloadavg(), "decisions": {}, "sweeps": {}}
    if decision:
        out["floor_us"] = call_floor_us()
        out["decisions"] = {pol: decision_cost(policy=pol) for pol in ("lru", "lfu")}
    ts = TraceSet(traces)
    rids = list(ts.request_ids[:requests]) if requests else None
    sel = rids if rids is not None else list(ts.request_ids)
    runnable = [p for p in POLICIES if POLICIES[p].eviction != "score" or ts.has("router_probs")]
    # the costliest first, so the workers finish together
    order = [
        p
        for p in ("presched", "lfu", "belady", "smoe", "score", "prefetch", "lru", "static")
        if p in runnable
    ]
    order += [p for p in runnable if p not in order]
    for cold in (True,) if not stream else (True, False):
        out["sweeps"]["cold" if cold else "stream"] = _sweep(traces, order, cold, rids, hardware, workers)
    out.update(
        traces=ts,
        requests=sel,
        subset=requests,
        runnable=runnable,
        skipped={p: _skip_reason(ts, p, sel[0]) for p in POLICIES if p not in runnable},
        load_after=os.getloadavg(),
    )
    return out


def hit_table(m: dict) -> dict[tuple[str, str], list[float]]:
    """(policy, mode) -> hit rates at 10/25/50 %, cold before stream, for the policies that ran."""
    return {
        (p, mode): [r[0] for r in res[p][2][:3]]
        for mode, (res, _wall) in m["sweeps"].items()
        for p in m["runnable"]
        if res[p][2] is not None
    }


def rows(quick: bool, ds_traces: Path) -> list[dict]:
    """``quick``: the first 300 requests."""
    from bench.figures import fig, missing, shown

    if not Path(ds_traces).is_dir():
        return [missing("replay", f"{shown(ds_traces)} absent (moecast import ...)")]
    m = measure(str(ds_traces), 300 if quick else 0)
    total = m["traces"].num_requests
    note = f"quick: first {len(m['requests'])} of {total} requests" if quick else ""
    _res, wall = m["sweeps"]["cold"]
    kind = "Puffin replay (subset)" if quick else "full Puffin replay"
    out = [
        fig(
            "replay",
            f"{kind}, {len(m['runnable'])} policies x 5 capacities, cold (s)",
            wall,
            "{:.1f} s",
            "< 60 s",
            note,
            judged=not quick,
        )
    ]
    return out + _decision_figs(m) + _hit_rows(m, note)


def _decision_figs(m: dict) -> list[dict]:
    """Each policy's per-layer decision cost against its goal, with the numpy call floor beside it."""
    from bench.figures import fig

    out = []
    for pol, d in m["decisions"].items():
        out.append(
            fig(
                "replay",
                f"per-layer decision, {pol} + substitution + prefetch (LayerStep one lane, us)",
                round(d["total"], 2),
                "{:.1f} us",
                "<= 10 us",
                f"CPU time {d['total_cpu']:.2f} us; wall time; numpy call floor {m['floor_us']:.2f} us under this load",
            )
        )
    return out


def _hit_rows(m: dict, note: str) -> list[dict]:
    """The hit rates at 10/25/50 % per policy and mode, then a row for each policy that was skipped."""
    from bench.figures import row

    out = []
    for (pol, mode), hits in hit_table(m).items():
        why = note
        if pol in ("prefetch", "presched"):  # these policies' default predictor is the oracle
            why = ", ".join(filter(None, [note, "oracle predictor (the policy's default): a bound"]))
        out.append(
            row("replay", f"hit rate 10/25/50 % {pol} {mode}", " / ".join(f"{h:.3f}" for h in hits), note=why)
        )
    for pol, reason in m["skipped"].items():
        short = "needs router_probs" if "router_probs" in reason else reason
        out.append(row("replay", f"hit rate {pol}", f"skipped: {short}", note="DeepSeek traces are ids only"))
    return out


def _parse_args() -> argparse.Namespace:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument("--quick", action="store_true", help="first 200 requests only")
    ap.add_argument("--requests", type=int, default=0, help="first N requests (0 = all; --quick = 200)")
    ap.add_argument("--workers", type=int, default=2, help="processes the policies are spread over")
    ap.add_argument("--hardware", default="prescope-a100-pcie4")
    ap.add_argument("--no-stream", action="store_true", help="skip the stream-mode sweep")
    ap.add_argument("--no-decision", action="store_true", help="skip the per-layer decision microbenchmark")
    return ap.parse_args()


def _print_decisions(m: dict) -> None:
    """The numpy call floor and each policy's per-layer decision cost, when they were measured."""
    if m["decisions"]:
        call_us = m["floor_us"]
        print(f"numpy call overhead on this machine now: {call_us:.2f} us CPU per tiny call (a.sum() on 64)")
        for pol, d in m["decisions"].items():
            print(
                f"per-layer decision (the live runtime's compiled one-lane step), 64 experts top-6 batch 1, "
                f"{pol}, capacity 16, alpha 0.2 (us): "
                + ", ".join(f"{k} {v:.2f}" for k, v in d.items() if k != "substituted_share")
                + f" = {d['total_cpu'] / call_us:.1f} tiny numpy calls"
                + f"  (substituted uses {d['substituted_share']:.0%}; goal <= 10 us total)"
            )


def _print_sweeps(m: dict, hardware: str, workers: int, n_req: int) -> None:
    """The TraceSet, then each sweep's time and rows per policy, then the policies skipped and why."""
    ts, sel = m["traces"], m["requests"]
    print(
        f"TraceSet {ts.path}: {len(sel)} requests, {int(ts.request_lengths(sel).sum())} tokens, "
        f"{ts.num_layers} layers, {ts.num_experts} experts, top-{ts.top_k}; hardware {hardware}; "
        f"capacities {', '.join(f'{c:.0%}' for c in CAPS5)}"
    )
    for mode, (out, wall) in m["sweeps"].items():
        cpu = sum(o[5] for o in out.values())
        for p in m["runnable"]:
            _, _, rows_, err, w, c, n_jobs = out[p]
            if rows_ is None:
                print(f"  {mode:<6} {p:<9} skipped: {err}")
                continue
            print(
                f"  {mode:<6} {p:<9} {w:6.1f} s wall {c:6.1f} s cpu  hit "
                + " ".join(f"{r[0]:.3f}" for r in rows_)
                + "  TPOT ms "
                + " ".join(f"{r[1]:.2f}" if r[1] is not None else "-" for r in rows_)
                + (f"  ({n_jobs} jobs of capacities in parallel)" if n_jobs > 1 else "")
            )
        print(
            f"{mode} replay of {len(sel)} requests, {len(m['runnable'])} policies x 5 capacities: {wall:.1f} s wall "
            f"({cpu:.1f} s cpu over {workers} worker(s))"
            + ("  (goal < 60 s)" if mode == "cold" and not n_req else "")
        )
    for p, reason in m["skipped"].items():
        print(f"  {p}: skipped ({reason})")


def _print_hit_table(m: dict) -> None:
    """The hit rates at 10/25/50 % per policy and mode, as a markdown table."""
    print(
        "\nhit rate at 10/25/50 % capacity: per-layer caches, batch 1; demand loads + policy; "
        "prefetch and presched with the oracle predictor;\ncold = every request starts empty, "
        "stream = caches persist across requests in TraceSet order; no warm-up excluded"
    )
    print(f"| {'policy':<9} | {'mode':<6} | {'10%':>6} | {'25%':>6} | {'50%':>6} |")
    print(f"|{'-' * 11}|{'-' * 8}|{'-' * 8}|{'-' * 8}|{'-' * 8}|")
    for (p, mode), hits in hit_table(m).items():
        print(f"| {p:<9} | {mode:<6} | " + " | ".join(f"{h:6.3f}" for h in hits) + " |")
    for p in m["skipped"]:
        print(f"| {p:<9} | -      |      - |      - |      - |  (needs router_probs)")


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    n_req = args.requests or (200 if args.quick else 0)
    m = measure(args.traces, n_req, args.workers, args.hardware, not args.no_stream, not args.no_decision)
    print(
        f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in m['load_before'])}; cpus {os.cpu_count()}"
    )
    _print_decisions(m)
    _print_sweeps(m, args.hardware, args.workers, n_req)
    print(f"\nload average now: {' '.join(f'{x:.2f}' for x in m['load_after'])}")
    _print_hit_table(m)


if __name__ == "__main__":
    main()
