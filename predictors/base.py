"""Predictor interfaces (docs/design.md, "Predictor interfaces"): every predictor returns expert scores.

Four horizons, one batch entry point for replay and evaluation:

- ``layer-ahead``: knows layer l-1 of the current token (gate input, top-k ids and
  weights, the token) and scores layer l (LLaPor, gate reuse).
- ``token-ahead``: knows the tokens so far and scores every layer of the next token
  (MoE-Beyond-style sequence model).
- ``prompt-ahead``: knows only the prompt and returns an [L, E] plan (EAM, EAP, cascade,
  MoE-Infinity activation-matrix matching).
- ``statistical``: frequency tables (global hot-expert table, per-request counts so far).

``score_request(trace)`` returns [T, L, E] float32 scores where row (t, l) uses only
what that horizon may know when it predicts token t's layer l; the runtime decides
what to fetch from them. Scores are comparable within a row only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
from moecast.collect.traceset import RequestTrace

HORIZONS = ("layer-ahead", "token-ahead", "prompt-ahead", "statistical")


class Predictor(ABC):
    """Base class; subclasses set ``name`` (checkpoint ``kind``) and ``horizon``."""

    name: ClassVar[str]
    horizon: ClassVar[str]
    #: TraceSet fields the predictor reads (checked against a TraceSet before use)
    needs: ClassVar[tuple[str, ...]] = ("topk_ids",)

    num_layers: int
    num_experts: int
    top_k: int
    fingerprint: str | None = None

    @abstractmethod
    def score_request(self, trace: RequestTrace) -> np.ndarray:
        """[T, L, E] float32 scores for every token and MoE layer of one request (causal for the horizon)."""

    @property
    def label(self) -> str:
        """How reports name it: ``name`` unless one kind covers several variants."""
        return self.name

    def metadata(self) -> dict[str, Any]:
        return {"kind": self.name, "horizon": self.horizon, "fingerprint": self.fingerprint}


def topk_from_scores(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores along the last axis (unordered), vectorised."""
    k = min(k, scores.shape[-1])
    return np.argpartition(-scores, k - 1, axis=-1)[..., :k]
