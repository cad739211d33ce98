"""CasMoE's Expert Activation Matcher (casmoe-eam-eap-cascade.md, "Expert Activation Matcher", Eqs. 4-5).

Sentence embeddings of prompts (:mod:`~moecast.predictors.sentence_encoder`) are the keys
of an hnswlib cosine index whose values are EP matrices (Eq. 3,
:mod:`~moecast.predictors.casmoe`); a query averages the EP of the top-k' neighbours
(Eq. 5) and reports the best cosine similarity (Eq. 4) as confidence. New (prompt, EP)
pairs go to a buffer of C = 30 that is folded into the index when full; the buffer is
written through to disk. Built by :mod:`moecast.train.eam`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from moecast.predictors.bert_encoder import check_engine
from moecast.predictors.casmoe import Planner, build_meta
from moecast.predictors.checkpoint import CheckpointError, save
from moecast.predictors.sentence_encoder import SentenceEmbedder, shared_embedder

from moecast.errors import InputError


@dataclass
class EAMConfig:
    """EAM hyper-parameters (``moecast train eam --eam.*``, configs/eam_minilm.yaml).

    Args:
        embedder: 'minilm' (the packaged all-MiniLM-L6-v2) or a local sentence-transformers folder.
        max_length: token limit of the embedder (longer prompts are truncated, said once).
        k_neighbours: k' of Eq. 5 (neighbours averaged).
        buffer_size: C, new pairs buffered before they are folded into the index (paper: 30).
        M: hnswlib graph degree.
        ef_construction: hnswlib build-time beam.
        ef: hnswlib query-time beam.
        seed: hnswlib seed.
        int8: embed with dynamic int8 Linear layers (CPU): ~1.5-2x faster short queries, embeddings
            ~0.99 cosine to fp32's with ONNX Runtime; off by default (see OrtBertEncoder, FastBertEncoder).
        engine: who runs the embedder: auto (ONNX Runtime on the CPU when installed), onnx or torch.
    """

    embedder: str = "minilm"
    max_length: int = 256
    k_neighbours: int = 3
    buffer_size: int = 30
    M: int = 16
    ef_construction: int = 200
    ef: int = 64
    seed: int = 0
    int8: bool = False
    engine: str = "auto"


def _atomic_hnsw_save(index: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    index.save_index(str(tmp))
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class EAM(Planner):
    """Expert Activation Matcher: HNSW cosine index of prompt embeddings -> EP (CasMoE Eqs. 4-5).

    ``query`` returns the mean EP of the top-k' neighbours (Eq. 5) and the best cosine
    similarity (Eq. 4) as confidence. ``observe`` adds a (prompt, EP) pair to the
    buffer of C pairs (paper: C = 30); a full buffer is folded into the index and, for
    a saved EAM, the index file and checkpoint are rewritten atomically.

    Crash safety of ``observe``: each buffered pair is appended and fsynced to
    ``<ckpt>.eam-buffer.jsonl`` before ``observe`` returns. A fold writes a new index
    file (generation-numbered), then the checkpoint naming it and the last folded
    buffer sequence number, then clears the buffer; a reload skips buffered pairs the
    checkpoint already holds, so a crash at any point neither loses nor duplicates one.
    """

    name: ClassVar[str] = "eam"

    def __init__(
        self,
        embedder: SentenceEmbedder,
        values: np.ndarray,
        keys: np.ndarray | None = None,
        *,
        fingerprint: str,
        moe_layers: Sequence[int],
        top_k: int,
        config: EAMConfig | None = None,
        index: Any = None,
        extra_meta: dict[str, Any] | None = None,
    ) -> None:
        import hnswlib

        self.embedder = embedder
        self.config = config or EAMConfig()
        self.values = np.ascontiguousarray(values, np.float32)  # [N, L, E]
        if self.values.ndim != 3 or len(self.values) == 0:
            raise InputError("EAM needs at least one (prompt, EP) pair with EP of shape [L, E]")
        self.num_layers, self.num_experts = self.values.shape[1:]
        self.moe_layers = list(moe_layers)
        self.top_k = int(top_k)
        self.fingerprint = fingerprint
        self.extra_meta = dict(extra_meta or {})
        if index is None:
            if keys is None or len(keys) != len(self.values):
                raise ValueError("EAM needs one embedding key per EP value")
            index = hnswlib.Index(space="cosine", dim=embedder.dim)
            index.init_index(
                max_elements=len(keys),
                ef_construction=self.config.ef_construction,
                M=self.config.M,
                random_seed=self.config.seed,
            )
            index.add_items(np.ascontiguousarray(keys, np.float32), np.arange(len(keys)))
        self.index = index
        self.index.set_ef(max(self.config.ef, self.config.k_neighbours))
        self.buffer: list[dict[str, Any]] = []
        self.path: Path | None = None
        self.generation = 0
        self.folded_seq = -1
        self.last_confidence = float("nan")

    # ------------------------------------------------------------------ query
    def query_embedding(self, emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([N, L, E] fused EP (Eq. 5), [N] best cosine similarity) of unit-norm embeddings."""
        k = min(self.config.k_neighbours, self.index.get_current_count())
        emb = np.ascontiguousarray(emb, np.float32)
        # one query row: no thread pool (hnswlib's default would use every core)
        labels, dist = self.index.knn_query(emb, k=k, num_threads=1 if len(emb) == 1 else -1)
        plans = self.values[labels].mean(axis=1)
        # hnswlib's cosine "distance" is 1 - cos
        return plans, 1.0 - dist[:, 0]

    def query(self, prompt: str) -> tuple[np.ndarray, float]:
        """([L, E] plan, confidence) for one prompt."""
        plans, conf = self.query_embedding(self.embedder.embed([prompt]))
        self.last_confidence = float(conf[0])
        return plans[0], float(conf[0])

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        return self.query(prompt)[0], "eam"

    def set_encoder(
        self, int8: bool | None = None, engine: str | None = None, threads: int | None = None
    ) -> None:
        """Query (and fold new keys) with another execution of the same embedding model.

        ``int8``: the int8 or the fp32 embedder; ``engine``: ``auto``, ``onnx`` or ``torch``
        (see :func:`checked_fast_encoder`); ``threads``: batch-1 threads. None keeps each.
        The index keys stay as built: int8 and fp32 embed to ~0.99 cosine of each other (on
        the DeepSeek Puffin held-out prompts the plan recall moved by under 0.005); ``save``
        records ``int8`` and ``engine``.
        """
        e = self.embedder
        if engine is not None:
            self.config.engine = check_engine(engine, "EAM")
        self.embedder = shared_embedder(
            e.spec,
            e.max_length,
            str(e.model.device),
            int8=e.int8 if int8 is None else bool(int8),
            engine=self.config.engine,
            threads=e.threads if threads is None else threads,
        )
        self.config.int8 = self.embedder.int8  # False off the CPU

    # ------------------------------------------------------------------ buffer (C pairs)
    @property
    def size(self) -> int:
        return int(self.index.get_current_count())

    def observe(self, prompt: str, ep: np.ndarray) -> bool:
        """Buffer one new (prompt, EP) pair; fold the buffer into the index when C are held.

        Returns True when this call folded the buffer.
        """
        ep = np.asarray(ep, np.float32)
        if ep.shape != (self.num_layers, self.num_experts):
            raise InputError(
                f"EP of shape {ep.shape} does not fit this EAM ({self.num_layers} layers x {self.num_experts} experts)"
            )
        if not np.isfinite(ep).all() or (ep < 0).any():
            raise InputError(
                "EP has NaN, inf or negative entries; compute it with ep_label from a valid trace"
            )
        emb = self.embedder.embed([prompt])[0]
        seq = max([self.folded_seq, *(e["seq"] for e in self.buffer)]) + 1
        entry = {"seq": seq, "prompt": prompt, "embedding": emb.tolist(), "ep": ep.tolist()}
        if self.path is not None:
            path = buffer_path(self.path)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        self.buffer.append(entry)
        if len(self.buffer) >= self.config.buffer_size:
            self.fold()
            return True
        return False

    def fold(self) -> None:
        """Add every buffered pair to the index (and, for a saved EAM, persist it atomically)."""
        if not self.buffer:
            return
        keys = np.array([e["embedding"] for e in self.buffer], np.float32)
        eps = np.array([e["ep"] for e in self.buffer], np.float32)
        n = self.size
        if n + len(keys) > self.index.get_max_elements():
            self.index.resize_index(n + len(keys))
        self.index.add_items(keys, np.arange(n, n + len(keys)))
        self.values = np.concatenate([self.values, eps])
        self.folded_seq = max(e["seq"] for e in self.buffer)
        self.buffer = []
        if self.path is not None:
            old = index_path(self.path, self.generation)
            self.generation += 1
            self.save(self.path)
            # the checkpoint now names the new index and folded_seq: the buffer and the
            # previous index are no longer needed
            bp = buffer_path(self.path)
            if bp.exists():
                bp.unlink()
            if old.exists() and old != index_path(self.path, self.generation):
                old.unlink()

    # ------------------------------------------------------------------ persistence
    def metadata(self) -> dict[str, Any]:
        return {
            **super().metadata(),
            "embedder": self.embedder.spec,
            "embedder_id": self.embedder.identity,
            "embedding_dim": self.embedder.dim,
            "config": vars(self.config),
            "entries": self.size,
            "generation": self.generation,
            "folded_seq": self.folded_seq,
        }

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (.safetensors with the EP values) and its hnswlib index file beside it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        idx = index_path(path, self.generation)
        _atomic_hnsw_save(self.index, idx)
        meta = self.metadata()
        meta["files"] = {"index": idx.name, "buffer": buffer_path(path).name}
        save(path, {"values": self.values}, meta)
        self.path = path
        return path

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> EAM:
        import hnswlib

        path = Path(path)
        idx = _index_file(path, meta)
        cfg = EAMConfig(**meta.get("config", {}))
        embedder = _checked_embedder(path, meta, cfg)
        values = tensors["values"].float().numpy()
        index = hnswlib.Index(space="cosine", dim=int(meta["embedding_dim"]))
        _load_index(index, idx, len(values), embedder.dim)
        extra = build_meta(meta)
        eam = cls(
            embedder,
            values,
            fingerprint=meta["fingerprint"],
            moe_layers=meta["moe_layers"],
            top_k=meta["top_k"],
            config=cfg,
            index=index,
            extra_meta=extra,
        )
        eam.path = path
        eam.generation = int(meta.get("generation", 0))
        eam.folded_seq = int(meta.get("folded_seq", -1))
        eam.buffer = read_buffer(buffer_path(path), eam.folded_seq)
        if len(eam.buffer) >= cfg.buffer_size:
            eam.fold()
        return eam


