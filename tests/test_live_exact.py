"""Alpha 0 in bf16, bit for bit, where a layer's experts run in several calls (runtime/live/pairs.py).

A prefill's loads stream through the slots in waves, the disk tier computes each demand load as it
lands, the CPU computes the balancer's set: each is a call of its own. Adding the calls' outputs
rounds each partial sum to bf16 first, which the model's one call does not; with float32 router
weights (DeepSeek-V3, Mixtral) or a top-k above 2 the logits then differ in their last bits.
In float32 on two threads, a call's pairs must also fall where the model's one call puts them in
each expert's group (pairs.placing).
"""

from __future__ import annotations

import pytest
import torch
from moecast.runtime.live import pairs
from moecast.runtime.live.runtime import attach
from test_live import decode_logits, make_model

torch.set_num_threads(1)

#: (family, top-k): float32 router weights at top-2, and bf16 ones at top-4
MODELS = [("deepseek_v3", 2), ("mixtral", 2), ("qwen3_moe", 4)]


def bf16_model(family: str, top_k: int):
    model = make_model(family).to(torch.bfloat16)
    model.config.num_experts_per_tok = top_k
    for m in model.modules():
        for name in ("top_k", "num_experts_per_tok"):
            if isinstance(getattr(m, name, None), int):
                setattr(m, name, top_k)
    return model


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_pairs_combined_equal_the_implementations_one_call(impl, w_dtype):
    """Each pair's unweighted output from its own row, weighted and summed by ``combine``, is the
    implementation's output bit for bit: the combine is the one transformers' implementations make."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts = bf16_model("qwen3_moe", 4).model.layers[0].mlp.experts
    fn = ALL_EXPERTS_FUNCTIONS[impl]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    index = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(5)])
    weights = torch.rand(5, 4, generator=gen).to(w_dtype)
    with torch.no_grad():
        ref = fn(experts, hidden, index, weights)
        got = pairs.combine(fn(experts, *pairs.pair_inputs(hidden, index, weights)), weights, hidden.dtype)
        # the rounding pairs.py avoids: two calls over halves of each token's experts, added in bf16
        halves = [torch.where(torch.arange(4) < 2, index, 8), torch.where(torch.arange(4) >= 2, index, 8)]
        experts._is_expert_parallel = True  # the sentinel 8 marks pairs another call computes
        parts = fn(experts, hidden, halves[0], weights) + fn(experts, hidden, halves[1], weights)
        experts._is_expert_parallel = False
    assert torch.equal(got, ref)
    assert not torch.equal(parts, ref)
    assert pairs.sums_over_top_k(impl) and not pairs.sums_over_top_k("eager")


SETTINGS = {
    # a 12-token prefill's experts outnumber the top-k slots: waves
    "prefill waves": (12, dict()),
    "prefill waves, simulated device": (12, dict(device_ops="simulated")),
    "prefill waves, two sequences": ((2, 12), dict()),
    # each demand load computed as its read lands, after the hits
    "disk tier": (1, dict(offload="disk")),
    "disk tier, prefill": (12, dict(offload="disk")),
    "disk tier, two sequences": ((2, 1), dict(offload="disk")),
    # the device's experts plus the CPU's
    "CPU balance": (1, dict(balance="cpu")),
    # the CPU's set read from disk one expert a wave, all of a layer's where nothing is resident
    "CPU balance, disk tier": (1, dict(balance="cpu", offload="disk")),
    "static, disk tier": (1, dict(policy="static", offload="disk")),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family,top_k", MODELS)
def test_alpha_zero_is_bit_exact_in_bf16_where_a_layer_runs_in_parts(family, top_k, setting, tmp_path):
    shape, kw = SETTINGS[setting]
    if kw.get("offload") == "disk":
        kw = dict(kw, offload_dir=str(tmp_path))
    model = bf16_model(family, top_k)
    ids = torch.randint(
        0, 64, shape if isinstance(shape, tuple) else (1, shape), generator=torch.Generator().manual_seed(1)
    )
    ref = decode_logits(model, ids, steps=5)
    rt = attach(model, **{**dict(alpha=0.0, policy="lru", capacity=top_k, prefetch="none"), **kw})
    try:
        assert rt.executor.exact
        got = decode_logits(model, ids, steps=5)
        stats = rt.stats()
    finally:
        rt.detach()
    static = kw.get("policy") == "static"  # never loads: its misses compute on the CPU
    assert (stats["loads"] > 0) != static
    assert (stats["cpu_experts"] > 0) == (kw.get("balance") == "cpu" or static)
    assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()


def test_calls_add_their_outputs_where_the_combine_is_not_known(tmp_path):
    """The class's own loop (``eager``) or a quantized slow tier: the calls' outputs add as before."""
    model = bf16_model("deepseek_v3", 2)
    model.set_experts_implementation("eager")
    ids = torch.randint(0, 64, (1, 1), generator=torch.Generator().manual_seed(1))
    ref = decode_logits(model, ids, steps=5)
    for kw in (dict(), dict(expert_dtype="int8", offload="disk", offload_dir=str(tmp_path))):
        rt = attach(model, alpha=0.0, policy="lru", capacity=2, prefetch="none", balance="cpu", **kw)
        try:
            assert not rt.executor.exact
            got = decode_logits(model, ids, steps=5)
        finally:
            rt.detach()
        if not kw:  # the eager loop's calls added in bf16: close, as before
            assert torch.allclose(got.float(), ref.float(), atol=0.05)


def _on_host(order, ids, keys, sentinel, rows):
    return torch.from_numpy(pairs.placing_host(order, ids.numpy(), keys.numpy(), sentinel, rows.numpy()))


@pytest.mark.parametrize("place", [_on_host, pairs.placing], ids=["host", "device ops"])
def test_placing_orders_each_group_as_the_models_one_call(place):
    """A call over some experts' pairs (slot ids, a sentinel for the rest) sorts them by its own keys,
    and torch.sort is not stable: fed ``hidden[placing]``, its sort visits each expert's pairs in the
    order the model's one call over the expert ids visits them. Both ways of computing it: numpy on
    the host, torch's ops on an accelerator (here on the CPU)."""
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, 16, (24, 4), generator=gen)  # ties in every group, past insertion sort
    ids = index.reshape(-1)
    order = pairs.reference_order(index)
    ref = {e: order[1][order[0] == e].tolist() for e in range(16)}
    # two waves of 8 experts, each in the 8 slots in any order
    slot = torch.cat([torch.randperm(8, generator=gen), torch.randperm(8, generator=gen)])
    for wave in (ids < 8, ids >= 8):
        keys = torch.where(wave, slot[ids], 8)
        src = place(order, ids, keys, 8, torch.arange(ids.numel()))
        assert torch.equal(torch.sort(src)[0], torch.arange(ids.numel()))  # a permutation
        values, perm = torch.sort(keys)  # the call's own sort
        visited = src[perm]
        for e in ids[wave].unique().tolist():
            assert visited[values == slot[e]].tolist() == ref[e]


