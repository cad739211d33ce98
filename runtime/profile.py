"""``moecast profile``: measure this machine into a hardware profile (PreScope Sec. 4.3.2 variables).

- CPU: a real SwiGLU expert MLP of the model's shape and dtype (gate, up, down projections on the
  CPU) timed for several token counts; a least-squares line gives PreScope Eq. 3's ``beta`` (per
  token) and ``C`` (start-up).
- CUDA, when present: pinned host-to-device bandwidth for one expert's bytes, device time of the
  same expert at batch 1 (``t_g``) and a stand-in for attention time (two hidden x hidden matmuls).
  Without CUDA the device fields are taken from the PreScope A100 profile and the source says so.
- With the model at hand (:func:`profile_model`): its non-expert time per MoE layer (a decode step
  with the routed experts skipped), the layer-ahead predictor's latency per layer (the given
  checkpoint, else a LLaPor of the default size with random weights: the same computation), and
  the direct-read bandwidth of an offload directory (O_DIRECT reads of a temporary file; buffered
  reads after ``posix_fadvise(DONTNEED)`` where the filesystem refuses O_DIRECT, and said so).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from moecast.predictors.base import LayerAhead
from moecast.runtime.cost_model import HardwareProfile, load_profile

from moecast.errors import InputError


def _time(fn, repeat: int, min_sample_s: float = 2e-3) -> float:
    """ms of one call: the median over ``repeat`` samples, each sample as many calls as fill
    ``min_sample_s`` (a small expert runs in microseconds, where one timed call is mostly clock
    noise and a busy machine's interruptions would decide the fit)."""
    fn()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-7)
    n = max(1, min(10_000, int(min_sample_s / one)))
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n)
    return float(np.median(samples)) * 1e3


def _sig(x: float, digits: int = 4) -> float:
    """Round to significant digits (fixed decimals would turn a microsecond-scale beta into 0)."""
    return float(f"{x:.{digits}g}")


def measure(
    hidden: int,
    intermediate: int,
    name: str = "local",
    token_counts=(1, 2, 4, 8, 16),
    repeat: int = 5,
    dtype: str = "float32",
) -> HardwareProfile:
    """The profile for an expert of ``hidden`` x ``intermediate``; the CPU expert runs in ``dtype``
    (the model's: bf16 matmuls take another code path than float32 ones on the CPU)."""
    import torch

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    dt = getattr(torch, dtype)
    wg = (torch.randn(intermediate, hidden) * 0.02).to(dt)
    wu = (torch.randn(intermediate, hidden) * 0.02).to(dt)
    wd = (torch.randn(hidden, intermediate) * 0.02).to(dt)
    expert_bytes = 3 * hidden * intermediate * 2  # bf16, the dtype a runtime moves

    def expert(x):
        return torch.nn.functional.linear(
            torch.nn.functional.silu(torch.nn.functional.linear(x, wg)) * torch.nn.functional.linear(x, wu),
            wd,
        )

    ms = []
    with torch.inference_mode():
        for m in token_counts:
            x = torch.randn(m, hidden, dtype=dt)
            ms.append(_time(lambda x=x: expert(x), repeat))
    beta, c = np.polyfit(np.asarray(token_counts, dtype=float), np.asarray(ms), 1)
    # a positive slope even where the timings are flat (tiny experts): Eq. 3's beta is per token
    beta, c = max(float(beta), 1e-6), max(float(c), 0.0)
    source = f"measured by moecast profile on this machine (CPU, {threads} threads; {dtype} expert {hidden}x{intermediate})"
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        host = torch.empty(expert_bytes // 2, dtype=torch.bfloat16).pin_memory()
        buf = torch.empty_like(host, device=dev)

        def copy():
            buf.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        t_copy = _time(copy, repeat)
        gbps = expert_bytes / (t_copy / 1e3) / 1e9
        g = [w.to(dev, torch.bfloat16) for w in (wg, wu, wd)]
        x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)

        def gpu_expert():
            y = torch.nn.functional.silu(x @ g[0].T) * (x @ g[1].T)
            (y @ g[2].T).sum().item()

        wa = torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16)

        def attn():
            (x @ wa @ wa).sum().item()

        t_g, t_attn = _time(gpu_expert, repeat), _time(attn, repeat)
        source += f"; CUDA {torch.cuda.get_device_name(0)}: pinned H2D copy, bf16 expert and 2-matmul attention stand-in"
    else:
        ref = load_profile("prescope-a100-pcie4")
        scale = expert_bytes / ref.ref_expert_bytes
        gbps, t_g, t_attn = ref.transfer_gbps, ref.gpu_expert_ms * scale, ref.attn_ms
        source += "; no CUDA here: link and device times taken from prescope-a100-pcie4"
    return HardwareProfile(
        name=name,
        transfer_gbps=_sig(gbps),
        ref_expert_bytes=expert_bytes,
        gpu_expert_ms=_sig(t_g),
        cpu_beta_ms=_sig(beta),
        cpu_c_ms=_sig(c),
        attn_ms=_sig(t_attn),
        source=source,
    )


