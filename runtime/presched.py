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
- Eq. 5: the current layer loads E_cur[i'..] for the smallest i' with
  ``T_G = alpha + (n - i') t_io + t_g < T_C = t_c(E_cur[0..i'-1])``, the rest run on the CPU
  (with no such i' everything runs on the CPU).
- Eq. 6 (Q2): the CPU leaves a gap ``T_gap = T_C - alpha - (n - i') t_io`` on the link;
  ``f = (T_gap + t_attn) / t_io`` prefetches fit, rounded to |f|.
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
from moecast.runtime import kernels
from moecast.runtime.cost_model import CostModel
from moecast.runtime.prefetch import gap_prefetch_count
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
    idx = np.arange(M + 1)[None, :]
    valid = np.arange(M)[None, :] < n_cur[:, None]
    tc = _tc_prefix(cur_sizes, valid, cost)
    t_io = cost.t_io if np.isfinite(cost.t_io) else 1e30
    # Eq. 5: smallest i' with T_G < T_C (loads E_cur[i'..n]); none -> all on the CPU
    tg = delay[:, None] + (n_cur[:, None] - idx) * t_io + cost.t_g
    ok = (tg < tc) & (idx <= n_cur[:, None])
    first = np.where(ok.any(1), ok.argmax(1), n_cur)
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
    n_pf = _prefetch_count(t_cpu, delay, n_load, n_next, next_in_queue, r_hit, cost, t_io)
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
def schedule_one(cur, n_cur, nxt, n_next, delay, r_hit, t_io, t_g, t_attn, beta, c, out):
    """:func:`schedule` for one row, with its floating-point operations in its order; ``out`` gets
    (n_load, n_cpu, t_cpu, n_prefetch)."""
    M = cur.shape[0]
    Mn = nxt.shape[0]
    t = t_io if np.isfinite(t_io) else 1e30
    valid = np.arange(M) < n_cur
    tc = np.empty(M + 1)
    _prefix(cur, valid, beta, c, tc)
    first = n_cur  # Eq. 5: the smallest i' with T_G < T_C
    for i in range(M + 1):
        if i <= n_cur and delay + np.float64(n_cur - i) * t + t_g < tc[i]:
            first = i
            break
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
        gap = t_cpu - delay - np.float64(n_load) * t
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

    With a non-negative link time and CPU time per expert both conditions are monotone in the
    position (T_G falls and T_C grows as i grows, also after rounding), so Eq. 5's i' is
    ``n + 1 -`` the number of positions that pass, and Eq. 4 reaches the next layer iff it holds at
    the last queued expert: one [rows, M + 1] comparison and one [rows] comparison.
    """
    n_cur = np.asarray(n_cur, dtype=np.int64)
    delay = np.asarray(delay, dtype=np.float64)
    per = cost.beta * 1.0 + cost.c
    run = np.concatenate([[0.0], np.cumsum(np.full(M + Mn, per))])  # t_c of the first i experts
    t_io = cost.t_io if np.isfinite(cost.t_io) else 1e30
    if not (t_io >= 0 and per >= 0):
        return _schedule_unit_rows(n_cur, M, n_next, Mn, delay, r_hit, cost, run, t_io)
    # T_G - delay - t_g for n pending and position i: (n - i) t_io, and +inf past n (never passes)
    n_i = np.arange(M + 1)[:, None] - np.arange(M + 1)[None, :]
    jt = np.where(n_i >= 0, n_i * t_io, np.inf)
    ok = delay[:, None] + jt[n_cur] + cost.t_g < run[: M + 1][None, :]
    n_load = np.maximum(ok.sum(1) - 1, 0)
    first = n_cur - n_load
    t_cpu = run[first]
    if Mn == 0:
        return PreSchedDecision(n_load, first, t_cpu, np.zeros(len(n_cur), dtype=np.int64))
    n_next = np.asarray(n_next, dtype=np.int64)
    # Eq. 4 at the last expert of E_all (position n + n' - 1: T_G = delay + 1 * t_io + t_g)
    last = np.maximum(n_cur + n_next - 1, 0)
    next_in_queue = (n_next > 0) & (delay + 1 * t_io + cost.t_g < run[last] + cost.t_attn)
    return PreSchedDecision(
        n_load, first, t_cpu, _prefetch_count(t_cpu, delay, n_load, n_next, next_in_queue, r_hit, cost, t_io)
    )


def _prefetch_count(
    t_cpu: np.ndarray,
    delay: np.ndarray,
    n_load: np.ndarray,
    n_next: np.ndarray,
    next_in_queue: np.ndarray,
    r_hit: np.ndarray,
    cost: CostModel,
    t_io: float,
) -> np.ndarray:
    """Eqs. 6-7 on the gap the CPU leaves on the link, at most the predicted experts, none if not queued."""
    gap = t_cpu - delay - n_load * t_io if t_io > 0 else np.zeros(np.shape(n_next))
    r_hit = np.asarray(r_hit, dtype=np.float64)
    n_pf = np.minimum(gap_prefetch_count(gap, cost.t_attn, t_io, r_hit), n_next).astype(np.int64)
    n_pf[~next_in_queue] = 0
    return n_pf


def _schedule_unit_rows(
    n_cur: np.ndarray,
    M: int,
    n_next: np.ndarray,
    Mn: int,
    delay: np.ndarray,
    r_hit: np.ndarray,
    cost: CostModel,
    run: np.ndarray,
    t_io: float,
) -> PreSchedDecision:
    """:func:`schedule_unit` position by position (any sign of the times)."""
    rows = len(n_cur)
    idx = np.arange(M + 1)[None, :]
    tc = np.where(idx <= n_cur[:, None], run[: M + 1][None, :], run[n_cur][:, None])
    tg = delay[:, None] + (n_cur[:, None] - idx) * t_io + cost.t_g
    ok = (tg < tc) & (idx <= n_cur[:, None])
    first = np.where(ok.any(1), ok.argmax(1), n_cur)
    n_load = n_cur - first
    t_cpu = tc[np.arange(rows), first]
    if Mn == 0:
        return PreSchedDecision(n_load, first, t_cpu, np.zeros(rows, dtype=np.int64))
    n_next = np.asarray(n_next, dtype=np.int64)
    n_all = n_cur + n_next
    ia = np.arange(M + Mn)[None, :]
    tca = run[: M + Mn][None, :] + cost.t_attn
    tga = delay[:, None] + (n_all[:, None] - ia) * t_io + cost.t_g
    cond = (tga < tca) & (ia < n_all[:, None])
    next_in_queue = cond.any(1) & (n_next > 0)
    return PreSchedDecision(
        n_load, first, t_cpu, _prefetch_count(t_cpu, delay, n_load, n_next, next_in_queue, r_hit, cost, t_io)
    )
