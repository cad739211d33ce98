"""Predictor checkpoints: one ``.safetensors`` file, tensors plus JSON metadata in its header (docs/design.md).

No pickles. ``save`` writes atomically; ``load_raw`` returns (tensors, metadata);
``check_fingerprint`` refuses a checkpoint used with another model, naming both.
Side files (the EAM hnswlib index) sit beside the checkpoint and are named in
its metadata under ``files``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from moecast.errors import InputError

FORMAT_VERSION = 1
REQUIRED_KEYS = ("kind", "format_version", "fingerprint", "moe_layers", "num_experts", "top_k")


class CheckpointError(InputError):
    """A checkpoint is missing, corrupt, of another format, or for another model."""


def save(path: str | Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> Path:
    """Write tensors (torch or numpy) and JSON metadata to ``path`` atomically."""
    import torch
    from moecast.collect.traceset import atomic_write_bytes
    from safetensors.torch import save as to_bytes

    path = Path(path)
    meta = {"format_version": FORMAT_VERSION, **metadata}
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint metadata lacks {missing}; this is a moecast bug, please report it")
    flat = {}
    for name, value in tensors.items():
        t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        flat[name] = t.detach().cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    # written as any output is (the umask's mode, synced, renamed, a failed write leaving no temporary):
    # safetensors' own save_file makes its file 0600, and a checkpoint is shared
    atomic_write_bytes(path, to_bytes(flat, metadata={"moecast": json.dumps(meta)}))
    return path


def missing_checkpoint(path: str | Path) -> str:
    """What every command says of a checkpoint path with no file: the two ways to make one."""
    return (
        f"{path}: no such checkpoint; build one with `moecast predictors eval KIND --traces T --save "
        f"{path}` (the kinds fitted from traces, listed by `moecast predictors eval --help`) or train "
        "one with `moecast train KIND`"
    )


def load_raw(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors as torch tensors, metadata dict) of a moecast checkpoint."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(missing_checkpoint(path))
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); re-export it") from exc
    if "moecast" not in header:
        raise CheckpointError(
            f"{path}: a safetensors file without moecast metadata; export it with `moecast train`"
        )
    meta = json.loads(header["moecast"])
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format_version')}, this moecast reads {FORMAT_VERSION}; retrain it"
        )
    return tensors, meta


def load_metadata(path: str | Path) -> dict[str, Any]:
    """The moecast metadata of a checkpoint without reading its tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); re-export it") from exc
    if "moecast" not in header:
        raise CheckpointError(
            f"{path}: a safetensors file without moecast metadata; export it with `moecast train`"
        )
    return json.loads(header["moecast"])


def check_fingerprint(
    meta: dict[str, Any], fingerprint: str, against: str, path: str | Path = "checkpoint"
) -> None:
    """Refuse a checkpoint whose model fingerprint differs from the model or TraceSet it is used with."""
    if meta.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path} was trained for model {meta.get('model_name', '?')} (fingerprint {meta.get('fingerprint')}) "
            f"but is used with {against} (fingerprint {fingerprint}); train a predictor on traces of this model"
        )
