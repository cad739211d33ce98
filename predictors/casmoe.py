"""CasMoE's expert-pattern (EP) label and plan metrics (casmoe-eam-eap-cascade.md, "Data Calibration", Eq. 3).

Before decoding, a CasMoE planner turns the prompt into an [L, E] expert-pattern plan
for every MoE layer at once; the runtime preloads each layer's top experts and uses the
plan as a prefetch prior. The planners each have their own module:
:mod:`~moecast.predictors.eam` (Eqs. 4-5), :mod:`~moecast.predictors.eap` (Eqs. 6-9)
and :mod:`~moecast.predictors.cascade` (the epsilon gate). What they share lives here:
the EP label every planner is trained and judged against (Eq. 3), the prompt a plan is
made from, and plan recall, so training, evaluation, the runtime and the reports use
one definition.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from moecast.collect.traceset import RequestTrace, TraceSet
from moecast.predictors.base import Predictor

from moecast.errors import InputError

# ----------------------------------------------------------------------------- EP label (Eq. 3)


def ep_labels(
    ts: TraceSet, requests: Sequence[str] | None = None, include_decode: bool = False
) -> tuple[np.ndarray, bool]:
    """EP matrices (CasMoE Eq. 3) of many requests: ([N, L, E] float32, router_weighted).

    EP_i[l, e] = sum over the prompt's tokens j of alpha_j,l,e * I(e in top-k_j,l),
    where alpha is the router weight of the selected expert; each layer's row is
    normalised to sum to 1 so prompts of any length are comparable. With
    ``include_decode`` the decoded tokens count too. A TraceSet without
    ``topk_weights`` (e.g. the imported DeepSeek traces) gives plain counts, and the
    second return value is False so callers can flag it in their metadata.

    One bincount over all selected (request, layer, expert) triples: no Python loop
    over tokens.
    """
    ids = list(ts.request_ids if requests is None else requests)
    L, E = ts.num_layers, ts.num_experts
    if not ids:
        return np.zeros((0, L, E), np.float32), ts.has("topk_weights")
    topk = ts.array("topk_ids", ids).astype(np.int64)  # [T, L, k]
    lengths = ts.request_lengths(ids)
    seg = np.repeat(np.arange(len(ids), dtype=np.int64), lengths)
    keep = np.ones(len(seg), dtype=bool)
    if not include_decode:
        keep = ts.column("phase", ids) != "decode"
    weighted = ts.has("topk_weights")
    w = ts.array("topk_weights", ids).astype(np.float64) if weighted else np.ones(topk.shape, np.float64)
    if np.any(topk < 0) or np.any(topk >= E):
        raise InputError(f"{ts.path}: topk_ids outside [0, {E}); the TraceSet is corrupt, re-collect it")
    flat = (seg[:, None, None] * L + np.arange(L)[None, :, None]) * E + topk
    ep = np.bincount(flat[keep].ravel(), weights=w[keep].ravel(), minlength=len(ids) * L * E)
    ep = ep.reshape(len(ids), L, E)
    totals = ep.sum(-1, keepdims=True)
    # a request with no prompt tokens (nothing selected) gets a uniform row rather than NaN
    ep = np.where(totals > 0, ep / np.maximum(totals, 1e-12), 1.0 / E)
    return ep.astype(np.float32), weighted


def ep_label(trace: RequestTrace, num_experts: int, include_decode: bool = False) -> np.ndarray:
    """EP matrix [L, E] of one request (Eq. 3), router-weighted when the trace has weights."""
    keep = np.ones(len(trace), bool) if include_decode else ~np.asarray(trace.is_decode, bool)
    w = trace.topk_weights[keep] if trace.topk_weights is not None else None
    return ep_matrix(trace.topk_ids[keep], w, num_experts)


def ep_matrix(topk_ids: np.ndarray, topk_weights: np.ndarray | None, num_experts: int) -> np.ndarray:
    """Eq. 3 on one prompt's routing, ids and weights [T, L, k] (weights None: plain counts):
    [L, E], each layer's row normalised to sum to 1 (uniform for a layer with no tokens)."""
    ids = np.asarray(topk_ids, np.int64)
    L = ids.shape[1]
    w = np.asarray(topk_weights, np.float64) if topk_weights is not None else np.ones(ids.shape, np.float64)
    flat = np.arange(L)[None, :, None] * num_experts + ids
    ep = np.bincount(flat.ravel(), weights=w.ravel(), minlength=L * num_experts).reshape(L, num_experts)
    tot = ep.sum(-1, keepdims=True)
    return np.where(tot > 0, ep / np.maximum(tot, 1e-12), 1.0 / num_experts).astype(np.float32)


