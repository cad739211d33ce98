"""Trace replay: a discrete-event model of an offloaded MoE over a recorded TraceSet.

Semantics (docs/design.md, "Metrics"):

- A step is one token of each of B interleaved requests (decode batch size B). A layer's access is
  the union of the step's routed experts at that layer; hits are uses whose expert is resident when
  the layer runs. The hit-rate denominator counts every routed use after substitution, cold misses
  included.
- Prompt tokens of a TraceSet with decode steps are prefill (SMoE Sec. 4.1, as the live runtime does):
  neither substituted nor balanced, every miss loaded, no prefetch for them.
- Caches persist across requests (stream) or start afresh for each group of B requests (``cold``:
  empty, or PreScope's hot-expert table under a policy that preloads it); per layer (``capacity``
  experts each) or shared (``capacity * L`` experts for all layers).
- What happens at one layer (prefetch landing in the link window, substitution, demand loads, the
  CPU set, the layer time and the next layer's prefetch window, with the predictor's latency
  charged before a prefetch may start) is :class:`moecast.runtime.core.step.LayerStep`, the same step
  the live runtime takes; its docstring states the layer-time formula.
- Modeled TPOT: mean step time over steps that decode, a step being its layers' times plus the
  profile's ``step_ms`` (what follows the last layer: the final norm, the LM head); a prefill-only
  TraceSet (the imported DeepSeek traces) has no decode steps, so each of its tokens is treated as a
  step and the result says so (``tpot_basis``). A hot-expert table preloaded at each cache start is not in
  ``modeled_tpot_ms``; ``modeled_tpot_ms_with_preload`` charges its transfers, spread over the steps.

A replay (:func:`replay_capacities`) goes through named steps:

1. :func:`_prepare`: the policy, capacities, cost model, predictor and planner, the trace arrays and
   the hot-expert table (:func:`_hot_table`), checked once;
2. a fast engine where one serves the case (below);
3. :func:`_predictions`: each (token, layer)'s predicted experts and each request's plan;
4. :func:`_general`: the step grid (:func:`_grid`: streams x steps x B token slots), then per chunk of
   cold streams the lanes (:func:`_lanes`: one cache each, preloaded) and the wavefront
   (:func:`_iteration`: demand access, prefetch window and landing, CPU split, all in the step);
5. :func:`_results`: the metrics of docs/design.md per capacity.

Two expert copies (``expert_dtype`` ``mixed`` or ``HIGH+LOW``, :mod:`moecast.runtime.core.mixed`)
and the prefetch gate (a policy's ``gate``, :mod:`moecast.runtime.core.gate`: the calibration the
predictor's checkpoint carries, else one fitted on the val side of the predictor's split, or on
``calibrate_on``) run on the general engine only. Every row
reports the MB per token read (by copy, under two copies), the MB per token prefetched and never
used (``wasted_mb_per_token``), and under two copies the share of uses computed at the low one.

Two engines, kept equal:

- the general engine (this module) serves every case. It is vectorised over "lanes" (one cache
  each): with per-layer caches every (stream, layer) pair is a lane and the layers advance as a
  wavefront (lane of layer l handles step i - l at iteration i), so one call of the step moves all
  layers and all cold streams at once; a shared cache has one lane per stream and walks the layers
  in order. Under PreSched the lane of layer l handles step (i - l) / 2 (:func:`_skew`): its
  decision reads layer l+1's cache, which must hold the previous token, as it does live.
- the batch-1 engine (:mod:`moecast.runtime.replay.fastreplay`) serves per-layer caches at batch size 1
  at one expert precision, without substitution, planner or prefetch gate: demand-only ``lru``/``lfu``/``belady``/``static``, ``lru`` with
  prefetch (late or not) and/or PreSched, and ``lfu`` with prefetch. Its module docstring says
  how. tests/test_replay.py checks that it gives the general engine's statistics exactly
  (``ReplayConfig(fast=False)`` forces the general one), and tests/test_replay_hand.py pins both
  to rules computed by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from moecast.collect.traceset import TraceSet, TraceSetError
from moecast.predictors.base import BatchScorer, HotTable, PromptPlanner, normalised
from moecast.predictors.calibration import calibration_of, fit_on
from moecast.runtime.core import eviction
from moecast.runtime.core import spec as core_spec
from moecast.runtime.core.cache import StaticTable, hot_table, resolve_capacity
from moecast.runtime.core.cost_model import HardwareProfile
from moecast.runtime.core.gate import Calibration, candidate_probability
from moecast.runtime.core.mixed import Copies, bytes_by_copy, parse_copies, parse_copy, tag_of
from moecast.runtime.core.policy import POLICIES as POLICIES  # the presets, where bench looks them up
from moecast.runtime.core.policy import Policy
from moecast.runtime.core.prefetch import OraclePredictor, plan_prior, top_predictions
from moecast.runtime.core.spec import RuntimeSpec
from moecast.runtime.core.step import STATS, LayerStep, rank_candidates
from moecast.runtime.replay import fastreplay as fast

from moecast.errors import InputError


@dataclass
class ReplayConfig(RuntimeSpec):
    """A replay's settings: the runtime's (:class:`~moecast.runtime.core.spec.RuntimeSpec`: policy,
    capacity, hardware, alpha, score window, predictor latency, precision, with their defaults) and
    the replay's own below."""

    cold: bool = False
    shared: bool = False
    # none | oracle | checkpoint path | a loaded predictor object; None = the policy's default
    predictor: str | BatchScorer | None = None
    planner: str | None = None
    # weight of the plan as a log-linear prior on the token-level scores (prefetch.plan_prior)
    plan_weight: float = 0.1
    batch_size: int = 1
    requests: list[str] | None = None
    # the requests the hot-expert table (static, `--planner hot`, PreSched's start) is counted on
    # (None: those not replayed, else all of them)
    hot_requests: list[str] | None = None
    progress: bool = False
    chunk_lanes: int = 20000  # cold streams replayed together (bounds the per-lane state in memory)
    fast: bool = True  # use the fast paths where they apply (False: the general engine, for cross-checks)
    # the requests the prefetch gate calibrates on (runtime/core/gate.py); None: the val side of the
    # predictor's split
    calibrate_on: list[str] | None = None


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
    # hits over the uses of the steps the TPOT covers (decode steps: a prompt is prefilled, loaded on
    # demand and never prefetched, so hit_rate mixes in what no prefetch can change)
    decode_hit_rate: float | None = None
    # modeled TPOT with the hot-expert table's transfers at every cache start (None: no preload)
    modeled_tpot_ms_with_preload: float | None = None
    preload_ms: float = 0.0  # the preload's transfer time at one cache start
    predictor_ms: float = 0.0  # predictor latency charged per layer before a prefetch
    # per token (MB = 2**20 bytes): read over the link, and prefetched but never used (bytes_moved's
    # prefetches and plan preloads less those used, each at its copy's bytes)
    mb_per_token: float = 0.0
    wasted_mb_per_token: float = 0.0
    # two expert copies (runtime/core/mixed.py): MB per token read at each copy, the share of routed
    # uses computed at the low copy (None: one precision), high copies read over low ones
    mb_per_token_by_copy: dict[str, float] = field(default_factory=dict)
    low_share: float | None = None
    upgrades: int = 0
    gate_refused: int = 0  # late prefetches the prefetch gate did not start
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("config"))
        d.update(d.pop("extra"))
        return d


