"""KVzip (Kim et al., 2025, "Query-Agnostic KV Cache Compression with Context Reconstruction"):
a slot scores the most attention a teacher-forced reconstruction of the turn gives it; each KV
head keeps its top-k (spec: docs/methods/kvzip.md)."""

from __future__ import annotations

from ...spec import SCOPES, Method, Option


class KVzip(Method):
    name = "kvzip"
    summary = "KVzip: query-agnostic, scored by a context-reconstruction pass (prefill takes ~2x)"
    axes = ("reconstruction attention", "top-k + sinks", "uniform", "dense")
    runs_at = "prefill-end, after a second pass"
    sinks = Option(4, "first tokens always kept", lo=0)
    chunk = Option(2048, "tokens reconstructed per pass", lo=16)
    scope = Option(
        "head",
        "head = B per KV head; layer = the layer's Hkv * B to its best (head, slot) pairs",
        choices=SCOPES,
        was="heads",
        was_values={"uniform": "head"},
    )
    points = frozenset({"prefill"})
    cache = ".cache:KVzipCache"

    @property
    def own_store(self) -> str:
        """scope=layer pads heads to the layer's largest count, masked by position: dense only."""
        return "padded heads; kvzip:scope=head stacks" if self.scope == "layer" else ""

    def slot_bytes(self, config) -> int:
        """An int32 position per slot and head with scope=layer (the padding is masked by it)."""
        return 4 * config.n_kv_heads if self.scope == "layer" else 0
