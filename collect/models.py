"""Loading a Hugging Face MoE causal LM and finding where its routing happens.

transformers 5 gives every MoE family one experts call (docs/design.md, "Where moecast
attaches"): the experts class is decorated with
``transformers.integrations.moe.use_experts_implementation`` and called as
``experts(hidden_states, top_k_index, top_k_weights)`` after the family's router.
A family is supported when the model holds modules of such a class; we find them
by inspecting the model (the decorated ``forward`` is a ``functools.wraps``
wrapper around the class's own and the decorator sets ``has_gate``), never with a
hand-kept list of families. The router (for full probability vectors) is the
class the model names in ``_can_record_outputs["router_logits"]``.

Models outside that interface can still be traced with ``router_pattern``: a
regex over module names whose outputs are router logits (see recorder.py).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moecast.collect.traceset import ModelInfo, model_fingerprint

from moecast.errors import InputError, MoecastError

# config keys that change between saves of the same weights, not the architecture
VOLATILE_CONFIG_KEYS = (
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "_experts_implementation",
    "_experts_implementation_internal",
    "_attn_implementation",
    "_attn_implementation_internal",
    "architectures",
)
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_selected_experts", "top_k", "moe_k")
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|decoder_layers)\.(\d+)(?:\.|$)")


class ModelLoadError(MoecastError):
    """The path or name does not give a usable MoE causal LM."""


@dataclass
class MoELayer:
    """One MoE layer: its model layer index, its experts module and (when found) its router module."""

    layer: int
    experts_name: str
    experts: Any  # torch.nn.Module
    router_name: str | None = None
    router: Any = None  # torch.nn.Module | None


@dataclass
class MoEStructure:
    """Where routing happens in a model, and how its router turns logits into scores."""

    layers: list[MoELayer]
    router_output_index: int = 0
    # "softmax": probabilities over all experts; "sigmoid-normalised": per-expert sigmoid
    # scores (DeepSeek-V3-style routers) divided by their sum so each row is a distribution
    router_probs_kind: str = "softmax"
    pattern: str | None = None  # set when found by --router-pattern instead of the experts interface
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def moe_layers(self) -> list[int]:
        return [entry.layer for entry in self.layers]


def is_experts_module(module: Any) -> bool:
    """True for an instance of a class decorated with ``use_experts_implementation``.

    The decorator replaces ``forward`` with a ``functools.wraps`` wrapper (so it has
    ``__wrapped__``) and sets ``has_gate``/``is_transposed`` in ``__init__``.
    """
    forward = getattr(type(module), "forward", None)
    return (
        hasattr(module, "has_gate")
        and hasattr(module, "is_transposed")
        and hasattr(forward, "__wrapped__")
        and hasattr(module, "config")
    )


def layer_index(name: str) -> int | None:
    """The decoder-layer index in a module name like ``model.layers.7.mlp.experts``."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def _router_recorder(model: Any) -> tuple[type | None, int]:
    recorders = getattr(model, "_can_record_outputs", None) or {}
    rec = recorders.get("router_logits") if isinstance(recorders, dict) else None
    if rec is None:
        return None, 0
    if isinstance(rec, type):
        return rec, 0
    return getattr(rec, "target_class", None), int(getattr(rec, "index", 0) or 0)


def find_moe_structure(model: Any, router_pattern: str | None = None) -> MoEStructure:
    """Find every MoE layer of ``model``: experts modules by the decorator, routers by ``_can_record_outputs``.

    With ``router_pattern`` the routers are the modules whose names match the regex,
    and no experts module is needed (models outside transformers' experts interface).
    """
    named = list(model.named_modules())
    if router_pattern:
        return _pattern_structure(model, named, router_pattern)

    layers = _experts_layers(model, named)
    index = _attach_routers(model, named, layers)
    kind = "softmax"
    # DeepSeek-V3-style routers score experts with a sigmoid plus a selection bias
    if any(hasattr(e.router, "e_score_correction_bias") for e in layers.values()) or (
        getattr(model.config, "scoring_func", "") == "sigmoid"
    ):
        kind = "sigmoid-normalised"
    return MoEStructure(
        layers=[layers[i] for i in sorted(layers)], router_output_index=index, router_probs_kind=kind
    )


