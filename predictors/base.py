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

What a caller may ask of a predictor is said by protocols, not found by probing it:

- :class:`BatchScorer`: every predictor; ``score_request`` over a recorded request
  (replay, evaluation).
- :class:`StreamingPredictor`: a layer-ahead predictor whose ``stream()`` gives a
  :class:`LayerStream`, which owns the window of finished tokens a live runtime feeds
  layer by layer (reset on the prompt, observe each layer, predict the next, end the
  token); with ``learns_online`` it also takes PreScope's online step (:class:`OnlineStream`).
- :class:`PromptPlanner`: a prompt-ahead planner; ``plan(prompt)`` before decoding, and
  :class:`LearningPlanner` when served prompts can be folded in (CasMoE's buffer).
- :class:`HotTable`: a predictor with an expert score ``table`` (frequency), policy static's hot-expert table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
from moecast.collect.traceset import RequestTrace

if TYPE_CHECKING:
    from moecast.predictors.calibration import Calibration
    from moecast.predictors.layer_stream import TraceWindow

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
    #: the prefetch gate's calibration its checkpoint carries (moecast.predictors.calibration), if any
    calibration: Calibration | None = None

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


def top_predictions(scores: np.ndarray, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, L, E] scores -> (ids [T, L, kp] best first, their scores) for compact storage."""
    kp = min(kp, scores.shape[-1])
    part = np.argpartition(-scores, kp - 1, axis=-1)[..., :kp]
    sc = np.take_along_axis(scores, part, -1)
    order = np.argsort(-sc, axis=-1, kind="stable")
    return np.take_along_axis(part, order, -1), np.take_along_axis(sc, order, -1)


def normalised(scores: np.ndarray) -> np.ndarray:
    """Scores as the runtimes rank and calibrate them: float32, each row divided by its largest
    magnitude (scores are comparable within a row only)."""
    s = np.asarray(scores, dtype=np.float32)
    return s / np.maximum(np.abs(s).max(-1, keepdims=True), 1e-12)


@runtime_checkable
class BatchScorer(Protocol):
    """Scores every token and layer of a recorded request (what replay and evaluation call)."""

    name: str
    horizon: str
    needs: tuple[str, ...]
    num_layers: int
    num_experts: int
    top_k: int
    fingerprint: str | None

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        """[T, L, E] float32 scores, row (t, l) causal for the predictor's horizon."""
        ...

    def metadata(self) -> dict[str, Any]:
        """What its checkpoint says of it: ``kind``, ``horizon``, ``fingerprint``, and where measured,
        ``predictor_ms`` (its latency per layer, which the runtime charges before a prefetch)."""
        ...


@runtime_checkable
class LayerStream(Protocol):
    """Layer-ahead prediction fed one layer at a time, as a model runs; it keeps its own window.

    A request starts with ``reset(prompt)``: the prompt's token ids are the first step's
    tokens (prefill). Each layer that runs is reported with ``observe``; between layers
    ``predict_next(layer)`` scores layer ``layer`` for the step's last token from what the
    earlier layers showed. ``end_token(next_token)`` closes the step: its tokens join the
    window of finished tokens, and ``next_token`` is the token the next step runs (decode).
    ``gate_rows`` says how many of a step's last tokens' gate inputs ``observe`` reads, so a
    caller converts no more rows than that (0: it reads none; pass None).
    """

    gate_rows: int

    def reset(self, prompt: Sequence[int]) -> None:
        """Forget the previous request; ``prompt`` (token ids) runs next."""
        ...

    def observe(
        self, layer: int, ids: np.ndarray, weights: np.ndarray | None, gate_input: np.ndarray | None
    ) -> None:
        """Layer ``layer`` ran for the step's n tokens: its top-k ids [n, k], router weights
        [n, k] and gate inputs (the router's input) of the step's last m tokens [m, H], at least
        ``min(n, gate_rows)`` of them (None when not recorded)."""
        ...

    def predict_next(self, layer: int) -> np.ndarray:
        """[E] scores of layer ``layer``'s experts for the step's last token (layers below it observed)."""
        ...

    def end_token(self, next_token: int) -> None:
        """The step is done; ``next_token`` is the token id the next step runs."""
        ...


@runtime_checkable
class OnlineStream(LayerStream, Protocol):
    """A stream whose predictor learns from what it just saw (PreScope §4.2.2, online updates)."""

    def learn(self, lr: float) -> float:
        """One update step on the step's last token, all of whose layers were observed; the loss."""
        ...


@runtime_checkable
class StreamingPredictor(BatchScorer, Protocol):
    """A layer-ahead predictor a live runtime drives through a :class:`LayerStream`."""

    #: ``stream()`` gives an :class:`OnlineStream` (the predictor has an online update step)
    learns_online: bool

    def stream(self) -> LayerStream:
        """A fresh stream with its own window (one per running request)."""
        ...


@runtime_checkable
class PromptPlanner(BatchScorer, Protocol):
    """A prompt-ahead planner: one [L, E] plan per request, made from the prompt before decoding."""

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        """([L, E] plan, which planner answered: eam, eap, ...)."""
        ...


@runtime_checkable
class LearningPlanner(PromptPlanner, Protocol):
    """A planner that takes served prompts and their expert pattern (CasMoE's EAM buffer)."""

    def observe(self, prompt: str, ep: np.ndarray) -> bool:
        """Keep (prompt, EP [L, E]); True when this folded the buffer into the planner."""
        ...


@runtime_checkable
class HotTable(Protocol):
    """A predictor carrying an expert score ``table`` (a frequency checkpoint's [L, E]): under policy
    static the live runtime pins each layer's top experts by it."""

    name: str
    table: np.ndarray


class LayerAhead(Predictor):
    """Base of the layer-ahead predictors: a batch scorer that also streams (:class:`StreamingPredictor`).

    ``score_at(trace, layer)`` scores the trace's last token at ``layer``; the default takes
    that row of ``score_request`` and a predictor with a cheaper per-layer path overrides it.
    ``stream()`` wraps the predictor in a :class:`~moecast.predictors.layer_stream.TraceWindow`
    that reads ``gate_width`` (0: no gate inputs) and ``gate_tokens`` (finished tokens whose
    gate inputs the features read).
    """

    horizon: ClassVar[str] = "layer-ahead"
    learns_online: ClassVar[bool] = False
    window: ClassVar[int] = 16  # finished tokens the stream keeps: the history features read fewer

    @property
    def gate_width(self) -> int:
        return 0

    @property
    def gate_tokens(self) -> int:
        return 0

    def score_at(self, trace: RequestTrace, layer: int) -> np.ndarray:
        """[E] scores of ``layer`` for the last token of ``trace``."""
        return self.score_request(trace)[-1, layer]

    def warm(self) -> None:
        """Load what the first :meth:`score_at` calls would (compiled kernels); the live runtime calls it
        at attach, so the first decode steps do not pay for it. Leaves the predictor as it was."""

    def learn_last(self, trace: RequestTrace, lr: float) -> float:
        """One online step on the last token of ``trace`` (its routing complete); predictors with
        ``learns_online`` implement it."""
        raise NotImplementedError(f"{self.name} has no online update")

    def stream(self) -> TraceWindow:
        from moecast.predictors.layer_stream import TraceWindow

        return TraceWindow(self, self.window, self.gate_width, self.gate_tokens)
