"""Exactly-sized page-locked host memory (runtime/tiers/pinned.py), checked with a stand-in for the driver."""

from __future__ import annotations

import gc

import torch
from moecast.runtime.tiers import pinned


class Driver:
    """Records registrations; ``ok`` says whether it accepts them."""

    def __init__(self, ok: bool = True) -> None:
        self.ok, self.registered, self.unregistered = ok, [], []

    def calls(self) -> pinned.Calls:
        def register(ptr: int, nbytes: int) -> bool:
            self.registered.append((ptr, nbytes))
            return self.ok

        return register, self.unregistered.append


def test_exactly_the_bytes_asked_for_are_locked_from_a_page_boundary():
    """Catches a power-of-two size (torch's allocator: 2 GiB locked for a 1.11 GB layer) and a block that
    does not start where the registration did."""
    drv = Driver()
    n = 64 * 17_301_504 // 1024 + 3  # not a power of two, not a page multiple
    t = pinned.pinned_empty(n, drv.calls())
    assert t.dtype == torch.uint8 and t.numel() == n
    assert drv.registered == [(t.data_ptr(), n)] and t.data_ptr() % pinned.PAGE == 0
    t.fill_(7)  # the whole block is writable memory
    assert int(t[-1]) == 7


def test_pages_are_unlocked_when_the_last_tensor_over_them_goes():
    """Catches an unregister while a view still uses the memory, and one never made (locked pages leak
    with every attach)."""
    drv = Driver()
    t = pinned.pinned_empty(10_000, drv.calls())
    ptr = t.data_ptr()
    view = t[100:200]
    del t
    gc.collect()
    assert drv.unregistered == []  # the view still reads these pages
    del view
    gc.collect()
    assert drv.unregistered == [ptr]


def test_a_refused_registration_falls_back_to_torchs_pinned_allocator(monkeypatch, caplog):
    """Catches a refusal that returns unlocked memory as if it were locked (every copy would then go
    through a hidden staging copy), and a fallback that says nothing."""
    drv = Driver(ok=False)
    got = []
    pinned._say_fallback.cache_clear()
    real_empty = torch.empty

    def empty(*a, **kw):
        got.append(kw.get("pin_memory"))
        kw.pop("pin_memory", None)  # no accelerator here to pin with
        return real_empty(*a, **kw)

    monkeypatch.setattr(pinned.torch, "empty", empty)
    with caplog.at_level("WARNING", logger=pinned.__name__):
        t = pinned.pinned_empty(4096, drv.calls())
        pinned.pinned_empty(4096, drv.calls())
    assert got == [True, True] and t.numel() == 4096 and drv.unregistered == []
    assert sum("cudaHostRegister refused" in r.message for r in caplog.records) == 1
