"""LLaPor's compiled per-row kernels (predictors/llapor_kernel.py) against small cases worked by hand."""

from __future__ import annotations

import numpy as np
from moecast.predictors import llapor_kernel


def test_row_bags_read_earlier_layers_and_the_previous_token_from_its_first_position():
    """prev_layers 2, history_tokens 1, history_layers 2, E 4, pad 16, top-1: the blocks are this
    token's layer l-1 and l-2 ids (offsets 0, 4), then token t-1's layer l and l-1 ids (8, 12)."""
    E, pad = 4, 16
    topk = np.array(
        [
            [[0], [1], [2]],  # token 0's ids at layers 0, 1, 2
            [[3], [2], [1]],  # token 1's
        ],
        np.int64,
    )
    out = np.empty(4, np.int64)
    llapor_kernel.row_bags(topk, 1, 2, 2, 1, 2, -2, E, pad, out)
    # token 1, layer 2: layer 1's id 2, layer 0's id 3 + 4, token 0's layer 2 id 2 + 8, layer 1 id 1 + 12
    assert out.tolist() == [2, 3 + 4, 2 + 8, 1 + 12]
    llapor_kernel.row_bags(topk, 1, 1, 2, 1, 2, -2, E, pad, out)
    # layer 1: no layer l-2, token 0's layers 1 and 0
    assert out.tolist() == [3, pad, 1 + 8, 0 + 12]
    llapor_kernel.row_bags(topk, 0, 1, 2, 1, 2, -2, E, pad, out)
    # the first token has no previous token
    assert out.tolist() == [0, pad, pad, pad]


def test_repeat_token_block_finds_an_occurrence_at_the_first_position():
    """Tokens [7, 8, 7]: token 2's latest earlier occurrence is position 0, so its layer-1 bag holds
    token 0's layer-1 expert in the repeat block (offset prev_layers x E = 4) after its own layer-0
    expert; token 1 (id 8) has none: the pad id (the vocabulary size, 8)."""
    import torch
    from moecast.collect.traceset import RequestTrace
    from moecast.predictors.llapor import LLaPor
    from moecast.predictors.llapor_features import FeatureSpec
    from moecast.predictors.llapor_net import LLaPorNet, NetConfig

    torch.manual_seed(0)
    spec = FeatureSpec(num_layers=2, num_experts=4, top_k=1, prev_layers=1, repeat_token=True)
    assert spec.vocab == 8
    net = LLaPorNet(spec, {"input": [0], "output": [1]}, NetConfig(hidden=4, dropout=0.0))
    pred = LLaPor(net, [0, 1])
    ids = np.array([[[1], [3]], [[0], [2]], [[2], [1]]], np.int64)
    tok = np.array([7, 8, 7])
    trace = RequestTrace("r", "w", "c", "p", tok, ["x"] * 3, np.zeros(3, bool), ids, None, None, None)
    assert pred.features_at(trace, 1)["bags"][0, 1].tolist() == [2, 3 + 4]
    assert pred.features_at(trace.prefix(2), 1)["bags"][0, 1].tolist() == [0, 8]
