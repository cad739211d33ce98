"""LLaPor's per-layer network (PreScope §4.2.1) as numpy weights for the compiled runtime path.

The runtime scores one layer of one token at a time (:meth:`LLaPor.score_layer`,
:meth:`LLaPor.score_at`): :func:`layer_weights` copies that layer's slice of
:class:`~moecast.predictors.llapor_net.LLaPorNet` out of torch once and packs it for
:mod:`.llapor_kernel`; :func:`fold` folds the gate inputs' PCA into the first matrices, so
a raw gate input meets one matrix instead of a projection and then a matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from moecast.predictors import llapor_kernel
from moecast.predictors.llapor_features import FeatureSpec
from moecast.predictors.llapor_net import LLaPorNet, StackedLinear


def layer_weights(net: LLaPorNet, layer: int, int8: bool, cache: dict[Any, Any]) -> dict[str, Any]:
    """Layer ``layer``'s weights as numpy arrays, packed for :func:`.llapor_kernel.forward`
    (int8 matrices with ``int8``); kept in ``cache`` (one per precision) after the first call."""
    if layer in cache:
        return cache[layer]
    spec = net.spec

    def np_(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().numpy().copy()

    V, E, H = spec.vocab, spec.num_experts, net.net.hidden
    # input table: the layer's sparse-feature rows, one zero row for the pad id (V)
    w: dict[str, Any] = {
        "table": np.ascontiguousarray(
            np.vstack([np_(net.w_in.weight[layer])[:V], np.zeros((1, H), np.float32)])
        )
    }
    bias = np_(net.w_in.bias[layer])
    if spec.deep_history and layer > 0:
        # earlier layers' expert embeddings: one table for all layers, each layer's mix apart
        if "deep" not in cache:
            cache["deep"] = np.ascontiguousarray(np_(net.deep_emb).reshape(-1, H))
        mix = np_((net.deep_mix * net.deep_mask)[layer, :layer])  # [layer]
        w["deep_table"] = cache["deep"]
        w["deep_w"] = np.repeat(mix, spec.top_k).astype(np.float32)
        w["deep_off"] = np.repeat(np.arange(layer) * E, spec.top_k)
    if spec.token_buckets:
        w["tok"] = np_(net.tok.weight)
        w["tok_proj"] = np_(net.tok_proj.weight[layer])
        bias = bias + np_(net.tok_proj.bias[layer])
    if spec.dense_dim:
        w["dense_proj"] = np_(net.dense_proj.weight[layer])
        bias = bias + np_(net.dense_proj.bias[layer])
        if spec.dense_skip:
            w["skip"] = (np_(net.dense_skip.weight[layer]), np_(net.dense_skip.bias[layer]))
    w["bias"] = bias
    w["fold_blocks"] = fold_blocks(spec, layer)
    group = next(g for g, ls in net.groups.items() if layer in ls)
    j = net.groups[group].index(layer)
    body = net.bodies[group]

    def pick(lin: StackedLinear) -> tuple[np.ndarray, np.ndarray]:
        return np_(lin.weight[j]), np_(lin.bias[j])

    w["hidden"] = [pick(lin) for lin in body.hidden]
    if body.residual:
        (r1, b1), (g, bg) = pick(body.res1), pick(body.gate)
        w["res_gate"] = (np.ascontiguousarray(np.hstack([r1, g])), np.concatenate([b1, bg]))
        w["res2"] = pick(body.res2)
    w["head"] = pick(body.head)
    w["packed"] = llapor_kernel.pack(w, H, E, int8=int8)
    cache[layer] = w
    return w


def fold_blocks(spec: FeatureSpec, layer: int) -> list[tuple[int, int]]:
    """The gate inputs layer ``layer``'s dense features project, as (tokens back, source
    layer), in their order in ``dense``: layer-1's of this token, then layer's of the
    ``context_gate`` previous tokens."""
    if not spec.gate_pca:
        return []
    first = [(0, layer - 1)] if layer > 0 else []
    return first + [(n, layer) for n in range(1, spec.context_gate + 1)]


def fold(net: LLaPorNet, w: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(means [G, Hg], folded matrices [G, Hg, hidden (+ E)]) of the layer's ``fold_blocks``:
    the gate inputs' PCA folded into the matrices that read it (:func:`.llapor_kernel.fold_pca`)."""
    spec, pca = net.spec, net.pca
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
