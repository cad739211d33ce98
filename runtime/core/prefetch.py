"""Prefetching: predictor scores -> which experts go on the link before a layer runs.

- Ranking (SMoE Sec. 5.2 and criterion C4 of its Sec. IV-A): prefetch the top-score predicted experts
  first, highest score first; the queue is cleared when the layer's real routing arrives, so only the
  transfers that finished before the layer's expert computation count.
- Sizing (PreScope Sec. 4.3.3, Eqs. 6-7): how many transfers fit in the link gap left before the
  next layer, ``f = (T_gap + t_attn) / t_io``, with the critical one kept only when its expected gain
  ``R_hit (f - |f| + 1) - R_miss (|f| - f)`` is positive; R_hit is the prefetch hit rate measured
  online (PreSched's, :class:`moecast.runtime.core.step.LayerStep` keeps it).

Built-in predictors for bounds: ``none`` (no prefetch) and ``oracle`` (the next layer's true
experts). Any moecast checkpoint loads with :func:`moecast.predictors.load`; a prompt-ahead
``--planner`` gives an [L, E] plan used for preloading and as a prior.
"""

from __future__ import annotations

import math

import numpy as np
from moecast.collect.traceset import RequestTrace
from moecast.predictors.base import Predictor
from moecast.predictors.base import top_predictions as top_predictions  # the runtimes' ranking

BUILTIN = ("none", "oracle")


class OraclePredictor(Predictor):
    """Upper bound: scores are the true routing of each (token, layer) (router weights when recorded)."""

    name = "oracle"
    horizon = "layer-ahead"

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        T, L, k = trace.topk_ids.shape
        out = np.zeros((T, L, self.num_experts), dtype=np.float32)
        w = (
            trace.topk_weights.astype(np.float32)
            if trace.topk_weights is not None
            else np.ones((T, L, k), np.float32)
        )
        np.put_along_axis(out, trace.topk_ids.astype(np.int64), w + 1.0, axis=2)
        return out


def plan_prior(scores: np.ndarray, plan: np.ndarray, weight: float) -> np.ndarray:
    """Token-level scores [T, L, E] with a prompt plan [L, E] as a log-linear prior (CasMoE Sec. 4).

    ``logit(s) + weight * log(plan)``: scores that are not already logits (non-negative ones:
    probabilities as they are, counts as shares per (token, layer)) are mapped to logits; the
    plan is normalised per layer. The prior only reorders experts the token-level
    predictor finds close (weight 0: the predictor alone); a plan knows the request, not the token.
    """
    s = np.asarray(scores, dtype=np.float64)
    if (s >= 0).all():
        # probabilities as they are; counts and other non-negative scores as shares per (token, layer)
        p = s if s.max(initial=0.0) <= 1 else s / np.maximum(s.sum(-1, keepdims=True), 1e-12)
        p = np.clip(p, 1e-6, 1 - 1e-6)
        s = np.log(p) - np.log1p(-p)
    q = np.clip(np.asarray(plan, dtype=np.float64), 1e-6, None)
    q = q / q.sum(-1, keepdims=True)
    return (s + weight * np.log(q)[None]).astype(np.float32)


def gap_prefetch_count(t_gap: np.ndarray, t_attn: float, t_io: float, r_hit: np.ndarray) -> np.ndarray:
    """PreScope Eqs. 6-7: prefetches to issue into a link gap (vectorised)."""
    if not math.isfinite(t_io):
        return np.zeros(np.shape(t_gap), dtype=np.int64)
    if t_io <= 0:
        return np.full(np.shape(t_gap), np.iinfo(np.int32).max, dtype=np.int64)
    f = (np.asarray(t_gap, dtype=np.float64) + t_attn) / t_io
    fr = np.floor(f + 0.5)
    xi = r_hit * (f - fr + 1) - (1 - r_hit) * (fr - f)
    return np.maximum(np.where(xi > 0, fr, fr - 1), 0).astype(np.int64)
