"""Compiled one-token kernels of the runtime's per-layer decision (numba).

At decode batch 1 a layer's decision (SMoE Algorithm 1 substitution, the expert cache's access and
eviction) works on one token's 64-odd scores; a numpy call costs 1-3 us there, so even a handful of
them per part would miss the runtime's microsecond budget. These kernels do each part as one
compiled loop over the lane's arrays. They are the single-lane paths of
:class:`~moecast.runtime.core.cache.ExpertCache` and :func:`~moecast.runtime.core.substitution.substitute_one`;
the vectorised numpy paths (many tokens, many lanes) are their reference, and the tests compare the
two step by step.

Compiled on first use and cached on disk (numba ``cache=True``), so only the first process pays
the compilation (about a second per kernel). The wrappers call the compiled entry points of
:func:`entry_point` with arguments whose types they have checked, since the dispatcher's own type
resolution (about 0.1 us per argument) would otherwise cost more than the kernels' work.
"""

from __future__ import annotations

import functools

import numpy as np
from moecast.runtime.core import eviction, jitcache
from moecast.runtime.core.eviction import NU_CAP as _NU_CAP
from numba import njit, types

# the eviction policies' codes (runtime/core/eviction.py), compile-time constants of the kernels
LRU, LFU, BELADY, STATIC, SCORE = (
    eviction.TABLE[n].code for n in ("lru", "lfu", "belady", "static", "score")
)
_BIG = np.iinfo(np.int64).max


@njit(cache=True, nogil=True)
def _shielded(e, a, b):
    found = False  # plain loops: numba compiles no generator expressions
    for x in a:
        found |= x == e
    for x in b:
        found |= x == e
    return found


@njit(cache=True, nogil=True)
def _score_first(a, b):
    """Whether score ``a`` sorts before ``b`` in numpy's ascending order (NaN last)."""
    return a < b or (b != b and a == a)


@njit(cache=True, nogil=True)
def _victim(res, last, freq, nu, score, lane, n, policy, shift, shield_a, shield_b):
    """The resident item of ``lane`` outside both shields with the lowest eviction key (-1: none).

    Integer keys as runtime/core/eviction.py's: unique per item (the id in the low bits), so a strict
    minimum finds the vectorised argmin / argpartition's victim. Score keys (SMoE Eq. 3's window
    sums) are floats: the first in a stable ascending sort, i.e. ties to the lower id. A code
    without a key here evicts nothing (the callers refuse such a policy: eviction.kernel_code).
    """
    bi = -1
    if policy == SCORE:
        best_s = 0.0
        for e in range(n):
            if not res[lane, e] or _shielded(e, shield_a, shield_b):
                continue
            v = score[lane, e]
            if bi < 0 or _score_first(v, best_s):
                best_s = v
                bi = e
        return bi
    best = _BIG
    for e in range(n):
        if not res[lane, e] or _shielded(e, shield_a, shield_b):
            continue
        if policy == LRU:
            key = ((last[lane, e] + 1) << shift) | e
        elif policy == LFU:
            key = (freq[lane, e] << (shift + 24)) | ((last[lane, e] + 1) << shift) | e
        elif policy == BELADY:
            key = ((_NU_CAP - min(nu[lane, e], _NU_CAP)) << shift) | e
        else:
            continue
        if key < best:
            best = key
            bi = e
    return bi


@njit(cache=True, nogil=True)
def _evict(res, last, freq, nu, score, pf, lane, n, policy, shift, shield_a, shield_b, need):
    """Evict up to ``need`` resident items of ``lane`` outside both shields, lowest key first
    (:func:`_victim`). Returns (evicted, prefetched wasted)."""
    n_ev = 0
    wasted = 0
    for _ in range(need):
        bi = _victim(res, last, freq, nu, score, lane, n, policy, shift, shield_a, shield_b)
        if bi < 0:
            break
        res[lane, bi] = False
        if pf[lane, bi]:
            pf[lane, bi] = False
            wasted += 1
        n_ev += 1
    return n_ev, wasted


