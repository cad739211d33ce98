"""The simulated device's timeline (runtime/tiers/simulated.py), worked out by hand on a logical clock.

At 0.001 GB/s (1e6 bytes a second) a copy of 1000 float32 values (4000 bytes) takes 4 ms on the link,
so every figure below is a small whole number of milliseconds.
"""

from __future__ import annotations

import time

import pytest
import torch
from moecast.runtime.tiers.simulated import SimulatedOps

GBPS = 0.001
COPY_MS = 4.0  # 4000 bytes at 1e6 bytes/s


def _ops(now: list[float]) -> SimulatedOps:
    return SimulatedOps(link_gbps=GBPS, clock=lambda: now[0])


def _copy(ops: SimulatedOps, stream) -> None:
    ops.copy(torch.empty(1000), torch.ones(1000), stream)


def test_a_link_rate_not_given_is_pcie4s_24_gb_per_s():
    """The dry run's default link is PCIe 4 x16's effective rate (24 GB/s): 24 MB lands in 1 ms."""
    for given in (None, 0):
        assert SimulatedOps(link_gbps=given).link_gbps == 24.0
    now = [0.0]
    ops = SimulatedOps(clock=lambda: now[0])
    stream = ops.stream()
    ops.copy(torch.empty(6_000_000), torch.ones(6_000_000), stream)  # 24e6 bytes
    assert stream.t == pytest.approx(1.0)


def test_copies_on_one_stream_run_one_after_another_and_an_idle_stream_starts_when_issued():
    now = [0.0]
    ops = _ops(now)
    stream = ops.stream()
    _copy(ops, stream)
    _copy(ops, stream)
    assert stream.t == 2 * COPY_MS  # the second waits for the first
    now[0] = 20.0
    _copy(ops, stream)  # idle since 8 ms: starts at the host's 20 ms
    assert stream.t == 20.0 + COPY_MS
    names = [ops.stream().name for _ in range(2)]
    assert (stream.name, names) == ("copy0", ["copy1", "copy2"])
    assert [e[0] for e in ops.sequence()] == ["copy"] * 3  # no kinds given: every entry
    assert [e[2] for e in ops.sequence("copy")] == [4000] * 3


def test_an_event_is_done_once_the_host_clock_reaches_its_time_or_the_host_waited_for_it():
    now = [0.0]
    ops = _ops(now)
    stream = ops.stream()
    start, end = ops.event(timing=True), ops.event(timing=True)
    start.record(stream)
    _copy(ops, stream)
    end.record(stream)
    assert (start.time, end.time) == (0.0, COPY_MS)
    now[0] = COPY_MS - 0.5
    assert start.query() and not end.query()
    now[0] = COPY_MS  # the device reaches the event exactly now
    assert end.query()
    # a host that waited knows the device passed the event, whatever its own clock says
    now[0] = 0.0
    assert not end.query()
    end.synchronize()
    assert end.query() and end.synced == 1
    start.synchronize()  # waiting for an earlier event does not take the device back in time
    assert end.query()


def test_elapsed_time_is_signed_and_needs_two_timing_events():
    now = [0.0]
    ops = _ops(now)
    stream = ops.stream()
    a, b, plain = ops.event(timing=True), ops.event(timing=True), ops.event()
    a.record(stream)
    _copy(ops, stream)
    _copy(ops, stream)
    b.record(stream)
    plain.record(stream)
    assert a.elapsed_time(b) == 2 * COPY_MS and b.elapsed_time(a) == -2 * COPY_MS
    for x, y in ((a, plain), (plain, a)):
        with pytest.raises(RuntimeError, match="two events made with timing=True"):
            x.elapsed_time(y)
    with pytest.raises(RuntimeError, match="never recorded"):
        a.elapsed_time(ops.event(timing=True))


def test_the_compute_stream_waits_for_the_latest_event_it_was_told_to():
    """Waiting for an event the stream has passed already leaves it where it stands: the compute
    stream at 8 ms (behind two copies) told to wait for the first copy's 4 ms stays at 8 ms."""
    now = [0.0]
    ops = _ops(now)
    stream = ops.stream()
    first, second = ops.event(), ops.event()
    _copy(ops, stream)
    first.record(stream)
    _copy(ops, stream)
    second.record(stream)
    ops.compute.wait_event(second)
    ops.compute.wait_event(first)
    mark = ops.event()
    mark.record(ops.compute)
    assert mark.time == 2 * COPY_MS
    assert [e[0] for e in ops.sequence("wait", "record")] == ["record", "record", "wait", "wait", "record"]


