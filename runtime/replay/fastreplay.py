"""The batch-1 replay engine: per-layer caches, batch size 1, no substitution, no planner.

Which cases it serves (:mod:`moecast.runtime.replay.engine` picks it; ``ReplayConfig(fast=False)`` never does):

- demand-only ``lru``, ``lfu``, ``belady`` and ``static`` (``fast_replay`` in
  :data:`moecast.runtime.core.eviction.TABLE`; no predictor, balancer ``none``, no preload): the misses of every (token, layer, capacity), then the modeled layer times from them;
- ``lru`` with prefetch (in the window, or one late: ``prefetch-late``) and/or PreSched, from empty
  caches or the hot-expert table, and ``lfu`` with prefetch from empty caches (:class:`Wavefront`);
  a prefetch policy is its demand-only eviction when no prefetch can ever fit in the link window
  (``t_attn + k * t_g < t_io``) and none may land late.

Everything else (substitution, batches, a shared cache, score eviction, SMoE's balancer, planners,
ids outside 0..63) goes to the general engine, which runs the per-layer step of
:mod:`moecast.runtime.core.step`. How they are kept equal: this engine follows the same rules (docs/design.md,
replay: a token's top-k at a layer is one access, its own experts are never evicted, ties by lowest
id; the step's prefetch window, landing and layer time), and tests/test_replay.py compares every
statistic of both engines (hit rates per layer, loads, CPU experts, prefetches issued and landed,
bytes moved, prefetch accuracy, layer times, TPOT) on synthetic and real traces, for each policy
here, with prefetches that land and that never fit; tests/test_replay_hand.py pins both to
timelines computed by hand. Only the algorithms differ:

- ``lru`` (demand only) is a stack algorithm under these semantics: after every access the resident
  set is the ``c`` items with the highest key (last access step, expert id) among the items seen so
  far. So an access of expert ``e`` at step ``t``, last used at step ``p``, hits at capacity ``c``
  iff fewer than ``c`` items rank above it: the experts used in steps ``p+1 .. t-1`` plus those used
  at ``p`` with a higher id. With one uint64 mask per (token, layer) (E <= 64) that count is the
  popcount of a range OR, answered in O(1) from a sparse table; every capacity comes from the same
  distances, and all tokens of a layer are processed at once.
- ``static``: the hot-expert table is fixed, so a use hits iff its expert is in the layer's table.
- ``lfu`` and ``belady`` (demand only): a step-synchronous simulation of every (request, layer,
  capacity) cache at once. Requests are sorted by length so the caches active at step ``s`` are a
  prefix of the lanes (no gathers of state); each lane keeps one int64 eviction key per expert
  (the policy's ``key`` in :data:`moecast.runtime.core.eviction.TABLE`, computed from the state it
  reads when the expert is used, with the id in the low bits; ``_BIG`` when not resident), so an
  eviction is a row min. At capacity = top-k the resident set after a token is exactly its experts, for
  every policy, and those lanes come from the LRU distances.
- prefetch / PreSched: :class:`Wavefront` (its docstring).

The demand-only paths return the number of misses per (token, layer, capacity); the replay turns
them into its statistics and the modeled timeline (no prefetch, every miss loaded: the step's layer
time with ``n_load`` = misses, :func:`layer_time_table`).
"""

from __future__ import annotations

import math

import numpy as np
from moecast.runtime.core import eviction
from moecast.runtime.core.step import landing, layer_time, window

_BIG = np.iinfo(np.int64).max
_CHUNK = 16384  # rows per eviction pass: [rows, E] temporaries stay a few MB


_POW2 = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))


def masks(ids: np.ndarray) -> np.ndarray:
    """[..., k] expert ids (0..63) -> [...] uint64 bitmask."""
    if ids.size and ids.min() >= 0 and ids.max() < 64:
        # one [...] gather and OR per column: no [..., k] uint64 temporaries
        out = _POW2[ids[..., 0]]
        for j in range(1, ids.shape[-1]):
            out |= _POW2[ids[..., j]]
        return out
    bits = np.left_shift(np.uint64(1), ids.astype(np.uint64))
    return np.bitwise_or.reduce(bits, axis=-1)


def valid_for_fast(topk: np.ndarray, E: int) -> bool:
    """Fast paths need E <= 64 and k distinct, non-negative ids per (token, layer)."""
    if E > 64 or topk.size == 0:
        return False
    if topk.min() < 0 or topk.max() >= E:
        return False
    k = topk.shape[-1]
    return bool((np.bitwise_count(masks(topk)) == k).all())


