"""CasMoE's Table 3 on held-out prompts: plan recall and planner latency of EAP, EAM and the cascade.

casmoe-eam-eap-cascade.md, "Experiment Results", Table 3: each planner's plan recall@k against
the true EP label (Eq. 3) and its latency per prompt, the cascade at several gate
thresholds epsilon. A report over the planners, not a component: ``moecast train
cascade --traces`` and ``bench/bench_casmoe.py`` print it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from moecast.collect.traceset import TEST_FRACTION, VAL_FRACTION
from moecast.predictors.base import Predictor
from moecast.predictors.casmoe import ep_labels, plan_recall, prompt_texts
from moecast.predictors.eam import EAM

from moecast.errors import InputError


@dataclass
class PlannerRun:
    """Plans, confidences and per-prompt latencies of one planner over held-out prompts."""

    plans: np.ndarray  # [N, L, E]
    latency_ms: np.ndarray  # [N]
    confidence: np.ndarray | None = None  # [N] (EAM only)


def run_planner(planner: Any, prompts: Iterable[str], progress: str | None = None) -> PlannerRun:
    """Time ``planner.plan`` (EAM: ``query``) prompt by prompt, as the runtime calls it before decoding."""
    from tqdm import tqdm

    prompts = list(prompts)
    plans, lat, conf = [], [], []
    it = tqdm(prompts, desc=progress, unit="prompt", leave=False, disable=progress is None)
    is_eam = isinstance(planner, EAM)
    for p in it:
        t0 = time.perf_counter()
        if is_eam:
            plan, c = planner.query(p)
            conf.append(c)
        else:
            plan, _ = planner.plan(p)
        lat.append((time.perf_counter() - t0) * 1e3)
        plans.append(plan)
    return PlannerRun(np.stack(plans), np.asarray(lat), np.asarray(conf) if is_eam else None)


def table3(
    eam_run: PlannerRun,
    eap_run: PlannerRun,
    true_ep: np.ndarray,
    k: int,
    epsilons: Sequence[float],
    fallback_ms: np.ndarray | None = None,
    baseline: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """CasMoE Table-3-style rows: EAP alone, EAM alone, the cascade at each epsilon, each with latency.

    The cascade's plan at epsilon is EAM's where its confidence >= epsilon, else EAP's;
    its latency is EAM's for every prompt plus, for those that fall back, the EAP's
    cost inside the cascade (``fallback_ms``; default the EAP's own latency, only
    its heads when it reuses the EAM's embedding). Computed
    from one run of each planner, which is exactly what the gate would have produced.
    ``baseline`` (an [L, E] static plan, e.g. the training set's mean EP) adds a row.
    """
    rows = []

    def row(name: str, plans: np.ndarray, lat: np.ndarray, eam_share: float | None = None) -> dict[str, Any]:
        r = plan_recall(plans, true_ep, k)
        out = {
            "planner": name,
            "k": k,
            "recall_at_k": r["recall_at_k"],
            "f1_micro": r["f1_micro"],
            "mean_latency_ms": float(np.mean(lat)),
            "p50_latency_ms": float(np.median(lat)),
            "requests": r["requests"],
            "per_layer_recall": r["per_layer"]["recall_at_k"],
        }
        if eam_share is not None:
            out["eam_share"] = eam_share
        return out

    if baseline is not None:
        rows.append(
            row("static (train mean EP)", np.broadcast_to(baseline, true_ep.shape), np.zeros(len(true_ep)))
        )
    rows.append(row("EAP", eap_run.plans, eap_run.latency_ms))
    rows.append(row("EAM", eam_run.plans, eam_run.latency_ms, 1.0))
    assert eam_run.confidence is not None
    fallback_cost = eap_run.latency_ms if fallback_ms is None else np.asarray(fallback_ms)
    for eps in epsilons:
        use_eam = eam_run.confidence >= eps
        plans = np.where(use_eam[:, None, None], eam_run.plans, eap_run.plans)
        lat = eam_run.latency_ms + np.where(use_eam, 0.0, fallback_cost)
        r = row(f"cascade eps={eps:g}", plans, lat, float(use_eam.mean()))
        # paired per prompt: the two planners' timings share each prompt's length and load
        d = lat - eap_run.latency_ms
        r["latency_vs_eap_ms"] = float(d.mean())
        r["latency_vs_eap_se_ms"] = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("inf")
        rows.append(r)
    return rows


def cascade_wins(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cascade rows of :func:`table3` that meet CasMoE's Table-3 claim against the EAP alone: plan
    recall at least the EAP's and a mean latency lower by more than two standard errors of the
    paired per-prompt difference (a lower mean inside timing noise is not a win)."""
    eap = next(r for r in rows if r["planner"] == "EAP")
    return [
        r
        for r in rows
        if r["planner"].startswith("cascade")
        and r["recall_at_k"] >= eap["recall_at_k"]
        and r["latency_vs_eap_ms"] + 2 * r["latency_vs_eap_se_ms"] < 0
    ]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'planner':<26} {'recall@k':>9} {'F1':>7} {'mean ms':>9} {'p50 ms':>8} {'EAM share':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        share = f"{r['eam_share']:.2f}" if "eam_share" in r else "-"
        lines.append(
            f"{r['planner']:<26} {r['recall_at_k']:>9.4f} {r['f1_micro']:>7.4f} "
            f"{r['mean_latency_ms']:>9.2f} {r['p50_latency_ms']:>8.2f} {share:>10}"
        )
    return "\n".join(lines)


def time_planners(
    eam: EAM, eap: Any, prompts: Sequence[str], progress: bool = False
) -> tuple[PlannerRun, PlannerRun, np.ndarray | None]:
    """(EAM run, EAP run, cascade fallback ms or None): each prompt planned by both, back to back.

    The EAM query (embedding + HNSW, as ``EAM.query``) and the EAP plan of a prompt are
    timed one after the other, the order alternating between prompts, so both see the
    same machine load (on a shared CPU, separate passes can differ by more than the
    planners do). When the EAP reuses the EAM's embedding (``shares_embedder``), its
    heads on that embedding are timed too: the cost of a fallback inside the cascade.
    One untimed warm-up of each first.
    """
    from tqdm import tqdm

    prompts = list(prompts)
    shared = eap.shares_embedder(eam.embedder)
    eam.query(prompts[0])
    eap.plan(prompts[0])
    n = len(prompts)
    eam_plans, eap_plans = [], []
    eam_ms, eap_ms, conf, fb_ms = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    it = tqdm(prompts, desc="EAM + EAP", unit="prompt", leave=False, disable=not progress)
    for i, p in enumerate(it):
        for which in ("eam", "eap") if i % 2 == 0 else ("eap", "eam"):
            t0 = time.perf_counter()
            if which == "eam":
                emb = eam.embedder.embed([p])
                plans, c = eam.query_embedding(emb)
                eam_ms[i] = (time.perf_counter() - t0) * 1e3
                eam_plans.append(plans[0])
                conf[i] = c[0]
                if shared:
                    t0 = time.perf_counter()
                    eap.plan_from_embedding(emb)
                    fb_ms[i] = (time.perf_counter() - t0) * 1e3
            else:
                eap_plans.append(eap.plan(p)[0])
                eap_ms[i] = (time.perf_counter() - t0) * 1e3
    eam_run = PlannerRun(np.stack(eam_plans), eam_ms, conf)
    eap_run = PlannerRun(np.stack(eap_plans), eap_ms)
    return eam_run, eap_run, fb_ms if shared else None


def compare_planners(
    eam: str | Path | EAM,
    eap: str | Path | Any,
    traces: str | Path,
    epsilons: Sequence[float] = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9),
    k: int | None = None,
    val_fraction: float = VAL_FRACTION,
    seed: int = 0,
    max_requests: int | None = None,
    progress: bool = True,
    int8: bool | None = None,
    engine: str | None = None,
    threads: int | None = None,
    test_fraction: float = TEST_FRACTION,
) -> list[dict[str, Any]]:
    """CasMoE Table-3-style comparison on the val requests of ``traces`` (``TraceSet.splits``: the
    side that tunes epsilon; test stays for ``moecast predictors eval``).

    EAP alone, EAM alone and the cascade at each epsilon: plan recall@k against each
    request's true EP top-k (k defaults to the model's top-k) and mean planner latency
    per prompt (:func:`time_planners`), plus the static train-mean-EP plan for reference.
    ``int8`` switches both planners' encoders to dynamic int8 (True) or fp32 (False),
    ``engine`` to ONNX Runtime or torch, ``threads`` sets their batch-1 threads (see
    ``EAM.set_encoder``); None keeps what the checkpoints say.
    """
    from moecast.collect.traceset import open_traces
    from moecast.predictors.registry import load

    ts = open_traces(traces)
    where = f"TraceSet {ts.path} ({ts.model.name_or_path})"
    eam_p = eam if isinstance(eam, EAM) else load(eam, ts.model.fingerprint, where)
    eap_p = eap if isinstance(eap, Predictor) else load(eap, ts.model.fingerprint, where)
    if not isinstance(eam_p, EAM) or getattr(eap_p, "name", "") != "eap":
        raise InputError(
            f"compare_planners needs an EAM and an EAP checkpoint, got {eam_p.name} and {eap_p.name}"
        )
    sides = ts.splits(val_fraction, test_fraction, seed)
    train_ids, val_ids = sides.train, sides.val
    if max_requests:
        val_ids = val_ids[:max_requests]
    if not val_ids:
        raise InputError(f"{ts.path}: no held-out requests at val_fraction={val_fraction}; raise it")
    include_decode = bool(eam_p.extra_meta.get("include_decode", False))
    true_ep, _ = ep_labels(ts, val_ids, include_decode)
    baseline = ep_labels(ts, train_ids, include_decode)[0].mean(0) if train_ids else None
    prompts = prompt_texts(ts, val_ids)
    eam_p.set_encoder(int8, engine, threads)
    eap_p.set_encoder(int8, engine, threads)
    eam_run, eap_run, fallback = time_planners(eam_p, eap_p, prompts, progress)
    return table3(eam_run, eap_run, true_ep, k or ts.top_k, epsilons, fallback, baseline)
