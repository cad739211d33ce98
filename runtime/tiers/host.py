"""The host-RAM tier: every routed expert in host memory (pinned within a budget), slots on the device.

SMoE §IV (Fig. 7) keeps every non-shared expert in CPU memory and a subset resident on the GPU; each
layer is a :class:`moecast.runtime.tiers.expert_store.LayerStore`. The host copies are pinned only while
their total fits the pinning budget, packed one block an expert so that a transfer is one copy; above it
they stay pageable and every transfer is staged through a few pinned blocks (``staged_layers`` in the
stats). The layers share one transfer stream, the link, which takes copies in the order they are issued.

At a quantized precision (issue 45: copy the packed bytes, dequantize into the slot), on an accelerator
only: each layer's experts are quantized once at open (:meth:`SlotDequantizer.quantize
<moecast.runtime.tiers.precision.SlotDequantizer.quantize>`, i.e. :func:`~moecast.runtime.tiers.precision.quantize_params`
from the model's weights) into packed blocks in host memory, pinned within the same budget; a load
copies the packed block in one copy and the device dequantizes it into the slot on the transfer
stream, so the link moves the quantized bytes and the resident experts compute at the model's dtype.
The model keeps its own expert weights (the packed copy is extra host memory), so detaching leaves it
exact. Without an accelerator the tier refuses a quantized precision: the experts already sit in the
memory that computes them, so a quantized copy would save no link (the disk tier's quantized copies do).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from moecast.runtime.tiers.base import TierSettings, TierSpec
from moecast.runtime.tiers.expert_store import (
    LayerStore,
    expert_params,
    link_stats,
    packed_bytes,
    shared_waits,
)
from moecast.runtime.tiers.precision import Precision, SlotDequantizer

from moecast.errors import InputError


def _refuse_on_cpu(expert_dtype: str) -> InputError:
    return InputError(
        f"expert_dtype={expert_dtype} with offload='ram' needs an accelerator (slots on a CUDA device, or "
        "device_ops='simulated'): on the CPU the experts already sit in the memory that computes them, so "
        "a quantized copy saves no link; use offload='disk' and offload_dir=DIR to read quantized copies"
    )


class HostTier:
    """:class:`moecast.runtime.tiers.base.ExpertTier` over host memory (``offload="ram"``)."""

    name: ClassVar[str] = "ram"
    help: ClassVar[str] = "host memory"
    #: a copy from host memory is synchronous, or the device's stream waits for it
    background_reads: ClassVar[bool] = False

    def __init__(self, layers: list[LayerStore]) -> None:
        self.layers = layers
        self._waits = shared_waits(layers)

    @classmethod
    def check(cls, settings: TierSettings) -> None:
        if settings.offload_dir:  # a directory given for a tier that reads none: the user meant disk
            raise InputError(
                f"offload_dir={settings.offload_dir} is the disk tier's directory, and offload='ram' reads "
                "none: add offload='disk' to read the experts from it"
            )
        if not settings.precision.quantized:
            return
        # slots where the experts are (device None) are known at open, which refuses the CPU there
        on_cpu = settings.device is not None and torch.device(settings.device).type == "cpu"
        if on_cpu and settings.device_ops != "simulated":
            raise _refuse_on_cpu(settings.expert_dtype)

    @classmethod
    def open(cls, model: Any, structure: Any, spec: TierSpec) -> HostTier:
        dev, prec = spec.device, spec.precision
        if prec.quantized and not dev.accelerated:
            raise _refuse_on_cpu(prec.dtype)
        experts = [e.experts for e in structure.layers]
        dequant = [_dequantizer(prec, e) for e in experts]
        # every layer's experts packed (one block an expert) and pinned, or none: pageable beyond the budget
        held = sum(
            packed_bytes(e) if d is None else int(e.num_experts) * d.stored.stride
            for e, d in zip(experts, dequant)
        )
        pin = None if held <= spec.pinned_budget else False
        # one transfer stream, the link: copies reach it in the order they are issued, whichever layer's
        link = dev.ops.stream() if dev.ops is not None else None
        return cls(
            [
                LayerStore(e, spec.capacity, dev.where, ops=dev.ops, pin=pin, stream=link, dequant=d)
                for e, d in zip(experts, dequant)
            ]
        )

    def waited(self) -> float:
        return self._waits.s

    def stats(self) -> dict[str, Any]:
        return dict(
            pinned_bytes=sum(st.pinned_bytes for st in self.layers),
            # layers whose host copies stayed pageable (over the pinning budget): each of their
            # transfers is a host copy into a pinned staging buffer, then the device copy
            staged_layers=sum(st.staged for st in self.layers),
            bytes_read=0,
            disk_reads=0,
            disk_read_gbps_observed=None,
            direct_io=None,
            **link_stats(self.layers),
        )

    @classmethod
    def report(cls, stats: dict[str, Any]) -> list[tuple[str, str]]:
        if not stats.get("staged_layers"):
            return []
        why = "over the pinning budget: --pinned-mb, by default half the memory available"
        return [
            (
                "staged copies",
                f"{stats['staged_layers']} layers' host copies stayed pageable ({why}): each transfer is staged",
            )
        ]

    def close(self) -> None:
        for st in self.layers:
            st.close()


def _dequantizer(prec: Precision, experts: Any) -> SlotDequantizer | None:
    """The layer's dequantizer at a quantized ``prec`` (None at the model's dtype)."""
    if not prec.quantized:
        return None
    if any(t.device.type == "meta" for t in expert_params(experts).values()):
        raise InputError(
            f"expert_dtype={prec.dtype} with offload='ram' quantizes the model's expert weights, and these are "
            "offloaded (meta tensors); load the model whole, or use offload='disk' and offload_dir=DIR"
        )
    return SlotDequantizer(prec, experts)
