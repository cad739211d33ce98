"""Expert weights for the live runtime: every routed expert in host memory, a fixed set of device slots.

SMoE §IV (Fig. 7, "parameter initialisation") keeps every non-shared expert in CPU
memory and a subset resident on the GPU; PreScope §4.4 (AsyncIO) pre-registers the
device buffers once, so a transfer only overwrites a fixed slot (no allocation per
transfer), and moves experts from pinned host memory with asynchronous copies.

:class:`LayerStore` is that for one MoE layer of a Hugging Face model (one experts
module of transformers' experts interface): ``host`` holds the weights of every expert,
``slots`` the device buffers, ``slot_of`` which expert each slot holds. :class:`SlotView`
presents the slots to the experts implementation the model already uses, as if they were
the module's own weights, so resident experts run with exactly the model's arithmetic.

With an accelerator (a :class:`moecast.runtime.tiers.base.Device`'s ``ops``: CUDA's streams, or the
simulated device's) an expert is one packed block (:mod:`moecast.runtime.tiers.layout`): the host
copies of a layer's experts are one pinned buffer, each expert's tensors contiguous in its block, and
each device slot is one buffer whose views are the tensors, so a transfer is one copy and one event
per expert (PreScope splits an expert into gate / up / down pieces on three streams; one block a copy
costs one launch and one event instead of three, and keeps the link's queue in issue order). Copies go
on the tier's one transfer stream, so a layer's demand loads, issued back to back as one batch, reach
the link before the next layer's prefetch, issued after them (the disk tier, whose reads land out of
order on its I/O threads, keeps that order with :class:`moecast.runtime.tiers.offload.LinkOrder`: a
prefetch copy whose read lands while a demand copy is still being read goes behind it). A copy into a
slot waits only for the last kernel that read that slot (one event recorded on the compute stream after each call that reads
slots), not for everything queued on the compute stream. Pinned host memory is bounded: the host
copies are packed and pinned only when they fit the pinning budget; otherwise they stay where they
are (pageable) and each transfer goes through a small ring of pinned staging blocks
(``STAGING_BUFFERS`` experts), which ``staged`` reports; ``pinned_bytes`` says how much is pinned.

Each copy is timed on the device (a timing mark before it and one after it), so ``link_seconds``
and ``link_bytes`` give the link's observed rate.

At a quantized precision on an accelerator (``dequant``: a
:class:`moecast.runtime.tiers.precision.SlotDequantizer`; issue 45) the host copy is the packed
quantized block (``layout``) and a slot holds the model's tensors (``slot_layout``): the block is
copied in one copy into a device landing block, the dequantize kernels follow it on the transfer
stream (``ops.launch``) and write the slot, and the slot's one event is recorded after them. The link
moves (and ``link_bytes``, ``bytes_moved`` count) the quantized bytes; the module keeps its own
weights.

On a CPU-only machine without ops the "device" is the CPU: slots are still pre-allocated and loads
really copy weights into them (so what runs is what was loaded), synchronously, each copy's wall
time counted as the host's wait for a transfer; the modeled duration comes from the cost model on
the live runtime's virtual clock.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from moecast.runtime.tiers.base import CudaOps, Wave
from moecast.runtime.tiers.layout import MEMORY_ALIGN, ExpertLayout
from moecast.runtime.tiers.pinned import pinned_empty
from torch import nn

from moecast.errors import InputError

#: pinned blocks a transfer from pageable host memory goes through; a block is reused once its
#: previous copy has landed, so this bounds the pinned memory of the staging path
STAGING_BUFFERS = 4


def expert_params(experts: nn.Module) -> dict[str, torch.Tensor]:
    """The experts module's per-expert tensors: parameters and buffers whose first dimension is the expert index."""
    num = int(experts.num_experts)
    tensors = dict(experts.named_parameters(recurse=False))
    tensors.update(dict(experts.named_buffers(recurse=False)))
    out = {name: t for name, t in tensors.items() if t.dim() >= 1 and t.shape[0] == num}
    if not out:
        raise InputError(
            f"{type(experts).__name__} has no per-expert weight tensors (first dimension {num}); "
            "the live runtime needs experts stored as stacked tensors, as transformers' experts interface does"
        )
    return out


