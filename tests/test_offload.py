"""The disk tier's offload directory: layout, resumable writes, direct reads and every bad input."""

from __future__ import annotations

import errno
import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from moecast.collect.models import find_moe_structure
from moecast.runtime.live.runtime import attach
from moecast.runtime.tiers import offload
from moecast.runtime.tiers.expert_store import expert_params
from moecast.runtime.tiers.offload import ALIGN, DiskLayerStore, ExpertReader, OffloadError, OffloadWarning
from safetensors import safe_open
from test_datapath import FakeOps
from test_live import decode_logits, make_model

torch.set_num_threads(1)

# qwen2_moe of test_live: hidden 32, expert width 16, fp32: gate_up [32, 32] and down [32, 16] per expert
QWEN_EXPERT_BYTES = (2 * 16 * 32 + 32 * 16) * 4  # 6144
QWEN_STRIDE = 8192  # rounded up to the 4096-byte alignment


def _write(model, d):
    return offload.write_offload(model, find_moe_structure(model), d)


def test_files_are_safetensors_with_each_expert_aligned_for_direct_io(tmp_path):
    model = make_model("qwen2_moe")
    meta = _write(model, tmp_path)
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    assert meta["experts"][0] == [
        {"name": "gate_up_proj", "shape": [32, 32], "dtype": "F32"},
        {"name": "down_proj", "shape": [32, 16], "dtype": "F32"},
    ]
    experts = model.model.layers[1].mlp.experts
    path = tmp_path / meta["files"][1]
    head = int.from_bytes(path.read_bytes()[:8], "little")
    start = 8 + head
    assert start % ALIGN == 0
    assert path.stat().st_size == start + 8 * QWEN_STRIDE
    with safe_open(str(path), "pt") as f:  # a plain safetensors reader takes the file as it is
        header = json.loads(path.read_bytes()[8:start])
        for e in range(8):
            assert torch.equal(f.get_tensor(f"e{e}.gate_up_proj"), experts.gate_up_proj[e])
            assert torch.equal(f.get_tensor(f"e{e}.down_proj"), experts.down_proj[e])
            assert header[f"e{e}.gate_up_proj"]["data_offsets"][0] == e * QWEN_STRIDE
            assert header[f"e{e}.down_proj"]["data_offsets"][0] == e * QWEN_STRIDE + 32 * 32 * 4
    # the dense file holds every other weight, each storage once
    with safe_open(str(tmp_path / "dense.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and not any("mlp.experts." in k for k in keys)


def test_reader_counts_whole_aligned_blocks(tmp_path):
    model = make_model("qwen2_moe")
    meta = _write(model, tmp_path)
    reader = ExpertReader(tmp_path, meta)
    try:
        assert reader.layouts[0].expert_bytes == QWEN_EXPERT_BYTES and reader.layouts[0].stride == QWEN_STRIDE
        buf = offload.aligned_bytes(QWEN_STRIDE)
        for e in (3, 0, 7):
            reader.read_into(1, e, buf.numpy())
            view = reader.layouts[1].views(buf, 1)
            assert torch.equal(view["down_proj"][0], model.model.layers[1].mlp.experts.down_proj[e])
        assert reader.reads == 3 and reader.bytes_read == 3 * 8192
        assert reader.direct  # ext4 and most local file systems take O_DIRECT
    finally:
        reader.close()


def test_read_parts_are_aligned_and_cover_the_block():
    assert offload._parts(10 * ALIGN + 1, 2) == [(0, 6 * ALIGN), (6 * ALIGN, 10 * ALIGN + 1)]
    assert offload._parts(8 * ALIGN, 2) == [(0, 4 * ALIGN), (4 * ALIGN, 8 * ALIGN)]
    assert offload._parts(ALIGN, 4) == [(0, ALIGN)]  # never a part under one aligned block
    assert offload._parts(3 * ALIGN, 1) == [(0, 3 * ALIGN)]


def test_submitted_experts_land_in_order_each_read_by_every_thread(tmp_path):
    """Two experts submitted together: both I/O threads read the first one's parts side by side
    (a barrier only both can pass), so it lands before the second; whole experts per thread would
    leave the barrier with one thread and fail."""
    import threading

    model = make_model("qwen2_moe")
    meta = _write(model, tmp_path)
    reader = ExpertReader(tmp_path, meta, threads=2)
    barrier = threading.Barrier(2, timeout=10)
    real = reader._read

    def read(pos, expert, view, offset, nbytes):
        if expert == 3:
            barrier.wait()
        real(pos, expert, view, offset, nbytes)

    reader._read = read
    try:
        bufs = [offload.aligned_bytes(QWEN_STRIDE) for _ in range(2)]
        first, second = reader.submit(1, 3, bufs[0].numpy()), reader.submit(1, 5, bufs[1].numpy())
        first.result(timeout=20)
        second.result(timeout=20)
        experts = model.model.layers[1].mlp.experts
        for buf, e in zip(bufs, (3, 5)):
            assert torch.equal(reader.layouts[1].views(buf, 1)["down_proj"][0], experts.down_proj[e])
        assert reader.reads == 2 and reader.bytes_read == 2 * QWEN_STRIDE
    finally:
        reader.close()


def test_a_failed_part_fails_the_expert(tmp_path):
    model = make_model("qwen2_moe")
    meta = _write(model, tmp_path)
    reader = ExpertReader(tmp_path, meta, threads=2)
    real = reader._read

    def read(pos, expert, view, offset, nbytes):
        if offset != reader.starts[pos] + expert * QWEN_STRIDE:  # the second part
            raise OSError(errno.EIO, "input/output error")
        real(pos, expert, view, offset, nbytes)

    reader._read = read
    try:
        with pytest.raises(OSError, match="input/output"):
            reader.submit(1, 3, offload.aligned_bytes(QWEN_STRIDE).numpy()).result(timeout=20)
    finally:
        reader.close()


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="MAP_POPULATE is Linux's")
def test_aligned_bytes_are_faulted_in_when_allocated():
    """Slots are resident before the first read: no decode step zeroes their pages."""

    def rss_kb() -> int:
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(x for x in status if x.startswith("VmRSS:")).split()[1])

    before = rss_kb()
    buf = offload.aligned_bytes(64 << 20)
    grown = rss_kb() - before
    assert grown >= 60 << 10, f"RSS grew by {grown} kB for a 64 MiB buffer never touched"
    assert buf.data_ptr() % offload.ALIGN == 0 and int(buf[-1]) == 0


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0]


