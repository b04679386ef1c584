"""H2O (Zhang et al., 2023, §3): heavy hitters by cumulative attention plus a recent window,
evicted after every prefill chunk and decode step."""

from __future__ import annotations

from ..bytes import composed
from ..method import Method, Scorer, Selector
from ..options import Option

METHOD = Method(
    "h2o",
    "select",
    "H2O: heavy hitters by cumulative attention + recent window",
    scorer=Scorer.CUMULATIVE,
    selector=Selector.TOPK_RECENT,
    when="every chunk and step",
    options=(
        Option("recent", 0.5, "share of the budget for the most recent tokens", lo=0.0, hi=1.0),
        Option("sinks", 0, "first tokens always kept", lo=0),
    ),
    protected=lambda o: o["sinks"] + 1,
    evicts_at_decode=True,
    # L * Hkv * T * (2 * D * e + 8): an int32 position and an fp32 score per head and slot
    nbytes=composed(lambda c: 8 * c.n_kv_heads),
)
