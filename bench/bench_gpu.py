"""The CUDA path measured in one command: profile, exactness and TPOT at 25 % of experts resident.

    python bench/bench_gpu.py [--out DIR] [--device cuda|cpu] [--quick] [--layers N] [--repeats 3]
                              [--precisions model,int8,int4] [--group-size 128] [--tiers host,disk]
                              [--rows NAMES] [--host-profile NAMES]
                              [--predictor TINY_CKPT] [--ds-predictor DS_CKPT] [--traces PATH]

``--tiers`` chooses which tiers get the precision rows (the disk tier writes every expert at each precision
to a temporary folder: 29 GB in bf16 at 26 layers); ``--rows`` runs only the measured rows whose names
contain one of its comma-separated parts, for a device lent for minutes (the 26-layer run of every host
row takes about 8 minutes on an H200: the calibration and the exactness check about a minute each, each
timed row 35-50 s at 3 repeats).

Writes DIR/gpu-<device>.md (date, command, machine, tables, and the traceback of any row that
failed: every row runs on its own, so one failure never costs the rest) and DIR/gpu-<device>.json
(the rows). DIR defaults to bench/results/.

Two models:
- ``tiny``, the project's embedded model (the built default preset when it exists, else the quick
  ``test`` preset: the output says which), its own routing;
- a DeepSeek-V2-Lite-shaped random-weight model (bench/ds_model.py: hidden 2048, expert
  intermediate 1408, 64 routed + 2 shared experts, top-6, bf16, ``--layers`` MoE layers) whose
  routing is the recorded routing of held-out DeepSeek requests (a benchmark mode; without the
  traces its random router decides, and the output says so).

Per model:
1. profile: CPU time of one expert of the model's shape and dtype (beta, C), non-expert time per
   layer measured on the model, and on CUDA pinned host-to-device bandwidth and kernel time per expert
   (:func:`moecast.runtime.profile.measure.measure`); written as a hardware-profile YAML beside the results;
2. exactness: logits of the live runtime at alpha 0 (25 % resident, LRU) against the unmodified model's;
3. TPOT at 25 % resident (teacher-forced decode of the same tokens in every row, after a one-token
   prompt, every layer's slots empty at the start as the replay's caches are; the mean wall time of a
   decode step, the first two steps excluded as warm-up):
   - full residency (the floor);
   - runtime, all resident: the live runtime attached with every expert in a slot (no transfer, no
     miss): its host work alone, against the floor; and the same with its decode calls not replayed
     as graphs (``graphs=False``), what the graphs save;
   - accelerate offload (CUDA only): ``dispatch_model`` with a device map that keeps the experts modules
     of the first layers on the GPU while they fit in the budget (25 % of the experts' bytes) and maps
     the others to "cpu", i.e. streamed to the GPU at each use (accelerate's unit is the module, so a
     layer's experts are resident or offloaded together; the map is built by hand because
     ``infer_auto_device_map`` would offload attention as well);
   - on-demand LRU; LLaPor prefetch (LRU + layer-ahead prefetch); PreSched with CPU experts;
     SMoE (tiny only: it needs router probabilities);
   beside each, the modeled TPOT: ``runtime.replay`` of the same routing (recorded from the
   unmodified model) under the profile just measured, with the row's policy. Each timed row runs
   ``--repeats`` times (default 3): the median, and the spread as the row's noise floor. The live
   runtime's split of a decode step covers the same steps as the TPOT (the warm-up left out of
   both). The recorded routing goes to the device once per request, so no layer waits on a copy.

4. the host tier at each quantized precision of ``--precisions`` (default ``model,int8,int4``): on-demand
   LRU and LLaPor prefetch as above, the experts quantized once at attach into packed host blocks, each
   load one copy of the packed block that the device dequantizes into its slot (the slots compute at
   the model's dtype), beside its replay at that precision (the profile's ``dequant_ms`` charged);
5. the disk tier at each of ``--precisions`` (the experts written once to an offload directory in the
   run's temporary folder, each quantized copy made from it): on-demand LRU, LLaPor prefetch-late, and
   every expert resident at that precision (its compute floor), each beside its replay at that precision.

On a machine without CUDA (``--device cpu``) every row except the CUDA ones runs: a dry run, whose live
rows attach with ``device_ops="simulated"`` (:mod:`moecast.runtime.tiers.simulated`), so they walk the
CUDA path's data path (packed pinned-layout slots, copies queued on one transfer stream with one event
each, the compute stream's waits, CPU experts on a worker thread) with CPU tensors.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_model  # the bench folder is not a package
from moecast.runtime.core.policy import DEFAULT_ALPHA, Policy, get_policy
from moecast.runtime.live.runtime import BREAKDOWN

RESULTS = Path(__file__).resolve().parent / "results"
CAPACITY = 0.25
WARMUP = 2  # decode steps at the start of each run left out of its TPOT (ds_model.decode_all's)
ACCELERATE_STEPS = 18


def log(msg: str) -> None:
    print(msg, flush=True)


def exit_status(rows: list[dict], bench: str) -> int:
    """1 when any row FAILED (each named on stderr, one line a row), else 0: the exit status of a bench
    run as a user's command, so that a failed row fails the command and not only its results file."""
    failed = [r for r in rows if r.get("status") == "FAILED"]
    for r in failed:
        where = f"{r['model']}: " if r.get("model") not in (None, "-") else ""
        print(f"{bench}: {where}{r['config']} FAILED (traceback in the results file)", file=sys.stderr)
    return 1 if failed else 0


@dataclass
class Setup:
    """One model prepared for the rows."""

    name: str
    model: Any
    device: torch.device
    requests: list[np.ndarray]  # token ids of each request: prompt, then the decoded tokens
    prompt: int
    prefill: int  # the exactness check's prefill: its experts outnumber the slots
    routing: ds_model.Routing
    notes: list[str] = field(default_factory=list)
    predictor: Any = None  # layer-ahead predictor for the live rows
    replay_predictor: Any = None  # the same for replay (a checkpoint path or the object)
    profile: Any = None  # HardwareProfile (calibrated all-resident once that step ran)
    probe_profile: Any = None  # the profile as probed, before that calibration: no runtime host work in it
    profile_path: Path | None = None
    traces: Path | None = None  # TraceSet of the unmodified model's routing, for replay
    substitutes: bool = False  # SMoE row (needs the model's own router probabilities)
    repeats: int = 3  # runs of each timed row (median and spread)
    offload_dir: Path | None = None  # the disk tier's directory for the precision rows
    precisions: tuple[str, ...] = ()  # the disk tier's expert precisions (tags) with rows of their own
    tiers: tuple[str, ...] = ("host", "disk")  # which precision rows run: the host tier's, the disk tier's
    profile_rows: tuple[str, ...] = ()  # --host-profile: rows run once more under the profilers
    profile_to: Path | None = None  # where those profiles go (the results folder) and with what device tag
    device_tag: str = ""
    row_name: str = ""  # the row being run (set by Report.guard)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ----------------------------------------------------------------------------- running tokens


def run_all(s: Setup, override: Any = None, keep_logits: bool = False, on_forward: Callable | None = None):
    return ds_model.decode_all(
        s.model, s.requests, s.prompt, s.device, s.routing, override, keep_logits, on_forward, WARMUP
    )


