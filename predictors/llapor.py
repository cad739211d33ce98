"""LLaPor: Learnable Layer-aware Predictor (PreScope §4.2, Fig. 9), layer-ahead.

One small predictor per MoE layer l scores layer l's experts from what is known
when layer l-1 finishes for the current token (PreScope §4.2.1):

- the gate input a of layer l-1, compressed by a per-layer PCA (256 components
  for the input/output groups, 512 for the middle group, capped by the hidden
  size; §4.2.2 "Feature Variables");
- layer l-1's top-k ids (multi-hot) and their router weights;
- for ID-only TraceSets (the imported DeepSeek traces carry neither gate
  inputs nor weights) the same network uses the features that exist: a learned
  token embedding, the current token's ids at the ``prev_layers`` previous MoE
  layers, and the ids at layer l itself of the last ``history_tokens`` tokens
  (those tokens finished every layer before this one started, so this stays
  causal); optionally also those tokens' ids at layers l-1.. (``history_layers``)
  and the previous tokens' own embeddings (``context_tokens``); ``repeat_token``:
  layer l's ids of this token's latest earlier occurrence in the request;
  ``context_vote``: earlier tokens' layer-l ids pooled with weights from their overlap
  with this token's ids at the last ``context_vote`` layers below l (a dense input);
  ``token_exact``: token ids index a vocabulary from the training split (stored in the
  checkpoint as ``tok_vocab``) instead of being hashed into ``token_buckets``.
- ``context_gate`` (TraceSets with gate inputs): the PCA of layer l's gate input of the
  last ``context_gate`` tokens. Layer l's attention mixes those tokens' layer-l states into
  this token's gate input, the part of it that layer l-1's gate input cannot show; they
  finished every layer before this token started, so this stays causal.
- ``dense_skip``: a linear map from the dense features (gate-input PCA, weights)
  straight to the logits beside the MLP, i.e. a learned router on layer l-1's
  gate input (gate reuse with learned instead of borrowed weights).

Layer 0 (the first MoE layer) has no previous MoE layer and its own gate input
is not known before its router runs, so it uses the token embedding and the
previous tokens' layer-0 ids only (history features), with zero dense input.

Every multi-hot input is a bag of feature ids turned into a multi-hot vector
and multiplied by a per-layer matrix: a wide first linear layer over sparse
inputs. With ``deep_history`` every earlier layer of the current token also
contributes, through one shared embedding per source layer and a learned
strictly lower-triangular layer-mixing matrix (causal by construction). Layer groups (§3.1) pick the body: input/output groups a shallow
Linear-GELU-Dropout stack; the middle group is deeper and adds a residual block
(Linear-GELU-Dropout-Linear) modulated by a sigmoid gating unit (§4.2.1).

``update(features, truth)`` does online gradient steps (§4.2.2, last sentence);
it is off unless called.

A checkpoint may carry a context memory (:mod:`.context_memory`, not from PreScope): the
routes that training tokens took after the same text. Its votes are added to the network's
softmax in :meth:`LLaPor.score_request` and :meth:`LLaPor.score_at`.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from moecast.collect.traceset import RequestTrace
from moecast.predictors import llapor_kernel
from moecast.predictors.base import Predictor
from moecast.predictors.context_memory import ContextMemory
from torch import nn

GROUPS = ("input", "middle", "output")


@dataclass
class FeatureSpec:
    """Which inputs LLaPor uses; chosen from the fields a TraceSet has and recorded in the checkpoint."""

    num_layers: int
    num_experts: int
    top_k: int
    prev_layers: int = 1  # current token's ids at layers l-1 .. l-prev_layers
    history_tokens: int = 0  # ids at layer l of tokens t-1 .. t-history_tokens
    token_buckets: int = 0  # 0 = no token embedding; token id is hashed modulo this
    token_dim: int = 32
    gate_pca: bool = False  # PCA of layer l-1's gate input
    pca_dims: list[int] = field(default_factory=list)  # components of layer l's gate input (feeds layer l+1)
    gate_hidden: int = 0  # the model's hidden size (gate input width)
    weights: bool = False  # layer l-1's top-k router weights, scattered over experts
    deep_history: bool = False  # all earlier layers of the current token, mixed through shared embeddings
    history_layers: int = 1  # history tokens' ids at layers l, l-1, .., l-history_layers+1
    context_tokens: int = 0  # token embeddings of the previous tokens t-1 .. t-context_tokens
    dense_skip: bool = False  # also a linear map of the dense features straight to the logits
    token_exact: bool = False  # token ids index a vocabulary (net buffer tok_vocab) instead of a hash
    repeat_token: bool = False  # layer l's ids of the latest earlier occurrence of this token in the request
    context_vote: int = (
        0  # >0: earlier tokens' layer-l ids, weighted by path overlap over this many layers < l
    )
    vote_power: float = 4.0  # weight of an earlier token = (1 + overlap) ** vote_power
    context_gate: int = 0  # PCA of layer l's gate input of tokens t-1 .. t-context_gate (needs gate_pca)

    @property
    def vocab(self) -> int:
        """Sparse feature ids per layer (prev-layer blocks then history blocks), plus one pad id."""
        return self.sparse_blocks * self.num_experts

    @property
    def sparse_blocks(self) -> int:
        """Blocks of ``num_experts`` sparse ids per layer: previous layers, history tokens, repeat."""
        return self.prev_layers + self.history_tokens * self.history_layers + int(self.repeat_token)

    @property
    def pca_max(self) -> int:
        return max(self.pca_dims) if self.gate_pca and self.pca_dims else 0

    @property
    def dense_dim(self) -> int:
        return (
            self.pca_max * (1 + self.context_gate)
            + (self.num_experts if self.weights else 0)
            + (self.num_experts if self.context_vote else 0)
        )

    def fields(self) -> list[str]:
        """TraceSet fields these features read."""
        out = ["topk_ids"]
        if self.token_buckets or self.repeat_token:
            out.append("token_id")
        if self.gate_pca:
            out.append("gate_inputs")
        if self.weights:
            out.append("topk_weights")
        return out


@dataclass(frozen=True)
class _RowConstants:
    """Shapes and numpy weights :meth:`LLaPor.features_at` needs, derived once per spec."""

    spec: FeatureSpec
    nbag: int
    route_layers: int
    ntok: int
    buckets: int
    dense_dim: int
    pca_max: int
    vote_dim: int
    mean: np.ndarray  # [L, H] PCA means
    comps: np.ndarray  # [L, H, C] components, transposed; layer l reads its first pca_dims[l] columns
    pca_dims: np.ndarray


_NO_GATE = np.zeros((1, 1, 1), np.float32)  # feature_row's gate and weight rows when the features read none
_NO_W = np.zeros(1, np.float32)
_NO_RAW = np.zeros((1, 0, 1), np.float32)  # score_layer: no raw gate inputs (its dense rows hold the PCA)
_NO_RAW_OK = np.zeros((1, 0), np.bool_)


def previous_occurrence(token_ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """[N] for each row of a token table: the row of the latest earlier occurrence of the same
    token id in the same request (``pos`` restarts at 0 for every request), or -1."""
    tok = np.asarray(token_ids, np.int64)
    req = np.cumsum(np.asarray(pos) == 0)
    order = np.lexsort((np.arange(len(tok)), tok, req))  # by request, token, then row
    out = np.full(len(tok), -1, np.int64)
    same = (req[order][1:] == req[order][:-1]) & (tok[order][1:] == tok[order][:-1])
    out[order[1:][same]] = order[:-1][same]
    return out


def sparse_bags(
    spec: FeatureSpec,
    topk: np.ndarray,
    rows: np.ndarray,
    pos: np.ndarray,
    prev_same: np.ndarray | None = None,
) -> np.ndarray:
    """[B, L, nbag] int64 feature ids (pad = spec.vocab) for rows of a [N, L, k] id array.

    ``rows`` index ``topk``; ``pos`` is each row's position in its request (so the
    history never crosses into the previous request, which sits at rows - j).
    ``prev_same`` [B] (needed with ``repeat_token``) is each row's earlier occurrence of
    the same token (an index into ``topk``, -1 for none; see ``previous_occurrence``).
    """
    L, E, k = spec.num_layers, spec.num_experts, spec.top_k
    B = len(rows)
    pad = spec.vocab
    cur = topk[rows].astype(np.int64)  # [B, L, k]
    blocks = []
    for d in range(1, spec.prev_layers + 1):
        blk = np.full((B, L, k), pad, np.int64)
        if d < L:
            blk[:, d:] = cur[:, :-d] + (d - 1) * E
        blocks.append(blk)
    base = spec.prev_layers * E
    for j in range(1, spec.history_tokens + 1):
        prev = topk[np.maximum(rows - j, 0)].astype(np.int64)
        for d in range(spec.history_layers):  # token t-j's ids at layer l-d
            blk = np.full((B, L, k), pad, np.int64)
            blk[:, d:] = prev[:, : L - d] + base
            blk[pos < j] = pad
            blocks.append(blk)
            base += E
    if spec.repeat_token:
        if prev_same is None:
            raise ValueError("repeat_token needs prev_same (see previous_occurrence)")
        ps = np.asarray(prev_same, np.int64)
        blk = topk[np.maximum(ps, 0)].astype(np.int64) + base  # token's earlier occurrence, layer l
        blk[ps < 0] = pad
        blocks.append(blk)
        base += E
    if not blocks:
        return np.full((B, L, 1), pad, np.int64)
    return np.concatenate(blocks, axis=-1)


def token_buckets_of(spec: FeatureSpec, token_ids: np.ndarray, vocab: np.ndarray | None = None) -> np.ndarray:
    """Raw token ids -> embedding rows: ``id % token_buckets`` (hashing), or with ``token_exact``
    the id's index in the sorted ``vocab`` (token_buckets - 1 ids), ``token_buckets - 1`` if unseen."""
    t = np.asarray(token_ids, np.int64)
    if not spec.token_exact:
        return t % spec.token_buckets
    if vocab is None:
        raise ValueError("token_exact needs the token vocabulary")
    v = np.asarray(vocab, np.int64)
    if len(v) == 0:
        return np.zeros_like(t)
    i = np.searchsorted(v, t)
    hit = v[np.minimum(i, len(v) - 1)] == t
    return np.where(hit, i, len(v))


