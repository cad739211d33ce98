"""Two expert copies in the live runtime (runtime/live/copies.py, the disk tier's DiskLayerStore): the
step's decisions and counters equal the replay's, the disk reads each copy where the step says, and
every use computes at the copy its slot holds.

Small cases use test_live's random Qwen2-MoE (8 experts of gate-up [32, 32] and down [32, 16] in
float32, top-2): a model-dtype expert is (32 * 32 + 32 * 16) * 4 = 6144 bytes, an 8192-byte block on
disk; its int4-g32 copy is gate-up 32 * 16 + 32 * 2 * 4 (one group of 32 per row) = 768 and down
32 * 8 + 32 * 2 * 4 (the whole row of 16 is one group) = 512, 1280 bytes, a 4096-byte block.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from moecast.collect.models import find_moe_structure
from moecast.runtime.core.cost_model import HardwareProfile
from moecast.runtime.live.attach import _resolve_impl
from moecast.runtime.live.config import LiveConfig
from moecast.runtime.live.copies import MixedExperts
from moecast.runtime.live.runtime import attach
from moecast.runtime.tiers import precision as P
from moecast.runtime.tiers.base import Device, TierSpec
from moecast.runtime.tiers.disk import DiskTier
from moecast.runtime.tiers.expert_store import SlotView, expert_params
from test_live import decode_logits, make_model
from test_live_replay_equal import _equal_values

from moecast.errors import InputError

torch.set_num_threads(1)

INT4 = P.Precision("int4", 32)
MIXED = dict(expert_dtype="mixed", group_size=32)  # model + int4-g32
HIGH_BLOCK, LOW_BLOCK = 8192, 4096


# ------------------------------------------------------------------------------------ the setting
def test_mixed_settings_need_a_tier_that_holds_both_copies(tmp_path):
    cfg = LiveConfig(offload="disk", offload_dir=str(tmp_path), expert_dtype="int8+int4-g64")
    assert isinstance(cfg.precision, P.TwoCopies)
    assert (cfg.precision.high, cfg.precision.low) == (P.Precision("int8"), P.Precision("int4", 64))
    assert cfg.precision.label == "int8+int4-g64" and cfg.precision.tag == "int8"  # files: the high copy's
    assert LiveConfig(offload="disk", offload_dir=str(tmp_path), expert_dtype="mixed").precision.label == (
        "model+int4-g128"
    )
    with pytest.raises(InputError, match="two copies of each expert, which only an offload directory holds"):
        LiveConfig(expert_dtype="mixed")
    for same in ("int4+int8", "model+model", "int8+int8", "int4-g32+int4-g128"):  # equal copies too
        with pytest.raises(InputError, match="the high copy comes first and is a larger dtype"):
            LiveConfig(offload="disk", offload_dir=str(tmp_path), expert_dtype=same)
    # and from the commands, before any work (the replay engine keeps equal copies as its test oracle)
    from moecast.cli import main

    for cmd in (
        ["replay", "--traces", str(tmp_path)],
        ["compare", "--traces", str(tmp_path), "--out", str(tmp_path / "c")],
    ):
        with pytest.raises(SystemExit, match="the high copy comes first and is a larger dtype"):
            main([*cmd, "--expert-dtype" if cmd[0] == "replay" else "--expert-dtypes", "model+model"])


# ------------------------------------------------------------------------------------ the disk tier
def _reference(params: dict, x: torch.Tensor, experts: list[int], low: list[bool]) -> torch.Tensor:
    """Each (token, k) pair's expert output at its copy, [tokens, k, hidden] (float32)."""
    exact = P.gated_expert_outputs(params, x, False)
    fake = P.gated_expert_outputs(P.fake_quantized(INT4, params, False), x, False)
    return torch.stack(
        [torch.stack([(fake if lo else exact)[e, t] for e, lo in zip(experts, low)]) for t in range(len(x))]
    )


