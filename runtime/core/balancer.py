"""SMoE Algorithm 2 (CPU-load balancing): each missing expert is loaded to the device or run on the CPU.

SMoE Sec. 5.4: minimise max(T_load, T_CPU). Missing experts are sorted by batch size B_i (tokens
routed to them) in descending order; a left pointer hands the largest to the transfer link (cost
t_load each), a right pointer hands the smallest to the CPU (cost B_i * t_cpu each); whichever
cumulative cost is lower takes the next expert (ties go to loading).

:func:`two_pointer` is the literal algorithm for one layer; :func:`two_pointer_split`
is the same decision vectorised over many layers at once: since both cost sequences are
non-decreasing, the pointers meet where the merged order of "cost before taking" puts ``n`` items,
so the number loaded is found without a loop.
"""

from __future__ import annotations

import numpy as np


def two_pointer(batch_sizes: np.ndarray, t_load: float, t_cpu: float) -> tuple[np.ndarray, np.ndarray]:
    """Literal SMoE Algorithm 2 on one layer: indices (into batch_sizes) to load, and to compute on the CPU."""
    b = np.asarray(batch_sizes, dtype=np.float64)
    order = np.argsort(-b, kind="stable")
    c_load = c_cpu = 0.0
    left, right = 0, len(b) - 1
    load: list[int] = []
    cpu: list[int] = []
    while left <= right:
        if c_load <= c_cpu:
            c_load += t_load
            load.append(int(order[left]))
            left += 1
        else:
            c_cpu += b[order[right]] * t_cpu
            cpu.append(int(order[right]))
            right -= 1
    return np.array(load, dtype=np.int64), np.array(cpu, dtype=np.int64)


def two_pointer_split(sorted_sizes: np.ndarray, n: np.ndarray, t_load: float, t_cpu: float) -> np.ndarray:
    """Vectorised Algorithm 2: how many of each row's ``n`` missing experts are loaded.

    ``sorted_sizes`` [rows, M]: batch sizes in descending order, the first ``n[row]`` valid. Loads
    take the first ``j`` (largest) entries, the CPU the rest. The left pointer's j-th take happens at
    cumulative cost j * t_load, the right pointer's i-th at P_i (prefix sums of the smallest sizes
    times t_cpu); ties go to loading. Exactly ``n`` items are taken, so j is the count of load costs
    among the ``n`` smallest of the merged cost sequence.
    """
    rows, M = sorted_sizes.shape
    if M == 0:
        return np.zeros(rows, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    idx = np.arange(M)[None, :]
    valid = idx < n[:, None]
    # CPU costs taken from the right end: reverse the valid part of each row
    rev_idx = np.clip(n[:, None] - 1 - idx, 0, M - 1)
    small_first = np.take_along_axis(sorted_sizes, rev_idx, axis=1) * t_cpu
    small_first = np.where(valid, small_first, np.inf)
    cpu_before = np.concatenate([np.zeros((rows, 1)), np.cumsum(small_first, axis=1)[:, :-1]], axis=1)
    # cumulative sums (not j * t_load) so float rounding matches the literal loop's accumulation
    load_before = np.concatenate([[0.0], np.cumsum(np.full(M - 1, float(t_load)))])[None, :]
    # j loads taken = number of load costs c with (#cpu costs strictly below c) + (#load costs <= c) <= n
    # counted the simple way: a load cost L_j is among the first n iff j + #{i: P_i < L_j} < n.
    below = (cpu_before[:, None, :] < np.broadcast_to(load_before, (rows, M))[:, :, None]) & valid[:, None, :]
    take = (idx + below.sum(2) < n[:, None]) & valid
    return take.sum(1)
