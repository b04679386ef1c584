"""MiniKV's allocation (§3.1.2-3.1.3): a recent window and heavy hitters per
layer for one turn, as fractions of the turn (or an even split of --kv-budget), uniform or
on MiniKV's pyramid (more to lower layers), optionally aligned to whole quantization groups."""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from ..budget import Budget, minikv_pyramid


def minikv_budgets(
    o: Mapping[str, Any], budget: Budget | None, t: int, n_layers: int
) -> tuple[list[int], int]:
    """(heavy hitters per layer, recent window) for a turn of t tokens."""
    if budget is not None:  # B(t) split evenly, protected minimum 0
        B = budget.tokens(t, 0)
        n_rw = B // 2
        n_hh = B - n_rw
    else:
        n_rw = math.floor(Fraction(str(o["recent"])) * t)
        n_hh = math.floor(Fraction(str(o["heavy"])) * t)
    if o["alloc"] == "pyramid":
        hh = minikv_pyramid(n_hh, n_layers, o["depth"], o["pyramid_dir"])
    else:
        hh = [n_hh] * n_layers
    if o["align"]:  # round heavy hitters down so the kept count fills whole groups
        hh = [max(0, h - (h + n_rw) % o["align"]) for h in hh]
    return hh, n_rw
