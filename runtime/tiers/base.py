"""The slow tier's protocol: what the live runtime asks of wherever its non-resident experts live.

A tier is one class behind :class:`ExpertTier` (host RAM: :mod:`moecast.runtime.tiers.host`; an offload
directory: :mod:`moecast.runtime.tiers.disk`), named in :data:`moecast.runtime.tiers.registry.TIERS`, from
which ``LiveConfig.offload`` takes its names. Opened for a model, it gives one :class:`LayerTier` per MoE
layer: that layer's pre-allocated slots on the device and the transfers into them (PreScope §4.4,
AsyncIO). The device is a :class:`Device` handed to the tier: CUDA streams and events, or the CPU standing
in for an accelerator (copies synchronous, their time modeled); the runtime asks it and the tier, never a
device type or a tier name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from moecast.errors import InputError

if TYPE_CHECKING:  # precision imports expert_store, which imports this module
    from moecast.runtime.tiers.precision import Precision

#: what :meth:`LayerTier.cpu_waves` yields: (tensors by name, expert id -> row of those tensors with the
#: sentinel elsewhere, the sentinel = the tensors' expert count)
Wave = tuple[dict[str, torch.Tensor], np.ndarray, int]


class CopyOps(Protocol):
    """The stream and event calls of an asynchronous device (CUDA's: :class:`CudaOps`; the simulated
    device's, which runs them on the CPU and records their order: :class:`moecast.runtime.tiers.simulated.SimulatedOps`).

    A stream has ``wait_event(event)``; an event has ``record(stream)``, ``synchronize()`` (the host
    waits for it), ``query()`` (done yet, without waiting) and ``elapsed_time(end)`` (ms from it to
    ``end``, both made with ``timing``).
    """

    #: host memory can be page-locked for the copy engine (the simulated device allocates it plainly)
    pins: bool

    def stream(self) -> Any: ...

    def current(self) -> Any: ...

    def event(self, timing: bool = False) -> Any: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (asynchronous where the device is)."""
        ...

    def launch(self, kernels: Callable[[], None], stream: Any) -> None:
        """Queue the device kernels ``kernels()`` issues on ``stream``, behind what is queued there."""
        ...

    def capture(
        self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor
    ) -> tuple[Callable[[], None], torch.Tensor]:
        """``fn(*inputs)`` captured as a graph: (its replay, which reruns it on the inputs' current
        contents on the current stream, and its output buffer, which each replay rewrites)."""
        ...


class CudaOps:
    """:class:`CopyOps` on a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pins = torch.cuda.is_available()

    def stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def launch(self, kernels: Callable[[], None], stream: Any) -> None:
        with torch.cuda.stream(stream):
            kernels()

    def capture(
        self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor
    ) -> tuple[Callable[[], None], torch.Tensor]:
        # torch.cuda.graph's recipe without its context manager, which empties the device's and the
        # pinned host memory's caches at every capture (a layer's each): warmed up on a side stream
        # first (lazy initialisations must not fall in the capture), captured there into a memory pool
        # of its own (a shared one is safe only for graphs replayed in their capture order, and a
        # call of another kind is captured later), thread-local (the disk tier's I/O threads go on
        # issuing copies)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn(*inputs)
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = fn(*inputs)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph.replay, out


#: ``LiveConfig.device_ops`` names: how copies reach the slots
DEVICE_OPS = ("auto", "simulated")


@dataclass(frozen=True)
class Device:
    """Where the slots live and how copies reach them.

    ``ops`` issues asynchronous copies (an accelerator beside the host: its streams compute while the
    host decides, copies wait on events), or simulates them on the CPU in the same order
    (:mod:`moecast.runtime.tiers.simulated`); None: the CPU standing in for an accelerator, where copies
    are synchronous and the same cores compute the resident and the CPU experts.
    """

    where: torch.device
    ops: CopyOps | None = None

    @property
    def accelerated(self) -> bool:
        """Copies go through streams and events (CUDA's, or the simulated device's)."""
        return self.ops is not None

    @property
    def simulated(self) -> bool:
        """No accelerator computes here: the CPU does (synchronously, or walking the simulated streams)."""
        return self.ops is None or not isinstance(self.ops, CudaOps)

    @staticmethod
    def accelerates(where: torch.device | str, ops: str = "auto") -> bool:
        """Whether :meth:`at` makes an accelerated device of ``where`` and ``ops`` (CUDA, or simulated)."""
        return ops == "simulated" or torch.device(where).type == "cuda"

    @classmethod
    def at(cls, where: torch.device | str, ops: str = "auto", link_gbps: float | None = None) -> Device:
        """The device at ``where``: ``ops`` auto (CUDA's streams on a CUDA device, else synchronous
        copies) or simulated (streams and events simulated on the CPU, the link at ``link_gbps``)."""
        where = torch.device(where)
        if ops not in DEVICE_OPS:
            raise InputError(f"unknown device_ops {ops!r}; choose one of {', '.join(DEVICE_OPS)}")
        if ops == "simulated":
            if where.type != "cpu":
                raise InputError(
                    f"device_ops='simulated' simulates an accelerator on the CPU; the slots are on {where}: "
                    "drop device=... or use device_ops='auto'"
                )
            from moecast.runtime.tiers.simulated import SimulatedOps

            return cls(where, SimulatedOps(link_gbps=link_gbps))
        return cls(where, CudaOps(where) if where.type == "cuda" else None)


def slot_device(model: Any, structure: Any, given: str | None) -> torch.device:
    """Where a model's slots go: ``given``, else where its experts are, else its first real weight's
    device (a model whose experts are on disk has them on the meta device)."""
    if given:
        return torch.device(given)
    first = structure.layers[0].experts
    for t in [*first.parameters(recurse=False), *first.buffers(recurse=False)]:
        if t.device.type != "meta":
            return t.device
    real = [p.device for p in model.parameters() if p.device.type != "meta"]
    return real[0] if real else torch.device("cpu")


@dataclass(frozen=True)
class TierSpec:
    """What the runtime opens a tier with: the slots, the device and the settings a tier may read."""

    capacity: int  # slots per MoE layer
    device: Device
    precision: Precision
    pinned_budget: int  # bytes of host memory the tier may pin
    capacity_arg: Any = None  # the capacity as given, for messages
    directory: str | None = None  # offload_dir
    io_threads: int = 2


class TierSettings(Protocol):
    """The settings :meth:`ExpertTier.check` reads (``LiveConfig`` has them)."""

    offload_dir: str | None
    expert_dtype: str
    precision: Precision
    device: str | None  # where the slots go (None: where the experts are, known at open)
    device_ops: str  # DEVICE_OPS: ``simulated`` is an accelerator whatever ``device`` is


@runtime_checkable
class LayerTier(Protocol):
    """One MoE layer's experts: ``num_slots`` device slots over the slow tier.

    ``slot_of`` maps expert -> slot (-1: not resident), ``expert_in`` slot -> expert (-1: empty);
    ``slots`` are the slot buffers by parameter name, as the experts implementation reads them.
    """

    num_experts: int
    num_slots: int
    slot_of: np.ndarray
    expert_in: np.ndarray
    slots: dict[str, torch.Tensor]
    loads: int

    def free_slot(self) -> int | None: ...

    def load_many(
        self, experts: np.ndarray | list[int], evict: list[int], prefetch: bool = False
    ) -> list[int]:
        """Copy ``experts`` back to back, each into a free slot or else the slot of the next of ``evict``
        (taken in order); returns their slots (the runtime moves a layer's loads in one call)."""
        ...

    def load(self, expert: int, evict: int | None = None, prefetch: bool = False) -> int:
        """Start copying ``expert`` into a free slot, or into ``evict``'s; returns the slot (``prefetch``:
        no compute waits for it yet, so it never goes on the link ahead of a demand copy in flight)."""
        ...

    def fill(self, experts: np.ndarray | list[int]) -> None:
        """Load ``experts`` into the free slots, as many as fit (initial placement)."""
        ...

    def wait(self, slots: np.ndarray | list[int] | None = None) -> None:
        """Before the compute reads ``slots`` (all if None): their copies have landed, or the device waits for them."""
        ...

    def awaits(self, slots: np.ndarray | list[int] | None = None) -> bool:
        """Whether :meth:`wait` for ``slots`` (all if None) has a copy to wait for (else the runtime skips
        the wait and its timing events)."""
        ...

    def in_flight(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` whose copy the host would still block on, in the order they were started."""
        ...

    def mark_read(self, slots: np.ndarray | list[int]) -> None:
        """Kernels queued now read ``slots``: a later copy into one waits for them."""
        ...

    def cpu_waves(self, experts: np.ndarray, wave: int | None = None) -> Iterator[Wave]:
        """``experts`` in host memory for computing them on the CPU, in waves of at most ``wave``."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ExpertTier(Protocol):
    """The slow tier of a model's routed experts, one :class:`LayerTier` per MoE layer.

    ``background_reads``: a load's bytes arrive on the host later (an I/O thread reads them), so
    without an accelerator the host may compute other experts while they land.
    """

    name: ClassVar[str]
    help: ClassVar[str]  # a few words for ``--offload``'s help: where its experts live
    layers: list[LayerTier]
    background_reads: ClassVar[bool]

    @classmethod
    def check(cls, settings: TierSettings) -> None:
        """Refuse settings this tier cannot run with (one ``InputError`` line), before anything is built."""
        ...

    @classmethod
    def open(cls, model: Any, structure: Any, spec: TierSpec) -> ExpertTier:
        """The tier for ``model``'s experts (``structure``: its MoE layers), slots placed empty."""
        ...

    def waited(self) -> float:
        """Host seconds blocked on transfers so far."""
        ...

    def stats(self) -> dict[str, Any]:
        """What the tier moved and holds, under the names ``LiveRuntime.stats`` reports."""
        ...

    @classmethod
    def report(cls, stats: dict[str, Any]) -> list[tuple[str, str]]:
        """Its rows of ``moecast run``'s text report, (label, text) each, read from a run's stats (the keys
        :meth:`stats` gave among them); [] where it has nothing to say."""
        ...

    def close(self) -> None:
        """Wait for copies in flight, give the model back any expert weights the tier took, release its I/O."""
        ...
