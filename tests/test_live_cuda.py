"""The live runtime's CUDA path: device slots, transfer streams, pinned host memory (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_random
from moecast.collect.models import kv_cache, with_cache
from moecast.runtime.live.runtime import attach

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"


def mixtral_random():
    """Another family and shape: Mixtral's fused gate_up experts, 8 experts of width 96, top-2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(1)
    return MixtralForCausalLM(cfg).eval()


MODELS = {"tiny": tiny_random, "mixtral": mixtral_random}
SETTINGS = [
    dict(policy="lru", capacity=0.25, prefetch="online"),
    dict(policy="smoe", capacity=0.25, prefetch="online"),
    dict(policy="lru", capacity=4, balance="cpu", prefetch="none"),
    dict(policy="lru", capacity=4, balance="presched", prefetch="online", hardware="prescope-a100-pcie4"),
    dict(policy="lfu", capacity=0.5, prefetch="none", pinned_mb=0),  # pageable host, staging ring
    dict(policy="smoe", capacity=None),
]


@torch.no_grad()
def decode(model, ids: torch.Tensor, steps: int = 4) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=True)
    logits, past = [out.logits[:, -1]], kv_cache(out)
    vocab = model.config.vocab_size
    for t in range(steps):
        nxt = torch.full((ids.shape[0], 1), (7 * t + 3) % vocab, device=ids.device)
        out = model(input_ids=nxt, **with_cache(model, past), use_cache=True)
        past = kv_cache(out)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.fixture(scope="module", params=list(MODELS))
def cuda_model(request):
    return request.param, MODELS[request.param]().cuda()


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_alpha_zero_logits_equal_the_wrapped_implementation_on_cuda(cuda_model, setting):
    name, model = cuda_model
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2)).cuda()
    ref = decode(model, ids)
    rt = attach(model, alpha=0.0, **setting)
    try:
        got = decode(model, ids)
        stats = rt.stats()
    finally:
        rt.detach()
    assert stats["device"].startswith("cuda") and not stats["simulated_device"]
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (name, setting, (got - ref).abs().max())
    assert stats["host_syncs"] == len(rt.stores) * (1 + 4)  # one per layer and step
    if setting.get("pinned_mb") == 0:
        # pageable host copies: only the staging blocks are pinned, and the run says it staged
        assert stats["pinned_bytes"] == sum(4 * st.layout.stride for st in rt.stores)
        assert stats["staged_layers"] == len(rt.stores)
    else:  # every expert's block, packed
        assert stats["pinned_bytes"] == sum(st.num_experts * st.layout.stride for st in rt.stores)
        assert stats["staged_layers"] == 0
    if stats["loads"]:  # the copies, timed by CUDA events: a real rate, and the device's wait for them
        assert stats["link_gbps_observed"] > 0 and stats["link_bytes"] > 0
    assert torch.equal(decode(model, ids), ref)  # detached: the wrapped implementation again


def test_experts_in_host_memory_run_from_device_slots():
    """The memory-saving layout: non-expert weights on the GPU, experts in (pinned) host memory only."""
    model = tiny_random().cuda()
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3)).cuda()
    ref = decode(model, ids)
    for layer in model.model.layers:
        layer.mlp.experts.to("cpu")
    rt = attach(model, policy="lru", capacity=0.25, prefetch="online", device="cuda")
    try:
        got = decode(model, ids)
        stats = rt.stats()
        experts = model.model.layers[0].mlp.experts
        # pinned in place: the module's own tensor is a view of the packed host block, held once
        assert experts.gate_up_proj.is_pinned()
        assert experts.gate_up_proj.data_ptr() == rt.stores[0].host["gate_up_proj"].data_ptr()
        assert rt.stores[0]._host_raw.is_pinned()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert stats["transfers"] > 0 and stats["hit_rate"] < 1
    # loads happened: the copies took link time, and the split's transfer wait is where they showed
    assert stats["link_ms"] > 0 and stats["transfer_wait_ms"] > 0


