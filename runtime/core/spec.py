"""The runtime's settings, each default written once, and the one function that builds the per-layer
core from them (docs/design.md, "Runtime": one spec).

:class:`RuntimeSpec` holds what the replay and the live runtime share: the policy, the cache capacity,
the hardware profile, alpha, SMoE's score window, the predictor's latency and the slow tier's
precision. ``ReplayConfig`` (and the live runtime's ``LiveConfig``) extend it with what only they
have, and the commands take their defaults from :data:`DEFAULT`. The defaults, and why:

- ``policy = "lru"``: a user's first run must be exact, the model's outputs unchanged (no substitution:
  alpha 0), and must mean the same in both runtimes. LRU with every miss loaded on demand is both: it
  needs no predictor (the prefetching presets' default source differs: the oracle, an upper bound,
  in the replay; the next gate, online, in the live runtime), no router probabilities (``score``,
  ``smoe``) and no hot-expert table (``static``, ``presched``), and it is the baseline every paper
  compares against. The others are one ``--policy`` away.
- ``capacity = 0.25``: a quarter of each layer's experts on the device, the middle of the papers'
  sweeps (SMoE, PreScope) and above top-k on every model moecast knows.
- ``hardware = None``: :func:`moecast.runtime.core.cost_model.default_hardware`, this machine's measured
  ``local`` profile where ``moecast profile`` wrote one, else ``prescope-a100-pcie4``; one profile for
  both runtimes, so one configuration models one machine.
- ``alpha = None``: the policy's (:func:`moecast.runtime.core.policy.resolve_alpha`: 0 unless the policy
  substitutes, then SMoE's ``DEFAULT_ALPHA``).
- ``score_window = 8``: SMoE Eq. 3's ``n``, the steps the ``score`` eviction averages.
- ``predictor_ms = None``: a predictor checkpoint's measured latency, else the profile's
  (:func:`moecast.runtime.core.step.predictor_latency`).
- ``expert_dtype = "model"``, ``group_size = 128``: the model's own precision (exact); int4's group.
  Two copies (``mixed``, ``int8+int4``: :mod:`moecast.runtime.core.mixed`) give the core a
  :class:`~moecast.runtime.core.mixed.Copies`: ``cost`` is the high copy's, ``copies.low`` a demand
  read's.

:func:`build_core` turns a spec into a :class:`Core`: the policy, the hardware profile, the cost model
and the predictor's latency, decided once per run; :meth:`Core.step` then builds the
:class:`~moecast.runtime.core.step.LayerStep` over fresh :class:`~moecast.runtime.core.cache.ExpertCache`
lanes (compiled for one lane and one token: :class:`~moecast.runtime.core.step.OneLane`). The replay and
the live runtime build theirs only through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from moecast.predictors.base import BatchScorer
from moecast.runtime.core import eviction
from moecast.runtime.core.cache import ExpertCache
from moecast.runtime.core.cost_model import CostModel, HardwareProfile, default_hardware, load_profile
from moecast.runtime.core.mixed import Copies, parse_copies, tag_of
from moecast.runtime.core.policy import Policy, get_policy
from moecast.runtime.core.step import LayerStep, predictor_latency

from moecast.errors import InputError


@dataclass
class RuntimeSpec:
    """The settings both runtimes share; see the module docstring for each default and why."""

    policy: str | Policy = "lru"
    capacity: float | str = 0.25
    hardware: str | HardwareProfile | None = None
    alpha: float | None = None
    score_window: int = 8
    predictor_ms: float | None = None
    expert_dtype: str = "model"
    group_size: int = 128

    def rule(self) -> Policy:
        """The policy with its alpha resolved (InputError for an unknown one)."""
        return get_policy(self.policy, self.alpha)

    def profile(self) -> tuple[HardwareProfile, str]:
        """(the hardware profile, where it comes from): the one given, else this machine's, else the default."""
        hw, why = (self.hardware, "given") if self.hardware is not None else default_hardware()
        return (hw if isinstance(hw, HardwareProfile) else load_profile(hw)), why