def timed(s: Setup, on_forward: Callable | None = None) -> tuple[float, list[float]]:
    """The mean ms of a decode step over the requests, the first WARMUP steps left out."""
    with ds_model.routed(s.model, s.routing) as ov:
        times, _ = run_all(s, ov, on_forward=on_forward)
    return float(np.mean(times)), times


def repeated(s: Setup, once: Callable[[], dict]) -> dict:
    """The row run ``s.repeats`` times, one after another: the median run (of an even count, the
    faster of the two middle ones), whose TPOT and other figures the row gives, every run's TPOT, and
    their spread ((max - min) / the median run's: the row's noise floor). One run's figures throughout,
    so that its split adds up to its TPOT."""
    runs = sorted((once() for _ in range(s.repeats)), key=lambda r: r["measured_tpot_ms"])
    ms = [r["measured_tpot_ms"] for r in runs]
    med = runs[(len(runs) - 1) // 2]
    mid = med["measured_tpot_ms"]
    return {**med, "measured_runs_ms": ms, "spread": (ms[-1] - ms[0]) / mid if mid > 0 else 0.0}


def warm_snapshot(rt: Any) -> tuple[dict, Callable[[bool], None]]:
    """(a dict, an ``on_forward`` callback that fills it with ``rt``'s stats as the WARMUP-th decode
    step ends): the snapshot :func:`window` starts the TPOT's steps from."""
    first: dict = {}
    seen = [0]

    def after(is_decode: bool) -> None:
        seen[0] += is_decode
        if is_decode and seen[0] == WARMUP:
            first.update(rt.stats())

    return first, after


def window(first: dict, last: dict, key: str) -> float:
    """``key``, a mean per decode step in the runtime's stats, over the steps between two snapshots
    (``first`` after the warm-up steps, ``last`` at the end): the steps the TPOT covers. Without a
    ``first`` snapshot (fewer decode steps than the warm-up) the whole run's mean."""
    n0, n1 = first.get("decode_steps", 0), last["decode_steps"]
    if not n0 or n1 <= n0:
        return float(last[key])
    return (float(last[key]) * n1 - float(first[key]) * n0) / (n1 - n0)


# ----------------------------------------------------------------------------- setups


def tiny_setup(args: argparse.Namespace, device: torch.device) -> Setup:
    from moecast.collect.tiny import _default_out, _is_built, ensure_tiny
    from moecast.runtime.live.commands import heldout_rows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    preset = args.tiny_preset
    if preset == "auto":
        preset = "default" if _is_built(_default_out("default")) else "test"
    path = ensure_tiny(preset)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    n = args.prompt + args.tokens
    rows = [r for r in heldout_rows(tok, "sharegpt", args.requests * 4, n) if len(r) >= n][: args.requests]
    if not rows:
        raise RuntimeError(f"no held-out ShareGPT text of {n} tokens; lower --prompt/--tokens")
    s = Setup(
        "tiny",
        model,
        device,
        [np.array(r) for r in rows],
        args.prompt,
        _prefill(args),
        ds_model.Routing(),
        substitutes=True,
    )
    s.notes.append(f"tiny preset {preset} ({path}), float32, its own routing")
    s.tiny_path = path  # type: ignore[attr-defined]
    return s


def _prefill(args: argparse.Namespace) -> int:
    """The exactness check's prefill length, within the requests (prompt + tokens long)."""
    return max(1, min(args.prefill, args.prompt + args.tokens - 1))


def ds_setup(args: argparse.Namespace, device: torch.device) -> Setup:
    overrides = DS_TEST_SHAPE if args.ds_shape == "test" else {}
    cfg = ds_model.ds_config(args.layers, **overrides)
    model = ds_model.build_ds_model(cfg, torch.bfloat16, str(device))
    n = args.prompt + args.tokens
    routing = ds_model.load_routing(args.traces, args.requests, n, args.layers, cfg.vocab_size)
    if routing.recorded:
        reqs = [r.tokens[:n] for r in routing.requests]
        for r in routing.requests:
            r.topk_ids = r.topk_ids[:n]
        note = f"BENCHMARK MODE: routing replaced by the {routing.source}"
    else:
        gen = np.random.default_rng(0)
        reqs = [gen.integers(0, cfg.vocab_size, n) for _ in range(args.requests)]
        note = f"{routing.source}: the model's own random router decides (not DeepSeek's routing)"
    s = Setup("deepseek-shaped", model, device, reqs, args.prompt, _prefill(args), routing)
    shape = "test sizes" if args.ds_shape == "test" else "DeepSeek-V2-Lite shape"
    s.notes += [
        f"random weights, {shape}: hidden {cfg.hidden_size}, expert intermediate {cfg.moe_intermediate_size}, "
        f"{cfg.n_routed_experts} routed + {cfg.n_shared_experts} shared experts, top-{cfg.num_experts_per_tok}, "
        f"{args.layers} MoE layers, bf16",
        note,
    ]
    return s


#: --models: each model's setup
BUILDERS = {"tiny": tiny_setup, "deepseek": ds_setup}
MODELS = tuple(BUILDERS)

# sizes for the test suite's dry run (seconds on a CPU)
DS_TEST_SHAPE = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_experts_per_tok=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    vocab_size=512,
    intermediate_size=128,
)


def calibrate_profile(s: Setup, out: Path) -> dict:
    """The profile calibrated (runtime/profile/measure.py ``calibrate_device``) on the first request run
    with the runtime attached and every expert resident, over the steps a TPOT covers: what a layer
    costs beyond its experts' kernels (the runtime's host work included). The rows after it model
    their time on it; the other requests are not seen by it."""
    from moecast.runtime.live.runtime import attach
    from moecast.runtime.profile.measure import calibrate

    if s.profile is None:
        raise RuntimeError("no profile to calibrate (the profile step failed)")
    rt = attach(s.model, policy="lru", capacity=None, prefetch="none", **_live_device(s), hardware=s.profile)
    first, after = warm_snapshot(rt)

    try:
        timed(replace(s, requests=s.requests[:1]), after)
        last = rt.stats()
    finally:
        rt.detach()
    steady = {
        **last,
        **{k: window(first, last, k) for k in ("measured_tpot_ms", "after_layers_ms", "predictor_ms")},
    }
    if first:  # the counters of the steps after the warm-up
        steady.update({k: last[k] - first[k] for k in ("decode_steps", "routed")})
    before, s.profile = s.profile, calibrate(s.profile, steady, len(_structure(s.model).layers))
    s.probe_profile = before
    s.profile_path = out / f"{s.profile.name}.yaml"
    _write(s.profile_path, s.profile.to_yaml())
    layers = len(_structure(s.model).layers)
    return {"attn_ms_probe": before.attn_ms, "attn_ms": s.profile.attn_ms, "step_ms": s.profile.step_ms,
            "step_ms_probe": before.step_ms, "layers": layers,
            "calibrated_on_steps": steady["decode_steps"], "profile": str(s.profile_path)}  # fmt: skip


def _structure(model: Any) -> Any:
    from moecast.collect.models import find_moe_structure

    return find_moe_structure(model)


