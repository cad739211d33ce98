"""Quantized experts on an accelerator (issue 45): the packed block is copied in one copy and dequantized
into its slot on the transfer stream; the slots then compute at the model's dtype.

Every test runs on the simulated device (the CPU walking the CUDA path: runtime/tiers/simulated.py),
or on the CPU device, which keeps the packed slots and the weight-only kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import pytest
import torch
from moecast.collect.models import find_moe_structure, model_info
from moecast.runtime.core.cost_model import CostModel, HardwareProfile, load_profile
from moecast.runtime.core.step import layer_time
from moecast.runtime.live.config import LiveConfig
from moecast.runtime.live.runtime import attach
from moecast.runtime.tiers import precision as P
from moecast.runtime.tiers.expert_store import LayerStore, expert_params
from moecast.runtime.tiers.simulated import SimulatedOps
from test_live import decode_logits, make_model
from test_live_replay_equal import _equal_values
from torch import nn

from moecast.errors import InputError

torch.set_num_threads(1)

PRECISIONS = [P.Precision("int8"), P.Precision("int4", 32), P.Precision("int4", 64)]


def _model(seed: int = 0):
    """A Qwen2-MoE of 8 experts whose gate-up projection takes 128 inputs and down projection 64, so
    int4's groups of 32 and of 64 differ on both."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen2_moe", vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


