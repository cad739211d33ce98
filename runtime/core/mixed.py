"""Mixed expert precision: the slow tier holds two copies of each expert, and the predictor
chooses which one moves.

A setting names a **high** copy (the model's dtype, or int8) and a **low** one (int4 at the run's
group size, or int8): ``mixed`` is ``model+int4``; ``model+int4``, ``int8+int4``, ``model+int8``,
``int8+int4-g64`` name the copies themselves, high first (:func:`parse_copies`, pure: no torch).
Both copies live in the offload directory; a fast-tier slot holds either, so a capacity in bytes
counts the high copy's bytes (a slot must fit it). Each resident expert has a precision: the copy
that was read into its slot.

The rules (applied by :class:`moecast.runtime.core.step.LayerStep`, in its step order):

1. **Demand misses read the low copy.** A demand load takes ``t_lo = low bytes / bandwidth`` on the
   link, and so does a CPU-set expert's read over a disk link; the step's layer-time formula is
   unchanged with ``t_io = t_lo`` (and the read's compute share ``t_rc`` at the low bytes). The
   expert is resident at low precision and computes at the low copy's time: the hardware profile's
   time at that precision (:meth:`~moecast.runtime.core.cost_model.HardwareProfile.expert_time`;
   ``moecast profile --expert-dtype model,int4`` measures both), as the CPU set's ``t_c`` does.
   A resident high copy computes at the high copy's time.
2. **Prefetches inside the window: as many as fit, the most confident at the high copy.** Of the
   predicted experts not resident, ``n = min(asked, floor(free / t_lo))`` land in the window (under
   the prefetch gate, :mod:`moecast.runtime.core.gate`, only a leading run of candidates whose
   calibrated probability is above zero: each lands inside the window, so it is free and pays
   whenever ``p > 0``). The time they leave turns the first of them, best first, into high copies:
   ``n_high = min(n, floor((free - n t_lo) / (t_hi - t_lo)))``, and ``n_low = n - n_high``. Every
   landed prefetch spares the same demand read (``t_lo``) when it is used, whichever copy it is, so
   the window's first use is landing candidates, and only link time no further candidate needs
   buys precision: the predicted experts get the high copy when the link has room.
3. **Past the window, the low copy**: the policy's late transfer (late_prefetch's one, which lands
   late and resident; PreSched's one, which does not land) holds the link past the window, so every
   ms of it delays the layer's demand loads: it reads the low copy, ``d = n_high t_hi + n_low t_lo +
   t_lo - free`` rather than ``... + t_hi - free``. Under the gate the late one is started only
   where ``p S > d_x``, at the copy ``x`` (high or low) that maximises ``p S - d_x``, ``S = t_lo``
   (a used prefetch spares a low read), ``d_x = n_high t_hi + n_low t_lo + t_x - free``. Since
   ``d_lo < d_hi`` and both spare the same ``S``, the gate too moves a late expert's low copy.
4. **Upgrades in idle link time.** What the window leaves idle after the prefetches, ``idle = free
   - n_high t_hi - n_low t_lo`` (zero when a late transfer was started: it holds the link past the
   window), reads ``u = floor(idle / t_hi)`` high copies over resident low ones: the predicted
   experts first (in rank order), then the most recently used; never a prefetched expert not yet
   used (its bytes are still to pay off as they are). The window is link time no demand load
   waits for, so an upgrade costs no link time; it makes the next uses of that expert high
   precision. Where the cores serve the reads (``t_rc > 0``: a CPU fast tier over a disk) each
   upgrade, like each prefetch, adds the high copy's ``t_rc`` to the layer it runs beside. A lane no
   prefetch reached (no predictor) upgrades in its whole window the same way. With equal copies
   there is nothing to upgrade.

Derivation of the time rules: the window ``free`` of the step (module docstring of
:mod:`moecast.runtime.core.step`, step 6) is the link time between the previous layer's last
transfer and this layer's expert phase; transfers are serial (PreScope Premise 4), so ``k`` reads
of ``t`` each fit when ``k t <= free``, and what they leave is idle unless something is read. A
demand miss is on the critical path (``link = delay + n_load t_io``, ``dev >= link + t_g``), so
reading its low copy shortens the layer by ``t_hi - t_lo`` per load; a prefetch or an upgrade in
the window is off it, so reading the high copy there costs nothing and buys precision once every
candidate that fits has landed (a high copy in the window's place of ``(t_hi - t_lo) / t_lo`` low
ones would leave those to demand reads, on the critical path). With both copies equal in bytes
every rule reduces to the single-precision step (tests pin it).

Statistics (:data:`moecast.runtime.core.step_kernels.STATS`): ``pf_low`` prefetches started at the
low copy, ``pf_used_low`` of the prefetched experts used, the low ones, ``upgrades``, ``low_uses``
the routed uses computed at low precision (a hit on a low copy, a demand load, a CPU-set expert).
The replay reports from them the bytes per token at each copy, ``low_share`` and the bytes
prefetched and never used (``wasted_mb_per_token``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from moecast.runtime.core.cost_model import CostModel
from moecast.runtime.core.gate import pays

from moecast.errors import InputError

#: precisions by bytes, ascending (a high copy must not be smaller than the low one)
_ORDER = ("int4", "int8", "model")
#: the ``mixed`` setting's copies
MIXED = "mixed"
DEFAULT_HIGH, DEFAULT_LOW = "model", "int4"

NONE, HIGH, LOW = 0, 1, 2  # PrefetchPlan.late


def parse_copies(expert_dtype: str, group_size: int = 128) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """``(high, low)`` as ``(dtype, group size)`` of a mixed setting (``mixed``, ``A+B``); None for
    one precision (``model``, ``int8``, ``int4``)."""
    text = str(expert_dtype).strip()
    if text == MIXED:
        return (DEFAULT_HIGH, int(group_size)), (DEFAULT_LOW, int(group_size))
    if "+" not in text:
        return None
    parts = text.split("+")
    if len(parts) != 2:
        raise InputError(f"expert dtype {text!r}: name two copies, high first, e.g. model+int4 or int8+int4")
    high, low = (parse_copy(p.strip(), int(group_size), text) for p in parts)
    # two of one dtype are the rules' degenerate case, which replays one precision (tests check it);
    # the commands and attach refuse them (precision.expert_setting): no cheaper copy to fall back on
    if _ORDER.index(high[0]) < _ORDER.index(low[0]):
        raise order_error(text)
    return high, low


def order_error(expert_dtype: str) -> InputError:
    """Two copies named in the wrong order, or two of one dtype."""
    return InputError(
        f"expert dtype {expert_dtype!r}: the high copy comes first and is a larger dtype than the low one "
        "(e.g. model+int4, int8+int4)"
    )


def parse_copy(tag: str, group_size: int = 128, given: str | None = None) -> tuple[str, int]:
    """``(dtype, group size)`` of one precision's tag (``model``, ``int8``, ``int4``, ``int4-gN``: N wins
    over ``group_size``); ``given``: the whole setting it came from, for the error."""
    if tag.startswith("int4-g"):
        try:
            return "int4", int(tag[len("int4-g") :])
        except ValueError:
            pass
    elif tag in _ORDER:
        return tag, group_size
    within = f" in {given!r}" if given is not None and given != tag else ""
    raise InputError(
        f"unknown expert dtype {tag!r}{within}; each precision is model, int8, int4 or int4-gN (N: the group "
        "size), and two copies are mixed or high+low (e.g. model+int4, int8+int4-g64)"
    )


def tag_of(dtype: str, group_size: int) -> str:
    """A copy's tag as a results row names it (``model``, ``int8``, ``int4-g128``)."""
    return f"int4-g{group_size}" if dtype == "int4" else dtype


