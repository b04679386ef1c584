"""PyramidKV (Cai et al., 2024, §3): SnapKV's selection with layer budgets decreasing
linearly from the first layer to the last (arithmetic schedule, same mean; spec:
docs/methods/pyramidkv.md)."""

from __future__ import annotations

from fractions import Fraction

from ..spec import Option, largest_remainder
from .snapkv import SnapKV


class PyramidKV(SnapKV):
    """SnapKV's votes with a pyramid allocator; bytes: sum_l 2 * Hkv * T_l * D * e (a stacked
    KIVI store by its formula)."""

    name = "pyramidkv"
    summary = "PyramidKV: SnapKV with linearly decreasing layer budgets"
    axes = ("window", "top-k + window", "pyramid", "dense")
    beta = Option(20, "last layer gets 1/beta of the mean", lo=1)

    def budgets(self, budget: int, n: int, n_layers: int) -> list[int]:
        """Per-layer budgets, window included, for a mean B over n slots (kvrun's rule: the
        public schedule in exact fractions, rounded by largest remainder so they sum to exactly
        L * B)."""
        L, w, B = n_layers, self.window, budget
        if n <= B:
            return [n] * L
        if n < 2 * (B - w) or L == 1:
            return [B] * L
        mean = Fraction(B - w)
        hi = min(2 * mean - mean / self.beta, Fraction(n - w))
        lo = 2 * mean - hi
        ks = [hi - Fraction(layer) * (hi - lo) / (L - 1) for layer in range(L)]
        return [k + w for k in largest_remainder(ks, L * (B - w))]
