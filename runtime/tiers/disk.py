"""The disk tier: routed experts in an offload directory, read with direct I/O (:mod:`moecast.runtime.tiers.offload`).

A model whose experts are in memory has them written to ``offload_dir`` once (resumable) and dropped
from memory while the tier is open; closing it reads them back from the model-dtype files. A quantized
precision (:mod:`moecast.runtime.tiers.precision`) is a setting of this tier: its files sit beside the
model-dtype ones, are written from them when missing, and are what the reads move.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from moecast.runtime.tiers import offload
from moecast.runtime.tiers.base import TierSettings, TierSpec
from moecast.runtime.tiers.expert_store import expert_params, link_stats

from moecast.errors import InputError


class DiskTier:
    """:class:`moecast.runtime.tiers.base.ExpertTier` over an offload directory (``offload="disk"``)."""

    name: ClassVar[str] = "disk"

    def __init__(
        self,
        layers: list[offload.DiskLayerStore],
        reader: offload.ExpertReader,
        structure: Any,
        model_meta: dict[str, Any],
        dropped: list[torch.device] | None,
    ) -> None:
        self.layers = layers
        self.reader: offload.ExpertReader | None = reader
        self.background_reads = True  # reads land on the I/O threads
        self._structure, self._model_meta = structure, model_meta
        self._dropped = dropped  # where open found the experts it moved to disk (None: it moved none)

    @classmethod
    def check(cls, settings: TierSettings) -> None:
        if not settings.offload_dir:
            raise InputError(
                "offload='disk' needs offload_dir=DIR (the directory the experts are written to and read from)"
            )

    @classmethod
    def open(cls, model: Any, structure: Any, spec: TierSpec) -> DiskTier:
        in_memory = all(
            t.device.type != "meta" for e in structure.layers for t in expert_params(e.experts).values()
        )
        prec, directory = spec.precision, spec.directory
        meta = offload.with_precision(offload.offload_meta(model, structure), structure, prec)
        if not in_memory and offload.missing_layers(directory, meta):
            raise offload.OffloadError(
                f"{directory} does not hold all of this model's experts and the model has none in "
                "memory; load it whole once (moecast run --offload disk writes them)"
            )
        if in_memory or (prec.quantized and offload.missing_layers(directory, meta, prec)):
            # a precision the directory lacks is quantized from its model-dtype files
            offload.write_offload(model, structure, directory, dense=False, precision=prec)
        model_meta = offload.tier_meta(meta, offload.MODEL)
        reader = offload.ExpertReader(directory, offload.tier_meta(meta, prec), threads=spec.io_threads)
        dev = spec.device
        try:
            if dev.where.type == "cpu":
                offload.check_fits(spec.capacity, reader.layouts, spec.capacity_arg)
            link = dev.ops.stream() if dev.ops is not None else None  # one transfer stream, the link
            layers = [
                offload.DiskLayerStore(
                    e.experts, spec.capacity, reader, pos, dev.where, ops=dev.ops, stream=link
                )
                for pos, e in enumerate(structure.layers)
            ]
        except BaseException:
            reader.close()
            raise
        dropped = offload.drop_experts(structure) if in_memory else None
        return cls(layers, reader, structure, model_meta, dropped)

    def waited(self) -> float:
        return sum(st.wait_s for st in self.layers)

    def stats(self) -> dict[str, Any]:
        r = self.reader
        return dict(
            pinned_bytes=sum(st.pinned_bytes for st in self.layers),
            staged_copies=0,  # reads land in pinned staging by design: no pageable fallback
            bytes_read=r.bytes_read if r is not None else 0,
            disk_reads=r.reads if r is not None else 0,
            # the disk as this run saw it, beside the profile's figure the modeled time used
            disk_read_gbps_observed=r.observed_gbps() if r is not None else None,
            direct_io=bool(r.direct) if r is not None else None,
            **link_stats(self.layers),
        )

    def close(self) -> None:
        for st in self.layers:
            st.close()
        if self.reader is None:
            return
        if self._dropped:  # the model gets back the expert weights open moved to disk
            # from the model-dtype files, whatever precision the run read
            exact = offload.ExpertReader(self.reader.directory, self._model_meta, threads=self.reader.threads)
            try:
                offload.restore_experts(self._structure, exact, self._dropped)
            finally:
                exact.close()
            self._dropped = None
        self.reader.close()
        self.reader = None
