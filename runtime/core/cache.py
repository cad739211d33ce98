"""Expert cache: which experts are resident on the device, and which one leaves when another arrives.

Eviction policies (docs/design.md, "Runtime"):

- ``lru``: least recently accessed first.
- ``lfu``: fewest accesses since the cache started (counted whether resident or not), then least
  recently used, then lowest id.
- ``score``: SMoE Eq. 3 (Sec. 5.3): evict the expert with the lowest mean router score over the last
  ``n`` steps, scores of inactive experts included; the experts selected for the layer being computed
  are shielded (never evicted while it runs).
- ``static``: PreScope's hot-expert table (Sec. 4.4): the most frequent (layer, expert) pairs of a
  profile fill the memory budget once; nothing is inserted or evicted afterwards.
- ``belady``: the offline optimum (evict the expert whose next use is farthest); replay only, since it
  needs the future accesses (the caller sets :attr:`ExpertCache.next_use`).

Ties are broken deterministically: stable sorts on the policy key keep ascending expert id order.
Each policy's key, name and kernel code are a row of :data:`moecast.runtime.core.eviction.TABLE`.

One object holds many independent caches ("lanes") so a replay can advance every layer (and every
cold request) with one vectorised call; the online runtime uses one lane per layer, or
:meth:`ExpertCache.access` on a single lane. Items are expert ids ``0..N-1``; a cache shared by all
layers uses ``layer * E + expert``.

Single-lane calls (:meth:`ExpertCache.access`, and :meth:`~ExpertCache.insert` /
:meth:`~ExpertCache.touch` with one row) run as compiled kernels on the same arrays
(:mod:`moecast.runtime.core.kernels`), since at batch 1 a dozen numpy calls on 64-element arrays cost
more than the decision itself. The decisions are the
same as the vectorised path's (tests compare them step by step). Treat the public arrays as
read-only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from moecast.predictors.base import HotTable
from moecast.runtime.core import eviction, kernels

from moecast.errors import InputError

_NEVER = np.iinfo(np.int64).max // 4


_I64 = np.dtype(np.int64)


def _i64(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.int64 else a.astype(np.int64)


#: the units a capacity in bytes is given in
BYTE_UNITS = (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10))


def in_bytes(capacity: object) -> bool:
    """Whether ``capacity`` is given in bytes (``"512MB"``), which a slot's size divides."""
    return isinstance(capacity, str) and capacity.strip().upper().endswith(tuple(u for u, _ in BYTE_UNITS))


