"""Measured TPOT with the experts on disk: moecast's disk tier against what a CPU user runs today.

    python bench/bench_tiers.py [--layers N] [--quick] [--json] [--predictor DS_CKPT]
                                [--capacities 0.1,0.25,0.5] [--noise N] [--out DIR]

The model is bench/ds_model.py's DeepSeek-V2-Lite-shaped one (hidden 2048, expert intermediate 1408,
64 routed + 2 shared experts, top-6, bf16, random weights; 26 MoE layers, ``--layers`` fewer), its
routing replaced by the recorded ids of held-out DeepSeek requests (a benchmark mode). Its experts
are generated once into an offload directory under $MOECAST_HOME/bench_tiers (runtime/tiers/offload.py's
format: one aligned block per expert), and every configuration reads them from there; the other
weights are loaded once (experts never materialised).

Rows, at each capacity (share of each layer's experts resident in RAM), run under the profile
measured here at the start (CPU expert time, non-expert time per layer, predictor latency, the disk's
direct-read bandwidth as the link) calibrated at that capacity, just before each round of rows, on a
live LRU run of another held-out request at the row's own capacity and precision (runtime.profile.calibrate,
as `moecast profile --calibrate` does before a user's run; the link the median disk rate of the
calibrations run so far), and measured side by side (:data:`MEASURED_RULE`: request by request,
every row on each request in turn, each request from a cold start). Each row has measured TPOT (mean
wall time of every decode step; the same teacher-forced tokens everywhere, after a one-token
prompt), modeled TPOT (runtime.replay of the same routing, each request under the profile its run
ran under), probe TPOT (the replay
under the uncalibrated probe's profile), TPOT at run rates (under the rates the row's own runs saw:
the disk's rate while a read was in flight, one expert's compute, the rest of a layer), hit rate,
bytes read from the disk and peak RSS (a live row also its RSS just before attach, and the peak over
the budget plus that: :data:`RSS_RULE`):
- moecast's disk tier (direct I/O, asynchronous reads): LRU and LFU on demand, static hot table
  (counted on other held-out requests), LLaPor prefetch, prefetch-late and lfu-prefetch
  (``--predictor``, the DeepSeek checkpoint; prefetch-late also starts one prefetch past the window,
  which the next layer waits for; lfu-prefetch evicts by LFU), LLaPor prefetch-gated where the
  checkpoint carries its gate calibration (``moecast predictors calibrate``: a late prefetch starts
  only where its calibrated probability of use pays for its bytes, runtime/core/gate.py), and the
  first two with an oracle (a bound: the next layer's true experts);
- page cache: the experts mmap'd from the same safetensors files (llama.cpp's approach, the
  family's eager experts so only routed experts are touched), the process held by a memory cgroup
  to its non-expert usage plus the experts' budget (bench/memlimit.py; needs root: the row says
  when it cannot);
- accelerate disk offload: ``dispatch_model`` with a device map that keeps the first layers'
  experts modules in RAM within the budget and the others in an ``offload_folder`` (accelerate's
  own format, written once), under the same cgroup.
At each quantized precision of ``--precisions`` (runtime/tiers/precision.py: ``int8``, ``int4`` with
``--group-size``), LRU, LLaPor prefetch-late and the oracle prefetch-late bound run again with the
slow tier's experts at that precision (the offload directory's quantized copy, written once from its
model-dtype files), each precision under its own calibration. Two copies (``mixed``, ``int8+int4``:
runtime/core/mixed.py; a demand miss reads the low copy, a prefetch or an idle-link upgrade the high
one) run the same rows under a profile that times a resident expert at each copy's precision (each
copy's own calibration of the round); at run rates each copy computes at the time the row's own runs
computed it (the live runtime times each copy's experts apart), and each two-copy row reports its
share of uses at the low copy, its upgrades and the MB read at each copy per token, live beside the
replays' (the markdown's two-copy table). And, where the experts fit in half the
memory available, an "all in RAM" row per precision holds every expert resident (the compute floor at
that precision: no disk read in any decode step). Every row shows the bytes it read per decode step,
its link floor (those bytes at the disk's rate the row saw) and the bytes it prefetched and never used.
The external baselines have no modeled TPOT and no hit rate (null). First, ``--noise N`` identical
LRU runs of one request, back to back, give the host's own spread (the noise floor row: the median,
and max / min), against which the rows' modeled / measured reads: no model matches one run closer
than two runs of one configuration match each other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from moecast.predictors.base import LayerAhead
from moecast.runtime.core.cache import StaticTable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # the guarded rows and the figures' formatting
import ds_model
import memlimit

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("config", "capacity", "measured_tpot_ms", "modeled_tpot_ms", "hit_rate", "bytes_read", "peak_rss_mb")


@dataclass
class Tiers:
    """The model and everything the rows share."""

    args: argparse.Namespace
    cfg: Any
    directory: Path
    model: Any
    routing: ds_model.Routing
    requests: list[np.ndarray]
    notes: list[str] = field(default_factory=list)
    predictor: Any = None
    hot: Any = None  # FrequencyTable of other held-out requests, for static
    hot_routing: list[Any] = field(default_factory=list)  # those requests, for replay's static table
    traces: Path | None = None
    profile: Any = None
    expert_bytes: int = 0
    # each quantized precision's probe: the profile with its experts timed on the precision's kernels
    probes: dict[str, Any] = field(default_factory=dict)

    def probe(self, precision: str) -> Any:
        return self.probes.get(precision, self.profile)

    @property
    def num_layers(self) -> int:
        return int(self.cfg.num_hidden_layers)


class FrequencyTable:
    """A hot-expert table ([L, E] use counts of other requests) for the live runtime's static policy."""

    name = "frequency"
    horizon = "statistical"
    fingerprint = None
    needs = ()

    def __init__(self, table: np.ndarray, top_k: int) -> None:
        self.table = table
        (self.num_layers, self.num_experts), self.top_k = table.shape, top_k  # attach checks the shape


class NextLayerOracle(LayerAhead):
    """Layer-ahead 'prediction' that knows the recorded routing: the next layer's true experts (a bound)."""

    name = "oracle"
    needs = ()

    def __init__(
        self, override: ds_model.RoutingOverride, num_experts: int, num_layers: int, top_k: int
    ) -> None:
        self.override = override
        self.num_experts, self.num_layers, self.top_k = num_experts, num_layers, top_k

    def score_request(self, trace: Any) -> np.ndarray:
        raise NotImplementedError("the oracle reads the running request's recorded routing: live only")

    def score_at(self, trace: Any, layer: int) -> np.ndarray:
        s = np.zeros(self.num_experts, np.float32)
        s[self.override.ids[self.override.rows.start, layer].numpy()] = 1.0
        return s


# ----------------------------------------------------------------------------- setup


def offload_home(args: argparse.Namespace) -> Path:
    from moecast import home

    return home() / "bench_tiers" / f"{args.ds_shape}-L{args.layers}"


def setup(args: argparse.Namespace) -> Tiers:
    overrides = bench_gpu.DS_TEST_SHAPE if args.ds_shape == "test" else {}
    cfg = ds_model.ds_config(args.layers, **overrides)
    d = offload_home(args) / "experts"
    print(f"experts in {d} (generated once)", flush=True)
    ds_model.ensure_offload(cfg, d)
    n = args.prompt + args.tokens
    routing = ds_model.load_routing(
        args.traces, args.requests + args.hot_requests, n, args.layers, cfg.vocab_size
    )
    t = Tiers(args, cfg, d, ds_model.load_dense(cfg, d), routing, [])
    if "accelerate" in baseline_kinds(args):  # here, so that its writes are no baseline's page cache
        ds_model.accelerate_folder(t.model, d, offload_home(args) / "accelerate")
    if routing.recorded:
        hot = routing.requests[args.requests :]
        routing.requests = [
            replace(r, tokens=r.tokens[:n], topk_ids=r.topk_ids[:n])
            for r in routing.requests[: args.requests]
        ]
        t.requests = [r.tokens for r in routing.requests]
        # counted as the replay counts its static table, on the tokens its traces hold (write_traces)
        t.hot_routing = [replace(r, tokens=r.tokens[:n], topk_ids=r.topk_ids[:n]) for r in hot]
        routed = np.concatenate([r.topk_ids for r in t.hot_routing])
        counts = StaticTable.from_topk(routed, cfg.n_routed_experts).counts.astype(np.float64)
        t.hot = FrequencyTable(counts, cfg.num_experts_per_tok)
        t.notes.append(f"BENCHMARK MODE: routing replaced by the {routing.source}")
        t.notes.append(f"static's hot table: counted on {len(hot)} other held-out requests")
    else:
        t.requests = random_requests(cfg.vocab_size, n, args.requests)
        t.notes.append(f"{routing.source}: the model's own random router decides; no modeled figures")
    shape = "test sizes" if args.ds_shape == "test" else "DeepSeek-V2-Lite shape"
    t.notes.insert(0, f"random weights, {shape}, {args.layers} MoE layers, bf16, experts in {d}")
    from moecast.runtime.tiers.offload import _read_meta

    t.expert_bytes = int(_layout(d).expert_bytes) if _read_meta(d) else 0
    return t


def random_requests(vocab: int, n: int, count: int) -> list[np.ndarray]:
    """``count`` requests of ``n`` random tokens, the same in the bench and in a baseline's process."""
    gen = np.random.default_rng(0)
    return [gen.integers(0, vocab, n) for _ in range(count)]


def _layout(d: Path) -> Any:
    from moecast.runtime.tiers.offload import _layouts, _read_meta

    return _layouts(_read_meta(d))[0]


