"""MoE-Beyond-style sequence predictor (MoE-Beyond §3.2), token-ahead and strictly causal.

A small transformer encoder runs over the request's tokens with a causal mask.
Position t's input is the embedding of token t (its identity is known when its
forward pass starts: a prompt token, or the token just sampled) plus a projection
of token t-1's routing at every layer (finished before token t starts) and a
position embedding. The output at t, added to a learned layer-id embedding,
goes through one shared head to E logits per layer: a multi-label prediction of
every layer's experts for token t before any of its layers run. MoE-Beyond's
original model reads the whole sequence (non-causal); here only tokens <= t are
visible, which is what a runtime can use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from moecast.collect.traceset import RequestTrace
from moecast.predictors.base import Predictor
from torch import nn

from moecast.errors import InputError


@dataclass
class SequenceConfig:
    num_layers: int
    num_experts: int
    top_k: int
    token_buckets: int = 32768
    # MoE-Beyond §3.2: a 4-layer encoder, 8 heads, 2048-wide feed-forward, 512-d model, and a 2-layer
    # GELU MLP head (its width unstated: None = d_model; 0 = a single Linear)
    d_model: int = 512
    n_heads: int = 8
    n_blocks: int = 4
    ffn: int = 2048
    dropout: float = 0.1
    max_len: int = 512
    head_hidden: int | None = None

    def __post_init__(self) -> None:
        # score_request slides windows of max_len tokens: without one token per window it cannot advance
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1:
            raise InputError(
                f"sequence predictor max_len must be a positive integer, got {self.max_len!r}; "
                "retrain with data.max_len >= 2"
            )


class SequenceNet(nn.Module):
    """Causal transformer encoder + layer-id embeddings -> [B, T, L, E] logits."""

    def __init__(self, cfg: SequenceConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tok = nn.Embedding(cfg.token_buckets, d)
        self.pos = nn.Embedding(cfg.max_len, d)
        self.route = nn.Linear(cfg.num_layers * cfg.num_experts, d)
        layer = nn.TransformerEncoderLayer(
            d, cfg.n_heads, cfg.ffn, cfg.dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.n_blocks, enable_nested_tensor=False)
        self.layer_emb = nn.Embedding(cfg.num_layers, d)
        self.norm = nn.LayerNorm(d)
        hh = d if cfg.head_hidden is None else cfg.head_hidden
        # 2-layer head: GELU -> Linear(d, hh) -> GELU -> Linear(hh, E); hh = 0: GELU -> Linear(d, E)
        self.head = (
            nn.Sequential(nn.Linear(d, hh), nn.GELU(), nn.Linear(hh, cfg.num_experts))
            if hh
            else nn.Linear(d, cfg.num_experts)
        )

    def forward(
        self, tokens: torch.Tensor, prev_route: torch.Tensor, pad: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens [B, T] bucket ids, prev_route [B, T, L*E] (token t-1's multi-hot), pad [B, T] True = padding."""
        T = tokens.shape[1]
        if self.cfg.max_len < T:
            raise InputError(
                f"request of {T} tokens is longer than the sequence predictor's max_len {self.cfg.max_len}"
            )
        pos = torch.arange(T, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos) + self.route(prev_route)
        # bool like the padding mask (True = may not attend): mixed mask types are deprecated in torch
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tokens.device), 1)
        h = self.norm(self.encoder(x, mask=causal, src_key_padding_mask=pad))
        h = h.unsqueeze(2) + self.layer_emb.weight  # [B, T, L, d]
        return self.head(F.gelu(h))


def sequence_inputs(
    token_ids: np.ndarray, topk: np.ndarray, cfg: SequenceConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(bucket ids [T], previous token's routing multi-hot [T, L*E]) for one request."""
    from moecast.predictors.metrics import multi_hot

    T = len(token_ids)
    hot = multi_hot(np.asarray(topk), cfg.num_experts, np.float32).reshape(T, -1)
    prev = np.zeros_like(hot)
    prev[1:] = hot[:-1]
    return np.asarray(token_ids, np.int64) % cfg.token_buckets, prev


class SequencePredictor(Predictor):
    """Token-ahead predictor: every layer's experts of token t from tokens <= t and routing of tokens < t."""

    name = "sequence"
    horizon = "token-ahead"

    def __init__(
        self,
        net: SequenceNet,
        moe_layers: list[int],
        fingerprint: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.net = net.eval()
        self.cfg = net.cfg
        self.moe_layers = list(moe_layers)
        self.num_layers, self.num_experts, self.top_k = (
            self.cfg.num_layers,
            self.cfg.num_experts,
            self.cfg.top_k,
        )
        self.fingerprint = fingerprint
        self.meta = dict(meta or {})

    @torch.no_grad()
    def score_request(self, trace: RequestTrace) -> np.ndarray:
        tok, prev = sequence_inputs(trace.token_ids, trace.topk_ids, self.cfg)
        T = len(tok)
        out = np.zeros((T, self.num_layers, self.num_experts), np.float32)
        W = self.cfg.max_len
        # longer requests: causal windows of max_len with stride max_len/2 (at least 1, so max_len 1
        # still advances); a window's first W - step positions were scored by the one before it with
        # more context, so every position past the first window keeps at least max_len/2 tokens
        step = max(1, W // 2)
        start = 0
        while True:
            hi = min(T, start + W)
            logits = self.net(torch.from_numpy(tok[start:hi])[None], torch.from_numpy(prev[start:hi])[None])[
                0
            ]
            keep = 0 if start == 0 else W - step
            out[start + keep : hi] = torch.sigmoid(logits[keep:]).numpy()
            if hi == T:
                break
            start += step
        return out

    def metadata(self) -> dict[str, Any]:
        return {
            **self.meta,
            **super().metadata(),
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "config": asdict(self.cfg),
        }

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        from moecast.predictors.checkpoint import save

        return save(path, dict(self.net.state_dict()), {**self.metadata(), **(extra or {})})

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> SequencePredictor:
        try:
            # checkpoints from before the 2-layer head carry no head_hidden: a single Linear
            net = SequenceNet(SequenceConfig(**{"head_hidden": 0, **meta["config"]}))
            net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
        except (KeyError, TypeError, RuntimeError) as exc:
            raise InputError(
                f"{path}: sequence checkpoint does not match this moecast ({exc}); retrain it"
            ) from exc
        return cls(net, meta["moe_layers"], meta.get("fingerprint"), meta)