def _skip_experts(module, hidden_states, top_k_index, top_k_weights, **kwargs):
    """An experts implementation that computes nothing: what is left of a forward is the dense part."""
    return hidden_states.new_zeros(hidden_states.shape)


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def dense_layer_ms(model, steps: int = 8, prompt: int = 8, repeat: int = 3) -> float:
    """Non-expert time (ms) per MoE layer of ``model`` on its device: the median decode step with every
    routed expert skipped (attention, router, shared experts, norms, and the embedding and output
    head shared out over the layers), divided by the MoE layer count."""
    import torch
    from moecast.collect.models import find_moe_structure
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    layers = len(find_moe_structure(model).layers)
    device = next(model.parameters()).device
    ALL_EXPERTS_FUNCTIONS["moecast_skip"] = _skip_experts
    previous = model.get_experts_implementation()
    model.set_experts_implementation("moecast_skip")
    vocab = int(model.config.vocab_size)
    ids = torch.arange(prompt + steps + 1, device=device)[None] % vocab
    samples = []
    try:
        with torch.inference_mode():
            for _ in range(repeat):
                out = model(input_ids=ids[:, :prompt], use_cache=True)
                cache = out.past_key_values
                _sync(device)
                t0 = time.perf_counter()
                for t in range(prompt, prompt + steps):
                    out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                _sync(device)
                samples.append((time.perf_counter() - t0) / steps)
    finally:
        model.set_experts_implementation(previous)
    return float(np.median(samples)) * 1e3 / layers


# ----------------------------------------------------------------------------- offload disk

_ALIGN = 4096  # O_DIRECT needs buffers, offsets and sizes aligned to the logical block size


