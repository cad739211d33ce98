"""Prediction metrics, one definition everywhere (docs/design.md, "Metrics").

- recall@k = |predicted top-k ∩ actual top-k| / k, averaged over (token, layer).
  ``k`` defaults to the model's top-k (the width of the true id array). With a
  smaller k it is the share of the predicted top-k that falls inside the true
  set (PreScope Table 3's "Top-4 within the true Top-6"), divided by k; with a
  larger k the denominator is the true set's size, so 1.0 always means "all of
  the true experts were predicted".
- precision, recall and F1 of the predicted top-k set as a binary multi-label
  decision over experts: micro (counts pooled over every token, layer and
  expert) and macro (F1 per (layer, expert) averaged over the experts that
  occur or are predicted, then over layers).
- everything per layer and per layer group.

All functions are vectorised numpy; ``MetricAccumulator`` sums the same counts
request by request so evaluation never holds a [tokens, L, E] array for a
whole TraceSet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moecast.errors import InputError


def topk_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores along the last axis (unordered); ties go to the lower index."""
    E = scores.shape[-1]
    k = min(k, E)
    if k == E:
        return np.broadcast_to(np.arange(E), scores.shape).copy()
    # a stable sort, not np.argpartition: argpartition breaks ties arbitrarily (scores [0, 0, 1, 1],
    # k = 1 gives expert 3), so tied scores (a count table) would be scored on an arbitrary expert
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def multi_hot(ids: np.ndarray, num_experts: int, dtype: Any = np.bool_) -> np.ndarray:
    """[..., k] expert ids -> [..., E] indicator (ids < 0 are ignored as padding)."""
    ids = np.asarray(ids).astype(np.int64)
    # padding goes to a spare column that is dropped, so it never clears a real id's mark
    safe = np.where(ids >= 0, ids, num_experts)
    out = np.zeros((*ids.shape[:-1], num_experts + 1), dtype=dtype)
    np.put_along_axis(out, safe, True if dtype == np.bool_ else 1, axis=-1)
    out = out[..., :num_experts]
    return out


def _check(scores: np.ndarray, true_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores)
    true_ids = np.asarray(true_ids)
    if scores.ndim < 1 or true_ids.ndim < 1:
        raise ValueError("metrics need scores [..., E] and true ids [..., k]")
    lead = np.broadcast_shapes(scores.shape[:-1], true_ids.shape[:-1])
    if not np.isfinite(scores).all():
        raise InputError("predictor scores contain NaN or inf; check the predictor's inputs (NaN features?)")
    return np.broadcast_to(scores, (*lead, scores.shape[-1])), np.broadcast_to(
        true_ids, (*lead, true_ids.shape[-1])
    )


def recall_per_row(scores: np.ndarray, true_ids: np.ndarray, k: int | None = None) -> np.ndarray:
    """[...] recall@k of each (token, layer) row: |top-k(scores) ∩ true| / min(k, |true|) (see module doc)."""
    scores, true_ids = _check(scores, true_ids)
    E = scores.shape[-1]
    k_true = true_ids.shape[-1]
    k = k_true if k is None else int(k)
    pred = multi_hot(topk_indices(scores, k), E)
    truth = multi_hot(true_ids, E)
    hits = (pred & truth).sum(-1)
    return hits / float(min(k, k_true) if k <= k_true else k_true)


def recall_at_k(scores: np.ndarray, true_ids: np.ndarray, k: int | None = None) -> float:
    """Mean recall@k over all (token, layer) rows; scores [..., E] and true ids [..., k] broadcast."""
    r = recall_per_row(scores, true_ids, k)
    return float(r.mean()) if r.size else float("nan")


