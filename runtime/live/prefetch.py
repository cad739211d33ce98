"""Where the live runtime's prefetch candidates come from, and which predictors it takes for what.

SMoE §IV-C predicts layer l+1's experts online (the next layer's gate on this layer's gate input, the
gate-reuse form of docs/design.md); a layer-ahead predictor (LLaPor) does it from its stream of the
request's routing, and may learn online from each decoded token (PreScope §4.2.2). Under policy static
a frequency predictor is the hot-expert table instead; a prompt-ahead planner (CasMoE) preloads a plan.
:class:`Prefetcher` is the per-runtime source; the functions refuse a predictor given for the wrong job
with one line saying what to do with it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch
from moecast.predictors.base import (
    BatchScorer,
    LayerAhead,
    LayerStream,
    PromptPlanner,
    StreamingPredictor,
)
from moecast.predictors.calibration import Calibration, calibration_of
from moecast.runtime.core.cache import hot_table as hot_table  # the live runtime's import of it
from moecast.runtime.core.gate import layer_probability
from moecast.runtime.core.policy import Policy
from moecast.runtime.core.step import ranked_predictions
from moecast.runtime.live.stats import ForwardTimes

from moecast.errors import InputError


class Prefetcher:
    """Layer ``nxt``'s prefetch candidates for the forward in progress (``mode``: none, online, predictor).

    A layer-ahead predictor's stream keeps the window of finished tokens; it is fed this forward's layers
    while ``streaming`` (a prefill resets it to the prompt, a one-token decode step ends the token before).
    """

    def __init__(
        self,
        mode: str,
        predictor: BatchScorer | None,
        structure: Any,
        num_experts: int,
        top_k: int,
        full: bool,
        calibration: Calibration | None = None,
    ) -> None:
        self.mode, self.structure, self.full = mode, structure, full
        # under the prefetch gate: the checkpoint's calibration, which prices each candidate (gate_calibration)
        self.calibration = calibration
        self.num_layers, self.num_experts, self.top_k = len(structure.layers), num_experts, top_k
        streams = mode == "predictor" and isinstance(predictor, StreamingPredictor)
        self._predictor = predictor if streams else None
        self.stream: LayerStream | None = predictor.stream() if streams else None
        # the step's last gate_rows gate inputs go to the stream with each layer's routing
        self.gate_rows = self.stream.gate_rows if self.stream is not None else 0
        self.streaming = False
        self._thread: ThreadPoolExecutor | None = None  # next_async's: made at its first use
        self._job: Future | None = None  # its last prediction, until a forward starts

    def warm(self) -> None:
        """The layer-ahead predictor's :meth:`~moecast.predictors.base.LayerAhead.warm` (its compiled
        kernels loaded now, at attach, not in the first decode steps)."""
        if isinstance(self._predictor, LayerAhead):
            self._predictor.warm()

    def begin(self, decode: bool, ids: torch.Tensor | None) -> bool:
        """A forward starts; returns whether the stream observes it."""
        self._settle()
        n = ids.numel() if ids is not None else 0
        # a prefill starts the stream's request; a one-token decode step closes the step before it
        # (forwards of several decoded tokens are not predicted, and leave the window as it is)
        self.streaming = self.stream is not None and (not decode or n == 1)
        if self.streaming:
            if decode:
                self.stream.end_token(int(ids.reshape(-1)[-1]))
            else:
                self.stream.reset(ids.detach().reshape(-1).cpu().numpy() if ids is not None else ())
        return self.streaming

    def predicts(self, decode: bool, nxt: int) -> bool:
        """Whether layer ``nxt`` gets a prediction in this forward."""
        return decode and self.mode != "none" and not self.full and nxt < self.num_layers

    def online_scores(self, nxt: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """SMoE §IV-C online prediction on the device: layer ``nxt``'s gate applied to this layer's gate input."""
        router = self.structure.layers[nxt].router
        w = getattr(router, "weight", None)
        if w is None or tuple(w.shape) != (self.num_experts, hidden.shape[-1]):
            return None
        with torch.no_grad():
            logits = torch.nn.functional.linear(hidden.to(w.dtype), w).float()
        return torch.softmax(logits, -1)

    def observe(
        self, pos: int, ids: np.ndarray, w_host: torch.Tensor, hidden: torch.Tensor | None, width: int
    ) -> None:
        """Layer ``pos``'s routing (after substitution) and gate inputs to the predictor's stream."""
        gate = None
        if self.gate_rows and hidden is not None:
            gate = hidden.reshape(-1, width)[-self.gate_rows :].float().numpy()
        self.stream.observe(pos, ids, w_host.float().numpy(), gate)

    def predict_layer_ahead(self, nxt: int) -> np.ndarray:
        """Layer-ahead predictor on the current token: what is known when layer nxt-1 finished."""
        return self.stream.predict_next(nxt)

    def scores(self, nxt: int, online: np.ndarray | None) -> np.ndarray | None:
        """Scores [B, E] of layer ``nxt`` for this forward's tokens (``online``: the next gate's, read
        with this layer's ids)."""
        if self.mode == "online":
            return online
        if self.streaming:
            return self.predict_layer_ahead(nxt)[None, :]
        return None

    def next(
        self, nxt: int, decode: bool, online: np.ndarray | None, times: ForwardTimes
    ) -> tuple[np.ndarray | None, tuple | None]:
        """Layer ``nxt``'s predicted experts: ([1, B * k] each token's top-k, for PreSched's E_next;
        (nxt, [1, M] the prefetch candidates ranked, [1, M] their P(used) under the gate, else None)),
        or Nones where nothing predicts them."""
        if not self.predicts(decode, nxt):
            return None, None
        scores = times.timed("predictor", self.scores, nxt, online)
        return self._ranked(nxt, scores)

    def next_async(
        self, nxt: int, decode: bool, online: np.ndarray | None, times: ForwardTimes
    ) -> Callable[[], tuple[np.ndarray | None, tuple | None]]:
        """:meth:`next` on the prediction thread, started now; the returned call waits for it (that wait
        is the predictor's time in the split) and gives what :meth:`next` gives.

        For an accelerator, whose host launches the layer's experts meanwhile (issue 43: the predictor
        off the critical path). The host is the bottleneck there, so a prediction made on the host's
        own thread after the launch adds its whole time to the layer. On this thread only the part
        that outlasts the launch does: the compiled predictor kernels release the GIL. Nothing feeds
        the stream until the call is joined, so the thread reads it as it stood when started.
        """
        if not self.predicts(decode, nxt):
            return lambda: (None, None)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moecast-predictor")
        job = self._job = self._thread.submit(lambda: self._ranked(nxt, self.scores(nxt, online)))
        return lambda: times.timed("predictor", job.result)

    def _settle(self) -> None:
        """Wait for a prediction still running: a forward cut short by an error never joined its layer's,
        and the next one must not feed or reset the stream while the thread reads it."""
        job, self._job = self._job, None
        if job is not None:
            wait([job])

    def _ranked(self, nxt: int, scores: np.ndarray | None) -> tuple[np.ndarray | None, tuple | None]:
        if scores is None:
            return None, None
        ids, ranked = ranked_predictions(scores, self.top_k)
        cal = self.calibration
        prob = None if cal is None else layer_probability(cal, nxt, scores, ids, ranked)
        return ids, (nxt, ranked, prob)

    def close(self) -> None:
        """End the prediction thread (a detached runtime keeps none)."""
        self._settle()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def learn(self, lr: float) -> float:
        """PreScope §4.2.2: one small step on the token just decoded, whose routing is now known; its loss."""
        return float(self.stream.learn(lr))