def profile(t: Tiers, out: Path) -> dict:
    """This machine for this model, with the disk as the link and the CPU as the fast tier's compute."""
    from moecast.runtime.profile.measure import profile_model

    pred = getattr(t.predictor, "inner", t.predictor)
    # the experts' directory holds the offload: profile_model reads it as the runtime does and, with
    # no accelerator, makes the disk the link and the CPU the fast tier (its source says so)
    prof, _how = profile_model(t.model, "bench-tiers", pred, offload_dir=t.directory, disk_mb=t.args.disk_mb)
    t.profile = prof
    bench_gpu._write(out / "bench-tiers-profile.yaml", prof.to_yaml())
    tags = precision_tags(t.args)
    # each copy of a two-copy setting is probed first: its profile is theirs together
    for q in dict.fromkeys(c for tag in tags for c in (*copy_tags(tag), tag) if c != "model"):
        t.probes[q] = precision_probe(t, q)
        bench_gpu._write(out / f"bench-tiers-profile-{q}.yaml", t.probes[q].to_yaml())
    return {
        k: getattr(prof, k)
        for k in ("disk_read_gbps", "cpu_beta_ms", "cpu_c_ms", "attn_ms", "predictor_ms", "read_cpu_ms")
    }


def precision_probe(t: Tiers, precision: str) -> Any:
    """The probe's profile with a resident expert timed at ``precision`` (a tag) as the live runtime
    computes a quantized tier's, into ``expert_ms`` (runtime/core/cost_model.py); two copies: the
    probes of both copies' precisions together."""
    from moecast.collect.models import find_moe_structure
    from moecast.runtime.profile.measure import precision_times
    from moecast.runtime.tiers.precision import Precision

    if "+" in precision:
        both = two_copies_profile({q: t.probe(q) for q in copy_tags(precision)}, precision)
        return replace(both, name=f"{t.profile.name}-{precision}")
    experts = find_moe_structure(t.model).layers[0].experts
    prof, how = precision_times(t.profile, experts, [Precision.of_tag(precision)])
    said = "; ".join(f"{k}: {v}" for k, v in how.items())
    return replace(prof, name=f"{t.profile.name}-{precision}", source=f"{t.profile.source}; {said}")


def copy_tags(precision: str) -> list[str]:
    """The precisions a setting computes at: its own, or both copies' (``model+int4-g128``)."""
    return precision.split("+")


def write_traces(t: Tiers, path: Path) -> None:
    """The recorded routing as a TraceSet for replay: the bench's requests, and the other requests that
    static's hot table is counted on (replayed by no row; replay's static counts its table on them)."""
    from moecast.collect.models import find_moe_structure, model_info
    from moecast.collect.traceset import RequestRecord, TraceMeta, TraceWriter

    info = model_info(t.model, find_moe_structure(t.model), "deepseek-shaped")
    meta = TraceMeta(model=info, collection={"source": "bench_tiers"})
    records = [
        RequestRecord(r.request_id, "bench", "", "", r.tokens, [""] * len(r.tokens),
                      np.arange(len(r.tokens)) >= t.args.prompt, r.topk_ids.astype(np.int16))
        for r in [*t.routing.requests, *t.hot_routing]
    ]  # fmt: skip
    TraceWriter(path, meta).write(records)
    t.traces = path


# ----------------------------------------------------------------------------- rows


