"""The live runtime's data path, checked on the CPU: slot events, host synchronisations, CPU overlap, pinning."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest
import torch
from moecast.collect.models import find_moe_structure, kv_cache, with_cache
from moecast.runtime.core.cost_model import load_profile
from moecast.runtime.live import runtime as live
from moecast.runtime.live import transfer
from moecast.runtime.live.runtime import attach, pinned_budget
from moecast.runtime.live.stats import BREAKDOWN, ForwardTimes, LiveStats, StreamWaits
from moecast.runtime.tiers.expert_store import STAGING_BUFFERS, LayerStore, expert_params, link_stats
from moecast.runtime.tiers.simulated import SimulatedOps
from test_live import decode_logits, make_model

torch.set_num_threads(1)


class FakeOps(SimulatedOps):
    """The simulated device on a frozen host clock (every copy issued at t = 0), at 1 GB/s: a purely
    logical timeline whose figures a test works out by hand."""

    def __init__(self, clock=None) -> None:
        super().__init__(link_gbps=LINK_GBPS, clock=clock or (lambda: 0.0))


LINK_GBPS = 1.0


def _store(pin: bool | None = None, slots: int = 2, ops=None) -> tuple[LayerStore, FakeOps, torch.nn.Module]:
    experts = make_model("mixtral").model.layers[0].mlp.experts
    ops = ops or FakeOps()
    return LayerStore(experts, num_slots=slots, ops=ops, pin=pin), ops, experts


def _ms(nbytes: int) -> float:
    return nbytes / (LINK_GBPS * 1e9) * 1e3


def test_an_expert_is_one_copy_and_one_event_from_a_packed_pinned_block():
    """Catches per-tensor copies (three copies and events an expert), a host copy held twice (the
    module keeping its own tensors beside the packed block) and slots that are not one buffer."""
    experts = make_model("mixtral").model.layers[0].mlp.experts
    want = {n: t.detach().clone() for n, t in expert_params(experts).items()}
    ops = FakeOps()
    store = LayerStore(experts, num_slots=3, ops=ops)
    lay = store.layout
    assert ops.made == 1 and store.pinned_bytes == store.num_experts * lay.stride and not store.staged
    # the module's tensors are now views of the packed host block, with their values
    lo, hi = store._host_raw.data_ptr(), store._host_raw.data_ptr() + store._host_raw.numel()
    for n, t in expert_params(experts).items():
        assert lo <= t.data_ptr() < hi and torch.equal(t, want[n])
    store.fill([4, 1, 6])  # one batch: per expert a timing mark, one copy and its landing event
    seq = [(e[0], e[1]) for e in ops.sequence()]
    assert seq == [("record", "copy0"), ("copy", "copy0"), ("record", "copy0")] * 3
    assert [e[2] for e in ops.sequence("copy")] == [lay.stride] * 3  # the expert's whole block
    assert all(len(store._events[s]) == 1 for s in range(3))
    for slot, e in enumerate([4, 1, 6]):
        for n in want:
            assert torch.equal(store.slots[n][slot], want[n][e])
    # each slot's tensors are views of its block of the one slot buffer
    base = store._slot_raw.data_ptr()
    assert (
        store.slots["down_proj"][2].data_ptr()
        == base + 2 * lay.stride + lay.offsets[lay.names.index("down_proj")]
    )


def test_a_copy_waits_for_the_last_kernel_that_read_its_slot_only():
    store, ops, experts = _store()
    store.fill([0, 1])
    # a fresh slot was never read: its copy waits for nothing, and never for the whole compute stream
    assert not ops.sequence("wait")
    slot0 = list(store._events[0])
    store.wait([0])  # the compute stream waits for slot 0's transfer only
    waits = ops.sequence("wait")
    assert [(w[1], w[2]) for w in waits] == [("compute", slot0[0])]
    assert set(store._events) == {1}
    ops.log.clear()
    store.mark_read([0])  # a kernel read slot 0; slot 1 was not read since its load
    (rec,) = ops.log
    assert rec[:2] == ("record", "compute")
    read_ev = rec[2]
    ops.log.clear()
    assert store.load(5, evict=0) == 0
    # the copy stream waits for exactly that read event, marks the copy's start, copies, records its landing
    assert [(e[0], e[1]) for e in ops.log] == [
        ("wait", "copy0"),
        ("record", "copy0"),
        ("copy", "copy0"),
        ("record", "copy0"),
    ]
    assert ops.log[0][2] is read_ev
    assert 0 not in store._read_events  # the next copy into slot 0 is ordered behind this one
    ops.log.clear()
    store.load(6, evict=1)  # slot 1 was never read: no wait at all
    assert not ops.sequence("wait")
    assert torch.equal(store.slots["gate_up_proj"][0], experts.gate_up_proj[5])
    assert torch.equal(store.slots["down_proj"][1], experts.down_proj[6])


def test_pageable_host_copies_go_through_a_bounded_staging_ring():
    store, ops, experts = _store(pin=False, slots=3)
    assert len(store._staging) == STAGING_BUFFERS and store.staged  # said in the run's stats
    assert store.pinned_bytes == STAGING_BUFFERS * store.layout.stride  # the ring alone
    assert experts.gate_up_proj.data_ptr() == store.host["gate_up_proj"].data_ptr()  # left where it was
    assert not LayerStore(experts, num_slots=2).staged  # copies within host memory need no staging
    for k, e in enumerate(range(STAGING_BUFFERS + 2)):
        store.load(e, evict=None if store.free_slot() is not None else int(store.expert_in[k % 3]))
    assert len(ops.sequence("copy")) == STAGING_BUFFERS + 2  # one copy an expert, staged or not
    # the ring wrapped twice: the reused blocks' previous transfer events were waited for on the host
    landings = [ev[2] for ev in ops.sequence("record")][1::2]
    assert [ev.synced for ev in landings[:2]] == [1, 1] and landings[2].synced == 0
    for slot, e in enumerate(store.expert_in):
        assert torch.equal(store.slots["gate_up_proj"][slot], experts.gate_up_proj[e])


def test_the_stream_wait_and_the_link_rate_on_the_simulated_timeline():
    """By hand, at 1 GB/s: a batch of two experts issued at t = 0 lands at 2d (d = one block's time);
    the kernels that wait for both at host time d/2 stand 2d - d/2; the link moved 2 blocks in 2d.
    Catches a stream wait that ignores the host's clock, a batch whose copies overlap on the link,
    and a link rate that counts the padding or the idle time."""
    now = [0.0]
    store, ops, _ = _store(slots=3, ops=FakeOps(clock=lambda: now[0]))
    d = _ms(store.layout.stride)
    store.load_many([3, 5], [])
    waits = StreamWaits(ops)
    now[0] = d / 2
    waits.around(store.wait, [0, 1], decode=True)
    assert waits.settle() == pytest.approx(2 * d - d / 2)
    now[0] = 10 * d  # the link idles, then one more copy: its time is its own, not the gap before it
    store.load(7)
    now[0] = 12 * d
    waits.around(store.wait, None, decode=True)  # it landed at 11d, before the host asks: no wait
    assert waits.settle() == 0.0
    stats = link_stats([store])
    assert stats["link_bytes"] == 3 * store.layout.stride
    assert stats["link_ms"] == pytest.approx(3 * d)
    assert stats["link_gbps_observed"] == pytest.approx(LINK_GBPS)


def test_a_simulated_copy_lands_at_the_links_rate_not_the_cpus_memcpy_rate():
    """On the host's real clock, a copy's events are nbytes / link_gbps apart, however long the CPU's
    own memcpy of it took: the host issues a copy and goes on. 64 MiB at 1000 GB/s is 0.067 ms on the
    link, and its memcpy takes milliseconds here. Catches the memcpy left in the host's clock (the
    events then measured the CPU's copy: 2.8-13 GB/s on a link set to 24.9)."""
    ops = SimulatedOps(link_gbps=1000.0)
    stream = ops.stream()
    src = torch.ones(16 * 2**20)
    dst = torch.empty_like(src)
    link_ms = src.numel() * 4 / 1e12 * 1e3
    took = []
    for _ in range(3):
        a, b = ops.event(timing=True), ops.event(timing=True)
        a.record(stream)
        ops.copy(dst, src, stream)
        b.record(stream)
        took.append(a.elapsed_time(b))
    assert torch.equal(dst, src)
    assert ops.device_seconds * 1e3 / 3 > 5 * link_ms  # the memcpy itself is far slower than the link
    # the events' times are on the host's clock, about 1e7-1e8 ms after boot, where a double rounds to
    # about 1e-8 ms: a relative tolerance on the 0.067 ms failed on a machine up for 9 hours
    assert all(t >= link_ms - 1e-6 for t in took)
    assert min(took) < 3 * link_ms  # the link's time and the host's few µs between the calls, no memcpy


def test_a_simulated_device_is_freed_without_a_garbage_collection():
    """The log refers to events and to the slots' tensors; events and streams refer to their device
    weakly, so a dropped device frees its tensors at once (a dry run held GBs a row until a collection)
    and an event that outlives it reads as done. Catches a strong reference from an event or a stream,
    or from the device to itself (its default clock once a bound method stored on it)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        for clock in (lambda: 0.0, None):  # a test's clock, and the dry run's own (the host's)
            ops = SimulatedOps(clock=clock)
            stream = ops.stream()
            dst = torch.zeros(4)
            ops.copy(dst, torch.ones(4), stream)
            ev = ops.event()
            ev.record(stream)
            ops.compute.wait_event(ev)
            gone, slot = weakref.ref(ops), weakref.ref(dst)
            del ops, stream, dst
            assert gone() is None and slot() is None, clock
            ev.synchronize()
            assert ev.query()
    finally:
        gc.enable()


def test_the_split_moves_the_devices_copy_wait_out_of_the_sync():
    """The device's wait for copies shows on the host where it next reads the device: that much of
    device_sync is transfer_wait (no more than the sync), and the parts still add up to the wall."""
    st = LiveStats()
    times = ForwardTimes(lambda: 0.0, FakeOps())
    times.begin(decode=True)
    times.acc.update(layers=0.010, expert_compute=0.002, transfer_wait=0.001, device_sync=0.004)
    ev = [FakeOps().event(timing=True) for _ in range(2)]
    ev[0].time, ev[1].time = 1.0, 4.0  # the compute stream stood 3 ms
    times.streams.pending.append((ev[0], ev[1], True))
    st.add_breakdown(12.0, times)
    assert st.transfer_wait_decode_ms == [pytest.approx(1.0 + 3.0)]
    assert st.device_sync_decode_ms == [pytest.approx(4.0 - 3.0)]
    assert st.stream_wait_decode_ms == [3.0]
    parts = [getattr(st, f"{p}_decode_ms")[0] for p in BREAKDOWN]
    assert sum(parts) == pytest.approx(12.0)


def test_the_split_counts_the_predictors_time_once():
    """A 12 ms step whose layers took 10 ms: experts 2, transfer wait 1, device sync 4 and the predictor 2
    of them, so policy is the 1 ms left; attention 2 (wall - layers). The parts add up to 12 (policy 3
    and 14 if the predictor were left in it)."""
    st = LiveStats()
    times = ForwardTimes(lambda: 0.0)
    times.begin(decode=True)
    times.acc.update(
        layers=0.010, expert_compute=0.002, transfer_wait=0.001, device_sync=0.004, predictor=0.002
    )
    st.add_breakdown(12.0, times)
    assert st.policy_decode_ms == [pytest.approx(1.0)] and st.attention_decode_ms == [pytest.approx(2.0)]
    assert sum(getattr(st, f"{p}_decode_ms")[0] for p in BREAKDOWN) == pytest.approx(12.0)


def test_each_decode_steps_stream_waits_count_in_that_step(monkeypatch):
    """On the simulated device at a logical clock (each forward starts 1000 ms after the one before, and
    the clock stands still inside it), the last layer's kernels of decode steps 1 and 3 wait for a copy
    landing 7 and 5 ms later (the prefill's, 3 ms later). By hand: stream_wait = [0, 7, 0, 5] (the last step's too), and in those
    steps the wait moves the whole of the routing reads' device_sync (a few microseconds on the CPU,
    less than the wait) to transfer_wait; in the others nothing moves. Each step's parts add up to its
    wall time, so over the measured steps they add up to the TPOT's. Catches waits read only once the
    host clock passed them (each counted one step late, the last one lost) and a prefill's waits
    counted in a decode step."""
    from moecast.runtime.tiers import simulated

    now = [0.0]
    monkeypatch.setattr(simulated, "_wall_ms", lambda: now[0])
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    # every expert resident: no copy in a decode step, so the planted waits are the only ones
    rt = attach(model, policy="lru", capacity=None, prefetch="none", alpha=0.0, device_ops="simulated")
    ops, last = rt.device.ops, rt.num_layers - 1
    planted = {-1: 3.0, 1: 7.0, 3: 5.0}  # decode step (-1: the prefill) -> ms the last layer's kernels wait
    forwards, layer = [], [0]
    real_begin, real_layer, real_wait = rt.begin_forward, rt.forward_layer, rt.times.stream_wait

    def begin_forward(ids, decode):
        now[0] = 1e6 + 1000.0 * len(forwards)  # long after the initial placement's copies landed
        forwards.append(decode)
        real_begin(ids, decode)

    def forward_layer(pos, *a, **kw):
        layer[0] = pos
        return real_layer(pos, *a, **kw)

    def stream_wait(wait, slots):
        step = len(forwards) - 2  # decode steps follow the prefill
        w = planted.get(step, 0.0) if layer[0] == last else 0.0

        def waits(s):
            wait(s)
            if w:  # a copy that lands w ms from now, and the kernels wait for it
                side = ops.stream()
                side.t = now[0] + w
                ev = ops.event()
                ev.record(side)
                ops.compute.wait_event(ev)

        real_wait(waits, slots)

    rt.begin_forward, rt.forward_layer, rt.times.stream_wait = begin_forward, forward_layer, stream_wait
    rt.stores[last].awaits = lambda slots: True  # the planted copies are the last layer's to wait for
    try:
        decode_logits(model, ids, steps=4)
        st = rt.stats_
    finally:
        rt.detach()
    assert forwards == [False, True, True, True, True]
    assert st.stream_wait_decode_ms == [pytest.approx(planted.get(t, 0.0)) for t in range(4)]
    for t in range(4):
        sync = st.transfer_wait_decode_ms[t] + st.device_sync_decode_ms[t]  # the routing reads' wait
        assert sync > 0
        moved = min(planted.get(t, 0.0), sync)
        assert st.transfer_wait_decode_ms[t] == pytest.approx(moved, abs=1e-9)  # no host transfer wait
        assert st.device_sync_decode_ms[t] == pytest.approx(sync - moved, abs=1e-9)
        parts = sum(getattr(st, f"{p}_decode_ms")[t] for p in BREAKDOWN)
        assert parts == pytest.approx(st.measured_decode_ms[t])
    total = sum(sum(getattr(st, f"{p}_decode_ms")) for p in BREAKDOWN)
    assert total == pytest.approx(sum(st.measured_decode_ms))


def test_pinned_budget_is_the_given_size_or_half_the_available_memory():
    assert pinned_budget(0) == 0 and pinned_budget(1.5) == 3 * 2**19
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    assert abs(pinned_budget(None) - avail // 2) < 2**28
    model = make_model("mixtral")
    rt = attach(model, policy="lru", capacity=2)
    try:
        assert rt.stats()["pinned_bytes"] == 0  # nothing is pinned without CUDA
        assert rt.stats()["staged_layers"] == 0
    finally:
        rt.detach()
    with pytest.raises(ValueError, match="pinned_mb"):
        attach(model, pinned_mb=-1)


class OnDevice(torch.Tensor):
    """A tensor that stands for device memory: reading it on the host (a synchronisation) is logged."""

    reads: ClassVar[list[str]] = []
    READS: ClassVar[set] = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.tolist}
    READS |= {torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__array__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.READS:
            cls.reads.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


SYNC_SETTINGS = [
    dict(policy="smoe", capacity=2, alpha=0.5, prefetch="online"),
    dict(policy="lru", capacity=2, balance="cpu", prefetch="online"),
    dict(policy="lru", capacity=2, balance="presched", prefetch="online", hardware="prescope-a100-pcie4"),
    dict(policy="score", capacity=3, prefetch="none"),
    dict(policy="static", capacity=2, prefetch="none"),
]


@pytest.mark.parametrize("setting", SYNC_SETTINGS)
def test_each_decode_layer_reads_the_device_once(monkeypatch, setting):
    """The experts call's inputs stand for device tensors: one to_host per layer, no other host read."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    rt = attach(model, **setting)
    rt.executor.overlap_cpu = True
    calls = []

    def fake_to_host(tensors):  # the one synchronisation: device tensors become host tensors
        calls.append(len(tensors))
        return [t.detach().as_subclass(torch.Tensor).clone() for t in tensors]

    monkeypatch.setattr(transfer, "to_host", fake_to_host)
    real = rt.forward_layer
    per_layer: list[int] = []

    def forward_layer(pos, module, hidden, index, weights, **kw):
        before = len(calls)
        rt.router_logits[pos] = rt.router_logits[pos].as_subclass(OnDevice)
        dev = [t.as_subclass(OnDevice) for t in (hidden, index, weights)]
        out = real(pos, module, *dev, **kw).as_subclass(torch.Tensor)
        per_layer.append(len(calls) - before)
        return out

    monkeypatch.setattr(rt, "forward_layer", forward_layer)
    OnDevice.reads.clear()
    try:
        decode_logits(model, ids, steps=3)
        stats = rt.stats()
    finally:
        rt.detach()
    assert OnDevice.reads == []
    assert per_layer == [1] * (4 * 2)  # (prefill + 3 decode steps) x 2 layers
    assert stats["host_syncs"] == 8
    if setting.get("balance") == "cpu" or setting["policy"] == "static":
        assert stats["cpu_experts"] > 0


