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
    n, E = scores.shape
    k = topk.shape[1]
    if alpha <= 0 or n == 0:
        return topk, np.zeros(n, dtype=np.int64)
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


class SubstitutingRouter:
    """Online per-layer SMoE Algorithm 1: router probabilities of a batch + resident set -> experts."""

    def __init__(self, top_k: int, alpha: float) -> None:
        if alpha < 0 or not np.isfinite(alpha):
            raise ValueError(f"alpha must be >= 0 (SMoE's substitution threshold), got {alpha}")
        self.top_k = int(top_k)
        self.alpha = float(alpha)

    def route(self, probs: np.ndarray, resident: np.ndarray, topk: np.ndarray | None = None) -> np.ndarray:
        """probs [B, E], resident [E] bool (this layer's cache), optional router top-k [B, k] -> ids [B, k]."""
        probs = np.atleast_2d(probs)
        if topk is None:
            topk = np.argpartition(-probs, self.top_k - 1, axis=1)[:, : self.top_k]
        topk = np.atleast_2d(topk)
        if self.alpha == 0:
            return topk
        if len(probs) == 1 and topk[0, 0] >= 0:
            return self._route_one(probs[0], np.asarray(resident, dtype=bool), topk)
        res = np.broadcast_to(np.asarray(resident, dtype=bool), probs.shape)
        ids, _ = substitute(
            probs,
            np.atleast_2d(topk),
            res,
            self.alpha,
            group=None if len(probs) == 1 else np.zeros(len(probs), dtype=np.int64),
        )
        return ids

    def _route_one(self, p: np.ndarray, resident: np.ndarray, topk: np.ndarray) -> np.ndarray:
        """Algorithm 1 for one token with a handful of numpy calls (same result as :func:`substitute`).

        With one token the batch set C is the token's own top-score experts, so the low-score
        experts to replace are those not resident and the alternatives are resident inactive ones.
        """
        s = p.astype(np.float32, copy=False)
        t = topk[0]
        masked = s.copy()
        masked[t] = -np.inf
        beta = masked.max()
        st = s[t]
        low_missing = (st <= (1 + self.alpha) * beta) & ~resident[t]
        if not low_missing.any():
            return topk
        alt = np.flatnonzero((masked > (1 - self.alpha) * beta) & (masked <= beta) & resident)
        if len(alt) == 0:
            return topk
        alt_s = s[alt].tolist()
        miss_ids = t[low_missing].tolist()
        miss_s = st[low_missing].tolist()
        use = min(len(miss_ids), len(alt_s))
        # best alternatives join (score descending, lower id first); lowest-scored missing ones leave
        chosen = sorted(zip(alt.tolist(), alt_s), key=lambda x: (-x[1], x[0]))[:use]
        dropped = {e for e, _ in sorted(zip(miss_ids, miss_s), key=lambda x: (x[1], x[0]))[:use]}
        sel = [(e, v) for e, v in zip(t.tolist(), st.tolist()) if e not in dropped] + chosen
        sel.sort(key=lambda x: (-x[1], x[0]))
        return np.array([[e for e, _ in sel]], dtype=topk.dtype)