def reset_peak_rss() -> None:
    """Start the process's peak RSS (VmHWM) again from its current RSS, so each row reports its own."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def release_freed() -> None:
    """Hand memory freed earlier back to the OS before a row is measured: glibc keeps freed heap
    chunks for reuse (the profile's ring of cold experts left ~700 MB in one of two runs), and the
    row's RSS would carry them as if the process held them."""
    import ctypes
    import gc

    gc.collect()  # an earlier row's garbage first
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_mb() -> float | None:
    """The process's resident set now (VmRSS), in MiB; None where /proc cannot tell."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(x for x in status if x.startswith("VmRSS:")).split()[1]) / 1024
    return None


def modeled(
    t: Tiers,
    policy: str,
    capacity: float | None,
    predictor: Any,
    hardware: Any,
    requests: list[int] | None = None,
    precision: str = "model",
) -> Any:
    """Replay of the bench's requests (``requests``: their indices; None: all) under the profile
    ``hardware``, each request's cache starting cold, as each live run's does (one attach per request);
    ``capacity`` None: every expert resident; ``precision``: the slow tier's (a tag)."""
    from moecast.runtime.replay.engine import ReplayConfig, replay
    from moecast.runtime.tiers.precision import Precision

    if t.traces is None or t.profile is None:
        return None
    picked = t.routing.requests if requests is None else [t.routing.requests[i] for i in requests]
    prec = Precision.of_tag(copy_tags(precision)[-1])  # two copies: the low one's group size
    if capacity is None:  # every expert resident from the start, as the live fill before the clock
        from moecast.runtime.core.policy import get_policy

        policy = replace(get_policy(policy), preload="hot")
    cfg = ReplayConfig(
        expert_dtype=precision if "+" in precision else prec.dtype,
        group_size=prec.group_size,
        policy=policy,
        capacity=t.cfg.n_routed_experts if capacity is None else capacity,
        hardware=hardware,
        predictor=predictor,
        cold=True,
        requests=[r.request_id for r in picked],
        hot_requests=[r.request_id for r in t.hot_routing] or None,
    )
    return replay(str(t.traces), cfg)


def modeled_by_round(
    t: Tiers, policy: str, capacity: float | None, predictor: Any, runs: list[dict], precision: str = "model"
) -> dict:
    """Each run's request replayed under the profile that run ran under (its round's calibration),
    pooled as the live runs are: TPOT over every decode step, hit rate over every use."""
    got = [
        (modeled(t, policy, capacity, predictor, r["profile"], [r["request"]], precision), r["stats"])
        for r in runs
    ]
    if any(g is None for g, _ in got):
        return {"modeled_tpot_ms": None}
    steps = [st["decode_steps"] for _, st in got]
    uses = [st["uses"] for _, st in got]
    out = {
        "modeled_tpot_ms": float(np.average([g.modeled_tpot_ms for g, _ in got], weights=steps)),
        "modeled_hit_rate": float(np.average([g.hit_rate for g, _ in got], weights=uses)),
        "tpot_basis": got[0][0].tpot_basis,
        "profile": ", ".join(dict.fromkeys(r["profile"].name for r in runs)),
    }
    if "+" in precision:
        out["copies"] = {"modeled": replay_copies([g for g, _ in got])}
    return out


def _modeled_keys(
    t: Tiers, policy: str, capacity: float | None, predictor: Any, st: dict, runs: list[dict], precision: str
) -> dict:
    """Replay of the row's requests, each under the profile its run ran under (modeled: its round's
    calibration where calibration ran), under the probe's profile alone (probe) and under the rates
    the row's own runs saw (at_run_rates: the model's rules apart from any drift of the disk; its
    decisions of what lands in a window may differ from those the runs took)."""
    from moecast.runtime.profile.measure import calibrate

    out = modeled_by_round(t, policy, capacity, predictor, runs, precision)
    if out["modeled_tpot_ms"] is None:
        return out
    probe = t.probe(precision)
    if any(r["profile"] is not probe for r in runs):
        out["probe_tpot_ms"] = modeled(t, policy, capacity, predictor, probe, None, precision).modeled_tpot_ms
    if st.get("disk_read_gbps_observed") and t.profile.fast_tier == "cpu":
        # the row's own rest of a layer already holds its reads' compute time: not charged again; a
        # run of two copies timed each copy's experts apart, so each copy's time is its own
        own = replace(calibrate(probe, st, t.num_layers), read_cpu_ms=0.0)
        got = modeled(t, policy, capacity, predictor, own, None, precision)
        out["at_run_rates_tpot_ms"] = got.modeled_tpot_ms
        tags = copy_tags(precision)
        out["run_rates"] = {
            "disk_read_gbps": own.transfer_gbps,
            "expert_ms": own.expert_time(tags[0]),  # the row's precision's (two copies: the high one's)
            "layer_other_ms": own.attn_ms,
            "after_layers_ms": own.step_ms,
        }
        if "+" in precision:
            out["run_rates"]["expert_ms_by_copy"] = {tag: own.expert_time(tag) for tag in tags}
            out["copies"]["at_run_rates"] = replay_copies([got])
    return out


def replay_copies(results: list[Any]) -> dict:
    """Two copies' figures of replays (one per request, or one over every request): the share of
    routed uses computed at the low copy, the upgrades and the MB read at each copy per token (over
    every token, the prompt's included, as the replay counts them; the uses weighted by tokens: one
    token routes as many uses as another)."""
    tokens = [r.tokens for r in results]
    total = max(sum(tokens), 1)
    tags = list(results[0].mb_per_token_by_copy)
    return {
        "low_share": float(np.average([r.low_share for r in results], weights=tokens)),
        "upgrades_per_token": sum(r.upgrades for r in results) / total,
        "mb_per_token": {
            tag: sum(r.mb_per_token_by_copy[tag] * r.tokens for r in results) / total for tag in tags
        },
    }


def live_copies(st: dict, precision: str, prompt: int) -> dict:
    """A two-copy row's figures as its live runs had them (``st``: pooled), on the replay's basis
    (:func:`replay_copies`): the runs' own share of uses at the low copy (the live step's counters),
    the high copies the disk reread over low ones, each copy's bytes as the disk read them, and
    each copy's expert time (its decode compute over its uses)."""
    tokens = max(st["decode_steps"] + st["prefill_steps"] * prompt, 1)
    high, low = copy_tags(precision)
    low_b = st["low_bytes_read"]
    by = st["expert_compute_by_copy"]
    return {
        "low_share": st["low_uses"] / st["uses"] if st["uses"] else None,
        "upgrades_per_token": st["upgrade_reads"] / tokens,
        "mb_per_token": {high: (st["bytes_read"] - low_b) / tokens / 2**20, low: low_b / tokens / 2**20},
        "expert_ms": {tag: by[tag]["s"] * 1e3 / by[tag]["uses"] if by[tag]["uses"] else None for tag in by},
        "uses": {tag: by[tag]["uses"] for tag in by},
    }


@dataclass
class Row:
    """One configuration: how it runs one request (``run(request index)``), and its runs so far."""

    name: str
    run: Any  # (request index, profile) -> dict of one request's run
    replay_policy: str | None = None  # None: an external baseline (no replay)
    replay_pred: Any = "none"
    runs: list[dict] = field(default_factory=list)
    error: BaseException | None = None
    precision: str = "model"  # the slow tier's (runtime/tiers/precision.py tag): its calibration and replay
    full: bool = False  # every expert resident (the all-in-RAM row)
    at: str | None = None  # a capacity in bytes, in place of the round's share of experts (SAME_RAM)


def live_run(
    t: Tiers, capacity: float | None, request: Any, tokens: np.ndarray, hardware: Any, **kw: Any
) -> dict:
    """One request on a freshly attached runtime under the profile ``hardware`` (its cache starts
    cold): its decode steps' ms, the runtime's stats and the process's RSS just before attach."""
    from moecast.runtime.live.runtime import attach

    release_freed()
    reset_peak_rss()
    # what the process holds before the runtime: interpreter, libraries, predictor, non-expert weights
    base = rss_mb()
    # each policy's own balancer, as replay's preset of the same name has it (static: its misses
    # are computed by the CPU, read from the disk first; the others load every miss)
    # warm=False: every layer's slots start empty, as the replay's cold caches and the baselines'
    # dropped page cache do (a warm attach would read experts 0..c-1 before the clock starts)
    rt = attach(
        t.model, capacity=capacity, offload="disk", offload_dir=str(t.directory),
        hardware=hardware or "prescope-a100-pcie4", warm=False, **kw,
    )  # fmt: skip
    routing = replace(t.routing, requests=[request] if request is not None else [])
    # a full cache's fill reads every expert at attach, before the clock: not a decode step's bytes
    for store in rt.stores:
        store.wait()
    filled = (rt.tier.reader.bytes_read, rt.tier.reader.reads)
    try:
        with ds_model.routed(t.model, routing) as ov:
            if isinstance(kw.get("predictor"), NextLayerOracle):
                kw["predictor"].override = ov
            times, _ = ds_model.decode_all(  # every decode step: the basis of replay's modeled TPOT
                t.model, [tokens], t.args.prompt, torch.device("cpu"), routing, ov, warmup=0
            )
        st = rt.stats()
    finally:
        rt.detach()
    st = {**st, "bytes_read": st["bytes_read"] - filled[0], "disk_reads": st["disk_reads"] - filled[1]}
    return {"times": times, "stats": st, "rss_base_mb": base}


def pooled(stats: list[dict]) -> dict:
    """Several live runs' stats as one run's: counts and bytes summed, the per-step parts averaged over
    all decode steps, the disk's rate over all the runs' busy time."""
    from moecast.runtime.live.runtime import BREAKDOWN

    keys = ("decode_steps", "routed", "uses", "hits", "bytes_read", "prefetches_issued", "prefetch_used")
    keys += ("wasted_bytes",)
    out = {k: sum(s[k] for s in stats) for k in keys}
    out["expert_bytes"] = stats[0]["expert_bytes"]
    # the precision the runs computed at: calibrate sets that precision's expert time from them
    out["expert_dtype"] = stats[0].get("expert_dtype", "model")
    out["hit_rate"] = out["hits"] / out["uses"] if out["uses"] else float("nan")
    steps = [s["decode_steps"] for s in stats]
    for key in ("modeled_tpot_ms", "after_layers_ms", *(f"{part}_ms" for part in BREAKDOWN)):
        out[key] = float(np.average([s[key] for s in stats], weights=steps))
    busy = sum(
        s["bytes_read"] / s["disk_read_gbps_observed"] / 1e9 for s in stats if s["disk_read_gbps_observed"]
    )
    out["disk_read_gbps_observed"] = out["bytes_read"] / busy / 1e9 if busy else None
    if stats[0].get("expert_compute_by_copy"):  # two copies: each copy's compute and counts, summed
        out["expert_compute_by_copy"] = {
            tag: {k: sum(s["expert_compute_by_copy"][tag][k] for s in stats) for k in ("s", "uses")}
            for tag in stats[0]["expert_compute_by_copy"]
        }
        for k in ("prefill_steps", "low_uses", "low_bytes_read", "upgrade_reads", "upgrades"):
            out[k] = sum(s[k] for s in stats)
    return out


def live_result(t: Tiers, row: Row, capacity: float) -> dict:
    """A live row's figures over its runs (one per request)."""
    from moecast.runtime.live.runtime import BREAKDOWN

    st = pooled([r["stats"] for r in row.runs])
    resident = t.cfg.n_routed_experts if row.full else int(row.runs[0]["stats"]["capacity"])
    budget = resident * t.num_layers * st["expert_bytes"] / 2**20
    # the run whose peak RSS was furthest over its own base + budget speaks for the row
    worst = max(row.runs, key=lambda r: r["stats"]["peak_rss_mb"] / (budget + r["rss_base_mb"]))
    got = {
        "measured_tpot_ms": float(np.mean([ms for r in row.runs for ms in r["times"]])),
        "hit_rate": st["hit_rate"],
        "bytes_read": st["bytes_read"],
        "peak_rss_mb": worst["stats"]["peak_rss_mb"],
        "rss_base_mb": worst["rss_base_mb"],
        "live_modeled_tpot_ms": st["modeled_tpot_ms"],
        # the measured step's split (ms per decode step) and the disk's rate as the run saw it
        **{f"{part}_ms": st[f"{part}_ms"] for part in BREAKDOWN},
        "disk_read_gbps_observed": st["disk_read_gbps_observed"],
        "budget_mb": budget,
        "dense_mb": (t.directory / "dense.safetensors").stat().st_size / 2**20,
        "requests": len(row.runs),
        # each request's own TPOT, in request order: the pairs a comparison with another row reads
        "request_tpot_ms": [float(np.mean(r["times"])) for r in sorted(row.runs, key=lambda r: r["request"])],
        "expert_dtype": row.precision,
        **link_figures(st),
        **_modeled_keys(
            t,
            row.replay_policy,
            None if row.full else (row.at or capacity),
            row.replay_pred,
            st,
            row.runs,
            row.precision,
        ),
    }
    if "+" in row.precision:  # two copies: the live runs' figures beside the replays'
        got["copies"] = {"live": live_copies(st, row.precision, t.args.prompt), **got.get("copies", {})}
    return got


def link_figures(st: dict) -> dict:
    """Per decode step: the MB the disk read, its link floor (those bytes at the rate the row's runs
    saw), and the MB prefetched and never used (the runtime's ``wasted_bytes``: prefetches that moved,
    each at the copy it read; a read the predictor was wrong about costs what a miss does)."""
    steps = max(1, st["decode_steps"])
    mb = st["bytes_read"] / steps / 2**20
    gbps = st.get("disk_read_gbps_observed")
    wasted = st["wasted_bytes"] / steps / 2**20
    return {
        "read_mb_per_token": mb,
        "link_floor_ms": mb * 2**20 / (gbps * 1e9) * 1e3 if gbps else None,
        "wasted_mb_per_token": wasted,
    }


def _row(
    t: Tiers, capacity: float, name: str, replay_policy: str, replay_pred: Any, precision: str = "model",
    full: bool = False, at: str | None = None, **kw: Any,
) -> Row:  # fmt: skip
    """A live row: each run attaches afresh at ``capacity`` (``at``: at this capacity in bytes instead;
    ``full``: every expert resident, read before the clock starts) with the slow tier at
    ``precision`` (a tag)."""
    cap = None if full else (at or capacity)

    def run(i: int, prof: Any) -> dict:
        req = t.routing.requests[i] if t.routing.recorded else None
        got = live_run(t, cap, req, t.requests[i], prof, **_tier(precision), **kw)
        return {**got, "request": i, "profile": prof}

    return Row(name, run, replay_policy, replay_pred, precision=precision, full=full, at=at)


def _tier(precision: str) -> dict:
    """attach()'s settings for the slow tier at ``precision`` (a tag, two copies' ``high+low``; none for
    the model's dtype)."""
    from moecast.runtime.tiers.precision import Precision, expert_setting

    if "+" in precision:
        return expert_setting(precision, Precision.of_tag(copy_tags(precision)[1]).group_size).settings()
    return Precision.of_tag(precision).settings()


def _suffix(precision: str) -> str:
    return "" if precision == "model" else f"-{precision}"


#: the suffix of a row held to the RAM the model-dtype experts take at the round's capacity
SAME_RAM = " (model's RAM)"


def same_ram(t: Tiers, capacity: float) -> str:
    """The round's capacity as bytes per layer: its share of the experts at the model's dtype, which
    a quantized tier's smaller experts fill with more of them (a capacity in bytes counts its bytes)."""
    slots = round(capacity * t.cfg.n_routed_experts)
    # the bytes a budget counts (the expert's own, as attach's capacity in bytes divides by)
    return f"{slots * t.expert_bytes / 2**20:.6f}MB"


def gated(t: Tiers) -> bool:
    """The prefetch gate's rows run: the predictor's checkpoint carries its calibration."""
    return getattr(t.predictor, "calibration", None) is not None


def precision_rows(t: Tiers, capacity: float, precision: str) -> list[Row]:
    """At a quantized precision: LRU, LLaPor prefetch-late and its oracle bound, named with the tag; at
    one precision, LRU, LLaPor prefetch-late and the bound again in the RAM the model-dtype experts
    take (:data:`SAME_RAM`)."""
    rows = [_row(t, capacity, f"lru {precision}", "lru", "none", precision, policy="lru", prefetch="none")]
    if t.predictor is not None:
        rows.append(_row(t, capacity, f"llapor prefetch-late {precision}", "prefetch-late", t.predictor,
                         precision, policy="prefetch-late", predictor=t.predictor))  # fmt: skip
    if gated(t):
        rows.append(_row(t, capacity, f"llapor prefetch-gated {precision}", "prefetch-gated", t.predictor,
                         precision, policy="prefetch-gated", predictor=t.predictor))  # fmt: skip
    if "+" not in precision:
        ram = same_ram(t, capacity)
        rows.append(_row(t, capacity, f"lru {precision}{SAME_RAM}", "lru", "none", precision, at=ram,
                         policy="lru", prefetch="none"))  # fmt: skip
        if t.predictor is not None:
            rows.append(_row(t, capacity, f"llapor prefetch-late {precision}{SAME_RAM}", "prefetch-late",
                             t.predictor, precision, at=ram, policy="prefetch-late", predictor=t.predictor))  # fmt: skip
    if t.routing.recorded:
        oracle = NextLayerOracle(ds_model.RoutingOverride(), t.cfg.n_routed_experts, t.num_layers,
                                 t.cfg.num_experts_per_tok)  # fmt: skip
        rows.append(_row(t, capacity, f"oracle prefetch-late (bound) {precision}", "prefetch-late", "oracle",
                         precision, policy="prefetch-late", predictor=oracle))  # fmt: skip
        # the bound in the model dtype's RAM too: what any predictor could reach there
        if "+" not in precision:
            rows.append(_row(t, capacity, f"oracle prefetch-late (bound) {precision}{SAME_RAM}", "prefetch-late",
                             "oracle", precision, at=same_ram(t, capacity), policy="prefetch-late",
                             predictor=oracle))  # fmt: skip
    return rows


def all_in_ram_rows(t: Tiers, report: Any, capacity: float, precisions: list[str]) -> list[Row]:
    """Every expert resident at each precision (the compute floor: no read in any decode step), where
    the experts fit in half the memory available now; the others are reported skipped, with why."""
    from moecast.runtime.tiers.offload import available_bytes

    s, rows = SimpleNamespace(name=f"{int(capacity * 100)} %"), []
    avail = available_bytes() or 0
    for prec in (p for p in precisions if "+" not in p):  # two copies: the high one's row is the floor
        need = t.num_layers * t.cfg.n_routed_experts * precision_bytes(t, prec)
        name = f"all in RAM {prec}"
        if need > avail / 2:
            report.skip(
                s, name, f"the experts need {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB are available"
            )
            continue
        rows.append(_row(t, capacity, name, "lru", "none", prec, full=True, policy="lru", prefetch="none"))
    return rows


def precision_bytes(t: Tiers, precision: str) -> int:
    """One expert's stored bytes at ``precision`` (a tag) in the bench's offload directory."""
    from moecast.runtime.tiers.offload import _layouts, _read_meta, tier_meta
    from moecast.runtime.tiers.precision import Precision

    return int(_layouts(tier_meta(_read_meta(t.directory), Precision.of_tag(precision)))[0].stride)


def live_rows(t: Tiers, report: Any, capacity: float) -> list[Row]:
    """moecast's rows at ``capacity``, each run under the profile its round gives it (a missing
    predictor's rows are reported skipped here)."""
    s = SimpleNamespace(name=f"{int(capacity * 100)} %")

    def row(name: str, replay_policy: str, replay_pred: Any, **kw: Any) -> Row:
        return _row(t, capacity, name, replay_policy, replay_pred, **kw)

    rows = [row("lru", "lru", "none", policy="lru", prefetch="none"),
            row("lfu", "lfu", "none", policy="lfu", prefetch="none")]  # fmt: skip
    if t.hot is not None:
        rows.append(row("static hot", "static", "none", policy="static", predictor=t.hot))
    # prefetch in the window (SMoE), and prefetch-late: one more than the window holds, which the
    # next layer waits for (a disk read outlasts a layer's attention, so none may fit the window)
    variants = ("prefetch", "prefetch-late")
    for policy in (*variants, "lfu-prefetch"):
        if t.predictor is not None:
            rows.append(row(f"llapor {policy}", policy, t.predictor, policy=policy, predictor=t.predictor))
        else:
            report.skip(s, f"llapor {policy}", "no DeepSeek checkpoint (--predictor)")
    if gated(t):
        rows.append(row("llapor prefetch-gated", "prefetch-gated", t.predictor, policy="prefetch-gated",
                        predictor=t.predictor))  # fmt: skip
    elif t.predictor is not None:
        report.skip(
            s,
            "llapor prefetch-gated",
            "the checkpoint has no gate calibration (moecast predictors calibrate)",
        )
    if t.routing.recorded:
        cfg = t.cfg
        for policy in variants:
            oracle = NextLayerOracle(
                ds_model.RoutingOverride(),
                cfg.n_routed_experts,
                cfg.num_hidden_layers,
                cfg.num_experts_per_tok,
            )
            rows.append(row(f"oracle {policy} (bound)", policy, "oracle", policy=policy, predictor=oracle))
    return rows


def calibrate_round(
    t: Tiers,
    capacity: float,
    i: int,
    done: list[dict],
    precision: str,
    disk: list[float],
    at: str | None = None,
    full: bool = False,
) -> Any:
    """The profile round ``i``'s rows at ``capacity`` (``at``: a capacity in bytes instead; ``full``:
    every expert resident) run under: the probe's, calibrated (moecast.runtime.profile.measure.calibrate)
    on a live LRU run at that capacity of one of the held-out requests static's table is counted on (no
    row measures them), just before the round's first row at ``precision`` and that capacity, as
    `moecast profile --calibrate` does before a user's run, so the calibration sees the disk the rows
    see and the host work their capacity brings (a layer that reads less loses less of its compute to
    the reads, and decides less); the probe's where there is nothing to calibrate on, or the
    calibration failed (kept in ``done``, which collects each round's run, its profile as calibrated).

    ``disk``: the disk rates every calibration at this capacity saw so far, every precision's (this
    one's is added where its decode steps read). The disk is one, whatever precision a run reads, so
    the profile takes their median: a calibration that ran in a slow spell (right after the model
    dtype's rows read tens of GB, the disk read at 0.96 GB/s, and the next rows at 1.3-1.5) does not
    set its precision's link alone. Only calibrations run before the rows count, so the profile stays
    one known ahead."""
    from moecast.runtime.profile.measure import calibrate

    cal, prof = t.hot_routing, t.probe(precision)
    if not cal or prof is None or prof.fast_tier != "cpu":
        return prof
    r = cal[i % len(cal)]
    where = _where(at, full)
    bench_gpu.log(
        f"[{int(capacity * 100)} %] calibration{_suffix(precision)}{where}: request {i + 1} of {len(t.requests)}"
    )
    try:
        cap = None if full else (at or capacity)
        st = live_run(t, cap, r, r.tokens, prof, policy="lru", prefetch="none", **_tier(precision))["stats"]
        got = calibrate(prof, st, t.num_layers)
    except Exception as exc:  # recorded, raised again in the calibration's guard
        done.append({"error": exc})
        return prof
    got = replace(got, name=f"{got.name}-{int(capacity * 100)}{_suffix(precision)}{_tag(at, full)}-r{i + 1}")
    done.append({"stats": st, "profile": got})
    if st.get("disk_read_gbps_observed"):  # an all-resident run reads nothing in its decode steps
        disk.append(got.transfer_gbps)
    if not disk:
        return got
    rate = float(np.median(disk))
    return replace(got, transfer_gbps=rate, disk_read_gbps=rate)


def _where(at: str | None, full: bool) -> str:
    """A capacity other than the round's share, as row names say it (SAME_RAM, or all in RAM)."""
    return " (all in RAM)" if full else (SAME_RAM if at else "")


def _tag(at: str | None, full: bool) -> str:
    """The same, in a profile's name."""
    return "-full" if full else ("-ram" if at else "")


def two_copies_profile(profs: dict[str, Any], precision: str) -> Any:
    """The profile a run of two copies (``high+low``) runs under: the high copy's round profile, with
    the resident expert's time at each copy's precision from that copy's own."""
    high, low = copy_tags(precision)
    base = profs[high]
    times = {**base.expert_ms, **profs[low].expert_ms}
    return replace(base, name=f"{base.name}+{low}", expert_ms=times)


def calibration_summary(
    t: Tiers,
    capacity: float,
    done: list[dict],
    precision: str = "model",
    at: str | None = None,
    full: bool = False,
) -> dict:
    """Each round's calibrated rates, and the profile calibrated on every round's run together,
    written as ``bench-tiers-calibrated-<capacity>.yaml`` (the profile a user would keep; a
    precision's and another capacity's named after them)."""
    from moecast.runtime.profile.measure import calibrate

    err = next((d["error"] for d in done if "error" in d), None)
    if err is not None:
        raise err
    keys = ("transfer_gbps", "gpu_expert_ms", "attn_ms", "step_ms")
    pooled_prof = calibrate(t.probe(precision), pooled([d["stats"] for d in done]), t.num_layers)
    pooled_prof = replace(
        pooled_prof, name=f"{pooled_prof.name}-{int(capacity * 100)}{_suffix(precision)}{_tag(at, full)}"
    )
    bench_gpu._write(Path(t.args.out) / f"{pooled_prof.name}.yaml", pooled_prof.to_yaml())
    return {
        **{k: getattr(pooled_prof, k) for k in keys},
        "rounds": {k: [getattr(d["profile"], k) for d in done] for k in keys},
    }


def noise_floor(t: Tiers, capacity: float, n: int) -> dict:
    """The host's own spread: ``n`` identical live LRU runs at ``capacity`` on the first request, back to
    back (the same routing, each from the same cold start): the noise floor row (module docstring)."""
    req = t.routing.requests[0] if t.routing.recorded else None
    runs = [
        live_run(t, capacity, req, t.requests[0], t.profile, policy="lru", prefetch="none") for _ in range(n)
    ]
    tpot = [float(np.mean(r["times"])) for r in runs]
    first = runs[0]["stats"]
    return {
        "measured_tpot_ms": float(np.median(tpot)),
        "modeled_tpot_ms": None,
        "hit_rate": first["hit_rate"],
        "bytes_read": first["bytes_read"],  # one run's: the runs are identical
        "peak_rss_mb": max(r["stats"]["peak_rss_mb"] for r in runs),
        "runs_tpot_ms": tpot,
        "max_over_min": max(tpot) / min(tpot),
        "disk_read_gbps_runs": [r["stats"]["disk_read_gbps_observed"] for r in runs],
        "note": f"{n} identical LRU runs of request 1, back to back: the median, the read MB of one",
    }


def measure_rows(t: Tiers, report: Any, capacity: float, rows: list[Row], calibrate: bool = False) -> None:
    """``rows`` at ``capacity`` measured side by side: request by request, each round runs every row
    on one request (each precision's after its calibration, with ``calibrate``), so a drift of the disk's rate
    over the minutes the rows take reaches every row alike. Each run attaches afresh (a baseline: a
    fresh process), so every request starts cold."""
    s = SimpleNamespace(name=f"{int(capacity * 100)} %")
    # each precision calibrates on its own LRU run (its experts compute with other kernels), at each
    # capacity its rows run at; two copies compute at both precisions: each copy on a run of its own
    classes = list(dict.fromkeys((q, row.at, row.full) for row in rows for q in copy_tags(row.precision)))
    done: dict[tuple, list[dict]] = {c: [] for c in classes}
    disk: list[float] = []  # the disk rates the calibrations saw, in order (calibrate_round)
    for i in range(len(t.requests)):
        profs: dict[tuple, Any] = {}

        def profile_of(row: Row, i: int = i, profs: dict[tuple, Any] = profs) -> Any:
            # each class calibrates just before its first row of the round, so that it sees the
            # disk as its rows do (a read-heavy row before it leaves the disk slower for a while)
            mine = {q: (q, row.at, row.full) for q in copy_tags(row.precision)}
            for q, c in mine.items():
                if c not in profs:
                    profs[c] = (
                        calibrate_round(t, capacity, i, done[c], q, disk, row.at, row.full)
                        if calibrate
                        else t.probe(q)
                    )
            if len(mine) == 1:
                return profs[mine[row.precision]]
            return two_copies_profile({q: profs[c] for q, c in mine.items()}, row.precision)

        for row in rows:
            if row.error is not None:
                continue
            prof = profile_of(row)
            bench_gpu.log(f"[{s.name}] {row.name}: request {i + 1} of {len(t.requests)}")
            try:
                row.runs.append(row.run(i, prof))
            except Exception as exc:  # recorded, raised again in the row's guard
                row.error = exc
    for c in classes:  # nothing to calibrate on (no held-out requests, or a device profile): the probe's
        if done[c]:
            q, at, full = c
            report.guard(s, f"calibration{_suffix(q)}{_where(at, full)}",
                         lambda c=c: calibration_summary(t, capacity, done[c], *c), kind="profile")  # fmt: skip
    for row in rows:

        def result(row: Row = row) -> dict:
            if row.error is not None:
                raise row.error
            if row.replay_policy is None:
                return child_result(row.runs)
            return {"config": row.name, **live_result(t, row, capacity)}

        report.guard(s, row.name, result)


def child_run(t: Tiers, kind: str, capacity: float, request: int) -> dict:
    """A baseline's run of one request in a process of its own, held to the budget by a memory cgroup."""
    why = memlimit.available()
    if why:
        raise RuntimeError(f"cannot hold the process to the budget: {why}")
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-capacity", str(capacity),
            "--child-request", str(request), *t.args.passthrough]  # fmt: skip
    cg = memlimit.Cgroup("moecast-tiers")
    try:
        p = cg.run(argv, timeout=t.args.child_timeout)
    finally:
        cg.remove()
    lines = _json_lines(p.stdout)
    if p.returncode in (-9, 137):
        raise RuntimeError(f"{kind} exited {p.returncode}: {killed_why(t, kind, lines[0] if lines else {})}")
    if p.returncode != 0 or not lines or "times" not in lines[-1]:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{kind} exited {p.returncode}: {' | '.join(tail)}")
    return lines[-1]