# ----------------------------------------------------------------------------- 1. preparation


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
        self.has_decode = bool(self.decode.any())
        self.probs = ts.array("router_probs", rids) if need_probs else None
        self.weights = ts.array("topk_weights", rids) if ts.has("topk_weights") else None


def _next_use(topk: np.ndarray, tok: np.ndarray, L: int, E: int, shared: bool) -> np.ndarray:
    """[tokens, L, k] the lane time of the next access of the same (lane, expert) (Belady's future)."""
    _G, S, _B = tok.shape
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


def _load_predictor(name: str | BatchScorer | None, ts: TraceSet) -> BatchScorer | None:
    if name in (None, "none"):
        return None
    if not isinstance(name, str):  # already loaded (a bench adapting a checkpoint to its model)
        return name
    if name == "oracle":
        return OraclePredictor(ts.num_layers, ts.num_experts, ts.top_k)
    from moecast.predictors import registry

    return registry.load(name, fingerprint=ts.meta.model.fingerprint, against=f"TraceSet {ts.path}")


def _load_planner(cfg: ReplayConfig, ts: TraceSet) -> BatchScorer | None:
    if cfg.planner != "hot":
        return _load_predictor(cfg.planner, ts)
    from moecast.predictors.baselines import HotTablePlanner

    replayed = list(cfg.requests) if cfg.requests is not None else list(ts.request_ids)
    return HotTablePlanner.fit(ts, _hot_source(ts, replayed, cfg.hot_requests)[0])


def _hot_counted_on(ts: TraceSet, replayed: list[str], hot_requests: list[str] | None) -> list[str]:
    """The requests a hot-expert table is counted on: ``hot_requests`` where given, else those not
    replayed (empty when every request is)."""
    if hot_requests:
        return list(hot_requests)
    chosen = set(replayed)
    return [r for r in ts.request_ids if r not in chosen]


def _hot_source(ts: TraceSet, replayed: list[str], hot_requests: list[str] | None) -> tuple[list[str], str]:
    """The requests a hot-expert table (static's, PreSched's start, ``--planner hot``) is counted on,
    and how a result says so: the replayed ones themselves when no other is (in-sample)."""
    others = _hot_counted_on(ts, replayed, hot_requests)
    if not others:
        return list(replayed), "the replayed requests themselves (in-sample)"
    return others, f"the {len(others)} requests " + ("of hot_requests" if hot_requests else "not replayed")


@dataclass
class _Run:
    """Everything a replay decided before it runs (see :func:`_prepare`)."""

    ts: TraceSet
    cfg: ReplayConfig
    policy: Policy
    rids: list[str]
    caps: np.ndarray  # experts per layer, per capacity replayed
    core: core_spec.Core  # the cost model, predictor latency and policy; builds the step
    pred_name: str
    predictor: BatchScorer | None
    planner: PromptPlanner | None
    data: _Data
    hot: StaticTable | None
    hot_from: str | None

    @property
    def copies(self) -> Copies | None:
        """Two expert copies (expert_dtype mixed / HIGH+LOW): the low one's cost; None for one precision."""
        return self.core.copies

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(L, E, k, B): MoE layers, experts, top-k, decode batch size."""
        m = self.ts.meta.model
        return m.num_layers, m.num_experts, m.top_k, int(self.cfg.batch_size)


@dataclass
class _Outcome:
    """An engine's statistics ([C * L], index capacity * L + layer) and its steps."""

    stats: dict[str, np.ndarray]
    tpots: list[float | None]  # mean step time over the basis steps, per capacity
    any_decode: bool
    n_steps: int
    n_basis: int  # steps the TPOT is the mean of
    starts: int  # cache starts: one per cold stream, or one for the whole stream


