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

On a CPU-only machine the "device" is the CPU: slots are still pre-allocated and loads
really copy weights into them (so what runs is what was loaded), but their duration
comes from the cost model on the live runtime's virtual clock, not from a wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

#: PreScope §4.4 uses one CUDA stream per piece (gate, up, down)
TRANSFER_STREAMS = 3


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
        raise ValueError(
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
    """Host copies of one layer's experts and ``num_slots`` pre-allocated device slots.

    ``device`` is where slots live: a CUDA device for the real path, the CPU for the
    simulated one. Host tensors are the module's own tensors when they already are in
    host memory and no pinning is needed (the CPU-only case: nothing is duplicated),
    otherwise pinned host copies.
    """

    def __init__(self, experts: nn.Module, num_slots: int, device: torch.device | str | None = None) -> None:
        self.experts = experts
        self.num_experts = int(experts.num_experts)
        if not 1 <= num_slots <= self.num_experts:
            raise ValueError(f"num_slots must be between 1 and {self.num_experts}, got {num_slots}")
        self.num_slots = int(num_slots)
        params = expert_params(experts)
        first = next(iter(params.values()))
        self.device = torch.device(device) if device is not None else first.device
        self.cuda = self.device.type == "cuda"
        pin = self.cuda and torch.cuda.is_available()
        self.host: dict[str, torch.Tensor] = {}
        for name, t in params.items():
            t = t.detach()
            if t.device.type != "cpu" or pin:
                # pinned memory lets the copy engine read host memory directly (asynchronous DMA)
                t = t.to("cpu").contiguous()
                t = t.pin_memory() if pin else t
            self.host[name] = t
        # AsyncIO's pre-registered buffers: allocated once, only ever overwritten
        self.slots = {
            name: torch.empty((self.num_slots, *t.shape[1:]), dtype=t.dtype, device=self.device)
            for name, t in self.host.items()
        }
        self.pieces = split_pieces(experts, self.host)
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host.values())
        self.slot_of = np.full(self.num_experts, -1, np.int64)  # expert -> slot (-1: host only)
        self.expert_in = np.full(self.num_slots, -1, np.int64)  # slot -> expert (-1: empty)
        self.loads = 0
        self.bytes_moved = 0
        self._streams: list[Any] = []
        self._events: dict[int, list[Any]] = {}
        if self.cuda:
            self._streams = [torch.cuda.Stream(device=self.device) for _ in range(TRANSFER_STREAMS)]

    # ------------------------------------------------------------------ residency
    def resident(self) -> np.ndarray:
        """Bool [E]: which experts are in a device slot now."""
        return self.slot_of >= 0

    def free_slot(self) -> int | None:
        empty = np.flatnonzero(self.expert_in < 0)
        return int(empty[0]) if len(empty) else None

    def load(self, expert: int, evict: int | None = None) -> int:
        """Copy ``expert`` into a free slot, or into ``evict``'s slot; returns the slot.

        On CUDA the pieces go out on the transfer streams from pinned memory and the
        slot records one event per piece; :meth:`wait` makes the compute stream wait
        for them. On the CPU the copy is synchronous.
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

    def _copy(self, expert: int, slot: int) -> None:
        if not self.cuda:
            for p in self.pieces:
                _piece(self.slots[p.param][slot], p).copy_(_piece(self.host[p.param][expert], p))
            return
        compute = torch.cuda.current_stream(self.device)
        events = []
        for i, p in enumerate(self.pieces):
            stream = self._streams[i % len(self._streams)]
            # the slot may still be read by kernels already queued on the compute stream
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                _piece(self.slots[p.param][slot], p).copy_(
                    _piece(self.host[p.param][expert], p), non_blocking=True
                )
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
        self._events[slot] = events

    def wait(self, slots: np.ndarray | list[int] | None = None) -> None:
        """Make the compute stream wait until the given slots' transfers (all, if None) have landed."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        keys = list(self._events) if slots is None else [int(s) for s in slots if int(s) in self._events]
        for s in keys:
            for ev in self._events.pop(s):
                compute.wait_event(ev)

    def fill(self, experts: np.ndarray | list[int]) -> None:
        """Load ``experts`` into free slots (initial placement), as many as fit."""
        for e in experts:
            if self.free_slot() is None:
                break
            self.load(int(e))


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
