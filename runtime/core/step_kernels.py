"""Compiled one-token path of the per-layer step (numba): one lane, one token, one call.

:class:`moecast.runtime.core.step.LayerStep` applies its rules (the docstring of
:mod:`moecast.runtime.core.step`) vectorised over lanes. The live runtime calls it with one lane and one
token per layer, where each of its few dozen numpy calls costs 1-3 us on six-odd experts: the
decision cost hundreds of microseconds per layer. These kernels take that case whole:

- :func:`step_one`: steps 3-7 (:func:`layer_one`: the access and the balancer's split;
  :func:`finish_one`: the inserts and recency, SMoE Eq. 3's score window, the layer time and the
  next layer's window, the statistics). Under PreSched it stops after the access with PreSched's
  inputs (the layer's misses and the next layer's pending predicted experts): the caller runs
  :func:`moecast.runtime.core.presched.schedule` on them and :func:`finish_one` the rest;
- :func:`prefetch_one`: step 1 (the landing rule and the prefetch inserts; under the prefetch gate
  its refusal of the late one);
- two expert copies (:mod:`moecast.runtime.core.mixed`): :func:`plan_one` (rules 2-3, the copy each
  prefetch moves), :func:`upgrade_one` (rule 4, high copies over resident low ones in idle link
  time; :func:`quiet_one` for a lane no prefetch reached), the low copy of each demand load and the
  high hits' compute time in :func:`layer_one` / :func:`finish_one`;
- :func:`rank_one`: the replay's ranking of a predictor's scores for one token
  (:func:`moecast.runtime.core.step.ranked_predictions`).

The vectorised path is their reference and the tests compare the two step by step: the
floating-point operations are the same (numpy's pairwise summation and NaN-propagating maximum
included), so are the decisions and times. The cache's inserts and recency are the compiled kernels
of :mod:`moecast.runtime.core.kernels`.
"""

from __future__ import annotations

import functools

import numpy as np
from moecast.runtime.core import jitcache, kernels
from numba import njit, types

#: the step's statistics, one row each of LayerStep's [len(STATS), slots] array
STATS = (
    "uses",  # routed (token, layer, expert) uses after substitution
    "hits",  # of those, expert resident when the layer ran
    "loads",  # demand loads
    "cpu",  # experts computed on the CPU
    "subs",  # substituted uses
    "pf_issued",  # prefetches asked for
    "pf_landed",  # prefetches that landed in the window
    "pf_started",  # prefetches that moved bytes (landed, plus one PreSched started late)
    "pf_used",  # prefetched experts used while resident
    "pf_inserted",  # experts a prefetch (or a plan preload) put in the cache
    "plan_loads",  # experts a plan preload moved before its request (CasMoE)
    "time",  # modeled layer time (ms)
    # two expert copies and the prefetch gate (runtime/core/mixed.py, gate.py)
    "pf_low",  # prefetches started at the low copy
    "pf_used_low",  # of the prefetched experts used, those at the low copy
    "pf_refused",  # late prefetches the gate did not start (one copy: the kernels too)
    "upgrades",  # high copies read over resident low ones in idle link time
    "low_uses",  # routed uses computed at the low copy
    # over the steps a TPOT covers (decode steps; every row where none is marked prefill)
    "dec_uses",  # uses in decode steps
    "dec_hits",  # of those, hits
)
USES, HITS, LOADS, CPU, SUBS, PF_ISSUED, PF_LANDED, PF_STARTED, PF_USED, PF_INSERTED, _, TIME = range(12)
PF_LOW, PF_USED_LOW, PF_REFUSED, UPGRADES, LOW_USES, DEC_USES, DEC_HITS = range(12, 19)
assert STATS[PF_LOW] == "pf_low" and STATS[DEC_HITS] == "dec_hits" and len(STATS) == DEC_HITS + 1
#: balancer codes of the kernels (Policy.balancer -> code)
BALANCER_CODE = {"none": 0, "smoe": 1, "presched": 2, "cpu": 3}
STATIC, SCORE = kernels.STATIC, kernels.SCORE
# fcost: the cost model's constants, in this order (fcost_of); with two copies T_IO .. T_RC are the
# low copy's (a demand read's) and T_IO_HI .. T_RC_HI the high copy's (one copy: the same values)
T_IO, T_G, T_ATTN, BETA, C, T_PRED, FIRST_WINDOW, SHARED, CPU_READS, LATE_PF, T_RC = range(11)
T_IO_HI, T_G_HI, T_RC_HI, COPIES, UPGRADING = range(11, 16)
#: the prefetch landing rules (step.landing): in the window only, PreSched's one late and not
#: resident, late_prefetch's one late and resident
IN_WINDOW, PRESCHED_ONE, LATE = range(3)
# fout: one call's times (ms): the last two are what a prefetch left (its delay, its reads' compute)
LAYER_T, LINK, T_CPU, DELAY, RC = range(5)
# counters: what the call adds to the cache's CacheStats and its insert clock
EVICTED, WASTED, USED, INSERTED, NEW = range(5)
_DMAX = np.finfo(np.float64).max
#: the most experts per token the kernels take (numpy sums longer rows in another order)
MAX_K = 128
#: the late prefetch's copy (mixed.PrefetchPlan.late)
NONE, HIGH, LOW = 0, 1, 2
_NO_IDS = np.zeros(0, np.int64)