def choose_prefetch(given: str, rule: Policy, predictor: BatchScorer | None, table: np.ndarray | None) -> str:
    """The live prefetch source (none, predictor or online) for LiveConfig's ``prefetch`` ``given``.

    ``auto``: a predictor given prefetches, as in the replay; else a policy that prefetches uses the
    next layer's gate. Under static the predictor is the hot-expert table, never a prefetcher."""
    prefetch = given
    if prefetch == "auto":
        if table is not None:
            prefetch = "none"
        elif predictor is not None:
            prefetch = "predictor"
        else:
            prefetch = "online" if rule.prefetches else "none"
    if prefetch == "predictor" and predictor is None:
        raise InputError("prefetch='predictor' needs a predictor checkpoint (predictor=CKPT)")
    if prefetch == "predictor" and table is not None:
        raise InputError(
            f"under policy static {predictor.name} is the hot-expert table, not a "
            "prefetcher; use prefetch auto or none"
        )
    if prefetch == "predictor" and not isinstance(predictor, StreamingPredictor):
        raise InputError(not_a_prefetcher(predictor))
    return prefetch


def gate_calibration(rule: Policy, mode: str, predictor: BatchScorer | None) -> Calibration | None:
    """The calibration a gated policy prices its prefetches with: the predictor checkpoint's
    (``moecast predictors calibrate``); None without the gate or without prefetches."""
    if rule.gate == "none" or mode == "none":
        return None
    cal = calibration_of(predictor) if mode == "predictor" else None
    if cal is None:
        whose = (
            "the online prefetcher has none"
            if predictor is None
            else f"{predictor.name}'s checkpoint has none"
        )
        raise InputError(
            f"policy {rule.name!r} prices each late prefetch with the predictor's calibrated probability of use, "
            f"and {whose}: run `moecast predictors calibrate CKPT --traces DIR` on the checkpoint and pass "
            "predictor=CKPT"
        )
    if cal.prob.shape[0] != predictor.num_layers:
        raise InputError(
            f"{predictor.name}'s gate calibration covers {cal.prob.shape[0]} layers, the predictor "
            f"{predictor.num_layers}; rerun `moecast predictors calibrate` on the checkpoint"
        )
    return cal


