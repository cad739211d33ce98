"""The simulated device: CUDA's streams and events on the CPU, in the order the CUDA path issues them.

:class:`SimulatedOps` is a :class:`moecast.runtime.tiers.base.CopyOps` whose copies run at once on the
CPU (the slots are host memory) while its streams and events keep a device timeline, so that the CPU
walks the accelerator's data path (copies queued on a transfer stream, one event each, the compute
stream waiting for them) and a test or a dry run reads what it did:

- ``log``: the calls in issue order, ``("copy", stream, nbytes, dst)``, ``("record", stream, event)``,
  ``("wait", stream, event)``, ``("kernel", stream, kernels)`` (device work queued on a stream: a
  quantized load's dequantization); the latest :data:`LOG_LIMIT` of them, so that a long dry run
  holds a bounded record (each entry is a tracked object: a log growing with every copy made the
  garbage collector's full passes cost a tenth of a decode step's host time, which CUDA's path
  does not pay);
- time (ms): a copy stream runs its copies one after another, each ``nbytes / link_gbps``, starting no
  earlier than the host's clock when issued (a stream idle since then starts now); the compute stream
  is the host (the CPU computes synchronously), so it stands at the host's clock, or later where it
  waited for an event. The host's clock leaves out the link's work that the stand-in does on the
  host's threads (a copy's memcpy, a landed block's dequantization): a real host issues them and goes
  on, so a copy lands at the link's rate, not at the CPU's memcpy rate, and the compute stream waits
  for it where the link is slower than the host. The compute stream's own work (a graph's replay) stays
  in the clock: the compute stream is the host. An event recorded on a stream carries the time the stream reaches it, and
  ``elapsed_time`` subtracts, as CUDA's timing events do;
- completion: an event is done (``query``) once the host's clock has reached its time, or once the
  host waited for it or for a later one (``synchronize``: the device has passed that time), so a
  reader that does not wait sees only what a device at this link would have finished by now.

``clock`` (ms) is the host's clock: ``time.perf_counter`` less the calling thread's link work by
default (a dry run: how long a device with this link would stall at the pace the host issued its
work), a constant in a test (a purely logical timeline whose figures are worked out by hand). Select it
with ``attach(..., device_ops="simulated")``.

Streams and events refer to their ops weakly: the log refers to the events, and a cycle through it
would keep every logged slot tensor (GBs in a dry run of a large model) until a garbage collection
after the runtime that made them is gone.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch

#: the link a simulated copy takes when none is given: PCIe 4 x16's effective host-to-device rate
DEFAULT_LINK_GBPS = 24.0
#: the calls ``SimulatedOps.log`` keeps, the latest
LOG_LIMIT = 20_000


def _wall_ms() -> float:
    return time.perf_counter() * 1e3


class SimEvent:
    """An event on the simulated timeline: ``time`` (ms) is when its stream reached it."""

    def __init__(self, ops: SimulatedOps, timing: bool) -> None:
        self._ops, self.timing = weakref.ref(ops), timing
        self.stream: SimStream | None = None
        self.time: float | None = None
        self.synced = 0  # host waits on it

    def record(self, stream: SimStream) -> None:
        ops = self._live()
        with ops.lock:
            self.stream, self.time = stream, stream.reach()
            ops.log.append(("record", stream.name, self))

    def synchronize(self) -> None:
        self.synced += 1
        ops = self._ops()
        if self.time is not None and ops is not None:  # the host waited until the device passed its time
            with ops.lock:
                ops.reached = max(ops.reached, self.time)

    def query(self) -> bool:
        ops = self._ops()
        if ops is None:  # its device is gone: whatever was queued on it has run
            return self.time is not None
        return self.time is not None and self.time <= max(ops.clock(), ops.reached)

    def _live(self) -> SimulatedOps:
        ops = self._ops()
        if ops is None:
            raise RuntimeError("recording an event of a simulated device that is gone")
        return ops

    def elapsed_time(self, end: SimEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs two events made with timing=True")
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_time of an event that was never recorded")
        return end.time - self.time


class SimStream:
    """A simulated stream: ``t`` (ms) is when the work queued on it so far ends."""

    def __init__(self, ops: SimulatedOps, name: str) -> None:
        self.ops, self.name = weakref.proxy(ops), name
        self.t = float("-inf")

    def reach(self) -> float:
        """When work queued now would start: after the queued work, and not before the host issues it."""
        self.t = max(self.t, self.ops.clock())
        return self.t

    def wait_event(self, ev: SimEvent) -> None:
        with self.ops.lock:
            self.ops.log.append(("wait", self.name, ev))
            if ev.time is not None:
                self.t = max(self.reach(), ev.time)


class SimulatedOps:
    """:class:`moecast.runtime.tiers.base.CopyOps` simulated on the CPU (see the module docstring).

    ``link_gbps``: the simulated link's rate (GB/s, 1e9 bytes); ``clock``: the host's clock in ms.
    """

    pins = False  # host memory is plain: nothing to page-lock

    def __init__(self, link_gbps: float | None = None, clock: Callable[[], float] | None = None) -> None:
        self.link_gbps = float(link_gbps) if link_gbps else DEFAULT_LINK_GBPS
        self._given_clock = clock  # kept apart: a bound method stored here would tie the device to itself
        self.log: deque[tuple] = deque(maxlen=LOG_LIMIT)
        self.lock = threading.RLock()  # the disk tier queues copies from its I/O threads
        self.compute = SimStream(self, "compute")
        self.made = 0  # copy streams made
        self.reached = float("-inf")  # the latest device time the host waited for (ms)
        self._work = threading.local()  # per thread: seconds of the device's work done on it

    def stream(self) -> SimStream:
        with self.lock:
            self.made += 1
            return SimStream(self, f"copy{self.made - 1}")

    def current(self) -> SimStream:
        return self.compute

    def event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self, timing)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream) -> None:
        nbytes = src.numel() * src.element_size()
        with self.lock:  # queued when issued; the CPU's own copy below is the host's time, not the link's
            stream.t = stream.reach() + nbytes / (self.link_gbps * 1e9) * 1e3
            self.log.append(("copy", stream.name, nbytes, dst))
        self._device_work(dst.copy_, src, link=True)

    def launch(self, kernels: Callable[[], None], stream: SimStream) -> None:
        """Run ``kernels()`` now on the CPU, logged ``("kernel", stream, kernels)`` in its place on
        ``stream``; it takes no time on the stream (a profile's dequantize time is in the link rate the
        runtime gives this device: the cost model's ``t_io``)."""
        with self.lock:
            stream.reach()
            self.log.append(("kernel", stream.name, kernels))
        self._device_work(kernels, link=stream is not self.compute)

    def capture(
        self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor
    ) -> tuple[Callable[[], None], torch.Tensor]:
        """A graph, simulated: ``fn`` is called now, and each replay calls it again on the inputs'
        current contents and writes the result into the first call's output buffer, as a CUDA graph's
        replay does (logged ``("graph", "compute", fn)`` at the capture)."""
        with self.lock:
            self.log.append(("graph", self.compute.name, fn))
        out = fn(*inputs)

        def replay() -> None:
            self._device_work(lambda: out.copy_(fn(*inputs)))

        return replay, out

    @property
    def device_seconds(self) -> float:
        """Seconds the calling thread spent doing the device's work (the copies' and kernels' own
        arithmetic, which a real device does while the host goes on): a store counts them as the host's
        wait for the copy, not as its time issuing it."""
        return getattr(self._work, "s", 0.0)

    def clock(self) -> float:
        """The host's clock (ms): the given one, else the calling thread's wall clock without the
        link's work it did."""
        if self._given_clock is not None:
            return self._given_clock()
        return _wall_ms() - getattr(self._work, "link_ms", 0.0)

    def _device_work(self, fn: Callable[..., object], *args: object, link: bool = False) -> None:
        t0, w0 = time.perf_counter(), _wall_ms()  # the link's share on the host clock's own scale
        try:
            fn(*args)
        finally:
            self._work.s = self.device_seconds + time.perf_counter() - t0
            if link:
                self._work.link_ms = getattr(self._work, "link_ms", 0.0) + _wall_ms() - w0

    # ------------------------------------------------------------------ reading the record
    def sequence(self, *kinds: str) -> list[tuple]:
        """The log's entries of ``kinds`` (all, if none), in issue order."""
        return [e for e in self.log if not kinds or e[0] in kinds]
