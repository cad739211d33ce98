"""The live runtime: SMoE's importance-driven expert scheduling inside a Hugging Face MoE model.

``rt = attach(model, policy="smoe", capacity=0.25, alpha=0.3)`` replaces the model's
experts call (docs/design.md, "Where moecast attaches": every transformers-5 MoE family calls
``experts(hidden_states, top_k_index, top_k_weights)`` after its router) with
``moecast_live``. Per MoE layer and forward pass, following SMoE §IV-V (Fig. 9):

1. router probabilities come from a forward hook on the model's router class
   (``_can_record_outputs["router_logits"]``), softmaxed (sigmoid-normalised for
   DeepSeek-V3-style routers);
2-4. the decisions are the replay's per-layer step (:class:`moecast.runtime.core.step.LayerStep`,
   one lane per layer, under a :class:`moecast.runtime.core.policy.Policy`): in decode steps the
   expert-cache router (SMoE Algorithm 1) substitutes low-score experts that are not resident,
   the cache (:class:`moecast.runtime.core.cache.ExpertCache`) says what is resident, the balancer
   splits the misses into loads and a CPU set (SMoE Algorithm 2, PreScope's PreSched, or every
   miss loaded; prefill loads every miss, SMoE §4.1), and the layer's modeled time comes from the
   step's formula on its link clock. The runtime then moves real weights: loads into the slots
   the cache freed (:mod:`moecast.runtime.tiers.expert_store`), resident experts computed from their
   slots, the CPU set from host memory;
5. prefetch for the next layer: the next layer's gate applied to this layer's gate input
   (SMoE §IV-C online prediction, without the next layer's attention: the gate-reuse
   form of docs/design.md) or a layer-ahead predictor checkpoint (LLaPor) ranks the
   candidates; the step lands those that fit in the link window the layer leaves (after the
   predictor's latency), and only those are copied into slots: a late prefetch is no hit.

With ``alpha = 0`` the routing is untouched and every expert is computed exactly as the
wrapped implementation computes it (the same function runs on the slot buffers), so the
logits equal the unmodified model's; ``rt.detach()`` restores the previous
implementation and removes every hook, leaving the model bit-identical.

Time is reported two ways: measured wall time of each forward on this machine (the
arithmetic is real), and modeled time from :class:`moecast.runtime.core.cost_model.CostModel`
on a virtual clock (attention, device experts, serial transfers, CPU experts overlapped
with the device), which is what an accelerator with that profile would take. The measured
decode step is split into attention / dense (outside the experts calls), expert compute,
host time blocked on transfers, predictor and policy (``*_ms`` in :meth:`LiveRuntime.stats`).

Data path: each layer reads the device once (:meth:`LiveRuntime._read_layer`: the routing
ids with everything the host decisions need), copies into a slot wait only for the last
kernel that read it (:mod:`moecast.runtime.tiers.expert_store`), and CPU-computed experts run on a
worker thread while the device computes the resident ones. The slow tier is host RAM
(pinned within a budget) or, with ``offload="disk"``, an offload directory read with direct
I/O (:mod:`moecast.runtime.tiers.offload`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from moecast.collect.models import MoEStructure, find_moe_structure, model_info
from moecast.predictors.base import (
    LayerStream,
    LearningPlanner,
    OnlineStream,
    PromptPlanner,
    StreamingPredictor,
)
from moecast.runtime.core.cache import ExpertCache, StaticTable, resolve_capacity
from moecast.runtime.core.cost_model import CostModel, HardwareProfile, default_hardware, load_profile
from moecast.runtime.core.policy import POLICIES, Policy, get_policy, with_policies
from moecast.runtime.core.step import LayerStep, layer_time, predictor_latency, ranked_predictions
from moecast.runtime.tiers.expert_store import LayerStore, SlotView, expert_params
from moecast.runtime.tiers.offload import peak_rss_mb
from moecast.runtime.tiers.precision import Precision, expert_nbytes, quantized_experts_forward

from moecast.errors import InputError, MoecastError

LIVE_IMPL = "moecast_live"
#: ``policy`` names: the presets of runtime/core/policy.py but belady (it needs the future: replay only)
LIVE_POLICIES = tuple(p for p in POLICIES if p != "belady")
PREFETCH = ("auto", "none", "online", "predictor")
#: balance overrides the policy's balancer; ``load`` loads every miss (the policy vocabulary's ``none``)
BALANCE = ("smoe", "presched", "load", "cpu")
#: where experts that are not resident live: host RAM, or an offload directory read with direct I/O
OFFLOAD = ("ram", "disk")
#: the per-layer breakdown of a decode step's wall time, as LiveStats lists and as_dict means
BREAKDOWN = ("attention", "expert_compute", "transfer_wait", "device_sync", "predictor", "policy")
# a forward's decode flag as the step reads it (never written)
_YES, _NO = np.array([True]), np.array([False])

# experts module -> (runtime, layer position); kept outside the module so attaching leaves no trace on it
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class LiveConfig:
    """What the runtime does (:func:`attach` takes it whole or field by field).

    Attributes:
        policy: A preset of runtime/core/policy.py (the replay's, but belady): <POLICY_HELP>; or a
            :class:`~moecast.runtime.core.policy.Policy`. Here presched starts from the initial placement (the
            runtime has no hot-expert table of its own) and static's fixed slots hold a predictor's
            hot-expert table, else experts 0..c-1.
        capacity: Experts per layer on the device: a fraction of E (0.25), a count (6), bytes ("512MB");
            None: all of them (full residency).
        alpha: SMoE substitution threshold in [0, 1); 0 leaves the routing untouched; None: the policy's
            default (0.3 under smoe). Only ``smoe`` substitutes (the replay's rule), so alpha > 0 with
            another policy is refused.
        hardware: Hardware profile name (configs/hardware), YAML path or HardwareProfile for the modeled times;
            None: this machine's profile where ``moecast profile`` wrote one (``local``), else the replay's
            default, prescope-a100-pcie4 (``stats()["hardware"]`` and ``hardware_from`` say which).
        prefetch: Where prefetch candidates come from: auto (if the policy prefetches: the predictor if
            given, else online), none, online (next gate on this gate input), predictor.
        balance: Overrides the policy's balancer for decode misses: smoe (SMoE Algorithm 2), presched
            (PreScope's PreSched, Algorithm 1: the load/CPU split with the predicted next layer in the link
            queue, and the prefetch count), load (always load), cpu (always CPU); None: the policy's.
        warm: Fill the slots at attach (SMoE §4.1); False starts every layer empty.
        score_window: SMoE Eq. 3's n (steps averaged by the score policy).
        device: Where slots live (default: where the experts are; a CUDA device for the real path).
        online_update: After each decoded token, one continual-learning step of the layer-ahead predictor
            on its now-known routing (PreScope §4.2.2); off by default.
        online_lr: Learning rate of those steps.
        learn_plans: CasMoE's buffer: each prompt given to ``rt.plan`` goes, with the EP of its prefill's
            routing (Eq. 3), to the planner's buffer, which folds C of them into the EAM's index (and
            rewrites a saved EAM's files); needs an EAM or cascade planner. Off by default.
        pinned_mb: Host memory (MB) the expert copies may pin on CUDA (default: half the available
            memory); above it they stay pageable and transfers go through a few pinned staging buffers.
        offload: Where the experts that are not resident live: ``ram`` (host memory) or ``disk``
            (``offload_dir``, read with direct I/O; :mod:`moecast.runtime.tiers.offload`). Under ``disk`` a
            model whose experts are in memory has them written to ``offload_dir`` once (resumable) and
            dropped from memory until ``detach``, which reads them back.
        offload_dir: The offload directory for ``offload="disk"``.
        io_threads: Threads reading the offload directory. The experts computed on the CPU are read in
            waves of max(2, io_threads), two waves at a time, so their buffers stay at
            2 x max(2, io_threads) experts however many a long prefill computes.
        predictor_ms: The predictor's latency per layer (ms) charged before a prefetch may start, as in
            the replay; None: the checkpoint's measured figure, else the hardware profile's.
        expert_dtype: The precision of the experts the slow tier holds and the slots compute
            (:mod:`moecast.runtime.tiers.precision`): ``model`` (the model's dtype, exact), ``int8`` (per
            output channel) or ``int4`` (group-wise). A quantized precision needs ``offload="disk"``: the
            offload directory holds its copy beside the model-dtype one, the link moves its bytes, a
            capacity in bytes counts them, and the experts compute on the packed weights.
        group_size: int4's group along the input dimension (32, 64, 128 or 256); a matrix whose input
            dimension it does not divide is quantized per output channel instead.
    """

    policy: str | Policy = "smoe"
    capacity: float | int | str | None = None
    alpha: float | None = None
    prefetch: str = "auto"
    balance: str | None = None
    hardware: str | HardwareProfile | None = None
    warm: bool = True
    score_window: int = 8
    device: str | None = None
    online_update: bool = False
    online_lr: float = 1e-4
    learn_plans: bool = False
    pinned_mb: float | None = None
    offload: str = "ram"
    offload_dir: str | None = None
    io_threads: int = 2
    predictor_ms: float | None = None
    expert_dtype: str = "model"
    group_size: int = 128

    def __post_init__(self) -> None:
        name = self.policy.name if isinstance(self.policy, Policy) else self.policy
        if name == "belady" or (isinstance(self.policy, Policy) and self.policy.eviction == "belady"):
            raise InputError(
                "belady needs the future accesses: it is a replay bound (moecast replay --policy belady)"
            )
        if not isinstance(self.policy, Policy) and self.policy not in LIVE_POLICIES:
            raise InputError(f"unknown policy {self.policy!r}; choose one of {', '.join(LIVE_POLICIES)}")
        if self.alpha is not None and not (math.isfinite(float(self.alpha)) and 0 <= float(self.alpha) < 1):
            raise InputError(f"alpha must be in [0, 1) (SMoE's substitution threshold), got {self.alpha}")
        # replay's rule, so that one policy name means the same in both runtimes: only policies that
        # substitute (smoe) take an alpha, 0.3 when none is given
        self.rule = get_policy(self.policy, self.alpha)
        self.alpha = self.rule.alpha
        if self.prefetch not in PREFETCH:
            raise InputError(f"unknown prefetch {self.prefetch!r}; choose one of {', '.join(PREFETCH)}")
        if self.balance is not None and self.balance not in BALANCE:
            raise InputError(f"unknown balance {self.balance!r}; choose one of {', '.join(BALANCE)}")
        if self.balance is not None:
            bal = "none" if self.balance == "load" else self.balance
            self.rule = dataclasses.replace(self.rule, balancer=bal)
        if self.offload not in OFFLOAD:
            raise InputError(f"unknown offload {self.offload!r}; choose one of {', '.join(OFFLOAD)}")
        if self.offload == "disk" and not self.offload_dir:
            raise InputError(
                "offload='disk' needs offload_dir=DIR (the directory the experts are written to and read from)"
            )
        if int(self.io_threads) < 1:
            raise InputError(f"io_threads must be at least 1, got {self.io_threads}")
        if self.pinned_mb is not None and not (math.isfinite(self.pinned_mb) and self.pinned_mb >= 0):
            raise InputError(f"pinned_mb must be a size in MB >= 0, got {self.pinned_mb}")
        self.precision = Precision(self.expert_dtype, int(self.group_size))
        if self.precision.quantized and self.offload != "disk":
            raise InputError(
                f"expert_dtype={self.expert_dtype} needs offload='disk' and offload_dir=DIR (the quantized copies "
                "live in the offload directory)"
            )


LiveConfig.__doc__ = with_policies(LiveConfig.__doc__ or "", exclude=("belady",))


@dataclass
class LiveStats:
    """Counters since attach (or :meth:`LiveRuntime.reset_stats`); rates are derived in :meth:`as_dict`."""

    decode_steps: int = 0
    prefill_steps: int = 0
    routed: int = 0  # (token, layer, expert) uses the router chose in decode steps
    cpu_uses: int = 0  # token uses of the experts computed on the CPU
    plan_loads: int = 0  # experts a prompt plan (CasMoE) loaded before decoding
    plans_learned: int = 0  # planned prompts whose prefill EP went to the planner's buffer (CasMoE)
    plans_folded: int = 0  # of those, the ones that filled the buffer and were folded into the index
    online_updates: int = 0  # PreScope §4.2.2 continual-learning steps taken on decoded tokens
    online_loss: float = float("nan")  # the predictor's loss on the latest decoded token, before its update
    host_syncs: int = 0  # device-to-host reads the experts calls waited for (one per layer and step)
    measured_decode_ms: list[float] = field(default_factory=list)
    modeled_decode_ms: list[float] = field(default_factory=list)
    measured_prefill_ms: float = 0.0
    # per decode step (ms): everything outside the experts calls (attention, dense, router, head), the
    # experts' arithmetic, host time blocked on transfers, the routing reads' wait for the device (on
    # a GPU the device finishing what was queued before them; on a CPU a copy), predictor calls, and
    # the rest of the calls (the policy's decisions)
    attention_decode_ms: list[float] = field(default_factory=list)
    expert_compute_decode_ms: list[float] = field(default_factory=list)
    transfer_wait_decode_ms: list[float] = field(default_factory=list)
    device_sync_decode_ms: list[float] = field(default_factory=list)
    predictor_decode_ms: list[float] = field(default_factory=list)
    policy_decode_ms: list[float] = field(default_factory=list)
    # per decode step (ms): after the last MoE layer's experts (its shared experts, final norm, LM head)
    after_layers_decode_ms: list[float] = field(default_factory=list)
    modeled_prefill_ms: float = 0.0

    def as_dict(self, step: dict[str, np.ndarray]) -> dict[str, Any]:
        """The counters, the per-layer step's (``step``: LayerStep.stats) under replay's names, and rates."""
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        t = {name: int(v.sum()) for name, v in step.items() if name != "time"}
        d.update(
            uses=t["uses"],
            hits=t["hits"],
            substituted=t["subs"],
            loads=t["loads"],  # on-demand loads
            cpu_experts=t["cpu"],  # (step, layer, expert) groups computed on the CPU
            prefetches_issued=t["pf_issued"],
            prefetches_landed=t["pf_landed"],
            prefetch_used=t["pf_used"],
            # experts moved over the link: demand loads, prefetches that landed, plan preloads
            transfers=t["loads"] + t["pf_landed"] + self.plan_loads,
        )
        d["hit_rate"] = t["hits"] / t["uses"] if t["uses"] else float("nan")
        d["substitution_rate"] = t["subs"] / self.routed if self.routed else 0.0
        d["prefetch_accuracy"] = t["pf_used"] / t["pf_landed"] if t["pf_landed"] else float("nan")
        d["measured_tpot_ms"] = (
            float(np.mean(self.measured_decode_ms)) if self.measured_decode_ms else float("nan")
        )
        d["modeled_tpot_ms"] = (
            float(np.mean(self.modeled_decode_ms)) if self.modeled_decode_ms else float("nan")
        )
        for part in (*BREAKDOWN, "after_layers"):
            ms = getattr(self, f"{part}_decode_ms")
            d[f"{part}_ms"] = float(np.mean(ms)) if ms else float("nan")
        return d


class LiveRuntime:
    """One model with the live runtime attached; create it with :func:`attach`."""

    def __init__(
        self, model: Any, structure: MoEStructure, config: LiveConfig, predictor: Any = None
    ) -> None:
        self.model = model
        self.structure = structure
        self.config = config
        self.info = model_info(
            model, structure, getattr(model.config, "_name_or_path", "") or type(model).__name__
        )
        self.num_layers = len(structure.layers)
        self.num_experts = self.info.num_experts
        self.top_k = self.info.top_k
        self.precision = config.precision
        # what one expert is on the link and in a slot: its bytes at the slow tier's precision
        first = structure.layers[0].experts
        self.link_bytes = (
            expert_nbytes(self.precision, expert_params(first), bool(getattr(first, "is_transposed", False)))
            if self.precision.quantized
            else int(self.info.expert_bytes)  # the replay's figure for the same TraceSet
        )
        self.capacity = (
            self.num_experts
            if config.capacity is None
            else resolve_capacity(config.capacity, self.num_experts, self.top_k, self.link_bytes)
        )
        self.full = self.capacity >= self.num_experts
        self.predictor = predictor
        rule = config.rule
        # static never inserts, so a predictor cannot prefetch under it: its predictor is the
        # hot-expert table that fills the slots once (docs/design.md: eviction static = hot-expert table)
        self.hot_table: np.ndarray | None = None
        if rule.eviction == "static" and predictor is not None:
            self.hot_table = hot_table(predictor, self.num_layers, self.num_experts)
        self.prefetch = _choose_prefetch(config.prefetch, rule, predictor, self.hot_table)
        # the layer-ahead predictor's stream (it keeps the window of finished tokens), fed this
        # forward's layers while ``_streaming``; the step's last ``_gate_rows`` gate inputs go with them
        self._stream: LayerStream | None = predictor.stream() if self.prefetch == "predictor" else None
        self._gate_rows = self._stream.gate_rows if self._stream is not None else 0
        self._streaming = False
        if config.online_update and not isinstance(self._stream, OnlineStream):
            raise InputError(
                "online_update needs a layer-ahead predictor with an update step (LLaPor) to prefetch"
            )
        # the policy as it runs here: a prefetch source given explicitly turns its prefetch on or off
        self.policy = dataclasses.replace(rule, prefetch="none" if self.prefetch == "none" else "predictor")
        hw, self.hardware_from = (
            (config.hardware, "given") if config.hardware is not None else default_hardware()
        )
        profile = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
        self.cost = CostModel.from_profile(profile, self.info.expert_bytes, link_bytes=self.link_bytes)
        self.cache, self.step = self._make_step(profile, predictor)
        self._next: tuple[int, np.ndarray] | None = None  # (layer, its ranked prefetch candidates)
        self._step_args()
        self._t = np.array([0])  # the step as the cache's time, set per forward
        self.stores = self._make_stores(structure, config)
        # CPU experts run on a worker thread while the device computes the resident ones. Without an
        # accelerator the same cores compute both (the step adds their times), so they run on this
        # thread after the resident ones: a second thread's kernels would only contend for the
        # cores with the attention that follows. A disk's reads for them start before the resident
        # experts compute, behind the demand loads (the step's rule for slow_tier disk).
        self.overlap_cpu = any(st.cuda for st in self.stores)
        self._init_state()
        self._place()

    def _make_step(self, profile: HardwareProfile, predictor: Any) -> tuple[ExpertCache, LayerStep]:
        """The slots' cache and the replay's per-layer step over it, one lane (and one statistics
        slot) per layer."""
        cache = ExpertCache(
            self.num_experts,
            self.capacity,
            self.policy.eviction,
            lanes=self.num_layers,
            score_window=self.config.score_window,
        )
        pred_ms = (
            predictor_latency(self.config.predictor_ms, predictor, profile)
            if self.prefetch != "none"
            else (0.0, "")
        )
        step = LayerStep(
            cache,
            self.policy,
            self.cost,
            self.num_experts,
            self.num_layers,
            stat_base=np.zeros(self.num_layers, dtype=np.int64),
            n_stats=self.num_layers,
            prefetching=self.prefetch != "none",
            predictor_ms=pred_ms[0],
            compiled=True,
        )
        return cache, step

    def _step_args(self) -> None:
        """Each layer's step arguments, made once: its lane, the next layer's lane, whether there is
        one, and whether the layer starts a token (the step only reads them)."""
        L = self.num_layers
        self._lanes = [np.array([pos]) for pos in range(L)]
        self._next_lanes = [np.array([min(pos + 1, L - 1)]) for pos in range(L)]
        self._has_next = [np.array([pos + 1 < L]) for pos in range(L)]
        self._restart = [np.array([pos == 0]) for pos in range(L)]

    def _init_state(self) -> None:
        """The statistics and the per-forward state, before the first forward."""
        self._pool: ThreadPoolExecutor | None = None
        self._next_scores: np.ndarray | None = None
        self.stats_ = LiveStats()
        self._previous: dict[str, Any] | None = None
        self._layer_prev: list[str | None] = []
        self._hooks: list[Any] = []
        self._logits: list[torch.Tensor | None] = [None] * self.num_layers
        self._decode = False
        self._step = 0
        self._t0 = 0.0
        self._clock = 0.0  # modeled time (ms) of the current forward: the sum of its layers' times
        self._layer_end = 0.0  # when the current forward's latest experts call returned (perf_counter)
        self._cur_ids = np.zeros((0, self.num_layers, self.top_k), np.int64)
        self._cur_w = np.zeros((0, self.num_layers, self.top_k), np.float32)
        self._cur_token = 0
        self._learn_prompt: str | None = None  # a planned prompt whose prefill routing goes to the planner
        self.planner: Any = None
        self.last_plan_branch: str | None = None

    def _make_stores(self, structure: MoEStructure, config: LiveConfig) -> list[LayerStore]:
        """One store per MoE layer; host copies are pinned only while their total fits the pinning budget.

        With ``offload="disk"`` the experts go to the offload directory (written once, resumable) and
        the module's weights are dropped; each store then reads its misses from there.
        """
        self.reader = None
        self._dropped: list[torch.device] | None = None  # where attach found the experts it moved to disk
        if config.offload == "disk":
            return self._disk_stores(structure, config)
        experts = [e.experts for e in structure.layers]
        total = sum(_host_bytes(e) for e in experts)
        budget = pinned_budget(config.pinned_mb)
        pin = None if total <= budget else False
        return [LayerStore(e, self.capacity, config.device, pin=pin) for e in experts]

    def _disk_stores(self, structure: MoEStructure, config: LiveConfig) -> list[LayerStore]:
        from moecast.runtime.tiers import offload

        in_memory = all(
            t.device.type != "meta" for e in structure.layers for t in expert_params(e.experts).values()
        )
        prec = self.precision
        meta = offload.with_precision(offload.offload_meta(self.model, structure), structure, prec)
        if not in_memory and offload.missing_layers(config.offload_dir, meta):
            raise offload.OffloadError(
                f"{config.offload_dir} does not hold all of this model's experts and the model has none in "
                "memory; load it whole once (moecast run --offload disk writes them)"
            )
        if in_memory or (prec.quantized and offload.missing_layers(config.offload_dir, meta, prec)):
            # a precision the directory lacks is quantized from its model-dtype files
            offload.write_offload(self.model, structure, config.offload_dir, dense=False, precision=prec)
        self._model_meta = offload.tier_meta(meta, offload.MODEL)
        tm = offload.tier_meta(meta, prec)
        reader = offload.ExpertReader(config.offload_dir, tm, threads=config.io_threads)
        # slots go where the model computes: its experts' device, else its first real weight's
        real = [p.device for p in self.model.parameters() if p.device.type != "meta"]
        first = expert_params(structure.layers[0].experts)
        here = next(iter(first.values())).device if in_memory else (real[0] if real else torch.device("cpu"))
        device = torch.device(config.device) if config.device else here
        try:
            if device.type == "cpu":
                offload.check_fits(self.capacity, reader.layouts, config.capacity)
            stores = [
                offload.DiskLayerStore(e.experts, self.capacity, reader, pos, device)
                for pos, e in enumerate(structure.layers)
            ]
        except BaseException:
            reader.close()
            raise
        self.reader = reader
        if in_memory:
            self._dropped = offload.drop_experts(structure)
        return stores

    # ------------------------------------------------------------------ placement
    def _place(self) -> None:
        """SMoE §4.1 parameter initialisation: fill each layer's slots (experts 0..c-1, or static's hot table)."""
        self._identity = [False] * self.num_layers
        if not self.config.warm and not self.full and self.policy.eviction != "static":
            return
        initial = np.arange(self.capacity)
        if self.hot_table is not None and not self.full:  # full residency holds every expert anyway
            # replay's static choice: each layer's top-capacity experts by score, ties by lower id
            initial = StaticTable(self.hot_table).per_layer(self.capacity)
        for pos, store in enumerate(self.stores):
            row = initial[pos] if initial.ndim == 2 else initial
            store.fill(row)
        lanes = np.arange(self.num_layers)
        self.cache.preload(lanes, np.stack([s.expert_in for s in self.stores]))
        self._identity = [bool((s.expert_in == np.arange(s.num_slots)).all()) for s in self.stores]

    def plan(self, prompt: str) -> str:
        """CasMoE planning before decoding: preload each layer's top planned experts into its slots.

        The attached prompt-ahead planner (EAM, EAP or their cascade) turns ``prompt`` into an [L, E]
        plan; each layer keeps its ``capacity`` best-planned experts resident (loads counted as
        transfers and ``plan_loads``). Call it before ``generate``; returns the branch that answered.
        """
        if self.planner is None:
            raise MoecastError("no planner attached; pass planner=<prompt-ahead predictor> to attach()")
        if not prompt.strip():
            raise MoecastError("cannot plan an empty prompt")
        plan, branch = self.planner.plan(prompt)
        plan = np.asarray(plan, dtype=np.float32).reshape(self.num_layers, self.num_experts)
        want = np.argsort(-plan, axis=1, kind="stable")[:, : self.capacity]
        for pos, store in enumerate(self.stores):
            keep = set(want[pos].tolist())
            # evict only residents the plan does not want, and only as many slots as the plan needs
            out = [int(e) for e in store.expert_in if e >= 0 and int(e) not in keep]
            for e in want[pos]:
                if store.slot_of[int(e)] >= 0:
                    continue
                before = store.loads
                store.load(int(e), evict=None if store.free_slot() is not None else out.pop(0))
                self.stats_.plan_loads += store.loads - before
        self.cache.preload(np.arange(self.num_layers), np.stack([s.expert_in for s in self.stores]))
        self._identity = [bool((s.expert_in == np.arange(s.num_slots)).all()) for s in self.stores]
        self.last_plan_branch = branch
        if self.config.learn_plans:
            self._learn_prompt = prompt
        return branch

    def _learn_plan(self) -> None:
        """CasMoE's buffer: the planned prompt and its EP (Eq. 3), from the routing of its prefill,
        go to the planner (:meth:`EAM.observe`), which folds C of them into its index."""
        from moecast.predictors.casmoe import ep_matrix

        prompt, self._learn_prompt = self._learn_prompt, None
        ep = ep_matrix(self._cur_ids, self._cur_w, self.num_experts)
        folded = self.planner.observe(prompt, ep)
        self.stats_.plans_learned += 1
        self.stats_.plans_folded += int(bool(folded))

    # ------------------------------------------------------------------ attach / detach
    def _attach(self) -> None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if LIVE_IMPL not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS[LIVE_IMPL] = live_experts_forward
        for entry in self.structure.layers:
            if entry.experts in _ATTACHED:
                raise MoecastError(
                    f"{entry.experts_name} already has the live runtime attached; detach it first"
                )
        missing = [e.layer for e in self.structure.layers if e.router is None]
        if missing:
            raise MoecastError(
                f"no router module found for MoE layer(s) {missing} of {type(self.model).__name__}: the live runtime "
                "needs router probabilities (the class in _can_record_outputs['router_logits'])"
            )
        self._layer_prev = [e.experts.config._experts_implementation for e in self.structure.layers]
        self._impl = [
            _resolve_impl(name, e.experts) for name, e in zip(self._layer_prev, self.structure.layers)
        ]
        if self.precision.quantized:  # the slots hold packed weights: the precision's kernels compute them
            self._impl = [functools.partial(quantized_experts_forward, self.precision)] * self.num_layers
        self._previous = self.model.get_experts_implementation()
        for pos, entry in enumerate(self.structure.layers):
            _ATTACHED[entry.experts] = (self, pos)
        self.model.set_experts_implementation(LIVE_IMPL)
        stuck = [
            e.experts_name
            for e in self.structure.layers
            if e.experts.config._experts_implementation != LIVE_IMPL
        ]
        if stuck:
            self.detach()
            raise MoecastError(
                f"{type(self.model).__name__} did not accept a custom experts implementation ({stuck[0]})"
            )
        index = self.structure.router_output_index
        for pos, entry in enumerate(self.structure.layers):
            self._hooks.append(entry.router.register_forward_hook(self._logits_hook(pos, index)))
        self._hooks.append(self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(self._post_forward))

    def detach(self) -> None:
        """Restore the experts implementation the model had and remove every hook."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._previous is not None:
            self.model.set_experts_implementation(self._previous)
            self._previous = None
        for entry in self.structure.layers:
            if _ATTACHED.get(entry.experts, (None,))[0] is self:
                del _ATTACHED[entry.experts]
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for st in self.stores:
            st.close()
        if self.reader is not None:
            if self._dropped:  # the model gets back the expert weights attach moved to disk
                from moecast.runtime.tiers.offload import ExpertReader, restore_experts

                # from the model-dtype files, whatever precision the run read
                exact = ExpertReader(self.reader.directory, self._model_meta, threads=self.reader.threads)
                try:
                    restore_experts(self.structure, exact, self._dropped)
                finally:
                    exact.close()
                self._dropped = None
            self.reader.close()
            self.reader = None

    def __enter__(self) -> LiveRuntime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # ------------------------------------------------------------------ hooks
    def _logits_hook(self, pos: int, index: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            self._logits[pos] = output[index] if isinstance(output, tuple) else output

        return hook

    def _pre_forward(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        seq = ids.shape[-1] if ids is not None else (emb.shape[1] if emb is not None else 2)
        # one new token per sequence with a cache = a decode step (SMoE's TPOT is measured on these);
        # a one-token prompt is a prefill, as the replay's traces mark it
        self._decode = seq == 1 and _continues(kwargs)
        # read once per forward: a torch index and int() cost ~20 us, paid at every layer otherwise
        self._cur_token = int(ids.reshape(-1)[-1]) if ids is not None and ids.numel() else 0
        n = ids.numel() if ids is not None else 0
        self._cur_ids = np.zeros((n, self.num_layers, self.top_k), np.int64)
        self._cur_w = np.zeros((n, self.num_layers, self.top_k), np.float32)
        # a prefill starts the stream's request; a one-token decode step closes the step before it
        # (forwards of several decoded tokens are not predicted, and leave the window as it is)
        self._streaming = self._stream is not None and (not self._decode or n == 1)
        if self._streaming:
            if self._decode:
                self._stream.end_token(self._cur_token)
            else:
                self._stream.reset(ids.detach().reshape(-1).cpu().numpy() if ids is not None else ())
        self._clock = 0.0
        self._t = np.array([self._step])
        self._next = None
        self._acc = dict.fromkeys(("layers", *BREAKDOWN[1:-1]), 0.0)
        self._t0 = self._layer_end = time.perf_counter()
        if self._decode and self.prefetch == "predictor":
            self._first_prefetch()

    def _first_prefetch(self) -> None:
        """The first layer's prefetch, predicted from what the token's start knows, sent out before the
        model runs: its reads overlap the first layer's attention, the window the step gives it
        (``t_attn - t_pred``). Its time counts with the layers' (policy and predictor), not attention."""
        t0, w0 = time.perf_counter(), self._waited()
        self._next = self._next_prediction(0, None)[1]
        self._prefetch()
        self._acc["layers"] += time.perf_counter() - t0
        self._acc["transfer_wait"] += self._waited() - w0

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        end = time.perf_counter()
        wall = (end - self._t0) * 1e3
        s = self.stats_
        if self._decode:
            s.decode_steps += 1
            s.measured_decode_ms.append(wall)
            # the step's layers, then what follows the last one (the profile's step_ms)
            s.modeled_decode_ms.append(self._clock + self.cost.t_step)
            self._record_breakdown(wall)
            s.after_layers_decode_ms.append((end - self._layer_end) * 1e3)  # _pre_forward set it to _t0
            if self._streaming and self.config.online_update:
                self._online_update()
        else:
            s.prefill_steps += 1
            s.measured_prefill_ms += wall
            s.modeled_prefill_ms += self._clock
            if self._learn_prompt is not None and len(self._cur_ids):
                self._learn_plan()
        self._step += 1

    def _record_breakdown(self, wall: float) -> None:
        """One decode step's wall time split: outside the experts calls, and inside them by kind (ms)."""
        acc, s = {k: v * 1e3 for k, v in self._acc.items()}, self.stats_
        inner = acc["expert_compute"] + acc["transfer_wait"] + acc["device_sync"] + acc["predictor"]
        s.attention_decode_ms.append(max(0.0, wall - acc["layers"]))
        s.expert_compute_decode_ms.append(acc["expert_compute"])
        s.transfer_wait_decode_ms.append(acc["transfer_wait"])
        s.device_sync_decode_ms.append(acc["device_sync"])
        s.predictor_decode_ms.append(acc["predictor"])
        s.policy_decode_ms.append(max(0.0, acc["layers"] - inner))

    def _waited(self) -> float:
        """Host time the stores have blocked on transfers (only a disk store's reads block)."""
        return sum(st.wait_s for st in self.stores) if self.reader is not None else 0.0

    def _timed(self, part: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)``, its wall time added to ``part`` less the transfer waits inside it (counted apart)."""
        t0, w0 = time.perf_counter(), self._waited()
        try:
            return fn(*args, **kwargs)
        finally:
            self._acc[part] += time.perf_counter() - t0 - (self._waited() - w0)

    # ------------------------------------------------------------------ the experts call
    def _router_probs(self, pos: int, n: int) -> torch.Tensor:
        """The layer's router probabilities for its last ``n`` tokens, where the logits are (the device)."""
        logits = self._logits[pos]
        if logits is None:
            raise MoecastError(
                f"MoE layer {self.structure.layers[pos].layer} ran its experts without its router hook"
            )
        logits = logits.detach().reshape(-1, logits.shape[-1])[-n:].float()
        if self.structure.router_probs_kind == "sigmoid-normalised":
            s = torch.sigmoid(logits)
            return s / s.sum(-1, keepdim=True)
        return torch.softmax(logits, dim=-1)

    def _read_layer(
        self, pos: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """What this layer's decisions read on the host, in one device-to-host synchronisation.

        The routing ids must be read; the weights, router probabilities, hidden rows (gate inputs for
        the predictor, inputs of CPU experts) and the online prefetcher's next-layer scores are
        computed on the device first and travel with them, so no later read stalls the layer.
        """
        n = index.shape[0]
        want: dict[str, torch.Tensor] = {"ids": index}
        substituting = self._decode and self.policy.substituting and not self.full
        if substituting or self.cache.policy == "score" or self.prefetch != "none":
            want["probs"] = self._router_probs(pos, n)
        if len(self._cur_ids) == n or self._streaming or substituting or self._cpu_possible():
            want["w"] = weights
        if (self._streaming and self._gate_rows) or self._cpu_possible():
            want["hidden"] = hidden
        self._next_scores = None
        nxt = pos + 1
        if self._decode and self.prefetch == "online" and not self.full and nxt < self.num_layers:
            scores = self._timed("predictor", self._online_scores, nxt, hidden)
            if scores is not None:
                want["next"] = scores
        # the one wait for the device in a layer: on a GPU it holds the queued attention and router
        # (timed directly: no transfer wait can fall inside it, so _timed's store sums are not needed)
        t0 = time.perf_counter()
        got = dict(zip(want, to_host(list(want.values()))))
        self._acc["device_sync"] += time.perf_counter() - t0
        self.stats_.host_syncs += 1
        if "next" in got:
            self._next_scores = got["next"].numpy()
        return got

    def _cpu_possible(self) -> bool:
        """Whether this layer may compute experts on the CPU (static never loads; balancers split decode misses)."""
        return not self.full and (
            self.policy.eviction == "static" or (self._decode and self.policy.balancer != "none")
        )

    def forward_layer(
        self,
        pos: int,
        module: Any,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One MoE layer's experts under the runtime (see the module docstring for the steps)."""
        st = self.stores[pos]
        n = top_k_index.shape[0]
        lane = self._lanes[pos]
        if self.full and st.cuda is False and self._identity[pos]:
            return self._full_layer(pos, module, hidden, top_k_index, top_k_weights, kwargs)
        host = self._read_layer(pos, hidden, top_k_index, top_k_weights)
        decode = _YES if self._decode and not self.full else _NO
        ids, probs, w_host, weights, top_k_index = self._route(pos, host, top_k_index, top_k_weights, decode)
        self._record(pos, n, ids, w_host, host, hidden.shape[-1])
        nxt = pos + 1
        # PreSched sizes this layer's split by the next layer's predicted experts, so it predicts first;
        # the others predict once the layer's demand loads are on the link, as the step's window has it
        presched = self.policy.balancer == "presched"
        next_ids, self._next = self._next_prediction(nxt, hidden) if presched else (None, None)
        before = self.cache.resident[pos].copy()
        o = self.step.layer(
            lane, lane, ids[None], self._t, probs, next_lanes=self._next_lanes[pos],
            has_next=self._has_next[pos], restart=self._restart[pos], next_predicted=next_ids,
            decode=decode, routed=True,
        )  # fmt: skip
        valid = o.uniq[0] >= 0
        uniq, counts, hit = o.uniq[0][valid], o.counts[0][valid], o.hit[0][valid]
        loads = o.load_ids[0][o.load_ids[0] >= 0]
        placed = loads[self.cache.resident[pos, loads]]  # loads the cache took, into the slots it freed
        self._move(pos, before, placed)
        if not presched:
            self._next = self._next_prediction(nxt, hidden)[1]
        cpu_ids = o.cpu_ids[0]
        early = not (cpu_ids >= 0).any()
        if early:
            # the next layer's prefetch is queued now, behind this layer's demand loads, so its
            # transfers run while this layer computes (the step's window opens when the link is free,
            # not after the experts' compute); a CPU set's reads come first, so it waits for them
            self._prefetch()
        # experts of the call, as np.unique(ids) counts them (the router gives no padding ids)
        distinct = len(uniq) if ids.min() >= 0 else len(np.unique(ids))
        call = _ExpertsCall(module, hidden, top_k_index, weights, ids, kwargs, host, w_host, distinct)
        # loads it did not take stream through the slots (more misses than slots: a long prefill); under
        # static, which never inserts, the step's streamed misses are computed from host memory here
        streamed = loads[~np.isin(loads, placed)] if len(placed) < len(loads) else loads[:0]
        out, to_cpu, cpu_part = self._run_experts(pos, call, uniq[hit], placed, streamed, uniq, cpu_ids)
        out = self._join(out, to_cpu, cpu_part, uniq, counts, hidden, n)
        self._clock += float(o.layer_t[0])
        if not early:
            self._prefetch()
        return out

    def _route(
        self,
        pos: int,
        host: dict[str, Any],
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        decode: Any,
    ) -> tuple[np.ndarray, np.ndarray | None, Any, torch.Tensor, torch.Tensor]:
        """(ids, probs, host weights, weights, top_k_index) of the layer after the step's
        substitution (SMoE), which may replace some of the router's ids and renormalise the weights."""
        ids = host["ids"].numpy().astype(np.int64)
        probs = host["probs"].numpy()[None] if "probs" in host else None
        w_host = host.get("w")
        if self._decode:
            self.stats_.routed += ids.size
        lane = self._lanes[pos]
        ids3 = ids[None]
        routed = self.step.route(lane, lane, ids3, probs, decode)
        if routed is ids3 or np.array_equal(routed[0], ids):
            return ids, probs, w_host, top_k_weights, top_k_index
        routed = routed[0]
        w_host = _substituted_weights(w_host, ids, routed, probs[0])
        weights = to_device(w_host, top_k_weights.device)
        top_k_index = to_device(torch.from_numpy(routed).to(top_k_index.dtype), top_k_index.device)
        return routed, probs, w_host, weights, top_k_index

    def _record(
        self, pos: int, n: int, ids: np.ndarray, w_host: Any, host: dict[str, Any], hidden: int
    ) -> None:
        """The layer's ids (and the prefill's weights, for a planner) into the forward's routing, and
        to the layer-ahead predictor's stream while it observes."""
        if len(self._cur_ids) == n:
            self._cur_ids[:, pos] = ids
            if self._learn_prompt is not None:  # the planner reads the prefill's weights
                self._cur_w[:, pos] = w_host.float().numpy()
        if self._streaming:
            self._observe(pos, ids, w_host, host.get("hidden"), hidden)

    def _join(
        self,
        out: torch.Tensor | None,
        to_cpu: np.ndarray,
        cpu_part: Any,
        uniq: np.ndarray,
        counts: np.ndarray,
        hidden: torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        """The layer's output over its ``n`` tokens: the device's experts' part plus the CPU's,
        computed while the device ran its own (``cpu_part`` gives it), or zeros where the call
        computed no expert."""
        if len(to_cpu):
            # one token: each expert has one use
            self.stats_.cpu_uses += len(to_cpu) if n == 1 else int(counts[np.isin(uniq, to_cpu)].sum())
            part = to_device(self._timed("expert_compute", cpu_part), hidden.device)
            out = part if out is None else out + part
        return torch.zeros_like(hidden) if out is None else out

    def _full_layer(
        self,
        pos: int,
        module: Any,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Full residency: nothing can miss, be evicted or substituted, so the bookkeeping is skipped;
        the slots hold every expert at its own index, so the wrapped implementation runs on them as is."""
        st, n = self.stores[pos], top_k_index.shape[0]
        used = int(torch.unique(top_k_index).numel())
        if self._learn_prompt is not None and len(self._cur_ids) == n:  # the planner learns the prefill
            self._cur_ids[:, pos] = top_k_index.detach().cpu().numpy()
            self._cur_w[:, pos] = top_k_weights.detach().float().cpu().numpy()
        lane = np.array([pos])
        self.step.add("uses", lane, lane, [top_k_index.numel()])
        self.step.add("hits", lane, lane, [top_k_index.numel()])
        if self._decode:
            self.stats_.routed += top_k_index.numel()
        layer_t, _ = layer_time(self.cost, np.array([used]), np.zeros(1), 0.0, 0.0)
        self._clock += float(layer_t[0])
        self.step.add("time", lane, lane, layer_t)
        st.wait()  # a disk store's slots may still be landing
        view = SlotView(module, st.slots, st.num_slots, False)
        return self._timed(
            "expert_compute", self._impl[pos], view, hidden, top_k_index, top_k_weights, **kwargs
        )

    def _run_experts(
        self,
        pos: int,
        call: _ExpertsCall,
        hit_ids: np.ndarray,
        placed: np.ndarray,
        streamed: np.ndarray,
        uniq: np.ndarray,
        cpu_ids: np.ndarray,
    ) -> tuple[torch.Tensor | None, np.ndarray, Any]:
        """Run the resident experts (hits and the loads just placed) on the device, start the rest on the CPU.

        Returns the device's output (None if it ran nothing), the experts left to the CPU and a
        callable that joins their output (host memory); the CPU's experts are computed meanwhile.
        ``streamed``: loads the cache did not keep (more misses than slots, a long prefill): they go
        through the slots in waves of ``capacity`` experts after the resident ones. ``cpu_ids``: the
        step's CPU set (-1 padded), which is the rest of ``uniq`` when nothing streams.
        """
        on_device = np.concatenate([hit_ids, placed])
        if not len(streamed):
            to_cpu = np.sort(cpu_ids[cpu_ids >= 0])
            # started before the device call, which may block the host (a wrapped implementation may sync)
            cpu_part = self._start_cpu(pos, call, to_cpu) if len(to_cpu) else None
            return self._resident(pos, call, hit_ids, placed), to_cpu, cpu_part
        out = self._device(pos, call, on_device)
        done = [on_device]
        for wave in (streamed[i : i + self.capacity] for i in range(0, len(streamed), self.capacity)):
            loaded = self._load(pos, wave, shield=wave)
            part = self._device(pos, call, loaded)
            out = part if out is None else (out if part is None else out + part)
            done.append(loaded)
        to_cpu = np.setdiff1d(uniq, np.concatenate(done))
        return out, to_cpu, self._start_cpu(pos, call, to_cpu) if len(to_cpu) else None

    def _resident(
        self, pos: int, call: _ExpertsCall, hit_ids: np.ndarray, placed: np.ndarray
    ) -> torch.Tensor | None:
        """The resident experts of a call: the hits and the demand loads just placed.

        Reading from a disk without an accelerator (each call runs to its end before the next
        starts), a decode step computes the hits while the loads are read, then each load as it
        lands, so only the last one's compute follows the link (the step's ``max(n_dev * t_g, link +
        t_g)``); a hit whose prefetch is still in flight computes as it lands, before the loads.
        Elsewhere they are one call, whose outputs stay bit-identical to the wrapped
        implementation's: a device's stream waits for the copies without blocking the host, a
        host-memory store copies synchronously, and a prefill's loads are many (a call per expert
        would cost more than the overlap gains)."""
        if not (self._decode and self.reader is not None and not self.stores[pos].cuda):
            return self._device(pos, call, np.concatenate([hit_ids, placed]))
        # a hit whose prefetch is still being read computes once it lands, after the hits that
        # have landed and before the loads (its read went to the disk first)
        st = self.stores[pos]
        late = st.expert_in[st.in_flight(st.slot_of[hit_ids])]
        if len(late):
            hit_ids = hit_ids[~np.isin(hit_ids, late)]
        out = None
        for experts in [hit_ids, *late[:, None], *placed[:, None]]:
            part = self._device(pos, call, experts)
            out = part if out is None else out + part
        return out

    def _device(self, pos: int, call: _ExpertsCall, experts: np.ndarray) -> torch.Tensor | None:
        """The (token, expert) pairs of ``experts`` (resident) from their device slots, with the wrapped implementation.

        Pairs of other experts carry the sentinel id ``num_slots``, which every experts implementation
        skips (its expert-parallel path), so the call computes exactly the pairs that run on the device.
        The slot ids are mapped on the host (the ids are there already) and sent without a sync; the
        compute stream waits only for these slots' transfers, and an event after the call marks them read.
        """
        if not len(experts):
            return None
        st = self.stores[pos]
        slot_of = st.slot_of
        if len(experts) == call.distinct:
            table = slot_of
            partial = False
        else:
            table = np.full(st.num_experts, st.num_slots, np.int64)
            table[experts] = slot_of[experts]
            partial = True
        slot_ids = to_device(torch.from_numpy(table[call.ids]), call.index.device)
        slots = slot_of[experts]
        st.wait(slots)
        out = self._timed(
            "expert_compute",
            self._impl[pos],
            SlotView(call.module, st.slots, st.num_slots, partial),
            call.hidden,
            slot_ids,
            call.weights,
            **call.kwargs,
        )
        st.mark_read(slots)
        return out

    def _start_cpu(self, pos: int, call: _ExpertsCall, experts: np.ndarray) -> Any:
        """Start the CPU's experts (on the worker thread when overlapping); returns the join."""
        if "hidden" not in call.host:  # not foreseen by _read_layer: read the rows now
            call.host["hidden"], call.host["w"] = to_host([call.hidden, call.weights])
            call.w_host = call.host["w"]
            self.stats_.host_syncs += 1
        if not self.overlap_cpu:
            # one token's experts each compute as its read lands (the step's rule); a prefill's in
            # waves of the reader's size. The reads go out now; the caller times the join.
            waves = self.stores[pos].cpu_waves(experts, wave=1 if len(call.ids) == 1 else None)
            return lambda: self._host(pos, call, experts, waves)
        grad = torch.is_grad_enabled()

        def job() -> torch.Tensor:
            with torch.set_grad_enabled(grad):  # grad mode is per thread
                return self._host(pos, call, experts)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moecast-cpu-experts")
        return self._pool.submit(job).result

    def _host(self, pos: int, call: _ExpertsCall, experts: np.ndarray, waves: Any = None) -> torch.Tensor:
        """CPU-assisted computation (SMoE §5.4): only the tokens routed to ``experts``, from host memory, on the host.

        The store gives the experts in waves (the disk tier holds a bounded number of them at a time;
        ``waves``: the store's already started); the waves' parts add up in float32, so one wave's
        result is exactly its part in the model's dtype.
        """
        hidden = call.host["hidden"].reshape(-1, call.hidden.shape[-1])
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        with contextlib.closing(waves if waves is not None else self.stores[pos].cpu_waves(experts)) as waves:
            for tensors, table, count in waves:
                cpu_ids = torch.from_numpy(table[call.ids])
                rows = (cpu_ids < count).any(1)
                view = SlotView(call.module, tensors, count, True)
                part = self._impl[pos](view, hidden[rows], cpu_ids[rows], call.w_host[rows], **call.kwargs)
                out[rows] += part.float()
        return out.to(call.hidden.dtype)

    def _load(self, pos: int, experts: np.ndarray, shield: np.ndarray) -> np.ndarray:
        """Insert ``experts`` into layer ``pos``'s cache and copy them into the slots the cache frees."""
        before = self.cache.resident[pos].copy()
        inserted = self.cache.insert(np.array([pos]), experts[None, :], shield=shield[None, :], t=self._step)[
            0
        ]
        self._move(pos, before, experts[inserted])
        return experts[inserted]

    def _move(self, pos: int, before: np.ndarray, placed: np.ndarray) -> None:
        """Copy the experts the cache just took (``placed``) into the slots of those it evicted since ``before``."""
        if not len(placed):
            return
        st = self.stores[pos]
        ev = list(np.flatnonzero(before & ~self.cache.resident[pos]))
        for e in placed:
            st.load(int(e), evict=int(ev.pop()) if st.free_slot() is None and ev else None)

    # ------------------------------------------------------------------ prefetch
    def _next_prediction(
        self, nxt: int, hidden: torch.Tensor | None
    ) -> tuple[np.ndarray | None, tuple | None]:
        """Layer ``nxt``'s predicted experts: ([1, B * k] each token's top-k, for PreSched's E_next;
        (nxt, [1, M] the prefetch candidates ranked)), or Nones where nothing predicts them."""
        if not self._decode or self.prefetch == "none" or self.full or nxt >= self.num_layers:
            return None, None
        scores = self._timed("predictor", self._predict, nxt, hidden)
        if scores is None:
            return None, None
        ids, ranked = ranked_predictions(scores, self.top_k)
        return ids, (nxt, ranked)

    def _prefetch(self) -> None:
        """Land the pending prefetch (SMoE §IV-C, PreScope Eqs. 6-7 under PreSched) through the step,
        and copy into slots only what lands inside the link window."""
        if self._next is None:
            return
        (nxt, ranked), self._next = self._next, None
        lane = self._lanes[nxt]
        before = self.cache.resident[nxt].copy()
        ins = self.step.prefetch(lane, lane, ranked, self._t)[0]
        self._move(nxt, before, ins[ins >= 0])

    def _predict(self, nxt: int, hidden: torch.Tensor | None) -> np.ndarray | None:
        """Scores [B, E] of layer ``nxt`` for this step's tokens."""
        if self.prefetch == "online":  # computed on the device and read with the layer's ids
            return self._next_scores
        if self._streaming:
            return self._predict_layer_ahead(nxt)[None, :]
        return None

    def _online_scores(self, nxt: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """SMoE §IV-C online prediction on the device: layer ``nxt``'s gate applied to this layer's gate input."""
        router = self.structure.layers[nxt].router
        w = getattr(router, "weight", None)
        if w is None or tuple(w.shape) != (self.num_experts, hidden.shape[-1]):
            return None
        with torch.no_grad():
            logits = torch.nn.functional.linear(hidden.to(w.dtype), w).float()
        return torch.softmax(logits, -1)

    def _observe(
        self, pos: int, ids: np.ndarray, w_host: torch.Tensor, hidden: torch.Tensor | None, width: int
    ) -> None:
        """Layer ``pos``'s routing (after substitution) and gate inputs to the predictor's stream."""
        gate = None
        if self._gate_rows and hidden is not None:
            gate = hidden.reshape(-1, width)[-self._gate_rows :].float().numpy()
        self._stream.observe(pos, ids, w_host.float().numpy(), gate)

    def _predict_layer_ahead(self, nxt: int) -> np.ndarray:
        """Layer-ahead predictor on the current token: what is known when layer nxt-1 finished."""
        return self._stream.predict_next(nxt)

    def _online_update(self) -> None:
        """PreScope §4.2.2: one small step on the token just decoded, whose routing is now known."""
        loss = self._stream.learn(self.config.online_lr)
        self.stats_.online_updates += 1
        self.stats_.online_loss = float(loss)

    # ------------------------------------------------------------------ results
    def reset_stats(self) -> None:
        self.stats_ = LiveStats()
        for v in self.step.stats.values():
            v[:] = 0.0

    def stats(self) -> dict[str, Any]:
        """Counters and rates since attach: hit rate, substitution rate, transfers, CPU experts, TPOT (measured, modeled)."""
        d = self.stats_.as_dict(self.step.stats)
        d.update(
            policy=self.policy.name,
            alpha=self.policy.alpha,
            balancer=self.policy.balancer,
            capacity=self.capacity,
            num_experts=self.num_experts,
            modeled_predictor_ms=self.step.predictor_ms,  # charged per layer before a prefetch (replay: predictor_ms)
            prefetch=self.prefetch,
            hardware=self.cost.profile,
            hardware_from=self.hardware_from,  # given, or the default chosen (this machine's where measured)
            device=str(self.stores[0].device),
            simulated_device=not self.stores[0].cuda,
            pinned_bytes=sum(st.pinned_bytes for st in self.stores),
            # layers whose host copies stayed pageable (over the pinning budget): each of their
            # transfers is a host copy into a pinned staging buffer, then the device copy
            staged_copies=sum(st.staged for st in self.stores),
            offload=self.config.offload,
            expert_dtype=self.precision.tag,
            expert_bytes=self.link_bytes,  # one expert as the link moves it (its precision's bytes)
            bytes_read=self.reader.bytes_read if self.reader is not None else 0,
            disk_reads=self.reader.reads if self.reader is not None else 0,
            # the disk as this run saw it, beside the profile's figure the modeled time used
            disk_read_gbps_observed=self.reader.observed_gbps() if self.reader is not None else None,
            direct_io=bool(self.reader.direct) if self.reader is not None else None,
            peak_rss_mb=peak_rss_mb(),
        )
        return d


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


def live_config(config: LiveConfig | None, settings: dict[str, Any]) -> LiveConfig:
    """``config`` (default: LiveConfig()) with ``settings`` by field name; an unknown name is refused."""
    names = [f.name for f in dataclasses.fields(LiveConfig)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise InputError(
            f"unknown live runtime setting {', '.join(unknown)}; LiveConfig's fields are {', '.join(names)}"
        )
    return LiveConfig(**settings) if config is None else dataclasses.replace(config, **settings)


def pinned_budget(pinned_mb: float | None) -> int:
    """Bytes of host memory the runtime may pin: ``pinned_mb``, or half of the memory available now."""
    if pinned_mb is not None:
        return int(pinned_mb * 2**20)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0  # unknown: pin nothing but the staging buffers
    return avail // 2


def _host_bytes(experts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in expert_params(experts).values())


def hot_table(predictor: Any, num_layers: int, num_experts: int) -> np.ndarray:
    """The [L, E] expert scores a static policy pins from (a frequency checkpoint's ``table``)."""
    name = predictor.name
    # the table is a frequency checkpoint's own field: no protocol declares it
    table = getattr(predictor, "table", None)
    shape = np.shape(table) if table is not None else None
    if shape != (num_layers, num_experts):
        has = "no table" if shape is None else f"a table of shape {shape}"
        raise InputError(
            f"policy static pins a hot-expert table of [{num_layers}, {num_experts}] expert scores; {name} "
            f"has {has}: pass a frequency checkpoint (moecast predictors eval frequency --save CKPT) or no predictor"
        )
    table = np.asarray(table, np.float64)
    if not np.isfinite(table).all():
        raise InputError(f"{name}'s hot-expert table holds non-finite scores; rebuild the checkpoint")
    return table


def _choose_prefetch(given: str, rule: Policy, predictor: Any, table: np.ndarray | None) -> str:
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
        raise InputError(_not_a_prefetcher(predictor))
    return prefetch


def _not_a_prefetcher(predictor: Any) -> str:
    """Why ``predictor`` cannot prefetch in the live runtime, and what to do with it instead."""
    name, horizon = getattr(predictor, "name", "?"), getattr(predictor, "horizon", "?")
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
    "(live planners are EAM, EAP or cascade checkpoints)"
)


def _not_a_planner(planner: Any) -> str:
    """Why ``planner`` cannot plan in the live runtime, and what to do with it instead."""
    name, horizon = getattr(planner, "name", "?"), getattr(planner, "horizon", "?")
    if horizon == "prompt-ahead":
        return f"planner {name} has no plan(prompt): {_MATCHES_ROUTING}"
    tail = "; pass it as the predictor (predictor=CKPT) to prefetch" if horizon == "layer-ahead" else ""
    return (
        f"planner {name} is {horizon}; a planner must be a prompt-ahead EAM, EAP or cascade checkpoint{tail}"
    )


def _substituted_weights(
    weights: torch.Tensor, old: np.ndarray, new: np.ndarray, probs: np.ndarray
) -> torch.Tensor:
    """Router weights for the substituted ids (host tensors in and out, in ``weights``' dtype): kept experts
    keep theirs, a substitute gets its probability scaled like the row's own weights (exact for softmax
    routers with or without top-k renormalisation)."""
    w = weights.float().numpy()
    rows = np.arange(len(old))[:, None]
    p_old = probs[rows, old]
    scale = w.sum(1, keepdims=True) / np.maximum(p_old.sum(1, keepdims=True), 1e-20)
    out = probs[rows, new] * scale
    # experts the router chose keep their exact weight
    match = new[:, :, None] == old[:, None, :]
    kept = match.any(2)
    src = match.argmax(2)
    out = np.where(kept, np.take_along_axis(w, src, 1), out)
    return torch.from_numpy(out.astype(np.float32)).to(weights.dtype)


@dataclass
class _ExpertsCall:
    """One experts call's inputs: device tensors, and the host copies :meth:`LiveRuntime._read_layer` read."""

    module: Any
    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    ids: np.ndarray
    kwargs: dict[str, Any]
    host: dict[str, torch.Tensor]
    w_host: torch.Tensor | None
    distinct: int  # distinct expert ids in ``ids``


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` with at most one synchronisation.

    Device tensors are copied without blocking into pinned buffers (from the caching host
    allocator) and one event is waited for; host tensors are returned as they are (detached).
    """
    tensors = [t.detach() for t in tensors]
    dev = [t for t in tensors if t.device.type == "cuda"]
    if not dev:
        return tensors
    out = []
    for t in tensors:
        if t.device.type != "cuda":
            out.append(t)
            continue
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        out.append(buf)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev[0].device))
    ev.synchronize()
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a synchronisation: pinned, then copied asynchronously."""
    if device.type != "cuda":
        return t
    # the caching host allocator keeps the pinned block until the copy that reads it has run
    return t.pin_memory().to(device, non_blocking=True)


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
    t0, w0 = time.perf_counter(), runtime._waited()
    try:
        return runtime.forward_layer(pos, module, hidden_states, top_k_index, top_k_weights, **kwargs)
    finally:
        runtime._layer_end = time.perf_counter()
        runtime._acc["layers"] += runtime._layer_end - t0
        runtime._acc["transfer_wait"] += runtime._waited() - w0


def attach(
    model: Any,
    config: LiveConfig | None = None,
    *,
    predictor: Any = None,
    planner: Any = None,
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
            top-capacity experts, as the replay's static table does.
        planner: A prompt-ahead predictor (EAM, EAP, cascade); ``rt.plan(prompt)`` then preloads its plan.
        router_pattern: A regex over module names naming the routers, where a model's routers are not
            found by transformers' ``_can_record_outputs`` (its experts modules must still use the
            experts interface: the runtime computes through them).
        settings: :class:`LiveConfig` fields by name.
    Errors (nothing is changed on the model): unsupported family, capacity below top-k, alpha outside [0, 1)
    or given to a policy that does not substitute, a predictor for another model or of the wrong kind.
    """
    cfg = live_config(config, settings)
    online_update, learn_plans = cfg.online_update, cfg.learn_plans
    if online_update and not (isinstance(predictor, StreamingPredictor) and predictor.learns_online):
        raise InputError("online_update needs a layer-ahead predictor with an update step (LLaPor)")
    if learn_plans and not isinstance(planner, LearningPlanner):
        given = "none was given" if planner is None else f"{getattr(planner, 'name', '?')} has no buffer"
        raise InputError(f"learn_plans needs a planner with a buffer (an EAM or cascade checkpoint); {given}")
    structure = find_moe_structure(model, router_pattern)
    without = [e.router_name for e in structure.layers if e.experts is None]
    if without:
        raise InputError(
            f"router_pattern={router_pattern!r} names routers with no experts module of transformers' experts "
            f"interface in their layer ({without[0]}); the live runtime computes through that module"
        )
    if predictor is not None:
        fp = model_info(model, structure, "").fingerprint
        if predictor.fingerprint and predictor.fingerprint != fp:
            raise InputError(
                f"the predictor was trained for model fingerprint {predictor.fingerprint}, this model is {fp}; "
                "train one on traces of this model"
            )
    if planner is not None:
        if not isinstance(planner, PromptPlanner) or planner.horizon != "prompt-ahead":
            raise InputError(_not_a_planner(planner))
        fp = model_info(model, structure, "").fingerprint
        if planner.fingerprint and planner.fingerprint != fp:
            raise InputError(
                f"the planner was built for model fingerprint {planner.fingerprint}, this model is {fp}; "
                "build one on traces of this model"
            )
    rt = LiveRuntime(model, structure, cfg, predictor)
    rt.planner = planner
    rt._attach()
    return rt