def not_a_prefetcher(predictor: BatchScorer) -> str:
    """Why ``predictor`` cannot prefetch in the live runtime, and what to do with it instead."""
    name, horizon = predictor.name, predictor.horizon
    head = f"the live prefetcher needs a layer-ahead predictor (e.g. LLaPor); {name} is {horizon}"
    if horizon == "layer-ahead":
        return f"the live prefetcher drives a layer-ahead predictor through its stream(); {name} has none"
    if horizon == "prompt-ahead" and isinstance(predictor, PromptPlanner):
        return f"{head}: pass it as the planner (planner=CKPT), which preloads its plan before decoding"
    if horizon == "prompt-ahead":
        return f"{head}: {_MATCHES_ROUTING}"
    if horizon == "statistical":
        return f"{head}: under policy=static its table is the hot-expert table"
    return head


# ActivationMatrixPredictor (MoE-Infinity) is prompt-ahead by what it may know, but it matches the
# request's own routing so far rather than the prompt text, so it has nothing to preload live
_MATCHES_ROUTING = (
    "it scores a request by matching the request's own routing so far, not the prompt text, so it has "
    "no plan to preload; evaluate it with `moecast predictors eval` or `moecast replay --predictor CKPT` "
    "(live planners are prompt-ahead checkpoints with a plan: EAM, EAP, cascade, hot)"
)


def check_planner(planner: BatchScorer | None) -> None:
    """Refuse a planner that is no prompt-ahead planner with a plan, saying where it belongs."""
    if planner is not None and (not isinstance(planner, PromptPlanner) or planner.horizon != "prompt-ahead"):
        raise InputError(not_a_planner(planner))


def not_a_planner(planner: BatchScorer) -> str:
    """Why ``planner`` cannot plan in the live runtime, and what to do with it instead."""
    name, horizon = planner.name, planner.horizon
    if horizon == "prompt-ahead":
        return f"planner {name} has no plan(prompt): {_MATCHES_ROUTING}"
    tail = "; pass it as the predictor (predictor=CKPT) to prefetch" if horizon == "layer-ahead" else ""
    return (
        f"planner {name} is {horizon}; a planner must be a prompt-ahead checkpoint with a plan (EAM, EAP, "
        f"cascade, hot){tail}"
    )