def token_context(
    spec: FeatureSpec,
    token_ids: np.ndarray,
    rows: np.ndarray,
    pos: np.ndarray,
    vocab: np.ndarray | None = None,
) -> np.ndarray:
    """Token bucket ids: [B] (the current token) or, with ``context_tokens`` = C, [B, 1 + C]
    (tokens t, t-1, .., t-C; a position before the request's start gets the pad bucket
    ``token_buckets``). ``token_ids`` are raw ids indexed by ``rows``; ``vocab`` is the
    sorted vocabulary of ``token_exact`` (see ``token_buckets_of``)."""
    ids = np.asarray(token_ids, np.int64)
    cur = token_buckets_of(spec, ids[rows], vocab)
    if not spec.context_tokens:
        return cur
    cols = [cur]
    for j in range(1, spec.context_tokens + 1):
        prev = token_buckets_of(spec, ids[np.maximum(rows - j, 0)], vocab)
        cols.append(np.where(pos < j, spec.token_buckets, prev))
    return np.stack(cols, 1)


def context_votes(spec: FeatureSpec, ids: np.ndarray, pos: np.ndarray | None = None) -> np.ndarray:
    """[T, L, E] float32 attention-like pooling of earlier tokens' layer-l ids (``context_vote``).

    For token t and layer l: sum over earlier tokens j of the same request of
    (1 + o)^p * multi_hot(ids[j, l]), normalised to sum 1, where o = |ids[t, m] & ids[j, m]|
    summed over the ``context_vote`` layers m = l-W .. l-1 (this token's ids below l only;
    earlier tokens finished every layer). The first token of a request gets zeros.
    ``pos`` (each row's position in its request) splits a table of several requests.
    """
    T, L, E = ids.shape[0], spec.num_layers, spec.num_experts
    out = np.zeros((T, L, E), np.float32)
    pos = np.arange(T) if pos is None else np.asarray(pos)
    starts = [*np.flatnonzero(pos == 0).tolist(), T]
    for a, b in itertools.pairwise(starts):
        n = b - a
        if n < 2:
            continue
        mh = np.zeros((n, L, E), np.float32)
        np.put_along_axis(mh, ids[a:b].astype(np.int64), 1.0, axis=-1)
        past = np.tril(np.ones((n, n), np.float32), -1)  # j < t
        gram = [mh[:, m] @ mh[:, m].T for m in range(L)]  # overlap per layer, [n, n]
        ov = np.zeros((n, n), np.float32)
        for li in range(L):
            if li >= 1:
                ov += gram[li - 1]
            if li - 1 - spec.context_vote >= 0:
                ov -= gram[li - 1 - spec.context_vote]
            w = (1.0 + ov) ** spec.vote_power * past
            v = w @ mh[:, li]
            out[a:b, li] = v / np.maximum(v.sum(-1, keepdims=True), 1e-9)
    return out


