"""StreamingLLM (Xiao et al., 2024, §3.2): the first tokens as attention sinks plus a window
of the most recent ones, evicted after every prefill chunk and decode step
(spec: docs/methods/streaming.md)."""

from __future__ import annotations

from ..spec import Method, Option


class Streaming(Method):
    name = "streaming"
    summary = "StreamingLLM: attention sinks + recent window"
    axes = ("none", "sinks + recent", "uniform", "dense")
    runs_at = "every chunk and step"
    sinks = Option(4, "first tokens always kept", lo=0)
    newest = 1  # the newest token
    points = frozenset({"chunk", "step"})
    scope = "layer"  # every KV head keeps the same slots

    def score(self, ctx):
        """The newest positions win (one row: every KV head keeps the same slots)."""
        return ctx.positions.float()

    def slot_bytes(self, config) -> int:
        """L * T * (2 * Hkv * D * e + 4): one int32 position row, the same for every head."""
        return 4