def _index_file(path: Path, meta: dict[str, Any]) -> Path:
    """The hnswlib index file the checkpoint ``path`` names, which must lie beside it."""
    files = meta.get("files") or {}
    idx = path.with_name(files.get("index", ""))
    if not files.get("index") or not idx.is_file():
        raise CheckpointError(
            f"{path}: its EAM index file {idx.name or '(unnamed)'} is missing beside it; copy it along "
            "with the checkpoint or rebuild with `moecast train eam`"
        )
    return idx


def _checked_embedder(path: Path, meta: dict[str, Any], cfg: EAMConfig) -> SentenceEmbedder:
    """The embedder the checkpoint names, refused unless it is the very model the index was built with."""
    embedder = shared_embedder(
        meta.get("embedder", "minilm"), max_length=cfg.max_length, int8=cfg.int8, engine=cfg.engine
    )
    if embedder.identity != meta.get("embedder_id"):
        raise CheckpointError(
            f"{path}: index built with embedding model {meta.get('embedder_id')}, but {embedder.path} "
            f"is {embedder.identity}; rebuild the index with `moecast train eam`"
        )
    return embedder


def _load_index(index: Any, idx: Path, count: int, embedder_dim: int) -> None:
    """Load ``idx`` into the hnswlib ``index``, checked to hold ``count`` keys of the embedder's dimension."""
    try:
        index.load_index(str(idx), max_elements=count)
    except Exception as exc:  # hnswlib raises RuntimeError for a corrupt or foreign file
        raise CheckpointError(
            f"{idx}: not a readable hnswlib index ({exc}); rebuild with `moecast train eam`"
        ) from exc
    if index.get_current_count() != count or index.dim != embedder_dim:
        raise CheckpointError(
            f"{idx} holds {index.get_current_count()} keys of dim {index.dim}, the checkpoint {count} "
            f"EP values for dim {embedder_dim}; the files do not belong together, rebuild with `moecast train eam`"
        )


def index_path(ckpt: Path, generation: int) -> Path:
    stem = ckpt.name.removesuffix(".safetensors")
    return ckpt.with_name(f"{stem}.eam-g{generation}.hnsw")


def buffer_path(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name.removesuffix(".safetensors") + ".eam-buffer.jsonl")


def read_buffer(path: Path, folded_seq: int) -> list[dict[str, Any]]:
    """Buffered pairs not yet in the checkpoint; a torn last line (crash mid-append) is skipped."""
    if not path.exists():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                print(
                    f"moecast: {path}: skipped a half-written last entry (interrupted write)", file=sys.stderr
                )
                continue
            raise CheckpointError(
                f"{path}: line {i + 1} is not JSON; the buffer file is corrupt, delete it"
            ) from None
        if entry["seq"] > folded_seq:
            out.append(entry)
    return out