def _pattern_structure(model: Any, named: list[tuple[str, Any]], router_pattern: str) -> MoEStructure:
    """The structure whose routers are the modules named by the ``--router-pattern`` regex."""
    try:
        regex = re.compile(router_pattern)
    except re.error as exc:
        raise InputError(f"router_pattern={router_pattern!r} is not a valid regex ({exc})") from exc
    # experts modules, when the model has them, still describe the experts (sizes, shared expert)
    experts = {layer_index(n): (n, m) for n, m in named if is_experts_module(m)}
    layers = []
    for name, module in named:
        if name and regex.search(name):
            idx = layer_index(name)
            idx = idx if idx is not None else len(layers)
            exp_name, exp = experts.get(idx, ("", None))
            layers.append(
                MoELayer(layer=idx, experts_name=exp_name, experts=exp, router_name=name, router=module)
            )
    if not layers:
        raise ModelLoadError(
            f"router_pattern={router_pattern!r} matches no module of {type(model).__name__}; "
            "list the module names with `print(model)` and match the router (gate) modules"
        )
    return MoEStructure(layers=sorted(layers, key=lambda e: e.layer), pattern=router_pattern)


def _experts_layers(model: Any, named: list[tuple[str, Any]]) -> dict[int, MoELayer]:
    """One MoELayer per decoder layer holding an experts module, keyed by layer index (no routers yet)."""
    layers: dict[int, MoELayer] = {}
    for name, module in named:
        if is_experts_module(module):
            idx = layer_index(name)
            if idx is None:
                raise ModelLoadError(
                    f"experts module {name} of {type(model).__name__} is not inside a numbered decoder layer; "
                    "pass router_pattern=REGEX to name its routers"
                )
            if idx in layers:
                raise ModelLoadError(
                    f"{type(model).__name__} has two experts modules in layer {idx} ({layers[idx].experts_name}, {name}); "
                    "pass router_pattern=REGEX to choose the routers"
                )
            layers[idx] = MoELayer(layer=idx, experts_name=name, experts=module)
    if not layers:
        raise ModelLoadError(
            f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}) has no MoE experts module that uses "
            "transformers' experts interface: it is not an MoE model, or pass router_pattern=REGEX naming its routers"
        )
    return layers


def _attach_routers(model: Any, named: list[tuple[str, Any]], layers: dict[int, MoELayer]) -> int:
    """Give each layer its router module; returns the index of the logits in the router's output."""
    router_cls, index = _router_recorder(model)
    if router_cls is not None:
        for name, module in named:
            if isinstance(module, router_cls):
                idx = layer_index(name)
                if idx in layers and layers[idx].router is None:
                    layers[idx].router_name, layers[idx].router = name, module
    if any(e.router is None for e in layers.values()):
        # releases that do not record router_logits for a family (transformers 5.17's DeepSeek-V2/V3)
        _sibling_routers(model, layers)
        index = 0
    return index


def _sibling_routers(model: Any, layers: dict[int, MoELayer]) -> None:
    """Routers found by shape where ``_can_record_outputs`` names none: the module beside the experts
    (same parent) that owns a ``weight`` of shape [num_experts, hidden]. Every release's routers return
    their logits first, so the recorded output index is 0."""
    import torch

    modules = dict(model.named_modules())
    for entry in layers.values():
        if entry.router is not None:
            continue
        parent_name = entry.experts_name.rpartition(".")[0]
        num_experts = int(getattr(entry.experts, "num_experts", 0) or 0)
        for child_name, child in modules[parent_name].named_children():
            weight = getattr(child, "weight", None)
            if child is entry.experts or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            if weight.shape[0] == num_experts:
                entry.router_name, entry.router = f"{parent_name}.{child_name}", child
                break