def fcost_of(
    cost, t_pred: float = 0.0, first_window: float = 0.0, late: bool = False, high=None
) -> np.ndarray:
    """The kernels' ``fcost`` array of a :class:`~moecast.runtime.core.cost_model.CostModel`:
    ``cost`` a demand read's, ``high`` (two copies) the high copy's (a prefetch's, an upgrade's)."""
    hi = cost if high is None else high
    return np.array(
        [
            cost.t_io, cost.t_g, cost.t_attn, cost.beta, cost.c, t_pred, first_window,
            float(cost.shared_compute), float(cost.cpu_reads_link), float(late), cost.t_rc,
            hi.t_io, hi.t_g, hi.t_rc, float(high is not None), float(cost.expert_bytes < hi.expert_bytes),
        ],
        np.float64,
    )  # fmt: skip


@njit(cache=True, nogil=True)
def _max(a, b):
    """np.maximum: NaN when either is."""
    if a != a or b != b:
        return np.nan
    return a if a >= b else b


@njit(cache=True, nogil=True)
def _nan_to_num(x):
    """np.nan_to_num(x, nan=0.0)."""
    if x != x:
        return 0.0
    if x == np.inf:
        return _DMAX
    if x == -np.inf:
        return -_DMAX
    return x


@njit(cache=True, nogil=True)
def _sum(a, n):
    """numpy's pairwise sum of ``a[:n]``, n <= MAX_K (float64; ``.sum()`` of a row adds in this order)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[i]
        return res
    r = a[:8].copy()
    i = 8
    while i < n - (n % 8):
        for j in range(8):
            r[j] += a[i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += a[i]
        i += 1
    return res


@njit(cache=True, nogil=True)
def _smoe_loads(n_miss, t_io, t_cpu):
    """SMoE Algorithm 2 (balancer.two_pointer) on ``n_miss`` misses of one token each: how many load."""
    c_load = 0.0
    c_cpu = 0.0
    left = 0
    right = n_miss - 1
    while left <= right:
        if c_load <= c_cpu:
            c_load += t_io
            left += 1
        else:
            c_cpu += 1.0 * t_cpu
            right -= 1
    return left


@njit(cache=True, nogil=True)
def _next_pending(res, next_lane, has_next, predicted, sizes):
    """PreSched's E_next (LayerStep._next_pending): the predicted experts not resident in the next
    lane, token counts ascending into ``sizes`` (0 after the last); returns how many."""
    P = predicted.shape[0]
    ids = np.sort(predicted)
    counts = np.zeros(P, np.int64)
    m = 0
    for i in range(P):
        if ids[i] < 0:
            continue
        if m > 0 and ids[i] == ids[m - 1]:
            counts[m - 1] += 1
            continue
        ids[m] = ids[i]
        counts[m] = 1
        m += 1
    n = 0
    for i in range(m):
        if has_next and not res[next_lane, ids[i]]:
            sizes[n] = counts[i]
            n += 1
    sizes[:n] = np.sort(sizes[:n])
    sizes[n:] = 0.0
    return n


#: layer_one's return values besides a count of loads
IN_PLACE, PRESCHED, BAD_IDS = -1, -2, -3


@njit(cache=True, nogil=True)
def layer_one(
    res, last, pf, lane, slot, ids, decode, prefetching, bal, policy, fcost, delay, rc, free, r_used, stats,
    next_lane, has_next, predicted, out, hit, cur, nxt, fout, info, low, windowed,
):  # fmt: skip
    """Steps 3-4 of LayerStep.layer for one token on ``lane``: the access and the balancer's split.

    Two copies (``fcost[COPIES]``; ``low`` [lanes, N + 1] each resident expert's copy, ``windowed``
    [lanes] a prefetch used the lane's window): first the upgrades of a lane no prefetch reached
    (LayerStep.upgrade_quiet), then the access counts the hits on low copies.

    ``ids`` [k] the token's experts after substitution (< 0: none). ``out`` [6, k] receives the
    access (rows: experts, token counts, demand loads, CPU experts, the misses in queue order, their
    token counts), ``hit`` [k] which were resident, ``info`` (misses, PreSched's pending next-layer
    experts), ``fout[DELAY]`` the link delay a late prefetch left (the lane's is reset). Returns the
    number of misses to load, IN_PLACE when every miss is loaded (the load row is written), PRESCHED
    when :func:`moecast.runtime.core.presched.schedule` decides (``cur`` then holds the misses' token
    counts ascending, ``nxt`` the pending ones'), BAD_IDS for an id >= E (nothing changed).
    """
    k = ids.shape[0]
    N = res.shape[1] - 1
    for i in range(k):
        if ids[i] >= N:
            return BAD_IDS
    copies = fcost[COPIES] != 0.0
    if copies:
        if not windowed[lane]:
            upgrade_one(res, last, pf, low, lane, slot, free[lane], fcost, _NO_IDS, rc, stats)
        windowed[lane] = False
    d = delay[lane]
    delay[lane] = 0.0
    fout[DELAY] = d
    fout[RC] = rc[lane]
    rc[lane] = 0.0
    uses = 0
    hits = 0
    used = 0
    used_low = 0
    low_uses = 0
    n_miss = 0
    for i in range(k):
        e = ids[i]
        out[0, i] = e
        c = 1 if e >= 0 else 0
        out[1, i] = c
        h = e >= 0 and res[lane, e]
        hit[i] = h
        lo = copies and h and low[lane, e]
        uses += c
        hits += c if h else 0
        if h and pf[lane, e]:
            used += 1
            used_low += 1 if lo else 0
        if e >= 0 and (lo or not h):  # a miss computes from the low copy too (mixed.py, rule 1)
            low_uses += c
        if e >= 0 and not h:  # the misses in routed order (one token each: the stable sort keeps it)
            out[4, n_miss] = e
            out[5, n_miss] = 1
            n_miss += 1
    for i in range(n_miss, k):
        out[4, i] = -1
        out[5, i] = 0
    info[0] = n_miss
    info[1] = 0
    if prefetching:
        r_used[lane] += used
        stats[PF_USED, slot] += used
        if copies:
            stats[PF_USED_LOW, slot] += used_low
    if copies:
        stats[LOW_USES, slot] += low_uses
    stats[USES, slot] += uses
    stats[HITS, slot] += hits
    if decode:
        stats[DEC_USES, slot] += uses
        stats[DEC_HITS, slot] += hits
    if not decode and policy != STATIC:
        bal = 0  # prefill loads what it needs (static keeps its slots: its misses stay on the CPU)
    if bal == 0:  # every miss loaded, in place (the vectorised path's one-token shortcut)
        for i in range(k):
            out[2, i] = ids[i] if ids[i] >= 0 and not hit[i] else -1
            out[3, i] = -1
        return IN_PLACE
    if bal == 2:
        for i in range(k):
            cur[i] = out[5, n_miss - 1 - i] if i < n_miss else 0.0
        info[1] = _next_pending(res, next_lane, has_next, predicted, nxt)
        return PRESCHED
    n_load = 0
    if bal == 1:
        t_io = fcost[T_IO]
        n_load = _smoe_loads(n_miss, t_io if np.isfinite(t_io) else np.inf, fcost[BETA] + fcost[C])
    return n_load if decode or policy == STATIC else n_miss


@njit(cache=True, nogil=True)
def finish_one(
    res, last, freq, pf, nu, score, count, ring, ring_pos, lane, slot, cap, t, n_load, probs, policy,
    shift, fcost, free, pf_n, stats, next_lane, has_next, restart, out, hit, fout, counters, split, low,
):  # fmt: skip
    """Steps 4-7 of LayerStep.layer after :func:`layer_one`, ``n_load`` of the misses loaded
    (IN_PLACE: layer_one wrote the load row): the load and CPU rows, the inserts (the token's
    experts shielded) and recency at ``t``, SMoE Eq. 3's window from ``probs`` [E], the layer time
    and link into ``fout``, the next layer's window, the statistics; the cache's counters into
    ``counters``. ``split`` [k]: scratch for the CPU times. Two copies: the loads are resident at
    the low copy (``low``), and the hits on a high copy compute at its time."""
    k = out.shape[1]
    N = res.shape[1] - 1
    copies = fcost[COPIES] != 0.0
    n_miss = 0
    n_hit = 0
    n_high = 0
    for i in range(k):
        n_miss += 1 if out[4, i] >= 0 else 0
        h = hit[i] and out[0, i] >= 0
        n_hit += 1 if h else 0
        n_high += 1 if h and copies and not low[lane, out[0, i]] else 0
    t_cpu = 0.0
    if n_load == IN_PLACE:
        n_load = n_miss
    else:
        for i in range(k):
            e = out[4, i]
            on_cpu = i >= n_load and e >= 0
            out[2, i] = e if i < n_load else -1
            out[3, i] = e if on_cpu else -1
            split[i] = fcost[BETA] * np.float64(out[5, i]) + fcost[C] if on_cpu else 0.0
        t_cpu = _sum(split, k)
    if policy != STATIC:  # static never inserts
        new = np.empty(k, np.bool_)
        ev, wasted, _put, n_new = kernels.insert(
            res, last, freq, pf, nu, score, count, lane, N, cap, out[2], out[0], False, -1, policy, shift, new
        )
        if copies:  # a demand load reads the low copy (mixed.py, rule 1)
            for i in range(k):
                if new[i]:
                    low[lane, out[2, i]] = True
        counters[EVICTED] += ev
        counters[WASTED] += wasted
        counters[NEW] += n_new > 0
    counters[USED] += kernels.touch(res, last, freq, pf, lane, out[0], t)
    if policy == SCORE:
        valid = False
        for i in range(k):
            valid |= out[0, i] >= 0
        pos = ring_pos[lane]
        for e in range(N):
            sc = np.float64(probs[e]) if valid else 0.0
            score[lane, e] += sc - np.float64(ring[lane, pos, e])
            ring[lane, pos, e] = np.float32(sc)
        ring_pos[lane] = (pos + 1) % ring.shape[1]
    stall = fout[DELAY] if fcost[LATE_PF] != 0.0 else 0.0
    layer_t, link = layer_time(
        fcost, n_hit + n_load, n_load, fout[DELAY], t_cpu, n_miss - n_load, stall, n_high if copies else -1
    )
    layer_t = layer_t + fout[RC]
    fout[LAYER_T] = layer_t
    fout[LINK] = link
    fout[T_CPU] = t_cpu
    if has_next:
        busy = _max(link, fcost[T_PRED]) if fcost[T_PRED] else link
        free[next_lane] = _nan_to_num(layer_t - busy)
    if restart:
        free[lane] = fcost[FIRST_WINDOW]
        pf_n[lane] = -1
    stats[LOADS, slot] += n_load
    stats[CPU, slot] += n_miss - n_load
    stats[TIME, slot] += layer_t
    return n_load


@njit(cache=True, nogil=True)
def step_one(
    res, last, freq, pf, nu, score, count, ring, ring_pos, lane, slot, cap, t, ids, decode, prefetching,
    bal, policy, shift, fcost, delay, rc, free, pf_n, r_used, stats, probs, next_lane, has_next, restart,
    predicted, out, hit, scratch, fout, info, counters, low, windowed,
):  # fmt: skip
    """:func:`layer_one` then, unless it returns PRESCHED or BAD_IDS, :func:`finish_one`: the layer
    in one call. ``scratch`` [>= 2k + P]: PreSched's inputs (``cur`` [k], ``nxt`` [P], after the CPU
    times [k]), P the predicted experts. Returns the number loaded, or layer_one's code."""
    k = ids.shape[0]
    P = predicted.shape[0]
    n_load = layer_one(
        res, last, pf, lane, slot, ids, decode, prefetching, bal, policy, fcost, delay, rc, free, r_used, stats,
        next_lane, has_next, predicted, out, hit, scratch[:k], scratch[2 * k : 2 * k + P], fout, info, low,
        windowed,
    )  # fmt: skip
    if n_load <= PRESCHED:  # PRESCHED or BAD_IDS
        return n_load
    return finish_one(
        res, last, freq, pf, nu, score, count, ring, ring_pos, lane, slot, cap, t, n_load, probs, policy,
        shift, fcost, free, pf_n, stats, next_lane, has_next, restart, out, hit, fout, counters,
        scratch[k : 2 * k], low,
    )  # fmt: skip


@njit(cache=True, nogil=True)
def layer_time(fcost, n_dev, n_load, delay, t_cpu, n_cpu, stall, n_high=-1):
    """step.layer_time for one row: (layer_t, link). ``n_high`` >= 0 (two copies): the device
    experts computing at the high copy's time ``fcost[T_G_HI]``."""
    t_io = fcost[T_IO]
    t_g = fcost[T_G]
    finite = np.isfinite(t_io)
    io = t_io if finite else 0.0
    link = delay + np.float64(n_load) * io
    if not finite and n_load > 0:
        link = np.inf
    compute = np.float64(n_dev) * t_g
    if n_high >= 0:
        compute = compute + np.float64(n_high) * (fcost[T_G_HI] - t_g)
    dev = _max(compute, link + (t_g if n_load > 0 else 0.0))
    if stall > 0:
        dev = _max(dev, stall + t_g)
    cpu_end = t_cpu
    if fcost[CPU_READS] != 0.0:
        first = link + io
        link = link + np.float64(n_cpu) * io
        if not finite and n_cpu > 0:
            link = np.inf
        if n_cpu > 0:
            cpu_end = _max(first + t_cpu, link + t_cpu / np.float64(n_cpu))
    if fcost[SHARED] != 0.0:
        busy = _max(dev + (t_cpu if n_cpu > 0 else 0.0), cpu_end)
        if fcost[T_RC] != 0.0:
            work = compute + (t_cpu if n_cpu > 0 else 0.0)
            busy = _max(busy, work + np.float64(n_load + n_cpu) * fcost[T_RC])
    else:
        busy = _max(dev, cpu_end) + np.float64(n_load) * fcost[T_RC]
    return fcost[T_ATTN] + busy, link


@njit(cache=True, nogil=True)
def prefetch_one(
    res, last, freq, pf, nu, score, count, lane, slot, cap, t, ranked, policy, shift, rule,
    fcost, free, delay, rc, pf_n, r_landed, stats, out, counters, gate, prob, low, windowed,
):  # fmt: skip
    """LayerStep.prefetch for one lane: ``ranked`` [M] the predicted experts best first (-1
    padded); the inserted ones into ``out`` [M] (-1 elsewhere). Returns -1 for an id out of range
    (nothing changed), else 0. ``gate``: the late prefetch starts only where its calibrated
    probability of use (``prob`` [M], ``ranked``'s) times the demand read it spares exceeds the time
    it is late (gate.pays). One copy: :func:`landing`, then the gate's refusal of the late one
    (mixed.plan_prefetch's rule for one copy); two copies (``fcost[COPIES]``): :func:`plan_one`,
    the copies landed into ``low``, then the upgrades in the idle link time (:func:`upgrade_one`)."""
    M = ranked.shape[0]
    N = res.shape[1] - 1
    for i in range(M):
        if ranked[i] >= N:
            return -1
    cand = np.full(M, -1, np.int64)
    p_cand = np.zeros(M if gate else 0, np.float64)
    n_cand = 0
    for i in range(M):
        e = ranked[i]
        if e >= 0 and not res[lane, e]:
            cand[n_cand] = e
            if gate:
                p_cand[n_cand] = prob[i]
            n_cand += 1
    copies = fcost[COPIES] != 0.0
    n_high = n_low = n_lo = refused = late = 0
    idle = 0.0
    if copies:
        want, n_high, n_low, late, lands, refused, d, idle = plan_one(
            n_cand, pf_n[lane], free[lane], fcost[T_IO_HI], fcost[T_IO], rule, gate, p_cand
        )
        landed = n_high + n_low + (1 if late != NONE and lands else 0)
        started = n_high + n_low + (1 if late != NONE else 0)
        n_lo = n_low + (1 if late == LOW else 0)
        rc[lane] = np.float64(started - n_lo) * fcost[T_RC_HI] + np.float64(n_lo) * fcost[T_RC]
    else:
        want, landed, started, d, fit = landing(n_cand, pf_n[lane], free[lane], fcost[T_IO], rule)
        # a late one (LATE: it lands past the window) that does not pay
        if gate and rule == LATE and landed > fit and not p_cand[landed - 1] * fcost[T_IO] - d > 0.0:
            landed -= 1
            started -= 1
            d = 0.0
            refused = 1
        rc[lane] = np.float64(started) * fcost[T_RC]
    delay[lane] = d
    row = np.full(M, -1, np.int64)
    row[:landed] = cand[:landed]
    new = np.zeros(M, np.bool_)
    if policy != STATIC:  # static never inserts
        ev, wasted, put, n_new = kernels.insert(
            res, last, freq, pf, nu, score, count, lane, N, cap, row, ranked, True, t, policy, shift, new
        )
        counters[EVICTED] += ev
        counters[WASTED] += wasted
        counters[INSERTED] += put
        counters[NEW] += n_new > 0
    r_landed[lane] += landed
    n_ins = 0
    for i in range(M):
        out[i] = cand[i] if new[i] else -1
        n_ins += 1 if new[i] else 0
        # two copies: the first n_high land high, the window's others and a late one low
        if copies and new[i]:
            low[lane, cand[i]] = i >= n_high and (i < n_high + n_low or late == LOW)
    if copies:
        upgrade_one(res, last, pf, low, lane, slot, idle, fcost, ranked, rc, stats)
        windowed[lane] = True
        stats[PF_LOW, slot] += n_lo
    stats[PF_INSERTED, slot] += n_ins
    stats[PF_ISSUED, slot] += want
    stats[PF_LANDED, slot] += landed
    stats[PF_STARTED, slot] += started
    if gate:
        stats[PF_REFUSED, slot] += refused
    return 0


@njit(cache=True, nogil=True)
def _fit(free, t, ask):
    """mixed._fit for one row: transfers of ``t`` each that finish within ``free``."""
    if np.isinf(t):
        return 0
    if t <= 0:
        return ask
    f = np.floor(free / t + 1e-9)
    return np.int64(f) if f > 0 else 0


@njit(cache=True, nogil=True)
def plan_one(n_cand, pf_n, free, t_hi, t_lo, rule, gate, p):
    """mixed.plan_prefetch for one row (``rule`` as :func:`landing`'s; ``p`` [M] the non-resident
    candidates' P(used), compacted, 0 after them): (issued, n_high, n_low, late, late lands,
    refused, delay, idle)."""
    ask = min(pf_n, n_cand) if pf_n >= 0 else n_cand
    finite = np.isfinite(t_hi)
    mixed = t_lo != t_hi
    if mixed and finite:  # rule 2: as many as fit land low, the time left turns the first high
        land = min(ask, _fit(free, t_lo, ask))
        if gate:
            lead = 0
            while lead < p.shape[0] and p[lead] > 0:
                lead += 1
            land = min(land, lead)
        n_high = min(land, _fit(free - np.float64(land) * t_lo, t_hi - t_lo, land))
        n_low = land - n_high
    else:
        n_high = min(ask, _fit(free, t_hi, ask))
        n_low = 0
    in_window = n_high + n_low
    late_ok = rule == LATE and finite and t_hi > 0
    presched_one = pf_n >= 0 and rule == PRESCHED_ONE
    issued = min(ask, in_window + 1) if late_ok else (ask if presched_one else in_window)
    has_late = ask > in_window and finite and t_hi > 0 and (late_ok or presched_one)
    late = (LOW if mixed else HIGH) if has_late else NONE
    lo_part = np.float64(n_low) * t_lo if mixed else 0.0
    d_hi = _max(np.float64(n_high + 1) * t_hi + lo_part - free, 0.0)
    d_lo = _max(np.float64(n_high) * t_hi + np.float64(n_low + 1) * t_lo - free, 0.0) if mixed else d_hi
    refused = 0
    if gate and has_late:  # rule 3 under the gate: the copy that pays most, if either pays
        pj = p[min(in_window, p.shape[0] - 1)] if p.shape[0] else 0.0
        save = t_lo if late_ok else 0.0
        best_low = mixed and pj * save - d_lo > pj * save - d_hi
        take = pj * save - (d_lo if best_low else d_hi) > 0
        refused = 0 if take else 1
        late = (LOW if best_low else HIGH) if take else NONE
    d = d_hi if late == HIGH else (d_lo if late == LOW else 0.0)
    idle = 0.0
    if finite and late == NONE:
        idle = _max(free - (np.float64(n_high) * t_hi + lo_part), 0.0)
    return issued, n_high, n_low, late, late_ok, refused, d, idle


@njit(cache=True, nogil=True)
def upgrade_one(res, last, pf, low, lane, slot, idle, fcost, ranked, rc, stats):
    """LayerStep._upgrade for one lane (mixed.py, rule 4): high copies over resident low ones in
    ``idle`` ms of link time, ``ranked`` (the predicted, best first) first, then the most recently
    used (ties to the lower id), never a prefetched expert not used yet. Returns how many."""
    if fcost[UPGRADING] == 0.0:
        return 0
    N = res.shape[1] - 1
    n_up = _fit(idle, fcost[T_IO_HI], N)  # what the link time holds, before scanning the experts
    if n_up <= 0:
        return 0
    n_low = 0
    for e in range(N):
        n_low += 1 if _upgradable(res, pf, low, lane, e) else 0
    n_up = min(n_up, n_low)
    done = 0
    for j in range(ranked.shape[0]):
        e = ranked[j]
        if done < n_up and e >= 0 and _upgradable(res, pf, low, lane, e):
            low[lane, e] = False
            done += 1
    while done < n_up:
        best = -1
        for e in range(N):
            if _upgradable(res, pf, low, lane, e) and (best < 0 or last[lane, e] > last[lane, best]):
                best = e
        low[lane, best] = False
        done += 1
    rc[lane] += np.float64(n_up) * fcost[T_RC_HI]
    stats[UPGRADES, slot] += n_up
    return n_up


@njit(cache=True, nogil=True)
def _upgradable(res, pf, low, lane, e):
    """A resident low copy that is not a prefetch still to be used (rule 4's candidates)."""
    return low[lane, e] and res[lane, e] and not pf[lane, e]


@njit(cache=True, nogil=True)
def quiet_one(res, last, pf, low, windowed, lane, slot, free, fcost, rc, stats):
    """LayerStep.upgrade_quiet for one lane: a lane no prefetch reached upgrades in its whole window."""
    if not windowed[lane]:
        upgrade_one(res, last, pf, low, lane, slot, free[lane], fcost, _NO_IDS, rc, stats)
        windowed[lane] = True


@njit(cache=True, nogil=True)
def landing(n_cand, pf_n, free, t_io, rule):
    """step.landing for one row (``rule``: IN_WINDOW, PRESCHED_ONE or LATE): (asked, landed, started,
    delay, the transfers the window fits)."""
    want = min(pf_n, n_cand) if pf_n >= 0 else n_cand
    if np.isinf(t_io):
        fit = 0
    elif t_io <= 0:
        fit = want
    else:
        fit = np.int64(max(np.floor(free / t_io + 1e-9), 0.0))
    finite = np.isfinite(t_io)
    if rule == LATE and finite and t_io > 0:
        landed = min(want, fit + 1)
        d = _max(np.float64(landed) * t_io - free if landed > fit else 0.0, 0.0)
        return landed, landed, landed, d, fit
    if not (pf_n >= 0 and rule == PRESCHED_ONE):
        want = min(want, fit)
    landed = min(want, fit)
    started = min(want, landed + 1) if finite else 0
    late = want > landed and finite and t_io > 0
    d = _max(np.float64(landed + 1) * t_io - free if late else 0.0, 0.0)
    return want, landed, started, d, fit


@njit(cache=True, nogil=True)
def rank_one(s, k, ids, ranked):
    """step.ranked_predictions for one token's scores ``s`` [E] (float32): its top-k ids into
    ``ids`` (best first, ties to the lower id) and the prefetch candidates into ``ranked``, both
    ``min(k, E)`` long. Returns False, writing nothing, where the vectorised path's choice depends
    on numpy's partition (a tie across the k-th score, a NaN): the caller takes that path then."""
    E = s.shape[0]
    kp = min(k, E)
    m = np.float32(0.0)
    for e in range(E):
        a = abs(s[e])
        if a != a:
            return False
        m = max(m, a)
    m = max(m, np.float32(1e-12))
    v = np.empty(kp + 1, np.float32)
    top = np.empty(kp + 1, np.int64)
    n = 0
    for e in range(E):  # the kp + 1 best, (score descending, id ascending)
        n = kernels._push(v, top, n, kp + 1, np.float32(s[e] / m), e)
    if n > kp and v[kp] == v[kp - 1]:
        return False
    ids[:kp] = top[:kp]
    # rank_candidates: summed score per distinct id (each id once here), ranked descending; its
    # sums come from a cumulative sum in id order, so they are recomputed the same way
    order = np.argsort(top[:kp])
    sid = top[:kp][order]
    ssc = v[:kp][order].astype(np.float64)
    csum = np.cumsum(ssc)
    total = csum - (csum - ssc)
    rank = np.argsort(-total, kind="mergesort")
    ranked[:kp] = sid[rank]
    return True


def _a(dtype, ndim: int, layout: str = "C") -> types.Array:
    return types.Array(dtype, ndim, layout)


_b1, _i1, _f1, _f1a = _a(types.bool_, 1), _a(types.int64, 1), _a(types.float64, 1), _a(types.float32, 1, "A")
_b2, _i2, _f2 = _a(types.bool_, 2), _a(types.int64, 2), _a(types.float64, 2)
_int, _flt, _bool = types.int64, types.float64, types.bool_
# resident, last, freq, prefetched, next use, score window sums, count (ExpertCache's arrays)
_CACHE = (_b2, _i2, _i2, _b2, _i2, _f2, _i1)


@functools.cache
def entry_points() -> tuple:
    """(step_one, finish_one, prefetch_one, rank_one, quiet_one) called without numba's dispatcher
    (see kernels.entry_point): the caller passes exactly these types."""
    ep = kernels.entry_point
    ids_a = _a(types.int64, 1, "A")
    ring = (_a(types.float32, 3), _i1)
    return (
        ep(step_one, *_CACHE, *ring, _int, _int, _int, _int, ids_a, _bool, _bool, _int, _int, _int, _f1,
           _f1, _f1, _f1, _i1, _f1, _f2, _f1a, _int, _bool, _bool, ids_a, _i2, _b1, _f1, _f1, _i1, _i1, _b2, _b1),
        ep(finish_one, *_CACHE, *ring, _int, _int, _int, _int, _int, _f1a, _int, _int, _f1, _f1, _i1, _f2,
           _int, _bool, _bool, _i2, _b1, _f1, _i1, _a(types.float64, 1, "A"), _b2),
        ep(prefetch_one, *_CACHE, _int, _int, _int, _int, ids_a, _int, _int, _int, _f1, _f1, _f1, _f1, _i1,
           _f1, _f2, _i1, _i1, _bool, _f1, _b2, _b1),
        ep(rank_one, _f1a, _int, _i1, _i1),
        ep(quiet_one, _b2, _i2, _b2, _b2, _b1, _int, _int, _f1, _f1, _f1, _f2),
    )  # fmt: skip


# an edit of a file these kernels compile in empties their cache (jitcache: numba sees only this file)
jitcache.keyed(globals())