def profile_model(s: Setup, out: Path, device_tag: str) -> dict:
    """``moecast profile`` of this model (its expert shape and dtype, its dense time per layer, its
    predictor's latency), written beside the results; the rows' modeled times come from it."""
    from moecast.runtime.profile.measure import profile_model as measure_model
    from moecast.runtime.tiers.precision import Precision

    # the DeepSeek adapter's checkpoint is timed as trained (all its layers), as the runtime calls it
    pred = getattr(s.predictor, "inner", s.predictor)
    # each quantized precision's dequantize into a slot (dequant_ms), which its rows' replays charge
    precs = [Precision.of_tag(t) for t in s.precisions]
    prof, _how = measure_model(s.model, f"bench-{device_tag}-{s.name}", pred, precisions=precs)
    if not s.cuda and torch.cuda.is_available():
        prof.source += "; device rows of this bench ran on the CPU"
    s.profile = prof
    s.profile_path = out / f"{prof.name}.yaml"
    _write(s.profile_path, prof.to_yaml())
    return {
        "h2d_gbps": prof.transfer_gbps,
        "kernel_ms_per_expert": prof.gpu_expert_ms,
        "cpu_beta_ms": prof.cpu_beta_ms,
        "cpu_c_ms": prof.cpu_c_ms,
        "dense_ms_per_layer": prof.attn_ms,
        "predictor_ms_per_layer": prof.predictor_ms,
        "expert_bytes": prof.ref_expert_bytes,
        "dequant_ms_per_expert": dict(prof.dequant_ms),
        "load_host_ms": prof.load_host_ms,
        "source": prof.source,
    }


def _info(s: Setup) -> Any:
    from moecast.collect.models import model_info

    return model_info(s.model, _structure(s.model), s.name)


def record_traces(s: Setup, out: Path) -> None:
    """The unmodified model's routing of every request, as a TraceSet for replay."""
    from moecast.collect.recorder import RoutingRecorder
    from moecast.collect.traceset import TraceMeta, TraceWriter

    st = _structure(s.model)
    info = _info(s)
    gate = "gate_inputs" in getattr(s.predictor, "needs", ())
    rec = RoutingRecorder(st, info.top_k, router_probs=True, gate_inputs=gate)
    steps: list[Any] = []
    with ds_model.routed(s.model, s.routing) as ov, rec.attach(s.model):
        records = []
        for i in range(len(s.requests)):
            if ov is not None:
                ov.start(s.routing.requests[i], s.device)
            steps.clear()
            ds_model.decode(
                s.model, s.requests[i], s.prompt, s.device, on_forward=lambda _d: steps.append(rec.take())
            )
            records.append(_request_record(s, i, steps, gate))
    fields = {"topk_weights": True, "router_probs": True, "gate_inputs": gate}
    s.traces = out / f"traces-{s.name}"
    TraceWriter(s.traces, TraceMeta(model=info, collection={"source": "bench_gpu"}, fields=fields)).write(
        records
    )


def _request_record(s: Setup, i: int, steps: list[Any], gate: bool) -> Any:
    """Request ``i``'s recorded forwards (``steps``) as one RequestRecord of the replay TraceSet."""
    from moecast.collect.traceset import RequestRecord

    ids = torch.cat([x.topk_ids for x in steps]).cpu().numpy()
    T = len(ids)
    opt = {
        "topk_weights": torch.cat([x.topk_weights for x in steps]).cpu().numpy().astype(np.float16),
        "router_probs": torch.cat([x.router_probs for x in steps]).cpu().numpy().astype(np.float16),
    }
    if gate:
        opt["gate_inputs"] = (
            torch.cat([x.gate_inputs for x in steps]).float().cpu().numpy().astype(np.float16)
        )
    phases = np.arange(T) >= s.prompt
    return RequestRecord(
        f"{s.name}-{i}",
        "bench",
        "",
        "",
        s.requests[i][:T],
        [""] * T,
        phases,
        ids.astype(np.int16),
        **opt,
    )


# ----------------------------------------------------------------------------- predictors


def tiny_predictor(s: Setup, args: argparse.Namespace, work: Path) -> None:
    """LLaPor for tiny: ``--predictor``, else one trained here in seconds on fresh traces of tiny."""
    from moecast.predictors.registry import load

    ckpt = Path(args.predictor) if args.predictor else None
    if ckpt is None:
        from moecast.collect.commands import collect

        from moecast import configs_dir
        from moecast.cli import run

        traces = collect(
            model=str(s.tiny_path),  # type: ignore[attr-defined]
            workloads="sharegpt",
            out=str(work / "tiny-train-traces"),
            max_requests=args.train_requests,
            max_new_tokens=16,
            gate_inputs=True,
            device="cpu",
            progress=False,
        )
        ckpt = work / "llapor-tiny.safetensors"
        run(
            ["train", "llapor", "--config", str(configs_dir() / "llapor_tiny.yaml"), "--traces", str(traces),
             "--out", str(ckpt), "--train.max_epochs", str(args.train_epochs),
             "--train.progress_bar", "false", "--data.val_fraction", "0.25"]
        )  # fmt: skip
        s.notes.append(
            f"LLaPor: trained here ({args.train_requests} requests, {args.train_epochs} epochs), not the tuned checkpoint"
        )
    else:
        s.notes.append(f"LLaPor: {ckpt}")
    s.predictor = load(str(ckpt), fingerprint=_info(s).fingerprint, against=f"tiny {s.name}")
    s.replay_predictor = str(ckpt)


def ds_predictor(s: Setup, args: argparse.Namespace) -> None:
    if not args.ds_predictor:
        s.notes.append("LLaPor: no DeepSeek checkpoint given (--ds-predictor): its row is skipped")
        return
    if not s.routing.recorded:
        s.notes.append(
            "LLaPor: the DeepSeek checkpoint needs the recorded routing (no traces): its row is skipped"
        )
        return
    s.predictor = ds_model.ds_predictor(args.ds_predictor, s.routing, args.layers)
    s.replay_predictor = s.predictor
    s.notes.append(f"LLaPor: {args.ds_predictor} on the first {args.layers} MoE layers")


# ----------------------------------------------------------------------------- rows


def _experts_to(s: Setup, device: str | torch.device) -> None:
    for e in _structure(s.model).layers:
        e.experts.to(device)


def modeled(
    s: Setup,
    policy: str | Policy,
    capacity: float | int,
    predictor: Any = None,
    alpha: float = 0.0,
    precision: str = "model",
    profile: Any = None,
) -> dict:
    """The row replayed on the recorded routing under the measured profile (``profile``, else the
    calibrated one), the slow tier at ``precision``."""
    from moecast.runtime.replay.engine import ReplayConfig, replay
    from moecast.runtime.tiers.precision import Precision

    profile = profile if profile is not None else s.profile
    if s.traces is None or profile is None:
        return {"modeled_tpot_ms": None, "note": "no replay (profile or routing record failed)"}
    prec = Precision.of_tag(precision)
    cfg = ReplayConfig(policy=policy, capacity=capacity, hardware=profile, predictor=predictor, alpha=alpha,
                       expert_dtype=prec.dtype, group_size=prec.group_size)  # fmt: skip
    r = replay(str(s.traces), cfg)
    return {"modeled_tpot_ms": r.modeled_tpot_ms, "modeled_hit_rate": r.hit_rate, "tpot_basis": r.tpot_basis}


def row_full(s: Setup) -> dict:
    row = repeated(s, lambda: {"measured_tpot_ms": timed(s)[0]})
    # static at capacity E: every expert preloaded before the clock starts, as the live row's model
    # holds them all (LRU would start empty and count each expert's first use as a load); on the profile
    # as probed: the calibrated one holds the runtime's host work, and no runtime is attached here
    full = modeled(s, "static", _info(s).num_experts, "none", profile=s.probe_profile)
    return {**row, "hit_rate": 1.0, **full}


