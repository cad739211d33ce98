"""The disk tier's behaviours that a planted bug slipped past: each test here fails on its bug.

Every expectation is computed by hand on a small case (byte counts, offsets, call orders), never by
comparing two implementations; each docstring names the planted bug the test catches.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from moecast.collect.models import find_moe_structure
from moecast.runtime.tiers import offload
from moecast.runtime.tiers.offload import ALIGN, ExpertLayout, ExpertReader, OffloadError, OffloadWarning
from safetensors import safe_open
from test_live import make_model

torch.set_num_threads(1)

# qwen2_moe of test_live: 8 experts of (2 * 16 * 32 + 32 * 16) * 4 = 6144 bytes, in 8192-byte blocks
NUM_EXPERTS = 8
STRIDE = 8192


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, dict[str, Any], Path]:
    """The tiny qwen2_moe model, its offload meta and a directory written once for the module
    (tests that change the files work on a copy)."""
    model = make_model("qwen2_moe")
    d = tmp_path_factory.mktemp("offload")
    meta = offload.write_offload(model, find_moe_structure(model), d)
    return model, meta, d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _one_line(exc: pytest.ExceptionInfo[OffloadError]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------ 1. expert strides
def _params(spec: dict[str, tuple[torch.dtype, int]], num_experts: int) -> dict[str, torch.Tensor]:
    """[num_experts, n] tensors of distinct values per expert, by name (in the order given)."""
    out = {}
    for k, (name, (dtype, n)) in enumerate(spec.items()):
        values = torch.arange(num_experts * n).reshape(num_experts, n) + 7 * k
        out[name] = (values % 251).to(dtype)
    return out


# an expert of 1 + 3 (the pad before w) + 1023 * 4 = 4096 bytes: its block is exactly one ALIGN
EXACT = {"flag": (torch.uint8, 1), "w": (torch.float32, 1023)}
# 4097 bytes: a@0 (1 B), b@2 (F16, 1 rounded up to 2), c@8, d@12, e@16 (F64, 13 rounded up to 16),
# f@24 (4073 B) ends at 4097, one byte past one ALIGN: two blocks
ODD = {
    "a": (torch.uint8, 1),
    "b": (torch.float16, 3),
    "c": (torch.float32, 1),
    "d": (torch.uint8, 1),
    "e": (torch.float64, 1),
    "f": (torch.uint8, 4073),
}


@pytest.mark.parametrize(
    ("spec", "offsets", "expert_bytes", "stride"),
    [(EXACT, (0, 4), 4096, 4096), (ODD, (0, 2, 8, 12, 16, 24), 4097, 8192)],
    ids=["exact-multiple", "one-byte-over"],
)
def test_expert_stride_rounds_up_to_align_and_no_further(
    spec: dict[str, tuple[torch.dtype, int]], offsets: tuple[int, ...], expert_bytes: int, stride: int
) -> None:
    """Catches a stride rounded one block too far (an exact multiple of ALIGN given one more block,
    or every stride one block over) and tensor offsets not rounded to their element size."""
    assert ALIGN == 4096  # the numbers here are worked out for it
    layout = ExpertLayout.of(_params(spec, 3))
    assert layout.names == tuple(spec)
    assert layout.offsets == offsets
    assert layout.expert_bytes == expert_bytes
    assert layout.stride == stride


@pytest.mark.parametrize(
    ("spec", "stride"), [(EXACT, 4096), (ODD, 8192)], ids=["exact-multiple", "one-byte-over"]
)
def test_a_written_layer_is_one_aligned_header_then_one_block_per_expert(
    tmp_path: Path, spec: dict[str, tuple[torch.dtype, int]], stride: int
) -> None:
    """Catches a too-long stride in the file: 3 experts after a 4096-byte header take 4096 + 3 * stride
    bytes, and expert e's tensor i starts at 4096 + e * stride + its offset."""
    params = _params(spec, 3)
    layout = ExpertLayout.of(params)
    path = tmp_path / "layer_000.safetensors"
    offload._write_atomic(path, lambda f: offload._write_layer(f, params, layout, 3))
    data = path.read_bytes()
    # the JSON of 3 experts' entries is well under 4088 bytes: one ALIGN holds prefix and header
    assert 8 + int.from_bytes(data[:8], "little") == 4096
    assert len(data) == path.stat().st_size == 4096 + 3 * stride
    for e in range(3):
        for name, off in zip(layout.names, layout.offsets):
            raw = params[name][e].numpy().tobytes()
            at = 4096 + e * stride + off
            assert data[at : at + len(raw)] == raw, (e, name)
    with safe_open(str(path), "pt") as f:  # the header's offsets say the same
        for e in range(3):
            for name in spec:
                assert torch.equal(f.get_tensor(f"e{e}.{name}"), params[name][e])


