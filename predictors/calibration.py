"""The prefetch gate's calibration: a predictor's scores mapped to the probability that a predicted
expert is used, fitted on held-out requests and kept in the predictor's checkpoint.

**Histogram binning** (Zadrozny & Elkan, "Obtaining calibrated probability estimates from decision
trees and naive Bayesian classifiers", ICML 2001, Sec. 3): per MoE layer, the predictions of a
held-out set (the TraceSet's val side of the predictor's split: tune on val, report test) are cut
into ``bins`` bins of equal count by their score, and a bin's probability is the share of its
predictions whose expert the token's router chose at that layer (label: the predicted id is in the
token's top-k there). A score falls in bin ``b`` when ``edge[b-1] <= score < edge[b]`` (the inner
edges are the score quantiles ``1/bins .. (bins-1)/bins``; equal quantiles merge, so a layer may
have fewer bins). A bin no val prediction fell in takes the layer's overall rate.

**The scores** are the runtimes': each (token, layer)'s scores divided by their largest magnitude
(:func:`~moecast.predictors.base.normalised`), top-k kept (:func:`~moecast.predictors.base.top_predictions`),
so a calibration fitted here is the one the replay fits on the same requests, and the live runtime
maps its predictions through it the same way.

**In the checkpoint** (``moecast predictors calibrate``, :func:`calibrate`): the edges and
probabilities as the tensors ``gate_calibration.edges`` [L, bins - 1] and ``gate_calibration.prob``
[L, bins] (float64; ``+inf`` pads a layer's merged edges), and under the metadata key
``gate_calibration`` the predictions it was fitted on and where from (TraceSet, its id, the side and
its requests). The checkpoint is rewritten atomically (:func:`moecast.predictors.checkpoint.save`);
the predictor's own tensors are copied unchanged. A predictor saved anew (retrained, or given a context
memory) scores differently and is written without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from moecast.predictors.base import normalised, top_predictions

from moecast.errors import InputError

#: bins per layer of the calibration
BINS = 10
#: where the calibration sits in a checkpoint: its tensors and its metadata key
EDGES, PROB, META = "gate_calibration.edges", "gate_calibration.prob", "gate_calibration"


@dataclass
class Calibration:
    """Per-layer histogram binning of predictor scores to P(used); see the module docstring."""

    edges: np.ndarray  # [L, bins - 1] inner edges per layer, ascending (+inf past a layer's own)
    prob: np.ndarray  # [L, bins] P(used) per bin
    samples: int = 0  # predictions it was fitted on

    @classmethod
    def fit(cls, scores: np.ndarray, used: np.ndarray, valid: np.ndarray, bins: int = BINS) -> Calibration:
        """From [T, L, kp] scores, whether each prediction was used, and which are predictions."""
        if bins < 1:
            raise InputError(f"calibration bins must be >= 1, got {bins}")
        valid = np.asarray(valid, dtype=bool)
        if not valid.any():
            raise InputError(
                "the prefetch gate has no val predictions to calibrate on; replay a TraceSet whose "
                "predictor split has a val side, or use a policy without the gate"
            )
        L = scores.shape[1]
        overall = float(used[valid].mean())
        edges = np.full((L, bins - 1), np.inf)
        prob = np.full((L, bins), overall)
        q = np.linspace(0.0, 1.0, bins + 1)[1:-1]
        for layer in range(L):
            m = valid[:, layer]
            s = scores[:, layer][m].astype(np.float64)
            if not len(s):
                continue
            y = used[:, layer][m].astype(np.float64)
            inner = np.unique(np.quantile(s, q)) if bins > 1 else np.zeros(0)
            edges[layer, : len(inner)] = inner
            b = np.searchsorted(inner, s, side="right")
            n = np.bincount(b, minlength=bins)
            hit = np.bincount(b, weights=y, minlength=bins)
            rate = float(y.mean())
            with np.errstate(invalid="ignore", divide="ignore"):
                prob[layer] = np.where(n > 0, hit / np.maximum(n, 1), rate)
        return cls(edges, prob, int(valid.sum()))

    def probability(self, scores: np.ndarray) -> np.ndarray:
        """[T, L, kp] scores -> P(used) of each."""
        out = np.empty(scores.shape, dtype=np.float64)
        for layer in range(scores.shape[1]):
            out[:, layer] = self.at(layer, scores[:, layer])
        return out

    def at(self, layer: int, scores: np.ndarray) -> np.ndarray:
        """P(used) of predictions for ``layer`` with these scores (any shape)."""
        b = np.searchsorted(self.edges[layer], np.asarray(scores).astype(np.float64), side="right")
        return self.prob[layer][b]

    def tensors(self) -> dict[str, np.ndarray]:
        """Its checkpoint tensors."""
        return {EDGES: np.asarray(self.edges, np.float64), PROB: np.asarray(self.prob, np.float64)}

    @classmethod
    def take(cls, tensors: dict[str, Any], meta: dict[str, Any]) -> Calibration | None:
        """The calibration a checkpoint's (tensors, metadata) hold, removed from both (so a predictor's
        own loader sees only its tensors); None where it has none."""
        edges, prob, about = tensors.pop(EDGES, None), tensors.pop(PROB, None), meta.pop(META, None)
        if edges is None or prob is None or about is None:
            return None
        edges, prob = np.asarray(edges, np.float64), np.asarray(prob, np.float64)
        if edges.ndim != 2 or prob.shape != (edges.shape[0], edges.shape[1] + 1):
            raise InputError(
                f"the checkpoint's gate calibration has edges {edges.shape} and probabilities {prob.shape}; "
                "rewrite it with `moecast predictors calibrate`"
            )
        return cls(edges, prob, int(about.get("samples", 0)))


def used_labels(pred_ids: np.ndarray, topk_ids: np.ndarray) -> np.ndarray:
    """[T, L, kp] whether each predicted id is among the token's routed [T, L, k] at its layer."""
    return (pred_ids[..., :, None] == topk_ids[..., None, :]).any(-1) & (pred_ids >= 0)