def _logits(s: Setup, attached: bool) -> list[torch.Tensor]:
    from moecast.runtime.live.runtime import attach

    rt = None
    if attached:
        rt = attach(
            s.model, policy="lru", capacity=CAPACITY, **_live_device(s), prefetch="none", balance="load"
        )
    try:
        with ds_model.routed(s.model, s.routing) as ov:
            return run_all(s, ov, keep_logits=True)[1]
    finally:
        if rt is not None:
            rt.detach()


#: decode steps the exactness check compares after its prompt
EXACT_STEPS = 8


def exactness(s: Setup) -> dict:
    """Alpha-0 logits of the live runtime (LRU, 25 %, experts served from slots / host) vs the model's.

    Twice: one token per forward from the first token on (every forward's experts fit in the
    slots: the runtime runs the wrapped implementation once, as the model does), and with the
    prefill (its experts outnumber the slots and run in waves, whose pairs' outputs are combined
    once, as the implementation combines them: runtime/live/pairs.py; the KV cache would carry any
    difference into the decode steps)."""
    out: dict[str, Any] = {}
    for tag, prompt in (("", 1), ("prefill_", s.prefill)):
        # one request, a few decode steps past the prompt: the check's figure is equality, not time,
        # and a lent device's minutes go to the timed rows
        t = replace(s, prompt=prompt, requests=[s.requests[0][: prompt + EXACT_STEPS]])
        ref, got = _logits(t, False), _logits(t, True)
        out[f"{tag}equal"] = all(torch.equal(a, b) for a, b in zip(ref, got))
        out[f"{tag}max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
        out[f"{tag}positions"] = sum(len(a) for a in ref)
        out.setdefault("max_abs_logit", max(float(a.abs().max()) for a in ref))
    return out


def _live_device(s: Setup) -> dict[str, str]:
    """Where the live rows' slots go: the CUDA device, or on the CPU the simulated device, whose streams
    and events walk the CUDA path's order (copies on the link stream, one event each, the waits)."""
    return {"device": str(s.device)} if s.cuda else {"device_ops": "simulated"}


def live_row(
    s: Setup, policy: str, replay_policy: str | Policy, replay_pred: Any, alpha: float = 0.0, **kw: Any
) -> dict:
    """A row of the live runtime, run ``s.repeats`` times (each attached afresh, every layer's slots
    empty), beside its replay under the measured profile."""
    row = repeated(s, lambda: live_once(s, policy, alpha, **kw))
    if any(p.lower() in s.row_name.lower() for p in s.profile_rows):
        one = replace(s, requests=s.requests[:1])
        row["host_profile"] = str(host_profile(s, lambda: live_once(one, policy, alpha, **kw)))
    capacity = kw.get("capacity", CAPACITY)
    capacity = _info(s).num_experts if capacity is None else capacity
    row.update(modeled(s, replay_policy, capacity, replay_pred, alpha, kw.get("precision_tag", "model")))
    return row


def host_profile(s: Setup, once: Callable[[], dict]) -> Path:
    """``once()`` (a live row's run) under cProfile and torch.profiler (CUDA kernels too on a GPU): the
    host's time by owner (moecast, transformers, torch, the rest) per decode step, the functions that take
    it, and the operators and kernels. Both profilers slow the run; the shares, not the times, are the
    figures. Written to ``profile-<device>-<row>.txt`` in the results folder."""
    import cProfile
    import io
    import pstats
    import re

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.cuda else [])
    prof = cProfile.Profile()
    with profile(activities=acts) as tp:
        prof.enable()
        try:
            row = once()
        finally:
            prof.disable()
    steps = max(1, len(s.requests[0]) - s.prompt)
    stats = pstats.Stats(prof)
    owners: dict[str, float] = {}
    for (path, _line, fn), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        owner = _owner(path, fn)
        owners[owner] = owners.get(owner, 0.0) + tt
    top = io.StringIO()
    pstats.Stats(prof, stream=top).sort_stats("tottime").print_stats(40)
    lines = [f"# host profile: {s.row_name} ({s.name}, {s.device_tag}, {steps} decode steps of one request)", "",
             f"measured TPOT under the profilers: {row['measured_tpot_ms']:.3f} ms", "",
             "## host time by owner (cProfile self time, ms per decode step)", ""]  # fmt: skip
    lines += [f"- {o}: {t / steps * 1e3:.3f}" for o, t in sorted(owners.items(), key=lambda kv: -kv[1])]
    lines += ["", "## functions by self time (cProfile)", "", "```", top.getvalue().strip(), "```", ""]
    if s.cuda:
        busy = device_busy(tp.key_averages())
        lines += ["## the device's own time (torch.profiler's kernels and copies, ms per decode step)", "",
                  f"- kernels: {busy['kernels'] / steps / 1e3:.3f}", f"- copies: {busy['copies'] / steps / 1e3:.3f}",
                  "", "Against the TPOT under the profilers above: the rest of a step the compute stream had "
                  "nothing to run (it waited for the host, or for a copy).", ""]  # fmt: skip
    for key in ("self_cpu_time_total",) + (("self_device_time_total",) if s.cuda else ()):
        table = tp.key_averages().table(sort_by=key, row_limit=25)
        lines += [f"## operators by {key} (torch.profiler)", "", "```", table.strip(), "```", ""]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", s.row_name).strip("-")
    path = Path(s.profile_to or RESULTS) / f"profile-{s.device_tag}-{s.name}-{slug}.txt"
    _write(path, "\n".join(lines) + "\n")
    return path


def device_busy(averages: Any) -> dict[str, float]:
    """µs of device work in a profile's averaged events (the device-side ones: kernels, and copies by
    their "Memcpy" names); the host-side operators that launched them are not counted again."""
    from torch.autograd import DeviceType

    out = {"kernels": 0.0, "copies": 0.0}
    for e in averages:
        if e.device_type == DeviceType.CUDA:
            out["copies" if "memcpy" in e.key.lower() else "kernels"] += float(e.device_time_total)
    return out


def _owner(path: str, fn: str) -> str:
    """Which package a profiled function belongs to: moecast (installed, or this checkout), the bench
    harness, transformers, torch, numpy, or other (a built-in method by the module its name gives)."""
    if path == "~":  # a built-in: "<built-in method torch._grouped_mm>", "<method 'numpy' ...>"
        return next((o for o in ("torch", "numpy") if o in fn), "other")
    checkout = str(RESULTS.parents[1])
    if path.startswith(str(RESULTS.parent)):
        return "bench harness"  # the routing override, the decode loop
    if path.startswith(checkout) and "site-packages" not in path:
        return "moecast"  # an editable install: the stage folders of this checkout
    pkg = path.split("site-packages/", 1)[1].split("/", 1)[0] if "site-packages/" in path else ""
    return pkg if pkg in ("moecast", "transformers", "torch", "numpy") else "other"