FLOAT32_SETTINGS = {
    "prefill waves": dict(),  # the prefill's experts outnumber the slots
    "one call": dict(capacity=0.875, shape=(1, 8)),  # on the slots, whose ids are not the experts'
    "CPU balance": dict(balance="cpu"),  # the device's experts plus the CPU's
    "disk tier, two sequences": dict(offload="disk", shape=(2, 8)),  # each demand load a call
}


@pytest.mark.parametrize("setting", list(FLOAT32_SETTINGS))
def test_alpha_zero_is_bit_exact_in_float32_on_two_threads(setting, tmp_path):
    """The ``tiny`` architecture in float32, on two threads, at a prefill whose experts outnumber the
    slots: a float32 matmul on two threads rounds a row by its place in its expert's group (on one
    thread it does not), and a call's unstable sort orders an expert's pairs by the call's other
    keys, so each call places its pairs where the model's one call puts them (pairs.placing);
    before, the logits differed from the model's by ~3e-7."""
    from conftest import tiny_random

    setting = FLOAT32_SETTINGS[setting]
    kw = {k: v for k, v in setting.items() if k != "shape"}
    if kw.get("offload") == "disk":
        kw = dict(kw, offload_dir=str(tmp_path))
    model = tiny_random()
    ids = torch.randint(5, 4000, setting.get("shape", (1, 16)), generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = decode_logits(model, ids, steps=2)
        rt = attach(model, **{**dict(alpha=0.0, policy="lru", capacity=0.25, prefetch="none"), **kw})
        try:
            assert rt.executor.exact
            got = decode_logits(model, ids, steps=2)
        finally:
            rt.detach()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, ref), (got - ref).abs().max()
