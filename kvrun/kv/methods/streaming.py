"""StreamingLLM (Xiao et al., 2024, §3.2): the first tokens as attention sinks plus a window
of the most recent ones, evicted after every prefill chunk and decode step
(spec: docs/methods/streaming.md)."""

from __future__ import annotations

from ..bytes import composed
from ..spec import Method, Option


def score(ctx):
    """The newest positions win (one row: every KV head keeps the same slots)."""
    return ctx.positions.float()


METHOD = Method(
    "streaming",
    "select",
    "StreamingLLM: attention sinks + recent window",
    axes=("none", "sinks + recent", "uniform", "dense"),
    runs_at="every chunk and step",
    options=(Option("sinks", 4, "first tokens always kept", lo=0),),
    protected=lambda o: o["sinks"] + 1,  # the sinks and the newest token
    score=score,
    points=lambda o: frozenset({"chunk", "step"}),
    per_layer=lambda o: True,
    sinks=lambda o: o["sinks"],
    # L * T * (2 * Hkv * D * e + 4): one int32 position row, the same for every head
    nbytes=composed(lambda c, o: 4),
)