def test_a_demand_read_takes_the_low_copy_and_an_upgrade_rereads_the_high_one_in_place(tmp_path):
    """Capacity 3 of layer 0: expert 2 loaded at the low copy, 5 at the high one, 6 low: three reads,
    two of a 4096-byte low block and one of an 8192-byte high one. The call over slots [2, 5, 6] computes
    2 and 6 at int4 and 5 exactly. 2's flag turning high rereads its high copy into the same slot
    (one more 8192-byte read), and the same call then computes it exactly. The CPU set reads the low copy."""
    model = make_model("qwen2_moe")
    structure = find_moe_structure(model)
    experts = structure.layers[0].experts
    params = {n: t.detach().clone() for n, t in expert_params(experts).items()}
    spec = TierSpec(
        3, Device.at("cpu"), P.expert_setting("mixed", 32), pinned_budget=0, directory=str(tmp_path)
    )
    tier = DiskTier.open(model, structure, spec)
    try:
        st = tier.layers[0]
        assert (st.layout.stride, st.low_layout.stride) == (HIGH_BLOCK, LOW_BLOCK)
        assert (st.layout.expert_bytes, st.low_layout.expert_bytes) == (6144, 1280)
        want = np.zeros(8, bool)
        st.follow(want)
        want[[2, 6]] = True
        for e in (2, 5, 6):
            st.load(e)
        st.wait()
        s = tier.stats()
        assert (s["disk_reads"], s["low_disk_reads"]) == (3, 2)
        assert (s["bytes_read"], s["low_bytes_read"]) == (HIGH_BLOCK + 2 * LOW_BLOCK, 2 * LOW_BLOCK)
        assert st.slot_low.tolist() == [True, False, True]
        q = P.quantize_params(INT4, {n: t[[2]] for n, t in params.items()}, False)
        assert torch.equal(st.low_slots["gate_up_proj.q"][0], q["gate_up_proj.q"][0])
        assert torch.equal(st.slots["down_proj"][1], params["down_proj"][5])

        impl = MixedExperts(
            st, _resolve_impl(None, experts), functools.partial(P.quantized_experts_forward, INT4)
        )
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
        routed = [[2, 5], [5, 6], [6, 2], [5, 2]]
        w = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [0.2, 0.8]])
        index = torch.from_numpy(st.slot_of[np.array(routed)])

        def check(low: dict[int, bool]) -> None:
            got = impl(SlotView(experts, st.slots, st.num_slots, False), x, index, w)
            ref = torch.stack(
                [
                    (w[t, :, None] * _reference(params, x[t : t + 1], r, [low[e] for e in r])[0]).sum(0)
                    for t, r in enumerate(routed)
                ]
            )
            wrong = torch.stack(
                [
                    (w[t, :, None] * _reference(params, x[t : t + 1], r, [not low[e] for e in r])[0]).sum(0)
                    for t, r in enumerate(routed)
                ]
            )
            err, off = (got - ref).abs().max().item(), (got - wrong).abs().max().item()
            assert err < 1e-5 and off > 100 * err, (err, off)

        check({2: True, 5: False, 6: True})
        slot = st.slot_of[2]
        want[2] = False
        assert st.sync() == 1 and st.slot_of[2] == slot and st.upgrades == 1
        st.wait()
        s = tier.stats()
        assert (s["disk_reads"], s["low_disk_reads"], s["upgrade_reads"]) == (4, 2, 1)
        assert s["bytes_read"] == 2 * HIGH_BLOCK + 2 * LOW_BLOCK
        assert torch.equal(st.slots["gate_up_proj"][slot], params["gate_up_proj"][2])
        check({2: False, 5: False, 6: True})
        assert st.sync() == 0  # nothing left to reread

        (tensors, table, count), *_ = list(st.cpu_waves(np.array([1])))
        assert torch.equal(
            tensors["gate_up_proj.q"][table[1]],
            P.quantize_params(INT4, {n: t[[1]] for n, t in params.items()}, False)["gate_up_proj.q"][0],
        )
        cpu = impl(
            SlotView(experts, tensors, count, True),
            x,
            torch.from_numpy(table[np.array([[1]] * 4)]),
            torch.ones(4, 1),
        )
        want_cpu = _reference(params, x, [1], [True])[:, 0]
        assert (cpu - want_cpu).abs().max().item() < 1e-5
    finally:
        tier.close()
    assert torch.equal(expert_params(experts)["gate_up_proj"], params["gate_up_proj"])  # restored exactly