def _segments(lengths: np.ndarray, cold: bool, n: int) -> np.ndarray:
    """[n] segment id per token: the request (cold) or one stream."""
    if not cold:
        return np.zeros(n, dtype=np.int64)
    return np.repeat(np.arange(len(lengths)), lengths)


def _prev_next(ids: np.ndarray, seg: np.ndarray, want_next: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """For ids [N, k] of one layer: previous / next token (same segment) using the same expert, -1 if none."""
    N, k = ids.shape
    flat = ids.reshape(-1).astype(np.uint8)
    order = np.argsort(flat, kind="stable")  # radix sort: grouped by expert, token order inside
    tok = order // k
    e_sorted = flat[order]
    same = (e_sorted[1:] == e_sorted[:-1]) & (seg[tok[1:]] == seg[tok[:-1]])
    prev = np.full(N * k, -1, dtype=np.int64)
    prev[order[1:][same]] = tok[:-1][same]
    if not want_next:
        return prev.reshape(N, k), prev.reshape(N, k)
    nxt = np.full(N * k, -1, dtype=np.int64)
    nxt[order[:-1][same]] = tok[1:][same]
    return prev.reshape(N, k), nxt.reshape(N, k)


class _RangeOr:
    """Sparse table of OR over a uint64 sequence: O(1) OR of any range."""

    def __init__(self, m: np.ndarray, max_len: int) -> None:
        levels = [m]
        span = 1
        while span * 2 <= max_len:
            prev = levels[-1]
            nxt = prev.copy()
            nxt[: len(prev) - span] |= prev[span:]
            levels.append(nxt)
            span *= 2
        self.flat = np.stack(levels).reshape(-1)
        self.n = len(m)
        self.lg = np.zeros(max(max_len, 1) + 1, dtype=np.int64)  # floor(log2(x)), lg[0] = 0
        self.lg[2:] = np.floor(np.log2(np.arange(2, len(self.lg)))).astype(np.int64)

    def query_before(self, p: np.ndarray, t: np.ndarray, has: np.ndarray) -> np.ndarray:
        """OR of m[p+1 .. t-1] where ``has`` (0 elsewhere and for empty ranges)."""
        ln = np.where(has, t - p - 1, 0)
        j = self.lg[ln]
        base = j * self.n
        i1 = base + np.where(has, p + 1, 0)
        i2 = base + np.maximum(t - (np.int64(1) << j), 0)
        out = self.flat.take(i1) | self.flat.take(i2)
        out[ln <= 0] = 0
        return out


def lru_distances(topk: np.ndarray, lengths: np.ndarray, cold: bool) -> np.ndarray:
    """[N, L, k] LRU stack distance of every use (items ranked above it; 64 = cold miss).

    An access hits at capacity c iff its distance < c.
    """
    N, L, k = topk.shape
    seg = _segments(lengths, cold, N)
    max_len = int(lengths.max()) if cold else N
    hi = np.array([~((1 << (e + 1)) - 1) & ((1 << 64) - 1) for e in range(64)], dtype=np.uint64)
    out = np.empty((N, L, k), dtype=np.int8)
    tix = np.broadcast_to(np.arange(N)[:, None], (N, k))
    for layer in range(L):
        ids = topk[:, layer, :].astype(np.int64)
        m = masks(ids)
        prev, _ = _prev_next(ids, seg, want_next=False)
        has = prev >= 0
        p = np.maximum(prev, 0)
        ro = _RangeOr(m, max_len)
        above = ro.query_before(p, tix, has) | (m[p] & hi[ids])
        dist = np.bitwise_count(above).astype(np.int8)
        dist[~has] = 64
        out[:, layer, :] = dist
    return out


def same_as_previous_misses(topk: np.ndarray, lengths: np.ndarray, cold: bool) -> np.ndarray:
    """[N, L] misses at capacity = top-k (any policy but static): the cache holds exactly the previous
    token's experts, so misses = k - |this token's experts & the previous token's| (k at a segment start)."""
    N, L, k = topk.shape
    m = masks(topk)  # [N, L]
    seg = _segments(lengths, cold, N)
    out = np.full((N, L), k, dtype=np.int8)
    same = seg[1:] == seg[:-1]
    out[1:][same] = k - np.bitwise_count(m[1:][same] & m[:-1][same]).astype(np.int8)
    return out


def static_misses(topk: np.ndarray, table_order: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """[N, L, C] misses with a fixed hot-expert table: table_order [L, E] hottest first."""
    N, L, _k = topk.shape
    E = table_order.shape[1]
    rdt = np.int8 if E <= 127 else np.int64
    rank = np.empty((L, E), dtype=rdt)
    np.put_along_axis(rank, table_order.astype(np.int64), np.arange(E, dtype=rdt)[None, :], axis=1)
    r = rank[np.arange(L)[None, :, None], topk]  # [N, L, k]
    out = np.empty((N, L, len(caps)), dtype=np.int8)
    for ci, c in enumerate(caps):
        out[:, :, ci] = (r >= c).sum(2)
    return out


def simulate_demand(
    topk: np.ndarray,
    lengths: np.ndarray,
    cold: bool,
    caps: np.ndarray,
    policy: str,
    E: int,
) -> np.ndarray:
    """[N, L, C] misses of demand-only per-layer caches under ``policy`` (lfu, belady: see the module
    docstring), whose keys are its ``key`` in :data:`moecast.runtime.core.eviction.TABLE`."""
    rule = eviction.get(policy)
    N, L, k = topk.shape
    C = len(caps)
    misses = np.zeros((N, L, C), dtype=np.int8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    seg = _segments(lengths, cold, N)
    sim = [ci for ci, c in enumerate(caps) if c > k]
    triv = [ci for ci, c in enumerate(caps) if c <= k]
    if triv:
        same = same_as_previous_misses(topk, lengths, cold)
        for ci in triv:
            misses[:, :, ci] = same
    if not sim:
        return misses
    Cs = len(sim)
    sim_caps = caps[sim].astype(np.int64)
    sh = max(1, int(E - 1).bit_length())
    if cold:
        g_start, g_len = starts, lengths.astype(np.int64)
    else:
        g_start, g_len = np.array([0]), np.array([N])
    S = int(g_len.max())
    nu = _next_use_steps(topk, seg, starts, cold) if "nu" in rule.reads else None
    big = _BIG
    idmask = np.int64((1 << sh) - 1)
    order = np.argsort(-g_len, kind="stable")
    g_start, g_len = g_start[order], g_len[order]
    G = len(g_len)
    lanes = G * L * Cs
    per_g = L * Cs
    K = np.full((lanes, E), big, dtype=np.int64)
    Kf = K.reshape(-1)
    # the state the policy's key reads, one entry per (lane, expert), as the cache keeps it
    state = eviction.KeyArrays(
        np.full(lanes * E, -1, dtype=np.int64) if "last" in rule.reads else None,
        np.zeros(lanes * E, dtype=np.int64) if "freq" in rule.reads else None,
        np.full(lanes * E, eviction.NU_CAP, dtype=np.int64) if nu is not None else None,
        None,
    )
    count = np.zeros(lanes, dtype=np.int64)
    capv = np.tile(sim_caps, G * L)
    lane_base = np.arange(lanes, dtype=np.int64) * E
    ids_all = topk.astype(np.int64)
    # active streams at step s: those longer than s (a prefix, lengths descending)
    n_act = np.searchsorted(-g_len, -np.arange(S), side="left")
    lay_ix = np.arange(L)[None, :, None]
    sim_ix = np.array(sim)[None, None, :]
    for s in range(S):
        n = int(n_act[s])
        nl = n * per_g
        toks = g_start[:n] + s
        ids = ids_all[toks]  # [n, L, k]
        ids_l = np.broadcast_to(ids[:, :, None, :], (n, L, Cs, k)).reshape(nl, k)
        flat = ids_l + lane_base[:nl, None]
        nm = (Kf[flat] == big).sum(1)
        misses[toks[:, None, None], lay_ix, sim_ix] = nm.reshape(n, L, Cs)
        cnt = count[:nl]
        need = cnt + nm - capv[:nl]
        Kf[flat] = big  # shield the token's own experts
        rows = np.flatnonzero(need > 0)
        if len(rows):
            # each row's `need` lowest keys (unique: the id is in the low bits; need never exceeds
            # the resident experts outside the shield, since capacity > k here)
            nr = need[rows]
            m = int(nr.max())
            for c0 in range(0, len(rows), _CHUNK):  # bounded temporaries (no page faults per step)
                rc, nc = rows[c0 : c0 + _CHUNK], nr[c0 : c0 + _CHUNK]
                if m == 1:
                    Kf[lane_base[rc] + (K[rc].min(1) & idmask)] = big
                else:
                    low = np.sort(K[rc], axis=1)[:, :m]
                    take = np.arange(m)[None, :] < nc[:, None]
                    Kf[(lane_base[rc][:, None] + (low & idmask))[take]] = big
        cnt += nm - np.maximum(need, 0)
        # the access, as the cache's touch records it (step s of the segment is its time)
        if state.last is not None:
            state.last[flat] = s
        if state.freq is not None:
            state.freq[flat] += 1  # ids distinct per row
        if state.nu is not None:
            state.nu[flat] = np.broadcast_to(nu[toks][:, :, None, :], (n, L, Cs, k)).reshape(nl, k)
        Kf[flat] = rule.key(state, flat, sh) | ids_l
    return misses


def _next_use_steps(topk: np.ndarray, seg: np.ndarray, starts: np.ndarray, cold: bool) -> np.ndarray:
    """[N, L, k] belady's future: the step (from the segment's start) of each use's next use, or
    NU_CAP (never: ranked first for eviction)."""
    N, L, k = topk.shape
    nu = np.empty((N, L, k), dtype=np.int64)
    first = seg_start(seg, starts, cold)[:, None]
    for layer in range(L):
        _, nxt = _prev_next(topk[:, layer, :].astype(np.int64), seg)
        nu[:, layer, :] = np.where(nxt >= 0, nxt - first, eviction.NU_CAP)
    return nu


def seg_start(seg: np.ndarray, starts: np.ndarray, cold: bool) -> np.ndarray:
    """[N] first token of each token's segment."""
    return starts[seg] if cold else np.zeros(len(seg), dtype=np.int64)


def layer_time_table(k: int, cost, on_cpu: bool = False) -> np.ndarray:
    """[k+1] modeled layer time with m misses of one token each, all loaded on demand (no prefetch),
    or all computed on the CPU (``on_cpu``)."""
    m = np.arange(k + 1)
    if on_cpu:
        return layer_time(cost, k - m, np.zeros(k + 1), 0.0, m * (cost.beta + cost.c), m)[0]
    return layer_time(cost, np.full(k + 1, k), m, 0.0, 0.0)[0]


_WAVE_STATS = (
    "hits",
    "dec_hits",
    "loads",
    "cpu",
    "time",
    "tpot",
    "pf_issued",
    "pf_landed",
    "pf_started",
    "pf_inserted",
    "pf_used",
)


class Wavefront:
    """LRU (or LFU) per-layer caches at batch 1 with prefetch and/or PreSched, as the general engine.

    Layers advance as a wavefront (lane of layer l handles step i - l at iteration i) because a
    prefetch for layer l uses the link time layer l-1 of the same step leaves free. Lanes are stored
    in order of the iteration they finish (latest first), so the lanes active at an iteration are a
    prefix and every per-lane quantity is a slice, not a gather. Under PreSched, layer l's decision
    reads layer l+1's cache as the previous token left it, so step s of layer l runs at iteration
    2 s + l (that token's row at layer l+1 ran one iteration before).

    Each lane keeps one key per expert: ``(key | id) << 1 | prefetched-unused`` when resident, ``big``
    otherwise, where ``key`` is the ``policy``'s (lru or lfu) in :data:`moecast.runtime.core.eviction.TABLE`
    from the expert's last use (the step) and, for lfu, its access count; so lookups are gathers and
    an eviction is a row min (the flag bit never decides: the ids of a lane are distinct).

    ``cand`` [N, L, kp]: each (token, layer)'s predicted candidates ranked best first (-1 padded);
    ``pred_ids`` [N, L, kp] the raw predicted ids (PreSched's next-layer view); ``preload``
    [L, >= max cap] the hot-expert table (PreSched's start); ``basis`` [N] bool: the tokens whose
    steps count for the modeled TPOT; ``predictor_ms`` the predictor's latency per layer;
    ``decode`` [N] bool: the decode tokens (the others are prefill: no prefetch, every miss loaded;
    None: every token is a decode step); ``late``: the policy's late_prefetch. Landing, layer time
    and window are the step's own rules (:func:`moecast.runtime.core.step.landing`, ``layer_time``,
    ``window``). :meth:`run` returns statistics reduced to [C * L] (index c * L + layer), and
    ``tpot_sum`` [C].
    """

    def __init__(
        self,
        topk: np.ndarray,
        lengths: np.ndarray,
        cold: bool,
        caps: np.ndarray,
        E: int,
        cost,
        balancer: str,
        cand: np.ndarray | None,
        pred_ids: np.ndarray | None,
        basis: np.ndarray,
        preload: np.ndarray | None = None,
        predictor_ms: float = 0.0,
        decode: np.ndarray | None = None,
        late: bool = False,
        policy: str = "lru",
    ) -> None:
        N, L, k = topk.shape
        self.rule = eviction.get(policy)
        if not set(self.rule.reads) <= {"last", "freq"} or self.rule.key is None or not self.rule.int_key:
            raise ValueError(f"the wavefront replays lru or lfu, not {policy!r}")
        self.N, self.L, self.k, self.E, self.C = N, L, k, E, len(caps)
        self.caps, self.cost, self.balancer = caps, cost, balancer
        self.late = late  # the policy's late_prefetch: one more than the window holds lands late
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        if cold:
            g_start, g_len = starts, lengths.astype(np.int64)
        else:
            g_start, g_len = np.array([0], dtype=np.int64), np.array([N], dtype=np.int64)
        # under PreSched layer l reads layer l+1's cache as the previous token left it: step s of
        # layer l runs at iteration skew * s + l, so that token's row at layer l+1 ran one before
        self.skew = 2 if (balancer == "presched" and cand is not None) else 1
        self._layout(g_start, g_len)
        S = int(g_len.max())
        self._keys(S)
        self.prefetching = cand is not None
        self._lane_clocks(predictor_ms)
        self._inputs(topk, cand, pred_ids, basis, decode)
        self.n_iter = self.skew * (S - 1) + L
        self.n_act_of = np.searchsorted(-self.end_sorted, -np.arange(self.n_iter), side="left")
        if preload is not None:
            self.preload(preload)

    def run(self) -> dict[str, np.ndarray]:
        for i in range(self.n_iter):
            self.iteration(i)
        return self.results()

    def _key(self, last: np.ndarray, ids: np.ndarray, fid: np.ndarray) -> np.ndarray:
        """The keys of experts ``ids`` (at flat ``fid``) last used at step ``last`` (broadcast to
        ``ids``): the policy's key from the eviction table with the id, above a clear prefetched flag."""
        state = eviction.KeyArrays(last, self.freq[fid] if self.freq is not None else None, None, None)
        return ((self.rule.key(state, ..., self.sh) | ids) << 1).astype(self.kdt)

    def _keys(self, S: int) -> None:
        """The cache's keys, one per (lane, expert): the policy's key | id | prefetched flag, in int32
        where they fit (lru's: step | id | flag)."""
        E, lanes = self.E, self.lanes
        self.sh = max(1, int(E - 1).bit_length())
        lfu = "freq" in self.rule.reads
        small = (int(S + 1).bit_length() + self.sh + 1) <= 30
        self.kdt = np.int32 if small and not lfu else np.int64
        self.big = np.iinfo(self.kdt).max
        self.idmask = self.kdt((1 << self.sh) - 1)
        # LFU (the cache's own order: accesses since the start, resident or not, then recency, then
        # id): each lane's access counts
        self.freq = np.zeros(lanes * E, dtype=np.int64) if lfu else None
        self.K = np.full((lanes, E), self.big, dtype=self.kdt)
        self.Kf = self.K.reshape(-1)
        self.count = np.zeros(lanes, dtype=np.int64)

    def _lane_clocks(self, predictor_ms: float) -> None:
        """Each lane's link clock and the rates PreSched reads, before the first step."""
        lanes, cost = self.lanes, self.cost
        self.t_pred = predictor_ms if self.prefetching else 0.0
        self.first_window = cost.t_attn - self.t_pred
        self.free = np.full(lanes, self.first_window)
        self.pf_n = np.full(lanes, -1, dtype=np.int64)
        self.delay = np.zeros(lanes)
        self.rc = np.zeros(lanes)  # the started prefetches' reads' compute time (step 1)
        self.r_used = np.ones(lanes)
        self.r_landed = np.full(lanes, 2.0)
        self.acc = {name: np.zeros(lanes) for name in _WAVE_STATS}

    def _inputs(
        self,
        topk: np.ndarray,
        cand: np.ndarray | None,
        pred_ids: np.ndarray | None,
        basis: np.ndarray,
        decode: np.ndarray | None,
    ) -> None:
        """The routed and predicted ids as the steps gather them, and which tokens count."""
        N, L, k = topk.shape
        # ids as int8 (E <= 64): the per-step gathers read a quarter of the bytes
        self.topk2 = topk.reshape(N * L, k).astype(np.int8)
        self.cand2 = cand.reshape(N * L, -1).astype(np.int8) if cand is not None else None
        self.pred2 = pred_ids.reshape(N * L, -1).astype(np.int8) if pred_ids is not None else None
        self.basis = basis
        self.decode = decode
        self.all_basis = bool(basis.all())
        self.kp = cand.shape[2] if self.prefetching else 0
        # predictions without -1 padding (the usual case) skip the masking below
        self.cand_full = bool(self.prefetching and (self.cand2 >= 0).all())
        self.pred_full = bool(self.pred2 is not None and (self.pred2 >= 0).all())

    def _layout(self, g_start: np.ndarray, g_len: np.ndarray) -> None:
        """Natural lane id (c * G + g) * L + l, stored at position pos[id], latest-finishing first."""
        C, G, L = self.C, len(g_len), self.L
        lanes = self.lanes = C * G * L
        o_cap = np.repeat(np.arange(C), G * L)
        o_layer = np.tile(np.arange(L), C * G)
        o_stream = np.tile(np.repeat(np.arange(G), L), C)
        o_end = self.skew * (g_len[o_stream] - 1) + 1 + o_layer
        perm = np.argsort(-o_end, kind="stable")
        pos = np.empty(lanes, dtype=np.int64)
        pos[perm] = np.arange(lanes)
        self.cap_of = o_cap[perm]
        self.layer_of = o_layer[perm]
        self.capv = self.caps[self.cap_of].astype(np.int64)
        self.tok0 = g_start[o_stream[perm]]
        self.end_sorted = o_end[perm]
        self.nxt_lane = np.where(
            self.layer_of < L - 1, pos[np.minimum(perm + 1, lanes - 1)], np.arange(lanes)
        )
        self.lane_ix = np.arange(lanes)

    def preload(self, table: np.ndarray) -> None:
        """Every lane starts from its layer's first ``capacity`` experts of the hot-expert table."""
        for c in range(self.C):
            n_pre = min(int(self.caps[c]), self.E)
            rows = np.flatnonzero(self.cap_of == c)
            items = table[self.layer_of[rows], :n_pre].astype(np.int64)  # [rows, n_pre]
            never = np.full((len(rows), 1), -1, dtype=np.int64)  # preloaded, not used yet
            self.K[rows[:, None], items] = self._key(never, items, rows[:, None] * self.E + items)
            self.count[rows] = n_pre

    def make_room(self, rows: np.ndarray, n_new: np.ndarray, shield: np.ndarray, shield_full: bool) -> None:
        """Evict what the rows need to take ``n_new`` experts each beyond their free slots."""
        need = n_new - (self.capv[rows] - self.count[rows])
        er = np.flatnonzero(need > 0)
        if len(er):
            self.evict(rows[er], need[er], shield[er], shield_full)

    def evict(self, act_rows: np.ndarray, need: np.ndarray, shield: np.ndarray, shield_full: bool) -> None:
        """Evict each row's ``need`` lowest keys outside ``shield`` (keys are unique: id in the low bits)."""
        K, big, E = self.K, self.big, self.E
        for c0 in range(0, len(act_rows), _CHUNK):
            rows, nd, sh_ = act_rows[c0 : c0 + _CHUNK], need[c0 : c0 + _CHUNK], shield[c0 : c0 + _CHUNK]
            sub = K[rows]  # copy [ne, E]
            r = np.arange(len(rows))
            if shield_full:
                sub[r[:, None], sh_] = big
            else:
                sv = sh_ >= 0
                sub[np.broadcast_to(r[:, None], sh_.shape)[sv], sh_[sv]] = big
            m = int(nd.max())
            if m == 1:
                low = sub.min(1)[:, None]
            else:
                low = np.sort(sub, axis=1)[:, :m]  # the m lowest keys, ascending (one SIMD sort per row)
            take = (low != big) & (np.arange(m)[None, :] < nd[:, None])
            v = ((low >> 1) & self.idmask)[take].astype(np.int64)
            self.Kf[np.broadcast_to(rows[:, None] * E, take.shape)[take] + v] = big
            self.count[rows] -= take.sum(1)

    def iteration(self, i: int) -> None:
        """The lanes active at iteration ``i``: prefetch, access, split, insert, time."""
        L, E = self.L, self.E
        n_act = int(self.n_act_of[i])
        if self.skew > 1:
            off = i - self.layer_of[:n_act]
            A = np.flatnonzero((off >= 0) & (off % self.skew == 0))  # the lanes with a step now
            act = A
        elif i < L - 1:
            A = np.flatnonzero(self.layer_of[:n_act] <= i)  # warm-up: deeper layers not started yet
            act = A
        else:
            A = slice(0, n_act)
            act = self.lane_ix[:n_act]
        if len(act) == 0:
            return
        lay = self.layer_of[A]
        s = (i - lay) // self.skew
        toks = self.tok0[A] + s
        tl = toks * L + lay
        base = act * E
        now = s.astype(np.int64)[:, None]  # the step: the last use of what the layer uses or lands
        ids = self.topk2[tl]  # [n, k]
        self.delay[A] = 0.0
        self.rc[A] = 0.0
        dec = self.decode[toks] if self.decode is not None else None
        if self.prefetching:
            self._prefetch(A, act, base, tl, now, dec)
        fid = base[:, None] + ids
        kv = self.Kf[fid]
        hit = kv != self.big
        if self.prefetching:
            used = (hit & ((kv & 1) != 0)).sum(1)
            self.r_used[A] += used
            self.acc["pf_used"][A] += used
        n_hit = hit.sum(1)
        n_miss = self.k - n_hit
        n_load, t_cpu = self._split(A, lay, toks, n_miss, dec)
        self._insert(act, ids, fid, hit, n_load, n_miss, now)
        stall = self.delay[A] if self.late else None
        layer_t, link = layer_time(
            self.cost, n_hit + n_load, n_load, self.delay[A], t_cpu, n_miss - n_load, stall
        )
        layer_t = layer_t + self.rc[A]
        has_next = lay < L - 1
        self.free[self.nxt_lane[A][has_next]] = window(layer_t, link, self.t_pred)[has_next]
        self.free[act[lay == 0]] = self.first_window
        acc = self.acc
        acc["hits"][A] += n_hit
        acc["dec_hits"][A] += n_hit if self.all_basis else np.where(self.basis[toks], n_hit, 0)
        acc["loads"][A] += n_load
        acc["cpu"][A] += n_miss - n_load
        acc["time"][A] += layer_t
        acc["tpot"][A] += layer_t if self.all_basis else np.where(self.basis[toks], layer_t, 0.0)

    def _prefetch(
        self, A, act: np.ndarray, base: np.ndarray, tl: np.ndarray, now: np.ndarray, dec: np.ndarray | None
    ) -> None:
        """Land the active lanes' prefetches (:func:`moecast.runtime.core.step.landing`)."""
        t_io, big, Kf = self.cost.t_io, self.big, self.Kf
        # the lanes that may issue a prefetch: PreSched asked for some; otherwise (no PreSched, or
        # no PreSched decision: the first layer) one must fit in the free link time (often none
        # does), unless one late is allowed. The others issue nothing.
        pfa = self.pf_n[A]
        free_a = self.free[A]
        capped = (pfa < 0) | (self.balancer != "presched")
        may = pfa != 0
        if dec is not None:
            may &= dec  # prefill prefetches nothing
        if t_io > 0 and not self.late:
            fits = (free_a / t_io + 1e-9 >= 1) if math.isfinite(t_io) else np.zeros(len(act), dtype=bool)
            may &= ~capped | fits
        sel = np.flatnonzero(may)
        if not len(sel):
            return
        a_s, base_s = act[sel], base[sel]
        cd = self.cand2[tl[sel]]  # [n_s, kp] best first
        if self.cand_full:
            nonres = Kf[base_s[:, None] + cd] == big
        else:
            cvalid = cd >= 0
            nonres = cvalid & (Kf[base_s[:, None] + np.where(cvalid, cd, 0)] == big)
        want, landed, started, self.delay[a_s] = landing(
            nonres.sum(1), pfa[sel], free_a[sel], t_io, self.balancer, self.late
        )
        pr = np.flatnonzero(landed > 0)
        if len(pr):
            apr = a_s[pr]
            self.make_room(apr, landed[pr], cd[pr], self.cand_full)
            # the first `landed` non-resident candidates, best first
            nr = nonres[pr]
            take = nr & (np.cumsum(nr, axis=1) <= landed[pr][:, None])
            cp = cd[pr]
            fl = (base_s[pr][:, None] + np.where(take, cp, 0))[take]
            # prefetched and not used yet: the flag bit set
            Kf[fl] = self._key(np.broadcast_to(now[sel[pr]], take.shape)[take], cp[take], fl) | 1
            self.count[apr] += landed[pr]
        self.r_landed[a_s] += landed
        self.rc[a_s] = started * self.cost.t_rc
        acc = self.acc
        acc["pf_issued"][a_s] += want
        acc["pf_landed"][a_s] += landed
        acc["pf_inserted"][a_s] += landed
        acc["pf_started"][a_s] += started

    def _split(
        self, A, lay: np.ndarray, toks: np.ndarray, n_miss: np.ndarray, dec: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | float]:
        """(demand loads, CPU time): every miss loaded, or PreSched's Eq. 5 split and its next-layer
        count (decode rows; prefill loads every miss)."""
        if self.balancer != "presched":
            return n_miss, 0.0
        from moecast.runtime.core.presched import schedule_unit

        L, E = self.L, self.E
        has_next = lay < L - 1
        if self.prefetching:
            nid = self.pred2[toks * L + np.minimum(lay + 1, L - 1)]
            consumer = self.nxt_lane[A]
            if self.pred_full:
                nres = self.Kf[(consumer * E)[:, None] + nid] == self.big  # not resident
                nn = nres.sum(1) * has_next
            else:
                nvalid = nid >= 0
                nres = self.Kf[(consumer * E)[:, None] + np.where(nvalid, nid, 0)] != self.big
                nn = (nvalid & ~nres & has_next[:, None]).sum(1)
            mn_ = self.kp
        else:
            nn = np.zeros(len(lay), dtype=np.int64)
            mn_ = 0
        r_hit = self.r_used[A] / self.r_landed[A]
        plan = schedule_unit(n_miss, self.k, nn, mn_, self.delay[A], r_hit, self.cost)
        if dec is None:
            self.pf_n[self.nxt_lane[A][has_next]] = plan.n_prefetch[has_next]
            # CPU time of the n_miss - n_load experts left (one token each): the scheduler's running sum
            return plan.n_load, plan.t_cpu
        decided = has_next & dec
        self.pf_n[self.nxt_lane[A][decided]] = plan.n_prefetch[decided]
        return np.where(dec, plan.n_load, n_miss), np.where(dec, plan.t_cpu, 0.0)

    def _insert(
        self,
        act: np.ndarray,
        ids: np.ndarray,
        fid: np.ndarray,
        hit: np.ndarray,
        n_load: np.ndarray,
        n_miss: np.ndarray,
        now: np.ndarray,
    ) -> None:
        """Demand loads in (evicting the lowest keys, the token's own experts shielded); keys of use."""
        lr = np.flatnonzero(n_load > 0)
        if len(lr):
            alr = act[lr]
            self.make_room(alr, n_load[lr], ids[lr], True)
            self.count[alr] += n_load[lr]
        # loaded: the first n_load misses in routing order; hits and loaded experts get the new key
        if self.freq is not None:  # counted after the evictions, as the cache's touch follows its inserts
            self.freq[fid] += 1
        used_key = self._key(now, ids, fid)  # the flag cleared: used
        if self.balancer != "presched" or (n_load == n_miss).all():
            self.Kf[fid] = used_key
        else:
            miss = ~hit
            now_res = hit | (miss & (np.cumsum(miss, axis=1) <= n_load[:, None]))
            # misses left to the CPU stay non-resident (their key is big already)
            self.Kf[fid] = np.where(now_res, used_key, self.big)

    def results(self) -> dict[str, np.ndarray]:
        C, L = self.C, self.L
        cl = self.cap_of * L + self.layer_of
        out = {name: np.bincount(cl, weights=v, minlength=C * L) for name, v in self.acc.items()}
        out["uses"] = np.full(C * L, float(self.N * self.k))
        out["dec_uses"] = np.full(C * L, float(self.basis.sum() * self.k))
        out["subs"] = np.zeros(C * L)
        out["plan_loads"] = np.zeros(C * L)
        out["tpot_sum"] = out.pop("tpot").reshape(C, L).sum(1)
        return out
