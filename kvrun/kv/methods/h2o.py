"""H2O (Zhang et al., 2023, §3): heavy hitters by cumulative attention plus a recent window,
evicted after every prefill chunk and decode step (spec: docs/methods/h2o.md)."""

from __future__ import annotations

import math
from fractions import Fraction

from ..spec import Method, Option, adaptive


class H2O(Method):
    name = "h2o"
    summary = "H2O: heavy hitters by cumulative attention + recent window"
    axes = ("cumulative", "top-k + recent", "uniform", "dense")
    runs_at = "every chunk and step"
    recent = Option(0.5, "share of the budget B for the most recent tokens", lo=0.0, hi=1.0)
    sinks = Option(0, "first tokens always kept", lo=0)
    scope, alpha, critical = adaptive()
    newest = 1  # the newest token
    points = frozenset({"chunk", "step"})
    cumulative = True

    def score(self, ctx):
        """Attention each slot received, summed over every query head and query so far."""
        return ctx.attention

    def kept_recent(self, budget: int) -> int:
        """W = floor(recent * B), exact from the decimal (as B(n) is), never in floats."""
        return math.floor(Fraction(str(self.recent)) * budget)

    def slot_bytes(self, config) -> int:
        """L * Hkv * T * (2 * D * e + 8): an int32 position and an fp32 score per head and slot."""
        return 8 * config.n_kv_heads
