"""Choosing SMoE's substitution threshold alpha under a TPOT budget (SMoE §V-C, Eq. 5).

    min_alpha A(alpha)   s.t.   T(alpha) <= R                                   (Eq. 5)

A(alpha), the accuracy loss, grows with alpha, so the best alpha is the smallest one that
meets the budget. SMoE observes that TPOT falls roughly linearly in alpha and fits T(alpha)
with a low-degree polynomial to measured points, then searches alpha in one dimension for
the smallest value whose fitted T(alpha) <= R. :func:`choose_alpha` does exactly that over the
measured range; when no alpha in it meets R it says so and names the closest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moecast.errors import InputError


@dataclass
class AlphaChoice:
    """Result of the Eq. 5 search: the chosen alpha, its fitted TPOT, and whether the budget is met."""

    alpha: float
    predicted_tpot_ms: float
    budget_ms: float
    met: bool
    coefficients: list[float]  # highest degree first (numpy.polyfit order)

    def message(self) -> str:
        if self.met:
            return (
                f"alpha = {self.alpha:.3f}: the smallest alpha whose fitted TPOT ({self.predicted_tpot_ms:.3f} ms) "
                f"meets the budget of {self.budget_ms:.3f} ms (SMoE Eq. 5)"
            )
        return (
            f"no alpha in the measured range meets the TPOT budget of {self.budget_ms:.3f} ms; the closest is "
            f"alpha = {self.alpha:.3f} with a fitted TPOT of {self.predicted_tpot_ms:.3f} ms: raise the budget, "
            "lower the capacity pressure, or measure larger alphas"
        )


def fit_tpot(alphas: np.ndarray, tpot_ms: np.ndarray, degree: int = 2) -> np.poly1d:
    """Least-squares polynomial T(alpha) of degree ``degree`` (lowered when there are too few distinct alphas)."""
    a = np.asarray(alphas, np.float64)
    t = np.asarray(tpot_ms, np.float64)
    ok = np.isfinite(a) & np.isfinite(t)
    a, t = a[ok], t[ok]
    if len(a) == 0:
        raise InputError(
            "fitting T(alpha) needs at least one measured (alpha, TPOT) point; measure some alphas first"
        )
    deg = max(0, min(int(degree), len(np.unique(a)) - 1))
    return np.poly1d(np.polyfit(a, t, deg))


def choose_alpha(
    alphas: np.ndarray | list[float],
    tpot_ms: np.ndarray | list[float],
    budget_ms: float,
    degree: int = 2,
    grid: int = 1001,
) -> AlphaChoice:
    """SMoE Eq. 5: the smallest alpha in the measured range whose fitted T(alpha) <= ``budget_ms``.

    When none meets it, ``met`` is False and ``alpha`` is the one with the lowest fitted TPOT.
    """
    budget = float(budget_ms)
    if not math.isfinite(budget) or budget <= 0:
        raise InputError(f"the TPOT budget must be a positive number of milliseconds, got {budget_ms}")
    poly = fit_tpot(np.asarray(alphas), np.asarray(tpot_ms), degree)
    a = np.asarray(alphas, np.float64)
    xs = np.linspace(float(np.nanmin(a)), float(np.nanmax(a)), grid)
    ys = poly(xs)
    meets = np.flatnonzero(ys <= budget)
    if len(meets):
        i, met = int(meets[0]), True
    else:
        i, met = int(np.argmin(ys)), False
    return AlphaChoice(float(xs[i]), float(ys[i]), budget, met, [float(c) for c in poly.coeffs])