def expert_shape(ts: TraceSet) -> tuple[int, int, str]:
    """(hidden size, intermediate size, dtype) of the experts of the model a TraceSet recorded."""
    m = ts.meta.model
    # expert_bytes are in the dtype the traces were collected in (imports: bfloat16)
    dtype = str(ts.meta.collection.get("dtype", "bfloat16"))
    width = {"float32": 4, "float64": 8}.get(dtype, 2)
    return m.hidden_size, max(1, m.expert_bytes // (3 * m.hidden_size * width)), dtype


def _precision_tag(dtype: str, group_size: int) -> str:
    pair = parse_copies(dtype, group_size)
    if pair is not None:
        return "+".join(_precision_tag(d, g) for d, g in pair)
    return tag_of(*parse_copy(dtype, group_size))  # without torch, which a replay never needs otherwise


def expert_link_bytes(ts: TraceSet, expert_dtype: str, group_size: int) -> int:
    """One expert's bytes on the link at a precision: the recorded model's own where it is not
    quantized, else those of its gated expert (gate-up [2I, H], down [H, I]) as the precision stores it.
    Two copies (``mixed``, ``A+B``): the high copy's, which a slot must hold."""
    pair = parse_copies(expert_dtype, group_size)
    if pair is not None:
        return expert_link_bytes(ts, *pair[0])
    expert_dtype, group_size = parse_copy(expert_dtype, group_size)  # a tag's group (int4-g64) wins
    if expert_dtype == "model":
        return int(ts.meta.model.expert_bytes)
    import torch
    from moecast.runtime.tiers.precision import Precision, expert_nbytes

    prec = Precision(expert_dtype, group_size)
    hidden, inter, dtype = expert_shape(ts)
    # an import records how its source stored the weights (e.g. bitsandbytes int8); its expert_bytes
    # are the model's bfloat16 ones (expert_shape), so those are the weights a precision quantizes
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        dt = torch.bfloat16
    params = {
        "gate_up_proj": torch.empty((1, 2 * inter, hidden), dtype=dt, device="meta"),
        "down_proj": torch.empty((1, hidden, inter), dtype=dt, device="meta"),
    }
    return expert_nbytes(prec, params, transposed=False)


def slot_bytes(ts: TraceSet, cfg: ReplayConfig, profile: HardwareProfile, link: int) -> int:
    """One slot's bytes, which a capacity in bytes divides by: a device fast tier dequantizes one
    quantized copy into a slot of the model's dtype (as the live runtime's SlotDequantizer does), the
    CPU keeps the copy the link moved (``link``; two copies: the high one's)."""
    one_quantized = (
        cfg.expert_dtype != "model" and parse_copies(cfg.expert_dtype, int(cfg.group_size)) is None
    )
    return int(ts.meta.model.expert_bytes) if one_quantized and profile.fast_tier == "device" else link


def _low_link_bytes(ts: TraceSet, cfg: ReplayConfig) -> int | None:
    """The low copy's bytes where ``expert_dtype`` names two copies (runtime/core/mixed.py); else None."""
    pair = parse_copies(cfg.expert_dtype, int(cfg.group_size))
    return None if pair is None else expert_link_bytes(ts, *pair[1])


def _prepare(ts: TraceSet, cfg: ReplayConfig, capacities: list[float | str]) -> _Run:
    """Check a configuration against the TraceSet and load what the replay reads."""
    spec = cfg.rule()
    m = ts.meta.model
    E, k = m.num_experts, m.top_k
    rids = list(cfg.requests) if cfg.requests is not None else list(ts.request_ids)
    if not rids or ts.num_tokens == 0:
        raise TraceSetError(
            f"{ts.path}: the TraceSet holds no requests to replay; collect or import some first"
        )
    if int(cfg.batch_size) < 1:
        raise InputError(f"batch size must be >= 1, got {cfg.batch_size}")
    if spec.eviction == "score" or spec.substituting:
        ts.require("router_probs", f"policy {spec.name!r} (SMoE score eviction / substitution)")
    if spec.eviction == "score" and cfg.shared:
        raise InputError(
            "score eviction keeps one score window per layer; drop --shared or choose another policy"
        )
    link = expert_link_bytes(ts, cfg.expert_dtype, int(cfg.group_size))
    pred_name = ("oracle" if spec.prefetches else "none") if cfg.predictor is None else cfg.predictor
    predictor, planner = _predictors(ts, cfg, spec, pred_name)
    if predictor is not None and not isinstance(pred_name, str):
        pred_name = predictor.name
    # under static the predictor is the table it pins (_predictors checked it): it prefetches nothing
    pinned, predictor = (predictor, None) if spec.eviction == "static" else (None, predictor)
    core = core_spec.build_core(
        cfg, num_experts=E, num_layers=m.num_layers, expert_bytes=m.expert_bytes, link_bytes=link,
        low_link_bytes=_low_link_bytes(ts, cfg), predictor=predictor, prefetching=predictor is not None or planner is not None, policy=spec,
    )  # fmt: skip
    slot = slot_bytes(ts, cfg, core.profile, link)
    caps = np.array([resolve_capacity(c, E, k, slot) for c in capacities], dtype=np.int64)
    if len(caps) == 0:
        raise InputError("no capacities to replay")
    d = _data(ts, rids, need_probs=spec.eviction == "score" or spec.substituting)
    hot, hot_from = None, None
    if pinned is not None:  # a checkpoint's table (a frequency predictor's), as the live runtime pins it
        hot, hot_from = StaticTable(hot_table(pinned, m.num_layers, E)), f"the table of {pred_name}"
    elif spec.eviction == "static" or spec.preload == "hot":
        hot, hot_from = _hot_table(ts, rids, d, E, cfg.hot_requests)
    elif cfg.planner == "hot":  # the planner's table, counted as _load_planner counted it
        hot_from = _hot_source(ts, rids, cfg.hot_requests)[1]
    return _Run(ts, cfg, spec, rids, caps, core, pred_name, predictor, planner, d, hot, hot_from)


def _predictors(
    ts: TraceSet, cfg: ReplayConfig, spec: Policy, pred_name: str | BatchScorer
) -> tuple[BatchScorer | None, PromptPlanner | None]:
    """The prefetch predictor and the planner, refused where they could change nothing."""
    if spec.eviction == "belady" and (pred_name not in (None, "none") or cfg.planner):
        raise InputError(
            "belady is the demand-only offline optimum; use it with --predictor none and no --planner"
        )
    predictor = _load_predictor(pred_name, ts)
    if spec.eviction == "static" and predictor is not None:
        # the slots are fixed: a prefetch would move bytes and change no hit. Under static the
        # predictor is the table it pins, as in the live runtime (a --planner's plan is pinned in the
        # table's place for its request, as there too)
        if not isinstance(predictor, HotTable):
            raise InputError(
                f"static pins its experts and never inserts, so nothing can prefetch into it; its predictor is "
                f"the hot-expert table it pins, which {predictor.name} is not: give a frequency checkpoint "
                "(moecast predictors eval frequency --save CKPT) or --predictor none"
            )
        hot_table(predictor, ts.num_layers, ts.num_experts)  # its shape and scores checked here, once
    if not (math.isfinite(cfg.plan_weight) and cfg.plan_weight >= 0):
        raise InputError(f"--plan-weight must be a finite number >= 0, got {cfg.plan_weight}")
    planner = _load_planner(cfg, ts) if cfg.planner else None
    if planner is not None and (not isinstance(planner, PromptPlanner) or planner.horizon != "prompt-ahead"):
        # MoE-Infinity's matching is prompt-ahead in the paper's sense but reads the request's
        # routing so far, token by token: it has no plan to preload before decoding
        raise InputError(
            f"--planner {cfg.planner}: {planner.name} ({planner.horizon}) does not plan from the prompt; "
            "a planner is a prompt-ahead checkpoint with a plan (CasMoE's EAM, EAP or cascade, hot, or a kind of "
            "your own: docs/adding-a-predictor.md); give other predictors as --predictor"
        )
    for p in (p for p in (predictor, planner) if p is not None):
        for f in p.needs:
            ts.require(f, f"predictor {p.name}")
    return predictor, planner


# ----------------------------------------------------------------------------- replay


def replay(ts: TraceSet | str, cfg: ReplayConfig) -> ReplayResult:
    """Replay one configuration over a TraceSet and return the metrics of docs/design.md."""
    return replay_capacities(ts, cfg, [cfg.capacity])[0]


def replay_capacities(
    ts: TraceSet | str, cfg: ReplayConfig, capacities: list[float | str]
) -> list[ReplayResult]:
    """Replay ``cfg`` at several cache capacities in one vectorised pass (the caches are independent
    lanes, so this equals one :func:`replay` per capacity, at a fraction of the Python overhead)."""
    t0 = time.perf_counter()
    if not isinstance(ts, TraceSet):
        ts = TraceSet(ts)
    run = _prepare(ts, cfg, capacities)
    out, note = _fast_demand_engine(run), ""
    if out is None:
        pr = _remembered(run, "predictions", lambda: _predictions(run))
        if run.policy.gate != "none":
            # a checkpoint's calibration is read as it is now (`predictors calibrate` rewrites it)
            if _checkpoint_calibration(run) is not None:
                prob, note = _gate_probabilities(run, pr)
            else:
                prob, note = _remembered(run, "gate", lambda: _gate_probabilities(run, pr))
            pr = dataclasses.replace(pr, prob=prob)
        out = _fast_wavefront(run, pr) if _fast_wave_serves(run) else _general(run, pr)
    results = _results(run, out, time.perf_counter() - t0)
    for res in results if note else ():
        res.extra["gate_calibrated_on"] = note
    return results


# ----------------------------------------------------------------------------- 2. fast engines


def _one_copy(run: _Run) -> bool:
    """The fast engines know one expert precision and no prefetch gate (runtime/core/mixed.py, gate.py)."""
    return run.copies is None and run.policy.gate == "none"


def _fast_wave_serves(run: _Run) -> bool:
    """Whether the batch-1 wavefront (fastreplay.Wavefront) serves this run."""
    _L, E, _k, B = run.shape
    spec = run.policy
    return (
        run.cfg.fast
        and _one_copy(run)
        and not run.cfg.shared
        and B == 1
        and not spec.substituting
        and run.planner is None
        and (
            (spec.eviction == "lru" and spec.balancer in ("none", "presched"))
            or (spec.eviction == "lfu" and spec.balancer == "none" and spec.preload != "hot")
        )
        and fast.valid_for_fast(run.data.topk, E)
    )


def _fast_demand_engine(run: _Run) -> _Outcome | None:
    """The demand-only batch-1 paths, where they serve the run; None otherwise."""
    _L, E, k, B = run.shape
    spec, cfg, cost = run.policy, run.cfg, run.core.cost
    if (
        cfg.fast
        and _one_copy(run)
        and not cfg.shared
        and B == 1
        and not spec.substituting
        and run.predictor is None
        and run.planner is None
        and (spec.balancer == "none" or (spec.eviction, spec.balancer) == ("static", "cpu"))
        and spec.preload != "hot"
        and spec.eviction in eviction.FAST_REPLAY
        and fast.valid_for_fast(run.data.topk, E)
    ):
        return _fast_demand(run, spec.eviction)
    t_io = cost.t_io
    if (
        _fast_wave_serves(run)
        and spec.balancer == "none"
        and spec.preload != "hot"
        and not spec.late_prefetch  # one late prefetch starts whatever the window
        and cost.t_rc <= t_io  # a read's compute time then never outlasts the read (the bound below)
        and (math.isinf(t_io) or (t_io > 0 and (cost.t_attn + k * cost.t_g) * (1 + 1e-12) / t_io + 1e-9 < 1))
    ):
        # A prefetch starts only when it fits in the link time the previous layer leaves free,
        # and at batch 1 that is at most t_attn + k * t_g (the device time of its k experts):
        # below one transfer no prefetch can ever start, so this is the demand-only eviction exactly.
        return _fast_demand(run, spec.eviction)
    return None


def _fast_demand(run: _Run, eviction: str) -> _Outcome:
    """Demand-only per-layer replay at batch 1 (see :mod:`moecast.runtime.replay.fastreplay`): statistics
    in the layout of the general engine, from the misses of every (token, layer, capacity)."""
    d, caps, cold = run.data, run.caps, run.cfg.cold
    L, E, k, _B = run.shape
    N = len(d.topk)
    C = len(caps)
    if eviction == "lru":
        dist = fast.lru_distances(d.topk, d.lengths, cold)
        misses = np.empty((N, L, C), dtype=np.int8)  # at most k per (token, layer)
        for ci, c in enumerate(caps):
            misses[:, :, ci] = (dist >= c).sum(2)
    elif eviction == "static":
        order = (run.hot if run.hot is not None else StaticTable.from_topk(d.topk, E)).per_layer(E)
        misses = fast.static_misses(d.topk, order, caps)
    else:
        misses = fast.simulate_demand(d.topk, d.lengths, cold, caps, eviction, E)
    on_cpu = run.policy.balancer == "cpu"  # static: every miss on the CPU (it never loads)
    lt = fast.layer_time_table(k, run.core.cost, on_cpu)
    per = lt[misses]  # [N, L, C] layer times
    miss_lc = misses.sum(0).T.reshape(-1)  # [C * L], index c * L + layer
    st = {name: np.zeros(C * L) for name in STATS}
    st["uses"] = np.full(C * L, float(N * k))
    st["hits"] = N * k - miss_lc.astype(np.float64)
    dec = d.decode if d.decode.any() else np.ones(N, dtype=bool)  # the TPOT's steps
    st["dec_uses"] = np.full(C * L, float(dec.sum() * k))
    st["dec_hits"] = st["dec_uses"] - misses[dec].sum(0).T.reshape(-1).astype(np.float64)
    st["cpu" if on_cpu else "loads"] = miss_lc.astype(np.float64)
    st["time"] = per.sum(0).T.reshape(-1)
    any_decode = bool(d.decode.any())
    step = per.sum(1)  # [N, C]: B = 1, every token is one step
    basis = step[d.decode] if any_decode else step
    tpots = [float(basis[:, c].mean()) if len(basis) else None for c in range(C)]
    return _Outcome(st, tpots, any_decode, N, len(basis), len(d.lengths) if cold else 1)


def _fast_wavefront(run: _Run, pr: _Predictions) -> _Outcome:
    """LRU with prefetch (late or not) and/or PreSched, or LFU with prefetch, at batch 1
    (fastreplay.Wavefront)."""
    d, spec = run.data, run.policy
    L, E, _k, _B = run.shape
    cand = None
    if pr.ids is not None:
        # B = 1: each (token, layer)'s candidates ranked once for the whole TraceSet, in chunks
        if isinstance(run.predictor, OraclePredictor):
            # equal scores, distinct ids: the ranking keeps ascending id order
            cand = np.sort(pr.ids, axis=2)
        else:
            n_tok, kp = len(d.topk), pr.ids.shape[2]
            cand = np.empty((n_tok, L, kp), dtype=np.int64)
            for c0 in range(0, n_tok, 8192):
                c1 = min(n_tok, c0 + 8192)
                cand[c0:c1] = rank_candidates(
                    pr.ids[c0:c1].reshape(-1, kp), pr.scores[c0:c1].reshape(-1, kp), E
                ).reshape(c1 - c0, L, kp)
    pre = run.hot.per_layer(int(run.caps.max())) if spec.preload == "hot" else None
    any_decode = bool(d.decode.any())
    basis = d.decode if any_decode else np.ones(len(d.topk), dtype=bool)
    st = fast.Wavefront(
        d.topk, d.lengths, run.cfg.cold, run.caps, E, run.core.cost, spec.balancer, cand, pr.ids, basis, pre,
        predictor_ms=run.core.predictor_ms, decode=d.decode if d.has_decode else None, late=spec.late_prefetch,
        policy=spec.eviction,
    ).run()  # fmt: skip
    n_basis = int(basis.sum())
    tpots = [float(v / n_basis) if n_basis else None for v in st.pop("tpot_sum")]
    return _Outcome(st, tpots, any_decode, len(d.topk), n_basis, len(d.lengths) if run.cfg.cold else 1)


# ----------------------------------------------------------------------------- 3. predictions


@dataclass
class _Predictions:
    ids: np.ndarray | None  # [tokens, L, kp] predicted ids, best first (-1: none)
    scores: np.ndarray | None  # [tokens, L, kp] their scores
    plan_top: np.ndarray | None  # [requests, L, capacity] each request's planned experts, best first
    prob: np.ndarray | None = None  # [tokens, L, kp] calibrated P(used) of each prediction (the gate's)


def _predictions(run: _Run) -> _Predictions:
    """Per (token, layer) the top-k predicted ids (a plan as a prior on them), per request its plan."""
    predictor, planner, d = run.predictor, run.planner, run.data
    L, _E, k, _B = run.shape
    if predictor is None and planner is None:
        return _Predictions(None, None, None)
    oracle = isinstance(predictor, OraclePredictor)
    pred_ids = np.full((len(d.topk), L, k), -1, dtype=np.int64)
    pred_sc = np.zeros((len(d.topk), L, k), dtype=np.float32)
    if oracle:
        pred_ids[:] = d.topk
        pred_sc[:] = 1.0
    if planner is None and (oracle or predictor is None):
        return _Predictions(pred_ids, pred_sc, None)
    cap = int(run.caps.max())
    plan_top = np.zeros((len(run.rids), L, cap), dtype=np.int64) if planner is not None else None
    it = _progress(list(enumerate(run.rids)), run.cfg.progress and not oracle, "predicting")
    with _scoring_mode(predictor, planner):
        for r, rid in it:
            s0, n = d.starts[r], d.lengths[r]
            sc, plan = _request_scores(run, run.ts.get(rid), oracle)
            if plan is not None:
                plan_top[r] = np.argsort(-plan, axis=1, kind="stable")[:, :cap]
            if sc is not None:
                ids, scs = top_predictions(sc, k)
                pred_ids[s0 : s0 + n], pred_sc[s0 : s0 + n] = ids, scs
    return _Predictions(pred_ids, pred_sc, plan_top)


def _request_scores(run: _Run, trace: Any, oracle: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A request's token-level scores [T, L, E] (None: none to score) and its plan [L, E] (None: no
    planner)."""
    predictor, planner = run.predictor, run.planner
    sc = raw_sc = plan = None
    if predictor is not None and not oracle:
        raw_sc = np.asarray(predictor.score_request(trace), dtype=np.float32)
        sc = normalised(raw_sc)
    if planner is not None:
        plan = np.asarray(planner.score_request(trace), dtype=np.float32)[0]  # [L, E]
        # Alone, a plan only preloads (CasMoE plans before decoding); as a constant per-token
        # prefetch it would evict the experts the previous token just used, which at small
        # capacities are the likeliest next ones.
        if sc is not None:
            # the plan as a prior on the token-level scores; a light weight, since a
            # request-wide plan knows less about the next token than the predictor does
            sc = plan_prior(raw_sc, plan, run.cfg.plan_weight)
    return sc, plan


_PRED_MEMO: dict[tuple, Any] = {}


def _remembered(run: _Run, what: str, make: Any) -> Any:
    """``make()``, kept for the next run of the same requests with the same checkpoints (a `compare`
    replays each predictor under several policies and precisions; scoring a TraceSet with a
    checkpoint dominates its replay). Kept only where the checkpoints are named by path."""
    cfg = run.cfg
    named = isinstance(cfg.predictor, (str, type(None))) and isinstance(cfg.planner, (str, type(None)))
    if not named:
        return make()
    key = (
        what, str(run.ts.path), run.ts.num_tokens, hash(tuple(run.rids)), cfg.predictor, run.pred_name,
        cfg.planner, cfg.plan_weight, int(run.caps.max()),
        None if cfg.calibrate_on is None else tuple(cfg.calibrate_on),
        _file_version(cfg.predictor), _file_version(cfg.planner),
    )  # fmt: skip
    if key not in _PRED_MEMO:
        for old in [k for k in _PRED_MEMO if k[0] == what]:
            del _PRED_MEMO[old]
        _PRED_MEMO[key] = make()
    return _PRED_MEMO[key]


def _file_version(name: str | None) -> tuple[int, int, int] | None:
    """A checkpoint file's (inode, modification time, size), so that a checkpoint saved again at the same
    path (a notebook's fit, save, replay) is scored anew: a save renames a new file into place, a new
    inode even within the filesystem's timestamp granularity. None for a name that is no file (oracle)."""
    try:
        st = os.stat(name) if name else None
    except OSError:
        return None
    return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)


def _gate_probabilities(run: _Run, pr: _Predictions) -> tuple[np.ndarray | None, str]:
    """Under the prefetch gate: each prediction's P(used), from the checkpoint's :class:`Calibration`
    (``moecast predictors calibrate``), else one fitted here on the val side of the predictor's split,
    or on ``calibrate_on`` (runtime/core/gate.py), and what it was fitted on; (None, "") without a
    prediction."""
    if pr.ids is None:
        return None, ""
    saved = _checkpoint_calibration(run)
    if saved is not None:
        return np.where(pr.ids >= 0, saved[0].probability(pr.scores), 0.0), saved[1]
    rids, side = _calibration_requests(run)
    oracle = isinstance(run.predictor, OraclePredictor)
    k = run.shape[2]

    def labelled() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for rid in _progress(rids, run.cfg.progress and not oracle, f"calibrating the gate on {side}"):
            trace = run.ts.get(rid)
            topk = np.asarray(trace.topk_ids, dtype=np.int64)
            sc, _plan = _request_scores(run, trace, oracle)
            if sc is None:  # the oracle: its predictions are the routing
                yield topk, np.ones(topk.shape, np.float32), topk
            else:
                yield (*top_predictions(sc, k), topk)

    with _scoring_mode(run.predictor, run.planner):
        cal = fit_on(labelled())
    if cal is None:
        raise InputError(
            f"the prefetch gate calibrates on the {side} side of the predictor's split, which holds no request "
            f"of {run.ts.path}; give calibrate_on requests or use a policy without the gate"
        )
    overlap = len(set(rids) & set(run.rids))
    note = f"the {len(rids)} {side} requests" + (
        f" ({overlap} of them replayed too: in-sample)" if overlap else ""
    )
    return np.where(pr.ids >= 0, cal.probability(pr.scores), 0.0), note


def _checkpoint_calibration(run: _Run) -> tuple[Calibration, str] | None:
    """The calibration the predictor's checkpoint carries (``moecast predictors calibrate``) and what
    it was fitted on; None where it has none, where ``calibrate_on`` asks for another, or under a
    planner, whose prior moves the scores it was fitted on."""
    cal = calibration_of(run.predictor)
    if cal is None or run.cfg.calibrate_on is not None or run.planner is not None:
        return None
    about = (getattr(run.predictor, "checkpoint_meta", None) or {}).get("gate_calibration") or {}
    on = f": {about['requests']} {about['side']} requests of {about['traces']}" if about else ""
    return cal, f"the checkpoint's calibration ({cal.samples} predictions{on})"


def _calibration_requests(run: _Run) -> tuple[list[str], str]:
    """(the requests the gate calibrates on, which side they are): ``calibrate_on``, else the val
    side of the split the predictor was trained on (the default split for the oracle)."""
    if run.cfg.calibrate_on is not None:
        return list(run.cfg.calibrate_on), "calibrate_on"
    from moecast.predictors.provenance import choose, trained_on

    pred = run.predictor
    record = trained_on(pred) if pred is not None and not isinstance(pred, OraclePredictor) else None
    return choose(run.ts, record, "val").requests, "val"


# ----------------------------------------------------------------------------- 4. the general engine


def _general(run: _Run, pr: _Predictions) -> _Outcome:
    """The general engine over the step grid, in chunks of cold streams (see the module docstring)."""
    cfg, d = run.cfg, run.data
    L, E, _k, B = run.shape
    C = len(run.caps)
    tok, start = _grid(d.lengths, d.starts, B, cfg.cold)
    G, S, _ = tok.shape
    stream_len = (tok >= 0).any(2).sum(1)  # steps per stream (slots finish at different times)
    reads = eviction.get(run.policy.eviction).reads
    nu = _next_use(d.topk, tok, L, E, cfg.shared) if "nu" in reads else None
    stats = {name: np.zeros(C * L) for name in STATS}
    step_time = np.zeros((C, G, S))
    step_decode = np.zeros((G, S), dtype=bool)
    # Cold streams are independent: replay them in chunks of similar length so the per-lane state
    # stays small (memory bound otherwise) and short streams do not idle behind long ones.
    by_len = np.argsort(-stream_len, kind="stable")
    per_chunk = max(1, cfg.chunk_lanes // (C * (1 if cfg.shared else L)))
    for c0 in range(0, G, per_chunk):
        gmap = by_len[c0 : c0 + per_chunk]
        ch = _Chunk(tok[gmap], start[gmap], stream_len[gmap], gmap)
        ln = _lanes(run, pr, ch)
        for i in _progress(range(ln.n_iter), cfg.progress, f"replay {run.policy.name}"):
            _iteration(run, pr, ch, ln, i, nu, step_time, step_decode)
        for name in STATS:
            stats[name] += ln.step.stats[name]
    valid_step = np.arange(S)[None, :] < stream_len[:, None]
    any_decode = bool(step_decode.any())
    basis = valid_step & step_decode if any_decode else valid_step
    tpots = [float(step_time[c][basis].mean()) if basis.any() else None for c in range(C)]
    return _Outcome(stats, tpots, any_decode, int(valid_step.sum()), int(basis.sum()), G)


def _grid(lengths: np.ndarray, starts: np.ndarray, B: int, cold: bool) -> tuple[np.ndarray, np.ndarray]:
    """The step grid: [streams, steps, B] token index (-1 = idle slot) and request-start flags."""
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


@dataclass
class _Chunk:
    tok: np.ndarray  # [G, S, B] token index per stream, step and slot (-1 idle)
    start: np.ndarray  # [G, S, B] a request starts in the slot
    stream_len: np.ndarray  # [G] steps per stream
    gmap: np.ndarray  # [G] the streams' indices in the whole grid


@dataclass
class _Lanes:
    """The chunk's caches (lanes) under the step, and where each lane sits."""

    step: LayerStep
    cap_of: np.ndarray  # [lanes] capacity index
    layer_of: np.ndarray  # [lanes] layer (per-layer caches; 0 for shared ones)
    stream_of: np.ndarray  # [lanes] stream in the chunk
    n_iter: int
    order: np.ndarray | None = None  # per-layer: lanes by the iteration they end, latest first
    sorted_end: np.ndarray | None = None
    skew: int = 1  # iterations between a lane's steps (_skew)


def _lanes(run: _Run, pr: _Predictions, ch: _Chunk) -> _Lanes:
    """One cache per (capacity, stream[, layer]), preloaded with the hot-expert table when there is one."""
    cfg, caps = run.cfg, run.caps
    L, _E, _k, _B = run.shape
    C, G = len(caps), len(ch.gmap)
    lanes = C * G if cfg.shared else C * G * L
    cap_of = np.repeat(np.arange(C), lanes // C)
    per_cap = caps * L if cfg.shared else caps
    step = run.core.step(per_cap[cap_of], stat_base=cap_of * L, n_stats=C * L, shared=cfg.shared)
    cache = step.cache
    cap = int(caps.max())
    if run.hot is not None:
        if cfg.shared:
            cache.preload(np.arange(lanes), np.broadcast_to(run.hot.shared(cap * L), (lanes, cap * L)))
        else:
            per = run.hot.per_layer(cap)  # [L, cap]; each lane keeps the first capacity_of[lane]
            cache.preload(np.arange(lanes), np.tile(per, (C * G, 1)))
    if cfg.shared:
        stream_of = np.tile(np.arange(G), C)
        return _Lanes(step, cap_of, np.zeros(lanes, dtype=np.int64), stream_of, int(ch.stream_len.max()) * L)
    layer_of = np.tile(np.arange(L), C * G)
    stream_of = np.tile(np.repeat(np.arange(G), L), C)
    skew = _skew(run, pr)
    lane_end = skew * (ch.stream_len[stream_of] - 1) + 1 + layer_of
    order = np.argsort(-lane_end, kind="stable")
    n_iter = skew * (int(ch.stream_len.max()) - 1) + L
    return _Lanes(step, cap_of, layer_of, stream_of, n_iter, order, lane_end[order], skew)


def _skew(run: _Run, pr: _Predictions) -> int:
    """Iterations between a lane's steps: 2 under PreSched with predictions, whose decision at layer
    l reads layer l+1's cache as the previous token left it (step s of layer l runs at iteration
    skew * s + l, so that token's row at layer l+1 ran one before); 1 otherwise."""
    return 2 if pr.ids is not None and run.policy.balancer == "presched" else 1


def _active(ln: _Lanes, ch: _Chunk, i: int, L: int, shared: bool) -> tuple[np.ndarray, ...]:
    """The lanes that run at iteration ``i``: (lanes, their layer, their step, their stream)."""
    if shared:
        s_i, l_i = divmod(i, L)
        act = np.flatnonzero(ch.stream_len[ln.stream_of] > s_i)
        return act, np.full(len(act), l_i), np.full(len(act), s_i), ln.stream_of[act]
    n_act = int(np.searchsorted(-ln.sorted_end, -i, side="left"))  # lanes with end > i
    act = ln.order[:n_act]
    if ln.skew > 1:
        off = i - ln.layer_of[act]
        act = act[(off >= 0) & (off % ln.skew == 0)]  # the lanes with a step now
    elif i < L - 1:
        act = act[ln.layer_of[act] <= i]  # warm-up: deeper layers not started yet
    lay = ln.layer_of[act]
    return act, lay, (i - lay) // ln.skew, ln.stream_of[act]


def _iteration(
    run: _Run,
    pr: _Predictions,
    ch: _Chunk,
    ln: _Lanes,
    i: int,
    nu: np.ndarray | None,
    step_time: np.ndarray,
    step_decode: np.ndarray,
) -> None:
    """One wavefront iteration: every active lane's layer through the step."""
    d, shared = run.data, run.cfg.shared
    L, E, _k, _B = run.shape
    act, lay, s, g = _active(ln, ch, i, L, shared)
    if len(act) == 0:
        return
    toks = ch.tok[g, s]  # [n, B]
    tvalid = toks >= 0
    tsafe = np.where(tvalid, toks, 0)
    ids = np.where(tvalid[:, :, None], d.topk[tsafe, lay[:, None]], -1)  # [n, B, k]
    lt = s * L + lay  # lane time
    dec = (d.decode[tsafe] & tvalid).any(1)
    step_decode[ch.gmap[g], s] |= dec
    # a TraceSet without decode steps has each token replayed as one (tpot_basis)
    decode = dec if d.has_decode else None
    if pr.plan_top is not None:
        _plan_preload(run, pr, ch, ln, act, lay, g, s, toks, tvalid)
    if pr.ids is not None:
        ranked = _ranked(run, pr, tsafe, tvalid, lay)
        if decode is not None:
            ranked[~decode] = -1  # prefill prefetches nothing
        prob = _ranked_prob(run, pr, tsafe, tvalid, lay, ranked) if pr.prob is not None else None
        ln.step.prefetch(act, lay, ranked, lt, prob)
    has_next = lay < L - 1
    next_lanes = act if shared else np.where(has_next, act + 1, act)
    restart = ~has_next if shared else lay == 0
    next_pred = None
    if pr.ids is not None and run.policy.balancer == "presched":
        nl = np.minimum(lay + 1, L - 1)
        pid = pr.ids[tsafe, nl[:, None]]
        next_pred = np.where(tvalid[:, :, None] & (pid >= 0), pid, -1).reshape(len(act), -1)
        if shared:
            next_pred = np.where(next_pred >= 0, next_pred + (nl * E)[:, None], -1)
    next_use = None
    if nu is not None:
        next_use = np.where(tvalid[:, :, None], nu[tsafe, lay[:, None]], np.iinfo(np.int64).max // 4)
        next_use = next_use.reshape(len(act), -1)
    probs = d.probs[tsafe, lay[:, None]] if d.probs is not None else None
    out = ln.step.layer(act, lay, ids, lt, probs, next_lanes, has_next, restart, next_pred, next_use, decode)
    step_time[ln.cap_of[act], ch.gmap[g], s] += out.layer_t


def _ranked(
    run: _Run, pr: _Predictions, tsafe: np.ndarray, tvalid: np.ndarray, lay: np.ndarray
) -> np.ndarray:
    """The rows' predicted experts for their layer, distinct and ranked by summed score (cache items)."""
    n = len(lay)
    pid = pr.ids[tsafe, lay[:, None]]  # [n, B, kp]
    psc = np.where(tvalid[:, :, None], pr.scores[tsafe, lay[:, None]], 0.0)
    pid = np.where(tvalid[:, :, None] & (pid >= 0), pid, -1)
    ranked = rank_candidates(pid.reshape(n, -1), psc.reshape(n, -1), run.shape[1])
    if run.cfg.shared:
        ranked = np.where(ranked >= 0, ranked + (lay * run.shape[1])[:, None], -1)
    return ranked


def _ranked_prob(
    run: _Run, pr: _Predictions, tsafe: np.ndarray, tvalid: np.ndarray, lay: np.ndarray, ranked: np.ndarray
) -> np.ndarray:
    """[n, M] the calibrated P(used) of each ranked candidate (gate.candidate_probability)."""
    n = len(lay)
    pid = pr.ids[tsafe, lay[:, None]]
    pid = np.where(tvalid[:, :, None] & (pid >= 0), pid, -1).reshape(n, -1)
    if run.cfg.shared:
        pid = np.where(pid >= 0, pid + (lay * run.shape[1])[:, None], -1)
    return candidate_probability(ranked, pid, pr.prob[tsafe, lay[:, None]].reshape(n, -1))


def _plan_preload(
    run: _Run,
    pr: _Predictions,
    ch: _Chunk,
    ln: _Lanes,
    act: np.ndarray,
    lay: np.ndarray,
    g: np.ndarray,
    s: np.ndarray,
    toks: np.ndarray,
    tvalid: np.ndarray,
) -> None:
    """A planner's preload at request start (not timed: it happens before the first token)."""
    d, cache = run.data, ln.step.cache
    _L, E, _k, B = run.shape
    starting = (ch.start[g, s] & tvalid).any(1)
    if not starting.any():
        return
    lanes, layer = act[starting], lay[starting]
    rq = np.searchsorted(d.starts, toks[starting].max(1), side="right") - 1
    plan_ids = pr.plan_top[rq, layer][:, : max(int(run.caps.max()) // B, 1)]
    if run.cfg.shared:
        plan_ids = plan_ids + (layer * E)[:, None]
    if run.policy.eviction == "static":
        # static never inserts: the request's plan is pinned in the table's place (CasMoE's
        # per-prompt placement); what was not resident is transferred
        new = (plan_ids >= 0) & ~cache.lookup(lanes, plan_ids)
        new &= np.cumsum(plan_ids >= 0, axis=1) <= cache.capacity_of[lanes][:, None]
        # the transferred ones count as a plan's other preloads do: prefetched until used
        cache.preload(lanes, plan_ids, moved=new)
        ins = new
    else:
        ins = cache.insert(lanes, plan_ids, prefetch=True, t=None)
        ln.step.set_copy(lanes, plan_ids, ins)
    ln.step.add("pf_inserted", lanes, layer, ins.sum(1))
    ln.step.add("plan_loads", lanes, layer, ins.sum(1))


# ----------------------------------------------------------------------------- 5. results


def _results(run: _Run, out: _Outcome, wall: float) -> list[ReplayResult]:
    """Per capacity: the metrics of docs/design.md from the [C * L] statistics (index c * L + layer)."""
    L, _E, _k, _B = run.shape
    C = len(run.caps)
    basis = (
        "decode steps" if out.any_decode else "every token as a step (prefill-only trace, no decode steps)"
    )
    # substitution's denominator: the routed uses of the steps it may act on (the live runtime's)
    d = run.data
    routed = int((d.topk[d.decode] >= 0).sum() if out.any_decode else (d.topk >= 0).sum())
    results = []
    for c in range(C):
        t = {name: v[c * L : (c + 1) * L] for name, v in out.stats.items()}
        for name in STATS:  # the fast engines leave out what they never count
            t.setdefault(name, np.zeros(L))
        uses = t["uses"].sum()
        tpot = out.tpots[c]
        if tpot is not None and not math.isfinite(tpot):
            tpot = None
        if tpot is not None:  # each step ends after its last layer (final norm, LM head)
            tpot += run.core.cost.t_step
        inserted = t["pf_inserted"].sum()
        preload_ms, with_preload = _preload_charge(run, out, c, tpot)
        moved = _bytes_by_copy(run, t)
        res = ReplayResult(
            config=_config_row(run, c),
            hit_rate=float(t["hits"].sum() / max(uses, 1)),
            decode_hit_rate=float(t["dec_hits"].sum() / t["dec_uses"].sum()) if t["dec_uses"].sum() else None,
            hit_rate_per_layer=(t["hits"] / np.maximum(t["uses"], 1)).tolist(),
            prefetch_accuracy=float(t["pf_used"].sum() / inserted) if inserted else None,
            prefetches_issued=int(t["pf_issued"].sum()),
            prefetches_landed=int(t["pf_landed"].sum()),
            loads=int(t["loads"].sum()),
            cpu_experts=int(t["cpu"].sum()),
            cpu_expert_rate=float(t["cpu"].sum() / max(uses, 1)),
            bytes_moved=int(moved["high"] + moved["low"]),
            substitution_rate=float(t["subs"].sum() / max(routed, 1)),
            modeled_tpot_ms=tpot,
            tpot_basis=basis,
            layer_time_ms_per_layer=(t["time"] / max(out.n_steps, 1)).tolist(),
            requests=len(run.rids),
            tokens=int(run.data.lengths.sum()),
            steps=out.n_steps,
            accesses=int(uses),
            wall_s=wall / C,
            modeled_tpot_ms_with_preload=with_preload,
            preload_ms=preload_ms,
            predictor_ms=run.core.predictor_ms,
            extra={"capacities_in_pass": C},
            **_byte_figures(run, t, moved),
        )
        if run.hot_from:
            res.extra["hot_table_from"] = run.hot_from
        results.append(res)
    return results


def _bytes_by_copy(run: _Run, t: dict[str, np.ndarray]) -> dict[str, float]:
    """Bytes read at each copy, and those prefetched (or plan-preloaded) and never used, from one
    capacity's statistics (:func:`moecast.runtime.core.mixed.bytes_by_copy`)."""
    lo = run.copies.low.expert_bytes if run.copies is not None else None
    return bytes_by_copy(t, run.core.cost.expert_bytes, lo)


def _byte_figures(run: _Run, t: dict[str, np.ndarray], moved: dict[str, float]) -> dict[str, Any]:
    """ReplayResult's per-token byte figures, low_share, upgrades and gate refusals."""
    per = max(int(run.data.lengths.sum()), 1) * float(1 << 20)
    by_copy = (
        {run.copies.high_tag: moved["high"] / per, run.copies.low_tag: moved["low"] / per}
        if run.copies
        else {}
    )
    uses = t["uses"].sum()
    return {
        "mb_per_token": (moved["high"] + moved["low"]) / per,
        "wasted_mb_per_token": max(moved["wasted"], 0.0) / per,
        "mb_per_token_by_copy": by_copy,
        "low_share": float(t["low_uses"].sum() / max(uses, 1)) if run.copies is not None else None,
        "upgrades": int(t["upgrades"].sum()),
        "gate_refused": int(t["pf_refused"].sum()),
    }


def _config_row(run: _Run, c: int) -> dict[str, Any]:
    spec, cfg = run.policy, run.cfg
    E = run.shape[1]
    return {
        "traces": str(run.ts.path),
        "policy": spec.name,
        "eviction": spec.eviction,
        "substitution": spec.substituting,
        "balancer": spec.balancer,
        "predictor": run.pred_name or "none",
        "planner": cfg.planner or "none",
        "capacity": int(run.caps[c]),
        "capacity_fraction": float(run.caps[c] / E),
        "shared": cfg.shared,
        "mode": "cold" if cfg.cold else "stream",
        "batch_size": run.shape[3],
        "hardware": run.core.profile.name,
        "alpha": spec.alpha,
        "predictor_ms_from": run.core.predictor_ms_from,
        "expert_dtype": _precision_tag(cfg.expert_dtype, int(cfg.group_size)),
        "expert_bytes": run.core.cost.expert_bytes,
    }


def _preload_charge(run: _Run, out: _Outcome, c: int, tpot: float | None) -> tuple[float, float | None]:
    """(transfer time of the hot-expert table at one cache start, TPOT with it charged at every start)."""
    if run.policy.preload != "hot":
        return 0.0, None
    L, E, _k, _B = run.shape
    n = min(int(run.caps[c]) * L, L * E) if run.cfg.shared else L * min(int(run.caps[c]), E)
    t_io = run.core.cost.t_io
    ms = n * t_io if n else 0.0
    if tpot is None or not out.n_basis or not math.isfinite(ms):
        return ms, None
    return ms, tpot + out.starts * ms / out.n_basis


_HOT_MEMO: dict[tuple, tuple[StaticTable, str]] = {}


def _hot_table(
    ts: TraceSet, rids: list[str], d: _Data, E: int, counted: list[str] | None = None
) -> tuple[StaticTable, str]:
    """PreScope's hot-expert table (Sec. 4.4) for the static policy and PreSched's start: counted on
    ``counted`` (``hot_requests``) where given, else on the TraceSet's other requests when only some
    are replayed (a profile of past traffic, as a deployment would have), on the replayed ones
    themselves when all are (in-sample, and said so). Kept for the next call on the same requests, as
    :func:`_data` is: reading the other requests takes ~1.3 s on the DeepSeek traces, and a bench or
    `compare` replays them many times."""
    key = (str(ts.path), ts.num_tokens, hash(tuple(rids)), hash(tuple(counted or ())))
    if key not in _HOT_MEMO:
        others, said = _hot_source(ts, rids, counted)
        _HOT_MEMO.clear()
        # the replayed requests themselves: their arrays are read already
        topk = d.topk if others == list(rids) else ts.array("topk_ids", others)
        _HOT_MEMO[key] = (StaticTable.from_topk(topk, E), said)
    return _HOT_MEMO[key]


def _scoring_mode(*preds: BatchScorer | None) -> contextlib.AbstractContextManager:
    """No autograd while checkpoints score a TraceSet (one batched call per request)."""
    if all(p is None or isinstance(p, OraclePredictor) for p in preds):
        return contextlib.nullcontext()
    try:
        import torch
    except ImportError:
        return contextlib.nullcontext()
    return torch.inference_mode()


# ----------------------------------------------------------------------------- helpers


def _progress(it: Any, show: bool, desc: str) -> Any:
    if not show:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, leave=False, mininterval=0.5)