def request_predictions(predictor: Any, trace: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's (ids, scores) [T, L, k] as the runtimes see its predictions (module docstring)."""
    return top_predictions(normalised(predictor.score_request(trace)), k)


def fit(predictor: Any, ts: Any, requests: list[str], bins: int = BINS) -> Calibration:
    """The calibration of ``predictor`` on ``requests`` of TraceSet ``ts``."""
    import torch

    k = ts.meta.model.top_k

    def labelled() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for rid in requests:
            trace = ts.get(rid)
            yield (*request_predictions(predictor, trace, k), np.asarray(trace.topk_ids, dtype=np.int64))

    with torch.inference_mode():
        cal = fit_on(labelled(), bins)
    if cal is None:
        raise InputError(f"{ts.path}: no requests to calibrate the prefetch gate on")
    return cal


def fit_on(
    predictions: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], bins: int = BINS
) -> Calibration | None:
    """The calibration of requests' predictions, each ``(ids, scores, routed)``: [T, L, kp] predicted
    ids and their scores as the runtimes see them, and the [T, L, k] experts the router chose; None
    without a request."""
    scores, used, valid = [], [], []
    for ids, sc, routed in predictions:
        scores.append(sc)
        used.append(used_labels(ids, routed))
        valid.append(ids >= 0)
    if not scores:
        return None
    return Calibration.fit(np.concatenate(scores), np.concatenate(used), np.concatenate(valid), bins)


def calibration_of(predictor: Any) -> Calibration | None:
    """The gate calibration a loaded predictor carries (from its checkpoint), if any."""
    return getattr(predictor, "calibration", None)


def write(path: Any, cal: Calibration, about: dict[str, Any]) -> None:
    """Rewrite checkpoint ``path`` atomically with ``cal`` in place of any calibration it held."""
    from moecast.predictors.checkpoint import load_raw, save

    tensors, meta = load_raw(path)
    Calibration.take(tensors, meta)
    tensors.update(cal.tensors())
    meta[META] = {**about, "samples": cal.samples, "bins": int(cal.prob.shape[1])}
    save(path, tensors, meta)
