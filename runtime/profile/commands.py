"""CLI function ``moecast profile`` (mapped in moecast/cli.py): measure this machine into a hardware profile."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moecast.runtime.core.cost_model import HardwareProfile

from moecast.errors import InputError


def profile(
    out: str | None = None,
    model: str | None = None,
    traces: str | None = None,
    predictor: str | None = None,
    offload_dir: str | None = None,
    disk_mb: int = 256,
    hidden_size: int = 2048,
    intermediate_size: int = 1408,
    dtype: str = "bfloat16",
    name: str = "local",
    calibrate: int = 0,
    expert_dtype: str = "model",
    group_size: int = 128,
    json: bool = False,
) -> None:
    """Measure this machine into a hardware profile YAML (CPU expert time; dense and predictor time per layer; disk and CUDA bandwidth).

    Args:
        out: where to write the profile YAML (default $MOECAST_HOME/hardware/<name>.yaml, then usable as --hardware <name>).
        model: the model at hand (``tiny`` or a local directory): its expert shape and dtype, and its
            non-expert time per MoE layer measured on it; without it the expert shape comes from
            --traces or --hidden_size/--intermediate_size and attention time from a stand-in.
        traces: a TraceSet whose model sets the expert shape (its hidden size; intermediate from expert_bytes).
        predictor: a layer-ahead checkpoint whose per-layer latency is measured (default: a LLaPor of the
            default size with random weights, on the routing of --model, else of --traces, else of
            DeepSeek-V2-Lite: 26 layers of 64 experts, top-6).
        offload_dir: the experts live on this directory's disk (the profile's slow tier; without CUDA
            the CPU is the fast tier and the disk the link): its direct-read bandwidth is measured as
            the runtime reads it where it holds an offload (random whole experts on the I/O threads),
            else on a temporary file (removed), which a host may serve from its cache.
        disk_mb: size of that temporary file (MB).
        hidden_size: expert hidden size when neither --model nor --traces.
        intermediate_size: expert intermediate size when neither --model nor --traces.
        dtype: the CPU expert's dtype when neither --model nor --traces (else the model's or the traces').
        name: profile name.
        calibrate: with --model and --offload_dir on a machine without CUDA, decode this many tokens
            with the live runtime (LRU, 25 % of experts resident, experts read from the directory) and
            take the rates it measured: the disk while busy, one expert call, the rest of a layer
            (attention and the runtime's host work), which the probes above do not see; 0: none.
        expert_dtype: with --model and the CPU computing the experts (--offload_dir on a machine without
            CUDA; a device's experts are not timed), the precisions to time a resident expert at, comma-separated
            (model, int8, int4 or int4-gN; e.g. model,int8,int4): each quantized one on the kernels the live
            runtime computes it with, into the profile's expert_ms, so one profile models a run at
            any of them, two copies (mixed) included; with --calibrate, each is calibrated on a
            live run of its own at it (the first run, at the model's dtype, gives the other rates).
        group_size: int4's group along each matrix's input dimension (32, 64, 128 or 256).
        json: print the profile as JSON.
    """
    from moecast.predictors.checkpoint import check_fingerprint
    from moecast.runtime.profile import measure as P

    pred = None
    if predictor:
        from moecast.predictors.registry import load

        pred = load(predictor)
        P.check_latency_predictor(pred)  # before a model loads or a timing starts
    from moecast.runtime.tiers.precision import TwoCopies, expert_setting

    precs = [expert_setting(d.strip(), group_size) for d in str(expert_dtype).split(",") if d.strip()]
    if any(isinstance(q, TwoCopies) for q in precs):
        raise InputError("--expert-dtype times one precision at a time: name each copy, e.g. model,int4")
    nbytes = None
    if model:
        if calibrate and not offload_dir:  # before the model loads and its probes run
            raise InputError("--calibrate measures the disk tier: give --offload_dir DIR")
        prof, nbytes = _profile_model(model, name, pred, offload_dir, disk_mb, calibrate, precs, predictor)
    else:
        if any(q.quantized for q in precs):
            raise InputError(
                "--expert-dtype times the model's own experts call: give --model (tiny or a directory)"
            )
        if calibrate:
            raise InputError(
                "--calibrate runs the live runtime on a model: give --model (tiny or a directory)"
            )
        if traces:
            hidden_size, intermediate_size, dtype = _traces_expert_shape(traces)
            if pred is not None:  # timed on the traces' model: a checkpoint of another is refused
                check_fingerprint(
                    pred.checkpoint_meta, _traces_fingerprint(traces), f"TraceSet {traces}", predictor
                )
        prof = P.measure(hidden_size, intermediate_size, name=name, dtype=dtype)
        if pred is None:  # measured, as with --model: a profile's 0 would charge a prefetch nothing
            routing = _traces_routing(traces) if traces else STANDIN_ROUTING
            pred = P.llapor_standin(*routing)
            said = "LLaPor of the default size, random weights, on {} layers of {} experts, top-{}".format(
                *routing
            )
        else:
            said = str(predictor)
        prof.predictor_ms = P._sig(P.predictor_latency_ms(pred, hidden_size))
        prof.source += f"; predictor_ms: {said}"
        if offload_dir:
            prof, how = P.on_disk(prof, offload_dir, disk_mb)
            prof.source += "".join(f"; {k}: {v}" for k, v in how.items())
    from moecast.collect.traceset import atomic_write_bytes

    from moecast import home

    path = Path(out) if out else home() / "hardware" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, prof.to_yaml().encode())
    if json:
        from dataclasses import asdict

        print(__import__("json").dumps(asdict(prof)))
    else:
        print(P.table(prof, nbytes))
        print(f"  source: {prof.source}")
        print(f"wrote {path}")


def _profile_model(
    model: str,
    name: str,
    pred: Any,
    offload_dir: str | None,
    disk_mb: int,
    calibrate: int,
    precs: list[Any],
    pred_path: str | None = None,
) -> tuple[HardwareProfile, dict[str, int]]:
    """`moecast profile --model`'s profile (and an expert's bytes at each quantized precision): measured on the model (its experts at the model's dtype and
    at each of ``precs``), then calibrated on ``calibrate`` tokens of the live runtime reading its
    experts from ``offload_dir``: at the model's dtype for every rate, then at each quantized
    precision for its expert time (0: not calibrated). ``pred_path``: ``pred``'s file, named where it is
    refused for another model."""
    from moecast.collect.models import load_model
    from moecast.runtime.profile import measure as P

    lm, _tok, _name = load_model(model)
    if pred is not None:  # timed on this model: a checkpoint of another is refused
        from moecast.collect.models import find_moe_structure, model_info
        from moecast.predictors.checkpoint import check_fingerprint

        fp = model_info(lm, find_moe_structure(lm), model).fingerprint
        check_fingerprint(pred.checkpoint_meta, fp, f"model {model}", pred_path or "--predictor")
    prof, _how = P.profile_model(lm, name, pred, offload_dir, disk_mb, precisions=precs)
    nbytes = _expert_bytes(lm, precs)
    if not calibrate:
        return prof, nbytes
    out = P.calibrate_live(lm, prof, offload_dir, calibrate)
    for q in (q for q in precs if q.quantized):
        at = P.calibrate_live(lm, prof, offload_dir, calibrate, precision=q)
        out = dataclasses.replace(out, expert_ms={**out.expert_ms, q.tag: at.expert_ms[q.tag]})
    return dataclasses.replace(out, name=name), nbytes


def _traces_fingerprint(traces: str) -> str:
    from moecast.collect.traceset import TraceSet

    return TraceSet(traces).meta.model.fingerprint


def _expert_bytes(lm: Any, precs: list[Any]) -> dict[str, int]:
    """One expert's stored bytes at each quantized precision of ``precs`` (the link moves these)."""
    from moecast.collect.models import find_moe_structure
    from moecast.runtime.tiers.precision import expert_nbytes

    experts = find_moe_structure(lm).layers[0].experts
    params = {n: p for n, p in experts.named_parameters(recurse=False) if p.dim() >= 2}
    transposed = bool(getattr(experts, "is_transposed", False))
    return {q.tag: expert_nbytes(q, params, transposed) for q in precs if q.quantized}


#: the routing (MoE layers, experts, top-k) the predictor stand-in scores without --model or --traces:
#: DeepSeek-V2-Lite's, whose expert shape the size defaults are
STANDIN_ROUTING = (26, 64, 6)


def _traces_routing(traces: str) -> tuple[int, int, int]:
    """(MoE layers, experts, top-k) of the model a TraceSet recorded."""
    from moecast.collect.traceset import TraceSet

    m = TraceSet(traces).meta.model
    return int(m.num_layers), int(m.num_experts), int(m.top_k)


def _traces_expert_shape(traces: str) -> tuple[int, int, str]:
    """(hidden size, intermediate size, dtype) of the experts of the model a TraceSet recorded."""
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.replay.engine import expert_shape

    return expert_shape(TraceSet(traces))
