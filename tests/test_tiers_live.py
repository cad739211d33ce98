"""``moecast run --offload disk`` on ``tiny``: experts written once, later runs load only the other weights."""

from __future__ import annotations

import json
import re

import pytest
import torch
from moecast.collect.models import kv_cache, with_cache
from moecast.collect.tiny import build_tiny
from moecast.runtime.live.config import LiveConfig
from moecast.runtime.live.runtime import attach
from moecast.runtime.tiers.offload import DENSE, OffloadError, load_offloaded, peak_rss_mb

from moecast.errors import InputError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(out=str(tmp_path_factory.mktemp("tiny") / "test"), preset="test", seed=0)


def test_tiny_from_the_offload_directory_gives_the_unmodified_logits(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ref_model(ids, use_cache=True)
        ref = [out.logits]
        ref.append(ref_model(torch.tensor([[5]]), **with_cache(ref_model, kv_cache(out))).logits)
    for _ in range(2):  # the first load writes the directory, the second reads it
        lm, _, _ = load_offloaded(str(tiny_dir), tmp_path / "off")
        # the experts were never materialised: only the dense weights are real
        experts = lm.model.layers[0].mlp.experts
        assert experts.gate_up_proj.device.type == "meta"
        assert lm.model.embed_tokens.weight.device.type == "cpu"
        assert lm.lm_head.weight is lm.model.embed_tokens.weight  # tied again
        rt = attach(
            lm, policy="lru", capacity=0.25, alpha=0.0, offload="disk", offload_dir=str(tmp_path / "off")
        )
        try:
            with torch.no_grad():
                out = lm(ids, use_cache=True)
                got = [out.logits, lm(torch.tensor([[5]]), **with_cache(lm, kv_cache(out))).logits]
            stats = rt.stats()
        finally:
            rt.detach()
        for g, r in zip(got, ref):
            assert torch.allclose(g, r, atol=2e-5, rtol=1e-5)
        assert stats["bytes_read"] > 0 and stats["decode_steps"] == 1
        assert stats["disk_read_gbps_observed"] > 0  # bytes over the time a read was in flight
        assert 0 < stats["peak_rss_mb"] <= peak_rss_mb() + 1  # the kernel syncs per-thread RSS counts lazily


def test_cli_run_offload_disk_writes_once_and_reports_the_tiers(tiny_dir, tmp_path, capsys):
    from moecast.cli import main

    base = ["run", "--model", str(tiny_dir), "--prompt", "hello there", "--max-new-tokens", "4"]
    base += ["--policy", "lru", "--capacity", "0.25"]
    main([*base, "--json"])
    ram = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    main([*base, "--device-ops", "simulated"])  # the GPU path's streams and events, simulated on the CPU
    sim = capsys.readouterr().out
    assert "simulated link" in sim and ram["output"] in sim and "reads included" not in sim
    off = tmp_path / "off"
    main([*base, "--offload", "disk", "--offload_dir", str(off), "--json"])
    first = capsys.readouterr().out
    assert "writing the experts" in first and (off / DENSE).is_file()
    main([*base, "--offload", "disk", "--offload-dir", str(off)])
    second = capsys.readouterr().out
    assert "writing the experts" not in second
    assert "disk reads" in second and "direct I/O" in second and "peak RSS" in second
    # the disk tier's own row (DiskTier.report): its reads, and the rate the disk gave while reading
    assert re.search(
        r"disk reads\s+\d+ \([\d.]+ MiB, direct I/O; whole 4 KiB blocks, [\d.]+ GB/s while reading\)", second
    )
    assert "transfer wait" in second
    # on the (simulated) device the disk tier's copies wait for their reads: the wait says it holds them
    main([*base, "--offload", "disk", "--offload-dir", str(off), "--device-ops", "simulated"])
    assert re.search(r"device wait [\d.]+ ms a step, the disk tier's reads included", capsys.readouterr().out)
    disk = json.loads(first.strip().splitlines()[-1])
    assert disk["output"] == ram["output"]  # alpha 0: the same greedy text from either tier
    assert disk["offload"] == "disk" and ram["offload"] == "ram" and ram["bytes_read"] == 0
    assert disk["hit_rate"] == ram["hit_rate"] and disk["transfers"] == ram["transfers"]
    parts = ("attention", "expert_compute", "transfer_wait", "device_sync", "predictor", "policy")
    assert all(disk[f"{p}_ms"] >= 0 for p in parts)
    # the parts split each step's wall time: outside the experts calls, and inside them by kind
    assert sum(disk[f"{p}_ms"] for p in parts) == pytest.approx(disk["measured_tpot_ms"], rel=1e-9)
    # the final norm and the LM head follow the last layer's experts: part of the time outside them
    assert 0 < disk["after_layers_ms"] < disk["attention_ms"]
    with pytest.raises(SystemExit, match="needs --offload-dir DIR"):
        main([*base, "--offload", "disk"])


def test_cli_run_at_a_precision_quantizes_the_directorys_copy_once(tiny_dir, tmp_path, capsys):
    """--expert-dtype int4 on a directory that holds the model-dtype experts: the int4 copy is written
    once from those files (the model's experts stay on disk), then read at a quarter of the bytes."""
    from moecast.cli import main

    off = tmp_path / "off"
    base = ["run", "--model", str(tiny_dir), "--prompt", "hello there", "--max-new-tokens", "3",
            "--policy", "lru", "--capacity", "0.25", "--offload", "disk", "--offload-dir", str(off)]  # fmt: skip
    main([*base, "--json"])
    exact = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    main([*base, "--expert-dtype", "int4", "--group-size", "32", "--json"])
    first = capsys.readouterr().out
    assert "writing the int4-g32 experts" in first and "writing the experts" not in first
    int4 = json.loads(first.strip().splitlines()[-1])
    main([*base, "--expert-dtype", "int4", "--group-size", "32"])
    second = capsys.readouterr().out
    assert "writing" not in second and "expert precision" in second and "int4-g32" in second
    assert f"int4-g32 ({int4['expert_bytes'] / 2**10:.3g} KiB an expert)" in second
    assert re.search(r"wasted prefetch +0.0 MiB \(prefetched, never used\)", second)  # lru prefetches nothing
    main([*base, "--expert-dtype", "model+int4-g32"])  # two copies: each copy's bytes, the uses' split
    mixed = capsys.readouterr().out
    assert "KiB an expert at model, " in mixed and "KiB at int4-g32)" in mixed
    assert "% of the uses at the low copy" in mixed and "upgrades; read model " in mixed
    assert exact["expert_dtype"] == "model" and int4["expert_dtype"] == "int4-g32"
    # a quarter of the weight bytes, plus the fp32 scale and zero of every 32 weights
    assert int4["expert_bytes"] == pytest.approx(exact["expert_bytes"] * (0.5 + 8 / 32) / 4)
    assert int4["bytes_read"] / int4["disk_reads"] < exact["bytes_read"] / exact["disk_reads"]
    with pytest.raises(
        SystemExit,
        match=r"--expert-dtype int8 with --offload ram needs an accelerator.*use --offload disk and --offload-dir DIR",
    ):
        main(["run", "--model", str(tiny_dir), "--max-new-tokens", "1", "--expert-dtype", "int8"])


def test_disk_decode_computes_hits_first_then_each_load_as_it_lands(tiny_dir, tmp_path, monkeypatch):
    """Without an accelerator a decode step's resident experts compute while its demand loads are
    read, then each load alone once it lands (the step's max(n_dev * t_g, link + t_g)); a prefill's
    loads stay one call. Logged: the experts of each call and whether its slots were still pending."""
    from moecast.runtime.live.executor import Executor

    lm, _, _ = load_offloaded(str(tiny_dir), tmp_path / "off")
    rt = attach(lm, policy="lru", capacity=0.5, alpha=0.0, offload="disk", offload_dir=str(tmp_path / "off"))
    calls: list[tuple[bool, list[int], bool]] = []
    device = Executor._device

    def logged(self, pos, call, experts):
        st = self.stores[pos]
        pending = any(int(s) in st._pending for s in st.slot_of[experts])
        calls.append((call.decode, sorted(int(e) for e in experts), pending))
        return device(self, pos, call, experts)

    monkeypatch.setattr(Executor, "_device", logged)
    ids = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            out = lm(ids, use_cache=True)
            cache = kv_cache(out)
            for tok in (7, 11, 13, 17):
                cache = kv_cache(lm(torch.tensor([[tok]]), **with_cache(lm, cache), use_cache=True))
        loads = rt.stats()["loads"]
    finally:
        rt.detach()
    decode = [c for c in calls if c[0]]
    singles = [c for c in decode if len(c[1]) == 1]
    assert loads > 0 and singles, "the run must have decode steps with demand loads"
    assert all(len(c[1]) >= 1 for c in decode)
    # a decode call of several experts is the hits (nothing pending); loads come one per call
    assert not any(c[2] for c in decode if len(c[1]) > 1)


def test_without_an_accelerator_cpu_experts_are_read_first_and_computed_after_the_resident_ones(
    tiny_dir, tmp_path, monkeypatch
):
    """A CPU fast tier over a disk (every decode miss to the CPU): the CPU experts' reads go out before
    the resident experts compute, and the CPU experts compute after them on the calling thread (a
    second thread would contend for the same cores), one expert per wave at decode, so each computes
    as its read lands. Logged in order per experts call: reads submitted, resident calls, CPU waves."""
    import threading

    from moecast.runtime.live.executor import Executor
    from moecast.runtime.tiers.offload import DiskLayerStore

    lm, _, _ = load_offloaded(str(tiny_dir), tmp_path / "off")
    rt = attach(
        lm, policy="lru", balance="cpu", capacity=0.5, offload="disk", offload_dir=str(tmp_path / "off")
    )
    calls: list[list[tuple[str, int]]] = []
    run, device = Executor.run, Executor._device
    read_wave, wave = DiskLayerStore._read_wave, DiskLayerStore._wave

    def logged_run(self, pos, call, *args):
        calls.append([("decode", int(call.decode))])
        return run(self, pos, call, *args)

    def logged_device(self, pos, call, experts):
        calls[-1].append(("resident", len(experts)))
        return device(self, pos, call, experts)

    def logged_read(self, experts, buf):
        calls[-1].append(("read", len(experts)))
        return read_wave(self, experts, buf)

    def logged_wave(self, buf, experts):
        assert threading.current_thread() is threading.main_thread()
        calls[-1].append(("cpu", len(experts)))
        return wave(self, buf, experts)

    monkeypatch.setattr(Executor, "run", logged_run)
    monkeypatch.setattr(Executor, "_device", logged_device)
    monkeypatch.setattr(DiskLayerStore, "_read_wave", logged_read)
    monkeypatch.setattr(DiskLayerStore, "_wave", logged_wave)
    ids = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            cache = kv_cache(lm(ids, use_cache=True))
            for tok in (7, 11, 13, 17):
                cache = kv_cache(lm(torch.tensor([[tok]]), **with_cache(lm, cache), use_cache=True))
        assert rt.stats()["cpu_experts"] > 0
    finally:
        rt.detach()
    with_cpu = [c[1:] for c in calls if c[0] == ("decode", 1) and any(k == "cpu" for k, _ in c)]
    assert with_cpu, "the run must have decode steps with CPU experts"
    for c in with_cpu:
        kinds = [k for k, _ in c]
        assert kinds[0] == "read", "the CPU experts' reads go out before the resident experts compute"
        if "resident" in kinds:
            assert max(i for i, k in enumerate(kinds) if k == "resident") < kinds.index("cpu")
        assert all(n == 1 for k, n in c if k in ("cpu", "read"))  # one expert per wave at decode


def test_a_dense_file_that_lacks_weights_is_refused_in_one_line(tiny_dir, tmp_path):
    """The dense file is the model's weights outside the experts; one missing (a file written by another
    version, or cut) left that parameter on the meta device, which fails later, far from the cause."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "off"
    load_offloaded(str(tiny_dir), d)  # writes the directory
    dense = load_file(d / DENSE)
    gone = next(k for k in dense if k.endswith("norm.weight"))
    save_file({k: v for k, v in dense.items() if k != gone}, d / DENSE)
    with pytest.raises(
        OffloadError, match=rf"{DENSE} lacks weights \['{gone}'\]; delete it and run again"
    ) as exc:
        load_offloaded(str(tiny_dir), d)
    assert "\n" not in str(exc.value)


# qwen2_moe of test_live: 8 experts a layer, 2 layers, fp32 gate_up [32, 32] and down [32, 16]: 6144 bytes
# an expert, already a multiple of the 256-byte alignment of the packed host copy
HOST_COPY_BYTES = 2 * 8 * 6144


@pytest.mark.parametrize(
    "pinned, staged",
    [(HOST_COPY_BYTES, 0), (HOST_COPY_BYTES - 1, 2), (0, 2)],
)
def test_the_host_tier_pins_its_copies_exactly_when_they_fit_the_budget(pinned, staged):
    """Every layer's packed host copy is pinned when the whole fits ``pinned_mb`` (its bytes exactly
    included), else every layer stays pageable and stages its transfers."""
    from test_live import make_model

    rt = attach(
        make_model("qwen2_moe"), policy="lru", capacity=2, prefetch="none", device_ops="simulated",
        pinned_mb=pinned / 2**20,
    )  # fmt: skip
    try:
        st = rt.stats()
    finally:
        rt.detach()
    assert st["staged_layers"] == staged
    if not staged:
        assert st["pinned_bytes"] == HOST_COPY_BYTES


def test_a_quantized_host_copy_is_pinned_by_its_own_bytes_not_the_models():
    """At int8 on an accelerator the host tier holds the packed int8 blocks: they fit a budget one byte
    short of the model-dtype copy (about a third of it), so nothing is staged."""
    from test_live import make_model

    rt = attach(
        make_model("qwen2_moe"), policy="lru", capacity=2, prefetch="none", device_ops="simulated",
        expert_dtype="int8", pinned_mb=(HOST_COPY_BYTES - 1) / 2**20,
    )  # fmt: skip
    try:
        st = rt.stats()
        stride = rt.stores[0].dequant.stored.stride
    finally:
        rt.detach()
    # 1536 int8 weights an expert and their scales, rounded up to the alignment: well under 6144
    assert 1536 <= stride < 6144 // 2
    assert st["staged_layers"] == 0 and st["pinned_bytes"] == 2 * 8 * stride


def test_a_directory_without_the_experts_of_a_model_that_holds_none_is_refused(tiny_dir, tmp_path):
    """A model whose experts are on disk (meta) attached to another, empty directory: refused in one
    line naming the directory, before anything reads from it."""
    lm, _, _ = load_offloaded(str(tiny_dir), tmp_path / "off")
    other = tmp_path / "empty"
    other.mkdir()
    with pytest.raises(
        OffloadError, match=r"empty does not hold all of this model's experts and the model has none"
    ):
        attach(lm, policy="lru", capacity=0.25, offload="disk", offload_dir=str(other))


def test_the_host_tier_refuses_to_quantize_experts_that_are_on_disk(tiny_dir, tmp_path):
    """offload='ram' at int8 quantizes the model's own expert weights at open: a model whose experts
    were left on disk (meta tensors) has none to quantize, so the tier refuses in one line naming the
    disk tier, on the simulated accelerator that otherwise accepts the setting."""
    lm, _, _ = load_offloaded(str(tiny_dir), tmp_path / "off")
    assert lm.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta"
    with pytest.raises(InputError, match=r"these are offloaded \(meta tensors\).*offload='disk'") as exc:
        attach(lm, policy="lru", capacity=0.25, offload="ram", expert_dtype="int8", device_ops="simulated")
    assert "\n" not in str(exc.value)


def test_slots_named_on_a_cuda_device_accept_a_quantized_host_copy():
    """The settings check refuses a quantized host copy only where the slots are named on the CPU
    without the simulated device: slots on a CUDA device are an accelerator's (checked without one)."""
    assert LiveConfig(expert_dtype="int8", device="cuda").precision.dtype == "int8"
    assert LiveConfig(expert_dtype="int4", device="cuda:1").precision.dtype == "int4"
    with pytest.raises(InputError, match="needs an accelerator"):
        LiveConfig(expert_dtype="int8", device="cpu")


