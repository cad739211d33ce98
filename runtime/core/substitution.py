"""SMoE Algorithm 1 (expert-cache router): substitute low-score experts by resident ones.

SMoE Sec. 5.1 / Sec. IV-B. Per token, with router scores S and beta = S_{k+1} (the best score among
the experts the router did not choose):

- top-score experts: active with S > (1 + alpha) * beta; always kept, and their union over the batch
  is the set C that counts as resident for every token of the batch (batch-aware);
- low-score experts E_l: active with beta < S <= (1 + alpha) * beta; kept when resident or in C;
- alternatives A: inactive experts with (1 - alpha) * beta < S <= beta that are resident or in C
  (the constraint of SMoE's Eq. 2 section);
- with m low-score experts neither resident nor in C: the m best alternatives replace them; when
  |A| < m, all of A replaces the |A| lowest-scored of them and the rest stay (to be loaded or run
  on the CPU).

With alpha = 0 both bands are empty and the routing is unchanged. Everything is vectorised over
rows (tokens); ``group`` says which rows share a batch (and so the set C).
"""

from __future__ import annotations

import numpy as np
from moecast.runtime.core import kernels


def substitute(
    scores: np.ndarray,
    topk: np.ndarray,
    resident: np.ndarray,
    alpha: float,
    group: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 for rows of tokens.

    scores [n, E] router probabilities; topk [n, k] the router's experts (rows of -1 are padding);
    resident [n, E] bool, the device cache of each row's layer; group [n] batch id per row (rows of
    one group share C). Returns (ids [n, k] after substitution, substituted count [n]).
    """
    n = scores.shape[0]
    if alpha <= 0 or n == 0:
        return topk, np.zeros(n, dtype=np.int64)
    if n == 1 and topk.shape[1] and topk[0].min() >= 0:  # one token: the compiled path (same ids)
        one = substitute_one(
            scores[0],
            topk[0],
            np.asarray(resident[0], dtype=bool),
            float(np.float32(1 + alpha)),
            float(np.float32(1 - alpha)),
        )
        if one is None:
            return topk.copy(), np.zeros(1, dtype=np.int64)
        return np.array([one[0]], dtype=topk.dtype), np.array([one[1]], dtype=np.int64)
    return _substitute_rows(scores, topk, resident, alpha, group)


def _substitute_rows(
    scores: np.ndarray,
    topk: np.ndarray,
    resident: np.ndarray,
    alpha: float,
    group: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`substitute` vectorised over rows (the reference the one-token path is tested against)."""
    n, E = scores.shape
    k = topk.shape[1]
    pad = topk[:, 0] < 0
    s = scores.astype(np.float32, copy=False)
    rows = np.arange(n)[:, None]
    active = np.zeros((n, E), dtype=bool)
    active[rows, np.where(topk >= 0, topk, 0)] = True
    active[pad] = False
    # beta = S_{k+1}: the best inactive score (robust to fp16 ties inside the top-k)
    beta = np.where(active, -np.inf, s).max(1)
    hi = (1 + alpha) * beta
    lo = (1 - alpha) * beta
    top = active & (s > hi[:, None])
    if group is None:
        cset = top
    else:
        g = np.unique(group, return_inverse=True)[1].reshape(-1)
        per_group = np.zeros((g.max() + 1, E), dtype=bool)
        np.logical_or.at(per_group, g, top)
        cset = per_group[g]
    avail = resident | cset
    low = active & ~top
    low_missing = low & ~avail
    m = low_missing.sum(1)
    alt = ~active & (s > lo[:, None]) & (s <= beta[:, None]) & avail
    alt[pad] = False
    n_alt = alt.sum(1)
    use = np.minimum(m, n_alt)
    # the best `use` alternatives join; the lowest-scored `use` missing low-score experts leave
    alt_rank = _rank_desc(np.where(alt, s, -np.inf))
    miss_rank_asc = _rank_desc(np.where(low_missing, -s, -np.inf))
    chosen = alt & (alt_rank < use[:, None])
    dropped = low_missing & (miss_rank_asc < use[:, None])
    selected = (active & ~dropped) | chosen
    order = np.argsort(np.where(selected, -s, np.inf), axis=1, kind="stable")[:, :k]
    out = order.astype(topk.dtype)
    out[pad] = topk[pad]
    # rows without any substitution keep the router's ids verbatim (same order)
    same = use == 0
    out[same] = topk[same]
    return out, use.astype(np.int64)


def _rank_desc(values: np.ndarray) -> np.ndarray:
    """Rank of each entry in its row by descending value (0 = largest), ties by lower index."""
    order = np.argsort(-values, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(values.shape[1])[None, :], axis=1)
    return rank


def substitute_one(
    p: np.ndarray, row: np.ndarray, resident: np.ndarray, hi_f: float, lo_f: float
) -> tuple[np.ndarray, int] | None:
    """Algorithm 1 for one token as one compiled kernel: exactly :func:`substitute`'s ids (order included).

    ``p`` [E] router probabilities, ``row`` [k] the router's experts (distinct, >= 0),
    ``resident`` [E] bool, ``hi_f`` / ``lo_f`` the float32 values of 1 + alpha and 1 - alpha.
    Returns None when nothing is substituted, else (ids [k] int64, substituted count). With one
    token the batch set C is the token's own top-score experts, so the low-score experts to replace
    are those not resident and the alternatives are resident inactive ones. Scores are compared in
    float32, as in the vectorised path.
    """
    if resident.shape[0] != p.shape[0]:
        raise ValueError(f"resident has {resident.shape[0]} experts, the router scores {p.shape[0]}")
    out = np.empty(len(row), dtype=np.int64)
    use = kernels.substitute(p[None], row[None], resident, hi_f, lo_f, out)
    if use < 0:
        raise ValueError("substitute_one needs the router's expert ids (no -1 padding)")
    return None if use == 0 else (out, use)
