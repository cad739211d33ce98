"""The live runtime's data path, checked on the CPU: slot events, host synchronisations, CPU overlap, pinning."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest
import torch
from moecast.runtime.live import runtime as live
from moecast.runtime.live import transfer
from moecast.runtime.live.runtime import attach, pinned_budget
from moecast.runtime.tiers.expert_store import STAGING_BUFFERS, TRANSFER_STREAMS, LayerStore
from test_live import decode_logits, make_model

torch.set_num_threads(1)


class FakeEvent:
    def __init__(self, log: list) -> None:
        self.log = log
        self.stream = None
        self.synced = 0

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.log.append(("record", stream.name, self))

    def synchronize(self) -> None:
        self.synced += 1


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name = name
        self.log = log

    def wait_event(self, ev: FakeEvent) -> None:
        self.log.append(("wait", self.name, ev))

    def wait_stream(self, other: FakeStream) -> None:  # the old whole-stream wait: must not be used
        self.log.append(("wait_stream", self.name, other.name))


class FakeOps:
    """CUDA's stream and event calls as a log: copies run synchronously on the CPU."""

    def __init__(self) -> None:
        self.log: list = []
        self.compute = FakeStream("compute", self.log)
        self.made = 0

    def stream(self) -> FakeStream:
        self.made += 1
        return FakeStream(f"copy{self.made - 1}", self.log)

    def current(self) -> FakeStream:
        return self.compute

    def event(self) -> FakeEvent:
        return FakeEvent(self.log)

    def on(self, stream: FakeStream):
        import contextlib

        return contextlib.nullcontext()


def _store(pin: bool | None = None, slots: int = 2) -> tuple[LayerStore, FakeOps, torch.nn.Module]:
    experts = make_model("mixtral").model.layers[0].mlp.experts
    ops = FakeOps()
    return LayerStore(experts, num_slots=slots, ops=ops, pin=pin), ops, experts


def test_a_copy_waits_for_the_last_kernel_that_read_its_slot_only():
    store, ops, experts = _store()
    assert ops.made == TRANSFER_STREAMS
    store.fill([0, 1])
    # a fresh slot was never read: its copy waits for nothing, and never for the whole compute stream
    assert not [e for e in ops.log if e[0] in ("wait", "wait_stream")]
    assert set(store._events) == {0, 1} and len(store._events[0]) == len(store.pieces)
    slot0 = list(store._events[0])
    store.wait([0])  # the compute stream waits for slot 0's transfer only
    waits = [e for e in ops.log if e[0] == "wait"]
    assert [w[1] for w in waits] == ["compute"] * len(store.pieces)
    assert [w[2] for w in waits] == slot0
    assert set(store._events) == {1}
    ops.log.clear()
    store.mark_read([0])  # a kernel read slot 0; slot 1 was not read since its load
    (rec,) = ops.log
    assert rec[:2] == ("record", "compute")
    read_ev = rec[2]
    ops.log.clear()
    slot = store.load(5, evict=0)
    assert slot == 0
    # each piece's copy stream waits for exactly that read event, then records its own event
    waits = [e for e in ops.log if e[0] == "wait"]
    assert len(waits) == len(store.pieces) and all(w[2] is read_ev for w in waits)
    assert {w[1] for w in waits} <= {f"copy{i}" for i in range(TRANSFER_STREAMS)}
    assert not [e for e in ops.log if e[0] == "wait_stream"]
    assert 0 not in store._read_events  # the next copy into slot 0 is ordered behind this one
    ops.log.clear()
    store.load(6, evict=1)  # slot 1 was never read: no wait at all
    assert not [e for e in ops.log if e[0] == "wait"]
    assert torch.equal(store.slots["gate_up_proj"][0], experts.gate_up_proj[5])
    assert torch.equal(store.slots["down_proj"][1], experts.down_proj[6])


def test_pageable_host_copies_go_through_a_bounded_staging_ring():
    store, ops, experts = _store(pin=False, slots=3)
    assert len(store._staging) == STAGING_BUFFERS and store.staged  # said in the run's stats
    assert not LayerStore(experts, num_slots=2).staged  # copies within host memory need no staging
    assert store.pinned_bytes == 0  # no CUDA here: the staging buffers are not pinned either
    for k, e in enumerate(range(STAGING_BUFFERS + 2)):
        store.load(e, evict=None if store.free_slot() is not None else int(store.expert_in[k % 3]))
    # the ring wrapped twice: the reused buffers' previous transfer events were waited for on the host
    first = [ev for ev in ops.log if ev[0] == "record" and ev[1] != "compute"][: len(store.pieces)]
    assert all(ev[2].synced == 1 for ev in first)
    for slot, e in enumerate(store.expert_in):
        assert torch.equal(store.slots["gate_up_proj"][slot], experts.gate_up_proj[e])


def test_pinned_budget_is_the_given_size_or_half_the_available_memory():
    assert pinned_budget(0) == 0 and pinned_budget(1.5) == 3 * 2**19
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    assert abs(pinned_budget(None) - avail // 2) < 2**28
    model = make_model("mixtral")
    rt = attach(model, policy="lru", capacity=2)
    try:
        assert rt.stats()["pinned_bytes"] == 0  # nothing is pinned without CUDA
        assert rt.stats()["staged_copies"] == 0
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
