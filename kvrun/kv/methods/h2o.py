"""H2O (Zhang et al., 2023, §3): heavy hitters by cumulative attention plus a recent window,
evicted after every prefill chunk and decode step (spec: docs/methods/h2o.md)."""

from __future__ import annotations

import math
from fractions import Fraction

from ..bytes import composed
from ..spec import Method, Option


def score(ctx):
    """Attention each slot received, summed over every query head and query so far."""
    return ctx.attention


def recent(o, B: int) -> int:
    """W = floor(recent * B), exact from the decimal (as B(n) is), never in floats."""
    return math.floor(Fraction(str(o["recent"])) * B)


METHOD = Method(
    "h2o",
    "select",
    "H2O: heavy hitters by cumulative attention + recent window",
    axes=("cumulative", "top-k + recent", "uniform", "dense"),
    runs_at="every chunk and step",
    options=(
        Option("recent", 0.5, "share of the budget for the most recent tokens", lo=0.0, hi=1.0),
        Option("sinks", 0, "first tokens always kept", lo=0),
    ),
    protected=lambda o: o["sinks"] + 1,
    score=score,
    points=lambda o: frozenset({"chunk", "step"}),
    cumulative=True,
    sinks=lambda o: o["sinks"],
    recent=recent,
    # L * Hkv * T * (2 * D * e + 8): an int32 position and an fp32 score per head and slot
    nbytes=composed(lambda c, o: 8 * c.n_kv_heads),
)