def _json_lines(out: str) -> list[dict]:
    """The JSON objects a child printed, one per line (a line that only looks like one is skipped)."""
    got = []
    for line in out.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                got.append(json.loads(line))
    return got


def killed_why(t: Tiers, kind: str, limit: dict) -> str:
    """Why a baseline was killed, from the limit its process announced (``limit_mb``, ``start_mb``)."""
    if not limit:
        return "killed: over the memory limit"
    room = limit["limit_mb"] - limit["start_mb"]
    why = f"killed: over the memory limit of {limit['limit_mb']:.0f} MB, {room:.0f} MB above its usage before decoding"
    module = t.cfg.n_routed_experts * t.expert_bytes / 2**20
    if kind == "accelerate" and module > room:
        # accelerate's offload unit is a module: the fused experts of a layer come in whole
        why += f"; accelerate loads an offloaded layer's whole experts module ({module:.0f} MB) at each use"
    return why


def child_result(runs: list[dict]) -> dict:
    """A baseline's figures over its runs (one process per request)."""
    worst = max(runs, key=lambda r: r["peak_rss_mb"] or 0)
    return {
        **{k: worst[k] for k in ("peak_rss_mb", "cgroup_limit_mb", "cgroup_peak_mb", "budget_mb")},
        "measured_tpot_ms": float(np.mean([ms for r in runs for ms in r["times"]])),
        "modeled_tpot_ms": None,
        "hit_rate": None,
        "bytes_read": sum(r["bytes_read"] for r in runs),
        "requests": len(runs),
    }


