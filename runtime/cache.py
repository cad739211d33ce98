"""Expert cache: which experts are resident on the device, and which one leaves when another arrives.

Eviction policies (DESIGN.md, "Runtime"):

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

One object holds many independent caches ("lanes") so a replay can advance every layer (and every
cold request) with one vectorised call; the online runtime uses one lane per layer, or
:meth:`ExpertCache.access` on a single lane. Items are expert ids ``0..N-1``; a cache shared by all
layers uses ``layer * E + expert``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICIES = ("lru", "lfu", "score", "static", "belady")
_NEVER = np.iinfo(np.int64).max // 4
_NU_CAP = np.int64(1) << 36  # next-use times beyond this count as never


def resolve_capacity(capacity: float | str, num_experts: int, top_k: int, expert_bytes: int = 0) -> int:
    """Experts per layer from ``0.25`` (fraction of E), ``6`` (experts) or ``"512MB"``/``"2GB"`` (bytes)."""
    if isinstance(capacity, str):
        text = capacity.strip().upper()
        for unit, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
            if text.endswith(unit):
                if expert_bytes <= 0:
                    raise ValueError("a capacity in bytes needs the model's expert_bytes; give experts or a fraction")
                try:
                    n = int(float(text[: -len(unit)]) * mult // expert_bytes)
                except ValueError:
                    raise ValueError(f"capacity {capacity!r}: expected e.g. 0.25, 6 or 512MB") from None
                return _check_capacity(n, num_experts, top_k, capacity)
        try:
            capacity = float(text)
        except ValueError:
            raise ValueError(f"capacity {capacity!r}: expected a fraction (0.25), experts (6) or bytes (512MB)") from None
    c = float(capacity)
    if not np.isfinite(c) or c <= 0:
        raise ValueError(f"capacity {capacity!r} must be > 0 (a fraction < 1 of the experts, or experts per layer)")
    n = int(round(c * num_experts)) if c < 1 else int(c)
    if c >= 1 and c != int(c):
        raise ValueError(f"capacity {capacity!r}: give a fraction below 1 or a whole number of experts")
    return _check_capacity(n, num_experts, top_k, capacity)


def _check_capacity(n: int, num_experts: int, top_k: int, given: object) -> int:
    if n < top_k:
        raise ValueError(
            f"capacity {given!r} holds {n} experts per layer, below top-k = {top_k}: one token's experts "
            f"would evict each other; use at least {top_k} experts ({top_k / num_experts:.3f} of {num_experts})"
        )
    return min(n, num_experts)


@dataclass
class CacheStats:
    evictions: int = 0
    prefetch_inserted: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0


class ExpertCache:
    """``lanes`` independent caches of ``capacity`` items out of ``num_items`` each."""

    def __init__(
        self,
        num_items: int,
        capacity: int | np.ndarray,
        policy: str = "lru",
        lanes: int = 1,
        score_window: int = 8,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.N = int(num_items)
        caps = np.minimum(np.broadcast_to(np.asarray(capacity, dtype=np.int64), (lanes,)), num_items)
        if (caps <= 0).any():
            raise ValueError(f"cache capacity must be > 0, got {capacity}")
        self.capacity_of = caps.copy()  # per lane (a replay may run several capacities side by side)
        self.capacity = int(caps.max())
        self._shift = max(1, int(self.N - 1).bit_length())
        self.policy = policy
        self.lanes = int(lanes)
        self.resident = np.zeros((lanes, num_items), dtype=bool)
        self.count = np.zeros(lanes, dtype=np.int64)
        self.last = np.full((lanes, num_items), -1, dtype=np.int64)
        self.freq = np.zeros((lanes, num_items), dtype=np.int64)
        self.prefetched = np.zeros((lanes, num_items), dtype=bool)  # inserted by prefetch, not used yet
        self.next_use = np.full((lanes, num_items), _NEVER, dtype=np.int64) if policy == "belady" else None
        self.window = int(score_window)
        if policy == "score":
            self._ring = np.zeros((lanes, self.window, num_items), dtype=np.float32)
            self._ring_pos = np.zeros(lanes, dtype=np.int64)
            self.score_sum = np.zeros((lanes, num_items), dtype=np.float64)
        self.stats = CacheStats()
        self._clock = 0
        self._ids = np.arange(num_items)

    # ------------------------------------------------------------------ state
    def reset(self, lanes: np.ndarray | None = None) -> None:
        """Empty the given lanes (all when None): a cold start."""
        sel = slice(None) if lanes is None else lanes
        self.resident[sel] = False
        self.count[sel] = 0
        self.last[sel] = -1
        self.freq[sel] = 0
        self.prefetched[sel] = False
        if self.next_use is not None:
            self.next_use[sel] = _NEVER
        if self.policy == "score":
            self._ring[sel] = 0
            self.score_sum[sel] = 0

    def preload(self, lanes: np.ndarray, items: np.ndarray) -> None:
        """Fill lanes with items (e.g. the static hot-expert table or a prompt plan), no eviction needed.

        ``items`` [n, j] with -1 padding; entries beyond capacity are ignored.
        """
        lanes = np.asarray(lanes)
        items = np.asarray(items)
        valid = items >= 0
        rank = np.cumsum(valid, axis=1) - 1
        valid &= rank < self.capacity_of[lanes][:, None]
        rows = np.broadcast_to(lanes[:, None], items.shape)[valid]
        self.resident[lanes] = False
        self.resident[rows, items[valid]] = True
        self.count[lanes] = self.resident[lanes].sum(1)

    # ------------------------------------------------------------------ decisions
    def lookup(self, lanes: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """[n, k] bool: which of each lane's ids are resident (ids < 0 are padding, never hit)."""
        safe = np.where(ids >= 0, ids, 0)
        return self.resident[lanes[:, None], safe] & (ids >= 0)

    def touch(self, lanes: np.ndarray, ids: np.ndarray, t: int | np.ndarray) -> None:
        """Record one access per (lane, id): recency, frequency, prefetch use. Ids distinct per row."""
        valid = ids >= 0
        rows = np.broadcast_to(lanes[:, None], ids.shape)[valid]
        cols = ids[valid]
        if np.ndim(t):
            self.last[rows, cols] = np.broadcast_to(np.asarray(t)[:, None], ids.shape)[valid]
        else:
            self.last[rows, cols] = t
        # ids are distinct within a row (one access = the union of a step's experts), so plain += is exact
        self.freq[rows, cols] += 1
        used = self.prefetched[rows, cols] & self.resident[rows, cols]
        if used.any():
            self.stats.prefetch_used += int(used.sum())
            self.prefetched[rows[used], cols[used]] = False

    def observe_scores(self, lanes: np.ndarray, scores: np.ndarray) -> None:
        """SMoE Eq. 3 window: push one step of router scores [n, N] (all experts, active or not)."""
        if self.policy != "score":
            return
        pos = self._ring_pos[lanes]
        old = self._ring[lanes, pos]
        self.score_sum[lanes] += scores - old
        self._ring[lanes, pos] = scores
        self._ring_pos[lanes] = (pos + 1) % self.window

    def _key(self, lanes: np.ndarray) -> np.ndarray:
        """Eviction key, lowest evicted first; unique per item (the id is in the low bits), so ties
        resolve to the lowest id without a stable sort. Score keys are floats (stable sort)."""
        ids = self._ids[None, :]
        sh = self._shift
        if self.policy == "lru":
            return ((self.last[lanes] + 1) << sh) | ids
        if self.policy == "lfu":
            return (self.freq[lanes] << (sh + 24)) | ((self.last[lanes] + 1) << sh) | ids
        if self.policy == "belady":
            return ((_NU_CAP - np.minimum(self.next_use[lanes], _NU_CAP)) << sh) | ids
        if self.policy == "score":
            return self.score_sum[lanes].copy()
        raise AssertionError(self.policy)

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
        if n == 0 or self.policy == "static" or ids.shape[1] == 0:
            return np.zeros(ids.shape, dtype=bool)
        valid = ids >= 0
        safe = np.where(valid, ids, 0)
        new = valid & ~self.resident[lanes[:, None], safe]
        n_new = new.sum(1)
        if not n_new.any():
            return new
        cap = self.capacity_of[lanes]
        free = cap - self.count[lanes]
        need = n_new - free
        ev_rows = np.flatnonzero(need > 0)
        if len(ev_rows):
            el = lanes[ev_rows]
            ne = len(ev_rows)
            eligible = self.resident[el]
            r_idx = np.arange(ne)[:, None]
            ins = ids[ev_rows]
            eligible[r_idx, np.where(ins >= 0, ins, 0)] &= ins < 0
            if shield is not None:
                sh = shield[ev_rows]
                eligible[r_idx, np.where(sh >= 0, sh, 0)] &= sh < 0
            n_elig = eligible.sum(1)
            n_evict = np.minimum(need[ev_rows], n_elig)
            m = int(n_evict.max())
            if m > 0:
                if self.policy == "score":
                    key = np.where(eligible, self._key(el), np.inf)
                    order = np.argsort(key, axis=1, kind="stable")[:, :m]
                else:
                    key = np.where(eligible, self._key(el), np.iinfo(np.int64).max)
                    if m < self.N // 4:
                        part = np.argpartition(key, m - 1, axis=1)[:, :m]
                        order = np.take_along_axis(part, np.argsort(np.take_along_axis(key, part, 1), axis=1), 1)
                    else:
                        order = np.argsort(key, axis=1)[:, :m]
                take = np.arange(m)[None, :] < n_evict[:, None]
                rows = np.broadcast_to(el[:, None], order.shape)[take]
                cols = order[take]
                wasted = self.prefetched[rows, cols]
                if wasted.any():
                    self.stats.prefetch_wasted += int(wasted.sum())
                    self.prefetched[rows, cols] = False
                self.resident[rows, cols] = False
                self.stats.evictions += len(cols)
                self.count[el] -= n_evict
            # fewer slots than new ids: keep the first ones (callers order by priority)
            room = free[ev_rows] + n_evict
            short = n_new[ev_rows] > room
            if short.any():
                sr = ev_rows[short]
                rank = np.cumsum(new[sr], axis=1)
                new[sr] &= rank <= room[short][:, None]
        rows = np.broadcast_to(lanes[:, None], ids.shape)[new]
        cols = ids[new]
        self.resident[rows, cols] = True
        self.count[lanes] += new.sum(1)
        if t is not None:
            tt = np.asarray(t)
            self.last[rows, cols] = np.broadcast_to(tt.reshape(-1, 1) if tt.ndim else tt, ids.shape)[new]
        if prefetch:
            self.prefetched[rows, cols] = True
            self.stats.prefetch_inserted += len(cols)
        self._clock += 1
        return new

    def access(self, ids: np.ndarray, t: int | None = None, insert: bool = True, lane: int = 0) -> np.ndarray:
        """Online per-layer call: one token's (or a batch's) expert ids -> hit mask; misses inserted.

        The ids of this access are shielded, so a token's own experts never evict each other.
        """
        ids2 = np.atleast_2d(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
        lanes = np.array([lane])
        hits = self.lookup(lanes, ids2)
        tt = self._clock if t is None else t
        if insert:
            self.insert(lanes, ids2, shield=ids2)
        self.touch(lanes, ids2, tt)
        if t is None:
            self._clock += 1
        return hits.reshape(np.shape(ids))

    def resident_ids(self, lane: int = 0) -> np.ndarray:
        return np.flatnonzero(self.resident[lane])


@dataclass
class StaticTable:
    """PreScope's hot-expert table (Sec. 4.4): (layer, expert) pairs ranked by activation frequency."""

    counts: np.ndarray  # [L, E] activations

    @classmethod
    def from_topk(cls, topk_ids: np.ndarray, num_experts: int) -> StaticTable:
        """Count activations of [T, L, k] routed ids."""
        T, L, k = topk_ids.shape
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