def test_two_copies_on_the_simulated_device_keep_the_high_copys_packed_slots(tmp_path):
    """int8+int4 on the disk tier with the simulated accelerator: a slot holds the int8 copy's packed
    parts as read (only one quantized copy is dequantized into model-dtype slots), so a slot is the int8
    expert's bytes: gate-up 32 x 32 int8 weights and 32 fp32 row scales (1024 + 128), down 32 x 16 and
    32 scales (512 + 128), 1792 bytes, against 6144 at fp32."""
    from test_live import decode_logits, make_model

    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    rt = attach(
        model, policy="lru", capacity=3, alpha=0.0, prefetch="none", offload="disk",
        offload_dir=str(tmp_path), expert_dtype="int8+int4-g32", device_ops="simulated",
    )  # fmt: skip
    try:
        decode_logits(model, ids)
        st = rt.stats()
        packed = [s.dequant is None and "gate_up_proj.q" in s.slots for s in rt.stores]
    finally:
        rt.detach()
    assert rt.device.accelerated and st["expert_dtype"] == "int8+int4-g32"
    assert rt.slot_bytes == rt.link_bytes == st["slot_bytes"] == 1024 + 128 + 512 + 128
    assert packed == [True, True]
    assert st["loads"] > 0 and st["low_disk_reads"] > 0