class MetricAccumulator:
    """Running counts for recall@k, precision and micro/macro F1 over [tokens, L, E] predictions."""

    def __init__(self, num_layers: int, num_experts: int, k: int, extra_k: Sequence[int] = ()) -> None:
        self.L, self.E, self.k = num_layers, num_experts, k
        self.extra_k = tuple(x for x in extra_k if x != k)
        self.tp = np.zeros((num_layers, num_experts), np.int64)
        self.fp = np.zeros((num_layers, num_experts), np.int64)
        self.fn = np.zeros((num_layers, num_experts), np.int64)
        self.recall_sum = np.zeros(num_layers, np.float64)
        self.extra_sum = {x: np.zeros(num_layers, np.float64) for x in self.extra_k}
        self.rows = np.zeros(num_layers, np.int64)

    def update(self, scores: np.ndarray, true_ids: np.ndarray) -> None:
        """Add [T, L, E] scores against [T, L, k] true ids."""
        scores, true_ids = _check(scores, true_ids)
        if scores.shape[1:] != (self.L, self.E):
            raise ValueError(f"scores have shape {scores.shape}, expected [T, {self.L}, {self.E}]")
        k_true = true_ids.shape[-1]
        pred = multi_hot(topk_indices(scores, self.k), self.E)
        truth = multi_hot(true_ids, self.E)
        both = pred & truth
        self.tp += both.sum(0)
        self.fp += (pred & ~truth).sum(0)
        self.fn += (~pred & truth).sum(0)
        self.recall_sum += (both.sum(-1) / float(min(self.k, k_true))).sum(0)
        for x in self.extra_k:
            self.extra_sum[x] += recall_per_row(scores, true_ids, x).sum(0)
        self.rows += scores.shape[0]

    def counts(self) -> np.ndarray:
        """Every running count as one float64 vector (exact below 2**53): what processes sum."""
        parts = [self.tp, self.fp, self.fn, self.recall_sum, *self.extra_sum.values(), self.rows]
        return np.concatenate([np.asarray(a, np.float64).ravel() for a in parts])

    def set_counts(self, vec: np.ndarray) -> None:
        """Replace the running counts by a ``counts()`` vector (e.g. the sum over DDP ranks)."""
        vec = np.asarray(vec, np.float64)
        if vec.shape != self.counts().shape:
            raise ValueError(f"counts of shape {vec.shape}, expected {self.counts().shape}")
        cut = np.cumsum([self.tp.size] * 3 + [self.L] * (2 + len(self.extra_k)))[:-1]
        tp, fp, fn, recall_sum, *extra, rows = np.split(vec, cut)
        shape = self.tp.shape
        self.tp, self.fp, self.fn = (np.rint(a).astype(np.int64).reshape(shape) for a in (tp, fp, fn))
        self.recall_sum = recall_sum.copy()
        self.extra_sum = {x: e.copy() for x, e in zip(self.extra_k, extra)}
        self.rows = np.rint(rows).astype(np.int64)

    def result(self, groups: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
        """Metrics overall, per layer and per layer group (a group is a list of layer positions)."""
        if self.rows.sum() == 0:
            raise InputError(
                "no tokens were evaluated (empty split?); choose another --split or more requests"
            )
        out = self._summary(np.arange(self.L))
        out["k"] = self.k
        out["tokens"] = int(self.rows[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            each = [self._summary(np.array([i])) for i in range(self.L)]
            out["per_layer"] = {
                "recall_at_k": (self.recall_sum / self.rows).tolist(),
                **{m: [e[m] for e in each] for m in ("precision", "f1_micro", "f1_macro")},
            }
        for x in self.extra_k:
            out[f"recall_at_{x}"] = float(self.extra_sum[x].sum() / self.rows.sum())
        if groups:
            out["per_group"] = {
                g: self._summary(np.asarray(list(ls), dtype=np.int64)) for g, ls in groups.items() if len(ls)
            }
        return out

    def _summary(self, layers: np.ndarray) -> dict[str, float]:
        tp, fp, fn = self.tp[layers], self.fp[layers], self.fn[layers]
        TP, FP, FN = tp.sum(), fp.sum(), fn.sum()
        precision = TP / max(TP + FP, 1)
        recall = TP / max(TP + FN, 1)
        f1_micro = 2 * precision * recall / max(precision + recall, 1e-12)
        denom = 2 * tp + fp + fn
        seen = denom > 0  # experts never used nor predicted say nothing about quality
        f1_e = np.where(seen, 2 * tp / np.maximum(denom, 1), np.nan)
        per_layer_macro = np.array([np.nanmean(r) if np.isfinite(r).any() else np.nan for r in f1_e])
        return {
            "recall_at_k": float(self.recall_sum[layers].sum() / max(self.rows[layers].sum(), 1)),
            "precision": float(precision),
            "recall": float(recall),
            "f1_micro": float(f1_micro),
            "f1_macro": float(np.nanmean(per_layer_macro))
            if np.isfinite(per_layer_macro).any()
            else float("nan"),
        }


def evaluate_scores(
    scores: np.ndarray,
    true_ids: np.ndarray,
    k: int | None = None,
    groups: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """All metrics of [T, L, E] scores against [T, L, k] true ids in one call."""
    scores, true_ids = _check(scores, true_ids)
    acc = MetricAccumulator(scores.shape[1], scores.shape[2], true_ids.shape[-1] if k is None else k)
    acc.update(scores, true_ids)
    return acc.result(groups)