def _anon_huge_kb(ptr: int) -> int:
    """AnonHugePages of the mapping of this process that holds address ``ptr`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_aligned_bytes_start_on_a_huge_page_and_ask_for_huge_pages(monkeypatch):
    """A buffer of a huge page or more starts on a 2 MB boundary and is madvised MADV_HUGEPAGE over
    its whole length (an O_DIRECT read then pins a few huge pages, not thousands of small ones); a
    smaller one is left as it was. Where the kernel grants THP on request, the pages are huge."""
    asked = []
    real = offload._huge_pages
    monkeypatch.setattr(offload, "_huge_pages", lambda mm, a, n: asked.append(n) or real(mm, a, n))
    small = offload.aligned_bytes(64 << 10)
    buf = offload.aligned_bytes(5 << 20)
    assert asked == [6 << 20]  # the small one asked for nothing; 5 MB rounds up to three huge pages
    assert buf.data_ptr() % offload.HUGE_PAGE == 0 and len(buf) == 5 << 20 and len(small) == 64 << 10
    assert int(buf.sum()) == 0
    if _thp_mode() in ("madvise", "always"):
        assert _anon_huge_kb(buf.data_ptr()) >= 2 << 10


def test_disk_tier_logits_and_bytes_read_by_hand(tmp_path):
    """static never loads after the fill: 2 experts x 2 layers read once, then one read per CPU expert."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    ref = decode_logits(model, ids)
    before = {n: t.clone() for n, t in expert_params(model.model.layers[0].mlp.experts).items()}
    rt = attach(
        model, policy="static", capacity=2, prefetch="none", offload="disk", offload_dir=str(tmp_path)
    )
    try:
        # the weights moved to disk: the module holds none, the slots hold capacity x stride per layer
        assert all(t.device.type == "meta" for t in expert_params(model.model.layers[0].mlp.experts).values())
        assert rt.stores[0]._slot_raw.numel() == 2 * QWEN_STRIDE
        got = decode_logits(model, ids)
        stats = rt.stats()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert stats["transfers"] == 0 and stats["cpu_experts"] > 0
    assert stats["disk_reads"] == 4 + stats["cpu_experts"]
    assert stats["bytes_read"] == 8192 * stats["disk_reads"]
    assert stats["direct_io"] is True and stats["offload"] == "disk"
    # detach read the weights back: the model is whole again
    for n, t in expert_params(model.model.layers[0].mlp.experts).items():
        assert torch.equal(t, before[n])
    assert torch.equal(decode_logits(model, ids), ref)


