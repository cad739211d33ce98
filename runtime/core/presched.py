"""PreSched: PreScope's prefetch-aware cross-layer scheduler (PreScope Sec. 4.3, Algorithm 1).

Premises (Sec. 4.3.2): (1) the current layer's missing experts E_cur and the predicted next layer's
E_next are sorted by pending tokens, ascending, and merged into E_all; (2) on-demand monotonicity:
if E_cur[i] is loaded so are all larger ones; (3) a started prefetch is never interrupted; (4) the
link is one serial queue; (5) device time of a loaded expert is masked by transfers.

- Eq. 3: ``t_c(m) = beta * m + C`` (CPU time of an expert over m tokens).
- Eq. 4 (Q1): E_all[i..] join the GPU queue when
  ``alpha + (n + n' - i) t_io + t_g < t_c(E_all[0..i-1]) + t_attn``. When no predicted expert of
  the next layer is in the queue, Algorithm 1 would prefetch "with a larger window" (Q4); here it
  prefetches nothing. The larger window needs predictions for layer l+2 made when layer l ends,
  which no layer-ahead predictor gives. The case is rare at decode batch 1: over the 200 held-out
  DeepSeek Puffin requests at 10 % capacity, PreSched with the oracle met it in 389 of 484,406 layer
  steps on ``prescope-a100-pcie4``, 1,652 on ``gh200-nvlink-c2c`` and 15,878 (3.3 %) on
  ``prescope-v100-pcie3`` (rows reaching :func:`_prefetch_count` with predicted next-layer experts
  but none queued, during ``moecast replay --policy presched --predictor oracle --capacity 0.1
  --cold true --holdout test --hardware NAME`` on the imported traces).
- Eq. 5: the current layer loads E_cur[i'..] and runs E_cur[..i'-1] on the CPU, with
  ``T_G(i') = alpha + (n - i') t_io + t_g`` and ``T_C(i') = t_c(E_cur[0..i'-1])`` (n counts the
  missing experts; the paper's ``n - i' + 1`` counts E_cur[0..n], inclusive). :func:`eq5_split`.
  **Deviation from the paper.** Sec. 4.3.3 (under Eq. 5) and Sec. 4.3.4 take "the smallest index
  i' satisfying T_G < T_C". Here i' minimises ``max(T_G(i'), T_C(i'))`` over i' = 0..n, the
  layer's own objective, Eq. 2 (``argmin max(T_C, T_G)``), that the recheck is meant to balance;
  ties go to the smaller i' (fewer CPU experts: the loaded ones stay resident). T_G falls and T_C
  grows with i' (non-negative times), so the literal i' is the first one past the balance point:
  it is the min-max i' only when ``T_G(i' - 1) > T_C(i')``, and it never picks i' = 0
  (T_C(0) = 0 < T_G), so it runs at least one expert on the CPU however slow the CPU is. With a
  CPU expert of 1.35 ms against loads of 0.4 ms, three misses of 1, 1 and 2 tokens: the literal
  rule runs one on the CPU (the layer takes 1.35 ms), the min-max loads all three (1.25 ms).
  Two smaller departures: every i' is a candidate, not only current-layer experts that Eq. 4 put
  in the GPU queue, and when no i' passes, the paper's Algorithm 1 keeps its initial ``i = n``
  (loads E_cur[n]) where the min-max may run everything on the CPU.
- Eq. 6 (Q2): the CPU leaves a gap ``T_gap = T_C - alpha - (n - i') t_io`` on the link;
  ``f = (T_gap + t_attn) / t_io`` prefetches fit, rounded to |f|. T_gap is clamped at 0 when any
  expert loads: the literal i' had ``T_C > T_G`` (so T_gap > t_g), but the min-max i' may be
  GPU-bound, where the layer waits for its own loads and the link is free at least through the
  next attention; a negative T_gap would eat into that t_attn. With nothing loaded it is kept: an
  earlier prefetch (alpha) can hold the link past the CPU's end, into the attention.
- Eq. 7 (Q3): the critical prefetch is kept when
  ``xi = R_hit (f - |f| + 1) - R_miss (|f| - f) > 0``, else |f| - 1 are issued; R_hit / R_miss are
  the prefetch hit and miss rates measured online.

Here ``alpha`` is the link delay left by an earlier prefetch (not SMoE's substitution alpha).
Vectorised over rows (layers or lanes) so one call schedules a whole replay step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from moecast.runtime.core import jitcache, kernels
from moecast.runtime.core.cost_model import CostModel
from moecast.runtime.core.prefetch import gap_prefetch_count
from numba import njit, types


@dataclass
class PreSchedDecision:
    n_load: np.ndarray  # [rows] experts of the current layer loaded (the largest ones)
    n_cpu: np.ndarray  # [rows] experts computed on the CPU (the smallest ones)
    t_cpu: np.ndarray  # [rows] CPU time of those (Eq. 3)
    n_prefetch: np.ndarray  # [rows] prefetches to issue for the next layer (Eqs. 6-7)


def _tc_prefix(sizes: np.ndarray, valid: np.ndarray, cost: CostModel) -> np.ndarray:
    """[rows, M+1] t_c of the first i experts (Eq. 3 summed), i = 0..M."""
    per = np.where(valid, cost.beta * sizes + cost.c, 0.0)
    return np.concatenate([np.zeros((len(sizes), 1)), np.cumsum(per, axis=1)], axis=1)


def schedule(
    cur_sizes: np.ndarray,
    n_cur: np.ndarray,
    next_sizes: np.ndarray,
    n_next: np.ndarray,
    delay: np.ndarray,
    r_hit: np.ndarray,
    cost: CostModel,
) -> PreSchedDecision:
    """PreSched Algorithm 1 for many rows at once.

    cur_sizes [rows, M] pending tokens of the current layer's missing experts, ascending, the first
    ``n_cur`` valid; next_sizes [rows, M'] the same for the predicted next layer's non-resident
    experts; delay [rows] link delay alpha; r_hit [rows] measured prefetch hit rate.
    """
    rows, M = cur_sizes.shape
    if rows == 1:  # one layer (the live runtime's): one compiled call, the same decision
        out = np.zeros(4)
        _schedule_entry()(
            np.asarray(cur_sizes[0], np.float64), int(n_cur[0]), np.asarray(next_sizes[0], np.float64),
            int(n_next[0]), float(delay[0]), float(np.ravel(r_hit)[0]), cost.t_io, cost.t_g,
            cost.t_attn, cost.beta, cost.c, out,
        )  # fmt: skip
        n_load, first, t_cpu, n_pf = out.tolist()
        return PreSchedDecision(
            np.array([int(n_load)]), np.array([int(first)]), np.array([t_cpu]), np.array([int(n_pf)])
        )
    n_cur = np.asarray(n_cur, dtype=np.int64)
    delay = np.asarray(delay, dtype=np.float64)
    valid = np.arange(M)[None, :] < n_cur[:, None]
    tc = _tc_prefix(cur_sizes, valid, cost)
    t_io = cost.t_io if np.isfinite(cost.t_io) else 1e30
    first, gap = _split_rows(tc, n_cur, delay, t_io, cost.t_g)  # Eq. 5, min-max (module docstring)
    n_load = n_cur - first
    t_cpu = tc[np.arange(rows), first]
    # Eq. 4 / Q4: does the cross-layer GPU queue reach into the next layer at all?
    Mn = next_sizes.shape[1]
    n_next = np.asarray(n_next, dtype=np.int64)
    if Mn == 0:
        return PreSchedDecision(n_load, first, t_cpu, np.zeros(rows, dtype=np.int64))
    allsz = np.concatenate(
        [
            np.where(valid, cur_sizes, np.inf),
            np.where(np.arange(Mn)[None, :] < n_next[:, None], next_sizes, np.inf),
        ],
        axis=1,
    )
    is_next = np.concatenate([np.zeros((rows, M), bool), np.ones((rows, Mn), bool)], axis=1)
    order = np.argsort(allsz, axis=1, kind="stable")
    allsz = np.take_along_axis(allsz, order, 1)
    is_next = np.take_along_axis(is_next, order, 1)
    n_all = n_cur + n_next
    v_all = np.isfinite(allsz)
    tca = _tc_prefix(np.where(v_all, allsz, 0.0), v_all, cost)[:, :-1] + cost.t_attn  # [rows, M+Mn]
    ia = np.arange(M + Mn)[None, :]
    tga = delay[:, None] + (n_all[:, None] - ia) * t_io + cost.t_g
    in_queue_from = np.where(((tga < tca) & v_all).any(1), ((tga < tca) & v_all).argmax(1), M + Mn)
    next_in_queue = (is_next & v_all & (ia >= in_queue_from[:, None])).any(1)
    n_pf = _prefetch_count(gap, n_next, next_in_queue, r_hit, cost, t_io)
    return PreSchedDecision(n_load, first, t_cpu, n_pf)


@njit(cache=True, nogil=True)
def _prefix(sizes, valid, beta, c, out):
    """_tc_prefix of one row: ``out[i]`` = t_c of the first i experts (a running sum, as np.cumsum)."""
    out[0] = 0.0
    acc = 0.0
    for i in range(sizes.shape[0]):
        per = beta * sizes[i] + c if valid[i] else 0.0
        acc = per if i == 0 else acc + per
        out[i + 1] = acc


@njit(cache=True, nogil=True)
def eq5_split(tc, n, delay, t_io, t_g):
    """Eq. 5 on one row, the one definition of the split: (i', Eq. 6's T_gap).

    ``tc[i]`` is T_C(i) = t_c of the i smallest missing experts (i = 0..n); i' minimises
    ``max(T_G(i'), T_C(i'))``, the strict ``<`` keeping the smaller i' on a tie (see the module
    docstring for why not the paper's literal "smallest i' with T_G < T_C").
    """
    best, best_span = 0, np.inf
    for i in range(n + 1):
        tg = delay + np.float64(n - i) * t_io + t_g
        span = tg if tg > tc[i] else tc[i]
        if span < best_span:
            best, best_span = i, span
    gap = tc[best] - delay - np.float64(n - best) * t_io
    if best < n and gap < 0.0:  # GPU-bound: the layer waits for its loads, the link idles after them
        gap = 0.0
    return best, gap


@njit(cache=True, nogil=True)
def _split_rows_into(tc, n_cur, delay, t_io, t_g, first, gap):
    for r in range(tc.shape[0]):
        first[r], gap[r] = eq5_split(tc[r], n_cur[r], delay[r], t_io, t_g)


def _split_rows(
    tc: np.ndarray, n_cur: np.ndarray, delay: np.ndarray, t_io: float, t_g: float
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`eq5_split` on each row of ``tc`` [rows, >= n + 1]: (i' [rows], T_gap [rows])."""
    first, gap = np.empty(len(tc), np.int64), np.empty(len(tc))
    _split_rows_into(tc, n_cur, delay, float(t_io), float(t_g), first, gap)
    return first, gap


@njit(cache=True, nogil=True)
def schedule_one(cur, n_cur, nxt, n_next, delay, r_hit, t_io, t_g, t_attn, beta, c, out):
    """:func:`schedule` for one row, with its floating-point operations in its order; ``out`` gets
    (n_load, n_cpu, t_cpu, n_prefetch)."""
    M = cur.shape[0]
    Mn = nxt.shape[0]
    t = t_io if np.isfinite(t_io) else 1e30
    valid = np.arange(M) < n_cur
    tc = np.empty(M + 1)
    _prefix(cur, valid, beta, c, tc)
    first, gap = eq5_split(tc, n_cur, delay, t, t_g)
    n_load = n_cur - first
    t_cpu = tc[first]
    out[0], out[1], out[2], out[3] = n_load, first, t_cpu, 0
    if Mn == 0:
        return
    allsz = np.empty(M + Mn)  # E_all: both layers' pending experts, ascending (ties: current first)
    for i in range(M):
        allsz[i] = cur[i] if i < n_cur else np.inf
    for j in range(Mn):
        allsz[M + j] = nxt[j] if j < n_next else np.inf
    order = np.argsort(allsz, kind="mergesort")
    srt = allsz[order]
    v_all = np.isfinite(srt)
    tca = np.empty(M + Mn + 1)
    _prefix(np.where(v_all, srt, 0.0), v_all, beta, c, tca)
    n_all = n_cur + n_next
    start = M + Mn  # Eq. 4: the first expert of E_all in the link queue
    for i in range(M + Mn):
        if v_all[i] and delay + np.float64(n_all - i) * t + t_g < tca[i] + t_attn:
            start = i
            break
    queued = False
    for i in range(start, M + Mn):
        queued |= order[i] >= M and v_all[i]
    if not queued:
        return
    # Eqs. 6-7 on the gap the CPU leaves on the link (prefetch.gap_prefetch_count), at most n_next
    if not np.isfinite(t):
        n_pf = 0
    elif t <= 0:
        n_pf = np.iinfo(np.int32).max
    else:
        f = (gap + t_attn) / t
        fr = np.floor(f + 0.5)
        xi = r_hit * (f - fr + 1) - (1 - r_hit) * (fr - f)
        n_pf = np.int64(max(fr if xi > 0 else fr - 1, 0.0))
    out[3] = min(n_pf, n_next)


@functools.cache
def _schedule_entry():
    f1, i, f = types.Array(types.float64, 1, "A"), types.int64, types.float64
    return kernels.entry_point(
        schedule_one, f1, i, f1, i, f, f, f, f, f, f, f, types.Array(types.float64, 1, "C")
    )


class PreSched:
    """Online per-layer PreSched (the live runtime's ``balance="presched"``): the layer's missing
    experts' token counts and the predicted next layer's non-resident ones -> (load, CPU, prefetch
    count), :func:`schedule` on one row. R_hit comes from the caller's prefetch record."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def decide(
        self, cur_tokens: np.ndarray, next_tokens: np.ndarray, delay: float = 0.0, r_hit: float = 0.5
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """-> (indices of cur to load, indices of cur for the CPU, prefetch count for the next layer)."""
        cur = np.asarray(cur_tokens, dtype=np.float64)
        nxt = np.asarray(next_tokens, dtype=np.float64)
        order = np.argsort(cur, kind="stable")
        d = schedule(
            cur[order][None, :],
            np.array([len(cur)]),
            np.sort(nxt)[None, :],
            np.array([len(nxt)]),
            np.array([delay]),
            np.array([r_hit]),
            self.cost,
        )
        split = int(d.n_cpu[0])
        return order[split:], order[:split], int(d.n_prefetch[0])


def schedule_unit(
    n_cur: np.ndarray,
    M: int,
    n_next: np.ndarray,
    Mn: int,
    delay: np.ndarray,
    r_hit: np.ndarray,
    cost: CostModel,
) -> PreSchedDecision:
    """:func:`schedule` when every pending expert has one token (decode batch 1), without the sorts.

    Same floating-point operations as :func:`schedule` on rows of ones (``n_cur`` of ``M`` current,
    ``n_next`` of ``Mn`` next), so the decisions are identical: the merged order of E_all is the
    current experts then the next ones, and t_c of the first i experts is the same running sum.
    """
    n_cur = np.asarray(n_cur, dtype=np.int64)
    delay = np.asarray(delay, dtype=np.float64)
    per = cost.beta * 1.0 + cost.c
    run = np.concatenate([[0.0], np.cumsum(np.full(M + Mn, per))])  # t_c of the first i experts
    t_io = cost.t_io if np.isfinite(cost.t_io) else 1e30
    first, gap = _split_rows(np.broadcast_to(run[: M + 1], (len(n_cur), M + 1)), n_cur, delay, t_io, cost.t_g)
    n_load = n_cur - first
    t_cpu = run[first]
    if Mn == 0:
        return PreSchedDecision(n_load, first, t_cpu, np.zeros(len(n_cur), dtype=np.int64))
    n_next = np.asarray(n_next, dtype=np.int64)
    next_in_queue = _unit_next_in_queue(n_cur, n_next, M + Mn, delay, run, t_io, per, cost)
    return PreSchedDecision(
        n_load, first, t_cpu, _prefetch_count(gap, n_next, next_in_queue, r_hit, cost, t_io)
    )


def _unit_next_in_queue(
    n_cur: np.ndarray,
    n_next: np.ndarray,
    width: int,
    delay: np.ndarray,
    run: np.ndarray,
    t_io: float,
    per: float,
    cost: CostModel,
) -> np.ndarray:
    """Eq. 4 / Q4 on one-token rows: does the GPU queue reach a next-layer expert (the last ones of E_all)?

    With a non-negative link time and CPU time per expert the condition is monotone in the position
    (T_G falls and T_C grows, also after rounding), so it reaches the next layer iff it holds at the
    last expert of E_all (position n + n' - 1: T_G = delay + 1 * t_io + t_g); otherwise any position.
    """
    if t_io >= 0 and per >= 0:
        last = np.maximum(n_cur + n_next - 1, 0)
        return (n_next > 0) & (delay + 1 * t_io + cost.t_g < run[last] + cost.t_attn)
    n_all = n_cur + n_next
    ia = np.arange(width)[None, :]
    tga = delay[:, None] + (n_all[:, None] - ia) * t_io + cost.t_g
    cond = (tga < run[:width][None, :] + cost.t_attn) & (ia < n_all[:, None])
    return cond.any(1) & (n_next > 0)


def _prefetch_count(
    gap: np.ndarray,
    n_next: np.ndarray,
    next_in_queue: np.ndarray,
    r_hit: np.ndarray,
    cost: CostModel,
    t_io: float,
) -> np.ndarray:
    """Eqs. 6-7 on Eq. 5's gap on the link, at most the predicted experts, none if not queued."""
    r_hit = np.asarray(r_hit, dtype=np.float64)
    n_pf = np.minimum(gap_prefetch_count(gap, cost.t_attn, t_io, r_hit), n_next).astype(np.int64)
    n_pf[~next_in_queue] = 0
    return n_pf


# an edit of a file these kernels compile in empties their cache (jitcache: numba sees only this file)
jitcache.keyed(globals())