@njit(cache=True, nogil=True)
def access(res, last, freq, pf, nu, score, count, lane, n, cap, ids, t, insert, policy, shift, hits):
    """ExpertCache.access on one lane: hits into ``hits``; returns (evicted, wasted, prefetch used),
    or evicted -1 (nothing changed) for an id outside [0, n) or a lane that does not exist."""
    if lane < 0 or lane >= res.shape[0]:
        return -1, 0, 0
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= n:
            return -1, 0, 0
    nmiss = 0
    for i in range(ids.shape[0]):
        h = res[lane, ids[i]]
        hits[i] = h
        if not h:
            nmiss += 1
    n_ev = 0
    wasted = 0
    if insert and policy != STATIC and nmiss > 0:
        cnt = count[lane]
        room = nmiss
        need = cnt + nmiss - cap
        if need > 0:
            n_ev, wasted = _evict(res, last, freq, nu, score, pf, lane, n, policy, shift, ids, ids[:0], need)
            cnt -= n_ev
            room = cap - cnt
        put = 0
        for i in range(ids.shape[0]):
            if not hits[i] and put < room:
                res[lane, ids[i]] = True
                put += 1
        count[lane] = cnt + put
    used = 0
    for i in range(ids.shape[0]):
        e = ids[i]
        last[lane, e] = t
        freq[lane, e] += 1
        if hits[i] and pf[lane, e]:
            pf[lane, e] = False
            used += 1
    return n_ev, wasted, used


@njit(cache=True, nogil=True)
def insert(res, last, freq, pf, nu, score, count, lane, n, cap, row, shield, prefetch, t, policy, shift, new):
    """ExpertCache.insert for one row (-1 padding; ``t`` < 0: no recency). Returns (evicted, wasted,
    inserted, new ids before the room cut); ``new`` marks the ids inserted now. Evicted -1 (nothing
    changed): an id >= n or a lane that does not exist."""
    if lane < 0 or lane >= res.shape[0]:
        return -1, 0, 0, 0
    for i in range(row.shape[0]):
        if row[i] >= n:
            return -1, 0, 0, 0
    n_new = 0
    for i in range(row.shape[0]):
        e = row[i]
        nw = e >= 0 and not res[lane, e]
        new[i] = nw
        if nw:
            n_new += 1
    if n_new == 0:
        return 0, 0, 0, 0
    free = cap - count[lane]
    need = n_new - free
    n_ev = 0
    wasted = 0
    room = n_new
    if need > 0:
        n_ev, wasted = _evict(res, last, freq, nu, score, pf, lane, n, policy, shift, row, shield, need)
        room = free + n_ev
    put = 0
    for i in range(row.shape[0]):
        if new[i]:
            if put >= room:  # fewer slots than new ids: the first ones stay (callers order by priority)
                new[i] = False
                continue
            e = row[i]
            res[lane, e] = True
            if t >= 0:
                last[lane, e] = t
            if prefetch:
                pf[lane, e] = True
            put += 1
    count[lane] += put - n_ev
    return n_ev, wasted, put, n_new


@njit(cache=True, nogil=True)
def touch(res, last, freq, pf, lane, row, t):
    """ExpertCache.touch for one row: recency, frequency, prefetch use. Returns prefetched used, or
    -1 (nothing changed) for an id >= the lane width or a lane that does not exist."""
    if lane < 0 or lane >= res.shape[0]:
        return -1
    for i in range(row.shape[0]):
        if row[i] >= res.shape[1] - 1:
            return -1
    used = 0
    for i in range(row.shape[0]):
        e = row[i]
        if e < 0:
            continue
        last[lane, e] = t
        freq[lane, e] += 1
        if pf[lane, e] and res[lane, e]:
            pf[lane, e] = False
            used += 1
    return used


@njit(cache=True, nogil=True)
def _before(va, ea, vb, eb):
    """(score descending, id ascending) order."""
    return va > vb or (va == vb and ea < eb)


@njit(cache=True, nogil=True)
def _push(vals, ids, m, cap, v, e):
    """Insert (v, e) into ``vals``/``ids``[:m], kept in (score descending, id ascending) order and
    at most ``cap`` long (the last entry drops out when full). Returns the new length."""
    if m == cap and not _before(v, e, vals[m - 1], ids[m - 1]):
        return m
    j = m if m < cap else cap - 1
    while j > 0 and _before(v, e, vals[j - 1], ids[j - 1]):
        vals[j] = vals[j - 1]
        ids[j] = ids[j - 1]
        j -= 1
    vals[j] = v
    ids[j] = e
    return m + 1 if m < cap else m


