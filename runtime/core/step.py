"""One MoE layer of an offloaded model, as the replay and the live runtime both model it.

A :class:`LayerStep` holds many independent caches ("lanes": a layer of a cold stream at one capacity
in the replay, a layer of the model in the live runtime) and their :class:`LinkClock`. For the lanes
that run a layer now it does, in this order:

1. **Prefetch** (:meth:`LayerStep.prefetch`, before the layer's experts run): the predicted experts
   not resident, best first, are moved over the link in the window the previous layer left free
   (``free``, below). Only transfers that finish inside it land and count as resident (SMoE Sec. 5.2:
   a prefetch never delays a layer's own loads; the rest are not started). Under PreSched the layer
   before chose a count (Eqs. 6-7); one more may be started that does not finish in the window: it
   delays this layer's demand loads by ``delay`` and its expert is not resident now (Premise 3).
   A lane no PreSched decision reached (the first layer) takes as many as fit. Under a policy's
   ``late_prefetch`` one more than fits is started and lands late, resident: it delays the layer's
   demand loads by ``delay`` and its expert computes no sooner than ``delay + t_g`` (``stall``).
   Where a transfer costs the step beside it (``t_rc > 0``: the read's compute time where a CPU fast
   tier reads a disk, the host's issue time of a copy to an accelerator), each started transfer
   takes ``t_rc`` from the layer it runs beside: the layer's time grows by ``started * t_rc`` (``rc``).
2. **Substitution** (SMoE Algorithm 1, :func:`moecast.runtime.core.substitution.substitute`) of the
   routed experts against the resident ones, when the policy substitutes with ``alpha > 0``
   (:meth:`LayerStep.route`).
3. **Access**: the union of the lane's routed experts (one access: docs/design.md, replay semantics);
   hits are uses whose expert is resident.
4. **Misses**: the balancer splits them into demand loads and a CPU set (``none``: load all,
   ``smoe``: Algorithm 2, ``presched``: PreSched Eq. 5, ``cpu``: none loaded). Loads are inserted
   (evicting by the policy, the layer's own experts shielded).
5. **Layer time** with ``n_dev`` experts on the device (hits + loads), ``n_load`` demand loads
   and the CPU set's ``n_cpu`` experts taking ``t_cpu = sum(beta * m + C)`` (PreScope Eq. 3)::

       link    = delay + n_load * t_io
       dev     = max(n_dev * t_g,  link + t_g * [n_load > 0])
       layer_t = t_attn + max(dev, t_cpu)

   Attention first; then the device, the serial link and the CPU run in parallel. The last demand
   load's expert computes once it lands (``+ t_g``); the others overlap with the link. Where the
   profile's tiers say otherwise (:class:`moecast.runtime.core.cost_model.HardwareProfile`), with a CPU
   set (``n_cpu > 0``):

   - ``slow_tier: disk``: the CPU set's weights are read over the link behind the demand loads
     (``link += n_cpu * t_io``) and each expert computes once read, so the CPU finishes at
     ``cpu_end = max(first_read + t_cpu, link + t_cpu / n_cpu)`` (``first_read`` = the loads'
     link + ``t_io``) instead of ``t_cpu``;
   - ``fast_tier: cpu``: the same cores compute both sets, so their times add:
     ``layer_t = t_attn + max(dev + t_cpu, cpu_end)`` instead of ``t_attn + max(dev, cpu_end)``;
     with ``t_rc > 0`` the cores also owe each read of the layer its share, so the expert phase
     lasts at least ``n_dev * t_g + t_cpu + (n_load + n_cpu) * t_rc`` (the reads' CPU time and the
     experts' together), and the layer adds the prefetches' ``rc`` (step 1);
   - ``fast_tier: device`` with ``t_rc > 0`` (the profile's ``load_host_ms``): the host issues each
     demand load before it launches anything else, so the layer adds ``n_load * t_rc``, and its
     prefetches' ``rc`` (step 1): ``layer_t = t_attn + max(dev, cpu_end) + n_load * t_rc``.
6. **Window** for the next layer's prefetch: its prediction is made once this layer has routed and
   takes ``t_pred`` (the predictor's latency); its transfers start when both it and this layer's
   link are done, and must land before the next layer's experts start, after its attention::

       free(next) = layer_t - max(link, t_pred)        free(first layer) = t_attn - t_pred

   (``layer_t`` with its prefetches' ``rc``: the attention the next layer's reads run beside is
   slowed by them as this layer's was by its own.)

Two expert copies (``copies``, :mod:`moecast.runtime.core.mixed`): demand loads and the CPU set's
reads take the low copy's ``t_io`` in step 5, and each device expert computes at the copy in its
slot (``n_dev * t_g`` is ``n_high * t_g(high) + (n_dev - n_high) * t_g(low)``, a demand load's at
the low copy's), the prefetches in the window land as many as fit at the low copy's ``t_io`` in
step 1 and the time left turns the most confident into high copies (``mixed``, rule 2), and link
time the window leaves idle reads high copies over resident low ones (upgrades). Under
the prefetch gate (``policy.gate``, :mod:`moecast.runtime.core.gate`) step 1's late transfer is
started only where its calibrated probability of use pays for the time it is late. The compiled
one-lane path (:mod:`moecast.runtime.core.step_kernels`) takes both, with the same decisions.

Prefill (SMoE Sec. 4.1: prefill loads what it needs): a row that is not a decode step is neither
substituted nor balanced (every miss is loaded; under static, which never loads, on the CPU), and
its caller asks no prefetch for it.

7. **Statistics** per lane group (the replay: capacity x layer; live: layer), under the names of
   :class:`moecast.runtime.replay.engine.ReplayResult`.

Everything is vectorised over the lanes that run now (``n`` rows, ``B`` token slots each, ``-1``
for an idle slot), so one call moves every layer and every cold stream of a replay wavefront, and the
live runtime calls it with one lane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from moecast.predictors.base import BatchScorer
from moecast.runtime.core import eviction, kernels
from moecast.runtime.core import step_kernels as sk
from moecast.runtime.core.balancer import two_pointer, two_pointer_split
from moecast.runtime.core.cache import ExpertCache
from moecast.runtime.core.cost_model import CostModel, HardwareProfile
from moecast.runtime.core.mixed import LOW, Copies, plan_prefetch, upgrade_count
from moecast.runtime.core.policy import Policy
from moecast.runtime.core.prefetch import top_predictions
from moecast.runtime.core.presched import schedule
from moecast.runtime.core.step_kernels import STATS
from moecast.runtime.core.substitution import substitute

from moecast.errors import InputError


@dataclass
class LinkClock:
    """Per lane: the link time free before its next expert compute starts, and what a prefetch left."""

    free: np.ndarray  # the prefetch window of the lane's next layer (ms)
    delay: np.ndarray  # link time a started, unfinished prefetch takes from the next layer's demand loads
    pf_n: np.ndarray  # PreSched's prefetch count for the lane's next layer (-1: none decided, as many as fit)
    rc: np.ndarray  # compute time the started prefetches' reads take from the lane's next layer (ms)

    @classmethod
    def start(cls, lanes: int, first_window: float) -> LinkClock:
        return cls(
            np.full(lanes, first_window), np.zeros(lanes), np.full(lanes, -1, dtype=np.int64), np.zeros(lanes)
        )


@dataclass
class LayerOutcome:
    """What one call of :meth:`LayerStep.layer` decided, per row."""

    ids: np.ndarray  # [n, B, k] routed ids after substitution (-1: idle slot)
    uniq: np.ndarray  # [n, M] the access: distinct experts (-1 padded)
    counts: np.ndarray  # [n, M] tokens per expert
    hit: np.ndarray  # [n, M] resident when the layer ran
    load_ids: np.ndarray  # [n, M] demand loads (-1 padded)
    cpu_ids: np.ndarray  # [n, M] experts computed on the CPU (-1 padded)
    layer_t: np.ndarray  # [n] modeled layer time (ms)
    link: np.ndarray  # [n] link busy time after attention (ms)


@dataclass
class LayerStep:
    """The per-layer step over ``cache``'s lanes; see the module docstring for the rules.

    ``stat_base`` [lanes]: each lane's first statistics slot (its slot for a row is ``stat_base +
    layer``; ``n_stats`` slots in all). ``prefetching``: a predictor (or a plan) may insert experts,
    so prefetch use is recorded. ``compiled``: calls with one lane and one token (the live runtime's
    decode steps) run as the compiled kernels of :mod:`moecast.runtime.core.step_kernels` (the same
    decisions, statistics and times); the cost model and the predictor latency are then fixed.
    ``copies``: the slow tier holds two copies of each expert (:mod:`moecast.runtime.core.mixed`):
    ``cost`` is then the high copy's (prefetches, upgrades) and ``copies.low`` a demand read's.
    """

    cache: ExpertCache
    policy: Policy
    cost: CostModel
    num_experts: int
    num_layers: int
    stat_base: np.ndarray
    n_stats: int
    shared: bool = False
    prefetching: bool = False
    predictor_ms: float = 0.0
    compiled: bool = False
    copies: Copies | None = None
    clock: LinkClock = field(init=False)
    stats: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        lanes = len(self.stat_base)
        # the compiled kernels write a row's statistics at stat_base + layer unchecked: a slot past
        # the table would corrupt the heap, not raise
        if lanes and (
            int(self.stat_base.min()) < 0 or int(self.stat_base.max()) + self.num_layers > self.n_stats
        ):
            raise ValueError(
                f"LayerStep: stat_base spans {int(self.stat_base.min())}..{int(self.stat_base.max())}, and each "
                f"lane's {self.num_layers} layers need slots up to stat_base + {self.num_layers - 1} within "
                f"n_stats = {self.n_stats}; give each lane its own run of {self.num_layers} slots"
            )
        self.clock = LinkClock.start(lanes, self.first_window)
        self.table = np.zeros((len(STATS), self.n_stats))  # the statistics, one row each
        self.stats = {name: self.table[i] for i, name in enumerate(STATS)}
        # PreSched's R_hit per lane: prefetched experts used / landed, from a prior of 1 / 2
        self.r_used = np.ones(lanes)
        self.r_landed = np.full(lanes, 2.0)
        # a demand read's cost: the low copy's under mixed precision (mixed.py, rule 1)
        self.demand = self.copies.low if self.copies is not None else self.cost
        if self.copies is not None:
            if self.policy.balancer == "presched":
                raise InputError(
                    f"policy {self.policy.name!r}: PreSched sizes its prefetches with one transfer time, so it "
                    "takes one expert precision; with two copies use prefetch, prefetch-late or prefetch-gated"
                )
            # each lane's resident experts at the low copy (read only while resident: every insert writes it)
            self.low = np.zeros((lanes, self.cache.N + 1), dtype=bool)
            self.upgrading = self.demand.expert_bytes < self.cost.expert_bytes
            self._windowed = np.zeros(lanes, dtype=bool)  # a prefetch used the lane's window this step
        if self.compiled:
            self._one = OneLane(self)

    def warm(self) -> None:
        """Load the compiled kernels this step's decode path calls: numba compiles them (or reads its
        cache) at their first call, which would otherwise land in the first decode steps' time."""
        if self.compiled:
            self._one.ep or self._one._load()
        else:
            self.cache._kernels()

    @property
    def first_window(self) -> float:
        """The prefetch window of a token's first layer: its attention, less the prediction."""
        return self.cost.t_attn - (self.predictor_ms if self.prefetching else 0.0)

    def add(self, name: str, lanes: np.ndarray, layer: np.ndarray, values: np.ndarray) -> None:
        """Add per-row ``values`` to statistic ``name`` in the rows' slots."""
        if len(lanes) == 1:  # the live runtime's one lane: no bincount over every slot
            self.stats[name][self.stat_base[lanes[0]] + layer[0]] += float(values[0])
            return
        idx = self.stat_base[lanes] + layer
        self.stats[name] += np.bincount(
            idx, weights=np.asarray(values, dtype=np.float64), minlength=self.n_stats
        )

    # ------------------------------------------------------------------ 1. prefetch
    def prefetch(
        self,
        lanes: np.ndarray,
        layer: np.ndarray,
        ranked: np.ndarray,
        t: np.ndarray,
        prob: np.ndarray | None = None,
    ) -> np.ndarray:
        """Land the lanes' prefetches for the layer they run next; -> [n, M] the experts inserted.

        ``ranked`` [n, M]: the predicted experts, best first, distinct (-1 padded; a shared cache's
        items). The predicted ones are shielded: a prefetch never evicts another predicted expert.
        ``prob`` [n, M]: their calibrated probability of use (the prefetch gate's, needed under it).
        """
        gate = self.policy.gate != "none"
        if gate and prob is None:
            raise InputError(
                f"policy {self.policy.name!r} gates its prefetches on calibrated probabilities, which this "
                "caller did not give (the replay calibrates them on val); use prefetch-late"
            )
        if self.compiled and len(lanes) == 1 and not self.shared:
            return self._one.prefetch(lanes, layer, ranked, t, prob)
        if self.copies is not None or gate:
            return self._prefetch_copies(lanes, layer, ranked, t, prob)
        cache, clock = self.cache, self.clock
        nonres = (ranked >= 0) & ~cache.lookup(lanes, ranked)
        cand = _compact(np.where(nonres, ranked, -1))
        want, landed, started, clock.delay[lanes] = landing(
            (cand >= 0).sum(1),
            clock.pf_n[lanes],
            clock.free[lanes],
            self.cost.t_io,
            self.policy.balancer,
            self.policy.late_prefetch,
        )
        clock.rc[lanes] = started * self.cost.t_rc
        take = np.arange(cand.shape[1])[None, :] < landed[:, None]
        ins = cache.insert(lanes, np.where(take, cand, -1), shield=ranked, prefetch=True, t=t)
        self.r_landed[lanes] += landed
        self.add("pf_inserted", lanes, layer, ins.sum(1))
        self.add("pf_issued", lanes, layer, want)
        self.add("pf_landed", lanes, layer, landed)
        self.add("pf_started", lanes, layer, started)
        return np.where(ins, cand, -1)

    def _prefetch_copies(
        self, lanes: np.ndarray, layer: np.ndarray, ranked: np.ndarray, t: np.ndarray, prob: np.ndarray | None
    ) -> np.ndarray:
        """:meth:`prefetch` over two copies and / or under the gate (:func:`mixed.plan_prefetch`),
        then the upgrades in the window's idle link time."""
        gate = self.policy.gate != "none"
        cache, clock = self.cache, self.clock
        nonres = (ranked >= 0) & ~cache.lookup(lanes, ranked)
        order = np.argsort(~nonres, axis=1, kind="stable")
        cand = np.take_along_axis(np.where(nonres, ranked, -1), order, 1)
        p = np.take_along_axis(np.where(nonres, prob, 0.0), order, 1) if prob is not None else None
        pl = plan_prefetch(
            (cand >= 0).sum(1), clock.pf_n[lanes], clock.free[lanes], self.cost.t_io, self.demand.t_io,
            self.policy.balancer, self.policy.late_prefetch, gate, p,
        )  # fmt: skip
        landed, started = pl.landed, pl.started
        clock.delay[lanes] = pl.delay
        n_lo = pl.n_low + (pl.late == LOW)
        clock.rc[lanes] = (started - n_lo) * self.cost.t_rc + n_lo * self.demand.t_rc
        col = np.arange(cand.shape[1])[None, :]
        take = col < landed[:, None]
        ins = cache.insert(lanes, np.where(take, cand, -1), shield=ranked, prefetch=True, t=t)
        if self.copies is not None:
            hi_end = pl.n_high[:, None]
            low_col = (col >= hi_end) & ((col < (pl.n_high + pl.n_low)[:, None]) | (pl.late == LOW)[:, None])
            self._mark(lanes, cand, ins, low_col)
            self._upgrade(lanes, layer, pl.idle, ranked)
            self._windowed[lanes] = True
        self.r_landed[lanes] += landed
        self.add("pf_inserted", lanes, layer, ins.sum(1))
        self.add("pf_issued", lanes, layer, pl.issued)
        self.add("pf_landed", lanes, layer, landed)
        self.add("pf_started", lanes, layer, started)
        self.add("pf_low", lanes, layer, n_lo)
        self.add("pf_refused", lanes, layer, pl.refused)
        return np.where(ins, cand, -1)

    def _mark(self, lanes: np.ndarray, ids: np.ndarray, inserted: np.ndarray, low: np.ndarray | bool) -> None:
        """Record the copy of the experts just read into the lanes' slots (``inserted`` of ``ids``)."""
        if self.copies is None:
            return
        rows = np.broadcast_to(lanes[:, None], ids.shape)[inserted]
        self.low[rows, ids[inserted]] = np.broadcast_to(low, ids.shape)[inserted]

    def set_copy(self, lanes: np.ndarray, ids: np.ndarray, inserted: np.ndarray) -> None:
        """Experts a caller inserted itself (a plan's preload) were read at the high copy."""
        self._mark(lanes, ids, inserted, False)

    def _upgrade(
        self, lanes: np.ndarray, layer: np.ndarray, idle: np.ndarray, ranked: np.ndarray | None
    ) -> None:
        """Rule 4 of :mod:`moecast.runtime.core.mixed`: read high copies over resident low ones in
        ``idle`` ms of link time, the predicted (``ranked``, best first) first, then the most
        recently used, never a prefetched expert not used yet. Each read's compute share ``t_rc``
        joins the lane's next layer, as a prefetch's does."""
        if not self.upgrading:
            return
        cache, N = self.cache, self.cache.N
        low = self.low[lanes, :N] & cache.resident[lanes] & ~cache.prefetched[lanes]
        n_up = upgrade_count(idle, self.cost.t_io, low.sum(1))
        if not n_up.any():
            return
        rows = np.flatnonzero(n_up > 0)
        ln, low = lanes[rows], low[rows]
        key = cache.last[ln].astype(np.float64)
        if ranked is not None:
            r = ranked[rows]
            M = r.shape[1]
            first = np.full(key.shape, -np.inf)
            rr = np.broadcast_to(np.arange(len(rows))[:, None], r.shape)
            ok = r >= 0
            # predicted experts rank above any recency (a time < 2**52), in their order (2**52 + rank
            # is exact in float64, where 2**62 + rank would round every rank to one key)
            first[rr[ok], r[ok]] = 2.0**52 + (M - np.broadcast_to(np.arange(M), r.shape)[ok])
            key = np.maximum(key, first)
        order = np.argsort(-np.where(low, key, -np.inf), axis=1, kind="stable")
        k = int(n_up[rows].max())
        sel = order[:, :k]
        pick = np.arange(k)[None, :] < n_up[rows][:, None]
        self.low[np.broadcast_to(ln[:, None], sel.shape)[pick], sel[pick]] = False
        # a read's share of the cores (t_rc: a CPU fast tier reading a disk), as a prefetch's
        self.clock.rc[ln] += n_up[rows] * self.cost.t_rc
        self.add("upgrades", ln, layer[rows], n_up[rows])

    def upgrade_quiet(self, lanes: np.ndarray, layer: np.ndarray) -> None:
        """A lane no prefetch reached upgrades in its whole window (mixed.py, rule 4): :meth:`layer`
        does it first, or a caller that reads the upgrades when the window opens (the live runtime,
        after the layer before) does it then, and the layer does not again."""
        if self.copies is None:  # one copy: nothing to upgrade (and no flags for the kernels to index)
            return
        if self.compiled and len(lanes) == 1 and not self.shared:
            self._one.upgrade_quiet(lanes, layer)
            return
        quiet = ~self._windowed[lanes]
        if quiet.any():
            self._upgrade(lanes[quiet], layer[quiet], self.clock.free[lanes[quiet]], None)
            self._windowed[lanes[quiet]] = True

    # ------------------------------------------------------------------ 2-7. the layer
    def layer(
        self,
        lanes: np.ndarray,
        layer: np.ndarray,
        ids: np.ndarray,
        t: np.ndarray,
        probs: np.ndarray | None = None,
        next_lanes: np.ndarray | None = None,
        has_next: np.ndarray | None = None,
        restart: np.ndarray | None = None,
        next_predicted: np.ndarray | None = None,
        next_use: np.ndarray | None = None,
        decode: np.ndarray | None = None,
        routed: bool = False,
    ) -> LayerOutcome:
        """Run layer ``layer`` [n] of ``lanes`` [n] on routed ``ids`` [n, B, k] at lane time ``t`` [n].

        ``probs`` [n, B, E] router probabilities (substitution, score eviction); ``next_lanes`` [n]
        the lanes that run the next layer of the same tokens where ``has_next`` (their window is
        written), ``restart`` the rows whose lane runs a first layer next (its window is the first
        layer's); ``next_predicted`` [n, M'] the next layer's predicted experts (PreSched's E_next);
        ``next_use`` [n, B * k] when each use's expert is used next (belady); ``decode`` [n] the
        rows that are decode steps (None: all); ``routed``: ``ids`` went through :meth:`route`.
        """
        if self.compiled and self._one.takes(lanes, ids, probs, next_use):
            return self._one.layer(
                lanes, layer, ids, t, probs, next_lanes, has_next, restart, next_predicted, decode, routed
            )
        pol = self.policy
        n, B, _k = ids.shape
        if self.copies is not None:
            self.upgrade_quiet(lanes, layer)
            self._windowed[lanes] = False
        delay = self.clock.delay[lanes].copy()
        rc = self.clock.rc[lanes].copy()
        self.clock.delay[lanes] = 0.0
        self.clock.rc[lanes] = 0.0
        valid = (ids >= 0).any(2)
        if not routed:
            ids = self.route(lanes, layer, ids, probs, decode)
        uniq, counts, hit, low = self._access(lanes, layer, ids, decode)
        miss = (uniq >= 0) & ~hit
        n_miss = miss.sum(1)
        n_load, load_ids, cpu_ids, t_cpu = self._split(
            lanes, uniq, counts, miss, delay, B == 1, decode, next_lanes, has_next, next_predicted
        )
        cache = self.cache
        loaded = cache.insert(lanes, load_ids, shield=uniq, t=None)
        self._mark(lanes, load_ids, loaded, True)  # a demand miss reads the low copy
        cache.touch(lanes, uniq, t)
        if next_use is not None:
            cache.set_next_use(lanes, self._items(layer, ids).reshape(n, -1), next_use)
        if pol.eviction == "score":
            sc = (probs.astype(np.float32) * valid[:, :, None]).sum(1) / np.maximum(valid.sum(1), 1)[:, None]
            cache.observe_scores(lanes, sc)
        n_dev = (hit & (uniq >= 0)).sum(1) + n_load
        stall = delay if pol.late_prefetch else None
        high = None
        if self.copies is not None:
            # hits on a high copy compute at its time; the rest (low hits, demand loads) at the low's
            high = ((hit & (uniq >= 0) & ~low).sum(1), self.cost.t_g)  # low: False where not hit
        layer_t, link = layer_time(self.demand, n_dev, n_load, delay, t_cpu, n_miss - n_load, stall, high)
        layer_t = layer_t + rc
        self._advance(lanes, layer_t, link, next_lanes, has_next, restart)
        self.add("loads", lanes, layer, n_load)
        self.add("cpu", lanes, layer, n_miss - n_load)
        self.add("time", lanes, layer, layer_t)
        return LayerOutcome(ids, uniq, counts, hit, load_ids, cpu_ids, layer_t, link)

    def _items(self, layer: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Cache items of expert ids (a shared cache numbers them layer * E + expert)."""
        if not self.shared:
            return ids
        off = (layer * self.num_experts).reshape((-1,) + (1,) * (ids.ndim - 1))
        return np.where(ids >= 0, ids + off, -1)

    def route(
        self,
        lanes: np.ndarray,
        layer: np.ndarray,
        ids: np.ndarray,
        probs: np.ndarray | None,
        decode: np.ndarray | None = None,
    ) -> np.ndarray:
        """Step 2: the rows' routed ids [n, B, k] after substitution (decode rows, substituting policy)."""
        if not self.policy.substituting:
            return ids
        if self.compiled and self._one.takes(lanes, ids, probs, None) and (decode is None or decode[0]):
            routed = self._one.route(lanes, layer, ids, probs)
            if routed is not None:
                return routed
        valid = (ids >= 0).any(2)
        if decode is not None:
            valid = valid & decode[:, None]
        return np.where(valid[:, :, None], self._substitute(lanes, layer, ids, probs, valid), ids)

    def _substitute(
        self, lanes: np.ndarray, layer: np.ndarray, ids: np.ndarray, probs: np.ndarray, valid: np.ndarray
    ) -> np.ndarray:
        """SMoE Algorithm 1 against the lane's resident set (the slots of a row share the set C)."""
        n, B, k = ids.shape
        E = self.num_experts
        res = self.cache.resident[np.repeat(lanes, B)]
        if self.shared:
            res = res.reshape(n * B, self.num_layers, E)[np.arange(n * B), np.repeat(layer, B)]
        new_ids, nsub = substitute(
            probs.reshape(n * B, E).astype(np.float32),
            ids.reshape(n * B, k),
            res,
            self.policy.alpha,
            group=np.repeat(np.arange(n), B),
        )
        self.add("subs", lanes, layer, (nsub.reshape(n, B) * valid).sum(1))
        return np.where(valid[:, :, None], new_ids.reshape(n, B, k), -1)

    def _access(
        self, lanes: np.ndarray, layer: np.ndarray, ids: np.ndarray, decode: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The union of the rows' experts with token counts, which are resident, and (two copies)
        which hits are on a low copy (``decode``: the rows whose uses and hits also count as the
        TPOT's; None: all)."""
        n, B, k = ids.shape
        flat = self._items(layer, ids).reshape(n, B * k)
        if B > 1:
            uniq, counts = union_counts(flat)
        else:
            uniq, counts = flat, (flat >= 0).astype(np.int64)
        hit = self.cache.lookup(lanes, uniq)
        low = self._low_of(lanes, uniq) & hit if self.copies is not None else None
        if self.prefetching:
            pf = hit & self.cache.was_prefetched(lanes, uniq)
            used = pf.sum(1)
            self.r_used[lanes] += used
            self.add("pf_used", lanes, layer, used)
            if low is not None:
                self.add("pf_used_low", lanes, layer, (pf & low).sum(1))
        if low is not None:
            # a miss computes from the low copy too, loaded or on the CPU (mixed.py, rule 1)
            self.add("low_uses", lanes, layer, (counts * ((uniq >= 0) & (low | ~hit))).sum(1))
        uses, hits = counts.sum(1), (counts * hit).sum(1)
        self.add("uses", lanes, layer, uses)
        self.add("hits", lanes, layer, hits)
        if decode is not None:
            uses, hits = np.where(decode, uses, 0), np.where(decode, hits, 0)
        self.add("dec_uses", lanes, layer, uses)
        self.add("dec_hits", lanes, layer, hits)
        return uniq, counts, hit, low

    def _low_of(self, lanes: np.ndarray, items: np.ndarray) -> np.ndarray:
        """[n, M] whether each item's slot holds its low copy (meaningful where resident)."""
        W = self.cache.N + 1
        return self.low.reshape(-1)[lanes[:, None] * W + np.where(items >= 0, items, W - 1)]

    def _split(
        self,
        lanes: np.ndarray,
        uniq: np.ndarray,
        counts: np.ndarray,
        miss: np.ndarray,
        delay: np.ndarray,
        one_token: bool,
        decode: np.ndarray | None,
        next_lanes: np.ndarray | None,
        has_next: np.ndarray | None,
        next_predicted: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The balancer: (n_load, load ids, CPU ids, CPU time) from the misses, largest first; a
        prefill row loads every miss."""
        bal, cost = self.policy.balancer, self.demand
        n = len(lanes)
        n_miss = miss.sum(1)
        if decode is not None and not decode.any() and self.policy.eviction != "static":
            bal = "none"  # prefill loads what it needs (static keeps its slots: its misses stay on the CPU)
        if bal == "none" and one_token:
            # one token per expert: every miss is loaded and no queue order is needed
            none = np.full(uniq.shape, -1)
            return n_miss, np.where(miss, uniq, -1), none, np.zeros(n)
        msize = np.where(miss, counts, 0)
        morder = np.argsort(-msize, axis=1, kind="stable")
        mids = np.take_along_axis(np.where(miss, uniq, -1), morder, 1)
        msz = np.take_along_axis(msize, morder, 1).astype(np.float64)
        if bal == "smoe":
            # Algorithm 2's CPU cost per token: at decode batch sizes C dominates, so one token's whole t_c
            t_io = cost.t_io if math.isfinite(cost.t_io) else math.inf
            if n == 1:  # the literal algorithm: the same decision, without the [M, M] comparison
                n_load = np.array([len(two_pointer(msz[0, : n_miss[0]], t_io, cost.beta + cost.c)[0])])
            else:
                n_load = two_pointer_split(msz, n_miss, t_io, cost.beta + cost.c)
        elif bal == "presched":
            nsz, nn = self._next_pending(next_lanes, has_next, next_predicted, n)
            dec = schedule(
                _reverse_valid(msz, n_miss),
                n_miss,
                nsz,
                nn,
                delay,
                self.r_used[lanes] / self.r_landed[lanes],
                cost,
            )
            n_load = dec.n_load
            if has_next is not None:
                decided = has_next if decode is None else has_next & decode
                self.clock.pf_n[next_lanes[decided]] = dec.n_prefetch[decided]
        elif bal == "cpu":
            n_load = np.zeros_like(n_miss)
        else:
            n_load = n_miss
        if decode is not None and self.policy.eviction != "static":
            n_load = np.where(decode, n_load, n_miss)
        col = np.arange(mids.shape[1])[None, :]
        load_ids = np.where(col < n_load[:, None], mids, -1)
        cpu_mask = (col >= n_load[:, None]) & (mids >= 0)
        t_cpu = np.where(cpu_mask, cost.beta * msz + cost.c, 0.0).sum(1)
        return n_load, load_ids, np.where(cpu_mask, mids, -1), t_cpu

    def _next_pending(
        self,
        next_lanes: np.ndarray | None,
        has_next: np.ndarray | None,
        predicted: np.ndarray | None,
        n: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """PreSched's E_next: the next layer's predicted experts not resident there, token counts
        ascending ([n, M'] sizes, [n] how many)."""
        if predicted is None or next_lanes is None or has_next is None:
            return np.zeros((n, 0)), np.zeros(n, dtype=np.int64)
        uniq, counts = union_counts(predicted)
        res = self.cache.lookup(next_lanes, uniq)
        keep = (uniq >= 0) & ~res & has_next[:, None]
        sizes = np.sort(np.where(keep, counts, np.inf).astype(np.float64), axis=1)
        return np.where(np.isfinite(sizes), sizes, 0.0), keep.sum(1)

    def _advance(
        self,
        lanes: np.ndarray,
        layer_t: np.ndarray,
        link: np.ndarray,
        next_lanes: np.ndarray | None,
        has_next: np.ndarray | None,
        restart: np.ndarray | None,
    ) -> None:
        """Write the prefetch windows this layer leaves: the next layer's, and a first layer's."""
        if next_lanes is not None and has_next is not None:
            free = window(layer_t, link, self.predictor_ms if self.prefetching else 0.0)
            self.clock.free[next_lanes[has_next]] = free[has_next]
        if restart is not None:
            self.clock.free[lanes[restart]] = self.first_window
            self.clock.pf_n[lanes[restart]] = -1  # no PreSched decision reaches a first layer


_NO_IDS = np.zeros(0, np.int64)
_NO_PROB = np.zeros(0, np.float64)
_NO_PROBS = np.zeros(1, np.float32)


def _i64(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.int64 else a.astype(np.int64)


def _time(t: int | np.ndarray) -> int:
    return t.item() if t.__class__ is np.ndarray else int(t)


class OneLane:
    """A compiled :class:`LayerStep`'s calls with one lane and one token, as the kernels of
    :mod:`moecast.runtime.core.step_kernels`: the constants and buffers they take, made once.

    PreSched's split stays :func:`moecast.runtime.core.presched.schedule` (called between the two layer
    kernels), and the cache's counters (evictions, prefetches wasted / used / inserted) are added to
    its :class:`~moecast.runtime.core.cache.CacheStats` after each call.
    """

    def __init__(self, step: LayerStep) -> None:
        self.step = step
        cache, cost, pol = step.cache, step.cost, step.policy
        self.code = eviction.kernel_code(cache.policy)  # a policy without a kernel never runs here
        t_pred = step.predictor_ms if step.prefetching else 0.0
        two = step.copies is not None
        # two copies: the demand read's cost first, the high copy's (prefetches, upgrades) beside it
        self.fcost = sk.fcost_of(
            step.demand, t_pred, step.first_window, pol.late_prefetch, cost if two else None
        )
        self.low = step.low if two else np.zeros((1, 1), bool)
        self.windowed = step._windowed if two else np.zeros(1, bool)
        self.scratch = np.empty(0)  # the kernels' scratch (PreSched's inputs, the CPU times)
        self.info = np.zeros(2, np.int64)
        self.counters = np.zeros(5, np.int64)
        self.bal = sk.BALANCER_CODE[pol.balancer]
        self.landing_rule = (
            sk.LATE if pol.late_prefetch else sk.PRESCHED_ONE if pol.balancer == "presched" else sk.IN_WINDOW
        )
        self.score = cache.policy == "score"
        self.ring = cache._ring if self.score else np.zeros((1, 1, 1), np.float32)
        self.ring_pos = cache._ring_pos if self.score else np.zeros(1, np.int64)
        # SMoE Algorithm 1's band edges as substitute() multiplies them (float32 factors)
        self.hi, self.lo = float(np.float32(1 + pol.alpha)), float(np.float32(1 - pol.alpha))
        self.ep: tuple | None = None
        self.gated = pol.gate != "none"  # its prefetches' late one starts only where it pays

    def _load(self) -> tuple:
        self.ep = (*sk.entry_points(), kernels.substitute_kernels())
        return self.ep

    def takes(self, lanes: np.ndarray, ids: np.ndarray, probs: np.ndarray | None, next_use: object) -> bool:
        """Whether a call is this path's: one lane, one token, no next-use times and a cache per layer."""
        return (
            len(lanes) == 1
            and ids.shape[1] == 1
            and ids.shape[2] <= sk.MAX_K
            and next_use is None
            and not self.step.shared
            and (probs is not None or not self.score)
        )

    def _fold(self) -> None:
        """Add the kernels' counters to the cache's statistics and insert clock."""
        ev, wasted, used, inserted, new = self.counters.tolist()
        if ev or wasted or used or inserted or new:
            st = self.step.cache.stats
            st.evictions += ev
            st.prefetch_wasted += wasted
            st.prefetch_used += used
            st.prefetch_inserted += inserted
            self.step.cache._clock += new
            self.counters[:] = 0

    def route(
        self, lanes: np.ndarray, layer: np.ndarray, ids: np.ndarray, probs: np.ndarray
    ) -> np.ndarray | None:
        """LayerStep.route (SMoE Algorithm 1) for one decode token; None where it holds padding."""
        step = self.step
        ep = self.ep or self._load()
        p = probs[0] if probs.dtype == np.float32 else probs[0].astype(np.float32)
        lane = int(lanes[0])
        out = np.empty(ids.shape[2], np.int64)
        use = ep[5][p.dtype](p, _i64(ids[0]), step.cache.resident[lane], self.hi, self.lo, out)
        if use < 0:
            return None
        if use == 0:
            return ids
        step.table[sk.SUBS, step.stat_base[lane] + layer[0]] += use
        return out.astype(ids.dtype)[None, None]

    def layer(
        self,
        lanes: np.ndarray,
        layer: np.ndarray,
        ids: np.ndarray,
        t: int | np.ndarray,
        probs: np.ndarray | None,
        next_lanes: np.ndarray | None,
        has_next: np.ndarray | None,
        restart: np.ndarray | None,
        next_predicted: np.ndarray | None,
        decode: np.ndarray | None,
        routed: bool,
    ) -> LayerOutcome:
        """LayerStep.layer for one token on one lane (its arguments)."""
        step = self.step
        if not routed:
            ids = step.route(lanes, layer, ids, probs, decode)
        cache, clock = step.cache, step.clock
        ep = self.ep or self._load()
        lane = int(lanes[0])
        slot = int(step.stat_base[lane] + layer[0])
        row = _i64(ids[0, 0])
        k = len(row)
        known = next_lanes is not None and has_next is not None
        nl, hn = (int(next_lanes[0]), bool(has_next[0])) if known else (0, False)
        pred = _i64(next_predicted[0]) if next_predicted is not None and known else _NO_IDS
        P = len(pred)
        if len(self.scratch) < 2 * k + P:
            self.scratch = np.empty(2 * k + P)
        p = _NO_PROBS
        if self.score:
            p = probs[0, 0] if probs.dtype == np.float32 else probs[0, 0].astype(np.float32)
        out, hit, fout = np.empty((6, k), np.int64), np.empty(k, bool), np.empty(5)
        state = (cache._res, cache._last, cache._freq, cache._pf, cache._nu_k, cache._score_k, cache._count)
        state += (self.ring, self.ring_pos, lane, slot, cache._caps[lane], _time(t))
        rs = restart is not None and bool(restart[0])
        n_load = ep[0](
            *state, row, decode is None or bool(decode[0]), step.prefetching, self.bal, self.code,
            cache._shift, self.fcost, clock.delay, clock.rc, clock.free, clock.pf_n, step.r_used, step.table, p,
            nl, hn, rs, pred, out, hit, self.scratch, fout, self.info, self.counters, self.low, self.windowed,
        )  # fmt: skip
        if n_load == sk.BAD_IDS:
            cache._bad_ids(lane, row)
        if n_load == sk.PRESCHED:
            cur, nxt = self.scratch[:k], self.scratch[2 * k : 2 * k + P]
            n_load = self._presched(lanes, next_lanes, has_next, decode, cur, nxt, fout)
            ep[1](
                *state, n_load, p, self.code, cache._shift, self.fcost, clock.free, clock.pf_n, step.table,
                nl, hn, rs, out, hit, fout, self.counters, self.scratch[k : 2 * k], self.low,
            )  # fmt: skip
        self._fold()
        return LayerOutcome(ids, out[0:1], out[1:2], hit[None], out[2:3], out[3:4], fout[0:1], fout[1:2])

    def upgrade_quiet(self, lanes: np.ndarray, layer: np.ndarray) -> None:
        """LayerStep.upgrade_quiet for one lane."""
        step = self.step
        ep = self.ep or self._load()
        lane = int(lanes[0])
        ep[4](
            step.cache._res, step.cache._last, step.cache._pf, self.low, self.windowed, lane,
            int(step.stat_base[lane] + layer[0]), step.clock.free, self.fcost, step.clock.rc, step.table,
        )  # fmt: skip

    def _presched(
        self,
        lanes: np.ndarray,
        next_lanes: np.ndarray | None,
        has_next: np.ndarray | None,
        decode: np.ndarray | None,
        cur: np.ndarray,
        nxt: np.ndarray,
        fout: np.ndarray,
    ) -> int:
        """PreSched's split (Eq. 5) and the next layer's prefetch count (Eqs. 6-7), as LayerStep._split."""
        step = self.step
        n_miss, n_next = self.info.tolist()
        lane = int(lanes[0])
        delay = np.array([fout[sk.DELAY]])
        r_hit = np.array([step.r_used[lane] / step.r_landed[lane]])
        dec = schedule(cur[None], np.array([n_miss]), nxt[None], np.array([n_next]), delay, r_hit, step.cost)
        # one row: the decision reaches the next layer when it runs the same token's decode step
        if has_next is not None and next_lanes is not None and has_next[0] and (decode is None or decode[0]):
            step.clock.pf_n[next_lanes[0]] = dec.n_prefetch[0]
        return int(dec.n_load[0])

    def prefetch(
        self,
        lanes: np.ndarray,
        layer: np.ndarray,
        ranked: np.ndarray,
        t: int | np.ndarray,
        prob: np.ndarray | None = None,
    ) -> np.ndarray:
        """LayerStep.prefetch for one lane (``prob``: the candidates' P(used), under the gate)."""
        step = self.step
        cache, clock = step.cache, step.clock
        ep = self.ep or self._load()
        lane = int(lanes[0])
        row = _i64(ranked[0])
        out = np.empty(len(row), np.int64)
        bad = ep[2](
            cache._res, cache._last, cache._freq, cache._pf, cache._nu_k, cache._score_k, cache._count, lane,
            int(step.stat_base[lane] + layer[0]), cache._caps[lane], _time(t), row, self.code, cache._shift,
            self.landing_rule, self.fcost, clock.free, clock.delay, clock.rc, clock.pf_n,
            step.r_landed, step.table, out, self.counters, self.gated,
            np.ascontiguousarray(prob[0], np.float64) if self.gated else _NO_PROB, self.low, self.windowed,
        )  # fmt: skip
        if bad:
            cache._bad_ids(lane, row)
        self._fold()
        return out[None]


def landing(
    n_cand: np.ndarray, pf_n: np.ndarray, free: np.ndarray, t_io: float, balancer: str, late: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step 1's rule: of ``n_cand`` non-resident candidates, (asked, landed, started, delay) per row.

    ``pf_n`` is PreSched's count (-1: none decided), ``free`` the window. A transfer lands when it
    finishes inside the window; only PreSched's own count may start one more, which does not land
    and delays the layer's demand loads by the time it still needs. Under ``late`` (the policy's
    late_prefetch) one more is started too, and it lands: resident, late by ``delay``.
    """
    n = len(n_cand)
    want = np.where(pf_n >= 0, np.minimum(pf_n, n_cand), n_cand)
    if math.isinf(t_io):
        fit = np.zeros(n, dtype=np.int64)
    elif t_io <= 0:
        fit = want
    else:
        fit = np.maximum(np.floor(free / t_io + 1e-9), 0).astype(np.int64)
    finite = math.isfinite(t_io)
    if late and finite and t_io > 0:
        landed = np.minimum(want, fit + 1)
        want = landed
        delay = np.maximum(np.where(landed > fit, landed * t_io - free, 0.0), 0.0)
        return want, landed, landed, delay
    want = np.where((pf_n >= 0) & (balancer == "presched"), want, np.minimum(want, fit))
    landed = np.minimum(want, fit)
    started = np.minimum(want, landed + 1) if finite else np.zeros(n, dtype=np.int64)
    late_one = (want > landed) & finite & (t_io > 0)
    delay = np.maximum(np.where(late_one, (landed + 1) * t_io - free, 0.0), 0.0)
    return want, landed, started, delay


def layer_time(
    cost: CostModel,
    n_dev: np.ndarray,
    n_load: np.ndarray,
    delay: np.ndarray | float,
    t_cpu: np.ndarray | float,
    n_cpu: np.ndarray | int = 0,
    stall: np.ndarray | None = None,
    high: tuple[np.ndarray, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Step 5's formula: (layer_t, link) per row (an absent link: infinite).

    ``high`` (two copies): ``(n_high, t_g_high)``, how many of the ``n_dev`` experts compute at the
    high copy and its time; the others, and the last load's tail, at ``cost.t_g`` (the low copy's).

    ``n_cpu`` experts make up the CPU set; where the slow tier is a disk they are read over the
    link after the demand loads, and where the CPU is also the fast tier their time adds to the
    resident experts', as the reads' compute time ``t_rc`` does (module docstring). ``stall`` (late_prefetch only): a late prefetch lands that
    long into the layer's expert phase, and its expert computes after it."""
    t_io = cost.t_io
    finite = math.isfinite(t_io)
    io = t_io if finite else 0.0
    link = delay + n_load * io
    if not finite:
        link = np.where(n_load > 0, math.inf, link)
    compute = n_dev * cost.t_g
    if high is not None:
        compute = compute + high[0] * (high[1] - cost.t_g)
    dev = np.maximum(compute, link + np.where(n_load > 0, cost.t_g, 0.0))
    if stall is not None:
        # a late prefetch that stalls moves the low copy (mixed.py, rule 3): it computes at cost.t_g
        dev = np.maximum(dev, np.where(stall > 0, stall + cost.t_g, 0.0))
    on_cpu = np.asarray(n_cpu) > 0
    cpu_end = t_cpu
    if cost.cpu_reads_link:
        # the CPU set's experts compute as their reads land, behind the loads': the first read
        # starts the compute, the last one's expert follows the link
        first = link + io
        link = link + n_cpu * io
        if not finite:
            link = np.where(on_cpu, math.inf, link)
        with np.errstate(invalid="ignore", divide="ignore"):
            last = np.where(on_cpu, t_cpu / np.maximum(n_cpu, 1), 0.0)
        cpu_end = np.where(on_cpu, np.maximum(first + t_cpu, link + last), t_cpu)
    if cost.shared_compute:
        busy = np.maximum(dev + np.where(on_cpu, t_cpu, 0.0), cpu_end)
        if cost.t_rc:
            # the cores compute every expert and serve every read of the layer
            work = compute + np.where(on_cpu, t_cpu, 0.0) + (n_load + n_cpu) * cost.t_rc
            busy = np.maximum(busy, work)
    else:
        # a device's copies: the host issues each one (t_rc, its time), serially with the step's launches
        busy = np.maximum(dev, cpu_end) + n_load * cost.t_rc
    return cost.t_attn + busy, link


def window(layer_t: np.ndarray, link: np.ndarray, t_pred: float) -> np.ndarray:
    """Step 6's rule: the next layer's prefetch window, once this layer's link and the prediction are done."""
    busy = np.maximum(link, t_pred) if t_pred else link
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(layer_t - busy, nan=0.0)


def _compact(a: np.ndarray) -> np.ndarray:
    """Move each row's non-negative entries to the front, keeping their order."""
    order = np.argsort(a < 0, axis=1, kind="stable")
    return np.take_along_axis(a, order, 1)


def union_counts(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: distinct non-negative ids (-1 padded) and how many times each occurs."""
    big = np.iinfo(np.int64).max
    srt = np.sort(np.where(flat >= 0, flat, big), axis=1)
    first = np.ones(srt.shape, dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    first &= srt != big
    grp = np.cumsum(first, axis=1) - 1
    rows = np.broadcast_to(np.arange(len(flat))[:, None], srt.shape)
    uniq = np.full(srt.shape, -1, dtype=np.int64)
    uniq[rows[first], grp[first]] = srt[first]
    counts = np.zeros(srt.shape, dtype=np.int64)
    ok = srt != big
    np.add.at(counts, (rows[ok], grp[ok]), 1)
    return uniq, counts


def _reverse_valid(desc: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Rows sorted descending in their first n entries -> the same entries ascending."""
    M = desc.shape[1]
    idx = np.clip(n[:, None] - 1 - np.arange(M)[None, :], 0, max(M - 1, 0))
    out = np.take_along_axis(desc, idx, 1) if M else desc
    return np.where(np.arange(M)[None, :] < n[:, None], out, 0.0)


def rank_candidates(ids: np.ndarray, scores: np.ndarray, E: int) -> np.ndarray:
    """Per row: distinct ids ranked by summed score, best first (-1 padded)."""
    if ids.shape[1] == 0:
        return ids
    key = np.where(ids >= 0, ids, E)
    order = np.argsort(key, axis=1, kind="stable")
    sid = np.take_along_axis(key, order, 1)
    ssc = np.take_along_axis(np.where(ids >= 0, scores, 0.0), order, 1).astype(np.float64)
    first = np.ones(sid.shape, dtype=bool)
    first[:, 1:] = sid[:, 1:] != sid[:, :-1]
    # summed score per distinct id: cumulative sums between group starts
    csum = np.cumsum(ssc, axis=1)
    grp = np.cumsum(first, axis=1) - 1
    last = np.ones(sid.shape, dtype=bool)
    last[:, :-1] = first[:, 1:]
    rows = np.broadcast_to(np.arange(len(ids))[:, None], sid.shape)
    end_sum = np.zeros(sid.shape)
    end_sum[rows[last], grp[last]] = csum[last]
    start_prev = np.zeros(sid.shape)
    start_prev[rows[first], grp[first]] = (csum - ssc)[first]
    total = end_sum - start_prev
    gid = np.full(sid.shape, -1, dtype=np.int64)
    gid[rows[first], grp[first]] = sid[first]
    gid[gid == E] = -1
    total = np.where(gid >= 0, total, -np.inf)
    order2 = np.argsort(-total, axis=1, kind="stable")
    return np.take_along_axis(gid, order2, 1)


_RANK = None  # step_kernels.rank_one's entry point, loaded on first use


def _rank_kernel():
    global _RANK
    _RANK = sk.entry_points()[3]
    return _RANK


def ranked_predictions(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, E] next-layer scores of a step's tokens -> ([1, B * k] each token's top-k predicted ids,
    [1, M] the prefetch candidates), as the replay ranks a predictor's: scores scaled by each row's
    largest magnitude, top-k per token, merged by summed score, ties to the lower id."""
    s = scores
    if s.__class__ is not np.ndarray or s.dtype != np.float32 or s.ndim != 2:
        s = np.atleast_2d(np.asarray(scores, dtype=np.float32))
    if len(s) == 1:  # one token: compiled, unless a tie at the k-th score leaves it to numpy
        out = np.empty((2, 1, min(k, s.shape[1])), np.int64)
        if (_RANK or _rank_kernel())(s[0], k, out[0, 0], out[1, 0]):
            return out[0], out[1]
    s = s / np.maximum(np.abs(s).max(-1, keepdims=True), 1e-12)
    ids, sc = top_predictions(s, k)
    flat = ids.reshape(1, -1)
    return flat, rank_candidates(flat, sc.reshape(1, -1), s.shape[1])


def predictor_latency(
    given: float | None, predictor: BatchScorer | None, profile: HardwareProfile
) -> tuple[float, str]:
    """(ms per layer, where it comes from) charged before a prefetch may start (step 6): ``given``
    (--predictor_ms), else a figure the checkpoint's header carries (``predictor_ms``: no moecast
    command writes one, since a latency is the machine's, not the checkpoint's), else the hardware
    profile's, which ``moecast profile --predictor CKPT`` times for that checkpoint. No predictor, no
    charge (a plan is made before decoding)."""
    if predictor is None:
        return 0.0, "no predictor"
    if given is not None:
        v = float(given)
        if not (math.isfinite(v) and v >= 0):
            raise InputError(f"--predictor_ms must be a finite number of ms >= 0, got {given}")
        return v, "--predictor_ms"
    measured = predictor.metadata().get("predictor_ms")
    if measured is not None:
        return float(measured), "the checkpoint's header"
    return profile.predictor_ms, f"hardware profile {profile.name}"
