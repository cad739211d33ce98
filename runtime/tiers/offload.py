"""The disk tier: routed experts in an offload directory, read with direct I/O into pre-allocated slots.

PreScope §4.4 (AsyncIO) moves experts between tiers with asynchronous, fixed-buffer transfers; this
is that transfer with a disk as the slow tier, as a CPU user runs a model larger than its RAM today
with llama.cpp's mmap or accelerate's disk offload, minus the page cache: a miss is served by the
device, never by the OS's copy of the file.

An offload directory holds:
- ``meta.json``: the model's fingerprint (config hash and routing shape), each expert tensor's
  per-expert shape and dtype, the alignment and the file names;
- ``layer_NNN.safetensors``, one per MoE layer: valid safetensors files whose header is padded with
  spaces so the data starts at a multiple of ``ALIGN`` bytes, with expert ``e``'s tensors
  (``e{e}.{name}``) packed in one block at ``data_start + e * stride`` (``stride`` a multiple of
  ``ALIGN``; ``__pad`` tensors fill the gaps), so one aligned read of ``stride`` bytes loads an expert;
- ``dense.safetensors``: the model's other weights, so a later load never materialises the experts;
- for each quantized precision written (:mod:`moecast.runtime.tiers.precision`), ``layer_NNN.<tag>.safetensors``
  (``int8``, ``int4-g128``) laid out the same way, with the stored parts (``gate_up_proj.q``,
  ``gate_up_proj.sz``...) in each block, and an entry under ``precisions`` in ``meta.json`` (its layout
  and files; for int4 an id of the int4 kernel's packing, so a torch that packs otherwise is refused).
  The model-dtype files are always there too: they restore the model at detach, and a precision missing
  from a directory is written from them when the model's experts are not in memory.

Files are written to a temporary name and renamed when complete, so an interrupted write is resumed
by writing the missing files again; a directory of another model's experts is refused.

:class:`ExpertReader` reads experts on a small I/O thread pool (``os.preadv`` releases the GIL) with
``O_DIRECT`` into page-aligned memory; where the file system refuses ``O_DIRECT`` it falls back to
buffered reads followed by ``posix_fadvise(DONTNEED)`` and says so once. A quantized copy's scales
are checked finite at each expert's first read (a damaged scale would turn the expert's output into
NaN silently); the check runs on the I/O threads, once per expert and reader. :class:`DiskLayerStore`
is :class:`moecast.runtime.tiers.expert_store.LayerStore` over that reader: on the CPU the slots are
aligned host memory that a read fills in place; with CUDA a read fills a pinned staging buffer whose
block then goes to the device slot on the tier's one transfer stream, a prefetch's behind the demand
copies still being read when it lands (:class:`LinkOrder`). Experts that are not resident are not
held in memory anywhere: those computed on the CPU are read in waves into two buffers of
``cpu_wave`` blocks each (the first two waves' reads start before the caller computes its resident
experts; one wave computes while the next is read), so the memory beyond the slots is bounded
however many experts a prefill sends to the CPU.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import hashlib
import json
import mmap
import os
import resource
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moecast.runtime.tiers.expert_store import (
    STAGING_BUFFERS,
    LayerStore,
    device_slots,
    expert_params,
    pending_in,
)
from moecast.runtime.tiers.iopool import IOPool
from moecast.runtime.tiers.layout import ALIGN, MEMORY_ALIGN, ExpertLayout, align_up
from moecast.runtime.tiers.precision import (
    Precision,
    SlotDequantizer,
    pack_int4,
    quantize_params,
    stored_layout,
)
from safetensors.torch import _TYPES as SAFETENSORS_DTYPES
from torch import nn

from moecast.errors import MoecastError

FORMAT = "moecast-offload"
VERSION = 1
IO_THREADS = 2
#: a transparent huge page (x86-64; arm64 with 4 KB pages)
HUGE_PAGE = 2 << 20
DENSE = "dense.safetensors"


class OffloadError(MoecastError):
    """An offload directory that cannot be used as it is; the one-line message says what to do."""


class OffloadWarning(UserWarning):
    """The disk tier runs, but not as asked (buffered reads where direct I/O was refused)."""


def _align(n: int) -> int:
    return align_up(n, ALIGN)


def _header(layout: ExpertLayout, num_experts: int) -> tuple[bytes, int]:
    """The safetensors header (length prefix included), padded so the data starts at a multiple of ALIGN."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt", "moecast": FORMAT}}
    pos = 0

    def pad(upto: int, tag: str) -> None:
        nonlocal pos
        if upto > pos:  # safetensors indexes every byte of its buffer: gaps are uint8 tensors
            entries[tag] = {"dtype": "U8", "shape": [upto - pos], "data_offsets": [pos, upto]}
            pos = upto

    for e in range(num_experts):
        base = e * layout.stride
        for i, name in enumerate(layout.names):
            pad(base + layout.offsets[i], f"e{e}.__pad{i}")
            end = pos + layout.nbytes(i)
            entries[f"e{e}.{name}"] = {
                "dtype": layout.dtypes[i],
                "shape": list(layout.shapes[i]),
                "data_offsets": [pos, end],
            }
            pos = end
        pad(base + layout.stride, f"e{e}.__pad")
    text = json.dumps(entries, separators=(",", ":")).encode()
    start = _align(8 + len(text))
    text += b" " * (start - 8 - len(text))
    return len(text).to_bytes(8, "little") + text, start


# ---------------------------------------------------------------------------------------- metadata
def offload_meta(model: Any, structure: Any) -> dict[str, Any]:
    """What an offload directory of this model records: fingerprint, expert layout, file names."""
    from moecast.collect.models import config_hash, model_info

    info = model_info(model, structure, "")
    layouts = [ExpertLayout.of(expert_params(e.experts)) for e in structure.layers]
    return {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": info.fingerprint,
        "config_hash": config_hash(model.config),
        "num_experts": info.num_experts,
        "moe_layers": [int(e.layer) for e in structure.layers],
        "align": ALIGN,
        "experts": [lay.as_json() for lay in layouts],
        "files": [f"layer_{pos:03d}.safetensors" for pos in range(len(structure.layers))],
        "dense": DENSE,
    }