@dataclass(frozen=True)
class Copies:
    """The two copies of a mixed run: ``low`` is the cost model of a demand read (the step's own
    ``cost`` is the high copy's: a prefetch's, an upgrade's and a slot's)."""

    high_tag: str
    low_tag: str
    low: CostModel

    @property
    def tag(self) -> str:
        return f"{self.high_tag}+{self.low_tag}"


@dataclass
class PrefetchPlan:
    """Per row, which of the ranked candidates move and at which copy (rules 2-4, module docstring)."""

    issued: np.ndarray  # what the policy asked for (as step.landing's ``want``)
    n_high: np.ndarray  # the first candidates, landing in the window at the high copy
    n_low: np.ndarray  # the next ones, landing in the window at the low copy (the gate under mixed)
    late: np.ndarray  # the next one, started past the window: NONE, HIGH or LOW
    late_lands: np.ndarray  # it lands, resident (late_prefetch), or not (PreSched's one)
    refused: np.ndarray  # a late one the gate did not start
    delay: np.ndarray  # link time the late one takes from the layer's demand loads
    idle: np.ndarray  # link time of the window left idle (upgrades)

    @property
    def started(self) -> np.ndarray:
        return self.n_high + self.n_low + (self.late != NONE)

    @property
    def landed(self) -> np.ndarray:
        return self.n_high + self.n_low + ((self.late != NONE) & self.late_lands)


def _fit(free: np.ndarray, t: float, ask: np.ndarray) -> np.ndarray:
    """Transfers of ``t`` each that finish within ``free`` (as step.landing counts them)."""
    if math.isinf(t):
        return np.zeros(len(free), dtype=np.int64)
    if t <= 0:
        return np.asarray(ask, dtype=np.int64)
    return np.maximum(np.floor(free / t + 1e-9), 0).astype(np.int64)


