"""Moving tensors between the host and the device without stalls, and the host memory they may pin.

:func:`to_host` is the one device-to-host read of a layer (one synchronisation for all its tensors);
:func:`to_device` sends a host tensor without one; :func:`pinned_budget` bounds what the host tier's
copies pin (the rest are staged through a few pinned buffers).
"""

from __future__ import annotations

import torch


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` with at most one synchronisation.

    Device tensors are copied without blocking into pinned buffers (from the caching host
    allocator) and one event is waited for; host tensors are returned as they are (detached).
    """
    tensors = [t.detach() for t in tensors]
    dev = [t for t in tensors if t.device.type == "cuda"]
    if not dev:
        return tensors
    out = []
    for t in tensors:
        if t.device.type != "cuda":
            out.append(t)
            continue
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        out.append(buf)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev[0].device))
    ev.synchronize()
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a synchronisation: pinned, then copied asynchronously."""
    if device.type != "cuda":
        return t
    # the caching host allocator keeps the pinned block until the copy that reads it has run
    return t.pin_memory().to(device, non_blocking=True)


def pinned_budget(pinned_mb: float | None) -> int:
    """Bytes of host memory the runtime may pin: ``pinned_mb``, or half of the memory available now."""
    if pinned_mb is not None:
        return int(pinned_mb * 2**20)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0  # unknown: pin nothing but the staging buffers
    return avail // 2
