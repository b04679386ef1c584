"""StreamingLLM (Xiao et al., 2024, §3.2): the first tokens as attention sinks plus a window
of the most recent ones, evicted after every prefill chunk and decode step."""

from __future__ import annotations

from ..bytes import composed
from ..method import Method, Selector
from ..options import Option

METHOD = Method(
    "streaming",
    "select",
    "StreamingLLM: attention sinks + recent window",
    selector=Selector.SINKS_RECENT,
    when="every chunk and step",
    options=(Option("sinks", 4, "first tokens always kept", lo=0),),
    protected=lambda o: o["sinks"] + 1,  # the sinks and the newest token
    evicts_at_decode=True,
    # L * T * (2 * Hkv * D * e + 4): one int32 position row, the same for every head
    nbytes=composed(lambda c: 4),
)
