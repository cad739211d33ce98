"""The disk tier: routed experts in an offload directory, read with direct I/O (:mod:`moecast.runtime.tiers.offload`).

A model whose experts are in memory has them written to ``offload_dir`` once (resumable) and dropped
from memory while the tier is open; closing it reads them back from the model-dtype files. A quantized
precision (:mod:`moecast.runtime.tiers.precision`) is a setting of this tier: its files sit beside the
model-dtype ones, are written from them when missing, and are what the reads move. Two copies
(:class:`moecast.runtime.tiers.precision.TwoCopies`, :mod:`moecast.runtime.core.mixed`) are two such
settings at once: the tier reads the high copy into slots sized for it and the low one where the
step asks (:class:`moecast.runtime.tiers.offload.DiskLayerStore`), both on one I/O pool.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from moecast.runtime.tiers import offload
from moecast.runtime.tiers.base import TierSettings, TierSpec
from moecast.runtime.tiers.expert_store import expert_params, link_stats, shared_waits
from moecast.runtime.tiers.precision import TwoCopies

from moecast.errors import InputError


class DiskTier:
    """:class:`moecast.runtime.tiers.base.ExpertTier` over an offload directory (``offload="disk"``)."""

    name: ClassVar[str] = "disk"
    help: ClassVar[str] = "``--offload_dir``, read with direct I/O"
    #: the offload directory keeps every precision's copy beside the model-dtype one: two copies fit
    holds_copies: ClassVar[bool] = True
    background_reads: ClassVar[bool] = True  # reads land on the I/O threads

    def __init__(
        self,
        layers: list[offload.DiskLayerStore],
        reader: offload.ExpertReader,
        structure: Any,
        model_meta: dict[str, Any],
        dropped: list[torch.device] | None,
        low_reader: offload.ExpertReader | None = None,
    ) -> None:
        self.layers = layers
        self._waits = shared_waits(layers)
        self.reader: offload.ExpertReader | None = reader
        self.low_reader = low_reader  # the low copy's files (two copies), on the reader's pool
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
        copies = [prec.high, prec.low] if isinstance(prec, TwoCopies) else [prec]
        meta = offload.offload_meta(model, structure)
        for p in copies:
            meta = offload.with_precision(meta, structure, p)
        if not in_memory and offload.missing_layers(directory, meta):
            raise offload.OffloadError(
                f"{directory} does not hold all of this model's experts and the model has none in "
                "memory; load it whole once (moecast run --offload disk writes them)"
            )
        for i, p in enumerate(copies):
            if (in_memory and i == 0) or (p.quantized and offload.missing_layers(directory, meta, p)):
                # a precision the directory lacks is quantized from its model-dtype files
                offload.write_offload(model, structure, directory, dense=False, precision=p)
        model_meta = offload.tier_meta(meta, offload.MODEL)
        reader = offload.ExpertReader(directory, offload.tier_meta(meta, copies[0]), threads=spec.io_threads)
        low = None
        dev = spec.device
        try:
            if len(copies) > 1:
                low = offload.ExpertReader(
                    directory, offload.tier_meta(meta, copies[1]), threads=spec.io_threads, pool=reader.pool
                )
            if dev.where.type == "cpu":
                offload.check_fits(spec.capacity, reader.layouts, spec.capacity_arg)
            link = dev.ops.stream() if dev.ops is not None else None  # one transfer stream, the link
            order = offload.LinkOrder()  # and the order copies take on it: demand before prefetch
            kw = dict(ops=dev.ops, low_reader=low, stream=link, order=order)
            # one quantized copy on an accelerator: the packed block is copied, then dequantized into
            # the slot on the device (the CPU computes on the packed slots with its weight-only kernels)
            dequant = dev.accelerated and prec.quantized and low is None
            layers = []
            for pos, e in enumerate(structure.layers):
                dq = offload.SlotDequantizer(prec, e.experts, reader.layouts[pos]) if dequant else None
                layers.append(
                    offload.DiskLayerStore(e.experts, spec.capacity, reader, pos, dev.where, **kw, dequant=dq)
                )
        except BaseException:
            if low is not None:
                low.close()
            reader.close()
            raise
        dropped = offload.drop_experts(structure) if in_memory else None
        return cls(layers, reader, structure, model_meta, dropped, low)

    def waited(self) -> float:
        return self._waits.s

    def stats(self) -> dict[str, Any]:
        r, lo = self.reader, self.low_reader
        low_bytes, low_reads = (lo.bytes_read, lo.reads) if lo is not None and r is not None else (0, 0)
        return dict(
            pinned_bytes=sum(st.pinned_bytes for st in self.layers),
            staged_layers=0,  # reads land in pinned staging by design: no pageable fallback
            # both copies' reads; the low copy's (two copies) also apart, and the slots reread high
            bytes_read=(r.bytes_read if r is not None else 0) + low_bytes,
            disk_reads=(r.reads if r is not None else 0) + low_reads,
            low_bytes_read=low_bytes,
            low_disk_reads=low_reads,
            upgrade_reads=sum(st.upgrades for st in self.layers),
            # the disk as this run saw it, beside the profile's figure the modeled time used
            disk_read_gbps_observed=_observed_gbps(r, lo) if r is not None else None,
            direct_io=bool(r.direct) if r is not None else None,
            **link_stats(self.layers),
        )

    @classmethod
    def report(cls, stats: dict[str, Any]) -> list[tuple[str, str]]:
        io = "direct I/O" if stats["direct_io"] else "buffered reads, pages dropped (no O_DIRECT)"
        gbps = stats.get("disk_read_gbps_observed")
        rate = f", {gbps:.2f} GB/s while reading" if gbps else ""
        mib = stats["bytes_read"] / 2**20
        return [("disk reads", f"{stats['disk_reads']} ({mib:.1f} MiB, {io}; whole 4 KiB blocks{rate})")]

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
        if self.low_reader is not None:
            self.low_reader.close()
            self.low_reader = None
        self.reader.close()
        self.reader = None


def _observed_gbps(reader: offload.ExpertReader, low: offload.ExpertReader | None) -> float | None:
    """The disk's read rate over the time a read was in flight, both copies' (their busy times add:
    an upper bound on the time, so a lower bound on the rate, where reads of the two overlapped)."""
    if low is None:
        return reader.observed_gbps()
    busy = reader.busy_s + low.busy_s
    return (reader.bytes_read + low.bytes_read) / busy / 1e9 if busy > 0 else None
