"""An expert as one packed block of bytes: where each of its tensors sits, and the block's stride.

PreScope §4.4 (AsyncIO) moves experts into pre-registered buffers; here every tier keeps an expert's
tensors contiguous in one block, in the slow tier and in its device slot alike, so a transfer is one
copy and one event per expert. A slot is one byte buffer and the expert's tensors are views into it,
described by an :class:`ExpertLayout`: a tier (or a precision, whose stored parts differ from the
model's tensors) gives its own layout and the same slot and copy code moves it. The offload
directory's files use the same layout (:mod:`moecast.runtime.tiers.offload`), with blocks aligned for
direct I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import _TYPES as SAFETENSORS_DTYPES

from moecast.errors import InputError

#: O_DIRECT needs offsets, lengths and buffer addresses aligned to the device's logical block
#: size; 4096 covers every common one
ALIGN = 4096
#: a block in memory starts where an allocation of its own would (cudaMalloc's 256 bytes), so a
#: kernel reading a slot's tensors sees the alignment it would on separate buffers
MEMORY_ALIGN = 256
DTYPE_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def align_up(n: int, align: int) -> int:
    return -(-int(n) // align) * align


@dataclass(frozen=True)
class ExpertLayout:
    """Where one expert's tensors sit in its block, and the block's aligned size."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # safetensors dtype names
    offsets: tuple[int, ...]  # byte offset of each tensor in the expert's block
    expert_bytes: int  # bytes of one expert's tensors
    stride: int  # the block: expert_bytes rounded up to the alignment

    @classmethod
    def of(cls, params: dict[str, torch.Tensor], align: int = ALIGN) -> ExpertLayout:
        """The layout of ``params`` (tensors [E, ...], expert first), blocks rounded up to ``align``."""
        names, shapes, dtypes, offsets, off = [], [], [], [], 0
        for name, t in params.items():
            if t.dtype not in DTYPE_NAME:
                raise InputError(
                    f"expert tensor {name} has dtype {t.dtype}, which safetensors cannot store; "
                    "load the model in float32, bfloat16 or float16"
                )
            size = t.element_size()
            off = -(-off // size) * size  # each tensor starts at a multiple of its element size
            names.append(name)
            shapes.append(tuple(int(x) for x in t.shape[1:]))
            dtypes.append(DTYPE_NAME[t.dtype])
            offsets.append(off)
            off += int(np.prod(t.shape[1:], dtype=np.int64)) * size
        return cls(tuple(names), tuple(shapes), tuple(dtypes), tuple(offsets), off, align_up(off, align))

    def as_json(self) -> list[dict[str, Any]]:
        return [
            {"name": n, "shape": list(s), "dtype": d} for n, s, d in zip(self.names, self.shapes, self.dtypes)
        ]

    def nbytes(self, i: int) -> int:
        return int(np.prod(self.shapes[i], dtype=np.int64)) * SAFETENSORS_DTYPES[self.dtypes[i]].itemsize

    def views(self, base: torch.Tensor, count: int, stride: int | None = None) -> dict[str, torch.Tensor]:
        """Tensors [count, *shape] by name over ``base`` (uint8), expert ``i``'s block at ``i * stride``."""
        stride = self.stride if stride is None else stride
        out = {}
        for i, name in enumerate(self.names):
            dtype = SAFETENSORS_DTYPES[self.dtypes[i]]
            size = dtype.itemsize
            typed = base[: len(base) // size * size].view(dtype)
            shape = self.shapes[i]
            inner = [int(np.prod(shape[j + 1 :], dtype=np.int64)) for j in range(len(shape))]
            start = (
                typed.storage_offset() + self.offsets[i] // size
            )  # as_strided counts from the storage's start
            out[name] = typed.as_strided((count, *shape), (stride // size, *inner), start)
        return out

    def block(self, base: torch.Tensor, i: int) -> torch.Tensor:
        """Expert ``i``'s block of ``base`` (uint8): the bytes one copy moves."""
        return base[i * self.stride : (i + 1) * self.stride]