@pytest.mark.parametrize(
    "setting",
    [
        dict(policy="lru", capacity=0.25, prefetch="online"),
        dict(policy="smoe", capacity=2, balance="presched", hardware="prescope-a100-pcie4"),
        dict(policy="lfu", capacity=None),
    ],
)
def test_disk_tier_alpha_zero_logits_equal_the_model(tmp_path, setting):
    model = make_model("mixtral")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = decode_logits(model, ids)
    rt = attach(model, alpha=0.0, offload="disk", offload_dir=str(tmp_path), **setting)
    try:
        got = decode_logits(model, ids)
        stats = rt.stats()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert stats["disk_reads"] >= stats["transfers"] and stats["bytes_read"] > 0
    # the decode step's split adds up to its wall time
    from moecast.runtime.live.runtime import BREAKDOWN

    parts = sum(stats[f"{p}_ms"] for p in BREAKDOWN)
    assert parts == pytest.approx(stats["measured_tpot_ms"], rel=1e-6)


def test_an_interrupted_write_resumes_with_the_missing_files_only(tmp_path, monkeypatch):
    model = make_model("qwen2_moe")
    real = offload._write_layer
    calls = []

    def interrupted(f, params, layout, n):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"half")
            raise KeyboardInterrupt
        real(f, params, layout, n)

    monkeypatch.setattr(offload, "_write_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _write(model, tmp_path / "a")
    meta = offload.offload_meta(model, find_moe_structure(model))
    # the half-written file kept its temporary name: it is not taken for complete
    assert offload.missing_layers(tmp_path / "a", meta) == [1]
    assert not (tmp_path / "a" / meta["files"][1]).exists()
    monkeypatch.setattr(offload, "_write_layer", real)
    written = []
    monkeypatch.setattr(offload, "_write_layer", lambda *a: (written.append(1), real(*a)))
    _write(model, tmp_path / "a")
    assert len(written) == 1 and offload.missing_layers(tmp_path / "a", meta) == []
    monkeypatch.setattr(offload, "_write_layer", real)
    _write(model, tmp_path / "b")  # the same bytes as an uninterrupted write
    for name in meta["files"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_another_models_directory_is_refused(tmp_path):
    _write(make_model("qwen2_moe"), tmp_path)
    other = make_model("mixtral")
    with pytest.raises(OffloadError) as exc:
        attach(other, policy="lru", capacity=2, offload="disk", offload_dir=str(tmp_path))
    assert "another model" in _one_line(exc)
    assert other.get_experts_implementation() != "moecast_live"  # nothing changed on the model
    assert all(t.device.type == "cpu" for t in other.parameters())


def test_a_truncated_expert_file_is_refused(tmp_path):
    model = make_model("qwen2_moe")
    meta = _write(model, tmp_path)
    path = tmp_path / meta["files"][0]
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(OffloadError) as exc:
        attach(model, policy="lru", capacity=2, offload="disk", offload_dir=str(tmp_path))
    msg = _one_line(exc)
    assert "truncated" in msg and str(path) in msg and "delete it" in msg


def test_an_unwritable_directory_is_refused(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadError) as exc:
        _write(make_model("qwen2_moe"), blocker / "offload")  # a file where a directory must go
    assert "cannot write to offload directory" in _one_line(exc)

    def denied(self, data):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(offload.Path, "write_bytes", denied)
    with pytest.raises(OffloadError) as exc:
        _write(make_model("qwen2_moe"), tmp_path / "ro")
    assert "Permission denied" in _one_line(exc) and "writable offload_dir=DIR" in str(exc.value)


def test_a_full_disk_is_refused_before_and_during_the_write(tmp_path, monkeypatch):
    model = make_model("qwen2_moe")
    usage = offload.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(OffloadError) as exc:
        _write(model, tmp_path / "small")
    assert "GiB free" in _one_line(exc)
    monkeypatch.undo()

    def full(f, *a):
        f.write(b"some")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload, "_write_layer", full)
    with pytest.raises(OffloadError) as exc:
        _write(model, tmp_path / "full")
    assert "no space left" in _one_line(exc)
    # the partial file is gone and nothing is taken for complete
    assert not [p for p in (tmp_path / "full").iterdir() if p.name.startswith(".layer")]
    meta = offload.offload_meta(model, find_moe_structure(model))
    assert offload.missing_layers(tmp_path / "full", meta) == [0, 1]


def test_the_room_a_quantized_copy_needs_is_its_own_files(tmp_path, monkeypatch):
    """Adding int4 to a directory that holds the model-dtype files needs room for the int4 files
    alone: the bytes those files take where they were written (a check that counted only the model's
    files let the write start and fail half-way)."""
    from moecast.runtime.tiers.precision import Precision

    model, int4 = make_model("qwen2_moe"), Precision("int4", 32)
    st = find_moe_structure(model)
    offload.write_offload(model, st, tmp_path / "ref", precision=int4)
    need = sum(f.stat().st_size for f in (tmp_path / "ref").glob("layer_*.int4-g32.safetensors"))
    _write(model, tmp_path / "d")
    usage = offload.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: usage._replace(free=need - 1))
    with pytest.raises(OffloadError, match="GiB free and the experts need"):
        offload.write_offload(model, st, tmp_path / "d", precision=int4)
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: usage._replace(free=need))
    offload.write_offload(model, st, tmp_path / "d", precision=int4)
    assert (
        offload.missing_layers(
            tmp_path / "d", offload.with_precision(offload.offload_meta(model, st), st, int4), int4
        )
        == []
    )


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])  # the file systems' two refusals
def test_without_o_direct_reads_are_buffered_and_dropped_and_it_says_so(tmp_path, monkeypatch, code):
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    ref = decode_logits(model, ids)

    def refused(path):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(offload, "_open_direct", refused)
    monkeypatch.setattr(offload, "_WARNED", set())
    dropped = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        os, "posix_fadvise", lambda fd, off, n, adv: (dropped.append(adv), real(fd, off, n, adv))
    )
    with pytest.warns(OffloadWarning, match="does not support direct I/O") as rec:
        rt = attach(model, policy="lru", capacity=2, offload="disk", offload_dir=str(tmp_path))
    assert len(rec) == 1  # said once, not per file
    try:
        got = decode_logits(model, ids)
        stats = rt.stats()
    finally:
        rt.detach()
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    assert stats["direct_io"] is False
    assert len(dropped) >= stats["disk_reads"] and set(dropped) == {os.POSIX_FADV_DONTNEED}


