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
   predictor's latency), and only those are copied into slots: a late prefetch is no hit. Under
   the prefetch gate each candidate carries its probability of use, from the predictor
   checkpoint's calibration (:mod:`moecast.runtime.core.gate`), as in the replay.

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
worker thread while the device computes the resident ones (:mod:`moecast.runtime.live.executor`).
The slow tier is one of runtime/tiers/registry.py's, behind one protocol
(:class:`moecast.runtime.tiers.base.ExpertTier`): host RAM (pinned within a budget) or an offload
directory read with direct I/O; the device (CUDA, or the CPU standing in for one) is a
:class:`moecast.runtime.tiers.base.Device`.

This module is the orchestration; the parts live beside it: config.py (LiveConfig), attach.py (the
hooks and :func:`attach`), prefetch.py (prediction sources), executor.py, transfer.py, stats.py.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from moecast.collect.models import MoEStructure, model_info
from moecast.predictors.base import BatchScorer, LearningPlanner, OnlineStream, PromptPlanner
from moecast.runtime.core import spec as core_spec
from moecast.runtime.core.cache import StaticTable, resolve_capacity
from moecast.runtime.core.policy import Policy
from moecast.runtime.core.step import layer_time
from moecast.runtime.live import transfer
from moecast.runtime.live.attach import Attachment, attach, live_experts_forward
from moecast.runtime.live.config import (
    BALANCE,
    LIVE_POLICIES,
    OFFLOAD,
    PREFETCH_SOURCES,
    LiveConfig,
    live_config,
)
from moecast.runtime.live.copies import SlotCopies
from moecast.runtime.live.executor import Executor, ExpertsCall
from moecast.runtime.live.graphs import ExpertGraphs
from moecast.runtime.live.prefetch import Prefetcher, choose_prefetch, gate_calibration, hot_table
from moecast.runtime.live.stats import BREAKDOWN, ForwardTimes, LiveStats, runtime_stats
from moecast.runtime.live.transfer import pinned_budget, to_device, to_host
from moecast.runtime.tiers.base import Device, TierSpec, slot_device
from moecast.runtime.tiers.expert_store import expert_params
from moecast.runtime.tiers.precision import Precision, TwoCopies, expert_nbytes

from moecast.errors import InputError, MoecastError

__all__ = [
    "BALANCE",
    "BREAKDOWN",
    "LIVE_POLICIES",
    "OFFLOAD",
    "PREFETCH_SOURCES",
    "LiveConfig",
    "LiveRuntime",
    "LiveStats",
    "attach",
    "hot_table",
    "live_config",
    "live_experts_forward",
    "pinned_budget",
    "to_device",
    "to_host",
]
# a forward's decode flag as the step reads it (never written)
_YES, _NO = np.array([True]), np.array([False])


@dataclass
class Forward:
    """The forward in progress: set when it starts, read and advanced by each of its MoE layers."""

    decode: bool = False
    streaming: bool = False  # the layer-ahead predictor's stream observes this forward's layers
    ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.int64))  # [n, L, k] its routing
    w: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))  # [n, L, k] its weights
    t: np.ndarray = field(default_factory=lambda: np.array([0]))  # the step as the cache's time
    clock: float = 0.0  # modeled time (ms): the sum of its layers' times
    # (layer, its ranked prefetch candidates, their P(used) under the gate), landed by _prefetch
    pending: tuple | None = None
    next_scores: np.ndarray | None = None  # the online prefetcher's next-layer scores, read with the ids


@dataclass
class Lanes:
    """Each layer's step arguments, made once: its lane, the next layer's lane, whether there is one,
    and whether the layer starts a token (the step only reads them)."""

    lane: list[np.ndarray]
    next: list[np.ndarray]
    has_next: list[np.ndarray]
    restart: list[np.ndarray]

    @classmethod
    def of(cls, L: int) -> Lanes:
        return cls(
            [np.array([pos]) for pos in range(L)],
            [np.array([min(pos + 1, L - 1)]) for pos in range(L)],
            [np.array([pos + 1 < L]) for pos in range(L)],
            [np.array([pos == 0]) for pos in range(L)],
        )