def resolve_capacity(capacity: float | str, num_experts: int, top_k: int, expert_bytes: int = 0) -> int:
    """Experts per layer from ``0.25`` (fraction of E), ``6`` (experts) or ``"512MB"``/``"2GB"`` (bytes)."""
    if isinstance(capacity, str):
        text = capacity.strip().upper()
        for unit, mult in BYTE_UNITS:
            if text.endswith(unit):
                if expert_bytes <= 0:
                    raise InputError(
                        "a capacity in bytes needs the model's expert_bytes; give experts or a fraction"
                    )
                try:
                    n = int(float(text[: -len(unit)]) * mult // expert_bytes)
                except ValueError:
                    raise InputError(f"capacity {capacity!r}: expected e.g. 0.25, 6 or 512MB") from None
                # which bytes a slot counts differs by where the experts compute (a device's dequantized
                # slot, the CPU's packed copy): the messages say which this count used
                return _check_capacity(n, num_experts, top_k, f"{capacity!r} at {_kib(expert_bytes)} a slot")
        try:
            capacity = float(text)
        except ValueError:
            raise InputError(
                f"capacity {capacity!r}: expected a fraction (0.25), experts (6) or bytes (512MB)"
            ) from None
    c = float(capacity)
    if not np.isfinite(c) or c <= 0:
        raise InputError(
            f"capacity {capacity!r} must be > 0 (a fraction < 1 of the experts, or experts per layer)"
        )
    n = round(c * num_experts) if c < 1 else int(c)
    if c >= 1 and c != int(c):
        raise InputError(f"capacity {capacity!r}: give a fraction below 1 or a whole number of experts")
    return _check_capacity(n, num_experts, top_k, repr(capacity))


class CapacityWarning(UserWarning):
    """A capacity that holds more experts than a layer has: every expert is resident (said in one line)."""


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _check_capacity(n: int, num_experts: int, top_k: int, given: str) -> int:
    if n > num_experts:
        warnings.warn(
            f"capacity {given} holds {n} experts per layer, more than the model's {num_experts}: "
            f"every expert is resident (capacity {num_experts})",
            CapacityWarning,
            stacklevel=3,
        )
    if n < top_k:
        raise InputError(
            f"capacity {given} holds {n} experts per layer, below top-k = {top_k}: one token's experts "
            f"would evict each other; use at least {top_k} experts ({top_k / num_experts:.3f} of {num_experts})"
        )
    return min(n, num_experts)


@dataclass
class CacheStats:
    evictions: int = 0
    prefetch_inserted: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0

    def add(self, evicted: int, wasted: int, used: int = 0) -> None:
        """Count what a compiled kernel call did."""
        self.evictions += evicted
        self.prefetch_wasted += wasted
        self.prefetch_used += used


class ExpertCache:
    """``lanes`` independent caches of ``capacity`` items out of ``num_items`` each.

    ``scalar_path=False`` sends single-lane calls through the vectorised numpy path as well (the
    reference the tests compare the compiled kernels with).
    """

    def __init__(
        self,
        num_items: int,
        capacity: int | np.ndarray,
        policy: str = "lru",
        lanes: int = 1,
        score_window: int = 8,
        scalar_path: bool = True,
    ) -> None:
        self._rule = eviction.get(policy)
        self.N = int(num_items)
        caps = np.minimum(np.broadcast_to(np.asarray(capacity, dtype=np.int64), (lanes,)), num_items)
        if (caps <= 0).any():
            raise InputError(f"cache capacity must be > 0, got {capacity}")
        self.capacity_of = caps.copy()  # per lane (a replay may run several capacities side by side)
        self.capacity = int(caps.max())
        self._shift = max(1, int(self.N - 1).bit_length())
        self.policy = policy
        self.lanes = int(lanes)
        # Each state array has one spare column (index N) that padding ids (-1) map to, so the hot
        # paths index flat, contiguous arrays without boolean masks; the spare item is never resident.
        W = self.W = num_items + 1
        self._res = np.zeros((lanes, W), dtype=bool)
        self._last = np.full((lanes, W), -1, dtype=np.int64)
        self._freq = np.zeros((lanes, W), dtype=np.int64)
        self._pf = np.zeros((lanes, W), dtype=bool)  # inserted by prefetch, not used yet
        self._nu = np.full((lanes, W), _NEVER, dtype=np.int64) if "nu" in self._rule.reads else None
        self.resident = self._res[:, :num_items]
        self._last_v = self._last[:, :num_items]
        self._freq_v = self._freq[:, :num_items]
        self.prefetched = self._pf[:, :num_items]
        self.next_use = self._nu[:, :num_items] if self._nu is not None else None
        self._res_f, self._last_f, self._freq_f, self._pf_f = (
            a.reshape(-1) for a in (self._res, self._last, self._freq, self._pf)
        )
        self._nu_f = self._nu.reshape(-1) if self._nu is not None else None
        self._count = np.zeros(lanes, dtype=np.int64)
        # read-only views for callers: each item's last access step (-1: never) and access count
        # [lanes, N], resident items per lane [lanes]
        self.last, self.freq, self.count = self._last_v, self._freq_v, self._count
        self.window = int(score_window)
        if "score" in self._rule.reads:
            self._ring = np.zeros((lanes, self.window, num_items), dtype=np.float32)
            self._ring_pos = np.zeros(lanes, dtype=np.int64)
            self._score = np.zeros((lanes, W), dtype=np.float64)
            self.score_sum = self._score[:, :num_items]
        self.stats = CacheStats()
        self._clock = 0
        self._ids = np.arange(W)
        self._keys = eviction.KeyArrays(self._last, self._freq, self._nu, getattr(self, "_score", None))
        # single-lane calls of a policy with a kernel run compiled (see the module docstring)
        self._kernel = bool(scalar_path) and self._rule.code is not None
        self._code = self._rule.code if self._kernel else -1
        self._nu_k = self._nu if self._nu is not None else np.zeros((1, 1), dtype=np.int64)
        self._score_k = self._score if "score" in self._rule.reads else np.zeros((1, 1))
        self._kc: tuple | None = None  # (access, insert, touch) entry points, loaded on first use
        self._no_shield = np.empty(0, dtype=np.int64)
        self._caps = self.capacity_of.tolist()

    # ------------------------------------------------------------------ single-lane kernels
    def _kernels(self) -> tuple:
        if self._kc is None:
            self._kc = kernels.cache_kernels()
        return self._kc

    def _bad_ids(self, lane: int, ids: np.ndarray) -> None:
        if not 0 <= lane < self.lanes:
            raise IndexError(f"lane {lane} does not exist; this cache has {self.lanes} lane(s)")
        raise IndexError(
            f"expert ids {ids.tolist()} out of range: items are 0..{self.N - 1} (-1 pads insert/touch rows)"
        )

    def _flat(self, lanes: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return lanes[:, None] * self.W + np.where(ids >= 0, ids, self.N)

    # ------------------------------------------------------------------ state
    def preload(self, lanes: np.ndarray, items: np.ndarray, moved: np.ndarray | None = None) -> None:
        """Fill lanes with items (e.g. the static hot-expert table or a prompt plan), no eviction needed.

        ``items`` [n, j] with -1 padding; entries beyond capacity are ignored. ``moved`` [n, j]: the items
        a plan brought over the link, flagged as prefetched until their first use (as an insert's are).
        """
        lanes = np.asarray(lanes)
        items = np.asarray(items)
        valid = items >= 0
        rank = np.cumsum(valid, axis=1) - 1
        valid &= rank < self.capacity_of[lanes][:, None]
        rows = np.broadcast_to(lanes[:, None], items.shape)
        self.resident[lanes] = False
        self.resident[rows[valid], items[valid]] = True
        self._count[lanes] = self.resident[lanes].sum(1)
        if moved is not None:
            flag = valid & moved
            self.prefetched[rows[flag], items[flag]] = True

    # ------------------------------------------------------------------ decisions
    def lookup(self, lanes: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """[n, k] bool: which of each lane's ids are resident (ids < 0 are padding, never hit)."""
        return self._res_f[self._flat(lanes, ids)]

    def touch(self, lanes: np.ndarray, ids: np.ndarray, t: int | np.ndarray) -> None:
        """Record one access per (lane, id): recency, frequency, prefetch use. Ids distinct per row."""
        if self._kernel and len(lanes) == 1:
            tt = np.asarray(t).reshape(-1)[0] if np.ndim(t) else t
            row = _i64(np.asarray(ids).reshape(-1))
            used = self._kernels()[2](
                self._res, self._last, self._freq, self._pf, int(lanes[0]), row, int(tt)
            )
            if used < 0:
                self._bad_ids(int(lanes[0]), row)
            self.stats.prefetch_used += used
            return
        f = self._flat(lanes, ids)
        if np.ndim(t):
            self._last_f[f] = np.asarray(t)[:, None]
        else:
            self._last_f[f] = t
        # ids are distinct within a row (one access = the union of a step's experts), so plain += is exact
        self._freq_f[f] += 1
        used = self._pf_f[f] & self._res_f[f]
        if used.any():
            self.stats.prefetch_used += int(used.sum())
            self._pf_f[f[used]] = False

    def was_prefetched(self, lanes: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """[n, k] bool: inserted by a prefetch and not used since."""
        return self._pf_f[self._flat(lanes, ids)]

    def set_next_use(self, lanes: np.ndarray, ids: np.ndarray, when: np.ndarray) -> None:
        """Belady: the lane time at which each (lane, id) is next accessed."""
        self._nu_f[self._flat(lanes, ids)] = when

    def observe_scores(self, lanes: np.ndarray, scores: np.ndarray) -> None:
        """SMoE Eq. 3 window: push one step of router scores [n, N] (all experts, active or not)."""
        if "score" not in self._rule.reads:
            return
        pos = self._ring_pos[lanes]
        old = self._ring[lanes, pos]
        self._score[lanes, : self.N] += scores - old
        self._ring[lanes, pos] = scores
        self._ring_pos[lanes] = (pos + 1) % self.window

    def _key(self, lanes: np.ndarray) -> np.ndarray:
        """Eviction key, lowest evicted first; unique per item (the id is in the low bits), so ties
        resolve to the lowest id without a stable sort. Score keys are floats (stable sort)."""
        key = self._rule.key(self._keys, lanes, self._shift)
        return key | self._ids[None, :] if self._rule.int_key else key

    def insert(
        self,
        lanes: np.ndarray,
        ids: np.ndarray,
        shield: np.ndarray | None = None,
        prefetch: bool = False,
        t: int | np.ndarray | None = None,
    ) -> np.ndarray:
        """Insert ids [n, j] (-1 padding, distinct per row; earlier columns first) into lanes (distinct).

        Eviction follows the policy. Shielded ids (the current layer's experts, SMoE Sec. 5.3) and the
        ids being inserted are never evicted. With ``t`` the inserted ids count as used at time ``t``
        (a prefetched expert must not be the next victim before its use). Ids that do not fit (more
        new ids than free or evictable slots, possible for a batch) are left out. Returns [n, j] bool:
        inserted now.
        """
        lanes = np.asarray(lanes)
        ids = np.asarray(ids)
        n = len(lanes)
        if n == 0 or self._rule.key is None or ids.shape[1] == 0:
            return np.zeros(ids.shape, dtype=bool)
        if self._kernel and n == 1:
            return self._insert_one(int(lanes[0]), ids[0], shield, prefetch, t)
        f = self._flat(lanes, ids)
        new = (ids >= 0) & ~self._res_f[f]
        n_new = new.sum(1)
        if not n_new.any():
            return new
        self._make_room(lanes, f, new, n_new, shield)
        fn = f[new]
        self._res_f[fn] = True
        self._count[lanes] += new.sum(1)
        if t is not None:
            tt = np.asarray(t)
            self._last_f[fn] = np.broadcast_to(tt.reshape(-1, 1) if tt.ndim else tt, ids.shape)[new]
        if prefetch:
            self._pf_f[fn] = True
            self.stats.prefetch_inserted += len(fn)
        self._clock += 1
        return new

    def _insert_one(
        self,
        lane: int,
        row: np.ndarray,
        shield: np.ndarray | None,
        prefetch: bool,
        t: int | np.ndarray | None,
    ) -> np.ndarray:
        """:meth:`insert` of one lane's ids ``row`` by the compiled kernel ([1, j] bool: inserted now)."""
        if t is not None and np.ndim(t):
            t = np.asarray(t).reshape(-1)[0]
        row = _i64(row)
        new = np.empty(len(row), dtype=bool)
        ev, wasted, put, n_new = self._kernels()[1](
            self._res, self._last, self._freq, self._pf, self._nu_k, self._score_k, self._count, lane,
            self.N, self._caps[lane], row,
            self._no_shield if shield is None else _i64(np.asarray(shield).reshape(-1)),
            prefetch, -1 if t is None else int(t), self._code, self._shift, new,
        )  # fmt: skip
        if ev < 0:
            self._bad_ids(lane, row)
        self.stats.add(ev, wasted)
        if prefetch:
            self.stats.prefetch_inserted += put
        self._clock += n_new > 0
        return new[None, :]

    def _make_room(
        self, lanes: np.ndarray, f: np.ndarray, new: np.ndarray, n_new: np.ndarray, shield: np.ndarray | None
    ) -> None:
        """Evict, by the policy, for the rows of ``new`` (the ids to insert, at flat indices ``f``) that
        have fewer free slots than new ids; where even eviction leaves too few, clear the last of a
        row's ``new`` (in place) so that only the first ones go in."""
        free = self.capacity_of[lanes] - self._count[lanes]
        need = n_new - free
        ev_rows = np.flatnonzero(need > 0)
        if not len(ev_rows):
            return
        el = lanes[ev_rows]
        eligible = self._res[el]
        base = (np.arange(len(ev_rows)) * self.W)[:, None]
        el_f = eligible.reshape(-1)
        el_f[base + (f[ev_rows] - (el * self.W)[:, None])] = False
        if shield is not None:
            el_f[base + np.where(shield[ev_rows] >= 0, shield[ev_rows], self.N)] = False
        n_evict = np.minimum(need[ev_rows], eligible.sum(1))
        m = int(n_evict.max())
        if m > 0:
            self._evict(el, self._victims(el, eligible, m), n_evict)
        # fewer slots than new ids: keep the first ones (callers order by priority)
        room = free[ev_rows] + n_evict
        short = n_new[ev_rows] > room
        if short.any():
            sr = ev_rows[short]
            rank = np.cumsum(new[sr], axis=1)
            new[sr] &= rank <= room[short][:, None]

    def _victims(self, el: np.ndarray, eligible: np.ndarray, m: int) -> np.ndarray:
        """[len(el), m] ids of lanes ``el`` in eviction order, the ``eligible`` first (a lane with fewer
        than m is padded with ids that :meth:`_evict` does not take)."""
        if not self._rule.int_key:
            key = np.where(eligible, self._key(el), np.inf)
            return np.argsort(key, axis=1, kind="stable")[:, :m]
        # keys are unique with the id in the low bits: m passes of a column-wise min (vectorised
        # across rows) find the m lowest, several times faster than a per-row argpartition on short rows
        big = np.iinfo(np.int64).max
        key_t = np.where(eligible, self._key(el), big).T.copy()
        mask = (1 << self._shift) - 1
        cols_r = np.arange(len(el))
        order = np.empty((len(el), m), dtype=np.int64)
        for j in range(m):
            v = np.minimum(key_t.min(0) & mask, self.N)  # rows out of candidates -> spare column
            order[:, j] = v
            key_t[v, cols_r] = big
        return order

    def _evict(self, el: np.ndarray, order: np.ndarray, n_evict: np.ndarray) -> None:
        """Evict the first ``n_evict`` ids of each row of ``order`` from its lane of ``el``, counting the
        prefetched ones among them as wasted."""
        take = np.arange(order.shape[1])[None, :] < n_evict[:, None]
        gone = ((el * self.W)[:, None] + order)[take]
        wasted = self._pf_f[gone]
        if wasted.any():
            self.stats.prefetch_wasted += int(wasted.sum())
            self._pf_f[gone] = False
        self._res_f[gone] = False
        self.stats.evictions += len(gone)
        self._count[el] -= n_evict

    def access(self, ids: np.ndarray, t: int | None = None, insert: bool = True, lane: int = 0) -> np.ndarray:
        """Online per-layer call: one step's distinct expert ids -> hit mask; misses inserted.

        The ids of this access are shielded, so a token's own experts never evict each other. This
        single-lane path avoids the batch machinery: one compiled kernel (``scalar_path=False``: a
        handful of numpy calls).
        """
        if ids.__class__ is not np.ndarray or ids.dtype is not _I64 or ids.ndim != 1:
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        tt = self._clock if t is None else int(t)
        self._clock += 1
        if self._kernel:
            hits = np.empty(ids.shape[0], dtype=bool)
            ev, wasted, used = (self._kc or self._kernels())[0](
                self._res, self._last, self._freq, self._pf, self._nu_k, self._score_k, self._count, lane,
                self.N, self._caps[lane], ids, tt, insert, self._code, self._shift, hits,
            )  # fmt: skip
            if ev or wasted or used:
                if ev < 0:
                    self._bad_ids(lane, ids)
                self.stats.add(ev, wasted, used)
            return hits
        res = self._res[lane]
        hits = res[ids]
        if insert and self._rule.key is not None and not hits.all():
            miss = ids[~hits]
            cap = int(self.capacity_of[lane])
            cnt = int(self._count[lane])
            need = cnt + len(miss) - cap
            if need > 0:
                n_ev = self._evict_one_lane(lane, ids, need)
                cnt -= n_ev
                miss = miss[: cap - cnt]
            res[miss] = True
            self._count[lane] = cnt + len(miss)
        self._last[lane, ids] = tt
        self._freq[lane, ids] += 1
        if self.stats.prefetch_inserted:
            pf = self._pf[lane]
            used = pf[ids] & hits
            if used.any():
                self.stats.prefetch_used += int(used.sum())
                pf[ids[used]] = False
        return hits

    def _evict_one_lane(self, lane: int, shield: np.ndarray, need: int) -> int:
        """Evict up to ``need`` of one lane's resident items outside ``shield``, lowest key first."""
        res = self._res[lane]
        if not self._rule.int_key:
            key = np.where(res, self._rule.key(self._keys, lane, self._shift), np.inf)
            key[shield] = np.inf
            n_ev = min(need, int(np.isfinite(key).sum()))
            victims = np.argsort(key, kind="stable")[:n_ev]
        else:
            big = np.iinfo(np.int64).max
            key = self._rule.key(self._keys, lane, self._shift) | self._ids
            key[~res] = big
            key[shield] = big
            if need == 1:
                v = int(key.argmin())
                if key[v] == big:
                    return 0
                victims = [v]
                n_ev = 1
            else:
                victims = np.argpartition(key, need - 1)[:need]
                victims = victims[key[victims] != big]
                n_ev = len(victims)
        if n_ev == 0:
            return 0
        pf = self._pf[lane]
        if self.stats.prefetch_inserted:
            self.stats.prefetch_wasted += int(pf[victims].sum())
            pf[victims] = False
        res[victims] = False
        self._count[lane] -= n_ev
        self.stats.evictions += n_ev
        return n_ev

    def resident_ids(self, lane: int = 0) -> np.ndarray:
        return np.flatnonzero(self.resident[lane])


@dataclass
class StaticTable:
    """PreScope's hot-expert table (Sec. 4.4): (layer, expert) pairs ranked by activation frequency."""

    counts: np.ndarray  # [L, E] activations

    @classmethod
    def from_topk(cls, topk_ids: np.ndarray, num_experts: int) -> StaticTable:
        """Count activations of [T, L, k] routed ids."""
        _T, L, _k = topk_ids.shape
        flat = (np.arange(L)[None, :, None] * num_experts + topk_ids.astype(np.int64)).reshape(-1)
        return cls(np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts))

    def per_layer(self, capacity: int) -> np.ndarray:
        """[L, capacity] the hottest experts of each layer (ties by lower id)."""
        order = np.argsort(-self.counts, axis=1, kind="stable")
        return order[:, :capacity]

    def shared(self, budget: int) -> np.ndarray:
        """[budget] hottest (layer * E + expert) items over all layers: one memory budget."""
        order = np.argsort(-self.counts.reshape(-1), kind="stable")
        return order[:budget]


def hot_table(predictor: Any, num_layers: int, num_experts: int) -> np.ndarray:
    """The [L, E] expert scores a static policy pins from (a frequency checkpoint's ``table``): the live
    runtime and the replay pin the same table."""
    name = predictor.name
    table = predictor.table if isinstance(predictor, HotTable) else None
    shape = np.shape(table) if table is not None else None
    if shape != (num_layers, num_experts):
        has = "no table" if shape is None else f"a table of shape {shape}"
        raise InputError(
            f"policy static pins a hot-expert table of [{num_layers}, {num_experts}] expert scores; {name} "
            f"has {has}: pass a frequency checkpoint (moecast predictors eval frequency --save CKPT) or no predictor"
        )
    table = np.asarray(table, np.float64)
    if not np.isfinite(table).all():
        raise InputError(f"{name}'s hot-expert table holds non-finite scores; rebuild the checkpoint")
    return table