def test_kernels_on_a_copy_stream_leave_the_hosts_clock_and_on_the_compute_stream_stay_in_it():
    """On the host's own clock: a dequantization launched on a copy stream is the device's work (a real
    host issues it and goes on), so the clock does not advance by it; a kernel on the compute stream
    (the host computes) and a graph's replay do advance it. All count in ``device_seconds``."""
    ops = SimulatedOps()
    stream = ops.stream()
    nap = 0.04

    def elapsed(fn) -> float:
        t0 = ops.clock()
        fn()
        return ops.clock() - t0

    assert (
        elapsed(lambda: ops.launch(lambda: time.sleep(nap), stream)) < nap * 1e3 * 0.9
    )  # a launch that ran in the host's time would add the whole nap
    assert elapsed(lambda: ops.launch(lambda: time.sleep(nap), ops.compute)) >= nap * 1e3
    x = torch.zeros(3)

    def slow_add(v: torch.Tensor) -> torch.Tensor:
        time.sleep(nap)
        return v + 1

    replay, _ = ops.capture(slow_add, x)
    assert elapsed(replay) >= nap * 1e3
    # the two launches and the replay, summed (the capture ran as the host)
    assert ops.device_seconds >= 3 * nap
    assert [e[0] for e in ops.sequence("kernel", "graph")] == ["kernel", "kernel", "graph"]


def test_a_simulated_graph_replays_on_its_inputs_current_contents_into_one_buffer():
    ops = SimulatedOps(clock=lambda: 0.0)
    x = torch.tensor([1.0, 2.0])
    replay, out = ops.capture(lambda v: v * 10, x)
    assert out.tolist() == [10.0, 20.0]
    first = out
    x.copy_(torch.tensor([3.0, 4.0]))
    replay()
    assert out is first and out.tolist() == [30.0, 40.0]


# ---------------------------------------------------------------------------------------------------------
# runtime/live/graphs.py on the simulated device's stand-in for a CUDA graph


def _experts(
    view: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """A stand-in experts call whose output depends on every input:
    hidden x sum(weights) + sum(ids) + view."""
    return hidden * weights.sum(-1, keepdim=True) + ids.sum() + view


def test_only_a_one_token_call_without_extra_arguments_or_autograd_is_captured():
    from moecast.runtime.live.graphs import ExpertGraphs

    one, two = torch.zeros(1, 4), torch.zeros(2, 4)
    with torch.no_grad():
        assert ExpertGraphs.takes(one, {})
        assert not ExpertGraphs.takes(two, {})  # a prefill's shapes change every call
        assert not ExpertGraphs.takes(one, {"output": None})
    with torch.enable_grad():
        assert not ExpertGraphs.takes(one, {})


def test_a_graph_replays_with_each_calls_inputs_and_its_outputs_stay_the_callers():
    """By hand: view 100, hidden [1, 2, 3, 4]-like rows, ids summing to 3 then 7, weights summing to 1
    then 2. Each call's output is its own inputs' (every input copied into the static buffers), an
    earlier output is not overwritten by the next replay, the caller's tensors are not the static
    buffers, and a call of other shapes captures a graph of its own."""
    from moecast.runtime.live.graphs import ExpertGraphs

    graphs = ExpertGraphs(SimulatedOps(clock=lambda: 0.0))
    view = torch.tensor(100.0)
    h1, i1, w1 = torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 2]]), torch.tensor([[0.25, 0.75]])
    h2, i2, w2 = torch.tensor([[3.0, 4.0]]), torch.tensor([[3, 4]]), torch.tensor([[0.5, 1.5]])
    with torch.no_grad():
        first = graphs.call(("layer0", "slots"), _experts, view, h1, i1, w1)
        second = graphs.call(("layer0", "slots"), _experts, view, h2, i2, w2)
        assert (graphs.captured, graphs.replays) == (1, 2)
        assert second.tolist() == [[3 * 2 + 7 + 100, 4 * 2 + 7 + 100]]
        assert first.tolist() == [[1 + 3 + 100, 2 + 3 + 100]]
        assert h1.tolist() == [[1.0, 2.0]] and i1.tolist() == [[1, 2]] and w1.tolist() == [[0.25, 0.75]]
        three = graphs.call(("layer0", "slots"), _experts, view, h1, torch.tensor([[1, 2, 3]]), w1)
        assert graphs.captured == 2 and three.tolist() == [[1 + 6 + 100, 2 + 6 + 100]]
