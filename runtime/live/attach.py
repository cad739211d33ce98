"""Where the live runtime meets the model: the ``moecast_live`` experts implementation, the hooks, attach.

docs/design.md, "Where moecast attaches": every transformers-5 MoE family calls
``experts(hidden_states, top_k_index, top_k_weights)`` after its router; :func:`attach` registers
:func:`live_experts_forward` in ``ALL_EXPERTS_FUNCTIONS`` and selects it, a forward hook on each router
keeps its logits, and hooks around the model's forward start and end each step.
:meth:`Attachment.remove` (``rt.detach()``) restores the implementation the model had.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from moecast.collect.models import find_moe_structure, model_info
from moecast.predictors.base import BatchScorer, LearningPlanner, StreamingPredictor
from moecast.runtime.live.config import LiveConfig, live_config
from moecast.runtime.live.pairs import sums_over_top_k
from moecast.runtime.live.prefetch import check_planner
from moecast.runtime.tiers.precision import experts_call

from moecast.errors import InputError, MoecastError

if TYPE_CHECKING:
    from moecast.runtime.live.runtime import LiveRuntime

LIVE_IMPL = "moecast_live"

# experts module -> (runtime, layer position); kept outside the module so attaching leaves no trace on it
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _resolve_impl(name: str | None, module: Any):
    """The experts function ``name`` selects for ``module`` (``eager``/None: the class's own forward)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = type(module).forward.__wrapped__
    if name is None or name == "eager":
        return original
    if name == LIVE_IMPL:
        raise MoecastError("the live runtime is already attached to this model; detach it first")
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, original)


