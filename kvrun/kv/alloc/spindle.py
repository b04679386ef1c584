"""SpindleKV's allocation (§3.2, Eq. 5 as corrected by the spec): per-layer eviction ratios
falling linearly with depth around the mean ratio the budget gives, and the kept counts."""

from __future__ import annotations

import math
from fractions import Fraction


def endpoints(r_c: Fraction, beta: Fraction) -> tuple[Fraction, Fraction]:
    """(r_c(0), r_c(L-1)) of Eq. 5, corrected (kvrun's decision; SpindleKV §3.3).

    The paper prints rL = 1 - 2 r_c and a hard-coded 0.05; 2 r_c - 1 and beta keep the mean of
    the two endpoints at r_c. r_c <= beta is a flat schedule; r_c >= 1 keeps everything.
    """
    alpha = (1 + beta) / 2
    if r_c >= 1:
        return Fraction(1), Fraction(1)
    if r_c <= beta:
        flat = max(r_c, Fraction(0))
        return flat, flat
    if r_c <= alpha:
        return 2 * r_c - beta, beta
    return Fraction(1), 2 * r_c - 1


def layer_ratios(
    r_c: Fraction, n_layers: int, beta: Fraction, schedule: str = "linear"
) -> list[Fraction]:
    """r_c(lambda) for every layer (Eq. 6), exact; their mean is r_c (0 <= r_c <= 1)."""
    if schedule == "flat" or n_layers == 1:  # one layer: Eq. 6 is 0/0, the mean is r_c itself
        return [min(max(r_c, Fraction(0)), Fraction(1))] * n_layers
    r0, rl = endpoints(r_c, beta)
    return [r0 + (rl - r0) * Fraction(lam, n_layers - 1) for lam in range(n_layers)]


def spindle_keep(
    t: int, budget: int, window: int, n_layers: int, beta: Fraction, schedule: str = "linear"
) -> list[int] | None:
    """k_lambda = floor(r_c(lambda) * n_ctx) context tokens per query head (Eq. 7), or None when
    everything is kept (n_ctx <= 0 or r_c >= 1). budget = B(t), window included."""
    n_ctx = t - window
    if n_ctx <= 0:
        return None
    r_c = Fraction(budget - window, n_ctx)
    if r_c >= 1:
        return None
    return [math.floor(r * n_ctx) for r in layer_ratios(r_c, n_layers, beta, schedule)]
