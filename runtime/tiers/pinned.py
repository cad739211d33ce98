"""Page-locked host memory of exactly the bytes asked for.

torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two, so that a freed
block can serve the next request of its size class: one DeepSeek-V2-Lite layer's packed experts
(64 x 17.3 MB = 1.11 GB) take 2 GiB of page-locked memory, and a 26-layer model 52 GiB for 29 GB of
experts. :func:`pinned_empty` allocates plain memory and page-locks exactly its pages with the driver
(``cudaHostRegister``), and unlocks them when the last tensor over them is freed. Where the driver
refuses, it falls back to torch's allocator and says so once.
"""

from __future__ import annotations

import functools
import logging
import mmap
import weakref
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE

#: (register(ptr, nbytes) -> ok, unregister(ptr)): the driver's calls, replaceable in tests
Calls = tuple[Callable[[int, int], bool], Callable[[int], None]]


def cuda_calls() -> Calls:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's binding of the CUDA runtime."""
    rt = torch.cuda.cudart()

    def register(ptr: int, nbytes: int) -> bool:
        try:
            return int(rt.cudaHostRegister(ptr, nbytes, 0)) == 0
        except (AttributeError, RuntimeError, TypeError):  # a torch without this binding: fall back
            return False

    def unregister(ptr: int) -> None:
        rt.cudaHostUnregister(ptr)

    return register, unregister


def pinned_empty(nbytes: int, calls: Calls | None = None) -> torch.Tensor:
    """``nbytes`` of uninitialised page-locked host memory (uint8), starting on a page boundary."""
    register, unregister = calls if calls is not None else cuda_calls()
    base = np.empty(nbytes + PAGE, np.uint8)  # untouched: the pages are faulted in by the registration
    skip = (-base.ctypes.data) % PAGE
    view = base[skip : skip + nbytes]
    ptr = view.ctypes.data
    if not nbytes:  # nothing to lock, so nothing to unlock when it goes
        return torch.from_numpy(view)
    if not register(ptr, nbytes):
        return fallback(nbytes)
    # ``base`` dies with the last tensor over it; numpy runs its weakref callbacks before freeing the data,
    # so the pages are unlocked while they are still mapped
    done = weakref.finalize(base, unregister, ptr)
    done.atexit = False  # at exit the driver may be gone, and the process's memory goes with it
    return torch.from_numpy(view)


def fallback(nbytes: int) -> torch.Tensor:
    """torch's pinned allocator (power-of-two blocks), when the driver would not register plain memory."""
    _say_fallback()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@functools.cache
def _say_fallback() -> None:
    """The fallback's line, once a process."""
    log.warning(
        "cudaHostRegister refused plain host memory: pinning with torch's allocator, which rounds "
        "each block up to a power of two (up to 2x the experts' bytes page-locked)"
    )
