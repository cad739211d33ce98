"""LLaPor's inputs (PreScope §4.2.1, §4.2.2 "Feature Variables"): what is known when layer l-1 finishes.

LLaPor (:mod:`~moecast.predictors.llapor`) scores layer l's experts for the current token from:

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

:class:`FeatureSpec` says which of these a checkpoint reads; the functions build them for
whole requests (training, :meth:`LLaPor.features`) and :mod:`.llapor_kernel` builds the same
row for one token at run time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np


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