def live_once(s: Setup, policy: str, alpha: float, **kw: Any) -> dict:
    """One timed run of the live runtime; its counters over all the run's decode steps, and its split of
    a decode step over the steps its TPOT covers (the warm-up left out of both)."""
    from moecast.runtime.live.runtime import attach

    kw.setdefault("capacity", CAPACITY)
    kw.pop("precision_tag", None)
    rt = attach(
        s.model, policy=policy, alpha=alpha, **_live_device(s),
        hardware=str(s.profile_path or "prescope-a100-pcie4"), warm=False, **kw,
    )  # fmt: skip
    first, after = warm_snapshot(rt)

    try:
        if s.cuda:
            torch.cuda.reset_peak_memory_stats(s.device)
        ms, _ = timed(s, after)
        st = rt.stats()
    finally:
        rt.detach()
    row = {
        "measured_tpot_ms": ms,
        "hit_rate": st["hit_rate"],
        "live_modeled_tpot_ms": window(first, st, "modeled_tpot_ms"),
        "runtime_tpot_ms": window(first, st, "measured_tpot_ms"),  # the runtime's own clock, same steps
        "loads": st["loads"],
        "prefetches_issued": st["prefetches_issued"],
        "cpu_experts": st["cpu_experts"],
        "substitution_rate": st["substitution_rate"],
        # the live runtime's own split of a decode step (host wall clock; on CUDA a kernel's time shows
        # where the host first waits for it), over the steps the TPOT covers
        **{f"{part}_ms": window(first, st, f"{part}_ms") for part in BREAKDOWN},
    }
    row["split_sum_ms"] = sum(row[f"{part}_ms"] for part in BREAKDOWN)
    # the device's own figures: its kernels' wait for their copies (CUDA events; on the CPU the simulated
    # link's), and the link's rate as the copies' events timed it
    row["stream_wait_ms"] = window(first, st, "stream_wait_ms")
    row["link_gbps_observed"] = st["link_gbps_observed"]
    # the host's mean time to issue one copy (in policy above; the profile's load_host_ms as paid here)
    row["copy_issue_ms"] = st["copy_issue_ms"]
    # decode experts calls replayed as graphs (None: the row ran them uncaptured)
    row["graph_replays"] = st["graph_replays"]
    row["device_ops"] = st["device_ops"]
    # the pinned host bytes the copies come from, and the layers whose copies went through pageable
    # staging buffers instead (over the pinning budget: each copy then waits for a staging slot)
    row["pinned_bytes"] = st["pinned_bytes"]
    row["staged_layers"] = st["staged_layers"]
    if s.cuda:
        row["peak_gpu_mb"] = torch.cuda.max_memory_allocated(s.device) / 2**20
    return row


def host_rows(s: Setup, report: Report, tag: str) -> None:
    """The host tier at quantized precision ``tag``, rows like the model dtype's: on-demand LRU and LLaPor
    prefetch. The experts are quantized once at attach into packed host blocks; a load copies the packed
    block and the device dequantizes it into the slot (runtime/tiers/precision.py, SlotDequantizer), so
    the link moves the quantized bytes and the slots compute at the model's dtype."""
    from moecast.runtime.tiers.precision import Precision

    kw = {"precision_tag": tag, **Precision.of_tag(tag).settings()}
    g = report.guard
    g(
        s,
        f"on-demand LRU ({tag})",
        lambda: live_row(s, "lru", "lru", "none", prefetch="none", balance="load", **kw),
    )
    if s.predictor is not None:
        g(s, f"LLaPor prefetch ({tag})",
          lambda: live_row(s, "lru", "prefetch", s.replay_predictor, predictor=s.predictor, balance="load", **kw))  # fmt: skip
    else:
        report.skip(s, f"LLaPor prefetch ({tag})", "no predictor for this model (see notes)")


def disk_rows(s: Setup, report: Report, tag: str) -> None:
    """The experts in a disk tier at precision ``tag`` (written once into ``s.offload_dir``, the quantized
    copy made from it): on-demand LRU, LLaPor prefetch-late (one prefetch more than the window holds,
    as a read outlasts a layer), and every expert resident at that precision (its compute floor)."""
    from moecast.runtime.tiers.precision import Precision

    kw = {"offload": "disk", "offload_dir": str(s.offload_dir), "precision_tag": tag,
          **Precision.of_tag(tag).settings()}  # fmt: skip
    g = report.guard
    g(
        s,
        f"disk LRU ({tag})",
        lambda: live_row(s, "lru", "lru", "none", prefetch="none", balance="load", **kw),
    )
    if s.predictor is not None:
        g(s, f"disk LLaPor prefetch-late ({tag})",
          lambda: live_row(s, "prefetch-late", "prefetch-late", s.replay_predictor, predictor=s.predictor, **kw))  # fmt: skip
    else:
        report.skip(s, f"disk LLaPor prefetch-late ({tag})", "no predictor for this model (see notes)")
    g(s, f"all resident ({tag})",
      lambda: live_row(s, "lru", "static", "none", capacity=None, prefetch="none", **kw))  # fmt: skip


def precision_tags(args: argparse.Namespace) -> tuple[str, ...]:
    """``--precisions`` as tags (int4 with ``--group-size``); empty: no disk rows."""
    from moecast.runtime.tiers.precision import Precision

    names = [p.strip() for p in args.precisions.split(",") if p.strip()]
    return tuple(Precision(n, args.group_size).tag for n in names)


def row_accelerate(s: Setup) -> dict:
    """Experts offloaded with accelerate at the same GPU budget (CUDA only; leaves the model dispatched)."""
    from accelerate import dispatch_model

    dm, keep = ds_model.accelerate_map(s.model, CAPACITY, main=s.device.index or 0, offload="cpu")
    _experts_to(s, "cpu")
    layers = _structure(s.model).layers
    for e in layers[:keep]:
        e.experts.to(s.device)
    torch.cuda.reset_peak_memory_stats(s.device)
    dispatch_model(s.model, device_map=dm, main_device=s.device.index or 0)
    # every offloaded layer moves all its experts at every step: one request of ACCELERATE_STEPS
    # decode steps measures it well enough and keeps the row within minutes
    short = replace(s, requests=[r[: s.prompt + ACCELERATE_STEPS] for r in s.requests[:1]])
    ms, times = timed(short)
    return {
        "measured_tpot_ms": ms,
        "note": f"1 request, {len(times)} timed decode steps",
        "resident_layers": f"{keep} of {len(layers)}",
        "peak_gpu_mb": torch.cuda.max_memory_allocated(s.device) / 2**20,
        "modeled_tpot_ms": None,
    }


def run_rows(s: Setup, report: Report) -> None:
    """Every row of one model, each guarded (a failure is recorded with its traceback; the rest go on)."""
    g = report.guard
    g(s, "full residency", lambda: row_full(s))
    g(s, "exactness (alpha 0)", lambda: exactness(s), kind="exactness")
    if s.cuda:  # the live rows serve experts from host memory: the GPU keeps only the slots
        _experts_to(s, "cpu")
    # the runtime's host work alone: attached, every expert in a slot (no transfer, no miss)
    g(
        s,
        "runtime, all resident",
        lambda: live_row(s, "lru", "static", "none", capacity=None, prefetch="none"),
    )
    # the same without the decode calls' graphs (runtime/live/graphs.py): what replaying them saves
    g(
        s,
        "all resident, no graphs",
        lambda: live_row(s, "lru", "static", "none", capacity=None, prefetch="none", graphs=False),
    )
    g(s, "on-demand LRU", lambda: live_row(s, "lru", "lru", "none", prefetch="none", balance="load"))
    if s.predictor is not None:
        g(
            s,
            "LLaPor prefetch",
            lambda: live_row(s, "lru", "prefetch", s.replay_predictor, predictor=s.predictor, balance="load"),
        )
    else:
        report.skip(s, "LLaPor prefetch", "no predictor for this model (see notes)")
    pre_kw = {"predictor": s.predictor} if s.predictor is not None else {"prefetch": "none"}
    # modeled as the live row runs it: every slot empty at the start (the preset preloads a hot table,
    # which the replay would count on these very requests)
    presched = replace(get_policy("presched"), preload="none")
    g(
        s,
        "PreSched + CPU experts",
        lambda: live_row(s, "lru", presched, s.replay_predictor or "none", balance="presched", **pre_kw),
    )
    if s.substitutes:
        # modeled without prefetch: replay has no gate-reuse predictor (the live row's online prefetch)
        g(
            s,
            f"SMoE (alpha {DEFAULT_ALPHA})",
            lambda: live_row(s, "smoe", "smoe", "none", alpha=DEFAULT_ALPHA),
        )
    else:
        report.skip(s, "SMoE", "tiny only: the recorded DeepSeek routing has no router probabilities")
    for tier, rows_at in (("host", host_rows), ("disk", disk_rows)):
        for tag in s.precisions:
            if tier == "host" and tag == "model":
                continue  # the rows above are the host tier at the model's dtype
            if tier in s.tiers:
                rows_at(s, report, tag)
            else:
                report.skip(s, f"{tier} tier ({tag})", f"not in --tiers {','.join(s.tiers)}")
    if s.cuda:
        g(s, "accelerate offload (device_map)", lambda: row_accelerate(s))
    else:
        report.skip(s, "accelerate offload (device_map)", "CUDA only (dry run)")


