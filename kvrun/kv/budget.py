"""Budgets: B(n) from --kv-budget, and per-layer allocators (uniform, pyramid).

kvrun's rule: b < 1 is a fraction of the tokens seen, b >= 1 a token count per layer;
ceil(b * n) is computed exactly from the decimal b, never in floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ..errors import KvrunError


@dataclass(frozen=True, slots=True)
class Budget:
    """A parsed --kv-budget: an exact fraction (< 1) or an absolute count (>= 1)."""

    value: Fraction
    text: str

    @classmethod
    def parse(cls, text: str | float) -> Budget:
        s = str(text).strip()
        try:
            v = Fraction(s)
        except (ValueError, ZeroDivisionError):
            raise KvrunError(
                f"--kv-budget {s!r} is not a number (use a fraction like 0.25 or a token count like 1024)"
            ) from None
        if v <= 0:
            raise KvrunError(f"--kv-budget must be > 0 (got {s})")
        return cls(v, s)

    @property
    def is_fraction(self) -> bool:
        return self.value < 1

    def tokens(self, n: int, protected: int = 0) -> int:
        """B(n) = min(n, max(P, ceil(b n))) for a fraction, min(n, floor(b)) for a count."""
        if self.is_fraction:
            return min(n, max(protected, math.ceil(self.value * n)))
        return min(n, math.floor(self.value))

    def check(self, protected: int, method: str) -> None:
        """An absolute budget below the method's protected minimum is an error."""
        if not self.is_fraction and math.floor(self.value) < protected:
            raise KvrunError(
                f"--kv-budget {self.text} is below {method}'s protected minimum of {protected} tokens "
                f"(sinks + window); use at least {protected} or a fraction"
            )

    def __str__(self) -> str:
        return self.text


def largest_remainder(shares: list[Fraction], total: int) -> list[int]:
    """Integers with floor(shares) plus one for the largest remainders (ties: lower index)."""
    base = [math.floor(s) for s in shares]
    left = total - sum(base)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return base


def pyramid_budgets(B: int, n: int, window: int, n_layers: int, beta: int) -> list[int]:
    """PyramidKV's per-layer budgets, window included (kvrun's rule: the public schedule in
    exact fractions, rounded by largest remainder so the layers sum to exactly L * B).

    B: mean budget B(n) in tokens; n: tokens (or slots) to select from.
    """
    L, w = n_layers, window
    if n <= B:
        return [n] * L
    if n < 2 * (B - w) or L == 1:
        return [B] * L
    mean = Fraction(B - w)
    hi = min(2 * mean - mean / beta, Fraction(n - w))
    lo = 2 * mean - hi
    ks = [hi - Fraction(layer) * (hi - lo) / (L - 1) for layer in range(L)]
    return [k + w for k in largest_remainder(ks, L * (B - w))]


def pyramid_budgets_compat(B: int, n: int, window: int, n_layers: int, beta: int) -> list[int]:
    """KVCache-Factory's integer schedule (tests only: the golden row of the spec)."""
    w, L = window, n_layers
    if n < B:
        return [n] * L
    min_num = (B - w) // beta
    max_num = 2 * (B - w) - min_num
    if max_num >= n - w:
        max_num = n - w
        min_num = 2 * (B - w) - max_num
    if n < 2 * (B - w):
        return [B] * L
    step = (max_num - min_num) // (L - 1)
    return [max_num - layer * step + w for layer in range(L)]


def minikv_pyramid_shares(n_layers: int, depth: int, direction: str = "down") -> list[Fraction]:
    """x_lambda / x of MiniKV's pyramid (§3.1.3, App. H): linear from 2 - 1/delta at layer
    0 to 1/delta at layer L-1, mean 1; `up` reverses it (the paper's App. H reading)."""
    L, top, bottom = n_layers, 2 - Fraction(1, depth), Fraction(1, depth)
    if L == 1:
        return [Fraction(1)]
    shares = [top + (bottom - top) * Fraction(layer, L - 1) for layer in range(L)]
    return shares if direction == "down" else shares[::-1]


def minikv_pyramid(n_hh: int, n_layers: int, depth: int, direction: str = "down") -> list[int]:
    """Heavy-hitter counts per layer summing to exactly L * n_hh (largest remainder, ties to
    the lower layer)."""
    shares = minikv_pyramid_shares(n_layers, depth, direction)
    return largest_remainder([n_hh * s for s in shares], n_layers * n_hh)
