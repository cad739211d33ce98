"""LLaPor's per-layer forward (PreScope §4.2.1) for the runtime, as one compiled numba loop.

The runtime asks LLaPor for one layer's scores of one token between two layers of the model
(PreScope §4.2: the prediction must finish within the layer gap). At batch 1 that is a
gather-sum over the layer's input table, the earlier layers' expert embeddings, a few
matrix-vector products and GELUs: numpy would spend most of it in per-call overhead (about 30
calls of 1-3 us), so the whole layer runs here as one loop. :meth:`LLaPor.score_layer` packs
the layer's weights once (:func:`pack`) and the tests compare the result with the torch network.
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


@njit(cache=True, nogil=True)
def _addmv(x, W, y):
    """y += x @ W (W [in, out] row-major: the inner loop runs along a row)."""
    for i in range(W.shape[0]):
        xi = x[i]
        if xi != 0.0:
            row = W[i]
            for j in range(y.shape[0]):
                y[j] += xi * row[j]


@njit(cache=True, nogil=True)
def _matvec(x, W, b, y):
    """y = x @ W + b."""
    for j in range(y.shape[0]):
        y[j] = b[j]
    _addmv(x, W, y)


@njit(cache=True, nogil=True)
def forward(
    bags, route, tokens, dense,  # features: [B, n], [B, r], [B, t], [B, Dd] (r, t, Dd may be 0)
    table, bias, deep_table, deep_w, deep_off, tok, tok_proj, dense_proj,
    hid_w, hid_b, res_w, res_b, res2_w, res2_b, head_w, head_b, skip_w, skip_b,
    out,
):  # fmt: skip
    """Scores [B, E] of one layer into ``out``; parts with zero-size weights are absent."""
    B = bags.shape[0]
    H = table.shape[1]
    E = head_w.shape[1]
    D = tok.shape[1]
    h = np.empty(H, np.float32)
    t = np.empty(H, np.float32)
    both = np.empty(res_w.shape[1], np.float32)
    r = np.empty(H, np.float32)
    logit = np.empty(E, np.float32)
    for b in range(B):
        for j in range(H):
            h[j] = bias[j]
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
            _addmv(tok[tokens[b, ti]], tok_proj[ti * D : (ti + 1) * D], h)
        _addmv(dense[b], dense_proj, h)
        for j in range(H):
            h[j] = _gelu(h[j])
        for layer in range(hid_w.shape[0]):
            _matvec(h, hid_w[layer], hid_b[layer], t)
            for j in range(H):
                h[j] = _gelu(t[j])
        if res_w.shape[0] > 0:  # middle group: gated residual block
            _matvec(h, res_w, res_b, both)
            for j in range(H):
                t[j] = _gelu(both[j])
            _matvec(t, res2_w, res2_b, r)
            for j in range(H):
                h[j] += _sigmoid(both[H + j]) * r[j]
        _matvec(h, head_w, head_b, logit)
        if skip_w.shape[0] > 0:
            _addmv(dense[b], skip_w, logit)
            for e in range(E):
                logit[e] += skip_b[e]
        for e in range(E):
            out[b, e] = _sigmoid(logit[e])


def pack(w: dict[str, Any], H: int, E: int) -> tuple:
    """The layer's numpy weights (LLaPor._layer_weights) as :func:`forward`'s weight arguments,
    absent parts as zero-size arrays."""

    def f32(a: Any, shape: tuple) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=_F32) if a is not None else np.zeros(shape, _F32)

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
        f32(w.get("tok_proj"), (0, H)),
        f32(w.get("dense_proj"), (0, H)),
        f32(np.stack([W for W, _ in hidden]) if hidden else None, (0, H, H)),
        f32(np.stack([b for _, b in hidden]) if hidden else None, (0, H)),
        f32(res[0] if res else None, (0, 2 * H)),
        f32(res[1] if res else None, (0,)),
        f32(res2[0] if res2 else None, (0, H)),
        f32(res2[1] if res2 else None, (0,)),
        f32(w["head"][0], ()),
        f32(w["head"][1], ()),
        f32(skip[0] if skip else None, (0, E)),
        f32(skip[1] if skip else None, (0,)),
    )