#: the defaults, where a command's signature reads them (jsonargparse shows a function's defaults)
DEFAULT = RuntimeSpec()


@dataclass
class Core:
    """What a run decides once (:func:`build_core`); :meth:`step` builds its per-layer step."""

    policy: Policy
    profile: HardwareProfile
    hardware_from: str
    cost: CostModel
    num_experts: int
    num_layers: int
    score_window: int
    prefetching: bool  # predictions (or a plan) may insert experts
    predictor_ms: float  # charged before each prefetch may start (0 without a predictor)
    predictor_ms_from: str
    copies: Copies | None = None  # two expert copies: the low one's cost (``cost`` is the high one's)

    def step(
        self,
        capacity: int | np.ndarray,
        stat_base: np.ndarray,
        n_stats: int,
        shared: bool = False,
        compiled: bool = False,
    ) -> LayerStep:
        """The step over ``len(stat_base)`` fresh caches of ``capacity`` experts each (one cache for
        all layers, ``L * E`` items, where ``shared``); see :class:`LayerStep` for the arguments."""
        E, L = self.num_experts, self.num_layers
        # a policy with only a numpy key (no kernel code yet) runs everywhere, uncompiled
        compiled = compiled and eviction.get(self.policy.eviction).code is not None
        cache = ExpertCache(
            L * E if shared else E,
            capacity,
            self.policy.eviction,
            lanes=len(stat_base),
            score_window=self.score_window,
        )
        return LayerStep(
            cache, self.policy, self.cost, E, L, stat_base=stat_base, n_stats=n_stats, shared=shared,
            prefetching=self.prefetching, predictor_ms=self.predictor_ms, compiled=compiled, copies=self.copies,
        )  # fmt: skip


def build_core(
    spec: RuntimeSpec,
    *,
    num_experts: int,
    num_layers: int,
    expert_bytes: int,
    link_bytes: int | None = None,
    low_link_bytes: int | None = None,
    predictor: BatchScorer | None = None,
    prefetching: bool,
    policy: Policy | None = None,
) -> Core:
    """The per-layer core of a run of ``spec`` on a model of ``num_layers`` MoE layers of ``num_experts``
    experts of ``expert_bytes`` (``link_bytes`` on the link where the slow tier is quantized; where
    ``spec.expert_dtype`` names two copies, ``link_bytes`` is the high copy's and ``low_link_bytes``
    the low one's).

    ``prefetching``: predictions or a plan may insert experts; only then is ``predictor``'s latency
    charged. ``policy``: the policy as the runtime runs it, where it adjusts the spec's (the live
    runtime's prefetch source and balancer override); default ``spec.rule()``.
    """
    rule = spec.rule() if policy is None else policy
    profile, why = spec.profile()
    ms, ms_from = predictor_latency(spec.predictor_ms, predictor if prefetching else None, profile)
    copies = None
    pair = parse_copies(spec.expert_dtype, int(spec.group_size))
    if pair is not None:
        if low_link_bytes is None:
            raise InputError(
                f"expert_dtype={spec.expert_dtype!r} names two copies: build_core needs the low copy's bytes "
                "(low_link_bytes=)"
            )
        low = CostModel.from_profile(
            profile, expert_bytes, link_bytes=low_link_bytes, precision=tag_of(*pair[1])
        )
        copies = Copies(tag_of(*pair[0]), tag_of(*pair[1]), low)
    # each copy computes at its own precision's time (cost_model: HardwareProfile.expert_time)
    tag = tag_of(*pair[0]) if pair is not None else tag_of(spec.expert_dtype, int(spec.group_size))
    return Core(
        rule, profile, why, CostModel.from_profile(profile, expert_bytes, link_bytes=link_bytes, precision=tag),
        int(num_experts), int(num_layers), int(spec.score_window), bool(prefetching), ms, ms_from, copies,
    )  # fmt: skip