def _layouts(meta: dict[str, Any]) -> list[ExpertLayout]:
    out = []
    for tensors in meta["experts"]:
        fake = {
            t["name"]: torch.empty((1, *t["shape"]), dtype=SAFETENSORS_DTYPES[t["dtype"]], device="meta")
            for t in tensors
        }
        out.append(ExpertLayout.of(fake))
    return out


def _read_meta(directory: Path) -> dict[str, Any] | None:
    path = directory / "meta.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OffloadError(
            f"{path} is unreadable ({exc}); remove {directory} and run again to rewrite it"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise OffloadError(
            f"{directory} is not a moecast offload directory; choose an empty or new offload_dir=DIR"
        )
    return meta


MODEL = Precision()


def int4_layout_id() -> str:
    """A digest of the int4 kernel's packing of a fixed matrix: two torches that pack alike share it."""
    codes = (torch.arange(16 * 64).reshape(16, 64) * 7 % 16).to(torch.int32)
    return hashlib.sha256(pack_int4(codes).numpy().tobytes()).hexdigest()[:16]


def _stored_layout(experts: nn.Module, prec: Precision) -> ExpertLayout:
    """One layer's expert block as ``prec`` stores it (shapes only: the module may be on meta)."""
    return stored_layout(prec, expert_params(experts), bool(getattr(experts, "is_transposed", False)), ALIGN)


def with_precision(meta: dict[str, Any], structure: Any, prec: Precision) -> dict[str, Any]:
    """``meta`` with ``prec``'s entry under ``precisions`` (unchanged for the model's own dtype)."""
    if not prec.quantized:
        return meta
    entry: dict[str, Any] = {
        "experts": [_stored_layout(e.experts, prec).as_json() for e in structure.layers],
        "files": [f"layer_{pos:03d}.{prec.tag}.safetensors" for pos in range(len(structure.layers))],
    }
    if prec.dtype == "int4":
        entry["int4_layout"] = int4_layout_id()
    return {**meta, "precisions": {**meta.get("precisions", {}), prec.tag: entry}}


def tier_meta(meta: dict[str, Any], prec: Precision) -> dict[str, Any]:
    """What a reader of ``prec``'s files needs: ``meta`` with that precision's layout and files."""
    if not prec.quantized:
        return {**meta, "precision": MODEL.tag}
    entry = meta["precisions"][prec.tag]
    return {**meta, "experts": entry["experts"], "files": entry["files"], "precision": prec.tag}


def _check_same_precision(
    directory: Path, have: dict[str, Any], want: dict[str, Any], prec: Precision
) -> bool:
    """Whether ``directory`` records ``prec``'s files as this run would write them (False: none yet, or
    a record whose files are all gone: they are written again); refuses one recorded otherwise (another
    layout or int4 packing) while any of its files is there."""
    got = have.get("precisions", {}).get(prec.tag)
    if got is None:
        return False
    need = want["precisions"][prec.tag]
    if got == need:
        return True
    if not any((directory / name).exists() for name in got.get("files", [])):
        return False
    if got.get("int4_layout") != need.get("int4_layout"):
        why = f"packed by another torch's int4 kernel (layout {got.get('int4_layout')}, this torch packs {need.get('int4_layout')})"
    else:
        why = f"in another layout ({_layout_difference(got['experts'], need['experts'])})"
    raise OffloadError(
        f"{directory} holds {prec.tag} experts {why}; remove its layer_*.{prec.tag}.safetensors files (they are "
        "written again), or choose another offload_dir=DIR"
    )


def _layout_difference(got: list[list[dict[str, Any]]], need: list[list[dict[str, Any]]]) -> str:
    """The first tensor whose recorded name, shape or dtype differs from this run's, in a few words."""
    for pos, (a, b) in enumerate(zip(got, need)):
        for x, y in zip(a, b):
            if x != y:
                return (
                    f"MoE layer {pos}'s {y.get('name')}: recorded {x.get('name')} {x.get('shape')} {x.get('dtype')}, "
                    f"this run's {y.get('shape')} {y.get('dtype')}"
                )
        if len(a) != len(b):
            return f"MoE layer {pos}: {len(a)} tensors recorded, this run's {len(b)}"
    return f"{len(got)} layers recorded, this run's {len(need)}"


def _check_same_model(directory: Path, have: dict[str, Any], want: dict[str, Any]) -> None:
    if have.get("version") != VERSION:
        raise OffloadError(
            f"{directory} was written by offload format {have.get('version')}, this moecast reads {VERSION}; "
            "remove it or choose another offload_dir=DIR"
        )
    if have.get("fingerprint") != want["fingerprint"] or have.get("config_hash") != want["config_hash"]:
        raise OffloadError(
            f"{directory} holds the experts of another model (fingerprint {have.get('fingerprint')}, this model is "
            f"{want['fingerprint']}); choose another offload_dir=DIR or remove it"
        )
    if have.get("experts") != want["experts"]:
        raise OffloadError(
            f"{directory} holds this model's experts in another shape or dtype ({have['experts'][0]} vs "
            f"{want['experts'][0]}); load the model in the dtype it was written in, or choose another offload_dir=DIR"
        )


def missing_layers(directory: str | Path, meta: dict[str, Any], prec: Precision = MODEL) -> list[int]:
    """MoE layer positions whose expert file at ``prec`` (``meta`` carries its entry: :func:`with_precision`)
    is not written yet; refuses another model's, another layout's or a damaged file."""
    d = Path(directory)
    have = _read_meta(d)
    if have is None:
        return list(range(len(meta["files"])))
    _check_same_model(d, have, meta)
    if prec.quantized and not _check_same_precision(d, have, meta, prec):
        return list(range(len(meta["files"])))
    tm = tier_meta(meta, prec)
    out = []
    for pos, (name, layout) in enumerate(zip(tm["files"], _layouts(tm))):
        path = d / name
        if not path.exists():
            out.append(pos)
            continue
        header, start = _header(layout, meta["num_experts"])
        want = start + meta["num_experts"] * layout.stride
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(header))
        if size != want or head != header:
            if size < want:
                what = f"truncated ({size} of {want} bytes)"
            elif size > want:
                what = f"longer than its layout ({size} of {want} bytes)"
            else:
                what = "damaged (its header differs)"
            raise OffloadError(f"expert file {path} is {what}; delete it and run again to rewrite it")
    return out