def _window_copies(
    ask: np.ndarray, free: np.ndarray, t_hi: float, t_lo: float, prob: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Rule 2: ``(n_high, n_low)`` landing in the window. As many candidates as fit land at the low
    copy (under the gate, only a leading run with ``p > 0``); the time left turns the first of them,
    the most confident, into high copies, ``t_hi - t_lo`` more each."""
    land = np.minimum(ask, _fit(free, t_lo, ask))
    if prob is not None:
        lead = np.cumprod(prob > 0, axis=1).sum(1) if prob.shape[1] else np.zeros_like(land)
        land = np.minimum(land, lead)
    n_high = np.minimum(land, _fit(free - land * t_lo, t_hi - t_lo, land))
    return n_high, land - n_high


def plan_prefetch(
    n_cand: np.ndarray,
    pf_n: np.ndarray,
    free: np.ndarray,
    t_hi: float,
    t_lo: float,
    balancer: str,
    late_policy: bool,
    gate: bool,
    prob: np.ndarray | None,
) -> PrefetchPlan:
    """The landing rule of step 1 over two copies and the gate (module docstring, rules 2-4).

    ``n_cand`` [n] non-resident candidates, ranked; ``prob`` [n, M] their calibrated P(used) (the
    gate's); ``t_hi`` / ``t_lo`` the copies' link times (equal: one precision). With ``gate`` off
    and equal copies this is :func:`moecast.runtime.core.step.landing` exactly.
    """
    n = len(n_cand)
    ask = np.where(pf_n >= 0, np.minimum(pf_n, n_cand), n_cand)
    finite = math.isfinite(t_hi)
    mixed = t_lo != t_hi
    if mixed and finite:
        n_high, n_low = _window_copies(ask, free, t_hi, t_lo, prob if gate else None)
    else:
        n_high, n_low = np.minimum(ask, _fit(free, t_hi, ask)), np.zeros(n, dtype=np.int64)
    in_window = n_high + n_low
    late_ok = late_policy and finite and t_hi > 0
    presched_one = (pf_n >= 0) & (balancer == "presched")
    if late_ok:
        issued = np.minimum(ask, in_window + 1)
    else:
        issued = np.where(presched_one, ask, in_window)
    has_late = (ask > in_window) & finite & (t_hi > 0) & (late_ok | presched_one)
    lands = np.full(n, late_ok)
    # past the window a read delays the demand loads: over two copies it moves the low one (rule 3)
    late = np.where(has_late, LOW if mixed else HIGH, NONE)
    zero = np.zeros(n)
    lo_part = n_low * t_lo if mixed else zero
    with np.errstate(invalid="ignore"):
        d_hi = np.maximum((n_high + 1) * t_hi + lo_part - free, 0.0)
        d_lo = np.maximum(n_high * t_hi + (n_low + 1) * t_lo - free, 0.0) if mixed else d_hi
    refused = np.zeros(n, dtype=bool)
    if gate and has_late.any():
        j = np.minimum(in_window, prob.shape[1] - 1) if prob is not None and prob.shape[1] else None
        p = prob[np.arange(n), j] if j is not None else zero
        save = np.where(lands, t_lo, 0.0)
        g_hi, g_lo = p * save - d_hi, p * save - d_lo
        best_low = mixed & (g_lo > g_hi)
        take = has_late & np.where(best_low, pays(p, save, d_lo), pays(p, save, d_hi))
        refused = has_late & ~take
        late = np.where(take, np.where(best_low, LOW, HIGH), NONE)
    delay = np.where(late == HIGH, d_hi, np.where(late == LOW, d_lo, 0.0))
    with np.errstate(invalid="ignore"):
        used = n_high * t_hi + lo_part if finite else zero
        idle = np.where(late != NONE, 0.0, np.maximum(free - used, 0.0)) if finite else zero
    return PrefetchPlan(issued, n_high, n_low, late, lands, refused, delay, idle)


def upgrade_count(idle: np.ndarray, t_hi: float, n_low: np.ndarray) -> np.ndarray:
    """High copies read over ``n_low`` resident low ones in ``idle`` ms of link time (rule 4)."""
    if math.isinf(t_hi):
        return np.zeros(len(idle), dtype=np.int64)
    if t_hi <= 0:
        return np.asarray(n_low, dtype=np.int64)
    return np.minimum(np.maximum(np.floor(idle / t_hi + 1e-9), 0).astype(np.int64), n_low)


def bytes_by_copy(t: dict[str, np.ndarray], hi: int, lo: int | None) -> dict[str, float]:
    """Bytes read at each copy, and those prefetched (or plan-preloaded) and never used, from a
    step's statistics ``t`` (:data:`moecast.runtime.core.step_kernels.STATS`, summed or per slot):
    demand loads and low prefetches read ``lo`` bytes each, high prefetches, plan preloads and
    upgrades ``hi``. One precision (``lo`` None): every read is the "high" copy's."""
    lo_b = hi if lo is None else lo
    pf_lo, used_lo = float(np.sum(t["pf_low"])), float(np.sum(t["pf_used_low"]))
    pf_hi = float(np.sum(t["pf_started"])) - pf_lo + float(np.sum(t["plan_loads"]))
    wasted = (pf_hi - (float(np.sum(t["pf_used"])) - used_lo)) * hi + (pf_lo - used_lo) * lo_b
    n_lo = float(np.sum(t["loads"])) + pf_lo
    if lo is None:
        n_lo, pf_hi = 0.0, pf_hi + n_lo  # one copy: demand loads are its reads too
    return {"high": (pf_hi + float(np.sum(t["upgrades"]))) * hi, "low": n_lo * lo_b, "wasted": wasted}
