"""The prefetch gate: a prefetch that makes the link late pays for its bytes.

**Calibration.** A predictor's scores rank experts; the gate needs the probability that a predicted
expert is used. :class:`~moecast.predictors.calibration.Calibration` maps them by histogram binning
(Zadrozny & Elkan, ICML 2001, Sec. 3; the binning and the scores it reads are
:mod:`moecast.predictors.calibration`'s), fitted per MoE layer on the TraceSet's val side of the
predictor's split (tune on val, report test). Where it comes from: ``moecast predictors calibrate``
fits it once and writes it into the predictor's checkpoint; the live runtime reads it from there
(a gated policy without one is refused at attach), and the replay uses it too, else fits the same
calibration on the replayed TraceSet's val side (or ``calibrate_on``) itself. Both runtimes map a
prediction's normalised score through it, the replay for every (token, layer) at once, the live
runtime for the layer it prefetches.

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

import numpy as np
from moecast.predictors.base import normalised
from moecast.predictors.calibration import Calibration as Calibration  # the runtimes' import of it


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


def layer_probability(
    cal: Calibration, layer: int, scores: np.ndarray, ids: np.ndarray, ranked: np.ndarray
) -> np.ndarray:
    """[1, M] P(used) of one step's ``ranked`` prefetch candidates for ``layer``, from its B tokens'
    [B, E] scores of that layer and their [1, B * k] predicted ids (each token's top-k, in token
    order), as the replay has it: each prediction's normalised score through ``cal``, then
    :func:`candidate_probability`."""
    s = normalised(scores).reshape(-1, np.shape(scores)[-1])
    if len(s) == 1 and ranked.shape[1] == ids.shape[1]:
        # one token (a decode step): its top-k are the candidates, each predicted once, so each one's
        # P(used) is its own prediction's, as 1 - (1 - p) (candidate_probability's arithmetic, to the bit)
        r = ranked[0]
        p = cal.at(layer, s[0][np.maximum(r, 0)])
        return np.where(r >= 0, 1.0 - (1.0 - p), 0.0)[None]
    sc = np.take_along_axis(s, ids.reshape(len(s), -1), 1).reshape(1, -1)
    return candidate_probability(ranked, ids, cal.at(layer, sc))