# ------------------------------------------------------------------------------------------ writing
def _write_atomic(path: Path, write: Any) -> None:
    """``write(file)`` into a temporary name, fsync, rename: a half-written file is never taken for complete."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno == errno.ENOSPC:
            raise OffloadError(
                f"no space left on the disk of {path.parent} while writing {path.name}; free space or choose "
                "another offload_dir=DIR (the files written so far are kept, and a re-run resumes)"
            ) from None
        raise OffloadError(
            f"cannot write {path} ({exc.strerror or exc}); choose a writable offload_dir=DIR"
        ) from None


def _write_layer(f: Any, params: dict[str, torch.Tensor], layout: ExpertLayout, num_experts: int) -> None:
    header, _ = _header(layout, num_experts)
    f.write(header)
    for e in range(num_experts):
        block = np.zeros(layout.stride, np.uint8)
        for i, name in enumerate(layout.names):
            raw = params[name][e].detach().contiguous().view(torch.uint8).reshape(-1).numpy()
            block[layout.offsets[i] : layout.offsets[i] + len(raw)] = raw
        f.write(block.tobytes())


def _dense_state(model: nn.Module, expert_names: set[str]) -> dict[str, torch.Tensor]:
    """The model's non-expert tensors, each storage once (tied weights are tied again on load)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if name in expert_names or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def _expert_names(model: nn.Module, structure: Any) -> set[str]:
    names = set()
    for entry in structure.layers:
        prefix = next(n for n, m in model.named_modules() if m is entry.experts)
        names |= {f"{prefix}.{p}" for p in expert_params(entry.experts)}
    return names


def prepare_dir(directory: str | Path) -> Path:
    """Create ``directory`` and prove it writable, or say in one line why it is not."""
    d = Path(directory).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OffloadError(
                f"the disk of offload directory {d} is full; free space or choose another offload_dir=DIR"
            ) from None
        raise OffloadError(
            f"cannot write to offload directory {d} ({exc.strerror or exc}); choose a writable offload_dir=DIR"
        ) from None
    return d