# ---------------------------------------------------------------------- 2. the model fingerprint
@pytest.mark.parametrize(
    "changed", ["config_hash", "fingerprint"], ids=["same-fingerprint", "same-config-hash"]
)
def test_a_directory_differing_in_fingerprint_or_config_hash_alone_is_refused(
    tmp_path: Path, written: tuple[torch.nn.Module, dict[str, Any], Path], changed: str
) -> None:
    """Catches a check that compares only the fingerprint (a different config hash passes) or only
    the config hash (a different fingerprint passes)."""
    _, meta, src = written
    d = _copy(src, tmp_path / "d")
    assert offload.missing_layers(d, meta) == []  # the copy as written is this model's
    have = json.loads((d / "meta.json").read_text())
    other = {**have, changed: f"other-{have[changed]}"}
    unchanged = "fingerprint" if changed == "config_hash" else "config_hash"
    assert other[unchanged] == meta[unchanged] and other["experts"] == meta["experts"]
    (d / "meta.json").write_text(json.dumps(other))
    with pytest.raises(OffloadError) as exc:
        offload.missing_layers(d, meta)
    msg = _one_line(exc)
    assert f"{d} holds the experts of another model" in msg
    assert "choose another offload_dir=DIR or remove it" in msg


# -------------------------------------------------------------------------- 3. fsync, then rename
def test_the_temporary_file_is_complete_and_fsynced_before_it_is_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the fsync removed (or moved after the rename, or before the flush): a crash could
    otherwise leave a renamed file whose data never reached the disk."""
    events: list[tuple[Any, ...]] = []
    real_fsync, real_replace = offload.os.fsync, offload.os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", st.st_ino, st.st_size))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", Path(src), Path(dst), os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(offload.os, "fsync", fsync)
    monkeypatch.setattr(offload.os, "replace", replace)
    target = tmp_path / "layer_000.safetensors"
    payload = b"x" * 100  # well under any write buffer: only the flush puts it in the file
    offload._write_atomic(target, lambda f: f.write(payload))
    assert [e[0] for e in events] == ["fsync", "replace"]
    (_, synced_ino, synced_size), (_, src, dst, renamed_ino) = events
    assert (src, dst) == (tmp_path / ".layer_000.safetensors.tmp", target)
    assert synced_ino == renamed_ino  # the file fsynced is the one renamed
    assert synced_size == len(payload)
    assert target.read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


@pytest.mark.parametrize("failing", ["write", "fsync"])
def test_a_failed_write_leaves_neither_temporary_file_nor_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Catches the temporary file kept after an error, and a rename that happens whatever the
    fsync said (the target would then be taken for complete)."""
    replaced: list[Any] = []
    real_replace = offload.os.replace
    monkeypatch.setattr(offload.os, "replace", lambda s, d: (replaced.append(d), real_replace(s, d)))

    def broken(*args: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    if failing == "fsync":
        monkeypatch.setattr(offload.os, "fsync", broken)

    def write(f: Any) -> None:
        f.write(b"half a layer")
        if failing == "write":
            broken()

    target = tmp_path / "layer_000.safetensors"
    with pytest.raises(OffloadError) as exc:
        offload._write_atomic(target, write)
    msg = _one_line(exc)
    assert f"cannot write {target} (Input/output error)" in msg
    assert replaced == []
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------- 4. EINVAL from a read, not the open
def _direct_refused_at_read(monkeypatch: pytest.MonkeyPatch) -> tuple[set[int], list[int]]:
    """Opens that stand for an accepted O_DIRECT (plain opens, so any file system will do) and a
    ``preadv`` that refuses those fds with EINVAL. Returns the "direct" fds and the refused calls."""
    direct: set[int] = set()
    refused: list[int] = []
    real_preadv = offload.os.preadv

    def open_direct(path: Path) -> int:
        fd = os.open(path, os.O_RDONLY)
        direct.add(fd)
        return fd

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if fd in direct:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(offload, "_open_direct", open_direct)
    monkeypatch.setattr(offload.os, "preadv", preadv)
    monkeypatch.setattr(offload, "_WARNED", set())
    return direct, refused


def _check_expert(reader: ExpertReader, buf: torch.Tensor, model: torch.nn.Module, pos: int, e: int) -> None:
    experts = model.model.layers[pos].mlp.experts
    got = reader.layouts[pos].views(buf, 1)
    assert torch.equal(got["gate_up_proj"][0], experts.gate_up_proj[e])
    assert torch.equal(got["down_proj"][0], experts.down_proj[e])


def test_einval_from_a_direct_read_reopens_buffered_warns_once_and_retries(
    written: tuple[torch.nn.Module, dict[str, Any], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the read-time fallback broken: EINVAL re-raised, the files not reopened (the retry
    fails again), the retry skipped (the buffer keeps zeros), or no OffloadWarning."""
    model, meta, d = written
    direct, refused = _direct_refused_at_read(monkeypatch)
    reader = ExpertReader(d, meta, threads=1)
    try:
        assert reader.direct and set(reader._fds) == direct  # the open took O_DIRECT
        buf = offload.aligned_bytes(STRIDE)
        with pytest.warns(OffloadWarning, match="does not support direct I/O") as rec:
            reader.read_into(1, 3, buf.numpy())
        assert len(rec) == 1
        assert len(refused) == 1  # one refused read, then the buffered retry
        assert reader.direct is False
        assert not direct & set(reader._fds)  # every layer's file reopened, not only layer 1's
        _check_expert(reader, buf, model, 1, 3)
        assert (reader.reads, reader.bytes_read) == (1, STRIDE)
        # the other layer reads buffered at once, and nothing is said again
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            reader.read_into(0, 6, buf.numpy())
        assert len(refused) == 1
        _check_expert(reader, buf, model, 0, 6)
    finally:
        reader.close()


def test_a_part_read_in_flight_when_another_part_reopened_the_files_retries(
    written: tuple[torch.nn.Module, dict[str, Any], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two I/O threads each read one 4096-byte part of an expert and both get EINVAL on the direct
    fd; one reopens the files, the other must retry on the new fd. Catches a retry only in the
    thread that reopened (the other's EINVAL reaching the caller)."""
    model, meta, d = written
    direct, refused = _direct_refused_at_read(monkeypatch)
    barrier = threading.Barrier(2, timeout=10)
    refusing = offload.os.preadv

    def both_refused(fd: int, buffers: Any, offset: int) -> int:
        if fd in direct:
            barrier.wait()  # both parts hold the direct fd before either is refused
        return refusing(fd, buffers, offset)

    monkeypatch.setattr(offload.os, "preadv", both_refused)
    reader = ExpertReader(d, meta, threads=2)
    try:
        assert offload._parts(STRIDE, 2) == [(0, 4096), (4096, 8192)]
        buf = offload.aligned_bytes(STRIDE)
        with pytest.warns(OffloadWarning, match="does not support direct I/O") as rec:
            reader.submit(1, 5, buf.numpy()).result(timeout=20)
        assert len(rec) == 1 and len(refused) == 2
        assert reader.direct is False
        _check_expert(reader, buf, model, 1, 5)
        assert (reader.reads, reader.bytes_read) == (1, STRIDE)
    finally:
        reader.close()


# ------------------------------------------------------------------ 5. a damaged header, same size
def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["length-prefix", "json", "padding"])
def test_a_header_byte_flipped_at_the_same_size_is_refused_as_damaged(
    tmp_path: Path, written: tuple[torch.nn.Module, dict[str, Any], Path], where: str
) -> None:
    """Catches a check of the file's size alone: a flipped header byte keeps the size right."""
    _, meta, src = written
    d = _copy(src, tmp_path / "d")
    path = d / meta["files"][1]
    raw = path.read_bytes()
    text_end = 8 + len(raw[8:4096].rstrip(b" "))  # the JSON ends where the space padding starts
    assert 8 + int.from_bytes(raw[:8], "little") == 4096 and text_end < 4096
    at = {"length-prefix": 0, "json": raw.index(b'"data_offsets"') + 1, "padding": text_end}[where]
    _flip(path, at)
    assert path.stat().st_size == len(raw) == 4096 + NUM_EXPERTS * STRIDE
    with pytest.raises(OffloadError) as exc:
        offload.missing_layers(d, meta)
    msg = _one_line(exc)
    assert f"expert file {path} is damaged (its header differs)" in msg and "delete it" in msg


def test_a_flipped_data_byte_is_not_detected_by_the_header_check(
    tmp_path: Path, written: tuple[torch.nn.Module, dict[str, Any], Path]
) -> None:
    """A known limit, pinned so that it stays a deliberate one: ``missing_layers`` compares the
    file's size and header bytes, not its data (no checksum), so a flipped byte inside expert 3's
    block passes and the reader returns the damaged weights."""
    model, meta, src = written
    d = _copy(src, tmp_path / "d")
    path = d / meta["files"][1]
    at = 4096 + 3 * STRIDE + 5  # byte 5 of expert 3's gate_up_proj
    _flip(path, at)
    assert offload.missing_layers(d, meta) == []
    reader = ExpertReader(d, meta, threads=1)
    try:
        buf = offload.aligned_bytes(STRIDE)
        reader.read_into(1, 3, buf.numpy())
    finally:
        reader.close()
    want = model.model.layers[1].mlp.experts.gate_up_proj[3].detach().clone()
    want.view(torch.uint8).view(-1)[5] ^= 0x01
    assert torch.equal(reader.layouts[1].views(buf, 1)["gate_up_proj"][0], want)
