"""The eviction policies, each written once: its numpy key, its compiled kernels' code, its replay engines.

:data:`TABLE` is the one place a policy is defined; the rest read it:

- :class:`~moecast.runtime.core.cache.ExpertCache` (its vectorised and single-lane numpy paths) ranks
  the resident experts by the policy's ``key`` (lowest evicted first), keeps the state it ``reads``,
  and takes the names from here (``policy.EVICTIONS``);
- the compiled kernels (:mod:`moecast.runtime.core.kernels`, :mod:`moecast.runtime.core.step_kernels`) take
  the policy as an integer, ``code``; their constants (``kernels.LRU`` ...) are read from here at
  import. A policy without a code has no kernel: the compiled paths refuse it (:func:`kernel_code`);
- ``fast_replay``: the batch-1 demand-only engine of :mod:`moecast.runtime.replay.fastreplay` simulates it,
  with this ``key`` (its LRU stack distances aside, which follow from LRU's key without computing it).

Adding a policy: a row here with its key; a ``code`` only once ``kernels._victim`` computes the same
key for it (tests/test_cache.py compares the two paths decision by decision).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moecast.errors import InputError

NU_CAP = np.int64(1) << 36  # next-use times beyond this count as never


@dataclass(frozen=True)
class KeyArrays:
    """The cache's per-item state a key reads, [lanes, W] each (``nu`` / ``score``: None unless kept)."""

    # the last access's time (-1: never), increasing within a lane in the engine's unit (replay: step x
    # layers + layer; live and fast replay: step): a key compares it, never adds it to another field
    last: np.ndarray
    freq: np.ndarray  # accesses since the cache started
    nu: np.ndarray | None  # belady: lane time of the next access
    score: np.ndarray | None  # score: SMoE Eq. 3's window sums


#: key(arrays, rows, shift) -> the rows' eviction keys, lowest evicted first; an integer key leaves the
#: low ``shift`` bits free for the expert id
Key = Callable[[KeyArrays, object, int], np.ndarray]


def _lru(a: KeyArrays, rows: object, shift: int) -> np.ndarray:
    return (a.last[rows] + 1) << shift


def _lfu(a: KeyArrays, rows: object, shift: int) -> np.ndarray:
    return (a.freq[rows] << (shift + 24)) | ((a.last[rows] + 1) << shift)


def _belady(a: KeyArrays, rows: object, shift: int) -> np.ndarray:
    return (NU_CAP - np.minimum(a.nu[rows], NU_CAP)) << shift


def _score(a: KeyArrays, rows: object, shift: int) -> np.ndarray:
    return a.score[rows]


@dataclass(frozen=True)
class Eviction:
    """One policy's rule; see the module docstring."""

    key: Key | None  # None: never evicts (nothing is inserted)
    code: int | None  # the compiled kernels' code; None: no kernel
    fast_replay: bool
    reads: tuple[str, ...] = ()  # the KeyArrays fields the key reads (a cache keeps nu / score for them)
    # integer keys hold the expert id in the low bits (unique: a strict minimum finds the victim);
    # float keys (score) tie to the lower id by a stable sort
    int_key: bool = True


# The codes are compiled into the disk-cached kernels, whose cache follows only their own files:
# give a new policy a new code, never renumber one.
TABLE: dict[str, Eviction] = {
    "lru": Eviction(_lru, 0, fast_replay=True, reads=("last",)),
    "lfu": Eviction(_lfu, 1, fast_replay=True, reads=("last", "freq")),
    "score": Eviction(_score, 4, fast_replay=False, reads=("score",), int_key=False),
    "static": Eviction(None, 3, fast_replay=True),
    "belady": Eviction(_belady, 2, fast_replay=True, reads=("nu",)),
}

NAMES = tuple(TABLE)
#: the policies the batch-1 demand-only replay engine simulates
FAST_REPLAY = tuple(n for n, e in TABLE.items() if e.fast_replay)


def get(name: str) -> Eviction:
    """The rule of eviction policy ``name`` (InputError for an unknown one)."""
    rule = TABLE.get(name)
    if rule is None:
        raise InputError(f"unknown eviction policy {name!r}; choose one of {', '.join(TABLE)}")
    return rule


def kernel_code(name: str) -> int:
    """The compiled kernels' code of policy ``name``; InputError where it has none."""
    code = get(name).code
    if code is None:
        raise InputError(
            f"eviction policy {name!r} has no compiled kernel; run it uncompiled (compiled=False)"
        )
    return code