def test_cpu_experts_run_on_a_worker_beside_the_device_and_join_exactly():
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(5))
    ref = decode_logits(model, ids, steps=4)
    rt = attach(model, policy="lru", capacity=2, balance="cpu", prefetch="none")
    rt.executor.overlap_cpu = True
    threads: list[str] = []
    real_host = rt.executor._host

    def host(pos, call, experts):
        threads.append(threading.current_thread().name)
        return real_host(pos, call, experts)

    rt.executor._host = host
    order: list[str] = []
    real_device = rt.executor._device
    rt.executor._device = lambda *a: (order.append("device"), real_device(*a))[1]
    real_start = rt.executor._start_cpu
    rt.executor._start_cpu = lambda *a: (order.append("cpu"), real_start(*a))[1]
    try:
        got = decode_logits(model, ids, steps=4)
        stats = rt.stats()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    # one CPU job per layer call with CPU experts, each on the worker thread
    assert stats["cpu_experts"] > 0 and threads and len(threads) == order.count("cpu")
    assert all(t.startswith("moecast-cpu-experts") for t in threads)
    # each layer with CPU experts starts them before its device call, so they overlap
    assert all(order[i + 1] == "device" for i, o in enumerate(order) if o == "cpu")
    assert rt.executor._pool is None  # detach joined and closed the worker


