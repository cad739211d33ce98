"""Context memory: the routes that training tokens took after the same text (a moecast addition).

None of the four papers has it. The idea is this:
- a model's router is deterministic, so a token whose preceding text repeats text seen in the
  traces goes down (nearly) the same experts;
- serving workloads repeat text: system prompts, templates, shared conversation openings.

On the DeepSeek-V2-Lite traces (../shared/traces, request-level 90/10 split), 31 % of the held-out
tokens end an 8-token context that also occurs in the training prompts. For those tokens, the
experts the training occurrences used reach recall@6 0.95, where ID-only LLaPor reaches 0.78.
It is the same bet as MoE-Infinity's matching of past requests' activation matrices (Xue et al.,
2024), made on a token's context instead of a whole request.

How it works:
- Every training token is indexed by a hash of its last ``n`` token ids, for each ``n`` in
  ``ngrams``. Near a prompt's start (fewer than ``n`` tokens), the hash covers the whole
  prefix and a start marker, so it matches only other prompt starts.
- Each key keeps its ``max_postings`` latest occurrences, which bounds a lookup.
- A new token at layer l gets, for each matched length, the share of matching occurrences that
  used each expert at l. These votes are summed over the matched lengths, so longer matches
  weigh more. Each vote row sums to k.
- :class:`~moecast.predictors.llapor.LLaPor` adds ``weight`` times the votes to its softmax
  (times k).

It is causal: it reads the token ids up to and including the current token, never the current
token's routing. Built from the training split only (:func:`build`), it leaks nothing into the
held-out evaluation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moecast.errors import InputError

_P = np.uint64(0x100000001B3)  # FNV-64 prime: odd, so the rolling hash is invertible mod 2^64
_BOS = np.uint64(0x9E3779B97F4A7C15)  # prompt-start marker: prefixes hash apart from mid-text n-grams
_LEN = np.uint64(0xC2B2AE3D27D4EB4F)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads the polynomial hash over all 64 bits."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


_M = (1 << 64) - 1


def _mix_int(h: int) -> int:
    """:func:`_mix` on one Python int (the runtime's per-token path: no numpy scalars)."""
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _M
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _M
    return h ^ (h >> 31)


def last_keys(token_ids: Sequence[int], ngrams: Sequence[int]) -> list[int]:
    """The last token's row of :func:`context_keys`, in Python ints: equal to it (tested), at
    ~1/20 of the cost for one token."""
    T = len(token_ids)
    want = {int(n): j for j, n in enumerate(ngrams)}
    out = [0] * len(want)
    acc, pw, P = 0, 1, int(_P)
    for c in range(1, min(T, max(want)) + 1):  # c = tokens covered, from the last one back
        acc = (acc + ((int(token_ids[T - c]) + 1) & _M) * pw) & _M
        pw = (pw * P) & _M
        if c in want:
            out[want[c]] = acc
    for n, j in want.items():
        if n > T:  # the whole prefix behind the start marker
            out[j] = (acc + int(_BOS) * pw) & _M
    return [_mix_int(h ^ ((n * int(_LEN)) & _M)) for n, h in zip(want, out, strict=True)]


def context_keys(token_ids: np.ndarray, ngrams: Sequence[int]) -> np.ndarray:
    """[T, len(ngrams)] uint64 keys: token t's last ``n`` ids (or its whole prefix and the start
    marker when t < n - 1), one column per length, the length mixed in."""
    tok = np.asarray(token_ids).astype(np.int64).astype(np.uint64) + np.uint64(1)
    T = len(tok)
    out = np.empty((T, len(ngrams)), np.uint64)
    if T == 0:
        return out
    with np.errstate(over="ignore"):
        # prefix hashes H[i] over [BOS, tok[0..i-1]]: H[0] = BOS, H[i+1] = H[i] * P + tok[i]
        pw = np.cumprod(np.full(T + 1, _P, np.uint64))  # P^1 .. P^(T+1)
        pw = np.concatenate([np.ones(1, np.uint64), pw[:-1]])  # P^0 .. P^T
        H = np.empty(T + 1, np.uint64)
        H[0] = _BOS
        h = _BOS
        for i in range(T):  # a linear recurrence mod 2^64, which no numpy scan computes
            h = h * _P + tok[i]
            H[i + 1] = h
        t = np.arange(T)
        for j, n in enumerate(ngrams):
            n = int(n)
            start = t + 1 - n  # first token of the window
            full = start >= 0
            h_win = np.where(full, H[t + 1] - H[np.maximum(start, 0)] * pw[min(n, T)], H[t + 1])
            # a window's hash still carries H[start]'s part only through P^n; subtracting it
            # leaves the n tokens alone, so the same n-gram hashes alike at any position
            out[:, j] = _mix(h_win ^ (np.uint64(n) * _LEN))
    return out


@dataclass(frozen=True)
class MemoryConfig:
    """How the memory is built and weighed (``moecast train llapor --model.memory_*``,
    ``moecast predictors remember``).

    Args:
        ngrams: context lengths indexed; empty turns the memory off. The votes of every matched
            length are summed, so a token matching 32 tokens back weighs 4 votes.
        max_postings: occurrences kept per context (the latest), which bounds each lookup.
        weight: the votes' weight against the network's softmax (both sum to k per layer).
    """

    ngrams: tuple[int, ...] = (6, 8, 16, 32)
    max_postings: int = 32
    weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ngrams", tuple(int(n) for n in self.ngrams))
        if any(n < 1 for n in self.ngrams) or len(set(self.ngrams)) != len(self.ngrams):
            raise InputError(
                f"context memory: ngrams (model.memory_ngrams, --ngrams) must be distinct lengths >= 1, got {list(self.ngrams)}"
            )
        if self.max_postings < 1:
            raise InputError(
                f"context memory: max_postings (model.memory_postings, --max_postings) must be >= 1, got {self.max_postings}"
            )
        if not np.isfinite(self.weight) or self.weight < 0:
            raise InputError(
                f"context memory: weight (model.memory_weight, --weight) must be a finite number >= 0, got {self.weight}"
            )


class ContextMemory:
    """Sorted context keys, each with up to ``max_postings`` rows of ``routes`` [N, L, k]."""

    def __init__(
        self,
        config: MemoryConfig,
        keys: np.ndarray,
        offsets: np.ndarray,
        postings: np.ndarray,
        routes: np.ndarray,
        num_experts: int,
    ) -> None:
        self.config = config
        self.keys = np.asarray(keys, np.uint64)
        self.offsets = np.asarray(offsets, np.int64)
        self.postings = np.asarray(postings, np.int64)
        self.routes = np.asarray(routes)
        self.num_experts = int(num_experts)
        self.num_layers = self.routes.shape[1]
        self.top_k = self.routes.shape[2]
        self._last: tuple[bytes, np.ndarray] | None = None

    # ------------------------------------------------------------------ lookups
    def votes(self, token_ids: np.ndarray) -> np.ndarray:
        """[T, L, E] float32: every token's summed votes (zero rows where no context matched)."""
        tok = np.asarray(token_ids)
        return self._votes(context_keys(tok, self.config.ngrams), len(tok))

    def _votes(self, keys: np.ndarray, T: int) -> np.ndarray:
        """Votes of ``keys`` [T, len(ngrams)] (:func:`context_keys`)."""
        L, E = self.num_layers, self.num_experts
        out = np.zeros((T, L, E), np.float32)
        if T == 0 or len(self.keys) == 0:
            return out
        pos = np.searchsorted(self.keys, keys.ravel())
        pos_c = np.minimum(pos, len(self.keys) - 1)
        hit = self.keys[pos_c] == keys.ravel()
        q = np.nonzero(hit)[0]
        if len(q) == 0:
            return out
        k0, k1 = self.offsets[pos_c[q]], self.offsets[pos_c[q] + 1]
        cnt = k1 - k0
        tok_of = np.repeat(q // keys.shape[1], cnt)
        # each posting's row, and its share of its key's vote (1 / occurrences)
        rel = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        rows = self.postings[np.repeat(k0, cnt) + rel]
        share = np.repeat(1.0 / cnt, cnt)
        r = self.routes[rows].astype(np.int64)  # [P, L, k]
        flat = (tok_of[:, None, None] * L + np.arange(L)[None, :, None]) * E + r
        w = np.broadcast_to(share[:, None, None], r.shape)
        out += (
            np.bincount(flat.ravel(), weights=w.ravel(), minlength=T * L * E)
            .reshape(T, L, E)
            .astype(np.float32)
        )
        return out

    def votes_last(self, token_ids: np.ndarray) -> np.ndarray:
        """[L, E] votes of the last token: the runtime's per-token lookup, memoised on the ids it
        reads, so the per-layer calls of one token look up once."""
        tok = np.asarray(token_ids)
        span = max(self.config.ngrams)
        # the last `span` ids decide every key; a shorter request is its whole prefix
        window = tok[-span:].astype(np.int64)
        sig = window.tobytes() + (len(tok) < span).to_bytes(1, "little")
        if self._last is not None and self._last[0] == sig:
            return self._last[1]
        keys = np.array([last_keys(window.tolist(), self.config.ngrams)], np.uint64)
        v = self._votes(keys, 1)[0]
        self._last = (sig, v)
        return v

    # ------------------------------------------------------------------ storage
    def tensors(self) -> dict[str, np.ndarray]:
        """The arrays a checkpoint stores (``memory.*``; keys as int64 bit patterns)."""
        return {
            "memory.keys": self.keys.view(np.int64),
            "memory.offsets": self.offsets,
            "memory.postings": self.postings.astype(np.int32),
            "memory.routes": self.routes,
        }

    def metadata(self) -> dict[str, Any]:
        cfg = {**asdict(self.config), "ngrams": list(self.config.ngrams)}  # as JSON reads it back
        return {**cfg, "contexts": len(self.keys), "tokens": len(self.routes)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any], meta: dict[str, Any], num_experts: int) -> ContextMemory:
        def np_(name: str) -> np.ndarray:
            t = tensors[name]
            return t.numpy() if hasattr(t, "numpy") else np.asarray(t)

        cfg = MemoryConfig(
            ngrams=tuple(meta["ngrams"]), max_postings=int(meta["max_postings"]), weight=float(meta["weight"])
        )
        return cls(
            cfg,
            np_("memory.keys").view(np.uint64),
            np_("memory.offsets"),
            np_("memory.postings"),
            np_("memory.routes"),
            num_experts,
        )


def build(
    ts: Any,
    request_ids: Iterable[str],
    config: MemoryConfig,
    progress: bool = False,
) -> ContextMemory:
    """Index the routes of ``request_ids`` (the training split) in ``ts`` by their contexts."""
    ids = list(request_ids)
    if not ids:
        raise InputError("the context memory needs at least one training request; the split is empty")
    ts.require("token_id", "the context memory")
    E = ts.num_experts
    routes = ts.array("topk_ids", ids)
    routes = routes.astype(np.uint8 if E <= 256 else np.int16)
    lengths = ts.request_lengths(ids)
    starts = np.cumsum(lengths) - lengths
    it: Iterable[int] = range(len(ids))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="context memory", unit="req")
    keys = np.empty((len(routes), len(config.ngrams)), np.uint64)
    for r in it:
        s, n = int(starts[r]), int(lengths[r])
        keys[s : s + n] = context_keys(ts.get(ids[r]).token_ids, config.ngrams)
    flat = keys.ravel()
    rows = np.repeat(np.arange(len(routes), dtype=np.int64), len(config.ngrams))
    # sort by key, later rows last, then keep each key's last `max_postings`
    order = np.lexsort((rows, flat))
    flat, rows = flat[order], rows[order]
    new = np.ones(len(flat), bool)
    new[1:] = flat[1:] != flat[:-1]
    first = np.nonzero(new)[0]
    run = np.diff(np.append(first, len(flat)))
    rank_from_end = np.repeat(first + run, run) - np.arange(len(flat))  # 1 = the key's latest row
    keep = rank_from_end <= config.max_postings
    flat, rows = flat[keep], rows[keep]
    new = np.ones(len(flat), bool)
    new[1:] = flat[1:] != flat[:-1]
    first = np.nonzero(new)[0]
    offsets = np.append(first, len(flat)).astype(np.int64)
    return ContextMemory(config, flat[first], offsets, rows, routes, E)
