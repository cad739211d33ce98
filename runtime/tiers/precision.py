"""Expert precision: weight-only, round-to-nearest quantization of the experts a slow tier holds.

An expert moved over a link costs its bytes; the link is the floor of an offloaded run (a disk reads
a DeepSeek-V2-Lite expert of 17.3 MB in bf16 in about 9 ms). A :class:`Precision` names what an
expert's weights are stored and computed as:

- ``model``: the model's own dtype, exact (the default);
- ``int8``: per output channel, symmetric: ``s = max|w_row| / 127``, ``q = round(w / s)`` in
  [-127, 127], ``w' = q s`` (LLM.int8's per-row absmax without its outlier split);
- ``int4``: group-wise, asymmetric, along the input dimension in groups of ``group_size``:
  ``s = (max - min) / 15``, ``q = round((w - min) / s)`` in [0, 15], ``w' = q s + min`` (the
  round-to-nearest baseline of GPTQ and HQQ). HQQ's optimiser, which refines ``min``, cut the
  error per expert by about 3 % but gained no accuracy on ``tiny``, at 40x the quantizing time, so
  it is not used (``bench/results/experiments.md``).

A weight matrix is quantized as [out, in] (a module whose experts are stored transposed is
transposed first), so every format reduces along the input dimension, as the kernels do. Biases and
other per-expert vectors stay in the model's dtype.

Computing on the packed weights, not on full-precision copies: on the CPU, torch's weight-only
kernels ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` read the int8 / int4 bytes
directly (at one token, a DeepSeek expert's gate-up projection took 0.36 and 0.25 ms against 33 and
110 ms to dequantize it; ``bench/results/experiments.md``). The int4 kernel takes its weights in
its own packed layout, which :func:`torch._convert_weight_to_int4pack_for_cpu` makes (about 28 ms a
matrix, so the offload directory stores that layout and a read needs no conversion); it needs a
group of 32-256, an output dimension divisible by 16 and an even input dimension. Where a kernel
cannot run (a shape it refuses), the weights are dequantized for the call instead, and
:func:`kernel_note` says so once. On an accelerator the slots hold no packed weights: a load copies
the packed block and :class:`SlotDequantizer` dequantizes it into the model-dtype slot on the device
(:func:`dequantize_matrix`'s arithmetic), so the resident experts compute as the model's
(:class:`DequantizedSlots`); only the CPU set computes on the packed host copies.

Each stored part of weight ``name`` is a tensor ``name.<part>``: int8 ``.q`` [out, in] and ``.s``
[out]; int4 ``.q`` (uint8, the kernel's layout, [out, in / 2]) and ``.sz`` [in / g, out, 2] with
``(s, min + 8 s)`` per group, the kernel's scales-and-zeros (``w' = (q - 8) s + z``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from moecast.runtime.core.mixed import order_error, parse_copies, parse_copy
from moecast.runtime.tiers.expert_store import expert_params
from moecast.runtime.tiers.layout import MEMORY_ALIGN, ExpertLayout

from moecast.errors import InputError

DTYPES = ("model", "int8", "int4")
#: the bytes of model-dtype experts an accelerator quantizes at a time (SlotDequantizer.quantize)
QUANTIZE_CHUNK_BYTES = 256 * 2**20
#: group sizes the CPU int4 kernel takes
INT4_KERNEL_GROUPS = (32, 64, 128, 256)


class PrecisionWarning(UserWarning):
    """A precision runs, but not as asked (a group size replaced, a kernel replaced by dequantization)."""


@dataclass(frozen=True)
class Precision:
    """How a slow tier stores its experts: ``dtype`` (``model``, ``int8``, ``int4``) and, for int4, the
    group size along the input dimension."""

    dtype: str = "model"
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InputError(f"unknown expert dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.dtype == "int4" and self.group_size not in INT4_KERNEL_GROUPS:
            groups = ", ".join(map(str, INT4_KERNEL_GROUPS))
            raise InputError(f"int4 group size {self.group_size} is not one of {groups}")

    @property
    def quantized(self) -> bool:
        return self.dtype != "model"

    @property
    def tag(self) -> str:
        """The name an offload directory and a results row carry: ``model``, ``int8``, ``int4-g128``."""
        return f"int4-g{self.group_size}" if self.dtype == "int4" else self.dtype

    @property
    def label(self) -> str:
        """The setting as a results row names it: the tag (two copies: both tags, high first)."""
        return self.tag

    @classmethod
    def of_tag(cls, tag: str, group_size: int = 128) -> Precision:
        """The precision a tag names (``model``, ``int8``, ``int4``, ``int4-g64``: the tag's group size
        wins over ``group_size``)."""
        return cls(*parse_copy(tag.strip(), int(group_size)))

    def settings(self) -> dict[str, Any]:
        """attach()'s keywords for this precision (none for the model's dtype)."""
        return {"expert_dtype": self.dtype, "group_size": self.group_size} if self.quantized else {}

    def group_for(self, in_features: int) -> int:
        """int4's group for a matrix of ``in_features`` inputs: ``group_size`` where it divides them,
        else the whole row (per channel), which the kernel takes when it is one of its groups; a
        PrecisionWarning says so once per shape."""
        if in_features % self.group_size == 0:
            return self.group_size
        _group_note(self.group_size, in_features)
        return in_features


_GROUP_NOTED: set[tuple[int, int]] = set()


def _group_note(group: int, in_features: int) -> None:
    if (group, in_features) not in _GROUP_NOTED:
        _GROUP_NOTED.add((group, in_features))
        warnings.warn(
            f"int4 group size {group} does not divide a matrix of {in_features} inputs: those matrices are "
            f"quantized per output channel (one group of {in_features}) instead; pick a group size that "
            "divides every expert matrix's inputs to group them all",
            PrecisionWarning,
            stacklevel=3,
        )


@dataclass(frozen=True)
class TwoCopies(Precision):
    """Two copies of each expert in the slow tier (:mod:`moecast.runtime.core.mixed`): as a
    :class:`Precision` this is the **high** copy, the one a slot is sized for and a prefetch or an
    upgrade reads (its files, its bytes on the link); ``low`` is the copy a demand miss and the CPU set read."""

    low: Precision = Precision("int4")

    @property
    def high(self) -> Precision:
        return Precision(self.dtype, self.group_size)

    @property
    def label(self) -> str:
        return f"{self.tag}+{self.low.tag}"

    def settings(self) -> dict[str, Any]:
        return {"expert_dtype": self.label, "group_size": self.group_size}


def expert_setting(expert_dtype: str, group_size: int = 128) -> Precision:
    """``expert_dtype`` (``model``, ``int8``, ``int4``; two copies: ``mixed``, ``int8+int4``,
    ``model+int4-g64``: :func:`moecast.runtime.core.mixed.parse_copies`) as a :class:`Precision`, a
    :class:`TwoCopies` for two."""
    pair = parse_copies(expert_dtype, int(group_size))
    if pair is None:  # one precision, by name or by a results row's tag
        return Precision.of_tag(str(expert_dtype), group_size)
    (hd, hg), (ld, lg) = pair
    if hd == ld:  # a low copy no cheaper than the high one: the run would report a meaningless share
        raise order_error(str(expert_dtype).strip())
    return TwoCopies(hd, hg, low=Precision(ld, lg))


# ---------------------------------------------------------------------------------------- formats
def weight_names(params: dict[str, torch.Tensor]) -> list[str]:
    """The per-expert tensors a precision quantizes: the matrices ([E, out, in]); vectors stay."""
    return [n for n, t in params.items() if t.dim() == 3 and t.is_floating_point()]


def part_shapes(
    prec: Precision, name: str, shape: tuple[int, ...], dtype: torch.dtype, transposed: bool
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored parts of one expert's matrix ``name`` of per-expert ``shape``: name -> (shape, dtype)."""
    out_f, in_f = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
    if prec.dtype == "int8":
        return {f"{name}.q": ((out_f, in_f), torch.int8), f"{name}.s": ((out_f,), dtype)}
    int4_packs(name, out_f, in_f)
    g = prec.group_for(in_f)
    return {f"{name}.q": ((out_f, in_f // 2), torch.uint8), f"{name}.sz": ((in_f // g, out_f, 2), dtype)}


def int4_packs(name: str, out_f: int, in_f: int) -> None:
    """Refuse a matrix torch's int4 layout cannot pack (its output rows in sixteens, its inputs in
    pairs); the stored bytes are that layout on every device, so no other shape is quantized at int4."""
    if out_f % 16 or in_f % 2:
        raise InputError(
            f"int4 packs a matrix's output rows in sixteens and its inputs in pairs (torch's int4 layout); "
            f"the experts' {name} is [{out_f} out, {in_f} in]: use expert_dtype=int8 for this model"
        )


def min_step(dtype: torch.dtype) -> float:
    """The smallest positive value of ``dtype`` (its smallest subnormal): a step stored in it never rounds
    to zero, so the disk tier can refuse a zero step as damage (a step of 6e-8 in float16 is a group
    whose weights all but agree)."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """[out, in] -> ``q`` int8 [out, in] and ``s`` [out] (per output channel, symmetric)."""
    x = w.float()
    s = x.abs().amax(dim=1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: q = 0 whatever s is
    s = s.clamp(min=min_step(w.dtype))
    q = torch.round(x / s[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q": q, "s": s.to(w.dtype)}


def int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> codes int32 [out, in] in [0, 15], scales and minima [out, in / group]."""
    out_f, in_f = w.shape
    x = w.float().reshape(out_f, in_f // group, group)
    lo, hi = x.amin(dim=2), x.amax(dim=2)
    s = (hi - lo) / 15
    s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: q = 0 and w' = min exactly
    s = s.clamp(min=min_step(w.dtype))
    q = torch.round((x - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(out_f, in_f), s, lo


def quantize_int4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """[out, in] -> ``q`` (the CPU kernel's packed layout) and ``sz`` [in / group, out, 2]."""
    q, s, lo = int4_codes(w, group)
    sz = torch.stack([s, lo + 8 * s], dim=-1).transpose(0, 1).contiguous().to(w.dtype)
    return {"q": pack_int4(q), "sz": sz}


def quantize_matrix(prec: Precision, w: torch.Tensor, name: str = "matrix") -> dict[str, torch.Tensor]:
    """One [out, in] matrix at ``prec`` (parts by suffix); ``name`` for a refusal."""
    if prec.dtype == "int8":
        return quantize_int8(w)
    int4_packs(name, *w.shape)
    return quantize_int4(w, prec.group_for(w.shape[1]))


def quantize_params(
    prec: Precision, params: dict[str, torch.Tensor], transposed: bool
) -> dict[str, torch.Tensor]:
    """A layer's per-expert tensors ([E, ...]) as ``prec`` stores them ([E, ...] per part). Vectors pass
    through."""
    out: dict[str, torch.Tensor] = {}
    mats = set(weight_names(params))
    for name, t in params.items():
        if name not in mats:
            out[name] = t
            continue
        parts = [quantize_matrix(prec, w.t() if transposed else w, name) for w in t]
        for suffix in parts[0]:
            out[f"{name}.{suffix}"] = torch.stack([p[suffix] for p in parts])
    return out


def dequantize_matrix(prec: Precision, parts: dict[str, torch.Tensor], in_features: int) -> torch.Tensor:
    """The [out, in] matrix the parts (by suffix) stand for, in the scales' dtype."""
    if prec.dtype == "int8":
        return (parts["q"].float() * parts["s"].float()[:, None]).to(parts["s"].dtype)
    sz = parts["sz"].float()  # [in / g, out, 2]
    q = unpack_int4(parts["q"], in_features).float()
    out_f, groups = q.shape[0], sz.shape[0]
    s, z = sz[..., 0].t(), sz[..., 1].t()  # [out, in / g]
    w = (q.reshape(out_f, groups, -1) - 8) * s[..., None] + z[..., None]
    return w.reshape(out_f, in_features).to(parts["sz"].dtype)


def stored_layout(
    prec: Precision, params: dict[str, torch.Tensor], transposed: bool, align: int = MEMORY_ALIGN
) -> ExpertLayout:
    """One expert's block as ``prec`` stores a layer's per-expert ``params`` (shapes only: they may be
    on meta), blocks rounded up to ``align``: each matrix's parts in its place, vectors as they are."""
    mats, fake = set(weight_names(params)), {}
    for name, t in params.items():
        if name not in mats:
            fake[name] = torch.empty((1, *t.shape[1:]), dtype=t.dtype, device="meta")
            continue
        for part, (shape, dtype) in part_shapes(prec, name, tuple(t.shape[1:]), t.dtype, transposed).items():
            fake[part] = torch.empty((1, *shape), dtype=dtype, device="meta")
    return ExpertLayout.of(fake, align)


def expert_nbytes(prec: Precision, params: dict[str, torch.Tensor], transposed: bool) -> int:
    """Bytes of one expert's tensors as ``prec`` stores them (parts rounded to nothing: the stored
    block adds its own alignment)."""
    if not prec.quantized:
        return sum(int(t[0].numel()) * t.element_size() for t in params.values())
    mats, total = set(weight_names(params)), 0
    for name, t in params.items():
        if name not in mats:
            total += int(t[0].numel()) * t.element_size()
            continue
        for shape, dtype in part_shapes(prec, name, tuple(t.shape[1:]), t.dtype, transposed).values():
            total += int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return total


def fake_quantized(
    prec: Precision, params: dict[str, torch.Tensor], transposed: bool
) -> dict[str, torch.Tensor]:
    """A layer's per-expert tensors with every matrix replaced by its quantized-then-dequantized value
    (the weights a quantized expert computes with, in the model's dtype and layout)."""
    if not prec.quantized:
        return dict(params)
    out = dict(params)
    for name in weight_names(params):
        t = params[name]
        mats = []
        for w in t:
            back = round_trip(prec, w.t() if transposed else w).to(t.dtype)
            mats.append(back.t() if transposed else back)
        out[name] = torch.stack(mats)
    return out


def relative_error(w: torch.Tensor, prec: Precision) -> float:
    """||w - w'|| / ||w|| for one [out, in] matrix quantized at ``prec`` and dequantized."""
    if not prec.quantized:
        return 0.0
    back = round_trip(prec, w).float()
    return float((w.float() - back).norm() / w.float().norm().clamp(min=1e-30))


def round_trip(prec: Precision, w: torch.Tensor) -> torch.Tensor:
    """One [out, in] matrix quantized at ``prec`` and dequantized: the weights its expert computes with."""
    return dequantize_matrix(prec, quantize_matrix(prec, w), w.shape[1])


def expert_output_error(
    params: dict[str, torch.Tensor],
    prec: Precision,
    tokens: int = 64,
    transposed: bool = False,
    seed: int = 0,
) -> torch.Tensor:
    """Per expert of a layer ([E]), ``||y - y'|| / ||y||``: its output on ``tokens`` N(0, 1) inputs with
    the model's weights (y) and with ``prec``'s (y', :func:`fake_quantized`).

    A matrix's :func:`relative_error` says how far its weights move; this says how far the expert's
    output does, through the gate's nonlinearity and the down projection. ``params`` are a gated layer's
    per-expert tensors (``gate_up_proj`` and ``down_proj``, as DeepSeek, Qwen and Mixtral store them in
    transformers' experts interface); both outputs are computed in float32, so only the weights differ.
    """
    if "gate_up_proj" not in params or "down_proj" not in params:
        raise InputError(f"expert_output_error needs gate_up_proj and down_proj, got {', '.join(params)}")
    gate_up = params["gate_up_proj"]
    hidden = gate_up.shape[1] if transposed else gate_up.shape[2]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    y = gated_expert_outputs(params, x, transposed)
    y_q = gated_expert_outputs(fake_quantized(prec, params, transposed), x, transposed)
    return (y - y_q).norm(dim=(1, 2)) / y.norm(dim=(1, 2)).clamp(min=1e-30)


def gated_expert_outputs(params: dict[str, torch.Tensor], x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Every expert's output [E, tokens, hidden] on ``x`` [tokens, hidden], in float32, by the experts
    interface's arithmetic: ``h = x W_gu^T (+ b)``, ``gate, up = h.chunk(2)``, ``(silu(gate) * up) W_d^T (+ b)``
    (SwiGLU, the interface's default gate)."""
    gate_up, down = params["gate_up_proj"].float(), params["down_proj"].float()
    if not transposed:  # stored [E, out, in]; the product wants [E, in, out]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    h = torch.matmul(x.float(), gate_up)
    if "gate_up_proj_bias" in params:
        h = h + params["gate_up_proj_bias"].float()[:, None]
    gate, up = h.chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, down)
    if "down_proj_bias" in params:
        y = y + params["down_proj_bias"].float()[:, None]
    return y


# ------------------------------------------------------------------------ dequantizing into a slot
class SlotDequantizer:
    """An accelerator's half of a quantized load (issue 45: copy the packed bytes, dequantize into the
    slot): one expert's stored block, landed in a device staging block, becomes the model-dtype
    tensors of its slot, on whatever device the block is on.

    The arithmetic is :func:`dequantize_matrix`'s, called as is, so a slot holds exactly the weights
    :func:`fake_quantized` gives (int4 unpacked from the CPU kernel's layout by a gather whose index
    lives on the device: :func:`unpack_int4`); a module whose experts are stored transposed gets each
    matrix transposed back into its slot, and vectors (biases) are copied. A resident expert then
    computes with the model's own experts implementation, as at the model's dtype: no dequantization
    per call. ``stored`` is the block's layout (default: :func:`stored_layout` at the memory
    alignment; the disk tier passes its files' layout, whose offsets are the same).
    """

    def __init__(self, prec: Precision, experts: Any, stored: ExpertLayout | None = None) -> None:
        if not prec.quantized:
            raise ValueError("a SlotDequantizer needs a quantized precision")
        params = expert_params(experts)
        self.prec = prec
        self.transposed = bool(getattr(experts, "is_transposed", False))
        self.stored = stored if stored is not None else stored_layout(prec, params, self.transposed)
        mats = weight_names(params)
        # a matrix is quantized as [out, in]: its input dimension is the last one unless transposed
        self.in_features = {n: int(params[n].shape[1 if self.transposed else 2]) for n in mats}
        self.vectors = [n for n in params if n not in self.in_features]

    def quantize(self, params: dict[str, torch.Tensor], device: Any = None) -> dict[str, torch.Tensor]:
        """A layer's per-expert tensors ([E, ...], any device) as the stored parts, in host memory.

        ``device``: where the arithmetic runs (None: the host). On an accelerator the experts go over
        in chunks of about :data:`QUANTIZE_CHUNK_BYTES` and come back quantized (the H200 host's cores
        took 12-15 s for a 26-layer DeepSeek-V2-Lite at every attach; the device's arithmetic is
        elementwise work it does far faster, not yet timed there). The bytes are the host's: the same
        float32 arithmetic, correctly rounded on both, and int4's packing by a gather read off the
        CPU kernel's layout (:func:`pack_int4`). Where the device fails (out of memory, say) the host
        quantizes instead, and a PrecisionWarning says so."""
        if device is not None:
            try:
                return self._quantize_on(params, device)
            except RuntimeError as exc:  # out of device memory, say: the host's cores give the same bytes
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                warnings.warn(
                    f"quantizing the experts on {device} failed ({first}); quantizing on the host instead",
                    PrecisionWarning,
                    stacklevel=2,
                )
        host = {n: t.detach().cpu() for n, t in params.items()}
        return quantize_params(self.prec, host, self.transposed)

    def _quantize_on(self, params: dict[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
        """:meth:`quantize` on ``device``, a chunk of experts at a time."""
        first = next(iter(params.values()))
        per_expert = sum(t[0].numel() * t.element_size() for t in params.values())
        step = max(1, QUANTIZE_CHUNK_BYTES // max(per_expert, 1))
        chunks = []
        for i in range(0, int(first.shape[0]), step):
            part = {n: t[i : i + step].detach().to(device) for n, t in params.items()}
            got = quantize_params(self.prec, part, self.transposed)
            chunks.append({n: t.cpu() for n, t in got.items()})
        return {n: torch.cat([c[n] for c in chunks]) for n in chunks[0]}

    def prepare(self, device: torch.device) -> None:
        """Put int4's unpacking index on ``device`` now (at attach, on the host's stream), not in the
        first load's copy."""
        if self.prec.dtype != "int4":
            return
        for name, in_f in self.in_features.items():
            out_f = self.stored.shapes[self.stored.names.index(f"{name}.q")][0]
            _int4_order_at(out_f, in_f, str(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def __call__(self, block: torch.Tensor, slot: dict[str, torch.Tensor]) -> None:
        """Write the expert whose stored block is ``block`` (uint8, from its start) into ``slot`` (its
        model-dtype tensors by name), with kernels on the current stream."""
        parts = {k: v[0] for k, v in self.stored.views(block, 1).items()}
        for name in self.vectors:
            slot[name].copy_(parts[name])
        for name, in_f in self.in_features.items():
            head = f"{name}."
            w = dequantize_matrix(
                self.prec, {k[len(head) :]: t for k, t in parts.items() if k.startswith(head)}, in_f
            )
            slot[name].copy_(w.t() if self.transposed else w)


class DequantizedSlots:
    """One layer's experts call where the slots hold dequantized weights (:class:`SlotDequantizer`) and
    the host the packed ones: the model's own implementation on the slots, the precision's weight-only
    CPU kernels (:func:`quantized_experts_forward`) on anything else (the CPU set's host copies)."""

    def __init__(self, prec: Precision, store: Any, model_impl: Any) -> None:
        self.prec, self.store, self.model_impl = prec, store, model_impl

    def __call__(
        self, view: Any, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, **kw: Any
    ):
        if object.__getattribute__(view, "_tensors") is self.store.slots:
            return self.model_impl(view, hidden, index, weights, **kw)
        return quantized_experts_forward(self.prec, view, hidden, index, weights, **kw)


def experts_call(prec: Precision, store: Any, model_impl: Any) -> Any:
    """The experts call of a layer whose slow tier holds ``prec``: :class:`DequantizedSlots` where its
    store dequantizes into the slots (an accelerator), else the precision's call on the packed slots
    (the CPU, whose weight-only kernels read them directly)."""
    if getattr(store, "dequant", None) is not None:
        return DequantizedSlots(prec, store, model_impl)
    return functools.partial(quantized_experts_forward, prec)


# --------------------------------------------------------------------------------- model weights
@contextmanager
def experts_at(model: Any, prec: Precision) -> Iterator[Any]:
    """Within the block, every experts module of ``model`` computes with ``prec``'s weights: each
    matrix is replaced by its :func:`fake_quantized` value, and the original tensors are put back on
    exit (whatever happens inside), so the model is bit-for-bit as before.

    This is the disk tier's arithmetic at ``prec``, without an offload directory and on any device: its
    weight-only kernels compute ``x @ w'^T`` with ``w'`` the dequantized weights
    (``test_the_weight_only_kernels_compute_the_formats_arithmetic`` in tests/test_precision.py), and
    the live runtime reading int8 / int4 experts from disk gives the logits of the model whose expert
    weights are these (``test_disk_tier_at_a_precision_computes_as_the_model_with_those_weights``);
    the two differ only in float rounding. Enter it before attaching a runtime, which then holds these
    weights as the model's own. Yields ``model``.
    """
    from moecast.collect.models import find_moe_structure

    saved: list[tuple[Any, dict[str, torch.Tensor]]] = []
    try:
        if prec.quantized:
            for entry in find_moe_structure(model).layers:
                mod = entry.experts
                saved.append((mod, _swap_tensors(mod, _fake_quantized_matrices(prec, mod))))
        yield model
    finally:
        for mod, originals in reversed(saved):
            _swap_tensors(mod, originals)


def _fake_quantized_matrices(prec: Precision, experts: Any) -> dict[str, torch.Tensor]:
    """The experts module's matrices at ``prec``, on their device (quantized on the CPU, where the int4
    packing runs)."""
    params = expert_params(experts)
    names = weight_names(params)
    if any(params[n].device.type == "meta" for n in names):
        raise InputError("experts_at needs the expert weights in memory; these are offloaded (meta tensors)")
    host = {n: params[n].detach().cpu() for n in names}
    fake = fake_quantized(prec, host, bool(getattr(experts, "is_transposed", False)))
    return {n: fake[n].to(params[n].device) for n in names}


def _swap_tensors(module: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put ``tensors`` into ``module`` by name (a parameter's data, or a buffer) and return the ones
    they replaced, which a second call puts back."""
    old: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in module._parameters:
            # .data keeps the Parameter object (optimisers, hooks and the runtime hold it)
            old[name] = module._parameters[name].data
            module._parameters[name].data = t
        else:
            old[name] = module._buffers[name]
            module._buffers[name] = t
    return old


# ------------------------------------------------------------------------------------ int4 layout
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int32 codes [out, in] in [0, 15] -> the CPU int4 kernel's uint8 [out, in / 2], on the device the
    codes are on: the kernel's own packing on the CPU, elsewhere the same bytes by a gather
    (:func:`pack_int4_gather`; the kernel runs on the CPU only)."""
    if codes.device.type != "cpu":
        return pack_int4_gather(codes)
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def pack_int4_gather(codes: torch.Tensor) -> torch.Tensor:
    """:func:`pack_int4`'s bytes on any device: each byte's low and high nibble gathered from the codes
    at the positions the CPU kernel's layout puts there (:func:`_int4_order`, read off the kernel)."""
    out_f, in_f = codes.shape
    lo, hi = _int4_sources_at(out_f, in_f, str(codes.device))
    flat = codes.reshape(-1).to(torch.uint8)
    return (flat[lo] | (flat[hi] << 4)).reshape(out_f, in_f // 2)


@functools.lru_cache(maxsize=64)
def _int4_sources_at(out_f: int, in_f: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For each byte of an [out, in] matrix's packed layout, the flat positions of the codes in its low
    and its high nibble, on ``device`` (:func:`_int4_order` inverted)."""
    byte, high = (t.reshape(-1) for t in _int4_order(out_f, in_f))
    pos = torch.arange(out_f * in_f, dtype=torch.int64)
    lo = torch.empty(out_f * in_f // 2, dtype=torch.int64)
    hi = torch.empty_like(lo)
    lo[byte[high == 0]] = pos[high == 0]
    hi[byte[high == 1]] = pos[high == 1]
    return lo.to(device), hi.to(device)


@functools.lru_cache(maxsize=64)
def _int4_order(out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each code of an [out, in] matrix lands in the packed layout: (byte index into the flat
    packed tensor, 0 for the low nibble and 1 for the high), each [out, in].

    Read off the packing itself, not assumed: codes that spell out each position's row and column
    bits are packed, and every nibble then says where it came from. So the unpacking follows the
    kernel's layout on any torch that has the kernel."""
    n = out_f * in_f
    bits = max(1, int(np.ceil(np.log2(max(n, 2)))))
    pos = torch.arange(n, dtype=torch.int64).reshape(out_f, in_f)
    src = torch.zeros(n, dtype=torch.int64)  # packed nibble -> the flat position it holds
    for k in range(0, bits, 4):
        packed = pack_int4(((pos >> k) & 15).to(torch.int32)).reshape(-1).to(torch.int64)
        src |= torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1) << k
    where = torch.empty(n, dtype=torch.int64)
    where[src] = torch.arange(n, dtype=torch.int64)
    return (where // 2).reshape(out_f, in_f), (where % 2).reshape(out_f, in_f)


@functools.lru_cache(maxsize=64)
def _int4_order_at(out_f: int, in_f: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_int4_order` flat and on ``device`` (byte index int32, high nibble bool), made once per
    shape and device: an unpacking on an accelerator never copies its index from the host."""
    byte, high = _int4_order(out_f, in_f)
    return byte.reshape(-1).to(torch.int32).to(device), high.reshape(-1).bool().to(device)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The CPU kernel's packed uint8 [out, in / 2] -> int32 codes [out, in] (:func:`pack_int4`'s inverse),
    on the device ``packed`` is on (a gather and two integer ops)."""
    out_f = packed.shape[0]
    byte, high = _int4_order_at(out_f, in_features, str(packed.device))
    flat = packed.reshape(-1).to(torch.int32)[byte]
    return torch.where(high, flat >> 4, flat & 15).reshape(out_f, in_features)


# ----------------------------------------------------------------------------------------- compute
#: the activations torch's weight-only CPU kernels take (a float64 model's are dequantized instead)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_ok(prec: Precision, x: torch.Tensor, out_f: int, in_f: int) -> bool:
    """Whether torch's weight-only CPU kernel computes this matrix directly (else it is dequantized)."""
    return x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and _cpu_kernel_ok(prec, out_f, in_f)


@functools.lru_cache(maxsize=256)
def _cpu_kernel_ok(prec: Precision, out_f: int, in_f: int) -> bool:
    # asked twice per expert per token: the answer depends on the shapes alone
    if prec.dtype == "int8":
        return True
    # the int4 layout refuses other shapes (part_shapes): every packed matrix has out_f % 16 == 0
    return prec.group_for(in_f) in INT4_KERNEL_GROUPS


_NOTED: set[tuple[str, int, int, str, str]] = set()


def kernel_note(prec: Precision, out_f: int, in_f: int, device: str, dtype: torch.dtype) -> None:
    """Say once per shape and dtype that a matrix is dequantized for each call instead of computed packed."""
    key = (prec.tag, out_f, in_f, device, str(dtype))
    if key not in _NOTED:
        _NOTED.add(key)
        what = str(dtype).removeprefix("torch.")
        warnings.warn(
            f"{prec.tag} experts of shape [{out_f}, {in_f}] on {device} in {what}: no weight-only kernel takes "
            "them, so each call dequantizes the weights first (slower; the bytes moved are still the small ones)",
            PrecisionWarning,
            stacklevel=3,
        )


def qlinear(prec: Precision, x: torch.Tensor, parts: dict[str, torch.Tensor], in_f: int) -> torch.Tensor:
    """``x @ w'.T`` for [tokens, in] ``x`` and one expert's stored parts (by suffix), in x's dtype."""
    out_f = parts["q"].shape[0]
    if kernel_ok(prec, x, out_f, in_f):
        if prec.dtype == "int8":
            return torch._weight_int8pack_mm(x, parts["q"], _as(parts["s"], x.dtype))
        g = prec.group_for(in_f)
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), parts["q"], g, _as(parts["sz"], x.dtype))
    kernel_note(prec, out_f, in_f, x.device.type, x.dtype)
    return F.linear(x, dequantize_matrix(prec, parts, in_f).to(x.device, x.dtype))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def expert_parts(tensors: dict[str, torch.Tensor], name: str, slot: int) -> dict[str, torch.Tensor]:
    """Expert ``slot``'s stored parts of matrix ``name`` (by suffix) out of the slots' tensors."""
    return {suffix: tensors[key][slot] for suffix, key in _part_keys(tuple(tensors), name)}


@functools.lru_cache(maxsize=256)
def _part_keys(keys: tuple[str, ...], name: str) -> tuple[tuple[str, str], ...]:
    # (suffix, key) of matrix ``name``'s parts: a layer's tensors have the same names every call
    head = f"{name}."
    return tuple((k[len(head) :], k) for k in keys if k.startswith(head))


def quantized_experts_forward(
    prec: Precision,
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    **_: Any,
) -> torch.Tensor:
    """transformers' experts call (``experts(hidden, top_k_index, top_k_weights)``) on quantized experts.

    ``module`` is a :class:`~moecast.runtime.tiers.expert_store.SlotView` whose tensors are the stored parts;
    ids ``>= module.num_experts`` are computed elsewhere and skipped. The arithmetic is the experts
    interface's (its ``batched_mm`` path): gate-up (or up) projection, the module's ``_apply_gate``
    (or activation), down projection, optional biases and post-expert norm, weighted by the routing
    weights; the flags come from the module, so every family that uses the interface runs as is.
    """
    tensors = object.__getattribute__(module, "_tensors")
    num, math = int(module.num_experts), _ExpertMath.of(module)
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    if len(hidden_states) == 1:  # a decode step: no per-expert search for its tokens
        # the loop below's arithmetic in its order (by slot), each part added in place; each weight as
        # a float32 value (multiplying by it equals multiplying by its 0-d tensor)
        picked = sorted(zip(top_k_index[0].tolist(), top_k_weights[0].float().tolist()))
        picked = [(slot, w) for slot, w in picked if slot < num]
        if picked:
            rows = math.decode(prec, tensors, hidden_states, [slot for slot, _ in picked])
            rows.mul_(torch.tensor([[w] for _, w in picked], dtype=torch.float32, device=rows.device))
            for row in rows.unsqueeze(1).unbind(0):
                out.add_(row)
        return out.to(hidden_states.dtype)
    for slot in torch.unique(top_k_index).tolist():
        if slot >= num:
            continue
        token, k = torch.nonzero(top_k_index == slot, as_tuple=True)
        part = math.run(prec, tensors, hidden_states[token], slot).float()
        out.index_add_(0, token, part * top_k_weights[token, k, None].float())
    return out.to(hidden_states.dtype)


@dataclass(frozen=True)
class _ExpertMath:
    """An experts module's flags and functions, read once per call: a decode step computes several
    experts, and each read through a :class:`~moecast.runtime.tiers.expert_store.SlotView` falls back
    to the module."""

    up: str
    bias: bool
    gate: Any  # the module's _apply_gate (gated) or act_fn
    norm: Any  # post_expert_norm, or None

    @classmethod
    def of(cls, module: Any) -> _ExpertMath:
        gated = bool(module.has_gate)
        return cls(
            "gate_up_proj" if gated else "up_proj",
            bool(module.has_bias),
            module._apply_gate if gated else module.act_fn,
            module.post_expert_norm if module.has_post_expert_norm else None,
        )

    def run(
        self, prec: Precision, tensors: dict[str, torch.Tensor], x: torch.Tensor, slot: int
    ) -> torch.Tensor:
        """Expert ``slot``'s output for the rows ``x`` (before the routing weight), from its stored parts."""
        h = qlinear(prec, x, expert_parts(tensors, self.up, slot), x.shape[-1])
        if self.bias:
            h = h + tensors[f"{self.up}_bias"][slot]
        h = self.gate(h)
        y = qlinear(prec, h, expert_parts(tensors, "down_proj", slot), h.shape[-1])
        if self.bias:
            y = y + tensors["down_proj_bias"][slot]
        return y if self.norm is None else self.norm(y)

    def decode(
        self, prec: Precision, tensors: dict[str, torch.Tensor], x: torch.Tensor, slots: list[int]
    ) -> torch.Tensor:
        """[n, out] float32: :meth:`run` of one token ``x`` [1, in] at each of ``slots``, row by row the
        same values. The kernels run back to back and the elementwise parts once on all rows: a small
        op right after a kernel that streamed megabytes through the caches finds them cold (~25 us on
        the benchmark's 2-core VM, against ~5 warm): one expert at a time, a step pays that twice an expert."""
        h = torch.cat([qlinear(prec, x, expert_parts(tensors, self.up, s), x.shape[-1]) for s in slots])
        if self.bias:
            h = h + tensors[f"{self.up}_bias"][slots]
        h = self.gate(h)
        width = h.shape[-1]
        y = torch.cat(
            [
                qlinear(prec, row, expert_parts(tensors, "down_proj", s), width)
                for row, s in zip(h.unsqueeze(1).unbind(0), slots)
            ]
        )
        if self.bias:
            y = y + tensors["down_proj_bias"][slots]
        return (y if self.norm is None else self.norm(y)).float()