def test_an_open_refused_otherwise_than_for_o_direct_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    model = make_model("qwen2_moe")
    offload.write_offload(model, find_moe_structure(model), tmp_path)

    def denied(path):
        raise OSError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(offload, "_open_direct", denied)
    meta = json.loads((tmp_path / "meta.json").read_text())
    with pytest.raises(
        OffloadError, match=r"cannot open expert file .*layer_000.safetensors \(Permission denied\)"
    ):
        ExpertReader(tmp_path, offload.tier_meta(meta, offload.MODEL))


def test_a_meta_json_of_another_format_is_refused(tmp_path):
    """A directory another tool wrote a meta.json into is not read as experts."""
    model = make_model("qwen2_moe")
    (tmp_path / "meta.json").write_text(json.dumps({"format": "someone-else", "version": 1}))
    meta = offload.offload_meta(model, find_moe_structure(model))
    with pytest.raises(OffloadError, match="is not a moecast offload directory; choose an empty or new"):
        offload.missing_layers(tmp_path, meta)


def test_a_capacity_larger_than_the_memory_available_is_refused(tmp_path, monkeypatch):
    model = make_model("qwen2_moe")
    monkeypatch.setattr(offload, "available_bytes", lambda: 10 * QWEN_STRIDE)
    with pytest.raises(OffloadError) as exc:
        attach(model, policy="lru", capacity=6, offload="disk", offload_dir=str(tmp_path))
    msg = _one_line(exc)
    # 2 layers x (6 slots + 4 staging buffers) x 8192 bytes needed; 10 blocks fit: 5 - 4 = 1 expert per layer
    assert "lower capacity=N" in msg and "at most 1 experts per layer" in msg
    assert all(t.device.type == "cpu" for t in model.parameters())  # the weights were not dropped
    # at the edge: 2 slots a layer need 2 x (2 + 4) blocks, the staging buffers counted with the slots
    monkeypatch.setattr(offload, "available_bytes", lambda: 12 * QWEN_STRIDE - 1)
    with pytest.raises(
        OffloadError, match=r"capacity 2 \(2 experts per layer\) needs .*at most 1 experts per layer"
    ):
        attach(model, policy="lru", capacity=2, offload="disk", offload_dir=str(tmp_path))
    monkeypatch.setattr(offload, "available_bytes", lambda: 12 * QWEN_STRIDE)
    attach(model, policy="lru", capacity=2, offload="disk", offload_dir=str(tmp_path)).detach()