def test_the_device_path_stages_each_copy_s_block(tmp_path):
    """The CUDA path (a fake stream log): a low read stages the 4096-byte int4 block and copies it to the
    slot's first bytes; the upgrade stages the 8192-byte model-dtype block into the same slot."""
    from test_datapath import FakeOps

    model = make_model("qwen2_moe")
    structure = find_moe_structure(model)
    params = {n: t.detach().clone() for n, t in expert_params(structure.layers[0].experts).items()}
    dev = Device(torch.device("cpu"), FakeOps())
    tier = DiskTier.open(
        model, structure, TierSpec(2, dev, P.expert_setting("mixed", 32), 0, directory=str(tmp_path))
    )
    try:
        st = tier.layers[0]
        want = np.zeros(8, bool)
        want[3] = True
        st.follow(want)
        st.load(3)
        st.load(5)
        st.wait()
        q = P.quantize_params(INT4, {n: t[[3]] for n, t in params.items()}, False)
        slot = st.slot_of[3]
        assert all(torch.equal(st.low_slots[k][slot], q[k][0]) for k in q)
        assert torch.equal(st.slots["gate_up_proj"][st.slot_of[5]], params["gate_up_proj"][5])
        want[3] = False
        assert st.sync() == 1
        st.wait()
        assert torch.equal(st.slots["down_proj"][slot], params["down_proj"][3])
        s = tier.stats()
        assert (s["bytes_read"], s["low_bytes_read"]) == (2 * HIGH_BLOCK + LOW_BLOCK, LOW_BLOCK)
    finally:
        tier.close()


# ------------------------------------------------------------------------------------ outputs
def _slow_link(tmp_path) -> str:
    """A link on which one model-dtype expert takes 100 ms: no window (attention 0.35 ms, a few 0.05 ms
    experts) ever holds an upgrade, so every resident expert stays at the low copy it was read at."""
    prof = HardwareProfile(
        name="slow-link", transfer_gbps=6144 / 100e6, ref_expert_bytes=6144, gpu_expert_ms=0.05,
        cpu_beta_ms=0.05, cpu_c_ms=0.3, attn_ms=0.35, predictor_ms=0.2,
    )  # fmt: skip
    path = tmp_path / "slow-link.yaml"
    path.write_text(prof.to_yaml())
    return str(path)


def _logits(model, ids, tmp_path, name, **settings):
    rt = attach(
        model, alpha=0.0, prefetch="none", offload="disk", offload_dir=str(tmp_path / name), **settings
    )
    try:
        out = decode_logits(model, ids)
        stats = rt.stats()
    finally:
        rt.detach()
    return out, stats


def test_every_use_at_one_copy_gives_that_copy_s_run(tmp_path):
    """Full residency under mixed: the slots are filled with the high copy and never change, so the
    logits are the model-dtype disk run's, bit for bit. LRU from empty slots on a link too slow for any
    upgrade: every expert is read on demand at the low copy and stays there, so the logits are the int4
    disk run's, bit for bit (the same decisions, the same kernels on the same bytes)."""
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    model = make_model("qwen2_moe")
    high, hs = _logits(model, ids, tmp_path, "a", policy="lru", capacity=None, **MIXED)
    model_dtype, _ = _logits(model, ids, tmp_path, "b", policy="lru", capacity=None)
    assert torch.equal(high, model_dtype) and hs["expert_dtype"] == "model+int4-g32"
    # and its uses are timed at the high copy: none at the low one
    by = hs["expert_compute_by_copy"]
    assert by["int4-g32"]["uses"] == 0 < by["model"]["uses"] and hs["low_share"] == 0.0
    slow = dict(policy="lru", capacity=3, warm=False, hardware=_slow_link(tmp_path))
    low, ls = _logits(model, ids, tmp_path, "c", **slow, **MIXED)
    int4, s4 = _logits(model, ids, tmp_path, "d", **slow, expert_dtype="int4", group_size=32)
    assert ls["upgrades"] == 0 and ls["low_share"] == 1.0 and ls["loads"] == s4["loads"] > 0
    assert torch.equal(low, int4) and not torch.equal(low, model_dtype)
    assert (
        ls["low_disk_reads"] == ls["disk_reads"] == ls["loads"]
        and ls["low_bytes_read"] == ls["loads"] * LOW_BLOCK
    )