def test_substituted_weights_stay_on_the_host_in_the_routers_dtype():
    w = torch.tensor([[0.75, 0.25]], dtype=torch.bfloat16)
    probs = np.array([[0.5, 0.3, 0.2]], np.float32)
    out = live._substituted_weights(w, np.array([[0, 1]]), np.array([[0, 2]]), probs)
    assert out.dtype == torch.bfloat16 and out.device.type == "cpu"
    # expert 0 keeps its weight; expert 2 gets p2 * sum(w) / (p0 + p1)
    want = torch.tensor([[0.75, 0.2 * 1.0 / 0.8]]).to(torch.bfloat16)
    assert torch.equal(out, want)


SIM_SETTING = dict(
    policy="lru", capacity=2, prefetch="online", alpha=0.0, warm=False, hardware="prescope-a100-pcie4"
)


def _sim_run(model, ids, steps=3, **kw):
    """Decode under the runtime on the simulated device; (logits, stats, runtime)."""
    rt = attach(model, device_ops="simulated", **{**SIM_SETTING, **kw})
    try:
        got = decode_logits(model, ids, steps=steps)
        return got, rt.stats(), rt
    finally:
        rt.detach()


def test_the_simulated_device_walks_the_cuda_path_with_the_cpus_results():
    """device_ops='simulated': the packed pinned layout, one link stream, events and stream waits, with
    the logits and every cache figure of the synchronous CPU path. Catches a simulated path that moves
    other weights than the CPU path (logits), decides otherwise (counters), reports itself as real or
    staged, or times no copy (transfer wait and link rate where loads happened)."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    ref = decode_logits(model, ids)
    rt = attach(model, **SIM_SETTING)
    try:
        cpu_logits, cpu = decode_logits(model, ids), rt.stats()
    finally:
        rt.detach()
    got, sim, rt = _sim_run(model, ids)
    assert torch.equal(got, ref) and torch.equal(cpu_logits, ref)
    for key in ("hits", "loads", "transfers", "prefetches_issued", "prefetches_landed", "cpu_experts"):
        assert sim[key] == cpu[key], key
    assert sim["loads"] > 0 and sim["simulated_device"] and sim["device_ops"] == "simulated"
    assert sim["pinned_bytes"] == sum(st.num_experts * st.layout.stride for st in rt.stores)
    assert sim["staged_layers"] == 0 and cpu["pinned_bytes"] == 0
    ops = rt.device.ops
    assert isinstance(ops, SimulatedOps) and ops.made == 1  # the tier's one link
    assert ops.link_gbps == pytest.approx(load_profile("prescope-a100-pcie4").transfer_gbps)  # the profile's
    copies = ops.sequence("copy")
    assert len(copies) == sim["transfers"] and {c[1] for c in copies} == {"copy0"}
    assert sim["link_bytes"] == len(copies) * rt.stores[0].layout.stride
    # the simulated link's rate, less the host's gaps between a copy's mark and its issue (the frozen
    # clock of test_the_stream_wait_and_the_link_rate_on_the_simulated_timeline pins it exactly)
    assert 0 < sim["link_gbps_observed"] <= ops.link_gbps * (1 + 1e-9)
    assert sim["transfer_wait_ms"] > 0 and cpu["transfer_wait_ms"] > 0  # loads happened: the host copied
    assert sim["stream_wait_ms"] >= 0 and cpu["stream_wait_ms"] == 0


def test_a_layers_demand_copies_go_out_as_one_batch_before_the_next_layers_prefetch():
    """On the simulated device's record: within each decode step's experts call, the layer's demand
    copies are issued back to back (no wait of the compute stream between them), and every prefetch copy into the next
    layer's slots comes after them on the same stream, so it lands after them. Catches a prefetch
    queued ahead of the demand loads, a stream per layer (copies of two layers racing on the link) and
    demand copies interleaved with the waits."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    rt = attach(model, device_ops="simulated", **SIM_SETTING)
    ops = rt.device.ops
    real_layer, real_prefetch = rt.forward_layer, rt._prefetch

    def forward_layer(pos, *a, **kw):
        ops.log.append(("layer", pos, rt.fwd.decode))
        return real_layer(pos, *a, **kw)

    def prefetch():
        ops.log.append(("prefetch",))
        real_prefetch()
        ops.log.append(("prefetched",))

    rt.forward_layer, rt._prefetch = forward_layer, prefetch
    try:
        decode_logits(model, ids, steps=6)
        bases = [(st._slot_raw.data_ptr(), st._slot_raw.numel()) for st in rt.stores]
    finally:
        rt.detach()

    def layer_of(dst):
        return next(i for i, (b, n) in enumerate(bases) if b <= dst.data_ptr() < b + n)

    calls, both = [], 0
    for entry in ops.log:
        if entry[0] == "layer":
            calls.append(dict(pos=entry[1], decode=entry[2], seq=[], prefetching=False))
        elif calls and entry[0] in ("prefetch", "prefetched"):
            calls[-1]["prefetching"] = entry[0] == "prefetch"
        elif calls and entry[0] == "copy":
            kind = "prefetch" if calls[-1]["prefetching"] else "demand"
            calls[-1]["seq"].append((kind, layer_of(entry[3]), entry[1]))
        elif calls and entry[0] == "wait" and entry[1] == "compute":
            calls[-1]["seq"].append(("compute-wait", None, "compute"))
    for call in calls:
        seq = [k for k, _, _ in call["seq"]]
        demand = [i for i, k in enumerate(seq) if k == "demand"]
        prefetch = [i for i, k in enumerate(seq) if k == "prefetch"]
        assert all(layer == call["pos"] for k, layer, _ in call["seq"] if k == "demand")
        assert all(layer == call["pos"] + 1 for k, layer, _ in call["seq"] if k == "prefetch")
        # a decode step's misses fit the slots: back to back, before any wait of the compute stream (a
        # prefill's outnumber them and stream through the slots in waves, each after the last computed)
        if demand and call["decode"]:
            assert seq[demand[0] : demand[-1] + 1] == ["demand"] * len(demand)
            assert "compute-wait" not in seq[: demand[0]]
        if demand and prefetch:
            assert max(demand) < min(prefetch)
            both += 1
        assert {s for k, _, s in call["seq"] if k != "compute-wait"} <= {"copy0"}
    assert both > 0  # the run had layers with both, so the order was tested