# ----------------------------------------------------------------------------- report


@dataclass
class Report:
    device: str
    rows: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)
    on_row: Callable[[], None] | None = None  # called after each row is recorded (the run saves its files)
    only: tuple[str, ...] = ()  # --rows: a measured row runs when its name contains one of these

    def guard(self, s: Setup | None, name: str, fn: Callable[[], dict], kind: str = "tpot") -> dict | None:
        model = s.name if s else "-"
        if s is not None and kind in ("tpot", "exactness") and not self.wanted(name):
            self.skip(s, name, "not in --rows")
            return None
        if s is not None:
            s.row_name = name
        log(f"[{model}] {name} ...")
        t0 = time.perf_counter()
        try:
            row = fn()
            status = "ok"
        except Exception:  # the GPU time is scarce: record it and go on
            tb = traceback.format_exc()
            self.failures.append(f"### {model}: {name}\n\n```\n{tb}```\n")
            print(tb, file=sys.stderr, flush=True)
            row, status = {}, "FAILED"
        row = {"model": model, "config": name, "kind": kind, "status": status, "capacity": CAPACITY, **row}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row.update(_released())
        self.rows.append(row)
        log(f"[{model}] {name}: {status} in {row['seconds']} s {_brief(row)}")
        self._saved()
        return row if status == "ok" else None

    def skip(self, s: Setup, name: str, why: str) -> None:
        self.rows.append({"model": s.name, "config": name, "kind": "tpot", "status": "skipped", "note": why})
        log(f"[{s.name}] {name}: skipped ({why})")
        self._saved()

    def wanted(self, name: str) -> bool:
        return not self.only or any(o.lower() in name.lower() for o in self.only)

    def _saved(self) -> None:
        if self.on_row is not None:
            self.on_row()


def _released() -> dict:
    """A row's leftovers returned before the next row: anything of its runtime or model copies left in a
    reference cycle would hold host memory (GBs a row in a dry run of the DeepSeek shape) and, on CUDA,
    device and pinned memory until a collection, which costs a third of a second here. The host memory
    after it, so a run that runs out of memory shows which row grew it."""
    from moecast.runtime.tiers.offload import available_bytes, peak_rss_mb

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    avail = available_bytes()
    return {"peak_rss_gb": round(peak_rss_mb() / 1024, 1),
            "host_available_gb": None if avail is None else round(avail / 2**30, 1)}  # fmt: skip


def _brief(row: dict) -> str:
    keys = ("measured_tpot_ms", "modeled_tpot_ms", "hit_rate", "equal", "max_abs_diff", "prefill_equal",
            "prefill_max_abs_diff", "staged_layers", "peak_rss_gb", "host_available_gb")  # fmt: skip
    return " ".join(f"{k}={_fmt(row[k])}" for k in keys if k in row)


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


def markdown(report: Report, args: argparse.Namespace, setups: list[Setup], machine: str, wall: float) -> str:
    lines = [
        f"# bench_gpu on {report.device}",
        "",
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- machine: {machine}",
        f"- wall time: {wall:.0f} s; capacity {int(CAPACITY * 100)} % of each layer's routed experts resident",
        "",
    ]
    for s in setups:
        lines += [f"## {s.name}", ""] + [f"- {n}" for n in s.notes] + [""]
        lines += _profile_lines(_model_row(report, s, "profile"))
        cal = _model_row(report, s, "calibration")
        if cal is not None and cal.get("status") == "ok":
            lines += [_calibration_line(cal), ""]
        lines += _exactness_lines(_model_row(report, s, "exactness"), s)
        lines += _tpot_lines(report, s)
        lines += _split_lines(report, s)
    if report.failures:
        lines += ["## Failures", "", *report.failures]
    return "\n".join(lines) + "\n"


def _calibration_line(cal: dict) -> str:
    """What the all-resident calibration found: a token's time beyond its experts' kernels, probed and
    with the runtime attached, each as its layers' share and what follows the last layer (the probe
    spreads the LM head over the layers, the calibration puts it after them: only the totals compare)."""
    n = cal["layers"]
    probed = n * cal["attn_ms_probe"] + cal["step_ms_probe"]
    attached = n * cal["attn_ms"] + cal["step_ms"]
    return (f"Calibrated on an all-resident run of {cal['calibrated_on_steps']} decode steps: a token's time "
            f"beyond its experts' kernels {_fmt(probed)} ms probed ({n} x {_fmt(cal['attn_ms_probe'])} a layer "
            f"+ {_fmt(cal['step_ms_probe'])} after the last), {_fmt(attached)} ms with the runtime's host work "
            f"({n} x {_fmt(cal['attn_ms'])} + {_fmt(cal['step_ms'])}). The rows below are modeled on it.")  # fmt: skip


def _model_row(report: Report, s: Setup, kind: str) -> dict | None:
    """The first row of ``kind`` for model ``s``, or None."""
    return next((r for r in report.rows if r["model"] == s.name and r["kind"] == kind), None)


def _profile_lines(prof: dict | None) -> list[str]:
    """The markdown table of a model's profile row, when it ran."""
    if not (prof and prof["status"] == "ok"):
        return []
    return [
        "| profile | value |",
        "|---|---|",
        *(f"| {k} | {_fmt(prof[k], 4)} |" for k in ("h2d_gbps", "kernel_ms_per_expert", "cpu_beta_ms",
                                                  "cpu_c_ms", "dense_ms_per_layer", "predictor_ms_per_layer",
                                                  "expert_bytes", "load_host_ms")),
        f"| source | {prof['source']} |",
        "",
    ]  # fmt: skip


def _exactness_lines(ex: dict | None, s: Setup) -> list[str]:
    """The markdown paragraph of a model's exactness row, when it ran."""
    if not (ex and ex["status"] == "ok"):
        return []
    return [
        f"Exactness at alpha 0 (live runtime, LRU at 25 %, against the unmodified model): one token per "
        f"forward, logits equal: **{_fmt(ex['equal'])}** (max |diff| {_fmt(ex['max_abs_diff'])}, "
        f"{ex['positions']} positions); after a {s.prefill}-token prefill (experts in waves through the "
        f"slots): equal **{_fmt(ex['prefill_equal'])}** (max |diff| {_fmt(ex['prefill_max_abs_diff'])}); "
        f"max |logit| {_fmt(ex['max_abs_logit'])}",
        "",
    ]


