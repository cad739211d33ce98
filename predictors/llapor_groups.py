"""LLaPor's layer groups (PreScope §3.1): input, middle and output layers, detected from traces.

PreScope observes that adjacent MoE layers' gate inputs are most alike, and routing most
predictable from the layer before, in the middle of the model; LLaPor builds the middle
group's predictors deeper (:mod:`.llapor_net`). :func:`detect_groups` splits the layers
from those two signals, measured on a training split.
"""

from __future__ import annotations

import numpy as np

GROUPS = ("input", "middle", "output")


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