def dense_features(
    spec: FeatureSpec,
    pca_in: np.ndarray | None,
    weights: np.ndarray | None,
    ids: np.ndarray,
    pos: np.ndarray | None = None,
) -> np.ndarray:
    """[T, L, dense_dim] float32 for the tokens of whole requests: PCA of
    layer l-1's gate input and layer l-1's weights (zeros at layer 0), then with ``context_vote``
    the earlier tokens' pooled layer-l ids (``context_votes``), then with ``context_gate`` the PCA
    of layer l's gate input of tokens t-1, t-2, .. (zeros before a request's first token; ``pos``
    is each row's position in its request). The layout is :func:`dense_rows`'.

    ``pca_in`` is the already projected gate input [T, L, pca_max] (row l = layer l's own gate input).
    """
    T = ids.shape[0]
    earlier = []
    if spec.context_gate and pca_in is not None:
        pos = np.arange(T) if pos is None else np.asarray(pos)
        for n in range(1, spec.context_gate + 1):
            prev = np.zeros_like(pca_in)
            rows = np.nonzero(pos >= n)[0]
            prev[rows] = pca_in[rows - n]
            earlier.append(prev)
    votes = context_votes(spec, ids, pos) if spec.context_vote else None
    return dense_rows(spec, pca_in, earlier, weights, ids, votes)


def dense_rows(
    spec: FeatureSpec,
    pca_own: np.ndarray | None,
    pca_earlier: list[np.ndarray],
    weights: np.ndarray | None,
    ids: np.ndarray,
    votes: np.ndarray | None,
) -> np.ndarray:
    """[B, L, dense_dim] float32 for B independent tokens, from each token's own per-layer inputs:

    ``pca_own`` [B, L, pca_max] its projected gate inputs (layer l's row feeds layer l+1),
    ``pca_earlier`` the same of tokens t-1, t-2, .. (``context_gate`` arrays, zeros where the
    request has no such token), ``weights`` / ``ids`` [B, L, k] its router weights and experts,
    ``votes`` [B, L, E] its ``context_votes`` row. Training builds batches with it; the runtime's
    compiled ``llapor_kernel.feature_row`` builds the same row.
    """
    B, L = ids.shape[0], spec.num_layers
    out = np.zeros((B, L, spec.dense_dim), np.float32)
    if spec.gate_pca and pca_own is not None:
        out[:, 1:, : spec.pca_max] = pca_own[:, :-1]
    off = spec.pca_max
    if spec.weights:
        if weights is not None:
            w = np.zeros((B, L, spec.num_experts), np.float32)
            np.put_along_axis(w, ids.astype(np.int64), weights.astype(np.float32), axis=-1)
            out[:, 1:, off : off + spec.num_experts] = w[:, :-1]
        off += spec.num_experts
    if spec.context_vote:
        if votes is not None:
            out[:, :, off : off + spec.num_experts] = votes
        off += spec.num_experts
    if spec.context_gate and pca_own is not None:
        for prev in pca_earlier:
            out[:, :, off : off + spec.pca_max] = prev
            off += spec.pca_max
    return out


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
    raise ValueError(f"unknown LLaPor loss {kind!r}; use one of {', '.join(LOSSES)}")