def prompt_text(trace_or_ts: RequestTrace | TraceSet, rid: str | None = None) -> str:
    """The prompt of a request: the stored text, else rebuilt from its prefill token texts.

    Imported MoE-Beyond traces store the prompt the importer rebuilt from byte-level
    BPE pieces ('Ġ' = space, 'Ċ' = newline); older imports may lack it, so rebuild.
    """
    if isinstance(trace_or_ts, TraceSet):
        if rid is None:
            raise ValueError("prompt_text(TraceSet, rid) needs a request id")
        text = trace_or_ts.request_info(rid).get("prompt") or ""
        if text.strip():
            return text
        trace_or_ts = trace_or_ts.get(rid)
    trace = trace_or_ts
    if trace.prompt and trace.prompt.strip():
        return trace.prompt
    from moecast.collect.moe_beyond import detokenize

    pieces = [t for t, d in zip(trace.token_texts, trace.is_decode) if not d]
    return detokenize(pieces)


def prompt_texts(ts: TraceSet, requests: Sequence[str]) -> list[str]:
    """The prompts of ``requests`` in ``ts`` (:func:`prompt_text` of each)."""
    return [prompt_text(ts, rid) for rid in requests]


# ----------------------------------------------------------------------------- plan metrics


def plan_truth(ep: np.ndarray, k: int) -> np.ndarray:
    """[..., L, k] ids of the k experts with the largest EP mass per layer (ties: lower id)."""
    return np.argsort(-ep, axis=-1, kind="stable")[..., :k]


def plan_recall(plans: np.ndarray, true_ep: np.ndarray, k: int) -> dict[str, Any]:
    """Plan recall@k (docs/design.md, Metrics) of [N, L, E] plans against the top-k of the true EP labels.

    Each request is one row per layer: |top-k(plan) ∩ top-k(EP)| / k, averaged over
    requests and layers; also per layer, precision and F1 from the shared accumulator.
    """
    from moecast.predictors.metrics import MetricAccumulator

    plans = np.asarray(plans, np.float32)
    acc = MetricAccumulator(plans.shape[1], plans.shape[2], k)
    acc.update(plans, plan_truth(true_ep, k))
    out = acc.result()
    out["requests"] = out.pop("tokens")
    return out


def broadcast_plan(plan: np.ndarray, num_tokens: int) -> np.ndarray:
    """The [L, E] plan repeated over a request's tokens: the prompt-ahead score_request contract."""
    return np.ascontiguousarray(np.broadcast_to(plan.astype(np.float32), (num_tokens, *plan.shape)))


#: checkpoint metadata a planner keeps from its build (training data, weighting, split, metrics)
BUILD_KEYS = ("trained_on", "ep_weighting", "include_decode", "metrics", "split")


class Planner(Predictor):
    """Base of CasMoE's prompt-ahead planners (EAM, EAP, cascade): an [L, E] plan per prompt.

    ``score_request`` repeats the plan of the request's prompt over its tokens; ``metadata``
    records the model's shape and what the planner kept from its build (``extra_meta``).
    """

    horizon: ClassVar[str] = "prompt-ahead"
    needs: ClassVar[tuple[str, ...]] = ("topk_ids",)
    moe_layers: list[int]
    extra_meta: dict[str, Any]

    @abstractmethod
    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        """([L, E] plan, which planner answered)."""

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        plan, _ = self.plan(prompt_text(trace))
        return broadcast_plan(plan, len(trace))

    def metadata(self) -> dict[str, Any]:
        return {
            **super().metadata(),
            **self.extra_meta,
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts,
            "num_layers": self.num_layers,
            "top_k": self.top_k,
        }


def build_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The :data:`BUILD_KEYS` of a loaded checkpoint's metadata: a planner's ``extra_meta``."""
    return {k: meta[k] for k in BUILD_KEYS if k in meta}
