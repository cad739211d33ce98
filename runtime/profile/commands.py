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
        predictor: a layer-ahead checkpoint whose per-layer latency is measured (with --model, default:
            a LLaPor of the default size with random weights).
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
        expert_dtype: with --model, time the experts at this precision (model, int8, int4) on the kernels
            the live runtime computes a quantized tier with, and calibrate at it: the profile to model a
            ``--expert-dtype`` run with (name it apart, e.g. --name local-int4).
        group_size: int4's group along each matrix's input dimension (32, 64, 128 or 256).
        json: print the profile as JSON.
    """
    from moecast.runtime.profile import measure as P

    pred = None
    if predictor:
        from moecast.predictors.registry import load

        pred = load(predictor)
    from moecast.runtime.tiers.precision import Precision

    prec = Precision(expert_dtype, group_size)
    if model:
        prof = _profile_model(model, name, pred, offload_dir, disk_mb, calibrate, prec)
    else:
        if prec.quantized:
            raise InputError(
                "--expert-dtype times the model's own experts call: give --model (tiny or a directory)"
            )
        if calibrate:
            raise InputError(
                "--calibrate runs the live runtime on a model: give --model (tiny or a directory)"
            )
        if traces:
            hidden_size, intermediate_size, dtype = _traces_expert_shape(traces)
        prof = P.measure(hidden_size, intermediate_size, name=name, dtype=dtype)
        if pred is not None:
            prof.predictor_ms = P._sig(P.predictor_latency_ms(pred, hidden_size))
            prof.source += f"; predictor_ms: {predictor}"
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
        print(P.table(prof))
        print(f"  source: {prof.source}")
        print(f"wrote {path}")


def _profile_model(
    model: str, name: str, pred: Any, offload_dir: str | None, disk_mb: int, calibrate: int, prec: Any
) -> HardwareProfile:
    """`moecast profile --model`'s profile: measured on the model (its experts at ``prec``), then
    calibrated on ``calibrate`` tokens of the live runtime reading its experts from ``offload_dir``
    at ``prec`` (0: not calibrated)."""
    from moecast.collect.models import load_model
    from moecast.runtime.profile import measure as P

    lm, _tok, _name = load_model(model)
    prof, _how = P.profile_model(lm, name, pred, offload_dir, disk_mb, precision=prec)
    if not calibrate:
        return prof
    if not offload_dir:
        raise InputError("--calibrate measures the disk tier: give --offload_dir DIR")
    return dataclasses.replace(P.calibrate_live(lm, prof, offload_dir, calibrate, precision=prec), name=name)


def _traces_expert_shape(traces: str) -> tuple[int, int, str]:
    """(hidden size, intermediate size, dtype) of the experts of the model a TraceSet recorded."""
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.replay.engine import expert_shape

    return expert_shape(TraceSet(traces))