def _first_attr(obj: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = getattr(obj, key, None)
        if value is not None:
            return value
    return None


def kv_cache(out: Any) -> Any:
    """A forward's KV cache: ``cache`` from transformers 5.2x on, ``past_key_values`` before (the old
    name still reads there, with a FutureWarning, until its removal)."""
    for name in ("cache", "past_key_values"):
        if name in out:
            return out[name]
    return None


@functools.cache
def _cache_keyword(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` to ``model``'s forward: ``cache`` where its signature
    names it (transformers 5.2x), else ``past_key_values``."""
    return {_cache_keyword(type(model).forward): cache}


def config_hash(config: Any) -> str:
    """Hash of ``config.to_dict()`` without keys that change between saves of the same model."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for key in VOLATILE_CONFIG_KEYS:
        data.pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_info(
    model: Any, structure: MoEStructure, name_or_path: str, norm_topk_prob: bool | None = None
) -> ModelInfo:
    """ModelInfo (TraceSet contract) of a loaded model; fingerprint folds in the full config's hash."""
    config = model.config
    first = structure.layers[0]
    num_experts = _first_attr(first.experts, ("num_experts",)) if first.experts is not None else None
    num_experts = num_experts or _first_attr(config, EXPERT_COUNT_KEYS)
    if num_experts is None and first.router is not None:
        num_experts = _first_attr(first.router, ("num_experts", "out_features"))
    top_k = _first_attr(config, TOPK_KEYS) or _first_attr(first.router, ("top_k",))
    if not num_experts or not top_k:
        raise ModelLoadError(
            f"cannot tell the number of experts / top-k of {type(model).__name__} from its config; "
            "it needs one of " + ", ".join(EXPERT_COUNT_KEYS) + " and one of " + ", ".join(TOPK_KEYS)
        )
    shared = getattr(config, "n_shared_experts", None)
    if shared is None:
        block = first.experts_name.rsplit(".", 1)[0] if first.experts_name else ""
        shared = (
            int(any(n.startswith(block + ".shared_expert") for n, _ in model.named_modules())) if block else 0
        )
    expert_bytes = expert_numel = 0
    if first.experts is not None:
        total = sum(p.numel() * p.element_size() for p in first.experts.parameters())
        expert_bytes = total // int(num_experts)
        expert_numel = sum(p.numel() for p in first.experts.parameters()) // int(num_experts)
    if norm_topk_prob is None:
        norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
    info = ModelInfo(
        name_or_path=name_or_path,
        family=str(getattr(config, "model_type", type(model).__name__)),
        moe_layers=structure.moe_layers,
        num_experts=int(num_experts),
        top_k=int(top_k),
        num_shared_experts=int(shared or 0),
        hidden_size=int(config.hidden_size),
        expert_bytes=int(expert_bytes),
        norm_topk_prob=bool(norm_topk_prob),
    )
    # Two models with the same routing shape (e.g. two fine-tunes' configs) must not share a fingerprint.
    info.fingerprint = fingerprint_of(info, config_hash(config), expert_numel)
    return info


def fingerprint_of(info: ModelInfo, cfg_hash: str, expert_numel: int) -> str:
    """The model's fingerprint: its routing shape and config hash. It names the model, not the dtype
    it was loaded in (traces collected in bfloat16 serve a float32 load, as ``moecast run`` makes),
    so the expert size enters as float32 bytes, which is also what every earlier fingerprint used."""
    arch = {**info.architecture(), "expert_bytes": int(expert_numel) * 4}
    return model_fingerprint({**arch, "config": cfg_hash})


def resolve_model_path(model: str) -> tuple[str, Path | str]:
    """(display name, local path or hub id) for ``--model``: ``tiny`` / ``tiny:PRESET`` build the embedded model."""
    if model == "tiny" or model.startswith("tiny:"):
        from moecast.collect.tiny import ensure_tiny

        preset = model.split(":", 1)[1] if ":" in model else "default"
        return model, ensure_tiny(preset)
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{model} is not a Hugging Face model directory (no config.json); pass a folder saved with "
                "save_pretrained, or `tiny`"
            )
        return model, path
    import os

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise ModelLoadError(
            f"model {model!r}: no such local directory and the hub is offline (HF_HUB_OFFLINE); "
            "download it elsewhere and pass its local path, or use `tiny`"
        )
    return model, model


def load_model(model: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False):
    """(model in eval mode, tokenizer, display name) for ``--model``; one-line errors for non-MoE or bad paths."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name, path = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"model {model!r}: cannot read its config ({str(exc).splitlines()[0]})") from exc
    torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype, None)
    if torch_dtype is None:
        raise InputError(f"--dtype {dtype!r} is not a torch dtype; use auto, float32, bfloat16 or float16")
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except ValueError as exc:
        raise ModelLoadError(
            f"model {model!r} ({getattr(config, 'model_type', '?')}) is not a causal LM transformers can load "
            f"({str(exc).splitlines()[0]})"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"model {model!r}: no usable tokenizer beside it ({str(exc).splitlines()[0]})"
        ) from exc
    lm.to(device)
    lm.eval()
    return lm, tokenizer, name
