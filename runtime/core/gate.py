"""The prefetch gate: a prefetch that makes the link late pays for its bytes.

**Calibration.** A predictor's scores rank experts; the gate needs the probability that a predicted
expert is used. :class:`Calibration` maps them by histogram binning (Zadrozny & Elkan, "Obtaining
calibrated probability estimates from decision trees and naive Bayesian classifiers", ICML 2001,
Sec. 3): per MoE layer, the predictions of a held-out set (the TraceSet's val side of the
predictor's split: tune on val, report test) are cut into ``bins`` bins of equal count by their
score, and a bin's probability is the share of its predictions whose expert the token's router
chose at that layer (label: the predicted id is in the token's top-k there). A score falls in bin
``b`` when ``edge[b-1] <= score < edge[b]`` (the inner edges are the score quantiles ``1/bins ..
(bins-1)/bins``; equal quantiles merge, so a layer may have fewer bins). A bin no val prediction
fell in takes the layer's overall rate. The scores are the replay's: each (token, layer)'s scores
divided by their largest magnitude, top-k kept (:func:`moecast.runtime.core.prefetch.top_predictions`).

A prefetch candidate of a step with B tokens is used when any token that predicted it uses it;
taking the tokens as independent, ``p = 1 - prod_b (1 - p_b)`` (:func:`candidate_probability`;
at B = 1 the token's own ``p``).

**The break-even rule** (:func:`pays`). A prefetch that lands inside the link window the previous
layer left free costs no time: nothing else would use the link then. One that ends ``d`` past the
window delays the layer's demand loads by ``d`` (:mod:`moecast.runtime.core.step`, step 1:
``delay``; under late_prefetch its expert computes no sooner than ``d + t_g``, ``stall``). If its
expert is used (probability ``p``) it spares the demand read the miss would have taken, ``S`` =
``t_io`` of the copy a miss reads; if not, it spares nothing. The layer's link time changes, in
expectation, by ``d - p S``: start it only when ``p S > d``. Over the precisions ``x`` it could move
(:mod:`moecast.runtime.core.mixed`), ``d_x = pos + t_x - free`` (``pos``: the link time the
prefetches before it took in the window), and the one chosen maximises ``p S - d_x`` (ties to the
higher precision). Consequences:

- a prefetch wholly past the window has ``d_x >= t_x >= S`` at one precision (and under mixed
  ``S = t_lo <= t_x``), so with ``p <= 1`` it never pays: at most one per layer passes, the one the
  window cuts, as late_prefetch's one;
- PreSched's extra transfer (Premise 3: started, never interrupted, not resident for this layer)
  spares no read of this layer (``S = 0``), so the gate never starts it;
- at ``p = 1`` (the oracle) a late prefetch passes whenever any part of it overlaps the window.

``S`` is the demand load's link time also under a balancer that would compute the miss on the
CPU (smoe): the gate then overrates a prefetch's saving, never the link time it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moecast.errors import InputError

#: bins per layer of the calibration
BINS = 10


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
            b = np.searchsorted(self.edges[layer], scores[:, layer].astype(np.float64), side="right")
            out[:, layer] = self.prob[layer][b]
        return out


def used_labels(pred_ids: np.ndarray, topk_ids: np.ndarray) -> np.ndarray:
    """[T, L, kp] whether each predicted id is among the token's routed [T, L, k] at its layer."""
    return (pred_ids[..., :, None] == topk_ids[..., None, :]).any(-1) & (pred_ids >= 0)


def candidate_probability(ranked: np.ndarray, ids: np.ndarray, prob: np.ndarray) -> np.ndarray:
    """[n, M] P(used) of each ranked candidate from the [n, P] per-token predictions ``ids`` with
    their ``prob``: ``1 - prod (1 - p)`` over the predictions of that id (0 for padding)."""
    eq = (ranked[:, :, None] == ids[:, None, :]) & (ranked >= 0)[:, :, None]
    miss = np.where(eq, 1.0 - prob[:, None, :], 1.0).prod(2)
    return np.where(ranked >= 0, 1.0 - miss, 0.0)


def pays(p: np.ndarray, save: np.ndarray | float, late_by: np.ndarray) -> np.ndarray:
    """The break-even rule: a prefetch ending ``late_by`` ms past its window is worth starting when
    ``p * save > late_by`` (``save``: the demand read its use spares)."""
    return p * save - late_by > 0
