"""LLaPor's network and loss (PreScope §4.2.1 architecture, Fig. 9; §4.2.2 loss).

Every multi-hot input is a bag of feature ids turned into a multi-hot vector
and multiplied by a per-layer matrix: a wide first linear layer over sparse
inputs. With ``deep_history`` every earlier layer of the current token also
contributes, through one shared embedding per source layer and a learned
strictly lower-triangular layer-mixing matrix (causal by construction). Layer groups (§3.1) pick the body: input/output groups a shallow
Linear-GELU-Dropout stack; the middle group is deeper and adds a residual block
(Linear-GELU-Dropout-Linear) modulated by a sigmoid gating unit (§4.2.1).

The losses: the paper's expert-balancing BCE plus focal term (§4.2.2), a softmax over each
row's experts against the true top-k set, and its distillation variant (Hinton et al. 2015).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from moecast.predictors.llapor_features import FeatureSpec
from torch import nn

from moecast.errors import InputError


class PCABank(nn.Module):
    """Per-layer PCA (components [L, C, H], mean [L, H]); layer l keeps its first pca_dims[li] components."""

    def __init__(self, num_layers: int, comps: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("components", torch.zeros(num_layers, comps, hidden))
        self.register_buffer("mean", torch.zeros(num_layers, hidden))

    def project(self, gate_inputs: np.ndarray) -> np.ndarray:
        """[T, L, H] gate inputs -> [T, L, C] components (float32)."""
        x = torch.from_numpy(np.asarray(gate_inputs, np.float32))
        return torch.einsum("tlh,lch->tlc", x - self.mean, self.components).numpy()


class StackedLinear(nn.Module):
    """One independent Linear per layer of a group, applied to [B, Lg, in] in one einsum."""

    def __init__(self, layers: int, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(layers, fan_in, fan_out) * fan_in**-0.5)
        self.bias = nn.Parameter(torch.zeros(layers, fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bli,lio->blo", x, self.weight) + self.bias


class GroupBody(nn.Module):
    """The per-layer networks of one layer group (PreScope §4.2.1): shallow, or deep with a gated residual block."""

    def __init__(
        self, layers: int, hidden: int, experts: int, depth: int, residual: bool, dropout: float
    ) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(StackedLinear(layers, hidden, hidden) for _ in range(depth))
        self.residual = residual
        if residual:
            self.res1 = StackedLinear(layers, hidden, hidden)
            self.res2 = StackedLinear(layers, hidden, hidden)
            self.gate = StackedLinear(layers, hidden, hidden)
        self.head = StackedLinear(layers, hidden, experts)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for lin in self.hidden:
            h = self.drop(F.gelu(lin(h)))
        if self.residual:
            r = self.res2(self.drop(F.gelu(self.res1(h))))
            # gating unit: how much the residual path (the hidden state's influence) contributes
            h = h + torch.sigmoid(self.gate(h)) * r
        return self.head(h)


@dataclass
class NetConfig:
    hidden: int = 256
    depth_io: int = 1  # hidden Linear-GELU-Dropout blocks after the input layer, input/output groups
    depth_middle: int = 2
    dropout: float = 0.1


class LLaPorNet(nn.Module):
    """All layers' LLaPor predictors in one module; groups map layer positions to bodies."""

    def __init__(self, spec: FeatureSpec, groups: dict[str, list[int]], net: NetConfig) -> None:
        super().__init__()
        self.spec, self.groups, self.net = spec, {g: list(v) for g, v in groups.items() if v}, net
        L, H = spec.num_layers, net.hidden
        # wide first layer over the sparse multi-hot inputs (one matrix per layer): a dense
        # multi-hot matmul, which on CPU beats EmbeddingBag by ~10x at these sizes
        self.w_in = StackedLinear(L, max(spec.vocab, 1), H)
        with torch.no_grad():
            self.w_in.weight.normal_(std=(max(spec.sparse_blocks, 1) * spec.top_k) ** -0.5)
        if spec.deep_history:
            # every earlier layer l' < l of this token: shared embedding per source layer,
            # combined by a learned strictly lower-triangular mix (cheap: B x L x L x H)
            self.deep_emb = nn.Parameter(torch.randn(L, spec.num_experts, H) * spec.top_k**-0.5)
            self.deep_mix = nn.Parameter(
                torch.tril(torch.ones(L, L), -1) / torch.arange(1, L + 1).clamp_min(1).view(L, 1)
            )
            self.register_buffer("deep_mask", torch.tril(torch.ones(L, L), -1))
        if spec.token_buckets:
            # one extra (pad) bucket when previous tokens are embedded too
            self.tok = nn.Embedding(spec.token_buckets + (1 if spec.context_tokens else 0), spec.token_dim)
            self.tok_proj = StackedLinear(L, spec.token_dim * (1 + spec.context_tokens), H)
            if spec.token_exact:
                # sorted raw token ids of the exact vocabulary (row token_buckets - 1 = unseen)
                self.register_buffer("tok_vocab", torch.zeros(spec.token_buckets - 1, dtype=torch.int64))
        if spec.dense_dim:
            self.dense_proj = StackedLinear(L, spec.dense_dim, H)
            if spec.dense_skip:
                # a router-like linear path (gate input -> logits), what gate reuse does with fixed weights
                self.dense_skip = StackedLinear(L, spec.dense_dim, spec.num_experts)
                nn.init.zeros_(self.dense_skip.weight)
        if spec.gate_pca:
            self.pca = PCABank(L, spec.pca_max, spec.gate_hidden)
        self.bodies = nn.ModuleDict(
            {
                g: GroupBody(
                    len(ls),
                    H,
                    spec.num_experts,
                    net.depth_middle if g == "middle" else net.depth_io,
                    residual=(g == "middle"),
                    dropout=net.dropout,
                )
                for g, ls in self.groups.items()
            }
        )

    def forward(
        self,
        bags: torch.Tensor,
        tokens: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
        route: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """bags [B, L, n] sparse feature ids (pad = spec.vocab), tokens [B] bucket ids, dense [B, L, D],
        route [B, L, k] the current token's ids at every layer (only layers < li reach row li) -> logits [B, L, E]."""
        B, L, _ = bags.shape
        V = self.spec.vocab
        hot = bags.new_zeros((B, L, V + 1), dtype=torch.float32).scatter_(2, bags, 1.0)[..., : max(V, 1)]
        h = self.w_in(hot if V else torch.zeros_like(hot))
        if self.spec.deep_history and route is not None:
            cur = route.new_zeros((B, L, self.spec.num_experts), dtype=torch.float32).scatter_(2, route, 1.0)
            per_layer = torch.einsum("ble,leh->blh", cur, self.deep_emb)
            h = h + torch.einsum("bmh,lm->blh", per_layer, self.deep_mix * self.deep_mask)
        if self.spec.token_buckets and tokens is not None:
            te = self.tok(tokens).reshape(B, -1)  # [B, token_dim * (1 + context_tokens)]
            h = h + self.tok_proj(te.unsqueeze(1).expand(B, L, -1))
        if self.spec.dense_dim and dense is not None:
            h = h + self.dense_proj(dense)
        h = F.gelu(h)
        out = h.new_zeros(B, L, self.spec.num_experts)
        for g, layers in self.groups.items():
            out[:, layers] = self.bodies[g](h[:, layers])
        if self.spec.dense_skip and dense is not None:
            out = out + self.dense_skip(dense)
        return out


def balanced_focal_loss(
    logits: torch.Tensor, target: torch.Tensor, inv_freq: torch.Tensor, lam: torch.Tensor, gamma: float
) -> torch.Tensor:
    """PreScope §4.2.2: L = L_expert + lambda * L_focal, averaged over experts (N) and rows.

    ``inv_freq`` [L, E] is 1/f_i normalised to mean 1 per layer (the expert-balancing term; f_i from
    add-one-smoothed counts of the training split, so an expert never chosen there gets a finite weight);
    ``lam`` [L] is lambda per layer (0 for the middle group, where the paper gives no loss:
    we use the balancing term alone, configurable). focal = (1 - p_t)^gamma * BCE.
    """
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    l_expert = (bce * inv_freq).mean(-1)
    p = torch.sigmoid(logits)
    p_t = torch.where(target > 0.5, p, 1 - p)
    l_focal = ((1 - p_t) ** gamma * bce).mean(-1)
    return (l_expert + lam * l_focal).mean()


LOSSES = ("focal", "bce", "softmax")


def topk_softmax_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a softmax over experts against the true top-k set (uniform 1/k each).

    Ranks experts within a (token, layer) row, which is what recall@k scores; the
    paper's per-expert sigmoid losses score each expert on its own."""
    return soft_cross_entropy(logits, topk_distribution(target))


def topk_distribution(target: torch.Tensor) -> torch.Tensor:
    """The multi-hot top-k set as a distribution: 1/k on each chosen expert."""
    return target / target.sum(-1, keepdim=True).clamp_min(1)


def soft_cross_entropy(logits: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the cross-entropy of softmax(logits) against the distribution q."""
    return -(torch.log_softmax(logits, -1) * q).sum(-1).mean()


def distill_softmax_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    probs: torch.Tensor,
    weight: float | torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """The softmax loss against a target that mixes the true top-k set with the router's own
    probabilities (knowledge distillation, Hinton et al. 2015, "Distilling the Knowledge in a
    Neural Network", Eq. 2: the teacher's softmax at temperature T).

    q = (1 - weight) * topk / k + weight * softmax(log p / T), with p the router's recorded
    probabilities over the layer's experts (TraceSet ``router_probs``; renormalised, so sigmoid
    scores work too). Not in PreScope: the hard top-k set says nothing about how near the
    (k+1)-th expert came, and near that boundary the label is what the features cannot decide;
    the router's softened probabilities rank every expert. On tiny (1024 requests, 8 epochs)
    weight 1 and T = 2 took val recall@4 from 0.9163 to 0.9343 (``configs/llapor_tiny.yaml``).
    """
    soft = torch.softmax(torch.log(probs.float().clamp_min(1e-12)) / temperature, -1)
    q = (1 - weight) * topk_distribution(target) + weight * soft  # weight: a float or one per layer, [L, 1]
    return soft_cross_entropy(logits, q)


def group_lambda(
    num_layers: int, groups: dict[str, list[int]], lam_io: float, lam_middle: float
) -> torch.Tensor:
    """[L] lambda of the focal term per layer: ``lam_io`` for the input/output groups, ``lam_middle`` for the middle."""
    lam = torch.full((num_layers,), float(lam_io))
    lam[groups.get("middle", [])] = float(lam_middle)
    return lam


def llapor_loss(
    kind: str,
    logits: torch.Tensor,
    target: torch.Tensor,
    inv_freq: torch.Tensor,
    lam: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """The training loss ``kind`` (one of :data:`LOSSES`): training and online updates share it."""
    if kind == "softmax":
        return topk_softmax_loss(logits, target)
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(logits, target)
    if kind == "focal":
        return balanced_focal_loss(logits, target, inv_freq, lam, gamma)
    raise InputError(f"unknown LLaPor loss {kind!r}; use one of {', '.join(LOSSES)}")