def pending_in(pending: dict[int, Any], slots: np.ndarray | list[int] | None) -> bool:
    """Whether any of ``slots`` (any slot, if None) is a key of ``pending`` (a store's copies or reads not
    yet waited for)."""
    if slots is None or not pending:
        return bool(pending)
    return any(int(s) in pending for s in slots)


def packed_bytes(experts: nn.Module) -> int:
    """Bytes of the packed host copy of one layer's experts (what :class:`LayerStore` pins)."""
    layout = ExpertLayout.of(expert_params(experts), MEMORY_ALIGN)
    return int(experts.num_experts) * layout.stride


def link_stats(layers: list[LayerStore]) -> dict[str, Any]:
    """The transfers into the slots as the device timed them (every copy landed first): their bytes, their
    time on the link (ms) and the link's observed rate (GB/s, 1e9 bytes; None before a copy); and the
    host's mean time to issue one copy to an accelerator (``copy_issue_ms``, the profile's
    ``load_host_ms`` as this run paid it; None where the host issued none: synchronous copies, or a
    disk tier's, which its I/O threads issue)."""
    for st in layers:
        st.settle(block=True)
    nbytes, seconds = sum(st.link_bytes for st in layers), sum(st.link_seconds for st in layers)
    issued = sum(st.issued for st in layers)
    return dict(
        link_bytes=int(nbytes),
        link_ms=seconds * 1e3,
        link_gbps_observed=nbytes / seconds / 1e9 if seconds > 0 else None,
        copy_issue_ms=sum(st.issue_seconds for st in layers) / issued * 1e3 if issued else None,
    )


class Waits:
    """Host seconds blocked on transfers. A tier's layers share one (:func:`shared_waits`): the
    runtime reads the total around every timed part of every layer, so it is one number, not a sum."""

    __slots__ = ("s",)

    def __init__(self) -> None:
        self.s = 0.0


def shared_waits(layers: list[Any]) -> Waits:
    """One :class:`Waits` for ``layers`` (a tier's stores), starting at what they waited so far."""
    waits = Waits()
    for st in layers:
        waits.s += st.waits.s
        st.waits = waits
    return waits


