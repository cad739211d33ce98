"""A layer's output assembled from several experts calls, bit for bit the one call's.

The live runtime computes a layer's experts in more than one call where they are not all in the slots
at once: a prefill's loads stream through the slots in waves, the disk tier computes each demand load
as its read lands, the CPU computes the balancer's set. Adding those calls' outputs rounds each
call's partial sum to the model's dtype before the sum of the parts, where the model's implementation
sums a token's top-k outputs once, in float32, and rounds once: in bf16 (or with float32 router
weights) the logits at alpha 0 then differ from the model's in their last bits.

transformers' ``grouped_mm`` and ``batched_mm`` implementations (the default of every family) end
alike: each (token, expert) pair's output times its weight, then ``view(tokens, top_k, hidden).sum(1)``
in the output's dtype (``transformers/integrations/moe.py``). So each call computes its pairs'
outputs unweighted (:func:`pair_inputs`: one row per pair, top-1, weight one, which every
implementation returns exactly, as a product by one and a sum of one term are exact), the calls'
pair outputs add exactly (each pair is computed by one call, zeros elsewhere), and
:func:`combine` weights and sums them as the implementation does. Where the model's implementation
is another (``eager``: each family's own loop), the calls' outputs add as before
(:func:`sums_over_top_k`).

A pair's output also depends on where its row falls in its expert's group: ``grouped_mm`` sorts the
pairs by expert with ``torch.sort``, which is not stable (the order of one expert's pairs depends on
the call's other keys), and a float32 matmul on the CPU's threads rounds a row by its place among
the group's rows (which thread, which block of rows computes it). A call on the slots (slot ids,
the other calls' pairs a sentinel) sorts other keys than the model's one call over the expert ids,
so it orders an expert's pairs otherwise and its outputs differ in their last bits. :func:`placing`
gives each row of such a call the pair that the model's call puts at the same place in the group.
"""

from __future__ import annotations

import numpy as np
import torch

#: transformers' experts implementations that end in one weighted sum over each token's top-k
SUMS_OVER_TOP_K = frozenset({"grouped_mm", "batched_mm"})


def sums_over_top_k(implementation: str | None) -> bool:
    """Whether the experts implementation named ``implementation`` combines as :func:`combine` does."""
    return implementation in SUMS_OVER_TOP_K


def pair_inputs(
    hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's arguments with one row per (token, top-k) pair: each token's hidden state repeated
    top-k times, its ids as a column, and unit weights of the weights' dtype."""
    k = index.shape[-1]
    pairs = index.reshape(-1, 1)
    return (
        hidden.repeat_interleave(k, dim=0),
        pairs,
        torch.ones(pairs.shape, dtype=weights.dtype, device=weights.device),
    )


def combine(pairs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tokens' outputs from their pairs' unweighted outputs ([tokens x top_k, hidden]), as
    ``grouped_mm_experts_forward`` makes them from its pairs."""
    tokens, k = weights.shape
    weighted = pairs * weights.reshape(-1, 1)
    return weighted.view(tokens, k, pairs.shape[-1]).sum(dim=1).to(dtype)


def reference_order(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' expert ids (``index``: [tokens, top_k]) sorted as the implementation's one call sorts
    them (the same call on the same ids: the same order), and the pairs in that order."""
    return torch.sort(index.reshape(-1))


def _ranks(keys: torch.Tensor) -> torch.Tensor:
    """Each row's place among the rows of its key, in the order ``torch.sort(keys)`` puts them."""
    values, perm = torch.sort(keys)
    first = torch.searchsorted(values, values)  # each sorted row's group starts there
    ranks = torch.empty_like(perm)
    ranks[perm] = torch.arange(perm.numel(), device=keys.device) - first
    return ranks


def placing(
    order: tuple[torch.Tensor, torch.Tensor],
    experts: torch.Tensor,
    keys: torch.Tensor,
    sentinel: int,
    rows: torch.Tensor,
) -> torch.Tensor:
    """The pair whose hidden state each row of a call takes, so that the call's sort puts every pair
    where the model's one call (``order``: :func:`reference_order`) puts it in its expert's group.

    The call's rows are the pairs ``rows`` (indices into the order's pairs), of expert ids ``experts``
    and the call's ids ``keys`` (one key an expert, ``sentinel`` for pairs other calls compute, which
    keep their row). Feed the call ``pair_hidden[placing]`` and write its output to ``out[placing]``.
    In torch's ops on the keys' device (an accelerator's: no host synchronisation)."""
    values, perm = order
    at = torch.searchsorted(values, experts) + _ranks(keys)
    mine = perm[at.clamp_(max=perm.numel() - 1)]  # a sentinel's place may fall past the end
    return torch.where(keys < sentinel, mine, rows)


def placing_host(
    order: tuple[torch.Tensor, torch.Tensor],
    experts: np.ndarray,
    keys: np.ndarray,
    sentinel: int,
    rows: np.ndarray,
) -> np.ndarray:
    """:func:`placing` where the model computes on the CPU, from the host's arrays: only the sorts are
    torch's (their order is what must match: ``order`` sorted CPU tensors); the rest is numpy, a few
    µs a call where torch's small ops cost tens (a batched decode step pays it in every layer)."""
    values, perm = (t.numpy() for t in order)
    got_values, got_perm = (t.numpy() for t in torch.sort(torch.from_numpy(keys)))
    ranks = np.empty_like(got_perm)
    ranks[got_perm] = np.arange(len(got_perm)) - np.searchsorted(got_values, got_values)
    at = np.searchsorted(values, experts) + ranks
    np.minimum(at, len(perm) - 1, out=at)  # a sentinel's place may fall past the end
    return np.where(keys < sentinel, perm[at], rows)


def unplace(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """A call's output fed ``hidden[src]`` (:func:`placing`), back in the pairs' order."""
    back = torch.empty_like(out)
    back[src] = out
    return back