def child_main(args: argparse.Namespace) -> None:
    """In the limited process: build the baseline, cap the cgroup at usage + budget, decode one request
    from a cold page cache, print one JSON line."""
    from moecast.runtime.tiers.offload import peak_rss_mb

    overrides = bench_gpu.DS_TEST_SHAPE if args.ds_shape == "test" else {}
    cfg = ds_model.ds_config(args.layers, **overrides)
    d = offload_home(args) / "experts"
    model = ds_model.load_dense(cfg, d)
    n, i = args.prompt + args.tokens, args.child_request
    routing = ds_model.load_routing(args.traces, args.requests, n, args.layers, cfg.vocab_size)
    if routing.recorded:
        routing.requests = [routing.requests[i]]
        tokens = routing.requests[0].tokens[:n]
    else:
        tokens = random_requests(cfg.vocab_size, n, args.requests)[i]
    budget = int(args.child_capacity * cfg.n_routed_experts) * args.layers * int(_layout(d).expert_bytes)
    # start cold, as the disk tier does: no expert file's pages left in the page cache by earlier rows
    for f in [*d.glob("layer_*.safetensors"), *(offload_home(args) / "accelerate").glob("*.dat")]:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if args.child == "page cache":
        ds_model.mmap_experts(model, d)
        model.set_experts_implementation("eager")  # touches only the routed experts' pages
    else:
        ds_model.accelerate_disk(model, d, offload_home(args) / "accelerate", args.child_capacity)
    # the experts' budget, and room for the decode's own work (activations, KV cache, allocator):
    # 10 % of what is held, as the target for moecast's peak RSS allows, and 64 MiB
    start = memlimit.usage_bytes()
    limit = memlimit.limit_self(budget, slack=0.1, floor=64 << 20)
    if limit and start:  # said before decoding: the parent reads it to explain a kill
        print(json.dumps({"limit_mb": limit / 2**20, "start_mb": start / 2**20}), flush=True)
    read0 = _read_bytes()
    reset_peak_rss()
    with ds_model.routed(model, routing) as ov:
        times, _ = ds_model.decode_all(
            model, [tokens], args.prompt, torch.device("cpu"), routing, ov, warmup=0
        )
    print(json.dumps({
        "config": args.child, "times": times, "bytes_read": _read_bytes() - read0, "peak_rss_mb": peak_rss_mb(),
        "cgroup_limit_mb": limit / 2**20 if limit else None,
        "cgroup_peak_mb": (memlimit.peak_bytes() or 0) / 2**20, "budget_mb": budget / 2**20,
    }), flush=True)  # fmt: skip