def write_offload(
    model: nn.Module, structure: Any, directory: str | Path, dense: bool = True, precision: Precision = MODEL
) -> dict[str, Any]:
    """Write the model's experts (and, with ``dense``, its other weights) into ``directory``, resuming.

    The model-dtype files always; with a quantized ``precision`` its files too, quantized from the
    experts in memory or, when the model has none there, from the model-dtype files already written.
    Complete files are kept; missing ones are written, each atomically. Refuses a directory of
    another model, a damaged file, and a disk without room for what is missing. Returns the meta.
    """
    d = prepare_dir(directory)
    meta = with_precision(offload_meta(model, structure), structure, precision)
    todo = missing_layers(d, meta)
    qtodo = missing_layers(d, meta, precision) if precision.quantized else []
    dense_todo = dense and not (d / DENSE).is_file()
    if not todo and not qtodo and not dense_todo:
        return meta
    _check_room(d, meta, [(MODEL, todo), (precision, qtodo)])
    for pos in todo:
        params = expert_params(structure.layers[pos].experts)
        if any(t.device.type == "meta" for t in params.values()):
            raise OffloadError(
                f"{d} lacks the experts of MoE layer {meta['moe_layers'][pos]} and this model's experts are not in "
                "memory; load the model whole once to write them"
            )
    have = _read_meta(d) or {}
    # the precisions the directory holds already stay recorded beside this run's
    meta = {**meta, "precisions": {**have.get("precisions", {}), **meta.get("precisions", {})}}
    _write_atomic(d / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    layouts = _layouts(meta)
    for pos in todo:
        params = {n: t.to("cpu") for n, t in expert_params(structure.layers[pos].experts).items()}
        _write_atomic(
            d / meta["files"][pos],
            lambda f, p=params, lay=layouts[pos]: _write_layer(f, p, lay, meta["num_experts"]),
        )
    if qtodo:
        _write_precision(d, structure, meta, precision, qtodo)
    if dense_todo:
        from safetensors.torch import save

        state = {k: v.to("cpu") for k, v in _dense_state(model, _expert_names(model, structure)).items()}
        _write_atomic(d / DENSE, lambda f: f.write(save(state, metadata={"format": "pt", "moecast": FORMAT})))
    return meta


def _check_room(d: Path, meta: dict[str, Any], todo: list[tuple[Precision, list[int]]]) -> None:
    """Refuse a disk without room for the layer files still to write (each precision's positions)."""
    need = 0
    for prec, positions in todo:
        layouts = _layouts(tier_meta(meta, prec)) if positions else []
        need += sum(
            _header(layouts[p], meta["num_experts"])[1] + meta["num_experts"] * layouts[p].stride
            for p in positions
        )
    free = shutil.disk_usage(d).free
    if need > free:
        raise OffloadError(
            f"the disk of {d} has {free / 2**30:.2f} GiB free and the experts need {need / 2**30:.2f} GiB more; "
            "free space or choose another offload_dir=DIR"
        )


def _write_precision(d: Path, structure: Any, meta: dict[str, Any], prec: Precision, todo: list[int]) -> None:
    """``prec``'s layer files at positions ``todo``, quantized from memory or from the model-dtype files."""
    from tqdm import tqdm

    tm, reader = tier_meta(meta, prec), None
    layouts = _layouts(tm)
    print(f"moecast: writing the {prec.tag} experts to {d} once (quantized from the model's weights)")
    try:
        for pos in tqdm(
            todo, desc=f"moecast: writing {prec.tag} experts", unit="layer", disable=len(todo) < 4
        ):
            experts = structure.layers[pos].experts
            params = expert_params(experts)
            if any(t.device.type == "meta" for t in params.values()):
                reader = reader or ExpertReader(d, tier_meta(meta, MODEL))
                params = _read_layer(reader, pos, int(meta["num_experts"]))
            params = {n: t.to("cpu") for n, t in params.items()}
            q = quantize_params(prec, params, bool(getattr(experts, "is_transposed", False)))
            _write_atomic(
                d / tm["files"][pos],
                lambda f, q=q, lay=layouts[pos]: _write_layer(f, q, lay, meta["num_experts"]),
            )
    finally:
        if reader is not None:
            reader.close()


def _read_layer(reader: ExpertReader, pos: int, num_experts: int) -> dict[str, torch.Tensor]:
    """Every expert of MoE layer ``pos`` from ``reader``'s files, as tensors [E, ...] by name."""
    layout = reader.layouts[pos]
    base = aligned_bytes(num_experts * layout.stride)
    for e in range(num_experts):
        reader.read_into(pos, e, base[e * layout.stride : (e + 1) * layout.stride].numpy())
    return layout.views(base, num_experts)


# ------------------------------------------------------------------------------------------ reading
def _open_direct(path: Path) -> int:
    """``path`` opened for direct reads (a test replaces this to stand for a file system without O_DIRECT)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform", str(path))
    return os.open(path, os.O_RDONLY | flag)


_WARNED: set[str] = set()


class ExpertReader:
    """Aligned reads of whole experts from an offload directory, on a small I/O thread pool.

    ``pool``: another reader's pool to read on (a second copy's files share the disk and its threads:
    reads of both copies are served in the order submitted); closing it is that reader's."""

    def __init__(
        self,
        directory: str | Path,
        meta: dict[str, Any],
        threads: int = IO_THREADS,
        pool: IOPool | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.meta = meta
        self.layouts = _layouts(meta)
        self.starts = [_header(lay, meta["num_experts"])[1] for lay in self.layouts]
        self.paths = [self.directory / name for name in meta["files"]]
        self.direct = True
        self._fds: list[int] = []
        self._retired: list[int] = []  # direct fds replaced by buffered ones (closed in close())
        self._reopen_lock = threading.Lock()
        for path in self.paths:
            self._fds.append(self._open(path))
        self.threads = max(1, int(threads))
        self._own_pool = pool is None
        self.pool = pool or IOPool(self.threads)
        self._lock = threading.Lock()
        # the CPU's experts are read in waves of cpu_wave experts into two buffers (one wave computes
        # while the next is read), so a call holds 2 x cpu_wave experts however many it computes
        self.cpu_wave = max(2, int(threads))
        self._cpu_raw: torch.Tensor | None = None
        self._cpu_lock = threading.Lock()
        # a quantized copy's scales, checked finite at each expert's first read (a NaN scale would turn
        # the expert's output into NaN and the model's text blank, with nothing said)
        self._scales = [_scale_spans(lay) for lay in self.layouts]
        self._verified = np.zeros((len(self.layouts), int(meta["num_experts"])), bool)
        self._verified[[not spans for spans in self._scales]] = True
        self.bytes_read = 0
        self.reads = 0
        # wall time with at least one read in flight: bytes_read / busy_s is the disk's rate as
        # this run saw it (the union of the reads' intervals, so overlapping reads count once)
        self.busy_s = 0.0
        self._active = 0
        self._busy_since = 0.0

    def _open(self, path: Path) -> int:
        if self.direct:
            try:
                return _open_direct(path)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise OffloadError(f"cannot open expert file {path} ({exc.strerror or exc})") from None
                self._fallback()
        return os.open(path, os.O_RDONLY)

    def _fallback(self) -> None:
        self.direct = False
        key = str(self.directory)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(
                f"the file system of {self.directory} does not support direct I/O (O_DIRECT): experts are read "
                "through the page cache and their pages dropped after each read (posix_fadvise DONTNEED)",
                OffloadWarning,
                stacklevel=3,
            )

    def read_into(self, pos: int, expert: int, buf: Any) -> None:
        """Read expert ``expert`` of MoE layer ``pos`` (its whole aligned block) into ``buf``."""
        view = self._view(pos, buf)
        self._read_part(pos, expert, view, 0, len(view), 1)
        self._verified[pos, expert] = True

    def _view(self, pos: int, buf: Any) -> memoryview:
        view = memoryview(buf).cast("B")
        stride = self.layouts[pos].stride
        if len(view) != stride:
            raise ValueError(f"read buffer of {len(view)} bytes for an expert block of {stride}")
        return view

    def _read_part(self, pos: int, expert: int, view: memoryview, start: int, end: int, reads: int) -> None:
        """Bytes [start, end) of the expert's block into the same bytes of ``view`` (``reads``: 1 for
        the part that counts the expert as read, 0 for the others)."""
        offset = self.starts[pos] + int(expert) * self.layouts[pos].stride + start
        self._enter()
        try:
            self._read(pos, expert, view[start:end], offset, end - start)
        except BaseException:
            self._leave(0, 0)
            raise
        self._leave(end - start, reads)
        if not self._verified[pos, expert]:
            self._check_scales(pos, expert, view, start, end)

    def _check_scales(self, pos: int, expert: int, view: memoryview, start: int, end: int) -> None:
        """Refuse non-finite scales and step sizes that are not positive among bytes [start, end) of the
        expert's block just read (whole elements: parts and tensors start on multiples of their element
        size). A zeroed block, the commonest damage, has zero steps; the files carry no checksum, so
        damage that leaves the steps positive and finite goes unseen."""
        for name, a, b, dtype in self._scales[pos]:
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            size = np.dtype(_EXPONENT[dtype][0]).itemsize
            # .s holds one step per row; .sz pairs (step, zero point), the steps at its even elements
            every = 2 if name.endswith(".sz") else 1
            what = _bad_scales(view[lo:hi], dtype, ((lo - a) // size) % every, every)
            if what:
                raise OffloadError(
                    f"{self.paths[pos]}: expert {expert}'s {name} holds {what}, so the file is damaged; "
                    "delete it and run again to rewrite it"
                )

    def _enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.perf_counter()
            self._active += 1

    def _leave(self, nbytes: int, reads: int) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self.busy_s += time.perf_counter() - self._busy_since
            self.bytes_read += nbytes
            self.reads += reads

    def observed_gbps(self) -> float | None:
        """The disk's read rate over the time a read was in flight (None before any read)."""
        return self.bytes_read / self.busy_s / 1e9 if self.busy_s > 0 else None

    def _read(self, pos: int, expert: int, view: memoryview, offset: int, stride: int) -> None:
        done = 0
        while done < stride:
            fd = self._fds[pos]
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # the open accepted O_DIRECT but the read did not: read this layer's files buffered
                # (once, by whichever read failed first; another read in flight then retries)
                with self._reopen_lock:
                    if self.direct:
                        self._fallback()
                        self._reopen_buffered()
                if self._fds[pos] == fd:
                    raise
                continue
            if got == 0:
                raise OffloadError(
                    f"expert file {self.paths[pos]} ends at byte {offset + done}, before expert {expert}'s end; "
                    "it is truncated: delete it and run again to rewrite it"
                )
            done += got
        if not self.direct:
            os.posix_fadvise(self._fds[pos], offset, stride, os.POSIX_FADV_DONTNEED)

    def _reopen_buffered(self) -> None:
        with self._lock:
            for i, path in enumerate(self.paths):
                # the direct fd stays open until close(): a read in flight may still hold it
                self._retired.append(self._fds[i])
                self._fds[i] = os.open(path, os.O_RDONLY)

    def submit(self, pos: int, expert: int, buf: Any) -> Future:
        """Read the expert into ``buf`` on the I/O pool; the future is done once all of it is read.

        The block is split into one part per I/O thread, queued together: the threads read one
        expert's parts side by side and the experts land in the order submitted, each as soon as
        the disk can deliver it. Whole experts on parallel threads would share the disk instead,
        and two submitted together would both land at the end (a layer could compute neither
        before both were read)."""
        view = self._view(pos, buf)
        parts = [
            (pos, expert, view, a, b, int(i == 0)) for i, (a, b) in enumerate(_parts(len(view), self.threads))
        ]
        fut = self.pool.submit_parts(self._read_part, parts)
        if not self._verified[pos, expert]:  # every part checked its bytes: the expert is checked
            fut.add_done_callback(functools.partial(self._mark_verified, pos, expert))
        return fut

    def _mark_verified(self, pos: int, expert: int, fut: Future) -> None:
        if fut.exception() is None:
            self._verified[pos, expert] = True

    @contextlib.contextmanager
    def cpu_buffers(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The two wave buffers of :meth:`DiskLayerStore.cpu_waves`, held by one caller at a time.

        Allocated at the first use and kept: a fresh buffer per call would zero-fill its pages again."""
        with self._cpu_lock:
            if self._cpu_raw is None:
                stride = max(lay.stride for lay in self.layouts)
                self._cpu_raw = aligned_bytes(2 * self.cpu_wave * stride)
            half = len(self._cpu_raw) // 2
            yield self._cpu_raw[:half], self._cpu_raw[half:]

    def close(self) -> None:
        if self._own_pool:
            self.pool.shutdown(wait=True)
        self._cpu_raw = None
        for fd in [*self._fds, *self._retired]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds, self._retired = [], []


#: a float's exponent bits by safetensors dtype: all ones is inf or NaN
_EXPONENT = {
    "BF16": (np.uint16, 0x7F80),
    "F16": (np.uint16, 0x7C00),
    "F32": (np.uint32, 0x7F800000),
    "F64": (np.uint64, 0x7FF0000000000000),
}


def _scale_spans(layout: ExpertLayout) -> list[tuple[str, int, int, str]]:
    """(name, start, end, dtype) of the scale tensors (``.s``, ``.sz``) in an expert's block."""
    return [
        (n, off, off + layout.nbytes(i), layout.dtypes[i])
        for i, (n, off) in enumerate(zip(layout.names, layout.offsets))
        if n.endswith((".s", ".sz")) and layout.dtypes[i] in _EXPONENT
    ]


def _bad_scales(buf: memoryview, dtype: str, first: int, every: int) -> str:
    """What is wrong with the scales in ``buf`` (safetensors ``dtype``), '' if nothing: an element that
    is not finite, or a step (every ``every``-th element from ``first``) that is not positive; from the
    bits, as numpy has no bfloat16."""
    kind, mask = _EXPONENT[dtype]
    bits = np.frombuffer(buf, kind)
    if ((bits & kind(mask)) == kind(mask)).any():
        return "non-finite scales"
    steps = bits[first::every]
    sign = kind(1 << (8 * np.dtype(kind).itemsize - 1))
    # a quantizer's step is > 0 (precision.min_step): zero, or a set sign bit (-0.0 too), is damage
    if ((steps & sign) != 0).any() or (steps == 0).any():
        return "steps that are not positive"
    return ""


def _parts(nbytes: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of up to ``n`` parts of ``nbytes``, every boundary on an ALIGN multiple."""
    step = max(ALIGN, -(-nbytes // max(1, n) // ALIGN) * ALIGN)
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def aligned_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` page-aligned, zero-filled host memory (an anonymous mmap it keeps alive).

    Its pages are faulted in here: a slot's first read would otherwise zero its pages inside the
    decode step, 3-6 ms of a core per DeepSeek-V2-Lite expert. From one huge page up it starts on a
    huge-page boundary and asks for transparent huge pages (:func:`_huge_pages`)."""
    size = max(ALIGN, _align(nbytes))
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return _frombuffer(mmap.mmap(-1, size, flags=flags))[: max(1, int(nbytes))]
    huge = align_up(size, HUGE_PAGE)
    mm = mmap.mmap(-1, huge + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room to align
    whole = _frombuffer(mm)
    start = (-whole.data_ptr()) % HUGE_PAGE
    _huge_pages(mm, start, huge)
    out = whole[start : start + size]
    out[:: mmap.PAGESIZE] = 0  # fault every page in now (a huge page at its first byte)
    return out[: max(1, int(nbytes))]


def _huge_pages(mm: mmap.mmap, start: int, length: int) -> None:
    """Back ``length`` bytes of ``mm`` from ``start`` with transparent huge pages (MADV_HUGEPAGE), which
    Linux grants where THP is ``madvise`` or ``always``. An O_DIRECT read pins its buffer's pages: a 2 MB
    page is one pin where small pages are 512, which cut a 4.6 MB read's CPU about 4x on a 2-core VM
    (``bench/bench_read_pages.py``). A kernel that refuses (no THP) leaves small pages: nothing else
    changes."""
    with contextlib.suppress(OSError):
        mm.madvise(mmap.MADV_HUGEPAGE, start, length)


def _frombuffer(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that the buffer is writable, which is the point
        return torch.frombuffer(mm, dtype=torch.uint8)


def pinned_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of pinned host memory starting at an ALIGN boundary (for O_DIRECT, then DMA)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def _wait(fut: Future | None) -> Any:
    return None if fut is None else fut.result()


# ------------------------------------------------------------------------------------- the store
class LinkOrder:
    """The order the disk tier's copies take on its one transfer stream (issue 43: prefetch copies are
    ordered after the layer's demand copies).

    The host tier queues a copy when the host issues it, so a layer's demand batch is on the link
    before anything issued after it. The disk tier queues one when its read lands, on an I/O thread,
    and reads land out of order: a prefetch read for layer l+1 that lands while layer l+1's demand
    reads are still running would put its copy on the link ahead of copies the compute stream waits
    for. Here a demand copy is counted when the host issues it and uncounted once it is queued; a
    prefetch copy whose read lands while any is counted is held, and the I/O thread that queues the
    last of them queues the held ones behind it, in the order their reads landed. A prefetch that
    lands with none counted goes at once, as on the host tier.

    Holding costs the host's thread one lock per demand copy and nothing else: no I/O thread ever
    blocks on another (a thread that waited would hold a pool worker that a demand read queued behind
    it may need), and the stream is not made to wait on an event: on one stream the order of the
    copies is the order they are queued, which only the host side decides.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._demand = 0  # demand copies issued and not yet queued
        self._held: list[tuple[Any, Future]] = []  # prefetch copies waiting for them

    def demand(self) -> None:
        """The host issued a demand copy (before its read is submitted)."""
        with self._lock:
            self._demand += 1

    def queue(self, copy: Any, landed: Future, prefetch: bool) -> None:
        """On an I/O thread whose read landed: ``copy()`` queues the copy and gives its events, which
        ``landed`` takes (a prefetch's later, behind the demand copies issued before its read landed)."""
        if prefetch:
            with self._lock:
                if self._demand:
                    self._held.append((copy, landed))
                    return
            _resolve(copy, landed)
            return
        try:
            _resolve(copy, landed)
        finally:
            with self._lock:
                self._demand -= 1
                flush = self._held if self._demand == 0 else []
                if flush:
                    self._held = []
            for held, fut in flush:
                _resolve(held, fut)


def _resolve(copy: Any, landed: Future) -> None:
    try:
        landed.set_result(copy())
    except BaseException as exc:
        landed.set_exception(exc)


def _raise(exc: BaseException) -> None:
    raise exc


class DiskLayerStore(LayerStore):
    """A :class:`LayerStore` whose slow tier is MoE layer ``pos`` of an offload directory.

    On the CPU a load reads the expert straight into its slot (aligned host memory) on the I/O
    pool, and :meth:`wait` blocks on the slots' reads; with ``ops`` (CUDA) a read fills a pinned
    staging buffer and the same I/O thread then queues one copy of the whole block (every tensor
    of the expert, packed as on disk) to the device slot, after the last kernel that read it, with
    one event: the device's slots are one packed buffer too. A prefetch's copy (and an upgrade's)
    goes behind the demand copies still being read when its read lands (``order``, the tier's
    :class:`LinkOrder`, shared by the stores on one ``stream``). The module's own expert tensors are
    never read.

    Two copies (``low_reader``: the low copy's files, :mod:`moecast.runtime.core.mixed`): a slot is sized
    for the high copy (``reader``'s) and holds either; ``slots`` are its tensors read as the high
    copy, ``low_slots`` the same bytes read as the low one, and ``slot_low`` says which each slot
    holds. A load reads the copy ``want_low`` names for the expert (:meth:`follow`: the per-layer
    step's flags), and :meth:`sync` rereads a slot whose flag changed while it was resident (an
    upgrade: the high copy into the same slot). The CPU set reads the low copy.
    """

    def __init__(
        self,
        experts: nn.Module,
        num_slots: int,
        reader: ExpertReader,
        pos: int,
        device: torch.device | str | None = None,
        ops: Any = None,
        low_reader: ExpertReader | None = None,
        stream: Any = None,
        order: LinkOrder | None = None,
        dequant: SlotDequantizer | None = None,
    ) -> None:
        self._setup(experts, num_slots, device if device is not None else "cpu", ops)
        self.reader, self.pos = reader, pos
        self.order = order if order is not None else LinkOrder()  # the link's: shared with ``stream``
        self.layout = layout = reader.layouts[pos]
        if dequant is not None and (self.ops is None or low_reader is not None):
            raise ValueError("dequantizing into the slots needs a device with ops and one copy")
        # what a slot holds: the block as read, or the model's tensors a dequantized block becomes
        self.slot_layout = ExpertLayout.of(expert_params(experts), MEMORY_ALIGN) if dequant else layout
        self.expert_bytes = layout.expert_bytes
        self.low_reader = low_reader
        self.low_layout = low_reader.layouts[pos] if low_reader is not None else layout
        if self.low_layout.stride > layout.stride:
            raise OffloadError(
                f"the low copy of MoE layer {pos} ({self.low_layout.stride} bytes a block) is larger than the "
                f"high one ({layout.stride}); name the larger copy first (e.g. model+int4)"
            )
        self.want_low = np.zeros(self.num_experts, bool)  # the copy each expert's next read takes
        self.slot_low = np.zeros(self.num_slots, bool)  # the copy each slot holds
        self.upgrades = 0  # slots reread at the high copy (sync)
        self.host = {}
        self._staging_raw: list[torch.Tensor] = []
        self._streams = []
        if self.ops is None:
            self._slot_raw = aligned_bytes(self.num_slots * layout.stride)
            self.slots = layout.views(self._slot_raw, self.num_slots)
        else:
            # one stream: copies into one slot stay in order, and each is one whole block (a quantized
            # one lands in a device block and is dequantized into the slot: LayerStore._copy_block)
            self.dequant = dequant
            self._slot_raw, self.slots, self._landing = device_slots(self, dequant)
            self._streams = [stream if stream is not None else self.ops.stream()]
            pin = bool(self.ops.pins)
            for _ in range(STAGING_BUFFERS):
                self._staging_raw.append(
                    pinned_aligned(layout.stride) if pin else aligned_bytes(layout.stride)
                )
        self.low_slots = (
            self.low_layout.views(self._slot_raw, self.num_slots, stride=layout.stride)
            if low_reader is not None
            else self.slots
        )
        # the CPU set computes from the low copy (mixed.py, rule 1), read into the low reader's buffers
        self._cpu = (low_reader, self.low_layout) if low_reader is not None else (reader, layout)
        self.pinned_bytes = layout.stride * len(self._staging_raw)
        self.staged = False  # reads land in pinned staging by design: no pageable fallback
        self._pending: dict[int, Future] = {}  # slot -> its read (and, with ops, the copy it queued)
        self._staging_busy: list[Future | None] = [None] * len(self._staging_raw)
        self._next_staging = 0

    def _blocked(self, fut: Future | None) -> Any:
        if fut is None or fut.done():
            return _wait(fut)
        import time

        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.waits.s += time.perf_counter() - t0

    def follow(self, want_low: np.ndarray) -> None:
        """Read each expert at the copy ``want_low[expert]`` names from now on (a live view of the
        step's per-expert flags: low for a demand load, high for a prefetch)."""
        self.want_low = want_low

    def sync(self) -> int:
        """Reread every slot whose copy is not the one its expert's flag names (an upgrade: the high
        copy over the low one, into the same slot; the compute waits for it as for any read); returns
        how many were reread."""
        held = self.expert_in >= 0
        want = self.want_low[np.where(held, self.expert_in, 0)] & held
        stale = np.flatnonzero(held & (self.slot_low != want))
        for slot in stale:
            self.upgrades += int(self.slot_low[slot])
            # idle-window work, as a prefetch: behind the demand copies on the link
            self._copy(int(self.expert_in[slot]), int(slot), prefetch=True)
            self.bytes_moved += self.moved_bytes(int(slot))
        return len(stale)

    def moved_bytes(self, slot: int) -> int:
        """The bytes of the copy ``slot`` holds: the low copy's or the high one's."""
        return self.low_layout.expert_bytes if self.slot_low[slot] else self.expert_bytes

    def _copy(self, expert: int, slot: int, prefetch: bool = False) -> None:
        low = self.low_reader is not None and bool(self.want_low[expert])
        reader, nbytes = (
            (self.low_reader, self.low_layout.stride) if low else (self.reader, self.layout.stride)
        )
        # a read still landing in this slot must finish before another overwrites it
        self._blocked(self._pending.pop(slot, None))
        self.slot_low[slot] = low
        if self.ops is None:
            start = slot * self.layout.stride
            buf = self._slot_raw[start : start + nbytes].numpy()
            self._pending[slot] = reader.submit(self.pos, expert, buf)
            return
        b = self._next_staging
        self._next_staging = (b + 1) % len(self._staging_raw)
        for ev in self._blocked(self._staging_busy[b]) or []:  # its previous copy must have read it
            ev.synchronize()
        read = self._read_events.pop(slot, None)
        landed: Future = Future()  # done once the copy is queued: its events
        if not prefetch:  # counted after the staging wait: a held prefetch never waits for an unsent read
            self.order.demand()
        self.reader.pool.submit(self._read_and_copy, expert, slot, b, read, reader, nbytes, prefetch, landed)
        self._pending[slot] = self._staging_busy[b] = landed

    def _read_and_copy(
        self,
        expert: int,
        slot: int,
        b: int,
        read: Any,
        reader: ExpertReader,
        nbytes: int,
        prefetch: bool,
        landed: Future,
    ) -> None:
        """On an I/O thread: the expert's block (``nbytes``, from ``reader``'s copy) into staging buffer
        ``b``, then to the slot's device bytes in one copy, after ``read`` (the last kernel that read the
        slot) and, for a ``prefetch``, after the demand copies still being read (:class:`LinkOrder`);
        ``landed`` takes its one event, which marks it landed."""
        try:  # whatever happens, the copy is handed to the order: a demand counted there is uncounted
            staged = self._staging_raw[b][:nbytes]
            reader.read_into(self.pos, expert, staged.numpy())
            copy = functools.partial(self._copy_block, staged, slot, read)
        except BaseException as exc:
            copy = functools.partial(_raise, exc)
        self.order.queue(copy, landed, prefetch)

    def wait(self, slots: np.ndarray | list[int] | None = None) -> None:
        """Block until the given slots' reads (all, if None) are done; with ops, the compute stream waits for their copies."""
        keys = list(self._pending) if slots is None else [int(s) for s in slots if int(s) in self._pending]
        for s in keys:
            events = self._blocked(self._pending.pop(s))
            if self.ops is not None:
                compute = self.ops.current()
                for ev in events:
                    compute.wait_event(ev)

    def awaits(self, slots: np.ndarray | list[int] | None = None) -> bool:
        """Whether :meth:`wait` for ``slots`` (all, if None) has a read (and its copy) to wait for."""
        return pending_in(self._pending, slots)

    def in_flight(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` still being read, in the order their reads were submitted (the order the
        I/O pool serves them in)."""
        asked = {int(x) for x in slots}
        return np.array([x for x, fut in self._pending.items() if x in asked and not fut.done()], np.int64)

    def source(self, expert: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError("a disk store reads experts with read_into; it holds no host copies")

    def cpu_waves(
        self, experts: np.ndarray, wave: int | None = None
    ) -> Iterator[tuple[dict[str, torch.Tensor], np.ndarray, int]]:
        """``experts`` for the CPU, read from disk in waves of at most ``wave`` experts (default
        ``reader.cpu_wave``).

        Each wave is yielded as :meth:`LayerStore.cpu_waves` says. The first two waves' reads go out
        now, into the reader's two buffers, so they run while the caller computes something else
        (the resident experts) before it asks for the first; once the caller is done with a wave,
        the wave after next is read into its buffer. However many experts a call computes (a long
        prefill's dozens), it holds two waves' blocks. Close the iterator (``contextlib.closing``)
        where it may not be run to its end: that waits for the reads and frees the buffers.
        """
        ids = np.asarray(experts, np.int64)
        w = max(1, int(wave or self._cpu[0].cpu_wave))
        gen = self._waves([ids[i : i + w] for i in range(0, len(ids), w)])
        next(gen)  # the first reads are submitted, the buffers held
        return gen

    def _waves(self, waves: list[np.ndarray]) -> Iterator[Any]:
        with self._cpu[0].cpu_buffers() as bufs:
            pending = [self._read_wave(waves[i], bufs[i]) if i < len(waves) else [] for i in range(2)]
            try:
                yield None
                for i, wave in enumerate(waves):
                    for f in pending[i % 2]:
                        self._blocked(f)
                    yield self._wave(bufs[i % 2], wave)
                    # the caller is done with this buffer: the wave after next is read into it
                    pending[i % 2] = self._read_wave(waves[i + 2], bufs[i % 2]) if i + 2 < len(waves) else []
            finally:
                # reads still landing must finish before another caller takes the buffers
                for f in (*pending[0], *pending[1]):
                    with contextlib.suppress(Exception):
                        f.result()

    def _read_wave(self, wave: np.ndarray, buf: torch.Tensor) -> list[Future]:
        reader, layout = self._cpu
        stride = layout.stride
        return [
            reader.submit(self.pos, int(e), buf[i * stride : (i + 1) * stride].numpy())
            for i, e in enumerate(wave)
        ]

    def _wave(self, buf: torch.Tensor, wave: np.ndarray) -> tuple[dict[str, torch.Tensor], np.ndarray, int]:
        m = len(wave)
        table = np.full(self.num_experts, m, np.int64)
        table[wave] = np.arange(m)
        return self._cpu[1].views(buf, m), table, m

    def close(self) -> None:
        for fut in self._pending.values():
            with contextlib.suppress(Exception):
                fut.result()
        self._pending = {}
        super().close()


# -------------------------------------------------------------------------- loading and memory
def peak_rss_mb() -> float:
    """The process's peak resident set (VmHWM), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_fits(capacity: int, layouts: list[ExpertLayout], capacity_arg: Any) -> None:
    """Refuse a capacity whose slots (plus the I/O buffers) exceed the memory available now."""
    need = sum((capacity + STAGING_BUFFERS) * lay.stride for lay in layouts)
    avail = available_bytes()
    if avail is not None and need > avail:
        per = max(1, int(avail // max(1, sum(lay.stride for lay in layouts))) - STAGING_BUFFERS)
        raise OffloadError(
            f"capacity {capacity_arg} ({capacity} experts per layer) needs {need / 2**20:.0f} MiB for the resident "
            f"experts and {avail / 2**20:.0f} MiB are available; lower capacity=N (at most {per} experts per layer fit)"
        )


def drop_experts(structure: Any) -> list[torch.device]:
    """Replace the experts' weights by meta tensors of the same shape (the disk holds them now);
    returns each layer's device, for :func:`restore_experts`."""
    devices = []
    for entry in structure.layers:
        mod = entry.experts
        devices.append(next(iter(expert_params(mod).values())).device)
        for name, t in expert_params(mod).items():
            empty = torch.empty_like(t, device="meta")
            if name in mod._parameters:
                mod._parameters[name] = nn.Parameter(empty, requires_grad=False)
            else:
                mod._buffers[name] = empty
    gc.collect()
    return devices


def restore_experts(structure: Any, reader: ExpertReader, devices: list[torch.device]) -> None:
    """Read every expert back from disk into the modules, on their devices (what :func:`drop_experts` replaced)."""
    for pos, entry in enumerate(structure.layers):
        mod = entry.experts
        views = _read_layer(reader, pos, int(mod.num_experts))
        for name in expert_params(mod):
            t = views[name].to(devices[pos], copy=True)
            if name in mod._parameters:
                mod._parameters[name] = nn.Parameter(t, requires_grad=False)
            else:
                mod._buffers[name] = t


@contextlib.contextmanager
def _params_on_meta():
    """Build modules with their parameters on the meta device and their buffers real (rotary tables)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_offloaded(model: str, directory: str | Path, dtype: str = "float32") -> tuple[Any, Any, str]:
    """(model, tokenizer, name) for the disk tier: non-expert weights in memory, experts left on disk.

    The first call for a model writes ``directory`` (this one load holds the whole model in memory);
    later calls build the model with its parameters on the meta device and load only
    ``dense.safetensors``, so the experts are never materialised.
    """
    from moecast.collect.models import find_moe_structure, load_model, resolve_model_path
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name, path = resolve_model_path(model)
    d = prepare_dir(directory)
    config = AutoConfig.from_pretrained(path)
    torch_dtype = getattr(torch, dtype)
    with _params_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    structure = find_moe_structure(lm)
    meta = offload_meta(lm, structure)
    if missing_layers(d, meta) or not (d / DENSE).is_file():
        print(f"moecast: writing the experts to {d} once (this load holds the whole model in memory)")
        full, _, _ = load_model(model, dtype=dtype)
        write_offload(full, find_moe_structure(full), d)
        del full
        gc.collect()
    from safetensors.torch import load_file

    lm.load_state_dict(load_file(d / DENSE), strict=False, assign=True)
    lm.tie_weights()
    experts = _expert_names(lm, structure)
    left = [n for n, p in lm.named_parameters() if p.device.type == "meta" and n not in experts]
    if left:
        raise OffloadError(f"{d / DENSE} lacks weights {left[:3]}; delete it and run again to rewrite it")
    lm.eval()
    tok = AutoTokenizer.from_pretrained(path)
    return lm, tok, name
