"""``moecast profile``: measure this machine into a hardware profile (PreScope Sec. 4.3.2 variables).

- CPU: a real SwiGLU expert MLP of the model's shape (gate, up, down projections in float32 on the
  CPU) timed for several token counts; a least-squares line gives PreScope Eq. 3's ``beta`` (per
  token) and ``C`` (start-up).
- CUDA, when present: pinned host-to-device bandwidth for one expert's bytes, device time of the
  same expert at batch 1 (``t_g``) and a stand-in for attention time (two hidden x hidden matmuls).
  Without CUDA the device fields are taken from the PreScope A100 profile and the source says so.
"""

from __future__ import annotations

import time

import numpy as np
from moecast.runtime.cost_model import HardwareProfile, load_profile


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
