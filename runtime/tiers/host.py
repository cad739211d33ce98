"""The host-RAM tier: every routed expert in host memory (pinned within a budget), slots on the device.

SMoE §IV (Fig. 7) keeps every non-shared expert in CPU memory and a subset resident on the GPU; each
layer is a :class:`moecast.runtime.tiers.expert_store.LayerStore`. The host copies are pinned only while
their total fits the pinning budget, packed one block an expert so that a transfer is one copy; above it
they stay pageable and every transfer is staged through a few pinned blocks (``staged_copies`` in the
stats). The layers share one transfer stream, the link, which takes copies in the order they are issued.
"""

from __future__ import annotations

from typing import Any, ClassVar

from moecast.runtime.tiers.base import TierSettings, TierSpec
from moecast.runtime.tiers.expert_store import LayerStore, link_stats, packed_bytes

from moecast.errors import InputError


class HostTier:
    """:class:`moecast.runtime.tiers.base.ExpertTier` over host memory (``offload="ram"``)."""

    name: ClassVar[str] = "ram"

    def __init__(self, layers: list[LayerStore]) -> None:
        self.layers = layers
        self.background_reads = False  # a copy from host memory is synchronous, or the device's stream waits

    @classmethod
    def check(cls, settings: TierSettings) -> None:
        if settings.precision.quantized:
            raise InputError(
                f"expert_dtype={settings.expert_dtype} needs offload='disk' and offload_dir=DIR (the quantized "
                "copies live in the offload directory)"
            )

    @classmethod
    def open(cls, model: Any, structure: Any, spec: TierSpec) -> HostTier:
        experts = [e.experts for e in structure.layers]
        # every layer's experts packed (one block an expert) and pinned, or none: pageable beyond the budget
        pin = None if sum(packed_bytes(e) for e in experts) <= spec.pinned_budget else False
        dev = spec.device
        # one transfer stream, the link: copies reach it in the order they are issued, whichever layer's
        link = dev.ops.stream() if dev.ops is not None else None
        return cls(
            [LayerStore(e, spec.capacity, dev.where, ops=dev.ops, pin=pin, stream=link) for e in experts]
        )

    def waited(self) -> float:
        return sum(st.wait_s for st in self.layers)

    def stats(self) -> dict[str, Any]:
        return dict(
            pinned_bytes=sum(st.pinned_bytes for st in self.layers),
            # layers whose host copies stayed pageable (over the pinning budget): each of their
            # transfers is a host copy into a pinned staging buffer, then the device copy
            staged_copies=sum(st.staged for st in self.layers),
            bytes_read=0,
            disk_reads=0,
            disk_read_gbps_observed=None,
            direct_io=None,
            **link_stats(self.layers),
        )

    def close(self) -> None:
        for st in self.layers:
            st.close()