def test_a_mixed_run_keeps_each_slot_at_the_step_s_copy(tmp_path):
    """prefetch-late with the online prefetcher on the default profile (small experts: windows hold
    upgrades): after every forward each resident expert's slot holds the copy the step's flag names, the
    disk read one low block per demand load and one high block per prefetch and upgrade, and the run's
    logits are neither the model-dtype run's nor the int4 run's."""
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    model = make_model("qwen2_moe")
    exact = decode_logits(model, ids)
    rt = attach(model, policy="prefetch-late", capacity=3, warm=False, prefetch="online", offload="disk",
                offload_dir=str(tmp_path), **MIXED)  # fmt: skip
    checked = 0
    end = rt.end_forward

    def checking() -> None:
        nonlocal checked
        end()
        for pos, st in enumerate(rt.stores):
            held = st.expert_in >= 0
            assert (st.slot_low[held] == rt.step.low[pos, st.expert_in[held]]).all()
            checked += 1

    rt.end_forward = checking
    try:
        got = decode_logits(model, ids)
        s = rt.stats()
    finally:
        rt.detach()
    assert checked == 4 * len(rt.stores)
    assert s["upgrades"] > 0 and 0 < s["low_share"] < 1 and s["prefetches_landed"] > 0
    # every upgrade the step counts is read, in the window before its layer (none evicted unread)
    assert s["low_disk_reads"] == s["loads"] and s["upgrade_reads"] == s["upgrades"]
    high_reads = s["disk_reads"] - s["low_disk_reads"]
    assert high_reads == s["prefetches_landed"] + s["upgrade_reads"]
    assert s["bytes_read"] == high_reads * HIGH_BLOCK + s["loads"] * LOW_BLOCK
    assert not torch.equal(got, exact)


def test_lru_reads_its_upgrades_as_the_window_opens_not_behind_the_layer_s_loads(tmp_path):
    """LRU over two copies (no prefetch): the step upgrades a layer's resident low copies in the
    window before its experts (mixed.py, rule 4: link time no demand load waits for). The runtime
    reads them then, after the layer before (the token's start for the first layer), so every
    reread of a slot at the high copy is issued before the step of its layer, ahead of that layer's
    demand loads, and no upgraded expert is evicted by them unread: the disk reread as many as the
    step counted."""
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    model = make_model("qwen2_moe")
    rt = attach(model, policy="lru", capacity=3, warm=False, prefetch="none", offload="disk",
                offload_dir=str(tmp_path), **MIXED)  # fmt: skip
    ran, late, reread = set(), [], [0]
    layer = rt.step.layer

    def stepping(lanes, *a, **kw):
        ran.add((rt._step, int(lanes[0])))
        return layer(lanes, *a, **kw)

    def syncing(pos, sync):
        def run() -> int:
            n = sync()
            reread[0] += n
            if n and (rt._step, pos) in ran:
                late.append((rt._step, pos, n))
            return n

        return run

    rt.step.layer = stepping
    for pos, st in enumerate(rt.stores):
        st.sync = syncing(pos, st.sync)
    try:
        decode_logits(model, ids, steps=6)
        s = rt.stats()
    finally:
        rt.detach()
    assert s["upgrades"] > 0 and late == [] and reread[0] == s["upgrade_reads"] == s["upgrades"]


