"""Recording the routing a transformers-5 MoE model actually uses (docs/design.md, "Where moecast attaches").

``RoutingRecorder.attach(model)`` registers ``moecast_record`` in
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` and selects it with
``model.set_experts_implementation``. Every experts call then passes through
:func:`record_experts_forward`, which keeps the ``top_k_index`` / ``top_k_weights``
the family's router produced (exactly what the model uses) and ``hidden_states``
(the router's input, i.e. the gate input), then calls the implementation that was
active before, so the model computes exactly what it computed unattached.
``detach`` restores that implementation.

Full router probabilities come from a forward hook on the router class the model
names in ``_can_record_outputs["router_logits"]``: softmax over all experts, or, for
sigmoid-scored routers (DeepSeek-V3), the sigmoid scores divided by their sum.

For models outside the experts interface (``router_pattern``) the hooks sit on the
named router modules and the top-k is taken from their logits (softmax, top-k,
renormalised when ``norm_topk_prob``); that equals the model's routing only for
plain softmax-top-k routers, and the TraceSet meta says it was derived this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from moecast.collect.models import MoEStructure

from moecast.errors import MoecastError

RECORD_IMPL = "moecast_record"


@dataclass
class StepRouting:
    """Routing of one forward pass, tokens in the flattened (batch, sequence) order the model used."""

    topk_ids: torch.Tensor  # [N, L, k] int64
    topk_weights: torch.Tensor  # [N, L, k] float32
    router_probs: torch.Tensor | None  # [N, L, E] float32
    gate_inputs: torch.Tensor | None  # [N, L, H] model dtype


def call_experts_impl(name: str | None, module: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``module``'s experts with implementation ``name`` (``eager``/None: the class's own forward)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = type(module).forward.__wrapped__
    if name is None or name == "eager":
        return original(module, *args, **kwargs)
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, original)(module, *args, **kwargs)


def record_experts_forward(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """The ``moecast_record`` experts implementation: note the routing, then run the wrapped implementation."""
    state = module.__dict__.get("_moecast_record")
    if state is None:
        # selected on a module we did not attach to (e.g. a second model sharing the config): do not record
        return call_experts_impl("grouped_mm", module, hidden_states, top_k_index, top_k_weights, **kwargs)
    recorder, pos, previous = state
    recorder._ids[pos] = top_k_index
    recorder._weights[pos] = top_k_weights
    if recorder.gate_inputs:
        recorder._gates[pos] = hidden_states
    return call_experts_impl(previous, module, hidden_states, top_k_index, top_k_weights, **kwargs)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if RECORD_IMPL not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS[RECORD_IMPL] = record_experts_forward


class RoutingRecorder:
    """Attach to a model, run forwards, ``take()`` each forward's routing; ``detach`` restores the model.

    Usable as a context manager. Recording stores references to the tensors the
    model produced (no copies on the hot path); ``take`` stacks them once per forward.
    """

    def __init__(
        self,
        structure: MoEStructure,
        top_k: int,
        router_probs: bool = True,
        gate_inputs: bool = False,
        norm_topk_prob: bool = False,
    ) -> None:
        self.structure = structure
        self.top_k = top_k
        self.router_probs = router_probs
        self.gate_inputs = gate_inputs
        self.norm_topk_prob = norm_topk_prob
        self._model: Any = None
        self._previous: dict[str, str | None] | None = None
        self._hooks: list[Any] = []
        self._reset()

    @property
    def num_layers(self) -> int:
        return len(self.structure.layers)

    def _reset(self) -> None:
        L = self.num_layers
        self._ids: list[torch.Tensor | None] = [None] * L
        self._weights: list[torch.Tensor | None] = [None] * L
        self._gates: list[torch.Tensor | None] = [None] * L
        self._logits: list[torch.Tensor | None] = [None] * L

    # ------------------------------------------------------------------ attach / detach
    def attach(self, model: Any) -> RoutingRecorder:
        if self._model is not None:
            raise MoecastError("this recorder is already attached; detach it first")
        self._model = model
        if self.structure.pattern is None:
            if model.config._experts_implementation == RECORD_IMPL:
                self._model = None
                raise MoecastError(
                    f"{type(model).__name__} is already being recorded by another recorder; detach that one first"
                )
            _register()
            for pos, entry in enumerate(self.structure.layers):
                previous = entry.experts.config._experts_implementation
                entry.experts.__dict__["_moecast_record"] = (self, pos, previous)
            self._previous = model.get_experts_implementation()
            model.set_experts_implementation(RECORD_IMPL)
            stuck = [
                e.experts_name
                for e in self.structure.layers
                if e.experts.config._experts_implementation != RECORD_IMPL
            ]
            if stuck:
                self.detach()
                raise MoecastError(
                    f"{type(model).__name__} did not accept a custom experts implementation (module {stuck[0]}); "
                    "pass --router-pattern REGEX naming its router modules instead"
                )
            if self.router_probs:
                for pos, entry in enumerate(self.structure.layers):
                    if entry.router is None:
                        self.detach()
                        raise MoecastError(
                            f"no router module found for MoE layer {entry.layer} of {type(model).__name__}; "
                            "collect without router probabilities (--router-probs false)"
                        )
                    self._hooks.append(entry.router.register_forward_hook(self._logits_hook(pos)))
        else:
            for pos, entry in enumerate(self.structure.layers):
                self._hooks.append(entry.router.register_forward_hook(self._pattern_hook(pos)))
        return self

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._model is None:
            return
        if self.structure.pattern is None:
            if self._previous is not None:
                self._model.set_experts_implementation(self._previous)
            for entry in self.structure.layers:
                entry.experts.__dict__.pop("_moecast_record", None)
        self._model = None
        self._previous = None
        self._reset()

    def __enter__(self) -> RoutingRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # ------------------------------------------------------------------ hooks
    def _logits_hook(self, pos: int):
        index = self.structure.router_output_index

        def hook(module: Any, args: Any, output: Any) -> None:
            self._logits[pos] = output[index] if isinstance(output, tuple) else output

        return hook

    def _pattern_hook(self, pos: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            logits = logits.reshape(-1, logits.shape[-1])
            probs = torch.softmax(logits.float(), dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            self._ids[pos], self._weights[pos], self._logits[pos] = ids, weights, logits
            if self.gate_inputs:
                x = args[0]
                self._gates[pos] = x.reshape(-1, x.shape[-1])

        return hook

    # ------------------------------------------------------------------ results
    def take(self) -> StepRouting:
        """Stack what the last forward recorded ([tokens, layers, ...]) and clear it."""
        missing = [self.structure.layers[i].layer for i, t in enumerate(self._ids) if t is None]
        if missing:
            self._reset()
            raise MoecastError(
                f"the forward pass did not route through MoE layer(s) {missing}; the model skipped its experts "
                "(is the recorder attached to this model?)"
            )
        ids = torch.stack([t.reshape(-1, t.shape[-1]) for t in self._ids], dim=1)
        weights = torch.stack([t.reshape(-1, t.shape[-1]).float() for t in self._weights], dim=1)
        probs = None
        if self.router_probs and any(t is None for t in self._logits):
            self._reset()
            raise MoecastError(
                "the routers' forward hooks did not fire (the model routes through another module); "
                "collect with --router-probs false or name the routers with --router-pattern"
            )
        if self.router_probs:
            logits = torch.stack([t.reshape(-1, t.shape[-1]).float() for t in self._logits], dim=1)
            if self.structure.router_probs_kind == "sigmoid-normalised":
                scores = torch.sigmoid(logits)
                probs = scores / scores.sum(-1, keepdim=True)
            else:
                probs = torch.softmax(logits, dim=-1)
        gates = torch.stack(self._gates, dim=1) if self.gate_inputs else None
        self._reset()
        return StepRouting(topk_ids=ids, topk_weights=weights, router_probs=probs, gate_inputs=gates)