def detect_groups(
    cos_sim: np.ndarray | None, routing_corr: np.ndarray, num_layers: int
) -> tuple[dict[str, list[int]], np.ndarray]:
    """Split layers into input / middle / output groups (PreScope §3.1).

    ``cos_sim[li]`` is the mean cosine similarity of the gate inputs of layers l-1 and li,
    ``routing_corr[li]`` how predictable layer l's experts are from layer l-1's (both for
    l >= 1). Middle layers are where these are high; the signal is their mean (the
    cosine alone when gate inputs exist is the paper's primary cue, routing correlation
    breaks its ties). Input group = layer 0 plus the leading layers below the mean;
    output group = the trailing layers below the mean; middle = the rest. With fewer
    than 3 layers there is no middle group.
    """
    L = num_layers
    if L < 3:
        return {"input": [0], "middle": [], "output": list(range(1, L))}, np.zeros(L)
    sig = np.asarray(routing_corr, np.float64).copy()
    if cos_sim is not None:
        sig = 0.5 * sig + 0.5 * np.asarray(cos_sim, np.float64)
    sig[0] = -np.inf
    body = sig[1:]
    thr = float(np.mean(body))
    high = np.flatnonzero(sig >= thr)
    first, last = int(high.min()), int(high.max())
    # keep every group non-empty and the middle group the majority's neighbourhood
    first = min(max(first, 1), L - 2)
    last = max(min(last, L - 2), first)
    groups = {
        "input": list(range(0, first)),
        "middle": list(range(first, last + 1)),
        "output": list(range(last + 1, L)),
    }
    return groups, np.where(np.isfinite(sig), sig, 0.0)


def routing_correlation(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """[L] for li >= 1: recall@k of the best single-expert co-occurrence predictor from layer l-1 to li."""
    L, k = topk.shape[1:]
    out = np.zeros(L)
    for li in range(1, L):
        a = topk[:, li - 1].astype(np.int64)
        b = topk[:, li].astype(np.int64)
        co = np.zeros((num_experts, num_experts))
        np.add.at(co, (np.repeat(a, k, 1).ravel(), np.tile(b, (1, k)).ravel()), 1)
        scores = co[a].sum(1)  # [N, E]
        pred = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
        out[li] = (pred[:, :, None] == b[:, None, :]).any(-1).mean()
    return out


def gate_cosine(gate_inputs: np.ndarray) -> np.ndarray:
    """[L] mean cosine similarity of adjacent layers' gate inputs (entry 0 unused)."""
    x = np.asarray(gate_inputs, np.float32)
    x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)
    out = np.zeros(x.shape[1])
    out[1:] = (x[:, 1:] * x[:, :-1]).sum(-1).mean(0)
    return out


def format_groups(groups: dict[str, list[int]], moe_layers: list[int]) -> str:
    parts = []
    for g in GROUPS:
        ls = groups.get(g, [])
        parts.append(
            f"{g}: " + (f"layers {moe_layers[ls[0]]}-{moe_layers[ls[-1]]} ({len(ls)})" if ls else "none")
        )
    return "layer groups  " + "  |  ".join(parts)