class LiveRuntime:
    """One model with the live runtime attached; create it with :func:`attach`.

    ``device`` (default: a CUDA device's streams where the slots are on one, else the CPU standing in
    for an accelerator) is where the slots live and how copies reach them.
    """

    def __init__(
        self,
        model: Any,
        structure: MoEStructure,
        config: LiveConfig,
        predictor: BatchScorer | None = None,
        planner: PromptPlanner | None = None,
        device: Device | None = None,
    ) -> None:
        self.model, self.structure, self.config, self.planner = model, structure, config, planner
        # CasMoE's buffer takes the planned prompts' prefill routing (attach refuses learn_plans without one)
        self.learner = planner if config.learn_plans and isinstance(planner, LearningPlanner) else None
        self.info = model_info(
            model, structure, getattr(model.config, "_name_or_path", "") or type(model).__name__
        )
        self.num_layers, self.num_experts, self.top_k = (
            len(structure.layers),
            self.info.num_experts,
            self.info.top_k,
        )
        # what one expert is on the link and in a slot: its bytes at the slow tier's precision (two
        # copies: a slot holds the high one; a demand read moves the low one's)
        prec = config.precision
        two = isinstance(prec, TwoCopies)
        self.link_bytes = link_bytes(prec, structure, self.info.expert_bytes)
        where = slot_device(model, structure, config.device)
        # an accelerator dequantizes one quantized copy into slots of the model's dtype (SlotDequantizer):
        # a capacity in bytes counts what a slot holds
        accelerated = (
            device.accelerated if device is not None else Device.accelerates(where, config.device_ops)
        )
        dequantized = prec.quantized and not two and accelerated
        E = self.num_experts
        self.slot_bytes = self.info.expert_bytes if dequantized else self.link_bytes
        self.capacity = (
            E
            if config.capacity is None
            else resolve_capacity(config.capacity, E, self.top_k, self.slot_bytes)
        )
        self.full = self.capacity >= E
        rule = config.rule()
        # static never inserts, so a predictor cannot prefetch under it: its predictor is the
        # hot-expert table that fills the slots once (docs/design.md: eviction static = hot-expert table)
        table = (
            hot_table(predictor, self.num_layers, E)
            if rule.eviction == "static" and predictor is not None
            else None
        )
        mode = choose_prefetch(config.prefetch, rule, predictor, table)
        cal = gate_calibration(rule, mode, predictor)
        self.prefetcher = Prefetcher(mode, predictor, structure, E, self.top_k, self.full, cal)
        self.prefetcher.warm()
        if config.online_update and not isinstance(self.prefetcher.stream, OnlineStream):
            raise InputError(
                "online_update=True needs a layer-ahead predictor with an update step (LLaPor) to prefetch"
            )
        # the policy as it runs here: a prefetch source given explicitly turns its prefetch on or off
        self.policy: Policy = dataclasses.replace(rule, prefetch="none" if mode == "none" else "predictor")
        core = core_spec.build_core(
            config, num_experts=E, num_layers=self.num_layers, expert_bytes=self.info.expert_bytes,
            link_bytes=self.link_bytes, predictor=predictor, policy=self.policy,
            prefetching=mode != "none" or planner is not None,  # a plan's preloads are counted as prefetches
            low_link_bytes=link_bytes(prec.low, structure, self.info.expert_bytes) if two else None,
        )  # fmt: skip
        self.cost, self.hardware_from = core.cost, core.hardware_from
        L = self.num_layers
        self.step = core.step(self.capacity, stat_base=np.zeros(L, dtype=np.int64), n_stats=L, compiled=True)
        self.step.warm()  # at attach, not in the first decode steps
        self.cache = self.step.cache
        self.lanes = Lanes.of(self.num_layers)
        self.device = device or Device.at(where, config.device_ops, link_gbps=_link_gbps(self.cost))
        spec = TierSpec(
            self.capacity, self.device, prec, pinned_budget(config.pinned_mb),
            capacity_arg=config.capacity, directory=config.offload_dir, io_threads=int(config.io_threads),
        )  # fmt: skip
        self.tier = config.tier.open(model, structure, spec)
        self.stores = self.tier.layers
        # two copies: the slots follow the step's copy of each expert (runtime/live/copies.py)
        self.copies = SlotCopies(self.step, self.stores, prec) if two else None
        self.stats_ = LiveStats()
        self.times = ForwardTimes(self.tier.waited, self.device.ops)
        self.executor = Executor(self.tier, self.device, self.cache, self.times, self.stats_)
        if config.graphs and self.device.accelerated:
            self.executor.graphs = ExpertGraphs(self.device.ops)
        if two:  # each copy's decode compute timed apart (stats: expert_compute_by_copy)
            self.executor.copy_tags = (prec.high.tag, prec.low.tag)
        self.fwd = Forward()
        self.router_logits: list[torch.Tensor | None] = [None] * self.num_layers  # kept by the router hooks
        self.attachment: Attachment | None = None  # attach() makes it
        self._step = 0  # forwards run so far
        self._learn_prompt: str | None = None  # a planned prompt whose prefill routing goes to the planner
        self.last_plan_branch: str | None = None
        # SMoE §4.1 parameter initialisation: each layer's slots hold experts 0..c-1, or static's hot table
        if config.warm or self.full or self.policy.eviction == "static":
            # replay's static choice: each layer's top-capacity experts by score, ties by lower id (full
            # residency holds every expert anyway)
            initial = (
                StaticTable(table).per_layer(self.capacity) if table is not None and not self.full else None
            )
            self.executor.place(np.arange(self.capacity) if initial is None else initial)

    def plan(self, prompt: str) -> str:
        """CasMoE planning before decoding: preload each layer's top planned experts into its slots.

        The attached prompt-ahead planner (EAM, EAP or their cascade) turns ``prompt`` into an [L, E]
        plan; each layer keeps its ``capacity`` best-planned experts resident (loads counted as
        transfers and ``plan_loads``, and as prefetches until their first use: one evicted unused is
        wasted bytes, as in the replay). Call it before ``generate``; returns the branch that answered.
        """
        if self.planner is None:
            raise MoecastError("no planner attached; pass planner=<prompt-ahead predictor> to attach()")
        if not prompt.strip():
            raise MoecastError("cannot plan an empty prompt")
        plan, branch = self.planner.plan(prompt)
        plan = np.asarray(plan, dtype=np.float32).reshape(self.num_layers, self.num_experts)
        want = np.argsort(-plan, axis=1, kind="stable")[:, : self.capacity]
        moved = np.zeros((self.num_layers, self.num_experts), bool)
        for pos in range(self.num_layers):
            new = want[pos][self.stores[pos].slot_of[want[pos]] < 0]
            if (
                self.copies is not None
            ):  # what a plan's preload reads is the high copy (the replay's set_copy)
                self.copies.mark(pos, new, False)
            loads = self.executor.preload(pos, want[pos])
            moved[pos, new] = True
            # counted as the replay's plan preloads are: inserted, and prefetched until their first use
            lane = self.lanes.lane[pos]
            self.step.add("plan_loads", lane, lane, [loads])
            self.step.add("pf_inserted", lane, lane, [loads])
        self.executor.placed(moved)
        self.last_plan_branch = branch
        if self.learner is not None:
            self._learn_prompt = prompt
        return branch

    def detach(self) -> None:
        """Restore the experts implementation the model had, remove every hook, close the tier."""
        if self.attachment is not None:
            self.attachment.remove()
            self.attachment = None
        self.executor.close()
        self.prefetcher.close()
        self.tier.close()

    def __enter__(self) -> LiveRuntime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # ------------------------------------------------------------------ a forward
    def begin_forward(self, ids: torch.Tensor | None, decode: bool) -> None:
        """A forward of the model starts (``ids``: its input ids; ``decode``: a decode step)."""
        n = ids.numel() if ids is not None else 0
        f = self.fwd
        f.decode, f.streaming = decode, self.prefetcher.begin(decode, ids)
        f.ids = np.zeros((n, self.num_layers, self.top_k), np.int64)
        f.w = np.zeros((n, self.num_layers, self.top_k), np.float32)
        f.clock, f.t, f.pending = 0.0, np.array([self._step]), None
        self.times.begin(decode)
        if decode and self.prefetcher.mode == "predictor":
            # the first layer's prefetch, predicted from what the token's start knows, sent out before the
            # model runs: its reads overlap the first layer's attention, the window the step gives it
            # (``t_attn - t_pred``); its time counts with the layers' (policy and predictor), not attention
            with self.times.layer():
                f.pending = self.prefetcher.next(0, True, None, self.times)[1]
                self._prefetch()
        elif self.copies is not None:  # no prefetch: the first layer's upgrades, read in its window
            with self.times.layer():
                self.copies.upgrade_ahead(0)

    def end_forward(self) -> None:
        """The forward ended: its wall and modeled time, the online update, the planner's lesson."""
        end = time.perf_counter()
        wall, s, f = (end - self.times.t0) * 1e3, self.stats_, self.fwd
        if f.decode:
            s.decode_steps += 1
            s.measured_decode_ms.append(wall)
            # the step's layers, then what follows the last one (the profile's step_ms)
            s.modeled_decode_ms.append(f.clock + self.cost.t_step)
            s.add_breakdown(wall, self.times)
            s.after_layers_decode_ms.append((end - self.times.layer_end) * 1e3)  # begin() set it to t0
            if f.streaming and self.config.online_update:
                s.online_updates += 1
                s.online_loss = self.prefetcher.learn(self.config.online_lr)
        else:
            s.prefill_steps += 1
            s.measured_prefill_ms += wall
            s.modeled_prefill_ms += f.clock
            if self._learn_prompt is not None and len(f.ids):
                self._learn_plan()
        self._step += 1

    def _learn_plan(self) -> None:
        """CasMoE's buffer: the planned prompt and its EP (Eq. 3), from the routing of its prefill,
        go to the planner (:meth:`EAM.observe`), which folds C of them into its index."""
        from moecast.predictors.casmoe import ep_matrix

        prompt, self._learn_prompt = self._learn_prompt, None
        ep = ep_matrix(self.fwd.ids, self.fwd.w, self.num_experts)
        folded = self.learner.observe(prompt, ep)
        self.stats_.plans_learned += 1
        self.stats_.plans_folded += int(bool(folded))

    # ------------------------------------------------------------------ the experts call
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
        f, n, lanes = self.fwd, top_k_index.shape[0], self.lanes
        lane = lanes.lane[pos]
        if self.full and not self.device.accelerated and self.executor.identity[pos]:
            return self._full_layer(pos, module, hidden, top_k_index, top_k_weights, kwargs)
        host = self._read_layer(pos, hidden, top_k_index, top_k_weights)
        decode = _YES if f.decode and not self.full else _NO
        ids, probs, w_host, weights, top_k_index = self._route(pos, host, top_k_index, top_k_weights, decode)
        # the layer's ids (and the prefill's weights, for a planner) into the forward's routing, and
        # to the layer-ahead predictor's stream while it observes
        if len(f.ids) == n:
            f.ids[:, pos] = ids
            if self._learn_prompt is not None:  # the planner reads the prefill's weights
                f.w[:, pos] = w_host.float().numpy()
        if f.streaming:
            self.prefetcher.observe(pos, ids, w_host, host.get("hidden"), hidden.shape[-1])
        nxt = pos + 1
        # PreSched sizes this layer's split by the next layer's predicted experts, so it predicts first;
        # the others predict once the layer's demand loads are on the link, as the step's window has it
        # (and on an accelerator once its experts are launched too)
        presched = self.policy.balancer == "presched"
        if presched:
            next_ids, f.pending = self.prefetcher.next(nxt, f.decode, f.next_scores, self.times)
        else:
            next_ids, f.pending = None, None
        before = self.cache.resident[pos].copy()
        o = self.step.layer(
            lane, lane, ids[None], f.t, probs, next_lanes=lanes.next[pos],
            has_next=lanes.has_next[pos], restart=lanes.restart[pos], next_predicted=next_ids,
            decode=decode, routed=True,
        )  # fmt: skip
        valid = o.uniq[0] >= 0
        uniq, counts, hit = o.uniq[0][valid], o.counts[0][valid], o.hit[0][valid]
        loads = o.load_ids[0][o.load_ids[0] >= 0]
        placed = loads[self.cache.resident[pos, loads]]  # loads the cache took, into the slots it freed
        self.executor.move(pos, before, placed)
        if self.copies is not None:  # what the step upgraded before this layer's experts: the high copy
            self.copies.sync(pos)
        cpu_ids = o.cpu_ids[0]
        early = not (cpu_ids >= 0).any()

        # the next layer's prediction: on an accelerator on the prediction thread while the host launches
        # this layer's experts, joined after the launch (the prefetch could not start before it anyway);
        # on the CPU, which computes them synchronously, before them, so that a prefetch's reads overlap them
        def window() -> None:
            # the next layer's window opens: its prefetch, or with none (two copies) its upgrades
            if self.copies is not None and f.pending is None:
                self.copies.upgrade_ahead(nxt)
            self._prefetch()

        def ahead() -> None:
            if not presched:
                f.pending = predicted()[1]
            if early:
                # the next layer's prefetch is queued now, behind this layer's demand loads, so its
                # transfers run while this layer computes (the step's window opens when the link is free,
                # not after the experts' compute); a CPU set's reads come first, so it waits for them
                window()

        after_launch = self.device.accelerated
        if after_launch and not presched:  # predicted on its thread while the host launches the experts
            predicted = self.prefetcher.next_async(nxt, f.decode, f.next_scores, self.times)
        else:
            predicted = functools.partial(self.prefetcher.next, nxt, f.decode, f.next_scores, self.times)
        if not after_launch:
            ahead()
        # experts of the call, as np.unique(ids) counts them (the router gives no padding ids)
        distinct = len(uniq) if ids.min() >= 0 else len(np.unique(ids))
        call = ExpertsCall(
            module, hidden, top_k_index, weights, ids, kwargs, host, w_host, distinct, f.decode, self._step
        )
        # loads it did not take stream through the slots (more misses than slots: a long prefill); under
        # static, which never inserts, the step's streamed misses are computed from host memory here
        streamed = loads[~np.isin(loads, placed)] if len(placed) < len(loads) else loads[:0]
        if self.copies is not None and len(streamed):  # demand loads too: the low copy
            self.copies.mark(pos, streamed, True)
        out, to_cpu, cpu_part = self.executor.run(pos, call, uniq[hit], placed, streamed, uniq, cpu_ids)
        if after_launch:  # the prefetch still queues behind the demand copies, which went out in move
            ahead()
        out = self.executor.join(call, out, to_cpu, cpu_part, uniq, counts)
        f.clock += float(o.layer_t[0])
        if not early:
            window()
        return out

    def _read_layer(
        self, pos: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """What this layer's decisions read on the host, in one device-to-host synchronisation.

        The routing ids must be read; the weights, router probabilities, hidden rows (gate inputs for
        the predictor, inputs of CPU experts) and the online prefetcher's next-layer scores are
        computed on the device first and travel with them, so no later read stalls the layer.
        """
        f, n, pf = self.fwd, index.shape[0], self.prefetcher
        want: dict[str, torch.Tensor] = {"ids": index}
        substituting = f.decode and self.policy.substituting and not self.full
        if substituting or self.cache.policy == "score" or pf.mode != "none":
            want["probs"] = router_probs(self.router_logits[pos], self.structure, pos, n)
        # whether this layer may compute experts on the CPU (static never loads; balancers split decode misses)
        cpu = not self.full and (
            self.policy.eviction == "static" or (f.decode and self.policy.balancer != "none")
        )
        if len(f.ids) == n or f.streaming or substituting or cpu:
            want["w"] = weights
        if (f.streaming and pf.gate_rows) or cpu:
            want["hidden"] = hidden
        f.next_scores = None
        if pf.mode == "online" and pf.predicts(f.decode, pos + 1):
            scores = self.times.timed("predictor", pf.online_scores, pos + 1, hidden)
            if scores is not None:
                want["next"] = scores
        # the one wait for the device in a layer: on a GPU it holds the queued attention and router
        # (timed directly: no transfer wait can fall inside it, so timed()'s tier sums are not needed)
        t0 = time.perf_counter()
        got = dict(zip(want, transfer.to_host(list(want.values()))))
        self.times.acc["device_sync"] += time.perf_counter() - t0
        self.stats_.host_syncs += 1
        if "next" in got:
            f.next_scores = got["next"].numpy()
        return got

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
        if self.fwd.decode:
            self.stats_.routed += ids.size
        lane = self.lanes.lane[pos]
        ids3 = ids[None]
        routed = self.step.route(lane, lane, ids3, probs, decode)
        if routed is ids3 or np.array_equal(routed[0], ids):
            return ids, probs, w_host, top_k_weights, top_k_index
        routed = routed[0]
        w_host = _substituted_weights(w_host, ids, routed, probs[0])
        weights = transfer.to_device(w_host, top_k_weights.device)
        top_k_index = transfer.to_device(torch.from_numpy(routed).to(top_k_index.dtype), top_k_index.device)
        return routed, probs, w_host, weights, top_k_index

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
        f, n = self.fwd, top_k_index.shape[0]
        used = int(torch.unique(top_k_index).numel())
        if self._learn_prompt is not None and len(f.ids) == n:  # the planner learns the prefill
            f.ids[:, pos] = top_k_index.detach().cpu().numpy()
            f.w[:, pos] = top_k_weights.detach().float().cpu().numpy()
        lane = np.array([pos])
        self.step.add("uses", lane, lane, [top_k_index.numel()])
        self.step.add("hits", lane, lane, [top_k_index.numel()])
        if f.decode:
            self.stats_.routed += top_k_index.numel()
        layer_t, _ = layer_time(self.cost, np.array([used]), np.zeros(1), 0.0, 0.0)
        f.clock += float(layer_t[0])
        self.step.add("time", lane, lane, layer_t)
        return self.executor.full(pos, module, hidden, top_k_index, top_k_weights, kwargs)

    def _prefetch(self) -> None:
        """Land the pending prefetch (SMoE §IV-C, PreScope Eqs. 6-7 under PreSched) through the step,
        and copy into slots only what lands inside the link window."""
        if self.fwd.pending is None:
            return
        (nxt, ranked, prob), self.fwd.pending = self.fwd.pending, None
        lane = self.lanes.lane[nxt]
        before = self.cache.resident[nxt].copy()
        ins = self.step.prefetch(lane, lane, ranked, self.fwd.t, prob)[0]
        self.executor.move(nxt, before, ins[ins >= 0], prefetch=True)
        if self.copies is not None:  # the upgrades in the window the prefetches left idle
            self.copies.sync(nxt)

    # ------------------------------------------------------------------ results
    def reset_stats(self) -> None:
        self.stats_.clear()
        for v in self.step.stats.values():
            v[:] = 0.0

    def stats(self) -> dict[str, Any]:
        """Counters and rates since attach: hit rate, substitution rate, transfers, CPU experts, TPOT (measured, modeled)."""
        return runtime_stats(self)


def link_bytes(prec: Precision, structure: MoEStructure, model_bytes: int) -> int:
    """One expert's bytes on the link at ``prec``: the precision's stored parts where it is quantized,
    else the model's (``model_bytes``, the replay's figure for the same TraceSet)."""
    if not prec.quantized:
        return int(model_bytes)
    first = structure.layers[0].experts
    return expert_nbytes(prec, expert_params(first), bool(getattr(first, "is_transposed", False)))


def _link_gbps(cost: Any) -> float | None:
    """The link's rate (GB/s) a CostModel moves an expert at, for a simulated device's link
    (None where the profile has no link or a free one)."""
    if not 0 < cost.t_io < float("inf"):
        return None
    return cost.expert_bytes / (cost.t_io * 1e-3) / 1e9


def router_probs(logits: torch.Tensor | None, structure: MoEStructure, pos: int, n: int) -> torch.Tensor:
    """Layer ``pos``'s router probabilities for its last ``n`` tokens, where the logits are (the device)."""
    if logits is None:
        raise MoecastError(f"MoE layer {structure.layers[pos].layer} ran its experts without its router hook")
    logits = logits.detach().reshape(-1, logits.shape[-1])[-n:].float()
    if structure.router_probs_kind == "sigmoid-normalised":
        s = torch.sigmoid(logits)
        return s / s.sum(-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


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
