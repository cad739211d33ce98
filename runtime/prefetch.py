"""Prefetching: predictor scores -> which experts go on the link before a layer runs.

- Ranking (SMoE Sec. 5.2 and criterion C4 of its Sec. IV-A): prefetch the top-score predicted experts
  first, highest score first; the queue is cleared when the layer's real routing arrives, so only the
  transfers that finished before the layer's expert computation count.
- Sizing (PreScope Sec. 4.3.3, Eqs. 6-7): how many transfers fit in the link gap left before the
  next layer, ``f = (T_gap + t_attn) / t_io``, with the critical one kept only when its expected gain
  ``R_hit (f - |f| + 1) - R_miss (|f| - f)`` is positive; R_hit is the prefetch hit rate measured
  online (:class:`Prefetcher` keeps it).

Built-in predictors for bounds: ``none`` (no prefetch) and ``oracle`` (the next layer's true
experts). Any moecast checkpoint loads with :func:`moecast.predictors.load`; a prompt-ahead
``--planner`` gives an [L, E] plan used for preloading and as a prior.
"""

from __future__ import annotations

import math

import numpy as np
from moecast.collect.traceset import RequestTrace
from moecast.predictors.base import Predictor
from moecast.runtime import kernels

BUILTIN = ("none", "oracle")
_BOOL_DT = np.dtype(bool)


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


def top_predictions(scores: np.ndarray, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, L, E] scores -> (ids [T, L, kp] best first, their scores) for compact storage."""
    kp = min(kp, scores.shape[-1])
    part = np.argpartition(-scores, kp - 1, axis=-1)[..., :kp]
    sc = np.take_along_axis(scores, part, -1)
    order = np.argsort(-sc, axis=-1, kind="stable")
    return np.take_along_axis(part, order, -1), np.take_along_axis(sc, order, -1)


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


class Prefetcher:
    """Online per-layer prefetch choice: scores of the next layer + its resident set -> ids to fetch."""

    def __init__(self, num_experts: int, top_k: int, t_io: float, t_attn: float) -> None:
        self.E, self.k = num_experts, top_k
        self.t_io, self.t_attn = float(t_io), float(t_attn)
        self.used = 1
        self.issued = 2  # uninformed prior R_hit = 0.5 until measured
        self._kern = None  # score dtype -> compiled entry point, loaded on first use

    def _load(self):
        self._kern = kernels.choose_kernels().get
        return self._kern

    @property
    def r_hit(self) -> float:
        return self.used / self.issued

    def record(self, used: int, issued: int) -> None:
        """Feed back how many prefetched experts were used (for R_hit of Eq. 7)."""
        self.used += used
        self.issued += issued

    def choose(self, scores: np.ndarray, resident: np.ndarray, t_gap: float | None = None) -> np.ndarray:
        """scores [E] or [B, E] for the next layer, resident [E] bool -> ids to prefetch, best first.

        Candidates are each token's top-k predicted experts (C4: top-score ones; exact ties at the
        k-th place go to the lower id) with a positive score, merged over the batch by summed score
        (ties: lower id first); with ``t_gap`` the count is sized by Eqs. 6-7. One token ([E] or
        [1, E]) takes a short path with the same result.
        """
        if not isinstance(scores, np.ndarray):
            scores = np.asarray(scores)
        if scores.ndim == 1:
            return self._choose_one(scores, resident, t_gap)
        if len(scores) == 1:
            return self._choose_one(scores.reshape(-1), resident, t_gap)
        s = np.atleast_2d(scores)
        top = np.argsort(-s, axis=1, kind="stable")[:, : self.k]
        agg = np.zeros(self.E, dtype=np.float64)
        np.add.at(agg, top.reshape(-1), np.take_along_axis(s, top, 1).reshape(-1))
        agg[resident] = 0.0
        cand = np.flatnonzero(agg > 0)
        cand = cand[np.argsort(-agg[cand], kind="stable")]
        if t_gap is not None:
            cand = cand[: self._gap_count(t_gap)]
        return cand

    def _choose_one(self, s: np.ndarray, resident: np.ndarray, t_gap: float | None) -> np.ndarray:
        """One token: the batch path's result for one row, as one compiled walk over the scores
        from the best down (ties to the lower id, as the batch path's stable sort)."""
        if resident.__class__ is not np.ndarray or resident.dtype is not _BOOL_DT or resident.ndim != 1:
            resident = np.asarray(resident, dtype=bool).reshape(-1)
        if resident.shape[0] != s.shape[0]:
            raise ValueError(f"resident has {resident.shape[0]} experts, the scores {s.shape[0]}")
        kern = (self._kern or self._load())(s.dtype)
        if kern is None:
            s = s.astype(np.float64)
            kern = self._kern(s.dtype)
        out = np.empty(self.k, dtype=np.int64)
        gap = math.nan if t_gap is None else float(t_gap)
        got = kern(s, resident, self.k, gap, self.t_attn, self.t_io, self.used, self.issued, out)
        if got < 0:  # a NaN score: rank by sorting instead
            return self._choose_sorted(s, resident, self.k if t_gap is None else self._gap_count(t_gap))
        return out[:got]

    def _choose_sorted(self, s: np.ndarray, resident: np.ndarray, n: int) -> np.ndarray:
        top = np.argsort(-s, kind="stable")[: self.k]
        keep = [e for e, v in zip(top.tolist(), s[top].tolist()) if v > 0 and not resident[e]]
        return np.array(keep[:n], dtype=np.intp)

    def _gap_count(self, t_gap: float) -> int:
        """Eqs. 6-7 for one gap (the compiled scalar form the one-token path uses)."""
        return kernels.gap_count(float(t_gap), self.t_attn, self.t_io, self.used, self.issued, self.E)
