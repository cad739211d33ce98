"""A layer-ahead predictor driven layer by layer (PreScope §4.2.1: predict layer l when layer l-1 finishes).

A live runtime sees a token's routing one layer at a time. :class:`TraceWindow` is the
:class:`~moecast.predictors.base.LayerStream` of any
:class:`~moecast.predictors.base.LayerAhead` predictor: it keeps the request's last
``window`` finished tokens (their token ids and every layer's expert ids; the gate inputs
of the last ``gate_tokens`` of them) and the running token's row as it fills, as one
:class:`~moecast.collect.traceset.RequestTrace` that the predictor's ``score_at`` reads.

What a finished token keeps is what the predictors read: no router weights (only the
running token's are features), and gate inputs only for LLaPor's ``context_gate`` tokens.
Once the window is full a decode step shifts it by one row in place, so a step costs a
few row copies, not a rebuild of [window, L, H] gate inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from moecast.collect.traceset import RequestTrace

if TYPE_CHECKING:
    from moecast.predictors.base import LayerAhead


class TraceWindow:
    """:class:`~moecast.predictors.base.OnlineStream` over a layer-ahead predictor's ``score_at``."""

    def __init__(self, predictor: LayerAhead, window: int = 16, gate_width: int = 0, gate_tokens: int = 0):
        if window < 1:
            raise ValueError(f"window must be >= 1 finished tokens, got {window}")
        self.predictor = predictor
        self.window = int(window)
        self.gate_width = int(gate_width)
        self.gate_tokens = min(int(gate_tokens), self.window) if gate_width else 0
        self.reset(())

    # ------------------------------------------------------------------ LayerStream
    def reset(self, prompt: Sequence[int]) -> None:
        self._trace = self._empty(1)
        self._begin(np.asarray(prompt, np.int64).reshape(-1))

    def observe(
        self, layer: int, ids: np.ndarray, weights: np.ndarray | None, gate_input: np.ndarray | None
    ) -> None:
        ids = np.asarray(ids)
        if len(ids) != len(self._ids):
            if len(self._tokens):
                raise ValueError(
                    f"observe: {len(ids)} tokens' ids, but the step runs {len(self._tokens)} tokens"
                )
            self._begin(self._tokens, len(ids))  # a step begun without token ids: its size is seen here
        self._ids[:, layer] = ids
        last = self._trace
        last.topk_ids[-1, layer] = ids[-1]
        if weights is not None:
            last.topk_weights[-1, layer] = np.asarray(weights)[-1]
        if self._gate is not None and gate_input is not None:
            g = np.asarray(gate_input, np.float32)
            self._gate[:, layer] = g[-len(self._gate) :]
            last.gate_inputs[-1, layer] = g[-1]

    def predict_next(self, layer: int) -> np.ndarray:
        return np.asarray(self.predictor.score_at(self._trace, layer))

    def end_token(self, next_token: int) -> None:
        tr = self._trace
        if len(self._ids) == 1 and len(tr) == self.window + 1:
            self._shift(tr)
        else:
            self._trace = self._finished_window()
        self._begin(np.array([next_token], np.int64))

    def learn(self, lr: float) -> float:
        return self.predictor.learn_last(self._trace, lr)

    @property
    def gate_rows(self) -> int:
        return max(1, self.gate_tokens) if self.gate_width else 0

    # ------------------------------------------------------------------ the window
    @property
    def trace(self) -> RequestTrace:
        """The window as the predictor reads it: finished tokens, then the running token's row
        (its later layers still zero). Valid until the next ``end_token``; do not keep it."""
        return self._trace

    def _begin(self, tokens: np.ndarray, n: int | None = None) -> None:
        """A step of ``tokens`` (``n`` of them when their ids are unknown) starts; the window's
        last row becomes its last token."""
        L, k = self.predictor.num_layers, self.predictor.top_k
        n = max(len(tokens) if n is None else n, 1)
        self._tokens = tokens
        self._ids = np.zeros((n, L, k), np.int16)
        keep = max(1, min(n, self.gate_tokens))
        self._gate = np.zeros((keep, L, self.gate_width), np.float32) if self.gate_width else None
        tr = self._trace
        tr.token_ids[-1] = tokens[-1] if len(tokens) else 0
        tr.topk_ids[-1] = 0
        tr.topk_weights[-1] = 0
        if tr.gate_inputs is not None:
            tr.gate_inputs[-1] = 0

    def _finished_window(self) -> RequestTrace:
        """The window after this step's tokens finished, built again (while it fills, or after prefill)."""
        old = self._trace
        fin_ids = np.concatenate([old.topk_ids[:-1], self._ids])[-self.window :]
        fin_tok = np.concatenate([old.token_ids[:-1], self._padded_tokens()])[-self.window :]
        tr = self._empty(len(fin_ids) + 1)
        tr.topk_ids[:-1] = fin_ids
        tr.token_ids[:-1] = fin_tok
        if self.gate_tokens:
            prev = np.concatenate([old.gate_inputs[:-1][-self.gate_tokens :], self._gate])
            prev = prev[-min(self.gate_tokens, len(fin_ids)) :]
            tr.gate_inputs[len(fin_ids) - len(prev) : -1] = prev
        return tr

    def _shift(self, tr: RequestTrace) -> None:
        """A full window after a one-token step: drop the oldest token, the running one becomes finished."""
        for a in (tr.token_ids, tr.topk_ids):
            a[:-1] = a[1:]
        cg = self.gate_tokens
        if cg:
            g = tr.gate_inputs
            g[-cg - 1 : -2] = g[-cg:-1]
            g[-2] = self._gate[-1]

    def _padded_tokens(self) -> np.ndarray:
        """The step's token ids, one per observed row (a step begun without ids counts as token 0)."""
        return self._tokens if len(self._tokens) else np.zeros(len(self._ids), np.int64)

    def _empty(self, t: int) -> RequestTrace:
        L, k = self.predictor.num_layers, self.predictor.top_k
        return RequestTrace(
            request_id="stream",
            workload="stream",
            category="",
            prompt="",
            token_ids=np.zeros(t, np.int64),
            token_texts=[""] * t,
            is_decode=np.ones(t, bool),
            topk_ids=np.zeros((t, L, k), np.int16),
            topk_weights=np.zeros((t, L, k), np.float16),
            router_probs=None,
            gate_inputs=np.zeros((t, L, self.gate_width), np.float32) if self.gate_width else None,
        )