def _tpot_lines(report: Report, s: Setup) -> list[str]:
    """The markdown table of a model's TPOT rows, measured beside modeled."""
    lines = [
        "| config | status | measured TPOT ms | spread | modeled TPOT ms | hit rate | modeled hit | loads | CPU experts | peak GPU MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        if r["model"] != s.name or r["kind"] != "tpot":
            continue
        note = "; ".join(n for n in (r.get("note"), _staged_note(r)) if n)
        cells = [r["config"], r["status"] + (f": {note}" if note else "")]
        cells += [_fmt(r.get(k)) for k in ("measured_tpot_ms", "spread", "modeled_tpot_ms", "hit_rate", "modeled_hit_rate",
                                           "loads", "cpu_experts", "peak_gpu_mb")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"measured TPOT: the median of {s.repeats} runs of each row (one after another); spread: their "
              "(max - min) / median, the row's noise floor", ""]  # fmt: skip
    if not s.cuda:
        lines += ["Dry run: the measured column is this CPU walking the CUDA path (experts computed on its "
                  "cores, its memcpy making the copies); the modeled column is the profile's accelerator "
                  "(its link and kernel times, the CPU's attention): the two are not comparable here.", ""]  # fmt: skip
    return lines


def _staged_note(r: dict) -> str | None:
    """A row whose copies fell back to pageable staging buffers says so (issue 43: a fallback that would
    serialise the copies silently)."""
    n = r.get("staged_layers") or 0
    return f"{n} layers' copies staged (over the pinning budget)" if n else None


def _split_lines(report: Report, s: Setup) -> list[str]:
    """The markdown table of a model's decode step split, for the rows the live runtime timed."""
    split = [r for r in report.rows if r["model"] == s.name and r.get("status") == "ok" and "policy_ms" in r]
    if not split:
        return []
    return [
        "Decode step split by the live runtime (ms per step, host wall clock, over the steps the TPOT covers): "
        + ", ".join(BREAKDOWN)
        + "; their sum, the runtime's own clock of those steps (attention is what the experts calls leave of "
        "it, policy what the timed parts leave of the calls), beside the harness's TPOT of the same run and "
        "steps (its own clock, around the model's forward: at least the sum); the host's mean time to issue "
        "one copy (of policy; the profile's load_host_ms as this row paid it)",
        "",
        "| config | " + " | ".join(BREAKDOWN) + " | sum | harness TPOT | issue ms a copy |",
        "|---|" + "---|" * (len(BREAKDOWN) + 3),
        *(_split_row(r) for r in split),
        "",
    ]


def _split_row(r: dict) -> str:
    cells = [
        r["config"],
        *(_fmt(r[f"{p}_ms"]) for p in BREAKDOWN),
        _fmt(r["split_sum_ms"]),
        _fmt(r["measured_tpot_ms"]),
        _fmt(r["copy_issue_ms"], 4),
    ]
    return "| " + " | ".join(cells) + " |"


def machine_line(device: torch.device) -> str:
    parts = [platform.node(), platform.processor() or platform.machine(), f"{os.cpu_count()} CPUs",
             f"torch {torch.__version__}", f"{torch.get_num_threads()} threads"]  # fmt: skip
    import transformers

    parts.append(f"transformers {transformers.__version__}")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        parts.append(f"{p.name} ({p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}")
    return ", ".join(p for p in parts if p)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


# ----------------------------------------------------------------------------- entry points


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS), help="folder for gpu-<device>.md/.json and the profiles")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda (cuda:N), or cpu: the dry run on the simulated device (default: cuda where there is one)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer requests and tokens, 2 DeepSeek-shaped layers"
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="MoE layers of the DeepSeek-shaped model (default 4)"
    )
    ap.add_argument("--requests", type=int, default=None, help="requests per model (default 3)")
    # one token of prompt in the timed rows: the replay takes a prompt token by token where the live
    # runtime prefills it in one forward, so a longer prompt would start the two from different caches
    ap.add_argument("--prompt", type=int, default=1, help="prompt tokens of each timed request (default 1)")
    ap.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prompt tokens of the exactness check's prefill (default 32)",
    )
    ap.add_argument("--tokens", type=int, default=None, help="decode steps per request (default 48)")
    ap.add_argument("--predictor", default=None, help="LLaPor checkpoint for tiny (default: train one here)")
    ap.add_argument("--ds-predictor", default=None, help="LLaPor checkpoint of the DeepSeek traces")
    ap.add_argument(
        "--traces", default=None, help="DeepSeek traces: CSV folder or a ds_model.py --extract .npz"
    )
    ap.add_argument("--tiny-preset", default="auto", help="tiny preset (auto: default when built, else test)")
    ap.add_argument(
        "--ds-shape", default="lite", choices=["lite", "test"], help="test: small sizes (the test suite)"
    )
    ap.add_argument("--models", default="tiny,deepseek", help=f"which models to run ({', '.join(MODELS)})")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each timed row: median and spread")
    ap.add_argument(
        "--precisions",
        default="model,int8,int4",
        help="expert precisions, each with its rows: the disk tier's at each, the host tier's at each quantized "
        "one (on-demand LRU, LLaPor prefetch; comma-separated; empty: none)",
    )
    ap.add_argument("--group-size", type=int, default=128, help="int4's group size")
    ap.add_argument(
        "--host-profile",
        default="",
        help="live rows (names containing one of these, comma-separated) run once more, one request, under "
        "cProfile and torch.profiler: where the host's time goes, written to DIR/profile-<device>-<row>.txt",
    )
    ap.add_argument(
        "--rows",
        default="",
        help="run only the measured rows whose name contains one of these (comma-separated, any case; the "
        "profile and calibration always run): e.g. 'full residency,all resident,on-demand LRU,LLaPor prefetch'",
    )
    ap.add_argument(
        "--tiers",
        default="host,disk",
        help="which tiers get the precision rows (comma-separated: host, disk; the disk tier writes every "
        "expert at each precision to a temporary offload directory, 29 GB in bf16 at 26 layers)",
    )
    ap.add_argument("--train-requests", type=int, default=None)
    ap.add_argument("--train-epochs", type=int, default=None)
    args = ap.parse_args(argv)
    q = args.quick
    defaults = dict(layers=2 if q else 4, requests=2 if q else 3, prefill=16 if q else 32, tokens=12 if q else 48,
                    train_requests=16 if q else 48, train_epochs=2 if q else 8)  # fmt: skip
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    if bad := sorted(set(tiers) - {"host", "disk"}):
        ap.error(f"--tiers: unknown tier {', '.join(bad)}; name host, disk or both")
    args.tiers = tiers
    if why := _bad_args(args):
        ap.error(why)
    return args