def test_a_dequantized_slot_is_the_models_expert_and_the_link_moves_the_packed_one():
    """One int8 copy in host memory on the simulated accelerator: the link moves each expert's packed
    int8 parts (gate-up 32 x 32 weights and 32 fp32 row scales, 1024 + 128 bytes; down 32 x 16 and 32
    scales, 512 + 128: 1792) and the slot holds it dequantized at fp32 (6144 bytes): the stats name
    both, ``expert_bytes`` the link's and ``slot_bytes`` the slot's."""
    from test_live import make_model

    rt = attach(
        make_model("qwen2_moe"), policy="lru", capacity=2, prefetch="none", device_ops="simulated",
        expert_dtype="int8",
    )  # fmt: skip
    try:
        st = rt.stats()
    finally:
        rt.detach()
    assert (st["expert_bytes"], st["slot_bytes"]) == (1024 + 128 + 512 + 128, 6144)


def _reader(nbytes: int, reads: int, busy_s: float):
    from types import SimpleNamespace

    return SimpleNamespace(
        bytes_read=nbytes, reads=reads, busy_s=busy_s, direct=True,
        observed_gbps=lambda: nbytes / busy_s / 1e9,
    )  # fmt: skip


def test_the_disk_tier_adds_both_copies_reads_and_rates_them_over_both_busy_times():
    """The disk tier's figures from its readers', by hand: the high copy read 3 MiB in 3 reads busy 1 ms,
    the low one 1 MiB in 2 reads busy 1 ms: 4 MiB in 5 reads, the low copy's also apart, and the rate
    over both busy times, 4 * 2**20 B / 2 ms = 2.097152 GB/s (one copy: its reader's own rate)."""
    from moecast.runtime.tiers.disk import DiskTier

    high, low = _reader(3 * 2**20, 3, 1e-3), _reader(2**20, 2, 1e-3)
    st = DiskTier([], high, None, {}, None, low).stats()
    assert (st["bytes_read"], st["disk_reads"]) == (4 * 2**20, 5)
    assert (st["low_bytes_read"], st["low_disk_reads"]) == (2**20, 2)
    assert st["disk_read_gbps_observed"] == pytest.approx(2.097152)
    assert st["direct_io"] is True and st["staged_layers"] == 0 and st["upgrade_reads"] == 0
    assert DiskTier.report(st) == [
        ("disk reads", "5 (4.0 MiB, direct I/O; whole 4 KiB blocks, 2.10 GB/s while reading)")
    ]
    one = DiskTier([], _reader(3 * 2**20, 3, 1e-3), None, {}, None).stats()
    assert (one["bytes_read"], one["disk_reads"], one["low_bytes_read"]) == (3 * 2**20, 3, 0)
    assert one["disk_read_gbps_observed"] == pytest.approx(3.145728)