def test_offload_disk_needs_a_directory():
    with pytest.raises(ValueError, match="offload_dir"):
        attach(make_model("qwen2_moe"), offload="disk")
    with pytest.raises(ValueError, match="unknown offload"):
        attach(make_model("qwen2_moe"), offload="tape")


def reload_after_a_read(store: DiskLayerStore, ops: FakeOps) -> None:
    """Fill slots 0, 1 with experts 4, 6, mark slot 0 read by a kernel, then load expert 1 over expert
    4; the load queues, on one stream, a wait for that kernel's event, a mark of the copy's start (the
    read may have left the link idle), the one copy of the whole block and its one landing event."""
    store.fill([4, 6])
    store.wait([0, 1])
    store.mark_read([0])
    read_ev = ops.log[-1][2]
    ops.log.clear()
    store.load(1, evict=4)
    store.wait()
    queued = [e for e in ops.log if e[1] != "compute"]
    assert [(e[0], e[1]) for e in queued] == [
        ("wait", "copy0"),
        ("record", "copy0"),
        ("copy", "copy0"),
        ("record", "copy0"),
    ]
    assert queued[0][2] is read_ev and queued[2][2] == store.layout.stride


def test_cuda_style_disk_store_reads_into_staging_then_copies_after_the_slots_last_reader(tmp_path):
    """The CUDA path of the disk store with a fake stream log: read on the I/O pool into a staging
    buffer, then one copy of the whole block (one event) after the slot's last read event; the device
    slots are one packed buffer whose views are the expert's tensors."""
    model = make_model("mixtral")
    meta = _write(model, tmp_path)
    reader = ExpertReader(tmp_path, meta)
    experts = model.model.layers[0].mlp.experts
    ops = FakeOps()
    store = DiskLayerStore(experts, 2, reader, 0, ops=ops)
    try:
        reload_after_a_read(store, ops)
        assert store._slot_raw.numel() == 2 * reader.layouts[0].stride
        assert torch.equal(store.slots["gate_up_proj"][0], experts.gate_up_proj[1])
        assert torch.equal(store.slots["down_proj"][1], experts.down_proj[6])
        assert reader.reads == 3 and reader.bytes_read == 3 * reader.layouts[0].stride
    finally:
        store.close()
        reader.close()
    assert np.array_equal(store.expert_in, [1, 6])


