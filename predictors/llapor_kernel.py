"""LLaPor's per-layer forward (PreScope §4.2.1) for the runtime, as one compiled numba loop.

The runtime asks LLaPor for one layer's scores of one token between two layers of the model
(PreScope §4.2: the prediction must finish within the layer gap). At batch 1 that is a
gather-sum over the layer's input table, the earlier layers' expert embeddings, a few
matrix-vector products and GELUs: numpy would spend most of it in per-call overhead (about 30
calls of 1-3 us), so the whole layer runs here as one loop. :meth:`LLaPor.score_layer` packs
the layer's weights once (:func:`pack`): matrices as int8 with per-column scales by default
(:func:`quantize`: the loop is bound by reading them), float32 on request. The tests compare
both with the torch network: float32 to rounding, int8 within its quantisation error.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

_F32, _I64 = np.float32, np.int64


@njit(cache=True, nogil=True, inline="always")
def _gelu(x):
    return 0.5 * x * (1.0 + math.erf(x * 0.7071067811865476))  # exact GELU, as torch's default


@njit(cache=True, nogil=True, inline="always")
def _sigmoid(x):
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


@njit(cache=True, nogil=True, inline="always", fastmath={"contract"})
def _acc4(x0, x1, x2, x3, W, i, acc, n):
    """acc += x0 W[i] + x1 W[i+1] + x2 W[i+2] + x3 W[i+3]: four rows per pass over acc, a quarter
    of its loads and stores. Its own function: the inner loop then runs at full width whether or
    not the caller tests the rows for zero first (written inline, the test cost ~30 %)."""
    r0, r1, r2, r3 = W[i], W[i + 1], W[i + 2], W[i + 3]
    for j in range(n):
        acc[j] += (
            x0 * np.float32(r0[j]) + x1 * np.float32(r1[j]) + x2 * np.float32(r2[j]) + x3 * np.float32(r3[j])
        )


@njit(cache=True, nogil=True, fastmath={"contract"})
def _addmv(x, W, s, acc, y):
    """y += (x @ W) * s: W [in, out] row-major (the inner loop runs along a row), int8 with
    per-output-column scales ``s`` or float32 with ``s`` = 1; ``acc`` is scratch of len(y).
    Groups of four zero rows of ``x`` are skipped (multi-hot inputs, and the PCA slots
    :meth:`LLaPor.score_at` leaves zero). Fused multiply-adds only ("contract"): no
    reassociation, and NaN / inf keep their meaning."""
    n = y.shape[0]
    for j in range(n):
        acc[j] = 0.0
    rows = W.shape[0]
    i = 0
    while i + 4 <= rows:
        x0, x1, x2, x3 = x[i], x[i + 1], x[i + 2], x[i + 3]
        if x0 != 0.0 or x1 != 0.0 or x2 != 0.0 or x3 != 0.0:
            _acc4(x0, x1, x2, x3, W, i, acc, n)
        i += 4
    while i < rows:
        xi = x[i]
        if xi != 0.0:
            row = W[i]
            for j in range(n):
                acc[j] += xi * np.float32(row[j])
        i += 1
    for j in range(n):
        y[j] += acc[j] * s[j]


@njit(cache=True, nogil=True)
def _matvec(x, W, s, b, acc, y):
    """y = (x @ W) * s + b."""
    for j in range(y.shape[0]):
        y[j] = b[j]
    _addmv(x, W, s, acc, y)


@njit(cache=True, nogil=True)
def forward(
    bags, route, tokens, dense,  # features: [B, n], [B, r], [B, t], [B, Dd] (r, t, Dd may be 0)
    table, bias, deep_table, deep_w, deep_off, tok, tok_proj, tok_s, dense_proj, dense_s,
    hid_w, hid_s, hid_b, res_w, res_s, res_b, res2_w, res2_s, res2_b, head_w, head_s, head_b,
    skip_w, skip_s, skip_b, fold_mean, fold_w, fold_s,
    graw, gok,  # raw gate inputs [B, G, Hg] of the folded blocks, and which are present [B, G]
    out,
):  # fmt: skip
    """Scores [B, E] of one layer into ``out``; parts with zero-size weights are absent.
    Every matrix comes with its per-output-column scales (``*_s``): see :func:`pack`.

    ``graw`` (G > 0 only on :meth:`LLaPor.score_at`'s path): gate inputs whose PCA blocks of
    ``dense`` are left zero; block g adds ``(graw[b, g] - fold_mean[g]) @ fold_w[g]``, the PCA
    folded into the first layer and the skip path (:func:`fold_pca`). Returns False when a raw
    gate input is NaN or inf (the scores are then meaningless)."""
    B = bags.shape[0]
    H = table.shape[1]
    E = head_w.shape[1]
    D = tok.shape[1]
    F = fold_w.shape[2]
    h = np.empty(H, np.float32)
    t = np.empty(H, np.float32)
    both = np.empty(res_w.shape[1], np.float32)
    r = np.empty(H, np.float32)
    logit = np.empty(E, np.float32)
    acc = np.empty(max(2 * H, E, F), np.float32)
    folded = np.zeros(F, np.float32)
    d = np.empty(graw.shape[2], np.float32)
    ok = True
    for b in range(B):
        for j in range(F):
            folded[j] = 0.0
        for g in range(graw.shape[1]):
            if gok[b, g]:
                for i in range(d.shape[0]):
                    d[i] = graw[b, g, i] - fold_mean[g, i]
                _addmv(d, fold_w[g], fold_s[g], acc, folded)
        for j in range(F):  # a NaN or inf input reaches every output (times a zero weight: NaN)
            if not math.isfinite(folded[j]):
                ok = False
        for j in range(H):
            h[j] = bias[j] + folded[j]
        for i in range(bags.shape[1]):  # multi-hot @ W_in as a gather-sum (pad id: a zero row)
            row = table[bags[b, i]]
            for j in range(H):
                h[j] += row[j]
        for i in range(route.shape[1]):  # this token's experts at earlier layers, mixed per layer
            wgt = deep_w[i]
            row = deep_table[route[b, i] + deep_off[i]]
            for j in range(H):
                h[j] += wgt * row[j]
        for ti in range(tokens.shape[1]):  # token (and context token) embeddings, projected
            _addmv(tok[tokens[b, ti]], tok_proj[ti * D : (ti + 1) * D], tok_s, acc, h)
        _addmv(dense[b], dense_proj, dense_s, acc, h)
        for j in range(H):
            h[j] = _gelu(h[j])
        for layer in range(hid_w.shape[0]):
            _matvec(h, hid_w[layer], hid_s[layer], hid_b[layer], acc, t)
            for j in range(H):
                h[j] = _gelu(t[j])
        if res_w.shape[0] > 0:  # middle group: gated residual block
            _matvec(h, res_w, res_s, res_b, acc, both)
            for j in range(H):
                t[j] = _gelu(both[j])
            _matvec(t, res2_w, res2_s, res2_b, acc, r)
            for j in range(H):
                h[j] += _sigmoid(both[H + j]) * r[j]
        _matvec(h, head_w, head_s, head_b, acc, logit)
        if skip_w.shape[0] > 0:
            _addmv(dense[b], skip_w, skip_s, acc, logit)
            for e in range(E):
                logit[e] += skip_b[e]
        if F > H:  # the folded skip path's logits
            for e in range(E):
                logit[e] += folded[H + e]
        for e in range(E):
            out[b, e] = _sigmoid(logit[e])
    return ok


def quantize(W: np.ndarray, int8: bool) -> tuple[np.ndarray, np.ndarray]:
    """``W`` [..., in, out] as (weights, per-output-column scales [..., out]).

    int8: symmetric, scale = max |column| / 127, so every column keeps its full range and the
    error per weight is at most scale / 2. At batch 1 the layer's matrix-vector products are
    bound by reading the weights (1.2 MB per layer at hidden 256 in float32, 26 layers per token,
    more than the caches hold): a quarter of the bytes is what makes a wider LLaPor fit the
    0.1 ms budget. float32: the weights unchanged, scales 1.
    """
    W = np.asarray(W, _F32)
    if not int8 or W.size == 0:
        return np.ascontiguousarray(W, np.int8 if int8 else _F32), np.ones(W.shape[:-2] + W.shape[-1:], _F32)
    s = np.abs(W).max(axis=-2) / 127.0
    s = np.where(s > 0, s, 1.0).astype(_F32)
    Q = np.clip(np.rint(W / s[..., None, :]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(Q), np.ascontiguousarray(s)


def fold_pca(
    mean: np.ndarray, comps: np.ndarray, dims: int, rows: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """One gate-input block's PCA folded into the matrices that read its components.

    PreScope §4.2.1 projects the gate input a onto its first ``dims`` principal components,
    z = (a - mean) @ comps[:dims].T, and only linear maps read z (the first layer, and the skip
    path to the logits): z @ W = (a - mean) @ (comps[:dims].T @ W). Folded, the runtime never
    forms z: one [Hg, sum of outputs] product replaces the [Hg, dims] projection plus the
    [dims, outputs] one, and the PCA matrix (4 MB per layer in float32 at Hg 2048, dims 512)
    is never read. ``rows``: each reader's [dims, out] rows for this block, concatenated
    along the outputs. Returns (mean [Hg], folded [Hg, sum of outs]).
    """
    c = np.asarray(comps, np.float64)[:dims]  # [dims, Hg]
    W = np.hstack([np.asarray(r, np.float64) for r in rows])
    return np.asarray(mean, _F32), np.ascontiguousarray((c.T @ W).astype(_F32))


def pack(w: dict[str, Any], H: int, E: int, int8: bool = True) -> tuple:
    """The layer's numpy weights (:func:`.llapor_weights.layer_weights`) as :func:`forward`'s weight arguments,
    absent parts as zero-size arrays. Matrices are int8 with per-column scales unless ``int8``
    is False; the gathered tables (a few rows read per token) and biases stay float32."""

    def f32(a: Any, shape: tuple) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=_F32) if a is not None else np.zeros(shape, _F32)

    def mat(a: Any, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
        return quantize(a if a is not None else np.zeros(shape, _F32), int8)

    hidden = w.get("hidden") or []
    res = w.get("res_gate")
    res2 = w.get("res2")
    skip = w.get("skip")
    return (
        f32(w["table"], ()),
        f32(w["bias"], ()),
        f32(w.get("deep_table"), (1, H)),
        f32(w.get("deep_w"), (0,)),
        np.ascontiguousarray(w["deep_off"], dtype=_I64) if "deep_off" in w else np.zeros(0, _I64),
        f32(w.get("tok"), (1, 1)),
        *mat(w.get("tok_proj"), (0, H)),
        *mat(w.get("dense_proj"), (0, H)),
        *mat(np.stack([W for W, _ in hidden]) if hidden else None, (0, H, H)),
        f32(np.stack([b for _, b in hidden]) if hidden else None, (0, H)),
        *mat(res[0] if res else None, (0, 2 * H)),
        f32(res[1] if res else None, (0,)),
        *mat(res2[0] if res2 else None, (0, H)),
        f32(res2[1] if res2 else None, (0,)),
        *mat(w["head"][0], ()),
        f32(w["head"][1], ()),
        *mat(skip[0] if skip else None, (0, E)),
        f32(skip[1] if skip else None, (0,)),
        # no folded gate-input blocks: LLaPor.score_at swaps in its own (fold_pca)
        np.zeros((0, 1), _F32),
        *mat(None, (0, 1, H)),
    )


@njit(cache=True, nogil=True)
def row_bags(topk, t, layer, prev_layers, history_tokens, history_layers, repeat_row, E, pad, out):
    """Token ``t``'s sparse feature ids at ``layer`` into ``out`` [nbag]: the runtime's one-row
    version of :func:`moecast.predictors.llapor_features.sparse_bags` (same blocks, same order; the tests
    compare them). ``topk`` [T, L, k] holds one request from position 0; ``repeat_row`` is the
    token's earlier occurrence (-1: none) or -2 without ``repeat_token``."""
    k = topk.shape[2]
    i = 0
    for d in range(1, prev_layers + 1):  # this token's ids at layers l-1 .. l-prev_layers
        for c in range(k):
            out[i] = topk[t, layer - d, c] + (d - 1) * E if layer >= d else pad
            i += 1
    base = prev_layers * E
    for j in range(1, history_tokens + 1):  # token t-j's ids at layers l, l-1, ..
        for dd in range(history_layers):
            for c in range(k):
                out[i] = topk[t - j, layer - dd, c] + base if (layer >= dd and t >= j) else pad
                i += 1
            base += E
    if repeat_row != -2:  # this token's latest earlier occurrence, layer l
        for c in range(k):
            out[i] = topk[repeat_row, layer, c] + base if repeat_row >= 0 else pad
            i += 1
    if i == 0:
        out[0] = pad


@njit(cache=True, nogil=True)
def _project(g, mean, comps, P, out):
    """out[:P] = (g - mean) @ comps[:, :P]: one gate input's PCA components."""
    for c in range(P):
        out[c] = 0.0
    for h in range(g.shape[0]):
        d = g[h] - mean[h]
        row = comps[h]
        for c in range(P):
            out[c] += d * row[c]


@njit(cache=True, nogil=True)
def feature_row(
    ids, tok_ids, gate, wrow, t, layer,  # request: [T, L, k], [T], [m, L, H] (row m-1 = token t), [k]
    prev_layers, history_tokens, history_layers, repeat_token, E, pad,
    token_buckets, context_tokens, gate_pca, means, comps, pca_dims, pca_max, weights, vote_dim, context_gate,
    bags, route, tokens, dense,  # out: [nbag], [L, k] or [0, k], [1 + context_tokens] or [0], [Dd]
):  # fmt: skip
    """Token ``t``'s inputs to layer ``layer``'s predictor, as :meth:`LLaPor.features` builds them
    for that row (same blocks, same order; the tests compare them), in one call: the runtime's
    per-layer path, where ~25 numpy calls of 1-10 us each cost more than the network itself.
    ``dense`` must be zero on entry; the ``vote_dim`` context-vote entries are left to the caller.
    Returns False when a gate input or router weight is NaN or inf."""
    repeat = -2
    if repeat_token:
        repeat = -1
        for s in range(t - 1, -1, -1):  # this token's latest earlier occurrence
            if tok_ids[s] == tok_ids[t]:
                repeat = s
                break
    row_bags(ids, t, layer, prev_layers, history_tokens, history_layers, repeat, E, pad, bags)
    for li in range(route.shape[0]):
        for c in range(route.shape[1]):
            route[li, c] = ids[t, li, c]
    for j in range(tokens.shape[0]):  # this token, then t-1 .., t-context_tokens (pad before the start)
        tokens[j] = tok_ids[t - j] % token_buckets if t >= j else token_buckets
    m = gate.shape[0]
    if gate_pca and layer > 0:
        _project(gate[m - 1, layer - 1], means[layer - 1], comps[layer - 1], pca_dims[layer - 1], dense)
    off = pca_max
    if weights:
        if layer > 0:
            for c in range(ids.shape[2]):
                dense[off + ids[t, layer - 1, c]] = wrow[c]
        off += E
    off += vote_dim
    for n in range(1, context_gate + 1):  # layer l's gate input of tokens t-1 .. t-context_gate
        if t >= n and gate_pca:
            _project(gate[m - 1 - n, layer], means[layer], comps[layer], pca_dims[layer], dense[off:])
        off += pca_max
    for i in range(dense.shape[0]):  # noqa: SIM110 (no generators in numba); NaN or inf survives the projection
        if not math.isfinite(dense[i]):
            return False
    return True


@njit(cache=True, nogil=True)
def score_row(
    ids, tok_ids, wrow, gate, t, layer,  # request: [T, L, k], [T], token t's layer-1 weights [k]; [m, L, Hg] (row m-1 = token t)
    blocks,  # [G, 2] the folded gate-input blocks: (tokens back, source layer)
    prev_layers, history_tokens, history_layers, repeat_token, E, pad, token_buckets,
    weights, context_gate, pca_max, nbag, ntok, dense_dim, deep,
    packed,  # :func:`forward`'s weight arguments, the folded blocks' (:func:`fold_pca`) last
    out,  # [1, E]
):  # fmt: skip
    """Token ``t``'s scores at ``layer``: :func:`feature_row` (the gate inputs' PCA blocks left
    zero) then :func:`forward` with the blocks' raw gate inputs, in one call. The runtime's
    per-layer path (:meth:`LLaPor.score_at`): the two calls from Python, with the arrays
    between them, cost ~20 us on top of the network at a real model's width.
    Returns 0, or 1 when a router weight and 2 when a gate input is NaN or inf."""
    k = ids.shape[2]
    bags = np.empty((1, nbag), np.int64)
    tokens = np.empty((1, ntok), np.int64)
    dense = np.zeros((1, dense_dim), np.float32)
    no_pca = np.zeros((0, 0), np.float32)
    ok = feature_row(
        ids, tok_ids, gate, wrow, t, layer, prev_layers, history_tokens, history_layers, repeat_token,
        E, pad, token_buckets, ntok, False, no_pca, np.zeros((0, 0, 0), np.float32), np.zeros(0, np.int64),
        pca_max, weights and dense_dim > 0, 0, context_gate, bags[0], np.empty((0, k), np.int64), tokens[0], dense[0],
    )  # fmt: skip
    if not ok:
        return 1
    route = np.empty((1, layer * k if deep else 0), np.int64)  # this token's ids at the earlier layers
    for i in range(route.shape[1]):
        route[0, i] = ids[t, i // k, i % k]
    G, m = blocks.shape[0], gate.shape[0]
    graw = np.empty((1, G, gate.shape[2]), np.float32)
    gok = np.zeros((1, G), np.bool_)
    for g in range(G):
        back = blocks[g, 0]
        if t >= back:
            graw[0, g] = gate[m - 1 - back, blocks[g, 1]]
            gok[0, g] = True
    if not forward(bags, route, tokens, dense, *packed, graw, gok, out):
        return 2
    return 0


@njit(cache=True, nogil=True)
def blend_rows(p, votes, k, weight, softmax, out):
    """out = each row's network scores ``p`` [N, E] (sigmoids) plus ``weight`` x the context
    memory's ``votes`` [N, E]; with ``softmax`` the sigmoids become the softmax times k first
    (odds p / (1 - p) normalised), so both terms sum to k per row. :meth:`LLaPor.with_memory`."""
    for i in range(p.shape[0]):
        if softmax:
            total = 0.0
            for e in range(p.shape[1]):
                q = min(max(p[i, e], 1e-7), 1.0 - 1e-7)
                out[i, e] = q / (1.0 - q)
                total += out[i, e]
            scale = k / total
            for e in range(p.shape[1]):
                out[i, e] = out[i, e] * scale + weight * votes[i, e]
        else:
            for e in range(p.shape[1]):
                out[i, e] = p[i, e] + weight * votes[i, e]