@pytest.mark.parametrize(
    "setting",
    [dict(policy="lru", capacity=0.25, prefetch="online"), dict(policy="smoe", capacity=2, balance="cpu")],
)
def test_disk_tier_reads_through_pinned_staging_into_device_slots(tmp_path, setting):
    model = mixtral_random().cuda()
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4)).cuda()
    ref = decode(model, ids)
    rt = attach(model, alpha=0.0, offload="disk", offload_dir=str(tmp_path), **setting)
    try:
        assert rt.stores[0].cuda and model.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta"
        got = decode(model, ids)
        stats = rt.stats()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert stats["bytes_read"] > 0 and stats["device"].startswith("cuda")
    # detach put the weights back on the GPU
    assert model.model.layers[0].mlp.experts.gate_up_proj.device.type == "cuda"
    assert torch.equal(decode(model, ids), ref)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_disk_tier_on_the_device_computes_as_the_quantized_model(tmp_path, dtype):
    """int8 / int4 experts read through pinned staging into device slots (one block a copy) and
    dequantized into them on the transfer stream: the logits of the model whose expert weights are
    the quantized ones, on the GPU."""
    from moecast.runtime.tiers import precision as P

    model = mixtral_random().cuda()
    prec = P.Precision(dtype, 32)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4)).cuda()
    with P.experts_at(mixtral_random().cuda(), prec) as ref_model:  # the quantized weights, on the GPU
        ref = decode(ref_model, ids)
    rt = attach(model, alpha=0.0, policy="lru", capacity=0.25, offload="disk", offload_dir=str(tmp_path),
                expert_dtype=dtype, group_size=32)  # fmt: skip
    try:
        assert rt.stores[0].cuda and rt.stats()["expert_dtype"] == prec.tag
        assert rt.stores[0].dequant is not None and "gate_up_proj" in rt.stores[0].slots
        got = decode(model, ids)
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantizing_on_the_gpu_gives_the_hosts_bytes(dtype):
    """The host tier quantizes a layer on the slots' GPU at attach (SlotDequantizer.quantize with a
    device): every stored part is bit for bit the host's (the same float32 arithmetic; int4 packed by
    the gather), at the DeepSeek-V2-Lite expert's shape, so the slots and the exactness checks see
    the same weights whichever quantized them."""
    from moecast.runtime.tiers.expert_store import expert_params
    from moecast.runtime.tiers.precision import SlotDequantizer, expert_setting

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 3
            self.gate_up_proj = torch.nn.Parameter((torch.randn(3, 2816, 2048) * 0.02).to(torch.bfloat16))
            self.down_proj = torch.nn.Parameter((torch.randn(3, 2048, 1408) * 0.02).to(torch.bfloat16))

    torch.manual_seed(0)
    experts = Experts()
    params = expert_params(experts)
    dq = SlotDequantizer(expert_setting(dtype, 128), experts)
    want, got = dq.quantize(params), dq.quantize(params, torch.device(DEVICE))
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].device.type == "cpu" and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("setting", [dict(policy="lru", capacity=0.25, prefetch="none"), dict(policy="smoe", capacity=None)],
                         ids=["lru-0.25", "all-resident"])  # fmt: skip
def test_decode_calls_replayed_as_cuda_graphs_keep_the_logits(cuda_model, setting):
    """graphs (the default): each layer's decode experts call is a CUDA graph captured once, replayed
    with the token's inputs while copies change the slots; the logits equal the runtime's without
    graphs bit for bit, and the unmodified model's as the other tests here compare them, and the
    graphs were replayed."""
    _, model = cuda_model
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        ref = decode(model, ids, steps=6)
        got = {}
        for graphs in (True, False):
            rt = attach(model, alpha=0.0, graphs=graphs, **{**setting, "policy": "lru"})
            try:
                got[graphs] = decode(model, ids, steps=6)
                g = rt.executor.graphs
                if graphs:
                    assert g.captured > 0 and g.replays > 0
                else:
                    assert g is None
            finally:
                rt.detach()
    assert torch.equal(got[True], got[False])  # the same kernels, replayed
    assert torch.allclose(got[True], ref, atol=1e-4, rtol=1e-4)  # as the wrapped implementation's


@pytest.mark.parametrize(
    "setting",
    [dict(), dict(balance="cpu"), dict(offload="disk")],
    ids=["prefill waves", "CPU balance", "disk tier"],
)
def test_alpha_zero_is_bit_exact_in_bf16_on_cuda_where_a_layer_runs_in_parts(tmp_path, setting):
    """Mixtral's float32 router weights in bf16: a layer in several calls (a 7-token prefill in waves
    through 2 slots, the CPU's set beside the device's) gives the model's logits bit for bit
    (runtime/live/pairs.py), as the one-call decode steps do."""
    model = mixtral_random().to(torch.bfloat16).cuda()
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5)).cuda()
    ref = decode(model, ids)
    if setting.get("offload"):
        setting = dict(setting, offload_dir=str(tmp_path))
    rt = attach(model, alpha=0.0, policy="lru", capacity=2, prefetch="none", **setting)
    try:
        assert rt.executor.exact
        got = decode(model, ids)
    finally:
        rt.detach()
    assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()


@pytest.mark.parametrize(
    "setting",
    [dict(), dict(capacity=0.875), dict(shape=(2, 8))],
    ids=["prefill waves", "one call", "two sequences"],
)
def test_alpha_zero_is_bit_exact_in_float32_on_cuda_where_calls_sort_other_keys(setting):
    """``tiny`` in float32 on the device: a wave's call, and one call over several tokens, sort slot
    ids where the model's call sorts expert ids; each places its pairs in the model's order
    (pairs.placing, in torch's ops on the device), so the logits are the model's bit for bit (on the
    CPU's two threads they differed by ~3e-7 before)."""
    model = tiny_random().cuda()
    setting = dict(setting)
    shape = setting.pop("shape", (1, 8))
    ids = torch.randint(5, 4000, shape, generator=torch.Generator().manual_seed(2)).cuda()
    ref = decode(model, ids)
    rt = attach(model, alpha=0.0, **{**dict(policy="lru", capacity=0.25, prefetch="none"), **setting})
    try:
        assert rt.executor.exact
        got = decode(model, ids)
    finally:
        rt.detach()
    assert torch.equal(got, ref), (got - ref).abs().max()