@pytest.mark.parametrize("device_ops", ["auto", "simulated"])
def test_the_next_layers_prediction_overlaps_the_launch_of_this_layers_experts_on_an_accelerator(device_ops):
    """On an accelerator (here the simulated one) the host is what a layer waits for: layer l+1's
    prediction starts on the prediction thread before layer l's experts are launched and is joined
    after, before the host waits for anything of theirs, so it overlaps the launch; on the CPU, which
    computes the experts synchronously, it comes first on the host's thread (its prefetch's reads then
    overlap the compute). Catches the prediction left on the accelerator host's critical path, or
    moved behind the CPU's compute."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    rt = attach(model, device_ops=device_ops, **SIM_SETTING)
    order: list[tuple[str, int]] = []
    real_next, real_async = rt.prefetcher.next, rt.prefetcher.next_async
    real_device, real_join = rt.executor._device, rt.executor.join

    def next_async(nxt, *a):
        order.append(("start", nxt))
        join = real_async(nxt, *a)
        return lambda: (order.append(("predicted", nxt)), join())[1]

    rt.prefetcher.next = lambda nxt, *a: (order.append(("predict", nxt)), real_next(nxt, *a))[1]
    rt.prefetcher.next_async = next_async
    rt.executor._device = lambda pos, *a: (order.append(("launch", pos)), real_device(pos, *a))[1]
    rt.executor.join = lambda *a: (order.append(("join", -1)), real_join(*a))[1]
    try:
        decode_logits(model, ids, steps=3)
    finally:
        rt.detach()
    kinds = [k for k, _ in order]
    if device_ops == "simulated":
        assert "predict" not in [k for k, nxt in order if nxt > 0]  # no layer predicted on the host's thread
        started = [i for i, (k, nxt) in enumerate(order) if k == "start" and nxt > 0]
        assert started
        for i in started:
            end = i + kinds[i:].index("predicted")
            # started, then the layer's experts launched, then the prediction joined, then the layer joined
            assert "launch" in kinds[i:end] and "join" not in kinds[i:end] and kinds[end + 1] == "join"
    else:
        predicted = [i for i, (k, nxt) in enumerate(order) if k == "predict" and nxt > 0]
        assert predicted and "start" not in kinds
        for i in predicted:
            before = kinds[:i]
            last = len(before) - 1 - before[::-1].index("join") if "join" in before else -1
            assert "launch" not in kinds[last + 1 : i]  # predicted before the layer's experts compute


def test_a_second_store_takes_the_packed_block_the_module_adopted():
    """A second attach to the same model finds its experts packed (the first store's views, adopted by
    the module) and takes that block: no second copy of every expert, no second pinning. Catches a
    store that packs again, and one that takes a block whose views differ from its layout."""
    experts = make_model("mixtral").model.layers[0].mlp.experts
    want = {n: t.detach().clone() for n, t in expert_params(experts).items()}
    first = LayerStore(experts, num_slots=2, ops=FakeOps())
    block = first._host_raw.data_ptr()
    first.close()
    ops = FakeOps()
    second = LayerStore(experts, num_slots=2, ops=ops)
    assert second._host_raw.data_ptr() == block and second.pinned_bytes == first.pinned_bytes
    for n, t in expert_params(experts).items():
        assert torch.equal(t, want[n])
    second.fill([3])
    slot = int(second.slot_of[3])
    for n in want:
        assert torch.equal(second.slots[n][slot], want[n][3])
    # one tensor no longer a view of the block: the store packs (and adopts) a block of its own
    name = next(iter(want))
    experts._parameters[name].data = experts._parameters[name].data.clone()
    third = LayerStore(experts, num_slots=2, ops=FakeOps())
    assert third._host_raw.data_ptr() != block
    for n, t in expert_params(experts).items():
        assert torch.equal(t, want[n])


def test_the_simulated_devices_log_keeps_its_latest_calls_only(monkeypatch):
    """A long dry run's record stays bounded: the log keeps the latest LOG_LIMIT calls, in issue order
    (an unbounded log grew with every copy, and the collector's passes over it cost the host time a
    device's path does not pay)."""
    from moecast.runtime.tiers import simulated

    monkeypatch.setattr(simulated, "LOG_LIMIT", 4)
    ops = FakeOps()
    stream = ops.stream()
    events = [ops.event() for _ in range(6)]
    for ev in events:
        ev.record(stream)
    assert [e[2] for e in ops.log] == events[2:]
    assert [e[2] for e in ops.sequence("record")] == events[2:]


@pytest.mark.parametrize("slow", ["issue", "device"])
def test_an_accelerators_copy_issue_is_the_hosts_work_not_a_wait_for_the_link(monkeypatch, slow):
    """On an accelerator the host issues a copy and goes on: its time issuing it (``issue``: the
    simulated device's copy call, slowed by 4 ms before the copy) is the runtime's host work in the
    split (``policy``) and the run's ``copy_issue_ms``, not ``transfer_wait``, which is the device's
    wait for the copies. The simulated device's own work on the host's thread (``device``: the copy's
    arithmetic, slowed by 4 ms) is the device's: a wait, not issue time. Catches the issue time
    counted as a wait (as it was: 12 ms of "transfer wait" a token in the H200's LRU row), the
    simulated copy's memcpy counted as host work (the stand-in then overstates a GPU host's), and a
    mean over the wrong count. The synchronous CPU path's copies are the host's wait."""
    import time as clock

    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    real, real_work, copies, at_forward = SimulatedOps.copy, SimulatedOps._device_work, [0], []

    def copy(self, dst, src, stream):
        copies[0] += 1
        if slow == "issue":
            clock.sleep(4e-3)
        real(self, dst, src, stream)

    def work(self, fn, *args, **kw):
        def slowed(*a):
            clock.sleep(4e-3)
            fn(*a)

        real_work(self, slowed if slow == "device" else fn, *args, **kw)

    monkeypatch.setattr(SimulatedOps, "copy", copy)
    monkeypatch.setattr(SimulatedOps, "_device_work", work)
    hook = model.register_forward_pre_hook(lambda *_: at_forward.append(copies[0]))
    try:
        _, sim, _ = _sim_run(model, ids, steps=4, prefetch="none")
    finally:
        hook.remove()
    decode_copies = copies[0] - at_forward[1]  # after the prefill
    assert decode_copies > 0
    per_step = 4.0 * decode_copies / sim["decode_steps"]
    if slow == "issue":
        assert 4.0 <= sim["copy_issue_ms"] < 40.0
        assert sim["policy_ms"] >= per_step and sim["transfer_wait_ms"] < per_step / 4
    else:
        assert sim["copy_issue_ms"] < 2.0
        assert sim["transfer_wait_ms"] >= per_step and sim["policy_ms"] < per_step / 2
    rt = attach(model, **SIM_SETTING)
    try:
        decode_logits(model, ids, steps=2)
        cpu = rt.stats()
    finally:
        rt.detach()
    assert cpu["copy_issue_ms"] is None and cpu["transfer_wait_ms"] > 0


def test_a_call_whose_slots_have_no_copy_in_flight_queues_no_wait_and_no_timing_events():
    """awaits(): a store knows whether a wait has anything to wait for. With every expert resident and
    no copy since the last wait, the runtime's experts call puts neither a stream wait nor the pair of
    timing events around it on the compute stream (host work and device events for nothing); a call
    whose slots have a copy in flight still gets both. Catches the check inverted or ignored."""
    store, ops, _ = _store(slots=3)
    store.load_many([3, 5], [])
    assert store.awaits([0]) and store.awaits(None) and not store.awaits([2])
    store.wait([0])
    assert not store.awaits([0]) and store.awaits([1])
    store.wait(None)
    assert not store.awaits(None) and not store.awaits([0, 1, 2])

    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    rt = attach(model, device_ops="simulated", policy="lru", capacity=None, warm=True)
    try:
        decode_logits(model, ids, steps=1)
        for st in rt.stores:  # the fill's copies into slots no call has read yet: waited for once
            st.wait(None)
        ops = rt.device.ops
        ops.log.clear()
        decode_logits(model, ids[:, :1], steps=2)
    finally:
        rt.detach()
    on_compute = [e for e in ops.log if e[1] == "compute" and e[0] in ("record", "wait")]
    timing = [e for e in on_compute if e[0] == "record" and e[2].timing]
    assert not [e for e in on_compute if e[0] == "wait"] and not timing


def _graph_run(model, ids, **kw):
    """Decode under inference mode on the simulated device; (logits, runtime's graphs, ops)."""
    rt = attach(model, device_ops="simulated", policy="lru", capacity=2, warm=False, **kw)
    try:
        with torch.inference_mode():
            got = decode_logits(model, ids, steps=5)
        graphs = rt.executor.graphs
        assert rt.stats()["graph_replays"] == (graphs.replays if graphs is not None else None)
        return got, graphs, rt.device.ops
    finally:
        rt.detach()


def test_decode_experts_calls_replay_their_layers_graph_with_the_tokens_inputs():
    """graphs (default): each layer's one-token experts call is captured once per kind of call (all of
    the token's experts on the device, or some of them) and replayed with the token's hidden state,
    slot ids and weights copied in, reading slots whose contents changed since (LRU at 2 slots reloads
    them every step): the logits are the unmodified model's, bit for bit, as without graphs. The
    prefill (five tokens) and calls with autograd on are never captured. Catches a replay on the
    captured token's inputs, a graph per call (no replay), and a capture of the prefill."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        ref = decode_logits(model, ids, steps=5)
    got, graphs, ops = _graph_run(model, ids)
    plain, none, _ = _graph_run(model, ids, graphs=False)
    assert none is None and torch.equal(got, ref) and torch.equal(plain, ref)
    layers = len(find_moe_structure(model).layers)
    assert layers <= graphs.captured <= 2 * layers and graphs.captured == len(ops.sequence("graph"))
    # the five decode steps' calls: each replayed once, but a layer's first one, which the capture computed
    assert graphs.replays >= 5 * layers - graphs.captured
    rt = attach(model, device_ops="simulated", policy="lru", capacity=2, warm=False)
    try:
        with torch.enable_grad():  # autograd on: nothing captured
            out = model(input_ids=ids, use_cache=True)
            model(input_ids=ids[:, :1], **with_cache(model, kv_cache(out)), use_cache=True)
        assert rt.executor.graphs.captured == 0
    finally:
        rt.detach()


def test_a_call_that_cannot_be_captured_runs_as_it_is_and_says_so_once(monkeypatch, caplog):
    """A device that refuses a capture (an implementation that reads back from the device, say): the
    call runs uncaptured from then on, the logits are the model's, and one warning names why."""
    from moecast.runtime.live import graphs as G

    def refuse(self, fn, *inputs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(SimulatedOps, "capture", refuse)
    G._say_uncapturable.cache_clear()
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        ref = decode_logits(model, ids, steps=5)
    with caplog.at_level("WARNING", logger="moecast.runtime.live.graphs"):
        got, graphs, _ = _graph_run(model, ids)
    assert torch.equal(got, ref) and graphs.captured == graphs.replays == 0
    said = [r.getMessage() for r in caplog.records if r.name == "moecast.runtime.live.graphs"]
    assert said == [
        "an experts call could not be captured as a graph (RuntimeError: operation not permitted when "
        "stream is capturing): it runs uncaptured"
    ]


def test_a_timed_part_leaves_out_the_transfer_waits_inside_it(monkeypatch):
    """On a logical clock: an expert computation of 5 ms inside which the tier waited 2 ms for a
    transfer counts 3 ms as expert_compute; the layer around it counts all 6 ms (1 ms of policy
    before it) as layers and the 2 ms as transfer_wait, so the parts do not count the wait twice."""
    from types import SimpleNamespace

    from moecast.runtime.live import stats

    now, waited = [0.0], [0.0]
    monkeypatch.setattr(stats, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    times = ForwardTimes(lambda: waited[0])
    times.begin(decode=True)

    def compute():
        now[0] += 0.005
        waited[0] += 0.002
        return "out"

    with times.layer():
        now[0] += 0.001
        assert times.timed("expert_compute", compute) == "out"
    assert times.acc["expert_compute"] == pytest.approx(0.003)
    assert times.acc["layers"] == pytest.approx(0.006)
    assert times.acc["transfer_wait"] == pytest.approx(0.002)
    st = LiveStats()
    st.add_breakdown(6.0, times)
    assert st.policy_decode_ms == [pytest.approx(1.0)] and st.attention_decode_ms == [pytest.approx(0.0)]