def _bad_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line (None: nothing), before anything is built."""
    from moecast.errors import InputError

    if args.device.split(":")[0] not in ("cuda", "cpu"):
        return f"--device {args.device}: name cuda (cuda:N) or cpu"
    if bad := [m for m in (m.strip() for m in args.models.split(",")) if m and m not in MODELS]:
        return f"--models: unknown model {', '.join(bad)}; choose from {', '.join(MODELS)}"
    for name in ("layers", "requests", "tokens", "repeats", "prefill"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.requests * args.tokens <= WARMUP:
        return (f"--requests {args.requests} x --tokens {args.tokens} decode steps leave none past the "
                f"{WARMUP} warm-up steps each TPOT leaves out; give more tokens")  # fmt: skip
    try:
        precision_tags(args)
    except InputError as exc:
        return f"--precisions: {exc}"
    return None


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the bench (arguments as on the command line) and return its rows; writes the .md and .json."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run with --device cpu for the dry run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "cpu"
    # replay traces and a tiny LLaPor trained here: fresh each run, removed at the end
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as tmp:
        return _run(args, device, out, tag, Path(tmp))


def _run(args: argparse.Namespace, device: torch.device, out: Path, tag: str, work: Path) -> list[dict]:
    report = Report(str(device), only=tuple(r.strip() for r in args.rows.split(",") if r.strip()))
    t0 = time.perf_counter()
    setups: list[Setup] = []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        _write(
            out / f"gpu-{tag}.md",
            markdown(report, args, setups, machine_line(device), time.perf_counter() - t0),
        )
        _write(out / f"gpu-{tag}.json", json.dumps(report.rows, indent=1, default=str) + "\n")

    report.on_row = save
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        holder: dict[str, Setup] = {}

        def build(n: str = name, h: dict = holder) -> dict:
            h["s"] = BUILDERS[n](args, device)
            return {}

        if report.guard(None, f"build {name}", build, kind="setup") is None:
            continue
        s = holder["s"]
        s.repeats = max(1, args.repeats)
        s.offload_dir, s.precisions, s.tiers = work / f"offload-{name}", precision_tags(args), args.tiers
        s.profile_rows = tuple(r.strip() for r in args.host_profile.split(",") if r.strip())
        s.profile_to, s.device_tag = out, tag
        setups.append(s)
        if name == "tiny":
            report.guard(s, "LLaPor for tiny", lambda s=s: tiny_predictor(s, args, work) or {}, kind="setup")
        else:
            report.guard(s, "DeepSeek LLaPor", lambda s=s: ds_predictor(s, args) or {}, kind="setup")
        # without a profile the live rows model time on the PreScope A100 profile, and without the
        # recorded routing they have no replay figure: both are said in the rows, the rest still runs
        report.guard(s, "profile", lambda s=s: profile_model(s, out, tag), kind="profile")
        report.guard(s, "record routing for replay", lambda s=s: record_traces(s, work) or {}, kind="setup")
        report.guard(s, "calibrate (all resident)", lambda s=s: calibrate_profile(s, out), kind="calibration")
        run_rows(s, report)
        del s.model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    log(f"wrote {out / f'gpu-{tag}.md'} ({time.perf_counter() - t0:.0f} s)")
    return report.rows


MOECAST_ROWS = ("on-demand LRU", "LLaPor prefetch", "PreSched + CPU experts", f"SMoE (alpha {DEFAULT_ALPHA})")


def figures(raw: list[dict]) -> list[dict]:
    """The rows as bench/figures.py figures, with the GPU bench's goals: at 25 % the best moecast row
    <= 1/3 of accelerate offload's TPOT and <= 2/3 of on-demand LRU's, modeled within 20 % of measured."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import figures as F

    out = []
    for model in dict.fromkeys(r["model"] for r in raw if r["model"] != "-"):
        by = {r["config"]: r for r in raw if r["model"] == model}
        ex = by.get("exactness (alpha 0)", {})
        if ex.get("status") == "ok":
            for tag, what in (("", "one token a forward"), ("prefill_", "after the prefill")):
                eq = ex[f"{tag}equal"]
                v = "equal" if eq else f"max |diff| {ex[f'{tag}max_abs_diff']:.3g}"
                out.append(F.row("gpu", f"{model}: alpha-0 logits vs the model's, {what}", v, "equal",
                                 "ok" if eq else "MISS"))  # fmt: skip
        ok = {c: r for c, r in by.items() if r.get("status") == "ok" and r.get("kind") == "tpot"}
        out += _tpot_figures(F, model, ok)
        out += _ratio_figures(F, model, ok)
        out += [
            F.failed("gpu", f"{model}: {c} failed (traceback in the results file)")
            for c, r in by.items()
            if r.get("status") == "FAILED"
        ]
    return out


def _tpot_figures(F: Any, model: str, ok: dict[str, dict]) -> list[dict]:
    """Each TPOT row's measured figure and, where modeled, its |modeled / measured - 1|."""
    out = []
    for c, r in ok.items():
        note = f"modeled {_fmt(r.get('modeled_tpot_ms'))} ms, hit {_fmt(r.get('hit_rate'))}"
        basis = r.get("tpot_basis", "") if r.get("modeled_tpot_ms") else ""
        out.append(
            F.fig(
                "gpu",
                f"{model}: {c} TPOT ms",
                r["measured_tpot_ms"],
                "{:.2f}",
                note=note,
                tpot_basis=basis,
            )
        )
        if r.get("modeled_tpot_ms"):
            err = abs(r["modeled_tpot_ms"] / r["measured_tpot_ms"] - 1)
            name = f"{model}: {c} |modeled / measured - 1|"
            out.append(F.fig("gpu", name, err, "{:.2f}", "<= 0.2", tpot_basis=basis))
    return out


def _ratio_figures(F: Any, model: str, ok: dict[str, dict]) -> list[dict]:
    """The best moecast row's TPOT over accelerate offload's and over on-demand LRU's, against the goals."""
    out = []
    best = min(
        (ok[c] for c in MOECAST_ROWS[1:] if c in ok), key=lambda r: r["measured_tpot_ms"], default=None
    )
    for base, goal in (("accelerate offload (device_map)", "<= 0.333"), ("on-demand LRU", "<= 0.667"),
                       ("full residency", "<= 1.25")):  # fmt: skip
        if best is not None and base in ok:
            ratio = best["measured_tpot_ms"] / ok[base]["measured_tpot_ms"]
            out.append(
                F.fig(
                    "gpu",
                    f"{model}: best moecast TPOT / {base}",
                    ratio,
                    "{:.2f}",
                    goal,
                    note=best["config"],
                )
            )
    if "runtime, all resident" in ok and "full residency" in ok:
        ratio = ok["runtime, all resident"]["measured_tpot_ms"] / ok["full residency"]["measured_tpot_ms"]
        name = f"{model}: runtime attached, all resident / full residency"
        out.append(F.fig("gpu", name, ratio, "{:.2f}", "<= 1.1", note="the runtime's host work alone"))
    return out


def rows(quick: bool, tiny_checkpoint: Path | None = None, ds_checkpoint: Path | None = None) -> list[dict]:
    """bench/run_all.py's entry: the CUDA bench into bench/results when a GPU is here, else one skipped row
    (its CPU dry run is tests/test_bench_gpu.py)."""
    if not torch.cuda.is_available():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench import figures as F

        return [
            F.skipped(
                "gpu",
                "no CUDA here: run python bench/bench_gpu.py on a GPU (dry run: tests/test_bench_gpu.py)",
            )
        ]
    argv = ["--quick"] if quick else []
    for flag, path in (("--predictor", tiny_checkpoint), ("--ds-predictor", ds_checkpoint)):
        if path is not None and Path(path).is_file():
            argv += [flag, str(path)]
    return figures(run(argv))


def main(argv: list[str] | None = None) -> int:
    return exit_status(run(argv), "bench_gpu")


if __name__ == "__main__":
    sys.exit(main())