def disk_read_gbps(directory: str | Path, size_mb: int = 256, chunk_mb: int = 4) -> tuple[float, str]:
    """(GB/s, how) of reading a ``size_mb`` temporary file in ``directory`` in ``chunk_mb`` reads.

    Direct I/O (the page cache never serves the read, as for a miss of the disk tier); where the
    filesystem refuses O_DIRECT, buffered reads after dropping the file's cached pages, and ``how``
    says so. The file is written with fsync first and removed afterwards."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    chunk = max(_ALIGN, (chunk_mb << 20) // _ALIGN * _ALIGN)
    n = max(1, (size_mb << 20) // chunk)
    path = d / f".moecast-profile-{os.getpid()}.bin"
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    buf.write(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(n):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        how = "O_DIRECT"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            if not hasattr(os, "O_DIRECT"):
                raise OSError("no O_DIRECT on this platform")
            os.preadv(fd, [buf], 0)  # some filesystems accept the flag and refuse the read
        except OSError:
            how = "buffered after posix_fadvise(DONTNEED): the filesystem refuses O_DIRECT"
            fd = os.open(path, os.O_RDONLY)
        try:
            if how != "O_DIRECT" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for i in range(n):
                os.preadv(fd, [buf], i * chunk)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        buf.close()
        path.unlink(missing_ok=True)
    return n * chunk / dt / 1e9, how


# ----------------------------------------------------------------------------- predictor latency


def llapor_standin(num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> Any:
    """A LLaPor of the default size with random weights: the per-layer computation of a trained one
    (ids of earlier layers and tokens, a token embedding, hidden 256), when no checkpoint is given."""
    import torch
    from moecast.predictors.llapor import LLaPor
    from moecast.predictors.llapor_features import FeatureSpec
    from moecast.predictors.llapor_net import LLaPorNet, NetConfig

    torch.manual_seed(seed)
    spec = FeatureSpec(
        num_layers=num_layers, num_experts=num_experts, top_k=top_k, prev_layers=2, history_tokens=2,
        token_buckets=4096, context_tokens=2, deep_history=True,
    )  # fmt: skip
    third = max(1, num_layers // 3)
    layers = list(range(num_layers))
    groups = {
        "input": layers[:third],
        "middle": layers[third:-third] or layers[:1],
        "output": layers[-third:],
    }
    return LLaPor(LLaPorNet(spec, groups, NetConfig()), list(range(1, num_layers + 1)))


def predictor_latency_ms(predictor: LayerAhead, hidden: int = 0, window: int = 16, repeat: int = 5) -> float:
    """Median ms of one layer-ahead call (``score_at``: one layer's features and network on the
    current token) over the predictor's layers, on a window of ``window`` earlier tokens, as the live
    runtime calls it."""
    from moecast.collect.traceset import RequestTrace

    L, E, k = predictor.num_layers, predictor.num_experts, predictor.top_k
    rng = np.random.default_rng(0)
    T = window + 1
    ids = np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)]).astype(np.int16)
    needs = predictor.needs
    trace = RequestTrace(
        request_id="profile", workload="profile", category="", prompt="",
        token_ids=rng.integers(0, 1000, T), token_texts=[""] * T, is_decode=np.ones(T, bool),
        topk_ids=ids, topk_weights=np.full((T, L, k), 1.0 / k, np.float16), router_probs=None,
        gate_inputs=rng.normal(size=(T, L, hidden)).astype(np.float32) if "gate_inputs" in needs else None,
    )  # fmt: skip
    times = [_time(lambda n=n: predictor.score_at(trace, n), repeat) for n in range(1, L)]
    return float(np.median(times))


# ----------------------------------------------------------------------------- the model at hand


def profile_model(
    model: Any,
    name: str = "local",
    predictor: Any = None,
    offload_dir: str | Path | None = None,
    disk_mb: int = 256,
) -> tuple[HardwareProfile, dict[str, str]]:
    """The hardware profile for ``model`` on this machine, and how each figure was obtained."""
    from moecast.collect.models import find_moe_structure, model_info

    if predictor is not None and not isinstance(predictor, LayerAhead):
        raise InputError(
            f"the predictor latency is a layer-ahead predictor's per-layer call; {predictor.name} is "
            f"{predictor.horizon}: give a layer-ahead checkpoint (LLaPor) or none"
        )
    st = find_moe_structure(model)
    info = model_info(model, st, name)
    p = next(st.layers[0].experts.parameters())
    hidden = int(info.hidden_size)
    inter = max(1, info.expert_bytes // (3 * hidden * p.element_size()))
    dtype = str(p.dtype).replace("torch.", "")
    prof = measure(hidden, inter, name=name, dtype=dtype)
    how = {"expert": f"{dtype} {hidden}x{inter}", "cpu": prof.source}
    # times are for the model's own expert (its dtype), which replay scales from
    prof = replace(prof, attn_ms=_sig(dense_layer_ms(model)), ref_expert_bytes=int(info.expert_bytes))
    how["attn_ms"] = "the model's decode step with the routed experts skipped, per MoE layer"
    if predictor is None:
        predictor = llapor_standin(len(st.layers), info.num_experts, info.top_k)
        how["predictor_ms"] = "LLaPor of the default size, random weights (no --predictor)"
    else:
        how["predictor_ms"] = f"{predictor.name} checkpoint"
    prof = replace(prof, predictor_ms=_sig(predictor_latency_ms(predictor, hidden)))
    if offload_dir is not None:
        gbps, method = disk_read_gbps(offload_dir, disk_mb)
        prof = replace(prof, disk_read_gbps=_sig(gbps))
        how["disk_read_gbps"] = f"{method}, {disk_mb} MB in {offload_dir}"
    prof.source += "; " + "; ".join(f"{k}: {v}" for k, v in how.items() if k not in ("cpu", "expert"))
    return prof, how


def table(prof: HardwareProfile) -> str:
    """The profile as a printed table (ms unless said otherwise)."""
    rows = [
        ("host-to-device bandwidth", f"{prof.transfer_gbps:g} GB/s"),
        (
            "disk direct-read bandwidth",
            f"{prof.disk_read_gbps:g} GB/s" if prof.disk_read_gbps else "not measured",
        ),
        ("device time per expert (t_g)", f"{prof.gpu_expert_ms:g} ms"),
        ("CPU expert: beta per token", f"{prof.cpu_beta_ms:g} ms"),
        ("CPU expert: C (start-up)", f"{prof.cpu_c_ms:g} ms"),
        ("attention / dense per layer", f"{prof.attn_ms:g} ms"),
        ("predictor per layer", f"{prof.predictor_ms:g} ms"),
        ("expert bytes", f"{prof.ref_expert_bytes:,}"),
    ]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)