class LLaPor(Predictor):
    """Layer-ahead predictor (PreScope §4.2); see the module docstring for its inputs."""

    name = "llapor"
    horizon = "layer-ahead"

    def __init__(
        self,
        net: LLaPorNet,
        moe_layers: list[int],
        fingerprint: str | None = None,
        meta: dict[str, Any] | None = None,
        int8_kernel: bool = True,
        memory: ContextMemory | None = None,
    ) -> None:
        self.net = net.eval()
        self.memory = memory
        # score_layer's matrices as int8 (llapor_kernel.quantize): about 2x faster at batch 1;
        # False keeps float32, equal to the torch network up to rounding
        self.int8_kernel = int8_kernel
        self.spec = net.spec
        self.groups = net.groups
        self.moe_layers = list(moe_layers)
        self.num_layers = self.spec.num_layers
        self.num_experts = self.spec.num_experts
        self.top_k = self.spec.top_k
        self.fingerprint = fingerprint
        self.meta = dict(meta or {})
        self.needs = tuple(f for f in self.spec.fields() if f != "token_id")
        self._opt: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ features
    def features(self, trace: RequestTrace) -> dict[str, torch.Tensor]:
        """Model inputs for every (token, layer) of one request (causal: see module docstring)."""
        spec = self.spec
        ids = np.asarray(trace.topk_ids)
        T = ids.shape[0]
        missing = [
            f for f in ("gate_inputs", "topk_weights") if f in spec.fields() and getattr(trace, f) is None
        ]
        if missing:
            raise ValueError(
                f"this LLaPor checkpoint was trained with {', '.join(missing)}, which request {trace.request_id} lacks; "
                "evaluate it on traces collected with those fields"
            )
        pos = np.arange(T)
        tok_ids = np.asarray(trace.token_ids) if (spec.token_buckets or spec.repeat_token) else None
        prev_same = previous_occurrence(tok_ids, pos) if spec.repeat_token else None
        feats = {"bags": torch.from_numpy(sparse_bags(spec, ids, pos, pos, prev_same))}
        if spec.deep_history:
            feats["route"] = torch.from_numpy(ids.astype(np.int64))
        if spec.token_buckets:
            vocab = self.net.tok_vocab.numpy() if spec.token_exact else None
            feats["tokens"] = torch.from_numpy(token_context(spec, tok_ids, pos, pos, vocab))
        if spec.dense_dim:
            pca_in = None
            if spec.gate_pca:
                g = np.asarray(trace.gate_inputs, np.float32)
                if not np.isfinite(g).all():
                    raise ValueError(
                        f"request {trace.request_id}: gate_inputs contain NaN or inf; re-collect it"
                    )
                pca_in = self.net.pca.project(g) * self._pca_mask()
            w = trace.topk_weights if spec.weights else None
            if w is not None and not np.isfinite(np.asarray(w, np.float32)).all():
                raise ValueError(
                    f"request {trace.request_id}: topk_weights contain NaN or inf; re-collect it"
                )
            feats["dense"] = torch.from_numpy(dense_features(spec, pca_in, w, ids))
        return feats

    def features_at(self, trace: RequestTrace, layer: int) -> dict[str, np.ndarray]:
        """The last token's inputs to layer ``layer``'s predictor, as :meth:`score_layer` reads them.

        The runtime's per-layer path: :meth:`features` builds every (token, layer) of the window,
        ~0.8 ms on tiny and O(L) gate-input projections per call; this builds one row, and
        projects only the gate inputs that layer reads (layer-1's of this token, and layer's of
        the ``context_gate`` previous tokens). Other layers' dense entries are left zero. Equal to
        ``features(trace)[-1:]`` at ``layer`` (tested).
        """
        return self._row(trace, layer, project=True)

    def _row(self, trace: RequestTrace, layer: int, project: bool) -> dict[str, np.ndarray]:
        """:meth:`features_at`; with ``project`` False the gate inputs' PCA blocks stay zero
        (:meth:`score_at` feeds the raw gate inputs to the folded matrices instead)."""
        spec = self.spec
        project = project and spec.gate_pca
        ids = np.asarray(trace.topk_ids)
        T, L, k = ids.shape[0], spec.num_layers, spec.top_k
        t = T - 1
        i64, f32 = np.int64, np.float32
        c = self._row_constants()
        bags = np.full((1, L, c.nbag), spec.vocab, i64)
        route = np.empty((1, c.route_layers, k), i64)
        tokens = np.empty((1, c.ntok), i64)
        dense = np.zeros((1, L, c.dense_dim), f32)
        gate = _NO_GATE
        if project:  # the rows the projections read: token t and its context_gate predecessors
            gate = np.asarray(trace.gate_inputs[max(0, t - spec.context_gate) :], f32)
        wrow = _NO_W
        if spec.weights and layer > 0:
            wrow = np.asarray(trace.topk_weights[t, layer - 1], f32)
        ok = llapor_kernel.feature_row(
            ids, np.asarray(trace.token_ids, i64), gate, wrow, t, layer,
            spec.prev_layers, spec.history_tokens, spec.history_layers, spec.repeat_token, spec.num_experts,
            spec.vocab, c.buckets, spec.context_tokens, project, c.mean, c.comps,
            c.pca_dims, c.pca_max, spec.weights, c.vote_dim,
            spec.context_gate, bags[0, layer], route[0], tokens[0], dense[0, layer],
        )  # fmt: skip
        if not ok:
            bad_w = spec.weights and layer > 0 and not np.isfinite(wrow).all()
            field = "topk_weights" if bad_w else "gate_inputs"
            raise ValueError(f"request {trace.request_id}: {field} contain NaN or inf; re-collect it")
        feats: dict[str, np.ndarray] = {"bags": bags}
        if spec.deep_history:
            feats["route"] = route
        if spec.token_buckets:
            if spec.token_exact:  # sorted-vocabulary lookup: rare, so left to numpy
                window = np.asarray(trace.token_ids[max(0, t - spec.context_tokens) :], i64)[::-1]
                tok = np.full(1 + spec.context_tokens, spec.token_buckets, i64)
                tok[: len(window)] = token_buckets_of(spec, window, self.net.tok_vocab.numpy())
                tokens = tok[None, :]
            feats["tokens"] = tokens if spec.context_tokens else tokens[0]
        if spec.context_vote:
            off = spec.pca_max + (spec.num_experts if spec.weights else 0)
            dense[0, layer, off : off + spec.num_experts] = context_votes(spec, ids)[t, layer]
        if c.dense_dim:
            feats["dense"] = dense
        return feats

    def _row_constants(self) -> _RowConstants:
        """What :meth:`features_at` derives from the spec and the PCA, once per spec: the spec's
        properties and torch-to-numpy copies cost microseconds on the runtime's per-layer call."""
        c = self.__dict__.get("_row_consts")
        spec = self.spec
        if c is None or c.spec is not spec:
            if spec.gate_pca:
                pca = self.net.pca
                mean = np.ascontiguousarray(pca.mean.numpy(), np.float32)
                comps = np.ascontiguousarray(pca.components.numpy().transpose(0, 2, 1), np.float32)
            else:
                mean, comps = np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.float32)
            c = _RowConstants(
                spec=spec,
                nbag=max(1, spec.sparse_blocks * spec.top_k),
                route_layers=spec.num_layers if spec.deep_history else 0,
                ntok=1 + spec.context_tokens if spec.token_buckets and not spec.token_exact else 0,
                buckets=max(spec.token_buckets, 1),
                dense_dim=spec.dense_dim,
                pca_max=spec.pca_max,
                vote_dim=spec.num_experts if spec.context_vote else 0,
                mean=mean,
                comps=comps,
                pca_dims=np.array(spec.pca_dims or [0] * spec.num_layers, np.int64),
            )
            self.__dict__["_row_consts"] = c
        return c

    def _pca_mask(self) -> np.ndarray:
        m = np.zeros((self.num_layers, self.spec.pca_max), np.float32)
        for li, c in enumerate(self.spec.pca_dims):
            m[li, :c] = 1
        return m

    @torch.no_grad()
    def score_request(self, trace: RequestTrace) -> np.ndarray:
        scores = self.score_features(self.features(trace))
        if self.memory is None:
            return scores
        return self.with_memory(scores, self.memory.votes(trace.token_ids))

    def with_memory(self, scores: np.ndarray, votes: np.ndarray) -> np.ndarray:
        """The network's scores (sigmoids, [..., E]) with the context memory's votes added
        (:func:`.llapor_kernel.blend_rows`).

        A softmax-trained network's rows become its softmax times k (from the sigmoids: a
        softmax is the odds p / (1 - p) normalised), so that both terms sum to k per row; a
        focal- or BCE-trained network's sigmoids already estimate each expert's chance.
        """
        assert self.memory is not None
        E = scores.shape[-1]
        p = np.ascontiguousarray(scores, np.float32).reshape(-1, E)
        v = np.ascontiguousarray(votes, np.float32).reshape(-1, E)
        out = np.empty_like(p)
        softmax = self.meta.get("hyper_parameters", {}).get("loss") == "softmax"
        llapor_kernel.blend_rows(p, v, float(self.top_k), self.memory.config.weight, softmax, out)
        return out.reshape(scores.shape)

    def score_features(self, feats: dict[str, torch.Tensor]) -> np.ndarray:
        """[T, L, E] scores of ``features()`` rows (what ``update`` also takes)."""
        self.net.eval()
        with torch.no_grad():  # after an online update the weights require grad
            return torch.sigmoid(self.net(**feats)).numpy().astype(np.float32)

    def score_layer(self, layer: int, feats: dict[str, torch.Tensor | np.ndarray]) -> np.ndarray:
        """[B, E] scores of one layer for a batch of tokens: the runtime's per-layer call.

        Runs only that layer's predictor, as one compiled loop (:mod:`.llapor_kernel`) on
        weights packed once per layer (int8 matrices unless ``int8_kernel`` is False): no torch
        dispatch, no per-operation numpy calls.
        ``feats`` are rows of ``features()`` (all layers' inputs; only this layer's are read) or
        the one row of ``features_at(trace, layer)``.
        """
        w = self._layer_weights(layer)
        return self._forward(layer, w, w["packed"], feats, _NO_RAW, _NO_RAW_OK)[0]

    def _forward(
        self,
        layer: int,
        w: dict[str, Any],
        packed: tuple,
        feats: dict[str, torch.Tensor | np.ndarray],
        raw: np.ndarray,
        present: np.ndarray,
    ) -> tuple[np.ndarray, bool]:
        """(scores [B, E], whether the raw gate inputs were finite): layer ``layer``'s slice of
        ``feats`` through :func:`.llapor_kernel.forward` with ``packed`` weights."""
        bags = np.asarray(feats["bags"])[:, layer]  # [B, n]; the pad id indexes a zero row
        B = len(bags)
        none_i = np.zeros((B, 0), np.int64)
        route = np.asarray(feats["route"])[:, :layer].reshape(B, -1) if "deep_off" in w else none_i
        tokens = np.asarray(feats["tokens"]).reshape(B, -1) if "tok" in w else none_i
        dense = (
            np.asarray(feats["dense"], np.float32)[:, layer]
            if "dense_proj" in w
            else np.zeros((B, 0), np.float32)
        )
        out = np.empty((B, self.num_experts), np.float32)
        ok = llapor_kernel.forward(bags, route, tokens, dense, *packed, raw, present, out)
        return out, ok

    def score_at(self, trace: RequestTrace, layer: int) -> np.ndarray:
        """[E] scores of layer ``layer`` for the last token of ``trace``: the runtime's per-layer
        call, ``score_layer(layer, features_at(trace, layer))[0]`` with the gate inputs' PCA
        folded into the layer's first matrices (:func:`.llapor_kernel.fold_pca`), the feature
        row and the network in one compiled call (:func:`.llapor_kernel.score_row`).

        At a real model's width the projection dominates the call: at Hg 2048 and 512
        components it reads a 4 MB matrix per gate input; folded, each gate input meets one
        [Hg, hidden + E] int8 matrix (~0.4 MB at hidden 128). Equal to the unfolded call up to
        the int8 rounding (tested). Once :meth:`update` has run, or with features built in
        numpy (``token_exact``, ``context_vote``), it is that call.
        """
        spec = self.spec
        if self._opt is not None or spec.token_exact or spec.context_vote:
            # online updates (update()) change the weights every token: folding them again
            # each time would cost more than it saves
            row = self.score_layer(layer, self.features_at(trace, layer))[0]
            return row if self.memory is None else self._blend_row(row, trace, layer)
        w = self._layer_weights(layer)
        args = w.get("row_args")
        if args is None:  # built on first use: only the runtime's path reads it
            args = w["row_args"] = self._row_args(layer, w)
        blocks, consts, packed = args
        ids = np.asarray(trace.topk_ids)
        t = len(ids) - 1
        gate = _NO_GATE
        if len(blocks):
            gate = trace.gate_inputs
            if not (isinstance(gate, np.ndarray) and gate.dtype == np.float32):
                gate = np.asarray(gate[max(0, t - int(blocks[:, 0].max())) :], np.float32)
        wrow = _NO_W
        if spec.weights and layer > 0:
            wrow = np.asarray(trace.topk_weights[t, layer - 1], np.float32)
        out = np.empty((1, self.num_experts), np.float32)
        bad = llapor_kernel.score_row(
            ids, np.asarray(trace.token_ids, np.int64), wrow, gate, t, layer, blocks, *consts, packed, out
        )
        if bad:
            field = "topk_weights" if bad == 1 else "gate_inputs"
            raise ValueError(f"request {trace.request_id}: {field} contain NaN or inf; re-collect it")
        if self.memory is not None:
            return self._blend_row(out[0], trace, layer)
        return out[0]

    def _blend_row(self, row: np.ndarray, trace: RequestTrace, layer: int) -> np.ndarray:
        """:meth:`with_memory` for the last token's row of ``layer``: one lookup per token."""
        assert self.memory is not None
        return self.with_memory(row, self.memory.votes_last(trace.token_ids)[layer])

    def _row_args(self, layer: int, w: dict[str, Any]) -> tuple[np.ndarray, tuple, tuple]:
        """:meth:`score_at`'s constant arguments of :func:`.llapor_kernel.score_row` for ``layer``:
        the folded blocks, the spec's sizes and the packed weights (the PCA folded in)."""
        spec, c = self.spec, self._row_constants()
        blocks = np.array(w["fold_blocks"], np.int64).reshape(-1, 2)
        packed = w["packed"]
        if len(blocks):
            mean, folded = self._fold(layer, w)
            packed = (*packed[:-3], mean, *llapor_kernel.quantize(folded, self.int8_kernel))
        consts = (
            spec.prev_layers, spec.history_tokens, spec.history_layers, spec.repeat_token,
            spec.num_experts, spec.vocab, c.buckets, spec.weights, spec.context_gate, c.pca_max, c.nbag,
            c.ntok if "tok" in w else 0, c.dense_dim if "dense_proj" in w else 0, "deep_off" in w,
        )  # fmt: skip
        return blocks, consts, packed

    def _layer_weights(self, layer: int) -> dict[str, Any]:
        # one cache per precision: packed int8 and float32 weights can both be kept
        cache = self.__dict__.setdefault("_layer_cache", {}).setdefault(self.int8_kernel, {})
        if layer in cache:
            return cache[layer]
        net = self.net

        def np_(t: torch.Tensor) -> np.ndarray:
            return t.detach().float().numpy().copy()

        V, E, H = self.spec.vocab, self.num_experts, net.net.hidden
        # input table: the layer's sparse-feature rows, one zero row for the pad id (V)
        w: dict[str, Any] = {
            "table": np.ascontiguousarray(
                np.vstack([np_(net.w_in.weight[layer])[:V], np.zeros((1, H), np.float32)])
            )
        }
        bias = np_(net.w_in.bias[layer])
        if self.spec.deep_history and layer > 0:
            # earlier layers' expert embeddings: one table for all layers, each layer's mix apart
            if "deep" not in cache:
                cache["deep"] = np.ascontiguousarray(np_(net.deep_emb).reshape(-1, H))
            mix = np_((net.deep_mix * net.deep_mask)[layer, :layer])  # [layer]
            w["deep_table"] = cache["deep"]
            w["deep_w"] = np.repeat(mix, self.top_k).astype(np.float32)
            w["deep_off"] = np.repeat(np.arange(layer) * E, self.top_k)
        if self.spec.token_buckets:
            w["tok"] = np_(net.tok.weight)
            w["tok_proj"] = np_(net.tok_proj.weight[layer])
            bias = bias + np_(net.tok_proj.bias[layer])
        if self.spec.dense_dim:
            w["dense_proj"] = np_(net.dense_proj.weight[layer])
            bias = bias + np_(net.dense_proj.bias[layer])
            if self.spec.dense_skip:
                w["skip"] = (np_(net.dense_skip.weight[layer]), np_(net.dense_skip.bias[layer]))
        w["bias"] = bias
        w["fold_blocks"] = self._fold_blocks(layer)
        group = next(g for g, ls in self.groups.items() if layer in ls)
        j = self.groups[group].index(layer)
        body = net.bodies[group]

        def pick(lin: StackedLinear) -> tuple[np.ndarray, np.ndarray]:
            return np_(lin.weight[j]), np_(lin.bias[j])

        w["hidden"] = [pick(lin) for lin in body.hidden]
        if body.residual:
            (r1, b1), (g, bg) = pick(body.res1), pick(body.gate)
            w["res_gate"] = (np.ascontiguousarray(np.hstack([r1, g])), np.concatenate([b1, bg]))
            w["res2"] = pick(body.res2)
        w["head"] = pick(body.head)
        w["packed"] = llapor_kernel.pack(w, H, E, int8=self.int8_kernel)
        cache[layer] = w
        return w

    def _fold_blocks(self, layer: int) -> list[tuple[int, int]]:
        """The gate inputs layer ``layer``'s dense features project, as (tokens back, source
        layer), in their order in ``dense``: layer-1's of this token, then layer's of the
        ``context_gate`` previous tokens."""
        spec = self.spec
        if not spec.gate_pca:
            return []
        first = [(0, layer - 1)] if layer > 0 else []
        return first + [(n, layer) for n in range(1, spec.context_gate + 1)]

    def _fold(self, layer: int, w: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(means [G, Hg], folded matrices [G, Hg, hidden (+ E)]) of ``_fold_blocks(layer)``."""
        spec, pca = self.spec, self.net.pca
        dims = spec.pca_dims
        readers = [w["dense_proj"]] + ([w["skip"][0]] if "skip" in w else [])
        offsets = [0] + [
            spec.pca_max * n + spec.num_experts * (int(spec.weights) + int(bool(spec.context_vote)))
            for n in range(1, spec.context_gate + 1)
        ]
        means, mats = [], []
        for back, src in w["fold_blocks"]:
            off = offsets[back]
            m, W = llapor_kernel.fold_pca(
                pca.mean[src].numpy(), pca.components[src].numpy(), dims[src],
                [r[off : off + dims[src]] for r in readers],
            )  # fmt: skip
            means.append(m)
            mats.append(W)
        return np.stack(means), np.stack(mats)

    # ------------------------------------------------------------------ online learning
    def update(
        self,
        feats: dict[str, torch.Tensor],
        truth: np.ndarray,
        lr: float = 1e-3,
        steps: int = 1,
        gamma: float | None = None,
        lam: float | None = None,
    ) -> float:
        """Online continual learning (PreScope §4.2.2): a few AdamW steps on newly observed routing.

        ``truth`` [B, L, k] are the true ids of the tokens whose features are ``feats``.
        The loss is the one the checkpoint was trained with (its ``loss``, ``gamma``,
        ``lam_io`` / ``lam_middle``; the paper's focal loss for a checkpoint that records
        none): a softmax-trained DeepSeek LLaPor updated with the focal loss fell from 0.709 to
        0.676 held-out recall@6. The expert-balancing weights 1/f_i are not in the checkpoint,
        so the balancing term weighs every expert 1. ``gamma`` / ``lam`` override the recorded
        values. Returns the loss before the last step. Off unless the runtime calls it.
        """
        from moecast.predictors.metrics import multi_hot

        hp = self.meta.get("hyper_parameters", {})
        kind = hp.get("loss", "focal")
        gamma = float(hp.get("gamma", 2.0) if gamma is None else gamma)
        if lam is None:
            lam_t = group_lambda(
                self.num_layers, self.groups, hp.get("lam_io", 0.5), hp.get("lam_middle", 0.0)
            )
        else:
            lam_t = torch.full((self.num_layers,), float(lam))
        target = torch.from_numpy(multi_hot(np.asarray(truth), self.num_experts, np.float32))
        if self._opt is None or self._opt.param_groups[0]["lr"] != lr:
            self._opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=0.0)
        inv = torch.ones(self.num_layers, self.num_experts)
        self.__dict__.pop("_layer_cache", None)  # weights change: per-layer numpy copies are stale
        self.net.train()
        loss_val = float("nan")
        for _ in range(steps):
            loss = llapor_loss(kind, self.net(**feats), target, inv, lam_t, gamma)
            self._opt.zero_grad()
            loss.backward()
            self._opt.step()
            loss_val = float(loss.detach())
        self.net.eval()
        return loss_val

    # ------------------------------------------------------------------ checkpoint
    def metadata(self) -> dict[str, Any]:
        return {
            **self.meta,
            **super().metadata(),
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "features": asdict(self.spec),
            "net": asdict(self.net.net),
            "groups": self.groups,
            "needs": list(self.spec.fields()),
            "memory": None if self.memory is None else self.memory.metadata(),
        }

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        from moecast.predictors.checkpoint import save

        tensors: dict[str, Any] = dict(self.net.state_dict())
        if self.memory is not None:
            tensors.update(self.memory.tensors())
        return save(path, tensors, {**self.metadata(), **(extra or {})})

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> LLaPor:
        try:
            spec = FeatureSpec(**meta["features"])
            net = LLaPorNet(spec, {g: list(v) for g, v in meta["groups"].items()}, NetConfig(**meta["net"]))
            weights = {k: v for k, v in tensors.items() if not k.startswith("memory.")}
            net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
            memory = None
            if meta.get("memory"):
                memory = ContextMemory.from_tensors(tensors, meta["memory"], spec.num_experts)
        except (KeyError, TypeError, RuntimeError, ValueError) as exc:
            raise ValueError(
                f"{path}: LLaPor checkpoint does not match this moecast ({exc}); retrain it"
            ) from exc
        return cls(net, meta["moe_layers"], meta.get("fingerprint"), meta, memory=memory)


def describe(pred: LLaPor) -> str:
    memory = None if pred.memory is None else pred.memory.metadata()
    return json.dumps({"features": asdict(pred.spec), "groups": pred.groups, "memory": memory})