def test_a_prefetch_read_that_lands_early_goes_on_the_link_after_the_demand_copies(tmp_path, monkeypatch):
    """Issue 43 on the disk tier (one transfer stream, simulated): layer 0's demand load of expert 1, then
    layer 1's prefetch of expert 5, then layer 1's demand loads of 2 and 3. The prefetch's read is held
    until the demand loads are issued, then lands before their reads run (one I/O thread: reads in
    issue order). On the link: layer 0's copy, layer 1's two demand copies, then the prefetch's; every
    slot holds its expert and the compute stream waits for each copy. Catches a prefetch copy queued
    as soon as its read lands (1, 5, 2, 3), a prefetch held behind the demand copies issued before its
    own read instead of those still being read (the same), and a held copy never queued (a hang)."""
    import threading

    model = make_model("mixtral")
    meta = _write(model, tmp_path)
    reader = ExpertReader(tmp_path, meta, threads=1)
    ops = FakeOps()
    link, order = ops.stream(), offload.LinkOrder()
    stores = [
        DiskLayerStore(model.model.layers[p].mlp.experts, 3, reader, p, ops=ops, stream=link, order=order)
        for p in (0, 1)
    ]
    issued = threading.Event()
    real_read = reader.read_into

    def read_into(pos, expert, buf):
        if (pos, expert) == (1, 5):  # the prefetch's read lands once the demand loads are issued
            assert issued.wait(timeout=60)
        real_read(pos, expert, buf)

    monkeypatch.setattr(reader, "read_into", read_into)
    try:
        stores[0].load_many([1], [])  # layer 0's demand batch
        stores[1].load(5, prefetch=True)  # the next layer's prefetch, issued after it
        stores[1].load_many([2, 3], [])  # layer 1's demand batch
        issued.set()
        for st in stores:
            st.wait()
        stride = reader.layouts[0].stride

        def copied(dst):
            pos = next(
                p
                for p, st in enumerate(stores)
                if st._slot_raw.data_ptr() <= dst.data_ptr() < st._slot_raw.data_ptr() + st._slot_raw.numel()
            )
            return pos, int(
                stores[pos].expert_in[(dst.data_ptr() - stores[pos]._slot_raw.data_ptr()) // stride]
            )

        assert [copied(c[3]) for c in ops.sequence("copy")] == [(0, 1), (1, 2), (1, 3), (1, 5)]
        assert {c[1] for c in ops.sequence("copy")} == {"copy0"}
        landings = [e[2] for e in ops.sequence("record")][1::2]  # each copy's start mark, then its landing
        assert {w[2] for w in ops.sequence("wait") if w[1] == "compute"} == set(landings)
        experts = model.model.layers[1].mlp.experts
        for e in (5, 2, 3):
            assert torch.equal(stores[1].slots["down_proj"][stores[1].slot_of[e]], experts.down_proj[e])
    finally:
        for st in stores:
            st.close()
        reader.close()


def test_the_runtime_sends_its_prefetches_to_the_disk_tier_as_prefetches(tmp_path):
    """On the simulated device's disk tier the runtime tells the stores which copies are prefetches
    (those issued while it lands the next layer's prefetch) and which are demand loads (every other),
    so the tier can order them (the test above), and those copies are the landed prefetches the stats
    count; the logits stay the model's. Catches a runtime or an
    executor that drops the flag (every copy a demand: the order is left to the reads' landing) or
    sets it on demand loads (they would wait behind each other's reads)."""
    model = make_model("qwen2_moe")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    ref = decode_logits(model, ids, steps=6)
    rt = attach(
        model, policy="lru", capacity=2, prefetch="online", alpha=0.0, warm=False, device_ops="simulated",
        hardware="prescope-a100-pcie4", offload="disk", offload_dir=str(tmp_path),
    )  # fmt: skip
    seen, inside = [], [False]
    for st in rt.stores:
        real_copy = st._copy
        st._copy = lambda e, s, prefetch=False, real=real_copy: (
            seen.append((inside[0], prefetch)),
            real(e, s, prefetch),
        )[1]
    real_prefetch = rt._prefetch

    def prefetch():
        inside[0] = True
        try:
            real_prefetch()
        finally:
            inside[0] = False

    rt._prefetch = prefetch
    try:
        got = decode_logits(model, ids, steps=6)
        st = rt.stats()
    finally:
        rt.detach()
    assert torch.equal(got, ref)
    assert seen and all(flag == was for was, flag in seen)
    assert any(was for was, _ in seen) and not all(was for was, _ in seen)  # both kinds were issued
    # the copies the prefetch made are the landed prefetches the stats count
    assert sum(was for was, _ in seen) == st["prefetches_landed"]


def test_cpu_experts_are_read_in_two_bounded_wave_buffers(tmp_path, monkeypatch):
    """However many experts one CPU call computes, the disk store holds two waves of ``cpu_wave``
    blocks (allocated once, then reused), reads wave i+1 only once wave i is handed out, and gives
    each expert's exact weights."""
    model = make_model("mixtral")
    meta = _write(model, tmp_path)
    reader = ExpertReader(tmp_path, meta, threads=1)
    experts = model.model.layers[0].mlp.experts
    store = DiskLayerStore(experts, 2, reader, 0)
    stride = reader.layouts[0].stride
    allocated, submitted, targets = [], [], []
    real_alloc, real_submit = offload.aligned_bytes, reader.submit
    monkeypatch.setattr(offload, "aligned_bytes", lambda n: allocated.append(n) or real_alloc(n))

    def submit(pos, e, buf):
        submitted.append(e)
        targets.append(buf.__array_interface__["data"][0])
        return real_submit(pos, e, buf)

    monkeypatch.setattr(reader, "submit", submit)
    want = {n: t.clone() for n, t in expert_params(experts).items()}
    try:
        for call in ([0, 2, 3, 5, 6, 7, 1], [4]):
            seen = []
            for i, (tensors, table, count) in enumerate(store.cpu_waves(np.array(call))):
                assert count <= reader.cpu_wave == 2
                assert len(submitted) <= 2 * (i + 2)  # this wave's and the next one's reads, no more
                wave = np.flatnonzero(table < count)
                for e in wave:
                    for n, t in tensors.items():
                        assert torch.equal(t[table[e]], want[n][e])
                seen += list(wave)
            assert sorted(seen) == sorted(call) and len(seen) == len(call)
            submitted.clear()
        base = reader._cpu_raw.data_ptr()
    finally:
        store.close()
        reader.close()
    assert allocated == [2 * 2 * stride]  # the two wave buffers, once for both calls
    assert all(base <= a and a + stride <= base + 4 * stride for a in targets)
    assert reader._cpu_raw is None  # closing the reader lets them go


def test_reader_observed_rate_counts_overlapping_reads_once(monkeypatch, tmp_path):
    """bytes_read / busy_s, busy_s the union of the reads' intervals: two reads that overlap in time
    count their span once, a gap between reads not at all (clock values given by hand)."""
    from moecast.runtime.tiers import offload

    r = offload.ExpertReader.__new__(offload.ExpertReader)
    r._lock = __import__("threading").Lock()
    r.bytes_read = r.reads = 0
    r.busy_s, r._active, r._busy_since = 0.0, 0, 0.0
    # the clock is read when the disk goes busy or idle: a starts 1.0, b overlaps, both done 1.5;
    # c runs 3.0 to 10.0
    clock = iter([1.0, 1.5, 3.0, 10.0])
    monkeypatch.setattr(offload.time, "perf_counter", lambda: next(clock))
    r._enter()  # a
    r._enter()  # b, while a is in flight
    r._leave(100, 1)  # a done, b still in flight
    r._leave(100, 1)  # b done: busy 1.0 .. 1.5
    assert r.busy_s == 0.5
    r._enter()  # c
    r._leave(50, 1)
    assert r.busy_s == 7.5 and (r.bytes_read, r.reads) == (250, 3)
    assert r.observed_gbps() == 250 / 7.5 / 1e9


def test_in_flight_names_the_slots_still_read_in_submission_order(tmp_path):
    import threading

    model = make_model("mixtral")
    meta = _write(model, tmp_path)
    reader = ExpertReader(tmp_path, meta, threads=1)
    gate = threading.Event()
    real = reader._read

    def read(pos, expert, view, offset, nbytes):
        if expert != 3:
            gate.wait(10)
        real(pos, expert, view, offset, nbytes)

    reader._read = read
    store = DiskLayerStore(model.model.layers[0].mlp.experts, 4, reader, 0)
    try:
        slots = [store.load(e) for e in (3, 6, 1)]  # 3 reads at once; 6 and 1 wait at the gate
        store.wait([slots[0]])
        assert list(store.in_flight(np.array(slots[::-1]))) == slots[1:]  # asked in any order
        assert list(store.in_flight(np.array(slots[:1]))) == []
        gate.set()
        store.wait()
        assert len(store.in_flight(np.array(slots))) == 0
    finally:
        gate.set()
        store.close()
        reader.close()


def test_a_hit_still_in_flight_computes_after_the_landed_hits_before_the_loads():
    """Disk tier, decode: the landed hits in one call, then each hit whose prefetch is still being
    read (as it lands), then each demand load."""
    from types import SimpleNamespace

    from moecast.runtime.live.executor import Executor
    from moecast.runtime.tiers.base import Device

    class Store:
        slot_of = np.array([-1, -1, 4, -1, 0, 3, -1, 1, -1, 2])  # expert -> slot
        expert_in = np.array([4, 7, 9, 5, 2])  # slot -> expert

        def in_flight(self, slots):
            return np.array([s for s in (1,) if s in set(slots.tolist())], np.int64)  # expert 7's read

    ex = Executor.__new__(Executor)  # a tier reading in the background, the CPU as the device
    ex.tier, ex.device, ex.stores = (
        SimpleNamespace(background_reads=True),
        Device(torch.device("cpu")),
        [Store()],
    )
    parts = ex._resident(0, SimpleNamespace(decode=True), np.array([4, 7, 9]), np.array([5, 2]))
    assert [p.tolist() for p in parts] == [[4, 9], [7], [5], [2]]


def test_a_directory_of_the_model_in_another_dtype_is_refused(tmp_path):
    """The same model (fingerprint and config) loaded in bfloat16 over a float32 directory: its experts'
    blocks would be read with the wrong element size, so the directory is refused, naming the dtypes."""
    model = make_model("qwen2_moe")
    offload.write_offload(model, find_moe_structure(model), tmp_path)
    other = make_model("qwen2_moe").to(torch.bfloat16)
    meta = offload.offload_meta(other, find_moe_structure(other))
    with pytest.raises(OffloadError, match=r"another shape or dtype .*'F32'.* vs .*'BF16'") as exc:
        offload.missing_layers(tmp_path, meta)
    assert "load the model in the dtype it was written in" in str(exc.value) and "\n" not in str(exc.value)


def test_held_prefetch_copies_follow_the_last_demand_copy_in_the_order_they_landed():
    """Two demand copies issued; three prefetch reads land before them (a, b, c): held. The first demand
    copy queues alone; the second queues, then a, b, c in landing order; a prefetch landing with no
    demand outstanding goes at once. Each landed future holds its own copy's result."""
    from concurrent.futures import Future

    order, queued = offload.LinkOrder(), []

    def copy(name: str):
        return lambda: (queued.append(name), name)[1]

    futs = {n: Future() for n in ("d1", "d2", "a", "b", "c", "e")}
    order.demand()
    order.demand()
    for n in ("a", "b", "c"):
        order.queue(copy(n), futs[n], prefetch=True)
    assert queued == []
    order.queue(copy("d1"), futs["d1"], prefetch=False)
    assert queued == ["d1"]
    order.queue(copy("d2"), futs["d2"], prefetch=False)
    assert queued == ["d1", "d2", "a", "b", "c"]
    order.queue(copy("e"), futs["e"], prefetch=True)
    assert queued[-1] == "e" and all(f.result() == n for n, f in futs.items())


def _two_readers(tmp_path):
    """The model-dtype copy and an int4-g32 copy of one directory (qwen2_moe): two ExpertReaders."""
    from moecast.runtime.tiers.precision import Precision

    model, int4 = make_model("qwen2_moe"), Precision("int4", 32)
    meta = offload.write_offload(model, find_moe_structure(model), tmp_path, precision=int4)
    high = ExpertReader(tmp_path, offload.tier_meta(meta, offload.MODEL), threads=1)
    low = ExpertReader(tmp_path, offload.tier_meta(meta, int4), threads=1, pool=high.pool)
    return model.model.layers[0].mlp.experts, high, low


def test_two_copies_reread_a_slot_whose_flag_changed_and_count_only_upgrades(tmp_path):
    """Expert 3 loaded at the low copy, then flagged high: sync rereads it (an upgrade, the high
    copy's 6144 bytes); flagged low again: reread (a downgrade: bytes, no upgrade). Nothing changed:
    nothing reread."""
    experts, high, low = _two_readers(tmp_path)
    store = DiskLayerStore(experts, 2, high, 0, low_reader=low)
    try:
        flags = np.zeros(store.num_experts, bool)
        store.follow(flags)
        flags[3] = True
        slot = store.load(3)
        store.wait()
        low_bytes = low.layouts[0].expert_bytes
        assert store.slot_low[slot] and store.bytes_moved == low_bytes < QWEN_EXPERT_BYTES
        flags[3] = False
        assert (store.sync(), store.upgrades, store.bytes_moved) == (1, 1, low_bytes + QWEN_EXPERT_BYTES)
        store.wait()
        assert not store.slot_low[slot] and store.sync() == 0
        flags[3] = True
        assert (store.sync(), store.upgrades, store.bytes_moved) == (1, 1, 2 * low_bytes + QWEN_EXPERT_BYTES)
        store.wait()
        assert store.slot_low[slot]
    finally:
        store.close()
        low.close()
        high.close()


def test_a_low_copy_larger_than_the_high_one_is_refused(tmp_path):
    experts, high, low = _two_readers(tmp_path)
    try:
        with pytest.raises(OffloadError, match=r"the low copy of MoE layer 0 .* is larger than the high one"):
            DiskLayerStore(experts, 2, low, 0, low_reader=high)
    finally:
        low.close()
        high.close()