class LayerStore:
    """Host copies of one layer's experts and ``num_slots`` pre-allocated device slots (a
    :class:`moecast.runtime.tiers.base.LayerTier`; :class:`moecast.runtime.tiers.host.HostTier` holds one per layer).

    ``device`` is where slots live: a CUDA device for the real path, the CPU for the
    simulated one. ``ops`` issues the asynchronous copies (default: :class:`CudaOps` on a
    CUDA device, none on the CPU, where copies are synchronous); ``stream`` is the transfer
    stream (the tier's one link; default: a stream of the store's own). With ``ops`` the host
    copies are packed in one block per expert (``layout``), pinned where ``ops`` pins; the
    module's host tensors are replaced by views of equal value into it, so nothing is held
    twice. ``pin=False`` leaves them where they are, and transfers are staged through
    ``STAGING_BUFFERS`` pinned blocks instead.
    """

    def __init__(
        self,
        experts: nn.Module,
        num_slots: int,
        device: torch.device | str | None = None,
        ops: Any = None,
        pin: bool | None = None,
        stream: Any = None,
        dequant: Any = None,
    ) -> None:
        params = expert_params(experts)
        first = next(iter(params.values()))
        self._setup(experts, num_slots, device if device is not None else first.device, ops)
        self.slot_layout = ExpertLayout.of(params, MEMORY_ALIGN)
        if dequant is not None:  # the host holds the packed copy; the slots the model's dtype
            if self.ops is None:
                raise ValueError("dequantizing into the slots needs a device with ops (an accelerator)")
            # on the slots' device: an accelerator quantizes a layer in a fraction of the host's time
            params = dequant.quantize(params, self.device)
        self.layout = layout = dequant.stored if dequant is not None else self.slot_layout
        self.expert_bytes = layout.expert_bytes
        self.pinned_bytes = 0
        self._staging: list[torch.Tensor] = []
        self._staging_events: list[list[Any]] = []
        self._next_staging = 0
        if self.ops is None:  # synchronous copies within memory: the module's tensors, slots per tensor
            self.host = {name: _host_tensor(t) for name, t in params.items()}
            self.slots = {
                name: torch.empty((self.num_slots, *t.shape[1:]), dtype=t.dtype, device=self.device)
                for name, t in self.host.items()
            }
            self.staged = False
            return
        self._streams = [stream if stream is not None else self.ops.stream()]
        pins = bool(self.ops.pins)
        if pin is None or pin:
            packed = None if dequant is not None else packed_block(params, layout, self.num_experts, pins)
            self._host_raw = (
                packed if packed is not None else _empty_bytes(self.num_experts * layout.stride, pins)
            )
            self.host = layout.views(self._host_raw, self.num_experts)
            for name, t in params.items():
                if packed is not None:  # the module's tensors are these views already
                    continue
                if dequant is None:
                    _adopt(experts, name, t, self.host[name])
                else:  # the module keeps its own weights: detach gives the model back exactly
                    self.host[name].copy_(t)
            self.pinned_bytes = self._host_raw.numel()
        else:
            # the host copies did not fit the pinning budget: every transfer goes through the staging ring,
            # a host copy then a device copy, which a run reports (stats' staged_layers)
            self.host = {name: _host_tensor(t) for name, t in params.items()}
            self._staging = [_empty_bytes(layout.stride, pins) for _ in range(STAGING_BUFFERS)]
            self._staging_events = [[] for _ in self._staging]
            self.pinned_bytes = layout.stride * len(self._staging)
        self.staged = bool(self._staging)
        # AsyncIO's pre-registered buffers: allocated once, only ever overwritten; one block a slot
        self.dequant = dequant
        self._slot_raw, self.slots, self._landing = device_slots(self, dequant)

    def _setup(self, experts: nn.Module, num_slots: int, device: torch.device | str, ops: Any) -> None:
        """The slot bookkeeping every store shares (``device`` and ``ops`` as in the class docstring)."""
        self.experts = experts
        self.num_experts = int(experts.num_experts)
        if not 1 <= num_slots <= self.num_experts:
            raise InputError(f"num_slots must be between 1 and {self.num_experts}, got {num_slots}")
        self.num_slots = int(num_slots)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.ops = ops if ops is not None else (CudaOps(self.device) if self.cuda else None)
        self.slot_of = np.full(self.num_experts, -1, np.int64)  # expert -> slot (-1: host only)
        self.expert_in = np.full(self.num_slots, -1, np.int64)  # slot -> expert (-1: empty)
        # slots are only ever filled (a load into a full store takes the slot of the expert it evicts),
        # so the empty ones are the last: slots [filled, num_slots)
        self._filled = 0
        # each expert's block of the host copies and each slot's block, as views made once: a slice
        # costs microseconds, twice a copy
        self._host_blocks: list[torch.Tensor] | None = None
        self._slot_blocks: list[torch.Tensor] | None = None
        self.loads = 0
        self.bytes_moved = 0
        self.waits = Waits()  # host time blocked on transfers: synchronous copies, staging waits, disk reads
        # an accelerator's copies: the host's time issuing them (not a wait: the host works meanwhile), and
        # how many it issued
        self.issue_seconds = 0.0
        self.issued = 0
        self.link_seconds = 0.0  # the copies' time on the link (device events; the wall clock without ops)
        self.link_bytes = 0  # the bytes those copies moved
        self._timed: list[tuple[Any, Any, int]] = []  # (start, landing, bytes) of copies not yet read
        self._lock = threading.Lock()
        self._streams: list[Any] = []
        self._events: dict[int, list[Any]] = {}  # slot -> its transfer's events, until waited for
        self._read_events: dict[int, Any] = {}  # slot -> event after the last kernel that read it
        self.dequant: Any = None  # a SlotDequantizer: the slots hold its dequantized weights
        self._landing: torch.Tensor | None = None

    # ------------------------------------------------------------------ residency
    def resident(self) -> np.ndarray:
        """Bool [E]: which experts are in a device slot now."""
        return self.slot_of >= 0

    def free_slot(self) -> int | None:
        return self._filled if self._filled < self.num_slots else None

    def load(self, expert: int, evict: int | None = None, prefetch: bool = False) -> int:
        """Copy ``expert`` into a free slot, or into ``evict``'s slot; returns the slot.

        With ``ops`` the expert's block goes out on the transfer stream in one copy, after the last
        kernel that read the slot, and the slot records its one event; :meth:`wait` makes the compute
        stream wait for it. Without, the copy is synchronous. ``prefetch``: no compute waits for it yet
        (a prefetch), so a store whose copies are queued later than issued (the disk tier's) queues it
        after the demand copies issued meanwhile; here copies are queued as issued.
        """
        expert = int(expert)
        if self.slot_of[expert] >= 0:
            return int(self.slot_of[expert])
        if evict is not None:
            slot = int(self.slot_of[int(evict)])
            if slot < 0:
                raise ValueError(f"cannot evict expert {evict}: it is not resident")
            self.slot_of[int(evict)] = -1
        else:
            free = self.free_slot()
            if free is None:
                raise ValueError(f"all {self.num_slots} slots are full; name an expert to evict")
            slot = free
        self._copy(expert, slot, prefetch)
        self._filled += int(evict is None)  # once the copy went out: a failed one leaves the slot free
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        self.loads += 1
        self.bytes_moved += self.moved_bytes(slot)
        return slot

    def moved_bytes(self, slot: int) -> int:
        """The bytes the last copy into ``slot`` moved: one expert's (a tier of two copies: the copy's)."""
        return self.expert_bytes

    def load_many(
        self, experts: np.ndarray | list[int], evict: list[int], prefetch: bool = False
    ) -> list[int]:
        """Copy ``experts`` back to back, each into a free slot or else the slot of the next of ``evict``
        (taken in order); returns their slots. With ``ops`` they are one batch on the transfer stream:
        the link runs them one after another before anything issued later (``prefetch``: :meth:`load`)."""
        evict, out = list(evict), []
        for e in experts:
            free = self.free_slot() is None and evict
            out.append(self.load(int(e), evict=evict.pop(0) if free else None, prefetch=prefetch))
        return out

    def source(self, expert: int) -> dict[str, torch.Tensor]:
        """One expert's host tensors, by parameter name (a subclass may read them from elsewhere)."""
        return {name: t[expert] for name, t in self.host.items()}

    def _copy(self, expert: int, slot: int, prefetch: bool = False) -> None:
        """The host's part of a transfer: the whole copy where it is synchronous, its wall time counted as
        the host's wait for transfers; else filling a staging block and queueing the copy (in issue
        order, ``prefetch`` or not), where only a staging block's wait for its previous copy is a
        wait (and a simulated device's own work, done on this thread) and the rest is the host's
        issue time (``issue_seconds``: host work, which a split counts as the runtime's, not as a
        wait for the link)."""
        t0 = time.perf_counter()
        if self.ops is None:
            try:
                for name, row in self.source(expert).items():
                    self.slots[name][slot].copy_(row)
                self.link_seconds += time.perf_counter() - t0  # the copy is the host's: its wall time
                self.link_bytes += self.expert_bytes
            finally:
                self.waits.s += time.perf_counter() - t0
            return
        blocked = 0.0
        # a simulated device does the copy's own work on this thread: that is the device's time, a wait
        device0 = getattr(self.ops, "device_seconds", 0.0)
        try:
            src, buffer, blocked = self._staged(expert)
            events = self._copy_block(src, slot, self._read_events.pop(slot, None))
            self._events[slot] = events
            if buffer is not None:
                self._staging_events[buffer] = events
        finally:
            blocked += getattr(self.ops, "device_seconds", 0.0) - device0
            self.waits.s += blocked
            self.issue_seconds += time.perf_counter() - t0 - blocked
            self.issued += 1

    def _copy_block(self, src: torch.Tensor, slot: int, read: Any) -> list[Any]:
        """``src`` (one expert's block, bytes) into ``slot``'s block on the transfer stream in one copy;
        its one event marks the landing (what the compute stream waits for).

        ``read`` is the event after the last kernel that read the slot: the copy waits for it alone, not
        for everything queued on the compute stream. A timing mark before the copy records where it
        starts: the link may have idled since the copy before it (the host issued it later than that
        one landed), so the previous landing would count the idle time as the copy's.
        """
        with self._lock:  # the disk tier copies from its I/O threads
            stream = self._streams[0]
            if read is not None:
                stream.wait_event(read)
            start = self.ops.event(timing=True)
            start.record(stream)
            # a block may be shorter than the slot's (a two-copy tier's low copy): its bytes, from the start;
            # a packed copy to dequantize lands in the landing block
            if self._slot_blocks is None:
                self._slot_blocks = [self.slot_layout.block(self._slot_raw, s) for s in range(self.num_slots)]
            dst = self._slot_blocks[slot] if self.dequant is None else self._landing
            self.ops.copy(dst if dst.numel() == src.numel() else dst[: src.numel()], src, stream)
            copied = self.ops.event(timing=True)
            copied.record(stream)
            self._timed.append((start, copied, int(src.numel())))  # the link's time: the copy alone
            ev = copied
            if self.dequant is not None:
                # on the transfer stream, behind its copy: the slot's one event marks the weights written
                one = {name: t[slot] for name, t in self.slots.items()}
                self.ops.launch(functools.partial(self.dequant, self._landing, one), stream)
                ev = self.ops.event()
                ev.record(stream)
            self._settle(False)
            return [ev]

    def _staged(self, expert: int) -> tuple[torch.Tensor, int | None, float]:
        """The block a transfer reads: the expert's pinned block, or a staging block filled from pageable
        memory; and the seconds the host waited for that block's previous transfer to read it."""
        if not self._staging:
            if self._host_blocks is None:
                self._host_blocks = [self.layout.block(self._host_raw, e) for e in range(self.num_experts)]
            return self._host_blocks[expert], None, 0.0
        b = self._next_staging
        self._next_staging = (b + 1) % len(self._staging)
        t0 = time.perf_counter()
        for ev in self._staging_events[b]:  # the block's previous transfer must have read it
            ev.synchronize()
        blocked = time.perf_counter() - t0
        views = self.layout.views(self._staging[b], 1)
        for name, row in self.source(expert).items():
            views[name][0].copy_(row)
        return self._staging[b], b, blocked

    def settle(self, block: bool = False) -> None:
        """Add the copies that have landed to ``link_seconds`` and ``link_bytes`` (``block``: wait for
        all of them first), reading their events without waiting on the device otherwise."""
        with self._lock:
            self._settle(block)

    def _settle(self, block: bool) -> None:
        done = 0
        for start, end, nbytes in self._timed:  # one stream: they land in issue order
            if block:
                end.synchronize()
            elif not end.query():
                break
            self.link_seconds += start.elapsed_time(end) / 1e3
            self.link_bytes += nbytes
            done += 1
        del self._timed[:done]

    def wait(self, slots: np.ndarray | list[int] | None = None) -> None:
        """Make the compute stream wait until the given slots' transfers (all, if None) have landed."""
        if self.ops is None:
            return
        compute = self.ops.current()
        keys = list(self._events) if slots is None else [int(s) for s in slots if int(s) in self._events]
        for s in keys:
            for ev in self._events.pop(s):
                compute.wait_event(ev)

    def awaits(self, slots: np.ndarray | list[int] | None = None) -> bool:
        """Whether :meth:`wait` for ``slots`` (all, if None) has a transfer to wait for: a copy whose event
        the compute stream has not been made to wait for yet."""
        return pending_in(self._events, slots)

    def in_flight(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` whose transfer the host would still block on, in the order they were
        started (none here: a host-memory store copies synchronously, a device's stream waits alone)."""
        return np.zeros(0, np.int64)

    def mark_read(self, slots: np.ndarray | list[int]) -> None:
        """Record that kernels now queued on the compute stream read ``slots``; a copy into one waits for them."""
        if self.ops is None or not len(slots):
            return
        ev = self.ops.event()
        ev.record(self.ops.current())
        for s in slots:
            self._read_events[int(s)] = ev

    def fill(self, experts: np.ndarray | list[int]) -> None:
        """Load ``experts`` into free slots (initial placement), as many as fit."""
        room = int((self.expert_in < 0).sum())
        self.load_many([int(e) for e in experts if self.slot_of[int(e)] < 0][:room], [])

    def cpu_waves(self, experts: np.ndarray, wave: int | None = None) -> Iterator[Wave]:
        """Host tensors that hold ``experts`` for computing them on the CPU, in waves (each a subset of
        ``experts``, together all of them once; ``wave``: at most that many each, where a store reads
        them): (tensors by name, expert id -> row of those tensors with the sentinel elsewhere, the
        sentinel = the tensors' expert count). The host copies hold every
        expert already: one wave."""
        table = np.full(self.num_experts, self.num_experts, np.int64)
        table[experts] = experts
        yield self.host, table, self.num_experts

    def close(self) -> None:
        """Drop the store's buffers: its packed host copies (a module keeps the views it adopted), staging
        blocks and slots. A detached runtime can outlive its detach in reference cycles; without this its
        pinned host memory and device slots would wait for the next garbage collection, and a process that
        attaches again (a benchmark's next row) would hold two sets."""
        self.host, self.slots, self._staging = {}, {}, []
        self._host_raw = self._slot_raw = self._landing = None
        self._host_blocks = self._slot_blocks = None


def device_slots(
    store: LayerStore, dequant: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """A store's slots on its device: their bytes (one ``slot_layout`` block a slot), the tensors over
    them, and with ``dequant`` the device block a packed copy lands in before it is dequantized into its
    slot (one: the copies and dequantizations into it queue on the one transfer stream, each behind the
    one before)."""
    raw = torch.empty(store.num_slots * store.slot_layout.stride, dtype=torch.uint8, device=store.device)
    landing = None
    if dequant is not None:
        landing = torch.empty(store.layout.stride, dtype=torch.uint8, device=store.device)
        dequant.prepare(store.device)
    return raw, store.slot_layout.views(raw, store.num_slots), landing


def _host_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (the module's own tensor where it is there)."""
    t = t.detach()
    return t if t.device.type == "cpu" else t.to("cpu")


def _empty_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked when ``pin`` (the copy engine then reads it directly: DMA),
    exactly its bytes (:func:`~moecast.runtime.tiers.pinned.pinned_empty`)."""
    return pinned_empty(nbytes) if pin else torch.empty(nbytes, dtype=torch.uint8)


def packed_block(
    params: dict[str, torch.Tensor], layout: ExpertLayout, n: int, pinned: bool
) -> torch.Tensor | None:
    """The packed host block that ``params`` already are views of, else None.

    A store adopts its packed views into the module (:func:`_adopt`), so a second attach to the same model
    finds its experts packed, and pinned where ``pinned``. It takes that block as it is: no second copy of
    every expert and no second page-locking (an attach of DeepSeek-V2-Lite's 29 GB costs seconds of
    each). Each tensor must be exactly this layout's view of the block: its memory, shape and strides.
    """
    storage = next(iter(params.values())).untyped_storage()
    if storage.device.type != "cpu" or storage.nbytes() != n * layout.stride:
        return None
    base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    if pinned and not base.is_pinned():
        return None
    want = layout.views(base, n)
    for name, t in params.items():
        w = want.get(name)
        if w is None or (t.data_ptr(), t.shape, t.stride(), t.dtype) != (
            w.data_ptr(),
            w.shape,
            w.stride(),
            w.dtype,
        ):
            return None
    return base


def _adopt(experts: nn.Module, name: str, t: torch.Tensor, packed: torch.Tensor) -> None:
    """``packed`` takes ``t``'s values; a host tensor of the module is replaced by it (equal values, held once)."""
    with torch.no_grad():
        packed.copy_(t.detach())
    if t.device.type != "cpu":
        return
    if name in experts._parameters:
        experts._parameters[name].data = packed
    else:
        experts._buffers[name] = packed


class SlotView:
    """The experts module seen through its device slots: ``num_experts`` is the slot count.

    Every per-expert tensor resolves to the slot buffers, everything else (activation,
    gating, flags, config) to the module, so the model's own experts implementation can
    run on it with slot indices in place of expert ids.
    """

    def __init__(
        self, module: nn.Module, tensors: dict[str, torch.Tensor], num_experts: int, sentinel: bool
    ) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_tensors", tensors)
        object.__setattr__(self, "num_experts", num_experts)
        # ids equal to num_experts mark (token, slot) pairs computed elsewhere; the
        # expert-parallel path of every experts implementation skips them with zero weight
        object.__setattr__(self, "_is_expert_parallel", sentinel)

    def __getattr__(self, name: str) -> Any:
        tensors = object.__getattribute__(self, "_tensors")
        if name in tensors:
            return tensors[name]
        return getattr(object.__getattribute__(self, "_module"), name)
