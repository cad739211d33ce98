"""Exactly-sized page-locked host memory (runtime/tiers/pinned.py), checked with a stand-in for the driver;
and how much the host tier may pin (runtime/live/transfer.py's pinned_budget), with a stand-in /proc/meminfo."""

from __future__ import annotations

import gc
import io

import pytest
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


def _meminfo(text: str | None):
    """A stand-in for ``open`` that serves /proc/meminfo as ``text`` (None: unreadable)."""

    def fake_open(path: str, *a, **kw) -> io.StringIO:
        assert path == "/proc/meminfo", path
        if text is None:
            raise PermissionError(path)
        return io.StringIO(text)

    return fake_open


@pytest.mark.parametrize(
    "text",
    [None, "MemTotal:  8000000 kB\n", "MemAvailable:  lots kB\n"],
    ids=["unreadable", "no MemAvailable line", "malformed"],
)
def test_the_pinned_budget_is_zero_where_the_available_memory_cannot_be_read(monkeypatch, text):
    """Without a --pinned-mb, the host tier may pin half the memory available now. Where /proc/meminfo
    gives no figure (a container without /proc, another kernel's format), it pins nothing beyond its
    staging buffers: an unlimited budget would lock every host copy and could take the whole
    machine's memory out of reach of the page cache and other processes."""
    from moecast.runtime.live import transfer

    monkeypatch.setattr(transfer, "open", _meminfo(text), raising=False)
    assert transfer.pinned_budget(None) == 0
    assert transfer.pinned_budget(3) == 3 * 2**20  # a given size never reads it


def test_the_pinned_budget_is_half_the_available_memory_read(monkeypatch):
    """MemAvailable 1000 kB (the line after MemFree, as the kernel writes it): 1000 x 1024 / 2 = 512000 bytes."""
    from moecast.runtime.live import transfer

    text = "MemTotal:  4000 kB\nMemFree:  2000 kB\nMemAvailable:  1000 kB\n"
    monkeypatch.setattr(transfer, "open", _meminfo(text), raising=False)
    assert transfer.pinned_budget(None) == 512_000


def test_an_empty_block_asks_the_driver_for_nothing():
    """cudaHostRegister refuses a zero-byte range, which would send an empty request to the fallback
    (and its warning) for nothing to lock; and freeing the block must not unregister a pointer that was
    never registered (cudaHostUnregister of unregistered memory is an error)."""
    drv = Driver(ok=False)
    pinned._say_fallback.cache_clear()
    t = pinned.pinned_empty(0, drv.calls())
    assert t.numel() == 0 and drv.registered == []
    del t
    gc.collect()
    assert drv.unregistered == []


class _Cudart:
    """A stand-in for torch.cuda.cudart(): cudaHostRegister returns ``code`` (0 is cudaSuccess)."""

    def __init__(self, code: int) -> None:
        self.code, self.calls = code, []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append((ptr, nbytes, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_the_drivers_register_succeeds_only_on_cuda_success(monkeypatch):
    """cudaHostRegister's return is an error code: 0 locked the pages, anything else (an out of memory,
    a range already registered) did not, and a torch without the binding falls back."""
    for code, ok in ((0, True), (2, False), (712, False)):
        rt = _Cudart(code)
        monkeypatch.setattr(pinned.torch.cuda, "cudart", lambda rt=rt: rt)
        register, unregister = pinned.cuda_calls()
        assert register(4096, 8192) is ok and rt.calls == [(4096, 8192, 0)]
        unregister(4096)
        assert rt.calls[-1] == ("unregister", 4096)
    monkeypatch.setattr(pinned.torch.cuda, "cudart", lambda: object())
    register, _ = pinned.cuda_calls()
    assert register(4096, 8192) is False
