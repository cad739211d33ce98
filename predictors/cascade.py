"""CasMoE's cascade planner (casmoe-eam-eap-cascade.md, "Cascade Planner", "Gating", "Inference").

The gate: the EAM's plan (Eqs. 4-5, :mod:`~moecast.predictors.eam`) when its cosine
confidence is at least epsilon, otherwise the EAP's (Eqs. 6-9,
:mod:`~moecast.predictors.eap`). Written by ``moecast train cascade``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from moecast.predictors.casmoe import Planner
from moecast.predictors.checkpoint import CheckpointError, save
from moecast.predictors.eam import EAM

from moecast.errors import InputError


class Cascade(Planner):
    """CasMoE's cascade planner with its gate ("Gating", "Inference"): EAM if confidence >= epsilon, else EAP.

    When the EAP's encoder is frozen and identical to the EAM's embedder, the EAM's
    embedding is reused by the EAP heads, so a fallback costs only the heads.
    """

    name: ClassVar[str] = "cascade"

    def __init__(self, eam: EAM, eap: Any, epsilon: float) -> None:
        if eam.fingerprint != eap.fingerprint:
            raise CheckpointError(
                f"the EAM is for model fingerprint {eam.fingerprint}, the EAP for {eap.fingerprint}; "
                "build both from traces of the same MoE model"
            )
        if (eam.num_layers, eam.num_experts) != (eap.num_layers, eap.num_experts):
            raise CheckpointError(
                f"EAM plans {eam.num_layers}x{eam.num_experts}, EAP {eap.num_layers}x{eap.num_experts}; they do not fit"
            )
        if not 0.0 <= epsilon <= 1.0:
            raise InputError(f"epsilon {epsilon} must be a cosine threshold in [0, 1]")
        self.eam, self.eap, self.epsilon = eam, eap, float(epsilon)
        self.num_layers, self.num_experts, self.top_k = eam.num_layers, eam.num_experts, eam.top_k
        self.fingerprint = eam.fingerprint
        self.moe_layers = eam.moe_layers
        self.shared_embedding = eap.shares_embedder(eam.embedder)
        self.extra_meta: dict[str, Any] = {}  # its EAM and EAP keep their builds' records
        self.last_confidence = float("nan")

    def set_encoder(
        self, int8: bool | None = None, engine: str | None = None, threads: int | None = None
    ) -> None:
        """The same encoder settings for both planners (see ``EAM.set_encoder``)."""
        self.eam.set_encoder(int8, engine, threads)
        self.eap.set_encoder(int8, engine, threads)

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        emb = self.eam.embedder.embed([prompt])
        plans, conf = self.eam.query_embedding(emb)
        self.last_confidence = float(conf[0])
        if conf[0] >= self.epsilon:
            return plans[0], "eam"
        if self.shared_embedding:
            return self.eap.plan_from_embedding(emb)[0], "eap"
        return self.eap.plan(prompt)[0], "eap"

    def observe(self, prompt: str, ep: np.ndarray) -> bool:
        """A served prompt and its EP into the EAM's buffer (:meth:`EAM.observe`); the EAP is
        trained offline and has no buffer."""
        return self.eam.observe(prompt, ep)

    def save(self, path: str | Path, eam_path: str | Path, eap_path: str | Path) -> Path:
        """A small checkpoint naming the EAM and EAP checkpoints (paths relative to it when beside it)."""
        path = Path(path)

        def rel(p: str | Path) -> str:
            p = Path(p).resolve()
            try:
                return str(p.relative_to(path.resolve().parent))
            except ValueError:
                return str(p)

        meta = {
            **self.metadata(),
            "epsilon": self.epsilon,
            "files": {"eam": rel(eam_path), "eap": rel(eap_path)},
        }
        import torch

        return save(path, {"epsilon": torch.tensor([self.epsilon])}, meta)

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> Cascade:
        from moecast.predictors.registry import load

        files = meta.get("files") or {}
        parts = {}
        for part in ("eam", "eap"):
            p = Path(files.get(part, ""))
            p = p if p.is_absolute() else Path(path).parent / p
            if not files.get(part) or not p.is_file():
                raise CheckpointError(
                    f"{path}: its {part.upper()} checkpoint {p} is missing; keep it beside the cascade"
                )
            parts[part] = load(p, fingerprint=meta["fingerprint"], against=f"cascade {path}")
        return cls(parts["eam"], parts["eap"], float(meta["epsilon"]))
