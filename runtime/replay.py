"""Trace replay: a discrete-event model of an offloaded MoE over a recorded TraceSet.

Semantics (DESIGN.md, "Metrics"):

- A step is one token of each of B interleaved requests (decode batch size B). A layer's access is
  the union of the step's routed experts at that layer: hits = uses whose expert is resident when
  the layer runs; the misses are loaded (and inserted, evicting by policy; the current experts are
  shielded) or computed on the CPU, as the balancer decides. The hit-rate denominator counts every
  routed use after substitution, cold misses included.
- Caches persist across requests (stream) or start empty for each group of B requests (``cold``);
  per layer (``capacity`` experts each) or shared (``capacity * L`` experts for all layers).
- Three resources per layer: device, CPU, and the serial transfer link (PreScope Premise 4). Layer
  time = ``t_attn + max(device, link, CPU)`` with link = delay left by a prefetch still in flight
  (Premise 3) + demand loads, CPU = sum of ``beta * m + C`` (PreScope Eq. 3). A prefetch for layer
  l is issued when layer l-1's routing is known; it counts only if it finishes before layer l's
  expert computation starts, i.e. inside the link time layer l-1 leaves free (its window also
  covers layer l's attention). The first MoE layer's window is its own attention time. Transfers
  not started by then are cancelled (SMoE Sec. 5.2 clears the queue); one started but unfinished
  delays layer l's demand loads and its expert is not counted as resident.
- Modeled TPOT: mean step time over steps that decode; a prefill-only TraceSet (the imported
  DeepSeek traces) has no decode steps, so each of its tokens is treated as a step and the result
  says so (``tpot_basis``).

The simulation is vectorised over "lanes" (one cache each): with per-layer caches every (stream,
layer) pair is a lane and the layers advance as a wavefront (lane of layer l handles step i - l at
iteration i), so one numpy call moves all layers and all cold streams at once. A shared cache has one
lane per stream and walks the layers in order.

Fast paths (:mod:`moecast.runtime.fastreplay`) take over for per-layer caches at batch size 1
without substitution, the common case: demand-only ``lru`` from LRU stack distances (every capacity
at once), ``static`` from the table, ``lfu``/``belady`` from a step-synchronous simulation of all
(request, layer, capacity) caches, ``prefetch``/``presched`` from a wavefront over contiguous lanes
(and ``prefetch`` as demand LRU when no prefetch can ever fit in the link window:
``t_attn + k * t_g < t_io``). They give the same results as the general engine
(``ReplayConfig(fast=False)``; checked in tests/test_replay.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from moecast.collect.traceset import TraceSet, TraceSetError
from moecast.runtime import fastreplay as fast
from moecast.runtime.balancer import two_pointer_split
from moecast.runtime.cache import ExpertCache, StaticTable, resolve_capacity
from moecast.runtime.cost_model import CostModel, HardwareProfile, load_profile
from moecast.runtime.policy import POLICIES as POLICIES  # the presets, where bench looks them up
from moecast.runtime.policy import Policy, get_policy
from moecast.runtime.prefetch import OraclePredictor, plan_prior, top_predictions
from moecast.runtime.presched import schedule
from moecast.runtime.substitution import substitute

DEFAULT_HARDWARE = "prescope-a100-pcie4"


@dataclass
class ReplayConfig:
    policy: str | Policy = "lru"  # a preset name (runtime/policy.py POLICIES) or a Policy
    capacity: float | str = 0.25
    cold: bool = False
    shared: bool = False
    # none | oracle | checkpoint path | a loaded predictor object; None = the policy's default
    predictor: Any = None
    planner: str | None = None
    # weight of the plan as a log-linear prior on the token-level scores (prefetch.plan_prior)
    plan_weight: float = 0.1
    hardware: str | HardwareProfile = DEFAULT_HARDWARE
    alpha: float | None = None  # None: the policy's default (policy.resolve_alpha)
    batch_size: int = 1
    score_window: int = 8
    requests: list[str] | None = None
    progress: bool = False
    chunk_lanes: int = 20000  # cold streams replayed together (bounds the per-lane state in memory)
    fast: bool = True  # use the fast paths where they apply (False: the general engine, for cross-checks)


@dataclass
class ReplayResult:
    config: dict[str, Any]
    hit_rate: float
    hit_rate_per_layer: list[float]
    prefetch_accuracy: float | None
    prefetches_issued: int
    prefetches_landed: int
    loads: int
    cpu_experts: int
    cpu_expert_rate: float
    bytes_moved: int
    substitution_rate: float
    modeled_tpot_ms: float | None
    tpot_basis: str
    layer_time_ms_per_layer: list[float]
    requests: int
    tokens: int
    steps: int
    accesses: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("config"))
        d.update(d.pop("extra"))
        return d


# ----------------------------------------------------------------------------- preparation


_DATA_MEMO: dict[tuple, _Data] = {}


def _data(ts: TraceSet, rids: list[str], need_probs: bool) -> _Data:
    """The arrays of a replay, kept for the next call on the same requests (a bench or `compare`
    replays one TraceSet many times; reading it dominates a fast replay otherwise)."""
    key = (str(ts.path), ts.num_tokens, hash(tuple(rids)), need_probs)
    if key not in _DATA_MEMO:
        _DATA_MEMO.clear()
        _DATA_MEMO[key] = _Data(ts, rids, need_probs)
    return _DATA_MEMO[key]


class _Data:
    """Everything the simulation reads, laid out for gathers by token index."""

    def __init__(self, ts: TraceSet, rids: list[str], need_probs: bool) -> None:
        self.topk = np.ascontiguousarray(ts.array("topk_ids", rids)).astype(np.int64)
        self.lengths = ts.request_lengths(rids)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.decode = ts.column("phase", rids) == "decode"
        self.probs = ts.array("router_probs", rids) if need_probs else None
        self.weights = ts.array("topk_weights", rids) if ts.has("topk_weights") else None


def _grid(lengths: np.ndarray, starts: np.ndarray, B: int, cold: bool) -> tuple[np.ndarray, np.ndarray]:
    """[streams, steps, B] token index (-1 = idle slot) and [streams, steps, B] request-start flags."""
    n = len(lengths)
    if cold:
        groups = [list(range(g, min(g + B, n))) for g in range(0, n, B)]
    else:
        groups = [list(range(n))]
    streams = []
    for members in groups:
        if cold:
            slots = [[r] for r in members]
        else:
            slots = [list(range(b, n, B)) for b in range(B)]
        slots += [[] for _ in range(B - len(slots))]
        streams.append(slots)
    steps = max(max((sum(int(lengths[r]) for r in slot) for slot in slots), default=0) for slots in streams)
    tok = np.full((len(streams), max(steps, 1), B), -1, dtype=np.int64)
    start = np.zeros(tok.shape, dtype=bool)
    for g, slots in enumerate(streams):
        for b, slot in enumerate(slots):
            if not slot:
                continue
            idx = np.concatenate([np.arange(starts[r], starts[r] + lengths[r]) for r in slot])
            tok[g, : len(idx), b] = idx
            pos = np.cumsum([0] + [int(lengths[r]) for r in slot[:-1]])
            start[g, pos, b] = True
    return tok, start


def _next_use(topk: np.ndarray, tok: np.ndarray, L: int, E: int, shared: bool) -> np.ndarray:
    """[tokens, L, k] the lane time of the next access of the same (lane, expert) (Belady's future)."""
    _G, S, _B = tok.shape
    topk.shape[2]
    g, s, b = np.nonzero(tok >= 0)
    t = tok[g, s, b]
    ids = topk[t]  # [n, L, k]
    lay = np.broadcast_to(np.arange(L)[None, :, None], ids.shape)
    lane = g[:, None, None] * (1 if shared else L) + (0 if shared else lay)
    item = lane * (L * E if shared else E) + (lay * E if shared else 0) + ids
    when = s[:, None, None] * L + lay  # lane time, monotone per lane
    span = S * L + 1
    key = (item.astype(np.int64) * span + when).reshape(-1)
    uk = np.unique(key)
    nxt = np.full(len(uk), np.iinfo(np.int64).max // 4, dtype=np.int64)
    same = (uk[1:] // span) == (uk[:-1] // span)
    nxt[:-1][same] = uk[1:][same] % span
    out = np.empty(topk.shape, dtype=np.int64)
    out[t] = nxt[np.searchsorted(uk, key)].reshape(ids.shape)
    return out


def _load_predictor(name: str | None, ts: TraceSet) -> Any:
    from moecast.runtime.prefetch import BUILTIN

    if name in (None, "none"):
        return None
    if not isinstance(name, str):  # already loaded (a bench adapting a checkpoint to its model)
        return name
    if name == "oracle":
        return OraclePredictor(ts.num_layers, ts.num_experts, ts.top_k)
    if name in BUILTIN:
        return None
    from moecast.predictors import registry

    return registry.load(name, fingerprint=ts.meta.model.fingerprint, against=f"TraceSet {ts.path}")


# ----------------------------------------------------------------------------- replay


def replay(ts: TraceSet | str, cfg: ReplayConfig) -> ReplayResult:
    """Replay one configuration over a TraceSet and return the DESIGN.md metrics."""
    return replay_capacities(ts, cfg, [cfg.capacity])[0]


def replay_capacities(
    ts: TraceSet | str, cfg: ReplayConfig, capacities: list[float | str]
) -> list[ReplayResult]:
    """Replay ``cfg`` at several cache capacities in one vectorised pass (the caches are independent
    lanes, so this equals one :func:`replay` per capacity, at a fraction of the Python overhead)."""
    t0 = time.perf_counter()
    if not isinstance(ts, TraceSet):
        ts = TraceSet(ts)
    spec = get_policy(cfg.policy, cfg.alpha)
    m = ts.meta.model
    L, E, k = m.num_layers, m.num_experts, m.top_k
    rids = list(cfg.requests) if cfg.requests is not None else list(ts.request_ids)
    if not rids or ts.num_tokens == 0:
        raise TraceSetError(
            f"{ts.path}: the TraceSet holds no requests to replay; collect or import some first"
        )
    B = int(cfg.batch_size)
    if B < 1:
        raise ValueError(f"batch size must be >= 1, got {B}")
    use_sub = spec.substituting
    if spec.eviction == "score" or use_sub:
        ts.require("router_probs", f"policy {spec.name!r} (SMoE score eviction / substitution)")
    if spec.eviction == "score" and cfg.shared:
        raise ValueError(
            "score eviction keeps one score window per layer; drop --shared or choose another policy"
        )
    caps = np.array([resolve_capacity(c, E, k, m.expert_bytes) for c in capacities], dtype=np.int64)
    if len(caps) == 0:
        raise ValueError("no capacities to replay")
    C = len(caps)
    cap = int(caps.max())
    profile = cfg.hardware if isinstance(cfg.hardware, HardwareProfile) else load_profile(cfg.hardware)
    cost = CostModel.from_profile(profile, m.expert_bytes)
    pred_name = ("oracle" if spec.prefetches else "none") if cfg.predictor is None else cfg.predictor
    if spec.eviction == "belady" and (pred_name not in (None, "none") or cfg.planner):
        raise ValueError(
            "belady is the demand-only offline optimum; use it with --predictor none and no --planner"
        )
    if spec.eviction == "static" and pred_name not in (None, "none"):
        # the slots are fixed: a prefetch would move bytes and change no hit (a --planner's plan
        # is pinned in the table's place for its request, as the live runtime does)
        raise ValueError(
            "static pins its experts and never inserts, so nothing can prefetch into it; use --predictor none"
        )
    predictor = _load_predictor(pred_name, ts)
    if predictor is not None and not isinstance(pred_name, str):
        pred_name = getattr(predictor, "name", type(predictor).__name__)
    if not (math.isfinite(cfg.plan_weight) and cfg.plan_weight >= 0):
        raise ValueError(f"--plan-weight must be a finite number >= 0, got {cfg.plan_weight}")
    planner = _load_predictor(cfg.planner, ts) if cfg.planner else None
    if planner is not None and (
        getattr(planner, "horizon", "") != "prompt-ahead" or not hasattr(planner, "plan")
    ):
        # MoE-Infinity's matching is prompt-ahead in the paper's sense but reads the request's
        # routing so far, token by token: it has no plan to preload before decoding
        raise ValueError(
            f"--planner {cfg.planner}: {planner.name} ({planner.horizon}) does not plan from the prompt; "
            "a planner is an EAM, EAP or cascade checkpoint (give other predictors as --predictor)"
        )
    for p in (predictor, planner):
        for f in getattr(p, "needs", ()):
            ts.require(f, f"predictor {getattr(p, 'name', '?')}")

    d = _data(ts, rids, need_probs=spec.eviction == "score" or use_sub)
    hot, hot_from = None, None
    if spec.eviction == "static" or spec.preload == "hot":
        hot, hot_from = _hot_table(ts, rids, d, E)

    def _finish(st: Any, tpots: Any, any_decode: Any, n_steps: Any) -> list[ReplayResult]:
        elapsed = time.perf_counter() - t0
        res = _results(
            st, tpots, any_decode, n_steps, elapsed, ts, cfg, spec, use_sub, pred_name,
            caps, E, L, B, profile, m, rids, d,
        )  # fmt: skip
        for r in res if hot_from else []:
            r.extra["hot_table_from"] = hot_from
        return res

    if (
        cfg.fast
        and not cfg.shared
        and B == 1
        and not use_sub
        and predictor is None
        and planner is None
        and spec.balancer == "none"
        and spec.preload != "hot"
        and spec.eviction in ("lru", "lfu", "belady", "static")
        and fast.valid_for_fast(d.topk, E)
    ):
        st, tpots, any_decode, n_steps = _fast_demand(d, spec.eviction, caps, cfg.cold, cost, L, E, k, hot)
        return _finish(st, tpots, any_decode, n_steps)

    fast_wave = (
        cfg.fast
        and not cfg.shared
        and B == 1
        and not use_sub
        and planner is None
        and spec.eviction == "lru"
        and spec.balancer in ("none", "presched")
        and fast.valid_for_fast(d.topk, E)
    )
    if fast_wave:
        t_io = cost.t_io
        if (
            spec.balancer == "none"
            and spec.preload != "hot"
            and (
                math.isinf(t_io)
                or (t_io > 0 and (cost.t_attn + k * cost.t_g) * (1 + 1e-12) / t_io + 1e-9 < 1)
            )
        ):
            # A prefetch starts only when it fits in the link time the previous layer leaves free,
            # and at batch 1 that is at most t_attn + k * t_g (the device time of its k experts):
            # below one transfer no prefetch can ever start, so this is demand LRU exactly.
            st, tpots, any_decode, n_steps = _fast_demand(d, "lru", caps, cfg.cold, cost, L, E, k)
            return _finish(st, tpots, any_decode, n_steps)

    # predictions: per (token, layer) the top-k predicted ids, best first
    kp = k
    pred_ids = pred_sc = None
    plan_top = None
    if predictor is not None or planner is not None:
        pred_ids = np.full((len(d.topk), L, kp), -1, dtype=np.int64)
        pred_sc = np.zeros((len(d.topk), L, kp), dtype=np.float32)
        if planner is not None:
            plan_top = np.zeros((len(rids), L, cap), dtype=np.int64)
        if isinstance(predictor, OraclePredictor) and planner is None:
            pred_ids[:] = d.topk
            pred_sc[:] = 1.0
        it = _progress(
            list(enumerate(rids)),
            cfg.progress and predictor is not None and not isinstance(predictor, OraclePredictor),
            "predicting",
        )
        with _scoring_mode(predictor, planner):
            for r, rid in it:
                s0, n = d.starts[r], d.lengths[r]
                if isinstance(predictor, OraclePredictor) and planner is None:
                    break
                if isinstance(predictor, OraclePredictor):
                    pred_ids[s0 : s0 + n] = d.topk[s0 : s0 + n]
                    pred_sc[s0 : s0 + n] = 1.0
                    if planner is None:
                        continue
                trace = ts.get(rid)
                sc = raw_sc = None
                if predictor is not None and not isinstance(predictor, OraclePredictor):
                    raw_sc = np.asarray(predictor.score_request(trace), dtype=np.float32)
                    sc = raw_sc / np.maximum(np.abs(raw_sc).max(-1, keepdims=True), 1e-12)
                if planner is not None:
                    plan = np.asarray(planner.score_request(trace), dtype=np.float32)[0]  # [L, E]
                    plan_top[r] = np.argsort(-plan, axis=1, kind="stable")[:, :cap]
                    # Alone, a plan only preloads (CasMoE plans before decoding); as a constant per-token
                    # prefetch it would evict the experts the previous token just used, which at small
                    # capacities are the likeliest next ones.
                    if sc is not None:
                        # the plan as a prior on the token-level scores; a light weight, since a
                        # request-wide plan knows less about the next token than the predictor does
                        sc = plan_prior(raw_sc, plan, cfg.plan_weight)
                if sc is not None:
                    ids, scs = top_predictions(sc, kp)
                    pred_ids[s0 : s0 + n], pred_sc[s0 : s0 + n] = ids, scs
    prefetching = pred_ids is not None
    if fast_wave:
        cand = None
        if prefetching:
            # B = 1: each (token, layer)'s candidates ranked once for the whole TraceSet, in chunks
            n_tok = len(d.topk)
            if isinstance(predictor, OraclePredictor):
                # equal scores, distinct ids: the ranking keeps ascending id order
                cand = np.sort(pred_ids, axis=2)
            else:
                cand = np.empty((n_tok, L, kp), dtype=np.int64)
                for c0 in range(0, n_tok, 8192):
                    c1 = min(n_tok, c0 + 8192)
                    cand[c0:c1] = _rank_candidates(
                        pred_ids[c0:c1].reshape(-1, kp), pred_sc[c0:c1].reshape(-1, kp), E
                    ).reshape(c1 - c0, L, kp)
        pre = hot.per_layer(cap) if spec.preload == "hot" else None
        any_decode = bool(d.decode.any())
        basis = d.decode if any_decode else np.ones(len(d.topk), dtype=bool)
        st = fast.wavefront_b1(
            d.topk, d.lengths, cfg.cold, caps, E, cost, spec.balancer, cand, pred_ids, pre, basis
        )
        n_basis = int(basis.sum())
        tpots = [float(v / n_basis) if n_basis else None for v in st.pop("tpot_sum")]
        return _finish(st, tpots, any_decode, len(d.topk))

    tok, start = _grid(d.lengths, d.starts, B, cfg.cold)
    G, S, _ = tok.shape
    stream_len = (tok >= 0).any(2).sum(1)  # steps per stream (slots finish at different times)
    N = L * E if cfg.shared else E
    nu = _next_use(d.topk, tok, L, E, cfg.shared) if spec.eviction == "belady" else None
    # statistics
    st = {
        n: np.zeros(C * L)
        for n in (
            "uses",
            "hits",
            "loads",
            "cpu",
            "subs",
            "pf_issued",
            "pf_landed",
            "pf_started",
            "pf_used",
            "pf_inserted",
            "time",
        )
    }
    step_time = np.zeros((C, G, S))
    step_decode = np.zeros((G, S), dtype=bool)
    # Cold streams are independent: replay them in chunks of similar length so the per-lane state
    # stays small (memory bound otherwise) and short streams do not idle behind long ones.
    G_all = G
    tok_all, start_all, len_all = tok, start, stream_len
    by_len = np.argsort(-len_all, kind="stable")
    per_chunk = max(1, cfg.chunk_lanes // (C * (1 if cfg.shared else L)))
    table = hot
    chunks = [by_len[i : i + per_chunk] for i in range(0, G_all, per_chunk)]
    for gmap in chunks:
        tok, start, stream_len = tok_all[gmap], start_all[gmap], len_all[gmap]
        G = len(gmap)
        lanes = C * G if cfg.shared else C * G * L
        per_cap = caps * L if cfg.shared else caps
        cap_of_lane = np.repeat(np.arange(C), lanes // C)
        cache = ExpertCache(
            N, per_cap[cap_of_lane], spec.eviction, lanes=lanes, score_window=cfg.score_window
        )
        if table is not None:
            if cfg.shared:
                cache.preload(np.arange(lanes), np.broadcast_to(table.shared(cap * L), (lanes, cap * L)))
            else:
                per = table.per_layer(cap)  # [L, cap]; each lane keeps the first capacity_of[lane]
                cache.preload(np.arange(lanes), np.tile(per, (C * G, 1)))

        # per-lane link state carried from the producing layer to the consuming one
        free = np.full(lanes, cost.t_attn)  # link time free before this lane's next compute start
        pf_n = np.full(
            lanes, -1, dtype=np.int64
        )  # PreSched's prefetch count for the lane (-1: as many as fit)
        delay = np.zeros(lanes)
        lane_pf_used = np.ones(lanes)
        lane_pf_landed = np.full(lanes, 2.0)
        layer_of_lane = np.zeros(lanes, dtype=np.int64) if cfg.shared else np.tile(np.arange(L), C * G)
        stream_of_lane = np.tile(np.arange(G), C) if cfg.shared else np.tile(np.repeat(np.arange(G), L), C)
        t_io = cost.t_io

        if cfg.shared:
            n_iter = int(stream_len.max()) * L
        else:
            n_iter = int(stream_len.max()) + L - 1
            lane_end = stream_len[stream_of_lane] + layer_of_lane
            lane_order = np.argsort(-lane_end, kind="stable")
            sorted_end = lane_end[lane_order]

        for i in _progress(range(n_iter), cfg.progress, f"replay {spec.name}"):
            if cfg.shared:
                s_i, l_i = divmod(i, L)
                act = np.flatnonzero(stream_len[stream_of_lane] > s_i)
                if len(act) == 0:
                    continue
                lay = np.full(len(act), l_i)
                s = np.full(len(act), s_i)
                g = stream_of_lane[act]
            else:
                n_act = int(np.searchsorted(-sorted_end, -i, side="left"))  # lanes with end > i
                act = lane_order[:n_act]
                if i < L - 1:
                    act = act[layer_of_lane[act] <= i]
                if len(act) == 0:
                    continue
                lay = layer_of_lane[act]
                s = i - lay
                g = stream_of_lane[act]
            n = len(act)
            toks = tok[g, s]  # [n, B]
            tvalid = toks >= 0
            tsafe = np.where(tvalid, toks, 0)
            ids = d.topk[tsafe, lay[:, None]]  # [n, B, k]
            ids = np.where(tvalid[:, :, None], ids, -1)
            off = (lay * E)[:, None, None] if cfg.shared else 0
            lt = s * L + lay  # lane time
            step_decode[gmap[g], s] |= (d.decode[tsafe] & tvalid).any(1)

            # planner preload at request start (not timed: it happens before the first token)
            if plan_top is not None:
                starting = (start[g, s] & tvalid).any(1)
                if starting.any():
                    rq = np.searchsorted(d.starts, toks[starting].max(1), side="right") - 1
                    plan_ids = plan_top[rq, lay[starting]][:, : max(cap // B, 1)] + (
                        off[starting, 0] if cfg.shared else 0
                    )
                    if spec.eviction == "static":
                        # static never inserts: the request's plan is pinned in the table's place
                        # (CasMoE's per-prompt placement); what was not resident is transferred
                        new = (plan_ids >= 0) & ~cache.lookup(act[starting], plan_ids)
                        new &= np.cumsum(plan_ids >= 0, axis=1) <= cache.capacity_of[act[starting]][:, None]
                        cache.preload(act[starting], plan_ids)
                        ins = new
                    else:
                        ins = cache.insert(act[starting], plan_ids, prefetch=True, t=None)
                    _acc(st["pf_inserted"], cap_of_lane[act[starting]] * L + lay[starting], ins.sum(1))

            # prefetch arrival: top predicted non-resident experts that fit in the free link time
            if prefetching:
                pid = pred_ids[tsafe, lay[:, None]]  # [n, B, kp]
                psc = np.where(tvalid[:, :, None], pred_sc[tsafe, lay[:, None]], 0.0)
                pid = np.where(tvalid[:, :, None] & (pid >= 0), pid, -1)
                cand = _rank_candidates(pid.reshape(n, -1), psc.reshape(n, -1), E)  # [n, C] best first
                if cfg.shared:
                    cand = np.where(cand >= 0, cand + off[:, 0], -1)
                predicted = cand  # shielded: a prefetch must not evict another predicted expert
                nonres = (cand >= 0) & ~cache.lookup(act, cand)
                cand = _compact(np.where(nonres, cand, -1))
                n_cand = (cand >= 0).sum(1)
                want = np.where(pf_n[act] >= 0, np.minimum(pf_n[act], n_cand), n_cand)
                if math.isinf(t_io):
                    fit = np.zeros(n, dtype=np.int64)
                elif t_io <= 0:
                    fit = want
                else:
                    fit = np.floor(free[act] / t_io + 1e-9).astype(np.int64)
                if spec.balancer != "presched":
                    # SMoE Sec. 5.2 / Fig. 17: prefetch loads must never delay the layer's own loads, so
                    # only transfers that finish inside the window are started
                    want = np.minimum(want, fit)
                landed = np.minimum(want, fit)
                started = np.where(np.isfinite(t_io), np.minimum(want, landed + 1), 0)
                new_delay = np.where(
                    (want > landed) & np.isfinite(t_io) & (t_io > 0), (landed + 1) * t_io - free[act], 0.0
                )
                delay[act] = np.maximum(new_delay, 0.0)
                take = np.arange(cand.shape[1])[None, :] < landed[:, None]
                ins = cache.insert(act, np.where(take, cand, -1), shield=predicted, prefetch=True, t=lt)
                _acc(st["pf_inserted"], cap_of_lane[act] * L + lay, ins.sum(1))
                lane_pf_landed[act] += landed
                _acc(st["pf_issued"], cap_of_lane[act] * L + lay, want)
                _acc(st["pf_landed"], cap_of_lane[act] * L + lay, landed)
                _acc(st["pf_started"], cap_of_lane[act] * L + lay, started)
            else:
                delay[act] = 0.0

            # SMoE Algorithm 1 substitution against the lane's resident set (batch-aware via group)
            if use_sub:
                flat_t = tsafe.reshape(-1)
                probs = d.probs[flat_t, np.repeat(lay, B)].astype(np.float32)
                res = cache.resident[np.repeat(act, B)]
                if cfg.shared:
                    res = res.reshape(n * B, L, E)[np.arange(n * B), np.repeat(lay, B)]
                new_ids, nsub = substitute(
                    probs, ids.reshape(n * B, k), res, spec.alpha, group=np.repeat(np.arange(n), B)
                )
                ids = np.where(tvalid[:, :, None], new_ids.reshape(n, B, k), -1)
                _acc(st["subs"], cap_of_lane[act] * L + lay, (nsub.reshape(n, B) * tvalid).sum(1))

            # the access: union of the step's experts, with token counts
            flat = ids.reshape(n, B * k) + (off[:, :, 0] if cfg.shared else 0)
            flat = np.where(ids.reshape(n, B * k) >= 0, flat, -1)
            if B > 1:
                uniq, counts = _union_counts(flat)
            else:
                uniq, counts = flat, (flat >= 0).astype(np.int64)
            hit_u = cache.lookup(act, uniq)
            if prefetching:
                used = (hit_u & cache.was_prefetched(act, uniq)).sum(1)
                lane_pf_used[act] += used
                _acc(st["pf_used"], cap_of_lane[act] * L + lay, used)
            uses = counts.sum(1)
            hits = (counts * hit_u).sum(1)
            miss = (uniq >= 0) & ~hit_u
            n_miss = miss.sum(1)
            # misses ordered by token count, largest first (the balancers' queue order)
            if spec.balancer == "none" and B == 1:
                # one token: every miss is loaded and all have one token, so no queue order is needed
                n_load = n_miss
                load_ids = np.where(miss, uniq, -1)
                t_cpu = np.zeros(n)
            else:
                msize = np.where(miss, counts, 0)
                morder = np.argsort(-msize, axis=1, kind="stable")
                mids = np.take_along_axis(np.where(miss, uniq, -1), morder, 1)
                msz = np.take_along_axis(msize, morder, 1).astype(np.float64)
                if spec.balancer == "smoe":
                    n_load = two_pointer_split(
                        msz, n_miss, t_io if math.isfinite(t_io) else math.inf, cost.beta
                    )
                elif spec.balancer == "presched":
                    asc = _reverse_valid(msz, n_miss)
                    _nid, nsz, nn = _next_layer_pending(
                        act, lay, s, g, tok, pred_ids, cache, cfg.shared, L, E, prefetching
                    )
                    dec = schedule(
                        asc, n_miss, nsz, nn, delay[act], lane_pf_used[act] / lane_pf_landed[act], cost
                    )
                    n_load = dec.n_load
                    consumer = act if cfg.shared else act + 1
                    has_next = lay < L - 1
                    pf_n[consumer[has_next]] = dec.n_prefetch[has_next]
                elif spec.balancer == "cpu":
                    n_load = np.zeros_like(n_miss)
                else:
                    n_load = n_miss
                col = np.arange(mids.shape[1])[None, :]
                load_ids = np.where(col < n_load[:, None], mids, -1)
                cpu_mask = (col >= n_load[:, None]) & (mids >= 0)
                t_cpu = (np.where(cpu_mask, cost.beta * msz + cost.c, 0.0)).sum(1)
            cache.insert(act, load_ids, shield=uniq, t=None)
            cache.touch(act, uniq, lt)
            if nu is not None:
                nxt = np.where(tvalid[:, :, None], nu[tsafe, lay[:, None]], np.iinfo(np.int64).max // 4)
                cache.set_next_use(act, flat, nxt.reshape(n, -1))
            if spec.eviction == "score":
                sc_mean = (d.probs[tsafe, lay[:, None]].astype(np.float32) * tvalid[:, :, None]).sum(
                    1
                ) / np.maximum(tvalid.sum(1), 1)[:, None]
                cache.observe_scores(act, sc_mean)

            # timeline of this layer: device, link, CPU in parallel after attention
            n_dev = (hit_u & (uniq >= 0)).sum(1) + n_load
            link = delay[act] + n_load * (t_io if math.isfinite(t_io) else 0.0)
            if not math.isfinite(t_io):
                link = np.where(n_load > 0, math.inf, link)
            t_dev = n_dev * cost.t_g
            layer_t = cost.t_attn + np.maximum(
                np.maximum(t_dev, link + np.where(n_load > 0, cost.t_g, 0.0)), t_cpu
            )
            cl = cap_of_lane[act]
            step_time[cl, gmap[g], s] += layer_t
            # the link time this layer leaves free for the next layer's prefetch (its window includes
            # the next layer's attention)
            if cfg.shared:
                with np.errstate(invalid="ignore"):
                    nxt_free = np.where(lay < L - 1, np.nan_to_num(layer_t - link, nan=0.0), cost.t_attn)
                free[act] = nxt_free
            else:
                has_next = lay < L - 1
                with np.errstate(invalid="ignore"):
                    free[act[has_next] + 1] = np.nan_to_num(layer_t - link, nan=0.0)[has_next]
                free[act[lay == 0]] = cost.t_attn

            _acc(st["uses"], cap_of_lane[act] * L + lay, uses)
            _acc(st["hits"], cap_of_lane[act] * L + lay, hits)
            _acc(st["loads"], cap_of_lane[act] * L + lay, n_load)
            _acc(st["cpu"], cap_of_lane[act] * L + lay, n_miss - n_load)
            _acc(st["time"], cap_of_lane[act] * L + lay, layer_t)
    any_decode = bool(step_decode.any())
    valid_step = np.arange(S)[None, :] < len_all[:, None]
    basis_mask = valid_step & step_decode if any_decode else valid_step
    n_steps = int(valid_step.sum())
    tpots = [float(step_time[c][basis_mask].mean()) if basis_mask.any() else None for c in range(C)]
    return _finish(st, tpots, any_decode, n_steps)


def _results(
    st,
    tpots,
    any_decode,
    n_steps,
    wall,
    ts,
    cfg,
    spec,
    use_sub,
    pred_name,
    caps,
    E,
    L,
    B,
    profile,
    m,
    rids,
    d,
) -> list[ReplayResult]:
    """Per capacity: the DESIGN.md metrics from the [C * L] statistics (index c * L + layer)."""
    C = len(caps)
    results = []
    for c in range(C):
        sl = slice(c * L, (c + 1) * L)
        t = {name: v[sl] for name, v in st.items()}
        uses = t["uses"].sum()
        tpot = tpots[c]
        if tpot is not None and not math.isfinite(tpot):
            tpot = None
        inserted = t["pf_inserted"].sum()
        cfg_out = {
            "traces": str(ts.path),
            "policy": spec.name,
            "eviction": spec.eviction,
            "substitution": use_sub,
            "balancer": spec.balancer,
            "predictor": pred_name or "none",
            "planner": cfg.planner or "none",
            "capacity": int(caps[c]),
            "capacity_fraction": float(caps[c] / E),
            "shared": cfg.shared,
            "mode": "cold" if cfg.cold else "stream",
            "batch_size": B,
            "hardware": profile.name,
            "alpha": spec.alpha,
        }
        results.append(
            ReplayResult(
                config=cfg_out,
                hit_rate=float(t["hits"].sum() / max(uses, 1)),
                hit_rate_per_layer=(t["hits"] / np.maximum(t["uses"], 1)).tolist(),
                prefetch_accuracy=float(t["pf_used"].sum() / inserted) if inserted else None,
                prefetches_issued=int(t["pf_issued"].sum()),
                prefetches_landed=int(t["pf_landed"].sum()),
                loads=int(t["loads"].sum()),
                cpu_experts=int(t["cpu"].sum()),
                cpu_expert_rate=float(t["cpu"].sum() / max(uses, 1)),
                bytes_moved=int((t["loads"].sum() + t["pf_started"].sum()) * m.expert_bytes),
                substitution_rate=float(t["subs"].sum() / max(uses, 1)),
                modeled_tpot_ms=tpot,
                tpot_basis="decode steps"
                if any_decode
                else "every token as a step (prefill-only trace, no decode steps)",
                layer_time_ms_per_layer=(t["time"] / max(n_steps, 1)).tolist(),
                requests=len(rids),
                tokens=int(d.lengths.sum()),
                steps=n_steps,
                accesses=int(uses),
                wall_s=wall / C,
                extra={"capacities_in_pass": C},
            )
        )
    return results


_HOT_MEMO: dict[tuple, tuple[StaticTable, str]] = {}


def _hot_table(ts: TraceSet, rids: list[str], d: _Data, E: int) -> tuple[StaticTable, str]:
    """PreScope's hot-expert table (Sec. 4.4) for the static policy and PreSched's start: counted on
    the TraceSet's other requests when only some are replayed (a profile of past traffic, as a
    deployment would have), on the replayed ones themselves when all are (in-sample, and said so).
    Kept for the next call on the same requests, as :func:`_data` is: reading the other requests
    takes ~1.3 s on the DeepSeek traces, and a bench or `compare` replays them many times."""
    key = (str(ts.path), ts.num_tokens, hash(tuple(rids)))
    if key not in _HOT_MEMO:
        chosen = set(rids)
        others = [r for r in ts.request_ids if r not in chosen]
        _HOT_MEMO.clear()
        _HOT_MEMO[key] = (
            (
                StaticTable.from_topk(ts.array("topk_ids", others), E),
                f"the {len(others)} requests not replayed",
            )
            if others
            else (StaticTable.from_topk(d.topk, E), "the replayed requests themselves (in-sample)")
        )
    return _HOT_MEMO[key]


def _fast_demand(d, eviction, caps, cold, cost, L, E, k, hot=None):
    """Demand-only per-layer replay at batch 1 (see :mod:`moecast.runtime.fastreplay`): statistics
    in the layout of the general engine, from the misses of every (token, layer, capacity)."""
    N = len(d.topk)
    C = len(caps)
    if eviction == "lru":
        dist = fast.lru_distances(d.topk, d.lengths, cold)
        misses = np.empty((N, L, C), dtype=np.int8)  # at most k per (token, layer)
        for ci, c in enumerate(caps):
            misses[:, :, ci] = (dist >= c).sum(2)
    elif eviction == "static":
        order = (hot if hot is not None else StaticTable.from_topk(d.topk, E)).per_layer(E)
        misses = fast.static_hits(d.topk, order, caps)
    else:
        misses = fast.simulate_demand(d.topk, d.lengths, cold, caps, eviction, E)
    lt = fast.layer_time_table(k, cost)
    per = lt[misses]  # [N, L, C] layer times
    miss_lc = misses.sum(0).T.reshape(-1)  # [C * L], index c * L + layer
    zeros = np.zeros(C * L)
    st = {
        n: zeros.copy()
        for n in ("cpu", "subs", "pf_issued", "pf_landed", "pf_started", "pf_used", "pf_inserted")
    }
    st["uses"] = np.full(C * L, float(N * k))
    st["hits"] = N * k - miss_lc.astype(np.float64)
    st["loads"] = miss_lc.astype(np.float64)
    st["time"] = per.sum(0).T.reshape(-1)
    any_decode = bool(d.decode.any())
    step = per.sum(1)  # [N, C]: B = 1, every token is one step
    basis = step[d.decode] if any_decode else step
    tpots = [float(basis[:, c].mean()) if len(basis) else None for c in range(C)]
    return st, tpots, any_decode, N


def _scoring_mode(*preds: Any) -> Any:
    """No autograd while checkpoints score a TraceSet (one batched call per request)."""
    import contextlib

    if all(p is None or isinstance(p, OraclePredictor) for p in preds):
        return contextlib.nullcontext()
    try:
        import torch
    except ImportError:
        return contextlib.nullcontext()
    return torch.inference_mode()


def _acc(target: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
    target += np.bincount(idx, weights=np.asarray(values, dtype=np.float64), minlength=len(target))


# ----------------------------------------------------------------------------- helpers


def _progress(it: Any, show: bool, desc: str) -> Any:
    if not show:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, leave=False, mininterval=0.5)


def _compact(a: np.ndarray) -> np.ndarray:
    """Move each row's non-negative entries to the front, keeping their order."""
    order = np.argsort(a < 0, axis=1, kind="stable")
    return np.take_along_axis(a, order, 1)


def _rank_candidates(ids: np.ndarray, scores: np.ndarray, E: int) -> np.ndarray:
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
    total = np.zeros(sid.shape)
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


def _union_counts(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def _next_layer_pending(act, lay, s, g, tok, pred_ids, cache, shared, L, E, prefetching):
    """PreSched's E_next: predicted experts of the next layer not resident there, with token counts, ascending."""
    n = len(act)
    if not prefetching:
        return None, np.zeros((n, 0)), np.zeros(n, dtype=np.int64)
    nl = np.minimum(lay + 1, L - 1)
    toks = tok[g, s]
    tv = toks >= 0
    pid = pred_ids[np.where(tv, toks, 0), nl[:, None]]
    pid = np.where(tv[:, :, None] & (pid >= 0), pid, -1).reshape(n, -1)
    if shared:
        pid = np.where(pid >= 0, pid + (nl * E)[:, None], -1)
    uniq, counts = _union_counts(pid)
    consumer = act if shared else np.where(lay < L - 1, act + 1, act)
    res = cache.lookup(consumer, uniq)
    keep = (uniq >= 0) & ~res & (lay < L - 1)[:, None]
    sizes = np.where(keep, counts, np.inf).astype(np.float64)
    sizes = np.sort(sizes, axis=1)
    nn = keep.sum(1)
    sizes = np.where(np.isfinite(sizes), sizes, 0.0)
    return None, sizes, nn