def _read_bytes() -> int:
    """Bytes this process caused to be read from storage (page-cache hits excluded)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


# ----------------------------------------------------------------------------- entry points


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="MoE layers (default 26, quick 4)")
    ap.add_argument("--quick", action="store_true", help="4 layers, one request, few tokens")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--capacities", default="0.1,0.25,0.5")
    ap.add_argument("--predictor", default=None, help="LLaPor checkpoint of the DeepSeek traces")
    ap.add_argument("--traces", default=None, help="DeepSeek traces: CSV folder or a ds_model.py .npz")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--hot-requests", type=int, default=4, help="other held-out requests for static's table")
    # one token of prompt: the replay takes a prompt token by token where the live runtime prefills
    # it in one forward, so a longer prompt would start the two from different caches
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument(
        "--disk-mb", type=int, default=256, help="disk probe's temporary file (MB) where no offload is read"
    )
    ap.add_argument("--ds-shape", default="lite", choices=["lite", "test"], help="test: small sizes (tests)")
    ap.add_argument(
        "--baselines", default=",".join(BASELINES), help="external baselines to run (comma-separated)"
    )
    ap.add_argument("--noise", type=int, default=4, help="identical LRU runs back to back (0: none)")
    ap.add_argument("--precisions", default="model,int8,int4,mixed",
                    help="slow-tier precisions (model, int8, int4; mixed or A+B: two copies, the predictor "
                         "choosing): each but the model's dtype adds its rows")  # fmt: skip
    ap.add_argument("--group-size", type=int, default=128, help="int4's group along each matrix's input")
    ap.add_argument("--out", default=str(RESULTS), help="tiers-<host>.md/.json and the profile go here")
    ap.add_argument("--child-timeout", type=float, default=3600)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-capacity", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-request", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = [b for b in baseline_kinds(args) if b not in BASELINES]
    if unknown:  # a child would otherwise run an unknown name as accelerate's offload
        ap.error(f"--baselines: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(BASELINES)}")
    q = args.quick
    for k, v in dict(layers=4 if q else 26, requests=1 if q else 2, prompt=1, tokens=19 if q else 47).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.passthrough = ["--layers", str(args.layers), "--requests", str(args.requests), "--prompt", str(args.prompt),
                        "--tokens", str(args.tokens), "--ds-shape", args.ds_shape]  # fmt: skip
    if args.traces:
        args.passthrough += ["--traces", args.traces]
    return args


def run(argv: list[str] | None = None) -> list[dict]:
    """Every row (dicts with :data:`KEYS` and a status); prints them, writes DIR/tiers-<host>.md/.json."""
    return _run(argv)[1]


def main(argv: list[str] | None = None) -> int:
    """The command: 1 when any row, setup step included, FAILED (each named on stderr)."""
    report, _ = _run(argv)
    return bench_gpu.exit_status(report.rows, "bench_tiers")


def _run(argv: list[str] | None) -> tuple[Any, list[dict]]:
    args = parse_args(argv)
    report = bench_gpu.Report("cpu")
    if args.child:
        child_main(args)
        return report, []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    holder: dict[str, Tiers] = {}
    report.guard(None, "setup", lambda: holder.setdefault("t", setup(args)) and {}, kind="setup")
    if "t" not in holder:
        return report, _finish(report, args, out, None, t0)
    t = holder["t"]
    if args.predictor:
        report.guard(None, "DeepSeek LLaPor", lambda: _load_predictor(t) or {}, kind="setup")
    report.guard(None, "profile", lambda: profile(t, out), kind="profile")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench_tiers-") as tmp:
        if t.routing.recorded:
            report.guard(
                None, "routing for replay", lambda: write_traces(t, Path(tmp) / "traces") or {}, kind="setup"
            )
        caps = [float(c) for c in args.capacities.split(",")]
        if args.noise > 0:
            cap = 0.25 if 0.25 in caps else caps[0]
            s = SimpleNamespace(name=f"{int(cap * 100)} %")
            report.guard(s, f"noise floor (lru x{args.noise})", lambda: noise_floor(t, cap, args.noise))
        precs = precision_tags(args)
        for p in precs[1:] if precs[:1] == ["model"] else precs:
            report.guard(None, f"{p} copy", lambda p=p: ensure_precision(t, p) or {}, kind="setup")
        with settled_heap():
            for cap in caps:
                rows = live_rows(t, report, cap) if "model" in precs else []
                rows += [r for p in precs if p != "model" for r in precision_rows(t, cap, p)]
                if cap == caps[0]:  # every expert resident: one capacity's round is enough
                    rows += all_in_ram_rows(t, report, cap, precs)
                measure_rows(t, report, cap, rows, calibrate=True)
            # after every moecast row: the baselines' reads (accelerate's run to 190 GB at 25 %) leave a
            # cloud disk slower for a while, which would fall on whichever calibration or row came next
            kinds = baseline_kinds(args)
            for cap in caps:
                rows = [Row(k, lambda i, _prof, k=k, c=cap: child_run(t, k, c, i)) for k in kinds]
                measure_rows(t, report, cap, rows)
    return report, _finish(report, args, out, t, t0)


@contextlib.contextmanager
def settled_heap() -> Iterator[None]:
    """Within the block, what is alive as it starts (the libraries, the model, the traces: all of it
    lives as long as the rows) sits outside the garbage collector's reach, so :func:`release_freed`'s
    collection before each row walks only what the rows made (a full one took 0.1-0.3 s a row in a
    process holding a test session's objects)."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def precision_tags(args: argparse.Namespace) -> list[str]:
    """``--precisions`` as tags (``int4`` with ``--group-size``; ``mixed`` and ``A+B``: two copies'
    ``high+low``), the model's dtype first where given, two copies last."""
    from moecast.runtime.core.mixed import parse_copies, tag_of
    from moecast.runtime.tiers.precision import Precision

    out = []
    for p in (p.strip() for p in args.precisions.split(",") if p.strip()):
        pair = parse_copies(p, args.group_size)
        out.append("+".join(tag_of(*c) for c in pair) if pair else Precision(p, args.group_size).tag)
    return sorted(dict.fromkeys(out), key=lambda p: (p != "model", "+" in p))


def ensure_precision(t: Tiers, precision: str) -> None:
    """The offload directory's copy at ``precision`` (two copies: each), quantized once from its
    model-dtype files."""
    from moecast.collect.models import find_moe_structure
    from moecast.runtime.tiers.offload import write_offload
    from moecast.runtime.tiers.precision import Precision

    if "+" in precision:
        for q in copy_tags(precision):
            ensure_precision(t, q)
        return
    if precision == "model":
        return
    write_offload(
        t.model, find_moe_structure(t.model), t.directory, dense=False, precision=Precision.of_tag(precision)
    )


def _load_predictor(t: Tiers) -> None:
    if not t.routing.recorded:
        raise RuntimeError("the DeepSeek checkpoint needs the recorded routing (no traces found)")
    t.predictor = ds_model.ds_predictor(t.args.predictor, t.routing, t.args.layers)


def _finish(report: Any, args: argparse.Namespace, out: Path, t: Tiers | None, t0: float) -> list[dict]:
    rows = []
    for r in report.rows:
        if r["kind"] != "tpot":
            continue
        cap = float(r["model"].rstrip(" %")) / 100
        rows.append({**{k: r.get(k) for k in KEYS}, "config": r["config"], "capacity": cap, "status": r["status"],
                     **{k: v for k, v in r.items() if k not in KEYS and k not in ("model", "kind", "capacity")}})  # fmt: skip
    rows.sort(key=lambda r: r["capacity"])  # the baselines ran after every capacity's moecast rows
    mark_against_lru(rows)
    host = os.uname().nodename
    bench_gpu._write(out / f"tiers-{host}.json", json.dumps(rows, indent=1, default=str) + "\n")
    bench_gpu._write(out / f"tiers-{host}.md", markdown(report, rows, args, t, time.perf_counter() - t0))
    if args.json:
        for r in rows:
            print(json.dumps({k: r.get(k) for k in (*KEYS, "status")}, default=str), flush=True)
    else:
        print(table(rows), flush=True)
    return rows


def paired_ratios(row: dict, base: dict) -> list[float]:
    """``row``'s TPOT over ``base``'s request by request (the same requests, run in the same rounds);
    empty where the two rows do not pair."""
    a, b = row.get("request_tpot_ms") or [], base.get("request_tpot_ms") or []
    return [x / y for x, y in zip(a, b)] if a and len(a) == len(b) else []


def against(row: dict, base: dict, noise: float) -> str | None:
    """``faster``, ``slower`` or ``tie``: ``row`` against ``base`` request by request
    (:func:`paired_ratios`). Faster (slower) only when every request's TPOT ratio is below 1 / noise
    (above noise), where noise is the host's own max / min of identical runs; a ratio inside that
    spread, or ratios on both sides of 1, make a tie. None without paired requests."""
    ratios = paired_ratios(row, base)
    if not ratios:
        return None
    if max(ratios) < 1 / noise:
        return "faster"
    if min(ratios) > noise:
        return "slower"
    return "tie"


def lru_of(row: dict) -> str | None:
    """The LRU row ``row`` is judged against: LRU at its precision and in its RAM (a row in the model's
    RAM holds more experts than the round's share, and so does its LRU); None for a row the runtime did
    not run (a baseline, the noise floor)."""
    prec = row.get("expert_dtype")
    if prec is None:
        return None
    ram = SAME_RAM if row["config"].endswith(SAME_RAM) else ""
    return ("lru" if prec == "model" else f"lru {prec}") + ram


def mark_against_lru(rows: list[dict]) -> None:
    """Each live row's ``vs_lru``: :func:`against` LRU at its capacity, precision and RAM
    (:func:`lru_of`), with the noise floor's max / min as the host's spread (1 without a noise floor:
    then only ratios on both sides of 1 tie)."""
    noise = max((r["max_over_min"] for r in rows if r.get("max_over_min")), default=1.0)
    for r in rows:
        name = lru_of(r)
        base = next((x for x in rows if x["config"] == name and x["capacity"] == r["capacity"]), None)
        if base is not None and base is not r and r["status"] == "ok":
            r["vs_lru"] = against(r, base, noise)


def table(rows: list[dict]) -> str:
    head = (f"{'capacity':>8}  {'config':<38} {'status':<8} {'measured':>9} {'vs LRU':>7} {'modeled':>9} {'probe':>9} {'run rates':>9} {'hit':>6} {'read MB':>9} "
            f"{'MB/token':>8} {'floor ms':>8} {'waste MB':>8} {'peak RSS MB':>11} {'budget MB':>9} {'base MB':>8} {'RSS ratio':>9}")  # fmt: skip
    lines = [head, "-" * len(head)]
    f = bench_gpu._fmt
    for r in rows:
        mb = None if r.get("bytes_read") is None else r["bytes_read"] / 2**20
        lines.append(
            f"{r['capacity']:>8.2f}  {r['config']:<38} {r['status']:<8} {f(r.get('measured_tpot_ms')):>9} {r.get('vs_lru') or '-':>7} "
            f"{f(r.get('modeled_tpot_ms')):>9} {f(r.get('probe_tpot_ms')):>9} {f(r.get('at_run_rates_tpot_ms')):>9} {f(r.get('hit_rate')):>6} {f(mb, 1):>9} "
            f"{f(r.get('read_mb_per_token'), 1):>8} {f(r.get('link_floor_ms'), 1):>8} {f(r.get('wasted_mb_per_token'), 1):>8} {f(r.get('peak_rss_mb'), 0):>11} "
            f"{f(r.get('budget_mb'), 0):>9} {f(r.get('rss_base_mb'), 0):>8} {f(rss_ratio(r), 3):>9}"
        )
    return "\n".join(lines)


BASELINES = ("page cache", "accelerate")


def baseline_kinds(args: argparse.Namespace) -> list[str]:
    """The external baselines ``--baselines`` asks for."""
    return [b.strip() for b in args.baselines.split(",") if b.strip()]


def _held(args: argparse.Namespace) -> str:
    """Whether the baselines ran held by a memory cgroup; with none asked for, no cgroup is probed (a
    probe makes and removes one)."""
    if not baseline_kinds(args):
        return "no baseline ran"
    return memlimit.available() or "yes"


def markdown(report: Any, rows: list[dict], args: argparse.Namespace, t: Tiers | None, wall: float) -> str:
    import datetime as dt
    import shlex

    prof = next((r for r in report.rows if r["config"] == "profile" and r["status"] == "ok"), None)
    lines = [
        "# bench_tiers: experts on disk, measured",
        "",
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- machine: {bench_gpu.machine_line(torch.device('cpu'))}",
        f"- wall time: {wall:.0f} s; baselines held by a memory cgroup: {_held(args)}",
        *(f"- {n}" for n in (t.notes if t else [])),
        f"- {MEASURED_RULE}",
        "- vs LRU: each live row against LRU at its capacity and precision, request by request: faster or slower "
        "only when every request's TPOT ratio lies beyond the noise floor's max / min; otherwise a tie (the "
        "difference is inside what identical runs differ by)",
    ]
    if prof:
        lines.append("- profile: " + ", ".join(f"{k} {bench_gpu._fmt(prof[k], 4)}" for k in
                                               ("disk_read_gbps", "cpu_beta_ms", "cpu_c_ms", "attn_ms", "predictor_ms", "read_cpu_ms")
                                               if k in prof))  # fmt: skip
    for cal in (r for r in report.rows if r.get("config") == "calibration" and r["status"] == "ok"):
        rounds = cal.get("rounds") or {}
        lines.append(f"- calibrated at {cal['model']} before each round (LRU on another held-out request; as each "
                     "calibration saw it, round by round, then all rounds pooled; the rows' link: the median disk rate of "
                     "the calibrations so far): " + ", ".join(
            f"{k} {' / '.join(bench_gpu._fmt(v, 4) for v in rounds.get(k, []))} ({bench_gpu._fmt(cal[k], 4)})"
            for k in ("transfer_gbps", "gpu_expert_ms", "attn_ms", "step_ms") if k in cal))  # fmt: skip
    lines.append("- modeled: each request replayed under the profile its run ran under (its round's calibration "
                 "where it ran); probe: under the probe's profile; run rates: under the rates the row's own runs "
                 "saw (disk while busy, one expert call (two copies: each copy's), the rest of a layer, what follows "
                 "the last layer)")  # fmt: skip
    lines += [*accuracy_lines(rows), f"- {RSS_RULE}", "", "```", table(rows), "```", ""]
    goals = goal_lines(rows)
    if goals:
        lines += ["Goals (at 25 %, the rows judged as `figures` judges them):", "", *goals, ""]
    copies = copies_table(rows)
    if copies:
        lines += [f"Two copies ({COPIES_RULE}):", "", "```", copies, "```", ""]
    if report.failures:
        lines += ["## Failures", "", *report.failures]
    return "\n".join(lines) + "\n"


def goal_lines(rows: list[dict]) -> list[str]:
    """The goals of :func:`_goal_figures`, one markdown line each: figure, value, goal, verdict, note."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import figures as F

    return [
        f"- {g['name']}: {g['value']} (goal {g['goal']}): {g['verdict'] or '-'}"
        + (f"; {g['note']}" if g["note"] else "")
        for g in _goal_figures(F, rows)
    ]


#: what the two-copy table's columns are, as the markdown states it
COPIES_RULE = (
    "live / modeled / at run rates: the live runs' own counts (the step's share of uses at the low copy, "
    "the high copies the disk reread over low ones, the bytes the disk read at each copy), the replay "
    "under the round's profile, the replay under the row's own rates; per token over every token, the "
    "prompt's included, as the replay counts (the disk reads whole 4 KiB blocks, the replay counts an "
    "expert's bytes); expert ms: each copy's decode compute over its uses, live"
)


def copies_table(rows: list[dict]) -> str:
    """The two-copy rows' figures, live beside the replays' (:data:`COPIES_RULE`); empty without one."""
    got = [r for r in rows if r.get("copies") and r["status"] == "ok"]
    if not got:
        return ""
    f = bench_gpu._fmt

    def three(r: dict, key: str, tag: str | None = None, nd: int = 3) -> str:
        c = r["copies"]
        vals = [c.get(k, {}).get(key) for k in ("live", "modeled", "at_run_rates")]
        if tag is not None:
            vals = [None if v is None else v.get(tag) for v in vals]
        return " / ".join(f(v, nd) for v in vals)

    head = (f"{'config':<46} {'low share':>21} {'upgrades/token':>21} {'high MB/token':>23} {'low MB/token':>23} "
            f"{'expert ms high / low':>21}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in got:
        high, low = r["expert_dtype"].split("+")
        ms = r["copies"]["live"]["expert_ms"]
        lines.append(
            f"{r['config']:<46} {three(r, 'low_share'):>21} {three(r, 'upgrades_per_token', nd=2):>21} "
            f"{three(r, 'mb_per_token', high, 2):>23} {three(r, 'mb_per_token', low, 2):>23} "
            f"{f(ms.get(high), 3) + ' / ' + f(ms.get(low), 3):>21}"
        )
    return "\n".join(lines)


def accuracy_lines(rows: list[dict]) -> list[str]:
    """How many rows model within 15 % of measured, calibrated and at their own rates, and the host's
    noise floor beside them (the spread of identical runs)."""
    f = bench_gpu._fmt
    out = []
    for r in (r for r in rows if r.get("runs_tpot_ms")):
        tp, disk = r["runs_tpot_ms"], [g for g in r["disk_read_gbps_runs"] if g]
        out.append(f"- noise floor at {r['capacity'] * 100:g} %: {len(tp)} identical LRU runs of one request, back to "
                   f"back: TPOT {min(tp):.1f}-{max(tp):.1f} ms (max / min {r['max_over_min']:.3f}), the disk while "
                   f"busy {f(min(disk, default=None))}-{f(max(disk, default=None))} GB/s")  # fmt: skip
    for key, what in (("modeled_tpot_ms", "modeled"), ("at_run_rates_tpot_ms", "at run rates")):
        ratios = [r[key] / r["measured_tpot_ms"] for r in rows if r.get(key) and r.get("measured_tpot_ms")]
        if ratios:
            within = sum(abs(x - 1) <= 0.15 for x in ratios)
            out.append(f"- {what} / measured: {min(ratios):.3f}-{max(ratios):.3f}; within 15 % in {within} of "
                       f"{len(ratios)} rows")  # fmt: skip
    return out


def rows(quick: bool, ds_checkpoint: Path | None = None) -> list[dict]:
    """bench/run_all.py's entry: the quick or full run's rows as figures."""
    argv = ["--quick"] if quick else []
    if ds_checkpoint is not None and Path(ds_checkpoint).is_file():
        argv += ["--predictor", str(ds_checkpoint)]
    return figures(run(argv))


#: how the rows are measured, as the markdown states it
MEASURED_RULE = (
    "measured side by side: at each capacity, round r runs every moecast row on request r, each precision's "
    "rows under a profile calibrated on a held-out request no row measures, at that precision and at the rows' "
    "own capacity (the round's share, the model's RAM, all in RAM), just before its first row, so a drift of the "
    "disk's rate reaches the calibration and its rows alike, its disk rate the median of "
    "those every calibration at the capacity saw so far (one slow spell does not set a precision's link); the "
    "baselines run after every "
    "capacity's moecast rows, in rounds of their own (their reads, up to 190 GB, leave the disk slower for "
    "a while); each run is a fresh attach (a baseline: a fresh process, its page cache dropped), so every "
    "request starts cold, as the replay's requests do (cold)"
)

#: what the peak RSS ratio divides by, as the markdown states it
RSS_RULE = (
    "peak RSS / (budget + non-expert): budget = resident experts x expert bytes; non-expert = the process's "
    "RSS just before attach (rss_base: interpreter, libraries, the loaded predictor and every non-expert "
    "weight, faulted in), the same footprint the page-cache baseline's cgroup limit starts from (its "
    "usage before decoding + budget x 1.1); dense = the non-expert weights' file; target <= 1.1"
)


def rss_ratio(row: dict) -> float | None:
    """A live row's peak RSS over budget + non-expert (:data:`RSS_RULE`); None without the figures."""
    if not row.get("rss_base_mb") or not row.get("peak_rss_mb"):
        return None
    return row["peak_rss_mb"] / (row["budget_mb"] + row["rss_base_mb"])


def figures(raw: list[dict]) -> list[dict]:
    """The rows as bench/figures.py figures, with the tiers bench's goals: at 25 % the best LLaPor row <= 0.6 of
    the page cache's TPOT and below LRU's; modeled within 15 %; peak RSS within budget + non-expert + 10 %."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import figures as F

    out = []
    for r in raw:
        name = f"{int(r['capacity'] * 100)} %: {r['config']} TPOT ms"
        if r["status"] != "ok":
            out.append(
                F.row(
                    "tiers",
                    name,
                    r["status"],
                    verdict="FAILED" if r["status"] == "FAILED" else "SKIPPED",
                    note=r.get("note", ""),
                )
            )
            continue
        out += _row_figures(F, r, name)
    return out + _goal_figures(F, raw)


def _row_figures(F: Any, r: dict, name: str) -> list[dict]:
    """A measured row's TPOT and, where the row has them, its model errors, spread and peak RSS ratio."""
    note = f"modeled {bench_gpu._fmt(r.get('modeled_tpot_ms'))}, hit {bench_gpu._fmt(r.get('hit_rate'))}, peak RSS {bench_gpu._fmt(r.get('peak_rss_mb'), 0)} MB"
    basis = r.get("tpot_basis", "") if r.get("modeled_tpot_ms") else ""
    out = [F.fig("tiers", name, r["measured_tpot_ms"], "{:.1f}", note=note, tpot_basis=basis)]
    if r.get("modeled_tpot_ms"):
        err = abs(r["modeled_tpot_ms"] / r["measured_tpot_ms"] - 1)
        error = f"{name[:-8]} |modeled / measured - 1|"
        out.append(F.fig("tiers", error, err, "{:.2f}", "<= 0.15", tpot_basis=basis))
    if r.get("max_over_min"):
        out.append(F.fig("tiers", f"{name[:-8]} max / min TPOT", r["max_over_min"], "{:.3f}",
                         note="identical runs back to back: the host's own spread"))  # fmt: skip
    if r.get("probe_tpot_ms"):
        err = abs(r["probe_tpot_ms"] / r["measured_tpot_ms"] - 1)
        out.append(F.fig("tiers", f"{name[:-8]} |probe / measured - 1|", err, "{:.2f}",
                         note="replay under the probe's profile, before calibration", tpot_basis=basis))  # fmt: skip
    if r.get("at_run_rates_tpot_ms"):
        err = abs(r["at_run_rates_tpot_ms"] / r["measured_tpot_ms"] - 1)
        c = r["run_rates"]
        note = (f"replay under the rates this run saw: disk {c['disk_read_gbps']:.2f} GB/s, expert "
                f"{c['expert_ms']:.2f} ms, other {c['layer_other_ms']:.1f} ms per layer")  # fmt: skip
        out.append(F.fig("tiers", f"{name[:-8]} |at run rates / measured - 1|", err, "{:.2f}",
                         note=note, tpot_basis=basis))  # fmt: skip
    if r.get("rss_base_mb") and r.get("peak_rss_mb"):
        out.append(F.fig("tiers", f"{name[:-8]} peak RSS / (budget + non-expert)", rss_ratio(r), "{:.2f}",
                         "<= 1.1", note=f"non-expert {r['rss_base_mb']:.0f} MB (dense weights "
                         f"{r['dense_mb']:.0f} MB of it), budget {r['budget_mb']:.0f} MB"))  # fmt: skip
    return out


def _goal_figures(F: Any, raw: list[dict]) -> list[dict]:
    """At 25 %, the best LLaPor row's TPOT over the page cache's and over LRU's, and the precisions'
    goals (:func:`precision_goals`)."""
    out = precision_goals(F, raw)
    at = {r["config"]: r for r in raw if r["capacity"] == 0.25 and r["status"] == "ok"}
    # at the model's dtype: the precisions have goals of their own (precision_goals)
    llapor = (r for c, r in at.items() if "llapor" in c and r.get("expert_dtype", "model") == "model")
    best = min(llapor, key=lambda r: r["measured_tpot_ms"], default=None)
    for base, goal in (("page cache", "<= 0.6"), ("lru", "< 1")):
        if best and base in at:
            out.append(
                F.fig(
                    "tiers",
                    f"25 %: best llapor / {base}",
                    best["measured_tpot_ms"] / at[base]["measured_tpot_ms"],
                    "{:.2f}",
                    goal,
                )
            )
    return out


def best_at(rows: list[dict], precision: str, ram: bool = False) -> dict | None:
    """The fastest row at ``precision`` that a user can run: neither a bound nor every expert in RAM;
    at the round's share of experts, or (``ram``) in the model dtype's RAM (:data:`SAME_RAM`)."""
    ok = [r for r in rows if r.get("expert_dtype") == precision and "bound" not in r["config"]
          and not r["config"].startswith("all in RAM") and r["config"].endswith(SAME_RAM) == ram]  # fmt: skip
    return min(ok, key=lambda r: r["measured_tpot_ms"], default=None)


def faster(row: dict, lru: dict) -> bool:
    """Whether ``row`` beat ``lru``: its ``vs_lru`` verdict (:func:`mark_against_lru`, every request
    beyond the noise floor) where it has one, else the lower mean TPOT (rows without paired requests)."""
    if row.get("vs_lru") is not None:
        return row["vs_lru"] == "faster"
    return row["measured_tpot_ms"] < lru["measured_tpot_ms"]


def ram_note(rows: list[dict], best: dict, ram: dict) -> str:
    """The note of a goal over every expert in RAM: the best row's name, its ratio request by request
    (each request's rows ran in one round, side by side: how far the host moved the figure) and the
    oracle bound's ratio at the same precision and RAM (what a perfect predictor reached in this run)."""
    note = best["config"]
    ratios = paired_ratios(best, ram)
    if ratios:
        note += "; per request " + ", ".join(f"{r:.2f}" for r in ratios)
    same = best["config"].endswith(SAME_RAM)
    bounds = [r for r in rows if "bound" in r["config"] and r.get("expert_dtype") == best.get("expert_dtype")
              and r["config"].endswith(SAME_RAM) == same]  # fmt: skip
    if bounds:
        bound = min(r["measured_tpot_ms"] for r in bounds)
        note += f"; oracle bound {bound / ram['measured_tpot_ms']:.2f}"
    return note


def precision_goals(F: Any, raw: list[dict]) -> list[dict]:
    """At 25 %: the best int4 row <= 0.5 x the best model-dtype row and <= 1.3 x int4 all in RAM, the best
    int8 row <= 0.7 x the best model-dtype row; and no LLaPor row reads more per token than LRU at its
    precision unless it is faster (:func:`faster`: as the table's vs LRU column judges it)."""
    out = []
    at = [r for r in raw if r["capacity"] == 0.25 and r["status"] == "ok"]
    base = best_at(at, "model")
    for r in at:
        if (
            r.get("expert_dtype") in (None, "model")
            or "+" in r["expert_dtype"]
            or r["config"] != f"lru {r['expert_dtype']}"  # once per precision: its LRU at the share
        ):
            continue
        prec, best = r["expert_dtype"], best_at(at, r["expert_dtype"])
        goal = "<= 0.5" if prec.startswith("int4") else "<= 0.7"
        if base:
            out.append(F.fig("tiers", f"25 %: best {prec} / best model dtype", best["measured_tpot_ms"] / base["measured_tpot_ms"],
                             "{:.2f}", goal, note=f"{best['config']} / {base['config']}"))  # fmt: skip
        ram = next((x for x in at if x["config"] == f"all in RAM {prec}"), None)
        if ram and prec.startswith("int4"):
            out.append(F.fig("tiers", f"25 %: best {prec} / all in RAM {prec}", best["measured_tpot_ms"] / ram["measured_tpot_ms"],
                             "{:.2f}", "<= 1.3", note=ram_note(at, best, ram)))  # fmt: skip
            same = best_at(at, prec, ram=True)
            if same:
                out.append(F.fig("tiers", f"25 %: best {prec}{SAME_RAM} / all in RAM {prec}",
                                 same["measured_tpot_ms"] / ram["measured_tpot_ms"], "{:.2f}", "<= 1.3",
                                 note=ram_note(at, same, ram)))  # fmt: skip
    for r in at:
        if not r["config"].startswith("llapor"):
            continue
        lru = next((x for x in at if x["config"] == lru_of(r)), None)
        if lru and r.get("read_mb_per_token") is not None and lru.get("read_mb_per_token"):
            more = r["read_mb_per_token"] / lru["read_mb_per_token"]
            ok = more <= 1 or faster(r, lru)
            out.append(F.row("tiers", f"25 %: {r['config']} read per token / LRU's", f"{more:.2f}",
                             "<= 1, or faster than LRU (vs LRU)", "ok" if ok else "MISS"))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