# ------------------------------------------------------------------------------------ live == replay
@pytest.mark.parametrize("case", ["lru", "oracle prefetch-late", "smoe"])
def test_live_and_replay_equal_with_two_copies(tiny, profile, tmp_path, case):
    """tiny at mixed (model + int4-g64): the live step's decisions are the replay's, so hit rate, loads,
    prefetches and TPOT (test_live_replay_equal) and the two-copy counters agree: the share of uses at
    the low copy, the upgrades, and the bytes each copy moved; the disk read every demand load (and
    smoe's CPU set) at the low copy and reread every upgrade at the high one; each copy's decode
    compute was timed on the uses the step computed at it."""
    tier = dict(offload="disk", offload_dir=str(tmp_path / "off"), expert_dtype="mixed", group_size=64)
    r, _, _, stats = _equal_values(tiny, profile, tmp_path, case, tier)
    assert stats["expert_dtype"] == r.config["expert_dtype"] == "model+int4-g64"
    assert stats["low_share"] == pytest.approx(r.low_share, abs=1e-12) and 0 < r.low_share < 1
    assert stats["upgrades"] == r.upgrades > 0
    tokens = r.tokens * 2**20
    assert stats["bytes_by_copy"] == pytest.approx({k: v * tokens for k, v in r.mb_per_token_by_copy.items()})
    assert sum(stats["bytes_by_copy"].values()) == r.bytes_moved
    # every demand load, every prefetch started past the window (rule 3) and smoe's CPU set read
    # the low copy
    assert stats["low_disk_reads"] == stats["loads"] + stats["prefetches_low"] + stats["cpu_experts"]
    assert (stats["prefetches_low"] > 0) == (case == "oracle prefetch-late")
    assert stats["upgrade_reads"] == stats["upgrades"]
    # the stores count each copy at its own bytes, upgrades included
    assert sum(stats["store_bytes_moved"]) == r.bytes_moved
    # each copy's decode compute is timed on its own uses: those at the low copy are the replay's
    # low uses less the one-token prompt's (cold: every one a demand read of the low copy)
    by = stats["expert_compute_by_copy"]
    high, low = by["model"], by["int4-g64"]
    prompt = stats["uses"] - stats["routed"]
    assert low["uses"] == round(r.low_share * stats["uses"]) - prompt and prompt > 0
    assert high["uses"] + low["uses"] == stats["routed"] and high["uses"] > 0 and low["uses"] > 0
    assert high["s"] > 0 and low["s"] > 0
    assert high["s"] + low["s"] == pytest.approx(stats["expert_compute_ms"] * stats["decode_steps"] / 1e3)


def test_presched_is_refused_with_two_copies(tmp_path):
    with pytest.raises(InputError, match="one expert precision"):
        attach(make_model("qwen2_moe"), policy="presched", capacity=3, offload="disk", offload_dir=str(tmp_path),
               **MIXED)  # fmt: skip


def test_batched_decode_times_each_copy_on_its_token_expert_pairs(tmp_path):
    """Two sequences decoded together, 5 steps, 2 MoE layers, top-2: 5 x 2 x 2 x 2 = 40 routed (token,
    expert) pairs, each computed at one copy, so the copies' uses add up to 40; counting an expert once
    per call (two tokens on one expert) under-counts them, and the calibration's time per use with them."""
    from moecast.collect.models import kv_cache, with_cache

    model = make_model("qwen2_moe")
    rt = attach(model, policy="lru", capacity=3, warm=False, prefetch="none", offload="disk",
                offload_dir=str(tmp_path / "off"), **MIXED)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.randint(0, 64, (2, 4), generator=gen), use_cache=True)
            for _ in range(5):
                nxt = torch.randint(0, 64, (2, 1), generator=gen)
                out = model(input_ids=nxt, **with_cache(model, kv_cache(out)), use_cache=True)
        st = rt.stats()
    finally:
        rt.detach()
    assert st["routed"] == 40 and sum(c["uses"] for c in st["expert_compute_by_copy"].values()) == 40