@njit(cache=True, nogil=True)
def substitute(P, T, resident, hi_f, lo_f, out):
    """SMoE Algorithm 1 for the token in row 0 of ``P`` [1, E] (router probabilities) and ``T``
    [1, k] (the router's experts; see substitution.substitute_one). Returns 0 when nothing
    changes, else the substituted count with the new ids in ``out`` [k] (score descending, lower
    id first); -1 when the row holds padding (< 0), which only the vectorised path handles."""
    p = P[0]
    row = T[0]
    k = row.shape[0]
    n = p.shape[0]
    for i in range(k):
        if row[i] < 0 or row[i] >= n:
            return -1
    all_res = True
    for i in range(k):
        if not resident[row[i]]:
            all_res = False
    if all_res:
        return 0
    # S_{k+1}: the best score the router did not choose (NaN anywhere there: no band, no change)
    chosen = np.zeros(n, np.bool_)
    for i in range(k):
        chosen[row[i]] = True
    beta = -np.inf
    for e in range(n):
        if chosen[e]:
            continue
        v = np.float32(p[e])
        if v != v:
            return 0
        if v > beta:
            beta = v
    hi = np.float32(hi_f * np.float64(beta))
    lo = np.float32(lo_f * np.float64(beta))
    # low-score missing experts, lowest score first (ties: lower id): kept by negated score
    lm_v = np.empty(k, np.float32)
    lm_e = np.empty(k, np.int64)
    nl = 0
    for i in range(k):
        e = row[i]
        v = np.float32(p[e])
        if v <= hi and not resident[e]:
            nl = _push(lm_v, lm_e, nl, k, -v, e)
    if nl == 0:
        return 0
    # alternatives: the best ``nl`` resident inactive experts with a score in (lo, beta]
    al_v = np.empty(nl, np.float32)
    al_e = np.empty(nl, np.int64)
    na = 0
    for e in range(n):
        if not resident[e]:
            continue
        v = np.float32(p[e])
        if not v > lo or chosen[e]:
            continue
        na = _push(al_v, al_e, na, nl, v, e)
    if na == 0:
        return 0
    use = min(nl, na)
    # the router's experts minus the dropped, plus the alternatives, in (score desc, id asc) order
    sv = np.empty(k, np.float32)
    m = 0
    for i in range(k):
        e = row[i]
        dropped = False
        for j in range(use):
            if lm_e[j] == e:
                dropped = True
        if not dropped:
            m = _push(sv, out, m, k, np.float32(p[e]), e)
    for a in range(use):
        m = _push(sv, out, m, k, al_v[a], al_e[a])
    return use


def entry_point(kernel, *argtypes):
    """The compiled function of ``kernel`` for exactly ``argtypes``, called without the dispatcher's
    per-call type resolution. The caller must pass arguments of these types (dtype, dimensions;
    arrays typed with layout "A" take any strides): the entry point does not check them. Falls back
    to the kernel itself where numba does not expose the entry point."""
    sig = tuple(argtypes)
    kernel.compile(sig)
    cres = kernel.overloads.get(sig)
    return getattr(cres, "entry_point", None) or kernel


def _arr(dtype, ndim: int, layout: str = "A") -> types.Array:
    return types.Array(dtype, ndim, layout)


_b1, _i1 = _arr(types.bool_, 1), _arr(types.int64, 1)
_b2c, _i2c, _i1c, _b1c = (
    _arr(types.bool_, 2, "C"),
    _arr(types.int64, 2, "C"),
    _arr(types.int64, 1, "C"),
    _arr(types.bool_, 1, "C"),
)
_f2c = _arr(types.float64, 2, "C")
# resident, last, freq, prefetched, next use, score window sums, count
_state = (_b2c, _i2c, _i2c, _b2c, _i2c, _f2c, _i1c)
_int, _flt = types.int64, types.float64


@functools.cache
def cache_kernels():
    """(access, insert, touch) entry points for ExpertCache's own arrays (all C-contiguous; ids and
    rows int64, one dimension; hits / new masks freshly allocated bool)."""
    acc = entry_point(access, *_state, _int, _int, _int, _i1, _int, types.bool_, _int, _int, _b1c)
    ins = entry_point(insert, *_state, _int, _int, _int, _i1, _i1, types.bool_, _int, _int, _int, _b1c)
    tch = entry_point(touch, _b2c, _i2c, _i2c, _b2c, _int, _i1, _int)
    return acc, ins, tch


def score_kernels(kernel, ndim: int, extra: tuple) -> dict:
    """Entry points of ``kernel`` (substitute) for float32 and float64 scores of ``ndim``
    dimensions; ``extra`` the types of the remaining arguments."""
    return {
        np.dtype(dt): entry_point(kernel, _arr(nt, ndim), *extra)
        for dt, nt in ((np.float32, types.float32), (np.float64, types.float64))
    }


@functools.cache
def substitute_kernels() -> dict:
    """substitute's entry points by score dtype: (P [1, E], T int64 [1, k], resident bool [E], hi,
    lo, out int64 [k])."""
    return score_kernels(substitute, 2, (_arr(types.int64, 2), _b1, _flt, _flt, _i1))


# an edit of a file these kernels compile in empties their cache (jitcache: numba sees only this file)
jitcache.keyed(globals())