class TransposedExperts(nn.Module):
    """Experts stored [E, in, out] (``is_transposed``, as gpt-oss stores them), with a bias vector."""

    def __init__(self, num: int = 4, hidden: int = 64, inter: int = 32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.num_experts, self.is_transposed = num, True
        self.gate_up_proj = nn.Parameter(torch.randn(num, hidden, 2 * inter, generator=g))
        self.down_proj = nn.Parameter(torch.randn(num, inter, hidden, generator=g))
        self.gate_up_proj_bias = nn.Parameter(torch.randn(num, 2 * inter, generator=g))


def _stored_parts(st: LayerStore, name: str, expert: int) -> dict[str, torch.Tensor]:
    """Expert ``expert``'s stored parts of matrix ``name`` as the store's host copy holds them."""
    return P.expert_parts(st.host, name, expert)


def _check_slots(st: LayerStore, prec: P.Precision) -> int:
    """Every filled slot holds dequantize_matrix of its expert's stored parts, bit for bit (transposed
    back where the module stores its experts so), and its vectors as stored; returns the slots checked."""
    dq = st.dequant
    checked = 0
    for slot, e in enumerate(st.expert_in):
        if e < 0:
            continue
        for name, in_f in dq.in_features.items():
            w = P.dequantize_matrix(prec, _stored_parts(st, name, int(e)), in_f)
            assert torch.equal(st.slots[name][slot], w.t() if dq.transposed else w), (name, slot)
        for name in dq.vectors:
            assert torch.equal(st.slots[name][slot], st.host[name][int(e)])
        checked += 1
    return checked


@pytest.mark.parametrize("prec", PRECISIONS, ids=lambda p: p.tag)
def test_a_loaded_slot_is_the_dequantized_stored_parts_bit_for_bit(prec):
    """The host tier on the simulated device: each slot the placement filled holds exactly the weights
    its stored parts stand for (precision.dequantize_matrix), the int4 ones unpacked from the CPU
    kernel's layout (whose packing test_precision reads back). Catches a part read at another offset of
    the landing block, a matrix given the wrong input width (another group), a dequantize that never
    ran or wrote another slot, a slot that kept the packed bytes."""
    model = _model()
    rt = attach(model, policy="lru", capacity=4, prefetch="none", alpha=0.0, device_ops="simulated",
                expert_dtype=prec.dtype, group_size=prec.group_size)  # fmt: skip
    try:
        assert [_check_slots(st, prec) for st in rt.stores] == [4, 4]
        assert set(rt.stores[0].slots) == set(expert_params(model.model.layers[0].mlp.experts))
    finally:
        rt.detach()


@pytest.mark.parametrize("prec", PRECISIONS[:2], ids=lambda p: p.tag)
def test_transposed_experts_are_dequantized_into_their_own_layout(prec):
    """A module that stores its experts [E, in, out] gets each matrix quantized as [out, in] and
    transposed back into its slot, its bias copied: the slot is precision.fake_quantized's weights
    bit for bit. Catches a missing transpose, or a bias left unwritten."""
    mod = TransposedExperts()
    st = LayerStore(mod, 2, "cpu", ops=SimulatedOps(), dequant=P.SlotDequantizer(prec, mod))
    st.load(3)
    st.load(1)
    assert _check_slots(st, prec) == 2
    fake = P.fake_quantized(prec, expert_params(mod), transposed=True)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias"):
        assert torch.equal(st.slots[name][0], fake[name][3]) and torch.equal(st.slots[name][1], fake[name][1])
    assert st.slots["gate_up_proj"].shape[1:] == mod.gate_up_proj.shape[1:]  # [in, out], as the module's


def test_one_copy_then_the_dequantize_on_the_link_and_one_event_per_load():
    """Per load the simulated device's record holds one copy of the packed block (the quantized bytes,
    into the landing block), then the dequantize on the same transfer stream, then the slot's one
    landing event, which is the only event the compute stream waits on for that slot. Catches a copy per
    tensor, the dequantize queued on the compute stream, and the compute waiting for the copy only
    (it would read the slot before the weights are written)."""
    prec = P.Precision("int4", 32)
    mod = TransposedExperts()
    ops = SimulatedOps(clock=lambda: 0.0)
    st = LayerStore(mod, 3, "cpu", ops=ops, dequant=P.SlotDequantizer(prec, mod))
    for e in (2, 0, 3):
        st.load(e)
    st.wait()
    log = ops.log
    copies = [e for e in log if e[0] == "copy"]
    kernels = [e for e in log if e[0] == "kernel"]
    assert len(copies) == len(kernels) == 3
    assert {c[1] for c in copies} == {k[1] for k in kernels} == {"copy0"}  # the link stream, not compute
    assert all(c[2] == st.layout.stride and c[3].data_ptr() == st._landing.data_ptr() for c in copies)
    assert st.layout.stride < st.slot_layout.stride  # the packed block, not the model-dtype one
    waits = [e for e in log if e[0] == "wait" and e[1] == "compute"]
    assert len(waits) == 3
    for k in kernels:  # after each dequantize: the landing event, which the compute waits on
        landing = log[log.index(k) + 1]
        assert landing[0] == "record" and landing[1] == "copy0"
        assert sum(w[2] is landing[2] for w in waits) == 1
    # the link's bytes are the packed ones, its time the copies' alone (the marks around each copy)
    st.settle(block=True)
    assert st.link_bytes == 3 * st.layout.stride and st.bytes_moved == 3 * st.layout.expert_bytes


@pytest.mark.parametrize("balance", ["load", "cpu"])
def test_the_live_output_is_the_fake_quantized_models(balance):
    """At alpha 0 the host tier at int4 on the simulated device gives the logits of the model whose expert
    weights are the quantized ones (precision.experts_at): the slots at the model's dtype through the
    wrapped implementation (``load``), the CPU set on the packed host copy with the weight-only call
    (``cpu``); the link moved the quantized bytes, and detach leaves the exact model. Catches slots
    computed on the model's own weights, the CPU set given the slots' implementation, a link counting
    the model dtype's bytes."""
    prec = P.Precision("int4", 32)
    model = _model()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    exact = decode_logits(model, ids)
    with P.experts_at(_model(), prec) as ref_model:
        ref = decode_logits(ref_model, ids)
    rt = attach(model, policy="lru", capacity=0.5, prefetch="none", alpha=0.0, device_ops="simulated",
                expert_dtype="int4", group_size=32, balance=balance)  # fmt: skip
    try:
        got = decode_logits(model, ids)
        stats = rt.stats()
        stores = rt.stores
    finally:
        rt.detach()
    to_ref, to_exact = (got - ref).abs().max().item(), (got - exact).abs().max().item()
    assert to_ref < to_exact / 20, (to_ref, to_exact)
    if balance == "load":  # the same weights, the same implementation: equal within bf16's rounding
        assert torch.allclose(got, ref, rtol=1e-2, atol=1e-3)
    else:
        assert stats["cpu_experts"] > 0
    info = model_info(model, find_moe_structure(model), "m")
    assert stats["expert_bytes"] == P.expert_nbytes(
        prec, expert_params(model.model.layers[0].mlp.experts), False
    )
    assert stats["expert_bytes"] < info.expert_bytes
    assert stats["link_bytes"] == sum(st.loads for st in stores) * stores[0].layout.stride
    assert sum(st.bytes_moved for st in stores) == sum(st.loads for st in stores) * stats["expert_bytes"]
    assert torch.equal(decode_logits(model, ids), exact)


@pytest.fixture(scope="module")
def dequant_profile(profile):
    """tight-window (test_live_replay_equal) with a dequantize of 0.2 ms a load at int4-g64."""
    prof = dataclasses.replace(load_profile(profile), name="with-dequant", dequant_ms={"int4-g64": 0.2})
    path = profile.parent / "with-dequant.yaml"
    path.write_text(prof.to_yaml())
    return path


@pytest.mark.parametrize("case", ["lru", "oracle prefetch"])
@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_live_and_replay_equal_at_int4_on_the_simulated_device(
    tiny,
    dequant_profile,
    tmp_path,
    case,
    offload,
):
    """Both tiers at int4 on the simulated device (dequantizing into the slots) make the replay's
    decisions and report its figures, the dequantize charged on both sides (test_live_replay_equal's
    checks: hits, loads, prefetches, modeled TPOT); bytes are int4's."""
    tier = dict(device_ops="simulated", expert_dtype="int4", group_size=64)
    if offload == "disk":
        tier.update(offload="disk", offload_dir=str(tmp_path / "off"))
    r, ts, cfg, stats = _equal_values(tiny, dequant_profile, tmp_path, case, tier)
    assert (
        stats["expert_bytes"]
        == r.config["expert_bytes"]
        < model_info(tiny, find_moe_structure(tiny), "t").expert_bytes
    )
    assert stats["link_bytes"] > 0 and stats["simulated_device"]
    from moecast.runtime.replay.engine import replay

    free = dataclasses.replace(load_profile(dequant_profile), dequant_ms={})
    assert replay(ts, dataclasses.replace(cfg, hardware=free)).modeled_tpot_ms < r.modeled_tpot_ms


def test_a_load_on_a_device_costs_its_bytes_and_its_dequantize_by_hand():
    """An expert of 2000 bytes (twice the reference) moved as 600 at int4 over 1000 bytes/ms, dequantized
    in 0.25 ms per reference expert: t_io = 0.6 + 0.5 = 1.1 ms; it computes at the model dtype's
    0.2 x 2 = 0.4 ms, not the CPU kernels' expert_ms. A layer with 3 resident experts, 2 of them loaded:
    0.5 + max(3 x 0.4, 2 x 1.1 + 0.4) = 3.1 ms. On a CPU fast tier neither applies: the slots stay
    packed (t_io 0.6, t_g = expert_ms 5.0 x 2). Catches the dequantize left out or charged on the CPU, and
    a device charged the CPU kernels' time."""
    prof = HardwareProfile(name="h", transfer_gbps=1e-3, ref_expert_bytes=1000, gpu_expert_ms=0.2, cpu_beta_ms=0.1,
                           cpu_c_ms=1.0, attn_ms=0.5, expert_ms={"int4-g128": 5.0}, dequant_ms={"int4-g128": 0.25})  # fmt: skip
    cost = CostModel.from_profile(prof, 2000, link_bytes=600, precision="int4-g128")
    assert (cost.t_io, cost.t_dq, cost.t_g) == pytest.approx((1.1, 0.5, 0.4))
    one, link = layer_time(cost, torch.tensor([3]).numpy(), torch.tensor([2]).numpy(), 0.0, 0.0)
    assert (float(one[0]), float(link[0])) == pytest.approx((3.1, 2.2))
    model = CostModel.from_profile(prof, 2000)
    assert (model.t_io, model.t_dq, model.t_g) == pytest.approx((2.0, 0.0, 0.4))
    cpu = CostModel.from_profile(
        dataclasses.replace(prof, fast_tier="cpu"), 2000, link_bytes=600, precision="int4-g128"
    )
    assert (cpu.t_io, cpu.t_dq, cpu.t_g) == pytest.approx((0.6, 0.0, 10.0))


def test_dequant_ms_survives_the_yaml_and_bad_values_are_refused(tmp_path):
    prof = HardwareProfile(name="h", transfer_gbps=1.0, ref_expert_bytes=1000, gpu_expert_ms=0.2, cpu_beta_ms=0.1,
                           cpu_c_ms=1.0, attn_ms=0.5, dequant_ms={"int8": 0.1, "int4-g64": 0.3})  # fmt: skip
    path = tmp_path / "p.yaml"
    path.write_text(prof.to_yaml())
    assert load_profile(path).dequant_ms == {"int8": 0.1, "int4-g64": 0.3}
    for bad in ({"int3": 1.0}, {"int8": -1.0}, ["int8"]):
        with pytest.raises(ValueError, match="dequant_ms"):
            dataclasses.replace(prof, dequant_ms=bad)


def test_the_profile_times_the_dequantize_of_each_precision(monkeypatch):
    """moecast profile's dequant_times: one expert's block into a slot, timed per quantized precision
    on the device given (the CPU here, and the note says so); the model's dtype gets none. Without CUDA
    the profile's device fields are borrowed, so profile_model leaves dequant_ms unmeasured."""
    from moecast.runtime.profile.measure import dequant_times, device_dequant_times

    base = HardwareProfile(name="h", transfer_gbps=1.0, ref_expert_bytes=1000, gpu_expert_ms=0.2, cpu_beta_ms=0.1,
                           cpu_c_ms=1.0, attn_ms=0.5)  # fmt: skip
    experts = _model().model.layers[0].mlp.experts
    prof, how = dequant_times(
        base, experts, [P.Precision(), P.Precision("int8"), P.Precision("int4", 32)], repeat=1
    )
    assert set(prof.dequant_ms) == {"int8", "int4-g32"} and min(prof.dequant_ms.values()) > 0
    assert "on cpu" in how["dequant_ms"] and dequant_times(base, experts, [P.Precision()]) == (base, {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prof, how = device_dequant_times(base, experts, [P.Precision("int8")])
    assert prof.dequant_ms == {} and "not timed" in how["dequant_ms"]


def test_the_cpu_device_refuses_the_host_tier_and_keeps_packed_slots_on_the_disk_tier(tmp_path):
    """Without an accelerator: the host tier refuses a quantized precision in one line (at the settings
    where the slots are named on the CPU, else at open, before the model is touched); the disk tier's
    slots hold the packed parts, computed by the weight-only kernels, while on the simulated device they
    hold the dequantized weights of the directory's copy. Catches the CPU path dequantizing (its int4
    kernel is faster than the model dtype's) or the accelerator's keeping packed slots."""
    with pytest.raises(InputError, match="needs an accelerator"):
        LiveConfig(expert_dtype="int8", device="cpu")
    LiveConfig(expert_dtype="int8", device="cpu", device_ops="simulated")  # accepted
    model = _model()
    before = model.get_experts_implementation()
    with pytest.raises(InputError, match=r"expert_dtype=int8 with offload='ram' needs an accelerator"):
        attach(model, expert_dtype="int8")
    assert model.get_experts_implementation() == before
    prec = P.Precision("int4", 32)
    want = P.fake_quantized(
        prec,
        {n: t.detach().clone() for n, t in expert_params(model.model.layers[0].mlp.experts).items()},
        False,
    )
    kw = dict(policy="lru", capacity=4, prefetch="none", alpha=0.0, offload="disk", offload_dir=str(tmp_path),
              expert_dtype="int4", group_size=32)  # fmt: skip
    rt = attach(model, **kw)
    try:
        st = rt.stores[0]
        st.wait()
        assert st.dequant is None and "gate_up_proj.q" in st.slots
        assert isinstance(rt.executor.impls[0], functools.partial)  # quantized_experts_forward
    finally:
        rt.detach()
    rt = attach(model, device_ops="simulated", **kw)
    try:
        st = rt.stores[0]
        st.wait()
        assert st.dequant is not None and set(st.slots) == set(want)
        assert isinstance(rt.executor.impls[0], P.DequantizedSlots)
        for slot, e in enumerate(st.expert_in):
            for name in want:
                assert torch.equal(st.slots[name][slot], want[name][e])
    finally:
        rt.detach()


def test_a_capacity_in_bytes_counts_the_dequantized_slots_not_the_packed_copies(tmp_path):
    """On an accelerator a slot holds the model's dtype whatever the link moves: 3 model-dtype experts'
    bytes make 3 slots at int4 (not the 3x more the packed bytes would fit); on the CPU, whose slots
    hold the packed copies, the same bytes hold more of them."""
    model = _model()
    info = model_info(model, find_moe_structure(model), "m")
    budget = f"{3 * info.expert_bytes / 2**10}KB"
    kw = dict(policy="lru", capacity=budget, prefetch="none", expert_dtype="int4", group_size=32)
    rt = attach(model, device_ops="simulated", **kw)
    try:
        assert rt.capacity == 3
        assert rt.stores[0].slot_layout.expert_bytes == info.expert_bytes  # what each slot holds
    finally:
        rt.detach()
    rt = attach(model, offload="disk", offload_dir=str(tmp_path), **kw)
    try:
        assert rt.capacity > 3
    finally:
        rt.detach()


def test_close_lets_the_host_copy_and_the_slots_go():
    """A closed store holds none of its buffers. Catches a close that keeps them: a detached runtime
    that lives on in a reference cycle would hold its packed host copies (pinned on CUDA) and device
    slots until the next garbage collection, so a process that attaches again holds two sets."""
    mod = TransposedExperts()
    st = LayerStore(mod, 2, "cpu", ops=SimulatedOps(), dequant=P.SlotDequantizer(PRECISIONS[0], mod))
    st.load(3)
    refs = [weakref.ref(t) for t in (st._host_raw, st._slot_raw, st._landing)]
    assert all(r() is not None for r in refs)
    st.ops.log.clear()  # the simulated device's record keeps its kernels' arguments (the landing block)
    st.close()
    assert [r() for r in refs] == [None, None, None]


@pytest.mark.parametrize("shape", [(16, 64), (48, 32), (2816, 2048), (2048, 1408)])
def test_the_gathered_int4_packing_is_the_cpu_kernels_bytes(shape):
    """pack_int4 off the CPU (an accelerator quantizing at attach) gathers each byte's nibbles where the
    CPU kernel's layout puts them: the same bytes as the kernel's own packing, at the DeepSeek-V2-Lite
    expert's shapes too. Catches nibbles swapped or a byte's codes taken from the wrong positions."""
    from moecast.runtime.tiers.precision import pack_int4, pack_int4_gather

    codes = torch.randint(
        0, 16, shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.int32
    )
    assert torch.equal(pack_int4_gather(codes), pack_int4(codes))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantizing_on_a_device_in_chunks_gives_the_hosts_bytes(monkeypatch, dtype):
    """SlotDequantizer.quantize on a device (here the CPU, in chunks of three experts and a remainder):
    every stored part equals the host's quantization of the whole layer. Catches chunks dropped,
    repeated or out of order."""
    from moecast.runtime.tiers import precision as P
    from moecast.runtime.tiers.expert_store import expert_params

    experts = make_model("qwen2_moe").model.layers[0].mlp.experts
    params = expert_params(experts)
    prec = P.expert_setting(dtype, 32)
    dq = P.SlotDequantizer(prec, experts)
    per_expert = sum(t[0].numel() * t.element_size() for t in params.values())
    monkeypatch.setattr(P, "QUANTIZE_CHUNK_BYTES", 3 * per_expert)
    want = dq.quantize(params)
    got = dq.quantize(params, "cpu")
    assert got.keys() == want.keys() and int(experts.num_experts) % 3
    for name in want:
        assert got[name].device.type == "cpu" and torch.equal(got[name], want[name]), name


def test_quantizing_on_a_device_that_fails_falls_back_to_the_host_and_says_so(monkeypatch):
    """A device that cannot quantize (out of memory, say) leaves the attach standing: the host
    quantizes the same bytes, and one PrecisionWarning names the device and the first line of why."""
    from moecast.runtime.tiers import precision as P
    from moecast.runtime.tiers.expert_store import expert_params

    experts = make_model("qwen2_moe").model.layers[0].mlp.experts
    params = expert_params(experts)
    dq = P.SlotDequantizer(P.expert_setting("int4", 32), experts)

    def fail(self, params, device):
        raise RuntimeError("CUDA out of memory. Tried to allocate 256.00 MiB\nmore")

    monkeypatch.setattr(P.SlotDequantizer, "_quantize_on", fail)
    with pytest.warns(
        P.PrecisionWarning,
        match=r"on cuda:0 failed \(CUDA out of memory\. Tried to allocate 256\.00 MiB\); quantizing on the host",
    ):
        got = dq.quantize(params, "cuda:0")
    want = dq.quantize(params)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