def live_experts_forward(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """The ``moecast_live`` experts implementation registered in transformers' ALL_EXPERTS_FUNCTIONS."""
    entry = _ATTACHED.get(module)
    if entry is None:
        # a model that shares the config but was not attached: plain default path
        return _resolve_impl("grouped_mm", module)(
            module, hidden_states, top_k_index, top_k_weights, **kwargs
        )
    runtime, pos = entry
    # the layer's wall time and the transfer waits in it, for the decode step's breakdown
    with runtime.times.layer():
        return runtime.forward_layer(pos, module, hidden_states, top_k_index, top_k_weights, **kwargs)


class Attachment:
    """The runtime's hold on the model: its experts implementation selected, and the hooks."""

    def __init__(self, rt: LiveRuntime) -> None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        self.rt, self.model, layers = rt, rt.model, rt.structure.layers
        self.hooks: list[Any] = []
        self.previous: dict[str, Any] | None = None
        if LIVE_IMPL not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS[LIVE_IMPL] = live_experts_forward
        for entry in layers:
            if entry.experts in _ATTACHED:
                raise MoecastError(
                    f"{entry.experts_name} already has the live runtime attached; detach it first"
                )
        missing = [e.layer for e in layers if e.router is None]
        if missing:
            raise MoecastError(
                f"no router module found for MoE layer(s) {missing} of {type(self.model).__name__}: the live runtime "
                "needs router probabilities (the class in _can_record_outputs['router_logits'])"
            )
        impls = [_resolve_impl(e.experts.config._experts_implementation, e.experts) for e in layers]
        # two copies: each slot computes at the copy it holds; one quantized precision: the slots hold
        # packed weights, which the precision's kernels compute, or (an accelerator) dequantized ones
        if rt.copies is not None:
            impls = rt.copies.impls(impls)
        elif rt.config.precision.quantized:
            impls = [experts_call(rt.config.precision, st, impl) for st, impl in zip(rt.stores, impls)]
        rt.executor.impls = impls
        # several calls of a layer combine their pairs as the model's implementation would (pairs.py); a
        # quantized slot computes with other kernels, whose sums exactness does not concern
        names = {e.experts.config._experts_implementation for e in layers}
        exact = rt.copies is None and not rt.config.precision.quantized
        rt.executor.exact = exact and all(sums_over_top_k(name) for name in names)
        self.previous = self.model.get_experts_implementation()
        for pos, entry in enumerate(layers):
            _ATTACHED[entry.experts] = (rt, pos)
        self.model.set_experts_implementation(LIVE_IMPL)
        stuck = [e.experts_name for e in layers if e.experts.config._experts_implementation != LIVE_IMPL]
        if stuck:
            self.remove()
            raise MoecastError(
                f"{type(self.model).__name__} did not accept a custom experts implementation ({stuck[0]})"
            )
        index = rt.structure.router_output_index
        for pos, entry in enumerate(layers):
            self.hooks.append(entry.router.register_forward_hook(self._logits_hook(pos, index)))
        self.hooks.append(self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self.hooks.append(self.model.register_forward_hook(self._post_forward))

    def remove(self) -> None:
        """Restore the experts implementation the model had and remove every hook."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.previous is not None:
            self.model.set_experts_implementation(self.previous)
            self.previous = None
        for entry in self.rt.structure.layers:
            if _ATTACHED.get(entry.experts, (None,))[0] is self.rt:
                del _ATTACHED[entry.experts]

    def _logits_hook(self, pos: int, index: int):
        logits = self.rt.router_logits

        def hook(module: Any, args: Any, output: Any) -> None:
            logits[pos] = output[index] if isinstance(output, tuple) else output

        return hook

    def _pre_forward(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        seq = ids.shape[-1] if ids is not None else (emb.shape[1] if emb is not None else 2)
        # one new token per sequence with a cache = a decode step (SMoE's TPOT is measured on these);
        # a one-token prompt is a prefill, as the replay's traces mark it
        self.rt.begin_forward(ids, seq == 1 and _continues(kwargs))

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        self.rt.end_forward()


def _continues(kwargs: dict[str, Any]) -> bool:
    """Whether a forward continues a sequence: its KV cache already holds tokens (transformers passes
    an empty cache object to a generation's first forward), or its cache positions start past 0."""
    for name in ("past_key_values", "cache", "cache_params"):
        cache = kwargs.get(name)
        if cache is not None:
            length = getattr(cache, "get_seq_length", None)
            return length() > 0 if callable(length) else len(cache) > 0
    pos = kwargs.get("cache_position")
    return pos is not None and pos.numel() > 0 and int(pos.reshape(-1)[0]) > 0


def check_learning(predictor: Any, planner: Any, online_update: bool, learn_plans: bool) -> None:
    """Refuse online learning a checkpoint cannot do: PreScope's online update needs a layer-ahead
    predictor with an update step, CasMoE's buffer a planner with one (what ``moecast run`` checks before
    it loads the model, and ``attach`` again)."""
    if online_update and not (isinstance(predictor, StreamingPredictor) and predictor.learns_online):
        raise InputError("online_update=True needs a layer-ahead predictor with an update step (LLaPor)")
    if learn_plans and not isinstance(planner, LearningPlanner):
        given = "none was given" if planner is None else f"{planner.name} has no buffer"
        raise InputError(
            f"learn_plans=True needs a planner with a buffer (an EAM or cascade checkpoint); {given}"
        )


def _check_fits(pred: Any, role: str, what_to_do: str, info: Any) -> None:
    """Refuse a predictor or planner of another model: its fingerprint where it has one, and always its
    shape (MoE layers, experts, top-k), which a predictor without a fingerprint would otherwise carry
    into the first forward as a broadcast error, the model still attached."""
    fp = info.fingerprint
    if pred.fingerprint and pred.fingerprint != fp:
        raise InputError(
            f"the {role} was made for model fingerprint {pred.fingerprint}, this model is {fp}; {what_to_do}"
        )
    have = (pred.num_layers, pred.num_experts, pred.top_k)
    want = (info.num_layers, info.num_experts, info.top_k)
    if tuple(int(x) for x in have) != want:
        raise InputError(
            f"the {role} {pred.name} scores {have[0]} MoE layers of {have[1]} experts, top-{have[2]}; this model "
            f"has {want[0]} of {want[1]}, top-{want[2]}: {what_to_do}"
        )


def attach(
    model: Any,
    config: LiveConfig | None = None,
    *,
    predictor: BatchScorer | None = None,
    planner: BatchScorer | None = None,
    router_pattern: str | None = None,
    **settings: Any,
) -> LiveRuntime:
    """Attach the live runtime to a transformers MoE model in one call; ``rt.detach()`` undoes it.

    ``attach(model, policy="smoe", capacity=0.25)``: the settings are :class:`LiveConfig`'s fields,
    given as one ``config`` or as keywords (keywords override a given config's fields).

    Args:
        model: A loaded transformers causal LM of a family using the experts interface.
        config: What the runtime does (:class:`LiveConfig`); None: its defaults and ``settings``.
        predictor: A layer-ahead predictor (``moecast.predictors.registry.load(ckpt, fingerprint)``) for prefetch;
            under ``static``, a predictor with an [L, E] score ``table`` (frequency): each layer pins its
            top-capacity experts, as the replay's static table does; under a gated policy (prefetch-gated), one whose
            checkpoint carries the gate's calibration (``moecast predictors calibrate``).
        planner: A prompt-ahead predictor (EAM, EAP, cascade); ``rt.plan(prompt)`` then preloads its plan.
        router_pattern: A regex over module names naming the routers, where a model's routers are not
            found by transformers' ``_can_record_outputs`` (its experts modules must still use the
            experts interface: the runtime computes through them).
        settings: :class:`LiveConfig` fields by name.
    Errors (nothing is changed on the model): unsupported family, capacity below top-k, alpha outside [0, 1)
    or given to a policy that does not substitute, a predictor for another model or of the wrong kind.
    """
    cfg = live_config(config, settings)
    check_learning(predictor, planner, cfg.online_update, cfg.learn_plans)
    structure = find_moe_structure(model, router_pattern)
    without = [e.router_name for e in structure.layers if e.experts is None]
    if without:
        raise InputError(
            f"router_pattern={router_pattern!r} names routers with no experts module of transformers' experts "
            f"interface in their layer ({without[0]}); the live runtime computes through that module"
        )
    if predictor is not None or planner is not None:
        info = model_info(model, structure, "")
        if predictor is not None:
            _check_fits(predictor, "predictor", "train one on traces of this model", info)
        if planner is not None:
            check_planner(planner)
            _check_fits(planner, "planner", "build one on traces of this model", info)
    from moecast.runtime.live.runtime import LiveRuntime  # it imports this module for its hooks

    rt = LiveRuntime(model, structure, cfg, predictor, planner)
    try:
        rt.attachment = Attachment(rt)
    except BaseException:
        rt.detach()  # the tier gives the model back what it took
        raise
    return rt
