"""Expert weights for the live runtime: every routed expert in host memory, a fixed set of device slots.

SMoE §IV (Fig. 7, "parameter initialisation") keeps every non-shared expert in CPU
memory and a subset resident on the GPU; PreScope §4.4 (AsyncIO) pre-registers the
device buffers once, so a transfer only overwrites a fixed slot (no allocation per
transfer), splits each expert into its gate / up / down matrices and moves the pieces
on separate CUDA streams from pinned host memory with asynchronous copies.

:class:`LayerStore` is that for one MoE layer of a Hugging Face model (one experts
module of transformers' experts interface): ``host`` holds the weights of every expert
(pinned when CUDA is present), ``slots`` the device buffers, ``slot_of`` which expert
each slot holds. :class:`SlotView` presents the slots to the experts implementation the
model already uses, as if they were the module's own weights, so resident experts run
with exactly the model's arithmetic.

On CUDA a copy into a slot waits only for the last kernel that read that slot (one event
recorded on the compute stream after each call that reads slots), not for everything
queued on the compute stream, so a prefetch into layer l+1's slots starts while layer l
computes. Pinned host memory is bounded: the host copies are pinned only when they fit
the pinning budget; otherwise they stay pageable and each transfer goes through a small
ring of pinned staging buffers (``STAGING_BUFFERS`` experts), and ``pinned_bytes`` says
how much is pinned.

On a CPU-only machine the "device" is the CPU: slots are still pre-allocated and loads
really copy weights into them (so what runs is what was loaded), but their duration
comes from the cost model on the live runtime's virtual clock, not from a wall clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from moecast.runtime.tiers.base import CudaOps, Wave
from torch import nn

from moecast.errors import InputError

#: PreScope §4.4 uses one CUDA stream per piece (gate, up, down)
TRANSFER_STREAMS = 3
#: pinned buffers a transfer from pageable host memory goes through; a buffer is reused once its
#: previous copy has landed, so this bounds the pinned memory of the staging path
STAGING_BUFFERS = 4


@dataclass
class Piece:
    """One contiguous part of one expert parameter that is copied as a unit (AsyncIO's sub-transfer)."""

    param: str
    dim: int  # dimension of the per-expert tensor (after the expert index) that is sliced
    start: int
    stop: int


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


def split_pieces(experts: nn.Module, params: dict[str, torch.Tensor]) -> list[Piece]:
    """Gate / up / down pieces (PreScope §4.4): a fused gate_up projection is copied as its two halves."""
    pieces = []
    for name, t in params.items():
        if name == "gate_up_proj" and getattr(experts, "has_gate", False):
            # [E, 2I, H] (or [E, H, 2I] when transposed): the two halves are gate and up
            dim = 1 if not getattr(experts, "is_transposed", False) else 2
            half = t.shape[dim] // 2
            pieces += [Piece(name, dim - 1, 0, half), Piece(name, dim - 1, half, t.shape[dim])]
        else:
            pieces.append(Piece(name, 0, 0, t.shape[1]) if t.dim() > 1 else Piece(name, -1, 0, 0))
    return pieces


def _piece(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The slice of one expert's tensor ``t`` (expert index already applied) that ``piece`` names."""
    if piece.dim < 0:
        return t
    return t.narrow(piece.dim, piece.start, piece.stop - piece.start)


class LayerStore:
    """Host copies of one layer's experts and ``num_slots`` pre-allocated device slots (a
    :class:`moecast.runtime.tiers.base.LayerTier`; :class:`moecast.runtime.tiers.host.HostTier` holds one per layer).

    ``device`` is where slots live: a CUDA device for the real path, the CPU for the
    simulated one. ``ops`` issues the asynchronous copies (default: :class:`CudaOps` on a
    CUDA device, none on the CPU, where copies are synchronous). Host tensors are the
    module's own tensors when they are in host memory; pinning replaces the module's
    tensors by pinned ones of equal value, so nothing is held twice. ``pin`` (default:
    on CUDA) pins the host copies; with ``pin=False`` transfers are staged through
    ``STAGING_BUFFERS`` pinned buffers instead.
    """

    def __init__(
        self,
        experts: nn.Module,
        num_slots: int,
        device: torch.device | str | None = None,
        ops: Any = None,
        pin: bool | None = None,
    ) -> None:
        params = expert_params(experts)
        first = next(iter(params.values()))
        self._setup(experts, num_slots, device if device is not None else first.device, ops)
        can_pin = self.cuda and torch.cuda.is_available()
        pin = can_pin if pin is None else bool(pin) and can_pin
        self.host = {name: _host_copy(experts, name, t, pin) for name, t in params.items()}
        # AsyncIO's pre-registered buffers: allocated once, only ever overwritten
        self.slots = {
            name: torch.empty((self.num_slots, *t.shape[1:]), dtype=t.dtype, device=self.device)
            for name, t in self.host.items()
        }
        self.pieces = split_pieces(experts, self.host)
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host.values())
        self._streams: list[Any] = []
        self._staging: list[dict[str, torch.Tensor]] = []
        self._staging_events: list[list[Any]] = []
        self._next_staging = 0
        if self.ops is not None:
            self._streams = [self.ops.stream() for _ in range(TRANSFER_STREAMS)]
            if not pin:
                self._staging = [
                    {n: _empty_like_row(t, can_pin) for n, t in self.host.items()}
                    for _ in range(STAGING_BUFFERS)
                ]
                self._staging_events = [[] for _ in self._staging]
        # the host copies did not fit the pinning budget: every transfer goes through the staging ring,
        # a host copy then a device copy, which a run reports (stats' staged_copies)
        self.staged = bool(self._staging)
        self.pinned_bytes = self.expert_bytes * (self.num_experts if pin else 0)
        if can_pin:
            self.pinned_bytes += self.expert_bytes * len(self._staging)

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
        self.loads = 0
        self.bytes_moved = 0
        self.wait_s = 0.0  # host time blocked on transfers (disk reads, staging reuse)
        self._events: dict[int, list[Any]] = {}  # slot -> its transfer's events, until waited for
        self._read_events: dict[int, Any] = {}  # slot -> event after the last kernel that read it

    # ------------------------------------------------------------------ residency
    def resident(self) -> np.ndarray:
        """Bool [E]: which experts are in a device slot now."""
        return self.slot_of >= 0

    def free_slot(self) -> int | None:
        empty = np.flatnonzero(self.expert_in < 0)
        return int(empty[0]) if len(empty) else None

    def load(self, expert: int, evict: int | None = None) -> int:
        """Copy ``expert`` into a free slot, or into ``evict``'s slot; returns the slot.

        With ``ops`` the pieces go out on the transfer streams, each after the last kernel
        that read the slot, and the slot records one event per piece; :meth:`wait` makes the
        compute stream wait for them. Without, the copy is synchronous.
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
        self._copy(expert, slot)
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        self.loads += 1
        self.bytes_moved += self.expert_bytes
        return slot

    def source(self, expert: int) -> dict[str, torch.Tensor]:
        """One expert's host tensors, by parameter name (a subclass may read them from elsewhere)."""
        return {name: t[expert] for name, t in self.host.items()}

    def _copy(self, expert: int, slot: int) -> None:
        if self.ops is None:  # a synchronous copy: whole rows (the pieces matter for the streams)
            for name, row in self.source(expert).items():
                self.slots[name][slot].copy_(row)
            return
        src, buffer = self._staged(expert)
        events = self._copy_pieces(src, slot, self._read_events.pop(slot, None))
        self._events[slot] = events
        if buffer is not None:
            self._staging_events[buffer] = events

    def _copy_pieces(self, src: dict[str, torch.Tensor], slot: int, read: Any) -> list[Any]:
        """``src``'s pieces into ``slot`` on the transfer streams; one event per piece marks its landing.

        ``read`` is the event after the last kernel that read the slot: the copies wait for it alone,
        not for everything queued on the compute stream.
        """
        events = []
        for i, p in enumerate(self.pieces):
            # a piece always takes the same stream, so copies into one slot stay in order
            stream = self._streams[i % len(self._streams)]
            if read is not None:
                stream.wait_event(read)
            with self.ops.on(stream):
                _piece(self.slots[p.param][slot], p).copy_(_piece(src[p.param], p), non_blocking=True)
                ev = self.ops.event()
                ev.record(stream)
                events.append(ev)
        return events

    def _staged(self, expert: int) -> tuple[dict[str, torch.Tensor], int | None]:
        """The tensors a transfer reads: pinned host rows, or a staging buffer filled from pageable memory."""
        if not self._staging:
            return self.source(expert), None
        b = self._next_staging
        self._next_staging = (b + 1) % len(self._staging)
        for ev in self._staging_events[b]:  # the buffer's previous transfer must have read it
            ev.synchronize()
        for name, row in self.source(expert).items():
            self._staging[b][name].copy_(row)
        return self._staging[b], b

    def wait(self, slots: np.ndarray | list[int] | None = None) -> None:
        """Make the compute stream wait until the given slots' transfers (all, if None) have landed."""
        if self.ops is None:
            return
        compute = self.ops.current()
        keys = list(self._events) if slots is None else [int(s) for s in slots if int(s) in self._events]
        for s in keys:
            for ev in self._events.pop(s):
                compute.wait_event(ev)

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
        for e in experts:
            if self.free_slot() is None:
                break
            self.load(int(e))

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
        """Release what the store holds beyond its tensors (nothing for host memory)."""


def _host_copy(experts: nn.Module, name: str, t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` in host memory, pinned when asked; a host tensor of the module is replaced by its pinned copy."""
    t = t.detach()
    if t.device.type == "cpu" and not pin:
        return t
    # pinned memory lets the copy engine read host memory directly (asynchronous DMA)
    host = t.to("cpu").contiguous()
    host = host.pin_memory() if pin else host
    if t.device.type == "cpu":
        # equal values in pinned memory: the module keeps working and the weights are held once
        target = experts._parameters if name in experts._parameters else experts._buffers
        if name in experts._parameters:
            target[name].data = host
        else:
            target[name] = host
    return host


def _empty_like_row(t: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(t.shape[1:], dtype=t.dtype, pin_memory=pin)


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
